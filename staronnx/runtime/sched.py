"""The contract between scheduling policies and whatever executes tasks.

Policies are pure: they never import ONNX Runtime nor read a real clock, and see only
:class:`WorkerInfo`, :class:`TaskView`, a :class:`Predictor` and a :class:`Clock` (seconds), so
the native engine (real threads, ``time.perf_counter``) and the simulator (simulated clock,
perf-model samples) drive the very same objects. The engine serialises all calls to a policy
under its own lock, so a policy needs no locking of its own.

Call protocol: ``attach`` once; ``push(task)`` when a task is ready, returning its worker when
the policy decides at push time (dm/dmda/...: the engine then prefetches the inputs to that
worker's memory node) or ``None`` when it waits in a shared queue (eager, ws); ``pop(worker_id)``
when a worker is idle; ``on_start``/``on_done`` around each run (StarPU's exp_start/exp_len/
exp_end); ``remove_worker`` when a worker dies, returning its queued tasks to be pushed again.
A worker may hold only some parts (a runtime whose workers cannot all load every model):
``attach`` then receives ``where``, and a policy places a task only on, and pops it only for,
a worker that holds its part (:meth:`Policy.can_run`); the core never pushes a task that no
live worker holds.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Collection, NamedTuple, Protocol, Sequence

if TYPE_CHECKING:
    from staronnx.perfmodels import Footprint


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic clock (real or simulated)."""
        ...


@dataclass(frozen=True)
class WorkerInfo:
    """A worker as a policy sees it."""

    id: int
    name: str
    arch: str  # perf-model architecture: "cpu<ncores>" or "cuda<device>"
    kind: str  # "cpu" or "cuda"
    memory_node: str  # "numa0", "cuda0", ...
    ncores: int = 1

    @property
    def speedup(self) -> float:
        """StarPU's relative speed of an architecture (CPU 0.5 per core, CUDA 13.33), used when
        nothing is calibrated and by the random policy."""
        return 13.33 if self.kind == "cuda" else 0.5 * self.ncores


class DataView(NamedTuple):
    """One input of a task: a data handle, its size and where valid copies are (a named
    tuple: immutable like a frozen dataclass, built in a third of its time, per task)."""

    handle: int  # which handle (its ``id()``: unique while its request runs)
    name: str
    nbytes: int
    valid_on: frozenset[str]  # memory nodes holding a valid copy


@dataclass(slots=True)
class TaskView:
    """A task as a policy sees it: one part applied to one batch."""

    id: int
    part: int
    batch: int
    request: int
    inputs: Sequence[DataView] = ()  # empty for a policy that does not read them (``reads_data``)
    priority: float = 0.0  # higher runs first in priority-sorted queues (heft sets it)
    submitted_at: float = 0.0
    #: when its request must be answered (its model's latency target; inf: no target): ready
    #: tasks run earliest deadline first, before heft's priorities (see :func:`runs_before`)
    deadline: float = math.inf
    #: its model's priority: a higher level runs before any deadline or rank
    level: int = 0
    #: filled by dm/dmda-style policies when they place the task (for accounting and stats)
    predicted: float = math.nan
    transfer: float = 0.0
    placed_on: int | None = None
    #: the perf-model key of this task (input shapes); None: no model applies
    footprint: Footprint | None = None
    #: the worker whose completion made this task ready (locality for ws and lws)
    releasing_worker: int | None = None
    #: its final outputs (name, bytes), where their sizes are known at push: a worker on a GPU
    #: writes them back to the host, a copy its prediction includes
    outputs: tuple[tuple[str, int], ...] = ()
    #: what a policy notes on a task for its own accounting and for stats
    extra: dict[str, Any] = field(default_factory=dict)


def runs_before(a: TaskView, b: TaskView) -> bool:
    """Whether ``a`` must run before ``b`` in an ordered queue: its model's priority first,
    then the earlier deadline (EDF across models sharing a runtime), then the task's own
    priority (heft's upward ranks within a request). With no service targets (every level 0,
    every deadline inf) this is StarPU's plain priority order."""
    if a.level != b.level:
        return a.level > b.level
    if a.deadline != b.deadline:
        return a.deadline < b.deadline
    return a.priority > b.priority


def has_target(task: TaskView) -> bool:
    """Whether the task carries a service target (a deadline or a model priority), i.e.
    whether a FIFO queue must still let it pass the tasks that have none."""
    return task.level != 0 or task.deadline != math.inf


class Predictor(Protocol):
    """Perf-model predictions a policy may ask for."""

    def exec_time(self, task: TaskView, worker: WorkerInfo) -> float:
        """Predicted execution time of ``task`` on ``worker``'s arch: NaN when the model is not
        calibrated yet, 0.0 when there is no model at all. It may depend on the worker only
        through its arch: a decision asks once per arch (a GPU's streams are alike)."""
        ...

    def transfer_time(self, task: TaskView, worker: WorkerInfo) -> float:
        """Predicted time of the copies the task makes on ``worker``: its inputs brought to
        ``worker``'s memory node from their cheapest valid copies, and its final outputs
        written back to the host from a GPU (:func:`staronnx.runtime.datawizard.task_copies`;
        0 when there is nothing to move). It may depend on the worker only through its memory
        node: a decision asks once per node."""
        ...


class Policy(ABC):
    """A scheduling policy; see the module docstring for the call protocol."""

    name: str = "?"
    #: True when push() decides the worker (the engine then prefetches the inputs)
    places_at_push: bool = False
    #: False for a policy that never reads ``TaskView.inputs`` (nor asks the predictor for
    #: transfer times): the core then spares each task a view per input
    reads_data: bool = True
    #: per part, the workers that hold it (see :meth:`attach`); None: every worker, every part
    where: list[frozenset[int]] | None = None

    def attach(
        self,
        workers: Sequence[WorkerInfo],
        predictor: Predictor,
        clock: Clock,
        dag: Sequence[Sequence[int]] = (),
        where: Sequence[Collection[int]] | None = None,
    ) -> None:
        """Receive the workers, predictions, clock, the plan's DAG (successors per part) and
        ``where``: per part, the ids of the workers that hold it (StarPU's ``can_execute``);
        None when every worker holds every part."""
        self.workers = list(workers)
        self.predictor = predictor
        self.clock = clock
        self.dag = [list(s) for s in dag]
        self.where = None if where is None else [frozenset(w) for w in where]
        self.setup()

    def can_run(self, worker_id: int, part: int) -> bool:
        """Whether worker ``worker_id`` holds ``part`` (a session for it): a policy never
        places or hands a task to a worker that does not (StarPU's
        ``starpu_worker_can_execute_task``)."""
        return self.where is None or worker_id in self.where[part]

    def holders(self, order: Sequence[WorkerInfo], part: int) -> Sequence[WorkerInfo]:
        """``order`` (the live workers, in the policy's order) less those that do not hold
        ``part``: the candidates of a decision. The list itself when every worker holds
        every part, so the common case costs nothing."""
        if self.where is None:
            return order
        where = self.where[part]
        return [w for w in order if w.id in where]

    def setup(self) -> None:
        """Build per-worker state once ``workers``, ``predictor``, ``clock`` and ``dag`` are
        set (called by :meth:`attach`); policies with queues override this."""

    @abstractmethod
    def push(self, task: TaskView) -> int | None: ...

    @abstractmethod
    def pop(self, worker_id: int) -> TaskView | None: ...

    def on_start(self, worker_id: int, task: TaskView, now: float) -> None:
        """Bookkeeping when a worker starts a task (default: nothing)."""

    def on_done(self, worker_id: int, task: TaskView, measured: float, now: float) -> None:
        """Bookkeeping when a worker finished a task (default: nothing)."""

    @abstractmethod
    def remove_worker(self, worker_id: int) -> list[TaskView]: ...

    @abstractmethod
    def pending(self) -> int:
        """Tasks pushed but not yet popped."""
