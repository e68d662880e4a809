"""staronnx: run ONNX models on every processor of a server at once.

Public API: :func:`partition` cuts a model into a :class:`Plan`; :func:`load_plan` reads one
back. The runtime and serving layers build on plans.
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
from staronnx.partition.api import partition  # noqa: E402  (shadows the subpackage name on purpose)
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.session import InferenceSession

__version__ = "0.1.0"


def load_plan(directory: str) -> Plan:
    """Read a plan folder written by :func:`partition` or ``staronnx partition``."""
    return Plan.load(directory)


__all__ = [
    "partition",
    "load_plan",
    "Plan",
    "Runtime",
    "InferenceSession",
    "StaronnxError",
    "ModelError",
    "PartitionError",
    "PlanError",
    "InputError",
    "DeviceError",
]
