"""What every worker thread shares: one thread that owns the sessions, a clean close.

A worker (:class:`~staronnx.workers.cpu.CpuWorker`, :class:`~staronnx.workers.cuda.CudaWorker`)
is one thread that builds its ONNX Runtime sessions itself and then runs the functions it is
given. The sessions must be built, run and dropped in that thread: its affinity is what ORT's
pool threads inherit, its memory binding decides where weights are first touched, and a CUDA
worker's device context, streams and buffers belong to it. So the lifecycle (``start`` waits
for the sessions and re-raises what failed; ``close`` finishes or cancels what is queued, tears
down in the thread and joins it; an ``atexit`` hook closes forgotten workers, whose threads are
daemons) and the queue of functions (``call``/``spawn``) live here.

There is one way to run a task: ``run_here`` in the worker's thread, from an engine's serving
loop spawned there (:mod:`staronnx.runtime.engine`: scheduled tasks, calibration and warm-up
alike), or from ``submit``/``run`` for a worker used on its own.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
import traceback
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, Self, TypeVar

import numpy as np

from staronnx.errors import DeviceError, ModelError
from staronnx.workers.replicas import DeviceTensor, OutputRoute

__all__ = ["ThreadWorker", "Worker", "WorkerLost"]

T = TypeVar("T")

Feeds = Mapping[str, np.ndarray]
Outputs = dict[str, np.ndarray]


class WorkerLost(DeviceError):
    """The worker can no longer run anything (a CUDA context lost to a sticky error): the task
    it was given did not fail, it must run elsewhere, and so must the worker's queued ones."""


class Worker(Protocol):
    """What engines need of a worker (:class:`ThreadWorker`'s subclasses, or a stand-in that
    subclasses this protocol for its defaults): its identity for the policy, and tasks run from
    inside its own thread (``spawn`` an engine's loop there, then ``run_here`` per task).

    ``run_here(..., timed=False)`` may skip timing (nothing to learn: the perf model is
    calibrated). A worker that :attr:`launches_ahead` starts a task with ``launch_here(part,
    feeds, timed, route) -> handle`` and waits for it with ``finish_here(handle) -> outputs``
    (the CUDA worker does), and the native engine then launches its next task before waiting;
    the defaults here run the task to its end at launch. Such workers with the same
    ``driver_key`` (a CUDA device's streams) are driven by one engine thread, which calls each
    one's ``adopt_thread()`` first (StarPU's driver thread per device). Any of them may raise
    :class:`WorkerLost`: the engine then moves the worker's tasks elsewhere."""

    name: str
    kind: str  # "cpu" or "cuda"
    arch: str  # perf-model architecture: "cpu<ncores>" or "cuda<device>"
    memory_node: str  # "numa0", "cuda0", ...
    n_cores: int
    last_compute_seconds: float | None  # kernel time of the last run_here (CUDA), else None
    #: the parts it holds a session for; None: every part (the scheduler's fast path)
    holds: frozenset[int] | None = None
    #: workers that launch ahead with the same key share one engine thread (None: its own)
    driver_key: str | None = None
    #: the native id of the thread it runs in (None until it started)
    native_id: int | None = None

    @property
    def launches_ahead(self) -> bool:
        """Whether ``launch_here`` returns before the task has run (a CUDA stream's queue): the
        engine then keeps up to two tasks launched per worker. A CUDA worker is the one kind
        that does."""
        return self.kind == "cuda"

    def spawn(self, fn: Callable[[], T]) -> Future[T]: ...
    def run_here(self, part: int, feeds: Feeds, timed: bool = True) -> Outputs: ...
    def close(self) -> None: ...

    # the defaults of a worker that runs a task to its end at launch (the handle is the outputs)
    def launch_here(self, part: int, feeds: Feeds, timed: bool = True, route: OutputRoute | None = None) -> Any:
        return self.run_here(part, feeds, timed)

    def finish_here(self, launch: Any) -> Outputs:
        outputs: Outputs = launch
        return outputs

    def device_outputs(self, launch: Any) -> Sequence[tuple[str, DeviceTensor]]:
        """After ``finish_here``: the outputs its ``route`` kept in the worker's GPU memory."""
        return ()

    def ready(self, launch: Any) -> bool:  # whether finish_here returns at once
        return True

    def adopt_thread(self) -> None:  # ready the calling thread to launch this worker's tasks
        return None


_STOP = object()
_live: weakref.WeakSet[ThreadWorker] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for worker in list(_live):
        with contextlib.suppress(Exception):  # best effort at exit
            worker.close(timeout=5.0, cancel_pending=True)


class ThreadWorker(Worker, ABC):
    """The thread, queue and lifecycle of a worker; subclasses run the tasks.

    Each worker has one thread named after it (``name``) that runs everything touching its
    sessions.
    """

    last_compute_seconds: float | None = None  # CPU: wall time is compute time

    def __init__(self, part_paths: Sequence[str | os.PathLike[str] | None], name: str) -> None:
        if not part_paths:
            raise ModelError(f"a {self.kind.upper()} worker needs at least one part (.onnx file)")
        #: by part number; None for a part this worker does not hold (no session: a runtime
        #: whose workers cannot all load every model gives each only some, and a worker no
        #: model's residency selects holds none and stays idle)
        self.part_paths: list[Path | None] = [None if p is None else Path(p) for p in part_paths]
        self.holds = (
            None if all(p is not None for p in self.part_paths)
            else frozenset(i for i, p in enumerate(self.part_paths) if p is not None))
        self.name = name
        self.native_id: int | None = None
        #: items: (fn, Future) or _STOP.
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
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
    def run_here(self, part: int, feeds: Feeds, timed: bool = True) -> Outputs:
        """Run a part from inside the worker's thread and return its outputs; errors
        propagate (the caller fails that task only)."""

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
    def submit(self, part: int, feeds: Feeds) -> Future[Outputs]:
        """``run_here(part, feeds)`` in the worker's thread, for a worker used on its own (an
        engine runs tasks from its loop, in that thread); the future resolves to ``{output
        name: array}``, or to the task's error (a failed task fails alone)."""
        self._check_part(part)
        return self.spawn(lambda: self.run_here(part, feeds))  # (refused once closed)

    def run(self, part: int, feeds: Feeds) -> Outputs:
        """Synchronous :meth:`submit` (still executed by the worker thread)."""
        return self.submit(part, feeds).result()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` in the worker thread, between tasks, and return its result."""
        return self.spawn(fn).result()

    def spawn(self, fn: Callable[[], T]) -> Future[T]:
        """Start ``fn()`` in the worker thread and return at once.

        An engine runs its serving loop this way, so tasks execute on the worker's own thread
        with no extra thread hop; the loop calls ``run_here`` for each task and must return
        before :meth:`close` can finish.
        """
        fut: Future[T] = Future()
        self._put((fn, fut))
        return fut

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
        if self._thread is None:
            raise RuntimeError(f"{self.name} is not started; call start() first")
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed; cannot accept new tasks")
            self._queue.put(item)

    def _cancel_queued(self) -> None:
        stop_seen = False
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                stop_seen = True
            else:  # (fn, future)
                item[1].cancel()
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
            while (item := self._queue.get()) is not _STOP:
                fn, fut = item
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001
                    # the traceback's frames hold the ORT session (``self`` of its run wrapper):
                    # kept in the future they would keep the session - its thread pool, arena,
                    # stream - alive after close(); the error's message says what went wrong
                    traceback.clear_frames(exc.__traceback__)
                    fut.set_exception(exc)
        finally:
            self._teardown()

    def _pin(self, pu: int, hint: Callable[[], str] = str) -> None:
        """Pin the calling thread (on Linux, ``sched_setaffinity(0)`` is per thread) to ``pu``;
        ``hint()`` ends the error when it cannot."""
        try:
            os.sched_setaffinity(0, {pu})
        except (OSError, ValueError) as exc:
            raise DeviceError(f"{self.name} cannot run on PU {pu} ({exc}){hint()}") from None
