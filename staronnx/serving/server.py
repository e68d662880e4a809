"""The serving front end: single-sample requests, a bounded queue, a batcher, per-request futures.

    with Runtime(plan) as rt, Server(rt, ServeSpec(batch_size=8)) as server:
        fut = server.submit({"x": sample})        # sample: batch dimension 1
        logits = fut.result()["logits"]           # shape [1, ...], this request's row only

Requests are batched by the plan's batching contract (:mod:`staronnx.contract`): only those
with the same shape signature (every non-batch dimension, and the value of each input without a
batch axis) share a batch, one queue per signature in effect (Triton's rule), FIFO across them;
batches are concatenated and split along each tensor's own batch axis; a model that cannot
batch runs one request per batch. A request's answer is computed from its own inputs only.

Batching follows the StarONNX papers by default: a batch leaves when it holds exactly
``batch_size`` requests, so under a low rate the first request of a batch waits for the rest
(that wait is the papers' latency). With ``max_delay`` the batcher behaves like Triton's
dynamic batcher instead: a batch of at most ``batch_size`` leaves once its oldest request has
waited ``max_delay`` seconds.

With a ``queue_policy`` that has priority levels (or a DELAY timeout action,
:mod:`staronnx.serving.priority`), the queue is kept in level order, level 1 first, arrival
order within a level and the requests :meth:`Server.delay` moved at the end of theirs: every
batch takes its requests from the front, so the highest level's leave first; a level whose own
capacity is reached refuses its requests (:class:`LevelFullError`). Without one the queue is in
arrival order and nothing is counted per request.

Only ``max_inflight`` batches are handed to the runtime at a time, so that the backlog builds
up here, where it is bounded, measured and rejected; :mod:`staronnx.serving.spec` says how many
(one rule for the server, ``staronnx serve``, sweeps and the simulator).

A checked request may hold several rows (``submit(..., checked=True, rows=n)``): it takes n
places in one batch and is answered with its own rows of the batch's outputs.

A batch leaves on the thread of the request that fills it (the batcher thread only when the
window was full or ``max_delay`` ran out; an event loop registered with
:meth:`Server.time_delays_on` times the delay of its own requests and sends their partial
batch itself, so a served request wakes no batcher thread); its results are handed out on the runtime's worker
thread that finished it when every worker is a CPU worker, and on the batcher thread where a
CUDA worker's driver thread must get back to its device at once.

Every request and batch is recorded in :mod:`staronnx.serving.records`, the format the
simulator fills too, so :func:`staronnx.serving.metrics.summarize` reads both.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import gc
import itertools
import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from staronnx.errors import InputError, StaronnxError
from staronnx.plan import Plan
from staronnx.runtime.registry import Worker
from staronnx.runtime.runtime import ModelHandle, Runtime
from staronnx.runtime.task import SETTLED as _SETTLED, RequestFuture, run_callbacks, settle_locked
from staronnx.runtime.trace import Tracer
from staronnx.serving.metrics import rate_of
from staronnx.serving.records import BatchRecord, RequestRecord, RunRecords, error_line
from staronnx.serving.spec import MIN_INFLIGHT, ServeSpec, inflight_window  # noqa: F401 - MIN_INFLIGHT: re-exported

log = logging.getLogger(__name__)


class OverloadError(StaronnxError, RuntimeError):
    """The request queue is full: the server is offered more than it can serve."""

    def __init__(self, capacity: int) -> None:
        super().__init__(
            f"request queue full ({capacity} requests waiting, its capacity): the server is overloaded; "
            "lower the rate, raise queue_capacity, or use on_full='block'"
        )
        self.capacity = capacity


class LevelFullError(OverloadError):
    """A priority level's own queue is full (its policy's capacity), whatever room the others have."""

    def __init__(self, level: int, capacity: int) -> None:
        StaronnxError.__init__(
            self, f"the queue of priority level {level} is full ({capacity} requests waiting, its capacity): "
                  "retry later, at another priority, or raise that level's max_queue_size")
        self.capacity = capacity
        self.level = level


class ServerClosed(StaronnxError, RuntimeError):
    """Submitting to a server after close(), or a request still queued when close gave up."""


Outputs = dict[str, np.ndarray]


class BatchRuntime(Protocol):
    """What the server needs from a runtime: :class:`~staronnx.runtime.runtime.Runtime`, a
    model's handle on a shared one, or a stand-in (:class:`StandInRuntime` gives the defaults
    of one that only runs batches). ``takes_arrival``: ``submit`` takes the batch's oldest
    arrival (``time.perf_counter()``), from which a model's latency target counts."""

    @property
    def plan(self) -> Plan: ...  # checks every request at submit
    @property
    def workers(self) -> Sequence[Worker]: ...  # sizes the window
    @property
    def takes_arrival(self) -> bool: ...
    @property
    def preferred_batch_sizes(self) -> tuple[int, ...]: ...  # its captured CUDA graphs' sizes
    @property
    def tracer(self) -> Tracer | None: ...  # where the server's batch spans go too
    def submit(self, feeds: Mapping[str, np.ndarray], *, arrival: float | None = None) -> Future[Outputs]: ...
    def batch_array(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray: ...  # pinned for CUDA
    def colocate(self) -> contextlib.AbstractContextManager[int | None]: ...  # see Runtime.colocate


class StandInRuntime:
    """The :class:`BatchRuntime` defaults of a runtime that only runs batches (a test's, a
    benchmark's): no workers to size the window by, no latency targets, no CUDA graphs, no
    trace, numpy's memory, no core to join. A subclass sets ``plan`` and ``submit``."""

    plan: Plan
    workers: Sequence[Worker] = ()
    takes_arrival = False
    preferred_batch_sizes: tuple[int, ...] = ()
    tracer: Tracer | None = None

    def submit(self, feeds: Mapping[str, np.ndarray], *, arrival: float | None = None) -> Future[Outputs]:
        raise NotImplementedError

    def batch_array(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        return np.empty(shape, dtype)

    def colocate(self) -> contextlib.AbstractContextManager[int | None]:
        return contextlib.nullcontext()


class _Request(RequestFuture):
    """A queued request is its own (light) future, sharing the server's Condition: a live
    request is two tracked objects, this and its record. ``cancel`` tells the server
    directly, where a done-callback would run on every completion."""

    #: its priority level's index (0: level 1, the highest) and whether its timeout moved it
    #: behind its level's others (DELAY): read only where the server keeps levels
    _level = 0
    _delayed = False
    #: the rows it holds along the batch axis: the places it takes in a batch (1 but for a
    #: checked multi-row request, :meth:`Server.submit`'s ``rows``)
    _rows = 1

    def __init__(self, server: Server, record: RequestRecord, sample: Mapping[str, np.ndarray],
                 signature: Any = None) -> None:
        super().__init__(record.id, server._future_cond)
        self._server = server
        self._record = record
        self._sample = sample
        #: what requests must share to be batched together (None: every request of the model)
        self._sig = signature

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        self._server._on_cancel()
        return True


#: a finished batch for the batcher thread: (its record, its requests, the runtime's future or
#: the error that kept it from being submitted)
_Completion = tuple[BatchRecord, list[_Request], "Future[Outputs] | BaseException"]


def _outcome(record: BatchRecord, future: Future[Outputs] | BaseException) -> tuple[Outputs | None, BaseException | None]:
    """(outputs, None) or (None, error) of a finished batch; notes its placement on ``record``."""
    if isinstance(future, BaseException):
        return None, future
    if future.cancelled():
        return None, ServerClosed("the batch was cancelled before it ran (runtime closed)")
    exc = future.exception()
    if exc is not None:
        return None, exc
    if isinstance(future, RequestFuture) and future.placement:  # a staronnx runtime's: part -> arch
        record.placement = dict(future.placement)
    return future.result(), None


#: one number per Server in this process, so the batch spans of successive servers on one
#: traced runtime never share an id
_SERVER_SERIALS = itertools.count()


_frozen_lock = threading.Lock()
_frozen_users = 0


def hold_frozen() -> None:
    """Freeze (``gc.freeze``) what the process holds now, until every holder has let go: what
    ``staronnx serve`` and a load generator (:func:`~staronnx.serving.loadgen.collector_quiet`)
    do while they serve, never a Server by itself (the process is its caller's).

    A full cycle collection walks every tracked object with every Python thread stopped: with
    a model and a runtime loaded that was 50-60 ms on the serving benchmark's host, long
    enough to be most of a p99. What exists when serving starts (model, sessions, runtime,
    caller's state) is what lives on, so it is taken out of those walks; they then cover what
    serving itself keeps (records, futures), bounded by ``keep_records`` in a long-running
    server. Frozen objects are still freed by reference counting; only cyclic garbage among
    them waits for the last :func:`release_frozen` (``gc.unfreeze``).
    """
    global _frozen_users
    with _frozen_lock:
        _frozen_users += 1
        gc.freeze()


def release_frozen() -> None:
    """The other half of :func:`hold_frozen`: the last holder unfreezes."""
    global _frozen_users
    with _frozen_lock:
        _frozen_users = max(_frozen_users - 1, 0)
        if not _frozen_users:
            gc.unfreeze()


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


def padded_size(n: int, pad_to: Sequence[int]) -> int:
    """The rows a batch of ``n`` requests runs as: the smallest of ``pad_to`` (sorted) that holds
    it, so a runtime that captured CUDA graphs at those sizes never meets another size while
    serving (Triton's preferred batch sizes); ``n`` itself when it is one of them, when none
    holds it, or when ``pad_to`` is empty."""
    if not pad_to or n >= pad_to[-1]:
        return n
    return pad_to[bisect.bisect_left(pad_to, n)]


class Server:
    """Batch single-sample requests for a runtime; see the module docstring.

    Args:
        runtime: where batches run; its ``plan`` checks every request at submit.
        spec: the batching settings (:class:`~staronnx.serving.spec.ServeSpec`, checked when
            made: ``Server(rt, ServeSpec(8, max_delay=0.01))``); ``self.spec`` holds them
            resolved for this runtime.
        clock: the time base of every record (``time.perf_counter`` unless a test says so).
        batch_memory: ``(shape, dtype) -> array`` where each batch is assembled; default: the
            runtime's :meth:`~staronnx.runtime.runtime.Runtime.batch_array` (pinned memory
            its CUDA workers copy to the device without staging).
        on_executed: called with the rows of each batch that succeeded (padding included) and
            the seconds from its submission to its outputs, on the runtime's thread (what
            ``staronnx serve`` counts as executions).

    Results are handed out on the batcher thread, not on the runtime's: the runtime's
    callback only queues the finished batch, so a CUDA worker goes straight back to its GPU
    instead of splitting outputs and resolving ``b`` futures (and whatever callbacks their
    callers attached) while holding the GIL its siblings need.
    """

    def __init__(
        self,
        runtime: BatchRuntime,
        spec: ServeSpec,
        *,
        clock: Callable[[], float] = time.perf_counter,
        batch_memory: Callable[[tuple[int, ...], np.dtype[Any]], np.ndarray] | None = None,
        on_executed: Callable[[int, float], None] | None = None,
    ) -> None:
        if not isinstance(spec, ServeSpec):
            raise TypeError(f"a Server takes its settings as one ServeSpec: "
                            f"Server(runtime, ServeSpec({spec!r}, ...))")
        self.runtime = runtime
        self.plan: Plan = runtime.plan
        self._contract = self.plan.contract
        #: the most requests a batch holds: 1 for a model that cannot batch (Triton's
        #: max_batch_size 0: one request per task, still concurrent over every worker)
        self._limit = spec.batch_size if self._contract.batchable else 1
        # never past the batch size (Triton's preferred sizes are <= max_batch_size): a runtime
        # that captured 32 for another server must not turn this one's batch of 3 into 32 rows
        pad_to = runtime.preferred_batch_sizes if spec.pad_to is None else spec.pad_to
        # no window given: the rule's for these workers, their times unknown
        self.max_inflight = spec.max_inflight or inflight_window([None] * len(runtime.workers))
        self.pad_to: tuple[int, ...] = tuple(sorted({m for m in pad_to if m <= self._limit})) if self._limit > 1 else ()
        self.spec = replace(spec, max_inflight=self.max_inflight, pad_to=self.pad_to)
        # read on every request: attributes, not the spec's
        self.batch_size, self.max_delay, self.on_full = spec.batch_size, spec.max_delay, spec.on_full
        self.queue_capacity, self.keep_records, self.colocate = spec.queue_capacity, spec.keep_records, spec.colocate
        self.clock = clock
        #: the most rows a checked request may hold: a batch's, and no more than the queue holds
        self._max_rows = min(self._limit, self.queue_capacity)
        self._batch_memory = batch_memory or runtime.batch_array
        self._on_executed = on_executed
        #: a model of a shared runtime counts its latency target from each batch's oldest
        #: arrival, which it can only read on the runtime's clock (perf_counter)
        self._pass_arrival = runtime.takes_arrival and clock is time.perf_counter
        self._exact_inputs = _exact_inputs(self.plan)
        #: whether requests can differ in what batching must keep apart (a dynamic non-batch
        #: size, an input without a batch axis); if not, every request has the same signature
        self._signed = self._limit > 1 and (self._exact_inputs is None
                                            or any(a is None for a in self._contract.inputs.values()))
        #: queued requests per signature (withdrawn ones included until dropped, like the queue)
        self._groups: dict[Any, int] = {}
        #: whether every request so far held one row (the queue's length is then its samples)
        self._all_single = True
        self._cond = threading.Condition()
        self._future_cond = threading.Condition()  # shared by this server's request futures
        self._queue: deque[_Request] = deque()
        #: priority levels (:mod:`staronnx.serving.priority`): the queue is kept in level order,
        #: each level's delayed requests last; without them, in arrival order (nothing counted)
        self.queue_policy = spec.queue_policy
        self._ordered = spec.queue_policy is not None and spec.queue_policy.ordered
        levels = len(spec.queue_policy.levels) if self._ordered and spec.queue_policy is not None else 0
        self._at_level = [0] * levels  # queued per level (withdrawn ones included until dropped, like the queue)
        self._delayed_at_level = [0] * levels  # of which moved behind their level's others
        self._inflight: dict[int, list[_Request]] = {}
        # batches the runtime finished, waiting for the batcher thread to hand out their results
        self._completions: list[_Completion] = []
        self._resolving = 0  # completions the batcher took and is resolving (close waits for them)
        #: hand out results on the runtime's thread that finished the batch (see _completed): where
        #: every worker is a CPU worker of a staronnx runtime (a remote server's stand-in is not)
        self._resolve_inline = isinstance(runtime, (Runtime, ModelHandle)) and all(
            w.kind == "cpu" for w in runtime.workers)
        #: a staronnx runtime, which takes the batches formed here without checking them again
        self._trusted = runtime if isinstance(runtime, (Runtime, ModelHandle)) else None
        # deques with maxlen=None are unbounded: one code path for both modes
        self._requests: deque[RequestRecord] = deque(maxlen=self.keep_records)
        self._idle_waiters = 0  # callers in wait_idle(): every result wakes them
        self._batches: deque[BatchRecord] = deque(maxlen=self.keep_records)
        self._queue_samples: deque[tuple[float, int]] = deque(maxlen=self.keep_records)
        self._request_ids = itertools.count()
        self._batch_ids = itertools.count()
        self._closing = False
        self._abort = False
        self._withdrawn = 0  # futures cancelled since the queue was last cleared of them
        self._flush_left = 0  # rows of the queue's first requests that leave without waiting to fill
        #: an event loop that times the max delay for requests submitted on its thread
        #: (:meth:`time_delays_on`), and when the timer it holds for this server fires (None: none)
        self._delay_loop: asyncio.AbstractEventLoop | None = None
        self._delay_thread = 0
        self._timer_at: float | None = None
        self.created = clock()
        # a traced runtime gets the server's view too, if both read the same clock
        self._tracer = runtime.tracer if clock is time.perf_counter else None
        self._serial = next(_SERVER_SERIALS)  # keeps trace ids unique across servers
        self._sample_queue()
        #: what the runtime's futures call back through (:func:`_batch_done`)
        self._weak = weakref.ref(self)
        self._thread = threading.Thread(target=self._batcher_thread, name="staronnx-batcher", daemon=True)
        self._thread.start()

    # -- context manager ---------------------------------------------------------------------
    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -----------------------------------------------------------------------------
    def submit(
        self, sample: Mapping[str, np.ndarray], arrival: float | None = None, *, timeout: float | None = None,
        level: int = 0, checked: bool = False, rows: int = 1,
    ) -> RequestFuture:
        """Queue one sample (batch dimension 1); the future resolves to this sample's outputs.

        ``arrival`` (a ``clock`` time) is when the request counts as arrived: now by default,
        the scheduled time when an open-loop generator submits, so that a generator running
        late does not hide queueing delay. Raises :class:`InputError` for a sample the plan
        cannot run, :class:`OverloadError` when the queue is full (with ``on_full="reject"``,
        or after ``timeout`` seconds of blocking), :class:`ServerClosed` after close().

        ``level``: the request's priority level where the spec's ``queue_policy`` has levels (1
        the highest; 0: the policy's default level); a full level raises
        :class:`LevelFullError`, at once.

        ``checked``: the caller already checked ``sample`` against the plan as one sample (a
        served model checks each request once, at the door), so it is not checked again here;
        the batches formed from such samples are not checked again by the runtime either.
        ``rows``: with ``checked``, the rows ``sample`` holds along its batch axis (at most
        ``batch_size``): the request takes that many places in one batch, as it is (Triton's
        dynamic batcher does the same), and its future resolves to its own rows of the batch's
        outputs (views), not cut into one-row requests to be joined again.
        """
        if not checked:
            self._check_sample(sample)
            rows = 1
        elif not 1 <= rows <= self._max_rows:
            if rows > self.queue_capacity:  # it could never be queued: on_full="block" waited forever
                raise InputError(f"a request of {rows} rows does not fit a queue of {self.queue_capacity} samples "
                                 "(queue_capacity)")
            raise InputError(f"a request of {rows} rows does not fit a batch of at most {self._limit}")
        index = self._level_index(level) if level or self._ordered else 0
        sig = self._contract.signature(sample) if self._signed else None
        with self._cond:
            if self._closing:
                raise ServerClosed("the server is closed; no new requests are accepted")
            record = RequestRecord(id=next(self._request_ids), arrival=self.clock() if arrival is None else arrival)
            self._requests.append(record)
            if self._withdrawn:
                self._drop_withdrawn()
            # the capacity counts samples (rows): every queued request's, withdrawn ones included
            full = (len(self._queue) if self._all_single and rows == 1
                    else sum(self._groups.values()) + rows - 1) >= self.queue_capacity
            if full and (self.on_full == "reject" or not self._wait_for_room(timeout, rows)):
                record.rejected = True
                if self._closing:
                    raise ServerClosed("the server closed while this request waited for room in the queue")
                raise OverloadError(self.queue_capacity)
            future = _Request(self, record, sample, sig)
            if rows != 1:
                future._rows = rows
                self._all_single = False
            if self._ordered:
                self._enqueue_ordered(future, index, record)
            else:
                self._queue.append(future)
            self._groups[sig] = alike = self._groups.get(sig, 0) + rows  # rows, not requests
            self._sample_queue()
            queued = len(self._queue)
            room = len(self._inflight) < self.max_inflight
            batch: list[_Request] = []
            formed: BatchRecord | None = None
            if alike >= self._limit and room and not self._flush_left:
                # the request that fills a batch launches it on this thread (see _form)
                batch = self._take(self._limit, sig)
                formed = self._form(batch)
            elif self._flush_left and room:
                self._cond.notify_all()
            elif queued == 1 and self.max_delay is not None and not self._timed_here(record.arrival):
                # the batcher only when it can act: a flush it must send, or a first request
                # whose max-delay deadline it must start timing (unless the caller's event loop
                # times it: _timed_here). Not for a full batch that max_inflight holds back: the
                # completion that frees a place wakes it anyway (a wake per such request was a
                # thread switch and a GIL hand-over each)
                self._cond.notify_all()
        if formed is not None:
            self._launch(formed, batch)
        return future

    def time_delays_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Let ``loop`` time the max delay of the requests submitted on its thread.

        The batcher thread otherwise wakes for the first request of every batch only to start
        timing its delay: in closed loop the batch fills before the delay runs out and the
        submitter launches it, so that wake (a thread switch and a GIL hand-over) bought nothing,
        and it was ~15 % of a served request's CPU on a trivial model. A ``call_later`` on the
        loop the request came from costs a heap push; when it fires, :meth:`_leave_due` sends a
        partial batch whose delay ran out from the loop's thread. Requests submitted on other
        threads, a window without room and close() still go through the batcher thread.
        """
        self._delay_loop = loop
        self._delay_thread = threading.get_ident()

    def _timed_here(self, arrival: float) -> bool:
        """(lock held) Whether the delay of a first request arriving at ``arrival`` is timed by
        the submitting thread's event loop (:meth:`time_delays_on`), a timer now set if needed."""
        loop = self._delay_loop
        if loop is None or threading.get_ident() != self._delay_thread or self.clock is not time.perf_counter:
            return False
        assert self.max_delay is not None
        due = arrival + self.max_delay
        if self._timer_at is None or due < self._timer_at:
            try:
                loop.call_later(max(0.0, due - self.clock()), self._leave_due)
            except RuntimeError:  # that loop is closed: the batcher times delays again
                self._delay_loop, self._timer_at = None, None
                return False
            self._timer_at = due
        return True

    def _leave_due(self) -> None:
        """(The event loop's timer.) Send the partial batch whose max delay ran out, as the
        batcher would; set the timer again for the next request's deadline if one waits."""
        formed: BatchRecord | None = None
        batch: list[_Request] = []
        with self._cond:
            self._timer_at = None
            if self._closing or self._abort or not self._queue:
                return  # close() drains through the batcher
            sig, size, due, _ = self._next_batch(closing=False)
            if size:
                batch = self._take(size, sig)
                formed = self._form(batch)
            elif due != math.inf and not self._timed_here(due - (self.max_delay or 0.0)):
                self._cond.notify_all()  # no loop to time it any more: the batcher does
            # due == inf: the window is full; the completion that frees a place wakes the batcher
        if formed is not None:
            self._launch(formed, batch)
            with self._cond:
                if self._queue and self._timer_at is None and self._delay_loop is not None:
                    self._timed_here(self._oldest_arrival(self.clock()))

    def _level_index(self, level: int) -> int:
        """The index (0 for level 1) of a request's priority ``level`` (0: the default one)."""
        policy = self.queue_policy
        count = len(policy.levels) if policy is not None else 1
        if level == 0:
            return policy.default_level - 1 if policy is not None else 0
        if not 1 <= level <= count:
            raise InputError(f"priority level {level} is out of range: this server's levels are 1 to {count}")
        return level - 1

    def _enqueue_ordered(self, future: _Request, index: int, record: RequestRecord) -> None:
        """(lock held) Queue ``future`` behind the requests of its level and the higher ones that
        are not delayed, before the delayed ones of its level and every lower level's; refused
        when its level's queue is full."""
        assert self.queue_policy is not None
        capacity = self.queue_policy.levels[index].capacity
        if capacity is not None and self._at_level[index] >= capacity:
            record.rejected = True
            raise LevelFullError(index + 1, capacity)
        future._level = index
        place = sum(self._at_level[:index + 1]) - self._delayed_at_level[index]
        if place >= len(self._queue):
            self._queue.append(future)
        else:
            self._queue.insert(place, future)
        self._at_level[index] += 1

    def _left_levels(self, requests: Sequence[_Request]) -> None:
        """(lock held) Count ``requests`` out of their levels (taken into a batch, or dropped)."""
        for p in requests:
            self._at_level[p._level] -= 1
            if p._delayed:
                self._delayed_at_level[p._level] -= 1

    def delay(self, futures: Sequence[RequestFuture]) -> int:
        """Triton's DELAY timeout action: move each of ``futures`` still waiting for its batch
        behind the other requests of its level (after the ones delayed before it), ahead of
        every lower level's; returns how many moved. It runs later, once the requests within
        their timeouts have left. A server without levels or a DELAY policy moves none."""
        if not self._ordered:
            return 0
        moved = 0
        with self._cond:
            for p in futures:
                if not isinstance(p, _Request) or p._server is not self or p._delayed or p.cancelled():
                    continue
                try:
                    self._queue.remove(p)
                except ValueError:  # already in a batch
                    continue
                p._delayed = True
                # its level ends at the sum of the counts up to it; one fewer now it is out
                self._queue.insert(sum(self._at_level[:p._level + 1]) - 1, p)
                self._delayed_at_level[p._level] += 1
                moved += 1
            if moved:
                self._cond.notify_all()  # the next batch's oldest request may have changed
        return moved

    def _on_cancel(self) -> None:
        """A caller that gives up on a queued request (a client that went away) frees its place
        in the queue and in the next batch: an abandoned request must cost the others nothing.
        Counted here, cleared lazily by whoever next needs the queue's true length."""
        with self._cond:
            self._withdrawn += 1
            self._cond.notify_all()

    def _drop_withdrawn(self) -> None:
        """Remove (lock held) the cancelled requests still queued; one pass for many cancels."""
        kept: deque[_Request] = deque()
        groups: dict[Any, int] = {}
        dropped: list[_Request] = []
        for p in self._queue:
            if p.cancelled():
                p._record.withdrawn = True
                p.set_running_or_notify_cancel()  # wait() and as_completed() count it done now
                dropped.append(p)
            else:
                kept.append(p)
                groups[p._sig] = groups.get(p._sig, 0) + p._rows
        if self._ordered:
            self._left_levels(dropped)
        self._flush_left = min(self._flush_left, sum(groups.values()))  # rows
        self._queue, self._withdrawn, self._groups = kept, 0, groups
        self._sample_queue()

    def _wait_for_room(self, timeout: float | None, rows: int = 1) -> bool:
        """Block (lock held) until the queue has room for ``rows`` more samples; False on timeout
        or close."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._closing:
            if self._withdrawn:
                self._drop_withdrawn()
            if sum(self._groups.values()) + rows <= self.queue_capacity:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._cond.wait(left)
        return not self._closing

    def _check_sample(self, sample: Mapping[str, np.ndarray]) -> None:
        """The plan's own checks, plus: a request is exactly one sample.

        When every input's shape is fixed but for the batch axis, a well-formed sample has one
        exact shape and dtype per input: comparing those is a few C calls, a fifth of the
        plan's general checks, which then only run to name what is wrong.
        """
        exact = self._exact_inputs
        if exact is not None and len(sample) == len(exact):
            try:
                for name, dtype, shape in exact:
                    value = sample[name]
                    if value.__class__ is not np.ndarray or value.shape != shape or value.dtype != dtype:
                        break
                else:
                    return
            except Exception:  # noqa: BLE001 - whatever it is, the full checks below name it
                pass
        self.plan.check_feeds(sample)
        if not self._contract.batchable:  # one request per task: a request is whatever the model takes
            return
        for name, axis in self._contract.inputs.items():
            if axis is not None and sample[name].shape[axis] != 1:
                raise InputError(
                    f"input {name!r}: a request is one sample, so axis {axis} (its batch axis) must be 1; got shape "
                    f"{list(sample[name].shape)} (the server forms the batches)"
                )

    def flush(self) -> None:
        """Let every request queued now leave at once, in batches of at most ``batch_size``.

        For the end of a run in the papers' model, where the last requests would otherwise wait
        forever for a batch to fill. Requests submitted later batch normally.
        """
        with self._cond:
            # in rows, as the batcher's rule counts them (a count of requests let a flush of
            # multi-row requests ask for fewer rows than the first one holds: nothing left)
            self._flush_left = sum(self._groups.values())
            self._cond.notify_all()

    # -- the batcher --------------------------------------------------------------------------
    def _batcher_thread(self) -> None:
        block: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.colocate:
            try:
                block = self.runtime.colocate()
            except Exception as exc:  # noqa: BLE001 - a closed runtime: the batcher must still answer
                log.warning("the batcher runs where it is: %s", exc)
        with block:
            self._batcher()

    def _batcher(self) -> None:
        """Form batches and hand them to the runtime; hand out the results of finished ones.

        Both on this thread: a full runtime wakes it for the completion that frees a place in
        ``max_inflight`` anyway, so resolving here costs no extra thread switch, and the next
        batch is launched before the finished one's requests are resolved.
        """
        while True:
            with self._cond:
                work = self._next_work()
                if work is None:
                    return
                batch, completions = work
                record = self._form(batch) if batch else None
            if record is not None:
                self._launch(record, batch)
            if completions:
                self._resolve(completions)
            # not held while the next round waits: the requests of the batches just resolved
            # (several, on a busy host) would stay alive, futures and results, until work came
            del work, batch, completions, record

    def _form(self, batch: list[_Request]) -> BatchRecord:
        """(lock held) Record ``batch`` (just taken from the queue) as formed and in flight.

        Called by the batcher thread, and by :meth:`submit` for the request that fills a batch
        while ``max_inflight`` has room: that thread launches it at once. Handing every full
        batch to the batcher cost a thread wake-up and a GIL hand-over per batch, the largest
        part of what an open-loop request cost beyond a closed-loop one (on a 2-core VM, ~30
        us of CPU a wake-up, against ~180 us of work in a whole batch of 8). Where results are
        handed out is :meth:`_completed`'s business.
        """
        rows = sum(p._rows for p in batch)
        record = BatchRecord(
            id=next(self._batch_ids), size=rows, formed=self.clock(),
            request_ids=[p._record.id for p in batch],
        )
        padded = padded_size(rows, self.pad_to)
        if padded != rows:
            record.padded_to = padded
        oldest = min(batch, key=lambda p: p._record.arrival)
        oldest._record.first_in_batch = True
        for p in batch:
            p._record.batch_id = record.id
        self._batches.append(record)
        self._inflight[record.id] = batch
        self._sample_queue()
        if self.on_full == "block":
            self._cond.notify_all()  # room in the queue for blocked submitters
        return record

    def _next_work(self) -> tuple[list[_Request], list[_Completion]] | None:
        """Wait (lock held) until a batch may leave or results wait to be handed out; None once
        closed and drained."""
        while True:
            if self._abort:
                return None
            sig, size, due, now = self._next_batch(closing=self._closing)
            if size or self._completions:
                completions, self._completions = self._completions, []
                self._resolving += len(completions)
                return (self._take(size, sig) if size else []), completions
            if self._closing and not self._queue and not self._inflight:
                return None
            self._cond.wait(None if due == math.inf else due - now)

    def _next_batch(self, closing: bool) -> tuple[Any, int, float, float]:
        """(lock held) The next batch's group, its size (0: none may leave yet), when one is
        due, and the clock read: one decision for the batcher thread and the event loop's timer
        (:func:`next_batch_size`), withdrawn requests dropped first."""
        if self._withdrawn:
            self._drop_withdrawn()
        now = self.clock()
        sig = self._next_group()
        size, due = next_batch_size(
            queued=self._groups.get(sig, 0) if self._queue else 0, inflight=len(self._inflight),
            batch_size=self._limit, max_inflight=self.max_inflight, flush_left=self._flush_left,
            closing=closing, oldest_arrival=self._oldest_arrival(now), max_delay=self.max_delay, now=now)
        return sig, size, due, now

    def _oldest_arrival(self, now: float) -> float:
        """(lock held) The arrival the max delay counts from: the front request's, or with levels
        the oldest of those the next batch would take (a high-priority request that came later is
        at the front, but the batch leaves once the oldest request in it has waited its delay)."""
        if not self._queue:
            return now
        if not self._ordered:
            return self._queue[0]._record.arrival
        return min(p._record.arrival for p in itertools.islice(self._queue, self._limit))

    def _next_group(self) -> Any:
        """(lock held) The signature whose requests leave next: a full group if the window held
        one back, else the oldest request's (its max-delay deadline is the one running)."""
        if len(self._groups) > 1:
            for sig, count in self._groups.items():
                if count >= self._limit:
                    return sig
            return self._queue[0]._sig
        return next(iter(self._groups), None)

    def _take(self, count: int, sig: Any = None) -> list[_Request]:
        """(lock held) The oldest queued requests of signature ``sig``, in order, holding at most
        ``count`` rows in all (a multi-row request that does not fit waits for the next batch)."""
        queue = self._queue
        taken: list[_Request] = []
        rows = 0
        if len(self._groups) <= 1:  # every queued request alike (most models): from the front
            while queue and rows + queue[0]._rows <= count:
                rows += queue[0]._rows
                taken.append(queue.popleft())
        else:
            kept: deque[_Request] = deque()
            while queue:
                p = queue[0]
                if p._sig == sig:
                    if rows + p._rows > count:
                        break
                    rows += p._rows
                    taken.append(queue.popleft())
                else:
                    kept.append(queue.popleft())
            kept.extend(queue)
            self._queue = kept
        if self._ordered:
            self._left_levels(taken)
        left = self._groups.get(sig, 0) - rows
        if left > 0:
            self._groups[sig] = left
        else:
            self._groups.pop(sig, None)
        self._flush_left = max(0, self._flush_left - rows)
        return taken

    def _launch(self, record: BatchRecord, batch: list[_Request]) -> None:
        """Concatenate the samples, submit the batch; the runtime's callback queues it back."""
        try:
            feeds = self._concat(batch, record.padded_to or record.size)
            started = time.perf_counter()
            future: Future[Outputs]
            if self._trusted is not None:  # samples checked here or by the caller, concatenated here
                future = self._trusted.submit(feeds, arrival=min(p._record.arrival for p in batch)
                                              if self._pass_arrival else None, checked=True)
            elif self._pass_arrival:
                future = self.runtime.submit(feeds, arrival=min(p._record.arrival for p in batch))
            else:
                future = self.runtime.submit(feeds)
        except Exception as exc:  # noqa: BLE001 - fails this batch's requests only
            # on whichever thread launched it (a submitter's too): the batcher hands it out
            self._completed(record, exc)
            return
        future.add_done_callback(functools.partial(_batch_done, self._weak, record, started))

    def _concat(self, batch: list[_Request], rows: int) -> dict[str, np.ndarray]:
        """One array per input holding the batch's samples along its batch axis, the last
        row repeated up to ``rows`` (the batch's requests share a signature: their shapes agree)."""
        samples = [p._sample for p in batch]
        held = sum(p._rows for p in batch)
        if held != len(batch) and rows > held:  # multi-row requests: pad with the last row
            samples += [self._contract.take(batch[-1]._sample, batch[-1]._rows - 1, batch[-1]._rows)] * (rows - held)
        return self._contract.concat(samples, len(samples) if held != len(batch) else rows, self._batch_memory)

    def _completed(self, record: BatchRecord, future: Future[Outputs] | BaseException) -> None:
        """Runtime callback, on the runtime's thread: hand out the batch's results (also the
        launching thread's report of a batch the runtime refused: ``future`` is then the error).

        Where CUDA workers may run the batch, only a list append and a wake-up here: splitting
        outputs and resolving ``b`` futures (running their callers' callbacks) would hold a CUDA
        worker's driver thread away from the device. A runtime of CPU workers only resolves them
        here instead, on the worker's thread (``_resolve_inline``): waking the batcher to do it
        cost a thread wake-up and a GIL hand-over per batch, as much CPU as the resolving, and
        its tail in open loop. The batcher is then woken only when a queued batch may now leave
        (the window had no room) or close() waits.
        """
        with self._cond:
            batch = self._inflight.pop(record.id, None)
            if batch is None:  # already failed by close(timeout)
                return
            if not self._resolve_inline:
                self._completions.append((record, batch, future))
                self._cond.notify_all()
                return
            self._resolving += 1
            if self._queue and (len(self._inflight) + 1 >= self.max_inflight or self._flush_left):
                # the window was full: a batch (or a max-delay timer) may be waiting for this
                # place. With room in it, nothing queued was held back by it: a full batch left
                # with its filling request, and the batcher already times a partial one's delay.
                # Waking it for the partial batch being filled (most completions at 75 % load)
                # cost a thread switch and a GIL hand-over each, for nothing
                self._cond.notify_all()
        self._resolve([(record, batch, future)])

    def _resolve(self, completions: list[_Completion]) -> None:
        """Hand out the results of finished batches (batcher thread, or the runtime's with
        ``_resolve_inline``; lock not held)."""
        finished: list[tuple[BatchRecord, list[_Request], list[dict[str, np.ndarray]] | None, BaseException | None]] = []
        for record, batch, future in completions:
            outputs, error = _outcome(record, future)
            results: list[dict[str, np.ndarray]] | None = None
            if outputs is not None:
                try:
                    results = self._split(outputs, batch, record.padded_to or record.size)
                except Exception as exc:  # noqa: BLE001 - a malformed result fails its batch only
                    error = exc
            finished.append((record, batch, results, error))
            if self._tracer is not None:
                self._trace(record, batch, failed=results is None)
        now = self.clock()
        with self._cond:
            for record, batch, results, error in finished:
                record.done = now
                why = error_line(error) if results is None and error is not None else None
                for p in batch:
                    if results is None:
                        p._record.failed = True
                        p._record.error = why  # what a sweep point's notes say
                    else:
                        p._record.done = now
            self._resolving -= len(completions)
            if self._closing or self._idle_waiters:
                self._cond.notify_all()  # close() or wait_idle() waits for the last ones
        for record, batch, results, error in finished:
            self._settle(record, batch, results, error)

    def _settle(self, record: BatchRecord, batch: list[_Request],
                results: list[dict[str, np.ndarray]] | None, error: BaseException | None) -> None:
        """Resolve a batch's futures in one hold of their shared Condition.

        What ``set_running_or_notify_cancel`` then ``set_result`` do per future (two lock
        round trips and a notify each, 3 us a request here), done once for the batch: the
        state, the waiters of ``wait()`` and blocked callers, then each future's callbacks,
        outside the lock as ``Future`` runs them.
        """
        settled: list[_Request] = []
        with self._future_cond:
            for i, p in enumerate(batch):
                if p._state not in _SETTLED:
                    p.batch = record
                if settle_locked(p, error if results is None else results[i], results is not None):
                    settled.append(p)
            self._future_cond.notify_all()
        for p in settled:
            run_callbacks(p)

    def _trace(self, record: BatchRecord, batch: list[_Request], *, failed: bool) -> None:
        assert self._tracer is not None
        now = self.clock()
        oldest = min(p._record.arrival for p in batch)
        args = {"requests": len(batch), "failed": failed}
        if record.padded_to is not None:
            args["padded_to"] = record.padded_to
        span = f"{self._serial}.{record.id}"
        self._tracer.async_span(f"fill {record.id} ({len(batch)})", "batch fill", span, oldest, record.formed, args)
        self._tracer.async_span(f"batch {record.id} ({len(batch)})", "batch", span, record.formed, now, args)

    def _split(self, outputs: Mapping[str, np.ndarray], batch: list[_Request],
               rows: int) -> list[dict[str, np.ndarray]]:
        """Each request's own rows of every output (views), along each output's batch axis; rows
        past theirs are the padding's and are dropped (a batch of one gets the outputs whole)."""
        return self._contract.split(outputs, [p._rows for p in batch], rows)

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
            "pad_to": list(self.pad_to),
            "policy": (self.runtime.policy_name if isinstance(self.runtime, Runtime)
                       else self.runtime.runtime.policy_name if isinstance(self.runtime, ModelHandle) else None),
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
            reqs = [r.copy() for r in self._requests if since is None or r.arrival >= since]
            ids = {r.id for r in reqs}
            batches = [b.copy() for b in self._batches if ids.intersection(b.request_ids)]
            samples = [s for s in self._queue_samples if since is None or s[0] >= since]
            now = self.clock()
        arrivals = sorted(r.arrival for r in reqs)
        if offered_rate is None:
            offered_rate = float(np.nan_to_num(rate_of(arrivals)))  # 0 for fewer than two arrivals
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
        # called from a result's callback, i.e. on the batcher thread: nothing more can drain
        on_batcher = threading.current_thread() is self._thread
        stuck = on_batcher
        if not on_batcher and self._resolve_inline:
            # or on the runtime's CPU worker that hands results out (_completed): the batches
            # queued behind on that worker cannot run while it waits here (it waited the timeout)
            me = threading.get_native_id()
            stuck = any(w.native_id == me for w in self.runtime.workers)
        deadline = time.monotonic() if stuck else None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            self._wait_drained(deadline)
            self._abort = True
            self._cond.notify_all()
            leftovers = self._unanswered()
            self._queue.clear()
            self._groups.clear()
            self._at_level = [0] * len(self._at_level)
            self._delayed_at_level = [0] * len(self._delayed_at_level)
            self._inflight.clear()
            self._completions.clear()
            for p in leftovers:
                p._record.failed = True
                p._record.error = "the server closed before this request completed"
        for p in leftovers:
            if p.set_running_or_notify_cancel():
                p.set_exception(ServerClosed("the server closed before this request completed"))
        if not on_batcher:
            self._thread.join(timeout=None if deadline is None else max(deadline - time.monotonic(), 1.0))

    def wait_idle(self, timeout: float | None = None) -> int:
        """Wait until every request accepted so far has its result (queued ones leave only as
        batches fill, so :meth:`flush` first at the end of a run); the number of requests still
        waiting for theirs after ``timeout`` s (0: all done).

        What a load generator waits on instead of keeping a future per request: those, and
        their results, lived until the end of the run, and each young collection moved them
        on, so the collections the serving threads stopped for grew with the run.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._idle_waiters += 1
            try:
                self._wait_drained(deadline)
            finally:
                self._idle_waiters -= 1
            return len(self._unanswered())

    def _unanswered(self) -> list[_Request]:
        """(lock held) The requests without a result yet: queued, in flight, or finished and
        waiting to be handed out."""
        return [*self._queue, *(p for b in self._inflight.values() for p in b),
                *(p for _, b, _ in self._completions for p in b)]

    def _wait_drained(self, deadline: float | None) -> None:
        """(lock held) Until nothing is queued, in flight or being handed out, or ``deadline``
        (``time.monotonic()``; None: no limit)."""
        while True:
            if self._withdrawn:  # cancelled requests left queued would keep it waiting: the
                self._drop_withdrawn()  # batcher that drops them has no reason to wake it
            if not (self._queue or self._inflight or self._completions or self._resolving):
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self._cond.wait(left)

    @property
    def closed(self) -> bool:
        return self._closing and not self._thread.is_alive()

    @property
    def batching(self) -> bool:
        """Whether the batcher thread still runs: False once closed, and also where it ended
        by an error nobody closed it after (a health check's question: requests would queue
        and never leave)."""
        return self._thread.is_alive()


def _batch_done(server: weakref.ref[Server], record: BatchRecord, started: float, future: Future[Outputs]) -> None:
    """A batch's done-callback: the server's ``on_executed`` (for a batch that succeeded,
    ``started`` being its submission's ``perf_counter``), then :meth:`Server._completed`,
    through a weak reference.

    A runtime keeps its last request's future (and so its callbacks) for as long as the worker
    that ran it waits for the next one. A strong reference there kept a closed server alive,
    with every record, future and result of its run (hundreds of thousands of objects after a
    sweep point), until the runtime's next task dropped it: its deallocation then ran on the
    worker's thread, holding the GIL for 10-30 ms right at the start of the next run (the
    first arrivals of each open-loop point after the first were that late). Weakly held, a
    server goes when its owner lets go of it, on the owner's thread.
    """
    target = server()
    if target is None:
        return
    try:
        if target._on_executed is not None and not future.cancelled() and future.exception() is None:
            target._on_executed(record.padded_to or record.size, time.perf_counter() - started)
    except Exception:  # noqa: BLE001 - a failing counter must not keep the batch's requests unanswered
        log.exception("the server's on_executed callback failed; the batch's results are handed out anyway")
    target._completed(record, future)


def _exact_inputs(plan: Plan) -> list[tuple[str, np.dtype[Any], tuple[int, ...]]] | None:
    """(name, dtype, shape) of a one-sample request per input, when each has exactly one;
    None when some dimension other than the batch axis is free (or a dtype numpy lacks)."""
    exact: list[tuple[str, np.dtype[Any], tuple[int, ...]]] = []
    contract = plan.contract
    for t in plan.inputs:
        try:
            dtype = np.dtype(t.dtype)
        except TypeError:
            return None
        axis_of = contract.inputs.get(t.name) if contract.batchable else None
        shape = [1 if axis == axis_of else d for axis, d in enumerate(t.shape)]
        fixed = [d for d in shape if isinstance(d, int) and not isinstance(d, bool) and d >= 0]
        if len(fixed) < len(shape):
            return None
        exact.append((t.name, dtype, tuple(fixed)))
    return exact

