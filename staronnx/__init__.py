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

from staronnx.errors import (
    DeviceError,
    InputError,
    ModelError,
    PartitionError,
    PlanError,
    StaronnxError,
)
from staronnx.plan import Plan
from staronnx.partition.api import partition  # shadows the subpackage name on purpose
from staronnx.partition.spec import PartitionSpec
from staronnx.runtime.models import ModelOverloaded, ServiceTarget
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import CudaOptions, RuntimeSpec
from staronnx.workers.layout import MachineSpec
from staronnx.compat import InferenceSession, SessionSpec
from staronnx.serving.server import OverloadError, Server, ServerClosed
from staronnx.serving.spec import ServeSpec

__version__ = "0.1.0"


def load_plan(directory: str) -> Plan:
    """Read a plan folder written by :func:`partition` or ``staronnx partition``."""
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
