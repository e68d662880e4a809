"""The CPU worker: one pinned thread per CPU group, one ONNX Runtime session per part.

StarPU's CPU worker is a thread bound to a core; ours owns a whole group of cores (usually a
NUMA node) because ONNX Runtime parallelises inside each operator.  The worker thread:

1. pins itself to the group's first PU with ``os.sched_setaffinity(0, ...)``, which on Linux
   applies to the calling thread only;
2. binds its memory allocations to the group's NUMA node(s) through hwloc (best effort: skipped
   on a 1-node machine or a topology that is not this system's, reported in :attr:`membind`);
3. builds one session per part with ``intra_op_num_threads`` = cores in the group and
   ``session.intra_op_thread_affinities`` pinning ORT's extra threads to the other cores
   (ORT's calling thread, the worker thread, is the pool's first member); inter-op 1,
   sequential execution; spinning off when the group's cores are shared with another worker,
   and stopped as soon as each run ends (``session.force_spinning_stop``) because every part
   has its own pool on the same cores;
4. serves tasks from its queue in order, timing each ``session.run``.

Sessions are built *in* the worker thread so that ORT's pool threads inherit its affinity and
the weights are first touched on its NUMA node.  Weights are shared between the groups of a
NUMA node through :mod:`staronnx.workers.cpu_weights` (one memory-mapped copy instead of one per
session).  Python threads suffice: ORT releases the GIL while it computes.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from staronnx.errors import DeviceError, ModelError
from staronnx.workers.cpu_weights import SharedWeights, default_shared_weights
from staronnx.workers.groups import CpuGroup
from staronnx.workers.topology import Topology, format_pus

__all__ = ["CpuWorker", "WorkerFuture", "OnDone"]

log = logging.getLogger(__name__)

Feeds = Mapping[str, np.ndarray]
Outputs = dict[str, np.ndarray]
#: ``on_done(part, batch, seconds)``: called in the worker thread after each successful task.
OnDone = Callable[[int, int, float], None]


class WorkerFuture(Future):  # type: ignore[type-arg]
    """A Future of ``{output name: array}`` that also says when and where the task ran.

    ``start``/``end`` are ``time.perf_counter()`` stamps taken around ``session.run`` (set
    before the result, so done-callbacks can read them); ``seconds`` is their difference.
    """

    def __init__(self, part: int, batch: int, worker: str) -> None:
        super().__init__()
        self.part = part
        self.batch = batch
        self.worker = worker
        self.start: float | None = None
        self.end: float | None = None

    @property
    def seconds(self) -> float | None:
        if self.start is None or self.end is None:
            return None
        return self.end - self.start


@dataclass
class WorkerStats:
    """Counters a scheduler or a benchmark may read (updated by the worker thread only)."""

    done: int = 0
    failed: int = 0
    busy_seconds: float = 0.0


class _Claims:
    """PUs used by live workers, to turn ORT's spinning off where workers share cores."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: Counter[int] = Counter()

    def claim(self, pus: Sequence[int]) -> bool:
        """Register ``pus``; True when no other live worker uses any of them."""
        with self._lock:
            alone = not any(self._count[p] for p in pus)
            self._count.update(pus)
            return alone

    def release(self, pus: Sequence[int]) -> None:
        with self._lock:
            self._count.subtract(pus)
            self._count += Counter()  # drop zero counts


_claims = _Claims()
_live: weakref.WeakSet[CpuWorker] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # Worker threads are daemons so a forgotten close() cannot hang the interpreter; closing
    # them here still lets ORT free its pools before the process tears down.
    for worker in list(_live):
        try:
            worker.close(timeout=5.0, cancel_pending=True)
        except Exception:  # pragma: no cover - best effort at exit
            pass


_STOP = object()


class CpuWorker:
    """Runs the parts of a plan on one CPU group.

    ``spin=None`` lets ORT's pool threads spin (lowest latency) unless another live worker
    already uses one of the group's PUs; ``True``/``False`` force it.  ``share_weights``
    uses :class:`~staronnx.workers.cpu_weights.SharedWeights` (``weights`` or the process-wide
    one); ``topology`` is only used for memory binding (default: this system's, loaded once).
    """

    kind = "cpu"

    def __init__(
        self,
        group: CpuGroup,
        part_paths: Sequence[str | os.PathLike[str]],
        name: str | None = None,
        spin: bool | None = None,
        *,
        topology: Topology | None = None,
        share_weights: bool = True,
        weights: SharedWeights | None = None,
        on_done: OnDone | None = None,
    ) -> None:
        if not part_paths:
            raise ModelError("a CPU worker needs at least one part (.onnx file)")
        self.group = group
        self.part_paths = [Path(p) for p in part_paths]
        self.name = name or f"cpu:{group.name}"
        self.on_done = on_done
        self.stats = WorkerStats()
        self.share_weights = share_weights
        #: per part: True when its weights come from the shared mapped copy.
        self.weights_shared: list[bool] = [False] * len(self.part_paths)
        #: what happened to memory binding ("bound to NUMA 1", "skipped: ...", "failed: ...").
        self.membind = "not started"
        self.spin: bool | None = spin
        self.native_id: int | None = None
        self._spin_arg = spin
        self._topology = topology
        self._weights = weights
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self._claimed = False
        self._sessions: list[ort.InferenceSession] = []
        self._inputs: list[list[str]] = []
        self._outputs: list[list[str]] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float | None = None) -> CpuWorker:
        """Start the thread and wait until every session is built; raise if one cannot be."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError(f"{self.name} is already started")
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            for p in self.part_paths:
                if not p.is_file():
                    raise ModelError(f"part file {str(p)!r} does not exist")
            alone = _claims.claim(self.group.pus)
            self._claimed = True
            self.spin = alone if self._spin_arg is None else self._spin_arg
            self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            _live.add(self)
            self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self.name} did not finish loading its sessions in {timeout} s")
        if self._error is not None:
            self._thread.join()
            with self._lock:
                self._closed = True
            self._release()
            err = self._error
            if isinstance(err, (ModelError, DeviceError)):
                raise err
            raise ModelError(f"{self.name} could not build its sessions: {err}") from err
        return self

    def close(self, timeout: float | None = None, cancel_pending: bool = False) -> None:
        """Stop accepting tasks, finish (or cancel) the queued ones, join the thread.

        Sessions are released inside the worker thread, which joins ORT's pool threads, so no
        thread is left behind.  Raises TimeoutError if the thread is still running a task
        after ``timeout`` seconds (it will still exit after that task).  Idempotent.
        """
        with self._lock:
            first = not self._closed
            self._closed = True
        thread = self._thread
        if thread is None:
            self._release()
            return
        if first:
            if cancel_pending:
                self._cancel_queued()
            self._queue.put(_STOP)
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"{self.name} is still running a task after {timeout} s")
        self._cancel_queued()  # anything submitted in a race with close()
        self._release()

    def __enter__(self) -> CpuWorker:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ tasks
    def submit(self, part: int, feeds: Feeds) -> WorkerFuture:
        """Queue ``part`` on ``feeds``; the future resolves to ``{output name: array}``.

        A task that raises (bad shape, wrong dtype, missing input) fails its own future only.
        """
        if self._thread is None:
            raise RuntimeError(f"{self.name} is not started; call start() first")
        if not 0 <= part < len(self.part_paths):
            raise IndexError(f"{self.name} has parts 0..{len(self.part_paths) - 1}, not {part}")
        fut = WorkerFuture(part, _batch_of(feeds, self._inputs[part]), self.name)
        self._put(("run", part, feeds, fut, True))
        return fut

    def run(self, part: int, feeds: Feeds) -> Outputs:
        """Synchronous :meth:`submit` (still executed by the pinned worker thread)."""
        return self.submit(part, feeds).result()

    def warmup(
        self,
        batch_sizes: Sequence[int],
        make_feeds: Callable[[int, int], Feeds],
        repeats: int = 1,
    ) -> list[tuple[int, int, float]]:
        """Run every part at every batch size so first-run costs don't reach the perf models.

        ``make_feeds(part, batch)`` builds the feeds.  Warm-up runs don't call ``on_done`` nor
        count in :attr:`stats`.  Returns ``(part, batch, seconds)`` of the last repeat of each.
        """
        timings = []
        for part in range(len(self.part_paths)):
            for b in batch_sizes:
                for _ in range(max(1, repeats)):
                    fut = WorkerFuture(part, b, self.name)
                    self._put(("run", part, make_feeds(part, b), fut, False))
                    fut.result()
                timings.append((part, b, fut.seconds or 0.0))
        return timings

    def affinity(self) -> set[int]:
        """What ``os.sched_getaffinity(0)`` reports inside the worker thread."""
        return self.call(lambda: os.sched_getaffinity(0))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` in the worker thread, between tasks, and return its result."""
        fut: Future[Any] = Future()
        self._put(("call", fn, fut))
        return fut.result()

    def spawn(self, fn: Callable[[], Any]) -> Future[Any]:
        """Start ``fn()`` in the worker thread and return at once.

        An engine runs its serving loop this way, so tasks execute on the pinned thread with no
        extra thread hop; the loop calls :meth:`run_here` for each task and must return before
        :meth:`close` can finish.
        """
        fut: Future[Any] = Future()
        self._put(("call", fn, fut))
        return fut

    def run_here(self, part: int, feeds: Feeds) -> Outputs:
        """Run a part in the calling thread, which must be this worker's own (see :meth:`spawn`).

        Exceptions propagate to the caller (the engine fails that task's request only), with
        the session-holding frames cleared as in the queued path.
        """
        if threading.get_native_id() != self.native_id:
            raise RuntimeError(f"run_here called outside {self.name}'s thread")
        try:
            values = self._sessions[part].run(None, dict(feeds))
        except BaseException as exc:
            self.stats.failed += 1
            traceback.clear_frames(exc.__traceback__)
            raise
        return dict(zip(self._outputs[part], values))

    def _put(self, item: tuple[Any, ...]) -> None:
        if self._thread is None:
            raise RuntimeError(f"{self.name} is not started; call start() first")
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed; cannot accept new tasks")
            self._queue.put(item)

    # ------------------------------------------------------------------ introspection
    def input_names(self, part: int) -> list[str]:
        return list(self._inputs[part])

    def output_names(self, part: int) -> list[str]:
        return list(self._outputs[part])

    @property
    def n_parts(self) -> int:
        return len(self.part_paths)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __repr__(self) -> str:
        state = "running" if self.alive else ("closed" if self._closed else "new")
        return f"CpuWorker({self.name!r}, {self.group.describe()}, parts={self.n_parts}, {state})"

    # ------------------------------------------------------------------ worker thread
    def _main(self) -> None:
        try:
            self.native_id = threading.get_native_id()
            self._pin()
            self.membind = _bind_memory(self._topology, self.group)
            for i, path in enumerate(self.part_paths):
                self._sessions.append(self._load(i, path))
                self._inputs.append([x.name for x in self._sessions[-1].get_inputs()])
                self._outputs.append([x.name for x in self._sessions[-1].get_outputs()])
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._sessions.clear()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve()
        finally:
            # Dropping the sessions here joins ORT's pool threads before this thread ends.
            self._sessions.clear()

    def _pin(self) -> None:
        target = {self.group.first_pu}
        try:
            os.sched_setaffinity(0, target)
        except (OSError, ValueError) as exc:
            raise DeviceError(
                f"{self.name} cannot run on PU {self.group.first_pu} ({exc}); this process may "
                f"use PUs {format_pus(os.sched_getaffinity(os.getpid()))}. Build groups from "
                "Topology.from_system(), not from a synthetic or XML topology."
            ) from None

    def _load(self, index: int, path: Path) -> ort.InferenceSession:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.intra_op_num_threads = self.group.n_cores
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        affinities = self.group.ort_thread_affinities()
        if affinities:
            so.add_session_config_entry("session.intra_op_thread_affinities", affinities)
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spin else "0")
        # Each part's session has its own pool on the same cores and only one runs at a time:
        # spin while a Run() is active, never after, or idle pools would steal the cores.
        so.add_session_config_entry("session.force_spinning_stop", "1")
        model = path
        if self.share_weights:
            try:
                weights = self._weights or default_shared_weights()
                model = weights.model_for(path, self.group.numa)
                # Already optimised (and prepacked): optimising again would only cost time.
                so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
                self.weights_shared[index] = True
            except Exception as exc:  # noqa: BLE001 - fall back to a private copy
                log.warning("%s: weights of %s not shared (%s); loading a private copy",
                            self.name, path, exc)
                model = path
        try:
            return ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ModelError(f"ONNX Runtime cannot load part {index} ({path}): {exc}") from None

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if item[0] == "call":
                _, fn, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001
                        fut.set_exception(exc)
                continue
            _, part, feeds, fut, record = item
            if not fut.set_running_or_notify_cancel():
                continue
            fut.start = time.perf_counter()
            try:
                values = self._sessions[part].run(None, dict(feeds))
            except BaseException as exc:  # noqa: BLE001 - fails this task only
                fut.end = time.perf_counter()
                if record:
                    self.stats.failed += 1
                # The traceback's frames hold the ORT session (``self`` of its run wrapper):
                # kept in the future they would keep the session, and its thread pool, alive
                # after close().  ORT's message says what went wrong; the locals can go.
                traceback.clear_frames(exc.__traceback__)
                fut.set_exception(exc)
                del exc
                continue
            fut.end = time.perf_counter()
            seconds = fut.end - fut.start
            if record:
                self.stats.done += 1
                self.stats.busy_seconds += seconds
                if self.on_done is not None:
                    try:
                        self.on_done(part, fut.batch, seconds)
                    except Exception:  # noqa: BLE001 - a broken hook must not fail the task
                        log.exception("%s: on_done hook failed", self.name)
            fut.set_result(dict(zip(self._outputs[part], values)))

    def _cancel_queued(self) -> None:
        stop_seen = False
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                stop_seen = True
                continue
            item[-2 if item[0] == "run" else -1].cancel()
        if stop_seen:
            self._queue.put(_STOP)

    def _release(self) -> None:
        with self._lock:
            if self._claimed:
                _claims.release(self.group.pus)
                self._claimed = False
        _live.discard(self)


# ---------------------------------------------------------------------- helpers
def _batch_of(feeds: Feeds, input_names: Sequence[str]) -> int:
    """The batch size: leading dimension of the first model input present in the feeds."""
    for name in list(input_names) + list(feeds):
        arr = feeds.get(name)
        if arr is not None:
            shape = getattr(arr, "shape", ())
            return int(shape[0]) if len(shape) else 1
    return 0


_system_topology: Topology | None = None
_system_lock = threading.Lock()


def _bind_memory(topology: Topology | None, group: CpuGroup) -> str:
    """Bind this thread's future allocations to the group's NUMA node(s); never raises.

    One node: hwloc BIND.  Several (a package group): INTERLEAVE, so that weights and
    activations spread over the nodes whose cores use them.
    """
    global _system_topology
    try:
        if topology is None:
            with _system_lock:
                if _system_topology is None:
                    _system_topology = Topology.from_system()
                topology = _system_topology
        if not topology.is_this_system or topology.hw is None:
            return "skipped: the topology is not this system's"
        if len(topology.numa_nodes) <= 1:
            return "skipped: one NUMA node"
        if not group.numa_nodes:
            return "skipped: the group has no NUMA node"
        from pyhwloc.bitmap import Bitmap
        from pyhwloc.topology import MemBindFlags, MemBindPolicy

        policy = MemBindPolicy.BIND if len(group.numa_nodes) == 1 else MemBindPolicy.INTERLEAVE
        topology.hw.set_membind(
            Bitmap.from_sched_set(set(group.numa_nodes)),
            policy,
            MemBindFlags.THREAD | MemBindFlags.BYNODESET,
        )
        return f"{policy.name.lower()} to NUMA {','.join(map(str, group.numa_nodes))}"
    except Exception as exc:  # noqa: BLE001 - best effort by design
        return f"failed: {exc}"
