"""The linear baseline: cut the topological order where the cumulative cost crosses each share.

It is what a pipeline-parallel system does by default, and the yardstick METIS must beat on
cut bytes at equal balance.
"""

from __future__ import annotations

import numpy as np


def linear_ranks(costs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Part index per vertex (vertices in topological order); every part gets >= 1 vertex."""
    n, k = len(costs), len(targets)
    costs = np.asarray(costs, dtype=float)
    total = float(costs.sum()) or 1.0
    midpoints = (np.cumsum(costs) - costs / 2) / total
    bounds = np.cumsum(targets)[:-1]
    ranks = np.searchsorted(bounds, midpoints, side="right").astype(np.int64)
    # every part needs at least one vertex: clamp the cut positions
    cuts = [int(np.searchsorted(ranks, r, side="left")) for r in range(1, k)]
    for i in range(len(cuts)):
        low = (cuts[i - 1] + 1) if i else 1
        high = n - (k - 1 - i)
        cuts[i] = min(max(cuts[i], low), high)
    out = np.zeros(n, dtype=np.int64)
    for r, c in enumerate(cuts, start=1):
        out[c:] = r
    return out
