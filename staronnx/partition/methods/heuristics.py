"""SIR+'s Comm+SD, DUET and OverSeer: a device per node from costs per device and transfers.

Each works on a :class:`~staronnx.partition.methods.model.Problem` and returns an
:class:`Assignment`; the pipeline turns it into parts. They are written from the papers'
descriptions (see DESIGN.md) on the shared cost model, so they can be compared on equal terms.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from staronnx.partition.methods.model import Problem, label_dag, makespan


@dataclass
class Assignment:
    """A device index per node, what the method reports about itself, and schedule orders it
    found (the MILP's start order) for the predicted makespan."""

    devices: np.ndarray
    info: dict[str, Any] = field(default_factory=dict)
    orders: list[list[int]] = field(default_factory=list)


# -- SIR+ Comm+SD --------------------------------------------------------------------------------


def comm_sd_pass(problem: Problem, assign: np.ndarray, alpha: float) -> tuple[np.ndarray, int]:
    """One topological sweep of Comm+SD; returns the new assignment and how many nodes moved.

    Each node's cost on a device is when it would finish there (queueing behind the nodes
    already swept onto that device, and its inputs' transfers) plus the transfers of its outputs
    to its successors where they sit now (the previous sweep's devices). A node moves to the
    cheapest device only when that saves more than ``alpha`` µs (SIR+'s hysteresis: queueing
    delay must exceed slowdown + communication + alpha).
    """
    a = [int(x) for x in assign]
    n, d = problem.n, problem.d
    cost = problem.cost.tolist()
    finish = [0.0] * n
    free = [0.0] * d
    moves = 0
    for v in range(n):
        totals = []
        efts = []
        for dv in range(d):
            ready = max((finish[u] + problem.comm_table(nbytes)[a[u]][dv] for u, nbytes in problem.in_edges[v]),
                        default=0.0)
            eft = max(ready, free[dv]) + cost[v][dv]
            out = sum(problem.comm_table(nbytes)[dv][a[s]] for s, nbytes in problem.out_edges[v])
            efts.append(eft)
            totals.append(eft + out)
        cur = a[v]
        best = min(range(d), key=lambda x: (totals[x], x))
        if best != cur and totals[cur] > totals[best] + alpha:
            a[v] = best
            moves += 1
        finish[v] = efts[a[v]]
        free[a[v]] = finish[v]
    return np.array(a, dtype=np.int64), moves


def comm_sd(problem: Problem, alpha: float = 100.0, max_iterations: int = 50) -> Assignment:
    """SIR+ Comm+SD: every node on its fastest device, then sweeps of :func:`comm_sd_pass` to a
    fixed point (no node moves), at most ``max_iterations`` sweeps. ``alpha`` in µs."""
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0 µs, got {alpha}")
    a = problem.fastest()
    history: list[int] = []  # nodes moved per sweep
    while len(history) < max_iterations and (not history or history[-1]):
        a, moves = comm_sd_pass(problem, a, alpha)
        history.append(moves)
    converged = bool(history) and history[-1] == 0
    return Assignment(a, {"alpha_us": alpha, "iterations": len(history), "converged": converged,
                          "moves_per_sweep": history})


# -- DUET -------------------------------------------------------------------------------------------


def duet_subgraphs(problem: Problem) -> list[list[int]]:
    """Coarse subgraphs from the phase structure.

    A node is *narrow* when everything after it in the topological order depends on what came
    before only through it (model inputs count as a virtual source, so branches that start
    from an input are parallel). Runs of narrow nodes are sequential phases (one subgraph
    each); the nodes between them form multi-path phases, split into their weakly connected
    components (the parallel branches), one subgraph each.
    """
    n = problem.n
    bad = np.zeros(n + 1, dtype=np.int64)
    for u, v, _ in problem.edges:
        if v > u + 1:
            bad[u + 1] += 1
            bad[v] -= 1
    sources = [v for v in range(n) if not problem.preds[v]]
    if sources:  # virtual source -> every source node: boundaries before the last source
        bad[0] += 1
        bad[max(sources)] -= 1
    narrow = np.cumsum(bad)[:n] == 0
    groups: list[list[int]] = []
    for sequential, nodes in itertools.groupby(range(n), key=lambda v: bool(narrow[v])):
        run = list(nodes)
        groups.extend([run] if sequential else _components(problem, run))
    return groups


def _components(problem: Problem, nodes: list[int]) -> list[list[int]]:
    inside = set(nodes)
    parent = {v: v for v in nodes}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for v in nodes:
        for w in problem.succs[v]:
            if w in inside:
                parent[find(v)] = find(w)
    comps: dict[int, list[int]] = {}
    for v in nodes:
        comps.setdefault(find(v), []).append(v)
    return sorted(comps.values(), key=lambda c: c[0])


def duet(problem: Problem, max_rounds: int = 100) -> Assignment:
    """DUET: coarse subgraphs; the critical path on the faster device; the rest greedily on the
    device that least lengthens the predicted latency; then Kernighan-Lin-style correction:
    the best single move or pairwise swap of subgraphs between devices, while it lowers the
    predicted latency."""
    groups = duet_subgraphs(problem)
    g = len(groups)
    sub_cost = np.array([problem.cost[grp].sum(axis=0) for grp in groups])  # (g, D)
    fastest = np.argmin(sub_cost, axis=1)
    owner = np.empty(problem.n, dtype=np.int64)
    for i, grp in enumerate(groups):
        owner[grp] = i
    # subgraph DAG and its critical path (faster-device costs)
    order, gsucc = label_dag(problem, owner)
    best_cost = sub_cost.min(axis=1)
    down = np.zeros(g)
    nxt = [-1] * g
    for i in reversed(order):
        best, arg = 0.0, -1
        for j in gsucc[i]:
            if down[j] > best:
                best, arg = down[j], j
        down[i] = best_cost[i] + best
        nxt[i] = arg
    heads = sorted(set(range(g)) - {j for i in range(g) for j in gsucc[i]})
    critical: list[int] = []
    cur = max(heads, key=lambda i: down[i]) if heads else -1
    while cur != -1:
        critical.append(cur)
        cur = nxt[cur]

    placed = fastest.copy()  # unplaced subgraphs count as on their faster device

    def latency(sub_devices: np.ndarray) -> float:
        return makespan(problem, sub_devices[owner])

    rest = sorted(set(range(g)) - set(critical), key=lambda i: (-best_cost[i], i))
    for i in rest:
        trials = []
        for dv in range(problem.d):
            placed[i] = dv
            trials.append((latency(placed), 0 if dv == fastest[i] else 1, dv))
        placed[i] = min(trials)[2]
    greedy_latency = latency(placed)

    def corrections() -> Iterator[np.ndarray]:
        """Every single move of a subgraph to another device, then every swap of two."""
        for i in range(g):
            for dv in range(problem.d):
                if dv != placed[i]:
                    trial = placed.copy()
                    trial[i] = dv
                    yield trial
        for i in range(g):
            for j in range(i + 1, g):
                if placed[i] != placed[j]:
                    trial = placed.copy()
                    trial[i], trial[j] = placed[j], placed[i]
                    yield trial

    current = greedy_latency
    swaps = 0
    for _ in range(max_rounds):
        value, trial = min(((latency(t), t) for t in corrections()), key=lambda m: m[0], default=(current, placed))
        if not value < current - 1e-9:
            break
        current, placed = value, trial
        swaps += 1
    return Assignment(
        placed[owner].astype(np.int64),
        {
            "subgraphs": g,
            "critical_path": len(critical),
            "latency_greedy_us": greedy_latency,
            "latency_corrected_us": current,
            "corrections": swaps,
        },
    )


# -- OverSeer ----------------------------------------------------------------------------------------


def overseer_tree(problem: Problem) -> list[int]:
    """The canonical spanning tree: each node hangs under the predecessor on its costliest
    path from a source (costs on the fastest device plus mean transfer times), so the
    model's critical path is a root-to-leaf path of the tree. -1 for roots."""
    n = problem.n
    w = problem.cost.min(axis=1)
    mean_lat, mean_pb = problem.mean_link()
    dist = np.zeros(n)
    parent = [-1] * n
    for v in range(n):
        best, arg = 0.0, -1
        for u, nbytes in problem.in_edges[v]:
            value = dist[u] + mean_lat + nbytes * mean_pb
            if arg == -1 or value > best:
                best, arg = value, u
        dist[v] = w[v] + best
        parent[v] = arg
    return parent


def overseer(problem: Problem) -> Assignment:
    """OverSeer's dynamic program over the spanning tree, O(|D|^2 |V|), then backtracked.

    On a root-to-leaf path it is cost(v, d) = f(v, d) + min_d' (g(e, d', d) + cost(parent, d'));
    we evaluate the same recursion from the leaves up, C(v, d) = f(v, d) + sum over children c
    of min_d' (g(v->c, d, d') + C(c, d')), which is identical on a chain and exact for the
    whole tree (forward costs per leaf would count shared ancestors once per leaf). Each root
    takes its cheapest device and the choices are backtracked down the tree.
    """
    n, d = problem.n, problem.d
    parent = overseer_tree(problem)
    children: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    edge_bytes = {(u, v): b for u, v, b in problem.edges}
    for v, p in enumerate(parent):
        if p >= 0:
            children[p].append((v, edge_bytes[(p, v)]))
    total = problem.cost.copy()  # C(v, d)
    choice = np.zeros((n, d), dtype=np.int64)  # best device of v given its parent's device
    for v in range(n - 1, -1, -1):
        for c, nbytes in children[v]:
            table = problem.comm_table(nbytes)
            for dv in range(d):
                options = [table[dv][dc] + total[c, dc] for dc in range(d)]
                best = int(np.argmin(options))
                total[v, dv] += options[best]
        if parent[v] >= 0:
            table = problem.comm_table(edge_bytes[(parent[v], v)])
            for dp in range(d):
                options = [table[dp][dc] + total[v, dc] for dc in range(d)]
                choice[v, dp] = int(np.argmin(options))
    a = np.zeros(n, dtype=np.int64)
    roots = [v for v in range(n) if parent[v] < 0]
    for v in range(n):  # topological: parents first
        a[v] = int(np.argmin(total[v])) if parent[v] < 0 else choice[v, a[parent[v]]]
    dp_cost = float(sum(total[r].min() for r in roots))
    return Assignment(a, {"roots": len(roots), "tree_cost_us": dp_cost})
