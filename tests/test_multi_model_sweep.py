"""Mixed traffic (issue 23): the simulator driving one shared core for several models, the LP
bound over several models, and ``staronnx simulate``/``sweep`` with a rate per model.

Real METIS plans of zoo chains, real perf-model stores filled with hand-chosen times (so the
expected figures can be worked out by hand), the real simulator and policies, the real CLI in
a subprocess; the live sweep runs real ORT sessions on explicit one-PU CPU groups.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
from dataclasses import replace
import sys
from pathlib import Path

import onnx
import pytest

from staronnx import partition
from staronnx.bench.bound import BoundError, machine_bound, mix_bound
from staronnx.bench.mix import split_per_model
from staronnx.bench.machine import SimulationError, build_machine, profile_plan
from staronnx.bench.simulator import simulate, simulate_mix
from staronnx.bench.sweep import mix_points
from staronnx.errors import StaronnxError
from staronnx.perfmodels import HistoryModel, PerfModelStore
from staronnx.plan import Plan
from staronnx.workers.topology import Topology
from staronnx.zoo import chain
from staronnx.partition import PartitionSpec
from staronnx.workers.layout import MachineSpec
from staronnx.bench.spec import SimSpec

MS = 1e-3
ONE_CORE = "pack:1 numa:1 core:1 pu:1"  # groups="cores=1": one worker, arch cpu1
TWO_CORES = "pack:1 numa:1 core:2 pu:1"  # groups="cores=1": two workers, arch cpu1
#: heavy: 6 + 4 ms per batch of 4 (400 samples/s on one worker); light: 0.5 + 0.5 ms per sample
HEAVY_TIMES = {(0, "cpu1"): 6 * MS, (1, "cpu1"): 4 * MS}
LIGHT_TIMES = {(0, "cpu1"): 0.5 * MS, (1, "cpu1"): 0.5 * MS}


def write_models(store: PerfModelStore, plan: Plan, times, batches) -> None:
    """Calibrated history models with a fixed time per (part, arch) at each batch size."""
    for (part, arch), t in times.items():
        model = HistoryModel(part, arch)
        for b in batches:
            fp = profile_plan(plan, b).footprints[part]
            for _ in range(11):
                model.record(fp, t)
        store.save(plan.hash, model)


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> tuple[Plan, Plan, Path]:
    """(heavy, light, home): two 2-part METIS cuts of zoo chains, in folders named ``heavy``
    and ``light``, and a store with their hand-made models (heavy at b=1 and 4, light at 1)."""
    root = tmp_path_factory.mktemp("mix")
    onnx.save(chain(depth=6, width=32), str(root / "a.onnx"))
    onnx.save(chain(depth=4, width=16), str(root / "b.onnx"))
    heavy = partition(root / "a.onnx", [0.6, 0.4], PartitionSpec(costs="estimate"), output_dir=root / "heavy")
    light = partition(root / "b.onnx", [0.5, 0.5], PartitionSpec(costs="estimate"), output_dir=root / "light")
    home = root / "home"
    store = PerfModelStore(home)
    write_models(store, heavy, HEAVY_TIMES, (1, 4))
    write_models(store, light, LIGHT_TIMES, (1,))
    return heavy, light, home


def machine(plans, topology: str = ONE_CORE):
    heavy, light, home = plans
    return build_machine({"heavy": heavy, "light": light}, MachineSpec(groups="cores=1"),
                         topology=Topology.from_synthetic(topology), store=PerfModelStore(home))


# -- the LP bound over several models ---------------------------------------------------------
def test_mix_bound_shares_the_machine_between_the_models_offered_loads(plans):
    m = machine(plans, TWO_CORES)
    # heavy: 100 req/s in batches of 4 = 25 batches/s x 10 ms = 0.25 s/s; light: 200 x 1 ms = 0.2
    # s/s; 2 workers: every rate can grow by 2 / 0.45
    bound = mix_bound(m, {"heavy": 100, "light": 200}, {"heavy": 4, "light": 1})
    assert bound.scale == pytest.approx(2 / 0.45, rel=1e-6)
    assert bound.feasible
    assert bound.throughput == pytest.approx({"heavy": 100 * 2 / 0.45, "light": 200 * 2 / 0.45}, rel=1e-6)
    # alone: heavy 2 workers x 4 samples / 10 ms, light 2 workers / 1 ms
    assert bound.solo == pytest.approx({"heavy": 800.0, "light": 2000.0}, rel=1e-6)
    # at the bound both workers are full, in the proportions of the loads
    for w in ("cpu:numa0.core0", "cpu:numa0.core1"):
        assert bound.utilization[w] == pytest.approx(1.0)
    assert sum(bound.busy["heavy"].values()) == pytest.approx(2 * 0.25 / 0.45, rel=1e-6)
    assert sum(bound.busy["light"].values()) == pytest.approx(2 * 0.20 / 0.45, rel=1e-6)
    assert bound.arch_share["light"] == pytest.approx({"part0/cpu1": 1.0, "part1/cpu1": 1.0})
    # too much together, though each alone would fit: not feasible, scale below 1
    over = mix_bound(m, {"heavy": 600, "light": 1000}, {"heavy": 4, "light": 1})
    assert over.scale == pytest.approx(2 / (150 * 0.010 + 1000 * 0.001), rel=1e-6) and not over.feasible
    assert json.loads(json.dumps(over.as_dict()))["feasible"] is False


def test_mix_bound_of_one_model_is_its_plain_bound(plans):
    heavy, _, home = plans
    m = build_machine(heavy, MachineSpec(groups="cores=1"), topology=Topology.from_synthetic(TWO_CORES),
                      store=PerfModelStore(home))
    bound = mix_bound(m, {"heavy": 50}, 4)
    assert bound.scale * 50 == pytest.approx(machine_bound(m, 4).throughput, rel=1e-9)
    with pytest.raises(BoundError, match="rate and a batch size for each model"):
        mix_bound(machine(plans), {"heavy": 50}, 4)
    with pytest.raises(BoundError, match="rate must be > 0"):
        mix_bound(m, {"heavy": 0}, 4)
    with pytest.raises(BoundError, match="several models: bound their traffic together with mix_bound"):
        machine_bound(machine(plans), 4)  # the plain bound is the mix LP over a set of one


# -- the simulator driving one shared core ----------------------------------------------------
def test_a_mix_of_one_model_simulates_exactly_as_the_single_model_run(plans):
    heavy, _, home = plans
    m = build_machine(heavy, MachineSpec(groups="cores=1"), topology=Topology.from_synthetic(TWO_CORES),
                      store=PerfModelStore(home))
    single = simulate(m, 500, 4, SimSpec(duration=2, distribution="poisson", seed=3)).metrics()
    mixed = simulate_mix(m, {"heavy": 500}, 4, SimSpec(duration=2, distribution="poisson", seed=3)).metrics("heavy")
    for key in ("throughput", "latency_p50", "latency_p99", "paper_latency_mean", "completed", "batches"):
        assert mixed[key] == single[key], key
    assert mixed["deadline_misses"] is None  # no target, nothing counted


def test_a_latency_target_keeps_the_light_model_out_of_the_heavy_models_queue(plans):
    """One worker; heavy at 85 % of it, light at 5 %. Without a target the light model's
    requests queue behind the heavy batches; with one (EDF) they wait at most for the heavy
    task running (6 ms, its longest part), and the heavy model keeps its throughput."""
    m = machine(plans)
    rates, sizes = {"heavy": 340, "light": 50}, {"heavy": 4, "light": 1}
    common = SimSpec(duration=10, distribution="poisson", seed=1)
    plain = simulate_mix(m, rates, sizes, common)
    target = simulate_mix(m, rates, sizes, replace(common, targets={"light": {"latency_ms": 5}}))
    light_plain, light_target = plain.metrics("light"), target.metrics("light")
    # light alone takes 1 ms; with the target it waits at most for one heavy part (6 ms)
    assert light_target["latency_p99"] <= (1 + 6) * MS + 1e-9
    assert light_plain["latency_p99"] > 2 * light_target["latency_p99"]
    assert light_target["deadline_misses"] > 0  # a 6 ms heavy part in the way: some are late
    assert light_target["deadline_misses"] == sum(
        1 for r in target.records["light"].requests if r.done is not None and r.done - r.arrival > 5 * MS)
    heavy_plain, heavy_target = plain.metrics("heavy"), target.metrics("heavy")
    assert heavy_target["throughput"] >= 0.98 * heavy_plain["throughput"]
    assert not heavy_target["congested"] and not light_target["congested"]
    # the shared worker's time, per model, is what each model's load asks of it
    assert target.busy_by_model["heavy"]["cpu:numa0.core0"] == pytest.approx(0.85, abs=0.04)
    assert target.busy_by_model["light"]["cpu:numa0.core0"] == pytest.approx(0.05, abs=0.01)
    assert target.share("light", 1) == {"cpu1": 1.0}


def test_simulate_mix_refuses_what_it_cannot_run(plans):
    m = machine(plans)
    with pytest.raises(SimulationError, match="no rate for model"):
        simulate_mix(m, {"heavy": 10}, 1, SimSpec(duration=1))
    with pytest.raises(SimulationError, match="unknown model"):
        simulate_mix(m, {"heavy": 10, "light": 10, "other": 1}, 1, SimSpec(duration=1))
    with pytest.raises(StaronnxError, match="unknown model"):
        simulate_mix(m, {"heavy": 10, "light": 10}, 1, SimSpec(duration=1, targets={"nope": {"latency_ms": 1}}))
    with pytest.raises(SimulationError, match="several models"):
        simulate(m, 10, 1, SimSpec(duration=1))
    with pytest.raises(SimulationError, match="no perf model for part 2"):  # light has no b=4 models
        simulate_mix(m, {"heavy": 10, "light": 10}, 4, SimSpec(duration=1))


# -- parsing ----------------------------------------------------------------------------------
def test_per_model_options_read_like_the_single_model_ones():
    assert split_per_model("a=100:400:100,b=50", "--rates") == {"a": "100:400:100", "b": "50"}
    assert split_per_model("a=100,200,b=50", "--rates") == {"a": "100,200", "b": "50"}
    for bad in ("100,a=5", "a=", "=5", "a=1,a=2"):
        with pytest.raises(StaronnxError, match="--rates"):
            split_per_model(bad, "--rates")
    points = mix_points({"a": [200.0, 100.0], "b": [50.0]}, [4, 1], ["a", "b"])
    assert [(p.batch_sizes["a"], p.rates["a"]) for p in points] == [(1, 100), (1, 200), (4, 100), (4, 200)]
    assert points[1].dominates(points[0]) and not points[2].dominates(points[0])
    assert points[0].label == "a=100,b=50"


# -- the CLI ----------------------------------------------------------------------------------
def _cli(*args: str, home: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "STARONNX_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "staronnx", *args], check=False, capture_output=True, text=True,
                          env=env, timeout=timeout)


def _table_row(stdout: str, name: str) -> list[str]:
    line = next(line for line in stdout.splitlines() if line.startswith(f"│ {name} "))
    return [c.strip() for c in line.strip("│").split("│")]


def test_cli_simulate_mixed_traffic(plans):
    heavy, light, home = plans
    base = ("simulate", str(heavy.root), str(light.root), "--synthetic", "pack:1 numa:1 core:1", "--groups",
            "cores=1", "--distribution", "poisson", "--duration", "5")
    plain = _cli(*base, "--rates", "heavy=340,light=50", "--batch", "heavy=4,light=1", home=home)
    assert plain.returncode == 0, plain.stderr
    assert "simulated 2 model(s) on one runtime" in plain.stdout
    assert "LP bound of the mix: scale x1.111 (the rates fit together" in plain.stdout
    assert "heavy 377.8 samples/s at that scale, 400.0 alone" in plain.stdout
    row = _table_row(plain.stdout, "light")
    assert row[1:3] == ["1", "50.0"] and row[7:9] == ["-", "-"]  # no target, no misses counted
    p99_plain = float(row[5])
    slo = _cli(*base, "--rates", "heavy=340,light=50", "--batch", "heavy=4,light=1", "--slo-ms", "light=5",
               "--priority", "heavy=0", home=home)
    assert slo.returncode == 0, slo.stderr
    row = _table_row(slo.stdout, "light")
    assert row[7] == "5 ms" and row[8].split("/")[0].isdigit()
    assert float(row[5]) <= 7.0 < p99_plain
    # --name renames; names are what --rates and --slo-ms use; one --batch for every model
    named = _cli("simulate", str(heavy.root), str(light.root), "--name", "big", "--name", "small",
                 "--rates", "big=40,small=10", "--batch", "1", "--synthetic", "pack:1 numa:1 core:1",
                 "--groups", "cores=1", "--duration", "2", home=home)
    assert named.returncode == 0, named.stderr
    assert _table_row(named.stdout, "big")[1] == "1" and _table_row(named.stdout, "small")[2] == "10.0"
    # mistakes get one clear line
    for args, words in (
        (("--rates", "heavy=10", "--batch", "1"), "no value for model(s) 'light'"),
        (("--rate", "10", "--batch", "1"), "--rate is for one plan"),
        (("--rates", "heavy=10,light=5", "--batch", "heavy=1"), "--batch gives no value"),
        (("--rates", "heavy=10,light=5", "--batch", "1", "--slo-ms", "other=5"), "not served"),
    ):
        bad = _cli(*base, *args, home=home)
        assert bad.returncode == 2 and words in bad.stderr, (args, bad.stderr)
    # the single-plan form is unchanged
    one = _cli("simulate", str(heavy.root), "--rate", "100", "--batch", "4", "--synthetic", "pack:1 numa:1 core:1",
               "--groups", "cores=1", "--duration", "2", home=home)
    assert one.returncode == 0, one.stderr
    assert "LP bound 400.0 samples/s at batch 4" in one.stdout


PNG = b"\x89PNG\r\n\x1a\n"


def test_cli_sweep_mixed_traffic_on_one_live_runtime(plans, tmp_path):
    """Two real plans on one runtime (one one-PU group, real ORT sessions): a row per mix and
    model, the mix's LP bound beside it, deadline misses for the model with a target, the
    simulated figures, and the per-model plots."""
    heavy, light, home = plans
    out = tmp_path / "mixed"
    done = _cli("sweep", str(heavy.root), str(light.root), "--rates", "heavy=40,80,light=20",
                "--batch-sizes", "heavy=4,light=1", "--groups", str(min(os.sched_getaffinity(0))),
                "--slo-ms", "light=50", "--priority", "light=1", "--duration", "400ms", "--min-batches", "3",
                "--simulate", "-o", str(out), home=home)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "sweeping 2 model(s) on one runtime" in done.stdout and "mixed sweep" in done.stdout
    # the simulator's table says which mix and model each line is
    assert any(line.startswith("│ heavy=80,light=20 │ light ") and "%" in line for line in done.stdout.splitlines())
    with open(out / "results.csv") as f:
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or [])
        rows = list(reader)
    assert header[:3] == ["model", "mix", "point"]
    assert [(r["mix"], r["model"]) for r in rows] == [
        ("heavy=40,light=20", "heavy"), ("heavy=40,light=20", "light"),
        ("heavy=80,light=20", "heavy"), ("heavy=80,light=20", "light")]
    by = {(r["mix"], r["model"]): r for r in rows}
    # the mix's bound, worked by hand: heavy 10 or 20 batches/s x 10 ms, light 20 x 1 ms, one worker
    for mix, load in (("heavy=40,light=20", 0.12), ("heavy=80,light=20", 0.22)):
        for model, rate in (("heavy", 40 if "40" in mix else 80), ("light", 20)):
            row = by[(mix, model)]
            assert float(row["bound_scale"]) == pytest.approx(1 / load, rel=1e-4)
            assert float(row["bound_throughput"]) == pytest.approx(rate / load, rel=1e-4)
            assert row["bound_feasible"] == "True"
            assert int(row["completed"]) > 0 and row["offered_rate"] == str(rate)
            assert row["sim_throughput"] != ""
    assert float(by[("heavy=40,light=20", "heavy")]["solo_bound_throughput"]) == pytest.approx(400, rel=1e-4)
    # only the model with a target counts misses
    assert by[("heavy=80,light=20", "light")]["latency_target_ms"] == "50"
    assert by[("heavy=80,light=20", "light")]["deadline_misses"].isdigit()
    assert by[("heavy=80,light=20", "heavy")]["deadline_misses"] == ""
    doc = json.loads((out / "results.json").read_text())
    assert doc["settings"]["mixed"] is True
    assert doc["settings"]["models"]["light"] == {"plan": str(light.root), "plan_hash": light.hash,
                                                  "latency_target_ms": 50.0, "priority": 1,
                                                  "held_by": doc["settings"]["workers"]}  # the only worker
    assert len(doc["bounds"]) == 2 and all(b["feasible"] for b in doc["bounds"].values())
    assert "fidelity" in doc
    for png in ("models.png", "latency_throughput_heavy.png", "latency_throughput_light.png"):
        assert (out / png).read_bytes()[:8] == PNG
    # sweep-plot redraws a mixed folder the same way
    again = _cli("sweep-plot", str(out), "-o", str(tmp_path / "figs"), home=home)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "figs" / "models.png").read_bytes()[:8] == PNG


def test_cli_sweep_mixed_traffic_mistakes(plans, tmp_path, capsys, monkeypatch):
    from _helpers import cli  # the CLI in this process: six refusals need no six interpreters

    heavy, light, home = plans
    monkeypatch.setenv("STARONNX_HOME", str(home))
    base = ("sweep", str(heavy.root), str(light.root), "-o", str(tmp_path / "x"))
    for args, words in (
        (("--rates", "100"), "rates per model"),
        (("--rates", "heavy=10"), "no value for model(s) 'light'"),
        (("--rates", "heavy=10,light=5", "--batch-sizes", "heavy=1,other=2"), "not given"),
        (("--rates", "heavy=10,light=5", "--url", "http://127.0.0.1:1"), "--url"),
        (("--rates", "heavy=10,light=5", "--name", "a"), "--name given 1 time(s) for 2 plan(s)"),
        (("--rates", "heavy=10,light=5", "--slo-ms", "nope=3"), "not served"),
        # a mix is measured once: --extend was accepted and dropped without a word
        (("--rates", "heavy=10,light=5", "--extend"), "--extend do(es) not go with several models (a mixed sweep)"),
    ):
        code, _, err = cli(capsys, *base, *args)
        assert code == 2 and words in " ".join(err.split()), (args, err)


# -- residency (issue 23): some models on some workers only -------------------------------------
CORE0, CORE1 = "cpu:numa0.core0", "cpu:numa0.core1"


def test_simulate_mix_places_a_model_only_on_the_workers_its_residency_names(plans):
    """Two workers. Without a residency both models' tasks run on both; with ``light`` held by
    core1 alone, none of its tasks runs on core0 while heavy still uses both, and the records
    and the result say where each model lived."""
    m = machine(plans, TWO_CORES)
    rates, sizes = {"heavy": 600, "light": 400}, {"heavy": 4, "light": 1}
    common = SimSpec(duration=3, distribution="poisson", seed=2)
    free = simulate_mix(m, rates, sizes, common)
    for model in ("heavy", "light"):
        assert all(free.busy_by_model[model][w] > 0 for w in (CORE0, CORE1)), (model, free.busy_by_model)
    assert free.held_by == {"heavy": [CORE0, CORE1], "light": [CORE0, CORE1]}
    kept = simulate_mix(m, rates, sizes, replace(common, residency={"light": CORE1}))
    assert kept.busy_by_model["light"][CORE0] == 0
    assert kept.busy_by_model["light"][CORE1] > 0
    assert all(kept.busy_by_model["heavy"][w] > 0 for w in (CORE0, CORE1))
    assert kept.metrics("light")["completed"] == free.metrics("light")["completed"] > 0
    assert kept.held_by == {"heavy": [CORE0, CORE1], "light": [CORE1]}
    for model in ("heavy", "light"):
        settings = kept.records[model].settings
        assert settings["residency"] == {"light": CORE1}
        assert settings["held_by"] == kept.held_by[model]
    assert free.records["light"].settings["residency"] == {}


def test_a_model_kept_off_the_gpu_needs_no_gpu_perf_models(plans, tmp_path):
    """The what-if the option is for: ``light`` was never calibrated on the GPU. Hosted
    everywhere, it cannot be simulated (nothing says how long it takes there); kept on the
    CPU, it runs there only, heavy takes the GPU, and the LP bound assigns the same way."""
    heavy, light, _ = plans
    store = PerfModelStore(tmp_path / "home")
    write_models(store, heavy, {**HEAVY_TIMES, (0, "cuda0"): 1 * MS, (1, "cuda0"): 1 * MS}, (1, 4))
    write_models(store, light, LIGHT_TIMES, (1,))
    m = build_machine({"heavy": heavy, "light": light}, MachineSpec(groups="cores=1", cuda_streams=1),
                      topology=Topology.from_synthetic(TWO_CORES), store=store)
    assert [w.name for w in m.workers] == ["cuda0.s0", CORE0]  # a core held back for the GPU's driver
    rates, sizes = {"heavy": 400, "light": 100}, {"heavy": 4, "light": 1}
    with pytest.raises(SimulationError, match="no perf model for part 2 on cuda0"):
        simulate_mix(m, rates, sizes, SimSpec(duration=1))
    with pytest.raises(SimulationError, match="no perf model for part 2 on cuda0"):
        mix_bound(m, rates, sizes)
    result = simulate_mix(m, rates, sizes, SimSpec(duration=2, residency={"light": "cpu"}))
    assert result.share("light", 0) == result.share("light", 1) == {"cpu1": 1.0}
    assert result.busy_by_model["light"]["cuda0.s0"] == 0
    assert result.held_by["light"] == [CORE0]
    assert result.metrics("light")["completed"] > 0 and not result.metrics("light")["congested"]
    assert result.placement.get((0, "cuda0"), 0) > 0  # heavy has the GPU
    bound = mix_bound(m, rates, sizes, residency={"light": "cpu"})
    assert bound.arch_share["light"] == pytest.approx({"part0/cpu1": 1.0, "part1/cpu1": 1.0})
    assert bound.busy["light"]["cuda0.s0"] == 0
    assert bound.as_dict()["residency"] == {"light": "cpu"}


def test_mix_bound_assigns_a_models_parts_to_its_holders_only(plans):
    """Worked by hand: heavy 100 req/s in fours (25 batches/s x 10 ms = 0.25 s/s) on core0
    only, light 200/s (0.2 s/s) on core1 only: the common scale is min(1/0.25, 1/0.2) = 4,
    where sharing both workers would allow 2/0.45; alone, each model has one worker."""
    m = machine(plans, TWO_CORES)
    rates, sizes = {"heavy": 100, "light": 200}, {"heavy": 4, "light": 1}
    split = mix_bound(m, rates, sizes, residency={"heavy": CORE0, "light": CORE1})
    assert split.scale == pytest.approx(4.0, rel=1e-6)
    assert mix_bound(m, rates, sizes).scale == pytest.approx(2 / 0.45, rel=1e-6)
    assert split.solo == pytest.approx({"heavy": 400.0, "light": 1000.0}, rel=1e-6)
    assert split.busy["heavy"][CORE1] == 0 and split.busy["light"][CORE0] == 0
    assert split.busy["heavy"][CORE0] == pytest.approx(1.0)


def test_residency_in_the_simulator_is_refused_as_the_runtime_refuses_it(plans):
    from staronnx.workers.residency import ResidencyError

    m = machine(plans, TWO_CORES)
    rates = {"heavy": 10, "light": 10}
    with pytest.raises(ResidencyError, match="unknown model.*'nope'"):
        simulate_mix(m, rates, 1, SimSpec(duration=1, residency={"nope": "cpu"}))
    with pytest.raises(ResidencyError, match=f"'cuda' matches no worker \\(workers: {CORE0}, {CORE1}"):
        simulate_mix(m, rates, 1, SimSpec(duration=1, residency={"light": "cuda"}))
    with pytest.raises(ResidencyError, match="'cpu:numa1' matches no worker"):
        mix_bound(m, rates, 1, residency={"light": "cpu,cpu:numa1"})


def _invoke(args: list[str], home: Path):
    """The CLI in this process (typer's runner): a StaronnxError comes back as the exception,
    whose text is the one line ``staronnx`` prints."""
    from typer.testing import CliRunner

    from staronnx.cli import app

    return CliRunner().invoke(app, args, env={"STARONNX_HOME": str(home), "COLUMNS": "200"})


def test_cli_simulate_with_model_workers(plans):
    heavy, light, home = plans
    base = ["simulate", str(heavy.root), str(light.root), "--synthetic", "pack:1 numa:1 core:2", "--groups",
            "cores=1", "--rates", "heavy=100,light=200", "--batch", "heavy=4,light=1", "--duration", "2"]
    out = _invoke([*base, "--model-workers", f"heavy={CORE0}", "--model-workers", f"light={CORE1}"], home)
    assert out.exit_code == 0, (out.output, out.exception)
    assert f"; heavy on {CORE0} only; light on {CORE1} only" in out.output
    assert "LP bound of the mix: scale x4 (the rates fit together" in out.output  # by hand, as above
    # the busy table: light's share of core0 is nothing, simulated and in the LP
    row = next(line for line in out.output.splitlines() if line.startswith(f"│ {CORE0} "))
    assert [c.strip() for c in row.strip("│").split("│")][-1] == "0% / 0%"
    plain = _invoke(base, home)
    assert plain.exit_code == 0, (plain.output, plain.exception)
    assert "only" not in plain.output.splitlines()[0] and "scale x4.444" in plain.output
    for extra, words in (
        (["--model-workers", "nope=cpu"], "--model-workers names model(s) 'nope' that are not served"),
        (["--model-workers", "light=cuda"], "'cuda' matches no worker"),
        (["--model-workers", "light"], "NAME=WORKERS"),
        (["--model-workers", "light=cpu", "--model-workers", "light=cpu"], "names model 'light' twice"),
    ):
        bad = _invoke([*base, *extra], home)
        assert bad.exit_code != 0 and isinstance(bad.exception, StaronnxError), (extra, bad.output)
        assert words in str(bad.exception), (extra, str(bad.exception))
    # one plan uses every worker: the option makes no sense there, for simulate as for sweep
    for cmd in (["simulate", str(heavy.root), "--rate", "100", "--batch", "4"],
                ["sweep", str(heavy.root), "--rates", "100", "--batch-sizes", "4"]):
        bad = _invoke([*cmd, "--model-workers", "heavy=cpu"], home)
        assert isinstance(bad.exception, StaronnxError), bad.output
        assert "needs several models" not in str(bad.exception)
        assert str(bad.exception).startswith("--model-workers keeps a model on some workers of a runtime shared "
                                             "by several models; give several plans")


def test_cli_sweep_mix_with_model_workers_on_one_live_runtime(plans, tmp_path):
    """Two one-PU CPU groups, heavy held by the first, light by the second: the live runtime,
    the mix's bound (worked by hand: heavy 10 batches/s x 10 ms on its worker, light 20 x 1 ms
    on its: scale min(1/0.1, 1/0.02) = 10, not the 2/0.12 of sharing both) and the simulated
    point all keep them apart, and the results say where each model lived."""
    from staronnx.bench.machine import sim_workers

    pus = sorted(os.sched_getaffinity(0))
    if len(pus) < 2:
        pytest.skip("needs two PUs for two CPU groups")
    groups = f"{pus[0]};{pus[1]}"
    first, second = (w.name for w in sim_workers(MachineSpec(groups=groups)))
    heavy, light, home = plans
    out = tmp_path / "kept"
    done = _cli("sweep", str(heavy.root), str(light.root), "--rates", "heavy=40,light=20",
                "--batch-sizes", "heavy=4,light=1", "--groups", groups, "--duration", "400ms", "--min-batches", "3",
                "--model-workers", f"heavy={first}", "--model-workers", f"light={second}",
                "--simulate", "--no-plots", "-o", str(out), home=home)
    assert done.returncode == 0, done.stderr + done.stdout
    assert f"heavy on {first} only, light on {second} only" in done.stdout
    doc = json.loads((out / "results.json").read_text())
    settings = doc["settings"]
    assert settings["residency"] == {"heavy": first, "light": second}
    assert settings["models"]["heavy"]["held_by"] == [first]
    assert settings["models"]["light"]["held_by"] == [second]
    (bound,) = doc["bounds"].values()
    assert bound["scale"] == pytest.approx(10.0, rel=1e-4) and bound["residency"] == settings["residency"]
    assert bound["busy"]["light"][first] == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["model"] for r in rows] == ["heavy", "light"]
    assert all(int(r["completed"]) > 0 and r["sim_throughput"] != "" for r in rows)


# -- latency lanes (issue 23): a worker of its own for the light model ---------------------------
LANE0 = "lane:numa0.core0"


def test_a_lane_is_one_more_worker_on_its_group_holding_the_lane_models_only(plans):
    """One core, heavy at 85 % of it, light at 5 % with a 5 ms target. Shared, light's p99 is
    its 1 ms plus a heavy part in the way (EDF); with a lane (one more worker of the group's
    arch) it never waits for heavy: its p99 is its own time plus its own queue. Heavy runs on
    the group's worker alone, preempted while the lane runs (its tasks stop and resume), and
    keeps its throughput: 90 % of the core is used either way. The LP bound says the same: the
    lane and the group's worker share the core, so 0.85 + 0.05 s/s binds: scale 1/0.9, as
    shared (a lane buys latency, not throughput)."""
    from staronnx.bench.machine import LANE_APPROXIMATION

    heavy, light, home = plans
    rates, sizes = {"heavy": 340, "light": 50}, {"heavy": 4, "light": 1}
    common = SimSpec(duration=10, distribution="poisson", seed=1, targets={"light": {"latency_ms": 5}})
    shared = simulate_mix(machine(plans), rates, sizes, common)
    m = build_machine({"heavy": heavy, "light": light}, MachineSpec(groups="cores=1", lanes={"light": "cpu"}),
                      topology=Topology.from_synthetic(ONE_CORE), store=PerfModelStore(home))
    assert [(w.name, w.arch, w.kind, w.memory_node) for w in m.workers] == [
        ("cpu:numa0.core0", "cpu1", "cpu", "numa0"), (LANE0, "cpu1", "cpu", "numa0")]
    assert m.lanes == {1: ("light",)} and m.settings["lanes"] == {"light": "cpu"}
    assert LANE_APPROXIMATION in m.notes
    laned = simulate_mix(m, rates, sizes, common)
    assert laned.held_by == {"heavy": ["cpu:numa0.core0"], "light": [LANE0]}
    assert laned.busy_by_model["light"]["cpu:numa0.core0"] == 0 and laned.busy_by_model["heavy"][LANE0] == 0
    assert laned.busy_by_model["light"][LANE0] == pytest.approx(0.05, abs=0.01)
    p99 = laned.metrics("light")["latency_p99"]
    assert p99 < 3 * MS < shared.metrics("light")["latency_p99"]
    assert laned.metrics("light")["deadline_misses"] == 0 < shared.metrics("light")["deadline_misses"]
    assert laned.metrics("heavy")["throughput"] >= 0.98 * shared.metrics("heavy")["throughput"]
    assert LANE_APPROXIMATION in laned.notes
    assert laned.records["light"].settings["lanes"] == {"light": "cpu"}
    assert laned.records["light"].settings["held_by"] == [LANE0]
    bound = mix_bound(m, rates, sizes)
    assert bound.scale == pytest.approx(1 / 0.9, rel=1e-6)
    assert mix_bound(machine(plans), rates, sizes).scale == pytest.approx(1 / 0.9, rel=1e-6)
    assert bound.busy["light"] == pytest.approx({"cpu:numa0.core0": 0.0, LANE0: 0.05 / 0.9})
    assert [b.name for b in bound.binding] == [f"cores of cpu:numa0.core0 (with {LANE0})"]
    assert bound.solo == pytest.approx({"heavy": 400.0, "light": 1000.0}, rel=1e-6)  # each on its worker
    assert bound.as_dict()["lanes"] == {"light": "cpu"}


def test_a_lane_task_preempts_its_groups_worker_in_the_simulation(plans):
    """What the OS does live (SCHED_IDLE): the heavy batch formed at 30 ms runs its 6 ms part
    from 30 ms; light's request at 33.3 ms runs at once on the lane (0.5 + 0.5 ms) while the
    heavy part stops, then resumes where it stopped: heavy's batch ends at 41 ms, not 40, and
    light's request is answered 1 ms after it arrived."""
    heavy, light, home = plans
    m = build_machine({"heavy": heavy, "light": light}, MachineSpec(groups="cores=1", lanes={"light": "cpu"}),
                      topology=Topology.from_synthetic(ONE_CORE), store=PerfModelStore(home))
    res = simulate_mix(m, {"heavy": 100, "light": 30}, {"heavy": 4, "light": 1}, SimSpec(duration=0.05, spread=0))
    first = res.records["heavy"].batches[0]
    assert first.formed == pytest.approx(0.030) and first.done == pytest.approx(0.041), first
    answered = [r for r in res.records["light"].requests if r.arrival > 0.03 and r.done is not None][0]
    assert answered.arrival == pytest.approx(1 / 30) and answered.done - answered.arrival == pytest.approx(0.001)
    # without the lane, light waits for heavy's 6 ms part to end (36 ms) before its own run
    shared = simulate_mix(machine(plans), {"heavy": 100, "light": 30}, {"heavy": 4, "light": 1},
                          SimSpec(duration=0.05, spread=0))
    waited = [r for r in shared.records["light"].requests if r.arrival > 0.03 and r.done is not None][0]
    assert waited.done - waited.arrival > 0.0027


def test_the_simulated_schedule_as_a_perfetto_trace(plans, tmp_path):
    """``simulate_mix(trace=...)``: a lane per worker, each task where it ran (the preempted
    heavy part in two stretches around light's two parts on the lane), dependency arrows,
    every batch's fill and run per model, and each queue as a counter."""
    heavy, light, home = plans
    m = build_machine({"heavy": heavy, "light": light}, MachineSpec(groups="cores=1", lanes={"light": "cpu"}),
                      topology=Topology.from_synthetic(ONE_CORE), store=PerfModelStore(home))
    path = tmp_path / "sim.json"
    res = simulate_mix(m, {"heavy": 100, "light": 30}, {"heavy": 4, "light": 1}, SimSpec(duration=0.05, spread=0),
                       trace=path)
    events = json.loads(path.read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert lanes == {0: "cpu:numa0.core0", 1: LANE0}
    tasks = [e for e in events if e["ph"] == "X" and e["cat"] == "task"]
    first = sorted((e for e in tasks if e["tid"] == 0 and e["name"] == "heavy/part0"), key=lambda e: e["ts"])[:2]
    # 30 to 33.33 ms, preempted for light's 1 ms on the lane, then 34.33 to 37 ms
    assert [round(e["ts"] / 1e3, 2) for e in first] == [30.0, 34.33] and first[1]["args"]["preempted_ms"] == \
        pytest.approx(1.0)
    assert first[0]["dur"] + first[1]["dur"] == pytest.approx(6000, abs=1)
    on_lane = [e for e in tasks if e["tid"] == 1]
    assert on_lane and all(e["name"].startswith("light/part") for e in on_lane)
    assert sum(1 for e in events if e["ph"] == "s") == sum(1 for e in events if e["ph"] == "f") > 0
    batches = [e for e in events if e["ph"] == "b" and e["cat"] == "batch"]
    assert {e["name"].split(":")[0] for e in batches} == {"heavy", "light"}
    assert len(batches) == sum(len([b for b in r.batches if b.done is not None]) for r in res.records.values())
    assert {e["name"] for e in events if e["ph"] == "C"} == {"heavy: server queue (requests)",
                                                             "light: server queue (requests)"}


def test_cli_simulate_writes_its_trace(plans, tmp_path):
    heavy, _, home = plans
    path = tmp_path / "one.json"
    out = _invoke(["simulate", str(heavy.root), "--synthetic", "pack:1 numa:1 core:2", "--groups", "cores=1",
                   "--rate", "200", "--batch", "4", "--duration", "0.5", "--trace", str(path)], home)
    assert out.exit_code == 0, (out.output, out.exception)
    assert f"trace: {path}" in out.output
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"cpu:numa0.core0", "cpu:numa0.core1"}
    assert any(e["ph"] == "X" and e["name"] == "part1" and e["args"]["simulated"] for e in events)
    assert any(e["ph"] == "b" and e["name"].startswith("batch ") for e in events)
    bad = _invoke(["simulate", str(heavy.root), "--rate", "200", "--batch", "4", "--trace", str(tmp_path)], home)
    assert str(bad.exception).startswith("cannot write --trace"), (bad.output, bad.exception)


def test_lanes_in_the_simulator_follow_the_runtimes_residency_rule(plans):
    """``--model-workers light=lane,cpu`` lets the shared workers run a lane model too; a model
    without a lane cannot be put on lanes only; and what the runtime refuses of a lane is
    refused here, in its words, before any perf model is read."""
    from staronnx.workers.residency import ResidencyError

    heavy, light, home = plans
    m = build_machine({"heavy": heavy, "light": light}, MachineSpec(groups="cores=1", lanes={"light": CORE1}),
                      topology=Topology.from_synthetic(TWO_CORES), store=PerfModelStore(home))
    assert [w.name for w in m.workers] == [CORE0, CORE1, "lane:numa0.core1"]
    rates = {"heavy": 400, "light": 200}
    alone = simulate_mix(m, rates, {"heavy": 4, "light": 1}, SimSpec(duration=2))
    assert alone.held_by == {"heavy": [CORE0, CORE1], "light": ["lane:numa0.core1"]}
    both = simulate_mix(m, rates, {"heavy": 4, "light": 1}, SimSpec(duration=2, residency={"light": "lane,cpu"}))
    assert both.held_by["light"] == [CORE0, CORE1, "lane:numa0.core1"]
    assert both.held_by["heavy"] == [CORE0, CORE1]  # "cpu" never selects a lane
    with pytest.raises(ResidencyError, match="lanes hold only the models given a lane"):
        mix_bound(m, rates, {"heavy": 4, "light": 1}, residency={"heavy": "lane"})
    for lanes, words in (({"nope": "cpu"}, "unknown model"), ({"heavy": "cpu", "light": "cpu"}, "names every model"),
                         ({"light": "cuda0"}, "'cuda0' names no CPU group")):
        with pytest.raises(ResidencyError, match=words):
            build_machine({"heavy": heavy, "light": light}, MachineSpec(groups="cores=1", lanes=lanes),
                          topology=Topology.from_synthetic(TWO_CORES), store=PerfModelStore(home / "empty"))


def test_cli_simulate_with_a_lane(plans):
    heavy, light, home = plans
    base = ["simulate", str(heavy.root), str(light.root), "--synthetic", "pack:1 numa:1 core:1", "--groups",
            "cores=1", "--rates", "heavy=340,light=50", "--batch", "heavy=4,light=1", "--slo-ms", "light=5",
            "--distribution", "poisson", "--duration", "5"]
    out = _invoke([*base, "--lane", "light"], home)
    assert out.exit_code == 0, (out.output, out.exception)
    first = out.output.splitlines()[0]
    assert first.endswith(f"cpu:numa0.core0 (cpu1), {LANE0} (cpu1); light on lanes {LANE0}"), first
    assert "LP bound of the mix: scale x1.111 (the rates fit together" in out.output  # 1 / 0.9, as above
    row = _table_row(out.output, "light")
    assert row[8] == f"0/{row[8].split('/')[1]}"  # no deadline missed on the lane
    lane_row = [c.strip() for c in next(line for line in out.output.splitlines()
                                        if line.startswith(f"│ {LANE0} ")).strip("│").split("│")]
    assert lane_row[3] == "0% / 0%" and lane_row[4] != "0% / 0%"  # heavy nothing there, light all of its
    assert "note: lanes are modelled as the live runtime runs them" in out.output and "not modelled" in out.output
    also = _invoke([*base, "--lane", "light", "--model-workers", "light=lane,cpu"], home)
    assert also.exit_code == 0, (also.output, also.exception)
    assert also.output.splitlines()[0].endswith(f"; light on lanes {LANE0} and cpu:numa0.core0")
    for extra, words in (
        (["--lane", "nope"], "--lane names model(s) 'nope' that are not served"),
        (["--lane", "heavy", "--lane", "light"], "names every model"),
        (["--lane", "light=cuda"], "'cuda' names no CPU group"),
        (["--lane", "light", "--model-workers", "heavy=lane"], "lanes hold only the models given a lane"),
    ):
        bad = _invoke([*base, *extra], home)
        assert bad.exit_code != 0 and isinstance(bad.exception, StaronnxError), (extra, bad.output)
        assert words in str(bad.exception), (extra, str(bad.exception))


def test_cli_lane_needs_several_models(plans, tmp_path):
    heavy, _, home = plans
    for cmd in (["simulate", str(heavy.root), "--rate", "100", "--batch", "4"],
                ["sweep", str(heavy.root), "--rates", "100", "--batch-sizes", "4", "-o", str(tmp_path / "x")]):
        bad = _invoke([*cmd, "--lane", "heavy"], home)
        assert isinstance(bad.exception, StaronnxError), bad.output
        assert str(bad.exception).startswith("--lane gives a model a worker that preempts the other models' tasks "
                                             "on a runtime shared by several models; give several plans")
    assert not (tmp_path / "x").exists()


def test_cli_sweep_mix_refuses_a_bad_lane_before_the_runtime_starts(plans, tmp_path):
    heavy, light, home = plans
    bad = _invoke(["sweep", str(heavy.root), str(light.root), "--rates", "heavy=40,light=20", "--batch-sizes",
                   "heavy=4,light=1", "--groups", str(min(os.sched_getaffinity(0))), "--lane", "light=cpu:numa7",
                   "--no-plots", "-o", str(tmp_path / "bad")], home)
    assert isinstance(bad.exception, StaronnxError), bad.output
    assert "'cpu:numa7' names no CPU group" in str(bad.exception)


def test_cli_sweep_mix_with_a_lane_on_one_live_runtime(plans, tmp_path):
    """One one-PU CPU group and a lane on it for light: the live runtime runs light on the
    lane and heavy on the group's worker, the mix's bound has the lane share the group's core
    (worked by hand: heavy 10 batches/s x 10 ms = 0.1 s/s on the group, light 20 x 1 ms on
    the lane: scale 1/0.12, as one shared worker), the simulated point has the same lane, and
    the notes say what the simulation leaves out."""
    from staronnx.bench.machine import sim_workers

    group = str(min(os.sched_getaffinity(0)))
    (worker,) = (w.name for w in sim_workers(MachineSpec(groups=group)))
    lane = "lane:" + worker.removeprefix("cpu:")
    heavy, light, home = plans
    out = tmp_path / "laned"
    done = _cli("sweep", str(heavy.root), str(light.root), "--rates", "heavy=40,light=20",
                "--batch-sizes", "heavy=4,light=1", "--groups", group, "--duration", "400ms", "--min-batches", "3",
                "--slo-ms", "light=50", "--lane", "light", "--simulate", "--no-plots", "-o", str(out),
                "--trace", str(tmp_path / "mix.json"), home=home)
    assert done.returncode == 0, done.stderr + done.stdout
    # the live trace marks the mix; the simulated one draws it where it ran, on the same lanes
    live = json.loads((tmp_path / "mix.json").read_text())["traceEvents"]
    sim = json.loads((tmp_path / "mix.sim.json").read_text())["traceEvents"]
    (live_point,) = [e for e in live if e.get("cat") == "sweep point"]
    (sim_point,) = [e for e in sim if e.get("cat") == "sweep point"]
    assert sim_point["name"] == live_point["name"] + " (simulated)"
    assert live_point["ts"] <= sim_point["ts"] <= live_point["ts"] + live_point["dur"]
    assert {e["args"]["name"] for e in sim if e["ph"] == "M" and e["name"] == "thread_name" and e["tid"] < 100_000} \
        == {worker, lane}
    assert {e["name"].split("/")[0] for e in sim if e.get("cat") == "task"} == {"heavy", "light"}
    assert "simulated schedule: " in done.stdout
    assert "light on lanes (cpu)" in done.stdout.splitlines()[0]
    assert "note: lanes are modelled as the live runtime runs them" in done.stdout
    doc = json.loads((out / "results.json").read_text())
    settings = doc["settings"]
    assert settings["lanes"] == {"light": "cpu"} and settings["workers"] == [worker, lane]
    assert settings["models"]["heavy"]["held_by"] == [worker]
    assert settings["models"]["light"]["held_by"] == [lane]
    (bound,) = doc["bounds"].values()
    assert bound["scale"] == pytest.approx(1 / 0.12, rel=1e-4) and bound["lanes"] == {"light": "cpu"}
    assert bound["busy"]["light"][worker] == 0 and bound["busy"]["heavy"][lane] == 0
    assert any("not modelled" in n for n in doc["notes"])
    rows = {r["model"]: r for r in doc["rows"]}
    assert rows["light"]["completed"] > 0 and rows["heavy"]["completed"] > 0
    assert rows["light"]["sim_throughput"] is not None and rows["light"]["deadline_misses"] is not None
    # the lane ran tasks (light's only: heavy is not held there) during the point
    assert rows["light"]["workers"][lane]["tasks"] >= 2 * rows["light"]["completed"]
