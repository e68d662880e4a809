"""Pinned host memory for batches: what a CUDA worker copies to its device without staging.

A CUDA worker copies each task's inputs into pinned staging buffers before the H2D copy (an
asynchronous copy from pageable memory is synchronous). When the serving batcher assembles a
batch straight into pinned memory, as Triton's pinned-memory pool lets its batcher do, the
worker skips that staging pass over the whole batch (on its own thread, under the GIL) and
copies to the device from the batch itself.

Buffers come back to the pool when the last view of a batch is garbage, never freed then, not
even once the pool is closed: the finalizer runs on whatever thread drops that view, at any
point (inside a lock, during another runtime's CUDA graph capture), and ``cudaFreeHost``
synchronises the device, which there would break the capture. The pool holds at most what was
in use at its peak (the batches in flight) and frees it on :meth:`PinnedPool.close`; a batch
still in use then is freed by a later call of ``close`` (or goes with the process).
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from staronnx.workers.cudart import Buffer


class PinnedArray(np.ndarray):
    """A numpy array over a pool buffer.  ``pinned_ptr`` is its address, set on the array the
    pool hands out and on nothing derived from it (a slice or a result has ``None``), so a
    CUDA worker tells "copy straight from here" with one attribute read instead of asking the
    pool (a lock and a scan) for every input of every task."""

    pinned_ptr: int | None = None


class BufferArena:
    """Buffers kept by size for reuse (this pool, a GPU's memory node), given back by finalizers
    (see above: :meth:`give_back` only appends, atomically; the arena's own calls take them back)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[Buffer]] = {}
        self._returned: deque[Buffer] = deque()
        self._closed = False
        #: buffers ever allocated (reuse keeps it at the peak in use)
        self.allocated = 0

    def give_back(self, buffer: Buffer) -> None:
        """(a finalizer: any thread, any moment) Queue ``buffer`` for reuse."""
        self._returned.append(buffer)

    def _idle(self, nbytes: int) -> Buffer | None:
        """(lock held) An idle buffer of ``nbytes`` (None: make one)."""
        self._take_back()
        free = self._free.get(nbytes)
        return free.pop() if free else None

    def _returning(self, buffer: Buffer) -> None:
        """(lock held) A buffer came back."""

    def _take_back(self) -> None:
        """(lock held) Returned buffers are free again, or freed once closed."""
        while self._returned:
            buffer = self._returned.popleft()
            self._returning(buffer)
            if self._closed:
                buffer.free()
            else:
                self._free.setdefault(buffer.nbytes, []).append(buffer)

    def _close_idle(self) -> list[Buffer]:
        """(lock held) Close; the idle buffers, to be freed (those in use are, by a later call)."""
        self._closed = True
        self._take_back()
        buffers = [b for bufs in self._free.values() for b in bufs]
        self._free.clear()
        return buffers


def _size_class(nbytes: int) -> int:
    """Buffers are sized in powers of two (at least 4 KiB), so batches of other sizes reuse them."""
    return max(4096, 1 << (nbytes - 1).bit_length())


class PinnedPool(BufferArena):
    """Numpy arrays over reusable pinned buffers from ``allocate(nbytes)``."""

    def __init__(self, allocate: Callable[[int], Buffer]) -> None:
        super().__init__()
        self._allocate = allocate
        self._leased: dict[int, Buffer] = {}  # start pointer -> buffer, while a view lives

    def array(self, shape: tuple[int, ...], dtype: np.dtype | type) -> PinnedArray:
        """An uninitialised C-contiguous array in pinned memory, returned to the pool when it
        (and every view of it) is garbage."""
        dt = np.dtype(dtype)
        count = math.prod(shape)
        nbytes = count * dt.itemsize
        if nbytes == 0 or self._closed:  # plain memory (pinned_ptr None)
            return np.empty(shape, dtype=dt).view(PinnedArray)
        size = _size_class(nbytes)
        with self._lock:
            buffer = self._idle(size)
        fresh = buffer is None
        if buffer is None:
            buffer = self._allocate(size)
        raw = (ctypes.c_ubyte * nbytes).from_address(buffer.ptr)
        with self._lock:
            self.allocated += fresh
            self._leased[buffer.ptr] = buffer
        weakref.finalize(raw, self.give_back, buffer)
        array = np.frombuffer(raw, dtype=dt, count=count).reshape(shape).view(PinnedArray)
        array.pinned_ptr = buffer.ptr
        return array

    @property
    def leased(self) -> int:
        with self._lock:
            self._take_back()
            return len(self._leased)

    def _returning(self, buffer: Buffer) -> None:
        self._leased.pop(buffer.ptr, None)

    def close(self) -> None:
        """Free the buffers not in use (see :meth:`BufferArena._close_idle`)."""
        with self._lock:
            buffers = self._close_idle()
        for b in buffers:
            b.free()
