"""Simulated time for the discrete-event simulator.

Policies read time only through a :class:`~staronnx.runtime.sched.Clock`, so the very same
policy objects that the native engine drives with ``time.perf_counter`` run here on a clock
that jumps from event to event. Keeping the clock and the event queue apart from the
simulator proper keeps both small and lets tests drive a policy by hand on the same clock.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any


class SimClock:
    """A clock that only moves when the simulator says so (never backwards)."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = float(start)

    def now(self) -> float:
        return self.t

    def advance(self, t: float) -> None:
        """Move to time ``t``; events are processed in time order, so ``t`` never decreases."""
        if t < self.t:
            raise ValueError(f"simulated time cannot go back from {self.t} to {t}")
        self.t = t


class EventQueue:
    """Events ordered by time, then by insertion (so ties resolve the same way every run).

    The insertion counter is what makes a seeded simulation reproducible: two events at the
    same instant always come out in the order they were scheduled, never by payload comparison.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()

    def push(self, t: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def pop(self) -> tuple[float, str, Any]:
        t, _, kind, payload = heapq.heappop(self._heap)
        return t, kind, payload

    def peek_time(self) -> float:
        """Time of the next event, ``inf`` when there is none."""
        return self._heap[0][0] if self._heap else float("inf")

    def __len__(self) -> int:
        return len(self._heap)
