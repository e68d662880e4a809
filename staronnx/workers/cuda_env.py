"""Whether CUDA workers can run here, and on which GPUs (what ``staronnx topology`` and the
CLI's one-line refusals say), and a part that does not fit in a GPU's memory.

Kept apart from the worker (:mod:`staronnx.workers.cuda`), which only drives a GPU: these are
asked before any worker starts, by commands that may never start one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnxruntime as ort

from staronnx.errors import DeviceError
from staronnx.workers.cudart import (INSTALL_HINT, CudaError, CudaRuntime, GpuRuntime, host_runtime_from_env,
                                     runtime_module)

__all__ = ["CUDA_EP", "PartDoesNotFit", "cuda_unavailable_reason", "describe_gpus", "missing_device",
           "visible_cuda_devices"]

log = logging.getLogger("staronnx.workers.cuda")

CUDA_EP = "CUDAExecutionProvider"


@functools.cache
def _preload_cuda_libraries() -> None:
    """Load the CUDA and cuDNN libraries that pip's nvidia-* wheels bring (ORT >= 1.21 offers
    ``preload_dlls``), so the CUDA provider finds them without LD_LIBRARY_PATH (once)."""
    if not hasattr(ort, "preload_dlls"):  # an ORT older than 1.21 has none
        return
    try:
        ort.preload_dlls()
    except Exception as exc:  # noqa: BLE001 - libraries from the system may still be found
        log.debug("onnxruntime.preload_dlls() failed: %s", exc)


# ---------------------------------------------------------------------- availability
def _gpu_runtime() -> GpuRuntime | None:
    """What CUDA workers would drive here: ``$STARONNX_CUDA_RUNTIME``'s stand-in, else CUDA
    itself; None where CUDA is missing."""
    return host_runtime_from_env() or (None if cuda_unavailable_reason() is not None else CudaRuntime())


def visible_cuda_devices() -> int:
    """How many GPUs CUDA workers can use here (0: none, or CUDA missing)."""
    runtime = _gpu_runtime()
    return 0 if runtime is None else int(runtime.device_count())


def describe_gpus(devices: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Each GPU's model, memory and compute capability (:meth:`CudaRuntime.properties`; the
    stand-in says it is one), for results and ``staronnx topology``: every visible GPU, or
    ``devices``. Empty where CUDA is missing; a GPU that cannot be read is left out."""
    runtime = _gpu_runtime()
    if runtime is None:
        return []
    out = []
    for d in range(int(runtime.device_count())) if devices is None else devices:
        with contextlib.suppress(DeviceError):
            out.append(runtime.properties(int(d)))
    return out


def missing_device(device_id: int, count: int) -> str | None:
    """Why GPU ``device_id`` cannot be used where ``count`` are visible, or None when it can."""
    if 0 <= device_id < count:
        return None
    return f"CUDA device {device_id} does not exist: {count} device(s) visible, 0..{count - 1}"


def cuda_unavailable_reason(device_id: int | None = None) -> str | None:
    """``None`` when a CUDA worker can run here, else one message saying what is missing.

    Checks, in order: ONNX Runtime's CUDA execution provider, cuda-bindings, then (only when
    both are there) the CUDA driver and ``device_id``.
    """
    missing = []
    providers = ort.get_available_providers()
    if CUDA_EP not in providers:
        missing.append(
            f"ONNX Runtime's {CUDA_EP} (onnxruntime {ort.__version__} here offers only "
            f"{', '.join(providers) or 'no provider'}; the GPU build is the onnxruntime-gpu "
            "package, which replaces onnxruntime: pip uninstall onnxruntime first)"
        )
    try:
        runtime_module()
    except DeviceError:
        missing.append("NVIDIA's cuda-bindings (the module cuda.bindings.runtime)")
    if missing:
        return f"CUDA workers need {' and '.join(missing)}. Install them with: {INSTALL_HINT}"
    _preload_cuda_libraries()
    try:
        count = CudaRuntime().device_count()
    except CudaError as exc:
        return (f"the CUDA runtime cannot see a GPU ({exc}); check the NVIDIA driver, and that "
                "cuda-bindings' major version is not newer than the driver's CUDA version")
    if count == 0:
        return ("no CUDA device is visible (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return None if device_id is None else missing_device(device_id, count)


#: cudaErrorMemoryAllocation
CUDA_OUT_OF_MEMORY = 2


class PartDoesNotFit(DeviceError):
    """A part's session could not be loaded for lack of GPU memory. A runtime of several
    models then leaves that model off this worker (its other workers run it) rather than
    failing to start (see :func:`staronnx.workers.launch.start_workers`)."""

    def __init__(self, worker: str, part: int, path: Path, cause: str) -> None:
        self.worker = worker
        self.part = part
        self.path = path  # the file the worker loaded: with --precision gpu=fp16, the part's fp16 copy
        super().__init__(f"{worker}: part {part} ({path}) does not fit in the GPU's memory: {cause}")


def _out_of_memory(text: str) -> bool:
    """Whether ONNX Runtime's error text says the device ran out of memory (its CUDA
    allocator's "Failed to allocate memory", cudaErrorMemoryAllocation, "CUDA failure 2")."""
    low = text.lower()
    return ("out of memory" in low or "failed to allocate memory" in low or "cudaerrormemoryallocation" in low
            or "cuda failure 2:" in low)
