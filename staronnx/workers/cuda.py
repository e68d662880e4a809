"""The CUDA worker: one thread per CUDA stream, one ONNX Runtime CUDA session per part.

A :class:`CudaWorker` is one of StarPU's ``STARPU_NWORKER_PER_CUDA`` workers
(STARPU_MODEL.md §4): a **non-blocking** stream of its own (never serialised with stream 0 or
another worker's), bound to each part's session (``user_compute_stream``). It is a driver: it
launches a task's copies and run on its stream and waits for them (``launch_here``,
``finish_here``), from the thread of the engine that drives it; the engine decides which copies
(:mod:`staronnx.runtime.datawizard`) and hands it each input where it is (a host array, or a
tensor already in GPU memory). Beside it: the buffer slots and their graph state
(:mod:`staronnx.workers.slots`), the GPU as a memory node and a handle's copies
(:mod:`staronnx.workers.replicas`), and whether CUDA workers can run here at all
(:mod:`staronnx.workers.cuda_env`).

Everything Python does per task holds the GIL that every worker shares, so on a GPU server the
host cost of a task, not the GPU, caps tasks/s at small batches. A task is therefore: one
async copy per input into the slot's fixed buffers (up from a batch the serving pool assembled
in pinned memory, else through the slot's pinned staging buffer; or within the GPU from a
tensor already there, after the event of a prefetch still in flight), one ORT run (or CUDA
graph replay), one async copy back per output the request needs on the host (the outputs
other parts read stay on the GPU), one wait; all on the worker's stream, with what it needs
cached in a :class:`Slot`. ORT synchronises its stream at the end of every run unless told not
to (``disable_synchronize_execution_providers``): that is set, and the worker's own wait is the
only one. Timing events are recorded only while a perf model still needs samples (``timed``).

CUDA graphs (on by default; at batch 1-8 a GPU waits on launches): a slot whose every buffer is
fixed gets a graph id of its own (ORT's ``enable_cuda_graph``, ``gpu_graph_id``). ORT 1.31's
first run of that id is the capture: its regular run(s), the capture and a replay, all in one
call; every later run from the same thread is a replay. ORT keeps graphs per thread (its CUDA
provider's ``PerThreadContext``), so a slot knows the threads it was captured on: the first run
from another thread is a capture again (counted, and said: warm up on the thread that will
replay: :func:`staronnx.runtime.engine.warm_up` runs its shapes as tasks pinned to the worker,
on its driver's thread). A capture
runs one at a time (:data:`CAPTURE_LOCK`), and every thread of staronnx that calls CUDA runs in
thread-local capture mode, so nothing else in the process breaks a capture (see
:mod:`staronnx.workers.cudart`). A failed capture (900/901: another thread's CUDA call; an op
ORT cannot capture) fails its task and is retried once with a new id, then the slot runs
without a graph, with a warning naming the CUDA error, since a "graphs" figure must not
silently measure none (warm-up runs the shape again instead of failing);
:meth:`CudaWorker.graph_stats` counts captures, replays and failures.

Errors: a task that fails (bad feed, ORT error, a CUDA error that is not sticky such as out of
memory or 900/901) fails alone; a sticky CUDA error (the context is lost) raises
:class:`~staronnx.workers.base.WorkerLost`, and an engine then moves the worker's tasks to the
others.

:attr:`CudaWorker.last_compute_seconds`, what the perf models learn, is GPU time between
events on the stream: transfers are the bus model's, as in StarPU.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from staronnx.errors import DeviceError, ModelError
from staronnx.workers.base import Feeds, Outputs, ThreadWorker, WorkerLost
from staronnx.workers.cuda_env import (  # noqa: F401 - re-exported: their old home
    CUDA_EP,
    CUDA_OUT_OF_MEMORY,
    PartDoesNotFit,
    _out_of_memory,
    cuda_unavailable_reason,
    describe_gpus,
    visible_cuda_devices,
)
from staronnx.workers.cudart import (
    CAPTURE_THREAD_LOCAL,
    CudaError,
    CudaRuntime,
    GpuEvent,
    GpuRuntime,
    capture_safe,
    is_sticky,
    host_runtime_from_env,
)
from staronnx.workers.layout import WorkerPlace
from staronnx.workers.memory import CopyLog, CopyRecord, MemoryNode
from staronnx.workers.pinned_pool import PinnedArray, PinnedPool
from staronnx.workers.replicas import DeviceMemory, DeviceTensor, OutputRoute
from staronnx.workers.slots import (GRAPH_CAPTURE, GRAPH_REPLAY, NO_GRAPH, Part, Slot, SlotCache, SlotTensor,
                                    check_feeds, native_run, numpy_type)

__all__ = ["CAPTURE_LOCK", "CONV_ALGO_SEARCHES", "CudaOptions", "CudaWorker", "PartDoesNotFit", "cuda_unavailable_reason"]

log = logging.getLogger(__name__)

CONV_ALGO_SEARCHES = ("EXHAUSTIVE", "HEURISTIC", "DEFAULT")
#: Provider options the worker owns; letting callers override them would break the stream model.
_RESERVED_OPTIONS = {"device_id", "user_compute_stream", "has_user_compute_stream"}



#: one capture at a time in the process: a capture is rare (once per part and batch size at
#: warm-up) and ORT's global-mode capture is the one place two of ours could still collide
CAPTURE_LOCK = threading.Lock()
#: captures tried per slot before it runs without a graph
CAPTURE_TRIES = 2
#: the calling thread's id, as ORT's CUDA provider tells its per-thread contexts apart
_thread_id = threading.get_ident

@dataclass(eq=False, slots=True)
class _Launch:
    """A task whose copies and run are queued on the stream: what waiting for it needs."""

    slot: Slot
    timed: bool
    wait_event: GpuEvent | None = None  # None: wait for the whole stream
    outputs: Outputs | None = None  # set when it ran synchronously (the general path)
    #: the outputs written back (None: all of them) and those kept on the device
    written: list[SlotTensor] | None = None
    kept: list[tuple[str, DeviceTensor]] | None = None
    h2d_bytes: int = 0


@dataclass(frozen=True)
class CudaOptions:
    """How CUDA workers run their parts: one value, the same for every stream of a runtime,
    checked when made (a bad value fails before any worker starts).

    ``cudnn_conv_algo_search``: EXHAUSTIVE (ORT's default: best kernels, slow first run per
    shape), HEURISTIC or DEFAULT. ``provider_options`` adds CUDA provider options (e.g.
    ``gpu_mem_limit``); device and stream are the worker's own. ``copy_log`` receives a
    :class:`~staronnx.workers.memory.CopyRecord` per timed task and direction, with ``host_node``
    as the host end. ``max_slots`` bounds how many (part, batch size) buffer sets stay cached.
    ``cuda_graphs`` captures each (part, batch size) buffer set whose outputs are fixed as a
    CUDA graph and replays it; ``capture_on_demand=False`` keeps slots made after warm-up
    graph-less (a Runtime that warmed up its batch sizes never stalls its workers on a capture
    while serving). ``thread_per_stream`` gives each worker a thread of its own under an
    engine; by default one engine thread drives every stream of a device, as StarPU does.
    ``runtime`` replaces the CUDA runtime: a :class:`~staronnx.workers.cudart.HostRuntime` runs
    the same pipeline on the CPU provider with host memory (``STARONNX_CUDA_RUNTIME=host`` makes
    it the default, for the CLI)."""

    runtime: GpuRuntime | None = None
    cuda_graphs: bool = True
    capture_on_demand: bool = True
    thread_per_stream: bool = False
    cudnn_conv_algo_search: str = "EXHAUSTIVE"
    provider_options: Mapping[str, str] = field(default_factory=dict)
    max_slots: int = 64
    copy_log: CopyLog | None = None
    host_node: MemoryNode | str = "numa0"

    def __post_init__(self) -> None:
        if self.cudnn_conv_algo_search not in CONV_ALGO_SEARCHES:
            raise ValueError(f"cudnn_conv_algo_search must be one of {CONV_ALGO_SEARCHES}, "
                             f"got {self.cudnn_conv_algo_search!r}")
        extra = {str(k): str(v) for k, v in self.provider_options.items()}
        if _RESERVED_OPTIONS & extra.keys():
            raise ValueError(f"provider option(s) {sorted(_RESERVED_OPTIONS & extra.keys())} are "
                             "set by the worker itself (its device and its own stream)")
        if self.max_slots < 2:
            raise ValueError("max_slots must be >= 2 (a task launched ahead needs a second buffer set)")
        object.__setattr__(self, "provider_options", extra)
        object.__setattr__(self, "host_node", MemoryNode.parse(self.host_node))

    @classmethod
    def of(cls, given: CudaOptions | Mapping[str, Any] | None, *, cuda_graphs: bool,
           thread_per_stream: bool) -> CudaOptions:
        """Options from a Runtime's ``cuda_options`` mapping (or options already made), over the
        machine's ``cuda_graphs`` and ``thread_per_stream``; an unknown key is refused by name."""
        if isinstance(given, CudaOptions):
            return given
        values = {"cuda_graphs": cuda_graphs, "thread_per_stream": thread_per_stream, **dict(given or {})}
        unknown = sorted(values.keys() - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown CUDA worker option(s) {unknown}; known: {sorted(f.name for f in fields(cls))}")
        return cls(**values)


# ---------------------------------------------------------------------- the worker
class CudaWorker(ThreadWorker):
    """Runs the parts of a plan on one CUDA stream of one GPU.

    ``place`` is its slot in the machine's layout (:func:`~staronnx.workers.layout.cuda_place`:
    device, stream, name, and the PU its thread is pinned to, a core held back by ``reserve=N``
    in the CPU groups); ``options`` say how it runs (:class:`CudaOptions`). Without a
    ``runtime`` in them, a missing CUDA provider, cuda-bindings or device raises
    :class:`DeviceError` here. ``pinned_pool`` and ``device_memory`` are what a device's streams
    share (where batches are assembled, and the GPU as a memory node); by default the worker
    makes its own.
    """

    kind = "cuda"

    def __init__(self, place: WorkerPlace, part_paths: Sequence[str | os.PathLike[str] | None],
                 options: CudaOptions = CudaOptions(), *, pinned_pool: PinnedPool | None = None,
                 device_memory: DeviceMemory | None = None) -> None:
        device_id = place.device
        if device_id is None:
            raise ValueError(f"{place.name} is not a CUDA worker's place (it names no device)")
        runtime = options.runtime or host_runtime_from_env()
        if runtime is None:
            reason = cuda_unavailable_reason(device_id)
            if reason is not None:
                raise DeviceError(reason)
            runtime = CudaRuntime()
        super().__init__(part_paths, place.name)
        self.options = options
        self._runtime: GpuRuntime = runtime
        self.device_id = device_id
        self.arch = self.memory_node = f"cuda{device_id}"
        self.n_cores = 1
        self.stream_index = place.stream
        self.node = MemoryNode("cuda", device_id)
        self.cpu = place.pu
        #: the stream's cudaStream_t value (set by start()).
        self.stream_handle: int | None = None
        self._device_type = runtime.ort_device_type
        self._bind_device = device_id if self._device_type == "cuda" else 0
        self._slots = SlotCache(options.max_slots)
        self._parts: list[Part] = []
        self._stream: Any = None
        self._run_options: ort.RunOptions | None = None
        #: the sticky CUDA error that made this worker unusable (it then leaves the pool)
        self.lost: BaseException | None = None
        self.cuda_graphs = options.cuda_graphs
        self.capture_on_demand = options.capture_on_demand
        #: parts whose sessions were built with enable_cuda_graph
        self.graph_parts: set[int] = set()
        self._next_graph_id = 1
        #: slots whose graph ORT captured, captures that failed, runs that replayed a graph
        self.graphs_captured = 0
        self.graph_failures = 0
        self.graph_replays = 0
        #: where batches can be assembled so that this worker copies them without staging
        #: (shared by the workers start_workers makes; the worker that made it frees it)
        self.pinned_pool = pinned_pool or PinnedPool(self._allocate_pinned)
        self._owns_pool = pinned_pool is None
        #: the GPU as a memory node: where outputs other parts read stay (shared by a device's
        #: streams when start_workers makes them; the worker that made it frees it)
        self.device_memory = device_memory or DeviceMemory(runtime, device_id, self.pinned_pool)
        self._owns_memory = device_memory is None
        #: inputs copied to the device straight from pool memory (no staging copy)
        self.staging_skipped = 0
        #: workers with the same key are driven by one engine thread (StarPU's driver thread
        #: per device); None (``thread_per_stream``, StarPU's STARPU_CUDA_THREAD_PER_WORKER):
        #: this worker's own thread drives it
        self.driver_key: str | None = None if options.thread_per_stream else f"cuda{device_id}"

    # ------------------------------------------------------------------ lifecycle hooks
    def _start_failure(self, err: BaseException) -> Exception:
        return DeviceError(f"{self.name} could not start: {err}")

    def _describe(self) -> str:
        return f"device {self.device_id}"

    # ------------------------------------------------------------------ tasks
    def run_here(self, part: int, feeds: Feeds, timed: bool = True) -> Outputs:
        """Run a part from inside this worker's thread (see :meth:`spawn`): copies in, run,
        copies out, one wait; errors propagate (:class:`WorkerLost` once the context is lost).

        ``timed=False`` records no event (nothing to learn: the perf model is calibrated), so
        :attr:`last_compute_seconds` is then None."""
        self._check_own_thread()
        return self.finish_here(self.launch_here(part, feeds, timed))

    def launch_here(self, part_index: int, feeds: Feeds, timed: bool = True,
                    route: OutputRoute | None = None) -> _Launch:
        """Queue a part's copies and run on the stream and return without waiting (from the
        worker's thread): an engine launches the next task before it waits for this one, so
        the GPU does not idle while the host finishes a task. A task waits on the whole stream
        unless another is launched behind it, which then records an event for it first.

        A feed is a host array (copied up into the slot's buffer) or a
        :class:`~staronnx.workers.replicas.DeviceTensor` (on this GPU: a device-local copy
        into the slot's fixed buffer, no upload; on another: a peer copy). ``route`` says
        which outputs come back to the host (:meth:`finish_here`) and which stay on this GPU as
        tensors of :attr:`device_memory` (:meth:`device_outputs`; None: every output comes
        back)."""
        if self.lost is not None:
            raise self._unusable()
        try:
            behind = self._unmarked
            if behind is not None:  # this task queues behind one not yet waited for: mark its end
                self._unmarked = None
                behind.wait_event = behind.slot.events["done"]
                behind.wait_event.record(self._stream)
            part = self._parts[part_index]
            arrays: list[Any]
            try:
                arrays = [feeds[n] for n in part.inputs]
                key = (part_index, *[(a.dtype, a.shape) for a in arrays])
            except (KeyError, AttributeError, TypeError):
                arrays = check_feeds(part, part_index, feeds)
                key = (part_index, *[(a.dtype, a.shape) for a in arrays])
            if len(feeds) != part.n_inputs:
                check_feeds(part, part_index, feeds)  # unknown names: its message
            slot = self._slots.take(key)
            if slot is None:  # a new signature (checked once), or every slot of it is in use
                arrays = check_feeds(part, part_index, feeds)
                slot = self._make_slot(key, part_index, arrays)
        except BaseException as exc:
            raise self._lost_or(exc) from None
        try:
            if not slot.fixed:
                return self._launch_general(slot, arrays, timed, route)
            rt, stream = self._runtime, self._stream
            ev = slot.events
            up = self._copy_inputs(slot, arrays, timed)
            if timed:
                ev["run_start"].record(stream)
            graph = slot.graph
            if graph == GRAPH_CAPTURE or (graph == GRAPH_REPLAY and _thread_id() not in slot.graph_threads):
                self._capture(slot)  # a new graph id, or a thread ORT holds no graph of this slot on
            else:
                run, bound = slot.native
                run(bound, slot.run_options)
                self.graph_replays += graph == GRAPH_REPLAY
            if timed:
                ev["run_done"].record(stream)
            if route is None:
                out_copies, keeps, written = slot.out_copies, None, None
            else:
                out_copies, keeps, written = slot.routes.get(route) or slot.route_plan(route)
            for dst, src, nbytes in out_copies:
                rt.copy_d2h(dst, src, nbytes, stream)
            kept = None
            if keeps:
                keep = self.device_memory.keep
                kept = [(name, keep(src, dtype, shape, stream)) for name, src, dtype, shape in keeps]
            if timed:
                ev["d2h_done"].record(stream)
                return _Launch(slot, timed, ev["d2h_done"], None, written, kept, up)
            launch = _Launch(slot, timed, None, None, written, kept)
            self._unmarked = launch
            return launch
        except BaseException as exc:
            self._settle(exc)
            slot.busy = False  # idle again: SlotCache.take may hand it out
            raise self._lost_or(exc) from None

    def finish_here(self, launch: _Launch) -> Outputs:
        """Wait for a launched task and return its outputs written back to the host (from the
        worker's thread)."""
        slot = launch.slot
        try:
            if launch.outputs is not None:  # ran synchronously (the general path)
                outputs = launch.outputs
            else:
                if launch.wait_event is not None:
                    launch.wait_event.synchronize()
                else:
                    self._unmarked = None
                    self._stream.synchronize()
                assert slot.outputs is not None
                written = slot.outputs if launch.written is None else launch.written
                outputs = {t.name: t.view.copy() for t in written}
            if launch.timed:
                self._read_timings(slot, launch)
            else:
                self.last_compute_seconds = None
        except BaseException as exc:
            self._settle(exc)
            raise self._lost_or(exc) from None
        finally:
            slot.busy = False  # idle again: SlotCache.take may hand it out
        return outputs

    def device_outputs(self, launch: _Launch) -> Sequence[tuple[str, DeviceTensor]]:
        """The outputs of a finished task that its route kept on this GPU: (name, tensor)."""
        return launch.kept or ()

    def ready(self, launch: _Launch) -> bool:
        """Whether :meth:`finish_here` would return without blocking (the launch's work is
        done on the device): the engine wakes the callers of finished requests before a wait
        that blocks, so they run while this thread waits. False on any error (the wait will
        report it)."""
        if launch.outputs is not None:
            return True
        try:
            event = launch.wait_event
            return bool(event.query() if event is not None else self._stream.query())
        except Exception:  # noqa: BLE001 - finish_here raises it, with its context
            return False

    def adopt_thread(self) -> None:
        """Make the calling thread fit to launch this worker's tasks (an engine thread that
        drives every stream of a device): the worker's device current, and thread-local
        capture mode, so its calls never break another thread's graph capture."""
        self._runtime.thread_capture_mode(CAPTURE_THREAD_LOCAL)
        self._runtime.set_device(self.device_id)

    def _unusable(self) -> WorkerLost:
        return WorkerLost(f"{self.name} is unusable after a CUDA error: {self.lost}")

    def _lost_or(self, exc: BaseException) -> BaseException:
        """``exc``, or :class:`WorkerLost` when it (or what followed) lost the CUDA context."""
        if self.lost is not None and not isinstance(exc, WorkerLost):
            lost = self._unusable()
            lost.__cause__ = exc
            return lost
        return exc

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

    def graph_stats(self) -> dict[str, int]:
        """CUDA graphs of this worker: captured, failed captures, replays (what ``staronnx
        run`` reports, and what a benchmark's "graphs" column must check is not zero)."""
        return {"captured": self.graphs_captured, "failed": self.graph_failures,
                "replays": self.graph_replays}

    def _allocate_pinned(self, nbytes: int) -> Any:
        # any thread may ask (the serving batcher does): in thread-local capture mode, so the
        # allocation never breaks a graph another thread is capturing
        with capture_safe(self._runtime):
            return self._runtime.pinned(nbytes)

    # ------------------------------------------------------------------ worker thread
    def _setup_thread(self) -> None:
        if self.cpu is not None:
            self._pin(self.cpu)
        rt = self._runtime
        # before any CUDA call of this thread: another worker's capture must neither fail
        # our calls (900) nor be broken by them (901)
        rt.thread_capture_mode(CAPTURE_THREAD_LOCAL)
        rt.set_device(self.device_id)
        self._stream = rt.stream()
        self.stream_handle = self._stream.handle
        self._run_options = self._options(-1)
        for i, path in enumerate(self.part_paths):
            # a part this worker does not hold: no session, no device memory
            held = None if path is None else Part.of(self._load_with_graphs(i, path))
            self._parts.append(held)  # type: ignore[arg-type]

    @staticmethod
    def _options(graph_id: int) -> ort.RunOptions:
        """Run options of a task: ``gpu_graph_id`` always set (-1: no graph; ORT 1.31's Python
        wrapper raises and catches an exception on every run where the key is missing), no
        synchronisation at the end of the run (the worker waits once, after its copies), and
        no error printing (errors reach the caller as exceptions)."""
        options = ort.RunOptions()
        options.log_severity_level = 4
        options.add_run_config_entry("gpu_graph_id", str(graph_id))
        options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        return options

    def _load_with_graphs(self, index: int, path: Path) -> ort.InferenceSession:
        """The part's session, with CUDA graphs where asked and where ORT accepts them."""
        if not self.cuda_graphs:
            return self._load(index, path)
        try:
            session = self._load(index, path, graphs=True)
        except PartDoesNotFit:
            raise  # without graphs it would not fit either
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
            "cudnn_conv_algo_search": self.options.cudnn_conv_algo_search,
            "do_copy_in_default_stream": "0",
            **({"enable_cuda_graph": "1"} if graphs else {}),
            **self.options.provider_options,
        }
        return [(CUDA_EP, options), "CPUExecutionProvider"]

    def _load(self, index: int, path: Path, graphs: bool = False) -> ort.InferenceSession:
        try:
            self._runtime.loading(index)
        except CudaError as exc:
            if exc.code == CUDA_OUT_OF_MEMORY:
                raise PartDoesNotFit(self.name, index, path, str(exc)) from None
            raise
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
            if self._device_type == "cuda" and _out_of_memory(text):
                raise PartDoesNotFit(self.name, index, path, text) from None
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

    def _copy_in(self, dst: int, a: DeviceTensor, nbytes: int) -> None:
        """An input already in GPU memory into the slot's buffer (see :meth:`launch_here`), after
        the event of the copy that filled it, if that is still pending on another stream."""
        stream = self._stream
        if a.ready is not None:
            stream.wait(a.ready)
        if a.device == self.device_id:
            self._runtime.copy_d2d(dst, a.ptr, nbytes, stream)
        else:
            self._runtime.copy_peer(dst, self.device_id, a.ptr, a.device, nbytes, stream)

    def _read_timings(self, slot: Slot, launch: _Launch) -> None:
        """GPU times of the task just waited for (its events are complete), and its copies
        into the copy log (the bus model's samples: only what crossed the bus)."""
        ev = slot.events
        self.last_compute_seconds = ev["run_done"].seconds_since(ev["run_start"])
        h2d = ev["run_start"].seconds_since(ev["h2d_start"])
        d2h = ev["d2h_done"].seconds_since(ev["run_done"])
        log_to = self.options.copy_log
        if log_to is not None:
            host, dev = MemoryNode.parse(self.options.host_node).name, self.node.name
            up = slot.in_bytes if launch.outputs is not None else launch.h2d_bytes
            down = slot.out_bytes if launch.written is None else sum(t.nbytes for t in launch.written)
            if up:
                log_to.add(CopyRecord(host, dev, up, h2d))
            if down:
                log_to.add(CopyRecord(dev, host, down, d2h))

    #: the last untimed launch not yet waited for and with nothing queued behind it
    _unmarked: _Launch | None = None

    def _capture(self, slot: Slot) -> None:
        """ORT's first run of the slot's graph id: its regular run, the capture (a stream
        sync, then ``cudaStreamBeginCapture`` in global mode) and a replay all happen inside
        this one call, so the whole call is the capture: one at a time, and a failure handled
        here (see the module docstring)."""
        run, bound = slot.native
        if slot.graph_threads:
            log.warning("%s: the CUDA graph of part %d (inputs %s) is captured again, on thread "
                        "%s: ORT keeps graphs per thread, and this one was captured on another "
                        "(warm up on the thread that replays)", self.name, slot.part,
                        slot.key[1:], threading.current_thread().name)
        try:
            with CAPTURE_LOCK:
                run(bound, slot.run_options)
        except BaseException as exc:
            if is_sticky(exc) or isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            self.graph_failures += 1
            slot.capture_tries += 1
            again = slot.capture_tries < CAPTURE_TRIES
            then = (f": {exc}; it will be captured again" if again
                    else f" {slot.capture_tries} times (last: {exc}); this shape runs without a graph")
            log.warning("%s: CUDA graph capture of part %d (inputs %s) failed%s", self.name, slot.part, slot.key[1:],
                        then)
            if again:
                self._give_graph(slot)
            else:
                self._drop_graph(slot)
            raise
        slot.graph = GRAPH_REPLAY
        slot.graph_threads.add(_thread_id())
        self.graphs_captured += 1

    def _give_graph(self, slot: Slot) -> None:
        """After output discovery: a graph id for a slot whose every buffer is fixed; its next
        run is the capture."""
        slot.graph_id = self._next_graph_id
        self._next_graph_id += 1
        slot.run_options = self._options(slot.graph_id)
        session = self._parts[slot.part].session
        slot.native = (self._runtime.graph_run(session, slot.plain_run, slot.graph_id), slot.native[1])
        slot.graph, slot.graph_threads = GRAPH_CAPTURE, set()

    def _drop_graph(self, slot: Slot) -> None:
        """The slot runs without a graph from now on."""
        slot.graph, slot.graph_id, slot.run_options = NO_GRAPH, None, self._run_options
        slot.native, slot.graph_threads = (slot.plain_run, slot.native[1]), set()

    def _make_slot(self, key: tuple[Any, ...], part_index: int, arrays: list[np.ndarray]) -> Slot:
        """A new buffer set (the cold path: allocations, and the frees of retired slots)."""
        self._slots.free_retired()
        part = self._parts[part_index]
        rt = self._runtime
        inputs: list[SlotTensor] = []
        events: dict[str, GpuEvent] = {}
        try:
            binding = part.session.io_binding()
            for name, a in zip(part.inputs, arrays):
                t = SlotTensor(name, a.dtype, tuple(a.shape))
                inputs.append(t)
                t.pinned = rt.pinned(t.nbytes)  # (set before the next allocation, which may fail)
                t.view = t.pinned.view(t.dtype, t.shape)
                t.device = rt.device_buffer(t.nbytes)
                binding.bind_input(name, self._device_type, self._bind_device, a.dtype.type,
                                   list(t.shape), t.device.ptr)
            for ev in ("h2d_start", "run_start", "run_done", "d2h_done"):
                events[ev] = rt.event(timing=True)
            events["done"] = rt.event(timing=False)
        except BaseException:
            for t in inputs:
                t.free()
            for e in events.values():
                e.destroy()
            raise
        native = native_run(part.session, binding)
        slot = Slot(key, part_index, binding, inputs, events, self._run_options, native, native[0])
        slot.in_copies = [(t, t.device.ptr, t.nbytes) for t in inputs]
        slot.in_bytes = sum(t.nbytes for t in inputs)
        self._slots.add(slot)
        return slot

    def _copy_inputs(self, slot: Slot, arrays: list[Any], timed: bool) -> int:
        """Enqueue a slot's input copies on the stream (a device tensor's from its GPU, a host
        array's from pinned memory), after the ``h2d_start`` event when timed; returns the
        bytes uploaded from the host (what the bus model learns from)."""
        stream = self._stream
        if timed:
            slot.events["h2d_start"].record(stream)
        up = 0
        for (t, dst, nbytes), a in zip(slot.in_copies, arrays):
            # from the array itself where it was assembled in pinned memory (a pool batch: no
            # staging pass), else through the slot's pinned buffer, filled here
            if isinstance(a, PinnedArray) and a.pinned_ptr is not None:
                src = a.pinned_ptr
                self.staging_skipped += 1
            elif isinstance(a, DeviceTensor):
                self._copy_in(dst, a, nbytes)
                continue
            else:
                np.copyto(t.view, a)
                src = t.pinned.ptr
            self._runtime.copy_h2d(dst, src, nbytes, stream)
            up += nbytes
        return up

    def _launch_general(self, slot: Slot, arrays: list[Any], timed: bool, route: OutputRoute | None) -> _Launch:
        """Output discovery (a slot's first run) and slots with ORT-allocated outputs
        (data-dependent shapes): synchronous, outputs read back here (or kept on the device,
        as ``route`` says)."""
        part = self._parts[slot.part]
        rt, stream = self._runtime, self._stream
        ev = slot.events
        binding = slot.binding
        self._copy_inputs(slot, arrays, timed)
        discovering = slot.outputs is None
        for i, name in enumerate(part.outputs):
            if discovering or not slot.bound[i]:
                # Rebind every run: a filled OrtValue would otherwise be reused as a
                # pre-allocated output, which fails when the shape changes.
                binding.bind_output(name, self._device_type, self._bind_device)
        if timed:
            ev["run_start"].record(stream)
        try:
            part.session.run_with_iobinding(binding, self._run_options)
        except Exception as exc:  # an ORT error: maybe our pre-allocated outputs
            if discovering or not any(slot.bound) or isinstance(exc, CudaError) or is_sticky(exc):
                raise
            log.warning("%s: part %d failed with pre-allocated outputs (%s); retrying with "
                        "ORT-allocated outputs for this shape", self.name, slot.part, exc)
            self._settle(exc)  # the slot stays this task's: it runs again below
            self._unbind_outputs(slot)
            return self._launch_general(slot, arrays, timed, route)
        if timed:
            ev["run_done"].record(stream)
        # ORT-allocated outputs: read their shapes and addresses now; the kernels filling them
        # may still be running (the copies below are ordered after them on the stream).
        produced: list[Any] = binding.get_outputs()
        if discovering:
            slot.outputs = [SlotTensor(n, numpy_type(v, n), tuple(v.shape()))
                            for n, v in zip(part.outputs, produced)]
            slot.bound = [False] * len(part.outputs)
        assert slot.outputs is not None
        sources = []
        for i, t in enumerate(slot.outputs):
            if slot.bound[i]:
                sources.append(t.device.ptr)
                continue
            v = produced[i]
            t.dtype, t.shape = numpy_type(v, t.name), tuple(v.shape())
            sources.append(v.data_ptr())
            if t.pinned is None or t.pinned.nbytes < t.nbytes:
                old = t.pinned
                t.pinned = rt.pinned(max(t.nbytes, int(old.nbytes * 1.5) if old is not None else 0))
                if old is not None:
                    old.free()
        written = slot.outputs if route is None else [t for t in slot.outputs if t.name in route.host]
        for t, src in zip(slot.outputs, sources):
            if route is None or t.name in route.host:
                rt.copy_d2h(t.pinned.ptr, src, t.nbytes, stream)
        kept = None if route is None else [
            (t.name, self.device_memory.keep(src, t.dtype, t.shape, stream))
            for t, src in zip(slot.outputs, sources) if t.name in route.device]
        if timed:
            ev["d2h_done"].record(stream)
        stream.synchronize()
        del produced  # ORT's own output buffers may go back to its arena now
        outputs = {t.name: np.array(t.pinned.view(t.dtype, t.shape), copy=True) for t in written}
        if discovering:
            self._bind_static_outputs(slot, part)
        return _Launch(slot, timed, None, outputs, written, kept)

    def _bind_static_outputs(self, slot: Slot, part: Part) -> None:
        """After the first run: give shape-determined outputs device and pinned buffers of
        their own; a slot whose outputs are all ours takes the fast path (and maybe a graph)."""
        assert slot.outputs is not None
        rt = self._runtime
        for i, t in enumerate(slot.outputs):
            if not part.static_outputs[i]:
                continue
            t.device = rt.device_buffer(t.nbytes)
            t.view = t.pinned.view(t.dtype, t.shape)  # (discovery gave every output a pinned buffer that fits)
            slot.binding.bind_output(t.name, self._device_type, self._bind_device, t.dtype.type,
                                     list(t.shape), t.device.ptr)
            slot.bound[i] = True
        if slot.bound and all(slot.bound):
            slot.fixed = True
            slot.routes.clear()
            slot.out_copies = [(t.pinned.ptr, t.device.ptr, t.nbytes) for t in slot.outputs]
            slot.out_bytes = sum(t.nbytes for t in slot.outputs)
            if self.cuda_graphs and self.capture_on_demand and slot.part in self.graph_parts:
                self._give_graph(slot)

    def _unbind_outputs(self, slot: Slot) -> None:
        """Fall back to ORT-allocated outputs for this slot (its shapes were not static)."""
        slot.fixed = False
        slot.routes.clear()
        self._drop_graph(slot)
        for i, t in enumerate(slot.outputs or []):
            if slot.bound[i]:
                slot.bound[i] = False
                if t.device is not None:
                    t.device.free()
                    t.device = None

    def _settle(self, exc: BaseException) -> None:
        """After a failure: wait until no queued GPU work uses the task's buffers (before the
        slot is reused, unbound or freed); a sticky error, in ``exc`` or met while waiting,
        marks the worker lost."""
        if is_sticky(exc):
            self.lost = exc
        try:
            self._stream.synchronize()
        except BaseException as err:  # noqa: BLE001
            if is_sticky(err) and self.lost is None:
                self.lost = err

    def _try(self, what: str, step: Callable[[], Any] | None) -> None:
        """``step()`` (None: nothing to do), a failure logged: keep freeing what we can."""
        if step is None:
            return
        try:
            step()
        except Exception as exc:  # noqa: BLE001
            log.warning("%s: %s failed: %s", self.name, what, exc)

    def _teardown(self) -> None:
        """Free everything, in an order that never leaves ORT holding a destroyed stream; a step
        that fails is logged and the next ones still run."""
        stream = self._stream
        self._try("synchronising the stream at close", None if stream is None else stream.synchronize)
        self._try("freeing buffers at close", self._slots.close)  # drops the IOBindings (they hold the sessions)
        self._try("freeing device memory at close", self.device_memory.close if self._owns_memory else None)
        if self._owns_pool:
            self.pinned_pool.close()
        refs = [weakref.ref(p.session) for p in self._parts if p is not None]
        self._parts.clear()
        if any(r() is not None for r in refs):
            gc.collect()
        if stream is None:
            return
        self._stream = None
        if any(r() is not None for r in refs):
            # Something outside still holds a session bound to this stream: leaking the stream is
            # harmless, destroying it under ORT is not.
            log.warning("%s: a session outlives the worker; its stream is not destroyed", self.name)
        else:
            self._try("destroying the stream", stream.destroy)
