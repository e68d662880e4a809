"""The discrete-event simulator: hand-made perf models on a small zoo plan, the real policies,
the LP bound as the yardstick, and one check against a real calibration."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from collections.abc import Callable, Mapping

import numpy as np
import onnx
import pytest

from staronnx import partition
from staronnx.bench.bound import machine_bound
from staronnx.bench.machine import ArchSource, SimulationError, build_machine, profile_plan
from staronnx.bench.simulator import simulate
from staronnx.perfmodels import BusModel, HistoryModel, LinkCost, PerfModelStore
from staronnx.plan import Plan
from staronnx.runtime.policies import POLICIES
from staronnx.workers.topology import Topology
from staronnx.zoo import chain
from staronnx.partition import PartitionSpec
from staronnx.workers.layout import MachineSpec
from staronnx.bench.spec import SimSpec

MS = 1e-3
CPU4 = "pack:1 numa:1 core:4 pu:1"  # groups="numa": one 4-core worker, arch cpu4
#: no core held back for the CUDA worker's thread, so the CPU worker beside it stays cpu4
NO_RESERVE = "numa,reserve=0"
TWO_CORES = "pack:1 numa:1 core:2 pu:1"  # groups="cores=1": two workers, arch cpu1
TWO_NODES = "pack:1 numa:2 core:1 pu:1"  # groups="numa": cpu1 on numa0 and on numa1


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Plan:
    """A 2-part chain (part 1 reads part 0's output)."""
    root = tmp_path_factory.mktemp("sim")
    onnx.save(chain(depth=6, width=32), str(root / "chain.onnx"))
    p = partition(root / "chain.onnx", [0.6, 0.4], PartitionSpec(profile_runs=2), output_dir=root / "plan")
    assert p.dependencies() == [set(), {0}]
    return p


Times = Mapping[tuple[int, str], "float | Callable[[int], float]"]


def write_models(store: PerfModelStore, plan: Plan, times: Times, batches=(1,), rel_std: float = 0.0) -> None:
    """Calibrated history models: per (part, arch) ``times`` seconds (or ``times(batch)``) at
    each batch size, with samples alternating mean*(1 +- rel_std) so the stddev is rel_std*mean."""
    for (part, arch), t in times.items():
        model = HistoryModel(part, arch)
        for b in batches:
            mean = t(b) if callable(t) else t
            fp = profile_plan(plan, b).footprints[part]
            model.record(fp, mean)  # the dropped first sample
            for i in range(10):
                model.record(fp, mean * (1 + rel_std * (1 if i % 2 else -1)))
        store.save(plan.hash, model)


def topo(description: str) -> Topology:
    return Topology.from_synthetic(description)


# -- latency and throughput against hand calculations -----------------------------------------
def test_low_rate_latency_is_the_batch_fill_plus_the_part_times(plan, tmp_path):
    store = PerfModelStore(tmp_path)
    write_models(store, plan, {(0, "cpu4"): 4 * MS, (1, "cpu4"): 2 * MS}, batches=(4,))
    res = simulate(build_machine(plan, topology=topo(CPU4), store=store), 100, 4, SimSpec(duration=10))
    m = res.metrics()
    # the first request of a batch waits for 3 more (30 ms), then the chain runs (6 ms)
    assert m["paper_latency_mean"] == pytest.approx(36 * MS, abs=1e-9)
    assert m["latency_p50"] == pytest.approx(21 * MS, abs=1e-9)  # waits 30/20/10/0 ms + 6 ms
    assert m["throughput"] == pytest.approx(100, rel=0.01)
    assert not m["congested"] and m["rejected"] == 0 and m["completed"] == 1000
    assert res.placement == {(0, "cpu4"): 250, (1, "cpu4"): 250}
    assert res.busy["cpu:numa0"] == pytest.approx(250 * 6 * MS / 9.996, rel=1e-3)
    # records filled as the live server fills them
    recs = res.records
    assert recs.start == 0.0 and recs.offered_rate == 100 and recs.batch_size == 4
    assert len(recs.batches) == 250 and all(b.size == 4 for b in recs.batches)
    for b in recs.batches:
        firsts = [recs.requests[i].first_in_batch for i in b.request_ids]
        assert firsts == [True, False, False, False]
        assert b.placement == {"part0": "cpu4", "part1": "cpu4"}
        assert b.done == pytest.approx(b.formed + 6 * MS)
    assert recs.queue_samples and max(q for _, q in recs.queue_samples) <= 4
    assert recs.settings["engine"] == "simulator" and recs.settings["policy"] == "heft"


@pytest.mark.parametrize("policy", ["dmda", "heft", "eager"])
def test_above_the_lp_bound_the_queue_grows_and_throughput_meets_the_bound(plan, tmp_path, policy):
    store = PerfModelStore(tmp_path)
    write_models(store, plan, {(0, "cpu1"): 4 * MS, (1, "cpu1"): 2 * MS}, batches=(4,), rel_std=0.1)
    machine = build_machine(plan, MachineSpec(groups="cores=1"), topology=topo(TWO_CORES), store=store)
    bound = machine_bound(machine, 4)
    assert bound.throughput == pytest.approx(2 * 4 / (6 * MS))  # two workers, 6 ms per batch
    over = simulate(machine, 1.5 * bound.throughput, 4, SimSpec(policy=policy))
    m = over.metrics()
    assert m["congested"]
    assert m["throughput"] == pytest.approx(bound.throughput, rel=0.03)
    under = simulate(machine, 0.5 * bound.throughput, 4, SimSpec(policy=policy)).metrics()
    assert not under["congested"]
    assert under["throughput"] == pytest.approx(0.5 * bound.throughput, rel=0.01)


# -- the real policies on a CPU + (hypothetical) GPU machine ------------------------------------
GPU_TIMES = {(0, "cuda0"): 1 * MS, (0, "cpu4"): 10 * MS, (1, "cuda0"): 1 * MS, (1, "cpu4"): 3 * MS}


def test_heft_runs_both_parts_on_the_gpu_at_low_load_and_overflows_part1_under_load(plan, tmp_path):
    store = PerfModelStore(tmp_path)
    write_models(store, plan, GPU_TIMES)
    machine = build_machine(plan, MachineSpec(groups=NO_RESERVE, cuda_streams=1), topology=topo(CPU4), store=store)
    assert [w.arch for w in machine.workers] == ["cuda0", "cpu4"]  # accelerators first
    low = simulate(machine, 100, 1, SimSpec(policy="heft"))
    assert set(low.placement) == {(0, "cuda0"), (1, "cuda0")}
    # 2 ms of GPU work per request every 1.6 ms: the GPU alone cannot keep up
    busy = simulate(machine, 625, 1, SimSpec(policy="heft"))
    assert busy.placement.get((0, "cpu4"), 0) == 0
    assert busy.placement.get((1, "cpu4"), 0) >= 0.2 * 6250
    m = busy.metrics()
    assert not m["congested"] and m["throughput"] == pytest.approx(625, rel=0.01)
    assert m["latency_p99"] < 15 * MS
    # the LP: part 0 all on the GPU, part 1 split; 666.7 samples/s, both workers binding
    bound = machine_bound(machine, 1)
    assert bound.throughput == pytest.approx(2000 / 3)
    assert bound.arch_share()[(0, "cuda0")] == pytest.approx(1.0)
    over = simulate(machine, 900, 1, SimSpec(policy="heft")).metrics()
    assert over["congested"]
    assert over["throughput"] <= bound.throughput * 1.01
    assert over["throughput"] >= bound.throughput * 0.85


def test_cuda_scale_is_a_what_if_gpu_built_from_the_cpu_models(plan, tmp_path):
    store = PerfModelStore(tmp_path)
    write_models(store, plan, {k: v for k, v in GPU_TIMES.items() if k[1] == "cpu4"})
    with pytest.raises(SimulationError, match=r"cuda0.*calibrate"):
        simulate(build_machine(plan, MachineSpec(groups=NO_RESERVE, cuda_streams=1), topology=topo(CPU4), store=store),
                 100, 1)
    machine = build_machine(plan, MachineSpec(groups=NO_RESERVE, cuda_streams=1), topology=topo(CPU4), store=store,
                            cuda_scale=(0.1, 1 / 3))
    assert machine.table.source("cuda0") == ArchSource("cpu4", (0.1, 1 / 3))
    assert any("what-if" in n for n in machine.notes)
    res = simulate(machine, 625, 1, SimSpec(policy="heft"))
    assert res.placement.get((0, "cpu4"), 0) == 0 and res.placement[(1, "cpu4")] > 0
    assert machine_bound(machine, 1).throughput == pytest.approx(2000 / 3)


def test_missing_cpu_group_sizes_borrow_the_nearest_calibrated_one(plan, tmp_path):
    store = PerfModelStore(tmp_path)
    write_models(store, plan, {(0, "cpu4"): 8 * MS, (1, "cpu4"): 4 * MS})
    machine = build_machine(plan, topology=topo("pack:1 numa:2 core:8 pu:1"), store=store)
    assert [w.arch for w in machine.workers] == ["cpu8", "cpu8"]
    assert machine.table.source("cpu8") == ArchSource("cpu4", 0.5)
    assert machine_bound(machine, 1).throughput == pytest.approx(2 / (6 * MS))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_serves_every_request(plan, tmp_path, policy):
    store = PerfModelStore(tmp_path)
    write_models(store, plan, GPU_TIMES, rel_std=0.2)
    machine = build_machine(plan, MachineSpec(groups=NO_RESERVE, cuda_streams=1), topology=topo(CPU4), store=store)
    res = simulate(machine, 500, 1, SimSpec(n_requests=400, policy=policy))
    m = res.metrics()
    assert m["completed"] == 400 and m["pending"] == 0
    assert sum(res.placement.values()) == 800
    assert all(b.done is not None and len(b.placement) == 2 for b in res.records.batches)


def test_a_seed_determines_the_run(plan, tmp_path):
    store = PerfModelStore(tmp_path)
    write_models(store, plan, GPU_TIMES, rel_std=0.2)
    machine = build_machine(plan, MachineSpec(groups=NO_RESERVE, cuda_streams=1), topology=topo(CPU4), store=store)

    def run(seed: int, policy: str = "heft"):
        res = simulate(machine, 600, 1, SimSpec(duration=2, distribution="poisson", seed=seed, policy=policy))
        recs = res.records
        return ([(r.arrival, r.done, r.batch_id) for r in recs.requests],
                [b.placement for b in recs.batches], res.placement)

    assert run(1) == run(1)
    assert run(1, "random") == run(1, "random")
    assert run(1)[0] != run(2)[0]


# -- models: regression, partial batches, transfers, errors ------------------------------------
def test_a_batch_size_never_calibrated_uses_the_regression(plan, tmp_path):
    store = PerfModelStore(tmp_path)
    linear = {(p, "cpu4"): (lambda b: b * MS) for p in (0, 1)}
    write_models(store, plan, linear, batches=(1, 2, 4, 8), rel_std=0.1)
    res = simulate(build_machine(plan, topology=topo(CPU4), store=store), 100, 3, SimSpec(spread=0))
    # 20 ms of batch fill, then 3 ms + 3 ms from the fit t(n) = 1 ms * n
    assert res.metrics()["paper_latency_mean"] == pytest.approx(26 * MS, rel=0.01)
    with pytest.raises(SimulationError, match="batch 32"):
        store2 = PerfModelStore(tmp_path / "two")
        write_models(store2, plan, linear, batches=(1, 2))  # too few sizes for a fit
        simulate(build_machine(plan, topology=topo(CPU4), store=store2), 100, 32)


def test_max_delay_lets_partial_batches_leave(plan, tmp_path):
    store = PerfModelStore(tmp_path)
    write_models(store, plan, {(0, "cpu4"): 1 * MS, (1, "cpu4"): 1 * MS}, batches=(1, 2, 8))
    res = simulate(build_machine(plan, topology=topo(CPU4), store=store), 100, 8,
                   SimSpec(max_delay=5 * MS, n_requests=50))
    assert {b.size for b in res.records.batches} == {1}
    arrival = {r.id: r.arrival for r in res.records.requests}
    *timed, flushed = res.records.batches  # the generator flushes after its last request
    assert all(b.formed == pytest.approx(arrival[b.request_ids[0]] + 5 * MS) for b in timed)
    assert flushed.formed == arrival[flushed.request_ids[0]]
    assert res.metrics()["latency_p50"] == pytest.approx(7 * MS)


def test_a_padded_partial_batch_costs_its_padded_size(plan, tmp_path):
    store = PerfModelStore(tmp_path)
    write_models(store, plan, {(0, "cpu4"): lambda b: b * MS, (1, "cpu4"): lambda b: b * MS}, batches=(1, 4, 8))
    machine = build_machine(plan, topology=topo(CPU4), store=store)
    common = SimSpec(max_delay=5 * MS, n_requests=50)
    plain = simulate(machine, 100, 8, common)
    padded = simulate(machine, 100, 8, replace(common, pad_to=(4, 8)))
    # one request per batch (10 ms apart, 5 ms max_delay): it runs as 1 row, or as 4 when padded
    assert {(b.size, b.padded_to) for b in plain.records.batches} == {(1, None)}
    assert {(b.size, b.padded_to) for b in padded.records.batches} == {(1, 4)}
    assert plain.metrics()["latency_p50"] == pytest.approx(5 * MS + 2 * MS)
    assert padded.metrics()["latency_p50"] == pytest.approx(5 * MS + 2 * 4 * MS)
    assert padded.records.settings["pad_to"] == [4, 8]


def test_a_partial_batch_with_no_model_is_left_waiting_with_a_note(plan, tmp_path):
    store = PerfModelStore(tmp_path)
    write_models(store, plan, {(0, "cpu4"): 1 * MS, (1, "cpu4"): 1 * MS}, batches=(4,))  # no fit either
    for max_delay in (None, 5 * MS):  # the end-of-run flush, and a batch max_delay lets leave early
        res = simulate(build_machine(plan, topology=topo(CPU4), store=store), 100, 4,
                       SimSpec(max_delay=max_delay, n_requests=10))
        assert [b.size for b in res.records.batches] == [4, 4]
        waiting = [r for r in res.records.requests if r.done is None]
        assert len(waiting) == 2
        assert "no model for a batch of 2: its requests waited for a full batch" in res.notes, res.notes


def test_transfers_between_memory_nodes_cost_time_and_lower_the_bound(plan, tmp_path):
    store = PerfModelStore(tmp_path)
    write_models(store, plan, {(0, "cpu1"): 4 * MS, (1, "cpu1"): 4 * MS})
    free = build_machine(plan, topology=topo(TWO_NODES), store=store)
    bus = BusModel()
    bus.set("numa0", "numa1", LinkCost(latency=2 * MS, bandwidth=1e12))
    bus.set("numa1", "numa0", LinkCost(latency=2 * MS, bandwidth=1e12))
    costly = build_machine(plan, topology=topo(TWO_NODES), store=store, bus=bus)
    assert machine_bound(free, 1).throughput == pytest.approx(2 / (8 * MS))
    bound = machine_bound(costly, 1)
    # numa1's worker pays a 2 ms copy of the input for each chain it runs: 8 + 2 ms
    assert bound.throughput == pytest.approx(1 / (8 * MS) + 1 / (10 * MS))
    for policy in ("dmda", "eager"):
        m = simulate(costly, 2 * bound.throughput, 1, SimSpec(policy=policy)).metrics()
        assert m["throughput"] <= bound.throughput * 1.01


def test_bad_settings_are_clear_errors(plan, tmp_path):
    store = PerfModelStore(tmp_path)
    with pytest.raises(SimulationError, match="staronnx calibrate"):
        build_machine(plan, topology=topo(CPU4), store=store)
    write_models(store, plan, {(0, "cpu4"): MS, (1, "cpu4"): MS})
    machine = build_machine(plan, topology=topo(CPU4), store=store)
    for rate, batch_size, spec, match in [
        (0, 1, SimSpec(), "rate"),
        (10.0, 0, SimSpec(), "batch_size"),
        (10.0, 1, SimSpec(distribution="bursty"), "distribution"),
        (10.0, 1, SimSpec(spread=-1), "spread"),
        (10.0, 1, SimSpec(max_delay=-1.0), "max_delay"),
    ]:
        with pytest.raises(SimulationError, match=match):
            simulate(machine, rate, batch_size, spec)
    with pytest.raises(SimulationError, match="batch 2"):  # no model at that size, no fit
        simulate(machine, 10, 2)


def test_ten_seconds_at_500_requests_per_second_are_all_simulated(plan, tmp_path):
    """Every request of a long what-if completes, and the simulation says how long it took
    (its speed is printed by benchmarks/simulator.py: a timed test fails on a busy host)."""
    store = PerfModelStore(tmp_path)
    write_models(store, plan, GPU_TIMES, rel_std=0.1)
    machine = build_machine(plan, MachineSpec(groups=NO_RESERVE, cuda_streams=2), topology=topo(CPU4), store=store)
    simulate(machine, 500, 1, SimSpec(duration=0.1))  # warm caches
    res = simulate(machine, 500, 1, SimSpec(duration=10.0))
    assert res.metrics()["completed"] == 5000
    assert res.wall_seconds > 0


# -- the CLI -----------------------------------------------------------------------------------
def test_cli_simulate_prints_metrics_placement_and_bound(plan, tmp_path):
    home = tmp_path / "home"
    write_models(PerfModelStore(home), plan, {k: v for k, v in GPU_TIMES.items() if k[1] == "cpu4"})
    env = {**os.environ, "STARONNX_HOME": str(home), "COLUMNS": "200"}
    out = subprocess.run(
        [sys.executable, "-m", "staronnx", "simulate", str(plan.root), "--rate", "625", "--batch", "1",
         "--synthetic", "pack:1 numa:1 core:4", "--groups", NO_RESERVE, "--cuda-streams", "1", "--cuda-scale", "0.1,0.3333333333",
         "--duration", "2"],
        check=False, capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "throughput" in out.stdout and "papers' latency" in out.stdout
    assert "LP bound 666.7 samples/s" in out.stdout
    assert "cuda0" in out.stdout and "cpu4" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "staronnx", "simulate", str(plan.root), "--rate", "10",
                          "--batch", "1", "--synthetic", "pack:1 numa:1 core:4", "--groups", NO_RESERVE, "--cuda-streams", "1"],
                         check=False, capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "cuda0" in bad.stderr


def test_cli_simulate_refuses_requests_with_a_duration(real_plan, tmp_path):
    """``--requests N`` wins over ``--duration`` in the simulator: given both, the duration was
    dropped without a word (the run lasted N requests, exit 0). Refused in one line before
    anything is simulated; ``--requests`` alone runs as before."""
    plan = real_plan("gru_stream")
    pu = str(min(os.sched_getaffinity(0)))
    env = {**os.environ, "STARONNX_HOME": str(tmp_path / "home"), "COLUMNS": "200"}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "staronnx", *args], check=False, capture_output=True, text=True,
                              env=env, timeout=300)

    for _ in range(3):  # on a loaded host an entry can end short of its samples: a second run finishes it
        done = cli("calibrate", str(plan.root), "--batch-sizes", "1", "--groups", pu, "--max-runs", "30", "--no-bus",
                   "--no-host")
        assert done.returncode == 0, done.stdout + done.stderr
        if "not calibrated (" not in done.stdout:
            break
    simulate = ("simulate", str(plan.root), "--rate", "50", "--batch", "1", "--groups", pu, "--band", "0")
    both = cli(*simulate, "--requests", "20", "--duration", "30s")
    assert both.returncode == 2 and "Traceback" not in both.stderr, both.stdout + both.stderr
    assert both.stderr.strip() == ("staronnx: error: --requests and --duration both say how long the simulated "
                                   "traffic lasts: give one of them")
    alone = cli(*simulate, "--requests", "20")
    assert alone.returncode == 0, alone.stdout + alone.stderr


def test_cli_simulate_lays_out_a_driver_thread_per_stream(real_plan, tmp_path):
    """``run``, ``sweep`` and ``serve --cuda-thread-per-stream`` hold a core back per stream (the
    CPU group one core narrower per extra stream), but ``simulate`` had no such flag ("No such
    option"): it could only simulate the machine with one driver per GPU. On a made-up 8-core
    machine with 2 streams the CPU worker is cpu7 with one driver, cpu6 with one per stream."""
    plan = real_plan("gru_stream")
    pu = str(min(os.sched_getaffinity(0)))
    env = {**os.environ, "STARONNX_HOME": str(tmp_path / "home"), "COLUMNS": "200"}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "staronnx", *args], check=False, capture_output=True, text=True,
                              env=env, timeout=300)

    for _ in range(3):  # on a loaded host an entry can end short of its samples: a second run finishes it
        done = cli("calibrate", str(plan.root), "--batch-sizes", "1", "--groups", pu, "--max-runs", "30", "--no-bus",
                   "--no-host")
        assert done.returncode == 0, done.stdout + done.stderr
        if "not calibrated (" not in done.stdout:
            break
    simulate = ("simulate", str(plan.root), "--rate", "50", "--batch", "1", "--synthetic", "pack:1 numa:1 core:8",
                "--cuda-streams", "2", "--cuda-scale", "0.5", "--band", "0")
    widths = {}
    for own in (False, True):
        out = cli(*simulate, *(["--cuda-thread-per-stream"] if own else []))
        assert out.returncode == 0, out.stdout + out.stderr
        first = out.stdout.splitlines()[0]
        assert "cuda0.s0 (cuda0), cuda0.s1 (cuda0)" in first, first
        widths[own] = re.search(r"cpu:numa0 \((cpu\d+)\)", first).group(1)
    assert widths == {False: "cpu7", True: "cpu6"}, widths


# -- against a real calibration ----------------------------------------------------------------
def test_saturated_simulation_of_a_calibrated_plan_meets_its_models_prediction(plan, tmp_path):
    """Calibrate on this machine's cores, then the simulated saturated throughput must be what
    the calibrated means predict: workers x batch / sum of part times (identical workers)."""
    from staronnx.calibrate import calibrate, start_workers

    store = PerfModelStore(tmp_path)
    workers = start_workers(plan, MachineSpec(groups="cores=1"))
    try:
        # a shared machine's noise can keep an entry's samples drifting past one run's budget;
        # as a user would, calibrate again (the store merges, so samples accumulate)
        for _ in range(4):
            report = calibrate(plan, [4], workers=workers, store=store, max_runs=200)
            if not report.uncalibrated:
                break
    finally:
        for w in workers:
            w.close()
    assert not report.uncalibrated
    machine = build_machine(plan, MachineSpec(groups="cores=1"), store=store)
    assert len(machine.workers) == len(workers)
    prof = profile_plan(plan, 4)
    arch = machine.workers[0].arch
    means = [store.load(plan.hash, p, arch).entry(prof.footprints[p]).mean for p in range(plan.k)]
    predicted = len(workers) * 4 / sum(means)
    bound = machine_bound(machine, 4)
    assert bound.throughput == pytest.approx(predicted, rel=1e-6)
    m = simulate(machine, 2 * predicted, 4, SimSpec(n_requests=8000, policy="dmda")).metrics()
    assert m["congested"]
    assert m["throughput"] == pytest.approx(predicted, rel=0.05)
    assert math.isfinite(m["paper_latency_mean"]) and np.isfinite(m["latency_p99"])
    assert machine.table.sources == {}  # real models, nothing borrowed


def test_a_sweeps_fidelity_replay_pads_as_the_live_server_did(plan, tmp_path):
    """The sweep replays each measured point in simulation with the live server's padding (the
    runtime's captured sizes): without it a partial batch was priced at its request count while
    the live one ran, and was timed, at the padded size."""
    from staronnx.bench.fidelity import simulate_row
    from staronnx.bench.machine import build_machine

    store = PerfModelStore(tmp_path)
    write_models(store, plan, {(0, "cpu4"): lambda b: b * MS, (1, "cpu4"): lambda b: b * MS}, batches=(1, 4, 8))
    machine = build_machine(plan, MachineSpec(groups="numa"), topology=topo(CPU4), store=store)
    row = {"offered_rate": 100.0, "batch_size": 8, "duration_s": 0.5, "latency_p50_ms": 13.0,
           "throughput": 100.0, "paper_latency_mean_ms": 13.0}
    common = SimSpec(policy="heft", distribution="constant", seed=0, queue_capacity=64, max_delay=5 * MS)
    plain = simulate_row(machine, row, common, warmup=0.1)
    padded = simulate_row(machine, row, replace(common, pad_to=[4, 8]), warmup=0.1)
    # one request per batch (10 ms apart, 5 ms max delay), run as 1 row or, padded, as 4
    assert plain["sim_latency_p50_ms"] == pytest.approx(5 + 2, rel=0.02)
    assert padded["sim_latency_p50_ms"] == pytest.approx(5 + 2 * 4, rel=0.02)
    assert padded["err_latency_p50"] == pytest.approx(padded["sim_latency_p50_ms"] / 13.0 - 1)
