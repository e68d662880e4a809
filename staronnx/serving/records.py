"""What a serving run (real or simulated) records, in one format both produce.

The papers' metric and every percentile come from these records, so the live server and the
discrete-event simulator must fill them the same way: times in seconds on one clock (the real
``time.perf_counter`` or the simulator's), per request and per batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """One single-sample request: when it arrived, which batch took it, when its result came.

    Slotted: a server keeps one per request for its records (tens of thousands per sweep
    point) and a ``__dict__`` doubled the objects that every young cycle collection walked,
    each of them a pause of every serving thread.
    """

    id: int
    arrival: float  # when the request entered the queue (its scheduled arrival for open loop)
    batch_id: int = -1  # -1 while queued; stays -1 if rejected
    first_in_batch: bool = False  # the oldest request of its batch: the papers' latency
    done: float | None = None  # result available to the caller; None if rejected or failed
    rejected: bool = False  # refused by a full queue (OverloadError)
    failed: bool = False  # its batch's task failed
    withdrawn: bool = False  # cancelled by its caller while queued: it left without running
    #: why it failed (one line), where the front end that failed it says (None: it did not)
    error: str | None = None

    @property
    def latency(self) -> float | None:
        return None if self.done is None else self.done - self.arrival

    def copy(self) -> RequestRecord:
        """A snapshot of this record: a server copies every record it reports, tens of
        thousands per sweep point, and ``dataclasses.replace`` costs several times as much."""
        return RequestRecord(self.id, self.arrival, self.batch_id, self.first_in_batch, self.done,
                             self.rejected, self.failed, self.withdrawn, self.error)


@dataclass(slots=True)
class BatchRecord:
    """One batch: formed from queued requests, run through the plan as one task per part."""

    id: int
    size: int
    formed: float  # when the batcher closed it (full, or max delay reached)
    done: float | None = None
    request_ids: list[int] = field(default_factory=list)
    #: (part, arch) -> count of this batch's tasks placed there (CPU share of each part)
    placement: dict[str, str] = field(default_factory=dict)  # "part0" -> worker arch
    #: rows the runtime ran when the batch was padded up to a captured size (``size`` stays the
    #: real number of requests); None when it ran as it was
    padded_to: int | None = None

    def copy(self) -> BatchRecord:
        """A snapshot of this record, its request ids and placement copied too (see
        :meth:`RequestRecord.copy`)."""
        return BatchRecord(self.id, self.size, self.formed, self.done, list(self.request_ids),
                           dict(self.placement), self.padded_to)


@dataclass
class RunRecords:
    """Everything one serving run produced, with its settings."""

    requests: list[RequestRecord]
    batches: list[BatchRecord]
    offered_rate: float  # requests per second asked of the arrival process
    batch_size: int
    start: float  # clock time of the first scheduled arrival
    end: float  # clock time when the run stopped (last result, or the deadline)
    #: queue length sampled over time: (clock time, requests waiting)
    queue_samples: list[tuple[float, int]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    #: why the first failed request failed (one line), where the front end saw it but its
    #: records do not say (a request's own ``error`` is read first): a sweep point whose
    #: requests failed reports it instead of a figure nobody can read
    first_error: str | None = None


def error_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line a report can carry: its message with whitespace runs folded
    (ONNX Runtime's span several lines), cut at ``limit`` characters; its type when it has none."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
