"""The METIS k-way cut, through pymetis, with target shares and integer weights."""

from __future__ import annotations

import numpy as np
import pymetis

from staronnx.errors import PartitionError
from staronnx.partition.cquiet import c_stdout_captured, library_lines, metis_line
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
    # METIS printf()s its complaints (an empty part: "***Cannot bisect a graph with 0 vertices!")
    # to descriptor 1: kept out of the command's output, and in our error if METIS fails
    with c_stdout_captured(metis_line) as printed:
        try:
            result = pymetis.part_graph(k, adjacency=pymetis.CSRAdjacency(starts, adjacent),
                                        vweights=integer_weights(costs), eweights=eweights,
                                        tpwgts=[float(t) for t in targets],
                                        options=pymetis.Options(seed=int(seed), ncuts=4, niter=20))
        except Exception as exc:  # pymetis raises RuntimeError / its own errors on METIS failures
            failure: Exception | None = exc
        else:
            failure = None
    if failure is not None:
        said = library_lines(printed.text)
        raise PartitionError(f"METIS could not cut the graph into {k} parts: {failure}"
                             + (f" (METIS said: {said})" if said else "")) from None
    return np.asarray(result.vertex_part, dtype=np.int64)
