"""CPU help never costs the GPU (issue 48, item 4): the H200 rows where it did, reproduced.

The H200 run of 2026-11-28 (googlenet fp32, 16 host cores; docs/guides/gpu.md, no artifact):
``gpu+cpu`` (dmda) ran 0.92x the GPU alone at batch 32 with 4 streams and 0.66x at batch 1 with
8 streams. Times per task derived from its figures:

- GPU alone, batch 32, 4 streams: 7,998 samples/s, so the device takes ``g = 32 / 7,998 = 4.0
  ms`` per batch and a stream's task, four overlapping, ``4 g = 16.0 ms``;
- GPU alone, batch 1, 8 streams: 2,829 samples/s, ``g = 0.353 ms``, a stream's task 2.83 ms;
- the CPU group (15 cores): ~400 samples/s, what ``--shares auto``'s 7 % tail with a predicted
  +4.9 % at batch 8 solves to (and the H100 host's 14-core group measured 389): 80 ms a batch of
  32, 2.5 ms a batch of 1 (batch 1 taken at batch 8's rate per sample: generous to the CPU);
- the GPU side's loss while a CPU task runs, ``host_share = 0.13``: had the CPU run all the time
  at batch 32, ``7,334 = 400 + 7,998 x (1 - f)`` (:mod:`staronnx.perfmodels.helpcost`).

A CPU task costs the GPU side ``0.13 x 80 + 0.1 = 10.5 ms`` at batch 32 and frees 4.0 ms of
device time; at batch 1 it costs 0.43 ms and frees 0.35 ms: on both rows the GPU alone finishes
the work sooner, yet StarPU's dmda (no cost term: ``HelpCost.free()``) gives the CPU tasks.
With the cost charged (the policies' default, option ``help_cost``) the CPU group takes none, on the policies driven by hand, on the
simulator that runs the same policy objects, and on a live runtime (CUDA workers on
``HostRuntime``, the CPU stand-in).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from test_policies import FakeClock, FakePredictor, data
from test_simulator import MS, NO_RESERVE, plan, topo, write_models  # noqa: F401 - plan is a fixture

from staronnx.bench.machine import SimMachine, build_machine
from staronnx.bench.simulator import simulate
from staronnx.bench.spec import SimSpec
from staronnx.perfmodels import PerfModelStore
from staronnx.perfmodels.helpcost import H200_HOST_SHARE, HelpCost, helped_end
from staronnx.runtime.policies import make_policy
from staronnx.runtime.sched import TaskView, WorkerInfo
from staronnx.workers.layout import MachineSpec

H200 = HelpCost()  # the H200's host share and a task's fixed 100 us
#: (batch, streams, GPU alone samples/s, CPU group samples/s), the H200 rows where help lost
ROWS = [(32, 4, 7998.0, 400.0), (1, 8, 2829.0, 400.0)]


def _times(batch: int, streams: int, gpu_rate: float, cpu_rate: float) -> tuple[float, float, float]:
    """(a stream's task, the device's time per batch, the CPU group's task), seconds."""
    device_s = batch / gpu_rate
    return streams * device_s, device_s, batch / cpu_rate


def _workers(streams: int) -> list[WorkerInfo]:
    gpus = [WorkerInfo(i, f"cuda0:{i}", "cuda0", "cuda", "cuda0") for i in range(streams)]
    return [*gpus, WorkerInfo(streams, "cpu15", "cpu15", "cpu", "numa0", ncores=15)]


def _burst(policy_name: str, batch: int, streams: int, gpu_rate: float, cpu_rate: float, tasks: int,
           help_cost: HelpCost | None) -> list[int]:
    """Push ``tasks`` one-part tasks at once (a window in flight; inputs in host memory);
    the workers they were placed on."""
    stream_s, _, cpu_s = _times(batch, streams, gpu_rate, cpu_rate)
    policy = make_policy(policy_name, help_cost=help_cost)
    policy.attach(_workers(streams), FakePredictor({(0, "cuda0"): stream_s, (0, "cpu15"): cpu_s}, bandwidth=50e9),
                  FakeClock())
    placed = []
    for i in range(tasks):
        t = TaskView(id=i, part=0, batch=batch, request=i, inputs=[data(batch * 3 * 224 * 224 * 4, "numa0")])
        placed.append(policy.push(t))
    return placed


def _finish_with_costs(placed: list[int], batch: int, streams: int, gpu_rate: float, cpu_rate: float) -> float:
    """When the burst is done, the GPU side charged H200's cost for each CPU task: the GPU
    does its tasks at ``g`` each plus the cost of each CPU task; the CPU its own one by one."""
    _, device_s, cpu_s = _times(batch, streams, gpu_rate, cpu_rate)
    on_cpu = sum(1 for w in placed if w == streams)
    gpu_end = (len(placed) - on_cpu) * device_s + on_cpu * H200.gpu_seconds(cpu_s)
    return max(gpu_end, on_cpu * cpu_s)


@pytest.mark.parametrize("policy_name", ["dmda", "heft"])
@pytest.mark.parametrize("row", ROWS, ids=["b32-4streams", "b1-8streams"])
def test_starpus_decision_gives_the_cpu_tasks_the_gpu_alone_would_finish_sooner(policy_name, row):
    """The loss, reproduced: without the cost term the CPU group takes tasks of a burst larger
    than its time's worth of GPU queue, and the burst ends later than on the GPU alone."""
    batch, streams, gpu_rate, cpu_rate = row
    tasks = 32 if batch == 32 else 16
    legacy = _burst(policy_name, batch, streams, gpu_rate, cpu_rate, tasks, help_cost=HelpCost.free())
    assert streams in legacy, "StarPU's decision gives the CPU group part of the burst"
    alone = _finish_with_costs([0] * tasks, batch, streams, gpu_rate, cpu_rate)
    assert _finish_with_costs(legacy, batch, streams, gpu_rate, cpu_rate) > alone


@pytest.mark.parametrize("policy_name", ["dmda", "dmdas", "heft"])
@pytest.mark.parametrize("row", ROWS, ids=["b32-4streams", "b1-8streams"])
def test_with_the_gpu_side_cost_charged_the_cpu_takes_nothing_on_the_h200_rows(policy_name, row):
    batch, streams, gpu_rate, cpu_rate = row
    placed = _burst(policy_name, batch, streams, gpu_rate, cpu_rate, 64, help_cost=H200)
    assert streams not in placed


@pytest.mark.parametrize("policy_name", ["dm", "dmda"])
def test_a_cpu_that_costs_more_than_it_frees_loses_whatever_the_weights(policy_name):
    """alpha 0 (only transfers weigh) must not turn an infinite end into a NaN fitness."""
    stream_s, _, cpu_s = _times(32, 4, 7998.0, 400.0)
    policy = make_policy(policy_name, alpha=0.0, help_cost=H200)
    policy.attach(_workers(4), FakePredictor({(0, "cuda0"): stream_s, (0, "cpu15"): cpu_s}), FakeClock())
    for i in range(32):
        assert policy.push(TaskView(id=i, part=0, batch=32, request=i,
                                    inputs=[data(1 << 20, "numa0")])) != 4


def test_a_cpu_whose_cost_is_below_the_gpu_time_it_frees_still_helps():
    """A P100-like machine: the GPU only 5x the CPU group, so a CPU task (10 ms, costing the
    GPU 1.4 ms) frees 2 ms of device time: a long burst still overflows to the CPU."""
    placed = _burst("dmda", 8, 1, 8 / 2e-3, 8 / 10e-3, 40, help_cost=H200)
    assert 1 in placed


def test_the_decision_records_what_a_cpu_task_would_cost_the_gpu():
    policy = make_policy("dmda", help_cost=H200)
    stream_s, device_s, cpu_s = _times(32, 4, 7998.0, 400.0)
    policy.attach(_workers(4), FakePredictor({(0, "cuda0"): stream_s, (0, "cpu15"): cpu_s}), FakeClock())
    policy.push(TaskView(id=0, part=0, batch=32, request=0))
    decision = policy.last_decision
    assert decision is not None
    cpu = next(c for c in decision.candidates if c.worker == 4)
    assert cpu.gpu_cost == pytest.approx(H200_HOST_SHARE * cpu_s + 100e-6)
    assert cpu.end == math.inf and cpu.fitness == math.inf  # 10.5 ms cost > 4.0 ms freed
    assert all(c.gpu_cost == 0.0 for c in decision.candidates if c.worker != 4)


def test_helped_end_and_bad_costs():
    assert helped_end(5.0, 10.0, 2.0, 1.0) == 9.0  # the GPU side's work ends 1 ms later, not 2
    assert helped_end(9.5, 10.0, 2.0, 1.0) == 9.5
    assert helped_end(1.0, 10.0, 2.0, 2.0) == math.inf
    with pytest.raises(ValueError, match="host_share"):
        HelpCost(host_share=1.5)
    with pytest.raises(ValueError, match="help_cost must be a HelpCost"):
        make_policy("dmda", help_cost=0.13)
    with pytest.raises(ValueError, match="host_share"):
        make_policy("heft", help_cost={"host_share": -1})
    assert make_policy("dmda", help_cost={"host_share": 0.05}).help_cost == HelpCost(host_share=0.05)
    assert make_policy("dmdas").help_cost == HelpCost()  # the H200's, until a machine measures its own


# -- the simulator: the same policy objects on simulated time ------------------------------------
def _machines(plan, store, streams: int) -> tuple[SimMachine, SimMachine]:
    both = build_machine(plan, MachineSpec(groups=NO_RESERVE, cuda_streams=streams),
                         topology=topo("pack:1 numa:1 core:4 pu:1"), store=store)
    gpu = SimMachine(plan, [w for w in both.workers if w.kind == "cuda"], both.table, list(both.notes),
                     dict(both.settings))
    return both, gpu


@pytest.mark.parametrize("policy_name", ["dmda", "heft"])
def test_simulate_puts_nothing_on_the_cpu_on_the_h200_batch32_row(plan, tmp_path, policy_name):
    """The 2-part chain at the H200's batch-32 times (each part half), offered 1.5x what the GPU
    alone serves: StarPU's decision overflows to the CPU group; with the cost, the simulation
    keeps every task on the GPU's 4 streams and serves what the GPU alone serves."""
    stream_s, device_s, cpu_s = _times(32, 4, 7998.0, 400.0)
    store = PerfModelStore(tmp_path)
    write_models(store, plan, {(0, "cuda0"): stream_s / 2, (1, "cuda0"): stream_s / 2,
                               (0, "cpu4"): cpu_s / 2, (1, "cpu4"): cpu_s / 2}, batches=(32,))
    both, gpu = _machines(plan, store, 4)
    rate = 1.5 * 32 / device_s
    kw: dict[str, Any] = dict(rate=rate, batch_size=32, max_inflight=64)
    free = SimSpec(policy=policy_name, duration=2, policy_options={"help_cost": HelpCost.free()})
    legacy = simulate(both, spec=free, **kw)
    assert any(arch.startswith("cpu") and n for (_, arch), n in legacy.placement.items())
    charged = SimSpec(policy=policy_name, duration=2)  # the default: the H200's cost
    helped = simulate(both, spec=charged, **kw)
    assert not any(arch.startswith("cpu") and n for (_, arch), n in helped.placement.items())
    alone = simulate(gpu, spec=charged, **kw).metrics()
    assert helped.metrics()["throughput"] >= 0.98 * alone["throughput"]


# -- a live runtime: CUDA workers on HostRuntime beside a CPU group ------------------------------
@pytest.mark.parametrize("policy_name", ["dmda", "heft"])
def test_a_live_runtime_keeps_the_h200_batch1_row_on_the_gpu(plan, tmp_path, policy_name):
    """8 CUDA streams (HostRuntime: their driver thread and pipeline run for real, host memory
    standing in for the device's) beside a CPU group, perf models at the batch-1 row's times
    (each part half): a burst of 48 requests runs entirely on the streams with the H200's cost
    (the default); with StarPU's decision (``HelpCost.free()``) the CPU group takes part of it."""
    from staronnx import CudaOptions, Runtime, RuntimeSpec
    from staronnx.workers.cudart import HostRuntime

    stream_s, _, cpu_s = _times(1, 8, 2829.0, 400.0)
    store = PerfModelStore(tmp_path)
    archs = [f"cpu{n}" for n in range(1, 5)]  # whatever size this host's CPU group has
    write_models(store, plan, {(p, a): (stream_s if a == "cuda0" else cpu_s) / 2
                               for p in (0, 1) for a in ["cuda0", *archs]}, batches=(1,))
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 32)).astype(np.float32)}

    def tasks_on_cpu(help_cost: HelpCost | None) -> int:
        with Runtime(plan,
                     MachineSpec(groups="numa", cuda_streams=8, cuda_graphs=False),
                     RuntimeSpec(policy=policy_name, store=store, policy_options={"help_cost": help_cost},
                                 cuda=CudaOptions(runtime=HostRuntime()))) as rt:
            assert any(w["arch"].startswith("cpu") for w in rt.stats()["workers"].values())
            for f in [rt.submit(feeds) for _ in range(48)]:
                f.result(timeout=120)
            workers = rt.stats()["workers"].values()
        return sum(w["tasks"] for w in workers if w["arch"].startswith("cpu"))

    assert tasks_on_cpu(None) == 0
    assert tasks_on_cpu(HelpCost.free()) > 0


# -- the measured cost: stored per host, read by the predictor, charged by the policies ----------
def test_a_stored_help_cost_is_what_the_policies_charge(tmp_path):
    from staronnx.runtime.predictor import PerfPredictor

    store = PerfModelStore(tmp_path)
    assert store.load_help_cost() is None and PerfPredictor("p", store).help_cost is None
    measured = HelpCost(host_share=0.02, task_s=50e-6)
    store.save_help_cost(measured)
    assert PerfModelStore(tmp_path).load_help_cost() == measured
    predictor = PerfPredictor("p", store)
    assert predictor.help_cost == measured
    policy = make_policy("heft")
    policy.attach(_workers(4), predictor, FakeClock())
    assert policy.help_cost == measured
    given = make_policy("dmda", help_cost=HelpCost.free())
    given.attach(_workers(4), predictor, FakeClock())
    assert given.help_cost == HelpCost.free()  # the option wins over the stored figure


def test_a_corrupt_help_cost_file_is_ignored_with_a_warning(tmp_path):
    store = PerfModelStore(tmp_path)
    store.help_cost_path().parent.mkdir(parents=True)
    store.help_cost_path().write_text("{not json")
    with pytest.warns(Warning, match="help cost"):
        assert store.load_help_cost() is None


def test_a_gpu_task_runs_longer_while_cpu_tasks_run():
    from staronnx.perfmodels.helpcost import gpu_task_scale

    assert gpu_task_scale(None, 3) == 1.0 and gpu_task_scale(H200, 0) == 1.0
    assert gpu_task_scale(H200, 1) == pytest.approx(1 / 0.87)
    assert gpu_task_scale(HelpCost(host_share=0.5), 4) == pytest.approx(10.0)  # capped
