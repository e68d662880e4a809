"""A thin, checked wrapper over the CUDA runtime of NVIDIA's ``cuda-bindings`` (cuda-python).

ONNX Runtime's Python API cannot create streams, events or pinned host memory (1.31 has no
"cuda_pinned" OrtValue device), so the CUDA worker and the memory nodes get them from
``cuda.bindings.runtime`` (cuda-bindings; the old ``cuda.cudart`` is gone in 13.x).  That API returns C-style
``(error, value...)`` tuples; this module turns them into objects that raise
:class:`CudaError` (a :class:`~staronnx.errors.DeviceError`) naming the call that failed, and
that free what they own exactly once.

Everything that allocates goes through :class:`CudaRuntime`, whose :class:`AllocationStats`
count allocations and frees: that is how tests check that buffers are reused across calls and
all released on close.  A different ``CudaRuntime`` (same methods, host memory behind them) can
drive the CUDA worker's pipeline on a machine without a GPU.

Streams and events belong to the device that was current (``set_device``) in the calling thread
when they were created; the CUDA runtime keeps the current device per thread, so every thread
that issues work calls :meth:`CudaRuntime.set_device` first.

CUDA graph capture: ONNX Runtime captures in CUDA's *global* mode, in which any other thread
still in the default (global) mode that allocates, frees or synchronises meanwhile gets error
900 and invalidates the capture (901). Every thread of staronnx that touches CUDA therefore runs
in thread-local capture mode (:meth:`CudaRuntime.thread_capture_mode`, or :func:`capture_safe`
around code that is not ours, such as a plain ORT session), so captures and everything else
never collide; no lock is needed around ordinary tasks.  :class:`HostRuntime` emulates those
rules (and sticky errors, and call counts) so the worker's handling of them is tested anywhere.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import itertools
import math
import os
import re
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from staronnx.errors import DeviceError

__all__ = ["AllocationStats", "Buffer", "CudaError", "CudaRuntime", "DeviceBuffer", "Event", "GpuEvent", "GpuStream",
           "HostBuffer", "HostRuntime", "INSTALL_HINT", "PinnedBuffer", "GpuRuntime", "Stream", "STICKY_ERRORS", "capture_safe",
           "check", "is_sticky", "runtime_module"]

INSTALL_HINT = "pip install 'staronnx[gpu]'"

#: CUDA errors after which the context is unusable (every later call fails): the worker that
#: met one must leave the pool.  Out of memory (2), capture errors (900, 901) and invalid
#: arguments are not sticky: they fail one task only.
STICKY_ERRORS = frozenset({
    214,  # cudaErrorECCUncorrectable
    700,  # cudaErrorIllegalAddress
    702,  # cudaErrorLaunchTimeout
    709,  # cudaErrorContextIsDestroyed
    710,  # cudaErrorAssert
    *range(714, 719),  # hardware stack error, illegal instruction, misaligned address, ...
    719,  # cudaErrorLaunchFailure
    999,  # cudaErrorUnknown
})

#: cudaStreamCaptureMode values (the same in every CUDA version)
CAPTURE_GLOBAL, CAPTURE_THREAD_LOCAL = 0, 1
#: error codes of the capture rules
CAPTURE_UNSUPPORTED, CAPTURE_INVALIDATED = 900, 901

def runtime_module() -> ModuleType:
    """The cuda-bindings runtime module (imported once: Python keeps it); :class:`DeviceError` if absent."""
    try:
        return importlib.import_module("cuda.bindings.runtime")
    except ImportError as exc:
        raise DeviceError(
            "NVIDIA's cuda-bindings is not installed (needed for CUDA streams, events and "
            f"pinned memory; cuda.bindings.runtime: {exc}). Install it with: {INSTALL_HINT}"
        ) from None


class CudaError(DeviceError):
    """A CUDA runtime call returned an error code."""

    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        self.call = call
        self.code = code
        self.name = name
        super().__init__(f"{call} failed: {name} ({code}): {text}")

    @property
    def sticky(self) -> bool:
        """Whether the CUDA context is lost (see :data:`STICKY_ERRORS`)."""
        return self.code in STICKY_ERRORS


def is_sticky(exc: BaseException) -> bool:
    """Whether ``exc`` (ours, or ONNX Runtime's "CUDA failure N" text) means a lost context."""
    if isinstance(exc, CudaError):
        return exc.sticky
    text = str(exc)
    if any(int(code) in STICKY_ERRORS for code in re.findall(r"CUDA (?:failure|error) (\d{1,4})", text)):
        return True
    return "illegal memory access" in text or "unspecified launch failure" in text

def _describe(rt: ModuleType, err: Any) -> tuple[str, str]:
    try:
        name = rt.cudaGetErrorName(err)[1]
        text = rt.cudaGetErrorString(err)[1]
        return (name.decode() if isinstance(name, bytes) else str(name),
                text.decode() if isinstance(text, bytes) else str(text))
    except Exception:  # noqa: BLE001 - describing an error must not raise another
        return str(err), "unknown CUDA error"


def check(result: Any, call: str) -> Any:
    """Unwrap a cuda-python ``(error, values...)`` result; raise :class:`CudaError` on error.

    Returns ``None`` for no value, the value itself for one, a tuple for several.
    """
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name, text = _describe(runtime_module(), err)
        raise CudaError(call, int(err), name, text)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


@dataclass
class AllocationStats:
    """Counts of pinned-host and device allocations made through one :class:`CudaRuntime`."""

    pinned_allocs: int = 0
    pinned_frees: int = 0
    pinned_bytes: int = 0  # currently allocated
    device_allocs: int = 0
    device_frees: int = 0
    device_bytes: int = 0  # currently allocated
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, kind: str, nbytes: int, freed: bool = False) -> None:
        """One allocation of ``nbytes`` of ``kind`` memory (``pinned`` or ``device``), or its free."""
        with self._lock:
            if kind == "pinned":
                self.pinned_allocs += not freed
                self.pinned_frees += freed
                self.pinned_bytes += -nbytes if freed else nbytes
            else:
                self.device_allocs += not freed
                self.device_frees += freed
                self.device_bytes += -nbytes if freed else nbytes

    @property
    def live(self) -> int:
        """Buffers allocated and not yet freed."""
        return (self.pinned_allocs - self.pinned_frees) + (self.device_allocs - self.device_frees)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {name: count for name, count in vars(self).items() if name != "_lock"}


def _done(rt: ModuleType, result: Any, call: str) -> bool:
    """A query's answer: True (done), False (``cudaErrorNotReady``: still running), or the
    call's error raised."""
    err = result[0] if isinstance(result, tuple) else result
    if int(err) == int(rt.cudaError_t.cudaErrorNotReady):
        return False
    check(result, call)
    return True


class GpuStream(Protocol):
    """A stream as the worker and the copiers use it (:class:`Stream`, or HostRuntime's
    stand-in): ``raw`` is the runtime's own object, ``handle`` its address for ORT."""

    raw: object
    handle: int

    def wait(self, event: GpuEvent) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...
    def destroy(self) -> None: ...


class GpuEvent(Protocol):
    """An event as the worker and the copiers use it (:class:`Event`, or HostRuntime's
    stand-in)."""

    raw: object

    def record(self, stream: GpuStream) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...
    def seconds_since(self, start: GpuEvent) -> float: ...
    def destroy(self) -> None: ...


class Stream:
    """A non-blocking CUDA stream: it never serialises with the legacy stream 0."""

    def __init__(self, rt: ModuleType) -> None:
        self._rt = rt
        #: the cuda-python ``cudaStream_t`` object, for calls this wrapper does not cover
        self.raw: Any = check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
        self.handle: int = int(self.raw)  # the cudaStream_t value, what ORT expects
        self._alive = True

    def wait(self, event: GpuEvent) -> None:
        """Make work queued on this stream after now wait for ``event`` (no host blocking)."""
        check(self._rt.cudaStreamWaitEvent(self.raw, event.raw, 0), "cudaStreamWaitEvent")

    def synchronize(self) -> None:
        check(self._rt.cudaStreamSynchronize(self.raw), "cudaStreamSynchronize")

    def query(self) -> bool:
        """True when all work queued on the stream is done, False while some is pending."""
        return _done(self._rt, self._rt.cudaStreamQuery(self.raw), "cudaStreamQuery")

    def destroy(self) -> None:
        if self._alive:
            self._alive = False
            check(self._rt.cudaStreamDestroy(self.raw), "cudaStreamDestroy")

    def __repr__(self) -> str:
        return f"Stream(0x{self.handle:x})"


class Event:
    """A CUDA event; ``timing=True`` allows :meth:`seconds_since` (slightly costlier waits)."""

    def __init__(self, rt: ModuleType, timing: bool = True) -> None:
        self._rt = rt
        flags = rt.cudaEventDefault if timing else rt.cudaEventDisableTiming
        self.raw: Any = check(rt.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags")
        self._alive = True

    def record(self, stream: GpuStream) -> None:
        check(self._rt.cudaEventRecord(self.raw, stream.raw), "cudaEventRecord")

    def synchronize(self) -> None:
        """Block the calling thread (without the GIL) until the recorded work is done."""
        check(self._rt.cudaEventSynchronize(self.raw), "cudaEventSynchronize")

    def query(self) -> bool:
        """True when the recorded work is done, False while it is pending."""
        return _done(self._rt, self._rt.cudaEventQuery(self.raw), "cudaEventQuery")

    def seconds_since(self, start: GpuEvent) -> float:
        """GPU time between ``start`` and this event (both recorded, completed, timing)."""
        ms = check(self._rt.cudaEventElapsedTime(start.raw, self.raw), "cudaEventElapsedTime")
        return float(ms) / 1000.0

    def destroy(self) -> None:
        if self._alive:
            self._alive = False
            check(self._rt.cudaEventDestroy(self.raw), "cudaEventDestroy")


class _Buffer:
    kind = ""

    def __init__(self, ptr: int, nbytes: int, stats: AllocationStats | None) -> None:
        self.ptr = int(ptr)
        self.nbytes = nbytes
        self._stats = stats
        self._alive = True
        if stats is not None:
            stats.count(self.kind, nbytes)

    def view(self, dtype: np.dtype | type, shape: tuple[int, ...]) -> np.ndarray:
        """A writable numpy view of the first ``prod(shape)`` elements (no copy).

        The view must not outlive the buffer: copy what you hand out.
        """
        dt = np.dtype(dtype)
        count = math.prod(shape)
        nbytes = count * dt.itemsize
        if nbytes > self.nbytes:
            raise ValueError(f"a {shape} {dt} view needs {nbytes} B, the buffer holds {self.nbytes} B")
        if nbytes == 0:
            return np.empty(shape, dtype=dt)
        raw = (ctypes.c_ubyte * nbytes).from_address(self.ptr)
        return np.frombuffer(raw, dtype=dt, count=count).reshape(shape)

    def _release(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def free(self) -> None:
        """Free the memory (idempotent); views made by :meth:`view` become invalid."""
        if self._alive:
            self._alive = False
            try:
                self._release()
            finally:
                if self._stats is not None:
                    self._stats.count(self.kind, self.nbytes, freed=True)

    def __repr__(self) -> str:
        state = "" if self._alive else ", freed"
        return f"{type(self).__name__}(0x{self.ptr:x}, {self.nbytes} B{state})"


class PinnedBuffer(_Buffer):
    """Page-locked host memory (``cudaHostAlloc``, portable): async copies need it.

    Pageable memory makes ``cudaMemcpyAsync`` synchronous (the driver stages it itself), which
    is StarPU's "unpinned buffers break asynchronous copies" pitfall.
    """

    kind = "pinned"

    def __init__(self, rt: ModuleType, nbytes: int, stats: AllocationStats | None = None) -> None:
        self._rt = rt
        # Portable: pinned for every CUDA context, so one buffer can feed several GPUs.
        ptr = check(rt.cudaHostAlloc(max(nbytes, 1), rt.cudaHostAllocPortable), "cudaHostAlloc")
        super().__init__(ptr, nbytes, stats)

    def _release(self) -> None:
        check(self._rt.cudaFreeHost(self.ptr), "cudaFreeHost")


class DeviceBuffer(_Buffer):
    """Device memory from ``cudaMalloc`` on the thread's current device."""

    kind = "device"

    def __init__(self, rt: ModuleType, nbytes: int, stats: AllocationStats | None = None) -> None:
        self._rt = rt
        # Never 0 bytes: a NULL pointer for an empty tensor would look like "no buffer" to ORT.
        ptr = check(rt.cudaMalloc(max(nbytes, 1)), "cudaMalloc")
        super().__init__(ptr, nbytes, stats)

    def view(self, dtype: np.dtype | type, shape: tuple[int, ...]) -> np.ndarray:
        raise TypeError("device memory has no host view; copy it to a pinned buffer first")

    def _release(self) -> None:
        check(self._rt.cudaFree(self.ptr), "cudaFree")


class Buffer(Protocol):
    """Pinned, device or stand-in memory: an address, a size, and a way to free it."""

    ptr: int
    nbytes: int

    def view(self, dtype: np.dtype | type, shape: tuple[int, ...]) -> np.ndarray: ...
    def free(self) -> None: ...


#: ``run(bound, run_options)``: a session's ``run_with_iobinding`` (or ORT's native one)
SessionRun = Callable[[Any, Any], None]


class GpuRuntime(Protocol):
    """What the CUDA worker and the copiers need from a runtime (:class:`CudaRuntime`, or
    :class:`HostRuntime` without a GPU): its streams (:class:`GpuStream`), events
    (:class:`GpuEvent`) and buffers (``ptr/nbytes/view/free``)."""

    ort_device_type: str
    stats: AllocationStats

    def device_count(self) -> int: ...
    def properties(self, device_id: int) -> dict[str, Any]: ...
    def set_device(self, device_id: int) -> None: ...
    def get_device(self) -> int: ...
    def stream(self) -> GpuStream: ...
    def event(self, timing: bool = True) -> GpuEvent: ...
    def pinned(self, nbytes: int) -> Buffer: ...
    def device_buffer(self, nbytes: int) -> Buffer: ...
    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: GpuStream) -> None: ...
    def copy_d2h(self, dst: int, src: int, nbytes: int, stream: GpuStream) -> None: ...
    def copy_d2d(self, dst: int, src: int, nbytes: int, stream: GpuStream) -> None: ...
    def copy_peer(self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int,
                  stream: GpuStream) -> None: ...
    def thread_capture_mode(self, mode: int) -> int: ...
    def graph_run(self, session: Any, run: SessionRun, graph_id: int) -> SessionRun: ...
    def loading(self, part: int) -> None: ...


def gpu_uuid(raw: Any) -> str:
    """A GPU's UUID as NVML and ``nvidia-smi -L`` spell it (``GPU-`` then 8-4-4-4-12 hex digits),
    from CUDA's 16 bytes (``cudaUUID_t``): what names one GPU whatever ``CUDA_VISIBLE_DEVICES``
    renumbers (Triton's metrics label GPUs with it)."""
    # cuda-bindings' cudaUUID_t holds its 16 bytes in .bytes; plain bytes are taken as they are
    h = bytes(raw if isinstance(raw, (bytes, bytearray)) else raw.bytes)[:16].hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class CudaRuntime:
    """Factory for streams, events and buffers, plus the copies the workers issue.

    One instance can serve several threads and devices; each thread must call
    :meth:`set_device` before creating or using anything.  ``ort_device_type`` is the
    IOBinding device string that matches the memory this runtime hands out.
    """

    ort_device_type = "cuda"

    def __init__(self) -> None:
        self.rt = runtime_module()
        self.stats = AllocationStats()
        self._kinds = self.rt.cudaMemcpyKind

    # -- devices
    def device_count(self) -> int:
        return int(check(self.rt.cudaGetDeviceCount(), "cudaGetDeviceCount"))

    def properties(self, device_id: int) -> dict[str, Any]:
        """What a result must say of the GPU it ran on (its model, memory, compute capability,
        SM count, PCI bus): a sweep or a benchmark compares like with like only on the same GPU."""
        prop = check(self.rt.cudaGetDeviceProperties(device_id), f"cudaGetDeviceProperties({device_id})")
        name = prop.name
        return {"device": device_id,
                "name": (name.split(b"\0", 1)[0].decode(errors="replace") if isinstance(name, bytes) else str(name)),
                "memory_bytes": int(prop.totalGlobalMem), "capability": f"{prop.major}.{prop.minor}",
                "sms": int(prop.multiProcessorCount), "pci_bus": int(prop.pciBusID), "uuid": gpu_uuid(prop.uuid)}

    def loading(self, part: int) -> None:
        """A worker is about to load ``part``'s session: nothing to do on a GPU, where ONNX
        Runtime's own allocation reports a lack of memory (:class:`HostRuntime` counts the
        call, and a test can make it fail as that would)."""

    def set_device(self, device_id: int) -> None:
        check(self.rt.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")

    def get_device(self) -> int:
        """The calling thread's current device."""
        return int(check(self.rt.cudaGetDevice(), "cudaGetDevice"))

    # -- objects
    def stream(self) -> Stream:
        return Stream(self.rt)

    def event(self, timing: bool = True) -> Event:
        return Event(self.rt, timing)

    def pinned(self, nbytes: int) -> PinnedBuffer:
        return PinnedBuffer(self.rt, nbytes, self.stats)

    def device_buffer(self, nbytes: int) -> DeviceBuffer:
        return DeviceBuffer(self.rt, nbytes, self.stats)

    # -- copies (asynchronous: order them with events, wait with Event/Stream.synchronize)
    def _memcpy(self, dst: int, src: int, nbytes: int, kind: object, stream: GpuStream, what: str) -> None:
        if nbytes:
            check(self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream.raw),
                  f"cudaMemcpyAsync({what})")

    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: GpuStream) -> None:
        self._memcpy(dst, src, nbytes, self._kinds.cudaMemcpyHostToDevice, stream, "host->device")

    def copy_d2h(self, dst: int, src: int, nbytes: int, stream: GpuStream) -> None:
        self._memcpy(dst, src, nbytes, self._kinds.cudaMemcpyDeviceToHost, stream, "device->host")

    def copy_d2d(self, dst: int, src: int, nbytes: int, stream: GpuStream) -> None:
        """Within one GPU's memory (a handle's copy into a graph slot's fixed buffer)."""
        self._memcpy(dst, src, nbytes, self._kinds.cudaMemcpyDeviceToDevice, stream, "device->device")

    def copy_peer(self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int,
                  stream: GpuStream) -> None:
        """Between two GPUs; the driver stages through the host when peer access is off."""
        if nbytes:
            check(self.rt.cudaMemcpyPeerAsync(dst, dst_device, src, src_device, nbytes, stream.raw),
                  "cudaMemcpyPeerAsync")

    # -- graph capture
    def thread_capture_mode(self, mode: int) -> int:
        """Set the calling thread's stream-capture mode; returns the previous one."""
        enum = self.rt.cudaStreamCaptureMode
        prev = check(self.rt.cudaThreadExchangeStreamCaptureMode(enum(mode)),
                     "cudaThreadExchangeStreamCaptureMode")
        return int(prev)

    def graph_run(self, session: Any, run: SessionRun, graph_id: int) -> SessionRun:
        """How a slot runs ``session`` (``run(bound, run_options)``) with CUDA graph
        ``graph_id``: ``run`` itself, for ONNX Runtime's CUDA provider captures and replays
        inside it (:class:`HostRuntime` wraps it in what that provider does)."""
        return run


@contextmanager
def capture_safe(runtime: GpuRuntime | None = None) -> Iterator[None]:
    """Run the block in thread-local capture mode, so its CUDA calls (a plain ORT session's
    creation, allocations, frees) neither fail with 900 nor break a graph that another thread
    is capturing. A no-op where cuda-bindings is absent (no CUDA call can happen then)."""
    if runtime is None:
        from staronnx.ortutil import cuda_capture_safe

        with cuda_capture_safe():
            yield
        return
    prev = runtime.thread_capture_mode(CAPTURE_THREAD_LOCAL)
    try:
        yield
    finally:
        runtime.thread_capture_mode(prev)


# ---------------------------------------------------------------------------- host stand-in
class _PerThread(threading.local):
    """CUDA's per-thread state, at CUDA's defaults in a thread that set none."""

    device = 0
    mode = CAPTURE_GLOBAL
    #: the thread's native id, once HostRuntime needed it (read per upload: no call then)
    native_id: int | None = None


class _Capture:
    """CUDA's process-wide view of stream captures, as :class:`HostRuntime` emulates it."""

    lock = threading.Lock()
    #: thread id -> "invalidated" flag of the global-mode capture that thread runs
    active: dict[int, bool] = {}
    modes = _PerThread()

    @classmethod
    def check_unsafe(cls, call: str) -> None:
        """CUDA's rule: a thread in global mode may not make a potentially unsafe call (allocate,
        free, create or destroy streams and events, synchronise the device) while another
        thread captures in global mode; the call fails with 900 and invalidates that capture."""
        if cls.modes.mode != CAPTURE_GLOBAL or not cls.active:
            return
        me = threading.get_ident()
        with cls.lock:
            others = [t for t in cls.active if t != me]
            for t in others:
                cls.active[t] = True
        if others:
            raise CudaError(call, CAPTURE_UNSUPPORTED, "cudaErrorStreamCaptureUnsupported",
                            "operation not permitted when stream is capturing")


class _HostStream:
    """Stands in for a stream: host copies complete in program order, so nothing to wait."""

    _next = 0x1000
    raw: object = None

    def __init__(self, rt: HostRuntime) -> None:
        _HostStream._next += 0x10
        self.handle = _HostStream._next
        self._rt = rt

    def wait(self, event: GpuEvent) -> None:
        self._rt._call("stream_wait")

    def synchronize(self) -> None:
        self._rt._call("stream_sync")

    def query(self) -> bool:
        self._rt._call("stream_query")
        return True  # host copies and runs are synchronous: queued work is already done

    def destroy(self) -> None:
        self._rt._call("stream_destroy", unsafe=True)


class _HostEvent:
    """Stands in for an event: records the host clock, so ``seconds_since`` is wall time."""

    raw: object = None

    def __init__(self, rt: HostRuntime) -> None:
        self.stamp: float | None = None
        self._rt = rt

    def record(self, stream: GpuStream) -> None:
        rt = self._rt
        rt.calls["event_record"] += 1
        if rt._faults:
            rt._check("event_record")
        self.stamp = time.perf_counter()

    def synchronize(self) -> None:
        rt = self._rt
        rt.calls["event_sync"] += 1
        if rt._faults:
            rt._check("event_sync")

    def query(self) -> bool:
        rt = self._rt
        rt.calls["event_query"] += 1
        if rt._faults:
            rt._check("event_query")
        if rt._held_queries > 0:  # (see HostRuntime.hold_events)
            rt._held_queries -= 1
            return False
        return True

    def seconds_since(self, start: GpuEvent) -> float:
        self._rt._call("event_elapsed")
        if self.stamp is None or not isinstance(start, _HostEvent) or start.stamp is None:
            raise RuntimeError("seconds_since needs two recorded events")
        return self.stamp - start.stamp

    def destroy(self) -> None:
        self._rt._call("event_destroy", unsafe=True)


class HostBuffer(_Buffer):
    """Ordinary host memory posing as pinned or device memory (for :class:`HostRuntime`)."""

    def __init__(self, rt: HostRuntime, kind: str, nbytes: int) -> None:
        rt._call(f"alloc_{kind}", unsafe=True)
        self.kind = kind
        self._rt = rt
        self._array = np.zeros(max(nbytes, 1), dtype=np.uint8)
        super().__init__(self._array.ctypes.data, nbytes, rt.stats)

    def _release(self) -> None:
        self._rt._call(f"free_{self.kind}", unsafe=True)
        self._array = np.zeros(0, dtype=np.uint8)


class HostRuntime:
    """:class:`CudaRuntime`'s interface over host memory and synchronous ``memmove``.

    With ``ort_device_type = "cpu"`` the CUDA worker binds these buffers to ONNX Runtime's
    CPU provider, so its whole pipeline - staging, buffer caching, output discovery, prefetch,
    error handling, teardown - runs on a machine without a GPU.  It checks logic, not CUDA's
    stream semantics, plus what CUDA does that the worker must handle:

    - ``devices`` GPUs: ``device_count`` says so and ``set_device`` refuses any other ordinal
      (``cudaErrorInvalidDevice``), so the paths that pick a GPU run here too;
    - ``calls`` counts every call by kind (copies, event records, waits, allocations), so a
      test can hold the per-task budget, and ``copy_threads`` holds the native ids of the
      threads that copied inputs to the device (the threads that launched tasks);
    - :attr:`copies` counts the copies that moved bytes, by kind (``h2d``, ``d2h``, ``peer``
      between GPUs, ``d2d`` within one), with their bytes (:meth:`copy_counts`): what the
      runtime's copy decisions are checked against, copy for copy;
    - :meth:`inject` makes a later call fail with a CUDA error code; a sticky code (700, ...)
      then fails every call, as a lost context does;
    - :meth:`hold_events` makes the next event queries answer "not done yet" (a copy still in
      flight on its stream: host copies are done at once), so what waits on an event can be
      made to;
    - the capture rules of CUDA's global mode (:meth:`capturing`, :meth:`thread_capture_mode`):
      an unsafe call from a global-mode thread while another thread captures fails with 900
      and the capture with 901.  ``capture_seconds`` holds each capture open that long, so a
      test can make another thread's calls land inside it;
    - ONNX Runtime's CUDA graphs (:meth:`graph_run`), as its CUDA provider (1.31) makes them:
      the first run of a graph id on a thread is the capture (graphs are per thread), and
      :attr:`graph_events` counts captures and replays, so the worker's own counts are checked
      against what ORT did.
    """

    ort_device_type = "cpu"

    def __init__(self, capture_seconds: float = 0.0, devices: int = 1) -> None:
        self.stats = AllocationStats()
        #: how many GPUs it stands in for (``set_device`` refuses the others, as CUDA does)
        self.devices = int(devices)
        self.calls: Counter[str] = Counter()
        #: copies of at least one byte by (kind, bytes): kinds h2d, d2h, peer (between GPUs),
        #: d2d (within one); see :meth:`copy_counts`. An ``itertools.count`` each, whose
        #: ``next`` is one atomic call per copy (the stand-in's own cost counts in what the
        #: host-overhead benchmark measures)
        self._tallies: dict[tuple[str, int], itertools.count[int]] = {}
        self._copy_lock = threading.Lock()
        #: each thread's current device (CUDA keeps it per thread)
        self._current = _PerThread()
        self.copy_threads: set[int] = set()
        self.capture_seconds = capture_seconds
        self._faults: list[list[Any]] = []  # [call name, code, times left]
        self._held_queries = 0
        self._lost: CudaError | None = None
        #: what the emulated CUDA provider did: "captured" (first runs of a graph id, each a
        #: capture) and "replayed" (runs that only launched a captured graph)
        self.graph_events: Counter[str] = Counter()
        #: per session, the (graph id, thread) captured: ORT keeps graphs in its CUDA provider's
        #: per-thread context (``PerThreadContext``: "a separate cuda graph per thread")
        self._graphs: weakref.WeakKeyDictionary[Any, set[tuple[int, int]]] = weakref.WeakKeyDictionary()
        self._graphs_lock = threading.Lock()
        # one call per copy: a copy method a subclass leaves alone is _copy with its kind given
        for kind in ("h2d", "d2h", "d2d"):
            if getattr(type(self), f"copy_{kind}") is getattr(HostRuntime, f"copy_{kind}"):
                setattr(self, f"copy_{kind}", functools.partial(self._copy, kind))

    # -- emulation
    def inject(self, call: str, code: int, times: int = 1) -> None:
        """Make the next ``times`` calls named ``call`` (a key of :attr:`calls`) fail with
        ``code``."""
        self._faults.append([call, code, times])

    def hold_events(self, queries: int) -> None:
        """The next ``queries`` event queries answer False: the work they ask about is still in
        flight (as a prefetch on a real copy stream may be)."""
        self._held_queries = queries

    def _call(self, name: str, unsafe: bool = False) -> None:
        """Count a call named ``name``; then :meth:`_check` it where a fault was ever injected
        (the calls made per task count inline and check only then: the stand-in's own cost
        is part of what the host-overhead benchmark measures)."""
        self.calls[name] += 1
        if self._faults or unsafe:
            self._check(name, unsafe)

    def _check(self, name: str, unsafe: bool = False) -> None:
        """Fail the call as a lost context, an injected fault or CUDA's capture rules say."""
        if self._lost is not None:
            raise self._lost
        for fault in self._faults:
            if fault[0] == name and fault[2] > 0:
                fault[2] -= 1
                err = CudaError(name, fault[1], f"cudaError({fault[1]})", "injected")
                if err.sticky:
                    self._lost = err
                raise err
        if unsafe:
            _Capture.check_unsafe(name)

    def device_count(self) -> int:
        return self.devices

    def _check_ordinal(self, device_id: int, call: str) -> None:
        """CUDA's answer to an ordinal past the GPUs stood in for."""
        if not 0 <= device_id < self.devices:
            raise CudaError(call, 101, "cudaErrorInvalidDevice",
                            f"invalid device ordinal {device_id} ({self.devices} device(s))")

    def properties(self, device_id: int) -> dict[str, Any]:
        """A stand-in says it is one: a result measured on it must never read as a GPU's."""
        self._check_ordinal(device_id, f"cudaGetDeviceProperties({device_id})")
        return {"device": device_id, "name": "HostRuntime (CPU stand-in, no GPU)", "memory_bytes": None,
                "capability": None, "sms": None, "pci_bus": None, "uuid": None}

    def loading(self, part: int) -> None:
        """Count a session load; an injected ``session_load`` fault (code 2, out of memory)
        stands in for a model that does not fit in the GPU's memory."""
        self._call("session_load")

    def set_device(self, device_id: int) -> None:
        self._check_ordinal(device_id, "cudaSetDevice")
        self._current.device = device_id

    def get_device(self) -> int:
        return self._current.device

    def copy_counts(self) -> dict[str, tuple[int, int]]:
        """``kind -> (copies, bytes)`` so far (kinds: h2d, d2h, peer, d2d)."""
        out: dict[str, tuple[int, int]] = {}
        with self._copy_lock:
            tallies = list(self._tallies.items())
        for (kind, nbytes), counter in tallies:
            n = int(repr(counter)[6:-1])  # 'count(N)': how far it counted (no call moves it)
            copies, total = out.get(kind, (0, 0))
            out[kind] = (copies + n, total + n * nbytes)
        return out

    def stream(self) -> _HostStream:
        self._call("stream_create", unsafe=True)
        return _HostStream(self)

    def event(self, timing: bool = True) -> _HostEvent:
        self._call("event_create", unsafe=True)
        return _HostEvent(self)

    def pinned(self, nbytes: int) -> HostBuffer:
        return HostBuffer(self, "pinned", nbytes)

    def device_buffer(self, nbytes: int) -> HostBuffer:
        return HostBuffer(self, "device", nbytes)

    def _copy(self, kind: str, dst: int, src: int, nbytes: int, stream: GpuStream | None = None) -> None:
        """A copy (host memory stands for every node), counted per (kind, size): lock-free
        after the first of its size, ``next`` on a count being atomic under the GIL. An
        upload notes its thread (the thread that launched the task)."""
        name = "copy_" + kind
        self.calls[name] += 1
        if self._faults:
            self._check(name)
        if kind == "h2d":
            here = self._current
            if here.native_id is None:
                here.native_id = threading.get_native_id()
            if here.native_id not in self.copy_threads:
                self.copy_threads.add(here.native_id)
        if nbytes:
            try:
                next(self._tallies[kind, nbytes])
            except KeyError:  # the first copy of its (kind, size)
                with self._copy_lock:
                    next(self._tallies.setdefault((kind, nbytes), itertools.count()))
            ctypes.memmove(dst, src, nbytes)

    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: GpuStream) -> None:
        self._copy("h2d", dst, src, nbytes)

    def copy_d2h(self, dst: int, src: int, nbytes: int, stream: GpuStream) -> None:
        self._copy("d2h", dst, src, nbytes)

    def copy_d2d(self, dst: int, src: int, nbytes: int, stream: GpuStream) -> None:
        self._copy("d2d", dst, src, nbytes)

    def copy_peer(self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int,
                  stream: GpuStream) -> None:
        self._copy("peer", dst, src, nbytes)

    def thread_capture_mode(self, mode: int) -> int:
        prev, _Capture.modes.mode = _Capture.modes.mode, mode
        return prev

    def graph_run(self, session: Any, run: SessionRun, graph_id: int) -> SessionRun:
        """``run`` as ONNX Runtime 1.31's CUDA provider runs ``session`` with ``gpu_graph_id``
        ``graph_id`` (the CPU provider ignores the id). Its first call with the id is the
        capture: ``InferenceSession::Run`` runs the model as long as the graph is not captured
        ("Start another run for necessary memory allocation or graph capture"), the provider
        captures once its regular runs are done (a stream sync, then
        ``cudaStreamBeginCapture`` in global mode) and replays the graph it just captured, all
        in that one call. Here the call is one run inside :meth:`capturing` (CUDA's global-mode
        rules; an injected ``capture`` fault fails it, and the id then stays uncaptured, so the
        next call captures again, as in ORT). Every later call from the same thread replays;
        graphs are per thread in the CUDA provider, so the first call from another thread
        captures again."""
        with self._graphs_lock:
            captured = self._graphs.setdefault(session, set())

        def run_graph(bound: Any, options: Any) -> None:
            key = (graph_id, threading.get_ident())
            if key in captured:
                self.graph_events["replayed"] += 1
                run(bound, options)
                return
            with self.capturing():
                run(bound, options)
            captured.add(key)
            self.graph_events["captured"] += 1

        return run_graph

    @contextmanager
    def capturing(self) -> Iterator[None]:
        """A global-mode capture by the calling thread for the duration of the block; raises
        :class:`CudaError` 901 at its end when another thread's unsafe call invalidated it."""
        self._call("capture")
        me = threading.get_ident()
        with _Capture.lock:
            _Capture.active[me] = False
        try:
            if self.capture_seconds:
                time.sleep(self.capture_seconds)
            yield
        finally:
            with _Capture.lock:
                invalidated = _Capture.active.pop(me, False)
        if invalidated:
            raise CudaError("cudaStreamEndCapture", CAPTURE_INVALIDATED,
                            "cudaErrorStreamCaptureInvalidated",
                            "capture sequence invalidated by another thread's call")


#: ``STARONNX_CUDA_RUNTIME=host`` (or ``host:N``): CUDA workers run their whole pipeline on
#: HostRuntime (the CPU provider, host memory), so every command's CUDA path can be driven on a
#: machine without a GPU
HOST_RUNTIME_ENV = "STARONNX_CUDA_RUNTIME"


def host_runtime_from_env() -> HostRuntime | None:
    """A :class:`HostRuntime` when ``$STARONNX_CUDA_RUNTIME`` asks for one (``host``, or
    ``host:N`` standing in for N GPUs), else None: the CLI's doors then run the CUDA workers'
    whole pipeline, and the bus calibration, on a machine without a GPU (the tests' way in)."""
    kind, _, count = os.environ.get(HOST_RUNTIME_ENV, "").partition(":")
    if kind != "host":
        return None
    return HostRuntime(devices=int(count) if count.isdigit() and int(count) > 0 else 1)
