"""Creating ONNX Runtime sessions from in-memory or on-disk models, large ones included."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Sequence

import onnx
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_inference_collection import InferenceSession as OrtSession

from staronnx.errors import DeviceError
from staronnx.modelio import PROTOBUF_LIMIT, model_nbytes, save_model


#: ORT's log severities: 3 logs errors, 4 only fatal ones. Every error ORT logs while running a
#: session also comes back to Python as an exception, which staronnx words in one line; the log
#: would print it a second time, raw and red, on stderr (the C++ logger bypasses Python's).
QUIET = 4

_ORT_ELEMENT_NAMES = {"float32": "float", "float64": "double", "object": "string", "str": "string"}

# ``OrtSession`` (imported above) is ONNX Runtime's own class, whatever a program put at
# ``onnxruntime.InferenceSession`` (``onnxruntime.InferenceSession = staronnx.InferenceSession``,
# the one-line switch done for a whole program): staronnx's own sessions must be ORT's, or each
# would partition its model again, with itself.


def ort_type_name(dtype: str) -> str:
    """ORT's NodeArg.type for a plan's dtype: a numpy name as a tensor's (float32 ->
    'tensor(float)'), and ORT's own type string as it is for what is not a tensor
    ('seq(tensor(int64))', 'optional(tensor(float))', 'map(string,tensor(float))')."""
    if "(" in dtype:
        return dtype
    return f"tensor({_ORT_ELEMENT_NAMES.get(dtype, dtype)})"


def value_type_name(tp: onnx.TypeProto) -> str:
    """ORT's type string of an ONNX value type ('tensor(float)', 'seq(tensor(int64))',
    'optional(seq(tensor(float)))', 'map(int64,tensor(float))'), as ``NodeArg.type`` says it."""
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        return f"tensor({_element_name(tp.tensor_type.elem_type)})"
    if kind == "sparse_tensor_type":
        return f"sparse_tensor({_element_name(tp.sparse_tensor_type.elem_type)})"
    if kind == "sequence_type":
        return f"seq({value_type_name(tp.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({value_type_name(tp.optional_type.elem_type)})"
    if kind == "map_type":
        return f"map({_element_name(tp.map_type.key_type)},{value_type_name(tp.map_type.value_type)})"
    return "unknown"


def _element_name(elem_type: int) -> str:
    """ORT's name of an element type: float, double, int64, string, bool, float16, ..."""
    if elem_type == onnx.TensorProto.UNDEFINED:
        return "undefined"
    return onnx.TensorProto.DataType.Name(elem_type).lower()


def providers_for(device: str) -> list[str]:
    """ORT providers for a device name, failing clearly when the device's provider is absent."""
    available = ort.get_available_providers()
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise DeviceError(
                "device 'cuda' needs ONNX Runtime's CUDAExecutionProvider, which this install "
                f"lacks (available: {', '.join(available)}); install staronnx[gpu] "
                "(onnxruntime-gpu) on a machine with an NVIDIA GPU"
            )
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    raise DeviceError(f"unknown device {device!r}; use 'cpu' or 'cuda'")


@contextlib.contextmanager
def cuda_capture_safe() -> Iterator[None]:
    """Run the block in CUDA's thread-local stream-capture mode (cudaThreadExchangeStreamCaptureMode),
    so a plain CUDA session created or run here neither fails with error 900 nor breaks a CUDA
    graph that a staronnx worker captures meanwhile in another thread. A no-op without
    cuda-bindings (no CUDA call can happen then)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        yield
        return
    modes = cudart.cudaStreamCaptureMode
    err, prev = cudart.cudaThreadExchangeStreamCaptureMode(modes.cudaStreamCaptureModeThreadLocal)
    try:
        yield
    finally:
        if int(err) == 0:
            cudart.cudaThreadExchangeStreamCaptureMode(prev)


def make_session(
    model: onnx.ModelProto | str | os.PathLike[str],
    *,
    optimize: bool = True,
    providers: Sequence[str | tuple[str, dict[str, str]]] | None = None,
    options: ort.SessionOptions | None = None,
) -> OrtSession:
    """An ORT session; models over protobuf's 2 GB limit go through a temporary file.

    Without ``options``, ORT logs nothing below a fatal error (:data:`QUIET`): its errors reach
    the caller as exceptions, which partition, verify and the probes summarise in one line."""
    so = options
    if so is None:
        so = ort.SessionOptions()
        so.log_severity_level = QUIET
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    providers = list(providers or ["CPUExecutionProvider"])
    if not isinstance(model, onnx.ModelProto):
        return OrtSession(str(model), so, providers=providers)
    if model_nbytes(model) < PROTOBUF_LIMIT:
        return OrtSession(model.SerializeToString(), so, providers=providers)
    with tempfile.TemporaryDirectory(prefix="staronnx-session-") as tmp:
        path = Path(tmp) / "model.onnx"
        save_model(model, path)
        # ORT reads the external weights while building the session, so the folder can go after.
        return OrtSession(str(path), so, providers=providers)


def quiet_ort_log() -> None:
    """Sessions that set no log level of their own (a plan's reference sessions) log nothing below
    a fatal error either: a command's user reads ORT's errors as staronnx's one line, not twice."""
    ort.set_default_logger_severity(QUIET)


#: ``[ONNXRuntimeError] : 1 : FAIL : `` before ORT's message (and what a task error put before it)
_ORT_PREFIX = re.compile(r"^.*?\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*\w+\s*:\s*", re.DOTALL)
#: ``Non-zero status code returned while running GRU node. Name:'/gru/GRU' Status Message: ...``
_NODE_FAILED = re.compile(r"Non-zero status code returned while running (\w+) node\. Name:'([^']*)' "
                          r"Status Message:\s*(.*)", re.DOTALL)
#: a C++ source location ORT puts before some messages: ``concatbase.h:135 PrepareForComputeImpl ``
_SOURCE_LOCATION = re.compile(r"^\S+\.(?:h|cc|cpp|cu):\d+ \S+ ")


def ort_failure(exc: BaseException) -> tuple[str | None, str | None, str]:
    """(op type, node name, message) of an error ONNX Runtime raised while running a model (or a
    staronnx task error whose cause it is), in one line without ORT's prefixes and source
    locations; op type and node name are None where ORT named no node."""
    cause = exc.__cause__ if exc.__cause__ is not None and type(exc.__cause__).__module__.startswith("onnxruntime") \
        else exc
    text = _ORT_PREFIX.sub("", str(cause).strip(), count=1)
    op = node = None
    found = _NODE_FAILED.search(text)
    if found is not None:
        op, node, text = found.group(1), found.group(2), found.group(3)
    text = _SOURCE_LOCATION.sub("", text.strip())
    return op, node, " ".join(text.split()) or type(cause).__name__
