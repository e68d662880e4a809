"""heft: dmdas with HEFT's upward-rank priorities (Topcuoglu et al.).

StarPU maps any policy name starting with "heft" to plain dmda ("heft is now called dmda");
staronnx follows DESIGN.md instead and makes heft the closer reading of HEFT: a task's priority
is its part's upward rank over the plan's DAG, ``rank(p) = w(p) + max rank(s)`` over successors
``s``, with ``w(p)`` the mean predicted time of ``p`` over the live workers' architectures, and
dmdas does the rest. So a part with a long path behind it overtakes, in a worker's queue, parts
near the end of the DAG. Classic HEFT's mean edge communication cost is left out: a policy only
sees the inputs of the task being pushed, the tensors crossing an inference DAG are small next
to its parts, and dmda's own decision prices every actual transfer. Until every part has a
usable prediction every part weighs 1.0 (longest-path ranks, recomputed at each push); only
complete ranks are cached, per batch size.
"""

from __future__ import annotations

import math
from graphlib import TopologicalSorter
from typing import TYPE_CHECKING, Sequence

from staronnx.runtime.policies.dmda import DmdasPolicy
from staronnx.runtime.sched import TaskView, WorkerInfo

if TYPE_CHECKING:
    from staronnx.perfmodels import Footprint


def upward_ranks(successors: Sequence[Sequence[int]], weights: Sequence[float]) -> list[float]:
    """rank(p) = weights[p] + max(rank(s) for s in successors[p]), for every part p.

    ``successors`` may be shorter than ``weights`` (missing entries have no successor).
    Raises graphlib.CycleError on a cyclic graph (a plan is acyclic by construction).
    """
    n = len(weights)
    succ = [list(successors[p]) if p < len(successors) else [] for p in range(n)]
    # "depending on" a successor makes static_order() yield successors first
    order = TopologicalSorter({p: succ[p] for p in range(n)}).static_order()
    rank = [0.0] * n
    for p in order:
        rank[p] = weights[p] + max((rank[s] for s in succ[p]), default=0.0)
    return rank


class HeftPolicy(DmdasPolicy):
    """heft = dmdas + upward-rank priorities (see the module docstring)."""

    name = "heft"
    #: (set up with the workers) upward ranks per batch size, and the footprint last seen per
    #: (part, batch size), with which the other parts' models are probed
    _ranks: dict[int, list[float]]
    _footprints: dict[tuple[int, int], Footprint | None]

    def setup(self) -> None:
        super().setup()
        self._ranks = {}
        self._footprints = {}

    def push(self, task: TaskView) -> int | None:
        fp = task.footprint
        if fp is not None:
            self._footprints[(task.part, task.batch)] = fp
        task.priority = self.ranks(task.batch, task)[task.part]
        return super().push(task)

    def ranks(self, batch: int, task: TaskView | None = None) -> list[float]:
        """Upward ranks of every part at ``batch`` (``task``, if given, is its own probe)."""
        n = max(len(self.dag), task.part + 1 if task is not None else 0)
        cached = self._ranks.get(batch)
        if cached is not None and len(cached) >= n:
            return cached
        weights = [self.part_weight(p, batch, task) for p in range(n)]
        known = [w for w in weights if w is not None]
        if len(known) < n:
            return upward_ranks(self.dag, [1.0] * n)  # not cached: models may calibrate
        ranks = upward_ranks(self.dag, known)
        self._ranks[batch] = ranks
        return ranks

    def part_weight(self, part: int, batch: int, task: TaskView | None = None) -> float | None:
        """Mean predicted time of ``part`` at ``batch`` over the live archs that hold it, or None
        when some arch has no usable prediction (NaN: not calibrated yet; 0: no model). Other parts than
        ``task``'s are probed with the footprint last seen for them: models are keyed by it."""
        if task is not None and task.part == part and task.batch == batch:
            probe = task
        else:
            probe = TaskView(id=-1, part=part, batch=batch, request=-1, footprint=self._footprints.get((part, batch)))
        archs: dict[str, WorkerInfo] = {}
        for w in self.holders(self._order, part):
            archs.setdefault(w.arch, w)
        if not archs:
            return None
        times = [self.predictor.exec_time(probe, w) for w in archs.values()]
        if not all(math.isfinite(t) and t > 0.0 for t in times):
            return None
        return sum(times) / len(times)

    def remove_worker(self, worker_id: int) -> list[TaskView]:
        """The set of live archs may change, and with it the mean times: drop cached ranks."""
        self._ranks = {}
        return super().remove_worker(worker_id)
