"""Predictions that say when the machine lied, count the host's own work, and schedules a person
can read (issue 40). No timing is asserted: the rules are (a point beside a busy loop is
flagged, a reading says busy or quiet, host costs only add time, a legend stays off the tasks).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
from _helpers import cli

from staronnx.bench import cpuload
from staronnx.bench.bound import machine_bound
from staronnx.bench.machine import NO_HOST_COSTS, build_machine
from staronnx.bench.results import load_results
from staronnx.bench.simulator import simulate
from staronnx.bench.sweep import sweep
from staronnx.perfmodels import HostCosts, HostModel, PerfModelStore
from staronnx.perfmodels.host import COLD_IDLE_S
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.workers.layout import MachineSpec
from staronnx.bench.spec import SimSpec
from staronnx.bench.spec import RunSpec, SweepSpec


# -- readings ------------------------------------------------------------------------------------
def _stat(busy: int, idle: int, steal: int = 0, cpus: int = 2) -> str:
    """A /proc/stat text whose every CPU has these cumulative ticks."""
    lines = [f"cpu  {busy * cpus} 0 0 {idle * cpus} 0 0 0 {steal * cpus} 0 0"]
    lines += [f"cpu{i} {busy} 0 0 {idle} 0 0 0 {steal} 0 0" for i in range(cpus)]
    return "\n".join(lines) + "\nintr 0\n"


class Reading:
    """An injected kernel: each read advances every CPU by ``busy`` and ``steal`` ticks (of 100
    per second) and this process's CPU by ``own`` seconds."""

    def __init__(self, busy: int, idle: int, steal: int = 0, own: float = 0.0) -> None:
        self.step = (busy, idle, steal)
        self.own_step = own
        self.n = 0

    def read(self) -> str:
        self.n += 1
        busy, idle, steal = self.step
        return _stat(busy * self.n, idle * self.n, steal * self.n)

    def own(self) -> float:
        return self.own_step * self.n

    def clock(self) -> float:
        """One second per read: the ticks above are per second."""
        return float(self.n)

    def snap(self) -> cpuload.CpuSnapshot | None:
        return cpuload.snapshot(self.read, self.own, self.clock)


def test_a_reading_says_busy_when_others_or_the_hypervisor_take_the_cpus():
    cpus = (0, 1)
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    quiet = Reading(busy=1, idle=99)  # 1 % of each CPU busy, all of it ours
    quiet.own_step = 2 * tick
    load = cpuload.machine_load(quiet.snap(), quiet.snap(), cpus)
    assert load is not None and not load.busy and load.why is None
    assert load.others_cpu_s == pytest.approx(0.0) and load.own_cpu_s == pytest.approx(2 * tick)

    other = Reading(busy=60, idle=40)  # 60 % busy, none of it ours: another process
    load = cpuload.machine_load(other.snap(), other.snap(), cpus)
    assert load.busy and load.others_cpu_s == pytest.approx(120 * tick) and load.seconds == pytest.approx(1.0)
    assert "other processes used" in load.why and "0,1" in load.why

    stolen = Reading(busy=2, idle=88, steal=10)  # the hypervisor took 10 %
    stolen.own_step = 4 * tick
    load = cpuload.machine_load(stolen.snap(), stolen.snap(), cpus)
    assert load.busy and load.steal_s == pytest.approx(20 * tick) and "hypervisor stole" in load.why
    assert load.as_dict()["busy"] is True
    # a reading over a few ticks says nothing: one tick there is tens of per cent
    brief = Reading(busy=60, idle=40)
    first = brief.snap()
    assert not cpuload.machine_load(first, cpuload.snapshot(brief.read, brief.own, lambda: 1.0 + 0.01), cpus).busy
    # no /proc/stat (not Linux): nothing said, nothing flagged
    assert cpuload.snapshot(lambda: (_ for _ in ()).throw(OSError("no /proc"))) is None
    assert cpuload.machine_load(None, None) is None


# -- sweeps flag points measured beside other work -------------------------------------------------
@pytest.fixture(scope="module")
def plan(calibrated_inception):
    return calibrated_inception[0]


@pytest.fixture(scope="module")
def home(calibrated_inception):
    return calibrated_inception[1]


@contextlib.contextmanager
def busy_loop(cpu: int):
    """Another process spinning on ``cpu`` while the block runs."""
    code = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass\n"
    proc = subprocess.Popen([sys.executable, "-c", code, str(cpu)])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_cli_sweep_flags_a_point_measured_beside_a_busy_loop(plan, home, two_groups, capsys, tmp_path, monkeypatch):
    """Through ``sweep --simulate``: with another process spinning on a worker's core, the point
    is flagged busy in the table, in results.json (with others' share and why) and in the
    notes, and the simulator's error summary leaves it out, saying so."""
    monkeypatch.setenv("STARONNX_HOME", str(home))
    monkeypatch.setenv("COLUMNS", "220")
    out = tmp_path / "busy"
    first = int(two_groups.split(";")[0])
    with busy_loop(first):
        code, stdout, stderr = cli(capsys, "sweep", plan.root, "--rates", "100", "--batch-sizes", "1", "--groups",
                                   two_groups, "--duration", "600ms", "--simulate", "--no-plots", "-o", out)
    assert code == 0, stderr + stdout
    doc = load_results(out)
    (row,) = doc["rows"]
    assert row["machine_busy"] is True
    assert row["others_cpu_share"] > cpuload.BUSY_SHARE and "other processes used" in row["busy_why"]
    assert row["machine"]["cpus"] and row["own_cpu_cores"] > 0
    assert "busy (others" in stdout
    assert any("measured beside other work" in n for n in doc["notes"])
    assert doc["fidelity"]["busy_points"] == 1 and doc["fidelity"]["simulated_points"] == 0
    assert "every point was measured beside other work" in stdout
    assert "machine_busy" in (out / "results.csv").read_text().splitlines()[0]


def test_sweep_flags_what_an_injected_reading_says(plan, home, two_groups, tmp_path, monkeypatch):
    """The flag follows the reading: a kernel that says the hypervisor stole 30 % flags the
    point (on any machine), one that says nothing else ran leaves it unflagged. (The tasks'
    own timing is read, and held at 1.0 for the flag, per window too: on a loaded host a point's
    tasks can run 1.25x the warm-up's, which flags it slowed whatever the kernel says.)"""
    from staronnx.bench import sweep as sweep_module

    real_ratio = sweep_module.task_time_ratio
    measured: list[float | None] = []

    def steady_ratio(before: Any, after: Any) -> float:
        measured.append(real_ratio(before, after))
        return 1.0

    monkeypatch.setattr(sweep_module, "task_time_ratio", steady_ratio)
    monkeypatch.setattr(sweep_module.TaskSampler, "ratio", lambda self, start, end: None)  # per window too
    with Runtime(plan, MachineSpec(groups=two_groups), RuntimeSpec(store=PerfModelStore(home))) as rt:
        stolen = Reading(busy=0, idle=70, steal=30)
        monkeypatch.setattr(cpuload, "_read_proc_stat", stolen.read)
        (row,) = sweep(plan, [100], [1], SweepSpec(RunSpec(duration=0.4), bound=False, extend=False,
                                                   out_dir=tmp_path / "a"), runtime=rt)
        assert row["machine_busy"] is True and row["steal_share"] > 0.2 and "hypervisor stole" in row["busy_why"]
        quiet = Reading(busy=0, idle=100)  # nothing busy at all: our own CPU is all there was
        monkeypatch.setattr(cpuload, "_read_proc_stat", quiet.read)
        (row,) = sweep(plan, [100], [1], SweepSpec(RunSpec(duration=0.4), bound=False, extend=False,
                                                   out_dir=tmp_path / "b"), runtime=rt)
        assert row["machine_busy"] is False and row["busy_why"] is None
        assert row["others_cpu_share"] == pytest.approx(0.0)
        # the engine's own check of its tasks against their perf models, per point
        assert measured and all(r is not None and r > 0 for r in measured), measured
        assert "calibration_check" in load_results(tmp_path / "b")["settings"]


def test_the_sweep_table_names_both_reasons_when_a_point_was_busy_and_slowed():
    """A busy loop beside a worker shows in /proc and slows its tasks: the table says both (on
    a loaded CI host the busy-loop test below reads both)."""
    from staronnx.cli.sweep_cmds import _busy_cell

    both = {"machine_busy": True, "others_cpu_share": 0.3, "steal_share": 0.0, "machine_slowed": 1.5}
    assert _busy_cell(both) == "busy (others 30%), slowed (tasks x1.50)"
    assert _busy_cell({**both, "others_cpu_share": 0.0}) == "slowed (tasks x1.50)"
    assert _busy_cell({**both, "machine_slowed": None}) == "busy (others 30%)"
    assert _busy_cell({**both, "machine_busy": False}) == ""


def test_cli_sweep_flags_a_point_whose_tasks_ran_slower_than_the_points_before(plan, home, two_groups, capsys,
                                                                              tmp_path, monkeypatch):
    """Through ``sweep``: the kernel says nothing else ran (a VM whose host takes the CPUs
    without counting steal), but the third point's tasks ran 1.8x their perf models where the
    points before ran at 1.0x (the engine's own timing of its tasks, here injected): that point
    is flagged busy as slowed, in the table, results.json, the CSV and the notes; the others
    are not. A point at 1.2x is noise, not a slowed machine."""
    from staronnx.bench import sweep as sweep_module

    monkeypatch.setenv("STARONNX_HOME", str(home))
    monkeypatch.setenv("COLUMNS", "220")
    monkeypatch.setattr(cpuload, "_read_proc_stat", Reading(busy=0, idle=100).read)
    ratios = iter([1.0, 1.0, 1.2, 1.8])  # the warm-up's, then one per point
    monkeypatch.setattr(sweep_module, "task_time_ratio", lambda before, after: next(ratios))
    monkeypatch.setattr(sweep_module.TaskSampler, "ratio", lambda self, start, end: None)  # the whole point's only
    out = tmp_path / "slowed"
    code, stdout, stderr = cli(capsys, "sweep", plan.root, "--rates", "20,30,40", "--batch-sizes", "1", "--groups",
                               two_groups, "--duration", "400ms", "--no-plots", "-o", out)
    assert code == 0, stderr + stdout
    doc = load_results(out)
    assert [bool(r["machine_busy"]) for r in doc["rows"]] == [False, False, True]
    slowed = doc["rows"][2]
    # held to the median of the points before it (1.0 and 1.2)
    assert slowed["machine_slowed"] == pytest.approx(1.8 / 1.1) and "ran slower" in slowed["busy_why"]
    assert "slowed (tasks x1.64)" in stdout
    assert any("1 of them because their tasks ran" in n for n in doc["notes"])
    assert "machine_slowed" in (out / "results.csv").read_text().splitlines()[0]


def test_cli_sweep_flags_a_point_whose_tasks_slowed_in_one_window(plan, home, two_groups, capsys, tmp_path,
                                                                  monkeypatch):
    """Through ``sweep``: over the whole point the third point's tasks ran as the points before
    (x1.05), but in its second window x1.6 (the engine's timing per window, here injected): a
    machine that slowed for a while leaves a backlog that sets the latency of the windows after
    it, so the point is flagged slowed, saying it was one window; the others are not. Unpatched,
    every row records one ratio per window, read off the engine's real task totals."""
    from staronnx.bench import sweep as sweep_module

    monkeypatch.setenv("STARONNX_HOME", str(home))
    monkeypatch.setenv("COLUMNS", "220")
    monkeypatch.setattr(cpuload, "_read_proc_stat", Reading(busy=0, idle=100).read)
    args = ("sweep", plan.root, "--rates", "20,30,40", "--batch-sizes", "1", "--groups", two_groups,
            "--duration", "600ms", "--no-plots")
    code, stdout, stderr = cli(capsys, "sweep", plan.root, "--rates", "150", "--batch-sizes", "1", "--groups",
                               two_groups, "--duration", "1500ms", "--no-plots", "-o", tmp_path / "real")
    assert code == 0, stderr + stdout
    (row,) = load_results(tmp_path / "real")["rows"]
    got = row["task_time_ratio_windows"]  # a window's ratio needs 20 tasks: 150 req/s gives ~80 a window
    assert len(got) == len(row["windows"]) >= 1, row
    assert all(x is not None and x > 0 for x in got), got

    ratios = iter([1.0, 1.0, 1.0, 1.05])  # the warm-up's, then one per point
    monkeypatch.setattr(sweep_module, "task_time_ratio", lambda before, after: next(ratios))
    samplers: list[list[Any]] = []  # [sampler, windows read so far], one per point measured

    def ratio(sampler: Any, start: float, end: float) -> float:
        if not samplers or samplers[-1][0] is not sampler:
            samplers.append([sampler, 0])
        samplers[-1][1] += 1
        return 1.6 if len(samplers) == 3 and samplers[-1][1] == 2 else 1.0

    monkeypatch.setattr(sweep_module.TaskSampler, "ratio", ratio)
    out = tmp_path / "window"
    code, stdout, stderr = cli(capsys, *args, "--no-extend", "-o", out)
    assert code == 0, stderr + stdout
    rows = load_results(out)["rows"]
    assert len(rows[2]["windows"]) >= 2, rows[2]["windows"]
    assert [bool(r["machine_busy"]) for r in rows] == [False, False, True]
    assert rows[2]["machine_slowed"] == pytest.approx(1.6)
    assert "in one of its" in rows[2]["busy_why"] and "x1.60" in rows[2]["busy_why"], rows[2]["busy_why"]
    assert "slowed (tasks x1.60)" in stdout


def test_a_congested_point_on_a_busy_machine_stops_the_sweep_only_when_the_next_congests_too(
        plan, home, two_groups, tmp_path, monkeypatch):
    """A stall is not the capacity: a congested point measured busy (here the kernel says the
    hypervisor stole 30 %) lets the sweep go on to the next rate, which stops it when it
    congests too; on a quiet machine the first congested point stops it, as before (its
    tasks slowed by the overload are not a slowed machine: it is offered above its bound)."""
    store = PerfModelStore(home)
    # far above what the plan serves on this machine, whatever its speed: every point congests and
    # is offered above its LP bound (at a fixed 20,000 req/s a fast host's bound was above it)
    bound = machine_bound(build_machine(plan, MachineSpec(groups=two_groups), store=store), 1).throughput
    top = max(20000.0, 2.0 * bound)
    rates = [top, 1.5 * top, 2.0 * top]
    spec = SweepSpec(RunSpec(duration=0.3, queue_capacity=16), extend=False)
    kw = dict(machine=MachineSpec(groups=two_groups), store=store)
    with Runtime(plan, MachineSpec(groups=two_groups), RuntimeSpec(store=store)) as rt:
        monkeypatch.setattr(cpuload, "_read_proc_stat", Reading(busy=0, idle=70, steal=30).read)
        rows = sweep(plan, rates, [1], replace(spec, out_dir=tmp_path / "busy"), runtime=rt, **kw)
        assert [r["offered_rate"] for r in rows] == rates[:2]
        assert all(r["congested"] and r["machine_busy"] for r in rows)
        assert [s["offered_rate"] for s in load_results(tmp_path / "busy")["skipped"]] == rates[2:]
        monkeypatch.setattr(cpuload, "_read_proc_stat", Reading(busy=0, idle=100).read)
        rows = sweep(plan, rates, [1], replace(spec, out_dir=tmp_path / "quiet"), runtime=rt, **kw)
        assert [r["offered_rate"] for r in rows] == rates[:1] and rows[0]["congested"]
        assert rows[0]["offered_rate"] > rows[0]["bound_throughput"] and not rows[0]["machine_busy"]


def test_calibration_warns_when_its_samples_were_taken_on_a_busy_machine(plan, two_groups, capsys, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path / "home"))
    busy = Reading(busy=80, idle=20)
    monkeypatch.setattr(cpuload, "_read_proc_stat", busy.read)
    monkeypatch.setattr(cpuload, "_clock", busy.clock)  # a second a reading, however fast this calibrates
    code, stdout, stderr = cli(capsys, "calibrate", plan.root, "--groups", two_groups, "--batch-sizes", "1",
                               "--no-host", "--max-runs", "30")
    assert code == 0, stderr + stdout
    assert "warning: calibration measured beside other work" in stdout and "--replace" in stdout


def test_the_error_summary_sets_busy_and_knee_points_apart():
    """Hand-made rows: a busy point is out of every figure (counted), a steady point offered
    90 % of its bound is at the knee (counted, and out of the below-the-knee figures)."""
    from staronnx.bench.fidelity import fidelity_summary

    def row(rate: float, err: float, **kw) -> dict:
        return {"offered_rate": rate, "bound_throughput": 100.0, "sim_throughput": rate, "throughput": rate,
                "err_throughput": 0.0, "err_latency_p50": err, "err_paper_latency": err, "congested": False,
                "sim_congested": False, "state": "stable", **kw}

    rows = [row(20, 0.02), row(50, -0.04), row(90, -0.6), row(60, 0.5, machine_busy=True)]
    f = fidelity_summary(rows)
    assert f["busy_points"] == 1 and f["simulated_points"] == 3 and f["knee_points"] == 1
    assert f["paper_latency"]["max_abs"] == pytest.approx(0.6)
    assert f["paper_latency_below_knee"]["points"] == 2 and f["paper_latency_below_knee"]["max_abs"] == pytest.approx(0.04)


# -- the host's own work -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def crnn_calibrated(real_plan, tmp_path_factory, two_groups):
    """crnn_ocr (a real exported model) cut 85/15 and calibrated through ``staronnx calibrate``
    at batch 1 and 2 on two one-PU groups, host costs included: (plan, home, stdout)."""
    plan = real_plan("crnn_ocr", "0.85,0.15")
    home = tmp_path_factory.mktemp("crnn-home")
    env = {**os.environ, "STARONNX_HOME": str(home), "COLUMNS": "200"}
    for max_runs in (40, 200, 200, 200):
        done = subprocess.run([sys.executable, "-m", "staronnx", "calibrate", str(plan.root), "--groups", two_groups,
                               "--batch-sizes", "1,2", "--max-runs", str(max_runs)], capture_output=True, text=True,
                              env=env, timeout=300, check=False)
        assert done.returncode == 0, done.stderr + done.stdout
        # on a loaded host the outlier rule can leave an entry short of its samples within
        # the cap (then there is no model to simulate): calibrate again, the store keeps the rest
        if "not calibrated (" not in done.stdout:
            break
    assert "not calibrated (" not in done.stdout, done.stdout
    return plan, home, done.stdout


def test_calibrate_measures_the_hosts_work_and_the_simulator_adds_it(crnn_calibrated, two_groups):
    plan, home, stdout = crnn_calibrated
    assert "host costs b=1:" in stdout and "host costs b=2:" in stdout and "host costs stored in" in stdout
    store = PerfModelStore(home)
    machine = build_machine(plan, MachineSpec(groups=two_groups), store=store)
    assert machine.host is not None and sorted(machine.host.costs) == [1, 2]
    assert machine.host.workers == [w.name for w in machine.workers]
    for costs in machine.host.costs.values():
        for value in (costs.launch_s, costs.wake_s, costs.gap_s, costs.finish_s, costs.lag_s, costs.cpu_per_batch_s):
            assert value >= 0
        assert costs.task_scale > 0 and costs.finish_on_worker  # CPU workers only: answered on their threads
    assert machine.host.probe_machine is not None and machine.host.calibration_machine is not None
    assert any(n.startswith("host costs (") for n in machine.notes)
    # every cost only adds time: with spread 0 (each task its mean) the same arrivals are
    # answered no sooner, and the bound can only fall
    plain = build_machine(plan, MachineSpec(groups=two_groups), store=store, host=False)
    for b in (1, 2):
        kw = dict(rate=50.0, batch_size=b, spec=SimSpec(duration=1.0, spread=0.0, seed=1))
        with_host = simulate(machine=machine, **kw).metrics()
        without = simulate(machine=plain, **kw).metrics()
        assert with_host["latency_p50"] >= without["latency_p50"]
        assert with_host["paper_latency_mean"] >= without["paper_latency_mean"]
        assert machine_bound(machine, b).throughput <= machine_bound(plain, b).throughput
    assert simulate(machine, 50.0, 1, SimSpec(duration=0.5)).records.settings["host"]["batch"] == 1


def test_host_costs_belong_to_the_workers_they_were_measured_on(crnn_calibrated, two_groups):
    """Other workers (one group instead of two) have no host costs: the notes say what the
    simulation then leaves out, rather than borrowing another layout's."""
    plan, home, _ = crnn_calibrated
    one = two_groups.split(";")[0]
    machine = build_machine(plan, MachineSpec(groups=one), store=PerfModelStore(home))
    assert machine.host is None and NO_HOST_COSTS in machine.notes


def test_host_cpu_is_taken_from_busy_workers_only_where_no_core_is_left(crnn_calibrated, two_groups):
    """A hand-made what-if: a large host CPU per request slows the simulation down (and lowers
    the bound) only when the groups cover every core; with a PU left for the host it is free."""
    import dataclasses

    plan, home, _ = crnn_calibrated
    store = PerfModelStore(home)
    costs = HostCosts(batch=1, launch_s=0.0, wake_s=0.0, gap_s=0.0, finish_s=0.0, lag_s=0.0,
                      cpu_per_batch_s=0.002, cpu_per_request_s=0.002)
    base = build_machine(plan, MachineSpec(groups=two_groups), store=store, host=False)
    model = HostModel([w.name for w in base.workers], 0, {1: costs})
    shared = dataclasses.replace(build_machine(plan, MachineSpec(groups=two_groups), store=store, host=model),
                                 free_pus=0)
    spare = dataclasses.replace(shared, free_pus=1)
    assert shared.host_shares_cores and not spare.host_shares_cores
    assert machine_bound(shared, 1).throughput < machine_bound(spare, 1).throughput
    assert any(b.kind == "host" for b in machine_bound(shared, 1).binding)
    rate = 0.9 * machine_bound(spare, 1).throughput  # the cores alone would keep up
    kw = dict(rate=rate, batch_size=1, spec=SimSpec(duration=1.0, spread=0.0, seed=2))
    assert simulate(machine=shared, **kw).metrics()["throughput"] < simulate(machine=spare, **kw).metrics()["throughput"]


def test_calibrate_measures_the_hosts_costs_at_a_light_and_a_loaded_rate(crnn_calibrated, two_groups):
    """The host probe serves each batch size twice; the stored costs are the loaded ones with the
    light ones beside them, at the rates they were offered (or calibrate says why the loaded
    probe was left out: on a busy machine it can fall behind)."""
    plan, home, stdout = crnn_calibrated
    machine = build_machine(plan, MachineSpec(groups=two_groups), store=PerfModelStore(home))
    assert machine.host is not None
    for b, costs in machine.host.costs.items():
        assert costs.rate > 0
        if costs.lighter is None:
            assert f"host costs: batch {b}: the loaded probe fell behind" in stdout
            continue
        assert 0 < costs.lighter.rate < costs.rate and costs.lighter.batch == b
        assert costs.at_rate(costs.lighter.rate / 2).cpu_per_batch_s == costs.lighter.cpu_per_batch_s
        assert costs.at_rate(costs.rate).cpu_per_batch_s == pytest.approx(costs.cpu_per_batch_s)
        assert f"at {costs.lighter.rate:.4g} req/s" in stdout


def _costs(task_scale: float, cpu: float, rate: float, lighter: HostCosts | None = None) -> HostCosts:
    return HostCosts(batch=1, launch_s=1e-4, wake_s=5e-5, gap_s=2e-5, finish_s=3e-5, lag_s=1e-4,
                     cpu_per_batch_s=cpu, cpu_per_request_s=cpu / 2, task_scale=task_scale, rate=rate, lighter=lighter)


def test_a_loaded_probe_whose_generator_fell_behind_is_left_out():
    """A loaded probe that answered its requests but whose generator ran 40 ms behind its
    schedule (crnn_ocr at 1,400 req/s on a stalled VM) measured a queue, not the host's costs:
    left out, as a probe that fell behind; a lag under the time between two batches is kept."""
    from staronnx.calibrate import _generator_kept_up, _ProbeRun

    run = _ProbeRun(batch=1, records=None, host_cpu_s=0.0, inline=True, rate=1400.0, seconds=1.0, loaded=True)
    assert _generator_kept_up(run, replace(_costs(1.0, 1e-4, rate=1400.0), lag_s=1e-4))
    assert not _generator_kept_up(run, replace(_costs(1.0, 1e-4, rate=1400.0), lag_s=0.04))
    slow = _ProbeRun(batch=4, records=None, host_cpu_s=0.0, inline=True, rate=20.0, seconds=1.0, loaded=True)
    assert _generator_kept_up(slow, replace(_costs(1.0, 1e-4, rate=20.0), lag_s=0.04))  # 200 ms between batches


def test_host_costs_between_two_loads_follow_the_offered_rate():
    """Below the light probe's rate its figures; above it ``a + c / rate`` through both
    measurements, past the loaded rate too (falling on towards ``a``, never below 0); the
    generator's lag stays the loaded one's (it is already in the arrival times); a store
    written before the two loads (no rate, no lighter) reads as one load."""
    light = _costs(2.0, 4e-4, rate=100.0)
    loaded = _costs(1.0, 2e-4, rate=300.0, lighter=light)
    assert loaded.at_rate(50.0).task_scale == 2.0 and loaded.at_rate(50.0).cpu_per_batch_s == 4e-4
    assert loaded.at_rate(300.0).task_scale == pytest.approx(1.0)
    assert loaded.at_rate(300.0).cpu_per_batch_s == pytest.approx(2e-4)
    mid = loaded.at_rate(200.0)  # a = 0.5, c = 150: 0.5 + 150 / 200
    assert mid.task_scale == pytest.approx(1.25) and mid.cpu_per_request_s == pytest.approx(1.25e-4)
    assert mid.rate == 200.0 and mid.lag_s == loaded.lag_s
    beyond = loaded.at_rate(1000.0)
    assert beyond.task_scale == pytest.approx(0.65) and beyond.cpu_per_request_s == pytest.approx(6.5e-5)
    assert beyond.lighter is None
    steep = _costs(1.0, 1e-4, rate=300.0, lighter=_costs(4.0, 4e-4, rate=100.0))  # a < 0: floored at 0
    assert steep.at_rate(1e6).task_scale == 0.0 and steep.at_rate(1e6).cpu_per_batch_s == 0.0
    assert HostCosts.from_dict(json.loads(json.dumps(loaded.as_dict()))) == loaded
    old = {k: v for k, v in light.as_dict().items() if k not in ("rate", "lighter")}
    assert HostCosts.from_dict(old).at_rate(1e6) == HostCosts.from_dict(old)
    with pytest.raises(ValueError, match="task_scale"):
        HostCosts.from_dict({**loaded.as_dict(), "lighter": {**light.as_dict(), "task_scale": "x"}})


def test_a_simulation_takes_the_host_costs_of_its_own_rate(crnn_calibrated, two_groups):
    """Tasks twice as slow at the light rate as at the loaded one: a simulation at the light rate
    answers later than one whose costs never change with the load; at the loaded rate alike;
    the LP bound (the capacity) reads the figures of the rate it finds: above the loaded
    rate's bound, and the bound of those figures taken as fixed."""
    plan, home, _ = crnn_calibrated
    store = PerfModelStore(home)
    base = build_machine(plan, MachineSpec(groups=two_groups), store=store, host=False)
    names = [w.name for w in base.workers]
    two = _costs(1.0, 1e-4, rate=400.0, lighter=_costs(2.0, 1e-4, rate=40.0))
    one = _costs(1.0, 1e-4, rate=400.0)
    varying = build_machine(plan, MachineSpec(groups=two_groups), store=store, host=HostModel(names, 0, {1: two}))
    steady = build_machine(plan, MachineSpec(groups=two_groups), store=store, host=HostModel(names, 0, {1: one}))
    kw = dict(batch_size=1, spec=SimSpec(duration=1.0, spread=0.0, seed=3))
    light_v = simulate(machine=varying, rate=20.0, **kw).metrics()["latency_p50"]
    light_s = simulate(machine=steady, rate=20.0, **kw).metrics()["latency_p50"]
    assert light_v > light_s * 1.3
    loaded_v = simulate(machine=varying, rate=400.0, **kw).metrics()["latency_p50"]
    loaded_s = simulate(machine=steady, rate=400.0, **kw).metrics()["latency_p50"]
    assert loaded_v == pytest.approx(loaded_s, rel=1e-3)
    bound = machine_bound(varying, 1).throughput
    assert bound > machine_bound(steady, 1).throughput * 1.02
    fixed = build_machine(plan, MachineSpec(groups=two_groups), store=store,
                          host=HostModel(names, 0, {1: two.at_rate(bound)}))
    assert machine_bound(fixed, 1).throughput == pytest.approx(bound, rel=2e-3)


def test_calibrate_times_tasks_after_an_idle_worker_apart(crnn_calibrated, two_groups):
    """The probe's tasks are split by their worker's idle time before them: the stored costs
    carry a warm and a cold scale, both loads alike, and calibrate prints both."""
    plan, home, stdout = crnn_calibrated
    machine = build_machine(plan, MachineSpec(groups=two_groups), store=PerfModelStore(home))
    assert machine.host is not None
    for costs in machine.host.costs.values():
        assert costs.cold_task_scale is not None and costs.cold_task_scale > 0 and costs.task_scale > 0
        assert len(costs.part_scales) == len(costs.part_cold_scales) == plan.k
        assert all(x > 0 for x in costs.part_scales + costs.part_cold_scales)
        if costs.lighter is not None:
            assert (costs.lighter.task_scale, costs.lighter.cold_task_scale) == (costs.task_scale, costs.cold_task_scale)
            assert (costs.lighter.part_scales, costs.lighter.part_cold_scales) == (costs.part_scales,
                                                                                   costs.part_cold_scales)
    assert f"after the worker idled {COLD_IDLE_S * 1e3:g} ms" in stdout and "their models per part" in stdout


def _probe_task(part: int, ratio: float, idle: float, start: float = 0.0) -> Any:
    from staronnx.calibrate import _TraceTask

    return _TraceTask(request=0, part=part, worker=part, start=start, end=start + ratio * 1e-3, predicted=1e-3,
                      idle=idle)


def test_task_scales_are_kept_apart_by_part():
    """What a light probe sees: every first part cold at x1.0 its model, every second part warm
    right behind it at x1.25. One warm scale would be the second part's, and a first part
    running warm at the knee would get it; per part, each keeps its own. A part seen warm and
    cold keeps both; one seen only warm runs so cold too (another part's cold effect is no
    guide); one task descheduled for ten times its model does not move its part's scale."""
    from staronnx.calibrate import _task_scales

    light = [_probe_task(0, 1.0, idle=0.05) for _ in range(20)] + [_probe_task(1, 1.25, idle=1e-5) for _ in range(20)]
    scales = _task_scales(light, 2)
    assert scales.part_warm == pytest.approx((1.0, 1.25)) and scales.part_cold == pytest.approx((1.0, 1.25))
    costs = scales.apply(_costs(1.0, 1e-4, rate=100.0))
    assert costs.scale_after(0.0, 0) == pytest.approx(1.0) and costs.scale_after(1.0, 1) == pytest.approx(1.25)
    mixed = ([_probe_task(0, 1.0, idle=1e-5) for _ in range(10)] + [_probe_task(0, 1.2, idle=0.05) for _ in range(10)]
             + [_probe_task(1, 2.0, idle=1e-5) for _ in range(19)] + [_probe_task(1, 20.0, idle=1e-5)])
    scales = _task_scales(mixed, 3)
    assert scales.part_warm[:2] == pytest.approx((1.0, 2.0)) and scales.part_cold[:2] == pytest.approx((1.2, 2.0))
    assert scales.part_warm[2] == pytest.approx(scales.warm) and scales.part_cold[2] == pytest.approx(scales.cold)


def test_a_cold_task_counts_only_where_workers_idle_in_the_normal_course():
    """A run whose batches come 0.5 ms apart sees a task after a 3 ms idle only after a stall
    (x1.7 here); a run whose batches come far apart sees every first part cold, at x1.0: the
    cold scale is the second run's alone."""
    from staronnx.calibrate import _ProbeRun, _scale_tasks, _task_scales

    fast = _ProbeRun(1, None, 0.0, True, 2000.0, 1.0, loaded=False, idles=False)
    slow = _ProbeRun(1, None, 0.0, True, 100.0, 1.0, loaded=False, cold_only=True, idles=True)
    tasks = {id(fast): [[_probe_task(0, 1.0, idle=1e-4)] for _ in range(30)]
             + [[_probe_task(0, 1.7, idle=3e-3)] for _ in range(10)],
             id(slow): [[_probe_task(0, 1.0, idle=9e-3)] for _ in range(10)]}
    scales = _task_scales(_scale_tasks([fast, slow], tasks), 1)
    assert scales.part_cold == pytest.approx((1.0,)) and scales.part_warm == pytest.approx((1.0,))
    stalled = _task_scales([t for ts in tasks[id(fast)] for t in ts], 1)
    assert stalled.part_cold[0] == pytest.approx(1.7)  # what the fast run alone would have said


def test_calibrate_host_probes_a_model_of_short_tasks_slowly_for_its_cold_scale(crnn_calibrated, two_groups,
                                                                               tmp_path):
    """crnn_ocr's light probe offers hundreds of requests/s, too close for a worker to idle:
    the probe runs a slower load first, at the batches' :func:`cold_interval`."""
    import shutil

    from staronnx.calibrate import calibrate_host, cold_interval

    plan, home, _ = crnn_calibrated
    shutil.copytree(home, tmp_path / "home")
    store = PerfModelStore(tmp_path / "home")
    bound = machine_bound(build_machine(plan, MachineSpec(groups=two_groups), store=store, host=False), 1,
                          host_costs=False)
    steps: list[str] = []
    calibrate_host(plan, [1], MachineSpec(groups=two_groups), store=store, on_step=steps.append)
    rates = [float(m.split(" at ")[1].split(" req/s")[0]) for m in steps if m.startswith("host costs: batch 1 at")]
    assert len(rates) == 3 and rates[0] < rates[1] < rates[2], steps
    assert rates[0] == pytest.approx(1 / cold_interval(1, bound.throughput), abs=1.0)


def test_calibrate_warns_when_the_probe_finds_the_machine_at_another_speed(crnn_calibrated, two_groups, tmp_path,
                                                                          capsys, monkeypatch):
    """Through ``calibrate``: the host probe's tasks ran x0.6 their perf models (a VM the host
    sped up between the two; the reading is injected, a machine's speed cannot be set) -> a
    warning naming the ratio and the batch size; at x1.05, none."""
    import shutil

    import staronnx.calibrate as calibrate_module

    plan, home, _ = crnn_calibrated
    shutil.copytree(home, tmp_path / "home")
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("COLUMNS", "300")

    def at(x: float) -> Any:
        return lambda tasks, parts: calibrate_module._Scales(x, x, (x,) * parts, (x,) * parts)

    args = ("calibrate", plan.root, "--groups", two_groups, "--batch-sizes", "1", "--max-runs", "40")
    monkeypatch.setattr(calibrate_module, "_task_scales", at(0.6))
    code, stdout, stderr = cli(capsys, *args)
    assert code == 0, stderr + stdout
    assert "warning:" in stdout and "x0.60 at batch 1 their perf models (faster)" in stdout, stdout
    monkeypatch.setattr(calibrate_module, "_task_scales", at(1.05))
    code, stdout, stderr = cli(capsys, *args)
    assert code == 0 and "their perf models (" not in stdout, stdout


def _scales_only(plan: Any, store: PerfModelStore, groups: str, **scales: Any) -> Any:
    """A simulated machine whose host costs at batch 1 are nothing but these task scales (so a
    latency is its tasks' time)."""
    names = [w.name for w in build_machine(plan, MachineSpec(groups=groups), store=store, host=False).workers]
    costs = HostCosts(batch=1, launch_s=0.0, wake_s=0.0, gap_s=0.0, finish_s=0.0, lag_s=0.0, cpu_per_batch_s=0.0,
                      rate=400.0, **scales)
    return build_machine(plan, MachineSpec(groups=groups), store=store, host=HostModel(names, 0, {1: costs}))


def _part_scaled(plan: Any, store: PerfModelStore, groups: str, scales: tuple[float, float]) -> Any:
    """A simulated machine whose host costs are nothing but these per-part task scales."""
    return _scales_only(plan, store, groups, part_scales=scales, part_cold_scales=scales)


def _part0_share(plan: Any, store: PerfModelStore, groups: str) -> float:
    """The first part's share of a request's modelled task time, read off a simulation that runs
    it twice as slow as its model (its calibrated means, whatever the shares asked for: on a
    loaded host crnn_ocr's second part once calibrated at 94 % of the time)."""
    ratio = simulate(_part_scaled(plan, store, groups, (2.0, 1.0)), 20.0, 1,
                     SimSpec(duration=1.0, spread=0.0, seed=3)).task_time_ratio
    assert ratio is not None
    return ratio - 1.0


def test_a_simulation_and_the_bound_run_each_part_at_its_own_scale(crnn_calibrated, two_groups):
    """One part twice as slow as its model and the other as its model, then the other way round:
    the simulated tasks' time over their models is 1 + the slow part's share of the time each
    way (the two add up to 3; one scale for both would read 1 and 1), three times as slow reads
    twice the excess, and the LP bound falls further when the larger part is the slow one."""
    plan, home, _ = crnn_calibrated
    store = PerfModelStore(home)
    first, second = (_part_scaled(plan, store, two_groups, s) for s in ((2.0, 1.0), (1.0, 2.0)))
    kw = dict(rate=100.0, batch_size=1, spec=SimSpec(duration=1.0, spread=0.0, seed=3))
    ratio_first = simulate(machine=first, **kw).task_time_ratio
    ratio_second = simulate(machine=second, **kw).task_time_ratio
    third = simulate(machine=_part_scaled(plan, store, two_groups, (3.0, 1.0)), **kw).task_time_ratio
    assert ratio_first is not None and ratio_second is not None and third is not None
    assert ratio_first + ratio_second == pytest.approx(3.0, rel=1e-6), (ratio_first, ratio_second)
    share = ratio_first - 1.0
    assert 0.0 < share < 1.0 and third == pytest.approx(1.0 + 2 * share, rel=1e-6)
    if abs(share - 0.5) > 0.05:
        assert (machine_bound(first, 1).throughput < machine_bound(second, 1).throughput) == (share > 0.5)


def test_cold_and_warm_task_scales_by_the_workers_idle_time():
    """Under :data:`COLD_IDLE_S` of idle time a task runs at the warm scale, from it on at the cold
    one; a store written before the cold scale reads it as the warm one."""
    costs = replace(_costs(1.1, 1e-4, rate=100.0), cold_task_scale=1.4)
    assert costs.scale_after(0.0) == costs.scale_after(COLD_IDLE_S / 2) == 1.1
    assert costs.scale_after(COLD_IDLE_S) == costs.scale_after(math.inf) == 1.4
    assert HostCosts.from_dict(json.loads(json.dumps(costs.as_dict()))) == costs
    old = {k: v for k, v in costs.as_dict().items() if k not in ("cold_task_scale", "part_scales", "part_cold_scales")}
    assert HostCosts.from_dict(old).cold_scale == 1.1 and HostCosts.from_dict(old).scale_after(1.0, 0) == 1.1
    per_part = replace(costs, part_scales=(0.9, 1.3), part_cold_scales=(1.0, 1.5))
    assert HostCosts.from_dict(json.loads(json.dumps(per_part.as_dict()))) == per_part
    assert per_part.scale_after(0.0, 1) == 1.3 and per_part.scale_after(1.0, 0) == 1.0
    assert per_part.scale_after(1.0) == 1.4 and per_part.scale_after(0.0, 5) == 1.1  # overall: no such part
    with pytest.raises(ValueError, match="part_scales"):
        HostCosts.from_dict({**per_part.as_dict(), "part_scales": [1.0, "x"]})


def test_a_simulation_runs_tasks_on_idle_workers_at_the_cold_scale(crnn_calibrated, two_groups):
    """Cold tasks twice as slow as warm ones, and no other host cost (so a latency is its tasks'
    time): at a light rate every request's first task finds its worker idle, and the simulation
    answers far later than one without a cold scale; with the requests back to back (all at
    once) the tasks follow each other and little of the difference is left; the LP bound (the
    capacity: workers never idle) reads the warm scale."""
    plan, home, _ = crnn_calibrated
    store = PerfModelStore(home)
    hot = _scales_only(plan, store, two_groups)
    cooling = _scales_only(plan, store, two_groups, cold_task_scale=2.0)
    spec = SimSpec(spread=0.0, seed=3)
    timed = replace(spec, duration=1.0)
    light = (simulate(cooling, 20.0, 1, timed).metrics()["latency_p50"]
             / simulate(hot, 20.0, 1, timed).metrics()["latency_p50"])
    burst = [0.0] * 200  # every request at once: each worker's tasks follow each other
    backlog = (simulate(cooling, 20.0, 1, spec, arrivals=burst).metrics()["latency_p50"]
               / simulate(hot, 20.0, 1, spec, arrivals=burst).metrics()["latency_p50"])
    # light: the first part always cold, the second cold or warm after it on the same worker:
    # about 1 + the first part's share of the time at least (less what the copies add)
    share = _part0_share(plan, store, two_groups)
    assert backlog < 1.1 and light >= 1.0 + 0.8 * share and light > backlog + share / 4, (light, backlog, share)
    assert machine_bound(cooling, 1).throughput == pytest.approx(machine_bound(hot, 1).throughput)


# -- schedules a person can read ------------------------------------------------------------------
def test_trace_plot_of_a_sweep_and_its_simulated_twin(plan, home, two_groups, tmp_path, capsys, monkeypatch):
    """``trace plot`` on a sweep's trace draws its simulated twin row by row; points in numeric
    order (20 before 100), one colour each, live and simulated twins alike; the legend right of
    the plot; every worker's whole name."""
    from staronnx.runtime.gantt import gantt_figure

    monkeypatch.setenv("STARONNX_HOME", str(home))
    trace = tmp_path / "T.json"
    code, stdout, stderr = cli(capsys, "sweep", plan.root, "--rates", "20,100", "--batch-sizes", "1,2", "--groups",
                               two_groups, "--duration", "300ms", "--min-batches", "3", "--simulate", "--no-plots",
                               "--trace", trace, "-o", tmp_path / "res")
    assert code == 0, stderr + stdout
    assert (tmp_path / "T.sim.json").is_file()
    code, stdout, stderr = cli(capsys, "trace", "plot", trace, "-o", tmp_path / "g.png")
    assert code == 0 and (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG", stderr + stdout
    fig, info = gantt_figure(trace, compare=tmp_path / "T.sim.json")
    names = [e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name" and e["tid"] != 100_000]
    assert info.rows[0] == "sweep points"
    for name in names:  # each worker whole, live above its simulated twin
        assert info.rows.index(f"{name} (live)") + 1 == info.rows.index(f"{name} (sim)")
    measured = [p for p in info.points if "(again)" not in p]
    assert measured[:2] == ["b=1 @ 20 req/s", "b=1 @ 100 req/s"] and measured[2].startswith("b=2 @ 20")
    assert len({info.colours[p] for p in info.points}) == len(info.points)  # one colour per point
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent(renderer)
    assert legend.x0 >= ax.get_window_extent(renderer).x1  # beside the tasks, not over them
    assert legend.x1 <= fig.bbox.x1 + 1  # and inside the picture
    for label in ax.get_yticklabels():
        box = label.get_window_extent(renderer)
        assert box.x0 >= 0 and label.get_text() in info.rows  # whole, not cut by the figure's edge
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_trace_plot_keeps_long_worker_names_whole(tmp_path):
    """A hand-written trace with long lane names and no points: colour by part, names whole."""
    from staronnx.runtime.gantt import gantt_figure

    lanes = ["pu:numa0.core1", "cpu:numa0.core0-core7,pkg0", "cuda0.s1"]
    events = []
    for tid, name in enumerate(lanes):
        events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}})
        for k in range(3):
            events.append({"ph": "X", "name": f"part{k % 2}", "cat": "task", "pid": 1, "tid": tid,
                           "ts": 1000.0 * (k + tid), "dur": 800.0, "args": {}})
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    fig, info = gantt_figure(path)
    assert info.rows == lanes and info.parts == ["part0", "part1"] and not info.points
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for label in fig.axes[0].get_yticklabels():
        assert label.get_window_extent(renderer).x0 >= 0
    import matplotlib.pyplot as plt

    plt.close(fig)


# -- the band: how far the machine's own drift moves a prediction ---------------------------------
def test_a_slower_machine_in_simulation_runs_every_task_that_much_longer(crnn_calibrated, two_groups):
    """``slowdown`` multiplies every task's time (the host costs' scales included): the simulated
    tasks' time over their models grows by that factor exactly with each task at its mean, and a
    slowdown that is not a positive number is refused by name."""
    from staronnx.bench.machine import SimulationError

    plan, home, _ = crnn_calibrated
    machine = build_machine(plan, MachineSpec(groups=two_groups), store=PerfModelStore(home))
    spec = SimSpec(duration=1.0, spread=0.0, seed=2)
    nominal = simulate(machine, 50.0, 1, spec)
    slower = simulate(machine, 50.0, 1, replace(spec, slowdown=1.5))
    assert nominal.task_time_ratio is not None and slower.task_time_ratio is not None
    assert slower.task_time_ratio == pytest.approx(1.5 * nominal.task_time_ratio, rel=1e-6)
    assert slower.metrics()["paper_latency_mean"] > nominal.metrics()["paper_latency_mean"]
    assert slower.records.settings["slowdown"] == 1.5
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(SimulationError, match="slowdown"):
            simulate(machine, 50.0, 1, replace(spec, slowdown=bad))


def _band_point(paper: float, *, congested: bool = False) -> dict[str, Any]:
    return {"paper_latency_mean": paper / 1e3, "latency_p50": paper / 1e3, "congested": congested}


def test_band_columns_call_a_point_fragile_where_the_band_tips_it():
    """A steady point the band moves by 5 % is robust and holds a live figure within its ends
    (widened by the target); one whose slow end is 30 % later, or congests, is fragile; a live
    congested point lies in a band whose slow end congests, not in one that never does."""
    from staronnx.bench.fidelity import band_columns

    nominal = {"sim_paper_latency_mean_ms": 10.0, "sim_latency_p50_ms": 10.0, "sim_congested": False}
    calm = band_columns(_band_point(9.5), _band_point(10.5), nominal, {"paper_latency_mean_ms": 10.8}, 0.05)
    assert calm["sim_fragile"] is False and calm["in_band"] is True and calm["sim_band"] == 0.05
    assert calm["sim_paper_latency_fast_ms"] == pytest.approx(9.5) and calm["sim_latency_p50_slow_ms"] == pytest.approx(10.5)
    far = band_columns(_band_point(9.5), _band_point(10.5), nominal, {"paper_latency_mean_ms": 30.0}, 0.05)
    assert far["in_band"] is False
    steep = band_columns(_band_point(9.0), _band_point(13.0), nominal, {"paper_latency_mean_ms": 14.5}, 0.05)
    assert steep["sim_fragile"] is True and steep["in_band"] is True
    tipped = band_columns(_band_point(9.0), _band_point(900.0, congested=True), nominal,
                          {"paper_latency_mean_ms": 400.0}, 0.05)
    assert tipped["sim_fragile"] is True and tipped["sim_congested_slow"] is True
    assert tipped["in_band"] is True  # a slow end that congests has no upper end
    live_congested = {"paper_latency_mean_ms": 800.0, "congested": True}
    assert band_columns(_band_point(9.0), _band_point(900.0, congested=True), nominal, live_congested,
                        0.05)["in_band"] is True
    assert band_columns(_band_point(9.5), _band_point(10.5), nominal, live_congested, 0.05)["in_band"] is False


def test_the_error_summary_gives_the_errors_without_the_fragile_points():
    """Hand-made rows: the fragile steady point is counted and out of the robust figures, a
    fragile point whose congestion the simulation missed is out of the robust congestion figure;
    the share of points within the band counts every judged point."""
    from staronnx.bench.fidelity import fidelity_summary

    def row(err: float, fragile: bool, in_band: bool) -> dict:
        return {"offered_rate": 10.0, "sim_throughput": 10.0, "throughput": 10.0, "err_throughput": 0.0,
                "err_latency_p50": err, "err_paper_latency": err, "congested": False, "sim_congested": False,
                "state": "stable", "sim_band": 0.05, "sim_fragile": fragile, "in_band": in_band}

    tipped = {**row(0.0, True, True), "congested": True}  # live congested, the nominal simulation not
    f = fidelity_summary([row(0.02, False, True), row(-0.04, False, True), row(0.7, True, False), tipped])
    assert f["band"] == 0.05 and f["fragile_points"] == 1  # steady ones: the tipped point is not steady
    assert f["paper_latency"]["max_abs"] == pytest.approx(0.7)
    assert f["paper_latency_robust"]["points"] == 2 and f["paper_latency_robust"]["max_abs"] == pytest.approx(0.04)
    assert f["in_band"] == pytest.approx(3 / 4) and f["in_band_points"] == 4
    assert f["congestion_agreement"] == pytest.approx(3 / 4)
    assert f["congestion_agreement_robust"] == 1.0 and f["robust_points"] == 2
    assert "band" not in fidelity_summary([{k: v for k, v in r.items() if k not in ("sim_fragile", "in_band")}
                                           for r in [row(0.02, False, True)]])
    # every point busy (a loaded host): the band is still said, with nothing judged by it
    busy = fidelity_summary([{**row(0.02, False, True), "machine_busy": True}])
    assert busy["band"] == 0.05 and busy["fragile_points"] == 0 and busy["in_band"] is None


def test_cli_sweep_simulates_each_point_in_a_band(crnn_calibrated, two_groups, capsys, tmp_path, monkeypatch):
    """Through ``sweep --simulate --sim-band 10`` on crnn_ocr (a real exported model): every point
    has its band in results.csv and results.json (its slow end no sooner than its fast end), the
    point offered the LP bound congests at its slow end and shows "cong." in the table, the light
    point does not, and the summary line names the band; ``--sim-band`` without ``--simulate``
    and a band of 100 % are refused with the option's name."""
    plan, home, _ = crnn_calibrated
    monkeypatch.setenv("STARONNX_HOME", str(home))
    monkeypatch.setenv("COLUMNS", "240")
    machine = build_machine(plan, MachineSpec(groups=two_groups), store=PerfModelStore(home))
    bound = machine_bound(machine, 1).throughput
    light, full = round(0.1 * bound), round(bound)
    out = tmp_path / "band"
    code, stdout, stderr = cli(capsys, "sweep", plan.root, "--rates", f"{light},{full}", "--batch-sizes", "1",
                               "--groups", two_groups, "--duration", "500ms", "--simulate", "--sim-band", "10",
                               "--no-plots", "-o", out)
    assert code == 0, stderr + stdout
    doc = load_results(out)
    assert doc["settings"]["sim_band"] == pytest.approx(0.1)
    rows = {round(r["offered_rate"]): r for r in doc["rows"]}
    assert sorted(rows) == sorted({light, full})
    for r in rows.values():
        assert r["sim_band"] == pytest.approx(0.1) and isinstance(r["sim_fragile"], bool)
        assert r["sim_latency_p50_slow_ms"] >= r["sim_latency_p50_fast_ms"]
    assert rows[full]["sim_congested_slow"] is True and rows[light]["sim_congested_slow"] is False
    header = (out / "results.csv").read_text().splitlines()[0]
    assert "sim_fragile" in header and "in_band" in header
    assert "sim band" in stdout and "cong." in stdout and "band (tasks 10% faster and slower)" in stdout
    assert "band" in doc["fidelity"] and "fragile_points" in doc["fidelity"]
    code, stdout, stderr = cli(capsys, "sweep", plan.root, "--rates", str(light), "--sim-band", "5", "-o",
                               tmp_path / "no")
    assert code != 0 and "--sim-band" in stdout + stderr and "--simulate" in stdout + stderr
    code, stdout, stderr = cli(capsys, "sweep", plan.root, "--rates", str(light), "--simulate", "--sim-band", "100",
                               "-o", tmp_path / "no")
    assert code != 0 and "--sim-band" in stdout + stderr


def test_a_sweep_without_a_band_simulates_each_point_once(crnn_calibrated, two_groups, tmp_path):
    """``sweep(simulate=True, sim_band=0)``: the nominal prediction alone, no band columns; a
    band outside [0, 1) is refused before anything runs."""
    from staronnx.bench.results import SweepError

    plan, home, _ = crnn_calibrated
    store = PerfModelStore(home)
    rows = sweep(plan, [20.0], [1],
                 SweepSpec(RunSpec(duration=0.3, min_batches=3), simulate=True, sim_band=0.0, out_dir=tmp_path / "nob"),
                 machine=MachineSpec(groups=two_groups), store=store)
    (row,) = rows
    assert "sim_throughput" in row and "sim_fragile" not in row and "in_band" not in row
    assert "band" not in load_results(tmp_path / "nob")["fidelity"]
    with pytest.raises(SweepError, match="sim_band"):
        sweep(plan, [20.0], [1], SweepSpec(RunSpec(duration=0.3), simulate=True, sim_band=1.0),
              machine=MachineSpec(groups=two_groups), store=store)


def test_cli_simulate_says_how_far_a_drift_moves_its_answer(crnn_calibrated, two_groups, capsys, monkeypatch):
    """Through ``staronnx simulate --band 10`` on crnn_ocr: a light rate is robust to a 10 % drift,
    the LP bound's rate is fragile (one end of the band congests, the other does not), ``--band
    0`` prints no band and ``--band 100`` is refused by name."""
    plan, home, _ = crnn_calibrated
    monkeypatch.setenv("STARONNX_HOME", str(home))
    monkeypatch.setenv("COLUMNS", "240")
    bound = machine_bound(build_machine(plan, MachineSpec(groups=two_groups), store=PerfModelStore(home)), 1).throughput
    common = ("simulate", plan.root, "--batch", "1", "--groups", two_groups, "--duration", "2s")
    code, stdout, stderr = cli(capsys, *common, "--rate", f"{0.1 * bound:.1f}", "--band", "10")
    assert code == 0, stderr + stdout
    assert "with every task 10% faster .. slower: papers' latency" in stdout and "robust" in stdout, stdout
    code, stdout, stderr = cli(capsys, *common, "--rate", f"{bound:.1f}", "--band", "10")
    assert code == 0, stderr + stdout
    assert "fragile: 10% " in stdout and "congested" in stdout, stdout
    code, stdout, stderr = cli(capsys, *common, "--rate", f"{0.1 * bound:.1f}", "--band", "0")
    assert code == 0 and "faster .. slower" not in stdout, stderr + stdout
    code, stdout, stderr = cli(capsys, *common, "--rate", f"{0.1 * bound:.1f}", "--band", "100")
    assert code != 0 and "--band" in stdout + stderr
