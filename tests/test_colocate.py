"""Colocation (``Runtime.colocate``, ``Server(colocate=True)``): the threads that hold the GIL in
turn run on the CUDA driver's core (or a CPU-only runtime's first CPU worker's), with real threads
and real affinities, on HostRuntime.

Every figure asserted comes from the threads themselves (``os.sched_getaffinity`` of their
native ids), never from the machine's core count, so the tests hold on 1 PU or 128.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from staronnx import CudaOptions, MachineSpec, Runtime, RuntimeSpec, partition
from staronnx.perfmodels import PerfModelStore
from staronnx.serving import ServeSpec, Server
from staronnx.workers.colocate import colocated
from staronnx.workers.cuda import CudaWorker
from staronnx.workers.cudart import HostRuntime
from staronnx.partition import PartitionSpec
from staronnx.bench.spec import RunSpec

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no thread affinity here")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16])], [w])
    path = tmp_path_factory.mktemp("colocate") / "mm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    return path


@pytest.fixture(scope="module")
def plan(model, tmp_path_factory: pytest.TempPathFactory):
    return partition(model, spec=PartitionSpec(parts=1, profile_runs=1),
                     output_dir=tmp_path_factory.mktemp("colocate-plan") / "plan")


def _runtime(plan, tmp_path, groups: str = "none", streams: int = 1) -> Runtime:
    return Runtime(plan, MachineSpec(groups, streams, cuda_graphs=False),
                   RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path), cuda=CudaOptions(runtime=HostRuntime())))


def _x(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((4, 16)).astype(np.float32)}


def _drivers(rt: Runtime) -> list[CudaWorker]:
    return [w for w in rt.workers if isinstance(w, CudaWorker)]


def test_a_caller_runs_on_the_drivers_core_inside_the_block_and_where_it_was_after(plan, model, tmp_path):
    ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    before = os.sched_getaffinity(0)
    with _runtime(plan, tmp_path) as rt:
        assert rt.host_core is None  # groups "none": no core is held back for the driver
        with rt.colocate() as pu:
            assert pu in os.sched_getaffinity(os.getpid()) | before
            assert os.sched_getaffinity(0) == {pu}
            # the driver was pinned to it first, for the block
            assert {os.sched_getaffinity(w.native_id) == {pu} for w in _drivers(rt)} == {True}
            assert rt.host_core == pu
            futs = [rt.submit(_x(i)) for i in range(32)]
            for i, f in enumerate(futs):
                np.testing.assert_allclose(f.result(timeout=10)["y"], ref.run(None, _x(i))[0], rtol=1e-5, atol=1e-5)
            seen: list[set[int]] = []
            t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
            t.start()
            t.join()
            assert seen == [{pu}]  # a thread started in the block inherits the pin
        assert os.sched_getaffinity(0) == before
        # the last block to end gives the driver its PUs back: a runtime nobody joins runs as before
        assert rt.host_core is None
        assert {os.sched_getaffinity(w.native_id) == before for w in _drivers(rt)} == {True}
        with rt.colocate() as again:  # the same core each time
            assert again == pu


def test_overlapping_blocks_share_the_core_until_the_last_ends(plan, tmp_path):
    with _runtime(plan, tmp_path) as rt:
        inside, leave = threading.Event(), threading.Event()
        seen: list[int | None] = []

        def other() -> None:
            with rt.colocate() as pu:
                seen.append(pu)
                inside.set()
                leave.wait(10)

        t = threading.Thread(target=other)
        with rt.colocate() as pu:
            t.start()
            assert inside.wait(10)
        # this block ended first: the other still runs on the core, the driver with it
        assert seen == [pu] and rt.host_core == pu
        assert os.sched_getaffinity(_drivers(rt)[0].native_id) == {pu}
        leave.set()
        t.join()
        assert rt.host_core is None


def test_the_host_core_is_the_one_held_back_for_the_driver(plan, tmp_path):
    # "numa" groups hold a core back for the driver where the machine has one to spare; on a
    # single PU nothing is held back and colocate pins the driver itself: the caller joins it
    # either way
    with _runtime(plan, tmp_path, groups="numa") as rt:
        held = rt.host_core
        with rt.colocate() as pu:
            assert held is None or pu == held
            assert os.sched_getaffinity(0) == {pu} == os.sched_getaffinity(_drivers(rt)[0].native_id)
            assert rt.run(_x(0))["y"].shape == (4, 16)


def test_without_cuda_workers_the_block_runs_on_the_first_cpu_workers_pu(plan, model, tmp_path):
    """A CPU-only runtime has no driver: the caller, its threads and a colocated server's
    batcher join the first CPU worker's thread, on its group's first PU."""
    ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    before = os.sched_getaffinity(0)
    pus = sorted(before)
    groups = ";".join(str(p) for p in (pus[-1:] + pus[:1] if len(pus) > 1 else pus))  # the last PU's group first
    with _runtime(plan, tmp_path, groups=groups, streams=0) as rt:
        first = rt.workers[0]
        assert first.kind == "cpu" and rt.host_core == pus[-1] == first.group.first_pu
        with rt.colocate() as pu:
            assert pu == pus[-1] and os.sched_getaffinity(0) == {pu} == os.sched_getaffinity(first.native_id)
            np.testing.assert_allclose(rt.run(_x(1))["y"], ref.run(None, _x(1))[0], rtol=1e-5, atol=1e-5)
        assert os.sched_getaffinity(0) == before
        assert os.sched_getaffinity(first.native_id) == {pus[-1]}  # the worker keeps its pin
        with Server(rt, ServeSpec(4, max_delay=0.001, colocate=True)) as server:
            sample = {"x": _x(2)["x"][:1]}
            np.testing.assert_allclose(server.submit(sample).result(timeout=10)["y"], ref.run(None, sample)[0],
                                       rtol=1e-5, atol=1e-5)
            assert os.sched_getaffinity(server._thread.native_id) == {pus[-1]}
        assert os.sched_getaffinity(0) == before


def test_an_open_loop_point_on_cpu_workers_colocated_records_the_workers_pu(plan, tmp_path):
    from staronnx.bench.points import measure_point

    pu = sorted(os.sched_getaffinity(0))[0]
    seen: set[frozenset[int]] = set()
    with _runtime(plan, tmp_path, groups=str(pu), streams=0) as rt:
        summary, records = measure_point(rt, 4, 400.0, [{"x": _x(5)["x"][:1]}],
                                         RunSpec(duration=0.5, warmup=0.1, max_delay=0.002, colocate=True),
                                         on_submit=lambda i, n: seen.add(frozenset(os.sched_getaffinity(0))))
    assert summary["throughput"] > 0
    assert seen == {frozenset({pu})} and records.settings["loadgen"]["core"] == pu


def test_workers_of_no_kind_of_ours_give_no_core():
    from staronnx.workers.colocate import Colocation

    before = os.sched_getaffinity(0)
    with Colocation([]).block() as pu:
        assert pu is None and os.sched_getaffinity(0) == before


def test_a_core_this_process_cannot_use_leaves_the_thread_where_it_was(caplog):
    before = os.sched_getaffinity(0)
    with caplog.at_level(logging.WARNING), colocated(1 << 20) as pu:
        assert pu is None and os.sched_getaffinity(0) == before
    assert "cannot run this thread on the runtime's host core (PU 1048576)" in caplog.text


def test_a_colocated_servers_batcher_runs_on_the_drivers_core(plan, model, tmp_path):
    ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    before = os.sched_getaffinity(0)
    with _runtime(plan, tmp_path) as rt:
        with Server(rt, ServeSpec(4, max_delay=0.001, colocate=True)) as server:
            sample = {"x": _x(3)["x"][:1]}
            np.testing.assert_allclose(server.submit(sample).result(timeout=10)["y"], ref.run(None, sample)[0],
                                       rtol=1e-5, atol=1e-5)
            pu = rt.host_core
            assert pu is not None
            assert os.sched_getaffinity(server._thread.native_id) == {pu}
            assert os.sched_getaffinity(0) == before  # the caller's thread is its own business
        with Server(rt, ServeSpec(4, max_delay=0.001)) as plain:  # off by default
            assert plain.submit(sample).result(timeout=10)["y"].shape == (1, 16)
            assert os.sched_getaffinity(plain._thread.native_id) == before


def test_an_open_loop_point_colocated_runs_its_generator_and_batcher_on_the_drivers_core(plan, tmp_path):
    from staronnx.bench.points import measure_point

    before = os.sched_getaffinity(0)
    seen: set[frozenset[int]] = set()
    batchers: set[frozenset[int]] = set()

    def on_submit(i: int, n: int) -> None:
        seen.add(frozenset(os.sched_getaffinity(0)))
        batchers.update(frozenset(os.sched_getaffinity(t.native_id)) for t in threading.enumerate()
                        if t.name == "staronnx-batcher" and t.native_id is not None)

    with _runtime(plan, tmp_path) as rt:
        summary, _ = measure_point(rt, 4, 400.0, [{"x": _x(5)["x"][:1]}],
                                   RunSpec(duration=0.5, warmup=0.1, max_delay=0.002, colocate=True),
                                   on_submit=on_submit)
        assert summary["throughput"] > 0
        assert len(seen) == 1 and batchers == seen
        (pus,) = seen
        assert len(pus) == 1
        assert os.sched_getaffinity(0) == before and rt.host_core is None  # all given back after the point


def test_workers_without_a_thread_of_ours_leave_the_caller_where_it_was():
    from staronnx.workers.colocate import Colocation

    class Seen:  # a CUDA worker as another engine shows it: no native thread id, no pin
        kind, cpu, native_id, alive = "cuda", None, None, True

    before = os.sched_getaffinity(0)
    with Colocation([Seen()]).block() as pu:
        assert pu is None and os.sched_getaffinity(0) == before


def test_a_closed_runtime_has_no_core_to_join(plan, tmp_path):
    from staronnx.runtime.engine import EngineClosed

    rt = _runtime(plan, tmp_path)
    rt.close()
    with pytest.raises(EngineClosed, match="the runtime is closed"):
        rt.colocate()


def test_a_colocated_server_on_a_closed_runtime_still_answers_every_request(plan, tmp_path, caplog):
    from staronnx.runtime.engine import EngineClosed

    rt = _runtime(plan, tmp_path)
    rt.close()
    with caplog.at_level(logging.WARNING), Server(rt, ServeSpec(2, max_delay=0.001, colocate=True)) as server:
        fut = server.submit({"x": _x(6)["x"][:1]})
        with pytest.raises(EngineClosed):
            fut.result(timeout=10)  # its error, not a hang
    assert "the batcher runs where it is" in caplog.text
