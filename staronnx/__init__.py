"""staronnx: run ONNX models on every processor of a server at once.

Public API: :func:`partition` cuts a model into a :class:`Plan`; :func:`load_plan` reads one
back; a :class:`Runtime` runs batches of a plan (or of several, each with its
:class:`ServiceTarget`) over the CPU and CUDA workers of a :class:`MachineSpec`, as its
:class:`RuntimeSpec` says; a :class:`Server`
batches single-sample requests for a runtime (fixed-size batches as in the StarONNX papers, or
Triton-style with ``max_delay``); :class:`InferenceSession` gives a model or plan
ONNX Runtime's call shape. The rest of :mod:`staronnx.serving` (arrival processes, load generator, metrics) and
:mod:`staronnx.bench` are for measuring.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from staronnx.errors import (
    DeviceError,
    InputError,
    ModelError,
    PartitionError,
    PlanError,
    StaronnxError,
)

if TYPE_CHECKING:
    from staronnx.compat import InferenceSession, SessionSpec
    from staronnx.partition.api import partition
    from staronnx.partition.spec import PartitionSpec
    from staronnx.plan import Plan
    from staronnx.runtime.models import ModelOverloaded, ServiceTarget
    from staronnx.runtime.runtime import Runtime
    from staronnx.runtime.spec import RuntimeSpec
    from staronnx.serving.server import OverloadError, Server, ServerClosed
    from staronnx.serving.spec import ServeSpec
    from staronnx.workers.cuda import CudaOptions
    from staronnx.workers.layout import MachineSpec

__version__ = "0.1.0"

#: the public names and the modules they come from, imported on first use: ``import staronnx``
#: (which every command line pays before its first line of work) took 0.3 s of CPU importing
#: the runtime, the partitioner, the server and the ORT facade whether the command used them or not
_LAZY: dict[str, str] = {
    "Plan": "staronnx.plan",
    "partition": "staronnx.partition.api",
    "PartitionSpec": "staronnx.partition.spec",
    "ModelOverloaded": "staronnx.runtime.models",
    "ServiceTarget": "staronnx.runtime.models",
    "Runtime": "staronnx.runtime.runtime",
    "CudaOptions": "staronnx.runtime.spec",
    "RuntimeSpec": "staronnx.runtime.spec",
    "MachineSpec": "staronnx.workers.layout",
    "InferenceSession": "staronnx.compat",
    "SessionSpec": "staronnx.compat",
    "OverloadError": "staronnx.serving.server",
    "Server": "staronnx.serving.server",
    "ServerClosed": "staronnx.serving.server",
    "ServeSpec": "staronnx.serving.spec",
}


def __getattr__(name: str) -> Any:
    """A public name of :data:`_LAZY`, imported now and kept (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'staronnx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


class _Package(types.ModuleType):
    """The package's module: ``staronnx.partition`` stays the function when the subpackage of
    that name is imported (the import system sets a subpackage on its parent)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "partition" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def load_plan(directory: str) -> Plan:
    """Read a plan folder written by :func:`partition` or ``staronnx partition``."""
    from staronnx.plan import Plan

    return Plan.load(directory)


__all__ = [
    "partition",
    "PartitionSpec",
    "load_plan",
    "Plan",
    "Runtime",
    "RuntimeSpec",
    "MachineSpec",
    "CudaOptions",
    "ServiceTarget",
    "ModelOverloaded",
    "InferenceSession",
    "SessionSpec",
    "Server",
    "ServeSpec",
    "OverloadError",
    "ServerClosed",
    "StaronnxError",
    "ModelError",
    "PartitionError",
    "PlanError",
    "InputError",
    "DeviceError",
]
