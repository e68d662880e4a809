"""CPU help that never hurts (issue 11): beside a GPU 20x faster than the CPU group, as on the
H100 host, the scheduler gives the CPU only work that finishes earlier there.

Driven through the simulator, which runs the very policy objects the live engine runs, on perf
models written for a hypothetical H100-like machine; "GPU only" is the same machine with its
CPU worker left out.  GPU+CPU must match or beat GPU only on throughput at every load, and not
raise latency where the GPU alone keeps up.
"""

from __future__ import annotations

import pytest
from test_simulator import MS, NO_RESERVE, plan, topo, write_models  # noqa: F401 - plan is a fixture

from staronnx.bench.machine import SimMachine, build_machine
from staronnx.bench.simulator import simulate
from staronnx.perfmodels import PerfModelStore
from staronnx.bench.spec import SimSpec
from staronnx.perfmodels.helpcost import HelpCost
from staronnx.workers.layout import MachineSpec

#: a 2-part chain: 1 ms per part on the GPU, 20 ms on the 4-core CPU group
H100_LIKE = {(0, "cuda0"): 1 * MS, (1, "cuda0"): 1 * MS, (0, "cpu4"): 20 * MS, (1, "cpu4"): 20 * MS}


def _machines(plan, store) -> tuple[SimMachine, SimMachine]:
    both = build_machine(plan, MachineSpec(groups=NO_RESERVE, cuda_streams=1),
                         topology=topo("pack:1 numa:1 core:4 pu:1"), store=store)
    gpu = SimMachine(plan, [w for w in both.workers if w.kind == "cuda"], both.table, list(both.notes),
                     dict(both.settings))
    return both, gpu


@pytest.mark.parametrize("cost", ["free", "h200"])
@pytest.mark.parametrize("policy", ["dmda", "heft"])
@pytest.mark.parametrize("rate", [100, 400, 480, 600])  # GPU alone saturates at 500 req/s
def test_gpu_plus_cpu_is_never_worse_than_gpu_alone(plan, tmp_path, policy, rate, cost):
    """``cost``: what a CPU task costs the GPU side (HelpCost): nothing (a host where CPU help
    is free), or the H200's share, under which a CPU 20x slower than the GPU never pays
    (test_cpu_help_costs.py)."""
    store = PerfModelStore(tmp_path)
    write_models(store, plan, H100_LIKE, rel_std=0.05)
    both, gpu = _machines(plan, store)
    alone = simulate(gpu, rate, 1, SimSpec(policy=policy, duration=4)).metrics()
    options = {"help_cost": HelpCost.free() if cost == "free" else HelpCost()}
    helped_res = simulate(both, rate, 1, SimSpec(policy=policy, duration=4, policy_options=options))
    helped = helped_res.metrics()
    assert helped["throughput"] >= 0.98 * alone["throughput"]
    on_cpu = sum(n for (part, arch), n in helped_res.placement.items() if arch.startswith("cpu"))
    if not alone["congested"]:
        assert helped["latency_p99"] <= 1.05 * alone["latency_p99"] + 0.5 * MS
    if rate <= 400:  # the GPU keeps up with room to spare: the CPU gets nothing
        assert on_cpu == 0
    if rate == 600 and cost == "free":  # above the GPU's 500/s: the CPU takes the overflow (at most +5 %)
        assert on_cpu > 0 and helped["throughput"] > 1.03 * alone["throughput"]
    if cost == "h200":  # 0.13 x 20 ms charged to the GPU side for 1 ms freed: never
        assert on_cpu == 0


def test_the_in_flight_window_lets_a_slow_worker_be_chosen():
    from staronnx.serving.server import inflight_window

    assert inflight_window([None, None]) == 4  # nothing known: twice the workers
    assert inflight_window([0.01, 0.01]) == 4  # alike workers: the floor
    # a GPU stream 20x faster than the CPU group: ~20 batches queued on the GPU before dmda
    # prefers the CPU, so the window must hold them
    assert inflight_window([0.002, 0.002, 0.04]) == 20 + 20 + 1 + 3
    assert inflight_window([1e-6, 1.0]) == 256
