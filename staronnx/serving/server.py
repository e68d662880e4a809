"""The serving front end: single-sample requests, a bounded queue, a batcher, per-request futures.

    with Runtime(plan, cpu_groups="numa") as rt, Server(rt, batch_size=8) as server:
        fut = server.submit({"x": sample})        # sample: batch dimension 1
        logits = fut.result()["logits"]           # shape [1, ...], this request's row only

Batching follows the StarONNX papers by default: a batch leaves when it holds exactly
``batch_size`` requests, so under a low rate the first request of a batch waits for the rest
(that wait is the papers' latency). With ``max_delay`` the batcher behaves like Triton's
dynamic batcher instead: a batch of at most ``batch_size`` leaves once its oldest request has
waited ``max_delay`` seconds.

Only ``max_inflight`` batches are handed to the runtime at a time. Without that bound a
saturated runtime would swallow every request into its own task queues, the server's queue
would never fill, and neither the overload error nor the queue-length samples would say
anything; with it, the backlog builds up here, where it is bounded, measured and rejected.

How many is enough depends on the machine: dmda gives a batch to a worker 20x slower than
the GPU only once the GPU's queue is longer than that worker's own time, so a window of twice
the worker count (the default when nothing is known) keeps such a worker idle under any load.
:func:`inflight_window` sizes it from the perf models' times per worker, as sweeps and the
simulator do.

Every request and batch is recorded in :mod:`staronnx.serving.records`, the format the
simulator fills too, so :func:`staronnx.serving.metrics.summarize` reads both.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from staronnx.errors import InputError, StaronnxError
from staronnx.plan import Plan
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.task import RequestFuture
from staronnx.serving.records import BatchRecord, RequestRecord, RunRecords

ON_FULL = ("reject", "block")


class OverloadError(StaronnxError, RuntimeError):
    """The request queue is full: the server is offered more than it can serve."""

    def __init__(self, capacity: int) -> None:
        super().__init__(
            f"request queue full ({capacity} requests waiting, its capacity): the server is overloaded; "
            "lower the rate, raise queue_capacity, or use on_full='block'"
        )
        self.capacity = capacity


class ServerClosed(StaronnxError, RuntimeError):
    """Submitting to a server after close(), or a request still queued when close gave up."""


class BatchRuntime(Protocol):
    """What the server needs from a runtime (:class:`staronnx.Runtime` or a stand-in)."""

    plan: Plan

    def submit(self, feeds: Mapping[str, np.ndarray]) -> Future:  # type: ignore[type-arg]
        ...


@dataclass
class _Pending:
    record: RequestRecord
    feeds: Mapping[str, np.ndarray]
    future: RequestFuture


#: one number per Server in this process, so the batch spans of successive servers on one
#: traced runtime never share an id
_SERVER_SERIALS = itertools.count()


def inflight_window(worker_seconds: Sequence[float | None], cap: int = 256) -> int:
    """Batches to keep in the runtime so every worker can be chosen under load.

    ``worker_seconds``: the predicted time of one batch through the whole plan on each worker
    (None where unknown).  A worker w is chosen by dmda once the others' queues run past its
    own time, i.e. with about ``T_slowest / T_w`` batches queued on each faster worker; the
    window is the sum of those, plus one running batch per worker, and never below the
    unknown-machine default of two per worker.
    """
    n = len(worker_seconds)
    floor = max(2, 2 * n)
    known = [t for t in worker_seconds if t is not None and math.isfinite(t) and t > 0]
    if len(known) < n or not known:
        return floor
    slowest = max(known)
    window = sum(math.ceil(slowest / t) for t in known) + n
    return int(min(max(floor, window), max(cap, floor)))


def next_batch_size(
    *, queued: int, inflight: int, batch_size: int, max_inflight: int, flush_left: int,
    closing: bool, oldest_arrival: float, max_delay: float | None, now: float,
) -> tuple[int, float]:
    """The batcher's rule, shared by :class:`Server` and the simulator so both form the same
    batches: ``(size, _)`` when a batch of ``size`` leaves now, else ``(0, due)``, the time the
    oldest request's ``max_delay`` runs out (``inf``: nothing leaves until the queue changes).

    A batch leaves full; or whatever is queued when closing (nothing queued is lost); or up to
    ``flush_left`` after a flush; or when the oldest request has waited ``max_delay``. Never
    while ``max_inflight`` batches are in the runtime.
    """
    if not queued or inflight >= max_inflight:
        return 0, math.inf
    if queued >= batch_size or closing:
        return min(batch_size, queued), 0.0
    if flush_left > 0:
        return min(batch_size, flush_left, queued), 0.0
    if max_delay is not None:
        due = oldest_arrival + max_delay
        return (min(batch_size, queued), 0.0) if due <= now else (0, due)
    return 0, math.inf


class Server:
    """Batch single-sample requests for a runtime; see the module docstring.

    Args:
        runtime: where batches run; its ``plan`` checks every request at submit.
        batch_size: ``b``: the exact batch size, or the largest one with ``max_delay``.
        max_delay: seconds the oldest queued request may wait before a partial batch leaves;
            None (the papers' model) waits for a full batch.
        queue_capacity: requests waiting for a batch; beyond it ``submit`` rejects or blocks.
        on_full: ``"reject"`` raises :class:`OverloadError`; ``"block"`` waits for room.
        max_inflight: batches handed to the runtime at once; None = twice its worker count
            (at least 2), enough to keep every worker fed and parts pipelined across batches.
        clock: the time base of every record (``time.perf_counter`` unless a test says so).
        keep_records: None keeps the record of every request, batch and queue sample (a sweep's
            figures need them all); a number keeps only the latest that many of each, so a
            long-running server (``staronnx serve``) does not grow without bound.
        batch_memory: ``(shape, dtype) -> array`` where each batch is assembled; default: the
            runtime's :meth:`~staronnx.runtime.runtime.Runtime.batch_array` (pinned memory
            its CUDA workers copy to the device without staging) for a Runtime, else numpy's.
    """

    def __init__(
        self,
        runtime: BatchRuntime,
        batch_size: int,
        *,
        max_delay: float | None = None,
        queue_capacity: int = 1024,
        on_full: str = "reject",
        max_inflight: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        keep_records: int | None = None,
        batch_memory: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None = None,
    ) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise StaronnxError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if max_delay is not None and not (max_delay >= 0):
            raise StaronnxError(f"max_delay must be >= 0 seconds or None, got {max_delay!r}")
        if queue_capacity < 1:
            raise StaronnxError(f"queue_capacity must be >= 1, got {queue_capacity}")
        if max_delay is None and queue_capacity < batch_size:
            # a full batch could never form: the queue would fill and stay full forever
            raise StaronnxError(
                f"queue_capacity ({queue_capacity}) must be at least batch_size ({batch_size}) "
                "when batches leave only when full (no max_delay)"
            )
        if on_full not in ON_FULL:
            raise StaronnxError(f"on_full must be one of {', '.join(ON_FULL)}, got {on_full!r}")
        if max_inflight is None:
            max_inflight = max(2, 2 * len(getattr(runtime, "workers", ()) or ()))
        if max_inflight < 1:
            raise StaronnxError(f"max_inflight must be >= 1, got {max_inflight}")
        if keep_records is not None and (not isinstance(keep_records, int) or keep_records < 1):
            raise StaronnxError(f"keep_records must be None (keep all) or an integer >= 1, got {keep_records!r}")
        self.runtime = runtime
        self.plan: Plan = runtime.plan
        self.batch_size = batch_size
        self.max_delay = max_delay
        self.queue_capacity = queue_capacity
        self.on_full = on_full
        self.max_inflight = max_inflight
        self.clock = clock
        self._batch_memory = batch_memory or (runtime.batch_array if isinstance(runtime, Runtime) else np.empty)
        self._batched = {t.name: _is_batched(t.shape) for t in self.plan.inputs}
        self._out_batched = {t.name: _is_batched(t.shape) for t in self.plan.outputs}
        self._cond = threading.Condition()
        self._queue: deque[_Pending] = deque()
        self._inflight: dict[int, list[_Pending]] = {}
        self.keep_records = keep_records
        # deques with maxlen=None are unbounded: one code path for both modes
        self._requests: deque[RequestRecord] = deque(maxlen=keep_records)
        self._batches: deque[BatchRecord] = deque(maxlen=keep_records)
        self._queue_samples: deque[tuple[float, int]] = deque(maxlen=keep_records)
        self._request_ids = itertools.count()
        self._batch_ids = itertools.count()
        self._closing = False
        self._abort = False
        self._withdrawn = 0  # futures cancelled since the queue was last cleared of them
        self._flush_left = 0  # the queue's first requests that leave without waiting to fill
        self.created = clock()
        # a traced runtime gets the server's view too, if both read the same clock
        tracer = getattr(runtime, "tracer", None)
        self._tracer = tracer if clock is time.perf_counter else None
        self._serial = next(_SERVER_SERIALS)  # keeps trace ids unique across servers
        self._sample_queue()
        self._thread = threading.Thread(target=self._batcher, name="staronnx-batcher", daemon=True)
        self._thread.start()

    # -- context manager ---------------------------------------------------------------------
    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -----------------------------------------------------------------------------
    def submit(
        self, sample: Mapping[str, np.ndarray], arrival: float | None = None, *, timeout: float | None = None
    ) -> RequestFuture:
        """Queue one sample (batch dimension 1); the future resolves to this sample's outputs.

        ``arrival`` (a ``clock`` time) is when the request counts as arrived: now by default,
        the scheduled time when an open-loop generator submits, so that a generator running
        late does not hide queueing delay. Raises :class:`InputError` for a sample the plan
        cannot run, :class:`OverloadError` when the queue is full (with ``on_full="reject"``,
        or after ``timeout`` seconds of blocking), :class:`ServerClosed` after close().
        """
        self._check_sample(sample)
        with self._cond:
            if self._closing:
                raise ServerClosed("the server is closed; no new requests are accepted")
            record = RequestRecord(id=next(self._request_ids), arrival=self.clock() if arrival is None else arrival)
            self._requests.append(record)
            if self._withdrawn:
                self._drop_withdrawn()
            full = len(self._queue) >= self.queue_capacity
            if full and (self.on_full == "reject" or not self._wait_for_room(timeout)):
                record.rejected = True
                if self._closing:
                    raise ServerClosed("the server closed while this request waited for room in the queue")
                raise OverloadError(self.queue_capacity)
            future = RequestFuture(record.id)
            future.add_done_callback(self._on_cancel)
            self._queue.append(_Pending(record, sample, future))
            self._sample_queue()
            # wake the batcher only when it can act: a full batch, or a first request whose
            # max-delay deadline it must start timing (a wake per request cost a thread switch
            # and a GIL hand-over per request, b times more than needed)
            queued = len(self._queue)
            if queued >= self.batch_size or queued == 1 or self._flush_left > 0:
                self._cond.notify_all()
        return future

    def _on_cancel(self, future: RequestFuture) -> None:
        """A caller that gives up on a queued request (a client that went away) frees its place
        in the queue and in the next batch: an abandoned request must cost the others nothing.
        Counted here, cleared lazily by whoever next needs the queue's true length."""
        if future.cancelled():
            with self._cond:
                self._withdrawn += 1
                self._cond.notify_all()

    def _drop_withdrawn(self) -> None:
        """Remove (lock held) the cancelled requests still queued; one pass for many cancels."""
        kept: deque[_Pending] = deque()
        for p in self._queue:
            if p.future.cancelled():
                p.record.withdrawn = True
            else:
                kept.append(p)
        self._flush_left = min(self._flush_left, len(kept))
        self._queue, self._withdrawn = kept, 0
        self._sample_queue()

    def _wait_for_room(self, timeout: float | None) -> bool:
        """Block (lock held) until the queue has room; False on timeout or close."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._closing:
            if self._withdrawn:
                self._drop_withdrawn()
            if len(self._queue) < self.queue_capacity:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._cond.wait(left)
        return not self._closing

    def _check_sample(self, sample: Mapping[str, np.ndarray]) -> None:
        """The plan's own checks, plus: a request is exactly one sample."""
        self.plan.check_feeds(sample)
        for name, batched in self._batched.items():
            if batched and sample[name].shape[0] != 1:
                raise InputError(
                    f"input {name!r}: a request is one sample, so axis 0 must be 1; got shape "
                    f"{list(sample[name].shape)} (the server forms the batches)"
                )

    def flush(self) -> None:
        """Let every request queued now leave at once, in batches of at most ``batch_size``.

        For the end of a run in the papers' model, where the last requests would otherwise wait
        forever for a batch to fill. Requests submitted later batch normally.
        """
        with self._cond:
            self._flush_left = len(self._queue)
            self._cond.notify_all()

    # -- the batcher --------------------------------------------------------------------------
    def _batcher(self) -> None:
        """Form batches from the queue and hand them to the runtime, until closed and empty."""
        while True:
            with self._cond:
                batch = self._next_batch()
                if batch is None:
                    return
                record = BatchRecord(
                    id=next(self._batch_ids), size=len(batch), formed=self.clock(),
                    request_ids=[p.record.id for p in batch],
                )
                oldest = min(batch, key=lambda p: p.record.arrival)
                oldest.record.first_in_batch = True
                for p in batch:
                    p.record.batch_id = record.id
                self._batches.append(record)
                self._inflight[record.id] = batch
                self._sample_queue()
                self._cond.notify_all()  # room in the queue for blocked submitters
            self._launch(record, batch)

    def _next_batch(self) -> list[_Pending] | None:
        """Wait (lock held) until a batch may leave; None once closed and drained."""
        while True:
            if self._abort:
                return None
            if self._withdrawn:
                self._drop_withdrawn()
            now = self.clock()
            size, due = next_batch_size(
                queued=len(self._queue), inflight=len(self._inflight), batch_size=self.batch_size,
                max_inflight=self.max_inflight, flush_left=self._flush_left, closing=self._closing,
                oldest_arrival=self._queue[0].record.arrival if self._queue else now,
                max_delay=self.max_delay, now=now)
            if size:
                return self._take(size)
            if self._closing and not self._queue:
                return None
            self._cond.wait(None if due == math.inf else due - now)

    def _take(self, count: int) -> list[_Pending]:
        taken = [self._queue.popleft() for _ in range(min(count, len(self._queue)))]
        self._flush_left = max(0, self._flush_left - len(taken))
        return taken

    def _launch(self, record: BatchRecord, batch: list[_Pending]) -> None:
        """Concatenate the samples, submit the batch, split its outputs when it completes."""
        try:
            feeds = self._concat(batch)
            future = self.runtime.submit(feeds)
        except Exception as exc:  # noqa: BLE001 - fails this batch's requests only
            self._finish(record, None, exc)
            return
        future.add_done_callback(lambda f: self._completed(record, f))

    def _concat(self, batch: list[_Pending]) -> dict[str, np.ndarray]:
        feeds: dict[str, np.ndarray] = {}
        for name, batched in self._batched.items():
            if not batched:
                feeds[name] = batch[0].feeds[name]
                continue
            parts = [p.feeds[name] for p in batch]
            try:
                shape = (sum(a.shape[0] for a in parts), *parts[0].shape[1:])
                feeds[name] = np.concatenate(parts, axis=0, out=self._batch_memory(shape, parts[0].dtype))
            except ValueError:
                shapes = sorted({tuple(p.feeds[name].shape) for p in batch})
                raise InputError(
                    f"input {name!r}: the requests of one batch must share every non-batch dimension; "
                    f"this batch mixes shapes {[list(s) for s in shapes]}"
                ) from None
        return feeds

    def _completed(self, record: BatchRecord, future: Future) -> None:  # type: ignore[type-arg]
        """Runtime callback (in a worker thread): resolve every request of the batch."""
        if future.cancelled():
            self._finish(record, None, ServerClosed("the batch was cancelled before it ran (runtime closed)"))
            return
        exc = future.exception()
        if exc is not None:
            self._finish(record, None, exc)
            return
        placement = getattr(future, "placement", None)  # per-batch (part -> arch), if the runtime says
        if isinstance(placement, Mapping):
            record.placement = {str(k): str(v) for k, v in placement.items()}
        self._finish(record, future.result(), None)

    def _finish(self, record: BatchRecord, outputs: Mapping[str, np.ndarray] | None, error: BaseException | None) -> None:
        with self._cond:
            batch = self._inflight.pop(record.id, None)
        if batch is None:  # already failed by close(timeout)
            return
        results: list[dict[str, np.ndarray]] = []
        if outputs is not None:
            try:
                results = self._split(outputs, len(batch))
            except Exception as exc:  # noqa: BLE001 - a malformed result fails its batch only
                error, outputs = exc, None
        now = self.clock()
        if self._tracer is not None:
            oldest = min(p.record.arrival for p in batch)
            args = {"requests": len(batch), "failed": outputs is None}
            span = f"{self._serial}.{record.id}"
            self._tracer.async_span(f"fill {record.id} ({len(batch)})", "batch fill", span, oldest,
                                    record.formed, args)
            self._tracer.async_span(f"batch {record.id} ({len(batch)})", "batch", span, record.formed, now, args)
        with self._cond:
            record.done = now
            for p in batch:
                if outputs is None:
                    p.record.failed = True
                else:
                    p.record.done = now
            self._cond.notify_all()
        for i, p in enumerate(batch):
            if not p.future.set_running_or_notify_cancel():
                continue  # the caller cancelled it; the batch ran anyway
            p.future.batch = record
            if outputs is None:
                assert error is not None
                p.future.set_exception(error)
            else:
                p.future.set_result(results[i])

    def _split(self, outputs: Mapping[str, np.ndarray], n: int) -> list[dict[str, np.ndarray]]:
        """Row ``i`` of every batched output for request ``i`` (unbatched outputs are shared)."""
        rows: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
        for name, arr in outputs.items():
            batched = self._out_batched.get(name, True) and getattr(arr, "ndim", 0) >= 1
            if batched and arr.shape[0] != n:
                raise RuntimeError(f"output {name!r} has {arr.shape[0]} rows for a batch of {n} requests")
            for i in range(n):
                rows[i][name] = arr[i : i + 1] if batched else arr
        return rows

    # -- records ------------------------------------------------------------------------------
    def _sample_queue(self) -> None:
        """Note the queue length now (lock held): at every arrival and every batch formed."""
        now = self.clock()
        self._queue_samples.append((now, len(self._queue)))
        if self._tracer is not None:
            self._tracer.counter("server queue (requests)", now, len(self._queue))

    @property
    def queue_length(self) -> int:
        """Requests waiting for a batch right now (not those their callers cancelled)."""
        with self._cond:
            if self._withdrawn:
                self._drop_withdrawn()
            return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Batches handed to the runtime and not yet completed."""
        with self._cond:
            return len(self._inflight)

    def settings(self) -> dict[str, Any]:
        """The knobs a run was made with, stored in its records."""
        return {
            "batch_size": self.batch_size,
            "max_delay": self.max_delay,
            "queue_capacity": self.queue_capacity,
            "on_full": self.on_full,
            "max_inflight": self.max_inflight,
            "policy": getattr(self.runtime, "policy_name", None),
            "plan_hash": self.plan.hash,
        }

    def records(
        self,
        *,
        since: float | None = None,
        offered_rate: float | None = None,
        start: float | None = None,
        end: float | None = None,
    ) -> RunRecords:
        """A consistent copy of what the server recorded (requests arriving at or after ``since``).

        ``offered_rate`` defaults to the observed arrival rate (a server does not know what
        was asked of the generator); ``start`` to the first arrival; ``end`` to the last
        result (or now while requests are outstanding).
        """
        with self._cond:
            reqs = [dataclasses.replace(r) for r in self._requests if since is None or r.arrival >= since]
            ids = {r.id for r in reqs}
            batches = [dataclasses.replace(b, request_ids=list(b.request_ids), placement=dict(b.placement))
                       for b in self._batches if ids.intersection(b.request_ids)]
            samples = [s for s in self._queue_samples if since is None or s[0] >= since]
            now = self.clock()
        arrivals = sorted(r.arrival for r in reqs)
        if offered_rate is None:
            span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
            offered_rate = (len(arrivals) - 1) / span if span > 0 else 0.0
        if start is None:
            start = arrivals[0] if arrivals else (self.created if since is None else since)
        if end is None:
            outstanding = any(r.done is None and not (r.rejected or r.failed or r.withdrawn) for r in reqs)
            finished = [t for t in (*(r.done for r in reqs), *(b.done for b in batches)) if t is not None]
            end = now if outstanding or not finished else max(finished)
        return RunRecords(
            requests=reqs, batches=batches, offered_rate=float(offered_rate), batch_size=self.batch_size,
            start=float(start), end=float(end), queue_samples=samples, settings=self.settings(),
        )

    # -- shutdown -----------------------------------------------------------------------------
    def close(self, timeout: float | None = 30.0) -> None:
        """Stop accepting, run what is queued (a last partial batch too), wait for the results.

        After ``timeout`` seconds whatever is still queued or running fails with
        :class:`ServerClosed`; the batcher thread is gone when this returns. The runtime stays
        open: it belongs to the caller.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while self._queue or self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            self._abort = True
            self._cond.notify_all()
            leftovers = list(self._queue) + [p for b in self._inflight.values() for p in b]
            self._queue.clear()
            self._inflight.clear()
            for p in leftovers:
                p.record.failed = True
        for p in leftovers:
            if p.future.set_running_or_notify_cancel():
                p.future.set_exception(ServerClosed("the server closed before this request completed"))
        self._thread.join(timeout=None if timeout is None else max(_time_left(deadline), 1.0))

    @property
    def closed(self) -> bool:
        return self._closing and not self._thread.is_alive()


def _time_left(deadline: float | None) -> float:
    """Seconds to a ``time.monotonic`` deadline (0 when passed or when there is none)."""
    return 0.0 if deadline is None else max(deadline - time.monotonic(), 0.0)


def _is_batched(shape: list[int | str | None]) -> bool:
    """A tensor whose first axis is symbolic carries the batch (the runtime's own rule)."""
    return bool(shape) and not isinstance(shape[0], int)
