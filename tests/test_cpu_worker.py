"""CPU worker: pinning, results, failures, shutdown and weight sharing, with real ORT sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from staronnx.errors import DeviceError, ModelError
from staronnx.workers.cpu import CpuWorker
from staronnx.workers.cpu_weights import SharedWeights, process_memory
from staronnx.workers.groups import CpuGroup, make_groups
from staronnx.workers.topology import Topology

IR_VERSION = 10  # onnx writes IR 14 by default; ONNX Runtime 1.31 reads up to 13.


def matmul_relu(path: Path, k: int = 16, n: int = 8, seed: int = 0) -> Path:
    """y = relu(x @ W), x: [batch, k]."""
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "matmul_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
        [numpy_helper.from_array(w, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)
    onnx.save(model, path)
    return path


def add_one(path: Path) -> Path:
    """z = y + 1 on [batch, 8]: a second part to chain after matmul_relu."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["y", "one"], ["z"])],
        "add_one",
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(np.ones((8,), np.float32), "one")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION)
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("parts")
    return [matmul_relu(d / "p0.onnx"), add_one(d / "p1.onnx")]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> SharedWeights:
    return SharedWeights(tmp_path_factory.mktemp("weights"))


@pytest.fixture(scope="module")
def system() -> Topology:
    return Topology.from_system()


@pytest.fixture(scope="module")
def single_core_groups(system: Topology, two_groups: str) -> list[CpuGroup]:
    # two explicit one-PU groups, whatever the host's size
    return list(make_groups(system, two_groups))


def reference(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def x_of(batch: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 16)).astype(np.float32)


def os_threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def thread_affinity(tid: int) -> set[int]:
    status = Path(f"/proc/self/task/{tid}/status").read_text()
    text = next(l for l in status.splitlines() if l.startswith("Cpus_allowed_list")).split(":")[1]
    out: set[int] = set()
    for chunk in text.strip().split(","):
        lo, _, hi = chunk.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


# ------------------------------------------------------------------------- pinning, results
def test_worker_thread_is_pinned_to_first_pu_of_its_group(
    single_core_groups: list[CpuGroup], parts: list[Path], weights: SharedWeights
) -> None:
    workers = [CpuWorker(g, parts, weights=weights).start() for g in single_core_groups]
    try:
        for g, w in zip(single_core_groups, workers):
            assert w.call(lambda: os.sched_getaffinity(0)) == {g.first_pu}  # inside its thread
            assert thread_affinity(w.native_id) == {g.first_pu}  # type: ignore[arg-type]
        # The caller's own affinity is untouched.
        assert os.sched_getaffinity(0) == set(Topology.from_system().allowed_pus)
    finally:
        for w in workers:
            w.close()


def test_results_equal_plain_ort(
    single_core_groups: list[CpuGroup], parts: list[Path], weights: SharedWeights
) -> None:
    for share in (True, False):
        with CpuWorker(single_core_groups[-1], parts, weights=weights, share_weights=share) as w:
            assert w.weights_shared == [share, share]
            for batch in (1, 3, 32):
                x = x_of(batch)
                y = w.run(0, {"x": x})
                assert set(y) == {"y"}
                np.testing.assert_allclose(y["y"], reference(parts[0], {"x": x})[0], rtol=1e-5, atol=1e-6)
                z = w.submit(1, {"y": y["y"]}).result()
                np.testing.assert_allclose(z["z"], y["y"] + 1, rtol=1e-6)
            assert w.input_names(0) == ["x"] and w.output_names(1) == ["z"]


def test_tasks_run_in_the_worker_thread(
    single_core_groups: list[CpuGroup], parts: list[Path], weights: SharedWeights
) -> None:
    """A task runs in the worker's own thread (its sessions' pool threads inherit its
    affinity), whether spawned there by an engine's loop (``run_here``) or submitted to a
    worker used alone; run_here refuses any other thread."""
    with CpuWorker(single_core_groups[0], parts, name="w0", weights=weights) as w:
        ran_in = w.call(lambda: (threading.current_thread().name, w.run_here(0, {"x": x_of(5)})["y"].shape))
        assert ran_in == ("w0", (5, 8))
        assert w.submit(1, {"y": np.zeros((2, 8), np.float32)}).result()["z"].shape == (2, 8)
        with pytest.raises(RuntimeError, match="outside w0's thread"):
            w.run_here(0, {"x": x_of(1)})


def test_many_concurrent_submitters(
    single_core_groups: list[CpuGroup], parts: list[Path], weights: SharedWeights
) -> None:
    with CpuWorker(single_core_groups[0], parts, weights=weights) as w:
        results: dict[int, np.ndarray] = {}

        def client(k: int) -> None:
            futs = [(i, w.submit(0, {"x": x_of(2, seed=100 * k + i)})) for i in range(20)]
            for i, f in futs:
                results[100 * k + i] = f.result()["y"]

        clients = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        assert len(results) == 80
        for seed, y in results.items():
            np.testing.assert_allclose(y, reference(parts[0], {"x": x_of(2, seed)})[0], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------- failures
def test_failing_feed_fails_only_its_future(
    single_core_groups: list[CpuGroup], parts: list[Path], weights: SharedWeights
) -> None:
    with CpuWorker(single_core_groups[0], parts, weights=weights) as w:
        good1 = w.submit(0, {"x": x_of(2)})
        bad_shape = w.submit(0, {"x": np.zeros((2, 5), np.float32)})
        bad_dtype = w.submit(0, {"x": np.zeros((2, 16), np.int64)})
        bad_name = w.submit(0, {"nope": x_of(2)})
        good2 = w.submit(0, {"x": x_of(3)})
        assert good1.result()["y"].shape == (2, 8)
        for bad in (bad_shape, bad_dtype, bad_name):
            assert bad.exception() is not None
        assert good2.result()["y"].shape == (3, 8)
        assert w.run(1, {"y": np.zeros((1, 8), np.float32)})["z"].tolist() == [[1.0] * 8]


def test_misuse_raises_clearly(
    single_core_groups: list[CpuGroup], parts: list[Path], weights: SharedWeights
) -> None:
    w = CpuWorker(single_core_groups[0], parts, weights=weights)
    with pytest.raises(RuntimeError, match="not started"):
        w.submit(0, {"x": x_of(1)})
    w.start()
    with pytest.raises(RuntimeError, match="already started"):
        w.start()
    with pytest.raises(IndexError, match="parts 0..1, not 2"):
        w.submit(2, {"x": x_of(1)})
    w.close()
    w.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        w.submit(0, {"x": x_of(1)})


def test_bad_parts_fail_start_without_leaving_threads(
    single_core_groups: list[CpuGroup], parts: list[Path], tmp_path: Path, weights: SharedWeights
) -> None:
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ModelError, match="does not exist"):
        CpuWorker(single_core_groups[0], [tmp_path / "missing.onnx"]).start()
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not onnx at all")
    for share in (True, False):
        with pytest.raises(ModelError, match="part 1"):
            CpuWorker(single_core_groups[0], [parts[0], junk], weights=weights, share_weights=share).start()
    with pytest.raises(ModelError, match="at least one part"):
        CpuWorker(single_core_groups[0], [])
    assert {t.name for t in threading.enumerate()} == before


def test_group_from_another_machine_is_refused(parts: list[Path], system: Topology) -> None:
    missing = max(p.os_index for p in system.pus) + 40
    big = Topology.from_synthetic(f"core:{missing + 1} pu:1")
    group = make_groups(big, f"{missing}")[0]
    with pytest.raises(DeviceError, match=f"cannot run on PU {missing}"):
        CpuWorker(group, parts).start()


# ------------------------------------------------------------------------- shutdown
def test_close_leaves_no_thread(system: Topology, parts: list[Path], weights: SharedWeights) -> None:
    py_before = set(threading.enumerate())
    os_before = os_threads()
    group = make_groups(system, "numa")[0]  # all cores of node 0: ORT adds pool threads
    w = CpuWorker(group, parts, weights=weights).start()
    w.run(0, {"x": x_of(4)})
    w.submit(0, {"x": np.zeros((1, 3), np.float32)}).exception()  # a failure must not pin anything
    # The worker thread + one ORT pool per session (per part) of n_cores - 1 threads each.
    assert len(os_threads() - os_before) == 1 + len(parts) * (group.n_cores - 1)
    w.close(timeout=30)
    assert set(threading.enumerate()) == py_before
    assert not w.alive
    # join() returns once Python is done with the thread; the OS thread may still be running
    # its thread-local destructors (ORT's, glibc's) for a moment.
    # (Threads of earlier tests may end meanwhile: only new threads count.)
    deadline = time.monotonic() + 10
    while os_threads() - os_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os_threads() - os_before == set()


def test_ort_pool_threads_are_pinned_to_the_other_cores(
    system: Topology, parts: list[Path], weights: SharedWeights
) -> None:
    group = make_groups(system, "numa")[0]
    if group.n_cores < 2:
        pytest.skip("needs a NUMA node with two cores")
    before = os_threads()
    with CpuWorker(group, parts, weights=weights) as w:
        pool = os_threads() - before - {w.native_id}
        assert len(pool) == len(parts) * (group.n_cores - 1)
        # Each session's pool has one thread per other core, pinned to that core's PUs. A pool
        # thread is born with its creator's affinity (the worker's first PU) and pins itself once
        # it runs: on a loaded host that can be after the session exists, so wait for it.
        expected = sorted(sorted(pus) for pus in group.core_pus[1:] for _ in parts)
        deadline = time.monotonic() + 30
        while (pinned := sorted(sorted(thread_affinity(t)) for t in pool)) != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pinned == expected


def test_close_drains_queued_tasks(
    single_core_groups: list[CpuGroup], parts: list[Path], weights: SharedWeights
) -> None:
    w = CpuWorker(single_core_groups[0], parts, weights=weights).start()
    futs = [w.submit(0, {"x": x_of(2, seed=i)}) for i in range(20)]
    w.close()
    assert all(f.done() and not f.cancelled() for f in futs)
    assert all(f.result()["y"].shape == (2, 8) for f in futs)


def test_close_can_cancel_queued_tasks(
    single_core_groups: list[CpuGroup], parts: list[Path], weights: SharedWeights
) -> None:
    w = CpuWorker(single_core_groups[0], parts, weights=weights).start()
    inside, release = threading.Event(), threading.Event()

    def block() -> None:
        inside.set()
        release.wait(30)

    blocker = threading.Thread(target=w.call, args=(block,))
    blocker.start()
    assert inside.wait(30)
    queued = [w.submit(0, {"x": x_of(1)}) for _ in range(3)]
    closer = threading.Thread(target=w.close, kwargs={"cancel_pending": True})
    closer.start()
    deadline = time.monotonic() + 30
    while not all(f.cancelled() for f in queued) and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    closer.join(30)
    blocker.join(30)
    assert all(f.cancelled() for f in queued)
    assert not w.alive


def test_spinning_is_turned_off_when_workers_share_cores(
    single_core_groups: list[CpuGroup], parts: list[Path], weights: SharedWeights
) -> None:
    g = single_core_groups[0]
    with CpuWorker(g, parts, weights=weights) as a, CpuWorker(g, parts, weights=weights) as b:
        assert a.spin is True and b.spin is False
        with CpuWorker(g, parts, weights=weights, spin=True) as forced:
            assert forced.spin is True
    with CpuWorker(g, parts, weights=weights) as again:  # claims were released
        assert again.spin is True


def test_pools_spin_within_a_run_and_stop_after_it(
    single_core_groups: list[CpuGroup], parts: list[Path], weights: SharedWeights
) -> None:
    """A pool left spinning after its run takes the cores from the process's other threads
    (the caller submitting the next batch, a server's loop, a job's reader and writer) when
    they have work: every session stops spinning as its run ends, one part or several."""
    g = single_core_groups[0]
    for held in (parts[:1], parts):
        with CpuWorker(g, held, weights=weights) as w:
            for session in w._sessions:
                options = session.get_session_options()
                assert options.get_session_config_entry("session.force_spinning_stop") == "1"
                assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
            x = x_of(2)
            np.testing.assert_allclose(w.run(0, {"x": x})["y"], reference(parts[0], {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_membind_is_best_effort(single_core_groups: list[CpuGroup], parts: list[Path], weights: SharedWeights) -> None:
    with CpuWorker(single_core_groups[0], parts, weights=weights) as w:
        if len(Topology.from_system().numa_nodes) == 1:
            assert w.membind == "skipped: one NUMA node"
        else:  # pragma: no cover - multi-node machines
            assert w.membind.startswith(("bind", "failed"))


# ------------------------------------------------------------------------- weight sharing
def test_shared_weights_built_once_per_numa_node(
    single_core_groups: list[CpuGroup], parts: list[Path], tmp_path: Path
) -> None:
    cache = SharedWeights(tmp_path / "cache")
    workers = [CpuWorker(g, parts[:1], weights=cache).start() for g in single_core_groups * 2]
    try:
        assert all(w.weights_shared == [True] for w in workers)
        numas = {g.numa for g in single_core_groups}
        assert len(list((tmp_path / "cache").glob("p0-*/numa*"))) == len(numas)
        x = x_of(3)
        for w in workers:
            np.testing.assert_allclose(w.run(0, {"x": x})["y"], reference(parts[0], {"x": x})[0], rtol=1e-5, atol=1e-6)
    finally:
        for w in workers:
            w.close()


def test_weights_fall_back_to_a_private_copy(
    single_core_groups: list[CpuGroup], parts: list[Path], tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("the cache cannot be created under a file")
    with CpuWorker(single_core_groups[0], parts, weights=SharedWeights(blocker / "cache")) as w:
        assert w.weights_shared == [False, False]
        assert w.run(0, {"x": x_of(2)})["y"].shape == (2, 8)


def test_process_memory_reads_proc() -> None:
    m = process_memory()
    assert m["rss"] > 0 and m["pss"] > 0 and m["rss_anon"] > 0


_MEMORY_SCRIPT = r"""
import gc, json, os, sys
import numpy as np
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from test_cpu_worker import matmul_relu
from staronnx.workers.cpu import CpuWorker
from staronnx.workers.cpu_weights import SharedWeights, process_memory
from staronnx.workers.groups import make_groups
from staronnx.workers.topology import Topology

share, d = sys.argv[1] == "1", Path(sys.argv[2])
path = matmul_relu(d / f"big{int(share)}.onnx", k=1024, n=10240)  # a 40 MiB weight
gc.collect()
# explicit one-PU groups on (at most) two PUs, whatever the host's size
groups = make_groups(Topology.from_system(), ";".join(map(str, sorted(os.sched_getaffinity(0))[:2])))
cache = SharedWeights(d / f"cache{int(share)}")
x = np.ones((2, 1024), np.float32)
m0, growth, workers = process_memory(), [], []
for i in range(4):
    w = CpuWorker(groups[i % len(groups)], [path], share_weights=share, weights=cache).start()
    w.run(0, {"x": x})
    workers.append(w)
    m = process_memory()
    growth.append({k: (m[k] - m0[k]) / 2**20 for k in m})
shared = [w.weights_shared[0] for w in workers]
for w in workers:
    w.close()
print(json.dumps({"shared": shared, "growth": growth}))
"""


def _memory_growth(share: bool, tmp_path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, "1" if share else "0", str(tmp_path), str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=300, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_weights_are_shared_between_sessions(tmp_path: Path) -> None:
    """4 sessions of a 40 MiB model: PSS grows ~4x without sharing and barely with it.

    VmRSS is not the measure here: it counts a file page once per mapping, so four sessions
    mapping the same weights show four times the pages although memory holds one copy.  PSS
    divides each shared page among its mappings; RssAnon shows that no private copy is made.
    """
    private = _memory_growth(False, tmp_path)
    shared = _memory_growth(True, tmp_path)
    assert private["shared"] == [False] * 4 and shared["shared"] == [True] * 4
    p1, p4 = private["growth"][0]["pss"], private["growth"][3]["pss"]
    s1, s4 = shared["growth"][0]["pss"], shared["growth"][3]["pss"]
    assert p1 > 35 and s1 > 35, (private, shared)  # one session does hold the 40 MiB weight
    assert p4 > 3 * p1, private  # the measure can see copies...
    assert s4 < 1.3 * s1, shared  # ...and with sharing there are none
    assert shared["growth"][3]["rss_anon"] < 20, shared


def test_a_runtime_shares_weights_between_the_groups_of_a_numa_node_only(small, two_groups: str) -> None:
    """One group alone on its NUMA node has no second session to share a part's weights with:
    it loads its parts as a plain ORT session does (the CPU engine next to a plain loop, issue
    51); two groups on one node share one mapped copy, and both answer as the model does."""
    from staronnx import MachineSpec, Runtime, RuntimeSpec, load_plan
    from staronnx.verify import random_plan_feeds

    model, folder = small
    plan = load_plan(folder)
    feeds = random_plan_feeds(plan, 2, seed=1)
    expected = reference(model, feeds)
    pus = sorted(os.sched_getaffinity(0))
    alone = f"{pus[0]}-{pus[-1]}" if len(pus) > 1 else str(pus[0])
    for groups, shared in ((alone, False), (two_groups, True)):
        with Runtime(plan, MachineSpec(groups=groups), RuntimeSpec(policy="eager")) as rt:
            assert [w.weights_shared for w in rt.workers] == [[shared] * plan.k] * len(rt.workers)  # type: ignore[attr-defined]  # (CPU workers)
            out = rt.run(feeds)
        for name, want in zip(plan.output_names, expected):
            np.testing.assert_allclose(out[name], want, rtol=1e-4, atol=1e-5)
