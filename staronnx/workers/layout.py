"""The machine a run asks for, as one value, and the one place its workers get their names.

A :class:`MachineSpec` is what ``Runtime(...)``, ``staronnx serve``, the simulator, the LP bound
and ``staronnx topology`` are asked for (CPU groups, CUDA streams and devices, graphs, lanes,
residency); :func:`layout` turns it, on one topology, into the workers a runtime starts, in
StarPU's order (CUDA streams first, GPU by GPU, then the CPU groups, then the lanes), each with
its name, arch, memory node, cores and, for a CUDA worker, the core its driver thread is pinned
to. Whoever needs a worker's name or kind reads it here, so nothing parses it back from a
``"lane:"`` or ``"cuda"`` prefix.

StarPU gives every CUDA driver thread a CPU core of its own ("GPU driver threads each take a
CPU core": ``STARPU_NCPU`` excludes them), and by default one thread drives every stream of a
device (``STARPU_CUDA_THREAD_PER_DEV``). A GPU driver is host-bound at the batch sizes of
inference (it copies, launches kernels and waits on events from Python), so an ONNX Runtime
thread pool spinning on the same core slows the GPU down by more than the CPU workers add: the
H100 measurements of issue 11 had GPU+CPU at 0.90x GPU alone. So, unless the group policy says
otherwise, one core per driver thread is held back (``reserve=N``: one per device, or one per
stream with ``thread_per_stream``) and the device's workers are pinned to it. A policy that
names ``reserve=`` or an explicit PU list keeps what it says; a machine too small to spare a
core per driver reserves what it can and leaves the CPU groups at least one core. The policy
``none`` starts CUDA workers only (GPU alone, the baseline CPU help is judged against).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from staronnx.errors import StaronnxError
from staronnx.workers.groups import DEFAULT_POLICY, CpuGroup, CpuGroups, GroupError, make_groups, policy_reserve
from staronnx.workers.lanes import check_preempt, plan_lanes
from staronnx.workers.residency import ResidencyError, WorkerSlot, model_holders
from staronnx.workers.topology import Topology

__all__ = ["NO_CPU", "MachineError", "MachineSpec", "Layout", "WorkerPlace", "cuda_ordinals", "layout"]

#: the group policy of a GPU-only runtime: CUDA workers and no CPU worker
NO_CPU = "none"


class MachineError(StaronnxError, ValueError):
    """Settings that describe no machine (negative streams, a GPU named twice, ...)."""


def cuda_ordinals(cuda_devices: Sequence[int]) -> tuple[int, ...] | None:
    """``cuda_devices`` as CUDA ordinals, each once, or None when they are not."""
    try:
        devices = tuple(int(d) for d in cuda_devices)
    except (TypeError, ValueError):
        return None
    if not devices or min(devices) < 0 or len(set(devices)) != len(devices):
        return None
    return devices


@dataclass(frozen=True)
class MachineSpec:
    """The workers a run asks for. Checked when made, so every door refuses the same settings
    in the same words."""

    #: CPU group policy (:mod:`staronnx.workers.groups`), or ``none`` for CUDA workers only
    groups: str = DEFAULT_POLICY
    #: CUDA workers (streams) per GPU of ``cuda_devices``
    cuda_streams: int = 0
    #: the GPUs, by CUDA ordinal, each once (kept as a tuple; not checked against this machine's:
    #: a simulated one may have more)
    cuda_devices: Sequence[int] = (0,)
    #: capture each (part, batch size) as a CUDA graph and replay it
    cuda_graphs: bool = True
    #: a driver thread (and a held-back core) per stream rather than per device
    thread_per_stream: bool = False
    #: model name -> the workers that load it (:mod:`staronnx.workers.residency`); others: all
    residency: Mapping[str, str] = field(default_factory=dict)
    #: model name -> the CPU groups that get a lane for it (:mod:`staronnx.workers.lanes`)
    lanes: Mapping[str, str] = field(default_factory=dict)
    #: how the lanes' groups' shared workers yield to them: ``idle`` (SCHED_IDLE) or ``nice``
    lane_preempt: str = "idle"

    def __post_init__(self) -> None:
        if self.cuda_streams < 0:
            raise MachineError(f"cuda_streams must be >= 0, got {self.cuda_streams}")
        devices = cuda_ordinals(self.cuda_devices)
        if devices is None:
            given = list(self.cuda_devices) if isinstance(self.cuda_devices, (list, tuple)) else self.cuda_devices
            raise MachineError(f"cuda_devices must name each GPU once, by its CUDA ordinal (0, 1, ...); got {given!r}")
        check_preempt(self.lane_preempt)
        object.__setattr__(self, "cuda_devices", devices)
        object.__setattr__(self, "residency", dict(self.residency))
        object.__setattr__(self, "lanes", dict(self.lanes))


@dataclass(frozen=True)
class WorkerPlace:
    """One worker of a layout, as the runtime starts it and the simulator, the bound and
    ``staronnx topology`` show it."""

    name: str  # cuda0.s1, cpu:numa0, lane:numa0
    kind: str  # "cuda", "cpu", or "lane" (a CPU worker of its own for some models)
    arch: str  # the perf models it runs on: cuda<d>, cpu<cores>
    memory_node: str  # cuda<d>, numa<n>
    n_cores: int
    #: a CUDA worker's GPU and stream, and the PU its driver thread is pinned to (None: not pinned)
    device: int | None = None
    stream: int = 0
    pu: int | None = None
    #: a CPU worker's or lane's cores
    group: CpuGroup | None = None
    #: a lane: the index of its group's CPU worker, and the models it holds
    beside: int | None = None
    models: tuple[str, ...] = ()
    #: a CPU worker whose group has a lane: it runs at a lower OS priority, so the lane preempts it
    lowered: bool = False

    @property
    def policy_kind(self) -> str:
        """The kind the scheduling policies see: a lane is a CPU worker to them."""
        return "cpu" if self.kind == "lane" else self.kind

    @property
    def slot(self) -> WorkerSlot:
        return WorkerSlot(self.name, self.kind, self.device)


@dataclass(frozen=True)
class Layout:
    """The workers of a :class:`MachineSpec` on one topology, in the runtime's order."""

    spec: MachineSpec
    topology: Topology
    groups: CpuGroups
    workers: tuple[WorkerPlace, ...]

    @property
    def free_pus(self) -> int:
        """PUs the process may run on that no CPU group owns and no CUDA driver thread is pinned
        to: where the load generator, the batcher and the engine's hand-overs run."""
        used = {p for g in self.groups for p in g.pus} | set(self.groups.reserved_pus)
        return len(set(self.topology.allowed_pus) - used)

    @property
    def policy(self) -> str:
        """The group policy actually applied (with the automatic ``reserve=N`` when added)."""
        return self.groups.policy

    @property
    def cuda(self) -> tuple[WorkerPlace, ...]:
        return tuple(w for w in self.workers if w.kind == "cuda")

    def lane_groups(self) -> dict[int, int]:
        """Lane index -> the index of the CPU worker on the same cores (preempted while it runs)."""
        return {i: w.beside for i, w in enumerate(self.workers) if w.beside is not None}

    def holds(self, owner: Sequence[str], residency: Mapping[str, str] | None = None) -> list[list[bool]]:
        """Per worker, per global part (``owner``: the model of each), whether it loads it.
        ``residency`` (default the spec's) keeps a model on the workers it selects; a lane
        holds its models only, and a model with lanes is held by its lanes alone unless
        ``residency`` names other workers too (``light=lane,cpu``): on a shared worker its
        task could wait for, and run at the priority of, the heavy model's."""
        residency = self.spec.residency if residency is None else residency
        lanes = {i: w.models for i, w in enumerate(self.workers) if w.kind == "lane"}
        laned = {m for models in lanes.values() for m in models}
        holders = model_holders(residency, list(dict.fromkeys(owner)), [w.slot for w in self.workers]) \
            if residency else {}
        for model, picked in holders.items():
            if model not in laned and picked and all(i in lanes for i in picked):
                raise ResidencyError(f"--model-workers {model}={residency[model]}: lanes hold only the models given "
                                     f"a lane (--lane {model}), so {model!r} would be held by no worker")

        def held(i: int, model: str) -> bool:
            if i in lanes:
                return model in lanes[i]
            if model in holders:
                return i in holders[model]
            return model not in laned  # a lane model runs on its lanes unless residency adds workers

        return [[held(i, m) for m in owner] for i in range(len(self.workers))]


def cuda_place(device: int = 0, stream: int = 0, pu: int | None = None) -> WorkerPlace:
    """The place of stream ``stream`` of GPU ``device`` (its driver thread pinned to ``pu``)."""
    return WorkerPlace(f"cuda{device}.s{stream}", "cuda", f"cuda{device}", f"cuda{device}", 1, device=device,
                       stream=stream, pu=pu)


def _cpu_place(group: CpuGroup, kind: str = "cpu", beside: int | None = None, models: tuple[str, ...] = (),
               lowered: bool = False) -> WorkerPlace:
    numa = group.numa if group.numa is not None else 0
    return WorkerPlace(f"{kind}:{group.name}", kind, f"cpu{group.n_cores}", f"numa{numa}", group.n_cores,
                       group=group, beside=beside, models=models, lowered=lowered)


def layout(spec: MachineSpec, topology: Topology, models: Sequence[str] = ()) -> Layout:
    """The workers ``spec`` starts on ``topology``: CUDA streams (GPU by GPU), CPU groups, then a
    lane per CPU group a lane of ``spec.lanes`` selects (``models``: the models served, in part
    order, which lanes are checked against)."""
    streams = [(d, s) for d in spec.cuda_devices for s in range(spec.cuda_streams)]
    if spec.groups.strip().lower() == NO_CPU:
        if not streams:
            raise GroupError("CPU groups 'none' leaves no worker at all: add CUDA streams (--cuda-streams N)")
        groups = CpuGroups(NO_CPU, ())
        pin: dict[tuple[int, int], int | None] = {}
    else:
        drivers = [(d, s if spec.thread_per_stream else 0) for d, s in streams]  # each stream's driver thread
        threads = list(dict.fromkeys(drivers))  # one per device, or one per stream
        policy = spec.groups
        if streams and policy_reserve(spec.groups) is None:
            reserve = min(len(threads), max(len(topology.allowed_cores()) - 1, 0))  # CPU groups keep a core
            if reserve:
                policy = f"{spec.groups},reserve={reserve}"
        groups = make_groups(topology, policy)
        reserved = [pus[0] for pus in groups.reserved if pus]
        by_thread = {t: reserved[i % len(reserved)] if reserved else None for i, t in enumerate(threads)}
        pin = {stream: by_thread[driver] for stream, driver in zip(streams, drivers)}
    places = [cuda_place(d, s, pin.get((d, s))) for d, s in streams]
    first_cpu = len(places)
    lane_plan = plan_lanes(spec.lanes, list(models), [_cpu_place(g).slot for g in groups])
    laned = lane_plan.groups
    places += [_cpu_place(g, lowered=i in laned) for i, g in enumerate(groups)]
    places += [_cpu_place(groups[i], "lane", beside=first_cpu + i, models=held) for i, held in lane_plan.lanes]
    return Layout(spec, topology, groups, tuple(places))
