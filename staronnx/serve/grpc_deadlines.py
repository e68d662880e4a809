"""``--request-timeout`` for the gRPC door's inference calls, without a timer per call.

``asyncio.timeout`` arms a loop timer when a call starts and disarms it when the call ends: a
timer handle made and cancelled per request (7 µs of the event loop's thread per call on uvloop,
measured on the 2-core host, about 2-3 % of a trivial model's gRPC request). Every call gets the
same timeout, so deadlines come in the order the calls start: the calls in flight are kept in
one insertion-ordered dict (an insert and a delete per call), and one timer, armed at the
earliest deadline, withdraws the calls past theirs and re-arms itself at the next one. The timer
fires about once per timeout (each time at the then-oldest call's deadline), never per call,
and a call is withdrawn exactly at its own deadline, as with ``asyncio.timeout``.

A withdrawn call's task is cancelled, as ``asyncio.timeout`` cancels it (the request path sees a
cancelled task and counts it so); :meth:`Deadlines.withdrawn` tells the call's handler, when the
cancellation reaches it, that its deadline and not its client ended it.
"""

from __future__ import annotations

import asyncio


class Deadlines:
    """The inference calls in flight, by task, with the loop time each must be answered by."""

    __slots__ = ("seconds", "_calls", "_withdrawn", "_timer")

    def __init__(self, seconds: float) -> None:
        #: the time a call may take (0 or less: no deadline, nothing is kept)
        self.seconds = seconds
        self._calls: dict[asyncio.Task[object], float] = {}
        self._withdrawn: set[asyncio.Task[object]] = set()
        self._timer: asyncio.TimerHandle | None = None

    def enter(self) -> asyncio.Task[object] | None:
        """Start the current task's deadline; the task (for :meth:`leave`), or None where there
        is no deadline to keep."""
        if self.seconds <= 0:
            return None
        task = asyncio.current_task()
        if task is None:  # not in a task (cannot be cancelled): nothing to withdraw
            return None
        loop = task.get_loop()
        self._calls[task] = loop.time() + self.seconds
        if self._timer is None:
            self._timer = loop.call_at(self._calls[task], self._sweep, loop)
        return task

    def leave(self, task: asyncio.Task[object] | None) -> None:
        """The call of ``task`` ended (answered, refused, cancelled or withdrawn)."""
        if task is not None:
            self._calls.pop(task, None)
            self._withdrawn.discard(task)

    def withdrawn(self, task: asyncio.Task[object] | None) -> bool:
        """Whether ``task`` was cancelled because its deadline passed; if so, its cancellation
        is taken back (``uncancel``), so the handler answers DEADLINE_EXCEEDED instead."""
        if task is None or task not in self._withdrawn:
            return False
        task.uncancel()
        return True

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """(The timer.) Withdraw every call past its deadline; re-arm at the next deadline."""
        self._timer = None
        now = loop.time()
        late = []
        for task, deadline in self._calls.items():
            if deadline > now:
                break
            late.append(task)
        for task in late:
            del self._calls[task]
            self._withdrawn.add(task)
            task.cancel()
        if self._calls:
            self._timer = loop.call_at(next(iter(self._calls.values())), self._sweep, loop)
