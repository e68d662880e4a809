"""Starting a machine's workers (staronnx.workers.launch): CUDA workers started and pinned to
cores held back from the CPU groups, through every door that takes ``cuda_streams``.

The layout is checked on synthetic hwloc topologies (any size, any host); the started CUDA
workers run their real pipeline on ONNX Runtime's CPU provider through
:class:`~staronnx.workers.cudart.HostRuntime` (what a worker does, not CUDA's semantics), so
the ``Runtime(cuda_streams=N)`` door is exercised on every CI machine; the same doors on a real
GPU are in ``test_gpu_entry_points.py``.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import onnx
import pytest

from staronnx import partition
from staronnx import CudaOptions, Runtime, RuntimeSpec
from staronnx.calibrate import start_workers
from staronnx.verify import random_plan_feeds
from staronnx.workers.cudart import HostRuntime
from staronnx.workers.groups import GroupError, policy_reserve
from staronnx.workers.layout import Layout, MachineSpec, layout
from staronnx.workers.topology import Topology
from staronnx.zoo import inception
from staronnx.partition import PartitionSpec
from staronnx.workers.layout import MachineSpec


@pytest.fixture(scope="module")
def plan2(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    model = root / "inception.onnx"
    onnx.save(inception(blocks=1, channels=8, size=16), str(model))
    return partition(model, [0.7, 0.3], PartitionSpec(profile_runs=1), output_dir=root / "plan")


def _allowed_pus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def worker_layout(topo: Topology, groups: str, cuda_streams: int = 0, cuda_devices=(0,),
                  thread_per_stream: bool = False) -> Layout:
    return layout(MachineSpec(groups, cuda_streams, cuda_devices, thread_per_stream=thread_per_stream), topo)


def cuda_pins(laid: Layout) -> list[tuple[int | None, int, int | None]]:
    """(device, stream, PU of its driver thread) of each CUDA worker, in worker order."""
    return [(w.device, w.stream, w.pu) for w in laid.cuda]


# ------------------------------------------------------------------ layout (synthetic machines)
def test_policy_reserve_reads_what_the_policy_says():
    assert policy_reserve("numa") is None
    assert policy_reserve("cores=2") is None
    assert policy_reserve("numa,reserve=3") == 3
    assert policy_reserve("numa,reserve=0") == 0
    assert policy_reserve("0-3;4-7") == 0  # an explicit list chose every core itself
    with pytest.raises(GroupError):
        policy_reserve("bogus")


def test_one_core_held_back_per_device_driver_thread_and_its_streams_pinned_to_it():
    topo = Topology.from_synthetic("pack:2 numa:2 core:4 pu:1")  # 16 cores, 4 NUMA nodes
    layout = worker_layout(topo, "numa", cuda_streams=2, cuda_devices=(0, 1))
    assert layout.policy == "numa,reserve=2"
    assert sum(g.n_cores for g in layout.groups) == 14
    pins = {(d, s): pu for d, s, pu in cuda_pins(layout)}
    assert pins[(0, 0)] == pins[(0, 1)] != pins[(1, 0)] == pins[(1, 1)]
    assert set(pins.values()) == set(layout.groups.reserved_pus)
    assert not set(pins.values()) & {p for g in layout.groups for p in g.pus}


def test_one_core_held_back_per_cuda_worker_with_a_thread_per_stream():
    topo = Topology.from_synthetic("pack:2 numa:2 core:4 pu:1")  # 16 cores, 4 NUMA nodes
    layout = worker_layout(topo, "numa", cuda_streams=2, cuda_devices=(0, 1), thread_per_stream=True)
    assert layout.policy == "numa,reserve=4"
    assert len(layout.groups.reserved) == 4
    assert sum(g.n_cores for g in layout.groups) == 12
    pins = [pu for _, _, pu in cuda_pins(layout)]
    assert [(d, s) for d, s, _ in cuda_pins(layout)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(set(pins)) == 4 and set(pins) == set(layout.groups.reserved_pus)
    assert not set(pins) & {p for g in layout.groups for p in g.pus}


def test_a_policy_that_names_its_reserve_or_its_pus_is_kept():
    topo = Topology.from_synthetic("numa:2 core:4 pu:1")
    assert worker_layout(topo, "numa,reserve=1", cuda_streams=3).policy == "numa,reserve=1"
    kept = worker_layout(topo, "numa,reserve=0", cuda_streams=2)
    assert kept.groups.reserved == () and all(pu is None for _, _, pu in cuda_pins(kept))
    explicit = worker_layout(topo, "0-3;4-7", cuda_streams=2)
    assert explicit.groups.reserved == () and len(explicit.groups) == 2
    one = worker_layout(topo, "numa,reserve=1", cuda_streams=3)
    assert len({pu for _, _, pu in cuda_pins(one)}) == 1  # three workers share the one reserved core


def test_a_small_machine_keeps_at_least_one_core_for_the_cpu_groups():
    topo = Topology.from_synthetic("core:2 pu:1")
    layout = worker_layout(topo, "numa", cuda_streams=4, thread_per_stream=True)
    assert len(layout.groups.reserved) == 1 and sum(g.n_cores for g in layout.groups) == 1
    single = worker_layout(Topology.from_synthetic("core:1 pu:1"), "numa", cuda_streams=2)
    assert single.groups.reserved == () and [pu for *_, pu in cuda_pins(single)] == [None, None]


def test_no_cuda_workers_no_reserve():
    topo = Topology.from_synthetic("numa:2 core:4 pu:1")
    layout = worker_layout(topo, "numa", cuda_streams=0)
    assert layout.cuda == () and layout.groups.reserved == () and len(layout.groups) == 2


def test_the_simulator_sees_the_layout_the_runtime_starts():
    from staronnx.bench.machine import sim_workers

    topo = Topology.from_synthetic("pack:2 numa:2 core:4 pu:1")
    infos = sim_workers(MachineSpec("numa", cuda_streams=2), topo)
    assert [w.kind for w in infos[:2]] == ["cuda", "cuda"]
    # 16 cores, 1 held back for the device's driver thread: the last NUMA node has 3 cores left
    assert sorted(w.ncores for w in infos[2:]) == [3, 4, 4, 4]


def test_the_layout_names_every_worker_once_lanes_and_residency_included():
    """One layout says each worker's name, kind, arch, memory node and cores, the lanes' places
    beside their group's worker (which runs lowered) and which worker holds which part: what the
    runtime starts, the simulator simulates and ``staronnx topology`` shows."""
    topo = Topology.from_synthetic("numa:2 core:2 pu:1")  # the driver's core is held back from numa1
    laid = layout(MachineSpec("numa", 1, lanes={"light": "cpu:numa1"}), topo, ["heavy", "light"])
    assert [(w.name, w.kind, w.arch, w.memory_node, w.policy_kind) for w in laid.workers] == [
        ("cuda0.s0", "cuda", "cuda0", "cuda0", "cuda"), ("cpu:numa0", "cpu", "cpu2", "numa0", "cpu"),
        ("cpu:numa1", "cpu", "cpu1", "numa1", "cpu"), ("lane:numa1", "lane", "cpu1", "numa1", "cpu")]
    assert laid.lane_groups() == {3: 2} and [w.lowered for w in laid.workers] == [False, False, True, False]
    assert laid.workers[0].pu == laid.groups.reserved_pus[0] and laid.free_pus == 0
    owner = ["heavy", "heavy", "light"]  # the global parts' models
    assert laid.holds(owner) == [[True, True, False]] * 3 + [[False, False, True]]
    # residency adds the shared CPU workers to the lane model, and keeps the heavy one off the GPU
    assert laid.holds(owner, {"light": "lane,cpu", "heavy": "cpu"}) == [
        [False, False, False], [True, True, True], [True, True, True], [False, False, True]]
    from staronnx.bench.machine import sim_workers

    assert [(w.name, w.arch) for w in sim_workers(MachineSpec("numa", 1), topo)] == [(w.name, w.arch) for w in laid.workers[:3]]


@pytest.mark.parametrize("bad", [{"cuda_streams": -1}, {"cuda_devices": (0, 0)}, {"cuda_devices": ("gpu0",)}])
def test_every_door_refuses_a_machine_that_cannot_be_in_the_same_words(plan2, tmp_path, bad):
    import re

    from staronnx.bench.machine import build_machine
    from staronnx.errors import StaronnxError
    from staronnx.perfmodels import PerfModelStore
    from staronnx.workers.layout import MachineError

    with pytest.raises(MachineError) as refused:
        MachineSpec("numa", **bad)
    words = re.escape(str(refused.value))
    with pytest.raises(StaronnxError, match=words):
        Runtime(plan2, MachineSpec("numa", **bad), RuntimeSpec(store=PerfModelStore(tmp_path)))
    with pytest.raises(MachineError, match=words):  # the simulator's door takes the same spec
        build_machine(plan2, MachineSpec(groups="numa", **bad), store=PerfModelStore(tmp_path))
    with pytest.raises(MachineError, match=words):
        start_workers(plan2, MachineSpec(groups="numa", **bad))


# ------------------------------------------------------------------ started workers, real threads
@pytest.mark.skipif(len(_allowed_pus()) < 2, reason="needs 2 allowed PUs to hold one back")
def test_start_workers_starts_cuda_workers_on_their_reserved_core(plan2):
    pus = _allowed_pus()
    groups = f"{pus[0]};{pus[1]}"  # explicit: nothing reserved automatically
    workers = start_workers(plan2, MachineSpec(groups=groups, cuda_streams=1), cuda_options={"runtime": HostRuntime()})
    try:
        assert [w.kind for w in workers] == ["cuda", "cpu", "cpu"]
        assert all(w.alive for w in workers)
        assert workers[0].cpu is None
    finally:
        for w in workers:
            w.close()
    auto = start_workers(plan2, MachineSpec(groups="numa", cuda_streams=1), cuda_options={"runtime": HostRuntime()})
    try:
        cuda, cpus = auto[0], auto[1:]
        assert cuda.kind == "cuda" and cuda.alive and cuda.cpu is not None
        assert all(cuda.cpu not in w.group.pus for w in cpus)
        pinned = cuda.call(lambda: os.sched_getaffinity(0))
        assert pinned == {cuda.cpu}
    finally:
        for w in auto:
            w.close()


def test_runtime_with_cuda_streams_starts_and_serves_through_its_cuda_workers(plan2, tmp_path):
    """Issue 11's defect: ``Runtime(plan, MachineSpec(cuda_streams=N))`` failed at once ("cuda0.s0 is not
    started") because its own workers' CUDA ones were never started."""
    from staronnx.perfmodels import PerfModelStore

    before = {t.name for t in threading.enumerate()}
    feeds = [random_plan_feeds(plan2, 2, seed=i) for i in range(12)]
    results = []
    with Runtime(plan2,
                 MachineSpec(groups="numa", cuda_streams=2),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path),
                             cuda=CudaOptions(runtime=HostRuntime()))) as rt:
        archs = [w.kind for w in rt.workers]
        # eager hands a task to whichever worker asks first: on a busy host the CPU worker can
        # drain a round before a CUDA worker's thread is scheduled, so rounds go on (a bounded
        # number) until a CUDA worker has served
        for _ in range(50):
            results += [f.result(timeout=60) for f in [rt.submit(f) for f in feeds]]
            stats = rt.stats()
            if any(key.endswith("cuda0") for key in stats["tasks"]):
                break
    assert archs[:2] == ["cuda", "cuda"] and "cpu" in archs
    for f, r in zip(feeds * (len(results) // len(feeds)), results):
        np.testing.assert_allclose(r["logits"], plan2.run_reference(f)["logits"], rtol=1e-5, atol=1e-6)
    assert any(key.endswith("cuda0") for key in stats["tasks"]), stats["tasks"]
    assert {t.name for t in threading.enumerate()} <= before


def test_the_server_assembles_batches_in_pinned_memory_its_cuda_workers_copy_without_staging(plan2, tmp_path):
    """Issue 11's lever "requests batched straight into pinned host buffers": the Server
    concatenates each batch into the Runtime's pinned pool (shared by its CUDA workers), which
    then copy it to the device with no staging pass; answers are unchanged."""
    import gc

    from staronnx.perfmodels import PerfModelStore
    from staronnx.serving import ServeSpec, Server

    samples = [random_plan_feeds(plan2, 1, seed=i) for i in range(16)]
    with Runtime(plan2,
                 MachineSpec(groups="none", cuda_streams=2),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path),
                             cuda=CudaOptions(runtime=HostRuntime()))) as rt:
        first, second = rt.workers
        assert first.pinned_pool is second.pinned_pool
        with Server(rt, ServeSpec(4)) as server:
            answers = [f.result(timeout=60) for f in [server.submit(s) for s in samples]]
            batches = len(server.records().batches)
        skipped = sum(w.buffer_stats()["staging_skipped"] for w in rt.workers)  # readable while serving
        pool = first.pinned_pool
        assert pool.allocated <= 2 * len(rt.workers) + 1  # buffers reused, not one per batch
    del first, second
    gc.collect()
    assert pool.leased == 0  # every batch's memory came back
    for sample, answer in zip(samples, answers):
        np.testing.assert_allclose(answer["logits"], plan2.run_reference(sample)["logits"], rtol=1e-5, atol=1e-6)
    part0_inputs = [t.name for t in plan2.inputs if 0 in t.consumers]
    assert batches == 4 and skipped == batches * len(part0_inputs), (batches, skipped)


def test_a_cuda_worker_that_cannot_start_closes_the_ones_already_started(plan2):
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(Exception, match="cudnn_conv_algo_search"):
        start_workers(plan2, MachineSpec(groups="numa", cuda_streams=1),
                      cuda_options={"runtime": HostRuntime(), "cudnn_conv_algo_search": "nope"})
    assert {t.name for t in threading.enumerate()} <= before


def test_the_starpu_engine_refuses_cuda_streams_in_one_line_whether_starpu_is_here_or_not(plan2, tmp_path):
    import subprocess
    import sys

    from staronnx.errors import StaronnxError

    with pytest.raises(StaronnxError, match="CPU codelets only"):
        Runtime(plan2, MachineSpec(cuda_streams=1), RuntimeSpec(engine="starpu"))
    out = subprocess.run(
        [sys.executable, "-m", "staronnx", "sweep", str(plan2.root), "--engine", "starpu", "--cuda-streams", "1",
         "--rates", "5", "--batch-sizes", "1", "--duration", "1s", "--no-plots", "-o", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "STARONNX_HOME": str(tmp_path / "home")},
    )
    assert out.returncode == 2, out.stderr
    assert "CPU codelets only" in out.stderr and "Traceback" not in out.stderr


def test_groups_none_is_the_gpu_alone():
    topo = Topology.from_synthetic("numa:2 core:4 pu:1")
    layout = worker_layout(topo, "none", cuda_streams=2)
    assert len(layout.groups) == 0 and [(d, s) for d, s, _ in cuda_pins(layout)] == [(0, 0), (0, 1)]
    with pytest.raises(GroupError, match="no worker"):
        worker_layout(topo, "none", cuda_streams=0)


def test_runtime_and_simulator_with_no_cpu_group(plan2, tmp_path):
    from staronnx.bench.machine import sim_workers
    from staronnx.perfmodels import PerfModelStore

    synthetic = Topology.from_synthetic("core:4 pu:1")
    assert [w.kind for w in sim_workers(MachineSpec("none", cuda_streams=2), synthetic)] == ["cuda"] * 2
    feeds = random_plan_feeds(plan2, 2, seed=3)
    with Runtime(plan2,
                 MachineSpec(groups="none", cuda_streams=1),
                 RuntimeSpec(policy="dmda", store=PerfModelStore(tmp_path),
                             cuda=CudaOptions(runtime=HostRuntime()))) as rt:
        assert [w.kind for w in rt.workers] == ["cuda"]
        out = rt.run(feeds)
    np.testing.assert_allclose(out["logits"], plan2.run_reference(feeds)["logits"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("graphs", [True, False])
def test_cli_run_cuda_streams_warm_up_capture_and_report_graphs(plan2, tmp_path, graphs):
    """Through the door users use: `staronnx run --cuda-streams 2 [--no-cuda-graphs]` with the
    CUDA workers on HostRuntime (STARONNX_CUDA_RUNTIME=host): the batch size is warmed up and
    captured on each worker before the figures, and the summary says what each replays."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "staronnx", "run", str(plan2.root), "--cuda-streams", "2", "--groups", "none",
           "--policy", "eager", "--batch", "2", "--requests", "12", *([] if graphs else ["--no-cuda-graphs"])]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "STARONNX_HOME": str(tmp_path / "home"), "STARONNX_CUDA_RUNTIME": "host",
                              "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    rows = [line for line in out.stdout.splitlines() if "cuda0.s" in line]
    assert len(rows) == 2
    for row in rows:
        if graphs:  # both parts of the plan at batch 2, two buffer sets each, captured at warm-up
            assert "4 captured" in row and "replays" in row and "failed" not in row
        else:
            assert "captured" not in row


def test_runtime_passes_cuda_graphs_to_its_cuda_workers(plan2, tmp_path):
    from staronnx.perfmodels import PerfModelStore

    feeds = random_plan_feeds(plan2, 2, seed=5)
    with Runtime(plan2,
                 MachineSpec(groups="none", cuda_streams=1, cuda_graphs=True),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path),
                             cuda=CudaOptions(runtime=HostRuntime()))) as rt:
        for _ in range(5):
            out = rt.run(feeds)
        (worker,) = rt.workers
    assert worker.cuda_graphs and worker.graphs_captured >= 1
    np.testing.assert_allclose(out["logits"], plan2.run_reference(feeds)["logits"], rtol=1e-5, atol=1e-6)
