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

import itertools
import math
import os
import random
import re
import statistics
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from staronnx.bench.simclock import EventQueue, SimClock
from staronnx.errors import StaronnxError
from staronnx.perfmodels import BusModel, Footprint, PerfModelStore
from staronnx.plan import Plan
from staronnx.runtime.predictor import PerfPredictor
from staronnx.runtime.core import Task, TaskGraph
from staronnx.runtime.models import HostedModel, ModelSet, ServiceTarget
from staronnx.runtime.sched import Policy, TaskView, WorkerInfo
from staronnx.serving.arrivals import DISTRIBUTIONS, make_arrivals
from staronnx.serving.metrics import summarize
from staronnx.serving.records import BatchRecord, RequestRecord, RunRecords
from staronnx.serving.server import next_batch_size, padded_size
from staronnx.workers.residency import WorkerSlot
from staronnx.workers.topology import Topology

#: per global part, the ids of the workers holding it (None: every worker holds every part)
Where = Sequence[frozenset[int]] | None
_CUDA_NAME = re.compile(r"cuda(\d+)(?:\.|$)")

class SimulationError(StaronnxError, ValueError):
    """A simulation that cannot run as asked: bad settings, or no model for a part on an arch."""


# ---------------------------------------------------------------------------- models
@dataclass(frozen=True)
class ArchSource:
    """Where a simulated arch takes its times from: another arch's models, times a factor
    (one for every part, or one per part).

    ``cpu_fallback`` lends a group size the store never saw the nearest calibrated ``cpu<m>``
    times m/n (ideal, optimistic scaling, said in :attr:`SimMachine.notes`), and a GPU the
    store never saw the times of the lowest calibrated one (``cuda1`` those of ``cuda0``: what
    a machine with more GPUs of the kind calibrated would do, said in the notes); ``cuda_scale``
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
                gpu = _CUDA_NAME.fullmatch(src.arch)
                workers = "" if gpu is None else " --cuda-streams N" + (
                    f" --cuda-devices {gpu.group(1)}" if gpu.group(1) != "0" else "")
                raise SimulationError(
                    f"no perf model for part {part} on {arch}{via} at batch {fp.batch}: "
                    f"calibrate it (staronnx calibrate PLANDIR --batch-sizes ...{workers}) "
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
    gpu_stored = [f"cuda{d}" for d in sorted(int(a[4:]) for a in stored if re.fullmatch(r"cuda[0-9]+", a))]
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
        elif arch.startswith("cuda") and arch not in stored and cpu_fallback and gpu_stored:
            sources[arch] = ArchSource(gpu_stored[0])
            notes.append(f"{arch}: no models; using {gpu_stored[0]}'s (a GPU of the same model assumed)")
    return sources, notes


# ---------------------------------------------------------------------------- the machine
def sim_workers(
    topology: Topology | None = None, groups: str = "numa", cuda_streams: int = 0,
    cuda_devices: Sequence[int] = (0,),
) -> list[WorkerInfo]:
    """The workers ``Runtime`` would start on ``topology``, as policies see them.

    Same layout as :func:`~staronnx.workers.launch.start_workers` (CUDA streams first, GPU by
    GPU, like StarPU's worker ids, which decides dmda's ties; a core held back per device driver
    thread unless the policy says otherwise), same names, archs and memory nodes as
    ``Runtime``'s ``_worker_info``: each GPU of ``cuda_devices`` is an arch (``cuda1``) and a
    memory node of its own, as the runtime keeps a perf model per GPU.
    """
    from staronnx.workers.launch import worker_layout

    if cuda_streams < 0:
        raise SimulationError(f"cuda_streams must be >= 0, got {cuda_streams}")
    devices = check_cuda_devices(cuda_devices)
    topology = topology if topology is not None else Topology.from_system()
    layout = worker_layout(topology, groups, cuda_streams, devices)
    infos: list[WorkerInfo] = []
    for d, s, _ in layout.cuda:
        dev = f"cuda{d}"
        infos.append(WorkerInfo(len(infos), f"{dev}.s{s}", dev, "cuda", dev, 1))
    for g in layout.groups:
        numa = g.numa if g.numa is not None else 0
        infos.append(WorkerInfo(len(infos), f"cpu:{g.name}", f"cpu{g.n_cores}", "cpu", f"numa{numa}", g.n_cores))
    return infos


def check_cuda_devices(cuda_devices: Sequence[int]) -> tuple[int, ...]:
    """``cuda_devices`` as CUDA ordinals, each once (the runtime's rule,
    :func:`~staronnx.workers.launch.cuda_ordinals`), or SimulationError. Not checked against
    this machine's GPUs: a simulated machine may have more."""
    from staronnx.workers.launch import cuda_ordinals

    devices = cuda_ordinals(cuda_devices)
    if devices is None:
        raise SimulationError(f"cuda_devices must name each GPU once, by its CUDA ordinal (0, 1, ...); got "
                              f"{list(cuda_devices) if isinstance(cuda_devices, (list, tuple)) else cuda_devices!r}")
    return devices


#: how the simulator and the LP bound model a latency lane (said in every result's notes)
LANE_APPROXIMATION = (
    "lanes are modelled as the live runtime runs them: a lane's task preempts its group's worker, whose task "
    "stops for as long as the lane runs and then resumes where it stopped (SCHED_IDLE's full preemption), and in "
    "the LP bound a lane and its group's worker share the group's cores (their loads add up to at most one); not "
    "modelled: the wake-up of a preempting lane (up to a scheduler tick with --lane-preempt nice) and the GIL, "
    "so the lane models' latency is what a lane that always gets the core at once gives")


def lane_groups(workers: Sequence[WorkerInfo]) -> dict[int, int]:
    """Lane worker id -> the id of the CPU worker on the same cores (``lane:<g>`` and
    ``cpu:<g>``, as :func:`lane_workers` and the runtime name them): the pairs that share cores,
    the group's worker preempted while its lane runs."""
    by_name = {w.name: w.id for w in workers}
    return {w.id: by_name["cpu:" + w.name.removeprefix("lane:")] for w in workers
            if w.name.startswith("lane:") and "cpu:" + w.name.removeprefix("lane:") in by_name}


def lane_workers(workers: Sequence[WorkerInfo], lanes: Mapping[str, str] | None,
                 model_names: Sequence[str]) -> tuple[list[WorkerInfo], dict[int, tuple[str, ...]]]:
    """``workers`` plus the latency lanes ``lanes`` (model -> CPU group selector, as
    ``Runtime(lanes=...)`` and ``--lane`` take it) asks for, as the live runtime adds them: one
    per selected CPU group, after every other worker, named ``lane:<group>``, with its group's
    arch, memory node and cores (a lane is a CPU worker on the same cores, so it runs on the
    group's perf models). Also, per lane's worker id, the models it holds. The runtime's own
    planning (:func:`~staronnx.workers.lanes.plan_lanes`), so what it refuses (an unknown model,
    one model, every model, a selector naming no CPU group) is refused here with its words.

    Why a lane is a plain extra worker here: to the scheduler it is one (its own queue, the
    group's arch). What it is to the OS (it preempts the group's worker, which then waits) the
    simulation and the LP bound add on top (:func:`lane_groups`, :data:`LANE_APPROXIMATION`)."""
    from staronnx.workers.lanes import plan_lanes

    out = list(workers)
    if not lanes:
        return out, {}
    cpu = [i for i, w in enumerate(workers) if w.kind == "cpu" and not w.name.startswith("lane:")]
    slots = worker_slots(workers)
    cpu_slots = [slots[i] for i in cpu]
    plan = plan_lanes(lanes, list(model_names), cpu_slots)
    held: dict[int, tuple[str, ...]] = {}
    for slot, (group, models) in zip(plan.slots(cpu_slots), plan.lanes):
        g = workers[cpu[group]]
        held[len(out)] = tuple(models)
        out.append(WorkerInfo(len(out), slot.name, g.arch, g.kind, g.memory_node, g.ncores))
    return out, held


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
    #: the models sharing the machine, their parts numbered as the runtime numbers them (the
    #: table is keyed by those global parts); one plan is a set of one, global = own part
    models: ModelSet | None = None
    #: the workers that are latency lanes (:func:`lane_workers`): worker id -> the models it holds
    lanes: dict[int, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.models is None:
            self.models = ModelSet.of(self.plan)

    @property
    def archs(self) -> list[str]:
        return list(dict.fromkeys(w.arch for w in self.workers))

    def hosted(self, model: int | str = 0) -> HostedModel:
        """One model of the machine, by index or name."""
        assert self.models is not None
        return self.models.model(model) if isinstance(model, str) else self.models.models[model]

    def profile(self, batch: int, model: int | str = 0) -> PlanProfile:
        return profile_plan(self.hosted(model).plan, batch)

    def check(self, batch: int, model: int | str = 0, where: Where = None) -> PlanProfile:
        """Profile ``batch`` of ``model`` and make sure each of its parts has times on every
        arch that may run it (else raise): every arch, or with ``where`` (see
        :func:`residency_where`) those of the workers holding the part, so that a model kept
        off the GPU needs no GPU perf models (it may never have been calibrated there)."""
        hosted = self.hosted(model)
        prof = self.profile(batch, hosted.index)
        for p in range(hosted.plan.k):
            g = hosted.first_part + p
            archs = self.archs if where is None else list(dict.fromkeys(
                w.arch for i, w in enumerate(self.workers) if i in where[g]))
            for arch in archs:
                self.table.distribution(g, arch, prof.footprints[p])
        return prof

    def mean_times(self, batch: int | Mapping[str, int], model: int | str | None = None,
                   where: Where = None) -> list[list[float]]:
        """``times[p][w]``: mean seconds of part ``p`` on worker ``w`` (for the LP).

        ``batch`` an int and ``model`` None: every part of a one-plan machine (of the first
        model's plan otherwise), at that batch size. ``model`` given: that model's parts (its
        own numbering). ``batch`` a mapping (model name -> batch size): every global part of
        a machine of several models, each at its model's batch size. ``where`` (per global
        part, the workers holding it; :func:`residency_where`): ``inf`` on the others, which
        the LP reads as "cannot run there"."""
        assert self.models is not None
        if isinstance(batch, Mapping):
            return [row for m in self.models.models for row in self.mean_times(int(batch[m.name]), m.index, where)]
        hosted = self.hosted(0 if model is None else model)
        prof = self.check(batch, hosted.index, where)
        first = hosted.first_part
        return [
            [self.table.distribution(first + p, w.arch, prof.footprints[p])[0]
             if where is None or i in where[first + p] else math.inf
             for i, w in enumerate(self.workers)]
            for p in range(hosted.plan.k)
        ]


def machine_inflight(machine: SimMachine, batch: int, model: int | str = 0, where: Where = None) -> int:
    """The server's in-flight window for this machine at ``batch`` (of ``model``'s server)
    (:func:`~staronnx.serving.server.inflight_window` over each worker's whole-plan time).
    With ``where`` (:func:`residency_where`), over the workers holding the model only: its
    batches can keep no other worker busy."""
    from staronnx.serving.server import inflight_window

    hosted = machine.hosted(model)
    mine = [i for i in range(len(machine.workers))
            if where is None or all(i in where[hosted.first_part + p] for p in range(hosted.plan.k))]
    try:
        times = machine.mean_times(batch, hosted.index, where)
    except Exception:  # noqa: BLE001 - a missing model: the unknown-machine default
        return inflight_window([None] * len(mine))
    return inflight_window([sum(times[p][w] for p in range(len(times))) for w in mine])


def worker_slots(workers: Sequence[WorkerInfo]) -> list[WorkerSlot]:
    """The workers as a residency selector sees them (:mod:`staronnx.workers.residency`):
    the runtime's names and kinds, a CUDA worker's GPU read from its name (``cuda1.s0``), a
    lane (``lane:<group>``, a CPU worker to the policies) of kind ``lane``, as the runtime's
    residency sees it, so that ``cpu`` does not select it and ``lane`` does."""
    slots = []
    for w in workers:
        m = _CUDA_NAME.match(w.name) if w.kind == "cuda" else None
        kind = "lane" if w.kind == "cpu" and w.name.startswith("lane:") else w.kind
        slots.append(WorkerSlot(w.name, kind, int(m.group(1)) if m else None))
    return slots


def residency_where(machine: SimMachine, residency: Mapping[str, str] | None) -> list[frozenset[int]] | None:
    """Per global part of ``machine``, the ids of the workers that hold it when ``residency``
    (model name -> worker selector, as ``Runtime(residency=...)`` and ``--model-workers`` take
    it) keeps some models on some workers only, or the machine has lanes (a lane holds its
    models only, and a model with lanes is held by its lanes alone unless ``residency`` names
    other workers too); None with neither (every worker holds every part: the policies'
    unrestricted path). The live runtime's own rule
    (:func:`~staronnx.workers.launch.held_part_paths`), so an unknown model, a selector that
    matches no worker or a model left on lanes that do not hold it is refused here as
    ``staronnx serve`` refuses it."""
    from staronnx.workers.launch import held_part_paths

    if not residency and not machine.lanes:
        return None
    models = machine.models
    assert models is not None
    held = held_part_paths(models, dict(residency or {}), worker_slots(machine.workers), machine.lanes)
    return [frozenset(w for w, paths in enumerate(held) if paths[p] is not None) for p in range(models.k)]


def held_by(machine: SimMachine, where: Where, model: int | str) -> list[str]:
    """The names of the workers holding every part of ``model`` (all of them without ``where``),
    as the live runtime's ``stats()["models"][name]["held_by"]`` lists them."""
    hosted = machine.hosted(model)
    return [w.name for i, w in enumerate(machine.workers)
            if where is None or all(i in where[p] for p in hosted.parts)]


def build_machine(
    plan: Plan | ModelSet | Mapping[str, Plan],
    *,
    groups: str = "numa",
    topology: Topology | None = None,
    cuda_streams: int = 0,
    cuda_devices: Sequence[int] = (0,),
    store: PerfModelStore | None = None,
    cuda_scale: float | Sequence[float] | None = None,
    cpu_fallback: bool = True,
    arch_sources: Mapping[str, ArchSource] | None = None,
    bus: BusModel | None = None,
    lanes: Mapping[str, str] | None = None,
) -> SimMachine:
    """Workers from ``topology`` (default: this machine) and ``groups``, plus ``cuda_streams``
    hypothetical or real CUDA workers on each GPU of ``cuda_devices``, with times from
    ``store`` (default: ``$STARONNX_HOME``).

    Each GPU is its own arch and memory node, as in the runtime. A GPU the store has no models
    or bus links for (a what-if: four GPUs where one was calibrated) takes those of the lowest
    calibrated GPU, said in ``notes``; transfers between two GPUs with no measured peer link go
    through the host (the bus model's routing), as a copy without peer access does.

    ``plan`` may be several plans (a :class:`~staronnx.runtime.models.ModelSet` or a mapping
    name -> plan): the machine then serves them as one shared runtime does, every model's
    parts numbered one after the other, each read from its own plan's stored models (nothing
    recalibrated for sharing). A per-part ``cuda_scale`` then has one factor per global part.

    ``lanes`` (model name -> CPU group selector, ``Runtime(lanes=...)``'s; see
    :mod:`staronnx.workers.lanes`) adds the runtime's latency lanes (:func:`lane_workers`):
    one more worker per selected group, same arch, holding the lane models only (the
    simulations and bounds over this machine keep them there, :func:`residency_where`). They
    are checked first, so a bad lane is refused before any perf model is read. A lane's task
    preempts its group's worker in the simulations, and the two share the group's cores in the
    bounds (:data:`LANE_APPROXIMATION`, in ``notes``, says what is left out).
    """
    store = store if store is not None else PerfModelStore()
    models = plan if isinstance(plan, ModelSet) else (
        ModelSet(dict(plan)) if isinstance(plan, Mapping) else ModelSet.of(plan))
    devices = check_cuda_devices(cuda_devices)
    workers, lane_of = lane_workers(sim_workers(topology, groups, cuda_streams, devices), lanes,
                                    [m.name for m in models.models])
    stored_by_model = {m.name: {key.arch for key in store.list(m.plan.hash)} for m in models.models}
    stored = set().union(*stored_by_model.values())
    sources, notes = resolve_sources(
        stored, [w.arch for w in workers], models.k,
        cuda_scale=cuda_scale, cpu_fallback=cpu_fallback, explicit=arch_sources,
    )
    if not arch_sources:
        for m in models.models:
            if not stored_by_model[m.name]:
                name = "" if models.single else f" (model {m.name!r})"
                raise SimulationError(
                    f"no perf models for plan {m.plan.hash}{name} in {store.root} (host {store.host}); "
                    f"run `staronnx calibrate {m.plan.root}` first"
                )
    first = models.models[0].plan
    parts = None if models.single else [(m.plan.hash, local) for m, local in models.owner]
    # a copy: borrowed GPU links must not change the caller's bus model or the store's
    predictor = PerfPredictor(first.hash, store, BusModel(bus.links) if bus is not None else None, parts=parts)
    if cpu_fallback:
        notes += borrow_gpu_links(predictor.bus, workers)
    table = PerfTable(predictor, sources)
    settings = {
        "groups": groups,
        "topology": (topology.source if topology is not None else "system") or "system",
        "cuda_streams": cuda_streams,
        "cuda_devices": list(devices),
        "cuda_scale": cuda_scale if not isinstance(cuda_scale, tuple) else list(cuda_scale),
        "sources": {a: s.describe() for a, s in sources.items()},
    }
    if lane_of:
        settings["lanes"] = dict(lanes or {})
        notes.append(LANE_APPROXIMATION)
    return SimMachine(first, workers, table, notes, settings, models, lane_of)


def borrow_gpu_links(bus: BusModel, workers: Sequence[WorkerInfo]) -> list[str]:
    """Give each GPU of ``workers`` that ``bus`` has no link to or from the links of the lowest
    GPU that has some (its host links, and its peer links to the other GPUs); returns the notes.

    Why: calibration measures the GPUs it is given (``calibrate --cuda-devices``), so a machine
    simulated with more GPUs than were calibrated would otherwise price their copies at 0 (the
    bus model's rule for an unknown route), making the extra GPUs look free to feed. Changes
    ``bus`` (the machine's own copy)."""
    gpus = list(dict.fromkeys(w.memory_node for w in workers if w.kind == "cuda"))
    linked = {n for link in bus.links for n in (link.src, link.dst)}
    known = sorted((n for n in linked if _CUDA_NAME.fullmatch(n)), key=lambda n: int(n[4:]))
    missing = [g for g in gpus if g not in linked]
    if not known or not missing:
        return []
    model = known[0]
    links = bus.links
    for gpu in missing:
        for link, cost in links.items():
            if model not in (link.src, link.dst):
                continue
            src = gpu if link.src == model else link.src
            dst = gpu if link.dst == model else link.dst
            if src != dst:
                bus.set(src, dst, cost)
    return [f"{', '.join(missing)}: no bus links; using {model}'s (a GPU on the same bus assumed)"]


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
    preempted: bool = False
    stretches: list[tuple[float, float]] = field(default_factory=list)  # (start, end) before each pause

    @property
    def paused(self) -> bool:
        return math.isnan(self.resumed)


class _Simulation:
    """One run: each model's server (queue and batcher), then the engine's core, on simulated
    time.

    A front end follows :class:`staronnx.serving.server.Server` (rejections when the queue is
    full, at most ``max_inflight`` batches in the runtime, full batches or ``max_delay``, queue
    samples at each arrival and batch) and flushes after its last arrival as the load generator
    does; ``tests/test_replay.py`` runs both on the same arrivals. Several front ends (one per
    model, as ``staronnx serve`` puts a Server over each model of a shared runtime) share the
    core, the workers and the policy, with the models' service targets in ``machine.models``.
    """

    def __init__(
        self,
        machine: SimMachine,
        policy: Policy,
        fronts: Sequence[_FrontEnd],
        *,
        seed: int,
        spread: float,
        drain: bool,
        charge_transfers: bool,
        models: ModelSet | None = None,
        where: Where = None,
        traced: bool = False,
    ) -> None:
        """``where``: per global part, the workers holding it (:func:`residency_where`), handed
        to the core as the live engine hands it the workers' sessions. ``traced``: keep what
        :meth:`write_trace` draws (each task's running stretches and its dependencies)."""
        self.m = machine
        self.where = where
        self.models = models if models is not None else machine.models
        assert self.models is not None
        self.fronts = list(fronts)
        self.policy = policy
        self.spread = spread
        self.drain = drain
        self.charge_transfers = charge_transfers
        # every model's arrivals merged in time order (ties: model order), so one model is the
        # single-plan run it always was
        times = np.concatenate([fe.arrivals for fe in self.fronts])
        which = np.concatenate([np.full(len(fe.arrivals), i) for i, fe in enumerate(self.fronts)])
        index = np.concatenate([np.arange(len(fe.arrivals)) for fe in self.fronts])
        order = np.argsort(times, kind="stable")
        self.arrivals, self.which, self.index = times[order], which[order], index[order]
        self.clock = SimClock(float(self.arrivals[0]))
        self.events = EventQueue()
        self.rng = random.Random(f"staronnx-sim-{seed}")
        for fe in self.fronts:
            fe.last_done = self.clock.t
        # the engine's own core: the same tasks, handles, policy calls and statistics
        self.core = TaskGraph(self.models, machine.workers, policy, machine.table, self.clock, self._footprint,
                              where=where)
        self.part_inputs = self.models.part_inputs
        self.part_outputs = [list(m.plan.parts[local].outputs) for m, local in self.models.owner]
        self.notes: list[str] = []
        self.n_events = 0
        self.last_done = self.clock.t
        self._dirty = False
        self._first: int | None = None
        # lanes: group worker id -> its lane's id; each worker's task in progress
        self._lane_of = {group: lane for lane, group in lane_groups(machine.workers).items()}
        self._running: dict[int, _Running] = {}
        self._tokens = itertools.count()
        #: per finished task, when traced: (worker id, task, [(start, end) it ran], wall seconds,
        #: [(worker, end) of each task it waited for]) (read at its end: a finished request's
        #: tasks are dropped by the core)
        self.ran: list[tuple[int, Task, list[tuple[float, float]], float, list[tuple[int, float]]]] | None = (
            [] if traced else None)

    def _footprint(self, req: Any, part: int) -> Footprint:
        return self.fronts[req.model].profiles[req.batch].footprints[part - req.first_part]

    # -- main loop ---------------------------------------------------------------------------
    def run(self) -> None:
        arrivals, n, i = self.arrivals, len(self.arrivals), 0
        left = [len(fe.arrivals) for fe in self.fronts]
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
                    wid, token = payload
                    run = self._running.get(wid)
                    if run is not None and run.token == token:  # else preempted since
                        del self._running[wid]
                        if self.ran is not None:
                            self._keep(wid, run, t)
                        self._on_done(wid, run.task, t - run.started if run.preempted else run.work)
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
        lay out theirs (:mod:`staronnx.runtime.trace`): a lane per worker with its tasks (a
        task a lane preempted shows each stretch it ran), dependency arrows, each batch's fill
        and run, and the queue length. A path: a file of its own, time 0 the first arrival
        (returned). A :class:`TraceInto`: into that open tracer, simulated time shifted onto
        its clock (a sweep's simulated points, each where its live point ran; None)."""
        from staronnx.runtime.trace import Tracer

        assert self.ran is not None, "write_trace needs a simulation run with traced=True"
        if isinstance(target, TraceInto):
            tracer, shift = target.tracer, target.shift
        else:
            tracer, shift = Tracer(target, origin=0.0), -float(self.arrivals[0])
            for info in self.m.workers:
                tracer.lane(info.id, info.name)
        self._draw_trace(tracer, shift)
        return None if isinstance(target, TraceInto) else tracer.save()

    def _draw_trace(self, tracer: Any, shift: float) -> None:
        for wid, task, stretches, wall, deps in self.ran or ():
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

    # -- the server: queue and batcher -------------------------------------------------------
    def _on_arrival(self, fe: _FrontEnd, i: int, t: float) -> None:
        rec = RequestRecord(id=i, arrival=t)
        fe.requests.append(rec)
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
                queued=len(fe.queue), inflight=counters.in_flight, batch_size=fe.batch_size,
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
        plan = self.models.models[fe.model].plan
        # the Server passes the batch's oldest arrival, from which a latency target counts
        req = self.core.submit(rows, {n: profile.nbytes[n] for n in plan.input_names}, t, owner=record,
                               model=fe.model, arrival=fe.requests[ids[0]].arrival)
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
        if self._lane_of:
            self._preempt()

    def _start(self, info: WorkerInfo, task: Task) -> None:
        assert task.view is not None and task.view.footprint is not None
        mean, std = self.m.table.distribution(task.part, info.arch, task.view.footprint)
        seconds = self._draw(mean, std * self.spread)
        if self.charge_transfers:
            seconds += self._transfer(task, info.memory_node)
        now = self.clock.t
        token = next(self._tokens)
        self._running[info.id] = _Running(task, seconds, seconds, now, now, token)
        self.events.push(now + seconds, "done", (info.id, token))

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
                run.left -= now - run.resumed
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

    def _transfer(self, task: Task, node: str) -> float:
        """Bus time to bring the task's inputs to ``node`` from their cheapest valid copies
        (the predictor's rule, on the copies valid now rather than at push)."""
        total = 0.0
        bus = self.m.table.bus
        for name in self.part_inputs[task.part]:
            handle = task.request.handles[name]
            if node in handle.valid_on or handle.nbytes == 0:
                continue
            costs = [c for c in (bus.predict(s, node, handle.nbytes) for s in handle.valid_on) if math.isfinite(c)]
            total += min(costs) if costs else 0.0
        return total

    def _on_done(self, wid: int, task: Task, seconds: float) -> None:
        """The core's completion (data locations, successors, stats), then the server's;
        ``seconds``: the task's wall time (its work, plus any time a lane preempted it)."""
        now = self.clock.t
        fe = self.fronts[task.request.model]
        nbytes = fe.profiles[task.request.batch].nbytes
        req = self.core.finish(wid, task, now, seconds, {n: nbytes[n] for n in self.part_outputs[task.part]})
        self._dirty = True
        self._first = wid
        if req is not None:
            record: BatchRecord = req.owner
            record.done = now
            for rid in record.request_ids:
                fe.requests[rid].done = now
            self.last_done = fe.last_done = now
            self._batcher(fe)


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
    cuda_devices: Sequence[int] = (0,),
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
    trace: str | os.PathLike[str] | TraceInto | None = None,
) -> SimResult:
    """Serve ``rate`` single-sample requests/s in batches of ``batch_size``, in simulation.

    ``machine`` (from :func:`build_machine`) replaces ``plan``, ``groups``, ``topology``,
    ``cuda_streams``, ``cuda_devices``, ``cuda_scale`` and ``store`` when given, so a sweep builds it once.
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
    ``trace``: a Perfetto trace of the simulated schedule there, laid out as a live
    ``Runtime(trace=...)`` behind a Server lays out its own, or into an open tracer
    (:class:`TraceInto`; :meth:`_Simulation.write_trace`).
    """
    t0 = time.perf_counter()
    if machine is None:
        if plan is None:
            raise SimulationError("give a plan or a machine")
        machine = build_machine(plan, groups=groups, topology=topology, cuda_streams=cuda_streams,
                                cuda_devices=cuda_devices, cuda_scale=cuda_scale, store=store)
    if machine.models is not None and not machine.models.single:
        raise SimulationError("this machine hosts several models: simulate their traffic together with "
                              "simulate_mix (a rate per model)")
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
    front = _FrontEnd(0, batch_size, times, queue_capacity, inflight, max_delay, tuple(sorted(set(pad_to))))
    sim = _Simulation(machine, policy_obj, [front], seed=seed, spread=spread, drain=drain,
                      charge_transfers=charge_transfers, traced=trace is not None)
    sim.run()
    if trace is not None:
        sim.write_trace(trace)
    start = float(times[0])
    end = _end_of(sim, front)
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
        requests=front.requests, batches=front.batches,
        offered_rate=float(rate) if arrivals is None else _mean_rate(times),
        batch_size=batch_size, start=start, end=end, queue_samples=front.samples, settings=settings,
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


def _end_of(sim: _Simulation, front: _FrontEnd) -> float:
    """When a front end's run ends: its last answer, or (requests still outstanding, an
    undrained run) where the simulation stopped; never before its last arrival."""
    last_arrival = float(front.arrivals[-1])
    outstanding = any(r.done is None and not r.rejected for r in front.requests)
    return max(front.last_done, last_arrival) if not outstanding else max(sim.clock.t, last_arrival)


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


# ---------------------------------------------------------------------------- mixed traffic
def deadline_misses(records: RunRecords, latency: float | None) -> int | None:
    """Requests answered later than ``latency`` seconds after their arrival (None without a
    target). Counted per request, as a client sees it (the core counts batches against the
    oldest request's deadline); a live run's records are counted alike."""
    if latency is None:
        return None
    return sum(1 for r in records.requests if r.done is not None and r.done - r.arrival > latency)


def model_metrics(records: RunRecords, target: ServiceTarget | None, warmup: float = 0.0) -> dict[str, Any]:
    """One model's figures in mixed traffic: :func:`~staronnx.serving.metrics.summarize`'s,
    plus its latency target (s) and the requests that missed it, over the whole run."""
    out = summarize(records, warmup=warmup)
    latency = target.latency if target is not None else None
    out["latency_target"] = latency
    out["deadline_misses"] = deadline_misses(records, latency)
    answered = sum(1 for r in records.requests if r.done is not None)
    out["deadline_miss_rate"] = (None if latency is None else
                                 (out["deadline_misses"] / answered if answered else None))
    return out


@dataclass
class MixResult:
    """What a simulation of several models' traffic produced: each model's serving records
    (its own server's), its target, and the shared machine's statistics."""

    records: dict[str, RunRecords]
    targets: dict[str, ServiceTarget]
    placement: dict[tuple[int, str], int]  # (global part, arch) -> tasks run there
    busy: dict[str, float]  # worker name -> busy fraction of [start, end]
    busy_by_model: dict[str, dict[str, float]]  # model -> worker name -> busy fraction spent on it
    workers: list[WorkerInfo]
    notes: list[str]
    events: int
    wall_seconds: float
    models: ModelSet
    #: model -> the workers holding it (every worker unless a residency said otherwise)
    held_by: dict[str, list[str]] = field(default_factory=dict)

    def metrics(self, model: str, warmup: float = 0.0) -> dict[str, Any]:
        """Throughput, latencies, congestion and deadline misses of ``model`` (see
        :func:`model_metrics`)."""
        return model_metrics(self.records[model], self.targets.get(model), warmup)

    def share(self, model: str, part: int) -> dict[str, float]:
        """Fraction of ``model``'s part ``part`` (its own numbering) run on each arch."""
        glob = self.models.model(model).first_part + part
        counts = {a: n for (p, a), n in self.placement.items() if p == glob}
        total = sum(counts.values())
        return {a: n / total for a, n in sorted(counts.items())} if total else {}


def simulate_mix(
    machine: SimMachine,
    rates: Mapping[str, float],
    batch_sizes: Mapping[str, int] | int,
    *,
    policy: str | Policy = "heft",
    policy_options: Mapping[str, Any] | None = None,
    targets: Mapping[str, ServiceTarget | Mapping[str, Any]] | None = None,
    duration: float | None = 10.0,
    arrivals: Mapping[str, Sequence[float]] | None = None,
    distribution: str = "constant",
    seed: int = 0,
    max_delay: float | None = None,
    queue_capacity: int | None = 1024,
    max_inflight: Mapping[str, int] | None = None,
    spread: float = 1.0,
    drain: bool = True,
    charge_transfers: bool = True,
    residency: Mapping[str, str] | None = None,
    trace: str | os.PathLike[str] | TraceInto | None = None,
) -> MixResult:
    """Serve every model of ``machine`` (:func:`build_machine` over several plans) at its own
    rate, as ``staronnx serve`` does on one shared runtime: a server per model (its queue of
    ``queue_capacity``, batches of its ``batch_sizes`` entry, its in-flight window) feeding one
    core, one policy and one set of workers, the models' ``targets`` (latency, priority) turned
    into deadlines and levels that order the ready tasks, exactly as the engine does.

    Model ``i`` (in the machine's order) draws its arrivals with seed ``seed + i``, so two
    Poisson streams are independent and a live mixed sweep replays the same ones. ``arrivals``
    (name -> sorted offsets in seconds) replaces the generated ones. ``residency`` (model name
    -> worker selector: ``"cpu"``, ``"cuda0"``, ``"cpu:numa0,cuda0.s1"``; see
    :mod:`staronnx.workers.residency`) loads those models on the selected workers only, as
    ``Runtime(residency=...)`` and ``staronnx serve --model-workers`` do: the policy places
    their tasks there alone, their in-flight windows count those workers only, and they need
    perf models only on those workers' archs (what if a model were kept off the GPU, before
    trying it live). A ``machine`` built with lanes (:func:`build_machine`'s ``lanes``) keeps
    the lane models on their lanes (plus the workers ``residency`` adds for them), each lane's
    task preempting its group's worker as the OS does live (:data:`LANE_APPROXIMATION`, in the
    notes, says what is left out). Other arguments as in :func:`simulate`.
    """
    t0 = time.perf_counter()
    models = machine.models
    assert models is not None
    names = [m.name for m in models.models]
    unknown = sorted(set(rates) - set(names))
    if unknown:
        raise SimulationError(f"rates for unknown model(s) {', '.join(map(repr, unknown))}; the models are "
                              f"{', '.join(map(repr, names))}")
    missing = [n for n in names if n not in rates]
    if missing:
        raise SimulationError(f"no rate for model(s) {', '.join(map(repr, missing))}: give each model a rate")
    sizes = {n: batch_sizes for n in names} if isinstance(batch_sizes, int) else dict(batch_sizes)
    if set(sizes) != set(names):
        raise SimulationError(f"give a batch size for each model ({', '.join(names)}), got {sorted(sizes)}")
    for n, b in sizes.items():
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise SimulationError(f"{n}: batch_size must be an int >= 1, got {b!r}")
        if queue_capacity is not None and queue_capacity < (1 if max_delay is not None else b):
            raise SimulationError(f"queue_capacity must be >= 1 and >= every batch size without max_delay, "
                                  f"got {queue_capacity}")
    if max_delay is not None and not max_delay >= 0:
        raise SimulationError(f"max_delay must be >= 0 seconds, got {max_delay!r}")
    if not (math.isfinite(spread) and spread >= 0):
        raise SimulationError(f"spread must be >= 0, got {spread!r}")
    # the core's view: the same plans in the same order (same global parts), with the targets
    shared = ModelSet({m.name: m.plan for m in models.models}, targets)
    where = residency_where(machine, residency)
    fronts: list[_FrontEnd] = []
    processes: dict[str, str] = {}
    for m in models.models:
        b = sizes[m.name]
        machine.check(b, m.index, where)
        window = (machine_inflight(machine, b, m.index, where) if max_inflight is None or m.name not in max_inflight
                  else int(max_inflight[m.name]))
        if window < 1:
            raise SimulationError(f"{m.name}: max_inflight must be >= 1, got {window}")
        if arrivals is not None and m.name in arrivals:
            times = np.asarray(arrivals[m.name], dtype=np.float64)
            if times.size == 0 or not np.all(np.isfinite(times)) or np.any(np.diff(times) < 0):
                raise SimulationError(f"{m.name}: arrivals must be a non-empty, sorted list of finite times")
            processes[m.name] = f"replay({times.size} arrivals)"
        else:
            times, processes[m.name] = arrival_schedule(float(rates[m.name]), duration=duration,
                                                        distribution=distribution, seed=seed + m.index)
            if times.size == 0:
                raise SimulationError(f"{m.name}: no arrival falls in the duration; lengthen it or raise its rate")
        fronts.append(_FrontEnd(m.index, b, times, queue_capacity, window, max_delay))
    policy_obj = _make_policy(policy, policy_options, seed)
    sim = _Simulation(machine, policy_obj, fronts, seed=seed, spread=spread, drain=drain,
                      charge_transfers=charge_transfers, models=shared, where=where, traced=trace is not None)
    sim.run()
    if trace is not None:
        sim.write_trace(trace)
    start = min(float(fe.arrivals[0]) for fe in fronts)
    ends = {m.name: _end_of(sim, fe) for m, fe in zip(models.models, fronts)}
    elapsed = max(max(ends.values()) - start, 1e-12)
    records: dict[str, RunRecords] = {}
    holders = {m.name: held_by(machine, where, m.index) for m in models.models}
    for m, fe in zip(shared.models, fronts):
        settings = {
            "engine": "simulator", "policy": policy_obj.name, "model": m.name, "batch_size": fe.batch_size,
            "arrivals": processes[m.name], "distribution": distribution if arrivals is None else "replay",
            "seed": seed + m.index, "max_delay": max_delay, "queue_capacity": queue_capacity,
            "max_inflight": fe.max_inflight, "spread": spread, "plan_hash": m.plan.hash,
            "target": {"latency": m.target.latency, "priority": m.target.priority},
            "workers": [w.name for w in machine.workers], "residency": dict(residency or {}),
            "held_by": holders[m.name], **machine.settings,
        }
        offered = (float(rates[m.name]) if arrivals is None or m.name not in arrivals
                   else _mean_rate(fe.arrivals))
        records[m.name] = RunRecords(
            requests=fe.requests, batches=fe.batches, offered_rate=offered, batch_size=fe.batch_size,
            start=float(fe.arrivals[0]), end=ends[m.name], queue_samples=fe.samples, settings=settings)
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
    )
