"""Arrival processes: when single-sample requests reach the server.

The papers inject queries at a rate rho with a constant interval; Poisson arrivals are the usual
model of independent users; a replayed trace gives production burstiness. Each process hands
out a *schedule* of absolute offsets from 0 (seconds), computed up front, so the open-loop
generator can sleep until each arrival time instead of "after the previous one": a late
submission then never shifts the arrivals that follow it, which is what keeps the offered
rate honest under load.

Schedules start with an arrival at offset 0; arrival ``i`` is at the sum of the first ``i``
intervals. A schedule is deterministic: the same process (same seed, same file) always gives
the same offsets, so a sweep point can be replayed exactly, and the simulator can be fed the
very schedule the live run used.
"""

from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from staronnx.errors import StaronnxError

DISTRIBUTIONS = ("constant", "poisson")


class ArrivalError(StaronnxError, ValueError):
    """An arrival process cannot be built as asked: bad rate, bad trace file, no length."""


def _check_rate(rate: float) -> float:
    rate = float(rate)
    if not math.isfinite(rate) or rate <= 0:
        raise ArrivalError(f"arrival rate must be a positive number of requests per second, got {rate}")
    return rate


def _check_bounds(n: int | None, duration: float | None) -> None:
    if n is None and duration is None:
        raise ArrivalError("a schedule needs a length: give n (requests) or duration (seconds)")
    if n is not None and n < 0:
        raise ArrivalError(f"n must be >= 0, got {n}")
    if duration is not None and (not math.isfinite(duration) or duration < 0):
        raise ArrivalError(f"duration must be a finite number of seconds >= 0, got {duration}")


def _offsets(intervals: np.ndarray) -> np.ndarray:
    """Arrival offsets from intervals: the first arrival at 0, then cumulative sums."""
    return np.concatenate([[0.0], np.cumsum(intervals, dtype=np.float64)])


def _cut(offsets: np.ndarray, n: int | None, duration: float | None) -> np.ndarray:
    """The arrivals kept by whichever bound comes first (``duration`` is exclusive)."""
    if duration is not None:
        offsets = offsets[offsets < duration]
    if n is not None:
        offsets = offsets[:n]
    return offsets


class ArrivalProcess(ABC):
    """A source of inter-arrival intervals with a nominal rate (requests per second)."""

    #: nominal rate: what the sweep calls "offered"
    rate: float

    @abstractmethod
    def intervals(self, count: int) -> np.ndarray:
        """The first ``count`` inter-arrival intervals (seconds), always the same for a process."""

    def schedule(self, n: int | None = None, duration: float | None = None) -> np.ndarray:
        """Absolute arrival offsets from 0 (seconds): ``n`` arrivals, or those before ``duration``.

        With both bounds, the schedule stops at whichever is reached first.
        """
        _check_bounds(n, duration)
        if n is not None:
            return _cut(_offsets(self.intervals(max(n - 1, 0))), n, duration)
        assert duration is not None
        # draw enough intervals to pass the deadline (several tries only if the process is far
        # burstier than its nominal rate says)
        count = int(duration * self.rate * 1.1) + 16
        while True:
            offsets = _offsets(self.intervals(count))
            if offsets[-1] >= duration or not self._unbounded:
                return _cut(offsets, n, duration)
            count *= 2

    #: False for finite traces: the schedule ends with the trace
    _unbounded: bool = True


class Constant(ArrivalProcess):
    """Every request ``1/rate`` seconds after the previous one (the papers' injection)."""

    def __init__(self, rate: float) -> None:
        self.rate = _check_rate(rate)

    def intervals(self, count: int) -> np.ndarray:
        return np.full(count, 1.0 / self.rate)

    def schedule(self, n: int | None = None, duration: float | None = None) -> np.ndarray:
        # i / rate rather than a cumulative sum: exact, with no rounding drift over long runs
        _check_bounds(n, duration)
        count = n if n is not None else 0
        if duration is not None:
            in_time = math.ceil(duration * self.rate)
            # ceil can count one too many when duration * rate is (nearly) an integer
            if in_time > 0 and (in_time - 1) / self.rate >= duration:
                in_time -= 1
            count = in_time if n is None else min(count, in_time)
        return np.arange(count, dtype=np.float64) / self.rate

    def __repr__(self) -> str:
        return f"Constant(rate={self.rate:g})"


class Poisson(ArrivalProcess):
    """Exponential intervals of mean ``1/rate``: independent users; reproducible from ``seed``."""

    def __init__(self, rate: float, seed: int = 0) -> None:
        self.rate = _check_rate(rate)
        self.seed = int(seed)

    def intervals(self, count: int) -> np.ndarray:
        # a fresh generator per call: the first k intervals never depend on earlier calls
        return np.random.default_rng(self.seed).exponential(1.0 / self.rate, size=count)

    def __repr__(self) -> str:
        return f"Poisson(rate={self.rate:g}, seed={self.seed})"


class Replay(ArrivalProcess):
    """Intervals read from a text file: one number (seconds) per line, ``#`` starts a comment.

    With ``timestamps=True`` each line is an absolute arrival time instead (non-decreasing;
    the first one becomes offset 0). A trace is finite: its schedule ends with the file unless
    ``loop=True`` repeats it. ``rate`` is the trace's mean rate.
    """

    def __init__(self, path: str | os.PathLike[str], *, timestamps: bool = False, loop: bool = False) -> None:
        self.path = Path(path)
        self.timestamps = timestamps
        self.loop = loop
        self._unbounded = loop
        values = _read_numbers(self.path)
        if timestamps:
            if len(values) < 2:
                raise ArrivalError(f"{self.path}: a timestamp trace needs at least 2 times, found {len(values)}")
            steps = np.diff(values)
            bad = np.flatnonzero(steps < 0)
            if bad.size:
                i = int(bad[0])
                raise ArrivalError(
                    f"{self.path}: timestamps must not decrease, but {values[i + 1]:g} follows {values[i]:g} "
                    f"(value {i + 2})"
                )
            self._intervals = steps
        else:
            if len(values) == 0:
                raise ArrivalError(f"{self.path}: no intervals in the file")
            bad = np.flatnonzero(values < 0)
            if bad.size:
                raise ArrivalError(
                    f"{self.path}: intervals must be >= 0 seconds, value {int(bad[0]) + 1} is {values[bad[0]]:g}"
                )
            self._intervals = values
        total = float(self._intervals.sum())
        if total <= 0:
            raise ArrivalError(f"{self.path}: the trace spans no time (every interval is 0)")
        self.rate = len(self._intervals) / total

    def intervals(self, count: int) -> np.ndarray:
        if count <= len(self._intervals) or not self.loop:
            return self._intervals[:count].copy()
        reps = -(-count // len(self._intervals))
        return np.tile(self._intervals, reps)[:count]

    def schedule(self, n: int | None = None, duration: float | None = None) -> np.ndarray:
        if self.loop:
            return super().schedule(n, duration)
        _check_bounds(n, duration)
        return _cut(_offsets(self._intervals), n, duration)

    def __len__(self) -> int:
        """Arrivals in one pass over the trace."""
        return len(self._intervals) + 1

    def __repr__(self) -> str:
        kind = "timestamps" if self.timestamps else "intervals"
        return f"Replay({str(self.path)!r}, {kind}, rate={self.rate:g})"


def _read_numbers(path: Path) -> np.ndarray:
    """Numbers of a trace file, one per line; errors name the file and the line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ArrivalError(f"arrival trace not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ArrivalError(f"arrival trace {path} is unreadable: {exc}") from None
    values: list[float] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        content = line.split("#", 1)[0].strip()
        if not content:
            continue
        try:
            value = float(content)
        except ValueError:
            raise ArrivalError(f"{path}:{lineno}: expected one number of seconds, got {content!r}") from None
        if not math.isfinite(value):
            raise ArrivalError(f"{path}:{lineno}: {content!r} is not a finite number of seconds")
        values.append(value)
    return np.asarray(values, dtype=np.float64)


def make_arrivals(distribution: str, rate: float, seed: int = 0) -> ArrivalProcess:
    """The process a sweep's ``--distribution`` names: ``constant`` or ``poisson``."""
    if distribution == "constant":
        return Constant(rate)
    if distribution == "poisson":
        return Poisson(rate, seed)
    raise ArrivalError(f"unknown arrival distribution {distribution!r}; choose one of {', '.join(DISTRIBUTIONS)}")
