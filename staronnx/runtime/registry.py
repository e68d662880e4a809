"""Engines by name, so ``Runtime`` has one setup path and never imports the engines above it.

An engine module registers a factory when imported; :data:`ENGINE_MODULES` names the module of
each built-in engine, loaded on first use (as an entry point would be), so ``import staronnx``
never loads StarPU's binding.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from staronnx.errors import StaronnxError
from staronnx.plan import Plan
from staronnx.runtime.models import ModelSet
from staronnx.runtime.predictor import PerfPredictor
from staronnx.runtime.spec import EngineSettings as EngineSettings  # what every engine factory takes
from staronnx.runtime.task import RequestFuture
from staronnx.runtime.trace import Tracer

#: engine name -> module that registers it when imported
ENGINE_MODULES = {"native": "staronnx.runtime.engine", "starpu": "staronnx.engines.starpu"}


class Worker(Protocol):
    """What a runtime's users see of a worker (:attr:`Engine.workers`, ``Runtime.workers``):
    its name, its kind (``cpu``, ``cuda``, ``lane``), its perf-model architecture and its
    thread's native id (None before it started: a caller on that thread must not wait for the
    worker's own work). The native engine's workers (:class:`staronnx.workers.base.Worker`) and
    the starpu engine's have these and more; a caller that needs more of a CUDA worker asks
    ``isinstance(w, CudaWorker)``."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def arch(self) -> str: ...
    @property
    def native_id(self) -> int | None: ...


class Engine(Protocol):
    """What ``Runtime`` drives: the contract both the native and the starpu engine keep."""

    @property
    def tracer(self) -> Tracer | None: ...

    @property
    def predictor(self) -> PerfPredictor | None:
        """The perf models it learns into staronnx's store (None: it keeps its own, as StarPU does)."""
        ...

    @property
    def workers(self) -> Sequence[Worker]: ...  # what tasks run on

    def submit(self, feeds: Mapping[str, np.ndarray], model: int = 0, arrival: float | None = None) -> RequestFuture:
        """Queue one batch of hosted model ``model`` (its index), whose oldest request arrived
        at ``arrival`` (``time.perf_counter()``; None: now); inputs are already checked."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def model_stats(self, model: int) -> dict[str, Any]:
        """One hosted model's requests, deadline misses, busy shares and tasks."""
        ...

    def close(self, timeout: float | None = 30.0) -> None:
        """Drain or cancel the requests, stop the engine and free the workers it started."""
        ...


#: an engine's factory: every model to host (a plan is a set of one), and the settings
EngineFactory = Callable[[Plan | ModelSet, EngineSettings], Engine]
_FACTORIES: dict[str, EngineFactory] = {}


def register_engine(name: str, factory: EngineFactory) -> None:
    """Make ``Runtime(engine=name)`` build its engine with ``factory(plan, settings)``."""
    _FACTORIES[name] = factory


def engine_factory(name: str) -> EngineFactory:
    """The factory registered under ``name``, importing its module on first use."""
    if name not in _FACTORIES and name in ENGINE_MODULES:
        importlib.import_module(ENGINE_MODULES[name])
    try:
        return _FACTORIES[name]
    except KeyError:
        names = sorted({*ENGINE_MODULES, *_FACTORIES})
        raise StaronnxError(f"unknown engine {name!r}; choose one of {', '.join(names)}") from None
