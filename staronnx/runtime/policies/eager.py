"""eager: one central FIFO shared by all workers (StarPU's ``eager_central_policy.c``).

A worker that goes idle takes the oldest task it can run (the oldest of the parts it holds,
when workers hold different models). StarPU's documentation says
priorities go to the front; its code does not, and neither do we. Service targets of a shared
runtime do: a task with a deadline or a model priority passes the queued tasks it runs before
(:func:`~staronnx.runtime.sched.runs_before`), so ``eager`` serves several models EDF. Nothing is decided at push,
so the engine does not prefetch (StarPU only prefetches single-architecture tasks here, and
every part of a plan runs on every architecture).
"""

from __future__ import annotations

import math
from collections import deque

from staronnx.runtime.policies._common import insert_sorted
from staronnx.runtime.sched import Policy, TaskView


class EagerPolicy(Policy):
    """Central FIFO: first come, first served by whichever worker asks first."""

    name = "eager"
    places_at_push = False
    reads_data = False

    def __init__(self) -> None:
        self._queue: deque[TaskView] = deque()
        self._alive: set[int] = set()

    def setup(self) -> None:
        self._alive = {w.id for w in self.workers}

    def push(self, task: TaskView) -> int | None:
        if task.level or task.deadline != math.inf:  # sched.has_target, inlined: every task asks
            insert_sorted(self._queue, task)
        else:
            self._queue.append(task)
        return None

    def pop(self, worker_id: int) -> TaskView | None:
        # Where every worker holds every part, "the first task it can run" is the head; a
        # worker that holds only some parts (``where``) takes the first one it holds.
        queue = self._queue
        if worker_id not in self._alive or not queue:
            return None
        where = self.where
        if where is None or worker_id in where[queue[0].part]:
            return queue.popleft()
        for i, task in enumerate(queue):
            if worker_id in where[task.part]:
                del queue[i]
                return task
        return None

    def remove_worker(self, worker_id: int) -> list[TaskView]:
        """Nothing is queued *on* a worker here; the dead one just stops popping."""
        self._alive.discard(worker_id)
        return []

    def pending(self) -> int:
        return len(self._queue)
