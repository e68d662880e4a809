"""What every worker thread shares: a queue, one thread that owns the sessions, a clean close.

A worker (:class:`~staronnx.workers.cpu.CpuWorker`, :class:`~staronnx.workers.cuda.CudaWorker`)
is one thread that builds its ONNX Runtime sessions itself and then serves a FIFO queue. The
sessions must be built, run and dropped in that thread: its affinity is what ORT's pool threads
inherit, its memory binding decides where weights are first touched, and a CUDA worker's
device context, streams and buffers belong to it. So the lifecycle (``start`` waits for the
sessions and re-raises what failed; ``close`` finishes or cancels the queue, tears down in the
thread and joins it; an ``atexit`` hook closes forgotten workers, whose threads are daemons),
the queue (tasks, and ``call``/``spawn`` of functions between tasks: an engine's serving loop
runs there and calls ``run_here`` per task) and the task bookkeeping (a failed task fails its
own future only, with its traceback's frames cleared since they hold the session) live here.
A subclass supplies :meth:`ThreadWorker._setup_thread` (pin, bind, build sessions),
:meth:`ThreadWorker._run_task` and :meth:`ThreadWorker._teardown`, all in the worker thread.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import time
import traceback
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, Self

import numpy as np

from staronnx.errors import DeviceError, ModelError

__all__ = ["OnDone", "ThreadWorker", "Worker", "WorkerFuture", "WorkerLost", "WorkerStats", "WorkerTask"]

Feeds = Mapping[str, np.ndarray]
Outputs = dict[str, np.ndarray]
#: ``on_done(part, batch, seconds)``: called in the worker thread after each successful task.
OnDone = Callable[[int, int, float], None]


class WorkerLost(DeviceError):
    """The worker can no longer run anything (a CUDA context lost to a sticky error): the task
    it was given did not fail, it must run elsewhere, and so must the worker's queued ones."""


class Worker(Protocol):
    """What engines and calibration need of a worker (:class:`ThreadWorker`'s subclasses, or
    a stand-in): its identity for the policy, tasks queued (``submit``/``run``) or run from
    inside its own thread (``spawn`` an engine's loop there, then ``run_here`` per task).

    ``run_here(..., timed=False)`` may skip timing (nothing to learn: the perf model is
    calibrated). A worker that can start a task without waiting for it also offers
    ``launch_here(part, feeds, timed) -> handle`` and ``finish_here(handle) -> outputs`` (the
    CUDA worker does), and the native engine then launches its next task before waiting. Such
    workers with the same ``driver_key`` (a CUDA device's streams) are driven by one engine
    thread, which calls each one's ``adopt_thread()`` first (StarPU's driver thread per
    device). Any of them may raise :class:`WorkerLost`: the engine then moves the worker's
    tasks elsewhere."""

    name: str
    kind: str  # "cpu" or "cuda"
    arch: str  # perf-model architecture: "cpu<ncores>" or "cuda<device>"
    memory_node: str  # "numa0", "cuda0", ...
    n_cores: int
    last_compute_seconds: float | None  # kernel time of the last run_here (CUDA), else None

    def submit(self, part: int, feeds: Feeds) -> WorkerFuture: ...
    def run(self, part: int, feeds: Feeds) -> Outputs: ...
    def spawn(self, fn: Callable[[], Any]) -> Future[Any]: ...
    def run_here(self, part: int, feeds: Feeds, timed: bool = True) -> Outputs: ...
    def close(self) -> None: ...


class WorkerFuture(Future):  # type: ignore[type-arg]
    """A Future of ``{output name: array}`` that also says when and where the task ran.

    ``start``/``end`` are ``time.perf_counter()`` stamps taken around ``session.run`` (set
    before the result, so done-callbacks can read them); ``seconds`` is their difference.
    """

    def __init__(self, part: int, batch: int, worker: str) -> None:
        super().__init__()
        self.part = part
        self.batch = batch
        self.worker = worker
        self.start: float | None = None
        self.end: float | None = None

    @property
    def seconds(self) -> float | None:
        if self.start is None or self.end is None:
            return None
        return self.end - self.start


@dataclass
class WorkerStats:
    """Counters a scheduler or a benchmark may read (updated by the worker thread only)."""

    done: int = 0
    failed: int = 0
    busy_seconds: float = 0.0


@dataclass
class WorkerTask:
    """One queued run of a part; ``record=False`` (warm-up) keeps it out of stats and on_done."""

    part: int
    feeds: Feeds
    fut: WorkerFuture
    record: bool


_STOP = object()
_live: weakref.WeakSet[ThreadWorker] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for worker in list(_live):
        with contextlib.suppress(Exception):  # best effort at exit
            worker.close(timeout=5.0, cancel_pending=True)


class ThreadWorker(ABC):
    """The thread, queue and lifecycle of a worker; subclasses run the tasks.

    Each worker has one thread named after it (``name``) that runs everything touching its
    sessions.  ``_log`` is the subclass's module logger, so its messages keep their origin.
    """

    kind: ClassVar[str]
    _log: ClassVar[logging.Logger]
    arch: str  # the rest of the Worker protocol's identity is set by the subclass
    memory_node: str
    n_cores: int
    last_compute_seconds: float | None = None  # CPU: wall time is compute time

    def __init__(
        self,
        part_paths: Sequence[str | os.PathLike[str] | None],
        name: str,
        on_done: OnDone | None,
    ) -> None:
        if not any(p is not None for p in part_paths):
            raise ModelError(f"a {self.kind.upper()} worker needs at least one part (.onnx file)")
        #: by part number; None for a part this worker does not hold (no session: a runtime
        #: whose workers cannot all load every model gives each only some)
        self.part_paths: list[Path | None] = [None if p is None else Path(p) for p in part_paths]
        #: the parts it holds; None when it holds every part (the scheduler's fast path)
        self.holds: frozenset[int] | None = (
            None if all(p is not None for p in self.part_paths)
            else frozenset(i for i, p in enumerate(self.part_paths) if p is not None))
        self.name = name
        self.on_done = on_done
        self.stats = WorkerStats()
        self.native_id: int | None = None
        #: items: ("run", WorkerTask), ("call", fn, Future) or _STOP.
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        #: items taken from the queue ahead of their turn (see _hold_next), served first.
        self._held: deque[Any] = deque()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ hooks
    def _prepare_start(self) -> None:
        """Called by :meth:`start`, under the lock, just before the thread starts."""

    @abstractmethod
    def _start_failure(self, err: BaseException) -> Exception:
        """What :meth:`start` raises (from ``err``) when the thread's setup failed with
        something other than a :class:`ModelError` or :class:`DeviceError`."""

    @abstractmethod
    def _setup_thread(self) -> None:
        """In the worker thread, before serving: pin, bind, build the sessions."""

    @abstractmethod
    def _run_task(self, task: Any) -> None:
        """In the worker thread: run one queued task and resolve its future (never raise)."""

    def _teardown(self) -> None:
        """In the worker thread, last: free what :meth:`_setup_thread` built (maybe half)."""

    @abstractmethod
    def _describe(self) -> str:
        """Where the worker runs, for ``repr`` (e.g. its group or its device)."""

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float | None = None) -> Self:
        """Start the thread and wait until it has built its sessions; raise if it cannot."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError(f"{self.name} is already started")
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            for p in self.part_paths:
                if p is not None and not p.is_file():
                    raise ModelError(f"part file {str(p)!r} does not exist")
            self._prepare_start()
            self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            _live.add(self)
            self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self.name} did not finish loading its sessions in {timeout} s")
        if self._error is not None:
            self._thread.join()
            with self._lock:
                self._closed = True
            self._release()
            err = self._error
            if isinstance(err, (ModelError, DeviceError)):
                raise err
            raise self._start_failure(err) from err
        return self

    def close(self, timeout: float | None = None, cancel_pending: bool = False) -> None:
        """Stop accepting tasks, finish (or cancel) the queued ones, tear down, join the thread.

        Teardown runs inside the worker thread, which owns the sessions and what they use
        (ORT's pool threads, a CUDA worker's streams and buffers), so nothing is left behind.
        Raises TimeoutError if the thread is still running a task after ``timeout`` seconds
        (it will still exit after that task).  Idempotent.
        """
        with self._lock:
            first = not self._closed
            self._closed = True
        thread = self._thread
        if thread is None:
            self._release()
            return
        if first:
            if cancel_pending:
                self._cancel_queued()
            self._queue.put(_STOP)
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"{self.name} is still running a task after {timeout} s")
        self._cancel_queued()  # anything submitted in a race with close()
        self._release()

    def __enter__(self) -> Self:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _release(self) -> None:
        """Forget the worker once its thread is gone (or never started)."""
        _live.discard(self)

    # ------------------------------------------------------------------ queue
    @abstractmethod
    def submit(self, part: int, feeds: Feeds) -> WorkerFuture:
        """Queue ``part`` on ``feeds``; the future resolves to ``{output name: array}``."""

    def run(self, part: int, feeds: Feeds) -> Outputs:
        """Synchronous :meth:`submit` (still executed by the worker thread)."""
        return self.submit(part, feeds).result()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` in the worker thread, between tasks, and return its result."""
        return self.spawn(fn).result()

    def spawn(self, fn: Callable[[], Any]) -> Future[Any]:
        """Start ``fn()`` in the worker thread and return at once.

        An engine runs its serving loop this way, so tasks execute on the worker's own thread
        with no extra thread hop; the loop calls ``run_here`` for each task and must return
        before :meth:`close` can finish.
        """
        fut: Future[Any] = Future()
        self._put(("call", fn, fut))
        return fut

    def _check_started(self) -> None:
        if self._thread is None:
            raise RuntimeError(f"{self.name} is not started; call start() first")

    def _check_open(self) -> None:
        self._check_started()
        if self._closed:
            raise RuntimeError(f"{self.name} is closed; cannot accept new tasks")

    def _check_part(self, part: int) -> None:
        if not 0 <= part < len(self.part_paths):
            raise IndexError(f"{self.name} has parts 0..{len(self.part_paths) - 1}, not {part}")
        if self.part_paths[part] is None:
            raise IndexError(f"{self.name} does not hold part {part} (it was not loaded on this worker)")

    def _check_own_thread(self) -> None:
        """``run_here`` must be called from the worker's thread (where its sessions live)."""
        if threading.get_native_id() != self.native_id:
            raise RuntimeError(f"run_here called outside {self.name}'s thread")

    def _put(self, item: tuple[Any, ...]) -> None:
        self._check_started()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed; cannot accept new tasks")
            self._queue.put(item)

    def _warmup(
        self,
        batch_sizes: Sequence[int],
        make_feeds: Callable[[int, int], Feeds],
        repeats: int,
        new_task: Callable[[int, Feeds, int], WorkerTask],
        seconds: Callable[[Any], float | None],
        parallel: int = 1,
    ) -> list[tuple[int, int, float]]:
        """Queue ``repeats`` unrecorded runs of every part at every batch size, ``parallel``
        at a time (a worker that launches the next task before waiting needs that many buffer
        sets per shape, all of them warm).

        ``new_task(part, feeds, batch)`` builds the task; returns ``(part, batch,
        seconds(future))`` of the last repeat of each.
        """
        timings = []
        for part in range(len(self.part_paths)):
            if self.part_paths[part] is None:
                continue
            for b in batch_sizes:
                feeds = make_feeds(part, b)
                for _ in range(max(1, repeats)):
                    tasks = [new_task(part, feeds, b) for _ in range(max(1, parallel))]
                    for task in tasks:
                        self._put(("run", task))
                    for task in tasks:
                        task.fut.result()
                timings.append((part, b, seconds(tasks[-1].fut) or 0.0))
        return timings

    def _cancel_queued(self) -> None:
        stop_seen = False
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                stop_seen = True
            elif item[0] == "run":
                item[1].fut.cancel()
            else:  # ("call", fn, future)
                item[-1].cancel()
        if stop_seen:
            self._queue.put(_STOP)

    # ------------------------------------------------------------------ introspection
    @property
    def n_parts(self) -> int:
        return len(self.part_paths)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __repr__(self) -> str:
        state = "running" if self.alive else ("closed" if self._closed else "new")
        return (f"{type(self).__name__}({self.name!r}, {self._describe()}, "
                f"parts={self.n_parts}, {state})")

    # ------------------------------------------------------------------ worker thread
    def _main(self) -> None:
        try:
            self.native_id = threading.get_native_id()
            self._setup_thread()
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._teardown()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve()
        finally:
            self._teardown()

    def _serve(self) -> None:
        while True:
            item = self._held.popleft() if self._held else self._queue.get()
            if item is _STOP:
                return
            if item[0] == "call":
                self._do_call(item[1], item[2])
            else:
                self._run_task(item[1])

    def _hold_next(self) -> Any:
        """Take the next queued item now (it is still served next); its task, if it is one.

        What a worker needs to prepare the next task while the current one runs (CUDA
        prefetch); ``None`` when the queue is empty or the item is a call or the stop marker.
        """
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            return None
        self._held.append(item)
        if item is not _STOP and item[0] == "run":
            return item[1]
        return None

    @staticmethod
    def _do_call(fn: Callable[[], Any], fut: Future[Any]) -> None:
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001
                fut.set_exception(exc)

    def _pin(self, pu: int) -> None:
        """Pin the calling thread (on Linux, ``sched_setaffinity(0)`` is per thread) to ``pu``."""
        try:
            os.sched_setaffinity(0, {pu})
        except (OSError, ValueError) as exc:
            raise DeviceError(
                f"{self.name} cannot run on PU {pu} ({exc}){self._pin_hint()}") from None

    def _pin_hint(self) -> str:
        """Appended to the error when :meth:`_pin` fails."""
        return ""

    def _record_done(self, task: WorkerTask, seconds: float) -> None:
        """Count a successful task (unless it is a warm-up) and call ``on_done``."""
        if not task.record:
            return
        self.stats.done += 1
        self.stats.busy_seconds += seconds
        self._call_on_done(task.part, task.fut.batch, seconds)

    def _call_on_done(self, part: int, batch: int, seconds: float) -> None:
        if self.on_done is not None:
            try:
                self.on_done(part, batch, seconds)
            except Exception:  # noqa: BLE001 - a broken hook must not fail the task
                self._log.exception("%s: on_done hook failed", self.name)

    def _fail(self, task: WorkerTask, exc: BaseException) -> None:
        """Fail this task's future only."""
        task.fut.end = task.fut.end or time.perf_counter()
        if task.record:
            self.stats.failed += 1
        # The traceback's frames hold the ORT session (``self`` of its run wrapper): kept in
        # the future they would keep the session - its thread pool, arena, stream - alive
        # after close().  ORT's message says what went wrong; the locals can go.
        traceback.clear_frames(exc.__traceback__)
        task.fut.set_exception(exc)


# ---------------------------------------------------------------------- helpers
def _batch_of(feeds: Feeds, input_names: Sequence[str]) -> int:
    """The batch size: leading dimension of the first model input present in the feeds."""
    for name in list(input_names) + list(feeds):
        arr = feeds.get(name)
        if arr is not None:
            shape: tuple[int, ...] = tuple(getattr(arr, "shape", ()))
            return int(shape[0]) if shape else 1
    return 0
