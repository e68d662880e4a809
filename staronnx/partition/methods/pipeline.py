"""From a model to a placed plan: costs per device, a device per node, parts, export.

    from staronnx.partition.methods import place
    from staronnx.partition.host import host_devices
    plan = place("model.onnx", PartitionSpec(method="comm-sd"), output_dir="plan/",
                 devices=host_devices("cores=1"), device_costs={"cpu:numa0.core1": 0.5},
                 options={"alpha_us": 100})

Steps: (1) the devices (typed: this machine's CPU groups and GPU are read by the doors, above
this layer) and every node's cost on each at batch 1 and 8 (profiled with the device's
threads, estimated, or what-if tables); transfers from the given model (default links unless
it carries a calibrated bus); (2) the method puts every node on a device
from the costs at the decision batch (``batch``, default the profile batch); (3)
:func:`~staronnx.partition.methods.model.group_parts` makes parts of one device each whose
quotient is a DAG; (4) the plan is exported as every other plan, with each part's device
(``PartSpec.device``) and the method's report — predicted makespan of the parts at batch 1
and 8, node-level makespan, the method's own figures — under ``settings["placement"]``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import onnx

from staronnx.contract import parse_batch_axes
from staronnx.errors import DeviceError, PartitionError
from staronnx.partition.spec import PartitionSpec
from staronnx.modelio import load_model
from staronnx.partition.costs import NodeCosts
from staronnx.partition.cut import CutRequest, Parts, plan_settings
from staronnx.partition.export import write_plan
from staronnx.partition.graph import ModelGraph, build_graph, check_batch_axes
from staronnx.partition.methods.devices import CostOverride, cost_tables, parse_devices
from staronnx.partition.methods.heuristics import Assignment, comm_sd, duet, overseer
from staronnx.partition.methods.model import (
    Device,
    Problem,
    TransferModel,
    best_makespan,
    group_parts,
    is_monotone,
    part_devices,
    predicted_makespan,
)
from staronnx.partition.notation import parse_input_shapes
from staronnx.plan import Plan, output_dir_for

#: Batches whose predicted makespan every placed plan reports.
REPORT_BATCHES = (1, 8)
#: Fixed cost of one part (one task through the runtime: queueing, dispatch, session call), µs;
#: benchmarks/engines.py measures 75-150 µs per task for the native engine on a 2-core VM.
PART_OVERHEAD_US = 100.0


@dataclass
class PlacementContext:
    """What a placement method sees: the graph, devices, per-batch problems and options."""

    graph: ModelGraph | None
    devices: list[Device]
    problems: dict[int, Problem]
    batch: int
    transfer: TransferModel
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    _decision: tuple[tuple[float, int], Problem] | None = field(default=None, repr=False, compare=False)

    @property
    def problem(self) -> Problem:
        return self.problems[self.batch]

    @property
    def decision(self) -> Problem:
        """The problem the methods decide on: :attr:`problem`, with the fixed cost of a part
        (``part_overhead_us``) charged on every cross-device edge unless ``charge_parts`` is
        off (the methods exactly as published)."""
        if not bool(self.options.get("charge_parts", True)):
            return self.problem
        us = float(self.options.get("part_overhead_us", PART_OVERHEAD_US))
        cached = self._decision
        if cached is None or cached[0] != (us, self.batch):
            cached = ((us, self.batch), self.problem.with_switch_cost(us))
            self._decision = cached
        return cached[1]


class PlacementMethod:
    """A method that decides a device per node (as opposed to shares-based cuts).

    Subclasses set ``name``, ``defaults`` (their options) and implement :meth:`assign`.
    Instances are what ``METHODS`` holds for these names; :meth:`check` runs before any
    profiling so impossible requests fail at once.
    """

    name = ""
    defaults: ClassVar[dict[str, Any]] = {}

    def check(self, devices: Sequence[Device], graph: ModelGraph | None, options: Mapping[str, Any]) -> None:
        unknown = set(options) - set(self.defaults) - COMMON_OPTIONS
        if unknown:
            raise PartitionError(
                f"method {self.name!r} has no option(s) {sorted(unknown)}; it takes "
                f"{sorted(set(self.defaults) | COMMON_OPTIONS)}"
            )

    def assign(self, ctx: PlacementContext) -> Assignment:
        raise NotImplementedError

    def option(self, ctx: PlacementContext, key: str) -> Any:
        return ctx.options.get(key, self.defaults[key])

    def __repr__(self) -> str:
        return f"<placement method {self.name}>"

    def __call__(self, graph: ModelGraph, request: CutRequest) -> Parts:
        """The :class:`~staronnx.partition.cut.Cut` step: costs on every device, a device per
        node, parts of one device each (``request.targets`` do not apply)."""
        return place_graph(graph, self, request).parts(request.profile_runs, request.costs)


#: Options every placement method takes (beyond its own).
COMMON_OPTIONS = frozenset({"part_overhead_us", "merge", "charge_parts"})


class CommSD(PlacementMethod):
    name = "comm-sd"
    defaults: ClassVar[dict[str, Any]] = {"alpha_us": 100.0, "max_iterations": 50}

    def assign(self, ctx: PlacementContext) -> Assignment:
        return comm_sd(ctx.decision, float(self.option(ctx, "alpha_us")), int(self.option(ctx, "max_iterations")))


class Duet(PlacementMethod):
    name = "duet"
    defaults: ClassVar[dict[str, Any]] = {"max_rounds": 100}

    def assign(self, ctx: PlacementContext) -> Assignment:
        return duet(ctx.decision, int(self.option(ctx, "max_rounds")))


class OverSeer(PlacementMethod):
    name = "overseer"
    defaults: ClassVar[dict[str, Any]] = {}

    def assign(self, ctx: PlacementContext) -> Assignment:
        return overseer(ctx.decision)


class Optimal(PlacementMethod):
    """SIR+'s MILP, exact over the nodes or, above ``max_nodes``, over coarse units.

    ``coarsen``: ``"auto"`` (default) contracts series chains, then DUET's phases, until the
    graph has at most ``max_nodes`` units (:mod:`~staronnx.partition.methods.coarsen`); the
    answer is then optimal among placements that keep each unit on one device, and the
    report says which level was used. ``"off"`` refuses graphs above ``max_nodes``.
    """

    name = "optimal"
    defaults: ClassVar[dict[str, Any]] = {"time_limit_s": 30.0, "max_nodes": 60, "mip_gap": 1e-6,
                                          "coarsen": "auto"}

    def check(self, devices: Sequence[Device], graph: ModelGraph | None, options: Mapping[str, Any]) -> None:
        super().check(devices, graph, options)
        how = options.get("coarsen", self.defaults["coarsen"])
        if how not in ("auto", "off"):
            raise PartitionError(f"method 'optimal': coarsen must be 'auto' or 'off', got {how!r}")
        limit = int(options.get("max_nodes", self.defaults["max_nodes"]))
        if how == "off" and graph is not None and len(graph) > limit:
            raise PartitionError(
                f"the optimal (MILP) placement is limited to {limit} nodes and this graph has "
                f"{len(graph)}: its ordering variables grow as n^2; use coarsen=auto, comm-sd, "
                "duet or overseer, or raise the max_nodes option"
            )

    def assign(self, ctx: PlacementContext) -> Assignment:
        from staronnx.partition.methods.coarsen import Coarsening, chain_units, coarsen
        from staronnx.partition.methods.optimal import optimal

        p = ctx.decision
        limit = int(self.option(ctx, "max_nodes"))
        time_limit = float(self.option(ctx, "time_limit_s"))
        mip_gap = float(self.option(ctx, "mip_gap"))
        auto = self.option(ctx, "coarsen") == "auto"

        def solve(q: Problem, seconds: float, extra: Sequence[np.ndarray] = ()) -> Assignment:
            starts = [comm_sd(q).devices, duet(q).devices, overseer(q).devices, *extra]
            return optimal(q, time_limit=seconds, max_nodes=limit, mip_gap=mip_gap, warm_starts=starts)

        c = coarsen(p, limit) if auto else Coarsening(np.arange(p.n, dtype=np.int64), "nodes", p)
        if c is None:
            raise PartitionError(
                f"the optimal (MILP) placement is limited to {limit} units and this graph has "
                f"{p.n} nodes that no coarsening (series chains, DUET phases) brings under it; "
                "use comm-sd, duet or overseer, or raise the max_nodes option"
            )
        if c.level != "nodes":
            result = solve(c.problem, time_limit)
            info = dict(result.info)
            info.update(coarsened=c.level, units=c.k, nodes=p.n,
                        optimal_among="placements keeping each " + ("series chain" if c.level == "chains"
                                                                     else "DUET phase subgraph") + " on one device")
            return Assignment(c.expand(result.devices), info, orders=[c.expand_order(o) for o in result.orders])
        seeds: list[np.ndarray] = []
        chains_info: dict[str, Any] = {}
        units = chain_units(p) if auto else None
        if units is not None and int(units.max()) + 1 < p.n:
            # the chain-level optimum is usually proven in milliseconds and is a placement of
            # the nodes too: it seeds the node-level search, whose time limit may stop it early
            chains = Coarsening(units, "chains", p.quotient(units))
            at_chains = solve(chains.problem, time_limit / 4)
            seeds.append(chains.expand(at_chains.devices))
            chains_info = {"chains_seed_us": at_chains.info["objective_us"], "chains": chains.k,
                           "chains_proven": at_chains.info["proven_optimal"]}
        result = solve(p, time_limit, seeds)
        result.info.update(chains_info)
        return result


class OrtStatic(PlacementMethod):
    """ONNX Runtime's own static placement: CUDA takes every node it supports (within the
    memory budget ``cuda_memory_limit_kb``, ORT's ``session.resource_cuda_partitioning_settings``),
    the CPU provider the rest; read off ORT's profile (the provider of each node's kernel)."""

    name = "ort-static"
    defaults: ClassVar[dict[str, Any]] = {"cuda_memory_limit_kb": None}

    def check(self, devices: Sequence[Device], graph: ModelGraph | None, options: Mapping[str, Any]) -> None:
        super().check(devices, graph, options)
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise DeviceError(
                "method 'ort-static' is ONNX Runtime's own CPU/GPU placement and needs its "
                "CUDAExecutionProvider, which this install lacks (available: "
                f"{', '.join(ort.get_available_providers())}); run it on a machine with an NVIDIA "
                "GPU and onnxruntime-gpu (staronnx[gpu]), or use comm-sd, duet, overseer or optimal"
            )

    def assign(self, ctx: PlacementContext) -> Assignment:
        from staronnx.partition.methods.ortstatic import ort_static_devices

        if ctx.graph is None:
            raise PartitionError("ort-static needs the model graph")
        return ort_static_devices(ctx.graph, ctx.devices, batch=ctx.batch, input_shapes=ctx.input_shapes,
                                  seed=ctx.seed, memory_limit_kb=self.option(ctx, "cuda_memory_limit_kb"))


PLACEMENT_METHODS: dict[str, PlacementMethod] = {
    m.name: m for m in (CommSD(), Duet(), OverSeer(), Optimal(), OrtStatic())
}


# -- building problems -------------------------------------------------------------------------


def graph_problem(
    graph: ModelGraph, devices: Sequence[Device], cost: np.ndarray, transfer: TransferModel, batch: int
) -> Problem:
    """The placement problem at ``batch``: every tensor between two vertices with its bytes."""
    def nbytes(t: str) -> float:
        info = graph.tensors.get(t)
        return float(info.bytes_per_sample) * (batch if info.batched else 1) if info is not None else 0.0

    tensors = [(u, readers, nbytes(t)) for t, u, readers in graph.links() if readers]
    lat, per_byte = transfer.matrices(devices)
    return Problem(cost, tensors, lat, per_byte, [d.name for d in devices])


def make_context(graph: ModelGraph, method: PlacementMethod, r: CutRequest) -> PlacementContext:
    """Devices, costs per device at the decision and report batches, and the problems built
    from them, for the :class:`~staronnx.partition.cut.CutRequest` ``r`` (its ``devices``,
    ``device_costs``, ``costs``, ``batch``, ``options``, ...)."""
    devs = parse_devices(r.devices)
    options = dict(r.options or {})
    method.check(devs, graph, options)
    batch = int(r.batch or r.profile_batch)
    batches = sorted(set(REPORT_BATCHES) | {batch})
    tables = cost_tables(graph, devs, batches, r)
    transfer = r.transfer or TransferModel()
    problems = {b: graph_problem(graph, devs, tables[b], transfer, b) for b in batches}
    return PlacementContext(graph, devs, problems, batch, transfer, r.seed, options, dict(r.input_shapes))


# -- placing -------------------------------------------------------------------------------------


@dataclass
class Placement:
    """A method's result: a device per node, parts, and its predictions."""

    method: str
    devices: list[Device]
    node_devices: np.ndarray  # device index per node
    ranks: np.ndarray  # part per node (monotone: the quotient is a DAG)
    part_device: list[int]  # device index per part
    predicted_us: dict[int, float]  # part-level makespan per batch (what runs)
    node_level_us: dict[int, float]  # node-level makespan per batch (the method's model)
    cut_bytes_per_sample: float
    info: dict[str, Any]
    batch: int
    costs_at_batch: np.ndarray  # (n, D) at the decision batch

    @property
    def k(self) -> int:
        return len(self.part_device)

    def parts(self, runs: int, source: str) -> Parts:
        """What this placement exports: its parts, each node's cost on its own device (so the
        parts' cost shares reflect the placement), each part's device and the report."""
        micros = self.costs_at_batch[np.arange(len(self.node_devices)), self.node_devices]
        used = "+".join(d.name for i, d in enumerate(self.devices) if i in set(self.part_device))
        costs = NodeCosts(micros, np.full(len(micros), source == "profile"), used, self.batch, runs)
        loads = np.bincount(self.ranks, weights=micros, minlength=self.k)
        shares = [float(x) / (float(loads.sum()) or 1.0) for x in loads]
        return Parts(self.ranks, costs, shares, [self.devices[d].name for d in self.part_device], self.settings())

    def settings(self) -> dict[str, Any]:
        """JSON-able record for ``plan.settings["placement"]``."""
        return {
            "method": self.method,
            "devices": [d.to_dict() for d in self.devices],
            "part_devices": [self.devices[d].name for d in self.part_device],
            "decision_batch": self.batch,
            "predicted_makespan_us": {str(b): round(v, 3) for b, v in self.predicted_us.items()},
            "node_level_makespan_us": {str(b): round(v, 3) for b, v in self.node_level_us.items()},
            "nodes_per_device": {
                d.name: int(np.sum(self.node_devices == i)) for i, d in enumerate(self.devices)
            },
            "info": _jsonable(self.info),
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def place_context(method: PlacementMethod, ctx: PlacementContext) -> Placement:
    """Run a method on a context and turn its device per node into parts."""
    result = method.assign(ctx)
    a = np.asarray(result.devices, dtype=np.int64)
    p = ctx.problem
    if a.shape != (p.n,) or (p.n and (a.min() < 0 or a.max() >= p.d)):
        raise PartitionError(f"method {method.name!r} returned an invalid assignment (a bug: please report)")
    overhead = float(ctx.options.get("part_overhead_us", PART_OVERHEAD_US))
    ranks = group_parts(p, a, overhead=overhead, merge=bool(ctx.options.get("merge", True)))
    if not is_monotone(p, ranks):
        raise PartitionError(f"method {method.name!r}: parts form a cycle (a bug: please report)")
    pdev = part_devices(ranks, a)
    predicted = {b: predicted_makespan(q, ranks, pdev, overhead) for b, q in ctx.problems.items()}
    node_level = {b: best_makespan(q, a, result.orders) for b, q in ctx.problems.items()}
    cut = ctx.problems[1].cut_bytes(a) if 1 in ctx.problems else p.cut_bytes(a) / max(ctx.batch, 1)
    return Placement(
        method.name, ctx.devices, a, ranks, pdev,
        {b: predicted[b] for b in REPORT_BATCHES if b in predicted},
        {b: node_level[b] for b in REPORT_BATCHES if b in node_level},
        cut, result.info, ctx.batch, p.cost,
    )


def place_graph(graph: ModelGraph, method: PlacementMethod | str, request: CutRequest) -> Placement:
    """Place a built graph as ``request`` asks (see :func:`make_context`)."""
    m = PLACEMENT_METHODS[method] if isinstance(method, str) else method
    return place_context(m, make_context(graph, m, request))


def place(
    model_or_path: onnx.ModelProto | str | os.PathLike[str],
    spec: PartitionSpec,
    *,
    output_dir: str | os.PathLike[str] | None = None,
    devices: Sequence[Device | str | Mapping[str, Any]] | None = None,
    device_costs: Mapping[str, CostOverride] | None = None,
    options: Mapping[str, Any] | None = None,
    batch: int | None = None,
    transfer: TransferModel | None = None,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Place a model's nodes on devices with ``spec.method`` (a placement method) and export the
    plan (parts with their device, the method's predictions under ``settings["placement"]``).

    Of the spec, the method, how costs are measured (``costs``, ``profile_batch``,
    ``profile_runs``, ``input_shapes``, ``seed``) and the batching contract (``batch_axes``,
    ``batching``, kept in the plan as partition keeps them) apply; the devices are this call's own, and a
    placement method chooses its parts itself (no shares). ``batch``: the batch size the method
    decides at (default the profile batch); ``options``: the method's own."""
    method = spec.method
    if method not in PLACEMENT_METHODS:
        raise PartitionError(f"unknown placement method {method!r}; choose one of {', '.join(PLACEMENT_METHODS)}")
    request = CutRequest(
        [], costs=spec.costs, profile_batch=spec.profile_batch, profile_runs=spec.profile_runs, seed=spec.seed,
        input_shapes=parse_input_shapes(spec.input_shapes), devices=devices, device_costs=device_costs,
        options=options, batch=batch, transfer=transfer, progress=progress or (lambda _m: None),
    )
    axes = parse_batch_axes(spec.batch_axes)
    out = output_dir_for(output_dir, force)
    request.progress("loading model")
    loaded = load_model(model_or_path)
    check_batch_axes(loaded.model, axes)
    graph = build_graph(loaded, request.input_shapes, axes)
    parts = PLACEMENT_METHODS[method](graph, request)
    # the spec's batching contract, as partition() keeps it (each plan load applies it)
    settings = plan_settings(method, parts.targets, request, device="placed", tolerance=None,
                             options=_jsonable(dict(options or {})), placement=parts.report,
                             contract=dict(batch_axes=axes or None, batching=None if spec.batching else False))
    request.progress(f"exporting {parts.k} parts to {out}")
    return write_plan(graph, parts, settings, out)
