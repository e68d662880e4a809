"""Predictions from calibrated perf models, in the form policies ask for them.

Models come from the on-disk store (filled by ``staronnx calibrate``) and keep learning while
serving. How much, is StarPU's ``STARPU_CALIBRATE`` (``calibrate`` here):

- 0 (default): a task's measured time is recorded only while its (part, arch, footprint)
  entry still needs samples; a calibrated entry is frozen;
- 1: every execution is recorded, so models follow the machine as it serves (a slower
  neighbour, another clock speed) and the simulator replays what serving really saw;
- 2: the stored models are ignored and, at close, replaced by what this run measured.

A runtime hosting several plans numbers their parts globally; ``parts`` then says which
(plan hash, own part index) each global part is, so every model keeps its own stored models
and joins or leaves a shared runtime without recalibration.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

from staronnx.errors import StaronnxError
from staronnx.perfmodels import BusModel, Footprint, HistoryModel, PerfModelStore
from staronnx.perfmodels.helpcost import HelpCost
from staronnx.perfmodels.store import PerfModelStoreReadOnly, PerfModelStoreReadOnlyWarning
from staronnx.runtime.datawizard import price, task_copies
from staronnx.runtime.sched import TaskView, WorkerInfo

if TYPE_CHECKING:
    from staronnx.runtime.models import ModelSet


#: StarPU's STARPU_CALIBRATE values (see the module docstring)
CALIBRATE_MODES = (0, 1, 2)


def calibrate_mode(value: int | str | None) -> int:
    """``value``, or ``$STARONNX_CALIBRATE`` when None (default 0), checked."""
    raw = os.environ.get("STARONNX_CALIBRATE", "0") if value is None else value
    try:
        mode = int(raw)
    except (TypeError, ValueError):
        mode = -1
    if mode not in CALIBRATE_MODES:
        raise StaronnxError(f"calibrate (or $STARONNX_CALIBRATE) must be 0, 1 or 2, got {raw!r}")
    return mode


class PerfPredictor:
    """Predictor over history models per (part, arch) and a bus model.

    ``parts`` (global part -> (plan hash, its own part index)) serves several plans at once;
    without it every part is ``plan_hash``'s own."""

    def __init__(self, plan_hash: str, store: PerfModelStore | None, bus: BusModel | None = None,
                 calibrate: int = 0, parts: Sequence[tuple[str, int]] | None = None):
        self.plan_hash = plan_hash
        self._parts = list(parts) if parts is not None else None
        self.store = store
        self.calibrate = calibrate_mode(calibrate)
        self.bus = bus or (store.load_bus() if store is not None else BusModel())
        #: what a CPU task costs the GPU on this host, as measured and stored (None: not
        #: measured; the policies charge their default): the dmda family reads it at setup
        self.help_cost: HelpCost | None = store.load_help_cost() if store is not None else None
        self._models: dict[tuple[int, str], HistoryModel] = {}
        self._lock = threading.Lock()
        self._read_only_warned = False

    @classmethod
    def for_models(cls, models: ModelSet, store: PerfModelStore | None, calibrate: int = 0) -> PerfPredictor:
        """The predictor of a runtime hosting ``models`` (one plan or several)."""
        return cls(models.models[0].plan.hash, store, calibrate=calibrate,
                   parts=None if models.single else [(m.plan.hash, local) for m, local in models.owner])

    def source(self, part: int) -> tuple[str, int]:
        """(plan hash, own part index) of global part ``part``: where its model is stored."""
        return (self.plan_hash, part) if self._parts is None else self._parts[part]

    def model(self, part: int, arch: str) -> HistoryModel:
        key = (part, arch)
        with self._lock:
            if key not in self._models:
                plan_hash, local = self.source(part)
                self._models[key] = (
                    self.store.load(plan_hash, local, arch)
                    if self.store is not None and self.calibrate < 2
                    else HistoryModel(local, arch)
                )
            return self._models[key]

    def exec_time(self, task: TaskView, worker: WorkerInfo) -> float:
        fp = task.footprint
        if fp is None:
            return 0.0
        return self.model(task.part, worker.arch).predict(fp)

    def transfer_time(self, task: TaskView, worker: WorkerInfo) -> float:
        """The bus time of exactly the copies the engine would issue for ``task`` on
        ``worker`` (:func:`~staronnx.runtime.datawizard.task_copies`: the fetches of inputs
        not valid on its node, from their cheapest copies, and the write-backs of final
        outputs from a GPU)."""
        node = worker.memory_node
        if not task.outputs and all(node in d.valid_on or d.nbytes <= 0 for d in task.inputs):
            return 0.0
        predict = self.bus.predict
        copies = task_copies(((d.name, d.nbytes, d.valid_on) for d in task.inputs), node, task.outputs, predict)
        return price(copies, predict)

    def needs_samples(self, part: int, arch: str, fp: Footprint) -> bool:
        """Whether the engine should record this execution (always, unless ``calibrate`` is 0)."""
        return self.calibrate >= 1 or self.model(part, arch).needs_samples(fp)

    def record(self, part: int, arch: str, fp: Footprint, seconds: float) -> None:
        self.model(part, arch).record(fp, seconds)

    def save(self) -> None:
        """Merge samples learnt while serving into the store (atomically, under its lock)."""
        if self.store is None:
            return
        with self._lock:
            models = [(self.source(part)[0], m) for (part, _), m in self._models.items()]
        try:
            for plan_hash, m in models:
                if m.unsaved_count:  # calibrate=2 replaces the stored model
                    (self.store.save if self.calibrate >= 2 else self.store.commit)(plan_hash, m)
        except PerfModelStoreReadOnly as exc:
            # serving from a read-only home: the models were read, what was learnt stays here
            if not self._read_only_warned:
                self._read_only_warned = True
                warnings.warn(f"{exc}; what this run learnt is kept in memory only",
                              PerfModelStoreReadOnlyWarning, stacklevel=2)
