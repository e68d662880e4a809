"""dm, dmda, dmdar, dmdas: StarPU's "deque model" family
(``src/sched_policies/deque_modeling_policy_data_aware.c``), reproduced decision for decision.

Every worker has a queue record (:class:`QueueState`): ``exp_start`` (when its queued work is
expected to start), ``exp_len`` (predicted work queued, transfers included), ``pipeline_len``
(work popped but not finished), ``ntasks`` (queued) and ``pipeline_ntasks``.

**Decision** at push, for each live worker *w* in worker order (StarPU's ids: accelerators
first) that holds the task's part (all of them, unless workers hold different models), with
``now`` the clock:

- ``start = max(exp_start, now)``, ``prev = exp_len``;
- ``L`` = predicted execution time, ``T`` = predicted transfer of inputs not valid on *w*'s
  memory node (dm: none);
- ``end_w = max(start + prev, now + T) + L``, ``best = min end_w``;
- ``fitness_w = alpha·(end_w − best) + beta·T + gamma·E`` (dm: ``end_w − best``). We have no
  energy model, so E = 0; the idle-power term ``gamma·idle_power·(end_w − max_end)/1e6`` is kept
  for completeness (``max_end = max_w start + prev``; off with the default idle_power 0);
- the first worker with the strictly smallest fitness wins, so ties go to the earlier worker.

Note that T counts twice (inside ``end_w`` and as ``beta·T``): dmda favours data locality on
purpose.

**CPU help that costs the GPU** (staronnx's addition; StarPU's decision has no such term): where
a part's candidates include both a GPU's streams and CPU groups, a CPU candidate's ``end_w`` is
what it costs the GPU side too (:mod:`staronnx.perfmodels.helpcost`): with ``best_gpu`` the best
GPU end, ``g`` the device time the task takes that GPU (its ``L`` over the GPU's live streams)
and ``k = help_cost.gpu_seconds(L_cpu, copies out of a GPU's memory)``, ``end_w = max(end_w,
best_gpu − g + k)``, and infinite where ``k >= g``: the GPU alone would finish the work sooner.
Without it dmda puts tasks on the CPU group whenever the GPU queue is longer than the CPU's
time, and on an H200 ``gpu+cpu`` ran 0.92x the GPU alone (batch 32, 4 streams) and 0.66x
(batch 1, 8 streams). The option ``help_cost`` (a :class:`~staronnx.perfmodels.helpcost.HelpCost`
or a mapping of its fields) sets the machine's figures; without it, the predictor's
(``PerfPredictor.help_cost``: measured on this host and stored) is charged, else the H200's share,
and ``HelpCost.free()`` gives StarPU's decision back (a host where CPU help costs the GPU nothing).

**No usable model.** If any candidate predicts NaN (not calibrated) or exactly 0 (no model),
the whole decision turns greedy: minimise ``(ntasks + pipeline_ntasks) / speedup``, and once a
NaN candidate has been seen only NaN candidates can win (forced exploration so the missing
model gets samples). Such a task is charged ``predicted = 0``.

**Push** (``push_task_on_best_worker``): ``pipeline_ntasks += 1``; ``exp_start = max(exp_start,
now)``; the part of the transfer not hidden behind the queue, ``T' = max(0, now + T −
exp_end)`` (0 when ``now + T < exp_end``); ``exp_len += T' + L``. FIFO queue for dm, dmda and
dmdar; sorted by priority (descending, FIFO among equals) for dmdas.

**Pop**: dm and dmda take the head; dmdar and dmdas take the first *ready* task
(:func:`pop_first_ready`). Then ``exp_len −= T'``, ``pipeline_len += T'``, ``exp_start = now +
pipeline_len``. **on_start** (StarPU's pre-exec hook): T' leaves the pipeline, L moves from
``exp_len`` to ``pipeline_len``, ``exp_start = now + pipeline_len``. **on_done** (post-exec
hook): ``pipeline_len −= L``, ``pipeline_ntasks −= 1``, ``exp_start = max(now + pipeline_len,
exp_start)``.

**Service targets** (several models on one runtime): a task whose model has a latency target
(a deadline) or a priority jumps, in any of these queues, the queued tasks it runs before
(:func:`~staronnx.runtime.sched.runs_before`; a FIFO queue keeps FIFO order among the others),
and its decision counts as ``prev`` only the queued work that runs before it, as StarPU's
dmdasd counts only work of priority >= the task's: a light model's task is not charged the
whole backlog of a heavy one it will pass (nor, in the greedy rule, its queued tasks).

StarPU quirk kept on purpose: ``pipeline_ntasks`` counts a task from push to completion, and
``ntasks`` from push to pop, so in the greedy rule a queued task weighs 2 and a running one 1.

Times are seconds (StarPU uses µs); alpha and beta are unitless so their defaults carry over,
and gamma keeps StarPU's "µs per joule" meaning because the idle term divides by 1e6 in both.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from staronnx.perfmodels.helpcost import HelpCost, helped_end
from staronnx.runtime.policies._common import PolicyError, check_weight, insert_sorted, pop_first_ready
from staronnx.runtime.sched import Policy, TaskView, WorkerInfo, has_target, runs_before


@dataclass
class QueueState:
    """StarPU's ``starpu_st_fifo_taskq`` for one worker: its queue and its predictions."""

    exp_start: float
    exp_len: float = 0.0
    pipeline_len: float = 0.0
    pipeline_ntasks: int = 0
    tasks: deque[TaskView] = field(default_factory=deque)

    @property
    def ntasks(self) -> int:
        """Tasks queued (pushed, not popped)."""
        return len(self.tasks)

    @property
    def exp_end(self) -> float:
        """When this worker is expected to be done with everything pushed to it."""
        return self.exp_start + self.exp_len


class Candidate(NamedTuple):
    """One worker as the decision saw it (a named tuple: one is built per worker per task)."""

    worker: int
    length: float  # L (NaN: uncalibrated, 0: no model)
    transfer: float  # T (0 for dm)
    end: float  # end_w (NaN when the decision went greedy before this worker)
    ntasks_end: float  # (ntasks + pipeline_ntasks) / speedup
    fitness: float = math.nan
    #: what this CPU candidate would cost the GPU side (HelpCost.gpu_seconds; 0 for a GPU)
    gpu_cost: float = 0.0


@dataclass(frozen=True)
class Decision:
    """Why a task went where it went; kept as ``policy.last_decision`` for tests and traces."""

    task: int
    worker: int
    forced: bool  # True when no usable model turned the decision greedy
    best_end: float
    candidates: tuple[Candidate, ...]


class DmdaPolicy(Policy):
    """dmda: minimum expected completion time, data-aware, FIFO queues, head pop."""

    name = "dmda"
    places_at_push = True
    #: count transfers (the "da" of dmda); dm does not
    data_aware = True
    #: keep each worker's queue sorted by priority (dmdas)
    sorted_queue = False
    #: pop the first ready task rather than the head (dmdar, dmdas)
    ready_first = False

    def __init__(
        self,
        alpha: float = 1.0,
        beta: float = 1.0,
        gamma: float = 1000.0,
        idle_power: float = 0.0,
        help_cost: HelpCost | Mapping[str, float] | None = None,
    ) -> None:
        #: what a CPU task costs the GPU beside it (see the module docstring): the option, else
        #: (at setup) the predictor's, measured on this host, else HelpCost's default
        self._help_option = help_cost
        self.help_cost = _help_cost(help_cost)
        self.alpha = check_weight("alpha", alpha)
        self.beta = check_weight("beta", beta)
        self.gamma = check_weight("gamma", gamma)
        self.idle_power = check_weight("idle_power", idle_power)
        self._order: list[WorkerInfo] = []
        self._nodes: dict[int, str] = {}
        self._queues: dict[int, QueueState] = {}
        self._speedups: dict[int, float] = {}
        self._streams: dict[str, int] = {}
        self.last_decision: Decision | None = None

    def setup(self) -> None:
        now = self.clock.now()
        self._order = list(self.workers)
        self._nodes = {w.id: w.memory_node for w in self.workers}
        self._queues = {w.id: QueueState(exp_start=now) for w in self.workers}
        self._speedups = {w.id: w.speedup for w in self.workers}
        measured = getattr(self.predictor, "help_cost", None)
        if self._help_option is None and isinstance(measured, HelpCost):
            self.help_cost = measured
        self._count_streams()
        self.last_decision = None

    def _count_streams(self) -> None:
        """Live CUDA workers per GPU memory node: a GPU's streams share its device."""
        self._streams = {}
        for w in self._order:
            if w.kind == "cuda":
                self._streams[w.memory_node] = self._streams.get(w.memory_node, 0) + 1

    def queue(self, worker_id: int) -> QueueState:
        """The bookkeeping of one live worker (read-only use, please)."""
        return self._queues[worker_id]

    # -- decision ---------------------------------------------------------------------------
    def _transfer(self, task: TaskView, w: WorkerInfo) -> float:
        if not self.data_aware:
            return 0.0
        t = self.predictor.transfer_time(task, w)
        return t if math.isfinite(t) else 0.0  # StarPU: a NaN transfer prediction counts as 0

    def decide(self, task: TaskView, now: float) -> Decision:
        """Pick the worker for ``task`` without changing any state."""
        if not self._order:
            raise RuntimeError(f"{self.name} policy: no worker left to place a task on")
        # (worker, L, T, end, ntasks_end) per candidate; named tuples are made once, at the end
        raw: list[tuple[int, float, float, float, float]] = []
        calibrating = unknown = False
        greedy: int | None = None
        greedy_end = 0.0
        best_end = math.inf
        max_end = -math.inf
        targeted = has_target(task)
        order = self.holders(self._order, task.part)
        if not order:
            raise RuntimeError(f"{self.name} policy: no live worker holds part {task.part}")
        # L depends on the worker only through its arch, T through its memory node (the
        # Predictor's contract): asked once per decision for each, not once per worker, so a
        # GPU's streams (alike workers) cost one prediction (with 8 streams a decision cost 6x
        # eager's host calls per task; StarPU's C loop pays little for the same repetition)
        lengths: dict[str, float] = {}
        transfers: dict[str, float] = {}
        queues, speedups, nan_ = self._queues, self._speedups, math.nan
        for w in order:
            q = queues[w.id]
            start = q.exp_start if q.exp_start > now else now
            horizon = start + (self._ahead_of(q, task) if targeted else q.exp_len)
            if horizon > max_end:
                max_end = horizon
            length = lengths.get(w.arch)
            if length is None:
                length = lengths[w.arch] = self.predictor.exec_time(task, w)
            queued = len(q.tasks) + q.pipeline_ntasks
            if targeted:  # the tasks it passes would not delay it: count those it waits for
                queued -= 2 * sum(1 for t in q.tasks if runs_before(task, t))
            ntasks_end = queued / speedups[w.id]
            nan = length != length
            # StarPU's greedy candidate, always tracked: the least loaded worker, except that a
            # first uncalibrated worker jumps the line and then only uncalibrated ones compete.
            if (
                greedy is None
                or (not calibrating and (ntasks_end < greedy_end or nan))
                or (calibrating and nan and ntasks_end < greedy_end)
            ):
                greedy, greedy_end = w.id, ntasks_end
            calibrating = calibrating or nan
            unknown = unknown or nan or length == 0.0
            if unknown:
                raw.append((w.id, length, nan_, nan_, ntasks_end))
                continue
            transfer = transfers.get(w.memory_node)
            if transfer is None:
                transfer = transfers[w.memory_node] = self._transfer(task, w)
            arrive = now + transfer
            end = (horizon if horizon > arrive else arrive) + length
            if end < best_end:
                best_end = end
            raw.append((w.id, length, transfer, end, ntasks_end))
        if unknown:
            assert greedy is not None
            return Decision(task.id, greedy, True, math.nan, tuple(Candidate(*r) for r in raw))
        costs: list[float] | None = None
        if self._streams and len(order) > 1:
            raw, costs, best_end = self._charge_cpu_help(task, order, raw, best_end)
        scored = tuple(Candidate(*r, self._fitness(r[3], r[2], best_end, max_end),
                                 0.0 if costs is None else costs[i]) for i, r in enumerate(raw))
        chosen = min(scored, key=attrgetter("fitness"))  # ties keep the earlier worker
        return Decision(task.id, chosen.worker, False, best_end, scored)

    def _charge_cpu_help(
        self, task: TaskView, order: Sequence[WorkerInfo], raw: list[tuple[int, float, float, float, float]],
        best_end: float,
    ) -> tuple[list[tuple[int, float, float, float, float]], list[float], float]:
        """Each CPU candidate's end weighed with what it costs the GPU side (the module's
        "CPU help that costs the GPU"): (raw with CPU ends replaced, each candidate's GPU-side
        cost, the new best end). Unchanged where no GPU holds the part."""
        best_gpu = math.inf
        device_s = math.inf
        for w, r in zip(order, raw):
            if w.kind == "cuda" and r[3] < best_gpu:
                best_gpu = r[3]
                device_s = r[1] / self._streams.get(w.memory_node, 1)
        costs = [0.0] * len(raw)
        if best_gpu == math.inf:
            return raw, costs, best_end
        from_gpu = any(d.nbytes and any(n.startswith("cuda") for n in d.valid_on) for d in task.inputs)
        help_cost = self.help_cost
        out = list(raw)
        best = math.inf
        for i, (w, r) in enumerate(zip(order, raw)):
            if w.kind != "cuda":
                wid, length, transfer, end, ntasks_end = r
                moved = transfer if from_gpu else 0.0  # copied out over the GPU's bus, by its driver
                costs[i] = cost = help_cost.gpu_seconds(length, moved)
                end = helped_end(end, best_gpu, device_s, cost)
                out[i] = (wid, length, transfer, end, ntasks_end)
            if out[i][3] < best:
                best = out[i][3]
        return out, costs, best

    @staticmethod
    def _ahead_of(q: QueueState, task: TaskView) -> float:
        """The queued work ``task`` will wait for on this queue: ``exp_len`` less what it
        passes (StarPU's dmdasd counts only work of priority >= the task's)."""
        passed = sum(t.predicted + t.transfer for t in q.tasks if runs_before(task, t))
        return max(q.exp_len - passed, 0.0)

    def _fitness(self, end: float, transfer: float, best_end: float, max_end: float) -> float:
        if end == math.inf:  # a CPU candidate that costs the GPU more than it frees (alpha 0 too)
            return math.inf
        if not self.data_aware:
            return end - best_end
        fit = self.alpha * (end - best_end) + self.beta * transfer  # + gamma * E, E = 0
        if end > max_end and self.idle_power:
            fit += self.gamma * self.idle_power * (end - max_end) / 1e6
        return fit

    # -- push -------------------------------------------------------------------------------
    def push(self, task: TaskView) -> int | None:
        now = self.clock.now()
        decision = self.decide(task, now)
        self.last_decision = decision
        chosen = next(c for c in decision.candidates if c.worker == decision.worker)
        length, transfer = (0.0, 0.0) if decision.forced else (chosen.length, chosen.transfer)
        q = self._queues[decision.worker]
        q.pipeline_ntasks += 1
        q.exp_start = max(q.exp_start, now)
        # the transfer overlaps the work already queued; only what sticks out costs time
        hidden = now + transfer < q.exp_end
        t_prime = 0.0 if hidden else now + transfer - q.exp_end
        q.exp_len += t_prime + length
        task.predicted = length
        task.transfer = t_prime
        task.placed_on = decision.worker
        task.extra["transfer_estimate"] = transfer
        task.extra["expected_end"] = math.nan if decision.forced else chosen.end
        task.extra["forced"] = decision.forced  # predicted=0 is a placeholder, not a model
        if self.sorted_queue or has_target(task):
            insert_sorted(q.tasks, task)
        else:
            q.tasks.append(task)
        return decision.worker

    # -- pop and hooks ----------------------------------------------------------------------
    def pop(self, worker_id: int) -> TaskView | None:
        q = self._queues.get(worker_id)
        if q is None:
            return None
        now = self.clock.now()
        q.exp_start = max(now, q.exp_start)
        if not q.tasks:
            return None
        if self.ready_first:
            task = pop_first_ready(q.tasks, self._nodes[worker_id])
            assert task is not None
        else:
            task = q.tasks.popleft()
        # its transfer starts now: from predicted work to pipelined work
        q.exp_len -= task.transfer
        q.pipeline_len += task.transfer
        q.exp_start = now + q.pipeline_len
        return task

    def on_start(self, worker_id: int, task: TaskView, now: float) -> None:
        q = self._queues.get(worker_id)
        if q is None:
            return
        q.pipeline_len -= task.transfer  # the transfer is over
        q.exp_len -= task.predicted  # the computation starts: predicted -> pipelined
        q.pipeline_len += task.predicted
        q.exp_start = now + q.pipeline_len

    def on_done(self, worker_id: int, task: TaskView, measured: float, now: float) -> None:
        q = self._queues.get(worker_id)
        if q is None:
            return
        q.pipeline_len -= task.predicted
        q.pipeline_ntasks = max(0, q.pipeline_ntasks - 1)
        q.exp_start = max(now + q.pipeline_len, q.exp_start)

    # -- failures ---------------------------------------------------------------------------
    def remove_worker(self, worker_id: int) -> list[TaskView]:
        self._order = [w for w in self._order if w.id != worker_id]
        self._count_streams()
        q = self._queues.pop(worker_id, None)
        return list(q.tasks) if q is not None else []

    def pending(self) -> int:
        return sum(q.ntasks for q in self._queues.values())


def _help_cost(value: HelpCost | Mapping[str, float] | None) -> HelpCost:
    """The ``help_cost`` option: a HelpCost, its fields as a mapping (a config file's), or None
    for the default (the H200's share, until a machine measures its own)."""
    if value is None:
        return HelpCost()
    if isinstance(value, HelpCost):
        return value
    if isinstance(value, Mapping):
        try:
            return HelpCost(**{k: float(v) for k, v in value.items()})
        except (TypeError, ValueError) as exc:
            raise PolicyError(f"policy option help_cost: {exc}") from None
    raise PolicyError(f"policy option help_cost must be a HelpCost or a mapping of its fields "
                      f"(host_share, task_s), got {value!r}")


class DmPolicy(DmdaPolicy):
    """dm: like dmda but blind to data: no transfer term, in the end time nor the fitness.

    Its fitness is ``end_w − best`` alone, so alpha, beta, gamma and idle_power are accepted
    (one option set for the whole family) but have no effect, as in StarPU.
    """

    name = "dm"
    data_aware = False


class DmdarPolicy(DmdaPolicy):
    """dmdar: dmda whose workers pop the first task with its inputs ready on their node."""

    name = "dmdar"
    ready_first = True


class DmdasPolicy(DmdaPolicy):
    """dmdas: dmda with priority-sorted queues and ready-first pops (StarPU's recommendation)."""

    name = "dmdas"
    sorted_queue = True
    ready_first = True
