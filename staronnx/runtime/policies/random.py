"""random: place each task on a worker drawn with probability proportional to its speed.

StarPU's ``random_policy.c`` draws ``u * Σ speedup`` and walks the workers until the running
sum reaches it, using the same relative speedups as dmda's greedy fallback (CPU 0.5 per core,
CUDA 13.33; :attr:`WorkerInfo.speedup`). The task then goes to that worker's local queue,
which StarPU keeps sorted by priority (FIFO among equals), so we do too; with the engine's
default priority 0 that is a plain FIFO. The worker is known at push, so the engine prefetches.
"""

from __future__ import annotations

import random as _random
from collections import deque

from staronnx.runtime.policies._common import PolicyError, insert_sorted
from staronnx.runtime.sched import Policy, TaskView, WorkerInfo


class RandomPolicy(Policy):
    """Speed-weighted random placement, then a per-worker FIFO."""

    name = "random"
    places_at_push = True
    reads_data = False

    def __init__(self, seed: int | None = None) -> None:
        if seed is not None and not isinstance(seed, int):
            raise PolicyError(f"policy option seed must be an int, got {seed!r}")
        self.seed = seed
        self._rng = _random.Random(seed)
        self._queues: dict[int, deque[TaskView]] = {}
        self._order: list[WorkerInfo] = []

    def setup(self) -> None:
        self._order = list(self.workers)
        self._queues = {w.id: deque() for w in self.workers}

    def choose(self, part: int | None = None) -> WorkerInfo:
        """Draw a worker with probability ∝ speedup (the last one absorbs rounding), among
        those that hold ``part`` (None: every live worker)."""
        order = self._order if part is None else self.holders(self._order, part)
        if not order:
            raise RuntimeError("random policy: no worker left to place a task on"
                               + ("" if part is None else f" (none holds part {part})"))
        target = self._rng.random() * sum(w.speedup for w in order)
        acc = 0.0
        for w in order:
            acc += w.speedup
            if acc > target:
                return w
        return order[-1]

    def push(self, task: TaskView) -> int | None:
        w = self.choose(task.part)
        insert_sorted(self._queues[w.id], task)
        task.placed_on = w.id
        return w.id

    def pop(self, worker_id: int) -> TaskView | None:
        q = self._queues.get(worker_id)
        return q.popleft() if q else None

    def remove_worker(self, worker_id: int) -> list[TaskView]:
        self._order = [w for w in self._order if w.id != worker_id]
        return list(self._queues.pop(worker_id, ()))

    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values())
