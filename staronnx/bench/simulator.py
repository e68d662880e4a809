"""A discrete-event simulator of serving a plan: what-ifs (more cores, more CUDA streams,
another split or policy) answered in seconds from the calibrated perf models.

It is only as good as its fidelity to the native engine, so it shares what the engine's
decisions depend on: the task-graph core (:class:`~staronnx.runtime.core.TaskGraph`) on a
:class:`~staronnx.bench.simclock.SimClock`, the workers ``Runtime`` would start and the
footprints calibration filled (the machine: :mod:`staronnx.bench.machine`), and the live
front end (the same arrivals, the Server's bounded queue, batcher and in-flight limit, which
keeps heft from letting new batches overtake old ones under overload). ``tests/test_replay.py``
holds the engine and the simulator to the same decisions on the same arrivals.

A task takes a time drawn from its perf model (a truncated normal; the batch-size regression
where no entry is calibrated) plus the bus model's transfer time for inputs not valid on its
worker's node (what the machine's arch sources and bus model say). Results fill
:class:`~staronnx.serving.records.RunRecords` as the live server does (:class:`SimResult`).
"""

from __future__ import annotations

import itertools
import math
import os
import random
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from staronnx.bench.machine import SimMachine, SimulationError, Where, held_by, machine_inflight, residency_where
from staronnx.bench.simclock import EventQueue, SimClock
from staronnx.bench.spec import SimSpec
from staronnx.perfmodels import Footprint, HostCosts
from staronnx.runtime.core import Request, Task, TaskGraph
from staronnx.runtime.datawizard import price
from staronnx.runtime.models import ModelSet, ServiceTarget, name_gaps
from staronnx.runtime.policies import make_policy, policy_options
from staronnx.runtime.sched import Policy, WorkerInfo
from staronnx.runtime.trace import Tracer
from staronnx.serving.arrivals import DISTRIBUTIONS, make_arrivals
from staronnx.serving.metrics import rate_of, summarize
from staronnx.serving.records import BatchRecord, RequestRecord, RunRecords
from staronnx.serving.server import next_batch_size, padded_size
from staronnx.serving.window import PlanProfile


# ---------------------------------------------------------------------------- the run
@dataclass
class _RunStats:
    """The simulated runtime's statistics, for one model or several."""

    placement: dict[tuple[int, str], int]  # (global part, arch) -> tasks run there
    busy: dict[str, float]  # worker name -> busy fraction of [start, end]
    workers: list[WorkerInfo]
    notes: list[str]
    events: int
    wall_seconds: float
    mean_queue_wait: float  # seconds from a task being ready to its start, averaged
    #: the simulated tasks' wall time (host work on their cores, a lane's preemption, the cold
    #: or warm scale included) over their perf models' means: the live ``task_time_ratio``'s twin
    task_time_ratio: float | None


@dataclass
class SimResult(_RunStats):
    """What a simulation of one model produced: its serving records and the runtime's statistics."""

    records: RunRecords

    def share(self, part: int) -> dict[str, float]:
        """Fraction of ``part``'s tasks run on each arch."""
        return _share(self.placement, part)

    def metrics(self, warmup: float = 0.0) -> dict[str, Any]:
        """Throughput, the papers' latency, percentiles, congestion: the live runs' own metrics."""
        return summarize(self.records, warmup=warmup)


@dataclass(eq=False)
class _FrontEnd:
    """One model's server in a simulation (the live Server's queue, batcher and in-flight
    window), with what it recorded. A shared runtime has one per model, each over its
    model's handle, all feeding one core."""

    model: int  # index in the machine's ModelSet
    batch_size: int
    arrivals: np.ndarray
    capacity: int | None
    max_inflight: int
    max_delay: float | None
    pad_to: tuple[int, ...] = ()
    requests: list[RequestRecord] = field(default_factory=list)
    batches: list[BatchRecord] = field(default_factory=list)
    queue: deque[int] = field(default_factory=deque)  # request ids waiting for a batch
    flush_left: int = 0
    timer_due: float = math.nan
    samples: list[tuple[float, int]] = field(default_factory=list)
    profiles: dict[int, PlanProfile] = field(default_factory=dict)  # batch size -> footprints, bytes
    last_done: float = -math.inf
    #: what serving costs the host around this server's batches (None: left out); its
    #: ``lag_s`` is already in ``arrivals`` (when the generator submitted each request)
    host: HostCosts | None = None
    launching: int = 0  # batches formed and not yet submitted to the runtime (host's launch time)


@dataclass(frozen=True)
class TraceInto:
    """Draw a simulation's schedule into an open :class:`~staronnx.runtime.trace.Tracer`, its
    simulated times plus ``shift`` (that tracer's clock): a sweep puts each simulated point
    where its live point ran, in a trace beside the live one."""

    tracer: Any
    shift: float = 0.0


@dataclass(eq=False, slots=True)
class _Running:
    """A task in progress on a simulated worker: its work, and what a lane's preemption did to
    it (a worker with no lane runs each task in one stretch)."""

    task: Task
    work: float  # seconds it needs on its worker
    left: float  # seconds of work not done yet (at the last pause)
    resumed: float  # when it last (re)started running; nan while a lane preempts it
    started: float
    token: int  # of its scheduled completion; a stale one (preempted since) is ignored
    modelled: float  # its perf model's mean (unscaled): what task_time_ratio divides by
    preempted: bool = False
    stolen: float = 0.0  # seconds of its core the host's threads took while it ran
    stretches: list[tuple[float, float]] = field(default_factory=list)  # (start, end) before each pause

    @property
    def paused(self) -> bool:
        return math.isnan(self.resumed)


class _Simulation:
    """One run on simulated time: each model's server (the live Server's queue, batcher and
    in-flight limit; it flushes after its last arrival as the load generator does), then the
    engine's core, one for all models as ``staronnx serve`` shares one runtime between them."""

    def __init__(
        self,
        machine: SimMachine,
        policy: Policy,
        fronts: Sequence[_FrontEnd],
        spec: SimSpec,
        models: ModelSet,
        *,
        where: Where = None,
        traced: bool = False,
    ) -> None:
        """``spec``: the run's seed, spread, drain, transfer charging and slowdown
        (:func:`simulate_mix`'s). ``where``: per global part, the workers holding it
        (:func:`residency_where`), handed to the core as the live engine hands it the workers'
        sessions. ``traced``: keep what :meth:`write_trace` draws (each task's running
        stretches and its dependencies)."""
        self.m = machine
        self.spec = spec
        self.where = where
        self.models = models
        self.fronts = list(fronts)
        for fe in self.fronts:  # the host's costs at the rate this server is offered
            if fe.host is not None and math.isfinite(rate := rate_of(fe.arrivals)):
                fe.host = fe.host.at_rate(rate)
        # every model's arrivals merged in time order (ties: model order), so one model is the
        # single-plan run it always was
        times = np.concatenate([fe.arrivals for fe in self.fronts])
        which = np.concatenate([np.full(len(fe.arrivals), i) for i, fe in enumerate(self.fronts)])
        index = np.concatenate([np.arange(len(fe.arrivals)) for fe in self.fronts])
        order = np.argsort(times, kind="stable")
        self.arrivals, self.which, self.index = times[order], which[order], index[order]
        self.clock = SimClock(float(self.arrivals[0]))
        self.events = EventQueue()
        self.rng = random.Random(f"staronnx-sim-{spec.seed}")
        for fe in self.fronts:
            fe.last_done = self.clock.t
        # the engine's own core: the same tasks, handles, policy calls and statistics
        self.core = TaskGraph(self.models, machine.workers, policy, machine.table, self.clock, self._footprint,
                              where=where, copy_cost=machine.table.bus.predict,
                              output_bytes=lambda req, part, fp: self.fronts[req.model].profiles[req.batch].nbytes)
        self.part_outputs = [list(m.plan.parts[local].outputs) for m, local in self.models.owner]
        self.notes: list[str] = []
        self.n_events = 0
        self._dirty = False
        self._first: int | None = None
        # the host's threads take their CPU from the CPU workers' cores (none left outside the
        # groups): round-robin over the busy ones
        self._host_cores = machine.host_shares_cores
        self._cpu_workers = [w.id for w in machine.workers if w.kind == "cpu" and w.id not in machine.lanes]
        self._steal_turn = 0
        #: worker id -> when its last task ended (how long it has been idle: a cold task's scale)
        self._last_end: dict[int, float] = {}
        #: the finished tasks' wall seconds and their perf models' means (task_time_ratio)
        self.task_wall = self.task_model = 0.0
        #: worker id -> until when its core runs the host's work instead of a task (it answers a
        #: finished batch on its own thread, the Server's inline split and settle in a CPU-only
        #: runtime, or the host's other threads took its idle core): it takes no task meanwhile
        self._hosting: dict[int, float] = {}
        # lanes: group worker id -> its lane's id; each worker's task in progress
        self._lane_of = {group: lane for lane, group in machine.lane_groups.items()}
        self._running: dict[int, _Running] = {}
        self._tokens = itertools.count()
        #: per finished task, when traced: (worker id, task, [(start, end) it ran], wall seconds,
        #: [(worker, end) of each task it waited for]) (read at its end: a finished request's
        #: tasks are dropped by the core)
        self.ran: list[tuple[int, Task, list[tuple[float, float]], float, list[tuple[int, float]]]] | None = (
            [] if traced else None)

    def _footprint(self, req: Request, part: int) -> Footprint:
        footprint: Footprint = self.fronts[req.model].profiles[req.batch].footprints[part - req.first_part]
        return footprint

    # -- main loop ---------------------------------------------------------------------------
    def run(self) -> None:
        arrivals, n, i = self.arrivals, len(self.arrivals), 0
        left = [len(fe.arrivals) for fe in self.fronts]
        deadline = math.inf if self.spec.drain else float(arrivals[-1])
        while True:
            ta = float(arrivals[i]) if i < n else math.inf
            te = self.events.peek_time()
            t = min(ta, te)
            if t == math.inf or t > deadline:
                break
            self.clock.advance(t)
            self.n_events += 1
            if te <= ta:  # completions before arrivals at the same instant
                _, kind, payload = self.events.pop()
                if kind == "done":
                    wid, token = payload
                    run = self._running.get(wid)
                    if run is not None and run.token == token:  # else preempted since
                        del self._running[wid]
                        if self.ran is not None:
                            self._keep(wid, run, t)
                        self._on_done(wid, run.task, t - run.started if run.preempted or run.stolen else run.work,
                                      run.modelled)
                elif kind == "launch":
                    self._launch(*payload)
                elif kind == "hosted":
                    if self._hosting.get(payload, math.inf) <= t:
                        del self._hosting[payload]
                        self._first, self._dirty = payload, True  # awake: it takes its next task at once
                else:
                    self._batcher(self.fronts[payload])
            else:
                fe = self.fronts[int(self.which[i])]
                self._on_arrival(fe, int(self.index[i]), t)
                i += 1
                left[fe.model] -= 1
                if not left[fe.model]:  # the load generator flushes after its last submission
                    fe.flush_left = len(fe.queue)
                    self._batcher(fe)
            if self._dirty:
                self._dispatch()

    def write_trace(self, target: str | os.PathLike[str] | TraceInto) -> Path | None:
        """The simulated schedule as a Perfetto trace, laid out as the live engine and Server
        lay out theirs (a task a lane preempted shows each stretch it ran). A path: a file of its
        own, time 0 the first arrival (returned). A :class:`TraceInto`: into that open tracer,
        on its clock (a sweep's simulated points, each where its live point ran; None)."""
        assert self.ran is not None, "write_trace needs a simulation run with traced=True"
        if isinstance(target, TraceInto):
            tracer, shift = target.tracer, target.shift
        else:
            tracer, shift = Tracer(target, origin=0.0), -float(self.arrivals[0])
            for info in self.m.workers:
                tracer.lane(info.id, info.name)
        for wid, task, stretches, wall, deps in self.ran:
            req = task.request
            view = task.view
            args = {"request": req.id, "batch": req.batch, "simulated": True, "measured_ms": wall * 1e3,
                    "predicted_ms": view.predicted * 1e3 if view is not None and math.isfinite(view.predicted) else None}
            if len(stretches) > 1:
                args["preempted_ms"] = (wall - sum(b - a for a, b in stretches)) * 1e3
            for k, (a, b) in enumerate(stretches):
                tracer.task(wid, self.models.label(task.part), a + shift, b + shift,
                            args if k == len(stretches) - 1 else {"request": req.id, "preempted": True})
            for src_worker, ended in deps:
                tracer.flow(src_worker, ended + shift, wid, stretches[0][0] + shift, f"r{req.id}")
        several = len(self.fronts) > 1
        for fe in self.fronts:
            prefix = f"{self.models.models[fe.model].name}: " if several else ""
            for record in fe.batches:
                if not record.request_ids:
                    continue
                oldest = fe.requests[record.request_ids[0]].arrival
                args = {"requests": record.size, **({"padded_to": record.padded_to} if record.padded_to else {})}
                span = f"{shift:.6f}.{fe.model}.{record.id}"  # unique across a sweep's points
                tracer.async_span(f"{prefix}fill {record.id} ({record.size})", "batch fill", span, oldest + shift,
                                  record.formed + shift, args)
                if record.done is not None:
                    tracer.async_span(f"{prefix}batch {record.id} ({record.size})", "batch", span,
                                      record.formed + shift, record.done + shift, args)
            for t, q in fe.samples:
                tracer.counter(f"{prefix}server queue (requests)", t + shift, q)
        return None if isinstance(target, TraceInto) else tracer.save()

    # -- the server: queue and batcher -------------------------------------------------------
    def _on_arrival(self, fe: _FrontEnd, i: int, t: float) -> None:
        """A request submitted at ``t``: recorded at its scheduled time, ``t`` less the
        generator's lag, as the live generator records it."""
        rec = RequestRecord(id=i, arrival=t - fe.host.lag_s if fe.host is not None else t)
        fe.requests.append(rec)
        if fe.host is not None:
            self._steal(fe.host.cpu_split()[0])
        if fe.capacity is not None and len(fe.queue) >= fe.capacity:
            rec.rejected = True
            return
        fe.queue.append(i)
        fe.samples.append((t, len(fe.queue)))
        self._batcher(fe)

    def _batcher(self, fe: _FrontEnd) -> None:
        """Form every batch that may leave now (the Server's own rule), then arm the timer."""
        t = self.clock.t
        counters = self.core.per_model[fe.model]
        while True:
            size, due = next_batch_size(
                queued=len(fe.queue), inflight=counters.in_flight + fe.launching, batch_size=fe.batch_size,
                max_inflight=fe.max_inflight, flush_left=fe.flush_left, closing=False,
                oldest_arrival=fe.requests[fe.queue[0]].arrival if fe.queue else t,
                max_delay=fe.max_delay, now=t)
            if not size:
                break
            if size < fe.batch_size and not self._runnable(fe, padded_size(size, fe.pad_to)):  # a flush or max_delay batch
                note = f"no model for a batch of {size}: its requests waited for a full batch"
                if not self.models.single:
                    note = f"{self.models.models[fe.model].name}: {note}"
                if note not in self.notes:
                    self.notes.append(note)
                fe.flush_left = 0
                return
            self._form_batch(fe, size)
        if due != math.inf and due != fe.timer_due:
            fe.timer_due = due
            self.events.push(due, "timeout", fe.model)

    def _runnable(self, fe: _FrontEnd, size: int) -> bool:
        try:
            self.m.check(size, fe.model, self.where)
        except SimulationError:
            return False
        return True

    def _form_batch(self, fe: _FrontEnd, size: int) -> None:
        t = self.clock.t
        ids = [fe.queue.popleft() for _ in range(size)]
        fe.flush_left = max(0, fe.flush_left - size)
        rows = padded_size(size, fe.pad_to)  # the Server's padding: priced at the size that runs
        profile = fe.profiles.get(rows)
        if profile is None:
            profile = fe.profiles[rows] = self.m.check(rows, fe.model, self.where)
        bid = len(fe.batches)
        record = BatchRecord(id=bid, size=size, formed=t, request_ids=ids,
                             padded_to=rows if rows != size else None)
        fe.batches.append(record)
        for j, rid in enumerate(ids):  # the queue is in arrival order: the first is the oldest
            fe.requests[rid].batch_id = bid
            fe.requests[rid].first_in_batch = j == 0
        fe.samples.append((t, len(fe.queue)))
        if fe.host is None:
            self._launch(fe, record, rows)
            return
        # the host concatenates and submits: the runtime sees the batch that much later
        fe.launching += 1
        self._steal(fe.host.cpu_split()[1] / 2)
        self.events.push(t + fe.host.submit_s, "launch", (fe, record, rows))

    def _launch(self, fe: _FrontEnd, record: BatchRecord, rows: int) -> None:
        """Submit a formed batch to the core (at once, or after the host's launch time)."""
        if fe.host is not None:
            fe.launching -= 1
        plan = self.models.models[fe.model].plan
        profile = fe.profiles[rows]
        # the Server passes the batch's oldest arrival, from which a latency target counts
        req = self.core.submit(rows, {n: profile.nbytes[n] for n in plan.input_names}, self.clock.t, owner=record,
                               model=fe.model, arrival=fe.requests[record.request_ids[0]].arrival)
        record.placement = req.placement
        self._dirty = True

    # -- the workers: times from the perf models ---------------------------------------------
    def _dispatch(self) -> None:
        """Idle workers pop, the worker that just finished first (it is awake already)."""
        self._dirty = False
        first, self._first = self._first, None
        workers = self.core.workers
        order = workers if first is None else [workers[first]] + [w for w in workers if w.info.id != first]
        now = self.clock.t
        for st in order:
            if st.info.id in self._hosting:
                continue
            if not st.running and (task := self.core.next_task(st.info.id, now)) is not None:
                self._start(st.info, task, awake=st.info.id == first)
        if self._lane_of:
            self._preempt()

    def _start(self, info: WorkerInfo, task: Task, awake: bool = False) -> None:
        """Run ``task`` on ``info``'s worker: its perf model's time (scaled as the host costs
        say tasks run while serving, warm or after the worker idled), its transfers, after the
        worker's wake-up (an idle worker) or the engine's gap between two tasks (``awake``: it
        just finished one)."""
        assert task.view is not None and task.view.footprint is not None
        mean, std = self.m.table.distribution(task.part, info.arch, task.view.footprint)
        host = self.fronts[task.request.model].host
        # each part at its own scale, slower on a worker idle for a while (cold core and caches)
        scale = self.spec.slowdown * (1.0 if host is None else host.scale_after(
            self.clock.t - self._last_end.get(info.id, -math.inf), self.models.owner[task.part][1]))
        seconds = self._draw(mean * scale, std * scale * self.spec.spread)
        if self.spec.charge_transfers:  # the copies the core decided when the worker took it, as the engine issues them
            seconds += price(task.copies, self.m.table.bus.predict)
        delay = 0.0 if host is None else (host.gap_s if awake else host.wake_s)
        begins = self.clock.t + delay
        token = next(self._tokens)
        self._running[info.id] = _Running(task, seconds, seconds, begins, begins, token, mean)
        self.events.push(begins + seconds, "done", (info.id, token))

    def _steal(self, seconds: float) -> None:
        """The host's threads take ``seconds`` of CPU now, where they share the workers' cores:
        an idle CPU worker's core if there is one (that worker then takes no task until it is
        done), else a running CPU worker's (round-robin), whose task ends that much later."""
        if seconds <= 0 or not self._host_cores:
            return
        cpu = self._cpu_workers
        now = self.clock.t
        idle = [w for w in cpu if w not in self._running]
        if idle:
            wid = min(idle, key=lambda w: self._hosting.get(w, now))  # the core free soonest
            self._host(wid, seconds)
            return
        for k in range(len(cpu)):
            wid = cpu[(self._steal_turn + k) % len(cpu)]
            run = self._running[wid]
            if not run.paused:  # a lane's preempted task is not on the core now
                break
        else:
            return
        self._steal_turn = (self._steal_turn + k + 1) % len(cpu)
        run.left += seconds
        run.stolen += seconds
        run.token = token = next(self._tokens)
        self.events.push(run.resumed + run.left, "done", (wid, token))  # (left: its work since it resumed)

    def _host(self, wid: int, seconds: float) -> None:
        """Worker ``wid``'s core runs ``seconds`` of the host's work (after what it already
        has): the worker takes no task until then."""
        until = max(self.clock.t, self._hosting.get(wid, self.clock.t)) + seconds
        self._hosting[wid] = until
        self.events.push(until, "hosted", wid)

    def _keep(self, wid: int, run: _Running, t: float) -> None:
        """What :meth:`write_trace` draws of a task ending now."""
        assert self.ran is not None
        req = run.task.request
        deps = [(src.worker, src.ended_at) for dep in self.core.preds[run.task.part]
                if (src := req.task(dep)).worker is not None]
        self.ran.append((wid, run.task, [*run.stretches, (run.resumed, t)], t - run.started, deps))

    def _preempt(self) -> None:
        """A group's worker stops while its lane runs a task and resumes when the lane is idle
        (what ``SCHED_IDLE`` does live): its task's work left is kept, its completion moved.
        The time it reports is its wall time, preemption included, as the live engine's."""
        now = self.clock.t
        for group, lane in self._lane_of.items():
            run = self._running.get(group)
            if run is None:
                continue
            lane_busy = lane in self._running
            if lane_busy and not run.paused:
                run.left -= max(now - run.resumed, 0.0)  # (not before it began: still waking up)
                if now > run.resumed:
                    run.stretches.append((run.resumed, now))  # what it ran before the lane came
                run.resumed = math.nan
                run.token = next(self._tokens)  # its scheduled completion is void now
                run.preempted = True
            elif run.paused and not lane_busy:
                run.resumed = now
                run.token = token = next(self._tokens)
                self.events.push(now + run.left, "done", (group, token))

    def _draw(self, mean: float, std: float) -> float:
        """A normal sample truncated to > 0 (redrawn; the mean after 20 misses)."""
        if std <= 0:
            return mean
        for _ in range(20):
            x = self.rng.gauss(mean, std)
            if x > 0:
                return x
        return mean

    def _on_done(self, wid: int, task: Task, seconds: float, modelled: float) -> None:
        """The core's completion (data locations, successors, stats), then the server's;
        ``seconds``: the task's wall time (its work, plus any time a lane preempted it),
        ``modelled``: its perf model's mean."""
        now = self.clock.t
        self._last_end[wid] = now
        self.task_wall += seconds
        self.task_model += modelled
        fe = self.fronts[task.request.model]
        nbytes = fe.profiles[task.request.batch].nbytes
        req = self.core.finish(wid, task, now, seconds, {n: nbytes[n] for n in self.part_outputs[task.part]})
        self._dirty = True
        self._first = wid
        if req is not None:
            # answered once the host has split the outputs and settled the futures
            answered = now + (fe.host.finish_s if fe.host is not None else 0.0)
            if fe.host is not None:
                self._steal(fe.host.cpu_split()[1] / 2)
                if fe.host.finish_on_worker and fe.host.finish_s > 0:  # on this worker's thread
                    self._host(wid, fe.host.finish_s)
            record: BatchRecord = req.owner
            record.done = answered
            for rid in record.request_ids:
                fe.requests[rid].done = answered
            fe.last_done = max(fe.last_done, answered)
            self._batcher(fe)


def simulate(machine: SimMachine, rate: float, batch_size: int, spec: SimSpec = SimSpec(), *,
             arrivals: Sequence[float] | None = None, max_inflight: int | None = None,
             trace: str | os.PathLike[str] | TraceInto | None = None) -> SimResult:
    """Serve ``rate`` single-sample requests/s in batches of ``batch_size``, in simulation:
    :func:`simulate_mix` of the one model of ``machine`` (from :func:`build_machine`, built
    once for a sweep's points), with ``spec``, read as that model's result; ``arrivals``
    (offsets in seconds, sorted) replays a schedule.
    """
    assert machine.models is not None
    if not machine.models.single:
        raise SimulationError("this machine hosts several models: simulate their traffic together with "
                              "simulate_mix (a rate per model)")
    name = machine.models.models[0].name
    mix = simulate_mix(machine, {name: rate}, {name: batch_size}, spec,
                       arrivals=None if arrivals is None else {name: arrivals},
                       max_inflight=None if max_inflight is None else {name: max_inflight}, trace=trace)
    return SimResult(records=mix.records[name], placement=mix.placement, busy=mix.busy, workers=mix.workers,
                     notes=mix.notes, events=mix.events, wall_seconds=mix.wall_seconds,
                     mean_queue_wait=mix.mean_queue_wait, task_time_ratio=mix.task_time_ratio)


def _end_of(sim: _Simulation, front: _FrontEnd) -> float:
    """When a front end's run ends: its last answer, or (requests still outstanding, an
    undrained run) where the simulation stopped; never before its last arrival."""
    last_arrival = float(front.arrivals[-1])
    outstanding = any(r.done is None and not r.rejected for r in front.requests)
    return max(front.last_done, last_arrival) if not outstanding else max(sim.clock.t, last_arrival)


def mean_rate(times: Sequence[float] | npt.NDArray[np.float64]) -> float:
    """Arrivals per second over sorted arrival ``times`` (0 with fewer than two)."""
    span = float(times[-1] - times[0]) if len(times) > 1 else 0.0
    return (len(times) - 1) / span if span > 0 else 0.0


def _make_policy(spec: SimSpec) -> Policy:
    """A fresh policy object; the random policy gets the run's seed unless told otherwise."""
    if isinstance(spec.policy, Policy):
        if spec.policy_options:
            raise SimulationError("policy_options only apply to a policy given by name")
        return spec.policy
    opts = dict(spec.policy_options or {})
    if "seed" in policy_options(spec.policy) and "seed" not in opts:
        opts["seed"] = spec.seed
    return make_policy(spec.policy, **opts)


# ---------------------------------------------------------------------------- mixed traffic
def deadline_misses(records: RunRecords, latency: float | None) -> tuple[int | None, float | None]:
    """Requests answered later than ``latency`` seconds after their arrival, and their share
    of the answered ones (None without a target, or the share with none answered). Counted
    per request, as a client sees it (the core counts batches against the oldest request's
    deadline); a live run's records are counted alike."""
    if latency is None:
        return None, None
    answered = [r.done - r.arrival for r in records.requests if r.done is not None]
    misses = sum(1 for waited in answered if waited > latency)
    return misses, misses / len(answered) if answered else None


def model_metrics(records: RunRecords, target: ServiceTarget | None, warmup: float = 0.0) -> dict[str, Any]:
    """One model's figures in mixed traffic: :func:`~staronnx.serving.metrics.summarize`'s,
    plus its latency target (s) and the requests that missed it, over the whole run."""
    out = summarize(records, warmup=warmup)
    out["latency_target"] = target.latency if target is not None else None
    out["deadline_misses"], out["deadline_miss_rate"] = deadline_misses(records, out["latency_target"])
    return out


@dataclass
class MixResult(_RunStats):
    """What a simulation of several models' traffic produced: each model's serving records
    (its own server's), its target, and the shared machine's statistics."""

    records: dict[str, RunRecords]
    targets: dict[str, ServiceTarget]
    busy_by_model: dict[str, dict[str, float]]  # model -> worker name -> busy fraction spent on it
    models: ModelSet
    #: model -> the workers holding it (every worker unless a residency said otherwise)
    held_by: dict[str, list[str]] = field(default_factory=dict)

    def metrics(self, model: str, warmup: float = 0.0) -> dict[str, Any]:
        """Throughput, latencies, congestion and deadline misses of ``model`` (see
        :func:`model_metrics`)."""
        return model_metrics(self.records[model], self.targets.get(model), warmup)

    def share(self, model: str, part: int) -> dict[str, float]:
        """Fraction of ``model``'s part ``part`` (its own numbering) run on each arch."""
        return _share(self.placement, self.models.model(model).first_part + part)


def _share(placement: Mapping[tuple[int, str], int], part: int) -> dict[str, float]:
    """Fraction of global part ``part``'s tasks run on each arch."""
    counts = {a: n for (p, a), n in placement.items() if p == part}
    total = sum(counts.values())
    return {a: n / total for a, n in sorted(counts.items())} if total else {}


def _times(who: str, name: str, index: int, rate: float, spec: SimSpec,
           arrivals: Mapping[str, Sequence[float]] | None) -> tuple[np.ndarray, str]:
    """One model's scheduled arrivals (offsets in s) and their process's description: replayed
    from ``arrivals``, or drawn by the live load generator's own processes
    (:mod:`staronnx.serving.arrivals`) with seed ``spec.seed + index``, so a simulated sweep
    point replays exactly the arrivals of the live one (``spec.n_requests`` wins over
    ``spec.duration``); ``who`` names the model in errors where there are several."""
    if arrivals is not None and name in arrivals:
        times = np.asarray(arrivals[name], dtype=np.float64)
        if times.size == 0 or not np.all(np.isfinite(times)) or np.any(np.diff(times) < 0):
            raise SimulationError(f"{who}arrivals must be a non-empty, sorted list of finite times")
        return times, f"replay({times.size} arrivals)"
    n_requests, duration = spec.n_requests, spec.duration
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise SimulationError(f"rate must be > 0 requests/s, got {rate!r}")
    if n_requests is None and (duration is None or not duration > 0):
        raise SimulationError("give a duration > 0 or a number of requests")
    if n_requests is not None and n_requests < 1:
        raise SimulationError(f"n_requests must be >= 1, got {n_requests}",
                              cli=f"--requests must be at least 1, got {n_requests}")
    if spec.distribution not in DISTRIBUTIONS:
        raise SimulationError(f"unknown distribution {spec.distribution!r}; choose {' or '.join(DISTRIBUTIONS)}")
    process = make_arrivals(spec.distribution, rate, spec.seed + index)
    times = np.asarray(process.schedule(**({"n": n_requests} if n_requests is not None else {"duration": duration})),
                       dtype=np.float64)
    if times.size == 0:
        raise SimulationError(f"{who}no arrival falls in the duration; lengthen it or raise "
                              f"{'its' if who else 'the'} rate")
    return times, repr(process)


def simulate_mix(machine: SimMachine, rates: Mapping[str, float], batch_sizes: Mapping[str, int] | int,
                 spec: SimSpec = SimSpec(), *, arrivals: Mapping[str, Sequence[float]] | None = None,
                 max_inflight: Mapping[str, int] | None = None,
                 trace: str | os.PathLike[str] | TraceInto | None = None) -> MixResult:
    """Serve every model of ``machine`` (:func:`build_machine` over one plan or several) at
    its own rate, as ``staronnx serve`` does on one shared runtime, with the settings of
    ``spec`` (:class:`~staronnx.bench.spec.SimSpec`, whose fields are named here): a server per model (the
    live Server's queue of ``queue_capacity``, None unbounded; batches of its ``batch_sizes``
    entry that leave when full or, with ``max_delay``, when the oldest request has waited that
    long; its in-flight window, by default :func:`machine_inflight`'s, as live sweeps use)
    feeding one core, one policy and one set of workers, the models' ``targets`` (latency,
    priority) turned into deadlines and levels that order the ready tasks, as the engine does.

    Model ``i`` (in the machine's order) draws its arrivals from the live generator's
    processes with seed ``seed + i`` for ``duration`` seconds or ``n_requests`` requests, so a
    live sweep replays the same ones; ``arrivals`` (name -> sorted offsets in seconds) replaces
    them. With ``drain`` the run goes on after the last arrival until every accepted request is
    done, as the load generator waits for its futures. ``spread`` scales the models' standard
    deviations (0: every task takes its mean). ``pad_to``: the live server's padding of partial
    batches (:func:`~staronnx.serving.server.padded_size`), priced at the padded size.
    ``trace``: the simulated schedule as a Perfetto trace there, or into an open tracer
    (:class:`TraceInto`; :meth:`_Simulation.write_trace`).

    ``residency`` (model name -> worker selector, :mod:`staronnx.workers.residency`) loads
    those models on the selected workers only, as ``Runtime(residency=...)`` does: their tasks
    placed, their windows counted and their perf models needed there alone. A ``machine``
    built with lanes keeps the lane models on their lanes (plus the workers ``residency``
    adds), each lane's task preempting its group's worker as the OS does live
    (:data:`~staronnx.bench.machine.LANE_APPROXIMATION` says what is left out).

    ``host_costs``: what serving costs the host beyond the tasks, as calibration measured it
    (``machine.host``, :mod:`staronnx.perfmodels.host`): the generator's lag (latency counted
    from the scheduled time, as live), the launch time of a formed batch, a worker's wake-up
    and the engine's gap between tasks, the answer's finish time (on the last worker's thread
    in a runtime of CPU workers only), tasks at the measured serving/calibration ratio, and,
    where no PU is left outside the CPU groups, the host's other threads' CPU taken from the
    CPU workers. They are calibration's of one plan alone, so a machine of several models
    leaves them out.

    ``slowdown``: every task takes that many times its (scaled) draw, as on a machine running
    that much slower than when it was calibrated; a sweep's band (:data:`~staronnx.bench.fidelity.BAND`)
    simulates each point at ``1 +/- band`` to say how far the machine's own drift moves it.
    """
    t0 = time.perf_counter()
    queue_capacity, max_delay, seed = spec.queue_capacity, spec.max_delay, spec.seed
    models = machine.models
    assert models is not None
    names = [m.name for m in models.models]
    who = {n: "" if models.single else f"{n}: " for n in names}
    unknown, missing = name_gaps(rates, names)
    if unknown:
        raise SimulationError(f"rates for unknown model(s) {', '.join(map(repr, unknown))}; the models are "
                              f"{', '.join(map(repr, names))}")
    if missing:
        raise SimulationError(f"no rate for model(s) {', '.join(map(repr, missing))}: give each model a rate")
    sizes = {n: batch_sizes for n in names} if isinstance(batch_sizes, int) else dict(batch_sizes)
    if set(sizes) != set(names):
        raise SimulationError(f"give a batch size for each model ({', '.join(names)}), got {sorted(sizes)}")
    for n, b in sizes.items():
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise SimulationError(f"{who[n]}batch_size must be an int >= 1, got {b!r}")
        if queue_capacity is not None and queue_capacity < (1 if max_delay is not None else b):
            batch_flag = "--batch" if models.single else "each model's --batch"
            raise SimulationError(f"queue_capacity must be >= 1 and >= {'batch_size' if models.single else 'every batch size'}"
                                  f" without max_delay, got {queue_capacity}",
                                  cli=f"--queue-capacity must be at least 1, and at least {batch_flag} without "
                                      f"--max-delay, got {queue_capacity}")
    if max_delay is not None and not max_delay >= 0:
        raise SimulationError(f"max_delay must be >= 0 seconds, got {max_delay!r}")
    if not (math.isfinite(spec.spread) and spec.spread >= 0):
        raise SimulationError(f"spread must be >= 0, got {spec.spread!r}", cli=f"--spread must be >= 0, got {spec.spread:g}")
    if not (math.isfinite(spec.slowdown) and spec.slowdown > 0):
        raise SimulationError(f"slowdown must be > 0, got {spec.slowdown!r}")
    # the core's view: the same plans in the same order (same global parts), with the targets
    shared = ModelSet({m.name: m.plan for m in models.models}, spec.targets)
    where = residency_where(machine, spec.residency)
    padding = tuple(sorted(set(spec.pad_to)))
    fronts: list[_FrontEnd] = []
    scheduled: list[np.ndarray] = []  # each model's arrivals as scheduled (before the host's lag)
    processes: dict[str, str] = {}
    for m in models.models:
        b = sizes[m.name]
        machine.check(b, m.index, where)
        window = (machine_inflight(machine, b, m.index, where) if max_inflight is None or m.name not in max_inflight
                  else int(max_inflight[m.name]))
        if window < 1:
            raise SimulationError(f"{who[m.name]}max_inflight must be >= 1, got {window}")
        times, processes[m.name] = _times(who[m.name], m.name, m.index, rates[m.name], spec, arrivals)
        host = machine.host_costs(b) if spec.host_costs else None
        scheduled.append(times)
        fronts.append(_FrontEnd(m.index, b, times + host.lag_s if host is not None else times, queue_capacity,
                                window, max_delay, padding, host=host))
    policy_obj = _make_policy(spec)
    sim = _Simulation(machine, policy_obj, fronts, spec, shared, where=where, traced=trace is not None)
    sim.run()
    if trace is not None:
        sim.write_trace(trace)
    start = min(float(times[0]) for times in scheduled)
    ends = {m.name: _end_of(sim, fe) for m, fe in zip(models.models, fronts)}
    elapsed = max(max(ends.values()) - start, 1e-12)
    records: dict[str, RunRecords] = {}
    holders = {m.name: held_by(machine, where, m.index) for m in models.models}
    for m, fe, times in zip(shared.models, fronts, scheduled):
        replayed = arrivals is not None and m.name in arrivals
        settings = {
            "engine": "simulator", "policy": policy_obj.name, "model": m.name, "batch_size": fe.batch_size,
            "arrivals": processes[m.name], "distribution": "replay" if replayed else spec.distribution,
            "seed": seed + m.index, "max_delay": max_delay, "queue_capacity": queue_capacity,
            "max_inflight": fe.max_inflight, "pad_to": list(padding), "spread": spec.spread, "slowdown": spec.slowdown,
            "host": None if fe.host is None else fe.host.as_dict(), "plan_hash": m.plan.hash,
            "target": {"latency": m.target.latency, "priority": m.target.priority},
            "workers": [w.name for w in machine.workers], "residency": dict(spec.residency or {}),
            "held_by": holders[m.name], **machine.settings,
        }
        records[m.name] = RunRecords(
            requests=fe.requests, batches=fe.batches,
            offered_rate=mean_rate(times) if replayed else float(rates[m.name]), batch_size=fe.batch_size,
            start=float(times[0]), end=ends[m.name], queue_samples=fe.samples, settings=settings)
    return MixResult(
        records=records,
        targets={m.name: m.target for m in shared.models},
        placement={key: len(times) for key, times in sorted(sim.core.measured.items())},
        busy={st.info.name: st.busy_seconds / elapsed for st in sim.core.workers},
        busy_by_model={m.name: {st.info.name: st.busy_by_model[m.index] / elapsed for st in sim.core.workers}
                       for m in shared.models},
        workers=list(machine.workers),
        notes=list(machine.notes) + sim.notes,
        events=sim.n_events,
        wall_seconds=time.perf_counter() - t0,
        models=shared,
        held_by=holders,
        mean_queue_wait=sim.core.queue_waits.mean(),
        task_time_ratio=sim.task_wall / sim.task_model if sim.task_model > 0 else None,
    )
