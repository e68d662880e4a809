"""Starting a machine's workers: CPU groups plus CUDA stream workers, laid out like StarPU's.

StarPU gives every CUDA driver thread a CPU core of its own ("GPU driver threads each take a
CPU core": ``STARPU_NCPU`` excludes them), and by default one thread drives every stream of a
device (``STARPU_CUDA_THREAD_PER_DEV``; the native engine does the same, see
:attr:`~staronnx.workers.cuda.CudaWorker.driver_key`).  A GPU driver is host-bound at the batch
sizes of inference — it copies, launches kernels and waits on events from Python — so an ONNX
Runtime thread pool spinning on the same core slows the GPU down by more than the CPU workers
add: the H100 measurements of issue 11 had GPU+CPU at 0.90x GPU alone.  So, unless the group
policy says otherwise, one core per driver thread is held back (``reserve=N``: one per device,
or one per stream with ``thread_per_stream``) and the device's workers are pinned to it.  A
policy that names ``reserve=`` or an explicit PU list keeps what it says; a machine too small
to spare a core per driver reserves what it can and leaves the CPU groups at least one core.
The policy ``none`` starts CUDA workers only (GPU alone, the baseline CPU help is judged
against).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from staronnx.workers.groups import CpuGroups, GroupError, make_groups, policy_reserve
from staronnx.workers.lanes import check_preempt, plan_lanes
from staronnx.workers.residency import ResidencyError, WorkerSlot, model_holders
from staronnx.workers.topology import Topology

__all__ = ["NO_CPU", "WorkerLayout", "worker_layout", "start_workers"]

log = logging.getLogger(__name__)

#: the group policy of a GPU-only runtime: CUDA workers and no CPU worker
NO_CPU = "none"


@dataclass(frozen=True)
class WorkerLayout:
    """Which cores the CPU workers own and which PU each CUDA worker's thread runs on."""

    groups: CpuGroups
    #: (device id, stream index, PU to pin the worker thread to or None), in worker order.
    cuda: tuple[tuple[int, int, int | None], ...]

    @property
    def policy(self) -> str:
        """The group policy actually applied (with the automatic ``reserve=N`` when added)."""
        return self.groups.policy


def cuda_ordinals(cuda_devices: Sequence[int]) -> tuple[int, ...] | None:
    """``cuda_devices`` as CUDA ordinals, each once, or None when they are not (the one rule of
    ``Runtime`` and the simulator; neither checks this machine's GPUs here: the runtime's
    workers do at start, and a simulated machine may have more)."""
    try:
        devices = tuple(int(d) for d in cuda_devices)
    except (TypeError, ValueError):
        return None
    if not devices or min(devices) < 0 or len(set(devices)) != len(devices):
        return None
    return devices


def worker_layout(
    topology: Topology, groups: str = "numa", cuda_streams: int = 0, cuda_devices: Sequence[int] = (0,),
    thread_per_stream: bool = False,
) -> WorkerLayout:
    """The CPU groups and CUDA worker pins for ``groups`` with ``cuda_streams`` per device: one
    reserved core per driver thread (per device, or per stream with ``thread_per_stream``)."""
    if cuda_streams < 0:
        raise ValueError(f"cuda_streams must be >= 0, got {cuda_streams}")
    n_cuda = cuda_streams * len(cuda_devices)
    if groups.strip().lower() == NO_CPU:
        if not n_cuda:
            raise GroupError("CPU groups 'none' leaves no worker at all: add CUDA streams (--cuda-streams N)")
        cuda = tuple((d, s, None) for d in cuda_devices for s in range(cuda_streams))
        return WorkerLayout(CpuGroups(NO_CPU, ()), cuda)
    policy = groups
    streams = [(d, s) for d in cuda_devices for s in range(cuda_streams)]
    drivers = [(d, s if thread_per_stream else 0) for d, s in streams]  # each stream's driver thread
    threads = list(dict.fromkeys(drivers))  # one per device, or one per stream
    if n_cuda and policy_reserve(groups) is None:
        spare = len(topology.allowed_cores()) - 1  # the CPU groups keep at least one core
        reserve = min(len(threads), max(spare, 0))
        if reserve:
            policy = f"{groups},reserve={reserve}"
    cpu_groups = make_groups(topology, policy)
    reserved = [pus[0] for pus in cpu_groups.reserved if pus]
    pin = {t: reserved[i % len(reserved)] if reserved else None for i, t in enumerate(threads)}
    cuda = tuple((d, s, pin[driver]) for (d, s), driver in zip(streams, drivers))
    return WorkerLayout(cpu_groups, cuda)


def start_workers(
    plan: Any,
    groups: str = "numa",
    cuda_streams: int = 0,
    cuda_devices: Sequence[int] = (0,),
    *,
    topology: Topology | None = None,
    cuda_options: dict[str, Any] | None = None,
    residency: Mapping[str, str] | None = None,
    lanes: Mapping[str, str] | None = None,
    lane_preempt: str = "idle",
) -> list[Any]:
    """Started workers for ``plan``: CUDA stream workers first (StarPU's order), then one CPU
    worker per group of :func:`worker_layout`.  On any failure the ones already started are
    closed, so a bad request leaves no thread behind.  ``cuda_options`` go to every
    :class:`~staronnx.workers.cuda.CudaWorker` (e.g. ``runtime=HostRuntime()`` to run the CUDA
    pipeline on the CPU provider). ``residency`` (model name -> worker selector, see
    :mod:`staronnx.workers.residency`) loads those models only on the workers selected; the
    others hold no session of them. ``lanes`` (model name -> CPU group selector, see
    :mod:`staronnx.workers.lanes`) adds a lane worker on each selected group, after the CPU
    workers, holding those models only; the groups' own workers then run at a lower OS
    priority (``lane_preempt``: ``idle`` or ``nice``), so a lane task preempts theirs."""
    from staronnx.workers.cpu import CpuWorker

    topology = topology or Topology.from_system()
    per_stream = bool((cuda_options or {}).get("thread_per_stream", False))
    layout = worker_layout(topology, groups, cuda_streams, cuda_devices, thread_per_stream=per_stream)
    slots = [WorkerSlot(f"cuda{d}.s{s}", "cuda", d) for d, s, _ in layout.cuda]
    cpu_slots = [WorkerSlot(f"cpu:{g.name}", "cpu") for g in layout.groups]
    slots += cpu_slots
    lane_plan = plan_lanes(lanes or {}, list(dict.fromkeys(part_models(plan))), cpu_slots)
    check_preempt(lane_preempt)
    slots += lane_plan.slots(cpu_slots)
    parts = held_part_paths(plan, residency or {}, slots, {len(slots) - len(lane_plan.lanes) + k: models
                                                           for k, (_, models) in enumerate(lane_plan.lanes)})
    workers: list[Any] = []
    try:
        if layout.cuda:
            from staronnx.workers.cuda import CudaWorker

            pool = None  # one pinned pool for every CUDA worker (pinned memory is portable)
            memories: dict[int, Any] = {}  # one memory node per GPU, shared by its streams
            for i, (device, stream, pu) in enumerate(layout.cuda):
                make = functools.partial(CudaWorker, device, stream, cpu=pu, pinned_pool=pool, name=slots[i].name,
                                         device_memory=memories.get(device),
                                         **(cuda_options or {}))  # given its part paths
                worker = start_fitting(make, parts[i], plan)
                pool = worker.pinned_pool
                memories.setdefault(device, worker.device_memory)
                workers.append(worker)
        for j, group in enumerate(layout.groups, start=len(layout.cuda)):
            lowered = lane_preempt if j - len(layout.cuda) in lane_plan.groups else None
            worker = CpuWorker(group, parts[j], topology=topology, name=slots[j].name, lowered=lowered)
            workers.append(worker)
            worker.start()
        for k, (slot, _) in enumerate(lane_plan.lanes):
            j = len(layout.cuda) + len(layout.groups) + k
            worker = CpuWorker(layout.groups[slot], parts[j], topology=topology, name=slots[j].name)
            workers.append(worker)
            worker.start()
        check_every_model_held(plan, workers)
    except BaseException:
        for w in workers:
            try:
                w.close()
            except Exception:  # noqa: BLE001 - close the others anyway; the first error wins
                pass
        raise
    return workers


def held_part_paths(plan: Any, residency: Mapping[str, str], slots: Sequence[WorkerSlot],
                    lanes: Mapping[int, Sequence[str]] | None = None) -> list[list[Path | None]]:
    """Per worker slot, its part files by global part number, None for the parts of a model
    ``residency`` keeps off it (a plan, or the models of a ModelSet, by name). ``lanes``: the
    slots that are lanes, each holding its models only; a model with lanes is held by its
    lanes alone unless ``residency`` names other workers for it too (``light=lane,cpu``): on
    a shared worker its task could wait for, and run at the priority of, the heavy model's."""
    lanes = lanes or {}
    paths = [plan.part_path(i) for i in range(plan.k)]
    owner = part_models(plan)
    laned = {m for models in lanes.values() for m in models}
    holders = model_holders(residency, list(dict.fromkeys(owner)), slots) if residency else {}
    for model, held in holders.items():
        if model not in laned and held and all(i in lanes for i in held):
            raise ResidencyError(f"--model-workers {model}={residency[model]}: lanes hold only the models given a "
                                 f"lane (--lane {model}), so {model!r} would be held by no worker")

    def held(i: int, model: str) -> bool:
        if i in lanes:
            return model in lanes[i]
        if model in holders:
            return i in holders[model]
        return model not in laned  # a lane model runs on its lanes unless residency adds workers

    return [[path if held(i, owner[p]) else None for p, path in enumerate(paths)] for i in range(len(slots))]


def start_fitting(make: Any, paths: list[Path | None], plan: Any) -> Any:
    """A started CUDA worker made by ``make(paths)``; in a runtime of several models, a model
    whose part does not fit in the GPU's memory (:class:`~staronnx.workers.cuda.PartDoesNotFit`)
    is left off this worker, with a warning, and the worker starts with the others (the
    runtime's other workers run that model; :func:`check_every_model_held` refuses a model
    that no worker holds). A single model that does not fit is an error, as before."""
    from staronnx.workers.cuda import PartDoesNotFit

    owner = part_models(plan)
    paths = list(paths)
    while True:
        worker = make(paths)
        try:
            return worker.start()
        except PartDoesNotFit as exc:
            model = owner[exc.part]
            if len(set(owner)) == 1:
                raise
            log.warning("%s: model %r is left off this worker: %s; the workers that hold it run it",
                        exc.worker, model, exc)
            for p, name in enumerate(owner):
                if name == model:
                    paths[p] = None
            if all(p is None for p in paths):
                raise PartDoesNotFit(exc.worker, exc.part, Path(str(plan.part_path(exc.part))),
                                     "no model fits in its memory") from exc


def check_every_model_held(plan: Any, workers: Sequence[Any]) -> None:
    """Refuse a runtime in which some model is held by no worker (every worker that was to
    hold it had no memory left for it), naming the model."""
    owner = part_models(plan)
    for model in dict.fromkeys(owner):
        parts = {p for p, name in enumerate(owner) if name == model}
        if not any(getattr(w, "holds", None) is None or parts <= w.holds for w in workers):
            raise GroupError(f"no worker holds model {model!r}: it fits in no GPU's memory and no CPU group "
                             "was given it (give it CPU workers: --model-workers NAME=cpu, or --groups)")


def part_models(plan: Any) -> list[str]:
    """The model each global part belongs to, by name: a runtime's ModelSet names them (its
    ``owner``); a plain plan is one model (workers sit below the runtime's layer, so this
    reads the ModelSet's shape rather than importing it)."""
    owner = getattr(plan, "owner", None)
    if owner is None:
        return [""] * plan.k
    return [model.name for model, _ in owner]
