"""The open-loop load generator: requests arrive on schedule whatever the server is doing.

A closed-loop client (send, wait, send) slows down with the server and so never sees its
saturation; the papers, Triton's perf_analyzer and every serving benchmark worth its name inject
at a fixed *offered* rate instead. Three details keep the schedule honest under load:

- each request is due at an absolute time ``t0 + schedule[i]``: the generator sleeps *until*
  that time, never "for one interval after the previous one", so a late submission (a GC
  pause, a descheduled thread) does not push every later arrival back;
- it sleeps rather than busy-waits: a busy-waiting Python thread holds the GIL, which the
  batcher and the workers need to finish batches (any of them waits up to the interpreter's
  5 ms switch interval for it), so a spin before each of thousands of arrivals per second
  stalled the very runtime under test. ``time.sleep`` wakes tens of microseconds late; that
  lateness is reported as lag and counted as queueing delay (below), never hidden. A wake-up
  that finds several arrivals due submits them all before sleeping again;
- it wakes at most once per :data:`MIN_WAKE_S` (0.2 ms): a wake-up is not free (on the 2-core
  VM of the serving benchmark, 20-60 us of CPU for the sleep and the GIL hand-over, more than
  the submission itself), so at 11k arrivals/s one wake per arrival made the generator the
  largest CPU cost of the run (26 us a request against 14 for batching, running and handing
  out the result). An arrival due before the next wake is submitted late, by at most that
  much plus the wake-up's own lateness: its lag is reported and counted like any other;
- only young cycle collections run while it injects (:func:`collector_quiet`): a full one
  stopped every thread for 50-60 ms on a 2-core host, the whole of a 37-100 ms lag p99 at
  25 % load, and the middle generation's, over the run's records, 0.4-17 ms every few tens
  of ms, most of the p99 at 75 %;
- it keeps no future: the server records each result, and :meth:`Server.wait_idle` says
  when the last one is in. A future and its result per request, kept to the end of the run,
  were most of what those collections walked.

Each request is submitted with its *scheduled* time as its arrival, so time lost by a lagging
generator counts as queueing delay rather than vanishing (no coordinated omission). The
generator reports the offered rate, the rate of the drawn schedule, and the rate it actually
achieved on the clock, with its lag behind the schedule, in ``records.settings["loadgen"]``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from staronnx.serving.arrivals import ArrivalProcess
from staronnx.serving.collector import young_only
from staronnx.serving.metrics import rate_of
from staronnx.serving.records import RunRecords
from staronnx.serving.server import OverloadError, Server, ServerClosed, hold_frozen, release_frozen

#: the last stretch before a due time that is busy-waited (0: none, see the module's doc)
SPIN_S = 0.0
#: delay before the first arrival, so arrival 0 is not already late while the loop starts
LEAD_S = 0.005
#: the shortest time between two wake-ups of the generator (see the module's doc); arrivals
#: due in between wait for the next wake-up, their lag counted
MIN_WAKE_S = 0.0002


def sleep_until(due: float, clock: Callable[[], float] = time.perf_counter, spin: float = SPIN_S) -> float:
    """Sleep until ``clock() >= due`` (sleep, then busy-wait the last ``spin`` s); returns clock()."""
    now = clock()
    left = due - now
    if left > spin:
        time.sleep(left - spin)
    now = clock()
    while now < due:
        now = clock()
    return now


@contextlib.contextmanager
def collector_quiet() -> Iterator[None]:
    """While a run injects: the process's objects frozen
    (:func:`~staronnx.serving.server.hold_frozen`) and only young cycle collections
    (:func:`~staronnx.serving.collector.young_only`, whose doc has the figures), until the last
    nested user leaves.

    A full collection took 50-60 ms on the serving benchmark's 2-core host (generator lag p99
    37-100 ms at 25 % load); freezing what existed before is not enough for a run, whose
    records fill the older generations again, and walking those (0.4-17 ms every few tens of
    ms at 40k requests/s) was most of the open-loop p99 at 75 %. What they would have freed
    waits for the first collection after the run.
    """
    with young_only():
        hold_frozen()
        try:
            yield
        finally:
            release_frozen()


def run_open_loop(
    server: Server,
    arrivals: ArrivalProcess,
    make_sample: Callable[[int], Mapping[str, np.ndarray]],
    *,
    n: int | None = None,
    duration: float | None = None,
    drain_timeout: float = 60.0,
    on_submit: Callable[[int, int], None] | None = None,
    min_wake: float = MIN_WAKE_S,
) -> RunRecords:
    """Offer ``arrivals`` to ``server`` for ``n`` requests or ``duration`` seconds; return the records.

    ``make_sample(i)`` builds request ``i``'s sample; it runs *before* the wait for request
    ``i``'s due time, so its cost comes out of idle time rather than delaying the arrival.
    The generator never waits for a result while injecting. Rejected requests
    (:class:`OverloadError`) are recorded as such and injection goes on. Returns once every
    accepted request has its result, or after ``drain_timeout`` seconds (what is still
    pending then has ``done=None`` in the records). ``on_submit(i, total)`` is called after
    each submission (for progress bars; keep it cheap). ``min_wake``: the shortest time
    between two wake-ups (0: one per arrival that is not yet due).

    The full collection stays held off (:func:`collector_quiet`) until the last result is in:
    when it came back with the schedule's end, a full collection of the run's records and
    futures (40-80 ms on the benchmark's host) could fall on the last requests' latency.
    """
    offsets = arrivals.schedule(n=n, duration=duration)
    total = len(offsets)
    clock = server.clock
    submitted: list[float] = []
    rejected = 0
    count = 0
    with collector_quiet():
        t0 = clock() + LEAD_S
        woke = -math.inf
        for i, offset in enumerate(offsets.tolist()):
            sample = make_sample(i)
            due = t0 + offset
            now = clock()
            if now < due:
                now = woke = sleep_until(max(due, woke + min_wake), clock)
            submitted.append(now)
            count = i + 1
            try:
                # the result is the server's to record: keeping the future (and so its result)
                # to the run's end made every young collection larger (see Server.wait_idle)
                server.submit(sample, arrival=due)
            except OverloadError:
                rejected += 1
            except ServerClosed:
                count = i
                break
            if on_submit is not None:
                on_submit(i, total)
        # in the papers' model the last requests would wait forever for a full batch: send them
        # now (summarize() keeps such a partial batch out of latency figures)
        server.flush()
        pending = server.wait_idle(drain_timeout)
    # end = the last result, or now when the drain timed out with requests still pending
    records = server.records(since=t0, offered_rate=arrivals.rate, start=t0)
    records.settings["arrivals"] = repr(arrivals)
    records.settings["loadgen"] = generator_report(arrivals.rate, offsets[:count], np.asarray(submitted[:count]) - t0)
    records.settings["loadgen"].update(rejected=rejected, drained=not pending, pending=pending)
    return records


def generator_report(offered_rate: float, scheduled: np.ndarray, submitted: np.ndarray) -> dict[str, Any]:
    """How well the generator kept its schedule (offsets from the same origin, in seconds).

    ``achieved_arrival_rate`` is measured on the clock, from the first to the last actual
    submission, so it compares directly with ``scheduled_rate`` (the drawn schedule's own
    rate: for Poisson it differs from ``offered_rate`` by sampling noise, not by the
    generator's fault).
    """
    m = len(submitted)
    lag = submitted - scheduled if m else np.zeros(0)
    return {
        "offered_rate": float(offered_rate),
        "scheduled_rate": rate_of(scheduled),
        "achieved_arrival_rate": rate_of(submitted),
        "submitted": m,
        "lag_mean_s": float(lag.mean()) if m else float("nan"),
        "lag_p99_s": float(np.percentile(lag, 99)) if m else float("nan"),
        "lag_max_s": float(lag.max()) if m else float("nan"),
    }
