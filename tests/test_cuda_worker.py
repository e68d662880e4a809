"""The CUDA worker (staronnx.workers.cuda).

Three kinds of tests:

- GPU tests (``needs_gpu``): skipped unless ONNX Runtime's CUDAExecutionProvider, cuda-python
  and a GPU are all present; they check streams, results, concurrency, buffer reuse, teardown;
- the constructor's error without a CUDA provider (runs anywhere);
- the same pipeline driven by :class:`~staronnx.workers.cudart.HostRuntime` on ONNX Runtime's
  CPU provider (runs anywhere): staging, buffer caching, output discovery, prefetch, errors,
  teardown.  It checks the worker's logic, not CUDA's stream semantics.
"""

from __future__ import annotations

import gc

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from staronnx.errors import DeviceError, InputError
from staronnx.workers.cuda import CudaOptions, CudaWorker, cuda_unavailable_reason
from staronnx.workers.layout import cuda_place
from staronnx.workers.cudart import HostRuntime
from staronnx.workers.pinned_pool import PinnedPool
from staronnx.workers.memory import CopyLog

from _helpers import warm_worker

pytestmark = pytest.mark.gpu

REASON = cuda_unavailable_reason(0)
needs_gpu = pytest.mark.skipif(
    REASON is not None,
    reason=f"needs a GPU with ONNX Runtime's CUDAExecutionProvider: {REASON}",
)

# TF32 would make GPU results differ from the CPU's by ~1e-3; compare exact fp32 kernels.
STRICT_FP32 = {"use_tf32": "0"}


# ---------------------------------------------------------------- models
def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def _matmul_model(path: Path) -> Path:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]),
         helper.make_node("Add", ["xw", "b"], ["xwb"]),
         helper.make_node("Relu", ["xwb"], ["y"])],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    return _save(graph, path)


def _conv_model(path: Path) -> Path:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"]),
         helper.make_node("GlobalAveragePool", ["y"], ["s"])],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 16, 16]),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, ["N", 4, 1, 1])],
        [numpy_helper.from_array(w, "w")],
    )
    return _save(graph, path)


def _nonzero_model(path: Path) -> Path:
    """A data-dependent output shape: must never get a pre-allocated buffer."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("NonZero", ["r"], ["nz"])],
        "nonzero",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("nz", TensorProto.INT64, [2, None])],
    )
    return _save(graph, path)


INPUT_SHAPES = {0: (16,), 1: (3, 16, 16)}


def make_feeds(part: int, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed * 1000 + batch * 10 + part)
    return {"x": rng.standard_normal((batch, *INPUT_SHAPES[part])).astype(np.float32)}


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("parts")
    return [_matmul_model(d / "matmul.onnx"), _conv_model(d / "conv.onnx")]


@pytest.fixture(scope="module")
def reference(parts: list[Path]) -> list[ort.InferenceSession]:
    return [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in parts]


def expected(reference: list[ort.InferenceSession], part: int, feeds: dict) -> dict:
    sess = reference[part]
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def assert_close(got: dict, want: dict, tol: float = 1e-4) -> None:
    assert got.keys() == want.keys()
    for name, ref in want.items():
        assert got[name].shape == ref.shape and got[name].dtype == ref.dtype, name
        scale = max(1.0, float(np.abs(ref).max(initial=0.0)))
        assert float(np.abs(got[name] - ref).max(initial=0.0)) <= tol * scale, name


def no_thread_named(name: str) -> bool:
    return not any(t.name == name for t in threading.enumerate())


# ---------------------------------------------------------------- runs anywhere
def test_without_a_cuda_provider_construction_raises_device_error(
    monkeypatch: pytest.MonkeyPatch, parts: list[Path]
) -> None:
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(DeviceError) as err:
        CudaWorker(cuda_place(0, 0), parts)
    message = str(err.value)
    assert "CUDAExecutionProvider" in message
    assert "pip install 'staronnx[gpu]'" in message


def test_bad_arguments_are_rejected_before_any_device_check(parts: list[Path]) -> None:
    with pytest.raises(ValueError, match="cudnn_conv_algo_search"):
        CudaWorker(cuda_place(0, 0), parts, CudaOptions(cudnn_conv_algo_search="FAST"))
    with pytest.raises(ValueError, match="user_compute_stream"):
        CudaWorker(cuda_place(0, 0), parts, CudaOptions(provider_options={"user_compute_stream": "1"}))


# ---------------------------------------------------------------- host-runtime pipeline
@pytest.fixture
def host_worker(parts: list[Path]) -> Iterator[CudaWorker]:
    worker = CudaWorker(cuda_place(0, 0), parts, CudaOptions(runtime=HostRuntime())).start()
    yield worker
    worker.close()


@pytest.mark.parametrize("batch", [1, 4])
def test_host_pipeline_matches_cpu_ort(host_worker: CudaWorker, reference, batch: int) -> None:
    for part in (0, 1):
        for seed in range(3):  # first run discovers outputs, later ones use bound buffers
            feeds = make_feeds(part, batch, seed)
            assert_close(host_worker.run(part, feeds), expected(reference, part, feeds))


def test_host_pipeline_reuses_buffers_per_batch_size(host_worker: CudaWorker) -> None:
    warm_worker(host_worker, [1, 4], make_feeds)
    before = host_worker.buffer_stats()
    for seed in range(10):
        host_worker.run(0, make_feeds(0, 4, seed))
        host_worker.run(1, make_feeds(1, 1, seed))
    after = host_worker.buffer_stats()
    for key in ("pinned_allocs", "device_allocs", "slots_created"):
        assert after[key] == before[key], key


def test_host_pipeline_a_task_launched_ahead_uses_a_second_buffer_set(parts, reference) -> None:
    """What an engine's driver does: launch the next task before waiting for this one; the two
    in flight take two buffer sets of the shape, reused after; one at a time takes one."""
    with CudaWorker(cuda_place(0, 0), parts, CudaOptions(runtime=HostRuntime())) as worker:
        feeds = [make_feeds(0, 2, s) for s in range(30)]

        def pipelined() -> list[dict[str, np.ndarray]]:
            out, launched = [], worker.launch_here(0, feeds[0])
            for f in feeds[1:]:
                ahead = worker.launch_here(0, f)
                out.append(worker.finish_here(launched))
                launched = ahead
            return out + [worker.finish_here(launched)]

        for got, f in zip(worker.call(pipelined), feeds):
            assert_close(got, expected(reference, 0, f))
        assert worker.buffer_stats()["slots_created"] == 2
    with CudaWorker(cuda_place(0, 0), parts, CudaOptions(runtime=HostRuntime())) as worker:
        for s in range(10):
            worker.run(0, make_feeds(0, 2, s))
        assert worker.buffer_stats()["slots_created"] == 1


def test_host_pipeline_data_dependent_outputs(tmp_path: Path) -> None:
    path = _nonzero_model(tmp_path / "nz.onnx")
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    with CudaWorker(cuda_place(0, 0), [path], CudaOptions(runtime=HostRuntime())) as worker:
        shapes = set()
        for _ in range(6):
            x = rng.standard_normal((5, 8)).astype(np.float32)
            got = worker.run(0, {"x": x})["nz"]
            np.testing.assert_array_equal(got, ref.run(None, {"x": x})[0])
            shapes.add(got.shape)
        assert len(shapes) > 1


def test_host_pipeline_bad_feeds_fail_only_their_task(host_worker: CudaWorker, reference) -> None:
    with pytest.raises(InputError, match="must be float32"):
        host_worker.run(0, {"x": np.zeros((2, 16), np.float64)})
    with pytest.raises(InputError, match="missing"):
        host_worker.run(0, {"z": np.zeros((2, 16), np.float32)})
    with pytest.raises(InputError, match="shape"):
        host_worker.run(1, {"x": np.zeros((2, 3, 8, 8), np.float32)})
    feeds = make_feeds(0, 3)
    assert_close(host_worker.run(0, feeds), expected(reference, 0, feeds))


def timed_run(worker: CudaWorker, part: int, feeds: dict[str, np.ndarray]):
    """The task run in the worker's thread, timed, as an engine runs it: a future of (outputs,
    kernel seconds, start, end)."""
    def run() -> tuple[dict[str, np.ndarray], float | None, float, float]:
        start = time.perf_counter()
        out = worker.run_here(part, feeds, timed=True)
        return out, worker.last_compute_seconds, start, time.perf_counter()

    return worker.spawn(run)


def test_host_pipeline_timing_and_copy_log(parts: list[Path]) -> None:
    log = CopyLog()
    options = CudaOptions(runtime=HostRuntime(), copy_log=log, host_node="numa1", cuda_graphs=False)
    with CudaWorker(cuda_place(0, 0), parts, options) as worker:
        warm_worker(worker, [2], make_feeds)
        # warm-up's copies are logged (2 parts x 2 repeats x 2 buffer sets, as a pipelined
        # worker uses, x 2 directions)
        assert len(log) == 16
        _, seconds, start, end = timed_run(worker, 1, make_feeds(1, 2)).result()
    assert seconds is not None and 0 <= seconds <= end - start
    last = log.records()[-2:]
    assert [(r.src, r.dst, r.nbytes) for r in last] == [
        ("numa1", "cuda0", 2 * 3 * 16 * 16 * 4), ("cuda0", "numa1", 2 * 4 * 16 * 16 * 4 + 2 * 4 * 4)]


def test_host_pipeline_close_frees_everything_and_leaves_no_thread(parts: list[Path]) -> None:
    rt = HostRuntime()
    worker = CudaWorker(cuda_place(0, 0), parts, CudaOptions(runtime=rt)).start()
    warm_worker(worker, [1, 4], make_feeds)
    pending = [worker.submit(1, make_feeds(1, 4, s)) for s in range(20)]
    assert rt.stats.live > 0
    worker.close(cancel_pending=True)
    assert all(f.done() for f in pending)
    assert rt.stats.live == 0
    assert rt.stats.pinned_bytes == 0 and rt.stats.device_bytes == 0
    assert not worker.alive and no_thread_named(worker.name)
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(0, make_feeds(0, 1))
    worker.close()  # idempotent


def test_pinned_pool_reuses_its_buffers_and_frees_them_at_close() -> None:
    rt = HostRuntime()
    pool = PinnedPool(rt.pinned)
    a = pool.array((4, 16), np.float32)
    ptr = a.ctypes.data
    assert a.pinned_ptr == ptr and pool.leased == 1  # what a CUDA worker copies from without staging
    assert a[1:].pinned_ptr is None  # a view of it is not: the worker stages it
    del a
    gc.collect()
    assert pool.leased == 0
    b = pool.array((2, 16), np.float32)  # a smaller batch reuses the buffer (4 KiB size class)
    assert b.ctypes.data == ptr and pool.allocated == 1 and rt.stats.pinned_allocs == 1
    c = pool.array((1024, 16), np.float32)  # 64 KiB: a buffer of its own
    assert c.ctypes.data != ptr and pool.allocated == 2
    del c
    gc.collect()
    pool.close()  # frees the idle buffer now, the leased one once it is back
    assert rt.stats.pinned_frees == 1
    b[:] = 1.0  # still valid memory while leased
    # its last view dies on another thread (a finalizer runs wherever that happens, maybe
    # during another runtime's graph capture): given back, not freed there
    frees_in_finalizers = []

    def drop(box: list) -> None:
        box.clear()
        gc.collect()
        frees_in_finalizers.append(rt.calls["free_pinned"] - 1)

    box = [b]
    del b
    dropper = threading.Thread(target=drop, args=(box,))
    dropper.start()
    dropper.join(10)
    assert frees_in_finalizers == [0] and rt.stats.pinned_frees == 1
    pool.close()  # a later call frees what came back
    assert rt.stats.pinned_bytes == 0 and rt.stats.pinned_frees == 2
    after = pool.array((4, 16), np.float32)  # a closed pool hands out plain numpy memory
    assert after.pinned_ptr is None and rt.stats.pinned_allocs == 2


def test_host_pipeline_copies_a_pool_batch_to_the_device_without_staging(host_worker: CudaWorker, reference) -> None:
    plain = make_feeds(0, 4, seed=3)
    x = host_worker.pinned_pool.array(plain["x"].shape, plain["x"].dtype)
    x[...] = plain["x"]
    before = host_worker.buffer_stats()["staging_skipped"]
    assert_close(host_worker.run(0, {"x": x}), expected(reference, 0, plain))
    assert host_worker.buffer_stats()["staging_skipped"] == before + 1
    assert_close(host_worker.run(0, plain), expected(reference, 0, plain))  # numpy memory: staged
    assert host_worker.buffer_stats()["staging_skipped"] == before + 1


def test_cuda_worker_names_and_what_a_policy_sees(parts: list[Path]) -> None:
    workers = [CudaWorker(cuda_place(d, s), parts, CudaOptions(runtime=HostRuntime())) for d in (0, 1) for s in (0, 1)]
    assert [w.name for w in workers] == ["cuda0.s0", "cuda0.s1", "cuda1.s0", "cuda1.s1"]
    assert [(w.device_id, w.stream_index) for w in workers] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(w.node.name == w.memory_node == w.arch == f"cuda{w.device_id}" for w in workers)
    assert all(w.kind == "cuda" and w.n_cores == 1 and w.last_compute_seconds is None for w in workers)


# ---------------------------------------------------------------- on a GPU
@pytest.fixture
def gpu_worker(parts: list[Path]) -> Iterator[CudaWorker]:
    options = CudaOptions(cudnn_conv_algo_search="HEURISTIC", provider_options=STRICT_FP32)
    worker = CudaWorker(cuda_place(0, 0), parts, options).start()
    yield worker
    worker.close()


@needs_gpu
def test_sessions_compute_on_the_workers_own_stream(gpu_worker: CudaWorker) -> None:
    assert gpu_worker.stream_handle  # a real, non-default stream
    for part in range(gpu_worker.n_parts):
        options = gpu_worker.provider_options(part)["CUDAExecutionProvider"]
        assert options["user_compute_stream"] == str(gpu_worker.stream_handle)
        assert options["device_id"] == "0"
        assert options["cudnn_conv_algo_search"] == "HEURISTIC"
        assert options["do_copy_in_default_stream"] == "0"


@needs_gpu
@pytest.mark.parametrize("batch", [1, 4])
def test_gpu_results_equal_cpu_ort(gpu_worker: CudaWorker, reference, batch: int) -> None:
    for part in (0, 1):
        for seed in range(3):
            feeds = make_feeds(part, batch, seed)
            got, seconds, _, _ = timed_run(gpu_worker, part, feeds).result()
            assert_close(got, expected(reference, part, feeds))
            assert seconds is not None and seconds > 0


@needs_gpu
def test_gpu_warmup_then_timing(parts: list[Path]) -> None:
    with CudaWorker(cuda_place(0, 0), parts) as worker:
        timings = warm_worker(worker, [1, 4], make_feeds)
        assert [(p, b) for p, b, _ in timings] == [(0, 1), (0, 4), (1, 1), (1, 4)]
        assert all(s > 0 for _, _, s in timings)
        assert timed_run(worker, 1, make_feeds(1, 4)).result()[1] > 0


@needs_gpu
def test_two_workers_on_two_streams_run_concurrently_without_mixing(parts, reference) -> None:
    a, b = (CudaWorker(cuda_place(0, s), parts, CudaOptions(provider_options=STRICT_FP32)) for s in (0, 1))
    with a, b:
        assert a.stream_handle != b.stream_handle
        warm_worker(a, [8], make_feeds)
        warm_worker(b, [8], make_feeds)
        jobs = []
        for seed in range(24):
            for worker, offset in ((a, 0), (b, 1000)):
                feeds = make_feeds(1, 8, seed + offset)
                jobs.append((worker, feeds, timed_run(worker, 1, feeds)))
        spans: dict[str, list[tuple[float, float]]] = {a.name: [], b.name: []}
        for worker, feeds, fut in jobs:
            got, _, start, end = fut.result()
            assert_close(got, expected(reference, 1, feeds))
            spans[worker.name].append((start, end))
        overlaps = sum(
            1 for s0, e0 in spans[a.name] for s1, e1 in spans[b.name] if s0 < e1 and s1 < e0
        )
        assert overlaps > 0, "the two workers never had a task in flight at the same time"


@needs_gpu
def test_gpu_pinned_and_device_buffers_are_reused(gpu_worker: CudaWorker) -> None:
    warm_worker(gpu_worker, [4], make_feeds)
    before = gpu_worker.buffer_stats()
    for seed in range(10):
        gpu_worker.run(0, make_feeds(0, 4, seed))
        gpu_worker.run(1, make_feeds(1, 4, seed))
    after = gpu_worker.buffer_stats()
    for key in ("pinned_allocs", "device_allocs", "slots_created"):
        assert after[key] == before[key], key
    gpu_worker.run(0, make_feeds(0, 5))  # a new batch size gets its own buffers
    assert gpu_worker.buffer_stats()["slots_created"] == before["slots_created"] + 1


@needs_gpu
def test_gpu_close_frees_everything_and_leaves_no_thread(parts: list[Path]) -> None:
    worker = CudaWorker(cuda_place(0, 0), parts).start()
    warm_worker(worker, [1, 4], make_feeds)
    futs = [worker.submit(1, make_feeds(1, 4, s)) for s in range(8)]
    worker.close()
    assert all(f.done() and not f.cancelled() for f in futs)
    stats = worker.buffer_stats()
    assert stats["pinned_allocs"] == stats["pinned_frees"] > 0
    assert stats["device_allocs"] == stats["device_frees"] > 0
    assert stats["pinned_bytes"] == 0 and stats["device_bytes"] == 0
    deadline = time.monotonic() + 5
    while not no_thread_named(worker.name) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.alive and no_thread_named(worker.name)


# ---------------------------------------------------------------- CUDA graphs (on by default)
def test_cuda_graphs_give_every_fixed_slot_its_own_graph_and_keep_the_results(parts, reference):
    with CudaWorker(cuda_place(0, 0), parts, CudaOptions(runtime=HostRuntime(), cuda_graphs=True)) as worker:
        assert worker.graph_parts == {0, 1}
        for i in range(5):
            for part in (0, 1):
                for b in (1, 3):
                    feeds = make_feeds(part, b, seed=i)
                    assert_close(worker.submit(part, feeds).result(), expected(reference, part, feeds))
        slots = worker.call(lambda: worker._slots.all())
        assert slots and all(s.graph_id is not None for s in slots)
        assert len({s.graph_id for s in slots}) == len(slots)  # one graph per fixed buffer set
        assert worker.graphs_captured == len(slots)


def test_cuda_graphs_skip_slots_whose_outputs_are_not_fixed(tmp_path):
    path = _nonzero_model(tmp_path / "nz.onnx")
    with CudaWorker(cuda_place(0, 0), [path], CudaOptions(runtime=HostRuntime(), cuda_graphs=True)) as worker:
        for i in range(4):
            worker.submit(0, {"x": np.random.default_rng(i).standard_normal((2, 8)).astype(np.float32)}).result()
        slots = worker.call(lambda: worker._slots.all())
        assert slots and all(s.graph_id is None for s in slots) and worker.graphs_captured == 0


@needs_gpu
def test_cuda_graphs_on_the_gpu_match_the_cpu(parts, reference):
    with CudaWorker(cuda_place(0, 0), parts, CudaOptions(provider_options=STRICT_FP32, cuda_graphs=True)) as worker:
        for i in range(6):
            for part in (0, 1):
                feeds = make_feeds(part, 4, seed=i)
                assert_close(worker.submit(part, feeds).result(), expected(reference, part, feeds), tol=1e-3)
        assert worker.graphs_captured >= 1, "no slot went through its capture"
