"""Predictions from calibrated perf models, in the form policies ask for them.

Models come from the on-disk store (filled by ``staronnx calibrate``) and keep learning while
serving: the engine records a task's measured time only while its (part, arch, footprint)
entry still needs samples, as StarPU does when a model is not calibrated yet.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Mapping

import numpy as np

from staronnx.perfmodels import BusModel, Footprint, HistoryModel, PerfModelStore
from staronnx.runtime.sched import TaskView, WorkerInfo


def task_footprint(feeds: Mapping[str, np.ndarray], batch: int) -> Footprint:
    """The footprint of a part's inputs; calibration computes it the same way.

    Serving sees the same few shapes over and over, so footprints are cached by shape: the
    CRC over the shapes is then paid once per shape, not once per task.
    """
    return _footprint(tuple((n, v.shape) for n, v in feeds.items()), batch)


@functools.lru_cache(maxsize=4096)
def _footprint(shapes: tuple[tuple[str, tuple[int, ...]], ...], batch: int) -> Footprint:
    return Footprint.from_shapes(dict(shapes), batch=batch)


class PerfPredictor:
    """Predictor over history models per (part, arch) and a bus model."""

    def __init__(self, plan_hash: str, store: PerfModelStore | None, bus: BusModel | None = None):
        self.plan_hash = plan_hash
        self.store = store
        self.bus = bus or (store.load_bus() if store is not None else BusModel())
        self._models: dict[tuple[int, str], HistoryModel] = {}
        self._lock = threading.Lock()

    def model(self, part: int, arch: str) -> HistoryModel:
        key = (part, arch)
        with self._lock:
            if key not in self._models:
                self._models[key] = (
                    self.store.load(self.plan_hash, part, arch)
                    if self.store is not None
                    else HistoryModel(part, arch)
                )
            return self._models[key]

    def exec_time(self, task: TaskView, worker: WorkerInfo) -> float:
        fp = task.extra.get("footprint")
        if fp is None:
            return 0.0
        return self.model(task.part, worker.arch).predict(fp)

    def transfer_time(self, task: TaskView, worker: WorkerInfo) -> float:
        total = 0.0
        for data in task.inputs:
            if worker.memory_node in data.valid_on or data.nbytes == 0:
                continue
            costs = [self.bus.predict(src, worker.memory_node, data.nbytes) for src in data.valid_on]
            costs = [c for c in costs if math.isfinite(c)]
            total += min(costs) if costs else 0.0
        return total

    def needs_samples(self, part: int, arch: str, fp: Footprint) -> bool:
        return self.model(part, arch).needs_samples(fp)

    def record(self, part: int, arch: str, fp: Footprint, seconds: float) -> None:
        self.model(part, arch).record(fp, seconds)

    def save(self) -> None:
        """Merge samples learnt while serving into the store (atomically, under its lock)."""
        if self.store is None:
            return
        with self._lock:
            models = list(self._models.values())
        for m in models:
            if m.unsaved_count:
                self.store.commit(self.plan_hash, m)
