"""This host as partitioning needs it: the CPU workers ``Runtime`` would start here (the
devices a placement method places on, the group sizes ``shares="auto"`` times) and the bus
model ``staronnx calibrate`` stored (what a placement method prices transfers with).

Read from the same :func:`~staronnx.workers.layout.layout` the runtime starts its workers
from, so one CPU group is the same worker for the cut and the runtime.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from staronnx.partition.methods.model import Device, TransferModel
from staronnx.perfmodels import BusModel, PerfModelStore
from staronnx.workers.layout import MachineSpec, layout
from staronnx.workers.topology import Topology


def host_devices(groups: str | None = None, *, cuda: bool = False) -> list[Device]:
    """The CPU groups of a group policy, named like the workers ``Runtime(plan, MachineSpec(groups))``
    starts (``policy="static"`` finds a part's device by that name), plus ``cuda0`` when asked.

    Without a policy: one group per NUMA node where there are several, else the cores split in
    two halves (``cores=1`` on a two-core machine), so that placement has two devices.
    """
    topology = Topology.from_system()
    if not groups:
        cores = topology.allowed_cores()
        groups = "numa" if len({c.numa for c in cores}) >= 2 else f"cores={max(1, math.ceil(len(cores) / 2))}"
    devices = [Device(w.name, "cpu", w.memory_node, w.n_cores) for w in layout(MachineSpec(groups), topology).workers]
    return devices + ([Device("cuda0", "cuda", "cuda0", 1)] if cuda else [])


def cpu_group_sizes(groups: str, cuda_streams: int, cuda_devices: Sequence[int] = (0,)) -> list[int]:
    """Cores of each CPU worker ``Runtime`` would start here with these settings (each CUDA
    device's driver thread holds back a core), which ``shares="auto"`` times the model on."""
    spec = MachineSpec(groups, cuda_streams, tuple(cuda_devices))
    return [g.n_cores for g in layout(spec, Topology.from_system()).groups]


def host_transfer() -> TransferModel:
    """Transfer costs priced with this host's calibrated bus model, default links without one."""
    try:
        bus: BusModel | None = PerfModelStore().load_bus()
    except Exception:  # noqa: BLE001 - no store, no bus: the default links
        bus = None
    return TransferModel(bus=bus if bus is not None and bus.links else None)
