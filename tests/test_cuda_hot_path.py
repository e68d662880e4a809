"""The CUDA worker's hot path and failure handling (issue 19), on HostRuntime.

:class:`~staronnx.workers.cudart.HostRuntime` stands in for CUDA (host memory, ORT's CPU
provider) and emulates what the worker must cope with: it counts calls by kind, injects CUDA
errors (sticky ones then fail every call, as a lost context does), and applies CUDA's
global-mode capture rules across threads. Each test names the defect it holds fixed.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import tomllib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from staronnx import MachineSpec, Runtime, RuntimeSpec, partition
from staronnx.perfmodels import PerfModelStore
from staronnx.workers.base import WorkerLost
from staronnx.workers.cuda import CAPTURE_LOCK, CAPTURE_TRIES, CudaOptions, CudaWorker
from staronnx.workers.layout import cuda_place
from staronnx.workers.cudart import CudaError, HostRuntime, capture_safe, is_sticky
from staronnx.partition import PartitionSpec

from _helpers import warm_worker

REPO = Path(__file__).resolve().parents[1]


def _model(path: Path) -> Path:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Relu", ["xw"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), path)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model(tmp_path_factory.mktemp("hot") / "mm.onnx")


@pytest.fixture(scope="module")
def plan(model: Path, tmp_path_factory: pytest.TempPathFactory):
    return partition(model, spec=PartitionSpec(parts=1, profile_runs=1),
                     output_dir=tmp_path_factory.mktemp("hotplan") / "plan")


@pytest.fixture(scope="module")
def reference(model: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])


def feeds(batch: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, 16)).astype(np.float32)}


def check(ref: ort.InferenceSession, x: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    np.testing.assert_allclose(got["y"], ref.run(None, x)[0], rtol=1e-5, atol=1e-5)


def in_thread(worker: CudaWorker, fn):
    """``fn`` in the worker's own thread (where run_here may be called); its result or error."""
    return worker.spawn(fn).result(timeout=30)


# ------------------------------------------------------------------ 1. no hang
def test_an_error_after_the_run_fails_its_task_and_the_worker_keeps_serving(model, reference):
    rt = HostRuntime()
    with CudaWorker(cuda_place(0, 0), [model], CudaOptions(runtime=rt, cuda_graphs=False)) as worker:
        worker.run(0, feeds())
        rt.inject("event_elapsed", 900)  # while reading the task's GPU times, after its run
        fut = worker.submit(0, feeds(seed=1))
        with pytest.raises(CudaError, match="900"):
            fut.result(timeout=5)
        assert worker.alive
        x = feeds(seed=2)
        check(reference, x, worker.run(0, x))  # the slot was released, not left busy
        assert worker.buffer_stats()["slots_created"] == 1


def test_run_here_releases_its_slot_when_the_wait_fails(model, reference):
    rt = HostRuntime()
    with CudaWorker(cuda_place(0, 0), [model], CudaOptions(runtime=rt, cuda_graphs=False)) as worker:
        in_thread(worker, lambda: [worker.run_here(0, feeds()) for _ in range(2)])
        rt.inject("stream_sync", 2)  # out of memory at the wait: not sticky
        with pytest.raises(CudaError, match="cudaError\\(2\\)"):
            in_thread(worker, lambda: worker.run_here(0, feeds(), timed=False))
        x = feeds(seed=3)
        check(reference, x, in_thread(worker, lambda: worker.run_here(0, x, timed=False)))
        assert worker.buffer_stats()["slots_created"] == 1 and worker.lost is None


# ------------------------------------------------------------------ 2. a lost worker leaves the pool
def _host_workers(plan, n: int, per_stream: bool = False) -> tuple[list[CudaWorker], list[HostRuntime]]:
    runtimes = [HostRuntime() for _ in range(n)]
    workers = [CudaWorker(cuda_place(0, i), [plan.part_path(0)],
                          CudaOptions(runtime=r, cuda_graphs=False, thread_per_stream=per_stream)).start()
               for i, r in enumerate(runtimes)]
    return workers, runtimes


@pytest.mark.parametrize("per_stream", [False, True], ids=["thread-per-device", "thread-per-stream"])
@pytest.mark.parametrize("policy", ["eager", "dmda"])
def test_a_sticky_cuda_error_moves_the_workers_tasks_to_the_others(plan, reference, tmp_path, policy, per_stream):
    workers, runtimes = _host_workers(plan, 2, per_stream)
    try:
        with Runtime(plan, spec=RuntimeSpec(policy=policy, workers=workers, store=PerfModelStore(tmp_path))) as rt:
            for _ in range(4):
                rt.run(feeds())
            # an illegal address in the doomed worker's own copy of an input: the context is lost
            # mid-copy. Under eager that is its upload; dmda places at push, so the upload was
            # prefetched on the node's copy stream and the worker's copy is the device-local one
            # into its graph slot
            runtimes[1].inject("copy_h2d" if policy == "eager" else "copy_d2d", 700)
            for wave in range(40):  # until the policy has given the doomed worker a task
                xs = [feeds(seed=i) for i in range(50)]
                futs = [rt.submit(x) for x in xs]
                for x, f in zip(xs, futs):
                    check(reference, x, f.result(timeout=60))  # not one request fails
                stats = rt.stats()
                if stats["dead_workers"]:
                    break
            futs = [rt.submit(feeds(seed=i)) for i in range(100)]  # and the pool goes on without it
            assert all(f.exception(timeout=60) is None for f in futs)
            stats = rt.stats()
    finally:
        for w in workers:
            w.close()
    assert [name for name, _ in stats["dead_workers"]] == [workers[1].name]
    assert stats["requests_failed"] == 0
    assert isinstance(workers[1].lost, CudaError) and workers[1].lost.code == 700


def test_an_error_that_is_not_sticky_fails_one_request_only(plan, reference, tmp_path):
    workers, runtimes = _host_workers(plan, 2)
    try:
        with Runtime(plan, spec=RuntimeSpec(policy="eager", workers=workers, store=PerfModelStore(tmp_path))) as rt:
            for _ in range(4):
                rt.run(feeds())
            runtimes[1].inject("copy_h2d", 2)  # out of memory: this task only
            failed = 0
            for wave in range(40):  # until the policy has given that worker a task
                futs = [rt.submit(feeds(seed=i)) for i in range(50)]
                failed += sum(f.exception(timeout=60) is not None for f in futs)
                if runtimes[1].calls["copy_h2d"] > 8:
                    break
            stats = rt.stats()
    finally:
        for w in workers:
            w.close()
    assert failed == 1 and stats["dead_workers"] == [] and workers[1].lost is None


def test_a_lost_worker_says_so_on_every_later_task(model):
    rt = HostRuntime()
    with CudaWorker(cuda_place(0, 0), [model], CudaOptions(runtime=rt, cuda_graphs=False)) as worker:
        worker.run(0, feeds())
        rt.inject("copy_d2h", 719)
        with pytest.raises(WorkerLost):
            in_thread(worker, lambda: worker.run_here(0, feeds()))
        with pytest.raises(WorkerLost):
            worker.run(0, feeds())


@pytest.mark.parametrize("call", ["copy_h2d", "stream_sync"], ids=["at-launch", "at-the-wait"])
def test_a_stream_lost_during_warm_up_fails_the_runtime_instead_of_hanging(plan, tmp_path, call):
    """Warm-up runs tasks pinned to each CUDA worker and waits for them. A stream that lost
    its context on the first one (a sticky error as it launched or as it was waited for)
    left the world without that task: it was neither in the pinned queue nor among the
    launched ones that a lost worker's tasks are failed from, so its future never settled
    and Runtime() hung for good instead of saying the GPU is unusable."""
    rt = HostRuntime()
    rt.inject(call, 700)
    outcome: list[BaseException | str] = []

    def build() -> None:
        try:
            Runtime(plan, MachineSpec(groups="none", cuda_streams=1, cuda_graphs=False),
                    RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path), warmup=(2,),
                                cuda=CudaOptions(runtime=rt))).close()
            outcome.append("started")
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            outcome.append(exc)

    t = threading.Thread(target=build, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "Runtime() waits for good for its lost stream's warm-up task"
    assert len(outcome) == 1 and isinstance(outcome[0], WorkerLost), outcome


def test_ort_text_of_a_sticky_error_is_recognised():
    assert is_sticky(RuntimeError("CUDA failure 700: an illegal memory access was encountered"))
    assert not is_sticky(RuntimeError("CUDA failure 2: out of memory"))
    assert not is_sticky(CudaError("cudaMalloc", 2, "cudaErrorMemoryAllocation", "out of memory"))


# ------------------------------------------------------------------ 3. captures vs other threads
def _capture_in_background(model: Path, seconds: float) -> tuple[CudaWorker, threading.Thread, threading.Event]:
    worker = CudaWorker(cuda_place(0, 0), [model], CudaOptions(runtime=HostRuntime(capture_seconds=seconds))).start()
    worker.run(0, feeds())  # discovery: the slot gets its graph id
    started = threading.Event()

    def capture() -> None:
        started.set()
        try:
            worker.run(0, feeds())  # ORT's first run of the graph id: the capture, held open `seconds`
        except CudaError:
            pass  # a broken capture: what graph_stats() then says is the test's business

    thread = threading.Thread(target=capture)
    thread.start()
    started.wait(5)
    time.sleep(seconds / 4)
    return worker, thread, started


def test_a_worker_starting_during_another_workers_capture_breaks_nothing(model, reference):
    capturing, thread, _ = _capture_in_background(model, 0.6)
    try:
        # session creation, stream and buffer allocation while the capture is open
        with CudaWorker(cuda_place(0, 1), [model], CudaOptions(runtime=HostRuntime(), cuda_graphs=False)) as other:
            x = feeds(seed=5)
            check(reference, x, other.run(0, x))
        thread.join(10)
        assert capturing.graph_stats() == {"captured": 1, "failed": 0, "replays": 0}
        x = feeds(seed=6)
        check(reference, x, capturing.run(0, x))
        assert capturing.graph_stats()["replays"] == 1
    finally:
        thread.join(10)
        capturing.close()


def test_code_that_is_not_ours_is_safe_during_a_capture_inside_capture_safe(model):
    capturing, thread, _ = _capture_in_background(model, 0.6)
    rt = HostRuntime()
    try:
        with capture_safe(rt):  # what a plain ORT session's thread does beside staronnx
            rt.pinned(64).free()
        # the same call from a thread left in CUDA's default global mode: CUDA's rule holds
        with pytest.raises(CudaError, match="900"):
            rt.pinned(64)
        thread.join(10)
        assert capturing.graph_stats()["failed"] == 1  # and the emulated capture saw it
    finally:
        thread.join(10)
        capturing.close()


# ------------------------------------------------------------------ 4. failed captures are said
def test_a_failed_capture_is_retried_then_dropped_with_a_warning(model, reference, caplog):
    rt = HostRuntime()
    with caplog.at_level(logging.WARNING, logger="staronnx.workers.cuda"), \
            CudaWorker(cuda_place(0, 0), [model], CudaOptions(runtime=rt)) as worker:
        rt.inject("capture", 901, times=2)
        results = []
        for i in range(8):
            try:
                results.append(worker.run(0, feeds(seed=i)))
            except CudaError:
                results.append(None)
        assert worker.graph_stats() == {"captured": 0, "failed": 2, "replays": 0}
        assert results.count(None) == 2  # the two capturing tasks; every other one ran
        x = feeds(seed=9)
        check(reference, x, worker.run(0, x))
    text = caplog.text
    assert "capture of part 0" in text and "901" in text and "runs without a graph" in text
    assert "pre-allocated outputs" not in text


def test_the_first_run_of_a_graph_id_is_the_capture_and_waits_for_the_capture_lock(model, reference):
    """ORT 1.31 captures inside the first run of a new gpu_graph_id (regular run, capture and
    replay in one call): that run is the one that must take the capture lock, and the counts
    must agree with what ORT did (a worker that took it for a plain run captured without the
    lock, and counted one capture late and one replay short)."""
    rt = HostRuntime()
    with CudaWorker(cuda_place(0, 0), [model], CudaOptions(runtime=rt)) as worker:
        worker.run(0, feeds())  # discovery: the slot gets its graph id
        x = feeds(seed=1)
        with CAPTURE_LOCK:  # another capture is under way somewhere
            fut = worker.submit(0, x)
            time.sleep(0.3)
            assert not fut.done(), "the first run of a graph id captured without the capture lock"
        check(reference, x, fut.result(timeout=30))
        assert rt.graph_events == {"captured": 1}
        assert worker.graph_stats() == {"captured": 1, "failed": 0, "replays": 0}
        for i in range(3):
            x = feeds(seed=2 + i)
            check(reference, x, worker.run(0, x))
        assert rt.graph_events == {"captured": 1, "replayed": 3}
        assert worker.graph_stats() == {"captured": 1, "failed": 0, "replays": 3}


def _warmed_runtime(plan, rt: HostRuntime, store: Path) -> Runtime:
    """A runtime on one stream of ``rt`` that warms batch size 4 up (runtime.engine.warm_up)."""
    return Runtime(plan, MachineSpec("none", 1),
                   RuntimeSpec(policy="eager", store=PerfModelStore(store), cuda=CudaOptions(runtime=rt), warmup=(4,)))


def test_a_capture_that_fails_at_warm_up_costs_the_graph_not_the_warm_up(plan, reference, caplog, tmp_path):
    """The first run of a graph id fails its capture (each of its tries, on both buffer sets a
    pipelined worker warms up): warm-up still succeeds, the shape runs without a graph."""
    rt = HostRuntime()
    rt.inject("capture", 901, times=2 * CAPTURE_TRIES)
    with caplog.at_level(logging.WARNING, logger="staronnx.workers.cuda"), _warmed_runtime(plan, rt, tmp_path) as runtime:
        worker = runtime.workers[0]
        assert worker.graph_stats() == {"captured": 0, "failed": 2 * CAPTURE_TRIES, "replays": 0}
        for i in range(3):
            x = feeds(seed=i)
            check(reference, x, runtime.run(x))
        assert rt.calls["capture"] == 2 * CAPTURE_TRIES and not rt.graph_events
    assert "runs without a graph" in caplog.text


def test_a_capture_that_fails_once_at_warm_up_is_captured_by_its_second_try(plan, reference, tmp_path):
    rt = HostRuntime()
    rt.inject("capture", 901, times=1)
    with _warmed_runtime(plan, rt, tmp_path) as runtime:
        worker = runtime.workers[0]
        # the round whose capture failed ran again (the other buffer set replaying), then one more
        assert worker.graph_stats() == {"captured": 2, "failed": 1, "replays": 3}
        x = feeds(seed=7)
        check(reference, x, runtime.run(x))
        assert worker.graph_stats()["replays"] == 4
        assert rt.graph_events == {"captured": 2, "replayed": 4}


def test_a_second_try_captures(model, reference):
    rt = HostRuntime()
    with CudaWorker(cuda_place(0, 0), [model], CudaOptions(runtime=rt)) as worker:
        rt.inject("capture", 901, times=1)
        for i in range(8):
            try:
                worker.run(0, feeds(seed=i))
            except CudaError:
                pass
        stats = worker.graph_stats()
        assert stats["captured"] == 1 and stats["failed"] == 1 and stats["replays"] >= 1


# ------------------------------------------------------------------ 5. no exception per run
def _runtime_errors_raised_in(fn) -> int:
    """RuntimeErrors raised (and maybe caught) anywhere in Python while ``fn`` runs."""
    tool = sys.monitoring.PROFILER_ID
    count = {"n": 0}

    def on_raise(code, offset, exc):
        if isinstance(exc, RuntimeError):
            count["n"] += 1

    sys.monitoring.use_tool_id(tool, "staronnx-test")
    try:
        sys.monitoring.register_callback(tool, sys.monitoring.events.RAISE, on_raise)
        sys.monitoring.set_events(tool, sys.monitoring.events.RAISE)
        fn()
    finally:
        sys.monitoring.set_events(tool, 0)
        sys.monitoring.register_callback(tool, sys.monitoring.events.RAISE, None)
        sys.monitoring.free_tool_id(tool)
    return count["n"]


@pytest.mark.parametrize("graphs", [False, True])
def test_no_exception_is_raised_inside_ort_per_run(model, graphs):
    with CudaWorker(cuda_place(0, 0), [model], CudaOptions(runtime=HostRuntime(), cuda_graphs=graphs)) as worker:
        warm_worker(worker, [4], lambda p, b: feeds(b))
        x = feeds()
        raised = _runtime_errors_raised_in(
            lambda: in_thread(worker, lambda: [worker.run_here(0, x, timed=False) for _ in range(50)]))
    assert raised == 0


# ------------------------------------------------------------------ 6. CUDA calls per task
def _calls_per_task(worker: CudaWorker, rt: HostRuntime, timed: bool, n: int = 20) -> dict[str, float]:
    x = feeds()
    in_thread(worker, lambda: worker.run_here(0, x, timed=timed))
    before = dict(rt.calls)
    in_thread(worker, lambda: [worker.run_here(0, x, timed=timed) for _ in range(n)])
    return {k: (v - before.get(k, 0)) / n for k, v in rt.calls.items() if v != before.get(k, 0)}


@pytest.mark.parametrize("graphs", [False, True])
def test_a_steady_task_is_one_copy_in_one_copy_out_and_one_wait(model, graphs):
    rt = HostRuntime()
    with CudaWorker(cuda_place(0, 0), [model], CudaOptions(runtime=rt, cuda_graphs=graphs)) as worker:
        warm_worker(worker, [4], lambda p, b: feeds(b))
        assert _calls_per_task(worker, rt, timed=False) == {"copy_h2d": 1, "copy_d2h": 1, "stream_sync": 1}
        timed = _calls_per_task(worker, rt, timed=True)
        assert timed == {"copy_h2d": 1, "copy_d2h": 1, "event_record": 4, "event_sync": 1, "event_elapsed": 3}
        if graphs:
            assert worker.graph_stats()["captured"] == 2 and worker.graph_stats()["replays"] >= 40  # 2 buffer sets


def test_ort_is_told_not_to_synchronise_the_stream(model):
    with CudaWorker(cuda_place(0, 0), [model], CudaOptions(runtime=HostRuntime())) as worker:
        worker.run(0, feeds())
        options = [worker._run_options] + [s.run_options for s in in_thread(worker, worker._slots.all)]
        for o in options:
            assert o.get_run_config_entry("disable_synchronize_execution_providers") == "1"
            assert o.get_run_config_entry("gpu_graph_id")


def test_through_a_runtime_events_stop_once_the_perf_model_is_calibrated(plan, reference, tmp_path):
    rt = HostRuntime()
    with Runtime(plan,
                 MachineSpec(groups="none", cuda_streams=1),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path), cuda=CudaOptions(runtime=rt))) as runtime:
        # StarPU's calibration: 10 accepted samples per footprint; a sample 50 % off the mean is
        # not accepted, so on a busy host it takes more runs: until 20 in a row time nothing
        quiet, i = 0, 0
        while quiet < 20 and i < 1000:
            timed = rt.calls.get("event_elapsed", 0)
            runtime.run(feeds(seed=i))
            quiet = quiet + 1 if rt.calls.get("event_elapsed", 0) == timed else 0
            i += 1
        before = dict(rt.calls)
        xs = [feeds(seed=i) for i in range(50)]
        for x, f in zip(xs, [runtime.submit(x) for x in xs]):
            check(reference, x, f.result(timeout=30))
        delta = {k: v - before.get(k, 0) for k, v in rt.calls.items()}
    assert delta.get("event_elapsed", 0) == 0  # no timing left
    assert delta["copy_h2d"] == 50 and delta["copy_d2h"] == 50
    # one wait per task: on the stream, or on the one event a task launched behind it recorded
    assert delta.get("event_record", 0) == delta.get("event_sync", 0)
    assert delta.get("event_sync", 0) + delta.get("stream_sync", 0) == 50


# ------------------------------------------------------------------ 7/8. nothing allocated or freed per task
def test_eviction_frees_only_when_a_new_buffer_set_is_made(model):
    rt = HostRuntime()
    with CudaWorker(cuda_place(0, 0), [model], CudaOptions(runtime=rt, cuda_graphs=False, max_slots=2)) as worker:
        for b in (1, 2, 3):  # the third signature retires the least recently used slot
            worker.run(0, feeds(b))
        frees = rt.stats.device_frees + rt.stats.pinned_frees
        allocs = rt.stats.device_allocs + rt.stats.pinned_allocs
        for _ in range(10):
            for b in (2, 3):
                worker.run(0, feeds(b))
        assert rt.stats.device_frees + rt.stats.pinned_frees == frees
        assert rt.stats.device_allocs + rt.stats.pinned_allocs == allocs


def test_a_graph_costs_one_capture_at_warm_up(model):
    rt = HostRuntime()
    with CudaWorker(cuda_place(0, 0), [model], CudaOptions(runtime=rt)) as worker:
        warm_worker(worker, [1, 4], lambda p, b: feeds(b), parallel=1)
        assert rt.calls["capture"] == 2  # one per (part, batch size), nothing more exclusive
        assert worker.graph_stats() == {"captured": 2, "failed": 0, "replays": 2}
        assert rt.graph_events == {"captured": 2, "replayed": 2}


# ------------------------------------------------------------------ 9. install
def test_the_gpu_extra_pins_one_cuda_major():
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    ort_gpu = next(r for r in extra if r.startswith("onnxruntime-gpu"))
    bindings = next(r for r in extra if r.startswith("cuda-bindings"))
    assert "<" in ort_gpu and ">=" in ort_gpu  # a range whose wheels are all built for CUDA 13
    assert ">=13" in bindings.replace(" ", "") and "<14" in bindings.replace(" ", "")
    assert not any(r.startswith("cuda-python") for r in extra)


# ------------------------------------------------------------------ graphs captured at warm-up, not while serving
def test_a_runtime_captures_its_warm_up_sizes_one_worker_at_a_time_and_never_while_serving(plan, reference, tmp_path):
    """ORT keeps CUDA graphs per thread: a device's second stream, driven by the device's
    driver thread, is warmed up there (not on a thread of its own), so serving only replays."""
    rt = HostRuntime()
    with Runtime(plan,
                 MachineSpec(groups="none", cuda_streams=2),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path), warmup=(4, 1, 2),
                             cuda=CudaOptions(runtime=rt))) as runtime:
        assert runtime.preferred_batch_sizes == (1, 2, 4)
        workers = runtime.workers
        # 3 sizes x 2 buffer sets (a pipelined worker launches a task behind another)
        assert [w.graph_stats()["captured"] for w in workers] == [6, 6]
        assert rt.calls["capture"] == 12
        for b in (1, 2, 3, 4):  # 3 was not warmed up: it runs, without a capture stalling anyone
            xs = [feeds(b, seed=i) for i in range(10)]
            for x, f in zip(xs, [runtime.submit(x) for x in xs]):
                check(reference, x, f.result(timeout=30))
        assert rt.calls["capture"] == 12
        stats = runtime.stats()["workers"]
        warm = 2 * 6  # one replay per buffer set at warm-up
        assert sum(row["graphs"]["replays"] for row in stats.values()) == warm + 30
        # what the (per-thread) CUDA provider did: every graph replayed where it was captured
        assert rt.graph_events == {"captured": 12, "replayed": warm + 30}


def test_a_graph_replayed_from_another_thread_is_captured_again_and_counted(model, reference, caplog):
    rt = HostRuntime()
    with caplog.at_level(logging.WARNING, logger="staronnx.workers.cuda"), \
            CudaWorker(cuda_place(0, 0), [model], CudaOptions(runtime=rt)) as worker:
        warm_worker(worker, [4], lambda p, b: feeds(b), parallel=1)  # on the worker's own thread
        assert rt.graph_events == {"captured": 1, "replayed": 1}
        out: list[dict] = []
        x = feeds(seed=3)
        other = threading.Thread(target=lambda: (worker.adopt_thread(), out.append(
            worker.finish_here(worker.launch_here(0, x, timed=False)))))
        other.start()
        other.join(30)
        check(reference, x, out[0])
        assert rt.graph_events == {"captured": 2, "replayed": 1}
        assert worker.graph_stats() == {"captured": 2, "failed": 0, "replays": 1}
        check(reference, x, worker.run(0, x))  # back on its own thread: its graph is still there
        assert rt.graph_events == {"captured": 2, "replayed": 2}
        assert worker.graph_stats() == {"captured": 2, "failed": 0, "replays": 2}
    assert "captured again" in caplog.text and "per thread" in caplog.text


def test_without_graphs_there_is_nothing_to_pad_to(plan, tmp_path):
    with Runtime(plan,
                 MachineSpec(groups="none", cuda_streams=1, cuda_graphs=False),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path), warmup=(1, 2),
                             cuda=CudaOptions(runtime=HostRuntime()))) as runtime:
        assert runtime.preferred_batch_sizes == ()
        assert "graphs" not in runtime.stats()["workers"]["cuda0.s0"]


# ------------------------------------------------------------------ one driver thread per device
@pytest.mark.parametrize("per_stream", [False, True], ids=["thread-per-device", "thread-per-stream"])
def test_one_thread_drives_every_stream_of_a_device_unless_asked_otherwise(plan, reference, tmp_path, per_stream):
    """StarPU's STARPU_CUDA_THREAD_PER_DEV: N streams cost the host one thread (one GIL
    contender, one set of context switches), so more streams are never slower than one."""
    host = HostRuntime()
    with Runtime(plan,
                 MachineSpec(groups="none", cuda_streams=3, cuda_graphs=False, thread_per_stream=per_stream),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path), cuda=CudaOptions(runtime=host))) as rt:
        host.copy_threads.clear()
        xs = [feeds(seed=i) for i in range(120)]
        futs = [rt.submit(x) for x in xs]
        for x, f in zip(xs, futs):
            check(reference, x, f.result(timeout=60))
        stats = rt.stats()
    tasks = {name: w["tasks"] for name, w in stats["workers"].items()}
    assert sum(tasks.values()) == 120
    if per_stream:  # each stream that ran something did it from a thread of its own
        assert len(host.copy_threads) == sum(n > 0 for n in tasks.values())
    else:
        assert len(host.copy_threads) == 1
        assert all(n > 0 for n in tasks.values()), tasks  # every stream was fed by that one thread


def test_a_driven_stream_placed_on_by_dmda_runs_its_own_tasks(plan, reference, tmp_path):
    """dmda places each task on one stream at push: the device's thread serves every stream's
    own queue (a task is never lost in a stream nobody pops)."""
    host = HostRuntime()
    with Runtime(plan,
                 MachineSpec(groups="none", cuda_streams=2, cuda_graphs=False),
                 RuntimeSpec(policy="dmda", store=PerfModelStore(tmp_path), cuda=CudaOptions(runtime=host))) as rt:
        for wave in range(5):
            xs = [feeds(seed=wave * 40 + i) for i in range(40)]
            futs = [rt.submit(x) for x in xs]
            for x, f in zip(xs, futs):
                check(reference, x, f.result(timeout=60))
        stats = rt.stats()
    assert stats["requests_done"] == 200 and stats["requests_failed"] == 0
    assert all(w["tasks"] > 0 for w in stats["workers"].values()), stats["workers"]
    # dmda's prefetches are uploaded by the submitting thread as it places each task; a task
    # whose prefetch could not start (a busy host's timing decides) is uploaded by the thread
    # that runs it: one thread for both streams
    assert len(host.copy_threads - {threading.get_native_id()}) <= 1


# ------------------------------------------------------------------ results handed out in groups
def test_a_quietly_settled_future_is_done_at_once_and_wakes_its_callers_when_announced():
    from concurrent.futures import FIRST_COMPLETED, wait

    from staronnx.runtime.task import RequestFuture, announce, settle_quietly

    cond = threading.Condition()
    f, g, cancelled = RequestFuture(1, cond), RequestFuture(2, cond), RequestFuture(3, cond)
    got: dict[str, object] = {}
    early: list[int] = []
    f.add_done_callback(lambda fut: early.append(fut.request_id))
    blocked = threading.Thread(target=lambda: got.update(result=f.result(timeout=10)))
    waiting = threading.Thread(target=lambda: got.update(wait=wait([g, cancelled], timeout=10,
                                                                   return_when=FIRST_COMPLETED)))
    blocked.start()
    waiting.start()
    time.sleep(0.05)
    assert settle_quietly(f, {"y": 1}, True) and settle_quietly(g, ValueError("bad"), False)
    assert f.done() and f.result() == {"y": 1} and g.exception().args == ("bad",)  # seen at once...
    late = []
    f.add_done_callback(lambda fut: late.append(fut.request_id))  # added after: runs now, as with any Future
    assert late == [1]
    time.sleep(0.05)
    assert blocked.is_alive() and waiting.is_alive() and early == []  # ...but nobody was woken yet
    announce([f, g])
    blocked.join(5)
    waiting.join(5)
    assert got["result"] == {"y": 1} and g in got["wait"].done  # type: ignore[union-attr]
    assert early == [1]
    assert cancelled.cancel() and not settle_quietly(cancelled, {"y": 2}, True)
    assert cancelled.cancelled()


def test_a_driver_wakes_the_callers_of_finished_requests_in_groups_not_per_task(plan, reference, tmp_path,
                                                                                monkeypatch):
    """2,000 requests in flight on one stream, a caller blocked on the first: the driver hands
    results out in groups (fewer wake-ups than tasks), and the first caller is woken long
    before the last request ends (a group is bounded: ANNOUNCE_EVERY results, ANNOUNCE_AFTER_S)."""
    from staronnx.runtime import engine

    groups: list[int] = []
    real = engine.announce
    monkeypatch.setattr(engine, "announce", lambda futures: (groups.append(len(futures)), real(futures)))
    with Runtime(plan,
                 MachineSpec(groups="none", cuda_streams=1, cuda_graphs=False),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path),
                             cuda=CudaOptions(runtime=HostRuntime()))) as rt:
        rt.run(feeds())
        groups.clear()
        x = feeds(seed=1)
        futures = [rt.submit(x) for _ in range(2000)]
        check(reference, x, futures[0].result(timeout=30))
        done_when_woken = sum(f.done() for f in futures)
        for f in futures:
            f.result(timeout=30)
    assert done_when_woken < len(futures), "the first caller was only woken at the very end"
    assert max(groups) <= engine.ANNOUNCE_EVERY
    assert sum(groups) <= len(futures) and len(groups) < len(futures) / 2, groups[:40]
