"""Triton's nv_gpu_* metrics on ``staronnx serve``'s /metrics (:mod:`staronnx.serve.gpu_metrics`).

NVML needs an NVIDIA driver, so here the collector reads a stand-in with NVML's call shapes
(pynvml's function names, its units: percent, bytes, milliwatts, millijoules) to check the
names, labels and units a Triton dashboard reads; ``tests/test_gpu_entry_points.py`` scrapes a
real server on a GPU. Without NVML, or on the CPU stand-in, the server runs without them."""

from __future__ import annotations

import re
import types

from prometheus_client import CollectorRegistry, generate_latest

from staronnx.serve.gpu_metrics import GpuCollector, gpu_collector


class _Nvml:
    """NVML's calls the collector makes, answering for one GPU as an idle H100 would."""

    def __init__(self) -> None:
        self.energy_mj = 1_000_000

    def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802 - NVML's names
        return types.SimpleNamespace(gpu=37, memory=5)

    def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802
        return types.SimpleNamespace(total=80 * 2**30, used=3 * 2**30, free=77 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h):  # noqa: N802
        return 71_500

    def nvmlDeviceGetEnforcedPowerLimit(self, h):  # noqa: N802
        return 700_000

    def nvmlDeviceGetTotalEnergyConsumption(self, h):  # noqa: N802
        return self.energy_mj


def test_triton_names_labels_and_units():
    nvml = _Nvml()
    uuid = "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    registry = CollectorRegistry()
    registry.register(GpuCollector(nvml, {uuid: object()}))
    nvml.energy_mj += 25_000  # 25 J since the server started
    text = generate_latest(registry).decode()
    got = {m.group(1): float(m.group(2)) for m in re.finditer(rf'^(nv_\w+)\{{gpu_uuid="{uuid}"\}} (\S+)$', text, re.M)}
    assert got == {"nv_gpu_utilization": 0.37, "nv_gpu_memory_total_bytes": 80 * 2**30,
                   "nv_gpu_memory_used_bytes": 3 * 2**30, "nv_gpu_power_usage": 71.5, "nv_gpu_power_limit": 700.0,
                   "nv_energy_consumption": 25.0}
    assert "# TYPE nv_energy_consumption untyped" in text  # Triton's exact name: no _total appended


def test_a_reading_nvml_refuses_is_left_out_and_the_rest_reported():
    nvml = _Nvml()

    def no_sensor(h):
        raise RuntimeError("NVMLError_NotSupported")

    nvml.nvmlDeviceGetPowerUsage = no_sensor
    registry = CollectorRegistry()
    registry.register(GpuCollector(nvml, {"GPU-x": object()}))
    text = generate_latest(registry).decode()
    assert 'nv_gpu_power_usage{' not in text and 'nv_gpu_memory_total_bytes{gpu_uuid="GPU-x"}' in text


def test_no_gpu_metrics_on_the_cpu_stand_in(monkeypatch):
    monkeypatch.setenv("STARONNX_CUDA_RUNTIME", "host")
    assert gpu_collector([0]) is None
    assert gpu_collector([]) is None
