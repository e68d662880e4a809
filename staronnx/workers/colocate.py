"""Colocation: the threads that spend their time holding the GIL run on one core.

A CUDA worker's driver thread, a serving batcher, an event loop and the caller submitting to a
runtime do little but Python between short calls that drop the GIL (a copy, a launch, a wait),
so they never run Python in parallel however many cores they are given. Spread over several
cores they pay for it instead: each hand-over of the GIL wakes the next holder on another
core (an inter-processor wake-up, costly on virtual machines), and every object they share
(a request, its task, its future) moves between the cores' caches. On the 2-core development
VM, a caller submitting one-stream tasks to a CUDA worker on :class:`~staronnx.workers.cudart.
HostRuntime` spent 44-47 µs of host time per task with the two threads on different cores and
30 µs with both on one (``benchmarks/host_overhead.py``'s ``colocated`` rows).

StarPU binds its main thread to a core when asked (``STARPU_MAIN_THREAD_BIND``); staronnx binds
such threads to the core of the runtime's first CUDA driver thread (its *host core*), which the
CPU groups hold back already (see :mod:`staronnx.workers.layout`), when asked: a thread pinned
to one core pins the threads it starts too (Linux threads inherit their creator's affinity),
and while the driver runs ONNX Runtime without a CUDA graph it launches kernels without the
GIL, work that a caller on another core overlaps. Without CPU groups (``none``) no core is held
back: the first driver thread is pinned to the last PU this process may use while a block runs
there.

A runtime without CUDA workers has no driver: there the threads join its first CPU worker's
thread, which runs its tasks (and its share of ONNX Runtime's intra-op work) pinned to its
group's first PU. On the 2-core VM, an open loop at 75 % of a one-PU worker's capacity (8
points in turn) had a p99 of 1.8x its p50 (median; 1.8-2.1x in 7 of 8) and a generator lag
p99 of 0.22 ms with the generator and batcher on that PU, against 3.4x (1.8-7.5x) and 0.54
ms with them floating (``benchmarks/serving_path.py``'s ``colocated`` rows). The block shares
that PU with the worker's compute: a win where tasks are short and host cost decides, a loss
where a task keeps the group's cores busy for milliseconds, hence a choice the caller makes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence

from staronnx.process_settings import SharedSetting
from staronnx.workers.cpu import CpuWorker
from staronnx.workers.cuda import CudaWorker

__all__ = ["Colocation", "colocated", "host_core"]

log = logging.getLogger(__name__)


#: thread affinity is Linux's (os.sched_setaffinity exists nowhere else)
_SUPPORTED = sys.platform == "linux"


def host_core(workers: Sequence[object]) -> int | None:
    """The PU of the first CUDA driver thread among ``workers`` (its ``cpu``), None when it is
    not pinned; without CUDA workers, the PU the first CPU worker's thread is pinned to (its
    group's first), None when there is none either. Workers of another engine (StarPU's, seen
    through it) are none of ours: they have no PU here."""
    cuda = next((w for w in workers if isinstance(w, CudaWorker)), None)
    if cuda is not None:
        return cuda.cpu
    cpu = next((w for w in workers if isinstance(w, CpuWorker)), None)
    return cpu.group.first_pu if cpu is not None else None


class Colocation:
    """A runtime's host core and the blocks that run there (:meth:`block`).

    Where no core is held back for the drivers (CPU groups ``none``), the first block pins the
    first CUDA driver thread to the last PU this process may use and the last block to end
    gives it back the PUs it had, so a runtime nobody colocates with runs as it always did.
    Without CUDA workers the host core is the first CPU worker's, pinned already."""

    def __init__(self, workers: Sequence[object]) -> None:
        self._workers = list(workers)
        self._cuda = [w for w in workers if isinstance(w, CudaWorker)]
        #: (host core or None, how to undo the driver's pin or None), held by the open blocks
        self._pin = SharedSetting(self._pin_driver, self._unpin_driver)

    @property
    def core(self) -> int | None:
        """The PU the drivers run on (None: not pinned now), or without CUDA workers the first
        CPU worker's (None: no worker of ours)."""
        return host_core(self._workers)

    @contextlib.contextmanager
    def block(self) -> Iterator[int | None]:
        """The calling thread on the host core for the block (see :func:`colocated`)."""
        with self._pin.held() as (pu, _), colocated(pu) as got:
            yield got

    def _pin_driver(self) -> tuple[int | None, tuple[CudaWorker, int, set[int]] | None]:
        """The host core, the first driver thread pinned to one first when it is not (the
        thread that drives a device's streams; with ``thread_per_stream``, the first stream's),
        and what undoes that pin: (its worker, its thread id, its PUs before)."""
        if not _SUPPORTED:
            return None, None
        pu = self.core
        if pu is not None or not self._cuda:  # pinned already (a CPU worker's thread for its whole life)
            return pu, None
        first = self._cuda[0]
        tid = first.native_id
        # no thread to join yet, or one that has ended, whose id the kernel may since have given
        # to another thread
        if tid is None or not first.alive:
            return None, None
        pu = max(os.sched_getaffinity(0))
        try:
            before = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, {pu})
        except OSError as exc:  # the thread has ended (a closed worker): nothing to join
            log.debug("cannot pin %s's thread to PU %d: %s", first.name, pu, exc)
            return None, None
        first.cpu = pu
        return pu, (first, tid, before)

    @staticmethod
    def _unpin_driver(pinned: tuple[int | None, tuple[CudaWorker, int, set[int]] | None]) -> None:
        """The driver the first block pinned gets its PUs back."""
        undo = pinned[1]
        if undo is None:
            return
        worker, tid, before = undo
        worker.cpu = None
        with contextlib.suppress(OSError):  # the thread has ended
            os.sched_setaffinity(tid, before)


@contextlib.contextmanager
def colocated(pu: int | None) -> Iterator[int | None]:
    """Run the calling thread on PU ``pu`` for the block, then give it back the PUs it had
    (None, or a platform without thread affinity: the block runs where it is)."""
    if pu is None or not _SUPPORTED:
        yield None
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {pu})
    except OSError as exc:  # a PU outside this process's cpuset
        log.warning("cannot run this thread on the runtime's host core (PU %d): %s; it runs where it was",
                    pu, exc)
        yield None
        return
    try:
        yield pu
    finally:
        os.sched_setaffinity(0, before)
