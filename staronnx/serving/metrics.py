"""What a serving run achieved: pure functions over :class:`RunRecords`.

The live server and the simulator fill the same records, so both are judged by the same code.
Times are seconds on the records' clock.

The measurement window runs from ``start + warmup`` to the last arrival: while load is
offered. The drain after the last arrival is left out of rates (nothing arrives then, so it
would dilute the throughput of a light load) but the requests that arrived in the window are
all counted in latencies, however late they complete.

- **Throughput**: samples completed inside the window, per second of window.
- **The papers' latency**: for each batch, the latency of its *first* (oldest) request, which
  is the largest of the batch when batches leave full; reported as the mean over batches, with
  std, p95 and max as its spread.
- **Per-request percentiles**: p50 ... p99.9 with numpy's default (linear) interpolation.
- **Congestion**: the backlog (requests arrived but not finished, wherever they wait) keeps
  growing over the last half of the window and is still large at its end (both by more than
  two batches and by more than 5 % of the requests of that half), or the queue overflowed. The backlog is derived from
  arrival and completion times rather than from the server's queue samples, so it also sees
  work piling up inside the runtime and needs nothing the simulator might not record.
- **Stability** (perf_analyzer's rule): the window's batches are split in three consecutive
  groups of equal count; the point is stable when each group's throughput and p50 latency are
  within 10 % of their mean over the three (see :func:`stability_windows` for why batches and
  not time slices).
- **Failures are failures**: a point where any request failed is ``failed`` (whatever its
  backlog did: failed requests leave no backlog and complete nothing), its notes saying how many
  failed and why the first did (:func:`point_state`); throughput counts only the samples whose
  answers came back.
- **Whole batches**: latencies (the papers' and per request) come from the batches whose oldest
  request arrived in the window, every request of such a batch included, so a window edge never
  cuts a batch (see :func:`_window_batches`).

In the papers' model (no ``max_delay``) a batch leaves only when full, so a smaller batch is
the flush at the end of a run: its requests did not wait for the batch to fill, and their
latencies would flatter the result. They count as completed but stay out of latency figures.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from staronnx.serving.records import BatchRecord, RequestRecord, RunRecords

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "p999": 99.9}
#: perf_analyzer's default stability threshold and window count
STABILITY_TOLERANCE = 0.10
STABILITY_WINDOWS = 3
#: congested when the backlog grows by more than this many batches over the last half ...
CONGESTION_BATCHES = 2.0
#: ... and by more than this fraction of the requests that arrived in that half
CONGESTION_FRACTION = 0.05
_GRID = 256

NAN = float("nan")


def summarize(records: RunRecords, warmup: float = 0.0) -> dict[str, Any]:
    """Everything a sweep point reports, from one run's records (see the module docstring)."""
    w0, w1 = measurement_window(records, warmup)
    span = w1 - w0
    b = records.batch_size
    in_window = [r for r in records.requests if w0 <= r.arrival <= w1]
    accepted = [r for r in in_window if not r.rejected]
    excluded = _flush_batches(records)
    by_id = {r.id: r for r in records.requests}
    measured = _window_batches(records.batches, by_id, w0, w1, excluded)
    latencies = np.array([r.done - r.arrival for bt in measured for r in _members(bt, by_id)
                          if r.done is not None], dtype=np.float64)
    firsts = _first_latencies(measured, by_id)
    completions = np.array([r.done for r in records.requests if r.done is not None], dtype=np.float64)
    out: dict[str, Any] = {
        "offered_rate": float(records.offered_rate),
        "arrival_rate": rate_of(sorted(r.arrival for r in in_window)),
        "achieved_arrival_rate": NAN,
        "throughput": _count_in(completions, w0, w1) / span if span > 0 else NAN,
        "batch_size": b,
        "requests": len(in_window),
        "completed": sum(r.done is not None for r in accepted),
        "rejected": sum(r.rejected for r in in_window),
        "failed": sum(r.failed for r in accepted),
        "pending": sum(r.done is None and not (r.failed or r.withdrawn) for r in accepted),
        "batches": len(firsts),
    }
    generator = records.settings.get("loadgen") or {}
    out["achieved_arrival_rate"] = float(generator.get("achieved_arrival_rate", out["arrival_rate"]))
    out.update(_stats("paper_latency", firsts, ("mean", "std", "p95", "max")))
    out.update(_stats("latency", latencies, ("mean", *PERCENTILES, "max")))
    share, placement = cpu_share(records.batches)
    out["cpu_share"] = share  # None: the runtime recorded no placement; the sweep fills it
    out["placement"] = placement
    out.update(_queue_stats(records.queue_samples, w0, w1))
    out.update(_congestion(records, w0, w1, out["rejected"]))
    windows = _batch_windows(measured, by_id, STABILITY_WINDOWS)
    out["windows"] = windows
    out["stable"] = is_stable(windows)
    out["warmup_s"] = float(warmup)
    out["measured_s"] = float(span)
    failed_run = [r for r in records.requests if r.failed]
    out["state"], out["notes"] = point_state(out, len(failed_run), sum(not r.rejected for r in records.requests),
                                             first_error(records, failed_run))
    return out


def first_error(records: RunRecords, failed: Iterable[RequestRecord] | None = None) -> str | None:
    """Why the earliest failed request failed: its own record's ``error``, else the run's
    ``first_error`` (a front end that saw it without recording it per request); None if unsaid."""
    failed = [r for r in records.requests if r.failed] if failed is None else list(failed)
    said = min((r for r in failed if r.error), key=lambda r: r.arrival, default=None)
    return said.error if said is not None else records.first_error


#: what a point can be, worst first: its requests failed, its backlog grew, it held or it did not
STATES = ("failed", "congested", "stable", "unstable")


def point_state(summary: dict[str, Any], failed: int | None = None, accepted: int | None = None,
                first_error: str | None = None) -> tuple[str, str]:
    """(state, notes) of a point: ``failed`` when any request failed (``failed`` counts the whole
    run, warm-up and drain included: a failure is one wherever it falls), else ``congested``,
    ``stable`` or ``unstable``; the notes say how many failed of the ``accepted`` and why the
    first did (``first_error``), so that a point nobody was served at never reads as a load
    the machine could not keep up with."""
    failed = int(summary.get("failed") or 0) if failed is None else int(failed)
    if failed > 0:
        of = "" if accepted is None else f" of {accepted}"
        why = f": {first_error}" if first_error else " (the front end did not say why)"
        return "failed", f"{failed}{of} request(s) failed{why}"
    if summary.get("congested"):
        return "congested", ""
    return ("stable" if summary.get("stable") else "unstable"), ""


# -- the window --------------------------------------------------------------------------------
def measurement_window(records: RunRecords, warmup: float = 0.0) -> tuple[float, float]:
    """(from, to) in clock time: ``start + warmup`` to the last arrival (``end`` if none later)."""
    w0 = records.start + warmup
    last = max((r.arrival for r in records.requests), default=records.end)
    w1 = min(last, records.end) if last > w0 else records.end
    return w0, max(w1, w0)


def _flush_batches(records: RunRecords) -> set[int]:
    """Ids of end-of-run partial batches (papers' model only; see the module docstring)."""
    if records.settings.get("max_delay") is not None:
        return set()
    return {bt.id for bt in records.batches if bt.size < records.batch_size}


def _members(bt: BatchRecord, by_id: dict[int, RequestRecord]) -> list[RequestRecord]:
    return [by_id[i] for i in bt.request_ids if i in by_id]


def _first(bt: BatchRecord, by_id: dict[int, RequestRecord]) -> RequestRecord | None:
    """The batch's first (oldest) request, as the server marked it."""
    return next((r for r in _members(bt, by_id) if r.first_in_batch), None)


def _batch_start(bt: BatchRecord, by_id: dict[int, RequestRecord]) -> float:
    """When the batch's oldest request arrived: the time a whole batch is filed under."""
    first = _first(bt, by_id)
    return first.arrival if first is not None else min((r.arrival for r in _members(bt, by_id)), default=math.inf)


def _window_batches(
    batches: Iterable[BatchRecord], by_id: dict[int, RequestRecord], w0: float, w1: float, excluded: set[int]
) -> list[BatchRecord]:
    """The batches whose oldest request arrived in the window, in arrival order.

    Latencies are taken over *whole* batches: with constant arrivals the requests of a batch
    have latencies L, L - 1/rate, ..., L - (b-1)/rate, and a window edge that cuts a batch
    would drop some of those steps and shift every percentile by up to a step (a sizeable
    fraction of the latency at low rates and large b), differently in a live run and in its
    simulation of the same schedule.
    """
    chosen = [(t, bt) for bt in batches if bt.id not in excluded
              if w0 <= (t := _batch_start(bt, by_id)) <= w1]
    chosen.sort(key=lambda x: x[0])
    return [bt for _, bt in chosen]


def _first_latencies(batches: Iterable[BatchRecord], by_id: dict[int, RequestRecord]) -> np.ndarray:
    firsts = (_first(bt, by_id) for bt in batches)
    return np.array([r.done - r.arrival for r in firsts if r is not None and r.done is not None], dtype=np.float64)


def _count_in(times: np.ndarray, t0: float, t1: float) -> int:
    return int(np.count_nonzero((times >= t0) & (times <= t1)))


def rate_of(times: Sequence[float] | np.ndarray) -> float:
    """Events per second between the first and the last of ``times`` (sorted); NaN with fewer
    than two or no time between them."""
    if len(times) < 2 or times[-1] <= times[0]:
        return NAN
    return float((len(times) - 1) / (times[-1] - times[0]))


#: the statistics other than percentiles (std: the population's, that of the batches measured)
_REDUCE: dict[str, Callable[[np.ndarray], Any]] = {"mean": np.mean, "std": np.std, "max": np.max}


def _stats(prefix: str, values: np.ndarray, which: Iterable[str]) -> dict[str, float]:
    def value(key: str) -> float:
        return float(_REDUCE[key](values) if key in _REDUCE else np.percentile(values, PERCENTILES[key]))

    return {f"{prefix}_{key}": value(key) if values.size else NAN for key in which}


# -- placement ---------------------------------------------------------------------------------
def cpu_share(batches: Iterable[BatchRecord]) -> tuple[float | None, dict[str, dict[str, float]]]:
    """Share of part-tasks run on a CPU arch, and per part the share of each arch.

    (None, {}) when no batch recorded its placement: the live runtime does not report it per
    batch yet, so a sweep derives it from ``Runtime.stats()`` instead.
    """
    per_part: dict[str, Counter[str]] = defaultdict(Counter)
    for bt in batches:
        for part, arch in bt.placement.items():
            per_part[part][arch] += 1
    if not per_part:
        return None, {}
    total = sum(sum(c.values()) for c in per_part.values())
    on_cpu = sum(n for c in per_part.values() for arch, n in c.items() if arch.startswith("cpu"))
    shares = {part: {arch: n / sum(c.values()) for arch, n in sorted(c.items())} for part, c in sorted(per_part.items())}
    return on_cpu / total, shares


# -- queue and congestion ------------------------------------------------------------------------
def _queue_stats(samples: list[tuple[float, int]], w0: float, w1: float) -> dict[str, float]:
    """Time-weighted mean and max of the server's queue length inside the window.

    Each sample holds until the next one; the time before the first sample is not counted.
    """
    if not samples:
        return {"queue_mean": NAN, "queue_max": NAN}
    ordered = sorted(samples, key=lambda s: s[0])
    times = np.array([t for t, _ in ordered], dtype=np.float64)
    values = np.array([q for _, q in ordered], dtype=np.float64)
    # the level at w0 is the last sample at or before it; samples inside the window follow
    held = _step(times, values, np.array([w0]))[0]
    inside = (times > w0) & (times <= w1)
    t = np.concatenate([[w0] if np.isfinite(held) else [], times[inside], [w1]])
    v = np.concatenate([[held] if np.isfinite(held) else [], values[inside]])
    qmax = float(v.max()) if v.size else NAN
    lengths = np.diff(t)
    total = float(lengths.sum())
    mean = float((v * lengths).sum() / total) if total > 0 else qmax
    return {"queue_mean": mean, "queue_max": qmax}


def _step(times: np.ndarray, values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The sampled step function (each value held until the next sample), NaN before the first."""
    idx = np.searchsorted(times, at, side="right") - 1
    out = np.where(idx >= 0, values[np.clip(idx, 0, None)], np.nan)
    return out.astype(np.float64)


def backlog(records: RunRecords, at: np.ndarray) -> np.ndarray:
    """Requests arrived and not yet finished at each time of ``at``, wherever they wait.

    Rejected requests never entered; a failed request leaves when its batch ended (or is left
    out if that is unknown); a withdrawn one (its caller cancelled it) is left out: when it
    left is not recorded, and counted forever it read as a backlog that never drains.
    """
    batch_done = {bt.id: bt.done for bt in records.batches}
    arrivals, exits = [], []
    for r in records.requests:
        if r.rejected or r.withdrawn:
            continue
        leave = r.done if r.done is not None else (batch_done.get(r.batch_id) if r.failed else math.inf)
        if leave is None:
            continue
        arrivals.append(r.arrival)
        exits.append(leave)
    a = np.sort(np.array(arrivals, dtype=np.float64))
    e = np.sort(np.array(exits, dtype=np.float64))
    at = np.asarray(at, dtype=np.float64)
    return (np.searchsorted(a, at, side="right") - np.searchsorted(e, at, side="right")).astype(np.float64)


def _congestion(records: RunRecords, w0: float, w1: float, rejected: int) -> dict[str, Any]:
    """Backlog growth over the window's last half (least-squares slope times its length)."""
    mid = (w0 + w1) / 2
    if w1 <= mid:
        end = float(backlog(records, np.array([w1]))[0])
        return {"backlog_end": end, "backlog_growth": NAN, "congested": rejected > 0}
    grid = np.linspace(mid, w1, _GRID)
    level = backlog(records, grid)
    slope = float(np.polyfit(grid - mid, level, 1)[0])
    growth = slope * (w1 - mid)
    arrived = sum(mid <= r.arrival <= w1 and not r.rejected for r in records.requests)
    threshold = max(CONGESTION_BATCHES * records.batch_size, CONGESTION_FRACTION * arrived)
    # a transient burst that has drained by the end is not congestion: the backlog must still
    # be there at the end, not only have sloped upwards somewhere in the last half
    end = float(level[-1])
    growing = growth > threshold and end > threshold
    return {"backlog_end": end, "backlog_growth": growth, "congested": bool(rejected > 0 or growing)}


# -- stability ---------------------------------------------------------------------------------
def stability_windows(
    records: RunRecords, w0: float, w1: float, excluded: set[int] | None = None, count: int = STABILITY_WINDOWS
) -> list[dict[str, float]]:
    """Throughput and p50 latency of ``count`` consecutive windows of equally many batches.

    perf_analyzer slices time; here the window's batches are sliced instead (in the order their
    oldest requests arrived), because batches leave whole: a time slice of a slow, large-batch
    point holds 3 or 4 batch completions depending only on where its edges fall, which reads as
    a 30 % swing of a perfectly steady run. A slice's throughput is measured between its own
    completions (samples after its first completion / time from its first to its last one), so
    it does not depend on where the slices' edges are either; a slice with fewer than two
    completed batches has no throughput (NaN: not stable).
    """
    excluded = _flush_batches(records) if excluded is None else excluded
    by_id = {r.id: r for r in records.requests}
    return _batch_windows(_window_batches(records.batches, by_id, w0, w1, excluded), by_id, count)


def _batch_windows(measured: list[BatchRecord], by_id: dict[int, RequestRecord], count: int) -> list[dict[str, float]]:
    """:func:`stability_windows` over the window's batches, already chosen and in arrival order."""
    out = []
    for chunk in np.array_split(np.arange(len(measured)), count):
        batches = [measured[i] for i in chunk]
        members = [r for bt in batches for r in _members(bt, by_id)]
        done = sorted((bt.done, bt.size) for bt in batches if bt.done is not None)
        span = done[-1][0] - done[0][0] if len(done) >= 2 else 0.0
        lat = [r.done - r.arrival for r in members if r.done is not None]
        out.append({
            "start": float(_batch_start(batches[0], by_id)) if batches else NAN,
            "end": float(max(r.arrival for r in members)) if members else NAN,
            "batches": len(batches),
            "completed": int(sum(size for _, size in done)),
            "throughput": sum(size for _, size in done[1:]) / span if span > 0 else NAN,
            "latency_p50": float(np.percentile(lat, 50)) if lat else NAN,
        })
    return out


def is_stable(windows: list[dict[str, float]], tolerance: float = STABILITY_TOLERANCE) -> bool:
    """perf_analyzer's rule: every window within ``tolerance`` of the windows' mean, both metrics."""
    for key in ("throughput", "latency_p50"):
        values = np.array([w[key] for w in windows], dtype=np.float64)
        if values.size == 0 or not np.isfinite(values).all():
            return False
        mean = values.mean()
        if mean <= 0 or np.any(np.abs(values / mean - 1) > tolerance + 1e-12):
            return False
    return True
