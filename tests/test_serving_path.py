"""The serving hot path (issue 19): results handed out off the runtime's thread, the light
request futures, the exact-shape sample check, padding to captured batch sizes, and the
generator's quiet collector. Real threads throughout; real ORT where the result matters.
No timings: speed is benchmarks/serving_path.py's business."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from concurrent.futures import CancelledError, Future, as_completed, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace

import numpy as np
import onnx
import pytest
from _helpers import Gated
from onnx import TensorProto, helper, numpy_helper

from staronnx import InputError, partition
from staronnx.errors import StaronnxError
from staronnx.perfmodels import PerfModelStore
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import CudaOptions, RuntimeSpec
from staronnx.workers.layout import MachineSpec
from staronnx.runtime.task import RequestFuture
from staronnx.serving import Constant, Server, ServerClosed, run_open_loop
from staronnx.serving import collector, loadgen
from staronnx.serving import server as server_module
from staronnx.serving.server import StandInRuntime, padded_size
from staronnx.serving.spec import ServeSpec, inflight_window
from staronnx.partition import PartitionSpec

W = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)


def _matmul_model(path, width: int | str = 16):
    """y = x @ W, x: [batch, width] (``width`` a name makes the second axis free too)."""
    w = numpy_helper.from_array(W, "w")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])], [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("path")
    return partition(_matmul_model(root / "mm.onnx"), spec=PartitionSpec(parts=1, profile_runs=1),
                     output_dir=root / "plan")


@pytest.fixture(scope="module")
def runtime(plan, tmp_path_factory, two_groups):
    with Runtime(plan,
                 MachineSpec(groups=two_groups),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path_factory.mktemp("home")))) as rt:
        yield rt


def _sample(i: int) -> dict[str, np.ndarray]:
    return {"x": np.full((1, 16), float(i), np.float32) + np.arange(16, dtype=np.float32)}


class _OwnThreadRuntime(StandInRuntime):
    """A stand-in BatchRuntime that runs every batch on a thread of its own, as a worker does:
    y = x @ W, the shapes it was given kept in ``seen``, the completing thread in ``threads``."""

    def __init__(self, plan, preferred_batch_sizes=()) -> None:
        self.plan = plan
        self.preferred_batch_sizes = preferred_batch_sizes
        self.seen: list[tuple[int, ...]] = []
        self.threads: set[int] = set()
        self.gate = threading.Event()
        self.gate.set()
        self._jobs: list = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="stand-in-worker", daemon=True)
        self._thread.start()

    def submit(self, feeds):
        fut: Future = Future()
        x = np.array(feeds["x"])  # the batch memory is the server's: copy, as ORT's input copy does
        self.seen.append(x.shape)
        with self._cv:
            self._jobs.append((fut, x))
            self._cv.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                fut, x = self._jobs.pop(0)
            self.gate.wait(30)
            self.threads.add(threading.get_ident())
            fut.set_result({"y": x @ W})

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(5)


@pytest.fixture
def stand_in(plan):
    rt = _OwnThreadRuntime(plan)
    yield rt
    rt.close()


# -- results are handed out off the runtime's thread --------------------------------------------
def test_request_futures_resolve_off_the_runtime_thread(stand_in):
    resolved_on: list[int] = []
    stand_in.gate.clear()  # no batch completes before every callback is in place
    with Server(stand_in, ServeSpec(4)) as server:
        futures = [server.submit(_sample(i)) for i in range(8)]
        for f in futures:
            f.add_done_callback(lambda _f: resolved_on.append(threading.get_ident()))
        stand_in.gate.set()
        results = [f.result(timeout=10) for f in futures]
    assert len(stand_in.threads) == 1 and len(resolved_on) == 8
    assert not set(resolved_on) & stand_in.threads  # not on the thread that completed the batch
    assert set(resolved_on) == {server._thread.ident}  # the batcher's
    for i, r in enumerate(results):
        np.testing.assert_allclose(r["y"], _sample(i)["x"] @ W, rtol=1e-6)


def test_a_real_runtime_worker_does_not_run_request_callbacks(runtime):
    names: list[str] = []
    gated = Gated(runtime)  # no batch completes before every callback is in place
    with Server(gated, ServeSpec(4), batch_memory=np.empty) as server:
        futures = [server.submit(_sample(i)) for i in range(12)]
        for f in futures:
            f.add_done_callback(lambda _f: names.append(threading.current_thread().name))
        gated.gate.set()
        results = [f.result(timeout=30) for f in futures]
        rec = server.records()
    assert names == ["staronnx-batcher"] * 12
    for i, r in enumerate(results):
        np.testing.assert_allclose(r["y"], _sample(i)["x"] @ W, rtol=1e-5, atol=1e-5)
        assert r["y"].shape == (1, 16)
    assert [b.size for b in rec.batches] == [4, 4, 4]
    assert all(r.done is not None and r.done >= r.arrival and not r.failed for r in rec.requests)
    assert all(b.done is not None and b.padded_to is None for b in rec.batches)
    assert futures[0].batch is rec.batches[0] or futures[0].batch.id == rec.batches[0].id


def test_a_cpu_only_runtime_hands_out_results_on_its_worker_and_a_cuda_one_on_the_batcher(plan, tmp_path):
    """With CPU workers only, waking the batcher to resolve each batch cost a thread switch and
    a GIL hand-over per batch: the worker that finished it resolves it. A CUDA worker's driver
    thread must not (it would keep the device waiting): the batcher still does there."""
    from staronnx.workers.cudart import HostRuntime

    pu = str(min(__import__("os").sched_getaffinity(0)))
    host = CudaOptions(runtime=HostRuntime())
    for machine, expect in ((MachineSpec(pu), "cpu:"),
                            (MachineSpec("none", cuda_streams=1, cuda_graphs=False), "staronnx-batcher")):
        with Runtime(plan, machine, RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path), cuda=host)) as rt:
            names: list[str] = []
            with Server(rt, ServeSpec(4)) as server:
                futures = []
                for i in range(16):  # a batch leaves with its 4th request: the first 3 have their callbacks
                    futures.append(server.submit(_sample(i)))
                    futures[-1].add_done_callback(lambda _f: names.append(threading.current_thread().name))
                results = [f.result(timeout=30) for f in futures]
                rec = server.records()
            # a future already done when its callback is added runs it on the caller's thread
            ran_elsewhere = [n for n in names if n != threading.current_thread().name]
            assert ran_elsewhere and all(n.startswith(expect) for n in ran_elsewhere), (expect, names)
            for i, r in enumerate(results):
                np.testing.assert_allclose(r["y"], _sample(i)["x"] @ W, rtol=1e-5, atol=1e-5)
            assert all(r.done is not None and not r.failed for r in rec.requests)
            assert all(b.done is not None for b in rec.batches)


def test_close_fails_batches_the_runtime_never_finished(stand_in):
    stand_in.gate.clear()  # the stand-in's worker holds the batch
    server = Server(stand_in, ServeSpec(2))
    futures = [server.submit(_sample(i)) for i in range(2)]
    server.close(timeout=0.3)
    for f in futures:
        with pytest.raises(ServerClosed):
            f.result(timeout=1)
    assert all(r.failed for r in server.records().requests)
    assert server.closed
    stand_in.gate.set()  # the late completion is ignored, not handed out twice
    time.sleep(0.05)
    assert all(isinstance(f.exception(), ServerClosed) for f in futures)


def test_close_from_a_result_callback_does_not_hang(stand_in):
    server = Server(stand_in, ServeSpec(1))
    closed = threading.Event()

    def close_now(_f):
        server.close(timeout=5)
        closed.set()

    first = server.submit(_sample(0))
    first.add_done_callback(close_now)
    assert first.result(timeout=10)["y"].shape == (1, 16)
    assert closed.wait(10)
    with pytest.raises(ServerClosed):
        server.submit(_sample(1))


def test_a_closed_server_is_not_kept_alive_by_the_runtime(runtime):
    # the runtime keeps its last request's future (the worker's last task) until its next
    # task; a server held there was freed, run and all, on that worker's thread at the start
    # of the next run (10-30 ms with the GIL held, the first arrivals that late)
    server = Server(runtime, ServeSpec(4), batch_memory=np.empty)
    futures = [server.submit(_sample(i)) for i in range(8)]
    assert all(f.result(timeout=30)["y"].shape == (1, 16) for f in futures)
    server.close()
    gone = weakref.ref(server)
    del server, futures
    gc.collect()
    assert gone() is None


def test_the_request_that_fills_a_batch_launches_it_on_its_own_thread(stand_in):
    launched_on: list[str] = []
    submit = stand_in.submit

    def spy(feeds):
        launched_on.append(threading.current_thread().name)
        return submit(feeds)

    stand_in.submit = spy
    with Server(stand_in, ServeSpec(4, max_inflight=1)) as server:
        stand_in.gate.clear()  # the first batch stays in flight: the window is full
        first = [server.submit(_sample(i)) for i in range(4)]
        second = [server.submit(_sample(i)) for i in range(4, 8)]  # held back by max_inflight
        assert launched_on == [threading.current_thread().name]  # the submitter's, at once
        assert server.queue_length == 4
        stand_in.gate.set()  # its completion frees the window: the batcher sends the next one
        results = [f.result(timeout=10) for f in first + second]
    assert launched_on == [threading.current_thread().name, "staronnx-batcher"]
    for i, r in enumerate(results):
        np.testing.assert_allclose(r["y"], _sample(i)["x"] @ W, rtol=1e-6)


def _count_wakes(server):
    """Count the batcher's wake-ups (``notify_all`` on the server's Condition) from now on."""
    wakes = [0]
    notify_all = server._cond.notify_all

    def counting():
        wakes[0] += 1
        notify_all()

    server._cond.notify_all = counting  # type: ignore[method-assign]
    return wakes


def test_a_full_window_does_not_wake_the_batcher_per_request(stand_in):
    # requests queued behind max_inflight are sent by the completion that frees a place; a
    # wake-up per such request was a thread switch and a GIL hand-over each, for nothing
    with Server(stand_in, ServeSpec(2, max_inflight=1, queue_capacity=64)) as server:
        stand_in.gate.clear()
        held = [server.submit(_sample(i)) for i in range(2)]
        wakes = _count_wakes(server)
        queued = [server.submit(_sample(i)) for i in range(2, 40)]
        assert wakes[0] == 0
        stand_in.gate.set()
        for f in held + queued:
            f.result(timeout=10)


def test_a_completion_with_room_in_the_window_leaves_the_batcher_asleep(runtime):
    # at 75 % load most completions find a partial batch being filled: waking the batcher for
    # it was a thread switch and a GIL hand-over per batch, and it could send nothing
    with Server(runtime, ServeSpec(4, max_inflight=4)) as server:
        first = [server.submit(_sample(i)) for i in range(4)]  # leaves with its 4th request
        wakes = _count_wakes(server)
        partial = [server.submit(_sample(i)) for i in range(4, 6)]
        for f in first:
            f.result(timeout=30)
        time.sleep(0.05)  # the completing worker has handed out the batch and left
        assert wakes[0] == 0 and server.queue_length == 2
        server.flush()
        for i, f in enumerate(first + partial):
            np.testing.assert_allclose(f.result(timeout=30)["y"], _sample(i)["x"] @ W, rtol=1e-5, atol=1e-5)


def test_a_completion_that_frees_a_full_window_starts_a_waiting_partial_batchs_delay(runtime):
    # with max_inflight=1 the partial batch's max-delay timer cannot run while the window is
    # full (the batcher waits for room): the completion that frees it must wake the batcher
    with Server(runtime, ServeSpec(4, max_inflight=1, max_delay=0.01)) as server:
        futures = [server.submit(_sample(i)) for i in range(5)]
        for i, f in enumerate(futures):
            np.testing.assert_allclose(f.result(timeout=10)["y"], _sample(i)["x"] @ W, rtol=1e-5, atol=1e-5)
        rec = server.records()
    assert sorted(b.size for b in rec.batches) == [1, 4]


def test_an_event_loop_times_the_max_delay_of_its_requests_and_the_batcher_sleeps(runtime):
    # a served model's requests come from one event loop: a call_later there times a partial
    # batch's delay, where waking the batcher thread for each batch's first request cost a
    # thread switch and a GIL hand-over, for nothing when the batch fills first (closed loop)
    with Server(runtime, ServeSpec(4, max_delay=0.02)) as server:
        async def main() -> tuple[list[dict[str, np.ndarray]], int]:
            server.time_delays_on(asyncio.get_running_loop())
            wakes = _count_wakes(server)
            answers = []
            for first in (0, 3):  # a partial batch of 3, then another: each leaves on its delay
                futures = [asyncio.wrap_future(server.submit(_sample(i))) for i in range(first, first + 3)]
                answers += await asyncio.gather(*futures)
            return answers, wakes[0]

        answers, wakes = asyncio.run(main())
        rec = server.records()
    assert wakes == 0
    assert [b.size for b in rec.batches] == [3, 3]
    for i, r in enumerate(answers):
        np.testing.assert_allclose(r["y"], _sample(i)["x"] @ W, rtol=1e-5, atol=1e-5)


def test_requests_from_another_thread_are_still_timed_by_the_batcher(runtime):
    # only the loop's own thread uses its timer; a request submitted elsewhere wakes the batcher
    with Server(runtime, ServeSpec(4, max_delay=0.02)) as server:
        async def main() -> list[dict[str, np.ndarray]]:
            server.time_delays_on(asyncio.get_running_loop())
            futures = await asyncio.to_thread(lambda: [server.submit(_sample(i)) for i in range(2)])
            return [f.result(timeout=10) for f in futures]

        answers = asyncio.run(main())
    for i, r in enumerate(answers):
        np.testing.assert_allclose(r["y"], _sample(i)["x"] @ W, rtol=1e-5, atol=1e-5)


def test_a_closed_loop_leaves_the_delay_to_the_batcher(runtime):
    # the loop that timed delays is gone: the next first request falls back to the batcher
    with Server(runtime, ServeSpec(4, max_delay=0.02)) as server:
        async def register() -> None:
            server.time_delays_on(asyncio.get_running_loop())

        asyncio.run(register())
        loop = asyncio.new_event_loop()
        try:
            answer = loop.run_until_complete(asyncio.wrap_future(server.submit(_sample(0)), loop=loop))
        finally:
            loop.close()
    np.testing.assert_allclose(answer["y"], _sample(0)["x"] @ W, rtol=1e-5, atol=1e-5)


def test_a_checked_multi_row_request_takes_its_rows_places_in_one_batch_and_gets_views(runtime):
    # Triton's dynamic batcher takes a request of n rows as it is: n places in a batch, and
    # its own rows of the batch's outputs back (no cut into n requests, no join of n answers)
    x = np.concatenate([_sample(i)["x"] for i in range(3)])
    with Server(runtime, ServeSpec(4, max_delay=5.0)) as server:
        many = server.submit({"x": x}, checked=True, rows=3)
        one = server.submit(_sample(3))  # fills the batch of 4: it leaves at once
        a, b = many.result(timeout=30), one.result(timeout=30)
        with pytest.raises(InputError, match="5 rows does not fit a batch of at most 4"):
            server.submit({"x": np.concatenate([x, x[:2]])}, checked=True, rows=5)
        rec = server.records()
    assert [bt.size for bt in rec.batches] == [4] and len(rec.requests) == 2
    np.testing.assert_allclose(a["y"], x @ W, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b["y"], _sample(3)["x"] @ W, rtol=1e-5, atol=1e-5)
    assert a["y"].shape == (3, 16)
    assert a["y"].base is not None and a["y"].base is b["y"].base  # views of one batch output


def test_a_multi_row_request_that_does_not_fit_waits_for_the_next_batch(runtime):
    with Server(runtime, ServeSpec(4, max_delay=0.01)) as server:
        first = server.submit({"x": np.concatenate([_sample(i)["x"] for i in range(3)])}, checked=True, rows=3)
        second = server.submit({"x": np.concatenate([_sample(i)["x"] for i in range(3, 5)])}, checked=True, rows=2)
        a, b = first.result(timeout=30), second.result(timeout=30)
        rec = server.records()
    assert sorted(bt.size for bt in rec.batches) == [2, 3]
    np.testing.assert_allclose(np.concatenate([a["y"], b["y"]]),
                               np.concatenate([_sample(i)["x"] for i in range(5)]) @ W, rtol=1e-5, atol=1e-5)


def test_the_queue_capacity_counts_a_multi_row_requests_rows(stand_in):
    # --queue-capacity is in samples: a request of 3 rows takes 3 of them, as its 3 one-row
    # pieces did when a request was cut into rows
    with Server(stand_in, ServeSpec(4, queue_capacity=4)) as server:
        stand_in.gate.clear()
        x = np.concatenate([_sample(i)["x"] for i in range(3)])
        first = server.submit({"x": x}, checked=True, rows=3)
        with pytest.raises(server_module.OverloadError):
            server.submit({"x": x[:2]}, checked=True, rows=2)
        second = server.submit(_sample(3))  # the 4th sample: fills the batch, which leaves
        stand_in.gate.set()
        np.testing.assert_allclose(first.result(timeout=10)["y"], x @ W, rtol=1e-5, atol=1e-5)
        second.result(timeout=10)


def test_wait_idle_counts_the_requests_still_without_a_result(stand_in):
    stand_in.gate.clear()  # the runtime holds every batch
    with Server(stand_in, ServeSpec(2)) as server:
        futures = [server.submit(_sample(i)) for i in range(3)]  # a batch of 2 leaves, 1 waits
        assert server.wait_idle(0.05) == 3
        stand_in.gate.set()
        assert server.wait_idle(0.3) == 1  # the partial batch waits for a second request
        server.flush()
        assert server.wait_idle(10) == 0
        assert all(f.done() for f in futures)


def test_the_generator_keeps_no_future_of_a_request_that_has_its_result(stand_in):
    # a future (and its result) per request kept to the end of the run made every young
    # collection walk them, pausing the serving threads longer as the run went on
    alive: list[weakref.ref] = []
    counted: list[int] = []

    class Watched(Server):
        def submit(self, sample, arrival=None, **kw):
            future = super().submit(sample, arrival, **kw)
            alive.append(weakref.ref(future))
            return future

    def on_submit(i, total):
        if i == total - 1:
            # answered futures that the resolving threads still hold go within moments (a busy
            # host may keep those threads waiting a while); futures the generator keeps never go
            deadline = time.monotonic() + 10
            while (kept := sum(r() is not None and r().done() for r in alive)) > 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            counted.append(kept)

    with Watched(stand_in, ServeSpec(2)) as server:
        rec = run_open_loop(server, Constant(4000), _sample, n=200, on_submit=on_submit)
    assert all(r.done is not None for r in rec.requests) and rec.settings["loadgen"]["pending"] == 0
    # at most the last batch or two, still in the hands of the thread that resolved them
    assert len(counted) == 1 and counted[0] <= 4, f"{counted} futures of answered requests were kept"


def test_an_idle_batcher_holds_no_answered_request(stand_in):
    """Once every request is answered and the server idles, no answered request's future is
    alive: the batcher thread kept the last round's batch and completions in its locals while it
    waited for work (several batches' requests on a busy host, where the test above counted 6)."""
    alive: list[weakref.ref] = []
    done = threading.Semaphore(0)
    with Server(stand_in, ServeSpec(2)) as server:
        for i in range(40):
            future = server.submit(_sample(i))
            future.add_done_callback(lambda _f: done.release())
            alive.append(weakref.ref(future))
            del future
        for _ in range(40):
            assert done.acquire(timeout=30)
        deadline = time.monotonic() + 10
        while (kept := sum(r() is not None for r in alive)) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert kept == 0, f"{kept} futures of answered requests are still held by an idle server"


def test_a_one_worker_runtime_gets_a_window_of_four_by_default(plan, tmp_path):
    # two batches for one worker left it idle whenever the batcher's hand-over outlasted its
    # task: open loop congested at 75 % of the closed-loop rate on the serving benchmark
    with Runtime(plan, MachineSpec(groups="0"), RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path))) as rt:
        assert len(rt.workers) == 1
        with Server(rt, ServeSpec(4)) as server:
            assert server.max_inflight == server_module.MIN_INFLIGHT == 4
    # the one rule says so too, however the worker's time is known (as sweeps and the simulator
    # size it), and two per worker beyond two workers
    assert inflight_window([None]) == inflight_window([0.01]) == 4
    assert inflight_window([None] * 3) == inflight_window([0.01] * 3) == 6


def test_a_server_takes_its_settings_as_one_spec_and_its_window_from_the_one_rule(stand_in, runtime):
    spec = ServeSpec(4, max_delay=0.01, queue_capacity=64, pad_to=(4, np.int64(2), 2, 8))
    assert spec.pad_to == (2, 4, 8)  # checked and sorted once
    with Server(stand_in, spec) as server, \
            Server(stand_in, ServeSpec(4, max_delay=0.01, queue_capacity=64, pad_to=[8, 4, 2])) as same:
        # the same settings make an equal spec; the server's holds it resolved for its runtime
        assert server.spec == same.spec == replace(spec, max_inflight=inflight_window([]), pad_to=(2, 4))
        assert (server.batch_size, server.max_delay, server.queue_capacity, server.max_inflight) == (4, 0.01, 64, 4)
        assert server.settings()["pad_to"] == [2, 4] and server.settings()["max_inflight"] == 4
    with Server(stand_in, replace(spec, max_inflight=2, on_full="block")) as changed:
        assert (changed.spec.max_inflight, changed.on_full, changed.queue_capacity) == (2, "block", 64)
        assert spec.max_inflight is None  # frozen: the caller's spec is left as it was
    with Server(runtime, ServeSpec(2)) as served:  # a real runtime's workers, no times known
        assert served.max_inflight == inflight_window([None] * len(runtime.workers)) == 2 * len(runtime.workers)
    # the spec refuses what the server would: one set of checks, at construction
    for bad, words in (({"batch_size": 0}, "batch_size"),
                       ({"batch_size": 8, "queue_capacity": 4}, "at least batch_size"),
                       ({"batch_size": 2, "on_full": "drop"}, "on_full"),
                       ({"batch_size": 2, "max_inflight": 0}, "max_inflight"),
                       ({"batch_size": 2, "max_delay": -1.0}, "max_delay"),
                       ({"batch_size": 2, "pad_to": (0,)}, "pad_to"),
                       ({"batch_size": 2, "keep_records": 0}, "keep_records")):
        with pytest.raises(StaronnxError, match=words):
            ServeSpec(**bad)
    with pytest.raises(TypeError, match=r"one ServeSpec: Server\(runtime, ServeSpec\(4, \.\.\.\)\)"):
        Server(stand_in, 4)  # type: ignore[arg-type]


# -- the light request futures ----------------------------------------------------------------
def test_request_future_keeps_the_attributes_of_a_request_future(stand_in):
    with Server(stand_in, ServeSpec(1)) as server:
        f = server.submit(_sample(0))
        f.result(timeout=10)
    plain = set(vars(Future())) | {"request_id", "placement", "batch"}
    # built without Future.__init__: if RequestFuture or Future grows an attribute, so must it
    missing = {name for name in plain if not hasattr(f, name)}
    assert not missing, missing
    assert isinstance(f, RequestFuture) and f.request_id == 0 and f.placement == {}
    assert f._waiters == [] and f._done_callbacks == []  # made on first use
    # a live request costs the cycle collector two objects: the future and its record
    fresh = server_module._Request(server, f._record, _sample(1))
    assert not gc.is_tracked(fresh.placement)
    assert fresh._waiter_list is None and fresh._callback_list is None


def test_request_futures_wait_time_out_cancel_and_await_like_futures(stand_in):
    stand_in.gate.clear()
    with Server(stand_in, ServeSpec(2, max_delay=None)) as server:
        a, b = server.submit(_sample(0)), server.submit(_sample(1))  # one batch, held at the gate
        c = server.submit(_sample(2))  # queued: its batch waits for a second request
        with pytest.raises(FutureTimeout):
            a.result(timeout=0.05)
        with pytest.raises(FutureTimeout):
            a.exception(timeout=0.01)
        # a caller blocked on c is woken by its cancel, another blocked on a by a's result
        got: dict[str, object] = {}

        def block(name, fut):
            try:
                got[name] = fut.result(timeout=10)
            except CancelledError as exc:
                got[name] = exc

        threads = [threading.Thread(target=block, args=(n, f)) for n, f in (("a", a), ("c", c))]
        for t in threads:
            t.start()
        time.sleep(0.05)
        assert c.cancel()
        threads[1].join(5)
        assert isinstance(got["c"], CancelledError) and "a" not in got
        done, pending = wait([c], timeout=5)  # a cancelled queued request counts as done
        assert done == {c}
        stand_in.gate.set()
        threads[0].join(5)
        np.testing.assert_allclose(got["a"]["y"], _sample(0)["x"] @ W, rtol=1e-6)
        assert {f for f in as_completed([a, b], timeout=10)} == {a, b}

        async def awaited():
            f3, f4 = server.submit(_sample(3)), server.submit(_sample(4))  # one batch of 2
            return await f3, await f4

        r3, r4 = asyncio.run(asyncio.wait_for(awaited(), 10))
        np.testing.assert_allclose(r4["y"], _sample(4)["x"] @ W, rtol=1e-6)
        rec = server.records()
    assert [r.withdrawn for r in rec.requests] == [False, False, True, False, False]


def test_many_callers_blocked_on_their_own_requests_each_get_their_own(stand_in):
    with Server(stand_in, ServeSpec(4)) as server:
        futures = [server.submit(_sample(i)) for i in range(16)]
        out: dict[int, np.ndarray] = {}
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, futures[i].result(10)["y"]))
                   for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
    assert sorted(out) == list(range(16))
    for i, y in out.items():
        np.testing.assert_allclose(y, _sample(i)["x"] @ W, rtol=1e-6)


# -- the sample check -------------------------------------------------------------------------
@pytest.mark.parametrize("sample, match", [
    ({"x": np.zeros((1, 16), np.float64)}, "expected dtype float"),
    ({"x": np.zeros((1, 15), np.float32)}, "axis 1 must be 16"),
    ({"x": np.zeros((2, 16), np.float32)}, "a request is one sample"),
    ({"x": np.zeros((16,), np.float32)}, "expected rank 2"),
    ({"x": [[0.0] * 16]}, "expected a numpy array"),
    ({}, "missing input"),
    ({"x": np.zeros((1, 16), np.float32), "z": np.zeros(1)}, "unknown input"),
])
def test_a_bad_sample_is_named_whichever_check_sees_it(stand_in, sample, match):
    with Server(stand_in, ServeSpec(2)) as server:
        assert server._exact_inputs == [("x", np.dtype(np.float32), (1, 16))]
        with pytest.raises(InputError, match=match):
            server.submit(sample)
        assert server.records().requests == []


def test_a_free_non_batch_axis_takes_the_plans_checks(tmp_path):
    plan = partition(_matmul_model(tmp_path / "free.onnx", width="n"),
                     spec=PartitionSpec(parts=1, profile_runs=1, input_shapes=["x=1x16"]), output_dir=tmp_path / "plan")
    rt = _OwnThreadRuntime(plan)
    try:
        with Server(rt, ServeSpec(1)) as server:
            assert server._exact_inputs is None
            assert server.submit(_sample(0)).result(timeout=10)["y"].shape == (1, 16)
            with pytest.raises(InputError, match="a request is one sample"):
                server.submit({"x": np.zeros((3, 16), np.float32)})
    finally:
        rt.close()


# -- padding partial batches to captured sizes ------------------------------------------------
def test_padded_size():
    assert [padded_size(n, (1, 2, 4, 8)) for n in range(1, 11)] == [1, 2, 4, 4, 8, 8, 8, 8, 9, 10]
    assert padded_size(3, ()) == 3 and padded_size(3, (8,)) == 8 and padded_size(5, (2, 4)) == 5


def test_a_partial_batch_is_padded_and_its_callers_get_their_own_rows(stand_in):
    """Also the Server's on_executed hook (what ``staronnx serve`` counts): the rows the
    runtime ran, padding included, and a time, once per batch that succeeded."""
    executed: list[tuple[int, float]] = []
    with Server(stand_in, ServeSpec(8, max_delay=0.05, pad_to=(8, 1, 4, 2)),
                on_executed=lambda rows, seconds: executed.append((rows, seconds))) as server:
        futures = [server.submit(_sample(i)) for i in range(3)]
        results = [f.result(timeout=10) for f in futures]
        rec = server.records()
    assert stand_in.seen == [(4, 16)]  # the runtime met a captured size only
    assert len(executed) == 1 and executed[0][0] == 4 and executed[0][1] > 0
    for i, r in enumerate(results):
        assert r["y"].shape == (1, 16)
        np.testing.assert_allclose(r["y"], _sample(i)["x"] @ W, rtol=1e-6)
    (batch,) = rec.batches
    assert batch.size == 3 and batch.padded_to == 4 and batch.request_ids == [0, 1, 2]
    assert rec.settings["pad_to"] == [1, 2, 4, 8]


def test_full_batches_and_batches_above_the_largest_size_run_as_they_are(plan):
    rt = _OwnThreadRuntime(plan, preferred_batch_sizes=(1, 2, 4))  # the default pad_to
    try:
        with Server(rt, ServeSpec(8)) as server:
            assert server.pad_to == (1, 2, 4)
            full = [server.submit(_sample(i)) for i in range(8)]
            [f.result(timeout=10) for f in full]
            above = [server.submit(_sample(i)) for i in range(6)]
            server.flush()
            results = [f.result(timeout=10) for f in above]
            rec = server.records()
        assert rt.seen == [(8, 16), (6, 16)]
        assert [(b.size, b.padded_to) for b in rec.batches] == [(8, None), (6, None)]
        for i, r in enumerate(results):
            np.testing.assert_allclose(r["y"], _sample(i)["x"] @ W, rtol=1e-6)
        with Server(rt, ServeSpec(8, pad_to=())) as server:  # padding off, whatever the runtime says
            assert server.pad_to == ()
    finally:
        rt.close()


def test_padding_through_a_real_runtime_gives_each_request_its_own_result(runtime):
    with Server(runtime, ServeSpec(8, pad_to=(2, 8))) as server:
        futures = [server.submit(_sample(i)) for i in range(11)]
        server.flush()
        results = [f.result(timeout=30) for f in futures]
        rec = server.records()
    assert [(b.size, b.padded_to) for b in rec.batches] == [(8, None), (3, 8)]
    for i, r in enumerate(results):
        np.testing.assert_allclose(r["y"], _sample(i)["x"] @ W, rtol=1e-5, atol=1e-5)


def test_pad_to_is_checked(stand_in):
    for bad in ([0, 4], [2.5], [True]):
        with pytest.raises(StaronnxError, match="pad_to"):
            Server(stand_in, ServeSpec(4, pad_to=bad))


# -- the generator's collector ----------------------------------------------------------------
def test_the_generator_injects_with_the_full_collection_held_off(stand_in):
    threshold, holders = gc.get_threshold(), server_module._frozen_users
    seen: list[tuple[tuple[int, ...], int]] = []

    def make_sample(i):
        seen.append((gc.get_threshold(), gc.get_freeze_count()))
        return _sample(i)

    with Server(stand_in, ServeSpec(2)) as server:
        rec = run_open_loop(server, Constant(2000), make_sample, n=20)
    assert len(rec.requests) == 20 and all(r.done is not None for r in rec.requests)
    # young collections go on; the older generations' wait for the end of the run
    assert all(t == (threshold[0], collector.OUT_OF_REACH, collector.OUT_OF_REACH) and frozen > 0
               for t, frozen in seen)
    assert gc.get_threshold() == threshold and server_module._frozen_users == holders
    assert holders or gc.get_freeze_count() == 0


def test_the_full_collection_stays_held_off_until_the_last_result(stand_in):
    # the results of the last requests come in while the generator drains: a full collection
    # of the run's records there (40-80 ms on the benchmark's host) would be their latency
    thresholds: list[int] = []
    submit = stand_in.submit

    def spy(feeds):
        future = submit(feeds)
        future.add_done_callback(lambda _f: thresholds.append(gc.get_threshold()[1:]))
        return future

    stand_in.submit = spy
    stand_in.gate.clear()  # no batch finishes before the schedule is over

    def on_submit(i, total):
        if i == total - 1:
            threading.Timer(0.05, stand_in.gate.set).start()

    with Server(stand_in, ServeSpec(2)) as server:
        rec = run_open_loop(server, Constant(2000), _sample, n=10, on_submit=on_submit)
    assert all(r.done is not None for r in rec.requests)
    assert thresholds == [(collector.OUT_OF_REACH, collector.OUT_OF_REACH)] * 5


def test_the_generator_wakes_at_most_once_per_min_wake_and_reports_the_lag(stand_in, monkeypatch):
    wakes: list[float] = []
    sleep_until = loadgen.sleep_until

    def counting(due, clock=time.perf_counter, spin=0.0):
        wakes.append(due)
        return sleep_until(due, clock, spin)

    monkeypatch.setattr(loadgen, "sleep_until", counting)
    with Server(stand_in, ServeSpec(4)) as server:
        rec = run_open_loop(server, Constant(20_000), _sample, n=200, min_wake=0.002)  # 10 ms
    assert len(wakes) <= 10 / 2 + 2  # not one per arrival (50 us apart)
    assert all(b - a >= 0.002 - 1e-9 for a, b in zip(wakes, wakes[1:]))
    report = rec.settings["loadgen"]
    assert report["submitted"] == 200 and report["lag_max_s"] >= 0.001  # the wait is lag, reported
    assert [r.arrival - rec.start for r in rec.requests] == pytest.approx([i / 20_000 for i in range(200)])


def test_collector_quiet_nests_and_restores_on_error():
    threshold, holders = gc.get_threshold(), server_module._frozen_users
    with pytest.raises(RuntimeError):
        with loadgen.collector_quiet():
            with loadgen.collector_quiet():
                assert gc.get_threshold()[1:] == (collector.OUT_OF_REACH,) * 2
            assert gc.get_threshold()[1:] == (collector.OUT_OF_REACH,) * 2  # the outer user still runs
            raise RuntimeError("boom")
    assert gc.get_threshold() == threshold and server_module._frozen_users == holders
    assert holders or gc.get_freeze_count() == 0


def test_a_server_leaves_the_collector_to_its_caller_who_holds_the_heap_frozen(stand_in):
    """No process-wide side effect from a constructor: a Server freezes nothing; ``staronnx
    serve`` and the load generator hold the heap frozen (``hold_frozen``, nested: the last
    holder unfreezes)."""
    holders, frozen = server_module._frozen_users, gc.get_freeze_count()
    with Server(stand_in, ServeSpec(1)) as server:
        assert server.submit(_sample(0)).result(timeout=10)["y"].shape == (1, 16)
        assert server_module._frozen_users == holders and gc.get_freeze_count() == frozen
    loaded = [object() for _ in range(10)]  # "the model": tracked objects there before serving
    server_module.hold_frozen()
    server_module.hold_frozen()
    assert server_module._frozen_users == holders + 2 and gc.get_freeze_count() >= len(loaded)
    server_module.release_frozen()
    assert server_module._frozen_users == holders + 1 and gc.get_freeze_count() > 0  # one still holds
    server_module.release_frozen()
    assert server_module._frozen_users == holders
    assert holders or gc.get_freeze_count() == 0


def test_a_batch_settles_its_cancelled_failed_and_waiting_requests(stand_in):
    stand_in.gate.clear()
    with Server(stand_in, ServeSpec(3)) as server:
        futures = [server.submit(_sample(i)) for i in range(3)]  # one batch, held in the runtime
        calls: list[int] = []
        called = threading.Event()
        futures[0].add_done_callback(lambda f: 1 / 0)  # a caller's broken callback hurts no one
        futures[2].add_done_callback(lambda f: (calls.append(f.request_id), called.set()))
        blocked: dict[str, object] = {}
        waiter = threading.Thread(target=lambda: blocked.setdefault("y", futures[2].result(10)["y"]))
        waiter.start()
        time.sleep(0.02)
        assert futures[1].cancel()  # in flight: its row is computed, then dropped
        stand_in.gate.set()
        waiter.join(10)
        np.testing.assert_allclose(blocked["y"], _sample(2)["x"] @ W, rtol=1e-6)
        assert futures[0].result(1)["y"].shape == (1, 16)
        assert called.wait(5) and calls == [2]  # run after the batch's results, past the broken one
        assert wait([futures[1]], timeout=5).done == {futures[1]}
        assert futures[0].batch.id == futures[2].batch.id == 0

    class Failing(_OwnThreadRuntime):
        def submit(self, feeds):
            fut: Future = Future()
            fut.set_exception(RuntimeError("the part failed"))
            return fut

    rt = Failing(stand_in.plan)
    try:
        with Server(rt, ServeSpec(2)) as server:
            futures = [server.submit(_sample(i)) for i in range(2)]
            for f in futures:
                with pytest.raises(RuntimeError, match="the part failed"):
                    f.result(timeout=10)
            assert all(r.failed and r.done is None for r in server.records().requests)
    finally:
        rt.close()


def test_records_are_snapshots(stand_in):
    with Server(stand_in, ServeSpec(2)) as server:
        futures = [server.submit(_sample(i)) for i in range(3)]
        futures[0].result(timeout=10)
        before = server.records()
        server.flush()
        futures[2].result(timeout=10)
        after = server.records()
    assert before.requests[2].done is None and before.requests[2].batch_id == -1  # not updated later
    assert after.requests[2].done is not None and after.requests[2].batch_id == 1
    assert [type(r) for r in after.requests] == [type(before.requests[0])] * 3
    assert after.requests[0] == before.requests[0] and after.requests[0] is not before.requests[0]
    assert before.batches[0] == after.batches[0] and before.batches[0] is not after.batches[0]
    before.batches[0].request_ids.append(99)
    before.batches[0].placement["part0"] = "x"
    assert server.records().batches[0] == after.batches[0]  # a copy's lists are its own


def test_padding_never_goes_past_the_batch_size(stand_in):
    """Sizes captured for another server's larger batches are not padding targets here."""
    with Server(stand_in, ServeSpec(4, max_delay=0.01, pad_to=(1, 2, 8, 32))) as server:
        assert server.pad_to == (1, 2)


def test_an_on_executed_that_raises_still_resolves_the_batchs_requests(runtime):
    # on_executed ran before the batch was handed out, in the runtime future's done-callback:
    # its exception (logged and swallowed by Future) skipped the hand-out, so the requests
    # never resolved and their batch held its place in the window for good
    def broken(rows, seconds):
        raise RuntimeError("counter broke")

    with Server(runtime, ServeSpec(2), on_executed=broken) as server:
        futures = [server.submit(_sample(i)) for i in range(4)]
        for i, f in enumerate(futures):
            np.testing.assert_allclose(f.result(timeout=30)["y"], _sample(i)["x"] @ W, rtol=1e-5, atol=1e-5)
        assert server.in_flight == 0


def test_close_from_a_result_callback_on_a_cpu_worker_does_not_wait_for_that_worker(plan, tmp_path):
    # a CPU-only runtime hands results out on the worker that finished the batch: a close()
    # from a result's callback there waited for the batches queued behind on that very worker
    pu = str(min(__import__("os").sched_getaffinity(0)))
    with Runtime(plan, MachineSpec(pu), RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path))) as rt:
        server = Server(rt, ServeSpec(2))
        queued, closed = threading.Event(), threading.Event()

        def close_now(_f):
            queued.wait(10)  # the second batch is in the runtime, behind this one
            server.close(timeout=60)
            closed.set()

        first = [server.submit(_sample(0))]
        first[0].add_done_callback(close_now)
        first.append(server.submit(_sample(1)))
        second = [server.submit(_sample(i)) for i in (2, 3)]
        queued.set()
        assert closed.wait(20), "close() from the worker's callback waits for that worker"
        for f in first:
            assert f.result(timeout=10)["y"].shape == (1, 16)
        for f in second:  # run, or failed by the close: answered either way
            assert f.exception(timeout=30) is None or isinstance(f.exception(), ServerClosed)
        assert not server.batching


def test_a_request_of_more_rows_than_the_queue_holds_is_refused_at_once(stand_in):
    # with max_delay the queue may hold fewer samples than a batch: a request of more rows
    # than the capacity could never be queued, and with on_full="block" its submit waited forever
    x = np.concatenate([_sample(i)["x"] for i in range(4)])
    with Server(stand_in, ServeSpec(8, max_delay=0.01, queue_capacity=2, on_full="block")) as server:
        got: list[BaseException] = []

        def submit() -> None:
            try:
                server.submit({"x": x}, checked=True, rows=4)
            except Exception as exc:  # noqa: BLE001 - what the test looks at
                got.append(exc)

        t = threading.Thread(target=submit, daemon=True)
        t.start()
        t.join(20)
        alive = t.is_alive()
    t.join(20)
    assert not alive and len(got) == 1 and isinstance(got[0], InputError), got
    assert "queue" in str(got[0])


def test_requests_their_callers_withdrew_are_neither_pending_nor_backlog(stand_in):
    # a withdrawn request never gets a result: it was counted pending and in the backlog for
    # good, so a run whose clients went away read as one with requests still waiting, and
    # enough of them as congested
    from staronnx.serving.metrics import backlog, summarize

    with Server(stand_in, ServeSpec(4)) as server:
        kept = [server.submit(_sample(i)) for i in range(4)]
        gone = [server.submit(_sample(i)) for i in range(4, 7)]
        assert all(f.cancel() for f in gone)
        assert server.queue_length == 0
        for f in kept:
            f.result(timeout=10)
        rec = server.records()
    assert sum(r.withdrawn for r in rec.requests) == 3
    summary = summarize(rec)
    assert summary["completed"] == 4 and summary["pending"] == 0, summary["pending"]
    assert backlog(rec, np.array([rec.end + 1.0]))[0] == 0


def test_the_capacity_of_a_queue_policy_without_levels_bounds_the_queue(stand_in):
    # "a model without priority levels is one level; its policy still applies": its capacity
    # was read only where the queue kept levels, so here it was silently ignored
    from staronnx.serving.priority import LevelPolicy, QueuePolicy

    policy = QueuePolicy(levels=(LevelPolicy(capacity=2),))
    spec = ServeSpec(4, max_delay=30.0, queue_policy=policy)
    assert spec.queue_capacity == 2
    with Server(stand_in, spec) as server:
        kept = [server.submit(_sample(i)) for i in range(2)]
        with pytest.raises(server_module.OverloadError):
            server.submit(_sample(2))
        server.flush()
        for f in kept:
            f.result(timeout=10)
    with pytest.raises(StaronnxError, match="queue_capacity"):  # a full batch could never form
        ServeSpec(4, queue_policy=policy)


def test_flush_sends_multi_row_requests(stand_in):
    # flush() counted the requests to let go, the batcher's rule their rows: two requests of
    # 3 rows made a flush batch of "2" rows, which neither fits: nothing left, and the batcher
    # spun on that decision (a core at 100 %) until close
    x = np.concatenate([_sample(i)["x"] for i in range(3)])
    with Server(stand_in, ServeSpec(8)) as server:
        futures = [server.submit({"x": x}, checked=True, rows=3) for _ in range(2)]
        server.flush()
        for f in futures:
            np.testing.assert_allclose(f.result(timeout=10)["y"], x @ W, rtol=1e-5, atol=1e-5)
        assert [b.size for b in server.records().batches] == [6]


def test_wait_idle_returns_once_the_last_queued_request_is_withdrawn(stand_in):
    # the cancel woke both the batcher and wait_idle(); when wait_idle looked first it found
    # the request still queued (the batcher drops withdrawn ones) and slept again, and the
    # batcher dropped it without a word: wait_idle() waited out its timeout (forever with None)
    with Server(stand_in, ServeSpec(4)) as server:
        for i in range(20):
            future = server.submit(_sample(i))
            left: list[int] = []
            waiter = threading.Thread(target=lambda: left.append(server.wait_idle()), daemon=True)
            waiter.start()
            while not server._idle_waiters:  # it waits for the request
                time.sleep(0.001)
            assert future.cancel()
            waiter.join(20)
            assert not waiter.is_alive(), f"wait_idle() still waits after cancel {i}"
            assert left == [0]
