"""The native engine: the task-graph core (:mod:`staronnx.runtime.core`) on Python threads.

Each worker runs a serving loop *inside its own pinned thread* (``Worker.spawn``) that asks
the core for its next task and runs it on its ORT sessions (ORT releases the GIL while
computing, so workers run in parallel). A worker that can launch a task without waiting for it
(a CUDA worker's ``launch_here``/``finish_here``) is given its next task before it waits for
the current one. The engine adds only what the simulator does not share: the lock around the
core, the real clock, the arrays, the perf models fed while they still need samples (tasks are
timed only then), the trace, and the futures.

Data lives where the core's decisions (:mod:`staronnx.runtime.datawizard`) say: a request's
tensors are its data handles (:class:`~staronnx.runtime.datawizard.DataHandle`), which hold
both the nodes the policies see as valid and the copies there (a host array, tensors in a
GPU's memory, or both). A CUDA worker leaves the outputs other parts read on its GPU and
writes back only the request's final outputs; a task is handed, per input, its copy on the
worker's node, or the copy its fetch reads (a CUDA worker copies it into its own buffers; a
CPU worker's fetch from a GPU is downloaded here first), and a fetched copy that later
readers will want is kept as the handle's own. Where the policy places a task when it is
pushed (dmda, heft, random, static), its inputs' copies to that worker's node start at once
(StarPU's prefetch, on the node's copy stream), so they overlap the worker's current task; the
task's stream waits on their events, not the host. They are decided under the engine's lock
and issued just after it is released (:meth:`NativeEngine._queue_prefetches`, then
:meth:`NativeEngine._issue_prefetches`): one thread at a time issues them, in the order they
were decided, so a copy's source is always in place first; a reader that finds its input still
being issued (its handle's ``arriving``) waits for it. ``stats()["prefetch"]`` counts the tasks that found their inputs on their node when
they started.

Everything here runs per task under the GIL that every worker and the serving threads share,
so the bookkeeping is kept small: one condition per worker (a task wakes the worker it was
placed on, or one idle worker for a shared queue, never all of them), footprints and frozen
calibration answers cached, a request's future settled in one lock hold. A driver that
launches ahead settles futures at once but wakes their callers in groups (see
:meth:`NativeEngine._drive`): before it waits for the device, goes idle, or after
:data:`ANNOUNCE_EVERY` results or :data:`ANNOUNCE_AFTER_S` seconds.

A task may also be pinned to one worker (:meth:`NativeEngine.pin`, StarPU's
``execute_on_specific_worker``): one part on given arrays, run by that worker's loop before
its next scheduled task, through the same launch, wait and copies as every task. Calibration
and warm-up are such tasks: there is one way to run a task.

A failing task fails only its own request (the other tasks of that request are dropped when
popped); a worker that raises :class:`~staronnx.workers.base.WorkerLost` (a lost CUDA
context), or whose loop dies, is reported and its task in hand and queued tasks are placed on
the others.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import threading
import time
import traceback
from collections import deque
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from staronnx.errors import StaronnxError
from staronnx.perfmodels import Footprint, PerfModelStore
from staronnx.plan import Plan
from staronnx.runtime.core import Request, Task, TaskGraph
from staronnx.runtime.datawizard import Copy, DataHandle, is_host, source
from staronnx.runtime.models import ModelOverloaded, ModelSet
from staronnx.runtime.policies import make_policy
from staronnx.runtime.predictor import PerfPredictor, calibrate_mode
from staronnx.runtime.registry import EngineSettings, register_engine
from staronnx.runtime.sched import Clock, Policy, WorkerInfo
from staronnx.runtime.task import RequestFuture, TaskError, announce, settle, settle_quietly
from staronnx.runtime.trace import Tracer
from staronnx.workers.base import Worker, WorkerLost
from staronnx.workers.cuda import CudaWorker
from staronnx.workers.launch import start_workers
from staronnx.workers.replicas import DeviceMemory, DeviceTensor, OutputRoute

log = logging.getLogger(__name__)


class EngineClosed(RuntimeError):
    """Submitting to an engine (or Runtime) after close()."""


@dataclass(eq=False, slots=True)
class Pinned:
    """A task pinned to one worker: part ``part`` on ``feeds`` (host arrays; every output comes
    back to the host), outside any request and any policy. ``future`` resolves to a
    :class:`PinnedResult`, or to the task's error."""

    part: int
    feeds: dict[str, np.ndarray]
    future: Future[PinnedResult]
    timed: bool = True


@dataclass(frozen=True)
class PinnedResult:
    """What a pinned task gave: its outputs, and its time: ``seconds`` is what a perf model
    learns (a CUDA worker's kernel time between events, copies excluded; a CPU worker's wall
    time), ``wall`` from its start to its outputs on the host."""

    outputs: dict[str, np.ndarray]
    seconds: float
    wall: float


def parts_held(workers: Sequence[Worker], k: int) -> list[frozenset[int]] | None:
    """Per part, the workers (indices) that hold a session for it, from each worker's
    ``holds`` (None: every part); None when every worker holds every part, so the policies
    keep their unrestricted fast path."""
    holds = [w.holds for w in workers]
    if all(h is None for h in holds):
        return None
    return [frozenset(i for i, h in enumerate(holds) if h is None or p in h) for p in range(k)]


#: a driver wakes the callers of finished requests at the latest after this many results...
ANNOUNCE_EVERY = 16
#: ... or after this long (seconds), whatever it is doing
ANNOUNCE_AFTER_S = 200e-6


#: what a worker is handed: its index, and a scheduled task or a pinned one (the other None)
Job = tuple[int, Task | None, Pinned | None]


class RealClock:
    """``time.perf_counter``, as the policies' :class:`~staronnx.runtime.sched.Clock` (the C
    function itself: it is read several times per task)."""

    now = staticmethod(time.perf_counter)


class NativeEngine:
    """Runs a plan's task graph (or those of several: a :class:`ModelSet`) over started
    workers with a policy."""

    def __init__(
        self,
        plan: Plan | ModelSet,
        workers: Sequence[Worker],
        policy: Policy,
        predictor: PerfPredictor,
        tracer: Tracer | None = None,
        own_workers: bool = False,
        clock: Clock | None = None,
    ) -> None:
        self.models = ModelSet.of(plan)
        self.plan = self.models.models[0].plan  # the first (or only) model's
        self.policy = policy
        self.predictor = predictor
        self.tracer = tracer
        self.own_workers = own_workers
        #: the policies' clock; a test may give a virtual one (see tests/test_replay.py)
        self.clock = clock if clock is not None else RealClock()
        self._lock = threading.Lock()
        #: the workers each thread drives: a CUDA device's stream workers share one thread
        #: (StarPU's ``STARPU_CUDA_THREAD_PER_DEV``), every other worker has its own
        self.drivers = driver_groups(workers)
        #: one condition per thread on the one lock, so a task wakes only the thread it is for
        self._group_of = {wid: group for group in self.drivers for wid in group}
        conds = [threading.Condition(self._lock) for _ in self.drivers]
        self._conds = [conds[self.drivers.index(self._group_of[wid])] for wid in range(len(workers))]
        self._drained = threading.Condition(self._lock)  # close() waits on it
        self._future_cond = threading.Condition()  # shared by the request futures (light ones)
        self._idle: set[int] = set()
        self._last_end = [0.0] * len(workers)
        self._workers = list(workers)
        self._output_names = [m.plan.output_names for m in self.models.models]
        self._capacity = [m.target.capacity for m in self.models.models]
        self._part_inputs = self.models.part_inputs
        #: per model, its batching contract: where the batch size of a request's feeds is read
        self._contracts = [m.plan.contract for m in self.models.models]
        #: per part (of every model), each input's batch axis (perf-model footprints)
        self._part_axes = [m.plan.part_batch_axes(p) for m, p in self.models.owner]
        self._footprints: dict[tuple[object, ...], Footprint] = {}
        self._archs = [w.arch for w in workers]
        #: each worker's memory node, and whether it is host memory
        self._nodes = [w.memory_node for w in workers]
        self._on_host = [is_host(n) for n in self._nodes]
        #: the GPUs as memory nodes (node -> its memory): empty when every value is a host array
        self._memories: dict[str, DeviceMemory] = {}
        for w in workers:
            if isinstance(w, CudaWorker):
                self._memories.setdefault(w.memory_node, w.device_memory)
        #: per part: which outputs a GPU writes back (final) and which it keeps (read by a part);
        #: None where every output comes back and none stays (the worker's plain path)
        self._routes: list[OutputRoute | None] = [
            None if route.host == set(outputs) and not route.device else route
            for m, local in self.models.owner
            for outputs in [m.plan.parts[local].outputs]
            for route in [OutputRoute(frozenset(n for n in outputs if n in m.plan.output_names),
                                      frozenset(n for n in outputs if any(n in p.inputs for p in m.plan.parts)))]]

        self._frozen: set[tuple[int, str, int, int]] = set()  # (part, arch, footprint) calibrated for good
        self._loops: list[Future[None]] = []
        self._stopping = False
        self._closed = False
        #: workers waiting with nothing to run (a test's quiescence probe)
        self.idle = 0
        self.started_at = self.clock.now()
        infos = [WorkerInfo(i, w.name, w.arch, w.kind, w.memory_node, w.n_cores) for i, w in enumerate(workers)]
        self.core = TaskGraph(self.models, infos, policy, predictor, self.clock, self._footprint,
                              where=parts_held(workers, self.models.k), copy_cost=predictor.bus.predict,
                              prefetch=bool(self._memories))
        #: per worker (each counted by its own thread): tasks started, those that needed an
        #: input moved to their node, and those whose moves were all done when they started
        self._starts = [[0, 0, 0] for _ in workers]
        #: prefetches decided under the lock and not yet issued, in decision order; the one
        #: thread issuing them at a time; where readers wait for their inputs to be issued
        self._to_issue: deque[tuple[Task, Copy, DataHandle]] = deque()
        self._issuing = threading.Lock()
        self._arrivals = threading.Condition()
        #: per worker, the tasks pinned to it (run before its next scheduled one), and how
        #: many are queued in all (a hint read without the lock, as ``core.queue``)
        self._pinned: list[deque[Pinned]] = [deque() for _ in workers]
        self._pinned_count = 0
        self.core.dropped = operator.attrgetter("cancelled_by_caller")  # (read in C, per task)
        if tracer is not None:
            for info in infos:
                tracer.lane(info.id, info.name)
        for group in self.drivers:
            first = self._workers[group[0]]
            loop = self._make_driver(group) if first.launches_ahead else self._make_loop(group[0])
            self._loops.append(first.spawn(loop))

    def _footprint(self, req: Request, part: int) -> Footprint:
        """The perf-model key of a task, by its inputs' shapes (a few, seen over and over)."""
        handles, names = req.handles, self._part_inputs[part]
        key = (part, req.batch, *[h.shape if (h := handles[n]).host is None else h.host.shape for n in names])
        try:
            return self._footprints[key]
        except KeyError:
            if len(self._footprints) > 4096:
                self._footprints.clear()
            fp = self._footprints[key] = Footprint.of_feeds({n: handles[n] for n in names}, req.batch,
                                                            self._part_axes[part])
        return fp

    # -- submission ---------------------------------------------------------------------------
    def submit(self, feeds: Mapping[str, np.ndarray], model: int = 0, arrival: float | None = None) -> RequestFuture:
        """Create the request's tasks; inputs must already be checked against the plan of
        ``model`` (its index). ``arrival`` (this engine's clock; default now) is when the
        request arrived, from which its model's latency target counts. Raises
        :class:`ModelOverloaded` when the model already has its capacity in flight."""
        batch = self._contracts[model].rows(feeds)
        future = RequestFuture(-1, self._future_cond)
        capacity = self._capacity[model]
        with self._lock:
            if self._closed:
                raise EngineClosed("the runtime is closed; no new requests are accepted")
            if capacity is not None and self.core.per_model[model].in_flight >= capacity:
                raise ModelOverloaded(self.models.models[model].name, capacity)
            if self.core.stranded and model in self.core.stranded:
                raise EngineClosed(f"model {self.models.models[model].name!r} can no longer run: every worker "
                                   "that held one of its parts was lost")
            req = self.core.submit(batch, None, self.clock.now(), feeds, future, model=model, arrival=arrival)
            if self.core.prefetches:
                self._queue_prefetches()
            future.request_id = req.id
            future.placement = req.placement
            if self._idle:
                self._wake()
        if self._to_issue:
            self._issue_prefetches()
        return future

    def pin(self, wid: int, part: int, feeds: Mapping[str, np.ndarray], n: int = 1,
            timed: bool = True) -> list[Future[PinnedResult]]:
        """Run ``part`` on ``feeds`` ``n`` times on worker ``wid`` (an index of :attr:`workers`),
        before the tasks the policy has for it: StarPU's ``execute_on_specific_worker``, what
        calibration and warm-up run. The same launch, copies and wait as every task (on a CUDA
        worker, on the thread that drives it: its graphs are captured there); no request, no
        policy, no perf model fed. ``timed``: record the CUDA events that time it. The ``n`` are
        queued at once: a CUDA worker launches the second before it waits for the first, as it
        does its scheduled tasks (so a warm-up makes both buffer sets a pipelined stream uses
        per shape)."""
        holds = self._workers[wid].holds
        if holds is not None and part not in holds:
            raise StaronnxError(f"{self._workers[wid].name} does not hold part {part}")
        items = [Pinned(part, dict(feeds), Future(), timed) for _ in range(n)]
        with self._lock:
            if self._closed:
                raise EngineClosed("the runtime is closed; no new tasks are accepted")
            if not self.core.workers[wid].alive:
                raise WorkerLost(f"{self._workers[wid].name} was lost")
            self._pinned[wid].extend(items)
            self._pinned_count += n
            self._notify(wid)
        return [item.future for item in items]

    def _queue_prefetches(self) -> None:
        """(lock held) Queue the copies the core decided when its policy placed tasks (its
        :attr:`~TaskGraph.prefetches`) for :meth:`_issue_prefetches`, each handle counting it
        as arriving; a copy between host nodes moves nothing (read in place)."""
        for task, copy in self.core.prefetches:
            h = task.request.handles.get(copy[0])
            if h is None or (is_host(copy[2]) and (is_host(copy[1]) or h.host is not None)):
                continue
            h.arriving += 1
            self._to_issue.append((task, copy, h))
        self.core.prefetches.clear()

    def _issue_prefetches(self) -> None:
        """(lock not held) Issue the queued prefetches: on the destination GPU's copy stream, or
        down from a GPU into pinned memory for a CPU worker, none waited for; each becomes the
        handle's copy there. One that cannot start is no longer valid there (its task fetches
        it when it starts). One thread at a time, in the order they were decided."""
        with self._issuing:
            while self._to_issue:
                task, copy, h = self._to_issue.popleft()
                try:
                    self._prefetch(h, copy[1], copy[2])
                except Exception as exc:  # noqa: BLE001 - the task's own fetch will say what fails
                    log.debug("prefetch of %s to %s failed: %s", copy[0], copy[2], exc)
                    with self._lock:
                        h.valid_on = h.valid_on - {copy[2]}
                        task.prefetched = [c for c in task.prefetched if c is not copy]
                finally:
                    with self._arrivals:
                        h.arriving -= 1
                        if not h.arriving:
                            self._arrivals.notify_all()

    def _await(self, h: DataHandle) -> None:
        """Wait until the prefetches of ``h`` decided before its reader started are issued."""
        with self._arrivals:
            self._arrivals.wait_for(lambda: not h.arriving)

    def _prefetch(self, h: DataHandle, src: str, dst: str) -> None:
        """Start the copy of ``h`` from node ``src`` to node ``dst`` (not both host memory);
        nothing when the source copy is gone (a failed request's)."""
        if is_host(dst):
            tensor = h.on_device(src)
            if tensor is not None and h.host is None:
                array, ready = tensor.memory.download_async(tensor)
                h.add_host(array, None if ready is None else (ready, tensor.memory))
            return
        memory = self._memories[dst]
        if is_host(src):
            if h.host is not None:
                h.add_device(dst, memory.upload(h.host, wait=False))
        elif (tensor := h.on_device(src)) is not None:
            h.add_device(dst, memory.peer(tensor, wait=False))

    def _count_start(self, task: Task, wid: int) -> None:
        """Whether ``task`` found its inputs on its worker's node as it starts: nothing to
        fetch now, and every prefetch of its done (a prefetch hit), counted per worker."""
        counts = self._starts[wid]
        counts[0] += 1
        node = self._nodes[wid]
        if any(c[2] == node for c in task.copies):
            counts[1] += 1
            return
        if not task.prefetched:
            return
        counts[1] += 1
        handles = task.request.handles
        for c in task.prefetched:
            h = handles[c[0]]
            if h.arriving:  # still being issued by the thread that decided it: a wait on the host
                self._await(h)
            if not h.arrived(node):
                return
        counts[2] += 1

    def _wake(self) -> None:
        """(lock held) Wake the workers the last core call gave work to: the one a task was
        placed on, or one idle worker for a task in a shared queue. Waking every worker on
        every event cost a thread switch and a GIL hand-over per idle worker per task."""
        for _ in range(self.core.pushed_shared):
            if not self._idle:
                break
            self._notify(next(iter(self._idle)))
        for target in self.core.pushed_to:
            if isinstance(target, int):
                if target in self._idle:
                    self._notify(target)
            elif self._idle:  # a shared queue's task that only these workers hold
                idle = next((w for w in self._idle if w in target), None)
                if idle is not None:
                    self._notify(idle)

    def _wake_all(self) -> None:
        """(lock held) Every idle worker looks again (close, a lost worker)."""
        for wid in list(self._idle):
            self._notify(wid)

    def _notify(self, wid: int) -> None:
        # the whole thread wakes: none of its workers is idle any more (a second task must
        # wake another thread, not this one again)
        self._idle.difference_update(self._group_of[wid])
        self.idle = len(self._idle)
        self._conds[wid].notify()

    # -- worker loops -------------------------------------------------------------------------
    def _make_loop(self, wid: int) -> Callable[[], None]:
        """The loop of a worker that runs one task at a time (CPU)."""
        worker = self._workers[wid]

        def loop() -> None:
            job: tuple[Task | None, Pinned | None] | None = None
            try:
                while (job := self._next_task(wid)) is not None:
                    started = self._start(wid, worker, job[0], job[1], False)
                    if started.pinned is not None:
                        self._end_pinned(wid, started.pinned, started)
                    else:
                        self._end(wid, started)
                    # let go of the task before waiting for the next: held here, its request's
                    # feeds, intermediates and outputs lived for as long as the worker stayed
                    # idle. (Inline, not in a helper: a failed task's traceback keeps the frame
                    # that called _start alive, and a helper's would hold the task with it.)
                    job = None
                    del started
            except BaseException as exc:  # noqa: BLE001 - the worker is lost, its work is not
                # a scheduled task in hand goes to the others (the core's); a pinned one cannot
                if job is not None and job[1] is not None:
                    _settle_pinned(job[1], WorkerLost(f"{worker.name} was lost: {exc!r}"))
                self._worker_died(wid, exc)

        return loop

    def _make_driver(self, wids: list[int]) -> Callable[[], None]:
        def loop() -> None:
            try:
                self._drive(wids)
            except BaseException as exc:  # noqa: BLE001 - the thread is lost, the work is not
                for wid in wids:
                    if self.core.workers[wid].alive:
                        self._worker_died(wid, exc)

        return loop

    def _drive(self, wids: list[int]) -> None:
        """The loop of workers that can launch a task without waiting for it (CUDA): one
        thread drives them all, a device's streams as StarPU's driver thread per device does,
        or one stream (``thread_per_stream``). Each stream gets up to two tasks launched
        ahead, so the device never waits for the host's bookkeeping between two tasks
        (StarPU's prefetch and CUDA pipeline), and the oldest launched task is waited for
        first. A launch costs the host the same whichever stream it goes to, so one thread
        keeps every stream fed while the GIL, the context switches and the cores that N
        threads per device would take are spent once. A finished task is booked and the
        next ones taken in one lock hold. A worker that is lost (:class:`WorkerLost`) leaves
        the group; its tasks, launched or queued, are placed again by :meth:`_worker_died`."""
        workers = self._workers
        if len(wids) > 1:  # this thread is the first worker's: the others' CUDA state too
            for wid in wids:
                workers[wid].adopt_thread()
        # finished requests whose callers are not woken yet: a wake-up per result made the
        # woken caller take the GIL at this thread's next CUDA call (a launch), twice a task
        deferred: list[RequestFuture] = []
        try:
            self._drive_loop(wids, deferred)
        finally:
            if deferred:
                announce(deferred)

    def _drive_loop(self, wids: list[int], deferred: list[RequestFuture]) -> None:
        """:meth:`_drive`'s loop. The callers of ``deferred`` are woken before this thread may
        block (for work, or for a task the device has not finished: they then run while it
        waits), else as the module docstring says."""
        workers = self._workers
        ahead: deque[tuple[int, _Started]] = deque()  # in launch order, all streams
        launched = dict.fromkeys(wids, 0)
        live = list(wids)
        room = 2 * len(live)  # tasks launched and not waited for: two per live stream
        n_ahead = 0  # len(ahead), kept as it changes (read per task)
        # when the oldest deferred result was settled, and the latest task's end (the engine's
        # clock, read by _end: the time the results have waited needs no clock read of its own)
        since = latest = 0.0

        def lost(wid: int, exc: BaseException) -> None:
            nonlocal room, n_ahead
            live.remove(wid)
            room = 2 * len(live)
            for entry in [e for e in ahead if e[0] == wid]:
                ahead.remove(entry)
                n_ahead -= 1
                if (pinned := entry[1].pinned) is not None:
                    _settle_pinned(pinned, exc)
            launched[wid] = 0
            self._worker_died(wid, exc)

        got: list[Job] = []
        taken: list[Job] | None
        started: _Started | None = None
        task: Task | None = None
        pinned: Pinned | None = None
        while live:
            if not got and not ahead:
                if deferred:  # about to wait for work
                    announce(deferred)
                    deferred.clear()
                # nothing of the last task held here while waiting: its request's arrays and
                # outputs lived for as long as the device stayed idle
                started = task = pinned = taken = None
                taken = self._take(live, group=wids)
                if taken is None:
                    return
                got, taken = taken, None
            for wid, task, pinned in got:
                try:
                    ahead.append((wid, self._start(wid, workers[wid], task, pinned, True)))
                    launched[wid] += 1
                    n_ahead += 1
                except WorkerLost as exc:
                    if pinned is not None:  # (a scheduled task is placed again by the core)
                        _settle_pinned(pinned, exc)
                    lost(wid, exc)
            got = []
            if not ahead:
                continue
            if (self.core.queue or self._pinned_count) and n_ahead < room:  # a stream has room: fill it
                with self._lock:  # before waiting (``queue`` is a hint read without the lock)
                    got = self._take_each([w for w in live if launched[w] < 2], self.clock.now())
                if got:
                    continue
            wid, started = ahead.popleft()
            launched[wid] -= 1
            n_ahead -= 1
            fresh = not deferred
            # (or before a wait that would block: failed at launch, ran to its end, or the device
            # says it is done, asked inline: this runs per task)
            if not fresh and (len(deferred) >= ANNOUNCE_EVERY or latest - since > ANNOUNCE_AFTER_S
                              or not (started.error is not None or started.handle is None
                                      or workers[wid].ready(started.handle))):
                announce(deferred)
                deferred.clear()
                fresh = True
            if started.error is None:  # wait for it: its outputs (and those its route kept), or its error
                worker = workers[wid]
                try:
                    started.outputs = worker.finish_here(started.handle)
                    started.compute = worker.last_compute_seconds
                    if started.routed:
                        started.device = worker.device_outputs(started.handle)
                except WorkerLost as exc:
                    if started.pinned is not None:  # taken out of ``ahead``: lost() no longer sees it
                        _settle_pinned(started.pinned, exc)
                    lost(wid, exc)
                    continue
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    started.error = exc
            if started.pinned is not None:
                self._end_pinned(wid, started.pinned, started)
                with self._lock:
                    got = self._take_each([w for w in live if launched[w] < 2], self.clock.now())
                continue
            got = self._end(wid, started, take=[w for w in live if launched[w] < 2], defer=deferred)
            latest = self._last_end[wid]
            if fresh and deferred:
                since = latest

    def _take(self, wids: list[int], group: list[int]) -> list[Job] | None:
        """A task for each of ``wids`` that has one, in one lock hold, waiting until one
        does. None: the engine is stopping (or the group has no live worker)."""
        with self._lock:
            workers = self.core.workers
            while True:
                got = self._take_each(wids, self.clock.now())
                if got:
                    return got
                if self._stopping or not any(workers[w].alive for w in group):
                    return None
                if self._closed and not self.core.inflight:
                    self._drained.notify_all()  # the take may have withdrawn close()'s last request
                self._idle.update(w for w in group if workers[w].alive)
                self.idle = len(self._idle)
                self._conds[group[0]].wait()
                self._idle.difference_update(group)
                self.idle = len(self._idle)

    def _take_each(self, wids: Sequence[int], now: float) -> list[Job]:
        """(lock held) A task for each live worker of ``wids`` that the policy has one for;
        stops asking once nothing is queued (a driver's streams would each ask in vain)."""
        core, states = self.core, self.core.workers
        got: list[Job] = []
        for wid in wids:
            if self._pinned_count and self._pinned[wid] and states[wid].alive:
                self._pinned_count -= 1
                got.append((wid, None, self._pinned[wid].popleft()))
                continue
            if not core.queue:
                if self._pinned_count:
                    continue
                break
            if states[wid].alive and (task := core.next_task(wid, now)) is not None:
                got.append((wid, task, None))
        return got

    def _next_task(self, wid: int) -> tuple[Task | None, Pinned | None] | None:
        """(CPU loop) The next task of worker ``wid`` (scheduled, or pinned to it), waiting
        for one; None once the engine stops or the worker is lost."""
        with self._lock:
            while self.core.workers[wid].alive:
                if self._pinned[wid]:
                    self._pinned_count -= 1
                    return None, self._pinned[wid].popleft()
                task = self.core.next_task(wid, self.clock.now())
                if task is not None:
                    return task, None
                if self._stopping:
                    return None
                if self._closed and not self.core.inflight:
                    # the requests next_task withdrew (their callers cancelled them) end without
                    # a task ending: close() waiting for the last of them must hear it here
                    self._drained.notify_all()
                self._idle.add(wid)
                self.idle = len(self._idle)
                self._conds[wid].wait()
            return None

    def _needs_samples(self, wid: int, task: Task, fp: Footprint, key: tuple[int, str, int, int]) -> bool:
        """Whether this task's time is wanted (``key`` not frozen: see :meth:`_start`): only
        while its perf model needs samples (a CUDA worker then records events; without them
        it saves their calls). A model that is calibrated under ``calibrate=0`` stays frozen,
        so that answer is kept."""
        needed = self.predictor.needs_samples(task.part, self._archs[wid], fp)
        if not needed and self.predictor.calibrate == 0:
            self._frozen.add(key)
        return needed

    def _feeds(self, task: Task, wid: int) -> tuple[dict[str, Any], _Kept | None]:
        """The task's inputs as its worker reads them: each one's copy on the worker's node,
        or, where the core decided a fetch, the copy that fetch reads (a CUDA worker copies it
        into its own buffers). A CPU worker's fetch from a GPU is downloaded here; a fetch the
        core keeps (a later reader wants it) is made here as the handle's own copy, and
        returned beside the feeds to join the handle when the task ends (None: none)."""
        handles = task.request.handles
        names = self._part_inputs[task.part]
        if not self._memories:  # no GPU memory anywhere: every input is a host array
            return {n: handles[n].host for n in names}, None
        node, keep = self._nodes[wid], task.keep
        kept: _Kept | None = None
        feeds: dict[str, Any] = {}  # host arrays, and tensors in a GPU's memory for a CUDA worker
        if self._on_host[wid]:
            for n in names:
                h = handles[n]
                if h.arriving:
                    self._await(h)
                if h.host is not None:
                    if h.host_ready is not None:
                        h.wait_host()  # a prefetch from a GPU still coming down
                    feeds[n] = h.host
                    continue
                tensor = _on_device(h, self._fetched_from(task, h, node))
                feeds[n] = array = tensor.memory.download(tensor)
                if n in keep:
                    kept = kept or _Kept()
                    kept.host.append((n, array))
            return feeds, kept
        for n in names:
            h = handles[n]
            if h.arriving:
                self._await(h)
            if h.device is None:  # the common case: a host array, and no copy on any GPU
                if n not in keep:
                    feeds[n] = _host(h) if h.host is None else h.host  # read as it is
                    continue
            elif (here := h.device.get(node)) is not None:
                feeds[n] = here
                continue
            src = self._fetched_from(task, h, node)
            if n not in keep:
                feeds[n] = _host(h) if is_host(src) else _on_device(h, src)
                continue
            memory = self._memories[node]
            feeds[n] = here = memory.upload(_host(h)) if is_host(src) else memory.peer(_on_device(h, src))
            kept = kept or _Kept()
            kept.device.append((n, here))
        return feeds, kept

    def _fetched_from(self, task: Task, h: DataHandle, node: str) -> str:
        """The node the fetch of ``h`` to ``node`` that the core decided for ``task`` reads; where
        it decided none (a prefetch there failed after the task was taken), the cheapest valid
        copy."""
        for c in task.copies:
            if c[0] == h.name and c[2] == node:
                return c[1]
        return source(h.valid_on, node, h.nbytes, self.core.copy_cost)

    def _start(self, wid: int, worker: Worker, task: Task | None, pinned: Pinned | None, ahead: bool) -> _Started:
        """Hand a scheduled ``task`` or a ``pinned`` one (the other is None) to its worker:
        launched (``ahead``: a worker that launches ahead; :meth:`_drive_loop` waits for it) or
        run to its end (CPU). A scheduled task's fetches from a GPU (a CPU worker's downloads)
        count in its wall time, not in its perf model's compute time; a pinned task reads its
        feeds as they are."""
        start = self.clock.now()
        kept = route = None
        given: dict[str, np.ndarray] | None = None  # a pinned task's feeds
        if task is not None:
            # timed while its perf model needs samples; a frozen answer is a set lookup
            fp = task.view.footprint if task.view is not None else None
            if fp is None:
                timed = False
            else:
                key = (task.part, self._archs[wid], fp.batch, fp.shape_hash)  # ints: hashed in C
                timed = key not in self._frozen and self._needs_samples(wid, task, fp, key)
            if self.core.prefetch:
                self._count_start(task, wid)
            part = task.part
        else:
            assert pinned is not None
            timed, part, given = pinned.timed, pinned.part, pinned.feeds
        try:
            if given is None:
                assert task is not None
                feeds, kept = self._feeds(task, wid)
                if self._memories:
                    route = self._routes[part]
            else:
                feeds = given
            if ahead:
                return _Started(start, timed, worker.launch_here(part, feeds, timed, route), kept=kept,
                                task=task, pinned=pinned, routed=route is not None)
            began = self.clock.now()
            outputs = worker.run_here(part, feeds, timed)
            copied = task is not None and bool(task.copies)
            compute = worker.last_compute_seconds or (self.clock.now() - began if copied else None)
            return _Started(start, timed, None, outputs, None, compute, kept, task=task, pinned=pinned)
        except WorkerLost:
            raise
        except Exception as exc:  # noqa: BLE001 - fails this request (or pinned task) only
            return _Started(start, timed, None, {}, exc, task=task, pinned=pinned)

    def _end_pinned(self, wid: int, item: Pinned, started: _Started) -> None:
        """Settle a pinned task's future: its outputs and time, or its error."""
        end = self.clock.now()
        start = max(started.start, self._last_end[wid])  # launched behind another: from its end
        self._last_end[wid] = end
        if started.error is not None:
            _let_go(started.error)
            _settle_pinned(item, started.error)
        else:
            _settle_pinned(item, PinnedResult(dict(started.outputs or {}), started.compute or (end - start),
                                              end - start))

    def _end(self, wid: int, started: _Started, take: Sequence[int] = (),
             defer: list[RequestFuture] | None = None) -> list[Job]:
        """Book a finished task: perf model, trace, the core (successors), the request; with
        ``take``, also take a task for each of those workers that has one ready, under the same
        lock (what a pipelined loop launches next). With ``defer``, a finished request's future
        is settled but its callers are left for the caller to :func:`announce` (appended)."""
        task = started.task
        assert task is not None
        req = task.request
        info = self.core.workers[wid].info
        end = self.clock.now()
        # a task launched behind another starts when that one ends
        last = self._last_end[wid]
        start = started.start if started.start > last else last
        self._last_end[wid] = end
        measured = end - start
        error, outputs = started.error, started.outputs
        if error is not None:
            _let_go(error)
        if error is None and started.timed:
            # CUDA workers report kernel time without their copies, which the bus model
            # prices; CPU workers' wall time is their compute time
            assert task.view is not None and task.view.footprint is not None
            self.predictor.record(task.part, info.arch, task.view.footprint, started.compute or measured)
        if self.tracer is not None:
            self._trace(wid, task, start, end, error is not None)
        sizes: dict[str, int] | None = None
        if error is None:
            sizes = {n: a.nbytes for n, a in outputs.items()} if outputs else {}
            for n, t in started.device:
                if n not in sizes:
                    sizes[n] = t.nbytes
        with self._lock:
            if started.kept is not None and error is None:
                started.kept.join(req.handles, info.memory_node)
            done = self.core.finish(wid, task, end, measured, sizes, outputs, started.device)
            if self.core.prefetches:
                self._queue_prefetches()
            if self._idle:
                self._wake()
            nxt = self._take_each(take, end) if take else []
            if self._closed and not self.core.inflight:  # (after the take: it may withdraw the last)
                self._drained.notify_all()
        if self._to_issue:
            self._issue_prefetches()
        if done is not None:
            value: BaseException | dict[str, np.ndarray]
            if error is not None:
                value, ok = TaskError(task.part, info.name, error), False
                value.__cause__ = error
            elif done.error is not None:  # its next task could not be placed
                value, ok = _unplaced(done), False
            else:
                results, value, ok = done.results, {}, True
                for n in self._output_names[done.model]:  # (a model input given back: its handle's)
                    value[n] = results[n] if n in results else _host(done.handles[n])
            if defer is None:
                settle(done.owner, value, ok)
            elif settle_quietly(done.owner, value, ok):
                defer.append(done.owner)
        return nxt

    def _trace(self, wid: int, task: Task, start: float, end: float, failed: bool) -> None:
        assert self.tracer is not None and task.view is not None
        req = task.request
        self.tracer.task(wid, self.models.label(task.part), start, end, {
            "request": req.id, "batch": req.batch, "predicted_ms": _ms(task.view.predicted),
            "measured_ms": (end - start) * 1e3, "failed": failed})
        tasks, first = req.tasks, req.first_part  # (read once: a failed request's list is cut meanwhile)
        if not tasks:  # its request failed (or was withdrawn): no flows from the tasks it let go
            return
        for dep in self.core.preds[task.part]:
            src = tasks[dep - first]
            if src.worker is not None:
                self.tracer.flow(src.worker, src.ended_at, wid, start, f"r{req.id}")

    def _worker_died(self, wid: int, exc: BaseException) -> None:
        """Re-place the dead worker's queued tasks (and the one it was running) on the others."""
        name = self.core.workers[wid].info.name
        log.error("worker %s died: %s; its queued tasks go to the other workers", name, exc)
        with self._lock:
            pinned = list(self._pinned[wid])
            self._pinned[wid].clear()
            self._pinned_count -= len(pinned)
            lost = self.core.worker_lost(wid, repr(exc), self.clock.now())
            if self.core.prefetches:
                self._queue_prefetches()
            self._wake_all()  # re-placed tasks may be anyone's now
            self._drained.notify_all()
        if self._to_issue:
            self._issue_prefetches()
        for req in lost:
            settle(req.owner, _unplaced(req) if req.error is not None
                   else RuntimeError(f"every worker died (last: {exc})"), False)
        for item in pinned:  # tasks pinned to it cannot run elsewhere
            _settle_pinned(item, WorkerLost(f"{name} was lost: {exc}"))

    # -- shutdown -----------------------------------------------------------------------------
    def close(self, timeout: float | None = 30.0) -> None:
        """Drain in-flight requests up to ``timeout`` seconds, cancel the rest, stop the loops.

        Called on a worker's own thread (a request's done-callback runs there), nothing can
        drain while that worker waits here and its loop cannot be joined from itself (that
        deadlocked for good with ``timeout=None``): what is in flight is cancelled at once,
        as a Server closed from its batcher does, and the other loops are joined."""
        me = threading.get_native_id()
        own = [i for i, group in enumerate(self.drivers) if self._workers[group[0]].native_id == me]
        if own:
            timeout = 0.0
        with self._lock:
            if self._closed and self._stopping:
                return
            self._closed = True
            self._drained.wait_for(lambda: not self.core.inflight, timeout)  # (notified as requests end)
            cancelled = list(self.core.inflight.values())
            for req in cancelled:
                self.core.fail(req)
            self._stopping = True
            self._wake_all()
        for req in cancelled:
            if req.owner.cancel():  # and announced, or wait()/as_completed() never count it done
                req.owner.set_running_or_notify_cancel()
            elif not req.owner.done():
                req.owner.set_exception(CancelledError())
        for i, loop in enumerate(self._loops):
            if i in own:  # this thread's: it ends once the callback that called close() returns
                continue
            try:
                loop.result(timeout=None if timeout is None else max(timeout, 1.0) + 60)
            except Exception:  # noqa: BLE001 - reported by _worker_died already
                pass
        for queue in self._pinned:  # pinned after the loops ended: nothing will run them
            while queue:
                queue.popleft().future.cancel()
        try:  # a perf model or trace that cannot be written must not leave the workers running
            self.predictor.save()
            if self.tracer is not None:
                self.tracer.save()
        finally:
            if self.own_workers:
                _close_all(self._workers)

    @property
    def workers(self) -> list[Worker]:
        return list(self._workers)

    # -- observability ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Busy fraction per worker, tasks per (part, arch), queue wait, predicted vs measured."""
        with self._lock:
            out = self.core.stats(self.clock.now() - self.started_at)
        if self.core.prefetch:  # StarPU's prefetch hits: inputs on the node as a task started
            tasks, moved, hits = (sum(c[i] for c in self._starts) for i in range(3))
            out["prefetch"] = {"tasks": tasks, "moved": moved, "hits": hits,
                               "on_node": (tasks - moved + hits) / tasks if tasks else None}
        for w in self._workers:  # CUDA graphs and driver thread per worker: what `staronnx run` reports
            if isinstance(w, CudaWorker) and w.name in out["workers"]:
                row = out["workers"][w.name]
                if w.cuda_graphs:
                    row["graphs"] = w.graph_stats()
                # who launches its tasks: the GPU's shared driver thread, or a thread of its own
                row["driver"] = {"thread": w.driver_key or f"{w.name} (own)", "pu": w.cpu}
        return out

    def model_stats(self, model: int) -> dict[str, Any]:
        """One hosted model's share of the machine (see :meth:`TaskGraph.model_stats`)."""
        with self._lock:
            return self.core.model_stats(model, self.clock.now() - self.started_at)


@dataclass(eq=False, slots=True)
class _Started:
    """A task handed to its worker: when, whether timed, the worker's handle (launched ahead)
    or the outputs/error once it ran, and its kernel time (CUDA)."""

    start: float
    timed: bool
    handle: object = None
    outputs: dict[str, np.ndarray] | None = None  # set once it ran (None while launched)
    error: BaseException | None = None
    compute: float | None = None
    #: fetched inputs kept as the handles' copies on the worker's node
    kept: _Kept | None = None
    #: its outputs kept on its GPU (a CUDA worker's, for the parts that read them)
    device: Sequence[tuple[str, DeviceTensor]] = ()
    #: the task: scheduled (``task``) or pinned (``pinned``), the other None
    task: Task | None = None
    pinned: Pinned | None = None
    #: launched with an output route (some outputs may stay on the GPU)
    routed: bool = False


class _Kept:
    """A task's fetched inputs that become their handles' copies on its worker's node when it
    ends (the core then marks them valid there): host arrays on a CPU worker, tensors on a
    CUDA worker's GPU. Made only for a task that keeps one."""

    __slots__ = ("host", "device")

    def __init__(self) -> None:
        self.host: list[tuple[str, np.ndarray]] = []
        self.device: list[tuple[str, DeviceTensor]] = []

    def join(self, handles: Mapping[str, DataHandle], node: str) -> None:
        """(engine lock held) Each copy joins its handle."""
        for name, array in self.host:
            handles[name].add_host(array)
        for name, tensor in self.device:
            handles[name].add_device(node, tensor)


def _settle_pinned(item: Pinned, outcome: PinnedResult | BaseException) -> None:
    """Give a pinned task's future its result or error, once: one its caller cancelled (or
    close() did) is left as it is, where ``set_result`` raised InvalidStateError on the
    worker's thread and killed its loop. A pinned task lost with its worker gets the error:
    taken off the queue, nothing else would settle it (warm-up and calibration waited for
    good on a CUDA stream lost at its first task)."""
    try:
        if isinstance(outcome, BaseException):
            item.future.set_exception(outcome)
        else:
            item.future.set_result(outcome)
    except InvalidStateError:
        pass


def _unplaced(req: Request) -> BaseException:
    """The error of a request one of whose tasks the policy could not place."""
    error = RuntimeError(f"request {req.id} cannot run: {req.error}")
    error.__cause__ = req.error
    return error


def _let_go(error: BaseException) -> None:
    """Clear the locals of the finished frames ``error``'s traceback holds, its line numbers
    kept. Those frames (:meth:`NativeEngine._start`, the worker's run) held the task, so its
    request, whose future holds the error: a cycle that kept a failed request's feeds and
    intermediates until the cycle collector ran, and its feeds for as long as the caller kept
    the future. (A frame still running, the driver loop that caught it, is left as it is.)"""
    traceback.clear_frames(error.__traceback__)


def _host(h: DataHandle) -> np.ndarray:
    """A handle's host copy (a model input's, or a final output its producer wrote back)."""
    if h.host is None:
        raise RuntimeError(f"{h!r} has no copy in host memory")
    return h.host


def _on_device(h: DataHandle, node: str) -> DeviceTensor:
    """A handle's copy on GPU ``node``, where a fetch reads it."""
    tensor = h.on_device(node)
    if tensor is None:
        raise RuntimeError(f"{h!r} has no copy on {node} to fetch from")
    return tensor




def driver_groups(workers: Sequence[Worker]) -> list[list[int]]:
    """Worker indices by the thread that drives them: pipelined workers with the same
    ``driver_key`` (a CUDA device's streams, unless ``thread_per_stream``) share one thread;
    every other worker is its own group."""
    groups: list[list[int]] = []
    by_key: dict[str, list[int]] = {}
    for wid, w in enumerate(workers):
        key = w.driver_key if w.launches_ahead else None
        if key is None:
            groups.append([wid])
        elif key in by_key:
            by_key[key].append(wid)
        else:
            by_key[key] = [wid]
            groups.append(by_key[key])
    return groups


def start_native(plan: Plan | ModelSet, settings: EngineSettings) -> NativeEngine:
    """The ``native`` engine: start the workers (unless given), then the engine over them.
    ``plan`` may be several plans (a :class:`ModelSet`): one set of workers holds sessions
    of every model's parts."""
    models = ModelSet.of(plan)
    options = dict(settings.policy_options)
    if settings.policy == "static" and "devices" not in options:
        devices = models.devices()
        if len(devices) != models.k:
            raise StaronnxError(
                "policy 'static' needs a plan whose parts name their device (partition with "
                "--method comm-sd, duet, overseer or optimal)"
            )
        options["devices"] = devices
    policy = make_policy(settings.policy, **options)  # fail before starting workers
    mode = calibrate_mode(settings.calibrate)
    own = settings.workers is None
    workers = list(settings.workers) if settings.workers is not None else start_workers(
        models, settings.machine, cuda_options=settings.cuda_options)
    try:
        store = settings.store if settings.store is not None else PerfModelStore()
        predictor = PerfPredictor.for_models(models, store, calibrate=mode)
        tracer = Tracer(settings.trace, origin=0.0) if settings.trace is not None else None
        engine = NativeEngine(models, workers, policy, predictor, tracer, own_workers=own)
    except BaseException:
        if own:
            _close_all(workers)
        raise
    try:
        warm_up(engine, settings.warmup)
    except BaseException:
        engine.close()  # (closes the workers it owns)
        raise
    engine.started_at = engine.clock.now()  # its statistics start with serving, not warm-up
    if tracer is not None:
        tracer.origin = engine.started_at
    return engine


def warm_up(engine: NativeEngine, batch_sizes: Sequence[int]) -> None:
    """Run every part at every batch size on every CUDA worker, as tasks pinned to it
    (:meth:`NativeEngine.pin`), before anything is served, one worker at a time: cuDNN's
    searches and every CUDA graph capture happen now, not in the middle of serving, and on
    the thread that drives the worker (ORT keeps graphs per thread). Each shape runs in pairs
    launched together (the two buffer sets a pipelined stream uses), the discovery run, the
    capture and a replay; a round in which a capture failed runs again (a new graph id, or no
    graph after ``CAPTURE_TRIES``). Then capture is frozen (a batch size seen later runs
    without a graph, which is why the Server pads partial batches up to these sizes). Parts
    get the real tensors their predecessors produce (a reference run), as calibration does."""
    sizes = sorted({int(b) for b in batch_sizes})
    workers = engine.workers
    cuda = [(wid, w) for wid, w in enumerate(workers) if isinstance(w, CudaWorker)]
    if not sizes or not cuda:
        return
    if sizes[0] < 1:
        raise StaronnxError(f"warm-up batch sizes must be >= 1, got {sizes[0]}")
    from staronnx.verify import random_plan_feeds

    models = engine.models
    values = {(m.index, b): m.plan.reference_values(random_plan_feeds(m.plan, b, seed=b))
              for m in models.models for b in sizes}
    for wid, worker in cuda:
        repeats = 3 if worker.cuda_graphs else 2  # discovery, the capture, one replay
        for part in range(models.k):
            if worker.part_paths[part] is None:
                continue
            model, local = models.owner[part]
            for b in sizes:
                _warm_shape(engine, wid, worker, part, model.plan.part_feeds(local, values[(model.index, b)]), repeats)
        worker.capture_on_demand = False


def _warm_shape(engine: NativeEngine, wid: int, worker: CudaWorker, part: int, feeds: Mapping[str, np.ndarray],
                repeats: int) -> None:
    """``repeats`` rounds of two pinned tasks on ``worker`` (``wid``); a round in which a
    capture failed runs again, any other error is raised."""
    done = 0
    while done < repeats:
        failures = worker.graph_failures
        errors = [f.exception() for f in engine.pin(wid, part, feeds, 2)]
        error = next((e for e in errors if e is not None), None)
        if error is None:
            done += 1
        elif worker.graph_failures == failures or worker.lost is not None:
            raise error


register_engine("native", start_native)


def _close_all(workers: Iterable[Worker]) -> None:
    for w in workers:
        with contextlib.suppress(Exception):  # close the others anyway
            w.close()


def _ms(x: float) -> float | None:
    """A predicted time in ms for the trace; None where no model predicted it (NaN, or the 0 a
    policy charges while its models calibrate), as in the statistics."""
    return x * 1e3 if 0.0 < x < math.inf else None


