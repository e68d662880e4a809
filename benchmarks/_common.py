"""Shared helpers of the ratio benchmarks: timing loops run side by side in one process."""

from __future__ import annotations

import atexit
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from staronnx.workers.cuda import CudaOptions

REPO = Path(__file__).resolve().parents[1]
#: the test and benchmark models, tracked in the repository so that a clone needs nothing beside it
MODELS = REPO / "models"
GOOGLENET = MODELS / "googlenet.onnx"
#: the seven real exported models with their reference inputs and outputs (see its README)
REAL = MODELS / "real"


def rate(fn: Callable[[], int], seconds: float) -> float:
    """Items per second of ``fn`` (which returns how many items it did), over ``seconds``."""
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        done += fn()
    return done / (time.perf_counter() - start)


def steal_seconds() -> float | None:
    """CPU time the hypervisor gave to others while this VM's vCPUs wanted to run (``steal``
    in /proc/stat, all CPUs), so far; None where the kernel does not say (not Linux). A
    benchmark prints how much of it fell in a point: on a shared VM a vCPU descheduled for
    milliseconds stalls every thread at once, which reads as a latency tail of our own
    unless the point says it happened."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def alternate(measures: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Median of each measure over rounds taken in turn, so noise hits them alike."""
    samples: dict[str, list[float]] = {k: [] for k in measures}
    for _ in range(rounds):
        for name, fn in measures.items():
            samples[name].append(fn())
    return {k: statistics.median(v) for k, v in samples.items()}


def scratch_dir(prefix: str) -> Path:
    """A temporary folder for a benchmark's plans and models, removed when the process exits
    (a benchmark run, or the test that runs one, leaves nothing in /tmp)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def cuda_worker_options(device: str) -> tuple[CudaOptions, str]:
    """The CUDA workers' options of a host-cost benchmark, and the words its header says:
    ``device="host"`` stands HostRuntime in for CUDA (runs anywhere), ``"cuda"`` drives the GPU
    (ONNX Runtime's CUDA provider), or exits with the one line that says what is missing, so a
    GPU run measures the real thing or nothing."""
    if device == "host":
        from staronnx.workers.cudart import HostRuntime

        return CudaOptions(runtime=HostRuntime()), "CUDA workers on HostRuntime"
    from staronnx.workers.cuda import cuda_unavailable_reason

    reason = cuda_unavailable_reason(0)
    if reason is not None:
        raise SystemExit(f"--device cuda: {reason}")
    return CudaOptions(), "CUDA workers on GPU 0"
