"""``staronnx serve``'s batches in flight come from the perf models (issue 11: CPU help).

With the Server's default window (two batches per worker) dmda never saw a GPU queue longer
than a 20x slower CPU group's time, so the CPU never took overflow; a served model now sizes
its window as sweeps and the simulator do. The GPU here is the simulator's what-if CUDA worker
(perf models written for it), so the window is checked on any host; the runtime is a real one
on two one-PU CPU groups.
"""

from __future__ import annotations

from dataclasses import replace

from test_simulator import MS, plan, write_models  # noqa: F401 - plan is a fixture

from staronnx.perfmodels import PerfModelStore
from staronnx.runtime.runtime import Runtime
from staronnx.workers.layout import MachineSpec
from staronnx.serve.metrics import ServeMetrics
from staronnx.serve.models import ENDPOINT_SPEC, ModelEndpoint, inflight_from_models


def _endpoint(plan, groups: str, cuda_streams: int) -> tuple[ModelEndpoint, Runtime]:
    runtime = Runtime(plan, MachineSpec(groups=groups))
    endpoint = ModelEndpoint("chain", runtime, replace(ENDPOINT_SPEC, max_delay=0.0, queue_capacity=16),
                             metrics=ServeMetrics(), settings={"groups": groups, "cuda_streams": cuda_streams})
    return endpoint, runtime


def test_window_from_models_holds_the_gpu_queue_a_slow_cpu_waits_behind(plan, tmp_path, monkeypatch, two_groups):
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path))
    # GPU 1 ms per part, each one-PU group 20 ms: dmda takes a CPU once ~20 batches queue on the GPU
    write_models(PerfModelStore(), plan, {(0, "cuda0"): 1 * MS, (1, "cuda0"): 1 * MS,
                                          (0, "cpu1"): 20 * MS, (1, "cpu1"): 20 * MS})
    assert inflight_from_models(plan, 1, groups=two_groups, cuda_streams=1) == 20 + 1 + 1 + 3  # GPU: 40/2, each CPU: 1, plus one running per worker
    endpoint, runtime = _endpoint(plan, two_groups, cuda_streams=1)
    try:
        assert endpoint.server.max_inflight == 25
        assert endpoint.config()["parameters"]["max_inflight"] == {"string_value": "25"}
    finally:
        endpoint.server.close()
        runtime.close()


def test_no_models_keeps_the_servers_default(plan, tmp_path, monkeypatch, two_groups):
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path))
    assert inflight_from_models(plan, 1, groups=two_groups, cuda_streams=0) is None
    endpoint, runtime = _endpoint(plan, two_groups, cuda_streams=0)
    try:
        assert endpoint.server.max_inflight == 2 * len(runtime.workers)
    finally:
        endpoint.server.close()
        runtime.close()
