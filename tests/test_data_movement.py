"""Data where the scheduler thinks it is (issue 37), on HostRuntime.

:class:`~staronnx.workers.cudart.HostRuntime` stands in for a GPU and counts every copy that
moves bytes by kind (h2d, d2h, peer between GPUs, d2d within one) with its bytes, so each test
holds the engine to the copies :mod:`staronnx.runtime.datawizard` decides, and the predictor
to pricing exactly those: a 2-part chain on one GPU keeps its intermediate on the device
(uploads the model's inputs once, downloads only its final outputs), a GPU-to-CPU edge moves
its tensor once, a tensor two parts read is fetched to a node once.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from staronnx import CudaOptions, Runtime, RuntimeSpec, partition
from staronnx.calibrate import start_workers
from staronnx.perfmodels import BusModel, LinkCost, PerfModelStore
from staronnx.plan import Plan
from staronnx.runtime.datawizard import Copy, request_copies, tally, task_copies, price
from staronnx.runtime.predictor import PerfPredictor
from staronnx.runtime.sched import DataView, TaskView, WorkerInfo
from staronnx.workers.cudart import HostRuntime
from staronnx.zoo import chain
from staronnx.partition import PartitionSpec
from staronnx.workers.layout import MachineSpec

pytestmark = pytest.mark.timeout(300)

BATCH = 4
WIDTH = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("movement")
    onnx.save(chain(depth=4, width=WIDTH), str(root / "chain.onnx"))
    return str(root / "chain.onnx")


@pytest.fixture(scope="module")
def two_parts(model, tmp_path_factory) -> Plan:
    out = tmp_path_factory.mktemp("movement2") / "plan"
    with pytest.warns(Warning):  # the linear cut of a 4-layer chain misses 50/50 a little
        return partition(model, spec=PartitionSpec(parts=2, method="linear", costs="estimate"), output_dir=out)


@pytest.fixture(scope="module")
def one_part(model, tmp_path_factory) -> Plan:
    return partition(model, spec=PartitionSpec(parts=1, costs="estimate"),
                     output_dir=tmp_path_factory.mktemp("movement1") / "plan")


def feeds(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((BATCH, WIDTH)).astype(np.float32)}


def delta(after: dict[str, tuple[int, int]], before: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    out = {}
    for kind, (n, b) in after.items():
        n0, b0 = before.get(kind, (0, 0))
        if n != n0:
            out[kind] = (n - n0, b - b0)
    return out


def serve(runtime: Runtime, rt: HostRuntime, model: str, n: int = 12) -> dict[str, tuple[int, int]]:
    """``n`` requests (checked against plain ORT), the copies they made."""
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    before = rt.copy_counts()
    xs = [feeds(i) for i in range(n)]
    for x, fut in zip(xs, [runtime.submit(x) for x in xs]):
        np.testing.assert_allclose(fut.result(timeout=60)["y"], ref.run(None, x)[0], rtol=1e-5, atol=1e-5)
    return delta(rt.copy_counts(), before)


def bus_copies(counted: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """What crossed a bus (copies within one GPU's memory are not transfers)."""
    return {k: v for k, v in counted.items() if k != "d2d"}


# -- 1. a chain on one GPU keeps its intermediate there ----------------------------------------
@pytest.mark.parametrize("streams", [1, 2])
def test_a_two_part_chain_on_one_gpu_uploads_its_inputs_once_and_downloads_only_its_outputs(
        two_parts, one_part, model, tmp_path, streams):
    """Per batch: one upload of x and one download of y, exactly what the 1-part plan moves;
    the intermediate goes from part 0's buffers to part 1's inside the GPU (two device-local
    copies: into the handle's own buffer, then into part 1's graph slot), across streams too."""
    x_bytes = y_bytes = BATCH * WIDTH * 4
    n = 12
    moved = {}
    for name, plan in (("1 part", one_part), ("2 parts", two_parts)):
        rt = HostRuntime()
        with Runtime(plan,
                     MachineSpec(groups="none", cuda_streams=streams),
                     RuntimeSpec(policy="eager", warmup=(BATCH,), store=PerfModelStore(tmp_path / name),
                                 cuda=CudaOptions(runtime=rt))) as runtime:
            counted = serve(runtime, rt, model, n)
            decided = runtime.stats()["copies"]
        moved[name] = bus_copies(counted)
        assert moved[name] == {"h2d": (n, n * x_bytes), "d2h": (n, n * y_bytes)}, name
        # the core decided exactly what moved, copy for copy
        assert {k: (v["copies"], v["bytes"]) for k, v in decided.items()} == moved[name]
    assert moved["2 parts"] == moved["1 part"]
    mid = two_parts.parts[0].outputs[0]
    assert counted.get("d2d") == (2 * n, 2 * n * BATCH * WIDTH * 4), f"{mid} stays on the device"


# -- 2. a GPU-to-CPU edge moves its tensor once ------------------------------------------------
def _placed(plan: Plan, rt: HostRuntime, devices: list[str]):
    """Workers (one CUDA stream, one CPU group) and the names that pin part p to devices[p]
    ("cuda" or "cpu")."""
    workers = start_workers(plan, MachineSpec(groups="1", cuda_streams=1), cuda_options={"runtime": rt})
    names = {w.kind: w.name for w in workers}
    return workers, {p: names[d] for p, d in enumerate(devices)}


@pytest.mark.parametrize("devices", [["cuda", "cpu"], ["cpu", "cuda"]])
def test_an_edge_between_a_gpu_and_a_cpu_moves_its_tensor_once_and_as_decided(two_parts, model, tmp_path, devices):
    """GPU then CPU: x up, the intermediate down once (to the CPU reader), y produced on the
    host: nothing more. CPU then GPU: the intermediate up once, y down. And the copies are
    those :func:`request_copies` lists for the placement, before anything ran."""
    rt = HostRuntime()
    workers, pinned = _placed(two_parts, rt, devices)
    n = 6
    try:
        with Runtime(two_parts,
                     spec=RuntimeSpec(policy="static", policy_options={"devices": pinned}, workers=workers,
                                      store=PerfModelStore(tmp_path))) as runtime:
            counted = bus_copies(serve(runtime, rt, model, n))
    finally:
        for w in workers:
            w.close()
    nodes = ["cuda0" if d == "cuda" else "numa0" for d in devices]
    nbytes = {t: BATCH * WIDTH * 4 for t in ("x", "y", *two_parts.parts[0].outputs)}
    one = request_copies([(p.inputs, p.outputs) for p in two_parts.parts], nodes, nbytes, set(two_parts.output_names))
    predicted = {k: (n * c, n * b) for k, (c, b) in tally(one).items()}
    assert counted == predicted
    mid = two_parts.parts[0].outputs[0]
    want = [Copy("x", "numa0", "cuda0", 128), Copy(mid, "cuda0", "numa0", 128)] if devices[0] == "cuda" else \
        [Copy(mid, "numa0", "cuda0", 128), Copy("y", "cuda0", "numa0", 128)]
    assert one == want


# -- 3. the predictor prices exactly the copies the engine issues ------------------------------
def _bus() -> BusModel:
    bus = BusModel()
    bus.set("numa0", "cuda0", LinkCost(10e-6, 10e9))
    bus.set("cuda0", "numa0", LinkCost(12e-6, 8e9))
    bus.set("cuda0", "cuda1", LinkCost(5e-6, 50e9))
    bus.set("cuda1", "cuda0", LinkCost(5e-6, 50e9))
    bus.set("numa0", "cuda1", LinkCost(10e-6, 10e9))
    bus.set("cuda1", "numa0", LinkCost(12e-6, 8e9))
    return bus


def test_the_predictor_prices_the_fetches_from_the_cheapest_copy_and_the_write_backs():
    bus = _bus()
    pred = PerfPredictor("h", None, bus=bus)
    task = TaskView(0, 1, BATCH, 0, inputs=[DataView(0, "mid", 4096, frozenset({"cuda0", "numa0"})),
                                           DataView(1, "mask", 64, frozenset({"numa0"}))],
                    outputs=(("y", 1024),))
    gpu1 = WorkerInfo(0, "cuda1.s0", "cuda1", "cuda", "cuda1")
    cpu = WorkerInfo(1, "cpu:numa0", "cpu2", "cpu", "numa0", 2)
    gpu0 = WorkerInfo(2, "cuda0.s0", "cuda0", "cuda", "cuda0")
    # on cuda1: mid by peer (cheaper than from the host), mask up, y written back
    want = [Copy("mid", "cuda0", "cuda1", 4096), Copy("mask", "numa0", "cuda1", 64), Copy("y", "cuda1", "numa0", 1024)]
    copies = task_copies([(d.name, d.nbytes, d.valid_on) for d in task.inputs], "cuda1", task.outputs, bus.predict)
    assert copies == want
    assert pred.transfer_time(task, gpu1) == pytest.approx(price(want, bus.predict))
    # on the host: nothing moves (mid is valid there, y is produced there)
    assert pred.transfer_time(task, cpu) == 0.0
    # on cuda0: only the mask goes up, and y comes down
    assert pred.transfer_time(task, gpu0) == pytest.approx(bus.predict("numa0", "cuda0", 64) + bus.predict("cuda0", "numa0", 1024))


def test_a_tensor_two_parts_read_is_fetched_to_a_node_once():
    """StarPU's rule: a fetched copy stays valid where it went while a reader has yet to come,
    so the second reader on that node finds it."""
    parts = [(["x"], ["a"]), (["x", "a"], ["b"]), (["x", "b"], ["y"])]
    nbytes = {"x": 100, "a": 10, "b": 10, "y": 10}
    copies = request_copies(parts, ["cuda0", "cuda0", "cuda0"], nbytes, {"y"})
    assert copies == [Copy("x", "numa0", "cuda0", 100), Copy("y", "cuda0", "numa0", 10)]
    # a CPU part between two GPU parts: b comes up, a goes down, x is on the host already
    copies = request_copies(parts, ["cuda0", "numa0", "cuda0"], nbytes, {"y"})
    assert copies == [Copy("x", "numa0", "cuda0", 100), Copy("a", "cuda0", "numa0", 10),
                      Copy("b", "numa0", "cuda0", 10), Copy("y", "cuda0", "numa0", 10)]


def test_a_model_input_read_by_two_parts_on_one_gpu_is_uploaded_once(tmp_path):
    """Live: the engine keeps the first reader's fetch as the handle's copy on the GPU (the
    core said a reader was still to come) and the second reader reads it there."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.eye(WIDTH, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["a"]), helper.make_node("Relu", ["a"], ["r"]),
         helper.make_node("Add", ["r", "x"], ["y"])], "skip",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", WIDTH])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), tmp_path / "skip.onnx")
    with pytest.warns(Warning):
        plan = partition(tmp_path / "skip.onnx", spec=PartitionSpec(parts=2, method="linear", costs="estimate"),
                         output_dir=tmp_path / "plan")
    assert all("x" in p.inputs for p in plan.parts), "both parts read the model input"
    rt = HostRuntime()
    with Runtime(plan,
                 MachineSpec(groups="none", cuda_streams=1),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path / "h"),
                             cuda=CudaOptions(runtime=rt))) as runtime:
        counted = bus_copies(serve(runtime, rt, str(tmp_path / "skip.onnx"), 4))
    assert counted == {"h2d": (4, 4 * BATCH * WIDTH * 4), "d2h": (4, 4 * BATCH * WIDTH * 4)}


# -- 4. a real model -----------------------------------------------------------------------------
def test_a_real_model_split_on_one_gpu_moves_only_its_inputs_up_and_its_outputs_down(real_plan, tmp_path):
    import realmodels

    plan = real_plan("bert_tiny")
    rt = HostRuntime()
    x = realmodels.request("bert_tiny", client=0, rows=2)
    want = realmodels.ort_outputs("bert_tiny", x)
    with Runtime(plan,
                 MachineSpec(groups="none", cuda_streams=1),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path), cuda=CudaOptions(runtime=rt))) as runtime:
        before = rt.copy_counts()
        got = runtime.run(x)
        counted = bus_copies(delta(rt.copy_counts(), before))
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-4)
    up = sum(a.nbytes for a in x.values())
    down = sum(a.nbytes for a in want.values())
    assert counted == {"h2d": (len(x), up), "d2h": (len(want), down)}


def test_the_bound_charges_a_gpu_worker_the_write_back_of_final_outputs(two_parts):
    """The LP bound prices what the engine issues: the part that produces y pays its download
    on a GPU worker, not on a CPU worker; the other part pays nothing."""
    from staronnx.runtime.datawizard import with_writebacks

    bus = _bus()
    workers = [WorkerInfo(0, "cpu:numa0", "cpu2", "cpu", "numa0", 2), WorkerInfo(1, "cuda0.s0", "cuda0", "cuda", "cuda0")]
    times = [[1e-3, 2e-4], [1e-3, 2e-4]]
    nbytes = {"y": 4096}
    got = with_writebacks(times, two_parts, workers, nbytes, bus.predict)
    assert got[0] == times[0]
    assert got[1] == [1e-3, pytest.approx(2e-4 + bus.predict("cuda0", "numa0", 4096))]


# -- 5. prefetch at push -------------------------------------------------------------------------
def test_a_policy_that_places_at_push_starts_the_inputs_copy_then(one_part, model, tmp_path):
    """dmda decides the worker when a task is pushed: the upload starts then, on the submitting
    thread (the node's copy stream), not when the worker takes the task; the worker copies
    the prefetched tensor into its graph slot on the device, and every task found its input
    on its node when it started (a prefetch hit: HostRuntime's copies are done at once)."""
    import threading

    rt = HostRuntime()
    n = 10
    with Runtime(one_part,
                 MachineSpec(groups="none", cuda_streams=1),
                 RuntimeSpec(policy="dmda", store=PerfModelStore(tmp_path), cuda=CudaOptions(runtime=rt))) as runtime:
        counted = serve(runtime, rt, model, n)
        stats = runtime.stats()
    assert threading.get_native_id() in rt.copy_threads  # uploads issued by the pushing thread
    assert counted == {"h2d": (n, n * 128), "d2d": (n, n * 128), "d2h": (n, n * 128)}
    assert {k: (v["copies"], v["bytes"]) for k, v in stats["copies"].items()} == bus_copies(counted)
    assert stats["prefetch"] == {"tasks": n, "moved": n, "hits": n, "on_node": 1.0}


def test_eager_places_nothing_at_push_so_the_worker_uploads(one_part, model, tmp_path):
    import threading

    rt = HostRuntime()
    with Runtime(one_part,
                 MachineSpec(groups="none", cuda_streams=1),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path), cuda=CudaOptions(runtime=rt))) as runtime:
        counted = serve(runtime, rt, model, 4)
        assert "prefetch" not in runtime.stats()
    assert threading.get_native_id() not in rt.copy_threads
    assert counted == {"h2d": (4, 4 * 128), "d2h": (4, 4 * 128)}


def test_a_task_whose_prefetch_is_still_in_flight_waits_on_its_event_not_on_the_host(one_part, model, tmp_path):
    """The copy is not done when the worker starts the task (HostRuntime holds its events'
    answers): the task is a prefetch miss, and its stream waits on the copy's event before
    reading the tensor (one stream wait per task, no host wait on the copy)."""
    rt = HostRuntime()
    n = 6
    with Runtime(one_part,
                 MachineSpec(groups="none", cuda_streams=1),
                 RuntimeSpec(policy="dmda", store=PerfModelStore(tmp_path), cuda=CudaOptions(runtime=rt))) as runtime:
        runtime.run(feeds(99))
        rt.hold_events(10 ** 6)
        waits, syncs = rt.calls["stream_wait"], rt.calls["event_sync"] + rt.calls["stream_sync"]
        counted = serve(runtime, rt, model, n)
        stats = runtime.stats()
        waits = rt.calls["stream_wait"] - waits
        syncs = rt.calls["event_sync"] + rt.calls["stream_sync"] - syncs
        rt.hold_events(0)
    assert stats["prefetch"]["hits"] == 1 and stats["prefetch"]["moved"] == n + 1  # only the first one
    assert waits == n
    assert syncs == n  # the host waits once per task, for its end, as without a prefetch: never for a copy
    assert counted["h2d"] == (n, n * 128)


def test_a_cpu_task_placed_at_push_gets_its_gpu_input_prefetched_down_once(two_parts, model, tmp_path):
    rt = HostRuntime()
    workers, pinned = _placed(two_parts, rt, ["cuda", "cpu"])
    n = 5
    try:
        with Runtime(two_parts,
                     spec=RuntimeSpec(policy="static", policy_options={"devices": pinned}, workers=workers,
                                      store=PerfModelStore(tmp_path))) as runtime:
            counted = bus_copies(serve(runtime, rt, model, n))
            stats = runtime.stats()
    finally:
        for w in workers:
            w.close()
    assert counted == {"h2d": (n, n * 128), "d2h": (n, n * 128)}
    assert stats["prefetch"]["moved"] == 2 * n and stats["prefetch"]["hits"] == 2 * n


def test_a_prefetch_that_fails_leaves_the_task_to_fetch_its_input_and_loses_no_request(one_part, model, tmp_path):
    rt = HostRuntime()
    n = 4
    with Runtime(one_part,
                 MachineSpec(groups="none", cuda_streams=1),
                 RuntimeSpec(policy="dmda", store=PerfModelStore(tmp_path), cuda=CudaOptions(runtime=rt))) as runtime:
        rt.inject("copy_h2d", 2)  # out of memory on the copy stream: the first prefetch fails
        counted = serve(runtime, rt, model, n)  # every answer checked
        stats = runtime.stats()
    assert stats["requests_failed"] == 0
    assert counted["h2d"] == (n, n * 128)  # n - 1 prefetched, one fetched by its worker
    assert stats["prefetch"]["moved"] == n and stats["prefetch"]["hits"] == n - 1


def test_a_scalar_tensor_prefetched_to_a_gpu_keeps_its_shape():
    """A 0-d tensor (bert's gathered sizes cross a cut so) is uploaded as a 0-d tensor."""
    from staronnx.workers.replicas import DeviceMemory

    rt = HostRuntime()
    memory = DeviceMemory(rt, 0)
    try:
        for wait in (False, True):  # a prefetch, a fetch
            t = memory.upload(np.array(7, dtype=np.int64), wait=wait)
            assert t.shape == () and t.nbytes == 8
            assert memory.download(t).shape == ()
    finally:
        memory.close()


def test_a_gpu_memory_node_reuses_its_buffers_and_does_not_keep_every_size_forever():
    """Tensors that die give their buffers back (no allocation per task in the steady state);
    sizes that keep changing (a sequence length) do not hold the device's memory forever."""
    from staronnx.workers.replicas import DeviceMemory

    rt = HostRuntime()
    memory = DeviceMemory(rt, 0)
    memory.max_idle = 4
    try:
        for _ in range(10):
            memory.tensor(np.dtype(np.float32), (8, 16))  # dies at once: its buffer comes back
        assert memory.allocated == 1
        for n in range(1, 20):
            memory.tensor(np.dtype(np.float32), (n, 3))
        assert rt.stats.device_allocs - rt.stats.device_frees <= memory.max_idle + 1
    finally:
        memory.close()
    assert rt.stats.device_allocs == rt.stats.device_frees


def test_a_task_moved_off_a_lost_gpu_books_the_copies_it_made_not_the_lost_ones(one_part, model, tmp_path):
    """A task a CUDA worker had taken kept the copies the core decided for that worker (its
    upload, its write-back) when the worker was lost and the task went to a CPU worker, which
    needs none: the core only replaced a task's copies, keeps and prefetches when the new
    worker needed some, so stats()["copies"] booked transfers that never happened (and the
    prefetch figures read the old node's)."""
    rt = HostRuntime()
    workers = start_workers(one_part, MachineSpec(groups="1", cuda_streams=1), cuda_options={"runtime": rt})
    gpu = next(w for w in workers if w.kind == "cuda")
    try:
        with Runtime(one_part, spec=RuntimeSpec(policy="eager", workers=workers,
                                                store=PerfModelStore(tmp_path))) as runtime:
            before = rt.copy_counts()
            serve(runtime, rt, model, 4)
            rt.inject("copy_h2d", 700)  # the GPU's context is lost at its next upload
            for _ in range(40):  # until eager has handed the GPU a task
                serve(runtime, rt, model, 12)  # every answer checked: not one request lost
                if runtime.stats()["dead_workers"]:
                    break
            stats = runtime.stats()
            counted = bus_copies(delta(rt.copy_counts(), before))
    finally:
        for w in workers:
            w.close()
    assert [name for name, _ in stats["dead_workers"]] == [gpu.name]
    assert stats["requests_failed"] == 0
    decided = {k: (v["copies"], v["bytes"]) for k, v in stats["copies"].items()}
    assert decided == counted, "the core booked copies its re-placed tasks never made"
