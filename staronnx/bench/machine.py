"""The simulated machine: the workers ``Runtime`` would start, where each arch's task times come
from, and the machine's GPUs, lanes and residency, built once and shared by every simulation and
LP bound over it (a sweep's).

Split from :mod:`staronnx.bench.simulator` (the run itself) because the LP bound
(:mod:`staronnx.bench.bound`) and the calibration checks need the machine but never simulate; the
in-flight window and the footprints of a batch size are the live server's
(:mod:`staronnx.serving.window`). What it shares with the live runtime: the layout of its
:class:`~staronnx.workers.layout.MachineSpec` (names, archs, memory nodes, a perf-model arch per
GPU, the lanes) and its residency rule, so a machine the runtime would refuse is refused here
in its words. Archs with no models borrow another's, scaled
(:class:`ArchSource`), and GPUs never calibrated borrow a calibrated GPU's times and bus links.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from staronnx.errors import StaronnxError
from staronnx.perfmodels import BusModel, Footprint, HostCosts, HostModel, PerfModelStore
from staronnx.plan import Plan
from staronnx.runtime.models import HostedModel, ModelSet
from staronnx.runtime.predictor import PerfPredictor
from staronnx.runtime.sched import TaskView, WorkerInfo
from staronnx.serving.window import PlanProfile, plan_window, profile_plan
from staronnx.workers.layout import Layout, MachineSpec, layout
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
        return self.scale[part] if isinstance(self.scale, tuple) else self.scale

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


class PerfTable:
    """Execution times per (part, arch, footprint) from the store, through arch sources.

    It is also the :class:`~staronnx.runtime.sched.Predictor` the policies get: predictions
    are the perf models' (entry mean, else regression, else NaN), scaled like the samples,
    and cached because nothing records into the models during a simulation.
    """

    def __init__(self, predictor: PerfPredictor, sources: Mapping[str, ArchSource] | None = None):
        self.base = predictor
        self.sources = dict(sources or {})
        #: the host's measured cost of CPU help to the GPU side, as the live predictor gives it
        #: to the dmda family (None: the policies' default), so a simulation charges the same
        self.help_cost = predictor.help_cost
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
        return 0.0 if task.footprint is None else self.predict(task.part, worker.arch, task.footprint)

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
def worker_infos(laid: Layout) -> list[WorkerInfo]:
    """The workers of a layout as policies see them (a lane is a CPU worker to them)."""
    return [WorkerInfo(i, w.name, w.arch, w.policy_kind, w.memory_node, w.n_cores) for i, w in enumerate(laid.workers)]


def sim_workers(spec: MachineSpec = MachineSpec(), topology: Topology | None = None) -> list[WorkerInfo]:
    """The workers ``Runtime`` would start for ``spec`` on ``topology`` (default: this machine),
    as policies see them: :func:`~staronnx.workers.layout.layout`'s, the runtime's own."""
    return worker_infos(layout(spec, topology or Topology.from_system()))


#: how the simulator and the LP bound model a latency lane (said in every result's notes)
LANE_APPROXIMATION = (
    "lanes are modelled as the live runtime runs them: a lane's task preempts its group's worker, whose task "
    "stops for as long as the lane runs and then resumes where it stopped (SCHED_IDLE's full preemption), and in "
    "the LP bound a lane and its group's worker share the group's cores (their loads add up to at most one); not "
    "modelled: the wake-up of a preempting lane (up to a scheduler tick with --lane-preempt nice) and the GIL, "
    "so the lane models' latency is what a lane that always gets the core at once gives")


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
    #: the workers that are latency lanes: worker id -> the models it holds
    lanes: dict[int, tuple[str, ...]] = field(default_factory=dict)
    #: what serving costs the host beyond the tasks, per batch size, as calibration measured it
    #: on these workers (:mod:`staronnx.perfmodels.host`); None: left out (said in ``notes``)
    host: HostModel | None = None
    #: PUs outside every CPU group (and every CUDA driver's core): where the host's threads
    #: run without taking a worker's time; 0 when the groups cover every core
    free_pus: int = 1
    #: the runtime's layout these workers are (None: workers made by hand)
    layout: Layout | None = None

    def __post_init__(self) -> None:
        if self.models is None:
            self.models = ModelSet.of(self.plan)

    @property
    def lane_groups(self) -> dict[int, int]:
        """Lane worker id -> the id of the CPU worker on the same cores, which the lane preempts
        (the layout's: workers made by hand have no lane)."""
        return self.layout.lane_groups() if self.layout is not None else {}

    @property
    def archs(self) -> list[str]:
        return list(dict.fromkeys(w.arch for w in self.workers))

    def hosted(self, model: int | str = 0) -> HostedModel:
        """One model of the machine, by index or name."""
        assert self.models is not None
        return self.models.model(model) if isinstance(model, str) else self.models.models[model]

    def host_costs(self, batch: int) -> HostCosts | None:
        """The host's costs around a batch of ``batch`` (the nearest measured size), None
        where none were measured or the machine hosts several models (their costs are each
        plan's alone, measured apart)."""
        assert self.models is not None
        return None if self.host is None or not self.models.single else self.host.at(batch)

    @property
    def host_shares_cores(self) -> bool:
        """Whether the host's threads run on the CPU workers' cores (no PU left outside the
        groups), so their CPU time comes out of the workers'."""
        return self.free_pus == 0 and any(w.kind == "cpu" for w in self.workers)

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


#: said where a machine has no host costs (not calibrated, or several models)
NO_HOST_COSTS = ("host costs not measured for these workers (staronnx calibrate measures them): the simulation "
                 "and the LP bound leave out what serving costs the host beyond the tasks (the generator's lag, "
                 "batching, hand-overs between threads, their CPU), so they are optimistic at low rates")


#: what the host-cost model leaves out (said beside the costs)
HOST_APPROXIMATION = (
    "host costs are measured on idle workers and added as they were measured; not modelled: contention for the "
    "GIL between the host's threads and the workers' bookkeeping, and task times more variable than at "
    "calibration (others on the cores), which near the knee move the latency most")


def host_notes(machine: SimMachine) -> list[str]:
    """What the machine's host costs say, one line each (for a sweep's or a simulation's
    notes)."""
    host = machine.host
    if host is None:
        return [NO_HOST_COSTS]
    where = ("the host's threads share the workers' cores (no PU outside the CPU groups): their CPU is taken from "
             "the workers'" if machine.host_shares_cores else f"{machine.free_pus} PU(s) outside the CPU groups "
             "run the host's threads")
    lines = [f"host costs ({where}): " + "; ".join(c.describe() for _, c in sorted(host.costs.items())),
             HOST_APPROXIMATION]
    for what, load in (("host costs measured", host.probe_machine),
                       ("perf models calibrated", host.calibration_machine)):
        if load and load.get("busy"):
            lines.append(f"{what} on a busy machine: {load.get('why')}")
    return lines


def machine_inflight(machine: SimMachine, batch: int, model: int | str = 0, where: Where = None) -> int:
    """The window of ``model``'s server on this machine at ``batch``
    (:func:`~staronnx.serving.window.plan_window`, the live server's); with
    ``where`` (:func:`residency_where`), over the workers holding the model only: its batches
    can keep no other worker busy."""
    hosted = machine.hosted(model)
    mine = [w.arch for i, w in enumerate(machine.workers) if where is None or all(i in where[p] for p in hosted.parts)]
    return plan_window(machine.table, hosted.plan, batch, mine, hosted.first_part)


def residency_where(machine: SimMachine, residency: Mapping[str, str] | None) -> list[frozenset[int]] | None:
    """Per global part of ``machine``, the ids of the workers that hold it when ``residency``
    (model name -> worker selector, as ``Runtime(residency=...)`` and ``--model-workers`` take
    it) keeps some models on some workers only, or the machine has lanes; None with neither
    (every worker holds every part: the policies' unrestricted path). The live runtime's own
    rule (:meth:`~staronnx.workers.layout.Layout.holds`), so what ``staronnx serve`` refuses is
    refused here in its words."""
    if not residency and not machine.lanes:
        return None
    models = machine.models
    if models is None or machine.layout is None:
        raise SimulationError("residency and lanes need a machine laid out by build_machine")
    held = machine.layout.holds([m.name for m, _ in models.owner], dict(residency or {}))
    return [frozenset(w for w, row in enumerate(held) if row[p]) for p in range(models.k)]


def held_by(machine: SimMachine, where: Where, model: int | str) -> list[str]:
    """The names of the workers holding every part of ``model`` (all of them without ``where``),
    as the live runtime's ``stats()["models"][name]["held_by"]`` lists them."""
    hosted = machine.hosted(model)
    return [w.name for i, w in enumerate(machine.workers)
            if where is None or all(i in where[p] for p in hosted.parts)]


def build_machine(
    plan: Plan | ModelSet | Mapping[str, Plan],
    spec: MachineSpec = MachineSpec(),
    *,
    topology: Topology | None = None,
    store: PerfModelStore | None = None,
    cuda_scale: float | Sequence[float] | None = None,
    cpu_fallback: bool = True,
    arch_sources: Mapping[str, ArchSource] | None = None,
    bus: BusModel | None = None,
    host: HostModel | bool = True,
) -> SimMachine:
    """Workers from ``topology`` (default: this machine) and ``spec`` (its CPU groups, its
    ``cuda_streams`` hypothetical or real CUDA workers on each GPU of its ``cuda_devices``, and
    its lanes), with times from ``store`` (default: ``$STARONNX_HOME``).

    Each GPU is its own arch and memory node, as in the runtime. A GPU the store has no models
    or bus links for (a what-if: four GPUs where one was calibrated) takes those of the lowest
    calibrated GPU, said in ``notes``; transfers between two GPUs with no measured peer link go
    through the host (the bus model's routing), as a copy without peer access does.

    ``plan`` may be several plans (a :class:`~staronnx.runtime.models.ModelSet` or a mapping
    name -> plan): the machine then serves them as one shared runtime does, every model's
    parts numbered one after the other, each read from its own plan's stored models (nothing
    recalibrated for sharing). A per-part ``cuda_scale`` then has one factor per global part.

    The spec's ``lanes`` (model name -> CPU group selector, ``Runtime(lanes=...)``'s; see
    :mod:`staronnx.workers.lanes`) adds the runtime's latency lanes: one more worker per
    selected group, same arch, holding the lane models only (the
    simulations and bounds over this machine keep them there, :func:`residency_where`). They
    are checked first, so a bad lane is refused before any perf model is read. A lane's task
    preempts its group's worker in the simulations, and the two share the group's cores in the
    bounds (:data:`LANE_APPROXIMATION`, in ``notes``, says what is left out).

    ``host``: what serving costs the host beyond the tasks (:mod:`staronnx.perfmodels.host`):
    True reads what calibration measured on exactly these workers from ``store`` (none: said
    in ``notes``), False leaves it out, a :class:`HostModel` is used as given (a what-if).
    Several models: left out (each plan's costs were measured alone).
    """
    store = store if store is not None else PerfModelStore()
    models = plan if isinstance(plan, ModelSet) else (
        ModelSet(dict(plan)) if isinstance(plan, Mapping) else ModelSet.of(plan))
    laid = layout(spec, topology if topology is not None else Topology.from_system(), [m.name for m in models.models])
    workers = worker_infos(laid)
    lane_of = {i: w.models for i, w in enumerate(laid.workers) if w.kind == "lane"}
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
        "groups": spec.groups,
        "topology": (topology.source if topology is not None else "system") or "system",
        "cuda_streams": spec.cuda_streams,
        "cuda_devices": list(spec.cuda_devices),
        "cuda_scale": cuda_scale if not isinstance(cuda_scale, tuple) else list(cuda_scale),
        "sources": {a: s.describe() for a, s in sources.items()},
    }
    if lane_of:
        settings["lanes"] = dict(spec.lanes)
        notes.append(LANE_APPROXIMATION)
    costs = (host if isinstance(host, HostModel) else
             store.load_host(first.hash, [w.name for w in workers]) if host and models.single else None)
    settings["host_costs"] = None if costs is None else costs.layout
    settings["free_pus"] = laid.free_pus
    machine = SimMachine(first, workers, table, notes, settings, models, lane_of, costs, laid.free_pus, laid)
    if host is not False and models.single:
        notes.extend(host_notes(machine))
    return machine


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
