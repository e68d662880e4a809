"""Triton's GPU metrics (``nv_gpu_utilization``, ``nv_gpu_memory_total_bytes``, ...) for the GPUs
a server's CUDA workers drive, read from NVML at scrape time.

Why Triton's names and labels: Grafana dashboards and alerts written for Triton read these
(per ``gpu_uuid``), and Triton exports them from the same source, NVML. Why at scrape time: a
gauge updated by a thread would be a copy that lags; NVML answers in microseconds. Why map by
UUID: a CUDA ordinal is an index into ``CUDA_VISIBLE_DEVICES``, NVML's index is not, and the
UUID is what both agree on.

NVML comes with the ``gpu`` extra (``nvidia-ml-py``). Where it is missing, or the GPUs are the
CPU stand-in, :func:`gpu_collector` says why in one line and the server runs without these
metrics; a GPU NVML cannot read at scrape time is left out of that scrape.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import GaugeMetricFamily, UnknownMetricFamily

log = logging.getLogger("staronnx.serve")

#: (name, help, what it reads from a device handle) in Triton's units: utilization 0..1, bytes, watts
GAUGES = (
    ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", lambda n, h: n.nvmlDeviceGetUtilizationRates(h).gpu / 100),
    ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", lambda n, h: n.nvmlDeviceGetMemoryInfo(h).total),
    ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", lambda n, h: n.nvmlDeviceGetMemoryInfo(h).used),
    ("nv_gpu_power_usage", "GPU power usage in watts", lambda n, h: n.nvmlDeviceGetPowerUsage(h) / 1000),
    ("nv_gpu_power_limit", "Maximum GPU power limit in watts", lambda n, h: n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000),
)
#: a counter in Triton, exposed untyped under its exact name (see :mod:`staronnx.serve.metrics`)
ENERGY = ("nv_energy_consumption", "GPU energy consumption in joules since the Triton Server started",
          lambda n, h: n.nvmlDeviceGetTotalEnergyConsumption(h) / 1000)


class GpuCollector:
    """The collector: one sample per metric and GPU, read from NVML when Prometheus scrapes;
    energy counted from the server's start, as Triton counts it."""

    def __init__(self, nvml: Any, handles: dict[str, Any]) -> None:
        self.nvml = nvml
        self.handles = handles  # gpu_uuid -> NVML handle
        self._energy0 = {u: self._read(ENERGY[2], h) for u, h in handles.items()}

    def _read(self, read: Any, handle: Any) -> float | None:
        try:
            return float(read(self.nvml, handle))
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported (no power sensor), a GPU gone: no sample
            return None

    def collect(self) -> Iterator[Any]:
        for name, text, read in (*GAUGES, ENERGY):
            energy = name == ENERGY[0]
            family = (UnknownMetricFamily if energy else GaugeMetricFamily)(name, text, labels=["gpu_uuid"])
            for uuid, handle in self.handles.items():
                value, start = self._read(read, handle), self._energy0.get(uuid) if energy else 0.0
                if value is not None and start is not None:
                    family.add_metric([uuid], value - start)
            yield family


def gpu_collector(devices: Sequence[int]) -> GpuCollector | None:
    """The collector for the CUDA ordinals ``devices``, or None with one log line saying why
    (no NVML, the CPU stand-in, a GPU NVML does not know)."""
    from staronnx.workers.cudart import host_runtime_from_env

    if not devices:
        return None
    if host_runtime_from_env() is not None:
        log.info("GPU metrics (nv_gpu_*) off: the CUDA workers run on the CPU stand-in")
        return None
    try:
        nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, ...
        log.warning("GPU metrics (nv_gpu_*) off: NVML is not usable here (%s); install nvidia-ml-py "
                    "(pip install 'staronnx[gpu]')", exc)
        return None
    from staronnx.workers.cuda_env import describe_gpus

    gpus = describe_gpus(devices)
    unread = sorted(set(devices) - {g["device"] for g in gpus})
    if unread:
        log.warning("GPU metrics: GPU(s) %s left out: CUDA cannot read their properties", unread)
    handles: dict[str, Any] = {}
    for g in gpus:
        try:
            handles[g["uuid"]] = nvml.nvmlDeviceGetHandleByUUID(g["uuid"])
        except Exception as exc:  # noqa: BLE001 - one GPU unknown to NVML: the others still reported
            log.warning("GPU metrics: GPU %d left out: %s", g["device"], exc)
    return GpuCollector(nvml, handles) if handles else None
