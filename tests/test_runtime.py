"""The native engine end to end: real ORT sessions on real pinned workers, every policy."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from staronnx import InferenceSession, InputError, partition
from staronnx import SessionSpec
from staronnx.calibrate import start_workers
from staronnx.errors import StaronnxError
from staronnx.perfmodels import PerfModelStore
from staronnx.runtime.engine import EngineClosed
from staronnx.runtime.policies import POLICIES
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.runtime.task import TaskError
from staronnx.verify import random_plan_feeds
from staronnx.zoo import inception
from staronnx.partition import PartitionSpec
from staronnx.workers.layout import MachineSpec


@pytest.fixture(scope="module")
def plan3(tmp_path_factory):
    root = tmp_path_factory.mktemp("rt")
    model = root / "inception.onnx"
    onnx.save(inception(blocks=2, channels=8, size=16), str(model))
    p = partition(model, [0.5, 0.3, 0.2], PartitionSpec(profile_runs=2), output_dir=root / "plan")
    p.source_model = model  # type: ignore[attr-defined]
    return p


@pytest.fixture
def store(tmp_path):
    return PerfModelStore(tmp_path / "home")


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_matches_reference(plan3, store, policy, two_groups):
    before = _threads()
    feeds = [random_plan_feeds(plan3, b, seed=i) for i, b in enumerate([1, 3, 2, 4] * 5)]
    with Runtime(plan3, MachineSpec(groups=two_groups), RuntimeSpec(policy=policy, store=store)) as rt:
        futures = [rt.submit(f) for f in feeds]
        results = [f.result(timeout=60) for f in futures]
        stats = rt.stats()
    for f, r in zip(feeds, results):
        ref = plan3.run_reference(f)
        np.testing.assert_array_equal(r["logits"], ref["logits"])
    assert stats["requests_done"] == len(feeds)
    assert sum(row["tasks"] for row in stats["tasks"].values()) == len(feeds) * plan3.k
    assert _threads() == before


def test_thousand_requests_from_eight_threads(plan3, store, two_groups):
    feeds = [random_plan_feeds(plan3, 1, seed=i) for i in range(16)]
    refs = [plan3.run_reference(f)["logits"] for f in feeds]
    with Runtime(plan3, MachineSpec(groups=two_groups), RuntimeSpec(policy="heft", store=store)) as rt:

        def client(c: int) -> int:
            ok = 0
            for i in range(125):
                j = (c * 125 + i) % len(feeds)
                out = rt.submit(feeds[j]).result(timeout=120)
                ok += bool(np.array_equal(out["logits"], refs[j]))
            return ok

        with ThreadPoolExecutor(8) as pool:
            assert sum(pool.map(client, range(8))) == 1000
        assert rt.stats()["requests_done"] == 1000


def test_failing_task_fails_only_its_request(fragile_plan, store, two_groups):
    plan = fragile_plan
    good = {"x": np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)}
    bad = {"x": np.ones((2, 5), np.float32)}
    with Runtime(plan, MachineSpec(groups=two_groups), RuntimeSpec(policy="dmda", store=store)) as rt:
        futures = [rt.submit(bad if i % 3 == 0 else good) for i in range(30)]
        for i, f in enumerate(futures):
            if i % 3 == 0:
                with pytest.raises(TaskError) as info:
                    f.result(timeout=30)
                assert info.value.__cause__ is not None  # ORT's own error
            else:
                np.testing.assert_allclose(f.result(timeout=30)["y"], plan.run_reference(good)["y"])
        assert rt.stats()["requests_failed"] == 10
        # and it keeps serving
        np.testing.assert_allclose(rt.run(good)["y"], plan.run_reference(good)["y"])


def test_bad_input_is_rejected_before_any_task(plan3, store, two_groups):
    with Runtime(plan3, MachineSpec(groups=two_groups), RuntimeSpec(policy="eager", store=store)) as rt:
        good = random_plan_feeds(plan3, 2)
        with pytest.raises(ValueError, match="'x'.*float32.*float64"):
            rt.submit({"x": good["x"].astype(np.float64)})
        with pytest.raises(InputError, match="missing"):
            rt.submit({})
        with pytest.raises(InputError, match="axis 1 must be 3"):
            rt.submit({"x": np.zeros((2, 4, 16, 16), np.float32)})
        assert rt.stats()["requests_done"] == 0
        rt.run(good)
    with pytest.raises(EngineClosed):
        rt.submit(good)


class _Crash(BaseException):
    """Not an Exception: kills the worker loop rather than failing one task."""


def test_dead_worker_tasks_are_replaced(plan3, store, two_groups):
    workers = start_workers(plan3, MachineSpec(groups=two_groups))
    original = workers[0].run_here
    calls = {"n": 0}

    def flaky(part, feeds, *rest):
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Crash("simulated worker crash")
        return original(part, feeds, *rest)

    workers[0].run_here = flaky
    feeds = [random_plan_feeds(plan3, 2, seed=i) for i in range(40)]
    try:
        with Runtime(plan3, spec=RuntimeSpec(policy="eager", workers=workers, store=store)) as rt:
            results = [f.result(timeout=60) for f in [rt.submit(x) for x in feeds]]
            stats = rt.stats()
    finally:
        for w in workers:
            w.close()
    assert len(stats["dead_workers"]) == 1 and "crash" in stats["dead_workers"][0][1]
    for f, r in zip(feeds, results):
        np.testing.assert_array_equal(r["logits"], plan3.run_reference(f)["logits"])


def test_map_keeps_order_and_bounds_in_flight(plan3, store, two_groups):
    feeds = [random_plan_feeds(plan3, 1, seed=i) for i in range(30)]
    submitted = []

    def stream():
        for i, f in enumerate(feeds):
            submitted.append(i)
            yield f

    with Runtime(plan3, MachineSpec(groups=two_groups), RuntimeSpec(policy="dmdas", store=store)) as rt:
        out = []
        for r in rt.map(stream(), max_in_flight=4):
            assert len(submitted) - len(out) <= 4 + 1
            out.append(r)
    for f, r in zip(feeds, out):
        np.testing.assert_array_equal(r["logits"], plan3.run_reference(f)["logits"])


def test_futures_are_awaitable(plan3, store, two_groups):
    feeds = [random_plan_feeds(plan3, 1, seed=i) for i in range(5)]
    with Runtime(plan3, MachineSpec(groups=two_groups), RuntimeSpec(policy="ws", store=store)) as rt:

        async def main():
            return await asyncio.gather(*(rt.submit(f) for f in feeds))

        results = asyncio.run(main())
    assert len(results) == 5 and all("logits" in r for r in results)


def test_runtime_futures_behave_like_futures(plan3, store, two_groups):
    """Runtime futures are light (one Condition per engine, none per request): waits,
    callbacks, timeouts and cancels must still behave as concurrent.futures' own."""
    from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, as_completed, wait
    from concurrent.futures import TimeoutError as FutureTimeout

    feeds = [random_plan_feeds(plan3, 2, seed=i) for i in range(12)]
    with Runtime(plan3, MachineSpec(groups=two_groups), RuntimeSpec(policy="eager", store=store)) as rt:
        futs = [rt.submit(f) for f in feeds]
        called: list[object] = []
        futs[0].add_done_callback(called.append)
        done, _ = wait(futs[:3], return_when=FIRST_COMPLETED, timeout=60)
        assert done
        assert sorted(map(id, as_completed(futs, timeout=60))) == sorted(map(id, futs))
        assert called == [futs[0]]
        late: list[object] = []
        futs[1].add_done_callback(late.append)  # on a done future: called at once
        assert late == [futs[1]]
        for f, x in zip(futs, feeds):
            np.testing.assert_array_equal(f.result(timeout=0)["logits"], plan3.run_reference(x)["logits"])
        assert not futs[0].cancel() and futs[0].exception() is None
        assert set(vars(Future())) <= set(dir(futs[0]))  # built without Future.__init__
    # a pending future: timeouts, then a cancel wakes a caller blocked in result()
    from staronnx.runtime.task import RequestFuture

    pending = RequestFuture(7, threading.Condition())
    with pytest.raises(FutureTimeout):
        pending.result(timeout=0.01)
    got: list[BaseException] = []

    def block() -> None:
        try:
            pending.result(timeout=30)
        except CancelledError as exc:
            got.append(exc)

    t = threading.Thread(target=block)
    t.start()
    while not pending._waiter_list:
        threading.Event().wait(0.001)
    assert pending.cancel()
    t.join(10)
    assert not t.is_alive() and len(got) == 1


def test_finished_requests_leave_nothing_for_the_cycle_collector(plan3, store, two_groups):
    """A request and its tasks pointed at each other, so every finished request waited for
    the cycle collector (a dozen objects each), whose full collections stop every thread for
    tens of ms under load. Reference counting alone must free them."""
    import gc

    feeds = [random_plan_feeds(plan3, 2, seed=i) for i in range(40)]
    with Runtime(plan3, MachineSpec(groups=two_groups), RuntimeSpec(policy="heft", store=store)) as rt:
        for f in feeds[:4]:
            rt.run(f)
        gc.collect()
        gc.disable()
        try:
            futs = [rt.submit(f) for f in feeds]
            for f in futs:
                f.result(timeout=60)
            del futs, f
            garbage = gc.collect()
        finally:
            gc.enable()
    assert garbage < len(feeds), garbage  # was about 11 a request


def test_trace_has_worker_lanes_tasks_and_flows(plan3, store, tmp_path, two_groups):
    path = tmp_path / "trace.json"
    with Runtime(plan3, MachineSpec(groups=two_groups), RuntimeSpec(policy="heft", trace=path, store=store)) as rt:
        for f in [rt.submit(random_plan_feeds(plan3, 2, seed=i)) for i in range(6)]:
            f.result()
    events = json.loads(path.read_text())["traceEvents"]
    lanes = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    tasks = [e for e in events if e["ph"] == "X"]
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert len(lanes) == 2 and len(tasks) == 6 * plan3.k
    deps = sum(len(d) for d in plan3.dependencies())
    assert len(flows) == 2 * 6 * deps
    from staronnx.runtime.gantt import plot_trace

    png = plot_trace(path, tmp_path / "gantt.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_inference_session_facade_matches_onnxruntime(plan3, store, two_groups):
    model = plan3.source_model
    ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(3).standard_normal((2, 3, 16, 16)).astype(np.float32)
    with InferenceSession(plan3.root,
                          spec=SessionSpec(cpu_groups=two_groups, runtime=RuntimeSpec(store=store))) as sess:
        assert [i.name for i in sess.get_inputs()] == [i.name for i in ref.get_inputs()]
        assert sess.get_inputs()[0].type == ref.get_inputs()[0].type
        assert [o.name for o in sess.get_outputs()] == [o.name for o in ref.get_outputs()]
        (got,) = sess.run(None, {"x": x})
    (want,) = ref.run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_serving_calibrates_models(plan3, tmp_path, two_groups):
    store = PerfModelStore(tmp_path / "h")
    feeds = random_plan_feeds(plan3, 2)
    with Runtime(plan3, MachineSpec(groups=two_groups), RuntimeSpec(policy="dmda", store=store)) as rt:
        for f in [rt.submit(feeds) for _ in range(60)]:
            f.result()
    rows = store.rows(plan3.hash)
    assert {r.part for r in rows} == set(range(plan3.k))
    assert all(r.n >= 1 for r in rows)


def _samples(store: PerfModelStore, plan) -> dict[tuple[int, str, int], int]:
    return {(r.part, r.arch, r.batch): r.n for r in store.rows(plan.hash)}


def _judged(store: PerfModelStore, plan) -> dict[tuple[int, str, int], int]:
    """Samples the models have judged: accepted (n) plus rejected as outliers (nerror)."""
    return {(r.part, r.arch, r.batch): r.n + r.nerror for r in store.rows(plan.hash)}


def test_calibrate_modes_freeze_keep_or_replace_the_models(plan3, tmp_path, monkeypatch, two_groups):
    # StarPU's STARPU_CALIBRATE: 0 stops recording once an entry is calibrated, 1 records every
    # execution, 2 starts from nothing and overwrites the stored models at close
    store = PerfModelStore(tmp_path / "h")
    feeds = random_plan_feeds(plan3, 2)

    def serve(n: int, **kw) -> int:
        """Serve ``n`` requests; the executions the models were offered (their journal: every
        verdict, accepted, outlier or reset, before the runtime saves it at close)."""
        with Runtime(plan3, MachineSpec(two_groups), RuntimeSpec(policy="dmda", store=store, **kw)) as rt:
            for f in [rt.submit(feeds) for _ in range(n)]:
                f.result()
            assert rt.predictor is not None
            return sum(rt.predictor.model(p, arch).unsaved_count for p in range(plan3.k)
                       for arch in {w.arch for w in rt.workers})

    serve(60)
    frozen = _samples(store, plan3)
    for _ in range(20):  # a loaded host rejects samples as outliers: serve on until every entry is calibrated
        if frozen and all(n >= 10 for n in frozen.values() if n):
            break
        serve(30)
        frozen = _samples(store, plan3)
    assert frozen and all(n >= 10 for n in frozen.values() if n)
    assert serve(30) == 0  # calibrate=0: calibrated entries take no more samples
    assert _samples(store, plan3) == frozen
    judged = _judged(store, plan3)
    # every execution is offered to the models (the journal counts each, whatever StarPU's
    # rules make of it: a loaded CI host rejected half as outliers, and a reset, nerror
    # reaching n, empties an entry, so the stored counts alone cannot show it)
    assert serve(40, calibrate=1) == 40 * plan3.k
    kept = _samples(store, plan3)
    assert _judged(store, plan3) != judged
    monkeypatch.setenv("STARONNX_CALIBRATE", "2")
    serve(12)
    replaced = _samples(store, plan3)
    assert sum(replaced.values()) <= 12 * plan3.k and sum(replaced.values()) < sum(kept.values())
    monkeypatch.setenv("STARONNX_CALIBRATE", "yes")
    with pytest.raises(StaronnxError, match="STARONNX_CALIBRATE"):
        Runtime(plan3, MachineSpec(groups=two_groups), RuntimeSpec(policy="dmda", store=store))
    with pytest.raises(StaronnxError, match="calibrate"):
        Runtime(plan3, MachineSpec(groups=two_groups), RuntimeSpec(policy="dmda", store=store, calibrate=3))


def test_close_with_zero_timeout_cancels_what_is_left(plan3, store, two_groups):
    before = _threads()
    rt = Runtime(plan3, MachineSpec(groups=two_groups), RuntimeSpec(policy="dmdas", store=store))
    feeds = random_plan_feeds(plan3, 8)
    futures = [rt.submit(feeds) for _ in range(200)]
    rt.close(timeout=0)
    done = [f for f in futures if f.done() and not f.cancelled() and f.exception() is None]
    cancelled = [f for f in futures if f.cancelled()]
    assert all(f.done() for f in futures)
    assert cancelled, "200 queued batches cannot all finish in zero seconds"
    assert len(done) + len(cancelled) == 200
    assert _threads() == before


def test_run_cli_prints_throughput_latency_and_placement(plan3, tmp_path, two_groups):
    import subprocess
    import sys

    trace = tmp_path / "t.json"
    out = subprocess.run(
        [sys.executable, "-m", "staronnx", "run", str(plan3.root), "--batch", "2", "--requests",
         "20", "--policy", "dmda", "--groups", two_groups, "--trace", str(trace)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "STARONNX_HOME": str(tmp_path / "home"), "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr
    assert "samples/s" in out.stdout and "p99" in out.stdout
    assert "part0/cpu1" in out.stdout and "placement" in out.stdout
    assert json.loads(trace.read_text())["traceEvents"]
    bad = subprocess.run([sys.executable, "-m", "staronnx", "run", str(plan3.root), "--policy", "nope"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "STARONNX_HOME": str(tmp_path / "home")})
    assert bad.returncode == 2 and "nope" in bad.stderr and "heft" in bad.stderr


def test_a_trace_that_cannot_be_written_still_closes_the_workers(plan3, store, two_groups, tmp_path):
    (tmp_path / "gone").write_text("the trace's folder was replaced by a file")
    rt = Runtime(plan3,
                 MachineSpec(groups=two_groups),
                 RuntimeSpec(policy="eager", store=store, trace=tmp_path / "gone" / "t.json"))
    workers = rt.workers
    rt.run(random_plan_feeds(plan3, 2))
    with pytest.raises(OSError):
        rt.close()
    assert not any(w.alive for w in workers)


# -- tasks pinned to a worker (StarPU's execute_on_specific_worker) ---------------------------
def test_a_task_pinned_to_a_worker_runs_there_whatever_the_policy_says(plan3, store):
    """The static policy sends every task of part 0 to the CUDA stream; a task pinned to the
    CPU worker runs there (no copy on the stand-in GPU), between the scheduled ones, with the
    reference's answer and its time; a task pinned to a worker that does not exist or is gone
    is refused."""
    from staronnx.runtime.engine import NativeEngine
    from staronnx.runtime.policies import make_policy
    from staronnx.runtime.predictor import PerfPredictor
    from staronnx.workers.base import WorkerLost
    from staronnx.workers.cudart import HostRuntime

    rt = HostRuntime()
    workers = start_workers(plan3, MachineSpec(groups="1", cuda_streams=1), cuda_options={"runtime": rt})
    gpu, cpu = (next(i for i, w in enumerate(workers) if w.kind == k) for k in ("cuda", "cpu"))
    policy = make_policy("static", devices={p: workers[gpu].name for p in range(plan3.k)})
    engine = NativeEngine(plan3, workers, policy, PerfPredictor(plan3.hash, store), own_workers=True)
    try:
        x = random_plan_feeds(plan3, 2, seed=3)
        want = plan3.reference_values(x)
        scheduled = [engine.submit(x) for _ in range(4)]
        before = rt.copy_counts()
        pinned = [engine.pin(cpu, 0, plan3.part_feeds(0, want))[0] for _ in range(3)]
        for fut in pinned:
            got = fut.result(timeout=60)
            for name, value in got.outputs.items():
                np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-5)
            assert got.seconds > 0 and got.wall >= got.seconds * 0.5
        for fut in scheduled:
            np.testing.assert_allclose(fut.result(timeout=60)["logits"], want["logits"], rtol=1e-4, atol=1e-4)
        assert engine.stats()["workers"][workers[cpu].name]["tasks"] == 0  # pinned tasks are no request's
        # the scheduled tasks copied on the GPU, the pinned ones nothing
        assert rt.copy_counts().get("h2d", (0, 0))[0] - before.get("h2d", (0, 0))[0] <= 4
        on_gpu = engine.pin(gpu, 1, plan3.part_feeds(1, want))[0].result(timeout=60)
        np.testing.assert_allclose(on_gpu.outputs[plan3.parts[1].outputs[0]], want[plan3.parts[1].outputs[0]],
                                   rtol=1e-5, atol=1e-5)
        with pytest.raises(IndexError):
            engine.pin(len(workers), 0, plan3.part_feeds(0, want))
        engine._worker_died(cpu, WorkerLost("gone"))
        with pytest.raises(WorkerLost):
            engine.pin(cpu, 0, plan3.part_feeds(0, want))
    finally:
        engine.close()


def test_a_cancelled_request_leaves_the_runtime(plan3, store):
    """A request its caller cancelled before its tasks ran had them dropped, but stayed among
    the runtime's in-flight requests for good: counted in stats and against its model's
    capacity, its feeds held, and close() waited its whole timeout for it."""
    pu = str(min(os.sched_getaffinity(0)))
    feeds = [random_plan_feeds(plan3, 2, seed=i) for i in range(12)]
    with Runtime(plan3, MachineSpec(pu), RuntimeSpec(policy="eager", store=store)) as rt:
        futs = [rt.submit(f) for f in feeds]
        withdrawn = [f for f in futs[4:-1] if f.cancel()]
        assert withdrawn
        futs[-1].result(timeout=60)  # one worker, FIFO: every earlier task was taken before it
        for f in futs[:4]:
            f.result(timeout=60)
        stats, model = rt.stats(), rt.model_stats()
        assert stats["in_flight"] == 0 and model["in_flight"] == 0, (stats["in_flight"], model["in_flight"])


def test_cancelled_requests_count_as_done_for_wait_and_as_completed(plan3, store):
    """A cancelled future counts for concurrent.futures.wait() once its executor says so
    (set_running_or_notify_cancel): the runtime never did for a request whose tasks it
    dropped, nor for those close() cancelled, so wait() and as_completed() over them hung."""
    from concurrent.futures import as_completed, wait

    pu = str(min(os.sched_getaffinity(0)))
    feeds = [random_plan_feeds(plan3, 2, seed=i) for i in range(12)]
    rt = Runtime(plan3, MachineSpec(pu), RuntimeSpec(policy="eager", store=store))
    futs = [rt.submit(f) for f in feeds]
    gone = futs[6]
    assert gone.cancel()
    futs[-1].result(timeout=60)  # one worker, FIFO: the cancelled request's task was dropped before
    done, _ = wait([gone], timeout=30)
    assert done == {gone}
    assert list(as_completed([gone], timeout=30)) == [gone]
    more = [rt.submit(f) for f in feeds * 4]
    rt.close(timeout=0)
    cancelled = [f for f in more if f.cancelled()]
    assert cancelled, "48 queued requests cannot all finish in zero seconds"
    done, not_done = wait(more, timeout=30)
    assert not not_done


def _one_worker(kind: str, store: PerfModelStore) -> tuple[MachineSpec, RuntimeSpec]:
    """One CPU worker on one PU, or one CUDA stream on the host stand-in (its driver thread's
    loop, not a CPU worker's), eager."""
    from staronnx.workers.cuda import CudaOptions
    from staronnx.workers.cudart import HostRuntime

    if kind == "cpu":
        return MachineSpec(str(min(os.sched_getaffinity(0)))), RuntimeSpec(policy="eager", store=store)
    return (MachineSpec(groups="none", cuda_streams=1),
            RuntimeSpec(policy="eager", store=store, cuda=CudaOptions(runtime=HostRuntime())))


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_failed_and_withdrawn_requests_leave_nothing_for_the_cycle_collector(fragile_plan, store, kind):
    """A failed request kept its feeds until the cycle collector ran: the request and its tasks
    point at each other (cut only when a request completed), and its error's traceback held
    the frame that ran its task, so the task, so the request, whose future holds the error. A
    request its caller cancelled (its tasks dropped) kept them the same way. A long-running
    server's memory must be bounded by reference counting alone."""
    import gc
    import weakref

    good = {"x": np.ones((2, 8), np.float32)}
    with Runtime(fragile_plan, *_one_worker(kind, store)) as rt:
        rt.run(good)
        gc.collect()
        gc.disable()
        try:
            bad = np.ones((2, 5), np.float32)  # passes the checks, fails inside ORT (part 1)
            failed_feeds = weakref.ref(bad)
            fut = rt.submit({"x": bad})
            del bad
            with pytest.raises(TaskError):
                fut.result(timeout=60)
            del fut
            # one worker, FIFO: the cancelled request's task is popped (and dropped) before the last
            first = rt.submit(good)
            gone = np.ones((2, 8), np.float32)
            withdrawn_feeds = weakref.ref(gone)
            cancelled = rt.submit({"x": gone})
            del gone
            cancelled.cancel()
            last = rt.submit(good)
            first.result(timeout=60)
            last.result(timeout=60)
            assert rt.stats()["in_flight"] == 0
            del cancelled
            rt.run(good)  # the worker's hands move on to another request
            assert failed_feeds() is None, "a failed request waits for the cycle collector"
            assert withdrawn_feeds() is None, "a cancelled request waits for the cycle collector"
        finally:
            gc.enable()


def test_close_hears_of_a_cancelled_last_request(plan3, store, tmp_path):
    """close() waits for the requests in flight; one its caller cancelled leaves them when its
    dropped task is popped, not when a task ends, and nobody told close(): with the cancelled
    request the last one in flight, close(timeout=None) hung for good (and a timed close
    waited its whole timeout)."""
    whole = partition(plan3.source_model, spec=PartitionSpec(parts=1, costs="estimate"), output_dir=tmp_path / "one")
    workers = start_workers(whole, MachineSpec(str(min(os.sched_getaffinity(0)))))
    gate, first = threading.Event(), threading.Event()
    original = workers[0].run_here

    def held(part, feeds, *rest):  # the first task waits for the gate: the cancel and close come first
        if not first.is_set():
            first.set()
            gate.wait(60)
        return original(part, feeds, *rest)

    workers[0].run_here = held
    x = random_plan_feeds(whole, 2)
    try:
        rt = Runtime(whole, spec=RuntimeSpec(policy="eager", workers=workers, store=store))
        running, cancelled = rt.submit(x), rt.submit(x)
        assert first.wait(60)
        assert cancelled.cancel()
        closer = threading.Thread(target=rt.close, kwargs={"timeout": None}, daemon=True)
        closer.start()
        while not rt._engine._closed:  # close() holds the engine's lock until it waits
            threading.Event().wait(0.001)
        gate.set()
        np.testing.assert_array_equal(running.result(timeout=60)["logits"], whole.run_reference(x)["logits"])
        closer.join(60)
        hung = closer.is_alive()
        if hung:  # let it go (it would wait for good), so the workers can be closed
            with rt._engine._lock:
                rt._engine._drained.notify_all()
            closer.join(60)
        assert not hung, "close() never heard that the cancelled request left"
        assert cancelled.cancelled()
    finally:
        gate.set()
        for w in workers:
            w.close()


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_an_idle_worker_holds_nothing_of_the_last_request(fragile_plan, store, kind):
    """A worker waiting for work kept its last task in its loop's locals, so that request's
    feeds, intermediates and outputs lived on after its caller let go of them, for as long as
    the worker stayed idle (a big batch's arrays per worker, in a server between bursts). A
    CPU worker's loop and a CUDA device's driver thread (on the host stand-in) alike."""
    import gc
    import weakref

    with Runtime(fragile_plan, *_one_worker(kind, store)) as rt:
        assert {w.kind for w in rt.workers} == {kind}
        rt.run({"x": np.ones((2, 8), np.float32)})
        gc.collect()
        gc.disable()
        try:
            x = np.ones((2, 8), np.float32)
            feeds = weakref.ref(x)
            out = rt.run({"x": x})
            np.testing.assert_allclose(out["y"], fragile_plan.run_reference({"x": x})["y"], rtol=1e-5)
            result = weakref.ref(out["y"])
            del x, out
            assert feeds() is None and result() is None, "the idle worker still holds the last request"
        finally:
            gc.enable()


def test_stats_predicted_times_are_the_models_not_placeholders(fragile_plan, store):
    """dmda charges a task 0 s where no model answers (its greedy decisions while the models
    calibrate): stats()' predicted_ms, documented as None when never predicted, read 0.0 for
    an uncalibrated runtime (and a mean diluted by those zeros once models answered), so
    predicted against measured (the CLI's table, the server's prediction-error gauge)
    compared the machine with placeholders."""
    pu = str(min(os.sched_getaffinity(0)))
    with Runtime(fragile_plan, MachineSpec(pu), RuntimeSpec(policy="dmda", store=store)) as rt:
        for _ in range(5):  # fewer than a model needs (10 samples): every decision is greedy
            rt.run({"x": np.ones((2, 8), np.float32)})
        rows = rt.stats()["tasks"]
    assert rows and all(row["tasks"] == 5 for row in rows.values())
    assert all(row["predicted_ms"] is None for row in rows.values()), rows


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_close_from_a_done_callback_does_not_wedge_the_runtime(plan3, store, kind):
    """A done-callback runs on the worker thread that finished the request. One that closed
    the runtime made that worker wait for the requests in flight, which needed that very
    worker, then join its own loop: close(timeout=None) deadlocked for good (30 s + 90 s
    with the default timeout), and every other caller with it. Closed from a worker's thread,
    the runtime cancels what is left at once (as a Server closed from its batcher does)."""
    from concurrent.futures import wait

    feeds = random_plan_feeds(plan3, 2)
    rt = Runtime(plan3, *_one_worker(kind, store))
    returned, errors, threads = threading.Event(), [], []
    ahead = [rt.submit(feeds) for _ in range(16)]  # the worker is busy with these meanwhile

    def close_here(_):
        threads.append(threading.current_thread())
        try:
            rt.close(timeout=None)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        returned.set()

    first = rt.submit(feeds)
    first.add_done_callback(close_here)
    rest = [rt.submit(feeds) for _ in range(8)]
    assert returned.wait(120), "close() from a done-callback never returned"
    assert not errors, errors
    assert threads[0] is not threading.main_thread()  # the worker's
    assert first.exception(timeout=0) is None and all(f.exception(timeout=0) is None for f in ahead)
    done, not_done = wait(rest, timeout=60)
    assert not not_done and all(f.cancelled() or f.exception() is None for f in rest)
    with pytest.raises(EngineClosed):
        rt.submit(feeds)
    rt.close()  # idempotent, from the caller's thread


def test_calibration_on_a_worker_that_dies_fails_instead_of_hanging(plan3, store):
    """Calibration runs tasks pinned to each worker and waits for them. A CPU worker whose
    loop died on one (anything but an ORT error: the thread is lost) re-placed its scheduled
    tasks, but the pinned task in its hands was nobody's: calibrate() waited for it for good."""
    from staronnx.calibrate import calibrate
    from staronnx.workers.base import WorkerLost

    workers = start_workers(plan3, MachineSpec(str(min(os.sched_getaffinity(0)))))

    def crash(part, feeds, *rest):
        raise _Crash("simulated worker crash")

    workers[0].run_here = crash
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(calibrate(plan3, [1], workers=workers, store=store))
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            outcome.append(exc)

    try:
        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(120)
        assert not t.is_alive(), "calibrate() waits for good for the dead worker's task"
        assert len(outcome) == 1 and isinstance(outcome[0], WorkerLost), outcome
    finally:
        for w in workers:
            w.close()


@pytest.mark.parametrize("policy", ["eager", "dmda"])
def test_a_request_after_every_worker_died_is_refused(plan3, store, policy):
    """Once every worker was lost, the requests in flight failed, but a new one was still
    taken: eager queued it for no one (its future never resolved), dmda's push raised after
    it was counted in flight (stats said 1 in flight for good and close() waited its whole
    timeout for it). It is refused at submit now, with EngineClosed."""
    workers = start_workers(plan3, MachineSpec(str(min(os.sched_getaffinity(0)))))

    def crash(part, feeds, *rest):
        raise _Crash("simulated worker crash")

    workers[0].run_here = crash
    feeds = random_plan_feeds(plan3, 2)
    try:
        rt = Runtime(plan3, spec=RuntimeSpec(policy=policy, workers=workers, store=store))
        with pytest.raises(RuntimeError, match="every worker died"):
            rt.submit(feeds).result(timeout=60)
        with pytest.raises(EngineClosed, match="can no longer run"):
            rt.submit(feeds).result(timeout=60)
        assert rt.stats()["in_flight"] == 0
        closer = threading.Thread(target=rt.close, kwargs={"timeout": None}, daemon=True)
        closer.start()
        closer.join(60)
        assert not closer.is_alive(), "close() waits for a request nobody can run"
    finally:
        for w in workers:
            w.close()


def test_a_static_placement_whose_worker_died_fails_its_requests_instead_of_hanging(fragile_plan, store, two_groups):
    """Under the static policy a part runs on its one worker. When that worker died, its
    tasks were handed back to be placed again, the policy refused them, and the refusal
    escaped from the bookkeeping: the requests in flight never resolved, and each later
    one killed the loop of the worker that finished its first part. They fail now, saying
    why, and the other worker keeps serving."""
    workers = start_workers(fragile_plan, MachineSpec(groups=two_groups))

    def crash(part, feeds, *rest):
        raise _Crash("simulated worker crash")

    workers[1].run_here = crash
    devices = {0: workers[0].name, 1: workers[1].name}
    good = {"x": np.ones((2, 8), np.float32)}
    try:
        with Runtime(fragile_plan, spec=RuntimeSpec(policy="static", policy_options={"devices": devices},
                                                    workers=workers, store=store)) as rt:
            for wave in range(2):  # the worker dies in the first; the second finds it gone
                futs = [rt.submit(good) for _ in range(4)]
                for f in futs:
                    with pytest.raises(RuntimeError, match="no live worker for part 1"):
                        f.result(timeout=60)
            stats = rt.stats()
            assert stats["in_flight"] == 0 and stats["requests_failed"] == 8
            assert [name for name, _ in stats["dead_workers"]] == [workers[1].name]  # only it
    finally:
        for w in workers:
            w.close()
