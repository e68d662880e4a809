"""The starpu engine: a plan's task graph run by the real StarPU runtime (libstarpu), for
``Runtime(plan, engine="starpu", policy="dmda")``.

- **Workers**: one StarPU CPU worker per staronnx CPU group, bound to its first PU, set in
  ``starpu_conf`` (which wins over ``STARPU_*`` variables, so the Runtime's arguments are what
  runs); each builds its parts' ORT sessions in its own thread, so weights land on its node.
- **Policy**: passed through by name after checking it against StarPU's own list (StarPU
  silently falls back to its default on a typo); ``heft`` keeps staronnx's meaning (dmdas with
  upward-rank priorities); alpha/beta/gamma options become ``STARPU_SCHED_*`` during init.
- **Perf models**: one codelet per part with a history-based model
  ``staronnx_<plan hash>_part<i>`` footprinted by batch size, kept where StarPU keeps them
  (``starpu_perfmodel_display`` reads them), not in staronnx's store.
- **Data**: inputs registered read-only over the caller's buffers, crossing tensors allocated
  lazily by StarPU on the producer's node, R/W modes giving sequential consistency; tensors whose
  shape is known only after their producer runs travel on the Python side, their handle still
  carrying the dependency. Codelets and callbacks enter Python through cffi (ORT releases the
  GIL while computing).

StarPU allows one ``starpu_init`` per process at a time: a second open engine is refused.
"""

from __future__ import annotations

import atexit
import errno
import functools
import itertools
import logging
import math
import os
import threading
import time
import traceback
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from staronnx.errors import StaronnxError
from staronnx.plan import Plan
from staronnx.runtime.engine import EngineClosed
from staronnx.runtime.task import RequestFuture, TaskError, announce_cancelled
from staronnx.runtime.core import RunningMean, per_part_arch
from staronnx.runtime.policies import upward_ranks
from staronnx.runtime.predictor import PerfPredictor
from staronnx.runtime.registry import EngineSettings
from staronnx.runtime.trace import Tracer
from staronnx.workers.groups import CpuGroup, make_groups
from staronnx.workers.topology import Topology, bind_memory

from ._build import StarpuUnavailable, load_binding

log = logging.getLogger(__name__)

#: staronnx policy names that mean something else in StarPU.
POLICY_ALIASES = {"heft": "dmdas"}
#: ``policy_options`` keys and the StarPU variables they set during ``starpu_init``.
POLICY_ENV = {
    "alpha": "STARPU_SCHED_ALPHA",
    "beta": "STARPU_SCHED_BETA",
    "gamma": "STARPU_SCHED_GAMMA",
    "idle_power": "STARPU_IDLE_POWER",
    "calibrate": "STARPU_CALIBRATE",
}

_active_lock = threading.Lock()
_active: StarpuEngine | None = None


# ----------------------------------------------------------------------------- bookkeeping
@dataclass
class _Part:
    codelet: Any  # struct starpu_codelet *
    symbol: str
    inputs: list[str]
    outputs: list[str]
    buffers: list[str]  # StarPU buffer order: inputs (R) then crossing outputs (W)
    modes: Any  # int[] of the buffers' access modes
    out_slots: dict[str, int]
    preds: list[int]
    sink: bool
    priority: int = 0


@dataclass
class _Layout:
    """How a registered tensor travels: through its StarPU buffer (shape, dtype) or not."""

    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int


@dataclass
class _Request:
    id: int
    batch: int
    future: RequestFuture
    submitted_at: float
    keep: list[np.ndarray]  # input buffers registered with StarPU: alive until the request ends
    layouts: dict[str, _Layout | None]
    side: dict[str, Any] = field(default_factory=dict)
    results: dict[str, np.ndarray] = field(default_factory=dict)
    ends: dict[int, tuple[float, int]] = field(default_factory=dict)  # part -> (end, worker)
    sinks_left: int = 0
    failed: bool = False


@dataclass
class _Worker:
    id: int  # StarPU worker id
    name: str
    group: CpuGroup
    arch: str
    kind: str = "cpu"  # StarPU's workers here are CPU workers (no CUDA codelets)
    sessions: list[Any] = field(default_factory=list)
    tasks: int = 0
    busy: float = 0.0
    membind: str = ""
    native_id: int = -1


# ----------------------------------------------------------------------------- the engine
class StarpuEngine:
    """Runs a plan on StarPU; the native engine's contract (:class:`~staronnx.runtime.registry.Engine`)."""

    #: StarPU learns and keeps its perf models itself (``starpu_perfmodel_display`` reads them)
    predictor: PerfPredictor | None = None
    tracer: Tracer | None = None

    def __init__(self, plan: Plan, settings: EngineSettings, *, topology: Topology | None = None) -> None:
        """``settings.policy_options`` are StarPU's (:data:`POLICY_ENV`); ``settings.machine``
        gives the CPU groups, one StarPU CPU worker each."""
        global _active
        self.plan = plan
        self.policy = policy = settings.policy
        cpu_groups = settings.machine.groups
        self._closed = True  # until started
        if settings.machine.cuda_streams:  # before loading StarPU: the same answer whether it is here or not
            raise StaronnxError(
                "engine='starpu' runs CPU codelets only (CUDA codelets are not implemented); "
                "use cuda_streams=0, or engine='native' for CUDA streams")
        ffi, lib, _install = load_binding()
        self._ffi, self._lib = ffi, lib
        _install_externs(ffi)
        self.starpu_policy = self._check_policy(policy)
        env = self._policy_env(settings.policy_options)
        topology = topology or Topology.from_system()
        groups = list(make_groups(topology, cpu_groups))
        if len(groups) > lib.STARPU_MAXCPUS:
            raise StaronnxError(
                f"cpu_groups={cpu_groups!r} gives {len(groups)} groups but this StarPU build "
                f"supports at most {lib.STARPU_MAXCPUS} CPU workers (STARPU_MAXCPUS); use fewer, "
                f"larger groups")
        logical = {p.os_index: p.logical_index for p in topology.pus}
        bindids = [logical[g.first_pu] for g in groups]
        by_bindid = dict(zip(bindids, groups))

        with _active_lock:
            if _active is not None:
                raise StaronnxError(
                    "a starpu engine is already running in this process (StarPU allows one "
                    "starpu_init at a time); close that Runtime first")
            _active = self
        self._owns_starpu = False
        self._cond = threading.Condition()
        self._submit_lock = threading.Lock()
        self._inflight: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._parts: list[_Part] = []
        self._workers: dict[int, _Worker] = {}
        self._init_errors: list[str] = []
        self._per_part_arch: dict[tuple[int, str], RunningMean] = defaultdict(RunningMean)
        self._predicted: dict[tuple[int, str], RunningMean] = defaultdict(RunningMean)
        self._queue_waits = RunningMean()
        self._done = 0
        self._failed = 0
        self._skipped = 0
        try:
            with _environ({"STARPU_SILENT": os.environ.get("STARPU_SILENT", "1"), **env}):
                ret = lib.sx_init(self.starpu_policy.encode(), len(groups), ffi.new("unsigned[]", bindids))
            if ret != 0:
                raise StarpuUnavailable(f"starpu_init failed ({_errno_name(ret)}) with policy "
                                        f"{self.starpu_policy!r} and {len(groups)} CPU worker(s)")
            self._owns_starpu = True
            self.started_at = time.perf_counter()
            major, minor, release = ffi.new("int*"), ffi.new("int*"), ffi.new("int*")
            lib.starpu_get_version(major, minor, release)
            self.starpu_version = f"{major[0]}.{minor[0]}.{release[0]}"
            for wid in range(lib.starpu_worker_get_count()):
                if not lib.sx_worker_is_cpu(wid):
                    continue
                group = by_bindid.get(lib.starpu_worker_get_bindid(wid))
                if group is None:
                    raise StaronnxError(f"StarPU worker {wid} is bound to PU (logical) "
                                        f"{lib.starpu_worker_get_bindid(wid)}, which starts no group")
                self._workers[wid] = _Worker(wid, f"starpu:cpu{wid}:{group.name}", group, f"cpu{group.n_cores}")
            if len(self._workers) != len(groups):
                raise StaronnxError(f"StarPU started {len(self._workers)} CPU worker(s) for {len(groups)} groups")
            lib.sx_on_each_cpu_worker()  # builds the sessions inside the worker threads
            if self._init_errors:
                raise StaronnxError("building the ONNX Runtime sessions failed: " + "; ".join(self._init_errors))
            self._build_codelets()
            self.tracer = Tracer(settings.trace, origin=self.started_at) if settings.trace is not None else None
            if self.tracer is not None:
                for w in self._workers.values():
                    self.tracer.lane(w.id, w.name)
        except BaseException:
            self._teardown()
            raise
        self._closed = False

    # -- setup --------------------------------------------------------------------------------
    def _check_policy(self, policy: str) -> str:
        lib, ffi = self._lib, self._ffi
        names = [ffi.string(lib.sx_policy_name(i)).decode() for i in range(lib.sx_policy_count())]
        wanted = POLICY_ALIASES.get(policy, policy)
        if wanted not in names:
            raise StaronnxError(
                f"unknown StarPU scheduling policy {policy!r}; this StarPU has "
                f"{', '.join(names)} (and 'heft', which staronnx runs as dmdas with upward-rank "
                f"priorities)")
        return wanted

    @staticmethod
    def _policy_env(options: Mapping[str, Any]) -> dict[str, str]:
        unknown = sorted(set(options) - set(POLICY_ENV))
        if unknown:
            raise StaronnxError(f"engine='starpu' does not know policy option(s) {unknown}; it "
                                f"accepts {', '.join(POLICY_ENV)} (set as STARPU_* variables)")
        return {POLICY_ENV[k]: str(v) for k, v in options.items()}

    def _worker_init(self, wid: int) -> None:
        """In StarPU worker ``wid``'s own thread: memory binding, then one session per part."""
        w = self._workers.get(wid)
        if w is None:
            return
        w.native_id = threading.get_native_id()
        try:
            from staronnx.workers.cpu import cpu_session
            from staronnx.workers.cpu_weights import default_shared_weights

            w.membind = bind_memory(None, w.group.numa_nodes)
            w.sessions = [cpu_session(self.plan.part_path(i), w.group, True, default_shared_weights(), w.name)[0]
                          for i in range(self.plan.k)]
        except BaseException as exc:  # noqa: BLE001 - reported by __init__
            self._init_errors.append(f"{w.name}: {exc}")

    def _build_codelets(self) -> None:
        lib, ffi, plan = self._lib, self._ffi, self.plan
        registered = {t.name for t in (*plan.inputs, *plan.crossing)}
        deps = plan.dependencies()
        succs = [[p for p, ds in enumerate(deps) if d in ds] for d in range(plan.k)]
        for spec, symbol in zip(plan.parts, self.perfmodel_symbols):
            cl = lib.sx_codelet_new(f"part{spec.index}".encode(), symbol.encode())
            if cl == ffi.NULL:
                raise MemoryError("sx_codelet_new")
            ins = [n for n in spec.inputs if n in registered]
            outs = [n for n in spec.outputs if n in registered]
            buffers = ins + outs
            modes = ffi.new("int[]", [lib.STARPU_R] * len(ins) + [lib.STARPU_W] * len(outs) or [0])
            self._parts.append(_Part(
                codelet=cl, symbol=symbol, inputs=list(spec.inputs),
                outputs=list(spec.outputs), buffers=buffers, modes=modes,
                out_slots={n: len(ins) + i for i, n in enumerate(outs)},
                preds=sorted(deps[spec.index]), sink=not succs[spec.index],
            ))
        if self.policy == "heft":  # staronnx's heft: dmdas + upward-rank priorities
            rank = upward_ranks(succs, [part.cost_us for part in plan.parts])
            order = sorted(range(plan.k), key=lambda p: rank[p])
            lo, hi = lib.starpu_sched_get_min_priority(), lib.starpu_sched_get_max_priority()
            for prio, p in enumerate(order):
                self._parts[p].priority = max(lo, min(hi, prio))
        # the request's tensors in StarPU registration order: model inputs read by a part, then
        # crossing tensors; and, per part, its buffers as indexes into that order
        used = {n for p in self._parts for n in p.buffers}
        self._in_names = [n for n in plan.input_names if n in used]
        self._tensor_names = self._in_names + [t.name for t in plan.crossing]
        index = {n: i for i, n in enumerate(self._tensor_names)}
        #: the task graph as the C arrays every request's submission reads: codelets, buffer counts,
        #: buffers (indexes into the tensors), access modes, priorities, sinks
        self._c_graph = (ffi.new("struct starpu_codelet *[]", [p.codelet for p in self._parts]),
                         ffi.new("int[]", [len(p.buffers) for p in self._parts]),
                         ffi.new("int[]", [index[n] for p in self._parts for n in p.buffers] or [0]),
                         ffi.new("int[]", [m for p in self._parts for m in p.modes[0:len(p.buffers)]] or [0]),
                         ffi.new("int[]", [p.priority for p in self._parts]),
                         ffi.new("int[]", [int(p.sink) for p in self._parts]))
        self._n_sinks = sum(p.sink for p in self._parts)
        self._output_names = list(plan.output_names)
        self._output_set = set(plan.output_names)
        self._batch_symbol = plan.contract.symbol

    # -- submission ---------------------------------------------------------------------------
    def submit(self, feeds: Mapping[str, np.ndarray], model: int = 0, arrival: float | None = None) -> RequestFuture:
        """Register the request's tensors and submit one task per part; inputs are pre-checked.
        ``model`` must be 0 (StarPU serves one plan here); ``arrival`` is not used: StarPU
        orders tasks by its own priorities, with no latency targets."""
        _one_model(model)
        lib, ffi, plan = self._lib, self._ffi, self.plan
        with self._submit_lock:
            if self._closed:
                raise EngineClosed("the runtime is closed; no new requests are accepted")
            batch, symbols, shape_hash = self._shapes(feeds)
            rid = next(self._ids)
            req = _Request(rid, batch, RequestFuture(rid), time.perf_counter(), [], {})
            n = len(self._tensor_names)
            ptrs = ffi.new("void *[]", max(n, 1))
            nbytes = ffi.new("size_t[]", max(n, 1))
            i = 0
            for name in self._in_names:
                arr = np.ascontiguousarray(feeds[name])
                if arr.nbytes > 0 and arr.dtype.kind in "biufc":
                    req.keep.append(arr)
                    req.layouts[name] = _Layout(arr.shape, arr.dtype, arr.nbytes)
                    ptrs[i] = ffi.from_buffer(arr)
                    nbytes[i] = arr.nbytes
                else:  # travels on the Python side; a 1-byte handle carries the dependency
                    req.side[name] = arr
                    req.layouts[name] = None
                    nbytes[i] = 1
                i += 1
            for spec in plan.crossing:
                layout = _layout(spec.dtype, spec.shape, spec.batched, symbols, batch)
                req.layouts[spec.name] = layout
                nbytes[i] = layout.nbytes if layout else 1
                i += 1
            req.sinks_left = self._n_sinks
            with self._cond:
                self._inflight[rid] = req
            done = ffi.new("int *")
            ret = lib.sx_submit_request(n, ptrs, nbytes, plan.k, *self._c_graph, rid * plan.k, batch, shape_hash, done)
            if ret != 0:
                # The tasks already submitted still run (and skip: the request is failed); the
                # request leaves once they are done, so close() still waits for them.
                req.failed = True
                with self._cond:
                    req.sinks_left = sum(p.sink for p in self._parts[: done[0]])
                    if req.sinks_left == 0:
                        self._inflight.pop(rid, None)
                        self._cond.notify_all()
                raise StaronnxError(f"starpu_task_submit failed for part {done[0]} ({_errno_name(ret)})")
        return req.future

    def _shapes(self, feeds: Mapping[str, np.ndarray]) -> tuple[int, dict[str, int], int]:
        """Batch size, values of the plan's symbolic dims, and a hash of the non-batch ones."""
        symbols: dict[str, int] = {}
        for spec in self.plan.inputs:
            arr = feeds[spec.name]
            for want, got in zip(spec.shape, arr.shape):
                if isinstance(want, str):
                    symbols.setdefault(want, int(got))
        batch = self.plan.contract.rows(feeds)
        others = sorted((k, v) for k, v in symbols.items() if k != self._batch_symbol)
        shape_hash = zlib.crc32(repr(others).encode()) if others else 0
        return batch, symbols, shape_hash

    # -- inside StarPU workers ----------------------------------------------------------------
    def _run(self, key: int, wid: int, ptrs: Any, sizes: Any, n: int, predicted: float) -> None:
        """The codelet's CPU implementation (StarPU worker thread, GIL held by cffi)."""
        rid, part_index = divmod(key, self.plan.k)
        req = self._inflight.get(rid)
        if req is None:
            return
        part = self._parts[part_index]
        if req.failed or req.future.done():  # failed elsewhere or cancelled: skip the work
            with self._cond:
                self._skipped += 1
            return
        w = self._workers[wid]
        ready = max((req.ends[d][0] for d in part.preds if d in req.ends), default=req.submitted_at)
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            feeds: dict[str, Any] = {}
            for slot, name in enumerate(part.buffers[: len(part.buffers) - len(part.out_slots)]):
                if name in req.side:
                    feeds[name] = req.side[name]
                else:
                    lay = req.layouts[name]
                    assert lay is not None
                    feeds[name] = self._view(ptrs[slot], sizes[slot], lay)
            for name in part.inputs:  # inputs that are not StarPU data (none in a checked plan)
                if name not in feeds:
                    feeds[name] = req.side[name]
            values = w.sessions[part_index].run(part.outputs, feeds)
            for name, arr in zip(part.outputs, values):
                out = part.out_slots.get(name)
                if out is not None:
                    lay = req.layouts.get(name)
                    if (lay is not None and isinstance(arr, np.ndarray) and arr.shape == lay.shape
                            and arr.dtype == lay.dtype and sizes[out] == lay.nbytes):
                        np.copyto(self._view(ptrs[out], sizes[out], lay), arr)
                    else:
                        req.side[name] = arr
                if name in self._output_set:
                    req.results[name] = arr
        except Exception as exc:  # noqa: BLE001 - fails this request only
            traceback.clear_frames(exc.__traceback__)
            error = exc
        end = time.perf_counter()
        measured = end - start
        req.ends[part_index] = (end, wid)
        fail: TaskError | None = None
        with self._cond:
            w.tasks += 1
            w.busy += measured
            self._queue_waits.append(max(0.0, start - ready))
            if error is None:
                self._per_part_arch[(part_index, w.arch)].append(measured)
                if math.isfinite(predicted) and predicted > 0:
                    self._predicted[(part_index, w.arch)].append(predicted * 1e-6)
            elif not req.failed:
                req.failed = True
                self._failed += 1
                fail = TaskError(part_index, w.name, error)
                fail.__cause__ = error
        if self.tracer is not None:
            self.tracer.task(wid, f"part{part_index}", start, end, {
                "request": req.id, "batch": req.batch, "failed": error is not None,
                "predicted_ms": predicted * 1e-3 if math.isfinite(predicted) and predicted > 0 else None,
                "measured_ms": measured * 1e3})
            for d in part.preds:
                if d in req.ends:
                    self.tracer.flow(req.ends[d][1], req.ends[d][0], wid, start, f"r{req.id}")
        if fail is not None and req.future.set_running_or_notify_cancel():
            req.future.set_exception(fail)

    def _view(self, ptr: int, size: int, lay: _Layout) -> np.ndarray:
        buf = self._ffi.buffer(self._ffi.cast("char *", ptr), size)
        return np.frombuffer(buf, dtype=lay.dtype, count=lay.nbytes // max(lay.dtype.itemsize, 1)).reshape(lay.shape)

    def _task_done(self, key: int) -> None:
        """StarPU callback of a sink task: resolves the request once its last sink is done."""
        req = self._inflight.get(key // self.plan.k)
        if req is None:
            return
        result: dict[str, np.ndarray] | None = None
        error: BaseException | None = None
        with self._cond:
            req.sinks_left -= 1
            if req.sinks_left > 0:
                return
            self._inflight.pop(req.id, None)
            if not req.failed and not req.future.done():
                try:
                    result = {n: req.results[n] for n in self._output_names}
                    self._done += 1
                except KeyError as exc:
                    error = StaronnxError(f"output {exc} was not produced by any part")
                    self._failed += 1
            req.keep.clear()
            self._cond.notify_all()
        if (result is not None or error is not None) and req.future.set_running_or_notify_cancel():
            if error is not None:
                req.future.set_exception(error)
            else:
                req.future.set_result(result)
        else:  # one its caller (or close) cancelled: wait() and as_completed() count it done once told
            announce_cancelled(req.future)

    # -- shutdown -----------------------------------------------------------------------------
    def close(self, timeout: float | None = 30.0) -> None:
        """Drain for up to ``timeout`` s, cancel the rest, wait for StarPU, starpu_shutdown."""
        if any(w.native_id == threading.get_native_id() for w in self._workers.values()):
            raise RuntimeError("close() called from a StarPU worker (a future's done-callback?): "
                               "StarPU cannot shut down from its own thread; close from another")
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
        with self._cond:
            self._cond.wait_for(lambda: not self._inflight, timeout)  # (notified as requests leave)
            for req in list(self._inflight.values()):
                req.failed = True  # its remaining tasks skip their work
                # cancelled and announced, as an executor does (or wait() never counts it done);
                # one that cannot be is settled (or being settled, RUNNING) by a failed task
                if req.future.cancel():
                    announce_cancelled(req.future)
        self._teardown()

    def _teardown(self) -> None:
        global _active
        try:
            if self._owns_starpu:
                self._lib.sx_shutdown()  # waits for every submitted task, then stops the workers
                self._owns_starpu = False
        finally:
            for w in self._workers.values():
                w.sessions.clear()  # joins ORT's pool threads
            for p in self._parts:
                self._lib.sx_codelet_free(p.codelet)
            self._parts.clear()
            self._inflight.clear()
            if self.tracer is not None:  # None until started, also on a failed start
                self.tracer.save()
            with _active_lock:
                if _active is self:
                    _active = None

    # -- observability ------------------------------------------------------------------------
    @property
    def workers(self) -> list[_Worker]:
        """StarPU's CPU workers as staronnx sees them (name, arch, group), in worker-id order."""
        return [self._workers[k] for k in sorted(self._workers)]

    def stats(self) -> dict[str, Any]:
        """Per-worker tasks and busy fraction, tasks per (part, arch), StarPU's predictions."""
        with self._cond:
            elapsed = max(time.perf_counter() - self.started_at, 1e-9)
            per_part = per_part_arch(self._per_part_arch, self._predicted)
            return {
                "engine": "starpu",
                "starpu_version": self.starpu_version,
                "starpu_policy": self.starpu_policy,
                "elapsed_s": elapsed,
                "requests_done": self._done,
                "requests_failed": self._failed,
                "in_flight": len(self._inflight),
                "tasks_skipped": self._skipped,
                "workers": {
                    w.name: {"arch": w.arch, "tasks": w.tasks, "busy": w.busy / elapsed, "alive": True,
                             "bound_to_pu": w.group.first_pu}
                    for w in self._workers.values()
                },
                "tasks": per_part,
                "mean_queue_wait_ms": self._queue_waits.mean() * 1e3,
                "dead_workers": [],
                "perfmodels": [p.symbol for p in self._parts] or list(self.perfmodel_symbols),
            }

    def model_stats(self, model: int) -> dict[str, Any]:
        """The plan's share of the machine, in the native engine's terms: all of it (StarPU
        serves one plan here), with no latency target, hence no deadline misses."""
        _one_model(model)
        s = self.stats()
        workers = {n: {"arch": w["arch"], "busy": w["busy"], "alive": True} for n, w in s["workers"].items()}
        return {**{k: s[k] for k in ("elapsed_s", "requests_done", "requests_failed", "in_flight")},
                "deadline_misses": 0, "target": None, "workers": workers, "tasks": s["tasks"],
                "mean_queue_wait_ms": s["mean_queue_wait_ms"], "held_by": list(workers)}

    @property
    def perfmodel_symbols(self) -> list[str]:
        tag = self.plan.hash or self.plan.compute_hash()
        return [f"staronnx_{tag}_part{i}" for i in range(self.plan.k)]

    def perfmodel_paths(self) -> list[str]:
        """Where StarPU writes the parts' history models (per the current STARPU_* settings)."""
        out = []
        for symbol in self.perfmodel_symbols:
            buf = self._ffi.new("char[]", 4096)
            self._lib.starpu_perfmodel_get_model_path(symbol.encode(), buf, 4096)
            out.append(self._ffi.string(buf).decode().replace("//", "/"))
        return out


# ----------------------------------------------------------------------------- helpers
def _layout(dtype: str, shape: list[Any], batched: bool, symbols: Mapping[str, int], batch: int) -> _Layout | None:
    """The crossing tensor's layout when known before its producer runs, else None.

    A guess that turns out wrong (the part produces another shape) only sends that tensor
    through the Python side instead of its StarPU buffer.
    """
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None
    if dt.kind not in "biufc":
        return None
    dims: list[int] = []
    for axis, d in enumerate(shape):
        if isinstance(d, int) and d >= 0:
            dims.append(d)
        elif isinstance(d, str) and d in symbols:
            dims.append(symbols[d])
        elif axis == 0 and batched and isinstance(d, str):
            dims.append(batch)
        else:
            return None
    nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    if nbytes <= 0 or nbytes >= 2**32:  # StarPU vectors count elements in 32 bits
        return None
    return _Layout(tuple(dims), dt, nbytes)


_Fn = TypeVar("_Fn", bound=Callable[..., None])


def _extern(ffi: Any, onerror: Callable[[Any, Any, Any], None]) -> Callable[[_Fn], _Fn]:
    """``ffi.def_extern(onerror=...)`` with its type said: it binds the function of the same
    name as the C side's ``extern "Python"`` and gives the function back as it is."""
    decorator: Callable[[_Fn], _Fn] = ffi.def_extern(onerror=onerror)
    return decorator


@functools.cache
def _install_externs(ffi: Any) -> None:
    """Bind the C side's ``extern "Python"`` entry points once per process (``ffi`` is the one
    binding :func:`load_binding` loads)."""

    def onerror(exc_type: Any, exc: Any, tb: Any) -> None:
        log.error("exception in a StarPU callback", exc_info=(exc_type, exc, tb))

    @_extern(ffi, onerror)
    def sx_py_run(key: int, wid: int, ptrs: Any, sizes: Any, n: int, predicted: float) -> None:
        engine = _active
        if engine is not None:
            engine._run(key, wid, ptrs, sizes, n, predicted)

    @_extern(ffi, onerror)
    def sx_py_done(key: int) -> None:
        engine = _active
        if engine is not None:
            engine._task_done(key)

    @_extern(ffi, onerror)
    def sx_py_worker_init(wid: int) -> None:
        engine = _active
        if engine is not None:
            engine._worker_init(wid)


@contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of ``starpu_init`` (which reads them)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _one_model(model: int) -> None:
    if model != 0:
        raise StaronnxError(f"the starpu engine serves one plan (model 0), not model {model}; several models "
                            "share a runtime on the native engine")


def _errno_name(ret: int) -> str:
    return errno.errorcode.get(-ret, str(ret))


@atexit.register
def _close_at_exit() -> None:
    # StarPU's worker threads call into Python: stop them before the interpreter tears down.
    engine = _active
    if engine is not None:
        try:
            engine.close(timeout=5.0)
        except Exception:  # pragma: no cover - best effort at exit
            log.debug("closing the starpu engine at exit failed", exc_info=True)
