"""ONNX Runtime's exception classes, raised by staronnx's session.

A script written for ORT catches ORT's classes (``except onnxruntime...InvalidArgument``,
``Fail``); staronnx's own code catches its :class:`~staronnx.errors.StaronnxError` tree. Each
error a session raises is of both, so neither kind of ``except`` misses it.
"""

from __future__ import annotations

import types

from onnxruntime.capi import onnxruntime_pybind11_state as _ort_state

from staronnx.errors import InputError, ModelError, StaronnxError
from staronnx.runtime.task import TaskError


class InvalidArgument(InputError, _ort_state.InvalidArgument):  # type: ignore[misc]
    """A feed or output name ORT would reject with INVALID_ARGUMENT; caught by either
    ``except onnxruntime...InvalidArgument`` (ORT scripts) or ``except ValueError`` (staronnx's)."""


class NoSuchFile(ModelError, _ort_state.NoSuchFile):  # type: ignore[misc]
    """The model file does not exist (ORT's NO_SUCHFILE)."""


class InvalidProtobuf(ModelError, _ort_state.InvalidProtobuf):  # type: ignore[misc]
    """The model is not a parsable ONNX protobuf (ORT's INVALID_PROTOBUF)."""


class NoGraph(ModelError, _ort_state.InvalidArgument):  # type: ignore[misc]
    """The model has no graph: empty bytes or an empty file (ORT's INVALID_ARGUMENT)."""


class Terminated(StaronnxError, RuntimeError, _ort_state.Fail):  # type: ignore[misc]
    """A run whose RunOptions has ``terminate`` set (ORT's FAIL; a RuntimeError as before)."""


class NotRecorded(StaronnxError, _ort_state.Fail):  # type: ignore[misc]
    """get_provider_graph_assignment_info() without the config entry that records it (ORT's Fail)."""


#: TaskError classes that are also ORT's, by ORT's class (None: an ORT class that cannot be a base)
_task_error_types: dict[type, type[TaskError] | None] = {}


def ort_task_error(exc: TaskError) -> TaskError:
    """A failed part's error that is also of ONNX Runtime's own class (``Fail``,
    ``RuntimeException``, ...), so ``except`` clauses written for ORT still catch it."""
    cause = exc.__cause__
    if not isinstance(cause, Exception) or not type(cause).__module__.startswith("onnxruntime"):
        return exc
    kind = type(cause)
    if kind not in _task_error_types:
        try:
            _task_error_types[kind] = types.new_class(kind.__name__, (TaskError, kind),
                                                      exec_body=lambda ns: ns.update(__module__=__name__))
        except TypeError:
            _task_error_types[kind] = None
    compat = _task_error_types[kind]
    if compat is None:
        return exc
    err: TaskError = compat.__new__(compat)
    TaskError.__init__(err, exc.part, exc.worker, cause)
    return err
