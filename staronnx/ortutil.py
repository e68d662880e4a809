"""Creating ONNX Runtime sessions from in-memory or on-disk models, large ones included."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Sequence

import onnx
import onnxruntime as ort

from staronnx.errors import DeviceError
from staronnx.modelio import PROTOBUF_LIMIT, model_nbytes, save_model


_ORT_ELEMENT_NAMES = {"float32": "float", "float64": "double", "object": "string", "str": "string"}


def ort_type_name(dtype: str) -> str:
    """ORT's NodeArg.type for a numpy dtype name: float32 -> 'tensor(float)', ..."""
    return f"tensor({_ORT_ELEMENT_NAMES.get(dtype, dtype)})"


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
) -> ort.InferenceSession:
    """An ORT session; models over protobuf's 2 GB limit go through a temporary file."""
    so = options or ort.SessionOptions()
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    providers = list(providers or ["CPUExecutionProvider"])
    if not isinstance(model, onnx.ModelProto):
        return ort.InferenceSession(str(model), so, providers=providers)
    if model_nbytes(model) < PROTOBUF_LIMIT:
        return ort.InferenceSession(model.SerializeToString(), so, providers=providers)
    with tempfile.TemporaryDirectory(prefix="staronnx-session-") as tmp:
        path = Path(tmp) / "model.onnx"
        save_model(model, path)
        # ORT reads the external weights while building the session, so the folder can go after.
        return ort.InferenceSession(str(path), so, providers=providers)
