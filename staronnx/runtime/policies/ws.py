"""ws / lws: one priority deque per worker, idle workers steal (StarPU's
``work_stealing_policy.c`` and ``prio_deque.c``).

Push goes to the worker that released the task (``task.releasing_worker``), so a chain of parts
stays where its data is; a new request's first parts go round-robin (in both cases only to a
worker that holds the part, and a thief steals only tasks whose part it holds). A thief takes
the *newest* task of a victim's highest-priority bucket, the least likely to have its inputs
prefetched yet; ``lws``'s proximity list is a cheap stand-in for StarPU's hwloc-distance list.

Deviation: StarPU only robs a busy victim, because its drivers poll and an idle owner takes its
own task a moment later. Our workers sleep until a push or a completion wakes them, so a thief
that skipped a queued-but-idle victim could sleep through the whole task: any non-empty victim
is fair game. A task may be stolen, so ``push`` returns ``None`` and the engine does not prefetch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from staronnx.runtime.sched import Policy, TaskView, WorkerInfo

#: a bucket's key: the model's priority, the deadline (earlier first), the task's priority
BucketKey = tuple[int, float, float]


def bucket_key(task: TaskView) -> BucketKey:
    """Higher keys run first: the order of :func:`~staronnx.runtime.sched.runs_before`
    (without service targets, the task's priority alone decides, as in StarPU)."""
    return (task.level, -task.deadline, task.priority)


class PrioDeque:
    """Tasks bucketed by priority (a shared runtime's service targets first: :func:`bucket_key`),
    each bucket a FIFO deque."""

    def __init__(self) -> None:
        self._buckets: dict[BucketKey, deque[TaskView]] = {}
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def push_back(self, task: TaskView) -> None:
        self._buckets.setdefault(bucket_key(task), deque()).append(task)
        self._n += 1

    def _take(self, prio: BucketKey, i: int) -> TaskView:
        bucket = self._buckets[prio]
        task = bucket[i]
        del bucket[i]
        if not bucket:
            del self._buckets[prio]
        self._n -= 1
        return task

    def pop_front_highest(self) -> TaskView | None:
        """The owner's pop: oldest task of the highest priority."""
        return self._take(max(self._buckets), 0) if self._n else None

    def pop_back_highest(self, runnable: Callable[[TaskView], bool] | None = None) -> TaskView | None:
        """A thief's pop: newest task of the highest priority; with ``runnable``, the newest
        of the highest priority that the thief can run (one that holds the task's part)."""
        for prio in sorted(self._buckets, reverse=True):
            bucket = self._buckets[prio]
            for i in range(len(bucket) - 1, -1, -1):
                if runnable is None or runnable(bucket[i]):
                    return self._take(prio, i)
        return None

    def drain(self) -> list[TaskView]:
        """Everything, highest priority first, oldest first within a priority."""
        out = [t for p in sorted(self._buckets, reverse=True) for t in self._buckets[p]]
        self._buckets.clear()
        self._n = 0
        return out


class WorkStealingPolicy(Policy):
    """ws: per-worker deques, push to the releasing worker, round-robin victims."""

    name = "ws"
    places_at_push = False
    reads_data = False

    def __init__(self) -> None:
        self._order: list[WorkerInfo] = []
        self._deques: dict[int, PrioDeque] = {}
        self._last_push = -1
        self._next_victim: dict[int, int] = {}

    def setup(self) -> None:
        self._order = list(self.workers)
        self._deques = {w.id: PrioDeque() for w in self.workers}
        self._last_push = -1
        self._next_victim = {w.id: 0 for w in self.workers}

    # -- push -------------------------------------------------------------------------------
    def _round_robin(self, part: int) -> int:
        """The next live worker in turn that holds ``part``."""
        if not self._order:
            raise RuntimeError(f"{self.name} policy: no worker left to place a task on")
        n = len(self._order)
        for _ in range(n):
            self._last_push = (self._last_push + 1) % n
            wid = self._order[self._last_push].id
            if self.can_run(wid, part):
                return wid
        raise RuntimeError(f"{self.name} policy: no live worker holds part {part}")

    def push(self, task: TaskView) -> int | None:
        releasing = task.releasing_worker
        if releasing is not None and releasing in self._deques and self.can_run(releasing, task.part):
            wid = releasing
        else:
            wid = self._round_robin(task.part)
        self._deques[wid].push_back(task)
        return None

    # -- pop --------------------------------------------------------------------------------
    def victims(self, thief: int) -> list[int]:
        """Candidate victims in the order ``thief`` tries them (advances the round-robin)."""
        ids = [w.id for w in self._order]
        if not ids:
            return []
        start = self._next_victim.get(thief, 0) % len(ids)
        return [i for i in ids[start:] + ids[:start] if i != thief]

    def _stolen(self, thief: int, victim: int) -> None:
        """Remember where the round-robin resumes (just after the victim robbed)."""
        ids = [w.id for w in self._order]
        self._next_victim[thief] = (ids.index(victim) + 1) % len(ids)

    def pop(self, worker_id: int) -> TaskView | None:
        own = self._deques.get(worker_id)
        if own is None:
            return None
        task = own.pop_front_highest()
        if task is not None:
            return task
        where = self.where
        runnable = None if where is None else (lambda t: worker_id in where[t.part])
        for victim in self.victims(worker_id):
            task = self._deques[victim].pop_back_highest(runnable)
            if task is not None:
                self._stolen(worker_id, victim)
                task.extra["stolen_from"] = victim
                return task
        return None

    # -- failures ---------------------------------------------------------------------------
    def remove_worker(self, worker_id: int) -> list[TaskView]:
        dq = self._deques.pop(worker_id, None)
        if worker_id in (w.id for w in self._order):
            idx = next(i for i, w in enumerate(self._order) if w.id == worker_id)
            del self._order[idx]
            if self._last_push >= idx:
                self._last_push -= 1
        self._next_victim.pop(worker_id, None)
        return dq.drain() if dq is not None else []

    def pending(self) -> int:
        return sum(len(d) for d in self._deques.values())


class LocalityWorkStealingPolicy(WorkStealingPolicy):
    """lws: like ws, but a thief tries victims by proximity (same memory node, same kind,
    then the rest; each group in cyclic worker order after the thief)."""

    name = "lws"

    def victims(self, thief: int) -> list[int]:
        ids = [w.id for w in self._order]
        me = next((w for w in self._order if w.id == thief), None)
        if me is None:
            return []
        pos = ids.index(thief)
        cyclic = [self._order[(pos + k) % len(ids)] for k in range(1, len(ids))]

        def distance(w: WorkerInfo) -> int:
            if w.memory_node == me.memory_node:
                return 0
            return 1 if w.kind == me.kind else 2

        return [w.id for w in sorted(cyclic, key=distance)]  # sorted() is stable

    def _stolen(self, thief: int, victim: int) -> None:
        """The proximity list is fixed; nothing to advance."""
