"""The cost model every placement method shares: devices, per-node costs, transfers, schedules.

A :class:`Problem` is what SIR+, DUET, OverSeer and the MILP reason about, in the classic model
of the papers: a device runs one node at a time (SIR+'s no-overlap constraint); a node starts
once every predecessor has finished *and* its tensor has arrived (``latency + bytes * per_byte``
between different devices); transfers overlap with computation and with each other (no link
contention, as in SIR+'s MILP); the makespan is the finish of the last node.

:func:`schedule` evaluates an assignment by list scheduling in a priority order. For a fixed
assignment the minimum over all topological orders is the model's exact optimum (every
semi-active schedule is a list schedule of some topological order), which is how the tests
brute-force tiny graphs. :func:`group_parts` and :meth:`Problem.quotient` turn a device per
node into the parts the runtime executes and the plan's predicted makespan.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from staronnx.partition.graph import priority_topological

# -- devices and transfers ---------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """Somewhere a node can run: a CPU group (``cores`` intra-op threads) or a GPU.

    ``name`` is the runtime's worker name for a CPU group (``cpu:numa0.core0``) or ``cudaD``
    for a GPU, so a part's recorded device maps to workers; ``memory`` is its memory node
    (``numa0``, ``cuda0``) as the bus model names them.
    """

    name: str
    kind: str = "cpu"  # "cpu" | "cuda"
    memory: str = "numa0"
    cores: int = 1

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class Link(NamedTuple):
    """A link's fixed cost and bandwidth (a ``perfmodels.LinkCost`` reads the same)."""

    latency: float  # s
    bandwidth: float  # bytes/s


class BusRoutes(Protocol):
    """What pricing a transfer needs of a calibrated bus model: ``perfmodels.BusModel`` is
    one, handed in by the doors (partition sits below perfmodels and reads no store)."""

    def has_route(self, src: str, dst: str) -> bool: ...

    def predict(self, src: str, dst: str, nbytes: int) -> float: ...


#: Two CPU groups on one NUMA node share memory: the runtime copies nothing, but the consumer
#: reads the tensor out of another core's caches and the engine hands the task over to another
#: worker. A small fixed cost plus a cache-to-cache bandwidth; configurable (``same_node``).
SAME_NODE_LINK = Link(latency=30e-6, bandwidth=20e9)
#: Memory nodes the bus model has no route between (not calibrated yet): a PCIe 3 x16-like
#: link for host<->GPU, a QPI/UPI-like one between NUMA nodes. Configurable (``default_link``).
DEFAULT_LINK = Link(latency=10e-6, bandwidth=12e9)


@dataclass
class TransferModel:
    """Seconds to move bytes between two devices.

    Same device: 0. Same memory node, different devices (two CPU groups of one NUMA node):
    ``same_node``. Different memory nodes: the bus model's prediction when it has a route
    (calibrated with ``staronnx calibrate``), else ``default_link``.
    """

    bus: BusRoutes | None = None
    same_node: Link = SAME_NODE_LINK
    default_link: Link = DEFAULT_LINK

    def link(self, src: Device, dst: Device) -> tuple[float, float]:
        """(latency s, seconds per byte) of the ``src -> dst`` transfer."""
        if src == dst:
            return 0.0, 0.0
        if src.memory == dst.memory:
            return self.same_node.latency, 1.0 / self.same_node.bandwidth
        if self.bus is not None and self.bus.has_route(src.memory, dst.memory):
            # the bus model is affine in bytes: recover (latency, slope) from two points
            lat = self.bus.predict(src.memory, dst.memory, 1)
            big = self.bus.predict(src.memory, dst.memory, 1 << 30)
            slope = max((big - lat) / ((1 << 30) - 1), 0.0)
            return max(lat - slope, 0.0), slope
        return self.default_link.latency, 1.0 / self.default_link.bandwidth

    def matrices(self, devices: Sequence[Device]) -> tuple[np.ndarray, np.ndarray]:
        """Latency (µs) and µs per byte for every ordered pair of devices."""
        d = len(devices)
        lat, per_byte = np.zeros((d, d)), np.zeros((d, d))
        for i, a in enumerate(devices):
            for j, b in enumerate(devices):
                if i != j:
                    s, slope = self.link(a, b)
                    lat[i, j], per_byte[i, j] = s * 1e6, slope * 1e6
        return lat, per_byte


# -- the problem ---------------------------------------------------------------------------------


@dataclass
class Problem:
    """Nodes (topological order), costs per device (µs), tensors (bytes), transfer times.

    ``tensors`` are ``(producer, consumers, bytes)``; node-level edges sum the tensors
    between a pair of nodes. ``lat`` and ``per_byte`` are (D, D) with a zero diagonal.
    """

    cost: np.ndarray  # (n, D) µs
    tensors: list[tuple[int, list[int], float]]
    lat: np.ndarray  # (D, D) µs
    per_byte: np.ndarray  # (D, D) µs per byte
    devices: list[str] = field(default_factory=list)
    overhead: float = 0.0  # µs added to every node (a part's task overhead in quotients)

    def __post_init__(self) -> None:
        self.cost = np.asarray(self.cost, dtype=float)
        if self.cost.ndim != 2:
            raise ValueError("cost must be an (n, devices) array")
        n, d = self.cost.shape
        self.lat = np.asarray(self.lat, dtype=float).reshape(d, d)
        self.per_byte = np.asarray(self.per_byte, dtype=float).reshape(d, d)
        if not self.devices:
            self.devices = [f"d{i}" for i in range(d)]
        pair: dict[tuple[int, int], float] = {}
        for u, users, nbytes in self.tensors:
            for v in set(users):
                if v == u:
                    continue
                if not 0 <= u < v < n:
                    raise ValueError(f"edge {u}->{v}: nodes must be in topological order (u < v < n)")
                pair[(u, v)] = pair.get((u, v), 0.0) + float(nbytes)
        self.edges: list[tuple[int, int, float]] = [(u, v, b) for (u, v), b in sorted(pair.items())]
        self.preds: list[list[int]] = [[] for _ in range(n)]
        self.succs: list[list[int]] = [[] for _ in range(n)]
        self.in_edges: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        self.out_edges: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        for u, v, b in self.edges:
            self.preds[v].append(u)
            self.succs[u].append(v)
            self.in_edges[v].append((u, b))
            self.out_edges[u].append((v, b))
        # per edge, the (D, D) transfer time, as nested lists for fast scalar access
        self._comm_tables: dict[tuple[int, int], list[list[float]]] = {}
        self._static_order: list[int] | None = None

    @classmethod
    def from_edges(
        cls,
        cost: np.ndarray | Sequence[Sequence[float]],
        edges: Sequence[tuple[int, int, float]],
        lat: float | np.ndarray = 0.0,
        per_byte: float | np.ndarray = 0.0,
        devices: Sequence[str] = (),
    ) -> Problem:
        """A hand-built problem: scalar ``lat``/``per_byte`` apply to every pair of devices."""
        cost = np.asarray(cost, dtype=float)
        off = 1.0 - np.eye(cost.shape[1])

        def pairwise(x: float | np.ndarray) -> np.ndarray:
            m = np.asarray(x, dtype=float)
            return m * off if m.ndim == 0 else m

        return cls(cost, [(u, [v], b) for u, v, b in edges], pairwise(lat), pairwise(per_byte), list(devices))

    @property
    def n(self) -> int:
        return int(self.cost.shape[0])

    @property
    def d(self) -> int:
        return int(self.cost.shape[1])

    def comm(self, nbytes: float, a: int, b: int) -> float:
        """µs to move ``nbytes`` from device a to device b."""
        if a == b:
            return 0.0
        return float(self.lat[a, b] + nbytes * self.per_byte[a, b])

    def comm_table(self, nbytes: float) -> list[list[float]]:
        key = (0, int(nbytes)) if float(nbytes).is_integer() else (1, hash(nbytes))
        table = self._comm_tables.get(key)
        if table is None:
            m = self.lat + nbytes * self.per_byte
            np.fill_diagonal(m, 0.0)
            table = m.tolist()
            self._comm_tables[key] = table
        return table

    def fastest(self) -> np.ndarray:
        """Each node's fastest device (lowest index on ties)."""
        return np.argmin(self.cost, axis=1).astype(np.int64)

    def static_order(self) -> list[int]:
        """A topological order by decreasing upward rank (HEFT's priority) with mean costs."""
        if self._static_order is None:
            mean_cost = self.cost.mean(axis=1) + self.overhead
            d = self.d
            mean_lat, mean_pb = self.mean_link()
            rank = np.zeros(self.n)
            for u in range(self.n - 1, -1, -1):
                best = 0.0
                for v, b in self.out_edges[u]:
                    best = max(best, rank[v] + (mean_lat + b * mean_pb) * (d - 1) / max(d, 1))
                rank[u] = mean_cost[u] + best
            self._static_order = priority_topological(self.preds, self.succs, [-r for r in rank])
        return self._static_order

    def mean_link(self) -> tuple[float, float]:
        """Latency and per-byte time averaged over the pairs of distinct devices (0 for one)."""
        pairs = self.d * self.d - self.d
        return (float(self.lat.sum() / pairs), float(self.per_byte.sum() / pairs)) if pairs else (0.0, 0.0)

    def quotient(self, ranks: np.ndarray, overhead: float = 0.0) -> Problem:
        """The part-level problem: part cost = sum of its nodes' costs, crossing tensors counted
        once per consuming part, ``overhead`` µs per part (the task's fixed cost)."""
        ranks = np.asarray(ranks, dtype=np.int64)
        k = int(ranks.max()) + 1
        cost = np.zeros((k, self.d))
        np.add.at(cost, ranks, self.cost)
        cost += overhead
        tensors = []
        for u, users, nbytes in self.tensors:
            p = int(ranks[u])
            parts = sorted({int(ranks[v]) for v in users} - {p})
            if parts:
                tensors.append((p, parts, nbytes))
        return Problem(cost, tensors, self.lat.copy(), self.per_byte.copy(), list(self.devices), overhead)

    def with_switch_cost(self, us: float) -> Problem:
        """The same problem where every cross-device edge also costs ``us`` µs.

        Why: in a plan, each change of device along an edge starts a new part, i.e. one more
        task with the runtime's fixed cost (queueing, dispatch, the session call). Methods
        that price it as part of the transfer stop splitting work so fine that the split
        costs more than the parallelism it buys.
        """
        if us == 0:
            return self
        off = 1.0 - np.eye(self.d)
        return Problem(self.cost.copy(), list(self.tensors), self.lat + us * off, self.per_byte.copy(),
                       list(self.devices), self.overhead)

    def cut_bytes(self, assign: np.ndarray) -> float:
        """Bytes crossing devices (a tensor counted once per other device reading it)."""
        total = 0.0
        for u, users, nbytes in self.tensors:
            other = {int(assign[v]) for v in users} - {int(assign[u])}
            total += nbytes * len(other)
        return total


# -- schedules -------------------------------------------------------------------------------------


@dataclass
class Schedule:
    start: np.ndarray
    finish: np.ndarray
    makespan: float


def schedule(problem: Problem, assign: Sequence[int] | np.ndarray, order: Sequence[int] | None = None) -> Schedule:
    """List-schedule an assignment: nodes in ``order`` (default :meth:`Problem.static_order`)
    are appended to their device's queue and start at max(device free, inputs arrived)."""
    a = [int(x) for x in assign]
    order = problem.static_order() if order is None else order
    n = problem.n
    cost = problem.cost.tolist()
    start = [0.0] * n
    finish = [0.0] * n
    free = [0.0] * problem.d
    for v in order:
        dv = a[v]
        ready = max((finish[u] if a[u] == dv else finish[u] + problem.comm_table(nbytes)[a[u]][dv]
                     for u, nbytes in problem.in_edges[v]), default=0.0)
        s = max(free[dv], ready)
        start[v] = s
        finish[v] = s + cost[v][dv]
        free[dv] = finish[v]
    return Schedule(np.array(start), np.array(finish), max(finish) if n else 0.0)


def makespan(problem: Problem, assign: Sequence[int] | np.ndarray, order: Sequence[int] | None = None) -> float:
    return schedule(problem, assign, order).makespan


def best_makespan(problem: Problem, assign: Sequence[int] | np.ndarray, orders: Sequence[Sequence[int]] = ()) -> float:
    """The least makespan over the static order, the plain topological order and ``orders``."""
    candidates = [problem.static_order(), list(range(problem.n)), *orders]
    return min(makespan(problem, assign, o) for o in candidates)


def eft_assign(problem: Problem, order: Sequence[int] | None = None) -> np.ndarray:
    """HEFT's placement: in priority order, each node on the device where it finishes first
    (what the runtime's heft policy does with parts that carry no device)."""
    order = problem.static_order() if order is None else order
    n = problem.n
    a = [0] * n
    finish = [0.0] * n
    free = [0.0] * problem.d
    cost = problem.cost.tolist()
    for v in order:
        best = None
        for dv in range(problem.d):
            ready = max((finish[u] + problem.comm_table(nbytes)[a[u]][dv] for u, nbytes in problem.in_edges[v]),
                        default=0.0)
            f = max(ready, free[dv]) + cost[v][dv]
            if best is None or f < best[0] - 1e-9:
                best = (f, dv)
        assert best is not None
        a[v] = best[1]
        finish[v] = best[0]
        free[best[1]] = best[0]
    return np.array(a, dtype=np.int64)


# -- from a device per node to parts ---------------------------------------------------------------


def group_parts(
    problem: Problem, assign: Sequence[int] | np.ndarray, overhead: float = 50.0, merge: bool = True
) -> np.ndarray:
    """Parts of one device each whose quotient is a DAG; returns a monotone rank per node.

    A part is one task in the runtime: it starts when all its inputs exist and its outputs
    appear when it ends, so grouping can cost parallelism. Two groupings are tried:

    * SIR+'s rule, a sweep in a topological order that keeps consecutive nodes of one device
      in one part: a node joins its device's newest part when none of its predecessors sits
      in a later part, else opens a new one (among ready nodes, those that fit go first);
    * the finest grouping that loses nothing: chains of one device (a node whose only
      predecessor is the node before it on the chain, on the same device) form a part.

    Each is then merged pairwise (parts of one device, where the quotient stays acyclic and
    the predicted part-level makespan, with ``overhead`` µs per part, does not grow), so
    fan-out graphs do not end up with a part per node; the better of the two is kept (lower
    predicted makespan, then fewer parts).
    """
    a = np.asarray(assign, dtype=np.int64)
    if problem.n == 0:
        return np.zeros(0, dtype=np.int64)
    best: tuple[float, int, np.ndarray] | None = None
    for start in (_sweep_parts(problem, a), chains(problem, a)):
        ranks = _renumber(problem, start)
        if merge:
            ranks = _renumber(problem, _merge_parts(problem, ranks, a, overhead))
        value = predicted_makespan(problem, ranks, part_devices(ranks, a), overhead)
        key = (round(value, 6), int(ranks.max()) + 1)
        if best is None or key < best[:2]:
            best = (key[0], key[1], ranks)
    assert best is not None
    return best[2]


def _sweep_parts(problem: Problem, a: np.ndarray) -> np.ndarray:
    n = problem.n
    preds, succs = problem.preds, problem.succs
    cluster = [-1] * n
    open_part: dict[int, int] = {}  # device -> newest part
    count = 0
    indeg = [len(p) for p in preds]
    ready = {v for v in range(n) if indeg[v] == 0}

    def fits(v: int) -> bool:
        p = open_part.get(int(a[v]))
        return p is not None and all(cluster[u] <= p for u in preds[v])

    while ready:
        fitting = [v for v in ready if fits(v)]
        if fitting:
            v = min(fitting)
            cluster[v] = open_part[int(a[v])]
        else:
            v = min(ready)
            cluster[v] = count
            open_part[int(a[v])] = count
            count += 1
        ready.discard(v)
        for w in succs[v]:
            indeg[w] -= 1
            if indeg[w] == 0:
                ready.add(w)
    return np.array(cluster, dtype=np.int64)


def chains(problem: Problem, assign: np.ndarray | None = None) -> np.ndarray:
    """Series chains: v joins u's chain when u -> v is u's only out-edge and v's only in-edge
    (and, given ``assign``, both are on one device); each node labelled by its chain's first node."""
    cluster = list(range(problem.n))
    for v, preds in enumerate(problem.preds):
        u = preds[0] if len(preds) == 1 else -1
        if u >= 0 and len(problem.succs[u]) == 1 and (assign is None or assign[u] == assign[v]):
            cluster[v] = cluster[u]
    return np.array(cluster, dtype=np.int64)


def label_dag(problem: Problem, labels: np.ndarray,
              key: dict[int, int] | None = None) -> tuple[list[int], dict[int, set[int]]]:
    """The quotient of the problem's edges by a label per node (acyclic): its labels in a
    topological order (the ready label of smallest ``key``, default the label itself, first) and
    each label's successors."""
    alive = sorted({int(x) for x in labels})
    succ: dict[int, set[int]] = {p: set() for p in alive}
    for u, v, _ in problem.edges:
        if labels[u] != labels[v]:
            succ[int(labels[u])].add(int(labels[v]))
    pos = {p: i for i, p in enumerate(alive)}
    preds: list[list[int]] = [[] for _ in alive]
    for p in alive:
        for q in succ[p]:
            preds[pos[q]].append(pos[p])
    order = priority_topological(preds, [sorted(pos[q] for q in succ[p]) for p in alive],
                                 [key[p] if key is not None else p for p in alive])
    return [alive[i] for i in order], succ


def reachable(succ: Sequence[Iterable[int]] | dict[int, set[int]], order: Iterable[int]) -> dict[int, int]:
    """Bitset of the vertices reachable from each vertex (itself excluded), ``order`` topological."""
    bits: dict[int, int] = {}
    for u in reversed(list(order)):
        bits[u] = 0
        for v in succ[u]:
            bits[u] |= (1 << v) | bits[v]
    return bits


def _renumber(problem: Problem, ranks: np.ndarray) -> np.ndarray:
    """Contiguous ranks in a topological order of the quotient (ties: first node's index)."""
    first: dict[int, int] = {}
    for v in range(problem.n - 1, -1, -1):
        first[int(ranks[v])] = v
    order, _ = label_dag(problem, ranks, first)
    new = {p: i for i, p in enumerate(order)}
    return np.array([new[int(r)] for r in ranks], dtype=np.int64)


def _merge_parts(problem: Problem, ranks: np.ndarray, a: np.ndarray, overhead: float) -> np.ndarray:
    """Greedy pairwise merges of parts of one device (ranks must be topological)."""
    ranks = ranks.copy()
    if int(ranks.max()) < 1:
        return ranks

    def quotient(r: np.ndarray) -> tuple[list[int], dict[int, set[int]], dict[int, int]]:
        """The parts alive, their successors, and the parts reachable from each (bitsets)."""
        order, succ = label_dag(problem, r)
        return sorted(succ), succ, reachable(succ, order)

    device_of = {int(ranks[v]): int(a[v]) for v in range(problem.n)}

    def predicted(r: np.ndarray) -> float:
        rr = _renumber(problem, r)
        return predicted_makespan(problem, rr, part_devices(rr, a), overhead)

    current = predicted(ranks)
    for _sweep in range(6):
        merged_any = False
        alive, succ, reach = quotient(ranks)
        for p in alive:
            if p not in reach:
                continue  # merged away in this sweep
            same = [q for q in reach if q != p and device_of[q] == device_of[p]]
            # neighbours in the quotient first, then the nearest in rank
            same.sort(key=lambda q: (0 if q in succ[p] or p in succ[q] else 1, abs(q - p), q))
            for q in same[:8]:
                if q not in reach or p not in reach:
                    continue
                # merging p and q is acyclic iff no path p -> x -> q (or q -> x -> p) via another part
                if any((reach[x] >> q) & 1 for x in _bits(reach[p]) if x != q) or any(
                    (reach[x] >> p) & 1 for x in _bits(reach[q]) if x != p
                ):
                    continue
                keep, drop = min(p, q), max(p, q)
                trial = np.where(ranks == drop, keep, ranks)
                value = predicted(trial)
                if value <= current + 1e-9:
                    ranks, current, merged_any = trial, value, True
                    alive, succ, reach = quotient(ranks)
                    if p not in reach:
                        break
        if not merged_any:
            break
    return ranks


def _bits(x: int) -> list[int]:
    """The indices of ``x``'s set bits, lowest first."""
    return [i for i in range(x.bit_length()) if (x >> i) & 1]


def part_devices(ranks: np.ndarray, assign: np.ndarray) -> list[int]:
    """The device of each part (every node of a part shares it)."""
    k = int(np.max(ranks)) + 1
    out = [-1] * k
    for v, r in enumerate(ranks):
        if out[int(r)] == -1:
            out[int(r)] = int(assign[v])
        elif out[int(r)] != int(assign[v]):
            raise ValueError(f"part {int(r)} mixes devices {out[int(r)]} and {int(assign[v])}")
    return out


def is_monotone(problem: Problem, ranks: np.ndarray) -> bool:
    return all(ranks[u] <= ranks[v] for u, v, _ in problem.edges)


def predicted_makespan(problem: Problem, ranks: np.ndarray, devices: Sequence[int] | None, overhead: float) -> float:
    """The plan's predicted makespan: parts as tasks on their device (or HEFT's choice when
    the plan leaves placement to the runtime)."""
    q = problem.quotient(ranks, overhead)
    dev = list(devices) if devices is not None else list(eft_assign(q))
    return min(makespan(q, dev), makespan(q, dev, list(range(q.n))))
