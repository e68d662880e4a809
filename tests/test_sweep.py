"""Sweeps and plots: rows and files of a short live sweep on a tiny zoo plan, congestion
stopping a batch size, progress events, the papers' figures and comparisons, the CLI.

Points last half a second: these tests check what is written and when, never timing ratios."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from staronnx.bench.fidelity import COLUMNS as SIM_COLUMNS
from staronnx.bench.fidelity import COMPARED, fidelity_summary, relative_error
from staronnx.bench.plots import (
    PlotError,
    compare,
    figure_best_batch,
    figure_compare,
    figure_cpu_share,
    figure_latency_throughput,
    plot_results,
)
from staronnx.bench.results import (
    COLUMNS,
    SweepError,
    best_per_rate,
    load_results,
    load_rows,
    rows_csv,
    write_results,
)
from staronnx.bench.sweep import sweep
from staronnx.cli.sweep_cmds import parse_batch_sizes, parse_rates
from staronnx.durations import parse_duration
from staronnx.errors import StaronnxError
from staronnx.perfmodels import PerfModelStore
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.bench.spec import RunSpec, SweepSpec
from staronnx.workers.layout import MachineSpec

PNG = b"\x89PNG\r\n\x1a\n"


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan(calibrated_inception):
    return calibrated_inception[0]


@pytest.fixture(scope="module")
def home(calibrated_inception):
    return calibrated_inception[1]


@pytest.fixture(scope="module")
def runtime(plan, home, two_groups):
    with Runtime(plan, MachineSpec(groups=two_groups), RuntimeSpec(policy="heft", store=PerfModelStore(home))) as rt:
        yield rt


# -- parsing -----------------------------------------------------------------------------------
def test_parse_rates_batch_sizes_and_durations():
    assert parse_rates("50:200:50") == [50, 100, 150, 200]
    assert parse_rates("300,100, 200") == [100, 200, 300]
    assert parse_rates("10:30:10,25") == [10, 20, 25, 30]
    assert parse_rates("0.5:1.5:0.5") == [0.5, 1.0, 1.5]
    for bad in ("", "a", "100:50:10", "10:20:0", "0", "-5", "1:2:3:4"):
        with pytest.raises(StaronnxError, match="--rates"):
            parse_rates(bad)
    assert parse_batch_sizes("8,1,2,2") == [1, 2, 8]
    for bad in ("", "0", "x", "1,-2"):
        with pytest.raises(StaronnxError, match="--batch-sizes"):
            parse_batch_sizes(bad)
    assert parse_duration("10s") == 10.0
    assert parse_duration("500ms") == pytest.approx(0.5)
    assert parse_duration("2m") == 120.0
    assert parse_duration("1.5") == 1.5
    assert parse_duration(3) == 3.0
    for bad in ("", "10x", "-1s", "0"):
        with pytest.raises(StaronnxError):
            parse_duration(bad)
    assert parse_duration("0", allow_zero=True) == 0.0 and parse_duration("0ms", allow_zero=True) == 0.0
    with pytest.raises(StaronnxError, match="--warmup: "):
        parse_duration("-1s", allow_zero=True, option="--warmup")


# -- the sweep ---------------------------------------------------------------------------------
def test_sweep_writes_one_row_per_point_with_every_column(plan, home, runtime, tmp_path, two_groups):
    events = []
    out = tmp_path / "res"
    rows = sweep(plan, [150, 100], [2, 1], SweepSpec(RunSpec(duration=0.5), out_dir=out, extend=False),
                 machine=MachineSpec(groups=two_groups), runtime=runtime, store=PerfModelStore(home),
                 progress=events.append)
    assert [(r["batch_size"], r["offered_rate"]) for r in rows] == [(1, 100), (1, 150), (2, 100), (2, 150)]
    for r in rows:
        assert set(COLUMNS) <= set(r)
        assert not r["congested"] and r["rejected"] == 0
        assert r["throughput"] > 0 and r["paper_latency_mean_ms"] > 0 and r["latency_p999_ms"] >= r["latency_p50_ms"]
        assert r["cpu_share"] == 1.0  # CPU workers only
        # every part ran somewhere, all on cpu1 workers (two one-PU groups)
        assert r["share_part0_cpu1"] == 1.0 and r["share_part1_cpu1"] == 1.0
        assert r["bound_throughput"] > 0 and r["achieved_over_bound"] == pytest.approx(
            r["throughput"] / r["bound_throughput"])
        assert len(r["windows"]) == 3 and r["loadgen"]["submitted"] > 0
        assert r["policy"] == "heft" and r["groups"] == two_groups and r["distribution"] == "constant"
    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4
    assert list(table[0])[: len(COLUMNS)] == list(COLUMNS)
    assert {"share_part0_cpu1", "share_part1_cpu1"} <= set(table[0])
    assert table[0]["congested"] == "False" and float(table[0]["offered_rate"]) == 100
    doc = load_results(out)
    assert doc["format"] == "staronnx-sweep" and len(doc["rows"]) == 4 and doc["skipped"] == []
    assert set(doc["bounds"]) == {"1", "2"} and doc["settings"]["batch_sizes"] == [1, 2]
    json.dumps(doc, allow_nan=False)  # strict JSON: no NaN
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temp files

    kinds = [e.kind for e in events]
    assert kinds[0] == "start" and events[0].total == 4 and kinds[-1] == "end"
    assert kinds.count("warmup") == 2 and kinds.count("point") == 4 and kinds.count("done") == 4
    assert "requests" in kinds
    done = [e for e in events if e.kind == "done"]
    assert [e.index for e in done] == [1, 2, 3, 4] and done[-1].row is rows[-1]
    last = [e for e in events if e.kind == "requests"][-1]
    assert last.submitted == last.requests


def _no_proc_stat() -> str:
    raise OSError("no /proc/stat here")


def test_congestion_stops_the_batch_size(plan, runtime, tmp_path, two_groups, monkeypatch):
    """The first congested point stops its batch size. The machine's load is not read here: on
    a host busy with other work its congested point would be flagged busy, and a busy point
    lets the sweep try the next rate (tests/test_predictions.py checks that rule)."""
    from staronnx.bench import cpuload

    monkeypatch.setattr(cpuload, "_read_proc_stat", _no_proc_stat)
    events = []
    # the first rate low enough to stay uncongested on a host busy with other work
    rows = sweep(plan, [20, 20_000, 40_000], [1],
                 SweepSpec(RunSpec(duration=0.5, queue_capacity=32), out_dir=tmp_path, bound=False, extend=False),
                 machine=MachineSpec(groups=two_groups), runtime=runtime, progress=events.append)
    assert [r["offered_rate"] for r in rows] == [20, 20_000]  # 40k never measured
    assert not rows[0]["congested"]
    assert rows[1]["congested"] and rows[1]["rejected"] > 0
    doc = load_results(tmp_path)
    assert [(s["batch_size"], s["offered_rate"]) for s in doc["skipped"]] == [(1, 40_000)]
    assert "congested at 20000" in doc["skipped"][0]["reason"]
    skipped = [e for e in events if e.kind == "skipped"]
    assert len(skipped) == 1 and skipped[0].skipped == [40_000] and skipped[0].index == 3
    assert len(load_rows(tmp_path)) == 2


def test_unstable_point_is_measured_again_longer(plan, runtime, tmp_path, monkeypatch):
    import staronnx.bench.sweep as sw

    real = sw.measure_point
    calls = []

    def flaky(runtime, batch_size, rate, samples, run, **kwargs):
        summary, records = real(runtime, batch_size, rate, samples, run, **kwargs)
        calls.append(run.duration)
        if len(calls) == 1:
            summary["stable"] = False  # as if the three windows disagreed
            summary["state"] = "unstable"
        else:  # the longer one held (whatever this machine measured)
            summary["stable"], summary["state"] = True, "stable"
        return summary, records

    monkeypatch.setattr(sw, "measure_point", flaky)
    rows = sweep(plan, [200], [1], SweepSpec(RunSpec(duration=0.4), bound=False, out_dir=tmp_path), runtime=runtime)
    assert calls == [pytest.approx(0.4), pytest.approx(0.8)]
    assert rows[0]["extended"] and rows[0]["attempts"] == 2 and rows[0]["duration_s"] == pytest.approx(0.8)


def test_sweep_checks_its_arguments(plan, runtime):
    with pytest.raises(SweepError, match="distribution"):
        sweep(plan, [10], [1], SweepSpec(RunSpec(distribution="uniform")), runtime=runtime)
    with pytest.raises(SweepError, match="rates"):
        sweep(plan, [-1], [1], runtime=runtime)
    with pytest.raises(SweepError, match="warmup"):
        sweep(plan, [10], [1], SweepSpec(RunSpec(duration=1.0, warmup=2.0)), runtime=runtime)
    with pytest.raises(SweepError, match="duration must be > 0 seconds"):  # seconds, not text: parsed at the edge
        sweep(plan, [10], [1], SweepSpec(RunSpec(duration="10s")), runtime=runtime)


# -- plots -------------------------------------------------------------------------------------
def _row(b: int, rate: float, latency: float, *, congested: bool = False, share: float | None = 0.2) -> dict:
    return {"batch_size": b, "offered_rate": rate, "throughput": rate * (0.6 if congested else 1.0),
            "paper_latency_mean_ms": latency, "paper_latency_std_ms": latency / 10, "latency_p99_ms": latency * 1.5,
            "cpu_share": share, "congested": congested, "stable": not congested, "policy": "heft", "groups": "numa"}


def _rows() -> list[dict]:
    # b=1 wins at low rates, b=4 at high ones; b=1 congests at 300
    return [
        _row(1, 100, 2.0), _row(1, 200, 3.0), _row(1, 300, 90.0, congested=True),
        _row(4, 100, 30.0), _row(4, 200, 15.0), _row(4, 300, 12.0), _row(4, 400, 14.0, share=0.4),
    ]


def test_figures_have_one_series_per_batch_size():
    fig, series = figure_latency_throughput(_rows())
    assert series == ["b = 1", "b = 4"]
    assert fig.axes[0].get_yscale() == "log"
    fig, series = figure_cpu_share(_rows())
    assert series == ["b = 1", "b = 4"] and len(fig.axes[0].lines) == 2
    fig, series = figure_best_batch(_rows())
    assert len(series) == 2
    best = best_per_rate(_rows())
    assert {r: v["batch_size"] for r, v in best.items()} == {100: 1, 200: 1, 300: 4, 400: 4}
    with pytest.raises(PlotError):
        figure_latency_throughput([])
    with pytest.raises(PlotError, match="CPU share"):
        figure_cpu_share([_row(1, 100, 2.0, share=None)])


def test_plot_results_and_compare_write_pngs(tmp_path):
    a, b = tmp_path / "split85", tmp_path / "split75"
    write_results(a, _rows(), settings={"label": "85/15"})
    write_results(b, [dict(r, paper_latency_mean_ms=r["paper_latency_mean_ms"] * 1.2) for r in _rows()[:4]])
    pngs = plot_results(a)
    assert sorted(p.name for p in pngs) == ["best_batch.png", "cpu_share.png", "latency_throughput.png"]
    for p in pngs:
        assert p.read_bytes()[:8] == PNG
    out = compare([a, b], None, tmp_path / "cmp" / "compare.png")
    assert out.read_bytes()[:8] == PNG
    fig, series = figure_compare([load_rows(a), load_rows(b)], ["85/15", "split75"])
    assert series == ["85/15", "split75"]
    assert [ln.get_label() for ln in fig.axes[0].lines] == ["85/15", "split75"]
    with pytest.raises(PlotError, match="labels"):
        figure_compare([load_rows(a)], ["x", "y"])
    # a folder without results is a clear error
    with pytest.raises(SweepError, match="no sweep results"):
        compare([tmp_path / "nothing"], None, tmp_path / "x.png")


def test_simulated_sweep_records_prediction_and_error_beside_each_point(plan, home, runtime, tmp_path, two_groups):
    out = tmp_path / "sim"
    rows = sweep(plan, [60, 120], [1, 2], SweepSpec(RunSpec(duration=0.6), out_dir=out, extend=False, simulate=True),
                 machine=MachineSpec(groups=two_groups), runtime=runtime, store=PerfModelStore(home))
    assert len(rows) == 4
    for r in rows:
        assert set(SIM_COLUMNS) <= set(r)
        # far below this tiny plan's capacity: the simulation serves what is offered, like the live run
        assert not r["sim_congested"]
        assert r["sim_throughput"] == pytest.approx(r["offered_rate"], rel=0.25)
        assert r["err_throughput"] == pytest.approx(r["sim_throughput"] / r["throughput"] - 1)
        assert r["err_latency_p50"] == pytest.approx(r["sim_latency_p50_ms"] / r["latency_p50_ms"] - 1)
        assert r["sim_latency_p50_ms"] > 0
        if r["batch_size"] == 2:  # the first request of a batch waits for the second: 1/rate at least
            assert r["sim_paper_latency_mean_ms"] >= 1e3 / r["offered_rate"]
    doc = load_results(out)
    fid = doc["fidelity"]
    # points measured beside other work (this host is shared) are counted apart, out of the errors
    quiet = sum(1 for r in rows if not r["machine_busy"])
    assert fid["simulated_points"] == quiet == fid["throughput"]["points"] and fid["busy_points"] == 4 - quiet
    assert fid["latency_p50"]["points"] == fid["steady_points"]
    with open(out / "results.csv") as f:
        header = next(csv.reader(f))
    assert header[len(COLUMNS): len(COLUMNS) + len(SIM_COLUMNS)] == list(SIM_COLUMNS)
    pngs = plot_results(out)
    assert "simulator.png" in {p.name for p in pngs}


def test_sweep_with_max_delay_sends_partial_batches(plan, home, runtime, tmp_path, two_groups):
    # 20 req/s in batches of up to 8 with a 10 ms delay: a batch would take 400 ms to fill, so
    # every batch leaves partial and the papers' latency stays near the delay plus one run
    spec = SweepSpec(RunSpec(duration=1.0, max_delay=0.010), out_dir=tmp_path / "md", extend=False, simulate=True)
    rows = sweep(plan, [20], [8], spec, machine=MachineSpec(groups=two_groups), runtime=runtime,
                 store=PerfModelStore(home))
    (r,) = rows
    assert r["max_delay_ms"] == pytest.approx(10.0)
    assert not r["congested"] and r["batches"] >= 10
    assert r["paper_latency_mean_ms"] < 200  # far below the 350 ms a full batch of 8 waits
    assert r["sim_paper_latency_mean_ms"] < 200
    assert load_results(tmp_path / "md")["settings"]["max_delay_s"] == pytest.approx(0.010)
    with pytest.raises(SweepError, match="max_delay"):
        sweep(plan, [20], [8], SweepSpec(RunSpec(duration=0.5, max_delay=-1.0)), runtime=runtime)


def test_traced_sweep_shows_tasks_batches_queue_and_points(plan, home, tmp_path, two_groups):
    trace = tmp_path / "sweep.json"
    rows = sweep(plan, [80, 160], [2], SweepSpec(RunSpec(duration=0.5), extend=False, trace=trace, bound=False),
                 machine=MachineSpec(groups=two_groups), store=PerfModelStore(home))
    events = json.loads(trace.read_text())["traceEvents"]
    tasks = [e for e in events if e.get("cat") == "task"]
    batches = [e for e in events if e.get("cat") == "batch" and e["ph"] == "b"]
    fills = [e for e in events if e.get("cat") == "batch fill" and e["ph"] == "b"]
    points = [e for e in events if e.get("cat") == "sweep point"]
    counters = [e for e in events if e["ph"] == "C"]
    assert [p["name"] for p in points] == ["b=2 @ 80 req/s", "b=2 @ 160 req/s"]
    done = sum(r["batches"] for r in rows)
    assert len(batches) >= done and len(fills) == len(batches)
    assert len(tasks) >= plan.k * len(batches)  # warm-up batches run too
    assert counters and all("server queue (requests)" in c["args"] for c in counters)
    ends = [e["id"] for e in events if e.get("cat") == "batch" and e["ph"] == "e"]
    assert sorted(b["id"] for b in batches) == sorted(ends) and len(set(ends)) == len(ends)  # unique across points
    for p in points:  # one span per measured point, with its length
        assert p["dur"] > 0


def test_a_traced_simulated_sweep_draws_each_simulated_point_where_its_live_point_ran(plan, home, tmp_path,
                                                                                     two_groups):
    """``sweep(trace=..., simulate=True)`` (``sweep --trace T --simulate``): beside the live trace,
    ``T.sim.json`` holds the simulated schedules on the live trace's clock and worker lanes, each
    point's simulated tasks inside its live point's span, so the two open side by side."""
    from staronnx.bench.sweep import simulated_trace_path

    trace = tmp_path / "sweep.json"
    sweep(plan, [80, 160], [2],
          SweepSpec(RunSpec(duration=0.5), extend=False, trace=trace, bound=False, simulate=True,
                    out_dir=tmp_path / "out"), machine=MachineSpec(groups=two_groups), store=PerfModelStore(home))
    sim_path = simulated_trace_path(trace)
    assert sim_path == tmp_path / "sweep.sim.json"
    assert load_results(tmp_path / "out")["settings"]["simulated_trace"] == str(sim_path)
    live = json.loads(trace.read_text())["traceEvents"]
    sim = json.loads(sim_path.read_text())["traceEvents"]

    def lanes(events: list) -> dict:
        return {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}

    assert {t: n for t, n in lanes(sim).items() if t < 100_000} == {t: n for t, n in lanes(live).items() if t < 100_000}
    live_points = [e for e in live if e.get("cat") == "sweep point"]
    sim_points = [e for e in sim if e.get("cat") == "sweep point"]
    assert [e["name"] for e in sim_points] == [f"{e['name']} (simulated)" for e in live_points]
    tasks = [e for e in sim if e.get("cat") == "task"]
    assert tasks and all(e["args"]["simulated"] for e in tasks)
    for lp, sp in zip(live_points, sim_points):
        # the simulated arrivals start where the live ones did, inside the live point's span
        assert lp["ts"] <= sp["ts"] <= lp["ts"] + lp["dur"]
        inside = [e for e in tasks if sp["ts"] <= e["ts"] <= sp["ts"] + sp["dur"] + 1e6]
        assert inside, sp


def test_sweep_without_perf_models_notes_that_it_cannot_simulate(plan, runtime, tmp_path, two_groups):
    out = tmp_path / "nosim"
    rows = sweep(plan, [80], [1],
                 SweepSpec(RunSpec(duration=0.4), out_dir=out, extend=False, simulate=True, bound=False),
                 machine=MachineSpec(groups=two_groups), runtime=runtime, store=PerfModelStore(tmp_path / "empty"))
    assert "sim_throughput" not in rows[0]
    assert any("no simulation" in n or "not simulated" in n for n in load_results(out)["notes"])


def test_fidelity_summary_counts_latency_only_where_both_sides_are_steady():
    rows = [
        {"throughput": 100.0, "sim_throughput": 110.0, "latency_p50_ms": 10.0, "sim_latency_p50_ms": 9.0,
         "paper_latency_mean_ms": 20.0, "sim_paper_latency_mean_ms": 20.0, "congested": False, "sim_congested": False},
        {"throughput": 100.0, "sim_throughput": 80.0, "latency_p50_ms": 10.0, "sim_latency_p50_ms": 13.0,
         "paper_latency_mean_ms": 20.0, "sim_paper_latency_mean_ms": 30.0, "congested": False, "sim_congested": False},
        {"throughput": 50.0, "sim_throughput": 55.0, "latency_p50_ms": 900.0, "sim_latency_p50_ms": 100.0,
         "paper_latency_mean_ms": 900.0, "sim_paper_latency_mean_ms": 100.0, "congested": True, "sim_congested": False},
        {"throughput": 50.0, "latency_p50_ms": 5.0},  # not simulated
    ]
    for r in rows[:3]:
        for sim_key, live_key, err_key in COMPARED:
            r[err_key] = relative_error(r[sim_key], r[live_key])
    f = fidelity_summary(rows)
    assert f["simulated_points"] == 3 and f["steady_points"] == 2
    assert f["throughput"]["points"] == 3
    assert f["throughput"]["median_abs"] == pytest.approx(0.1) and f["throughput"]["max_abs"] == pytest.approx(0.2)
    assert f["throughput"]["within_target"] == pytest.approx(2 / 3)
    assert f["latency_p50"]["points"] == 2 and f["latency_p50"]["max_abs"] == pytest.approx(0.3)
    assert f["latency_p50"]["within_target"] == pytest.approx(0.5)
    assert f["congestion_agreement"] == pytest.approx(2 / 3)
    assert relative_error(1.0, 0.0) is None and relative_error(None, 1.0) is None
    assert relative_error(float("nan"), 1.0) is None


def test_csv_leaves_missing_values_empty():
    text = rows_csv([{"batch_size": 1, "offered_rate": 10.0, "throughput": None, "share_part1_cpu1": 1.0,
                      "share_part0_cpu1": 0.5}])
    header, line = text.splitlines()
    cols = header.split(",")
    assert cols[: len(COLUMNS)] == list(COLUMNS) and cols[len(COLUMNS):] == ["share_part0_cpu1", "share_part1_cpu1"]
    values = dict(zip(cols, line.split(","), strict=True))
    assert values["throughput"] == "" and values["offered_rate"] == "10" and values["share_part0_cpu1"] == "0.5"


# -- CLI ---------------------------------------------------------------------------------------
def _cli(*args: str, home: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "STARONNX_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "staronnx", *args], check=False, capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_cli_help(tmp_path):
    for cmd in ("sweep", "optimize-batch", "sweep-plot"):
        out = _cli(cmd, "--help", home=tmp_path)
        assert out.returncode == 0, out.stderr
        assert "Usage" in out.stdout
    assert "--batch-sizes" in _cli("sweep", "--help", home=tmp_path).stdout
    assert "--slo-ms" in _cli("optimize-batch", "--help", home=tmp_path).stdout


def test_cli_sweep_end_to_end(plan, home, tmp_path, two_groups):
    out = tmp_path / "res"
    done = _cli("sweep", str(plan.root), "--rates", "100,200", "--batch-sizes", "1,2", "--groups", two_groups,
                "--duration", "400ms", "-o", str(out), home=home)
    assert done.returncode == 0, done.stderr + done.stdout
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    for name in ("latency_throughput.png", "best_batch.png", "cpu_share.png"):
        assert (out / name).read_bytes()[:8] == PNG
    assert "papers' latency" in done.stdout
    assert "simulator vs measurement" not in done.stdout
    # a second folder overlaid with the first through --compare and through sweep-plot
    again = _cli("sweep", str(plan.root), "--rates", "100", "--batch-sizes", "2", "--groups", two_groups,
                 "--duration", "300ms", "-o", str(tmp_path / "res2"), "--compare", str(out), "--labels", "new,old",
                 home=home)
    assert again.returncode == 0, again.stderr + again.stdout
    assert (tmp_path / "res2" / "compare.png").read_bytes()[:8] == PNG
    plotted = _cli("sweep-plot", str(out), str(tmp_path / "res2"), "-o", str(tmp_path / "both.png"), home=home)
    assert plotted.returncode == 0, plotted.stderr
    assert (tmp_path / "both.png").read_bytes()[:8] == PNG


def test_cli_sweep_plot_refuses_labels_for_one_folder(tmp_path):
    """``sweep-plot FOLDER --labels NAME``: one folder's figures are redrawn as they were, so the
    label went nowhere, without a word (exit 0). Refused in one line; with two folders the
    labels name the overlaid sweeps, as before."""
    a, b = tmp_path / "a", tmp_path / "b"
    write_results(a, _rows(), settings={"label": "a"})
    write_results(b, _rows()[:4], settings={"label": "b"})
    one = _cli("sweep-plot", str(a), "--labels", "renamed", home=tmp_path)
    assert one.returncode == 2 and "Traceback" not in one.stderr, one.stdout + one.stderr
    assert one.stderr.strip() == ("staronnx: error: --labels names the sweeps overlaid in one plot: give two folders "
                                  "or more (a sweep's own label is set when it runs: staronnx sweep --labels NAME)")
    assert not (a / "latency_throughput.png").exists()
    two = _cli("sweep-plot", str(a), str(b), "--labels", "x,y", "-o", str(tmp_path / "both.png"), home=tmp_path)
    assert two.returncode == 0, two.stdout + two.stderr
    assert (tmp_path / "both.png").read_bytes()[:8] == PNG


def test_cli_sweep_simulate_prints_the_simulator_error(plan, home, tmp_path, two_groups):
    out = tmp_path / "simres"
    done = _cli("sweep", str(plan.root), "--rates", "80", "--batch-sizes", "1", "--groups", two_groups,
                "--duration", "400ms", "--simulate", "--max-delay", "5ms", "-o", str(out), home=home)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "simulator vs measurement" in done.stdout and "median |error|" in done.stdout
    assert load_rows(out)[0]["max_delay_ms"] == pytest.approx(5.0)
    assert (out / "simulator.png").read_bytes()[:8] == PNG


def test_cli_sweep_bad_arguments(plan, tmp_path):
    bad = _cli("sweep", str(plan.root), "--rates", "fast", "-o", str(tmp_path / "x"), home=tmp_path)
    assert bad.returncode == 2 and "--rates" in bad.stderr
    bad = _cli("sweep", str(plan.root), "--rates", "10", "--compare", str(tmp_path / "none"),
               "-o", str(tmp_path / "x"), home=tmp_path)
    assert bad.returncode == 2 and "results.json" in bad.stderr
