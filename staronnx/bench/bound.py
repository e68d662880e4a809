"""An LP upper bound on the throughput a plan can sustain on a set of workers.

A sweep says what a policy achieved; only a bound says how much was left on the table. The
fluid relaxation below keeps only capacity (no DAG latency, queueing or indivisible tasks), so
no schedule can beat it in steady state: "achieved / bound" is the headline figure.

At batch size ``b``, with ``t[p][w]`` the mean seconds of part ``p`` on worker ``w`` (perf
models), ``R`` batches/s and ``y[p][w]`` batches/s of part ``p`` on ``w``::

    maximise R
    sum_w y[p][w] = R                        every part of every batch runs somewhere
    sum_p t[p][w] * y[p][w] <= 1             each worker computes at most 1 s per second

Transfers occupy the consumer's worker (as in the simulator and StarPU's policies). To stay
linear and still a bound, ``u[T][n]`` batches/s of tensor ``T`` brought to node ``n`` must cover
the busiest consumer there beyond what is produced there, paid once per node::

    u[T][n] >= sum_{w on n} y[c][w] - sum_{w on n} y[producer(T)][w]    for each consumer c
    sum_{w on n} sum_p t[p][w] * y[p][w] + sum_T cost(T, n) * u[T][n] <= |workers on n|

``cost(T, n)``: the bus model from the cheapest other node (model inputs start on the host).
With one memory node there is no transfer variable and the LP is exact. Solved with HiGHS
(:func:`scipy.optimize.linprog`); the result names the binding constraints and their shadow
prices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import linprog

from staronnx.bench.machine import SimMachine, Where, residency_where
from staronnx.errors import StaronnxError
from staronnx.perfmodels.host import HostCosts
from staronnx.plan import Plan
from staronnx.runtime.datawizard import with_writebacks
from staronnx.runtime.sched import WorkerInfo
from staronnx.workers.layout import MachineSpec

#: relative slack under which a constraint counts as binding
TIGHT = 1e-7
HOST_NODE = "numa0"


class BoundError(StaronnxError, ValueError):
    """The LP cannot be set up or solved as asked (no worker can run some part, ...)."""


@dataclass(frozen=True)
class FlowTensor:
    """A tensor that moves between parts: its bytes per batch, producer (a part, or None for a
    model input, valid on the host node) and consumers."""

    name: str
    nbytes: int
    producer: int | None
    consumers: tuple[int, ...]


@dataclass(frozen=True)
class Binding:
    """A constraint with no slack at the optimum: what limits the throughput."""

    name: str  # "worker cpu:numa0", "node numa1 (compute + copies)", "cores of cpu:numa0 (with lane:numa0)"
    kind: str  # "worker", "node", "cores" or "host"
    load: float  # seconds of work per second at the optimum (= its capacity)
    capacity: float
    shadow_price: float  # samples/s gained per extra second/second of this capacity


@dataclass
class Bound:
    """The LP's answer: the bound, the fractional assignment that reaches it, what binds."""

    throughput: float  # samples per second (= batches_per_s * batch_size)
    batches_per_s: float
    batch_size: int
    #: (part, worker name) -> fraction of the part's batches run there (only > 0 entries)
    assignment: dict[tuple[int, str], float]
    binding: list[Binding]
    #: worker name -> busy fraction at the optimum
    utilization: dict[str, float]
    #: (tensor, node) -> batches/s of that tensor copied to that node at the optimum
    transfers: dict[tuple[str, str], float] = field(default_factory=dict)
    workers: list[WorkerInfo] = field(default_factory=list)
    #: ``loads[p][w]``: seconds per second worker ``w`` spends on part ``p`` at the optimum
    loads: list[list[float]] = field(default_factory=list)

    def arch_share(self) -> dict[tuple[int, str], float]:
        """(part, arch) -> fraction of the part's batches on that arch."""
        arch = {w.name: w.arch for w in self.workers}
        out: dict[tuple[int, str], float] = {}
        for (p, name), x in self.assignment.items():
            key = (p, arch.get(name, name))
            out[key] = out.get(key, 0.0) + x
        return dict(sorted(out.items()))


def lp_bound(times: Sequence[Sequence[float]], batch_size: int, workers: Sequence[WorkerInfo] | None = None, *,
             tensors: Sequence[FlowTensor] = (), transfer: Callable[[str, str, int], float] | None = None,
             host_node: str = HOST_NODE, demand: Sequence[float] | None = None,
             shared_cores: Sequence[tuple[int, int]] = (), host_cpu: float = 0.0,
             host_cores: Sequence[tuple[int, int]] = ()) -> Bound:
    """Solve the LP of the module docstring.

    ``demand[p]`` (default 1 for every part): batches of part ``p`` needed per unit of ``R``,
    i.e. ``sum_w y[p][w] = demand[p] * R``. Several models sharing the workers (their parts
    numbered one after the other) set each part's demand to its model's offered batches/s:
    ``R`` is then the factor by which every offered rate can be scaled together
    (:func:`mix_bound`); a part of demand 0 is not run.

    ``times[p][w]``: mean seconds of part ``p`` on worker ``w`` at this batch size (NaN or inf:
    cannot run there). ``workers`` give names and memory nodes (default: ``w0, w1, ...`` on the
    host node). ``transfer(src, dst, nbytes)`` prices a copy (e.g. ``BusModel.predict``); with
    none, or a single memory node, transfers are free. ``shared_cores``: pairs of workers
    (indices) that run on the same cores, a latency lane and its group's worker: their loads
    together are at most one (``sum_p t*y`` over both ``<= 1``).

    ``host_cpu``: CPU seconds the host's own threads spend per unit of ``R`` (per batch: the
    generator, the batcher, the engine's hand-overs; :mod:`staronnx.perfmodels.host`), taken
    from the cores of ``host_cores`` (pairs of worker index and its cores: the CPU workers, on
    a machine with no PU outside their groups): ``sum_w cores_w * sum_p t*y + host_cpu * R <=
    sum_w cores_w``. Without them the host's work is free, as on a machine that keeps a core
    for it.
    """
    t = np.asarray(times, dtype=np.float64)
    if t.ndim != 2 or t.size == 0:
        raise BoundError("times must be a non-empty [parts][workers] table")
    n_parts, n_workers = t.shape
    if workers is None:
        workers = [WorkerInfo(i, f"w{i}", "?", "cpu", host_node) for i in range(n_workers)]
    if len(workers) != n_workers:
        raise BoundError(f"{len(workers)} workers for a table of {n_workers} columns")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise BoundError(f"batch_size must be an int >= 1, got {batch_size!r}")
    usable = np.isfinite(t) & (t >= 0)
    for p in range(n_parts):
        if not usable[p].any():
            raise BoundError(f"part {p} has no worker with a known time: the bound is 0")
    if np.any(usable & (t == 0)):
        raise BoundError("a part takes 0 s on some worker: the throughput is unbounded")
    need = np.ones(n_parts) if demand is None else np.asarray(demand, dtype=np.float64)
    if need.shape != (n_parts,) or not np.all(np.isfinite(need)) or np.any(need < 0) or not need.any():
        raise BoundError(f"demand must be {n_parts} finite numbers >= 0, not all 0; got {demand!r}")

    nodes = list(dict.fromkeys(w.memory_node for w in workers))
    on_node = {n: [i for i, w in enumerate(workers) if w.memory_node == n] for n in nodes}
    # transfer variables only where a copy costs something
    flows: list[tuple[FlowTensor, str, float]] = []
    if transfer is not None and len(nodes) > 1:
        for tensor in tensors:
            if tensor.nbytes <= 0 or not tensor.consumers:
                continue
            for n in nodes:
                sources = [m for m in nodes if m != n] if tensor.producer is not None else (
                    [host_node] if n != host_node else [])
                cost = min((c for m in sources if math.isfinite(c := transfer(m, n, tensor.nbytes))), default=0.0)
                if cost > 0:
                    flows.append((tensor, n, cost))

    # variables: R, y[p][w] (row-major), u[flow]
    n_y = n_parts * n_workers
    n_vars = 1 + n_y + len(flows)

    def y(p: int, w: int) -> int:
        return 1 + p * n_workers + w

    a_eq = np.zeros((n_parts, n_vars))
    a_eq[:, 0] = -need
    a_eq[:, 1:1 + n_y] = np.repeat(np.eye(n_parts), n_workers, axis=1)
    work = np.where(usable, t, 0.0)  # seconds per batch (a part's y is 0 where it cannot run)
    rows: list[np.ndarray] = []
    rhs: list[float] = []
    labels: list[tuple[str, str, float]] = []  # (name, kind, capacity) of capacity rows

    def capacity(weights: Sequence[tuple[int, float]], cap: float, name: str, kind: str) -> np.ndarray:
        """A capacity row: the seconds of work per unit of R of the workers in ``weights``
        (index, weight), at most ``cap``."""
        row = np.zeros(n_vars)
        for w, weight in weights:
            row[1 + w:1 + n_y:n_workers] = weight * work[:, w]
        rows.append(row)
        rhs.append(cap)
        labels.append((name, kind, cap))
        return row

    for w, info in enumerate(workers):
        capacity([(w, 1.0)], 1.0, f"worker {info.name}", "worker")
    for a, b in shared_cores:
        capacity([(a, 1.0), (b, 1.0)], 1.0, f"cores of {workers[b].name} (with {workers[a].name})", "cores")
    if host_cpu > 0 and host_cores:
        total = float(sum(cores for _, cores in host_cores))
        capacity(host_cores, total, "cores shared with the host's threads", "host")[0] = host_cpu  # R's own CPU
    for n in nodes if flows else ():
        mine = [k for k, f in enumerate(flows) if f[1] == n]
        if mine:
            row = capacity([(w, 1.0) for w in on_node[n]], float(len(on_node[n])), f"node {n} (compute + copies)",
                           "node")
            for k in mine:
                row[1 + n_y + k] = flows[k][2]
    for k, (tensor, n, _) in enumerate(flows):
        for c in dict.fromkeys(tensor.consumers):
            row = np.zeros(n_vars)
            for w in on_node[n]:
                row[y(c, w)] = 1.0
            if tensor.producer is not None:
                for w in on_node[n]:
                    row[y(tensor.producer, w)] -= 1.0
            row[1 + n_y + k] = -1.0
            rows.append(row)
            rhs.append(0.0)

    bounds = [(0.0, None)] + [
        (0.0, None if usable[p, w] else 0.0) for p in range(n_parts) for w in range(n_workers)
    ] + [(0.0, None)] * len(flows)
    cost_vec = np.zeros(n_vars)
    cost_vec[0] = -1.0
    res = linprog(cost_vec, A_ub=np.array(rows), b_ub=np.array(rhs), A_eq=a_eq, b_eq=np.zeros(n_parts),
                  bounds=bounds, method="highs")
    if res.status != 0:
        raise BoundError(f"the throughput LP failed: {res.message}")
    x = res.x
    r = float(x[0])
    ub = np.array(rows) @ x
    marginals = np.asarray(res.ineqlin.marginals)
    binding = [Binding(name, kind, float(ub[i]), cap, float(-marginals[i] * batch_size))
               for i, (name, kind, cap) in enumerate(labels) if cap - ub[i] <= TIGHT * max(cap, 1.0)]
    assignment = {
        (p, workers[w].name): float(x[y(p, w)] / (r * need[p]))
        for p in range(n_parts) for w in range(n_workers)
        if r > 0 and need[p] > 0 and x[y(p, w)] > TIGHT * r * need[p]
    }
    utilization = {workers[w].name: float(ub[w]) for w in range(n_workers)}
    transfers = {(f[0].name, f[1]): float(x[1 + n_y + k]) for k, f in enumerate(flows) if x[1 + n_y + k] > 0}
    return Bound(
        throughput=r * batch_size, batches_per_s=r, batch_size=batch_size, assignment=assignment,
        binding=binding, utilization=utilization, transfers=transfers, workers=list(workers),
        loads=(work * x[1:1 + n_y].reshape(n_parts, n_workers)).tolist())


def plan_tensors(plan: Plan, nbytes: Mapping[str, int]) -> list[FlowTensor]:
    """The tensors parts read (model inputs and crossing tensors), with bytes per batch."""
    producers = plan.producers()
    readers: dict[str, list[int]] = {}
    for part in plan.parts:
        for name in part.inputs:
            readers.setdefault(name, []).append(part.index)
    return [
        FlowTensor(name, int(nbytes.get(name, 0)), producers.get(name), tuple(parts))
        for name, parts in readers.items()
    ]


def machine_bound(machine: SimMachine, batch_size: int, host_costs: bool = True) -> Bound:
    """The bound for a :class:`~staronnx.bench.machine.SimMachine` of one plan (same workers,
    model means and bus as the simulator, so achieved / bound compares like with like):
    :func:`_lp` over a set of one model, at one batch per unit of throughput. ``host_costs``:
    the machine's host costs, where calibration measured them, as the simulator runs them
    (:func:`~staronnx.bench.simulator.simulate_mix`)."""
    assert machine.models is not None
    if not machine.models.single:
        raise BoundError("this machine hosts several models: bound their traffic together with mix_bound "
                         "(a rate per model)")
    name = machine.models.models[0].name
    return _lp(machine, {name: batch_size}, {name: 1.0}, batch_size=batch_size, host_costs=host_costs)


def batch_bounds(machine: SimMachine, batch_sizes: Sequence[int]) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """The bound per batch size as a sweep records it (where the perf models allow), with
    notes on what failed."""
    notes: list[str] = []
    out: dict[int, dict[str, Any]] = {}
    for b in batch_sizes:
        try:
            bound = machine_bound(machine, b)
        except StaronnxError as exc:
            notes.append(f"no LP bound at batch {b}: {exc}")
            continue
        out[b] = {
            "throughput": bound.throughput,
            "binding": [x.name for x in bound.binding],
            "arch_share": {f"part{p}/{a}": x for (p, a), x in bound.arch_share().items()},
        }
    return out, notes



# ---------------------------------------------------------------------------- several models
@dataclass
class MixBound:
    """The LP over several models sharing one machine at given offered rates (:func:`mix_bound`).

    ``scale``: the largest factor by which every model's offered rate can be multiplied
    together and still be served; ``feasible``: ``scale >= 1``. ``throughput[m]`` =
    ``scale * rates[m]``; ``solo[m]``: ``m``'s own LP bound on the whole machine, the yardstick
    for what sharing costs it. ``busy[m][w]``: the busy fraction of worker ``w`` spent on
    ``m``; ``arch_share[m]``: ``"part<p>/<arch>"`` (the model's own part numbers) -> fraction of
    the part's batches there.
    """

    scale: float
    rates: dict[str, float]
    batch_sizes: dict[str, int]
    throughput: dict[str, float]
    solo: dict[str, float]
    binding: list[Binding]
    utilization: dict[str, float]
    busy: dict[str, dict[str, float]]
    arch_share: dict[str, dict[str, float]]
    residency: dict[str, str] = field(default_factory=dict)
    lanes: dict[str, str] = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return self.scale >= 1.0 - 1e-9  # exactly full counts as fitting (LP rounding)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (a sweep's ``results.json`` keeps it per mix): the binding constraints by name."""
        fields = dataclasses.asdict(self)
        return {"scale": fields.pop("scale"), "feasible": self.feasible, **fields,
                "binding": [b.name for b in self.binding]}


def _lp(machine: SimMachine, sizes: Mapping[str, int], demand_per_model: Mapping[str, float],
        where: Where = None, *, batch_size: int = 1, host_costs: bool = False) -> Bound:
    """The LP over every global part of ``machine``, each part's demand its model's (batches
    per unit of throughput, whose samples are ``batch_size``); a part runs only on the workers
    ``where`` says hold it (infinite time elsewhere). ``host_costs``: the host's, where the
    machine has them (one plan: :meth:`~staronnx.bench.machine.SimMachine.host_costs`)."""
    models = machine.models
    assert models is not None
    times = machine.mean_times(dict(sizes), where=where)
    demand = [float(demand_per_model.get(m.name, 0.0)) for m, _ in models.owner]
    tensors: list[FlowTensor] = []
    for m in models.models:
        nbytes = machine.profile(int(sizes[m.name]), m.index).nbytes
        times = with_writebacks(times, m.plan, machine.workers, nbytes, machine.table.bus.predict, first=m.first_part)
        for t in plan_tensors(m.plan, nbytes):  # names kept apart, parts made global
            tensors.append(FlowTensor(
                t.name if models.single else f"{m.name}/{t.name}", t.nbytes,
                None if t.producer is None else m.first_part + t.producer,
                tuple(m.first_part + c for c in t.consumers)))
    def solve(host: HostCosts | None) -> Bound:
        task_times = times
        if host is not None:  # each task also costs its worker the engine's gap; a batch its answer
            task_times = [[x * host.warm_scale(models.owner[p][1]) + host.gap_s
                           + (host.finish_s if host.finish_on_worker and not models.succs[p] else 0.0) for x in row]
                          for p, row in enumerate(times)]
        shares = host is not None and machine.host_shares_cores
        return lp_bound(task_times, batch_size, machine.workers, tensors=tensors, demand=demand,
                        transfer=lambda src, dst, n: machine.table.bus.predict(src, dst, n),
                        shared_cores=list(machine.lane_groups.items()),
                        host_cpu=host.cpu_per_batch_s if shares and host is not None else 0.0,
                        host_cores=[(w.id, w.ncores) for w in machine.workers
                                    if w.kind == "cpu" and w.id not in machine.lanes] if shares else ())

    host = machine.host_costs(batch_size) if host_costs else None
    bound = solve(host)
    if host is None or host.lighter is None:
        return bound
    # the host's costs fall with the rate: those of the rate the bound finds, until it settles
    for _ in range(_HOST_RATE_ROUNDS):
        if not (math.isfinite(bound.throughput) and bound.throughput > 0):
            break
        again = solve(host.at_rate(bound.throughput))
        settled = abs(again.throughput - bound.throughput) <= 1e-3 * bound.throughput
        bound = again
        if settled:
            break
    return bound


#: rounds of :func:`_lp`'s fixed point between the bound and the host's costs at its rate (each
#: moves the bound by a fraction of the costs' share of it: three settle it to well under 0.1 %)
_HOST_RATE_ROUNDS = 5


def mix_bound(machine: SimMachine, rates: Mapping[str, float], batch_sizes: Mapping[str, int] | int,
              residency: Mapping[str, str] | None = None) -> MixBound:
    """The LP bound of several models' traffic on ``machine`` (built over their plans): can
    the machine serve ``rates`` (model -> single-sample requests/s) in batches of
    ``batch_sizes`` (model -> b, or one b for all), and by how much could they all grow?

    Model ``m`` needs ``rates[m] / b[m]`` batches/s of each of its parts; the LP of the module
    docstring with those demands maximises the common scale factor, and with the other
    models' demand at 0 gives each model's solo bound. ``residency`` (model name -> worker
    selector) assigns a model's parts to the workers holding it only. A machine with latency
    lanes is bounded as the simulator runs it: each lane one more worker holding the lane
    models, sharing its group's cores with the group's worker (their loads together at most
    one): a lane buys latency, not throughput (:data:`~staronnx.bench.machine.LANE_APPROXIMATION`).
    """
    models = machine.models
    assert models is not None
    names = [m.name for m in models.models]
    sizes = {n: batch_sizes for n in names} if isinstance(batch_sizes, int) else {n: int(batch_sizes[n]) for n in names
                                                                               if n in batch_sizes}
    missing = [n for n in names if n not in rates or n not in sizes]
    if missing or set(rates) - set(names):
        raise BoundError(f"give a rate and a batch size for each model ({', '.join(names)}); "
                         f"got rates for {sorted(rates)}, batch sizes for {sorted(sizes)}")
    for n in names:
        r = rates[n]
        if not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
            raise BoundError(f"{n}: the rate must be > 0 requests/s, got {r!r}")
        if isinstance(sizes[n], bool) or sizes[n] < 1:
            raise BoundError(f"{n}: the batch size must be >= 1, got {sizes[n]!r}")
    where = residency_where(machine, residency)
    demand = {n: float(rates[n]) / sizes[n] for n in names}
    lp = _lp(machine, sizes, demand, where)
    scale = lp.batches_per_s
    solo = {n: _lp(machine, sizes, {n: 1.0 / sizes[n]}, where).batches_per_s for n in names}
    busy = {m.name: {w.name: sum(lp.loads[p][i] for p in m.parts) for i, w in enumerate(machine.workers)}
            for m in models.models}
    # each model's parts in its own numbering, as batch_bounds writes a single plan's
    shares = {m.name: {f"part{p - m.first_part}/{a}": x for (p, a), x in lp.arch_share().items() if p in m.parts}
              for m in models.models}
    return MixBound(
        scale=scale, rates={n: float(rates[n]) for n in names}, batch_sizes=sizes,
        throughput={n: scale * float(rates[n]) for n in names}, solo=solo, binding=lp.binding,
        utilization=lp.utilization, busy=busy, arch_share=shares, residency=dict(residency or {}),
        lanes=dict(machine.settings.get("lanes") or {}))


#: measured / bound above which a measurement is not noise: the perf models are stale
STALE_MARGIN = 1.1


def stale_models_note(plan: Plan, points: Sequence[tuple[int, Any, Any]], machine: MachineSpec) -> str | None:
    """The remark on measurements above the bound, or None.

    The bound is what the perf models allow at best, so a measured throughput above it (by
    more than noise) says the models predict the parts slower than they run now: calibrated
    on a loaded machine, or before a change. Every figure built on them (bound, simulation,
    the predicted best batch size) is then off, so say it, and how to recalibrate.
    ``points`` are (batch size, measured samples/s, bound samples/s) on the workers of ``machine``.
    """
    from staronnx.perfmodels.store import calibrate_line

    def finite(v: Any) -> bool:
        return isinstance(v, (int, float)) and math.isfinite(v)

    over: dict[int, tuple[float, float]] = {}
    for b, measured, bound in points:
        if finite(measured) and finite(bound) and bound > 0 and measured > STALE_MARGIN * bound:
            if b not in over or measured / bound > over[b][0] / over[b][1]:
                over[b] = (float(measured), float(bound))
    if not over:
        return None
    where = ", ".join(f"b={b}: {m:.1f} vs {bnd:.1f} samples/s" for b, (m, bnd) in sorted(over.items()))
    return (f"measured throughput above the LP bound ({where}): the perf models are stale (they "
            f"predict the parts slower than they run now); recalibrate with "
            f"`{calibrate_line(plan.root, machine, batch_sizes=list(over), replace=True)}`")
