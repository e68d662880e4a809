"""The CPU worker: one pinned thread per CPU group, one ONNX Runtime session per part.

StarPU's CPU worker is a thread bound to a core; ours owns a whole group of cores (usually a
NUMA node) because ONNX Runtime parallelises inside each operator. The thread pins itself to
the group's first PU (``os.sched_setaffinity(0, ...)`` applies to the calling thread only, on
Linux), binds its allocations to the group's NUMA node(s) through hwloc (best effort, reported
in :attr:`membind`) and builds the sessions itself, so that ORT's pool threads inherit its
affinity and the weights are first touched on its node. The worker thread is the pool's first
member; ``session.intra_op_thread_affinities`` pins the others to the rest of the group.
Weights are shared between the groups of a NUMA node through :mod:`staronnx.workers.cpu_weights`
(one memory-mapped copy instead of one per session). Python threads suffice: ORT releases the
GIL while it computes.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import onnxruntime as ort

from staronnx.errors import ModelError
from staronnx.workers.base import Feeds, Outputs, ThreadWorker
from staronnx.workers.cpu_weights import SharedWeights, default_shared_weights
from staronnx.workers.groups import CpuGroup
from staronnx.workers.lanes import lower_priority
from staronnx.workers.topology import Topology, bind_memory, format_pus

__all__ = ["CpuWorker"]

log = logging.getLogger(__name__)


#: PUs used by live workers, to turn ORT's spinning off where workers share cores
_claimed_pus: Counter[int] = Counter()
_claims_lock = threading.Lock()


class CpuWorker(ThreadWorker):
    """Runs the parts of a plan on one CPU group.

    ``spin=None`` lets ORT's pool threads spin within a run (never after it: see
    :func:`cpu_session`) unless another live worker already uses one of the group's PUs;
    ``True``/``False`` force it.  ``share_weights``
    uses :class:`~staronnx.workers.cpu_weights.SharedWeights` (``weights`` or the process-wide
    one); ``topology`` is only used for memory binding (default: this system's, loaded once).
    Its sessions are dropped in the worker thread at close, which joins ORT's pool threads, so
    no thread is left behind.
    """

    kind = "cpu"

    def __init__(
        self,
        group: CpuGroup,
        part_paths: Sequence[str | os.PathLike[str] | None],
        name: str | None = None,
        spin: bool | None = None,
        *,
        topology: Topology | None = None,
        share_weights: bool = True,
        weights: SharedWeights | None = None,
        lowered: str | None = None,
    ) -> None:
        super().__init__(part_paths, name or f"cpu:{group.name}")
        #: how its threads yield to a latency lane on the same cores (``"idle"`` or ``"nice"``,
        #: see :mod:`staronnx.workers.lanes`); None: they run at their starter's priority
        self.lowered = lowered
        #: what the worker thread runs as once started (``"SCHED_IDLE"``, ``"nice 10"``; None:
        #: not lowered)
        self.priority: str | None = None
        self.group = group
        # what an engine's policy sees of this worker (perf models are keyed by core count)
        self.arch = f"cpu{group.n_cores}"
        self.memory_node = f"numa{group.numa if group.numa is not None else 0}"
        self.n_cores = group.n_cores
        self.share_weights = share_weights
        #: per part: True when its weights come from the shared mapped copy.
        self.weights_shared: list[bool] = [False] * len(self.part_paths)
        #: what happened to memory binding ("bound to NUMA 1", "skipped: ...", "failed: ...").
        self.membind = "not started"
        self.spin: bool | None = spin
        self._spin_arg = spin
        self._topology = topology
        self._weights = weights
        self._claimed = False
        self._sessions: list[ort.InferenceSession] = []
        self._inputs: list[list[str]] = []
        self._outputs: list[list[str]] = []

    # ------------------------------------------------------------------ lifecycle hooks
    def _prepare_start(self) -> None:
        # Spinning is decided before the sessions are built: it is a session option.
        with _claims_lock:
            alone = not any(_claimed_pus[p] for p in self.group.pus)
            _claimed_pus.update(self.group.pus)
        self._claimed = True
        self.spin = alone if self._spin_arg is None else self._spin_arg

    def _start_failure(self, err: BaseException) -> Exception:
        return ModelError(f"{self.name} could not build its sessions: {err}")

    def _release(self) -> None:
        with self._lock, _claims_lock:
            if self._claimed:
                _claimed_pus.subtract(self.group.pus)
                self._claimed = False
        super()._release()

    def _describe(self) -> str:
        return self.group.describe()

    # ------------------------------------------------------------------ tasks
    def run_here(self, part: int, feeds: Feeds, timed: bool = True) -> Outputs:
        """Run a part in the calling thread, which must be this worker's own (see :meth:`spawn`).

        Exceptions propagate to the caller (the engine fails that task's request only), with
        the session-holding frames cleared as in the queued path.
        """
        self._check_own_thread()
        try:
            values = self._sessions[part].run(None, dict(feeds))
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)
            raise
        return dict(zip(self._outputs[part], values))

    # ------------------------------------------------------------------ introspection
    def input_names(self, part: int) -> list[str]:
        return list(self._inputs[part])

    def output_names(self, part: int) -> list[str]:
        return list(self._outputs[part])

    # ------------------------------------------------------------------ worker thread
    def _setup_thread(self) -> None:
        self._pin(self.group.first_pu, lambda: (
            f"; this process may use PUs {format_pus(os.sched_getaffinity(os.getpid()))}. "
            "Build groups from Topology.from_system(), not from a synthetic or XML topology."))
        if self.lowered:  # before the sessions: ORT's pool threads inherit this thread's priority
            self.priority = lower_priority(self.lowered, self.name)
        self.membind = bind_memory(self._topology, self.group.numa_nodes)
        for i, path in enumerate(self.part_paths):
            # a part this worker does not hold: no session, no memory
            session = None if path is None else self._load(i, path)
            self._sessions.append(session)
            self._inputs.append([x.name for x in session.get_inputs()] if session else [])
            self._outputs.append([x.name for x in session.get_outputs()] if session else [])

    def _teardown(self) -> None:
        # Dropping the sessions here joins ORT's pool threads before this thread ends.
        self._sessions.clear()

    def _load(self, index: int, path: Path) -> ort.InferenceSession:
        weights = (self._weights or default_shared_weights()) if self.share_weights else None
        try:
            session, self.weights_shared[index] = cpu_session(path, self.group, bool(self.spin), weights, self.name)
        except Exception as exc:  # noqa: BLE001 - ORT's own error types; reported as ours
            raise ModelError(f"ONNX Runtime cannot load part {index} ({path}): {exc}") from None
        return session


def cpu_session(path: str | os.PathLike[str], group: CpuGroup, spin: bool = True, weights: SharedWeights | None = None,
                who: str = "") -> tuple[ort.InferenceSession, bool]:
    """One part's ONNX Runtime session on ``group``'s cores, as a CPU worker runs it (ours, or
    a StarPU CPU worker's codelet), with its weights from ``weights``' mapped copy (None: a
    private copy); and whether they are shared."""
    so = ort.SessionOptions()
    so.log_severity_level = 4  # a failing run raises its error in Python: no raw red log line beside it
    so.intra_op_num_threads = group.n_cores
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    affinities = group.ort_thread_affinities()
    if affinities:
        so.add_session_config_entry("session.intra_op_thread_affinities", affinities)
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    # Spin while a Run() is active, never after: between two runs the cores belong to the
    # process's other threads (the engine's bookkeeping, the caller that submits the next
    # batch, a server's event loop, a batch job's reader and writer) and to the sessions of the
    # other parts, which have pools of their own on the same cores. A pool spinning on after
    # its run took a core from them exactly when they had work: on crnn_ocr at batch 8 (~1 ms
    # a task, both cores of a 2-core VM to the worker) one that spun on ran 0.74x one that stops
    # (medians; ranges overlap on that drifting VM), 0.64x while another process kept a core
    # busy (ranges apart); googlenet's 50 ms tasks read the same either way
    # (benchmarks/results/cpu-spin-2026-12-07.json).
    so.add_session_config_entry("session.force_spinning_stop", "1")
    model, shared = path, False
    if weights is not None:
        try:
            model, shared = weights.model_for(path, group.numa), True
            # Already optimised (and prepacked): optimising again would only cost time.
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        except Exception as exc:  # noqa: BLE001 - fall back to a private copy
            log.warning("%s: weights of %s not shared (%s); loading a private copy", who, path, exc)
    return ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"]), shared
