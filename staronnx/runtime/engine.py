"""The native engine: StarPU's task model on Python threads.

Each submitted batch becomes one task per part. A task is pushed to the policy once every part
it reads from has finished; the policy places it (dmda & co. pick a worker at once and the
engine prefetches its inputs there; eager & co. leave it in a shared queue); each worker runs a
serving loop *inside its own pinned thread* that pops tasks and runs them on its ORT sessions
(ORT releases the GIL while computing, so workers run in parallel). Completion updates the data
handles, feeds the perf models while they still need samples, releases successors and resolves
the request's future when its last part is done.

A failing task fails only its own request (the other tasks of that request are dropped when
popped); a worker whose loop dies is reported and its queued tasks are placed on the others.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import defaultdict
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from staronnx.plan import Plan
from staronnx.errors import StaronnxError
from staronnx.perfmodels import PerfModelStore
from staronnx.runtime.policies import make_policy
from staronnx.runtime.predictor import PerfPredictor, calibrate_mode, task_footprint
from staronnx.runtime.registry import EngineSettings, register_engine
from staronnx.runtime.sched import Policy, TaskView, WorkerInfo
from staronnx.runtime.task import DataHandle, Request, RequestFuture, Task, TaskError
from staronnx.runtime.taskstats import per_part_arch
from staronnx.runtime.trace import Tracer
from staronnx.workers.launch import start_workers

log = logging.getLogger(__name__)

HOST_NODE = "numa0"


class EngineClosed(RuntimeError):
    """Submitting to an engine (or Runtime) after close()."""


class Worker(Protocol):
    """What the native engine needs of a worker (:class:`~staronnx.workers.cpu.CpuWorker`,
    :class:`~staronnx.workers.cuda.CudaWorker`): its identity for the policy, a way to run the
    engine's serving loop in its own thread, and a run of one part from inside that thread."""

    name: str
    kind: str  # "cpu" or "cuda"
    arch: str  # perf-model architecture: "cpu<ncores>" or "cuda<device>"
    memory_node: str  # "numa0", "cuda0", ...
    n_cores: int
    #: kernel time of the last run_here without copies (CUDA), None where wall time is compute
    last_compute_seconds: float | None

    def spawn(self, fn: Callable[[], Any]) -> Future[Any]: ...

    def run_here(self, part: int, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


def worker_info(index: int, worker: Worker) -> WorkerInfo:
    """The worker as a policy sees it."""
    return WorkerInfo(index, worker.name, worker.arch, worker.kind, worker.memory_node, worker.n_cores)


class _RealClock:
    def now(self) -> float:
        return time.perf_counter()


@dataclass
class _WorkerState:
    info: WorkerInfo
    worker: Worker
    loop: Future | None = None
    alive: bool = True
    busy: float = 0.0
    tasks: int = 0


class NativeEngine:
    """Runs a plan's task graph over started workers with a policy."""

    def __init__(
        self,
        plan: Plan,
        workers: Sequence[Worker],
        policy: Policy,
        predictor: PerfPredictor,
        tracer: Tracer | None = None,
        own_workers: bool = False,
    ) -> None:
        infos = [worker_info(i, w) for i, w in enumerate(workers)]
        self.own_workers = own_workers
        self.plan = plan
        self.policy = policy
        self.predictor = predictor
        self.tracer = tracer
        self.clock = _RealClock()
        self._cond = threading.Condition()
        self._workers = [_WorkerState(info, w) for info, w in zip(infos, workers)]
        self._stopping = False
        self._closed = False
        self._inflight: dict[int, Request] = {}
        self._ids = itertools.count()
        self._task_ids = itertools.count()
        self._preds = plan.dependencies()
        self._succs: list[list[int]] = [[] for _ in plan.parts]
        for p, deps in enumerate(self._preds):
            for d in deps:
                self._succs[d].append(p)
        self._producer = plan.producers()
        self._readers: dict[str, int] = defaultdict(int)
        for part in plan.parts:
            for name in part.inputs:
                self._readers[name] += 1
        self._outputs = set(plan.output_names)
        self.started_at = self.clock.now()
        # statistics
        self._per_part_arch: dict[tuple[int, str], list[float]] = defaultdict(list)
        self._predicted: dict[tuple[int, str], list[float]] = defaultdict(list)
        self._queue_waits: list[float] = []
        self._done_requests = 0
        self._failed_requests = 0
        #: (worker name, error) of workers whose loop died
        self.dead_workers: list[tuple[str, str]] = []
        policy.attach(infos, predictor, self.clock, self._succs)
        if tracer is not None:
            for st in self._workers:
                tracer.lane(st.info.id, st.info.name)
        for st in self._workers:
            st.loop = st.worker.spawn(self._make_loop(st))

    # -- submission ---------------------------------------------------------------------------
    def submit(self, feeds: Mapping[str, np.ndarray]) -> RequestFuture:
        """Create the request's tasks; inputs must already be checked against the plan."""
        batch = _batch_size(self.plan, feeds)
        now = self.clock.now()
        with self._cond:
            if self._closed:
                raise EngineClosed("the runtime is closed; no new requests are accepted")
            rid = next(self._ids)
            future = RequestFuture(rid)
            handles = {
                name: DataHandle(name, int(arr.nbytes), {HOST_NODE}, readers_left=self._readers[name])
                for name, arr in feeds.items()
            }
            req = Request(
                id=rid, batch=batch, future=future, values=dict(feeds), handles=handles,
                tasks=[], submitted_at=now, parts_left=self.plan.k,
            )
            req.tasks = [Task(req, p.index, set(self._preds[p.index])) for p in self.plan.parts]
            self._inflight[rid] = req
            for task in req.tasks:
                if not task.waiting_on:
                    self._push(task, now)
            self._cond.notify_all()
        return future

    def _push(self, task: Task, now: float, releasing: int | None = None) -> None:
        """Hand a ready task to the policy (lock held)."""
        req = task.request
        part = self.plan.parts[task.part]
        feeds = {n: req.values[n] for n in part.inputs}
        view = TaskView(
            id=next(self._task_ids), part=task.part, batch=req.batch, request=req.id,
            inputs=[req.handles[n].view() for n in part.inputs], submitted_at=req.submitted_at,
        )
        view.footprint = task_footprint(feeds, req.batch)
        view.extra["task"] = task
        if releasing is not None:
            view.releasing_worker = releasing
        task.view = view
        task.ready_at = now
        # (a policy placing at push could start the copies here; the CUDA worker stages the
        # next queued inputs itself while it computes)
        self.policy.push(view)

    # -- worker loops -------------------------------------------------------------------------
    def _make_loop(self, st: _WorkerState) -> Callable[[], None]:
        def loop() -> None:
            task: Task | None = None
            try:
                while True:
                    task = self._next_task(st)
                    if task is None:
                        return
                    self._execute(st, task)
                    task = None
            except BaseException as exc:  # noqa: BLE001 - the worker is lost, its work is not
                self._worker_died(st, exc, task)

        return loop

    def _next_task(self, st: _WorkerState) -> Task | None:
        with self._cond:
            while True:
                if not st.alive:
                    return None
                view = self.policy.pop(st.info.id)
                if view is not None:
                    task: Task = view.extra["task"]
                    now = self.clock.now()
                    if task.request.failed or task.request.future.done():
                        # its request already failed or was cancelled: keep the policy's
                        # queue accounting straight, then drop it
                        self.policy.on_start(st.info.id, view, now)
                        self.policy.on_done(st.info.id, view, 0.0, now)
                        continue
                    task.started_at = now
                    task.worker = st.info.id
                    self.policy.on_start(st.info.id, view, now)
                    return task
                if self._stopping:
                    return None
                self._cond.wait()

    def _execute(self, st: _WorkerState, task: Task) -> None:
        req = task.request
        part = self.plan.parts[task.part]
        feeds = {n: req.values[n] for n in part.inputs}
        start = self.clock.now()
        error: BaseException | None = None
        outputs: dict[str, np.ndarray] = {}
        try:
            outputs = st.worker.run_here(task.part, feeds)
        except Exception as exc:  # noqa: BLE001 - fails this request only
            error = exc
        end = self.clock.now()
        measured = end - start
        view = task.view
        assert view is not None
        if error is None:
            fp = view.footprint
            if self.predictor.needs_samples(task.part, st.info.arch, fp):
                # CUDA workers report kernel time without their copies, which the bus model
                # prices; CPU workers' wall time is their compute time
                compute = st.worker.last_compute_seconds
                self.predictor.record(task.part, st.info.arch, fp, compute or measured)
        if self.tracer is not None:
            self.tracer.task(
                st.info.id, f"part{task.part}", start, end,
                {"request": req.id, "batch": req.batch, "predicted_ms": _ms(view.predicted),
                 "measured_ms": measured * 1e3, "failed": error is not None},
            )
            for dep in self._preds[task.part]:
                src = req.tasks[dep]
                if src.worker is not None:
                    self.tracer.flow(src.worker, src.ended_at, st.info.id, start, f"r{req.id}")
        resolve: tuple[RequestFuture, Any, bool] | None = None
        with self._cond:
            task.ended_at = end
            st.busy += measured
            st.tasks += 1
            self.policy.on_done(st.info.id, view, measured, end)
            self._queue_waits.append(task.started_at - task.ready_at)
            if error is not None:
                if not req.failed:
                    req.failed = True
                    self._inflight.pop(req.id, None)
                    self._failed_requests += 1
                    err = TaskError(task.part, st.info.name, error)
                    err.__cause__ = error
                    resolve = (req.future, err, False)
            elif not req.failed:
                req.future.placement[f"part{task.part}"] = st.info.arch
                self._per_part_arch[(task.part, st.info.arch)].append(measured)
                if math.isfinite(view.predicted):
                    self._predicted[(task.part, st.info.arch)].append(view.predicted)
                req.values.update(outputs)
                for name, arr in outputs.items():
                    req.handles[name] = DataHandle(name, int(arr.nbytes), {st.info.memory_node},
                                                   readers_left=self._readers[name])
                for name in part.inputs:  # free intermediates nobody else will read
                    h = req.handles[name]
                    h.valid_on.add(st.info.memory_node)
                    h.readers_left -= 1
                    if h.readers_left <= 0 and name not in self._outputs and name in self._producer:
                        req.values.pop(name, None)
                req.parts_left -= 1
                for succ in self._succs[task.part]:
                    t = req.tasks[succ]
                    t.waiting_on.discard(task.part)
                    if not t.waiting_on:
                        self._push(t, end, releasing=st.info.id)
                if req.parts_left == 0:
                    self._inflight.pop(req.id, None)
                    self._done_requests += 1
                    result = {n: req.values[n] for n in self.plan.output_names}
                    resolve = (req.future, result, True)
            self._cond.notify_all()
        if resolve is not None:
            fut, value, ok = resolve
            if fut.set_running_or_notify_cancel():
                fut.set_result(value) if ok else fut.set_exception(value)

    def _worker_died(self, st: _WorkerState, exc: BaseException, current: Task | None) -> None:
        """Re-place the dead worker's queued tasks (and the one it was running) on the others."""
        log.error("worker %s died: %s; its queued tasks go to the other workers", st.info.name, exc)
        with self._cond:
            st.alive = False
            self.dead_workers.append((st.info.name, repr(exc)))
            orphans = [t.view for t in ([current] if current is not None else []) if t.view]
            orphans += self.policy.remove_worker(st.info.id)
            alive = [w for w in self._workers if w.alive]
            now = self.clock.now()
            if not alive:
                for req in list(self._inflight.values()):
                    req.failed = True
                    if req.future.set_running_or_notify_cancel():
                        req.future.set_exception(RuntimeError(f"every worker died (last: {exc})"))
                self._inflight.clear()
            else:
                for view in orphans:
                    task: Task = view.extra["task"]
                    if not task.request.failed:
                        self._push(task, now)
            self._cond.notify_all()

    # -- shutdown -----------------------------------------------------------------------------
    def close(self, timeout: float | None = 30.0) -> None:
        """Drain in-flight requests up to ``timeout`` seconds, cancel the rest, stop the loops."""
        with self._cond:
            if self._closed and self._stopping:
                return
            self._closed = True
            deadline = None if timeout is None else self.clock.now() + timeout
            while self._inflight:
                left = None if deadline is None else deadline - self.clock.now()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left if left is None else min(left, 0.5))
            for req in list(self._inflight.values()):
                req.failed = True
                if not req.future.cancel() and not req.future.done():
                    req.future.set_exception(CancelledError())
            self._inflight.clear()
            self._stopping = True
            self._cond.notify_all()
        for st in self._workers:
            if st.loop is not None:
                try:
                    st.loop.result(timeout=None if timeout is None else max(timeout, 1.0) + 60)
                except Exception:  # noqa: BLE001 - reported by _worker_died already
                    pass
        self.predictor.save()
        if self.tracer is not None:
            self.tracer.save()
        if self.own_workers:
            _close_all(w.worker for w in self._workers)

    @property
    def workers(self) -> list[Worker]:
        return [st.worker for st in self._workers]

    # -- observability ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Busy fraction per worker, tasks per (part, arch), queue wait, predicted vs measured."""
        with self._cond:
            elapsed = max(self.clock.now() - self.started_at, 1e-9)
            per_worker = {
                st.info.name: {"arch": st.info.arch, "tasks": st.tasks, "busy": st.busy / elapsed,
                               "alive": st.alive}
                for st in self._workers
            }
            per_part = per_part_arch(self._per_part_arch, self._predicted)
            return {
                "elapsed_s": elapsed,
                "requests_done": self._done_requests,
                "requests_failed": self._failed_requests,
                "in_flight": len(self._inflight),
                "workers": per_worker,
                "tasks": per_part,
                "mean_queue_wait_ms": float(np.mean(self._queue_waits) * 1e3) if self._queue_waits else 0.0,
                "dead_workers": list(self.dead_workers),
            }


def start_native(plan: Plan, settings: EngineSettings) -> NativeEngine:
    """The ``native`` engine: start the workers (unless given), then the engine over them."""
    options = dict(settings.policy_options)
    if settings.policy == "static" and "devices" not in options:
        devices = {p.index: p.device for p in plan.parts if p.device}
        if len(devices) != plan.k:
            raise StaronnxError(
                "policy 'static' needs a plan whose parts name their device (partition with "
                "--method comm-sd, duet, overseer or optimal)"
            )
        options["devices"] = devices
    policy = make_policy(settings.policy, **options)  # fail before starting workers
    mode = calibrate_mode(settings.calibrate)
    own = settings.workers is None
    workers = list(settings.workers) if settings.workers is not None else start_workers(
        plan, groups=settings.cpu_groups, cuda_streams=settings.cuda_streams,
        cuda_options=dict(settings.cuda_options))
    try:
        store = settings.store if settings.store is not None else PerfModelStore()
        predictor = PerfPredictor(plan.hash, store, calibrate=mode)
        tracer = Tracer(settings.trace, origin=0.0) if settings.trace is not None else None
        engine = NativeEngine(plan, workers, policy, predictor, tracer, own_workers=own)
        if tracer is not None:
            tracer.origin = engine.started_at
        return engine
    except BaseException:
        if own:
            _close_all(workers)
        raise


register_engine("native", start_native)


def _close_all(workers: Any) -> None:
    for w in workers:
        try:
            w.close()
        except Exception:  # noqa: BLE001 - close the others anyway
            pass


def _ms(x: float) -> float | None:
    return x * 1e3 if math.isfinite(x) else None


def _batch_size(plan: Plan, feeds: Mapping[str, np.ndarray]) -> int:
    """Leading dim of the first batched input (1 when no input has a batch axis)."""
    for spec in plan.inputs:
        if spec.shape and not isinstance(spec.shape[0], int):
            return int(feeds[spec.name].shape[0])
    return 1
