"""Several GPUs in the simulator, the LP bound, the sweeps and serve's in-flight window, each
through the door users use (``simulate``, ``sweep``, ``optimize-batch``, ``run``, ``serve``
with ``--cuda-devices``). ``STARONNX_CUDA_RUNTIME=host:2`` stands in for two GPUs
(:class:`~staronnx.workers.cudart.HostRuntime`), so the live halves run here too."""

from __future__ import annotations

import json
import re
import urllib.request

import onnx
import pytest

from staronnx import CudaOptions, Runtime, RuntimeSpec, partition
from staronnx.bench.bound import machine_bound
from staronnx.bench.machine import SimulationError, build_machine, sim_workers
from staronnx.bench.simulator import simulate
from staronnx.perfmodels import BusModel, LinkCost, PerfModelStore
from staronnx.plan import Plan
from staronnx.serve.models import inflight_from_models
from staronnx.workers.cudart import HostRuntime
from staronnx.workers.topology import Topology
from staronnx.zoo import chain
from test_cuda_cli import _cli
from test_simulator import MS, write_models
from staronnx.partition import PartitionSpec
from staronnx.workers.layout import MachineError, MachineSpec
from staronnx.bench.spec import SimSpec

pytestmark = pytest.mark.timeout(300)

CPU4 = "pack:1 numa:1 core:4 pu:1"
NO_RESERVE = "numa,reserve=0"


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Plan:
    root = tmp_path_factory.mktemp("multigpu")
    onnx.save(chain(depth=4, width=8), str(root / "chain.onnx"))
    return partition(root / "chain.onnx", spec=PartitionSpec(parts=2, method="linear", costs="estimate"),
                     output_dir=root / "plan")


@pytest.fixture
def two_gpus(monkeypatch, tmp_path):
    monkeypatch.setenv("STARONNX_CUDA_RUNTIME", "host:2")
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path / "home"))
    return PerfModelStore(tmp_path / "home")


def topo(text: str) -> Topology:
    return Topology.from_synthetic(text)


# -- the simulated machine --------------------------------------------------------------------
def test_the_simulator_sees_the_workers_the_runtime_starts_on_two_gpus(plan, tmp_path):
    """Same names, archs and memory nodes, in the same order (CUDA streams first, GPU by GPU):
    dmda breaks its ties by worker order, and each GPU has perf models of its own."""
    with Runtime(plan,
                 MachineSpec(groups="none", cuda_streams=2, cuda_devices=(0, 1)),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path),
                             cuda=CudaOptions(runtime=HostRuntime(devices=2)))) as rt:
        live = [(w.name, w.arch, w.kind, w.memory_node) for w in rt.workers]
    simulated = [(w.name, w.arch, w.kind, w.memory_node) for w in sim_workers(MachineSpec("none", 2, (0, 1)))]
    assert simulated == live == [("cuda0.s0", "cuda0", "cuda", "cuda0"), ("cuda0.s1", "cuda0", "cuda", "cuda0"),
                                 ("cuda1.s0", "cuda1", "cuda", "cuda1"), ("cuda1.s1", "cuda1", "cuda", "cuda1")]


@pytest.mark.parametrize("bad", [(), (0, 0), (-1,), ("gpu0",)])
def test_cuda_devices_are_checked_as_the_runtime_checks_them(plan, tmp_path, bad):
    # the simulator's machine is the runtime's spec: refused when made, in the runtime's words
    with pytest.raises(MachineError, match="each GPU once, by its CUDA ordinal"):
        build_machine(plan, MachineSpec(groups="none", cuda_streams=1, cuda_devices=bad),
                      store=PerfModelStore(tmp_path))


def test_two_calibrated_gpus_double_the_bound_and_share_the_load(plan, tmp_path):
    """Each GPU is priced from its own models: two GPUs of one model bound twice the throughput
    of one, and the simulation serves twice the rate one GPU congests at, using both."""
    store = PerfModelStore(tmp_path)
    times = {(p, arch): 2 * MS for p in (0, 1) for arch in ("cuda0", "cuda1")}
    write_models(store, plan, times, batches=(1,))
    one = build_machine(plan, MachineSpec(groups="none", cuda_streams=1), store=store)
    two = build_machine(plan, MachineSpec(groups="none", cuda_streams=1, cuda_devices=(0, 1)), store=store)
    assert [w.arch for w in two.workers] == ["cuda0", "cuda1"] and not two.table.sources
    assert two.settings["cuda_devices"] == [0, 1] and one.settings["cuda_devices"] == [0]
    assert machine_bound(one, 1).throughput == pytest.approx(250, rel=1e-6)  # 4 ms a sample
    assert machine_bound(two, 1).throughput == pytest.approx(500, rel=1e-6)
    res = simulate(two, 400, 1, SimSpec(duration=5))
    m = res.metrics()
    assert not m["congested"] and m["throughput"] == pytest.approx(400, rel=0.02)
    assert res.busy["cuda0.s0"] > 0.3 and res.busy["cuda1.s0"] > 0.3
    assert simulate(one, 400, 1, SimSpec(duration=5)).metrics()["congested"]


def test_a_gpu_never_calibrated_borrows_the_first_calibrated_gpus_times_and_links(plan, tmp_path):
    """A what-if with more GPUs than were calibrated: cuda2 and cuda3 take cuda0's times and
    bus links (so their copies are not free), said in the notes; the store's and the caller's
    bus models stay as they were."""
    store = PerfModelStore(tmp_path)
    write_models(store, plan, {(0, "cuda0"): 3 * MS, (1, "cuda0"): 1 * MS, (0, "cpu4"): 9 * MS, (1, "cpu4"): 3 * MS})
    bus = BusModel()
    bus.set("numa0", "cuda0", LinkCost(latency=50e-6, bandwidth=10e9))
    bus.set("cuda0", "numa0", LinkCost(latency=60e-6, bandwidth=12e9))
    m = build_machine(plan, MachineSpec(groups=NO_RESERVE, cuda_streams=1, cuda_devices=(0, 2, 3)), topology=topo(CPU4),
                      store=store, bus=bus)
    assert [w.arch for w in m.workers] == ["cuda0", "cuda2", "cuda3", "cpu4"]
    assert m.settings["sources"] == {"cuda2": "cuda0", "cuda3": "cuda0"}
    assert any("cuda2: no models; using cuda0's" in n for n in m.notes), m.notes
    assert any("cuda2, cuda3: no bus links; using cuda0's" in n for n in m.notes), m.notes
    assert m.table.bus.cost("numa0", "cuda3") == LinkCost(latency=50e-6, bandwidth=10e9)
    assert m.table.bus.cost("cuda2", "numa0") == LinkCost(latency=60e-6, bandwidth=12e9)
    assert m.table.bus.predict("cuda2", "cuda3", 1 << 20) > 0  # through the host
    assert bus.cost("numa0", "cuda2") is None  # the caller's model is untouched
    bound = machine_bound(m, 1)
    compute = 3 / (4 * MS) + 1 / (12 * MS)  # three GPUs at 4 ms a sample, the CPU at 12 ms
    assert 0.97 * compute < bound.throughput < compute  # every GPU's copies cost a little
    # strict callers (the bound of --rates auto, perfmodel show) borrow nothing
    strict = build_machine(plan, MachineSpec(groups=NO_RESERVE, cuda_streams=1, cuda_devices=(0, 2)),
                           topology=topo(CPU4), store=store, bus=bus, cpu_fallback=False)
    assert not strict.table.sources
    with pytest.raises(SimulationError, match="on cuda2"):
        machine_bound(strict, 1)


def test_serves_in_flight_window_counts_every_gpus_models(plan, tmp_path, two_gpus):
    """dmda gives a slower GPU a batch only behind a queue as long as its time: ``serve
    --cuda-devices 0,1`` sizes its window from each GPU's own models (cuda1 10x slower here: 10
    + 1 batches queued, plus one running on each), where it fell back to two per worker with
    several GPUs."""
    from test_serve import start_server

    write_models(two_gpus, plan, {(0, "cuda0"): 1 * MS, (1, "cuda0"): 1 * MS,
                                  (0, "cuda1"): 10 * MS, (1, "cuda1"): 10 * MS}, batches=(4,))
    assert inflight_from_models(plan, 4, groups="none", cuda_streams=1, cuda_devices=(0, 1)) == 13
    served = start_server([plan.root], tmp_path, "--name", "tiny", "--cuda-streams", "1", "--cuda-devices", "0,1",
                          "--groups", "none", "--batch-size", "4", "--max-delay", "1ms")
    try:
        config = json.loads(urllib.request.urlopen(f"http://{served.http}/v2/models/tiny/config", timeout=10).read())
    finally:
        assert served.stop() == 0, "\n".join(served.lines)
    assert config["parameters"]["max_inflight"] == {"string_value": "13"}, config["parameters"]


# -- the doors ---------------------------------------------------------------------------------
def test_simulate_a_machine_with_more_gpus_than_this_one(plan, two_gpus):
    """``simulate --cuda-devices 0-3`` on a host with two (stood-in) GPUs, cuda0 calibrated: four
    GPU workers, the others priced as cuda0 (said), and an LP bound four times one GPU's."""
    write_models(two_gpus, plan, {(0, "cuda0"): 2 * MS, (1, "cuda0"): 2 * MS})
    args = ["simulate", str(plan.root), "--rate", "100", "--batch", "1", "--groups", "none", "--cuda-streams", "1",
            "--duration", "1"]
    one = _cli(*args)
    four = _cli(*args, "--cuda-devices", "0-3")
    assert one.returncode == 0 and four.returncode == 0, one.stderr + four.stderr
    assert "cuda3.s0 (cuda3)" in four.stdout and "cuda1.s0" not in one.stdout, four.stdout
    assert "cuda1: no models; using cuda0's" in four.stdout, four.stdout
    # GPUs this host lacks are what-ifs, not to calibrate: the warning names the one it has
    assert "no calibrated model for parts 0, 1 on cuda1: " in four.stderr, four.stderr
    assert four.stderr.rstrip().endswith("--cuda-streams 1 --cuda-devices 0,1") and "cuda2" not in four.stderr

    def bound(out: str) -> float:
        return float(re.search(r"LP bound ([\d.]+) samples/s", out).group(1))

    assert bound(one.stdout) == pytest.approx(250, rel=1e-3) and bound(four.stdout) == pytest.approx(1000, rel=1e-3)


def test_sweep_on_two_gpus_runs_simulates_and_bounds_both(plan, tmp_path, two_gpus):
    """``sweep --cuda-devices 0,1 --simulate`` on models of both GPUs: the live runtime's workers
    are on both GPUs, the twin and the bound too, and results.json says which GPUs. (Models
    written, not calibrated: on a shared 2-core host a 20-run calibration of this tiny model can
    miss its outlier test; ``calibrate --cuda-devices`` has its own test in test_cuda_cli.)"""
    write_models(two_gpus, plan, {(p, a): 2 * MS for p in (0, 1) for a in ("cuda0", "cuda1")}, batches=(2,))
    out = tmp_path / "sweep"
    done = _cli("sweep", str(plan.root), "--rates", "50", "--batch-sizes", "2", "--duration", "1s",
                "--cuda-streams", "1", "--cuda-devices", "0,1", "--groups", "none", "--policy", "dmda",
                "--simulate", "--no-plots", "-q", "-o", str(out), "--trace", str(tmp_path / "t.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 CUDA stream(s) on each of GPUs 0,1" in done.stdout, done.stdout
    # the simulated schedule beside the live trace, on both GPUs' lanes
    assert f"simulated schedule: {tmp_path / 't.sim.json'}" in done.stdout, done.stdout
    sim = json.loads((tmp_path / "t.sim.json").read_text())["traceEvents"]
    assert {e["tid"] for e in sim if e.get("cat") == "task"} <= {0, 1}
    assert any(e.get("cat") == "task" for e in sim)
    results = json.loads((out / "results.json").read_text())
    settings = results["settings"]
    assert settings["cuda_devices"] == [0, 1] and settings["workers"] == ["cuda0.s0", "cuda1.s0"]
    # which GPUs the figures come from (a stand-in says it is one)
    assert [(g["device"], g["name"].startswith("HostRuntime")) for g in settings["gpus"]] == [(0, True), (1, True)]
    row = results["rows"][0]
    assert row["bound_throughput"] == pytest.approx(1000, rel=1e-3)  # 2 samples in 4 ms on each GPU
    assert row["cuda_devices"] == "0,1" and "cuda_devices" in (out / "results.csv").read_text().splitlines()[0]
    assert row.get("sim_throughput") is not None, row
    assert not any("no LP bound" in n or "not simulated" in n for n in results["notes"]), results["notes"]


def test_sweep_refuses_cuda_devices_with_url(plan, two_gpus):
    done = _cli("sweep", str(plan.root), "--url", "http://127.0.0.1:9", "--cuda-devices", "0", timeout=120)
    assert done.returncode == 2 and "with --url the GPUs are the server's" in done.stderr, done.stderr


def test_optimize_batch_measures_and_simulates_on_every_gpu_named(plan, tmp_path, two_gpus):
    write_models(two_gpus, plan, {(p, a): 2 * MS for p in (0, 1) for a in ("cuda0", "cuda1")}, batches=(1, 2))
    report = tmp_path / "opt.json"
    done = _cli("optimize-batch", str(plan.root), "--rate", "100", "--batch-sizes", "1,2", "--cuda-streams", "1",
                "--cuda-devices", "0,1", "--groups", "none", "--sim-duration", "1s", "--verify-duration", "0.5s",
                "--max-verify", "1", "--json", str(report))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(report.read_text())
    bounds = {c["batch_size"]: c["bound_throughput"] for c in result["candidates"]}
    assert bounds[1] == pytest.approx(500, rel=1e-3), bounds  # 4 ms a sample on each of two GPUs
    assert any(c.get("measured_throughput") for c in result["candidates"]), result


def test_run_warns_of_the_gpu_left_uncalibrated(plan, two_gpus):
    """Perf models are per GPU: ``run --cuda-devices 0,1`` with only cuda0 calibrated names cuda1
    and the calibrate line that covers both (it used to check cuda0 only)."""
    write_models(two_gpus, plan, {(0, "cuda0"): 2 * MS, (1, "cuda0"): 2 * MS})
    done = _cli("run", str(plan.root), "--requests", "4", "--cuda-streams", "1", "--cuda-devices", "0,1",
                "--groups", "none", "--policy", "dmda", "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no calibrated model for parts 0, 1 on cuda1" in done.stderr, done.stderr
    assert "--cuda-streams 1 --cuda-devices 0,1" in done.stderr, done.stderr


def test_sweep_over_the_network_takes_the_servers_gpus(plan, tmp_path, two_gpus):
    """``sweep --url`` against ``serve --cuda-devices 0,1``: the GPUs are the server's (read from
    its configuration, as its other runtime settings are), so the bound is both GPUs' and
    results.json names them."""
    from test_serve import start_server

    write_models(two_gpus, plan, {(p, a): 2 * MS for p in (0, 1) for a in ("cuda0", "cuda1")}, batches=(2,))
    served = start_server([plan.root], tmp_path, "--name", "tiny", "--cuda-streams", "1", "--cuda-devices", "0,1",
                          "--groups", "none", "--batch-size", "2", "--max-delay", "2ms")
    try:
        out = tmp_path / "wire"
        done = _cli("sweep", str(plan.root), "--url", f"http://{served.http}", "--model", "tiny", "--rates", "40",
                    "--duration", "1s", "--no-extend", "--no-plots", "-q", "-o", str(out))
        # --rates auto bounds the server's workers at its batch size (it bounded this command
        # line's defaults: CPU groups of this host, batch sizes 1-16, and found no model)
        auto = _cli("sweep", str(plan.root), "--url", f"http://{served.http}", "--model", "tiny", "--rates", "auto",
                    "--duration", "0.2s", "--min-batches", "2", "--no-extend", "--no-plots", "-q",
                    "-o", str(tmp_path / "auto"))
    finally:
        assert served.stop() == 0, "\n".join(served.lines)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["cuda_devices"] == [0, 1] and results["settings"]["cuda_streams"] == 1
    assert results["rows"][0]["bound_throughput"] == pytest.approx(1000, rel=1e-3)  # both GPUs
    assert auto.returncode == 0, auto.stdout + auto.stderr
    assert "over the calibrated perf models: 1,000 samples/s" in auto.stdout, auto.stdout
