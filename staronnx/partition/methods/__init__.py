"""Placement methods of the field behind the partitioner: a device per node, then parts.

``comm-sd`` (SIR+), ``duet`` (DUET), ``overseer`` (OverSeer), ``optimal`` (SIR+'s MILP with
HiGHS) and ``ort-static`` (ONNX Runtime's own CPU/GPU placement) decide where each node runs
from its cost on each device and the transfer times (:mod:`.model`), group the nodes into
parts of one device whose quotient is a DAG, and export an ordinary plan whose parts carry
their device (``PartSpec.device``) and whose ``settings["placement"]`` holds the prediction.

They are ``staronnx partition --method NAME`` (with defaults) and :func:`place` (with devices,
what-if costs and options).
"""

from staronnx.partition.methods.devices import parse_devices
from staronnx.partition.methods.heuristics import (
    Assignment,
    comm_sd,
    comm_sd_pass,
    duet,
    duet_subgraphs,
    overseer,
)
from staronnx.partition.methods.model import (
    Device,
    Problem,
    TransferModel,
    group_parts,
    makespan,
    schedule,
)
from staronnx.partition.methods.pipeline import (
    PLACEMENT_METHODS,
    Placement,
    PlacementContext,
    PlacementMethod,
    make_context,
    place,
    place_context,
    place_graph,
)

__all__ = [
    "PLACEMENT_METHODS",
    "Assignment",
    "Device",
    "Placement",
    "PlacementContext",
    "PlacementMethod",
    "Problem",
    "TransferModel",
    "comm_sd",
    "comm_sd_pass",
    "duet",
    "duet_subgraphs",
    "group_parts",
    "make_context",
    "makespan",
    "overseer",
    "parse_devices",
    "place",
    "place_context",
    "place_graph",
    "schedule",
]
