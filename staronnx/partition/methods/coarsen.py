"""Coarse units for the exact placement: series chains, then DUET's phase subgraphs.

Why: the MILP's ordering binaries grow with the square of the node count, so HiGHS proves
optimality on tens of nodes, not on googlenet's 139. Real DNN graphs are mostly series chains
(conv -> relu -> conv -> relu inside a branch), and SIR+ itself solves its MILP over such
contracted graphs. Contracting them keeps every branch point and join, i.e. every placement
decision that creates parallelism, and gives a graph small enough to solve exactly; the
answer is then optimal *among placements that keep each chain on one device* (moving part of a
chain only adds a transfer inside a sequence that cannot overlap with itself, which rarely
pays). Where chains are not enough, DUET's phase subgraphs (sequential phases and the
parallel branches of multi-path phases) are the next coarser level.

A coarsening is a *monotone* unit numbering (every edge goes from a lower or equal unit to a
higher or equal one), so :meth:`Problem.quotient` is again a DAG in topological order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from staronnx.partition.methods.model import Problem, chains


@dataclass
class Coarsening:
    """Unit per node, the level used, and the unit-level problem."""

    units: np.ndarray  # unit index per node (monotone)
    level: str  # "nodes", "chains" or "phases"
    problem: Problem

    @property
    def k(self) -> int:
        return self.problem.n

    def expand(self, unit_devices: np.ndarray) -> np.ndarray:
        """A device per node from a device per unit."""
        devices: np.ndarray = np.asarray(unit_devices, dtype=np.int64)[self.units]
        return devices

    def expand_order(self, unit_order: list[int]) -> list[int]:
        """A node order from a topological unit order: each unit's nodes in index order."""
        members: list[list[int]] = [[] for _ in range(self.k)]
        for v, u in enumerate(self.units):
            members[int(u)].append(v)
        return [v for u in unit_order for v in members[u]]


def _number(groups: list[list[int]], n: int) -> np.ndarray:
    """Units numbered by their first node, which is topological for chains and phases."""
    units = np.empty(n, dtype=np.int64)
    for i, g in enumerate(sorted(groups, key=min)):
        units[g] = i
    return units


def chain_units(problem: Problem) -> np.ndarray:
    """Contract series chains: v joins u's unit when u -> v is u's only out-edge and v's only
    in-edge (:func:`~staronnx.partition.methods.model.chains`, numbered by their first node)."""
    return np.unique(chains(problem), return_inverse=True)[1].astype(np.int64)


def phase_units(problem: Problem) -> np.ndarray:
    """DUET's coarse subgraphs (see :func:`~staronnx.partition.methods.heuristics.duet_subgraphs`)."""
    from staronnx.partition.methods.heuristics import duet_subgraphs

    return _number(duet_subgraphs(problem), problem.n)


def coarsen(problem: Problem, max_units: int) -> Coarsening | None:
    """The finest level with at most ``max_units`` units: nodes, chains, then phases; None if none fits."""
    if problem.n <= max_units:
        return Coarsening(np.arange(problem.n, dtype=np.int64), "nodes", problem)
    for level, build in (("chains", chain_units), ("phases", phase_units)):
        units = build(problem)
        if int(units.max()) + 1 <= max_units:
            return Coarsening(units, level, problem.quotient(units))
    return None
