"""Starting a machine's workers: the :func:`~staronnx.workers.layout.layout` of a
:class:`~staronnx.workers.layout.MachineSpec`, each worker holding the parts of the models the
layout gives it. The layout module says why CUDA driver threads get cores of their own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from staronnx.plan import Plan, arch_part_path
from staronnx.workers.base import ThreadWorker
from staronnx.workers.groups import GroupError
from staronnx.workers.layout import MachineSpec, layout
from staronnx.workers.replicas import DeviceMemory
from staronnx.workers.topology import Topology

if TYPE_CHECKING:
    from staronnx.workers.cuda import CudaOptions

__all__ = ["ServedModels", "start_workers", "part_models"]

log = logging.getLogger(__name__)


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class ServedModels(Protocol):
    """A runtime's :class:`~staronnx.runtime.models.ModelSet` as workers read it (it sits in the
    layer above them): its global parts, each one's file and the model it belongs to."""

    @property
    def k(self) -> int: ...

    @property
    def owner(self) -> Sequence[tuple[_Named, int]]: ...

    def part_path(self, part: int) -> Path: ...


def start_workers(plan: Plan | ServedModels, spec: MachineSpec, *, topology: Topology | None = None,
                  cuda_options: CudaOptions | Mapping[str, Any] | None = None) -> list[ThreadWorker]:
    """Started workers for ``plan`` laid out as ``spec`` asks. On any failure the ones already
    started are closed, so a bad request leaves no thread behind. ``cuda_options`` go to every
    :class:`~staronnx.workers.cuda.CudaWorker` (e.g. ``runtime=HostRuntime()`` to run the CUDA
    pipeline on the CPU provider); their ``cuda_graphs`` and ``thread_per_stream``, where
    given, override the spec's. A model that ``residency`` keeps off a worker has no session
    there; a lane holds its models only, and the CPU workers of its group run lowered
    (``lane_preempt``) so that a lane task preempts theirs."""
    from staronnx.workers.cpu import CpuWorker
    from staronnx.workers.cuda import CudaOptions, CudaWorker

    # a mapping's cuda_graphs and thread_per_stream, where given, override the machine's
    options = CudaOptions.of(cuda_options, cuda_graphs=spec.cuda_graphs, thread_per_stream=spec.thread_per_stream)
    spec = replace(spec, cuda_graphs=options.cuda_graphs, thread_per_stream=options.thread_per_stream)
    topology = topology or Topology.from_system()
    owner = part_models(plan)
    laid = layout(spec, topology, list(dict.fromkeys(owner)))
    paths = [[plan.part_path(p) if held else None for p, held in enumerate(row)] for row in laid.holds(owner)]
    workers: list[ThreadWorker] = []
    # weights are shared (one mapped copy) between the CPU workers of a NUMA node; a worker
    # alone on its node loads its parts as a plain session does (nothing to share)
    per_node = Counter(place.group.numa for place in laid.workers if place.group is not None)
    try:
        pool = None  # one pinned pool for every CUDA worker (pinned memory is portable)
        memories: dict[int, DeviceMemory] = {}  # one memory node per GPU, shared by its streams
        for place, parts in zip(laid.workers, paths):
            if place.device is not None:
                make = functools.partial(CudaWorker, place, options=options, pinned_pool=pool,
                                         device_memory=memories.get(place.device))
                # a plan with --precision gpu=fp16 has its own part files for the CUDA workers
                parts = [None if p is None else arch_part_path(p, "cuda") for p in parts]
                cuda = start_fitting(make, parts, plan)
                pool = cuda.pinned_pool
                memories.setdefault(place.device, cuda.device_memory)
                workers.append(cuda)
                continue
            assert place.group is not None  # a CPU worker or a lane
            cpu = CpuWorker(place.group, parts, topology=topology, name=place.name,
                            lowered=spec.lane_preempt if place.lowered else None,
                            share_weights=per_node[place.group.numa] > 1)
            workers.append(cpu)
            cpu.start()
        check_every_model_held(owner, workers)
    except BaseException:
        for w in workers:
            with contextlib.suppress(Exception):  # close the others anyway; the first error wins
                w.close()
        raise
    return workers


def start_fitting(make: Callable[[list[Path | None]], Any], paths: list[Path | None], plan: Plan | ServedModels) -> Any:
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
                raise PartDoesNotFit(exc.worker, exc.part, exc.path, "no model fits in its memory") from exc


def check_every_model_held(owner: Sequence[str], workers: Sequence[ThreadWorker]) -> None:
    """Refuse a runtime in which some model (``owner``: each part's) is held by no worker (every
    worker that was to hold it had no memory left for it), naming the model."""
    for model in dict.fromkeys(owner):
        parts = {p for p, name in enumerate(owner) if name == model}
        if not any(w.holds is None or parts <= w.holds for w in workers):
            raise GroupError(f"no worker holds model {model!r}: it fits in no GPU's memory and no CPU group "
                             "was given it (give it CPU workers: --model-workers NAME=cpu, or --groups)")


def part_models(plan: Plan | ServedModels) -> list[str]:
    """The model each global part belongs to, by name: a plan is one model (named "")."""
    if isinstance(plan, Plan):
        return [""] * plan.k
    return [model.name for model, _ in plan.owner]
