"""The task-graph core: requests, tasks, data handles, dependencies, policy calls, statistics.

Why one core: the native engine (threads, real workers) and the simulator (a virtual clock,
workers timed by the perf models) must take the very same decisions, as StarPU's SimGrid mode
swaps the clock and the workers but never the core. So this module knows no clock and no
thread: its caller says what time it is (``now``) and serialises the calls (the engine holds
its lock; the simulator is single-threaded), and it never runs anything itself.

A request is one batch: one task per part, one data handle per tensor
(:class:`~staronnx.runtime.datawizard.DataHandle`: the engine keeps the copies in it, the
simulator none). A handle knows the memory nodes holding a valid copy (StarPU's MSI states reduced to what a read-mostly inference
DAG needs: written once on its producer's node, then shared by the nodes that read it), so
policies price transfers and prefer workers where the data already is. Which copies a task
makes is decided here, when a worker takes it, by :mod:`staronnx.runtime.datawizard`'s rules
(the ones the predictor prices): ``Task.copies`` lists them and ``Task.keep`` the fetched
inputs that stay valid on the worker's node; the driver issues exactly those (the engine), or
charges their bus time (the simulator). A task is pushed to the
policy once every part it reads from has finished; the worker whose completion released it is
passed along (``TaskView.releasing_worker``) for locality-aware stealing.

Several plans may share one core (:class:`~staronnx.runtime.models.ModelSet`): a request is for
one model and gets one task per part of that model; parts are numbered globally, so workers,
policies and perf models see codelets, as StarPU's do. A model's service target gives its
tasks a deadline (arrival + latency target) and a level (its priority), which ordered queues
honour; the core counts per model what a shared machine must answer for: requests in flight,
deadline misses and each worker's busy time spent on it.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from staronnx.perfmodels import Footprint
from staronnx.plan import Plan
from staronnx.runtime.datawizard import (HOST_NODE, Copy, CopyCost, DataHandle, copy_kind, is_host, produced_on,
                                         source)
from staronnx.runtime.models import ModelSet
from staronnx.runtime.sched import Clock, DataView, Policy, Predictor, TaskView, WorkerInfo
from staronnx.runtime.task import announce_cancelled

if TYPE_CHECKING:
    import numpy as np

    from staronnx.workers.replicas import DeviceTensor

_ON_HOST = frozenset((HOST_NODE,))

@dataclass(eq=False, slots=True)
class Task:
    """One part applied to one request's batch."""

    request: Request
    part: int
    waiting: int  # parts whose outputs this task still needs
    view: TaskView | None = None
    ready_at: float = 0.0
    ended_at: float = 0.0
    worker: int | None = None
    #: the copies it makes on its worker (decided when taken): fetches of its inputs, and the
    #: write-backs of its final outputs where their sizes are known by then
    copies: Sequence[Copy] = ()
    #: its fetched inputs that stay valid on its worker's node (another reader is to come)
    keep: tuple[str, ...] = ()
    #: the copies to its worker's node started when the policy placed it (prefetches)
    prefetched: Sequence[Copy] = ()


@dataclass(eq=False, slots=True)
class Request:
    """One submitted batch travelling through the plan.

    ``handles`` has a handle per input and per output another part reads; the core drops an
    intermediate's copies once its last reader is done. ``results`` holds the host copies of
    its final outputs the driver made (the engine's answer; a handle only for one another
    part also reads).
    """

    id: int
    batch: int
    submitted_at: float
    parts_left: int
    handles: dict[str, DataHandle]
    owner: Any = None  # the driver's own record of the request (a future, a batch record)
    tasks: list[Task] = field(default_factory=list)  # by the model's own part index
    placement: dict[str, str] = field(default_factory=dict)  # "part<k>" -> arch
    failed: bool = False
    model: int = 0  # its model's index in the core's ModelSet
    first_part: int = 0  # the global number of its model's part 0
    deadline: float = math.inf  # arrival + its model's latency target
    results: dict[str, np.ndarray] = field(default_factory=dict)
    #: why it failed where no task of it did: the policy could not place one of its tasks
    error: BaseException | None = None

    def task(self, part: int) -> Task:
        """Its task of global part ``part``."""
        return self.tasks[part - self.first_part]


@dataclass(eq=False)
class WorkerState:
    """A worker as the core tracks it."""

    info: WorkerInfo
    alive: bool = True
    #: tasks popped and not finished, in the order popped (a dict used as an ordered set): one,
    #: or two when the next is launched ahead (pipelined)
    running: dict[Task, None] = field(default_factory=dict)
    busy_seconds: float = 0.0
    tasks: int = 0
    #: busy seconds per model (index in the ModelSet): who used this worker
    busy_by_model: list[float] = field(default_factory=list)


@dataclass(eq=False)
class ModelCounters:
    """What the core counts per hosted model."""

    in_flight: int = 0
    done: int = 0
    failed: int = 0
    deadline_misses: int = 0
    queue_waits: RunningMean = field(default_factory=lambda: RunningMean())


class RunningMean:
    """A count and a sum: what the statistics need of every task's time, in constant memory
    (a list per (part, arch) grew by one float per task for as long as a server ran)."""

    __slots__ = ("n", "total")

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0

    def append(self, value: float) -> None:
        self.n += 1
        self.total += value

    def __len__(self) -> int:
        return self.n

    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0


#: ``footprint(request, part)``: the perf-model key of a part's task (the driver knows shapes)
FootprintFn = Callable[[Request, int], "Footprint | None"]
#: ``output_bytes(request, part, footprint)``: bytes of each output of a part's task, where the
#: driver knows them before it runs (the simulator: its profile). Without it the core learns
#: them from the first task of each (part, footprint) that ran.
OutputBytesFn = Callable[[Request, int, "Footprint | None"], "Mapping[str, int] | None"]


class CopyCounts:
    """Copies and bytes per link (``(src, dst)``) the core decided; by kind (``h2d``,
    ``d2h``, ``peer``, ``host``) in :meth:`snapshot`. Counted per task under the core's lock,
    so :meth:`add` is the whole cost."""

    __slots__ = ("links",)

    def __init__(self) -> None:
        self.links: dict[tuple[str, str], list[int]] = {}

    def add(self, copies: Sequence[Copy]) -> None:
        links = self.links
        for c in copies:
            try:
                entry = links[c[1], c[2]]
            except KeyError:
                entry = links[c[1], c[2]] = [0, 0]
            entry[0] += 1
            entry[1] += c[3]

    def snapshot(self) -> dict[str, dict[str, int]]:
        kinds: dict[str, dict[str, int]] = {}
        for (src, dst), (n, b) in sorted(self.links.items()):
            k = kinds.setdefault(copy_kind(src, dst), {"copies": 0, "bytes": 0})
            k["copies"] += n
            k["bytes"] += b
        return dict(sorted(kinds.items()))


class TaskGraph:
    """The task graphs of a plan (or of several: a :class:`ModelSet`) under one policy; see
    the module docstring."""

    def __init__(self, plan: Plan | ModelSet, workers: Sequence[WorkerInfo], policy: Policy, predictor: Predictor,
                 clock: Clock, footprint: FootprintFn, where: Sequence[Collection[int]] | None = None,
                 copy_cost: CopyCost | None = None, output_bytes: OutputBytesFn | None = None,
                 prefetch: bool = False) -> None:
        """``where``: per global part, the ids of the workers holding it (None: all of them).
        ``copy_cost``: the bus model's ``predict``, which picks the cheapest source of a fetch
        (the predictor's own choice); ``output_bytes``: see :data:`OutputBytesFn` (without it,
        write-backs are known only once a task ran). ``prefetch``: when the policy places a
        task at push time, its inputs' copies to that worker's node are decided then (StarPU's
        prefetch: ``prefetches`` lists them for the driver to start at once; the copies are
        valid there from then on, so the task's own fetches are those that could not be)."""
        self.models = ModelSet.of(plan)
        self.plan = self.models.models[0].plan  # the first (or only) model's
        self.policy = policy
        self.footprint = footprint
        n_models = len(self.models.models)
        self.workers = [WorkerState(info, busy_by_model=[0.0] * n_models) for info in workers]
        self._part_inputs = self.models.part_inputs
        self.preds = self.models.preds
        self.succs = self.models.succs
        # per model, by its own tensor names (two models may both read "input")
        self._producer = [set(m.plan.producers()) for m in self.models.models]
        #: parts reading each tensor (a tensor no part reads has no entry)
        self._readers = [dict(Counter(n for part in m.plan.parts for n in part.inputs)) for m in self.models.models]
        self._outputs = [set(m.plan.output_names) for m in self.models.models]
        #: per global part, its outputs that are its model's final outputs (written back)
        self._finals = [tuple(n for n in m.plan.parts[local].outputs if n in self._outputs[m.index])
                        for m, local in self.models.owner]
        self.copy_cost = copy_cost
        self.output_bytes = output_bytes
        #: (part, batch, shape hash) -> its final outputs' (name, bytes), from a task that ran
        self._out_sizes: dict[tuple[int, int, int], tuple[tuple[str, int], ...]] = {}
        #: the few copies serving makes over and over, made once: (name, src, dst, bytes) ->
        #: fetch; and ((name, bytes) pairs, node) -> write-backs
        self._copy_cache: dict[tuple[str, str, str, int], Copy] = {}
        self._back_cache: dict[tuple[tuple[tuple[str, int], ...], str], list[Copy]] = {}
        #: per worker, whether its memory node is a GPU's (its final outputs are written back)
        self._on_device = [not is_host(w.memory_node) for w in workers]
        #: per worker, where an output it produced is valid: an intermediate, a final output
        #: (:func:`~staronnx.runtime.datawizard.produced_on`)
        self._valid_here = [(produced_on(w.memory_node, False), produced_on(w.memory_node, True)) for w in workers]
        #: every copy decided so far
        self.copy_counts = CopyCounts()
        self.prefetch = prefetch and policy.places_at_push
        #: (task, copy) prefetches the last submit/finish/worker_lost decided: the driver starts
        #: them, and clears the list
        self.prefetches: list[tuple[Task, Copy]] = []
        # what submit reads per request, computed once: a request's cost is the host's cost
        # per task at small batches (issue 19)
        self._model_parts = [tuple(m.parts) for m in self.models.models]
        self._n_parts = [len(p) for p in self._model_parts]
        self._waits = [len(p) for p in self.models.preds]
        self._latency = [m.target.latency for m in self.models.models]
        self._levels = [m.target.priority for m in self.models.models]
        #: per model, the parts reading each of its inputs (0 for an input no part reads)
        self._input_readers = [{n: self._readers[m.index].get(n, 0) for n in m.plan.input_names}
                               for m in self.models.models]
        #: what the core counts per model (same order as ``models.models``)
        self.per_model = [ModelCounters() for _ in self.models.models]
        self.inflight: dict[int, Request] = {}
        #: tasks pushed and not popped yet, by TaskView id (empty: no worker need ask for one)
        self.queue: dict[int, Task] = {}
        #: what the pushes of the last submit/finish/worker_lost returned: the worker each
        #: placed its task on, or the workers holding its part (a shared queue, when not every
        #: worker does) ...
        self.pushed_to: list[int | frozenset[int]] = []
        #: ... and how many went to a shared queue any worker may take from: the engine wakes
        #: just those workers, or that many idle ones
        self.pushed_shared = 0
        #: the driver's own reason to drop a request's remaining tasks, asked of its ``owner``
        #: (a future its caller cancelled); None: none (the simulator's)
        self.dropped: Callable[[Any], bool] | None = None
        #: the last request and task ids given (plain counters: the caller serialises the core)
        self._last_id = -1
        self._last_task_id = -1
        self.measured: dict[tuple[int, str], RunningMean] = defaultdict(RunningMean)
        self.predicted: dict[tuple[int, str], RunningMean] = defaultdict(RunningMean)
        self.queue_waits = RunningMean()
        self._part_keys = [f"part{local}" for _, local in self.models.owner]
        self.done_requests = 0
        self.failed_requests = 0
        #: (worker name, error) of workers that died
        self.dead_workers: list[tuple[str, str]] = []
        #: per global part, the workers that hold it; None where every worker holds every part
        self.where = None if where is None else [frozenset(w) for w in where]
        if self.where is not None:
            unheld = [self.models.label(p) for p, w in enumerate(self.where) if not w]
            if unheld:
                raise ValueError(f"no worker holds {', '.join(unheld)}")
        #: models (indices) that a lost worker left with a part nobody holds (refused at submit)
        self.stranded: set[int] = set()
        policy.attach(workers, predictor, clock, self.succs, self.where)
        #: whether the policy reads where a task's inputs are (:attr:`Policy.reads_data`)
        self._sees_data = policy.reads_data
        #: whether the policy keeps accounting around runs (dmda's expected ends): a policy
        #: that does not (eager, ws, ...) is spared two calls per task
        self._hooks = type(policy).on_start is not Policy.on_start or type(policy).on_done is not Policy.on_done

    # -- requests ------------------------------------------------------------------------------
    def submit(self, batch: int, inputs: Mapping[str, int] | None, now: float,
               feeds: Mapping[str, np.ndarray] | None = None, owner: Any = None, model: int = 0,
               arrival: float | None = None) -> Request:
        """A new request of ``model`` (its index) whose inputs are on the host; its ready tasks
        are pushed. ``inputs``: their bytes by name (the simulator's, which has no arrays), or
        None where ``feeds``, the inputs' host copies (the engine's), say it. ``arrival``
        (default ``now``) starts its latency target."""
        self.pushed_to, self.pushed_shared = [], 0
        readers = self._input_readers[model]
        if feeds is not None:
            handles = {n: DataHandle(n, a.nbytes, _ON_HOST, readers[n], a) for n, a in feeds.items()}
        else:
            assert inputs is not None
            handles = {n: DataHandle(n, nbytes, _ON_HOST, readers[n]) for n, nbytes in inputs.items()}
        latency = self._latency[model]
        deadline = math.inf if latency is None else (now if arrival is None else arrival) + latency
        parts, waits = self._model_parts[model], self._waits
        self._last_id += 1
        req = Request(self._last_id, batch, now, self._n_parts[model], handles, owner, model=model,
                      first_part=parts[0], deadline=deadline)
        req.tasks = tasks = [Task(req, p, waits[p]) for p in parts]
        self.inflight[req.id] = req
        self.per_model[model].in_flight += 1
        try:
            for task in tasks:
                if not task.waiting:
                    self._push(task, now, None)
        except BaseException:  # refused to its caller, so not left in flight (its pushed tasks dropped)
            req.failed = True
            req.tasks = []
            del self.inflight[req.id]
            self.per_model[model].in_flight -= 1
            raise
        return req

    def _push(self, task: Task, now: float, releasing: int | None) -> None:
        req = task.request
        self._last_task_id += 1
        view = TaskView(
            self._last_task_id, task.part, req.batch, req.id,
            # where its inputs are valid as it is pushed, for a policy that prices copies
            [DataView(id(h), h.name, h.nbytes, h.valid_on)
             for h in [req.handles[n] for n in self._part_inputs[task.part]]]
            if self._sees_data else (),
            submitted_at=req.submitted_at, footprint=self.footprint(req, task.part),
            releasing_worker=releasing, deadline=req.deadline, level=self._levels[req.model],
        )
        if self._finals[task.part]:
            fp = view.footprint
            if self.output_bytes is not None:
                sizes = self.output_bytes(req, task.part, fp)
                if sizes:
                    view.outputs = tuple((n, sizes[n]) for n in self._finals[task.part] if n in sizes)
            elif fp is not None:
                try:
                    view.outputs = self._out_sizes[task.part, fp.batch, fp.shape_hash]
                except KeyError:
                    pass
        task.view = view
        task.ready_at = now
        self.queue[view.id] = task
        try:
            target = self.policy.push(view)
        except BaseException:  # (a static placement whose worker was lost): not queued after all
            del self.queue[view.id]
            raise
        if self.prefetch and isinstance(target, int):
            self._prefetch(task, self.workers[target].info.memory_node)
        if target is not None:
            self.pushed_to.append(target)
        elif self.where is not None:  # a shared queue: wake one that holds it
            self.pushed_to.append(self.where[task.part])
        else:
            self.pushed_shared += 1

    def _prefetch(self, task: Task, node: str) -> None:
        """The copies of ``task``'s inputs to ``node``, the node of the worker the policy placed
        it on, decided now: each becomes a valid copy there at once (in flight: the reader's
        stream waits on its event), booked, and listed in :attr:`prefetches` for the driver."""
        req = task.request
        handles, cache = req.handles, self._copy_cache
        done: list[Copy] = []
        for name in self._part_inputs[task.part]:
            h = handles[name]
            valid = h.valid_on
            if node in valid or h.nbytes <= 0 or not valid:
                continue
            key = (name, source(valid, node, h.nbytes, self.copy_cost), node, h.nbytes)
            try:
                copy = cache[key]
            except KeyError:
                copy = cache.setdefault(key, Copy(*key))
            done.append(copy)
            h.valid_on = valid | {node}
            self.prefetches.append((task, copy))
        if done:
            task.prefetched = done
            self.copy_counts.add(done)

    # -- workers -------------------------------------------------------------------------------
    def next_task(self, wid: int, now: float) -> Task | None:
        """The task worker ``wid`` must start now, or None; tasks of failed requests are dropped.

        Its copies on the worker's node are decided here (:mod:`~staronnx.runtime.datawizard`'s
        rules, inlined: this runs per task): a fetch per input not valid there, from its cheapest
        copy, kept while another reader has not started; a write-back per final output where the
        node is a GPU (where the push knew its size; else booked when it finished)."""
        policy = self.policy
        while True:
            view = policy.pop(wid)
            if view is None:
                return None
            task = self.queue.pop(view.id)
            if self._hooks:
                policy.on_start(wid, view, now)
            req = task.request
            if req.failed or (self.dropped is not None and self.dropped(req.owner)):
                # its request failed or was cancelled: keep the policy's accounting, drop it
                policy.on_done(wid, view, 0.0, now)
                if not req.failed:  # cancelled: it will never complete, so it leaves the in-flight
                    self.withdraw(req)  # requests now (else counted, held and waited for by close)
                continue
            task.worker = wid
            st = self.workers[wid]
            node, cache = st.info.memory_node, self._copy_cache
            handles = req.handles
            copies: list[Copy] = []
            keep: list[str] = []
            for name in self._part_inputs[task.part]:
                h = handles[name]
                h.unstarted -= 1
                valid = h.valid_on
                if node in valid or h.nbytes <= 0 or not valid:
                    continue
                if valid is _ON_HOST:  # a model input (no call)
                    src = HOST_NODE
                elif len(valid) == 1:
                    for src in valid:
                        break
                else:
                    src = source(valid, node, h.nbytes, self.copy_cost)
                key = (name, src, node, h.nbytes)
                try:
                    copies.append(cache[key])
                except KeyError:
                    if len(cache) > 4096:
                        cache.clear()
                    copies.append(cache.setdefault(key, Copy(*key)))
                if h.unstarted > 0:
                    keep.append(name)
            if self._on_device[wid] and view.outputs:
                back = (view.outputs, node)
                try:
                    copies += self._back_cache[back]
                except KeyError:
                    if len(self._back_cache) > 4096:
                        self._back_cache.clear()
                    copies += self._back_cache.setdefault(back, [Copy(n, node, HOST_NODE, b)
                                                                 for n, b in view.outputs if b > 0])
            if copies:
                task.copies = copies
            if keep:
                task.keep = tuple(keep)
            st.running[task] = None
            wait = now - task.ready_at
            # (RunningMean.append, inlined: this runs per task)
            waits = self.queue_waits
            waits.n += 1
            waits.total += wait
            waits = self.per_model[req.model].queue_waits
            waits.n += 1
            waits.total += wait
            return task

    def finish(self, wid: int, task: Task, now: float, measured: float, outputs: Mapping[str, int] | None,
               host: Mapping[str, np.ndarray] | None = None,
               device: Sequence[tuple[str, DeviceTensor]] = ()) -> Request | None:
        """Worker ``wid`` ended ``task`` after ``measured`` s; ``outputs`` (name -> bytes), or
        None when it failed. ``host`` and ``device``: the copies of its outputs the worker made
        (the engine's: in host memory, and on its GPU), which their handles keep. Returns the
        request if it is now complete (or has just failed)."""
        self.pushed_to, self.pushed_shared = [], 0
        st = self.workers[wid]
        del st.running[task]
        st.busy_seconds += measured
        st.tasks += 1
        req = task.request
        st.busy_by_model[req.model] += measured
        task.ended_at = now
        view = task.view
        assert view is not None
        if self._hooks:
            self.policy.on_done(wid, view, measured, now)
        if req.failed:
            return None
        if outputs is None:
            self.fail(req)
            return req
        node, arch = st.info.memory_node, st.info.arch
        req.placement[self._part_keys[task.part]] = arch
        key = (task.part, arch)
        mean = self.measured[key]  # (RunningMean.append, inlined: this runs per task)
        mean.n += 1
        mean.total += measured
        # a model's prediction only: NaN (none asked) compares false, and 0 is what a policy
        # charges where no model answered (dmda's greedy decisions while calibrating), which
        # made stats' "predicted_ms" read 0.0 or a mean diluted by placeholders (as the starpu
        # engine reports it: predictions > 0 only)
        if 0.0 < view.predicted < math.inf:
            self.predicted[key].append(view.predicted)
        readers, produced, final = self._readers[req.model], self._producer[req.model], self._outputs[req.model]
        copies = task.copies  # fetches and write-backs, booked as they happened
        if self._on_device[wid] and self._finals[task.part] and not view.outputs:
            copies = [*copies, *self._writebacks(task, node, outputs)]
        if copies:
            self.copy_counts.add(copies)
        handles = req.handles
        here, with_host = self._valid_here[wid]
        for name, nbytes in outputs.items():
            # a handle for what another part reads; a final output's host copy is the answer
            # (the engine's; the simulator has nothing to hold)
            copy = host[name] if host is not None and name in host else None
            if copy is not None and name in final:
                req.results[name] = copy
            if name in readers:
                handles[name] = DataHandle(name, nbytes, with_host if name in final else here, readers[name], copy)
        for name, tensor in device:
            handles[name].add_device(node, tensor)
        for name in task.keep:  # fetched copies that stay valid where they were fetched
            h = handles[name]
            if node not in h.valid_on:
                h.valid_on = h.valid_on | {node}
        for name in self._part_inputs[task.part]:  # free intermediates nobody else reads
            h = handles[name]
            h.readers_left -= 1
            if h.readers_left <= 0 and name not in final and name in produced:
                h.drop()
        req.parts_left -= 1
        for succ in self.succs[task.part]:
            t = req.tasks[succ - req.first_part]
            t.waiting -= 1
            if not t.waiting:
                try:
                    self._push(t, now, wid)
                except Exception as exc:  # noqa: BLE001 - the policy cannot place it: this request fails
                    self._unplaceable(req, exc)
                    return req
        if req.parts_left:
            return None
        del self.inflight[req.id]  # (a failed request left it, and returned above)
        req.tasks = []  # a request and its tasks point at each other: cut, reference counting frees them
        self.done_requests += 1
        counters = self.per_model[req.model]
        counters.in_flight -= 1
        counters.done += 1
        if now > req.deadline:
            counters.deadline_misses += 1
        return req

    def _writebacks(self, task: Task, node: str, outputs: Mapping[str, int]) -> list[Copy]:
        """The write-backs of a task that ran on a GPU whose push did not know its final
        outputs' sizes; they are kept for the next task of its footprint, whose push then
        prices them."""
        fp = None if task.view is None else task.view.footprint
        if fp is not None and self.output_bytes is None:
            key = (task.part, fp.batch, fp.shape_hash)
            if key not in self._out_sizes:
                if len(self._out_sizes) > 4096:
                    self._out_sizes.clear()
                    self._copy_cache.clear()
                    self._back_cache.clear()
                self._out_sizes[key] = tuple((n, outputs[n]) for n in self._finals[task.part] if n in outputs)
        return [Copy(n, node, HOST_NODE, outputs[n]) for n in self._finals[task.part] if outputs.get(n, 0) > 0]

    def _unplaceable(self, req: Request, exc: BaseException) -> None:
        """Fail ``req``, one of whose tasks the policy could not place (``exc``: why), rather
        than let the error out of a worker's bookkeeping, which killed that worker's loop and
        left the request (and every later one) unanswered."""
        req.error = exc
        self.fail(req)

    def fail(self, req: Request) -> None:
        """Fail a request: its queued tasks are dropped when popped. Its task list is cut as a
        finished request's is: a request and its tasks point at each other, so a failed one
        (its feeds, its intermediates) waited for the cycle collector, which a long-running
        server must not count on; its queued and running tasks still reach it (``task.request``)
        and let go of it as they are dropped or end."""
        req.tasks = []
        if not req.failed:
            req.failed = True
            self.inflight.pop(req.id, None)
            self.failed_requests += 1
            counters = self.per_model[req.model]
            counters.in_flight -= 1
            counters.failed += 1

    def withdraw(self, req: Request) -> None:
        """A request its caller cancelled, one of whose tasks was dropped: it leaves the in-flight
        requests (its model's capacity, close()'s drain) as a failed one does, its other tasks
        dropped too, without being counted as failed. Its task list is cut (see :meth:`fail`)."""
        req.failed = True
        req.tasks = []
        if self.inflight.pop(req.id, None) is not None:
            self.per_model[req.model].in_flight -= 1
        # what an executor does with a cancelled item it reaches: concurrent.futures.wait() and
        # as_completed() count a cancelled future done only once it is notified (they hung)
        announce_cancelled(req.owner)

    def worker_lost(self, wid: int, error: str, now: float) -> list[Request]:
        """A worker died: its queued tasks (and the one it ran) go to the others. Returns the
        requests failed because no worker is left."""
        self.pushed_to, self.pushed_shared = [], 0
        st = self.workers[wid]
        st.alive = False
        self.dead_workers.append((st.info.name, error))
        orphans = list(st.running)
        st.running.clear()
        for task in orphans:  # taken, not run: its reads are still to start
            for name in self._part_inputs[task.part]:
                task.request.handles[name].unstarted += 1
        orphans += [self.queue.pop(view.id) for view in self.policy.remove_worker(wid)]
        for task in orphans:  # what was decided for the lost worker's node is not the next one's
            # (next_task sets copies and keeps only where the new worker needs some: kept, the
            # lost worker's upload and write-back were booked for a CPU worker that made none)
            task.copies = task.keep = task.prefetched = ()
        if not any(w.alive for w in self.workers):
            # every model is stranded: a later request is refused at submit, where it was
            # queued for no one (eager: a future that never resolved) or refused by the
            # policy after it was counted in flight (dmda: close() waited for it in vain)
            self.stranded = self.stranded_models()
            lost = list(self.inflight.values())
            for req in lost:
                self.fail(req)
            return lost
        # a model with a part no live worker holds can no longer answer: its requests fail
        self.stranded = self.stranded_models()
        lost = [req for req in self.inflight.values() if req.model in self.stranded]
        for req in lost:
            self.fail(req)
        for task in orphans:
            if not task.request.failed:
                try:
                    self._push(task, now, None)
                except Exception as exc:  # noqa: BLE001 - nowhere to go (a static placement): it fails
                    self._unplaceable(task.request, exc)
                    lost.append(task.request)
        return lost

    def stranded_models(self) -> set[int]:
        """The models (indices) with a part that no live worker holds: nothing can run them."""
        alive = {i for i, w in enumerate(self.workers) if w.alive}
        if not alive:
            return {m.index for m in self.models.models}
        if self.where is None:
            return set()
        return {self.models.owner[p][0].index for p, holders in enumerate(self.where) if not holders & alive}

    # -- observability -------------------------------------------------------------------------
    def stats(self, elapsed: float) -> dict[str, Any]:
        """Busy fraction per worker, tasks per (part, arch), queue wait, predicted vs measured."""
        elapsed = max(elapsed, 1e-9)
        tasks = per_part_arch(self.measured, self.predicted)
        if not self.models.single:  # "<model>/part<p>/<arch>": part numbers are each model's own
            tasks = {f"{self.models.label(p)}/{arch}": row
                     for (p, arch), row in zip(sorted(self.measured), tasks.values())}
        return {
            "elapsed_s": elapsed,
            "requests_done": self.done_requests,
            "requests_failed": self.failed_requests,
            "in_flight": len(self.inflight),
            "workers": {st.info.name: {"arch": st.info.arch, "tasks": st.tasks,
                                       "busy": st.busy_seconds / elapsed, "alive": st.alive}
                        for st in self.workers},
            "tasks": tasks,
            "mean_queue_wait_ms": self.queue_waits.mean() * 1e3,
            "copies": self.copy_counts.snapshot(),
            "dead_workers": list(self.dead_workers),
            "models": {m.name: self.model_stats(m.index, elapsed) for m in self.models.models},
        }

    def model_stats(self, model: int, elapsed: float) -> dict[str, Any]:
        """One hosted model's view of the shared machine: its requests (in flight, done,
        failed, late), its target, each worker's busy share spent on it (the fraction of the
        runtime's lifetime), its tasks per (part, arch) keyed by its own part numbers."""
        elapsed = max(elapsed, 1e-9)
        hosted = self.models.models[model]
        c = self.per_model[model]
        parts = hosted.parts
        local = {(p - hosted.first_part, arch): v for (p, arch), v in self.measured.items() if p in parts}
        local_pred = {(p - hosted.first_part, arch): v for (p, arch), v in self.predicted.items() if p in parts}
        target = hosted.target
        return {
            "elapsed_s": elapsed,
            "requests_done": c.done,
            "requests_failed": c.failed,
            "in_flight": c.in_flight,
            "deadline_misses": c.deadline_misses,
            "target": {"latency_ms": None if target.latency is None else target.latency * 1e3,
                       "priority": target.priority, "capacity": target.capacity},
            "workers": {st.info.name: {"arch": st.info.arch, "busy": st.busy_by_model[model] / elapsed,
                                       "alive": st.alive}
                        for st in self.workers},
            "tasks": per_part_arch(local, local_pred),
            "mean_queue_wait_ms": c.queue_waits.mean() * 1e3,
            #: the workers holding every part of it (all of them unless a residency says otherwise)
            "held_by": [st.info.name for i, st in enumerate(self.workers)
                        if st.alive and (self.where is None or all(i in self.where[p] for p in parts))],
        }


def per_part_arch(measured: Mapping[tuple[int, str], RunningMean],
                  predicted: Mapping[tuple[int, str], RunningMean]) -> dict[str, dict[str, Any]]:
    """``"part<p>/<arch>"`` -> tasks, mean measured ms, mean predicted ms (None: never predicted).

    Both engines report through it (the starpu engine too), so ``Runtime.stats()`` reads the
    same whichever runs the plan, and users see whether the perf models still fit the machine.
    """
    out: dict[str, dict[str, Any]] = {}
    for (part, arch), times in sorted(measured.items()):
        pred = predicted.get((part, arch))
        out[f"part{part}/{arch}"] = {"tasks": len(times), "measured_ms": times.mean() * 1e3,
                                     "predicted_ms": pred.mean() * 1e3 if pred else None}
    return out
