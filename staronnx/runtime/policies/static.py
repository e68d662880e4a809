"""static: every task of a part goes to the worker its plan chose (placement methods).

SIR+, DUET, OverSeer and the MILP decide a device per part offline; ``staronnx partition
--method duet`` records it in each part's ``device``. Running such a plan under a dynamic
policy would measure heft on the method's cut, not the method, so this policy pins part p to
the worker named ``devices[p]`` with a FIFO per worker. A part whose worker is gone (or was
never there) is an error at attach time, not a silent fallback. On a runtime shared by several
models, a task with a service target (a deadline or a model priority) passes the queued tasks
it runs before, as in every other policy's queues: the placement is the plan's, the order the
targets'.
"""

from __future__ import annotations

from collections import deque
from typing import Mapping

from staronnx.runtime.policies._common import PolicyError, insert_sorted
from staronnx.runtime.sched import Policy, TaskView, has_target


class StaticPolicy(Policy):
    """Part -> worker name, fixed; per-worker FIFO queues (targeted tasks first, EDF)."""

    name = "static"
    places_at_push = True
    reads_data = False

    def __init__(self, devices: Mapping[int, str] | None = None) -> None:
        self.devices = {int(p): str(d) for p, d in (devices or {}).items()}
        self._queues: dict[int, deque[TaskView]] = {}
        self._worker_of: dict[int, int] = {}

    def setup(self) -> None:
        by_name = {w.name: w.id for w in self.workers}
        missing = {p: d for p, d in self.devices.items() if d not in by_name}
        if missing:
            raise PolicyError(
                f"static placement names worker(s) this runtime lacks: "
                f"{', '.join(f'part {p} -> {d}' for p, d in sorted(missing.items()))}; "
                f"workers are {', '.join(by_name)} (use the same --groups as the plan's devices)"
            )
        self._worker_of = {p: by_name[d] for p, d in self.devices.items()}
        unheld = {p: d for p, d in self.devices.items() if not self.can_run(self._worker_of[p], p)}
        if unheld:
            raise PolicyError(
                "static placement puts part(s) on worker(s) that do not hold them: "
                + ", ".join(f"part {p} -> {d}" for p, d in sorted(unheld.items()))
                + " (load those models on those workers, or choose another policy)"
            )
        self._queues = {w.id: deque() for w in self.workers}

    def push(self, task: TaskView) -> int | None:
        wid = self._worker_of.get(task.part)
        if wid is None or wid not in self._queues:
            raise PolicyError(f"static placement has no live worker for part {task.part}")
        task.placed_on = wid
        if has_target(task):
            insert_sorted(self._queues[wid], task)
        else:
            self._queues[wid].append(task)
        return wid

    def pop(self, worker_id: int) -> TaskView | None:
        queue = self._queues.get(worker_id)
        return queue.popleft() if queue else None

    def remove_worker(self, worker_id: int) -> list[TaskView]:
        """A static plan cannot move a part: its tasks are handed back and will fail to place."""
        orphans = list(self._queues.pop(worker_id, ()))
        self._worker_of = {p: w for p, w in self._worker_of.items() if w != worker_id}
        return orphans

    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values())
