"""A discrete-event simulator of serving a plan: what-ifs (more cores, more CUDA streams,
another split or policy) answered in seconds from the calibrated perf models.

It is only as good as its fidelity to the native engine, so it shares what the engine's
decisions depend on: the task-graph core (:class:`~staronnx.runtime.core.TaskGraph`) on a
:class:`~staronnx.bench.simclock.SimClock`, the workers ``Runtime`` would start
(:func:`sim_workers`), the footprints calibration filled (:func:`profile_plan`), and the live
front end (the same arrivals, the Server's bounded queue, batcher and in-flight limit, which
keeps heft from letting new batches overtake old ones under overload). ``tests/test_replay.py``
holds the engine and the simulator to the same decisions on the same arrivals.

A task takes a time drawn from its perf model (a truncated normal; the batch-size regression
where no entry is calibrated) plus the bus model's transfer time for inputs not valid on its
worker's node. Archs with no models borrow another's, scaled (:class:`ArchSource`). Results fill
:class:`~staronnx.serving.records.RunRecords` as the live server does (:class:`SimResult`).
"""

from __future__ import annotations

import math
import random
import re
import statistics
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from staronnx.bench.simclock import EventQueue, SimClock
from staronnx.errors import StaronnxError
from staronnx.perfmodels import BusModel, Footprint, PerfModelStore
from staronnx.plan import Plan
from staronnx.runtime.predictor import PerfPredictor
from staronnx.runtime.core import Task, TaskGraph
from staronnx.runtime.sched import Policy, TaskView, WorkerInfo
from staronnx.serving.arrivals import DISTRIBUTIONS, make_arrivals
from staronnx.serving.metrics import summarize
from staronnx.serving.records import BatchRecord, RequestRecord, RunRecords
from staronnx.serving.server import next_batch_size, padded_size
from staronnx.workers.topology import Topology

class SimulationError(StaronnxError, ValueError):
    """A simulation that cannot run as asked: bad settings, or no model for a part on an arch."""


# ---------------------------------------------------------------------------- models
@dataclass(frozen=True)
class ArchSource:
    """Where a simulated arch takes its times from: another arch's models, times a factor
    (one for every part, or one per part).

    ``cpu_fallback`` lends a group size the store never saw the nearest calibrated ``cpu<m>``
    times m/n (ideal, optimistic scaling, said in :attr:`SimMachine.notes`); ``cuda_scale``
    runs CUDA streams at a factor of the widest CPU group's time and wins over stored ``cuda``
    models, so a what-if is never silently replaced; explicit ``arch_sources`` win over both.
    Streams on one GPU are independent workers, as contended as their calibration was.
    """

    arch: str
    scale: float | tuple[float, ...] = 1.0

    def factor(self, part: int) -> float:
        if isinstance(self.scale, tuple):
            return self.scale[part]
        return self.scale

    def times(self, other: float | Sequence[float], k: int) -> ArchSource:
        """This source with its times further multiplied by ``other`` (one factor, or per part)."""
        if isinstance(other, (int, float)) and not isinstance(self.scale, tuple):
            return ArchSource(self.arch, self.scale * float(other))
        mine = [self.factor(p) for p in range(k)]
        theirs = [float(other)] * k if isinstance(other, (int, float)) else [float(x) for x in other]
        return ArchSource(self.arch, tuple(a * b for a, b in zip(mine, theirs, strict=True)))

    def describe(self) -> str:
        if isinstance(self.scale, tuple):
            return f"{self.arch} x ({', '.join(f'{s:g}' for s in self.scale)})"
        return self.arch if self.scale == 1.0 else f"{self.arch} x {self.scale:g}"


@dataclass(frozen=True)
class PlanProfile:
    """What the engine sees of one batch size: each part's footprint and every tensor's bytes."""

    batch: int
    footprints: tuple[Footprint, ...]
    nbytes: Mapping[str, int]


_PROFILES: dict[tuple[str, str, int], PlanProfile] = {}
_PROFILES_LOCK = threading.Lock()


def profile_plan(plan: Plan, batch: int) -> PlanProfile:
    """Footprints and tensor sizes at ``batch``, computed exactly like the engine and calibration.

    One reference run of the plan (ONNX Runtime, CPU) per batch size, cached per process, so a
    sweep pays it once per size. Shapes, hence footprints, rarely depend on values; feeds are
    drawn with calibration's seed anyway so data-dependent shapes agree too.
    """
    from staronnx.verify import random_plan_feeds

    key = (str(plan.root), plan.hash, int(batch))
    with _PROFILES_LOCK:
        cached = _PROFILES.get(key)
    if cached is not None:
        return cached
    values = plan.reference_values(random_plan_feeds(plan, batch, seed=0))
    profile = PlanProfile(
        batch=int(batch),
        footprints=tuple(Footprint.of_feeds(plan.part_feeds(p.index, values), batch) for p in plan.parts),
        nbytes={name: int(v.nbytes) for name, v in values.items()},
    )
    with _PROFILES_LOCK:
        _PROFILES[key] = profile
    return profile


class PerfTable:
    """Execution times per (part, arch, footprint) from the store, through arch sources.

    It is also the :class:`~staronnx.runtime.sched.Predictor` the policies get: predictions
    are the perf models' (entry mean, else regression, else NaN), scaled like the samples,
    and cached because nothing records into the models during a simulation.
    """

    def __init__(self, predictor: PerfPredictor, sources: Mapping[str, ArchSource] | None = None):
        self.base = predictor
        self.sources = dict(sources or {})
        self._pred: dict[tuple[int, str, Footprint], float] = {}
        self._dist: dict[tuple[int, str, Footprint], tuple[float, float]] = {}

    @property
    def bus(self) -> BusModel:
        return self.base.bus

    def source(self, arch: str) -> ArchSource:
        return self.sources.get(arch) or ArchSource(arch)

    def predict(self, part: int, arch: str, fp: Footprint) -> float:
        """Predicted seconds, NaN when no model can say (what a policy would see)."""
        key = (part, arch, fp)
        value = self._pred.get(key)
        if value is None:
            src = self.source(arch)
            value = self.base.model(part, src.arch).predict(fp) * src.factor(part)
            self._pred[key] = value
        return value

    def distribution(self, part: int, arch: str, fp: Footprint) -> tuple[float, float]:
        """(mean, stddev) in seconds of part ``part`` on ``arch``; SimulationError when unknown."""
        key = (part, arch, fp)
        dist = self._dist.get(key)
        if dist is not None:
            return dist
        src = self.source(arch)
        model = self.base.model(part, src.arch)
        entry = model.entry(fp)
        if entry is not None and entry.n >= model.calibrate_minimum:
            mean, std = entry.mean, entry.stddev
        else:
            mean = model.predict(fp)  # the batch-size regression of the shape family
            if not (math.isfinite(mean) and mean > 0):
                via = "" if src.arch == arch else f" (taken from {src.describe()})"
                raise SimulationError(
                    f"no perf model for part {part} on {arch}{via} at batch {fp.batch}: "
                    f"calibrate it (staronnx calibrate PLANDIR --batch-sizes ...{' --cuda-streams N' if src.arch.startswith('cuda') else ''}) "
                    "or give a what-if source (cuda_scale / arch_sources)"
                )
            rel = [
                e.stddev / e.mean
                for f, e in model.entries().items()
                if f.shape_hash == fp.shape_hash and e.n >= model.calibrate_minimum and e.mean > 0
            ]
            std = mean * statistics.median(rel) if rel else 0.0
        factor = src.factor(part)
        dist = (mean * factor, std * factor)
        self._dist[key] = dist
        return dist

    # -- Predictor protocol (what policies call) ---------------------------------------------
    def exec_time(self, task: TaskView, worker: WorkerInfo) -> float:
        fp = task.footprint
        if fp is None:
            return 0.0
        return self.predict(task.part, worker.arch, fp)

    def transfer_time(self, task: TaskView, worker: WorkerInfo) -> float:
        return self.base.transfer_time(task, worker)


def resolve_sources(
    stored: set[str],
    archs: Sequence[str],
    k: int,
    *,
    cuda_scale: float | Sequence[float] | None = None,
    cpu_fallback: bool = True,
    explicit: Mapping[str, ArchSource] | None = None,
) -> tuple[dict[str, ArchSource], list[str]]:
    """Decide where each simulated arch takes its times (:class:`ArchSource` says how), with notes."""
    explicit = dict(explicit or {})
    if cuda_scale is not None and not isinstance(cuda_scale, (int, float)):
        cuda_scale = tuple(float(x) for x in cuda_scale)
        if len(cuda_scale) != k:
            raise SimulationError(f"cuda_scale has {len(cuda_scale)} factors for {k} parts")
    for s in [cuda_scale] if isinstance(cuda_scale, (int, float)) else (cuda_scale or ()):
        if not (math.isfinite(s) and s > 0):
            raise SimulationError(f"cuda_scale factors must be finite and > 0, got {s!r}")
    sources: dict[str, ArchSource] = {}
    notes: list[str] = []
    cpu_stored = sorted(int(a[3:]) for a in stored if re.fullmatch(r"cpu[0-9]+", a))
    cpu_archs = [a for a in dict.fromkeys(archs) if a.startswith("cpu")]
    for arch in cpu_archs:
        if arch in explicit:
            sources[arch] = explicit[arch]
        elif arch not in stored and cpu_fallback and cpu_stored:
            n = int(arch[3:])
            m = min(cpu_stored, key=lambda m: (abs(math.log(m / n)), -m))
            sources[arch] = ArchSource(f"cpu{m}", m / n)
            notes.append(f"{arch}: no models; using cpu{m} x {m}/{n} (ideal scaling in cores)")
    for arch in [a for a in dict.fromkeys(archs) if not a.startswith("cpu")]:
        if arch in explicit:
            sources[arch] = explicit[arch]
        elif arch.startswith("cuda") and cuda_scale is not None:
            if not cpu_archs:
                raise SimulationError("cuda_scale needs at least one CPU worker to scale from")
            widest = max(cpu_archs, key=lambda a: int(a[3:]))
            base = sources.get(widest) or ArchSource(widest)
            sources[arch] = base.times(cuda_scale, k)
            notes.append(f"{arch}: what-if, {sources[arch].describe()}"
                         + (" (stored cuda models ignored)" if arch in stored else ""))
    return sources, notes


# ---------------------------------------------------------------------------- the machine
def sim_workers(
    topology: Topology | None = None, groups: str = "numa", cuda_streams: int = 0, cuda_device: int = 0
) -> list[WorkerInfo]:
    """The workers ``Runtime`` would start on ``topology``, as policies see them.

    Same layout as :func:`~staronnx.workers.launch.start_workers` (CUDA streams first, like
    StarPU's worker ids, which decides dmda's ties; a core held back per device driver thread
    unless the policy says otherwise), same names, archs and memory nodes as ``Runtime``'s ``_worker_info``.
    """
    from staronnx.workers.launch import worker_layout

    if cuda_streams < 0:
        raise SimulationError(f"cuda_streams must be >= 0, got {cuda_streams}")
    topology = topology if topology is not None else Topology.from_system()
    layout = worker_layout(topology, groups, cuda_streams, (cuda_device,))
    infos: list[WorkerInfo] = []
    for s in range(cuda_streams):
        dev = f"cuda{cuda_device}"
        infos.append(WorkerInfo(len(infos), f"{dev}.s{s}", dev, "cuda", dev, 1))
    for g in layout.groups:
        numa = g.numa if g.numa is not None else 0
        infos.append(WorkerInfo(len(infos), f"cpu:{g.name}", f"cpu{g.n_cores}", "cpu", f"numa{numa}", g.n_cores))
    return infos


@dataclass
class SimMachine:
    """A plan on a (real or hypothetical) machine: workers and their time distributions.

    Built once by :func:`build_machine` and reusable across many simulations and LP bounds
    (a sweep), since loading models and profiling batch sizes is the slow part.
    """

    plan: Plan
    workers: list[WorkerInfo]
    table: PerfTable
    notes: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def archs(self) -> list[str]:
        return list(dict.fromkeys(w.arch for w in self.workers))

    def profile(self, batch: int) -> PlanProfile:
        return profile_plan(self.plan, batch)

    def check(self, batch: int) -> PlanProfile:
        """Profile ``batch`` and make sure every part has times on every arch (else raise)."""
        prof = self.profile(batch)
        for p in range(self.plan.k):
            for arch in self.archs:
                self.table.distribution(p, arch, prof.footprints[p])
        return prof

    def mean_times(self, batch: int) -> list[list[float]]:
        """``times[p][w]``: mean seconds of part ``p`` on worker ``w`` at ``batch`` (for the LP)."""
        prof = self.check(batch)
        return [
            [self.table.distribution(p, w.arch, prof.footprints[p])[0] for w in self.workers]
            for p in range(self.plan.k)
        ]


def machine_inflight(machine: SimMachine, batch: int) -> int:
    """The server's in-flight window for this machine at ``batch``
    (:func:`~staronnx.serving.server.inflight_window` over each worker's whole-plan time)."""
    from staronnx.serving.server import inflight_window

    try:
        times = machine.mean_times(batch)
    except Exception:  # noqa: BLE001 - a missing model: the unknown-machine default
        return inflight_window([None] * len(machine.workers))
    return inflight_window([sum(times[p][w] for p in range(len(times))) for w in range(len(machine.workers))])


def build_machine(
    plan: Plan,
    *,
    groups: str = "numa",
    topology: Topology | None = None,
    cuda_streams: int = 0,
    cuda_device: int = 0,
    store: PerfModelStore | None = None,
    cuda_scale: float | Sequence[float] | None = None,
    cpu_fallback: bool = True,
    arch_sources: Mapping[str, ArchSource] | None = None,
    bus: BusModel | None = None,
) -> SimMachine:
    """Workers from ``topology`` (default: this machine) and ``groups``, plus ``cuda_streams``
    hypothetical or real CUDA workers, with times from ``store`` (default: ``$STARONNX_HOME``).
    """
    store = store if store is not None else PerfModelStore()
    workers = sim_workers(topology, groups, cuda_streams, cuda_device)
    stored = {key.arch for key in store.list(plan.hash)}
    sources, notes = resolve_sources(
        stored, [w.arch for w in workers], plan.k,
        cuda_scale=cuda_scale, cpu_fallback=cpu_fallback, explicit=arch_sources,
    )
    if not stored and not arch_sources:
        raise SimulationError(
            f"no perf models for plan {plan.hash} in {store.root} (host {store.host}); "
            f"run `staronnx calibrate {plan.root}` first"
        )
    table = PerfTable(PerfPredictor(plan.hash, store, bus), sources)
    settings = {
        "groups": groups,
        "topology": (topology.source if topology is not None else "system") or "system",
        "cuda_streams": cuda_streams,
        "cuda_scale": cuda_scale if not isinstance(cuda_scale, tuple) else list(cuda_scale),
        "sources": {a: s.describe() for a, s in sources.items()},
    }
    return SimMachine(plan, workers, table, notes, settings)


# ---------------------------------------------------------------------------- arrivals
def arrival_schedule(
    rate: float,
    *,
    duration: float | None = 10.0,
    n_requests: int | None = None,
    distribution: str = "constant",
    seed: int = 0,
) -> tuple[np.ndarray, str]:
    """Arrival offsets (s, the first at 0) and a description of the process.

    The live load generator's own processes (:mod:`staronnx.serving.arrivals`) draw the
    schedule, so a simulated sweep point replays exactly the arrivals of the live one (same
    distribution, rate and seed). ``n_requests`` wins over ``duration``.
    """
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise SimulationError(f"rate must be > 0 requests/s, got {rate!r}")
    if n_requests is None and (duration is None or not duration > 0):
        raise SimulationError("give a duration > 0 or a number of requests")
    if n_requests is not None and n_requests < 1:
        raise SimulationError(f"n_requests must be >= 1, got {n_requests}")
    if distribution not in DISTRIBUTIONS:
        raise SimulationError(f"unknown distribution {distribution!r}; choose {' or '.join(DISTRIBUTIONS)}")
    bounds = {"n": n_requests} if n_requests is not None else {"duration": duration}
    process = make_arrivals(distribution, rate, seed)
    return np.asarray(process.schedule(**bounds), dtype=np.float64), repr(process)


# ---------------------------------------------------------------------------- the run
@dataclass
class SimResult:
    """What a simulation produced: the serving records and the runtime's statistics."""

    records: RunRecords
    placement: dict[tuple[int, str], int]  # (part, arch) -> tasks run there
    busy: dict[str, float]  # worker name -> busy fraction of [start, end]
    workers: list[WorkerInfo]
    notes: list[str]
    events: int
    wall_seconds: float
    mean_queue_wait: float  # seconds from a task being ready to its start, averaged

    def share(self, part: int) -> dict[str, float]:
        """Fraction of ``part``'s tasks run on each arch."""
        counts = {a: n for (p, a), n in self.placement.items() if p == part}
        total = sum(counts.values())
        return {a: n / total for a, n in sorted(counts.items())} if total else {}

    def metrics(self, warmup: float = 0.0) -> dict[str, Any]:
        """Throughput, the papers' latency, percentiles, congestion: the live runs' own metrics."""
        return summarize(self.records, warmup=warmup)


class _Simulation:
    """One run: the server's queue and batcher, then the engine's core, on simulated time.

    The front end follows :class:`staronnx.serving.server.Server` (rejections when the queue is
    full, at most ``max_inflight`` batches in the runtime, full batches or ``max_delay``, queue
    samples at each arrival and batch) and flushes after the last arrival as the load generator
    does; ``tests/test_replay.py`` runs both on the same arrivals.
    """

    def __init__(
        self,
        machine: SimMachine,
        policy: Policy,
        batch_size: int,
        arrivals: np.ndarray,
        *,
        seed: int,
        spread: float,
        max_delay: float | None,
        queue_capacity: int | None,
        max_inflight: int,
        drain: bool,
        charge_transfers: bool,
        pad_to: Sequence[int] = (),
    ) -> None:
        self.m = machine
        self.pad_to = tuple(sorted(set(pad_to)))
        self.plan = machine.plan
        self.policy = policy
        self.b = batch_size
        self.arrivals = arrivals
        self.spread = spread
        self.max_delay = max_delay
        self.capacity = queue_capacity
        self.max_inflight = max_inflight
        self.drain = drain
        self.charge_transfers = charge_transfers
        self.clock = SimClock(float(arrivals[0]))
        self.events = EventQueue()
        self.rng = random.Random(f"staronnx-sim-{seed}")
        self.profiles: dict[int, PlanProfile] = {}  # batch size -> footprints and bytes
        # the engine's own core: the same tasks, handles, policy calls and statistics
        self.core = TaskGraph(self.plan, machine.workers, policy, machine.table, self.clock,
                              lambda req, part: self.profiles[req.batch].footprints[part])
        self.requests: list[RequestRecord] = []
        self.batches: list[BatchRecord] = []
        self.queue: deque[int] = deque()  # request ids waiting for a batch
        self.flush_left = 0
        self.timer_due = math.nan
        self.samples: list[tuple[float, int]] = []
        self.notes: list[str] = []
        self.n_events = 0
        self.last_done = self.clock.t
        self._dirty = False
        self._first: int | None = None

    # -- main loop ---------------------------------------------------------------------------
    def run(self) -> None:
        arrivals, n, i = self.arrivals, len(self.arrivals), 0
        deadline = math.inf if self.drain else float(arrivals[-1])
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
                    self._on_done(*payload)
                else:
                    self._batcher()
            else:
                self._on_arrival(i, t)
                i += 1
                if i == n:  # the load generator flushes after its last submission
                    self.flush_left = len(self.queue)
                    self._batcher()
            if self._dirty:
                self._dispatch()

    # -- the server: queue and batcher -------------------------------------------------------
    def _on_arrival(self, i: int, t: float) -> None:
        rec = RequestRecord(id=i, arrival=t)
        self.requests.append(rec)
        if self.capacity is not None and len(self.queue) >= self.capacity:
            rec.rejected = True
            return
        self.queue.append(i)
        self.samples.append((t, len(self.queue)))
        self._batcher()

    def _batcher(self) -> None:
        """Form every batch that may leave now (the Server's own rule), then arm the timer."""
        t = self.clock.t
        while True:
            size, due = next_batch_size(
                queued=len(self.queue), inflight=len(self.core.inflight), batch_size=self.b,
                max_inflight=self.max_inflight, flush_left=self.flush_left, closing=False,
                oldest_arrival=self.requests[self.queue[0]].arrival if self.queue else t,
                max_delay=self.max_delay, now=t)
            if not size:
                break
            if size < self.b and not self._runnable(padded_size(size, self.pad_to)):  # a flush or max_delay batch
                note = f"no model for a batch of {size}: its requests waited for a full batch"
                if note not in self.notes:
                    self.notes.append(note)
                self.flush_left = 0
                return
            self._form_batch(size)
        if due != math.inf and due != self.timer_due:
            self.timer_due = due
            self.events.push(due, "timeout")

    def _runnable(self, size: int) -> bool:
        try:
            self.m.check(size)
        except SimulationError:
            return False
        return True

    def _form_batch(self, size: int) -> None:
        t = self.clock.t
        ids = [self.queue.popleft() for _ in range(size)]
        self.flush_left = max(0, self.flush_left - size)
        rows = padded_size(size, self.pad_to)  # the Server's padding: priced at the size that runs
        profile = self.profiles.get(rows)
        if profile is None:
            profile = self.profiles[rows] = self.m.check(rows)
        bid = len(self.batches)
        record = BatchRecord(id=bid, size=size, formed=t, request_ids=ids,
                             padded_to=rows if rows != size else None)
        self.batches.append(record)
        for j, rid in enumerate(ids):  # the queue is in arrival order: the first is the oldest
            self.requests[rid].batch_id = bid
            self.requests[rid].first_in_batch = j == 0
        self.samples.append((t, len(self.queue)))
        req = self.core.submit(rows, {n: profile.nbytes[n] for n in self.plan.input_names}, t, owner=record)
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
            if not st.running and (task := self.core.next_task(st.info.id, now)) is not None:
                self._start(st.info, task)

    def _start(self, info: WorkerInfo, task: Task) -> None:
        assert task.view is not None and task.view.footprint is not None
        mean, std = self.m.table.distribution(task.part, info.arch, task.view.footprint)
        seconds = self._draw(mean, std * self.spread)
        if self.charge_transfers:
            seconds += self._transfer(task, info.memory_node)
        self.events.push(self.clock.t + seconds, "done", (info.id, task, seconds))

    def _draw(self, mean: float, std: float) -> float:
        """A normal sample truncated to > 0 (redrawn; the mean after 20 misses)."""
        if std <= 0:
            return mean
        for _ in range(20):
            x = self.rng.gauss(mean, std)
            if x > 0:
                return x
        return mean

    def _transfer(self, task: Task, node: str) -> float:
        """Bus time to bring the task's inputs to ``node`` from their cheapest valid copies
        (the predictor's rule, on the copies valid now rather than at push)."""
        total = 0.0
        bus = self.m.table.bus
        for name in self.plan.parts[task.part].inputs:
            handle = task.request.handles[name]
            if node in handle.valid_on or handle.nbytes == 0:
                continue
            costs = [c for c in (bus.predict(s, node, handle.nbytes) for s in handle.valid_on) if math.isfinite(c)]
            total += min(costs) if costs else 0.0
        return total

    def _on_done(self, wid: int, task: Task, seconds: float) -> None:
        """The core's completion (data locations, successors, stats), then the server's."""
        now = self.clock.t
        nbytes = self.profiles[task.request.batch].nbytes
        req = self.core.finish(wid, task, now, seconds, {n: nbytes[n] for n in self.plan.parts[task.part].outputs})
        self._dirty = True
        self._first = wid
        if req is not None:
            record: BatchRecord = req.owner
            record.done = now
            for rid in record.request_ids:
                self.requests[rid].done = now
            self.last_done = now
            self._batcher()


def simulate(
    plan: Plan | None = None,
    *,
    rate: float,
    batch_size: int,
    policy: str | Policy = "heft",
    policy_options: Mapping[str, Any] | None = None,
    groups: str = "numa",
    topology: Topology | None = None,
    cuda_streams: int = 0,
    cuda_scale: float | Sequence[float] | None = None,
    duration: float | None = 10.0,
    n_requests: int | None = None,
    arrivals: Sequence[float] | None = None,
    distribution: str = "constant",
    seed: int = 0,
    store: PerfModelStore | None = None,
    max_delay: float | None = None,
    queue_capacity: int | None = 1024,
    max_inflight: int | None = None,
    spread: float = 1.0,
    drain: bool = True,
    charge_transfers: bool = True,
    machine: SimMachine | None = None,
    pad_to: Sequence[int] = (),
) -> SimResult:
    """Serve ``rate`` single-sample requests/s in batches of ``batch_size``, in simulation.

    ``machine`` (from :func:`build_machine`) replaces ``plan``, ``groups``, ``topology``,
    ``cuda_streams``, ``cuda_scale`` and ``store`` when given, so a sweep builds it once.
    Arrivals come from the live generator's processes (``distribution``, ``seed``) for
    ``duration`` seconds or ``n_requests`` requests, or are replayed from ``arrivals``
    (offsets in seconds, sorted). The front end is the live server's: ``queue_capacity``
    (None: unbounded), ``max_inflight`` (None: :func:`machine_inflight`, the window the
    perf models call for, as live sweeps use), batches that leave when full or, with ``max_delay``, when the oldest request has
    waited that long. With ``drain`` (default) the run goes on after the last arrival until
    every accepted request is done, as the load generator waits for its futures. ``spread``
    scales the models' standard deviations (0: every task takes its mean). Deterministic for a
    given ``seed``. ``pad_to``: the live server's padding of partial batches to captured sizes
    (:func:`~staronnx.serving.server.padded_size`); a padded batch costs its padded size.
    """
    t0 = time.perf_counter()
    if machine is None:
        if plan is None:
            raise SimulationError("give a plan or a machine")
        machine = build_machine(plan, groups=groups, topology=topology, cuda_streams=cuda_streams,
                                cuda_scale=cuda_scale, store=store)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise SimulationError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if max_delay is not None and not max_delay >= 0:
        raise SimulationError(f"max_delay must be >= 0 seconds, got {max_delay!r}")
    if not (math.isfinite(spread) and spread >= 0):
        raise SimulationError(f"spread must be >= 0, got {spread!r}")
    if queue_capacity is not None and queue_capacity < (1 if max_delay is not None else batch_size):
        raise SimulationError(f"queue_capacity must be >= 1 and >= batch_size without max_delay, got {queue_capacity}")
    inflight = machine_inflight(machine, batch_size) if max_inflight is None else int(max_inflight)
    if inflight < 1:
        raise SimulationError(f"max_inflight must be >= 1, got {max_inflight}")
    if arrivals is not None:
        times = np.asarray(arrivals, dtype=np.float64)
        if times.size == 0 or not np.all(np.isfinite(times)) or np.any(np.diff(times) < 0):
            raise SimulationError("arrivals must be a non-empty, sorted list of finite times")
        process = f"replay({times.size} arrivals)"
    else:
        times, process = arrival_schedule(rate, duration=duration, n_requests=n_requests,
                                          distribution=distribution, seed=seed)
        if times.size == 0:
            raise SimulationError("no arrival falls in the duration; lengthen it or raise the rate")
    policy_obj = _make_policy(policy, policy_options, seed)
    machine.check(batch_size)
    sim = _Simulation(
        machine, policy_obj, batch_size, times, seed=seed, spread=spread, max_delay=max_delay,
        queue_capacity=queue_capacity, max_inflight=inflight, drain=drain,
        charge_transfers=charge_transfers, pad_to=pad_to,
    )
    sim.run()
    start = float(times[0])
    outstanding = any(r.done is None and not r.rejected for r in sim.requests)
    end = max(sim.last_done, float(times[-1])) if not outstanding else max(sim.clock.t, float(times[-1]))
    elapsed = max(end - start, 1e-12)
    settings = {
        "engine": "simulator",
        "policy": policy_obj.name,
        "batch_size": batch_size,
        "arrivals": process,
        "distribution": distribution if arrivals is None else "replay",
        "seed": seed,
        "max_delay": max_delay,
        "queue_capacity": queue_capacity,
        "max_inflight": inflight,
        "pad_to": sorted(set(pad_to)),
        "spread": spread,
        "plan_hash": machine.plan.hash,
        "workers": [w.name for w in machine.workers],
        **machine.settings,
    }
    records = RunRecords(
        requests=sim.requests, batches=sim.batches,
        offered_rate=float(rate) if arrivals is None else _mean_rate(times),
        batch_size=batch_size, start=start, end=end, queue_samples=sim.samples, settings=settings,
    )
    return SimResult(
        records=records,
        placement={key: len(times) for key, times in sorted(sim.core.measured.items())},
        busy={st.info.name: st.busy_seconds / elapsed for st in sim.core.workers},
        workers=list(machine.workers),
        notes=list(machine.notes) + sim.notes,
        events=sim.n_events,
        wall_seconds=time.perf_counter() - t0,
        mean_queue_wait=sim.core.queue_waits.mean(),
    )


def _mean_rate(times: np.ndarray) -> float:
    span = float(times[-1] - times[0]) if times.size > 1 else 0.0
    return (times.size - 1) / span if span > 0 else 0.0


def _make_policy(policy: str | Policy, options: Mapping[str, Any] | None, seed: int) -> Policy:
    """A fresh policy object; the random policy gets the run's seed unless told otherwise."""
    from staronnx.runtime.policies import make_policy, policy_options

    if isinstance(policy, Policy):
        if options:
            raise SimulationError("policy_options only apply to a policy given by name")
        return policy
    opts = dict(options or {})
    if "seed" in policy_options(policy) and "seed" not in opts:
        opts["seed"] = seed
    return make_policy(policy, **opts)
