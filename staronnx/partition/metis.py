"""The METIS k-way cut, through pymetis, with target shares and integer weights."""

from __future__ import annotations

import numpy as np
import pymetis

from staronnx.partition.graph import ModelGraph

#: METIS wants integer weights; totals are scaled to this so they stay far from int overflow.
_WEIGHT_SCALE = 1_000_000


def integer_weights(values: np.ndarray, scale: int = _WEIGHT_SCALE) -> list[int]:
    """Positive integers proportional to values, summing to about ``scale``."""
    values = np.asarray(values, dtype=float)
    total = float(values.sum()) or 1.0
    return [max(1, int(round(x / total * scale))) for x in values]


def metis_parts(graph: ModelGraph, costs: np.ndarray, targets: np.ndarray, seed: int) -> np.ndarray:
    """METIS's own (undirected, possibly cyclic once directed) assignment of vertices to parts."""
    n, k = len(graph), len(targets)
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    neighbours: list[dict[int, int]] = [dict() for _ in range(n)]
    for u, v, nbytes in graph.edges():  # one per pair, u < v: the vertices are in topological order
        neighbours[u][v] = neighbours[v][u] = max(int(nbytes), 1)
    starts, adjacent, raw = [0], [], []
    for v in range(n):
        for u, w in sorted(neighbours[v].items()):
            adjacent.append(u)
            raw.append(w)
        starts.append(len(adjacent))
    eweights = integer_weights(np.array(raw, dtype=float)) if raw else None
    result = pymetis.part_graph(k, adjacency=pymetis.CSRAdjacency(starts, adjacent), vweights=integer_weights(costs),
                                eweights=eweights, tpwgts=[float(t) for t in targets],
                                options=pymetis.Options(seed=int(seed), ncuts=4, niter=20))
    return np.asarray(result.vertex_part, dtype=np.int64)
