"""This host as partitioning needs it, and ``staronnx.partition()``, the door that reads it.

Partition sits below workers and perfmodels and takes the machine as typed values (devices,
CPU group sizes, a transfer model); the group policy strings users write (``"cores=1"``,
``"numa"``), the hwloc topology and the bus model ``staronnx calibrate`` stored are read here,
from what those layers know, so one CPU group is the same worker for the cut and the runtime.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence

import onnx

from staronnx.partition import api
from staronnx.partition.autoshares import WorkerSpeed, is_auto
from staronnx.partition.methods.model import Device, TransferModel
from staronnx.partition.methods.pipeline import PLACEMENT_METHODS
from staronnx.perfmodels import BusModel, PerfModelStore
from staronnx.plan import Plan
from staronnx.workers.groups import make_groups
from staronnx.workers.launch import worker_layout
from staronnx.workers.topology import Topology


def host_devices(groups: str | None = None, *, cuda: bool = False) -> list[Device]:
    """The CPU groups of a group policy, named like the workers ``Runtime(cpu_groups=groups)``
    starts (``policy="static"`` finds a part's device by that name), plus ``cuda0`` when asked.

    Without a policy: one group per NUMA node where there are several, else the cores split in
    two halves (``cores=1`` on a two-core machine), so that placement has two devices.
    """
    topology = Topology.from_system()
    if not groups:
        cores = topology.allowed_cores()
        groups = "numa" if len({c.numa for c in cores}) >= 2 else f"cores={max(1, math.ceil(len(cores) / 2))}"
    devices = [Device(f"cpu:{g.name}", "cpu", f"numa{g.numa if g.numa is not None else 0}", g.n_cores)
               for g in make_groups(topology, groups)]
    return devices + ([Device("cuda0", "cuda", "cuda0", 1)] if cuda else [])


def cpu_group_sizes(groups: str, cuda_streams: int, cuda_devices: Sequence[int] = (0,)) -> list[int]:
    """Cores of each CPU worker ``Runtime`` would start here with these settings (each CUDA
    device's driver thread holds back a core), which ``shares="auto"`` times the model on."""
    return [g.n_cores for g in worker_layout(Topology.from_system(), groups, cuda_streams, cuda_devices).groups]


def host_transfer() -> TransferModel:
    """Transfer costs priced with this host's calibrated bus model, default links without one."""
    try:
        bus: BusModel | None = PerfModelStore().load_bus()
    except Exception:  # noqa: BLE001 - no store, no bus: the default links
        bus = None
    return TransferModel(bus=bus if bus is not None and bus.links else None)


def partition(
    model_or_path: onnx.ModelProto | str | os.PathLike[str],
    shares: Sequence[float] | str | None = None,
    *,
    parts: int | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    method: str = "metis",
    device: str = "cpu",
    input_shapes: Sequence[str] | dict[str, Sequence[int]] | None = None,
    seed: int = 0,
    costs: str = "profile",
    profile_batch: int = 8,
    profile_runs: int = 5,
    tolerance: float = 0.02,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
    groups: str | None = None,
    cuda_streams: int = 0,
    speeds: Sequence[WorkerSpeed] | None = None,
    cuda_devices: Sequence[int] = (0,),
    batch_axes: Sequence[str] | Mapping[str, int | None] | None = None,
    batching: bool = True,
) -> Plan:
    """:func:`staronnx.partition.api.partition` on this host (``batch_axes`` and ``batching``
    set the model's batching contract where the graph cannot tell it): ``groups`` names the CPU groups
    (as for ``Runtime(cpu_groups=groups, cuda_streams=cuda_streams)``) that ``shares="auto"``
    times (default ``numa``) or that a placement method places on, beside the GPU for
    ``device="cuda"`` (default: one per NUMA node, or two halves of the cores; ``shares="auto"``
    times each GPU of ``cuda_devices``, whose rates add up); a placement
    method prices transfers with the bus model ``staronnx calibrate`` stored. Only what the
    request uses is read.
    """
    placed = method in PLACEMENT_METHODS
    timed = is_auto(shares) and speeds is None and not placed
    return api.partition(
        model_or_path, shares, parts=parts, output_dir=output_dir, method=method, device=device,
        input_shapes=input_shapes, seed=seed, costs=costs, profile_batch=profile_batch, profile_runs=profile_runs,
        tolerance=tolerance, force=force, progress=progress, speeds=speeds,
        devices=host_devices(groups, cuda=device == "cuda") if placed else None,
        cpu_group_sizes=cpu_group_sizes(groups or "numa", cuda_streams, cuda_devices) if timed else None,
        cuda_devices=cuda_devices,
        transfer=host_transfer() if placed else None, batch_axes=batch_axes, batching=batching,
    )
