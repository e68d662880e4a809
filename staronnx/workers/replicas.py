"""A data handle's copies, and the memory of a GPU node they live in (StarPU's datawizard,
the part that moves bytes; :mod:`staronnx.runtime.datawizard` decides which).

A request's tensor may be valid on several memory nodes at once; its
:class:`~staronnx.runtime.datawizard.DataHandle` holds the copies. Its copy on the host is a
numpy array (pinned when it came from a GPU, or from the serving pool); its copy on a GPU is a
:class:`DeviceTensor`, a buffer of that GPU's :class:`DeviceMemory`.

:class:`DeviceMemory` is one GPU as a memory node: an arena of device buffers (reused by size:
nothing is allocated per task in the steady state, and nothing freed while serving, since
``cudaFree`` synchronises the device), and the copies the runtime issues to and from it
outside a task's own launch: a fetch kept for later readers, a copy from another GPU, a
download for a CPU reader. Each runs on the node's own copy stream, in thread-local capture
mode (no CUDA call of ours may break a graph another thread is capturing), and restores the
calling thread's current device. A :class:`DeviceTensor`'s buffer goes back to the arena when
the tensor is garbage: its last reader is done (the engine drops a request's intermediates
then), or its request failed.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from staronnx.workers.cudart import capture_safe
from staronnx.workers.pinned_pool import BufferArena, PinnedArray, PinnedPool

if TYPE_CHECKING:
    from staronnx.workers.cudart import Buffer, GpuEvent, GpuRuntime, GpuStream

__all__ = ["DeviceMemory", "DeviceTensor", "OutputRoute"]


class DeviceTensor:
    """A tensor in one GPU's memory: its buffer, dtype, shape, and the node it is on.

    ``ready`` is None once the copy or run that filled it is complete as far as a reader on
    another stream is concerned, else an event that reader's stream waits on first (a
    prefetch in flight; :meth:`DeviceMemory.settled` clears it); ``source`` keeps what such a
    copy reads alive until then (a pinned staging copy)."""

    __slots__ = ("buffer", "ptr", "nbytes", "dtype", "shape", "node", "device", "memory", "ready", "source")

    def __init__(self, memory: DeviceMemory, buffer: Buffer, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.memory = memory
        self.buffer = buffer
        self.ptr = buffer.ptr
        self.dtype = dtype
        self.shape = shape
        self.nbytes = math.prod(shape) * dtype.itemsize
        self.node = memory.node
        self.device = memory.device_id
        self.ready: GpuEvent | None = None
        self.source: object = None

    def __del__(self) -> None:  # any thread, any moment: only queues the buffer (and event) back
        self.memory.give_back(self.buffer)
        if self.ready is not None:
            self.memory.give_event(self.ready)

    def __repr__(self) -> str:
        return f"DeviceTensor({self.node}, {self.shape}, {self.dtype}, 0x{self.ptr:x})"


class OutputRoute:
    """Where a part's outputs go after a run on a GPU: ``host`` ones are written back (the
    request's final outputs), ``device`` ones stay on the GPU as the handle's copy (what other
    parts read); a name may be in both, and one in neither (read by nobody) is not copied at
    all. One per part, made once by the engine: a worker caches its copy lists per route
    (hashed by identity)."""

    __slots__ = ("host", "device")

    def __init__(self, host: frozenset[str], device: frozenset[str]) -> None:
        self.host = frozenset(host)
        self.device = frozenset(device)

    def __repr__(self) -> str:
        return f"OutputRoute(host={sorted(self.host)}, device={sorted(self.device)})"


class DeviceMemory(BufferArena):
    """One GPU as a memory node: its buffer arena and the runtime's copies to and from it."""

    def __init__(self, runtime: GpuRuntime, device_id: int, pinned_pool: PinnedPool | None = None) -> None:
        super().__init__()  # the arena's free lists, under its lock
        self.runtime = runtime
        self.device_id = device_id
        self.node = f"cuda{device_id}"
        #: where downloads land (pinned, so a GPU reads them again without staging); None:
        #: plain arrays
        self.pinned_pool = pinned_pool
        self._copying = threading.Lock()  # the copy stream: one runtime copy at a time
        self._stream: GpuStream | None = None
        #: events of prefetches, reused (an event is never destroyed while serving: a finalizer
        #: may give one back on any thread, and cudaEventDestroy there could break a capture)
        self._events: deque[GpuEvent] = deque()
        #: idle buffers kept for reuse, at most (past it, a new allocation frees the oldest)
        self.max_idle = 64

    # -- the arena
    def tensor(self, dtype: np.dtype, shape: tuple[int, ...]) -> DeviceTensor:
        """An uninitialised tensor in this GPU's memory (the calling thread's current device
        must be this one, in thread-local capture mode: a worker's or :meth:`_on_device`)."""
        nbytes = max(math.prod(shape) * np.dtype(dtype).itemsize, 1)
        with self._lock:
            buffer = self._idle(nbytes)
            surplus = self._surplus() if buffer is None else []
        for old in surplus:  # (the cold path: a size not seen lately)
            old.free()
        if buffer is None:
            buffer = self.runtime.device_buffer(nbytes)
            self.allocated += 1
        return DeviceTensor(self, buffer, np.dtype(dtype), tuple(shape))

    def _surplus(self) -> list[Buffer]:
        """(lock held) Idle buffers past :attr:`max_idle`, of the sizes least recently given
        back, taken out to be freed: shapes that vary (a sequence length) must not keep the
        device's memory forever; freeing synchronises the device, so it happens only when a
        new buffer is made anyway."""
        idle = sum(len(bs) for bs in self._free.values())
        out: list[Buffer] = []
        for size in list(self._free):  # insertion order: the sizes first given back first
            if idle - len(out) <= self.max_idle:
                break
            bufs = self._free[size]
            while bufs and idle - len(out) > self.max_idle:
                out.append(bufs.pop(0))
            if not bufs:
                del self._free[size]
        return out

    # -- copies the runtime issues
    @contextmanager
    def _on_device(self) -> Iterator[None]:
        """This device current and thread-local capture mode in the calling thread; the
        thread's device and mode are restored after."""
        rt = self.runtime
        with capture_safe(rt):
            before = rt.get_device()
            rt.set_device(self.device_id)
            try:
                yield
            finally:
                if before != self.device_id:
                    rt.set_device(before)

    @contextmanager
    def _copy_stream(self) -> Iterator[GpuStream]:
        """The copy stream (made on first use), with the copy lock held and this device
        current (:meth:`_on_device`): one runtime copy at a time."""
        with self._copying, self._on_device():
            if self._stream is None:
                self._stream = self.runtime.stream()
            yield self._stream

    def keep(self, src: int, dtype: np.dtype, shape: tuple[int, ...], stream: GpuStream) -> DeviceTensor:
        """A handle's own copy of ``src`` (device memory of this GPU, e.g. a graph slot's
        output) made on ``stream`` after what is queued there (a worker keeping an output on
        its device; the caller's thread is that worker's)."""
        t = self.tensor(dtype, shape)
        self.runtime.copy_d2d(t.ptr, src, t.nbytes, stream)
        return t

    def upload(self, array: np.ndarray, wait: bool = True) -> DeviceTensor:
        """A copy on this GPU of the host array ``array``: made and waited for (the fetch of a
        reader whose copy stays for the readers to come), or, with ``wait=False``, started on
        this node's copy stream and not waited for: its ``ready`` event is what a reader's
        stream waits on (StarPU's prefetch, at push time, while the worker runs its current
        task)."""
        with self._copy_stream() as stream:
            if not array.flags.c_contiguous:  # (reshaped: np.ascontiguousarray makes a 0-d array 1-d)
                array = np.ascontiguousarray(array).reshape(array.shape)
            t = self.tensor(array.dtype, array.shape)
            src, staging = self._pinned_source(array)
            self.runtime.copy_h2d(t.ptr, src, t.nbytes, stream)
            return self._copied(t, staging, stream, wait)

    def peer(self, tensor: DeviceTensor, wait: bool = True) -> DeviceTensor:
        """A copy on this GPU of ``tensor`` (on another GPU), enqueued behind ``tensor``'s own
        ready event: waited for, or not (``wait=False``), as :meth:`upload`."""
        with self._copy_stream() as stream:
            t = self.tensor(tensor.dtype, tensor.shape)
            if tensor.ready is not None:
                stream.wait(tensor.ready)
            self.runtime.copy_peer(t.ptr, self.device_id, tensor.ptr, tensor.device, t.nbytes, stream)
            return self._copied(t, tensor, stream, wait)

    def _copied(self, t: DeviceTensor, source: object, stream: GpuStream, wait: bool) -> DeviceTensor:
        """(copy lock held, on this device) ``t`` once its copy is enqueued: waited for, or
        given the event a reader waits on and ``source`` (what the copy reads: the pinned
        staging of a host array, or the peer tensor) to keep alive until then."""
        if wait:
            stream.synchronize()  # (the staging buffer may go once the copy is done)
            return t
        t.source = source
        t.ready = ready = self._event()
        ready.record(stream)
        return t

    def settled(self, tensor: DeviceTensor) -> bool:
        """Whether the copy that fills ``tensor`` (a prefetch) is complete; once it is, its
        event goes back and a reader no longer waits on it."""
        ready = tensor.ready
        if ready is None:
            return True
        if not self.done(ready):
            return False
        tensor.ready = None  # (before the event goes back: another copy may take it at once)
        self.give_event(ready)
        return True

    def done(self, event: GpuEvent) -> bool:
        """Whether the copy ``event`` marks is complete (asked in thread-local capture mode)."""
        with capture_safe(self.runtime):
            return bool(event.query())

    def _event(self) -> GpuEvent:
        """(in :meth:`_on_device`) An event for a prefetch, reused where one came back."""
        try:
            return self._events.popleft()
        except IndexError:
            return self.runtime.event(timing=False)

    def give_event(self, event: GpuEvent) -> None:
        """(any thread) An event no reader waits on any more."""
        self._events.append(event)

    def download(self, tensor: DeviceTensor) -> np.ndarray:
        """``tensor``'s bytes in host memory (pinned, from the pool where there is one), waited
        for: the fetch of a CPU reader."""
        return self._download(tensor, wait=True)[0]

    def download_async(self, tensor: DeviceTensor) -> tuple[np.ndarray, GpuEvent | None]:
        """``tensor``'s bytes in host memory, the copy only started (a prefetch for a CPU
        reader): the array, and the event its reader waits on (None: already complete, as a
        copy to pageable memory is without a pinned pool)."""
        return self._download(tensor, wait=False)

    def _download(self, tensor: DeviceTensor, wait: bool) -> tuple[np.ndarray, GpuEvent | None]:
        pool = self.pinned_pool
        out = pool.array(tensor.shape, tensor.dtype) if pool is not None else np.empty(tensor.shape, tensor.dtype)
        dst = out.pinned_ptr if isinstance(out, PinnedArray) and out.pinned_ptr else out.ctypes.data
        with self._copy_stream() as stream:
            if tensor.ready is not None:
                stream.wait(tensor.ready)
            self.runtime.copy_d2h(int(dst), tensor.ptr, tensor.nbytes, stream)
            if wait or pool is None:
                stream.synchronize()
                return out, None
            ready = self._event()
            ready.record(stream)
        return out, ready

    def _pinned_source(self, array: np.ndarray) -> tuple[int, np.ndarray | None]:
        """Where an upload reads ``array``: itself when it is pinned pool memory, else a pinned
        staging copy (returned too, to live until the copy is done)."""
        ptr = array.pinned_ptr if isinstance(array, PinnedArray) else None
        if ptr is not None or self.pinned_pool is None:
            return int(ptr if ptr is not None else array.ctypes.data), None
        staging = self.pinned_pool.array(array.shape, array.dtype)
        np.copyto(staging, array)
        return int(staging.pinned_ptr or staging.ctypes.data), staging

    def close(self) -> None:
        """Free the arena's idle buffers and the copy stream; buffers of tensors still alive
        are freed by a later call, once they have come back."""
        with self._copying, self._lock:
            buffers = self._close_idle()
            stream, self._stream = self._stream, None
            events = list(self._events)
            self._events.clear()
        with self._on_device():
            if stream is not None:
                stream.synchronize()
                stream.destroy()
            for b in buffers:
                b.free()
            for e in events:
                e.destroy()
