"""Devices to place on and each node's cost on each of them.

On a CPU-only machine the "devices" are CPU groups (``cores=1`` on two cores gives two). Node
costs per device come from ORT's profiler with ``intra_op_num_threads`` = the group's cores
(groups of equal size share one profile), on CUDA from a CUDA session, or from the FLOP/byte
estimate (``costs="estimate"``, divided by the group's cores). Identical groups cost the same,
so what-if tables can replace any device's costs (``device_costs``):

* a number: that device costs ``x`` times the reference costs (the first CPU device's);
* a mapping ``{op_type: factor}`` with an optional ``"*"`` default (1.0): per-op factors,
  e.g. a GPU ``{"Conv": 0.05, "MatMul": 0.05, "Gemm": 0.05, "*": 0.5}``;
* an array of µs per node: costs at the profile batch, scaled linearly to other batches;
* a callable ``f(batch, reference_us, graph) -> µs per node`` (e.g. the simulator's GPU model).

A device listed in ``devices`` that this machine does not have (a GPU on a CPU box) needs an
override, or profiling fails with the missing provider's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from staronnx.errors import PartitionError
from staronnx.partition.costs import estimated_costs, profile_costs
from staronnx.partition.cut import CutRequest
from staronnx.partition.graph import ModelGraph
from staronnx.partition.methods.model import Device

CostOverride = float | Mapping[str, float] | Sequence[float] | np.ndarray | Callable[..., Any]


def parse_devices(spec: Sequence[Device | str | Mapping[str, Any]] | None) -> list[Device]:
    """Devices from a list of :class:`Device`, dicts, or names (``"cuda0"``, ``"cpu:g0"``).

    A CPU group policy (``"cores=1"``) names this machine's groups: ``staronnx.partition()``
    turns one into devices (:func:`staronnx.partition.host.host_devices`)."""
    if spec is None or isinstance(spec, str):
        raise PartitionError(f"placement needs a list of devices, got {spec!r}; a CPU group policy "
                             "is read by staronnx.partition.host.host_devices()")
    out: list[Device] = []
    for item in spec:
        if isinstance(item, Device):
            out.append(item)
        elif isinstance(item, Mapping):
            out.append(Device(**item))
        elif isinstance(item, str):
            kind = "cuda" if item.startswith("cuda") else "cpu"
            out.append(Device(item, kind, item if kind == "cuda" else "numa0", 1))
        else:
            raise PartitionError(f"cannot read a device from {item!r}")
    names = [d.name for d in out]
    if len(set(names)) != len(names):
        raise PartitionError(f"device names must be distinct, got {names}")
    if len(out) < 1:
        raise PartitionError("placement needs at least one device")
    return out


def apply_override(
    override: CostOverride, reference: np.ndarray, graph: ModelGraph | None, batch: int, profile_batch: int
) -> np.ndarray:
    """One device's µs per node at ``batch`` from a what-if override (see the module doc)."""
    n = len(reference)
    if callable(override):
        out = np.asarray(override(batch, reference, graph), dtype=float)
    elif isinstance(override, (int, float)):
        out = reference * float(override)
    elif isinstance(override, Mapping):
        if graph is None:
            raise PartitionError("per-op-type cost factors need the model graph")
        default = float(override.get("*", 1.0))
        factors = np.array([float(override.get(node.op_type, default)) for node in graph.nodes])
        out = reference * factors
    else:
        out = np.asarray(override, dtype=float) * (batch / profile_batch)
    if out.shape != (n,) or not np.all(np.isfinite(out)) or np.any(out < 0):
        raise PartitionError(f"a device cost override must give {n} finite, non-negative µs values")
    floored: np.ndarray = np.maximum(out, 1e-3)
    return floored


def cost_tables(graph: ModelGraph, devices: Sequence[Device], batches: Sequence[int],
                request: CutRequest) -> dict[int, np.ndarray]:
    """Per batch, an (n, devices) array of µs per node, as ``request`` asks (its ``costs``
    source, ``profile_runs``, ``profile_batch``, ``input_shapes``, ``seed`` and ``device_costs``)."""
    source, runs, profile_batch = request.costs, request.profile_runs, request.profile_batch
    say, overrides = request.progress, dict(request.device_costs or {})
    unknown = set(overrides) - {d.name for d in devices}
    if unknown:
        raise PartitionError(
            f"device_costs names unknown device(s) {sorted(unknown)}; devices are {[d.name for d in devices]}"
        )
    if source not in ("profile", "estimate"):
        raise PartitionError(f"unknown cost source {source!r}; use 'profile' or 'estimate'")
    tables: dict[int, np.ndarray] = {}
    for b in batches:
        cache: dict[tuple[str, int], np.ndarray] = {}

        def measured(dev: Device, b: int = b, cache: dict[tuple[str, int], np.ndarray] = cache) -> np.ndarray:
            key = (dev.kind, dev.cores)
            if key not in cache:
                if source == "estimate":
                    if dev.kind != "cpu":
                        raise PartitionError(
                            f"no cost estimate for {dev.name} ({dev.kind}); give device_costs for it "
                            "or profile (costs='profile') on a machine that has it"
                        )
                    cache[key] = np.maximum(estimated_costs(graph, b).micros / max(dev.cores, 1), 1e-3)
                else:
                    say(f"profiling {len(graph)} nodes on {dev.name} ({dev.cores} thread(s), batch {b})")
                    # the partitioner's own profiling, with the device's threads
                    cache[key] = profile_costs(graph, device=dev.kind, batch=b, runs=runs,
                                               input_shapes=request.input_shapes, seed=request.seed,
                                               threads=int(dev.cores) if dev.kind == "cpu" else None).micros
            costs: np.ndarray = cache[key]
            return costs

        def column(dev: Device, reference: np.ndarray, b: int) -> np.ndarray:
            if dev.name in overrides:
                return apply_override(overrides[dev.name], reference, graph, b, profile_batch)
            return measured(dev)

        ref_dev = next((d for d in devices if d.kind == "cpu" and d.name not in overrides), None)
        if ref_dev is None:
            ref_dev = next((d for d in devices if d.kind == "cpu"), None) or Device("cpu:ref", "cpu", "numa0", 1)
        reference = measured(ref_dev)
        tables[b] = np.stack([column(d, reference, b) for d in devices], axis=1)
    return tables
