"""A thin, checked wrapper over the CUDA runtime of NVIDIA's ``cuda-python``.

ONNX Runtime's Python API cannot create streams, events or pinned host memory (1.31 has no
"cuda_pinned" OrtValue device), so the CUDA worker and the memory nodes get them from
``cuda.bindings.runtime`` (``cuda.cudart`` in cuda-python < 12.6).  That API returns C-style
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
"""

from __future__ import annotations

import ctypes
import importlib
import threading
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from staronnx.errors import DeviceError

__all__ = [
    "AllocationStats",
    "Buffer",
    "CudaError",
    "CudaRuntime",
    "DeviceBuffer",
    "Event",
    "HostBuffer",
    "HostRuntime",
    "INSTALL_HINT",
    "PinnedBuffer",
    "Runtime",
    "Stream",
    "check",
    "runtime_module",
]

INSTALL_HINT = "pip install 'staronnx[gpu]'"

_module: ModuleType | None = None
_module_lock = threading.Lock()


def runtime_module() -> ModuleType:
    """The cuda-python runtime module, imported once; :class:`DeviceError` if absent."""
    global _module
    with _module_lock:
        if _module is not None:
            return _module
        errors = []
        for name in ("cuda.bindings.runtime", "cuda.cudart"):
            try:
                _module = importlib.import_module(name)
                return _module
            except ImportError as exc:
                errors.append(f"{name}: {exc}")
        raise DeviceError(
            "NVIDIA's cuda-python is not installed (needed for CUDA streams, events and pinned "
            f"memory; tried {'; '.join(errors)}). Install it with: {INSTALL_HINT}"
        )


class CudaError(DeviceError):
    """A CUDA runtime call returned an error code."""

    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        self.call = call
        self.code = code
        self.name = name
        super().__init__(f"{call} failed: {name} ({code}): {text}")


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
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
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

    def add(self, kind: str, nbytes: int) -> None:
        with self._lock:
            if kind == "pinned":
                self.pinned_allocs += 1
                self.pinned_bytes += nbytes
            else:
                self.device_allocs += 1
                self.device_bytes += nbytes

    def remove(self, kind: str, nbytes: int) -> None:
        with self._lock:
            if kind == "pinned":
                self.pinned_frees += 1
                self.pinned_bytes -= nbytes
            else:
                self.device_frees += 1
                self.device_bytes -= nbytes

    @property
    def live(self) -> int:
        """Buffers allocated and not yet freed."""
        return (self.pinned_allocs - self.pinned_frees) + (self.device_allocs - self.device_frees)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "pinned_allocs": self.pinned_allocs,
                "pinned_frees": self.pinned_frees,
                "pinned_bytes": self.pinned_bytes,
                "device_allocs": self.device_allocs,
                "device_frees": self.device_frees,
                "device_bytes": self.device_bytes,
            }


class Stream:
    """A CUDA stream; non-blocking by default so it never serialises with the legacy stream 0."""

    def __init__(self, rt: ModuleType, non_blocking: bool = True) -> None:
        self._rt = rt
        flags = rt.cudaStreamNonBlocking if non_blocking else rt.cudaStreamDefault
        self._stream = check(rt.cudaStreamCreateWithFlags(flags), "cudaStreamCreateWithFlags")
        self.handle: int = int(self._stream)  # the cudaStream_t value, what ORT expects
        self._alive = True

    @property
    def raw(self) -> Any:
        """The cuda-python ``cudaStream_t`` object, for calls this wrapper does not cover."""
        return self._stream

    def wait(self, event: Event) -> None:
        """Make work queued on this stream after now wait for ``event`` (no host blocking)."""
        check(self._rt.cudaStreamWaitEvent(self._stream, event.raw, 0), "cudaStreamWaitEvent")

    def synchronize(self) -> None:
        check(self._rt.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def destroy(self) -> None:
        if self._alive:
            self._alive = False
            check(self._rt.cudaStreamDestroy(self._stream), "cudaStreamDestroy")

    def __repr__(self) -> str:
        return f"Stream(0x{self.handle:x})"


class Event:
    """A CUDA event; ``timing=True`` allows :meth:`seconds_since` (slightly costlier waits)."""

    def __init__(self, rt: ModuleType, timing: bool = True) -> None:
        self._rt = rt
        flags = rt.cudaEventDefault if timing else rt.cudaEventDisableTiming
        self._event = check(rt.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags")
        self.timing = timing
        self._alive = True

    @property
    def raw(self) -> Any:
        return self._event

    def record(self, stream: Stream) -> None:
        check(self._rt.cudaEventRecord(self._event, stream.raw), "cudaEventRecord")

    def synchronize(self) -> None:
        """Block the calling thread (without the GIL) until the recorded work is done."""
        check(self._rt.cudaEventSynchronize(self._event), "cudaEventSynchronize")

    def query(self) -> bool:
        """True when the recorded work is done, False while it is pending."""
        result = self._rt.cudaEventQuery(self._event)
        err = result[0] if isinstance(result, tuple) else result
        if int(err) == int(self._rt.cudaError_t.cudaErrorNotReady):
            return False
        check(result, "cudaEventQuery")
        return True

    def seconds_since(self, start: Event) -> float:
        """GPU time between ``start`` and this event (both recorded, completed, timing)."""
        ms = check(self._rt.cudaEventElapsedTime(start.raw, self._event), "cudaEventElapsedTime")
        return float(ms) / 1000.0

    def destroy(self) -> None:
        if self._alive:
            self._alive = False
            check(self._rt.cudaEventDestroy(self._event), "cudaEventDestroy")


class _Buffer:
    kind = ""

    def __init__(self, ptr: int, nbytes: int, stats: AllocationStats | None) -> None:
        self.ptr = int(ptr)
        self.nbytes = nbytes
        self._stats = stats
        self._alive = True
        if stats is not None:
            stats.add(self.kind, nbytes)

    @property
    def alive(self) -> bool:
        return self._alive

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
                    self._stats.remove(self.kind, self.nbytes)

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

    def view(self, dtype: np.dtype | type, shape: tuple[int, ...]) -> np.ndarray:
        """A writable numpy view of the first ``prod(shape)`` elements (no copy).

        The view must not outlive the buffer: copy what you hand out.
        """
        return host_view(self.ptr, self.nbytes, dtype, shape)

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


def host_view(
    ptr: int, capacity: int, dtype: np.dtype | type, shape: tuple[int, ...]
) -> np.ndarray:
    """A writable numpy array over host memory at ``ptr`` (used for pinned buffers)."""
    dt = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    nbytes = count * dt.itemsize
    if nbytes > capacity:
        raise ValueError(f"a {shape} {dt} view needs {nbytes} B, the buffer holds {capacity} B")
    if nbytes == 0:
        return np.empty(shape, dtype=dt)
    raw = (ctypes.c_ubyte * nbytes).from_address(ptr)
    return np.frombuffer(raw, dtype=dt, count=count).reshape(shape)


class Buffer(Protocol):
    """Pinned, device or stand-in memory: an address, a size, and a way to free it."""

    ptr: int
    nbytes: int

    def view(self, dtype: np.dtype | type, shape: tuple[int, ...]) -> np.ndarray: ...
    def free(self) -> None: ...


class GpuRuntime(Protocol):
    """What the CUDA worker and the copiers need from a runtime (:class:`CudaRuntime`, or
    :class:`HostRuntime` without a GPU).  Streams, events and buffers are duck-typed alike:
    ``Stream.handle/wait/synchronize/destroy``, ``Event.record/synchronize/seconds_since/
    destroy``, buffers ``ptr/nbytes/view/free``."""

    ort_device_type: str
    stats: AllocationStats

    def device_count(self) -> int: ...
    def set_device(self, device_id: int) -> None: ...
    def stream(self, non_blocking: bool = True) -> Any: ...
    def event(self, timing: bool = True) -> Any: ...
    def pinned(self, nbytes: int) -> Buffer: ...
    def device_buffer(self, nbytes: int) -> Buffer: ...
    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: Any) -> None: ...
    def copy_d2h(self, dst: int, src: int, nbytes: int, stream: Any) -> None: ...
    def copy_peer(self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int,
                  stream: Any) -> None: ...


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
        kinds = self.rt.cudaMemcpyKind
        self._h2d = kinds.cudaMemcpyHostToDevice
        self._d2h = kinds.cudaMemcpyDeviceToHost

    # -- devices
    def device_count(self) -> int:
        return int(check(self.rt.cudaGetDeviceCount(), "cudaGetDeviceCount"))

    def set_device(self, device_id: int) -> None:
        check(self.rt.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")

    # -- objects
    def stream(self, non_blocking: bool = True) -> Stream:
        return Stream(self.rt, non_blocking)

    def event(self, timing: bool = True) -> Event:
        return Event(self.rt, timing)

    def pinned(self, nbytes: int) -> PinnedBuffer:
        return PinnedBuffer(self.rt, nbytes, self.stats)

    def device_buffer(self, nbytes: int) -> DeviceBuffer:
        return DeviceBuffer(self.rt, nbytes, self.stats)

    # -- copies (asynchronous: order them with events, wait with Event/Stream.synchronize)
    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        if nbytes:
            check(self.rt.cudaMemcpyAsync(dst, src, nbytes, self._h2d, stream.raw),
                  "cudaMemcpyAsync(host->device)")

    def copy_d2h(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        if nbytes:
            check(self.rt.cudaMemcpyAsync(dst, src, nbytes, self._d2h, stream.raw),
                  "cudaMemcpyAsync(device->host)")

    def copy_peer(self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int,
                  stream: Stream) -> None:
        """Between two GPUs; the driver stages through the host when peer access is off."""
        if nbytes:
            check(self.rt.cudaMemcpyPeerAsync(dst, dst_device, src, src_device, nbytes, stream.raw),
                  "cudaMemcpyPeerAsync")


# ---------------------------------------------------------------------------- host stand-in
class _HostStream:
    """Stands in for a stream: host copies complete in program order, so nothing to wait."""

    _next = 0x1000

    def __init__(self) -> None:
        _HostStream._next += 0x10
        self.handle = _HostStream._next

    def wait(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def destroy(self) -> None:
        pass


class _HostEvent:
    """Stands in for an event: records the host clock, so ``seconds_since`` is wall time."""

    def __init__(self) -> None:
        self.stamp: float | None = None

    def record(self, stream: Any) -> None:
        self.stamp = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def seconds_since(self, start: _HostEvent) -> float:
        if self.stamp is None or start.stamp is None:
            raise RuntimeError("seconds_since needs two recorded events")
        return self.stamp - start.stamp

    def destroy(self) -> None:
        pass


class HostBuffer(_Buffer):
    """Ordinary host memory posing as pinned or device memory (for :class:`HostRuntime`)."""

    def __init__(self, kind: str, nbytes: int, stats: AllocationStats | None) -> None:
        self.kind = kind
        self._array = np.zeros(max(nbytes, 1), dtype=np.uint8)
        super().__init__(self._array.ctypes.data, nbytes, stats)

    def view(self, dtype: np.dtype | type, shape: tuple[int, ...]) -> np.ndarray:
        return host_view(self.ptr, self.nbytes, dtype, shape)

    def _release(self) -> None:
        self._array = np.zeros(0, dtype=np.uint8)


class HostRuntime:
    """:class:`CudaRuntime`'s interface over host memory and synchronous ``memmove``.

    With ``ort_device_type = "cpu"`` the CUDA worker binds these buffers to ONNX Runtime's
    CPU provider, so its whole pipeline - staging, buffer caching, output discovery, prefetch,
    error handling, teardown - runs on a machine without a GPU.  It checks logic, not CUDA's
    stream semantics.
    """

    ort_device_type = "cpu"

    def __init__(self) -> None:
        self.stats = AllocationStats()

    def device_count(self) -> int:
        return 1

    def set_device(self, device_id: int) -> None:
        pass

    def stream(self, non_blocking: bool = True) -> _HostStream:
        return _HostStream()

    def event(self, timing: bool = True) -> _HostEvent:
        return _HostEvent()

    def pinned(self, nbytes: int) -> HostBuffer:
        return HostBuffer("pinned", nbytes, self.stats)

    def device_buffer(self, nbytes: int) -> HostBuffer:
        return HostBuffer("device", nbytes, self.stats)

    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if nbytes:
            ctypes.memmove(dst, src, nbytes)

    copy_d2h = copy_h2d

    def copy_peer(self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int,
                  stream: Any) -> None:
        self.copy_h2d(dst, src, nbytes, stream)
