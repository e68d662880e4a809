"""A repository model's ``instance_group`` mapped onto the server's workers.

Triton makes ``count`` copies of a model per group (per GPU listed, for ``KIND_GPU``), each a
thread that runs one batch at a time. staronnx has one set of workers for every model, CUDA
streams and CPU groups, each holding a session of the models it may run, and its policy places
each task on one of them. So an instance here is a worker that holds the model:

* ``KIND_GPU`` with ``count: N``: the first N CUDA streams of each GPU in ``gpus`` (every GPU of
  the server when it lists none); without a count, every stream of those GPUs. A GPU the server
  does not drive (``--cuda-devices``), or more instances on a GPU than the server has streams
  on it (``--cuda-streams``), is refused, saying which flag to raise;
* ``KIND_CPU`` with ``count: N``: the first N CPU groups (``--groups``; their ORT sessions use
  every core of their group); without a count, every group. More than the server has is
  refused; ``gpus`` on a CPU group too;
* ``KIND_AUTO``: without a count or GPUs, every worker (the policy picks per task, GPU or CPU);
  with them, as ``KIND_GPU`` where the server has CUDA streams and ``KIND_CPU`` where it has
  none, as Triton resolves it;
* several groups add up: two ``KIND_CPU`` groups of one are two CPU groups, a ``KIND_GPU``
  group beside a ``KIND_CPU`` one gives the model both.

The result is a ``--model-workers`` selector (:mod:`staronnx.workers.residency`): the model's
sessions are made on those workers only, and its tasks run there, still shared with the
other models those workers hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from staronnx.errors import StaronnxError
from staronnx.workers.residency import WorkerSlot


class InstanceError(StaronnxError):
    """An instance group this server's workers cannot give the model: the message says which flag
    gives it."""


@dataclass(frozen=True)
class InstanceGroup:
    """One ``instance_group`` entry of a config."""

    #: where it is in the config, for messages (``instance_group[0] 'fast'``)
    where: str
    #: ``cpu``, ``gpu`` or ``auto``
    kind: str
    #: instances asked for (None: the config gives no count)
    count: int | None = None
    #: the GPUs of a KIND_GPU group, by CUDA ordinal (empty: every GPU of the server)
    gpus: tuple[int, ...] = ()


def holders(groups: Sequence[InstanceGroup], workers: Sequence[WorkerSlot]) -> str | None:
    """The ``--model-workers`` selector of the workers (CUDA streams and CPU groups of the server,
    in its order) that hold a model with these instance groups; None where every worker does."""
    if not groups:
        return None
    cuda = [w for w in workers if w.kind == "cuda"]
    cpus = [w for w in workers if w.kind == "cpu"]
    devices = sorted({w.device for w in cuda if w.device is not None})
    per_gpu: dict[int, int | None] = {}  # GPU -> streams wanted (None: all)
    cpu_count: int | None = 0  # None: all
    for group in groups:
        kind = group.kind
        if kind == "auto":
            if group.count is None and not group.gpus:
                return None  # any worker: the policy picks
            kind = "gpu" if cuda else "cpu"
        if kind == "cpu":
            if group.gpus:
                raise InstanceError(f"{group.where}: gpus {list(group.gpus)} go with KIND_GPU; remove them from this "
                                    "KIND_CPU group or make it KIND_GPU")
            cpu_count = None if cpu_count is None or group.count is None else cpu_count + group.count
            continue
        if not cuda:
            raise InstanceError(f"{group.where} KIND_GPU: this server has no CUDA workers (start it with "
                                "--cuda-streams N)")
        for gpu in group.gpus or devices:
            if gpu not in devices:
                raise InstanceError(f"{group.where}: GPU {gpu} is not one this server drives (GPUs "
                                    f"{', '.join(map(str, devices))}; give it in --cuda-devices, or list those)")
            have = per_gpu.get(gpu, 0)
            per_gpu[gpu] = None if have is None or group.count is None else have + group.count
    chosen: list[WorkerSlot] = []
    for gpu, wanted in sorted(per_gpu.items()):
        streams = [w for w in cuda if w.device == gpu]
        if wanted is not None and wanted > len(streams):
            raise InstanceError(f"instance_group: {wanted} instance(s) on GPU {gpu}, but this server has "
                                f"{len(streams)} CUDA stream(s) per GPU (--cuda-streams {len(streams)}): start it "
                                f"with --cuda-streams {wanted} or more, or lower the count")
        chosen += streams if wanted is None else streams[:wanted]
    if cpu_count is None or cpu_count > 0:
        if cpu_count is not None and cpu_count > len(cpus):
            names = ", ".join(w.name for w in cpus) or "none"
            raise InstanceError(f"instance_group: {cpu_count} KIND_CPU instance(s), but this server has {len(cpus)} "
                                f"CPU group(s) ({names}; --groups): give --groups that make {cpu_count} groups "
                                "(cores=N, or a list of PUs such as 0-3;4-7), or lower the count")
        chosen += cpus if cpu_count is None else cpus[:cpu_count]
    if not chosen:
        raise InstanceError("instance_group: KIND_CPU, but this server has no CPU groups (--groups none): give it CPU "
                            "groups, or make the group KIND_GPU")
    if len(chosen) == len(cuda) + len(cpus):
        return None
    if chosen == cpus:
        return "cpu"
    if chosen == cuda:
        return "cuda"
    return ",".join(w.name for w in chosen)
