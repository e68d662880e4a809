"""The CUDA worker: one thread per CUDA stream, one ONNX Runtime CUDA session per part.

A :class:`CudaWorker` is one of StarPU's ``STARPU_NWORKER_PER_CUDA`` workers
(STARPU_MODEL.md §4): a **non-blocking** compute stream of its own (never serialised with
stream 0 or another worker's) bound to each part's session (``user_compute_stream``), and two
copy streams. A task's inputs go through **pinned** staging buffers, H2D on the copy stream,
into device buffers bound to an IOBinding; events order copies, kernels and the D2H copy
without blocking the host (with a user stream ORT does not synchronise, so this event chain is
what makes results safe to read). While a task computes, the next queued task's inputs are
staged (prefetch). Buffers and bindings are cached per (part, input signature) in a
:class:`_Slot`, so steady-state calls allocate nothing.

CUDA graphs (``cuda_graphs=True``, opt-in; at batch 1-8 a GPU waits on launches): a slot whose
every buffer is fixed gets a graph id of its own (ORT's ``enable_cuda_graph``,
``gpu_graph_id``). Capture uses CUDA's global capture mode, where another thread's CUDA call
fails it (errors 900/901), so capturing runs hold :data:`GRAPH_LOCK` exclusively.

:attr:`CudaWorkerFuture.compute_seconds`, what the perf models learn, is GPU time between
events on the compute stream: input transfers are the bus model's, as in StarPU.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from staronnx.errors import DeviceError, InputError, ModelError
from staronnx.workers.base import (
    Feeds,
    OnDone,
    Outputs,
    WorkerTask,
    ThreadWorker,
    WorkerFuture,
    _batch_of,
)
from staronnx.workers.cudart import (
    INSTALL_HINT,
    CudaError,
    CudaRuntime,
    GpuRuntime,
    runtime_module,
)
from staronnx.workers.memory import CopyLog, CopyRecord, MemoryNode
from staronnx.workers.pinned_pool import PinnedPool

__all__ = [
    "CONV_ALGO_SEARCHES",
    "CudaWorker",
    "CudaWorkerFuture",
    "cuda_unavailable_reason",
]

log = logging.getLogger(__name__)

CUDA_EP = "CUDAExecutionProvider"
CONV_ALGO_SEARCHES = ("EXHAUSTIVE", "HEURISTIC", "DEFAULT")
#: Provider options the worker owns; letting callers override them would break the stream model.
_RESERVED_OPTIONS = {"device_id", "user_compute_stream", "has_user_compute_stream"}

#: ONNX Runtime type strings -> numpy dtypes the worker can stage and return.
_ORT_TO_NUMPY: dict[str, np.dtype] = {
    f"tensor({k})": np.dtype(v)
    for k, v in {
        "float": np.float32, "float16": np.float16, "double": np.float64,
        "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
        "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
        "bool": np.bool_,
    }.items()
}


#: runs of a slot's graph id under the exclusive lock: ORT's regular run(s), then its capture
GRAPH_CAPTURE_RUNS = 3


class _CaptureLock:
    """Shared for graph-enabled tasks, exclusive for a capturing run (a writer-preferring
    readers-writer lock: a waiting capture holds new tasks back, so it is never starved)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._writer or self._waiting_writers:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting_writers += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._waiting_writers -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


#: one per process: CUDA's global capture mode spans every thread of the process
GRAPH_LOCK = _CaptureLock()


# ---------------------------------------------------------------------- availability
def cuda_unavailable_reason(device_id: int | None = None) -> str | None:
    """``None`` when a CUDA worker can run here, else one message saying what is missing.

    Checks, in order: ONNX Runtime's CUDA execution provider, cuda-python, then (only when
    both are there) the CUDA driver and ``device_id``.
    """
    missing = []
    providers = ort.get_available_providers()
    if CUDA_EP not in providers:
        missing.append(
            f"ONNX Runtime's {CUDA_EP} (onnxruntime {ort.__version__} here offers only "
            f"{', '.join(providers) or 'no provider'}; the GPU build is the onnxruntime-gpu "
            "package, which replaces onnxruntime: pip uninstall onnxruntime first)"
        )
    try:
        runtime_module()
    except DeviceError:
        missing.append("NVIDIA's cuda-python (the module cuda.bindings.runtime)")
    if missing:
        return f"CUDA workers need {' and '.join(missing)}. Install them with: {INSTALL_HINT}"
    try:
        count = CudaRuntime().device_count()
    except CudaError as exc:
        return (f"the CUDA runtime cannot see a GPU ({exc}); check the NVIDIA driver, and that "
                "cuda-python's major version is not newer than the driver's CUDA version")
    if count == 0:
        return ("no CUDA device is visible (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    if device_id is not None and not 0 <= device_id < count:
        return f"CUDA device {device_id} does not exist: {count} device(s) visible, 0..{count - 1}"
    return None


# ---------------------------------------------------------------------- futures, parts
class CudaWorkerFuture(WorkerFuture):
    """A :class:`~staronnx.workers.base.WorkerFuture` that also reports the task's transfers.

    ``start``/``end`` are host ``perf_counter`` stamps from the start of the task's execution
    to its outputs being on the host; ``compute_seconds``, ``h2d_seconds`` and
    ``d2h_seconds`` are GPU times measured with CUDA events.
    """

    def __init__(self, part: int, batch: int, worker: str) -> None:
        super().__init__(part, batch, worker)
        self.compute_seconds: float | None = None
        self.h2d_seconds: float | None = None
        self.d2h_seconds: float | None = None
        self.h2d_bytes = 0
        self.d2h_bytes = 0


@dataclass
class _Part:
    """One part's session and what the worker needs to know about its signature."""

    session: ort.InferenceSession
    inputs: list[str]
    input_dtypes: list[np.dtype | None]
    input_shapes: list[list[int | str | None]]
    outputs: list[str]
    #: per output: its shape is determined by the input shapes (so it may be pre-allocated).
    static_outputs: list[bool]

    @classmethod
    def of(cls, session: ort.InferenceSession) -> _Part:
        ins, outs = session.get_inputs(), session.get_outputs()
        symbols = {d for i in ins for d in i.shape if isinstance(d, str)}
        return cls(
            session=session,
            inputs=[i.name for i in ins],
            input_dtypes=[_ORT_TO_NUMPY.get(i.type) for i in ins],
            input_shapes=[list(i.shape) for i in ins],
            outputs=[o.name for o in outs],
            static_outputs=[
                all(isinstance(d, int) or (isinstance(d, str) and d in symbols) for d in o.shape)
                for o in outs
            ],
        )


# ---------------------------------------------------------------------- buffer slots
@dataclass
class _Tensor:
    """A tensor's staging: pinned host buffer, device buffer (None: ORT allocates), shape."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    pinned: Any = None  # PinnedBuffer
    device: Any = None  # DeviceBuffer

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def free(self) -> None:
        for buf in (self.pinned, self.device):
            if buf is not None:
                buf.free()
        self.pinned = self.device = None


@dataclass
class _Slot:
    """Everything one (part, input signature) needs, reused call after call.

    ``outputs`` is None until the first run has shown the output shapes and types.
    """

    key: tuple[Any, ...]
    part: int
    binding: Any  # ort.IOBinding
    inputs: list[_Tensor]
    events: dict[str, Any]
    outputs: list[_Tensor] | None = None
    bound: list[bool] = field(default_factory=list)  # output i bound to our device buffer
    busy: bool = False
    last_used: int = 0
    #: CUDA graph of this slot's fixed buffers (None: runs without one) and runs made with it
    graph_id: int | None = None
    graph_runs: int = 0
    run_options: Any = None  # ort.RunOptions carrying gpu_graph_id

    def free(self) -> None:
        for t in self.inputs + (self.outputs or []):
            t.free()
        for ev in self.events.values():
            ev.destroy()
        self.events.clear()
        self.binding = None

    @property
    def device_bytes(self) -> int:
        return sum(t.device.nbytes for t in self.inputs + (self.outputs or []) if t.device)


class _SlotCache:
    """Slots per key with LRU eviction of idle ones beyond ``max_slots``."""

    def __init__(self, max_slots: int) -> None:
        self.max_slots = max_slots
        self._slots: dict[tuple[Any, ...], list[_Slot]] = {}
        self._clock = 0
        self.created = 0

    def acquire(self, key: tuple[Any, ...], make: Callable[[], _Slot]) -> _Slot:
        self._clock += 1
        for slot in self._slots.get(key, ()):
            if not slot.busy:
                break
        else:
            slot = make()
            self.created += 1
            self._slots.setdefault(key, []).append(slot)
        slot.busy = True  # before evicting, so the new slot is never the victim
        slot.last_used = self._clock
        self._evict()
        return slot

    def release(self, slot: _Slot) -> None:
        slot.busy = False

    def _evict(self) -> None:
        idle = [s for ss in self._slots.values() for s in ss if not s.busy]
        excess = len(self) - self.max_slots
        for slot in sorted(idle, key=lambda s: s.last_used)[: max(excess, 0)]:
            self._slots[slot.key].remove(slot)
            if not self._slots[slot.key]:
                del self._slots[slot.key]
            slot.free()

    def __len__(self) -> int:
        return sum(len(v) for v in list(self._slots.values()))  # a snapshot: any thread may ask

    def all(self) -> list[_Slot]:
        return [s for ss in self._slots.values() for s in ss]

    def close(self) -> None:
        for slot in self.all():
            slot.free()
        self._slots.clear()


@dataclass
class _Task(WorkerTask):
    """A :class:`~staronnx.workers.base.WorkerTask` with its staging state."""

    fut: CudaWorkerFuture
    slot: _Slot | None = None
    dead: bool = False  # failed or cancelled while prefetched


# ---------------------------------------------------------------------- the worker
class CudaWorker(ThreadWorker):
    """Runs the parts of a plan on one CUDA stream of one GPU.

    ``cudnn_conv_algo_search``: EXHAUSTIVE (ORT's default: best kernels, slow first run per
    shape), HEURISTIC or DEFAULT.  ``provider_options`` adds CUDA provider options (e.g.
    ``gpu_mem_limit``); device and stream are the worker's own.  ``cpu`` pins the worker thread
    to one PU (a core held back by ``reserve=N`` in the CPU groups).  ``prefetch`` stages the
    next task's inputs while the current one computes.  ``copy_log`` receives a
    :class:`~staronnx.workers.memory.CopyRecord` per task and direction (GPU-timed), with
    ``host_node`` as the host end.  ``max_slots`` bounds how many (part, batch size) buffer
    sets stay cached.  ``cuda_graphs`` captures each
    (part, batch size) buffer set as a CUDA graph and replays it (see the module's doc).
    ``runtime`` replaces the CUDA runtime: a
    :class:`~staronnx.workers.cudart.HostRuntime` runs the same pipeline on the CPU provider
    with host memory (how it is tested without a GPU).  Without one, the constructor raises
    :class:`DeviceError` when ONNX Runtime's CUDA provider, cuda-python or the device is
    missing.

    The thread, queue, ``start``/``close``, ``call``/``spawn`` and the task bookkeeping are
    :class:`~staronnx.workers.base.ThreadWorker`'s; this class sets up the device, streams and
    sessions, stages and runs tasks, and tears it all down.  The worker's device is current in
    its thread, so functions given to ``call``/``spawn`` run with it.  At close, in that
    thread, streams are synchronised, bindings and sessions dropped, pinned and device buffers
    freed, events and streams destroyed.
    """

    kind = "cuda"
    _log = log

    def __init__(
        self,
        device_id: int,
        stream_index: int,
        part_paths: Sequence[str | os.PathLike[str]],
        cudnn_conv_algo_search: str = "EXHAUSTIVE",
        name: str | None = None,
        *,
        cpu: int | None = None,
        provider_options: Mapping[str, str] | None = None,
        prefetch: bool = True,
        copy_log: CopyLog | None = None,
        host_node: MemoryNode | str = "numa0",
        max_slots: int = 64,
        on_done: OnDone | None = None,
        runtime: GpuRuntime | None = None,
        cuda_graphs: bool = False,
        pinned_pool: PinnedPool | None = None,
    ) -> None:
        if cudnn_conv_algo_search not in CONV_ALGO_SEARCHES:
            raise ValueError(f"cudnn_conv_algo_search must be one of {CONV_ALGO_SEARCHES}, "
                             f"got {cudnn_conv_algo_search!r}")
        extra = {str(k): str(v) for k, v in (provider_options or {}).items()}
        if _RESERVED_OPTIONS & extra.keys():
            raise ValueError(f"provider option(s) {sorted(_RESERVED_OPTIONS & extra.keys())} are "
                             "set by the worker itself (its device and its own stream)")
        if max_slots < 2:
            raise ValueError("max_slots must be >= 2 (prefetch needs two buffer sets)")
        if runtime is None:
            reason = cuda_unavailable_reason(device_id)
            if reason is not None:
                raise DeviceError(reason)
            runtime = CudaRuntime()
        super().__init__(part_paths, name or f"cuda{device_id}.s{stream_index}", on_done)
        self._runtime: GpuRuntime = runtime
        self.device_id = device_id
        self.arch = self.memory_node = f"cuda{device_id}"
        self.n_cores = 1
        self.stream_index = stream_index
        self.cudnn_conv_algo_search = cudnn_conv_algo_search
        self.node = MemoryNode("cuda", device_id)
        self.host_node = MemoryNode.parse(host_node)
        self.cpu = cpu
        self.prefetch = prefetch
        self.copy_log = copy_log
        #: the compute stream's cudaStream_t value (set by start()).
        self.stream_handle: int | None = None
        self._extra_options = extra
        self._device_type = runtime.ort_device_type
        self._bind_device = device_id if self._device_type == "cuda" else 0
        self._slots = _SlotCache(max_slots)
        self._parts: list[_Part] = []
        self._streams: dict[str, Any] = {}
        self._run_options: ort.RunOptions | None = None
        self._broken: BaseException | None = None
        self.cuda_graphs = bool(cuda_graphs)
        #: parts whose sessions were built with enable_cuda_graph
        self.graph_parts: set[int] = set()
        self._next_graph_id = 1
        #: slots whose graph has been through its capture runs
        self.graphs_captured = 0
        #: where batches can be assembled so that this worker copies them without staging
        #: (shared by the workers start_workers makes; the worker that made it frees it)
        self.pinned_pool = pinned_pool or PinnedPool(self._allocate_pinned)
        self._owns_pool = pinned_pool is None
        #: inputs copied to the device straight from pool memory (no staging copy)
        self.staging_skipped = 0

    # ------------------------------------------------------------------ lifecycle hooks
    def _start_failure(self, err: BaseException) -> Exception:
        return DeviceError(f"{self.name} could not start: {err}")

    def _describe(self) -> str:
        return f"device {self.device_id}"

    # ------------------------------------------------------------------ tasks
    def submit(self, part: int, feeds: Feeds) -> CudaWorkerFuture:
        """Queue ``part`` on ``feeds`` (host arrays); resolves to ``{output name: array}``.

        A task that fails (bad feed, ORT error) fails its own future only; a CUDA error
        breaks the worker (the context is unusable), and later tasks fail with it.
        """
        self._check_open()
        self._check_part(part)
        fut = CudaWorkerFuture(part, _batch_of(feeds, self._parts[part].inputs), self.name)
        self._put(("run", _Task(part, feeds, fut, True)))
        return fut

    def warmup(
        self,
        batch_sizes: Sequence[int],
        make_feeds: Callable[[int, int], Feeds],
        repeats: int = 2,
    ) -> list[tuple[int, int, float]]:
        """Run every part at every batch size before anything is timed.

        The first run of a shape pays cuDNN's algorithm search and the buffer set-up (it runs
        with ORT-allocated outputs to learn their shapes); the second runs the steady-state
        path with the worker's own buffers, hence ``repeats=2``.  Warm-up runs don't call
        ``on_done`` nor count in :attr:`stats`.  Returns ``(part, batch, compute seconds)`` of
        the last repeat of each.
        """
        if self.cuda_graphs:  # discovery, then the graph's regular runs and its capture
            repeats = max(repeats, 1 + GRAPH_CAPTURE_RUNS)
        return self._warmup(
            batch_sizes, make_feeds, repeats,
            lambda part, feeds, b: _Task(part, feeds, CudaWorkerFuture(part, b, self.name), False),
            lambda fut: fut.compute_seconds,
        )

    def run_here(self, part: int, feeds: Feeds) -> Outputs:
        """Run a part from inside this worker's thread (see :meth:`spawn`): stage, compute, copy
        back, with the same stream/event ordering as queued tasks; errors propagate."""
        self._check_own_thread()
        self._check_part(part)
        fut = CudaWorkerFuture(part, _batch_of(feeds, self._parts[part].inputs), self.name)
        task = _Task(part, feeds, fut, True)
        if self._begin(task):
            self._execute(task)
        outputs = fut.result()
        # perf models hold kernel time only; copies belong to the bus model (as in StarPU)
        self.last_compute_seconds = fut.compute_seconds
        return outputs

    # ------------------------------------------------------------------ introspection
    def input_names(self, part: int) -> list[str]:
        return list(self._parts[part].inputs)

    def output_names(self, part: int) -> list[str]:
        return list(self._parts[part].outputs)

    def provider_options(self, part: int) -> dict[str, dict[str, str]]:
        """The options ORT reports for part ``part``'s session, per provider."""
        return {k: dict(v) for k, v in self._parts[part].session.get_provider_options().items()}

    def buffer_stats(self) -> dict[str, int]:
        """Allocation counters of this worker's runtime plus the cached buffer sets."""
        out = dict(self._runtime.stats.snapshot())
        # read here, not through call(): under a Runtime the worker's thread runs the engine's
        # loop and would never get to a call
        out["slots"] = len(self._slots) if self.alive else 0
        out["slots_created"] = self._slots.created
        out["staging_skipped"] = self.staging_skipped
        return out

    def _allocate_pinned(self, nbytes: int) -> Any:
        # any thread may ask (the serving batcher does): never while a graph is being captured
        with GRAPH_LOCK.shared():
            return self._runtime.pinned(nbytes)

    # ------------------------------------------------------------------ worker thread
    def _setup_thread(self) -> None:
        if self.cpu is not None:
            self._pin(self.cpu)
        rt = self._runtime
        rt.set_device(self.device_id)
        for key in ("compute", "h2d", "d2h"):
            self._streams[key] = rt.stream(non_blocking=True)
        self.stream_handle = self._streams["compute"].handle
        self._run_options = ort.RunOptions()
        # Errors reach the caller as exceptions; ORT printing them too (e.g. the expected
        # failure that sends a slot back to ORT-allocated outputs) would be noise.
        self._run_options.log_severity_level = 4
        if self.cuda_graphs:
            # runs that must not be captured (output discovery, slots with ORT-allocated outputs)
            self._run_options.add_run_config_entry("gpu_graph_id", "-1")
        for i, path in enumerate(self.part_paths):
            self._parts.append(_Part.of(self._load_with_graphs(i, path)))

    def _load_with_graphs(self, index: int, path: Path) -> ort.InferenceSession:
        """The part's session, with CUDA graphs where asked and where ORT accepts them."""
        if not self.cuda_graphs:
            return self._load(index, path)
        try:
            session = self._load(index, path, graphs=True)
        except (DeviceError, ModelError) as exc:
            log.warning("%s: part %d runs without CUDA graphs: %s", self.name, index, exc)
            return self._load(index, path)
        self.graph_parts.add(index)
        return session

    def _providers(self, graphs: bool = False) -> list[Any]:
        if self._device_type != "cuda":
            return ["CPUExecutionProvider"]
        options = {
            "device_id": str(self.device_id),
            "user_compute_stream": str(self.stream_handle),
            "cudnn_conv_algo_search": self.cudnn_conv_algo_search,
            "do_copy_in_default_stream": "0",
            **({"enable_cuda_graph": "1"} if graphs else {}),
            **self._extra_options,
        }
        return [(CUDA_EP, options), "CPUExecutionProvider"]

    def _load(self, index: int, path: Path, graphs: bool = False) -> ort.InferenceSession:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        # Nodes the CUDA provider leaves to the CPU are small (shapes, indices): one thread,
        # no spinning, so N CUDA workers do not compete with the CPU workers for cores.
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            session = ort.InferenceSession(str(path), so, providers=self._providers(graphs))
        except Exception as exc:  # noqa: BLE001 - ORT's own error types; reported as ours
            text = str(exc)
            if any(w in text.lower() for w in ("cuda", "cudnn", "cublas")):
                raise DeviceError(f"{self.name}: ONNX Runtime cannot start CUDA for part {index} "
                                  f"({path}): {text}") from None
            raise ModelError(f"ONNX Runtime cannot load part {index} ({path}): {text}") from None
        if self._device_type == "cuda" and session.get_providers()[0] != CUDA_EP:
            raise DeviceError(
                f"{self.name}: ONNX Runtime fell back to {session.get_providers()} for part "
                f"{index}: its CUDA provider could not start (usually CUDA or cuDNN libraries "
                "that do not match onnxruntime-gpu; see ORT's warning above, and "
                "onnxruntime.preload_dlls() when they come from pip)"
            )
        return session

    # -- serving
    def _run_task(self, task: _Task) -> None:
        """Stage the task (unless the prefetch did), stage the next one, then run this one."""
        if task.dead or (task.slot is None and not self._begin(task)):
            return
        if self.prefetch and not self._held:
            nxt = self._hold_next()
            if nxt is not None and not self._begin(nxt):
                nxt.dead = True
        self._execute(task)

    def _begin(self, task: _Task) -> bool:
        """Mark the task running and stage its inputs; False when it is cancelled or failed."""
        if not task.fut.set_running_or_notify_cancel():
            return False
        try:
            if self._broken is not None:
                raise DeviceError(f"{self.name} is unusable after a CUDA error: {self._broken}")
            # staging may allocate pinned memory, which must not happen during another
            # worker's graph capture
            with GRAPH_LOCK.shared() if self.cuda_graphs else nullcontext():
                task.slot = self._stage(task)
            return True
        except BaseException as exc:  # noqa: BLE001 - fails this task only
            self._fail(task, exc)
            return False

    def _stage(self, task: _Task) -> _Slot:
        """Copy the feeds into the slot's pinned buffers and start their H2D copies."""
        part = self._parts[task.part]
        arrays = _check_feeds(part, task.part, task.feeds)
        key = (task.part, tuple((a.dtype.str, a.shape) for a in arrays))
        slot = self._slots.acquire(key, lambda: self._new_slot(key, task.part, arrays))
        try:
            sources = []
            for t, a in zip(slot.inputs, arrays):
                if self.pinned_pool.owns(a):  # assembled in pinned memory: no staging pass
                    sources.append(a.ctypes.data)
                    self.staging_skipped += 1
                else:
                    np.copyto(t.pinned.view(t.dtype, t.shape), a)
                    sources.append(t.pinned.ptr)
            h2d = self._streams["h2d"]
            slot.events["h2d_start"].record(h2d)
            for t, src in zip(slot.inputs, sources):
                self._runtime.copy_h2d(t.device.ptr, src, t.nbytes, h2d)
            slot.events["h2d_done"].record(h2d)
            task.fut.h2d_bytes = sum(t.nbytes for t in slot.inputs)
        except BaseException as exc:
            self._recover(slot, exc)
            self._slots.release(slot)
            raise
        return slot

    def _new_slot(self, key: tuple[Any, ...], part_index: int, arrays: list[np.ndarray]) -> _Slot:
        part = self._parts[part_index]
        rt = self._runtime
        inputs: list[_Tensor] = []
        events: dict[str, Any] = {}
        try:
            binding = part.session.io_binding()
            for name, a in zip(part.inputs, arrays):
                t = _Tensor(name, a.dtype, tuple(a.shape))
                inputs.append(t)
                t.pinned = rt.pinned(t.nbytes)
                t.device = rt.device_buffer(t.nbytes)
                binding.bind_input(name, self._device_type, self._bind_device, a.dtype.type,
                                   list(t.shape), t.device.ptr)
            for ev in ("h2d_start", "h2d_done", "run_start", "run_done", "d2h_start", "d2h_done"):
                events[ev] = rt.event(timing=True)
        except BaseException:
            for t in inputs:
                t.free()
            for e in events.values():
                e.destroy()
            raise
        return _Slot(key, part_index, binding, inputs, events)

    def _execute(self, task: _Task) -> None:
        slot = task.slot
        assert slot is not None
        fut = task.fut
        try:
            if self._broken is not None:
                raise DeviceError(f"{self.name} is unusable after a CUDA error: {self._broken}")
            fut.start = time.perf_counter()
            try:
                with self._graph_guard(slot):
                    values = self._run_slot(slot)
            except (CudaError, InputError):
                raise
            except Exception as exc:  # an ORT error: maybe our pre-allocated outputs
                if not any(slot.bound):
                    raise
                log.warning("%s: part %d failed with pre-allocated outputs (%s); retrying with "
                            "ORT-allocated outputs for this shape", self.name, slot.part, exc)
                self._recover(slot, exc)
                self._unbind_outputs(slot)
                values = self._run_slot(slot)
            fut.end = time.perf_counter()
        except BaseException as exc:  # noqa: BLE001 - fails this task only
            self._recover(slot, exc)
            self._slots.release(slot)
            self._fail(task, exc)
            return
        ev = slot.events
        fut.d2h_bytes = sum(t.nbytes for t in slot.outputs or [])
        fut.compute_seconds = compute = ev["run_done"].seconds_since(ev["run_start"])
        fut.h2d_seconds = ev["h2d_done"].seconds_since(ev["h2d_start"])
        fut.d2h_seconds = ev["d2h_done"].seconds_since(ev["d2h_start"])
        self._slots.release(slot)
        if self.copy_log is not None:
            host, dev = self.host_node.name, self.node.name
            self.copy_log.add(CopyRecord(host, dev, fut.h2d_bytes, fut.h2d_seconds))
            self.copy_log.add(CopyRecord(dev, host, fut.d2h_bytes, fut.d2h_seconds))
        self._record_done(task, compute)
        fut.set_result(values)

    def _graph_guard(self, slot: _Slot) -> Any:
        """The lock a run of ``slot`` holds: none without graphs, exclusive while its graph is
        being captured, shared otherwise (no capture may run beside it)."""
        if not self.cuda_graphs:
            return nullcontext()
        if slot.graph_id is not None and slot.graph_runs < GRAPH_CAPTURE_RUNS:
            return GRAPH_LOCK.exclusive()
        return GRAPH_LOCK.shared()

    def _give_graph(self, slot: _Slot) -> None:
        """After output discovery: a graph id for a slot whose every buffer is fixed."""
        if slot.part not in self.graph_parts or not slot.bound or not all(slot.bound):
            return
        slot.graph_id = self._next_graph_id
        self._next_graph_id += 1
        slot.run_options = ort.RunOptions()
        slot.run_options.log_severity_level = 4
        slot.run_options.add_run_config_entry("gpu_graph_id", str(slot.graph_id))

    def _run_slot(self, slot: _Slot) -> Outputs:
        """Compute after the inputs' event, copy outputs back after the compute event."""
        part = self._parts[slot.part]
        compute, d2h = self._streams["compute"], self._streams["d2h"]
        ev = slot.events
        binding = slot.binding
        discovering = slot.outputs is None
        for i, name in enumerate(part.outputs):
            if discovering or not slot.bound[i]:
                # Rebind every run: a filled OrtValue would otherwise be reused as a
                # pre-allocated output, which fails when the shape changes.
                binding.bind_output(name, self._device_type, self._bind_device)
        compute.wait(ev["h2d_done"])
        ev["run_start"].record(compute)
        graph = slot.graph_id is not None and not discovering
        part.session.run_with_iobinding(binding, slot.run_options if graph else self._run_options)
        ev["run_done"].record(compute)
        if graph:
            slot.graph_runs += 1
            if slot.graph_runs == GRAPH_CAPTURE_RUNS:
                self.graphs_captured += 1

        # ORT-allocated outputs (first run, data-dependent shapes): read their shapes and
        # addresses now; the kernels filling them may still be running.
        produced: list[Any] = binding.get_outputs() if discovering or not all(slot.bound) else []
        if discovering:
            slot.outputs = [_Tensor(n, _numpy_type(v, n), tuple(v.shape()))
                            for n, v in zip(part.outputs, produced)]
            slot.bound = [False] * len(part.outputs)
        assert slot.outputs is not None
        sources = []
        for i, t in enumerate(slot.outputs):
            if slot.bound[i]:
                sources.append(t.device.ptr)
                continue
            v = produced[i]
            t.dtype, t.shape = _numpy_type(v, t.name), tuple(v.shape())
            sources.append(v.data_ptr())
            if t.pinned is None or t.pinned.nbytes < t.nbytes:
                old = t.pinned
                t.pinned = self._runtime.pinned(
                    max(t.nbytes, int(old.nbytes * 1.5) if old is not None else 0))
                if old is not None:
                    old.free()
        d2h.wait(ev["run_done"])
        ev["d2h_start"].record(d2h)
        for t, src in zip(slot.outputs, sources):
            self._runtime.copy_d2h(t.pinned.ptr, src, t.nbytes, d2h)
        ev["d2h_done"].record(d2h)
        ev["d2h_done"].synchronize()
        del produced  # ORT's own output buffers may go back to its arena now
        result = {t.name: np.array(t.pinned.view(t.dtype, t.shape), copy=True)
                  for t in slot.outputs}
        if discovering:
            self._bind_static_outputs(slot, part)
            if self.cuda_graphs:
                self._give_graph(slot)
        return result

    def _bind_static_outputs(self, slot: _Slot, part: _Part) -> None:
        """After the first run: give shape-determined outputs a device buffer of their own."""
        assert slot.outputs is not None
        for i, t in enumerate(slot.outputs):
            if not part.static_outputs[i]:
                continue
            t.device = self._runtime.device_buffer(t.nbytes)
            slot.binding.bind_output(t.name, self._device_type, self._bind_device, t.dtype.type,
                                     list(t.shape), t.device.ptr)
            slot.bound[i] = True

    def _unbind_outputs(self, slot: _Slot) -> None:
        """Fall back to ORT-allocated outputs for this slot (its shapes were not static)."""
        slot.graph_id, slot.run_options = None, None  # a graph needs fixed output buffers
        for i, t in enumerate(slot.outputs or []):
            if slot.bound[i]:
                slot.bound[i] = False
                if t.device is not None:
                    t.device.free()
                    t.device = None

    def _recover(self, slot: _Slot, exc: BaseException) -> None:
        """Wait until no queued GPU work uses ``slot`` before it is reused or freed."""
        try:
            for stream in self._streams.values():
                stream.synchronize()
        except CudaError as err:
            self._broken = err
        if isinstance(exc, CudaError):
            self._broken = exc

    def _teardown(self) -> None:
        """Free everything, in an order that never leaves ORT holding a destroyed stream."""
        for stream in self._streams.values():
            try:
                stream.synchronize()
            except Exception as exc:  # noqa: BLE001 - keep freeing what we can
                log.warning("%s: synchronising a stream at close failed: %s", self.name, exc)
        try:
            self._slots.close()  # drops the IOBindings (they hold the sessions) and buffers
        except Exception as exc:  # noqa: BLE001
            log.warning("%s: freeing buffers at close failed: %s", self.name, exc)
        if self._owns_pool:
            self.pinned_pool.close()
        refs = [weakref.ref(p.session) for p in self._parts]
        self._parts.clear()
        if any(r() is not None for r in refs):
            gc.collect()
        session_alive = any(r() is not None for r in refs)
        for key, stream in list(self._streams.items()):
            if key == "compute" and session_alive:
                # Something outside still holds a session bound to this stream: leaking the
                # stream is harmless, destroying it under ORT is not.
                log.warning("%s: a session outlives the worker; its stream is not destroyed",
                            self.name)
                continue
            try:
                stream.destroy()
            except Exception as exc:  # noqa: BLE001
                log.warning("%s: destroying a stream failed: %s", self.name, exc)
        self._streams.clear()


# ---------------------------------------------------------------------- helpers
def _check_feeds(part: _Part, index: int, feeds: Feeds) -> list[np.ndarray]:
    """The feeds as arrays in the session's input order, or an :class:`InputError`."""
    unknown = sorted(set(feeds) - set(part.inputs))
    missing = [n for n in part.inputs if n not in feeds]
    if unknown or missing:
        raise InputError(
            f"part {index} takes inputs {part.inputs}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unknown {unknown}" if unknown else "")
        )
    arrays = []
    for name, dtype, shape in zip(part.inputs, part.input_dtypes, part.input_shapes):
        a = np.asarray(feeds[name])
        if dtype is None:
            raise InputError(f"input {name!r} of part {index} has a type the CUDA worker "
                             "cannot stage (only numeric and bool tensors)")
        if a.dtype != dtype:
            raise InputError(f"input {name!r} of part {index} must be {dtype}, got {a.dtype}")
        fixed_dims_differ = any(isinstance(d, int) and d != n for d, n in zip(shape, a.shape))
        if len(shape) != a.ndim or fixed_dims_differ:
            raise InputError(f"input {name!r} of part {index} must have shape {shape}, "
                             f"got {list(a.shape)}")
        arrays.append(a)
    return arrays


def _numpy_type(value: Any, name: str) -> np.dtype:
    kind = value.data_type()
    dtype = _ORT_TO_NUMPY.get(kind)
    if dtype is None:
        raise ModelError(f"output {name!r} is a {kind}, which the CUDA worker cannot return "
                         "as a numpy array")
    return dtype
