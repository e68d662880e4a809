"""What a caller of either engine holds: a request's future and a failed task's error.

(The requests, tasks and data handles themselves are the core's: :mod:`staronnx.runtime.core`.)
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from concurrent.futures._base import CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED, PENDING
from typing import Any, Generator

import numpy as np

#: a future in one of these states will not change any more
SETTLED = (CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED)


class RequestFuture(Future[Any]):
    """A concurrent.futures.Future of a request's outputs, also awaitable from asyncio; a
    light one.

    A plain Future builds a Condition per request (an RLock, a deque and five bound methods:
    objects the cycle collector then walks for as long as the caller keeps the future, and a
    microsecond to build on the submitting thread, which is what bounds a runtime's requests/s
    at small batches). The futures of one engine or server share one Condition instead
    (``condition``), which only guards state changes; a caller that blocks in ``result()``
    waits on a lock of its own, registered as a waiter the way ``concurrent.futures.wait``
    registers its own, so a result wakes that caller only (no herd on the shared Condition).
    Waiter and callback lists are made on first use (most requests never have either).
    ``concurrent.futures.wait``/``as_completed``, ``add_done_callback``, ``cancel`` and
    ``await`` behave as with any Future (tests/test_runtime.py and tests/test_serving_path.py
    hold them, and that this class keeps every attribute ``Future.__init__`` sets).
    """

    def __init__(self, request_id: int, condition: threading.Condition | None = None) -> None:
        # Future.__init__ without its per-future Condition (see the class docstring)
        self._condition = condition if condition is not None else threading.Condition()
        self._state = PENDING
        self._result = None
        self._exception = None
        self._waiter_list: list[Any] | None = None
        self._callback_list: list[Any] | None = None
        self.request_id = request_id
        #: set by :meth:`cancel` (a plain attribute: the engine reads it for every task it pops)
        self.cancelled_by_caller = False
        #: "part<k>" -> arch of the worker that ran it (serving reports CPU share from this)
        self.placement: dict[str, str] = {}
        #: the serving batch that carried this request (a BatchRecord: formed/done times, size),
        #: set by the Server before the result, so network front ends can split queue from compute
        self.batch: Any = None

    # Future's code and concurrent.futures.wait() use these lists under the shared Condition
    # (appends, removals, the loops of set_result and friends) or once the future is settled
    # (_invoke_callbacks), so making them on first use cannot race.
    @property
    def _waiters(self) -> list[Any]:  # type: ignore[override]  # an attribute of Future.__init__, skipped here
        if self._waiter_list is None:
            self._waiter_list = []
        return self._waiter_list

    @property
    def _done_callbacks(self) -> list[Any]:
        if self._callback_list is None:
            self._callback_list = []
        return self._callback_list

    def cancel(self) -> bool:
        """Future.cancel, which only notifies the Condition: callers blocked on a lock of their
        own are woken here; :attr:`cancelled_by_caller` then tells the engine to drop the
        request's tasks not yet started."""
        if not super().cancel():
            return False
        self.cancelled_by_caller = True
        with self._condition:
            blocked = [w for w in self._waiter_list or () if isinstance(w, _Wakeup)]
        for w in blocked:
            w.add_cancelled(self)
        return True

    def result(self, timeout: float | None = None) -> Any:
        if self._state not in SETTLED:  # (read without the lock: see _block)
            self._block(timeout)
        if self._state == FINISHED:  # settled states never change: no lock needed to read it
            if self._exception is not None:
                try:
                    raise self._exception
                finally:
                    self = None  # type: ignore[assignment]  # as Future: no cycle via the frame
            return self._result
        return super().result(0)  # cancelled: CancelledError; still pending: TimeoutError

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._block(timeout)
        if self._state == FINISHED:
            return self._exception
        return super().exception(0)

    def _block(self, timeout: float | None) -> None:
        """Wait until done or ``timeout`` s, on a lock of this caller's own."""
        if self._state in SETTLED:  # read without the lock: a settled state never changes back
            return
        wakeup = _Wakeup()
        cond = self._condition
        cond.acquire()  # its lock's C methods: a Condition's __enter__/__exit__ are Python calls
        try:
            if self._state in SETTLED:
                return
            waiters = self._waiters
            waiters.append(wakeup)
        finally:
            cond.release()
        try:
            wakeup.lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0))
        finally:
            cond.acquire()
            try:
                if wakeup in waiters:
                    waiters.remove(wakeup)
            finally:
                cond.release()

    def __await__(self) -> Generator[Any, None, dict[str, np.ndarray]]:
        return asyncio.wrap_future(self).__await__()


def settle(future: RequestFuture, value: Any, ok: bool) -> None:
    """Give ``future`` its result (``ok``) or error in one hold of its Condition, as
    ``set_result``/``set_exception`` would, minus their errors for a future its caller
    cancelled meanwhile (that one is only announced to its waiters, as
    ``set_running_or_notify_cancel`` does). Callbacks run after, outside the lock."""
    with future._condition:
        callbacks = settle_locked(future, value, ok)
    if callbacks:
        run_callbacks(future)


def settle_quietly(future: RequestFuture, value: Any, ok: bool) -> bool:
    """:func:`settle`'s state change without waking anyone yet: True when the future has
    waiters or callbacks, which :func:`announce` must then reach. The state changes under
    the Condition now, so a caller that looks from here on finds the result and never
    blocks; only those already blocked (or called back) hear of it later. A driver thread
    uses it to hand out several results in one wake-up instead of one per task (a wake-up
    costs the woken thread's switch and a GIL hand-over each way)."""
    cond = future._condition
    cond.acquire()  # the Condition's lock methods (C) rather than its Python __enter__/__exit__
    try:
        if future._state == PENDING:  # (_finish_locked's common case, inlined: once per request)
            future._state = FINISHED
            if ok:
                future._result = value
            else:
                future._exception = value
        elif not _finish_locked(future, value, ok):
            return False
        return bool(future._waiter_list or future._callback_list)
    finally:
        cond.release()


def announce(futures: list[RequestFuture]) -> None:
    """Wake the callers blocked on ``futures`` (settled by :func:`settle_quietly`), in one
    hold of their Condition when they share it, then run their callbacks."""
    cond = None
    for f in futures:
        if f._condition is not cond:
            if cond is not None:
                cond.release()
            cond = f._condition
            cond.acquire()
        _wake_locked(f)
    if cond is not None:
        cond.release()
    for f in futures:
        if f._callback_list:
            run_callbacks(f)


def run_callbacks(future: RequestFuture) -> None:
    """Run a settled future's callbacks, as ``set_result`` does once it released the lock."""
    future._invoke_callbacks()  # type: ignore[attr-defined]  # Future's own runner, private: not in typeshed


def settle_locked(future: RequestFuture, value: Any, ok: bool) -> bool:
    """:func:`settle`'s state change, with the future's Condition already held (a server
    settles a whole batch in one hold); True when the future has callbacks for the caller to
    run once the lock is released."""
    if not _finish_locked(future, value, ok):
        return False
    _wake_locked(future)
    return bool(future._callback_list)


def announce_cancelled(owner: object) -> None:
    """What an executor does with a cancelled item it reaches: a :class:`RequestFuture` its caller
    cancelled is announced to its waiters, so that ``concurrent.futures.wait()`` and
    ``as_completed()`` count it done (they wait for the announcement); once only. Anything else
    (a pending future, a driver's batch record) is left alone."""
    if isinstance(owner, RequestFuture):
        with owner._condition:
            if owner._state == CANCELLED:
                _finish_locked(owner, None, False)


def _finish_locked(future: RequestFuture, value: Any, ok: bool) -> bool:
    """(Condition held) A pending future takes its result or error: True. A future its caller
    cancelled is only announced to its waiters (``set_running_or_notify_cancel``), and a
    settled one is left alone: False."""
    state = future._state
    if state == CANCELLED:
        future._state = CANCELLED_AND_NOTIFIED
        for w in future._waiter_list or ():
            w.add_cancelled(future)
        return False
    if state in SETTLED:
        return False
    future._state = FINISHED
    if ok:
        future._result = value
    else:
        future._exception = value
    return True


def _wake_locked(future: RequestFuture) -> None:
    """(Condition held) Tell the waiters of a finished future: blocked callers, ``wait()``."""
    waiters = future._waiter_list
    if waiters:
        failed = future._exception is not None
        for w in waiters:
            if failed:
                w.add_exception(future)
            else:
                w.add_result(future)


class _Wakeup:
    """A caller blocked on one :class:`RequestFuture`: what ``concurrent.futures``' waiters
    are to ``wait()`` (set_result, set_exception and set_running_or_notify_cancel call these)."""

    __slots__ = ("lock",)

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()

    def add_result(self, future: Future[Any]) -> None:
        try:
            self.lock.release()
        except RuntimeError:  # woken already (a cancel, then its notification)
            pass

    add_exception = add_cancelled = add_result


class TaskError(RuntimeError):
    """A part failed while running; ``__cause__`` is ONNX Runtime's own error."""

    def __init__(self, part: int, worker: str, cause: BaseException) -> None:
        super().__init__(f"part {part} failed on worker {worker}: {type(cause).__name__}: {cause}")
        self.part = part
        self.worker = worker
