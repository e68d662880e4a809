"""Shared helpers of the ratio benchmarks: timing loops run side by side in one process."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
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


#: what ``staronnx serve`` prints of each door once it listens (the HTTP host may be a name or an
#: IPv6 address in brackets)
SERVE_ADDRESSES = {"http": r"HTTP \(KServe v2\) on http://([\w.\[\]:]+)", "grpc": r"gRPC \(KServe v2\) on ([\w.\[\]:]+)",
                   "metrics": r"metrics on (http://[\w.\[\]:]+/metrics)"}


class ServeNotReady(RuntimeError):
    """``staronnx serve`` exited, or did not say ``ready`` in time; the message's first line
    names its last output line, the lines after it the output's tail."""


@dataclass
class ServeProcess:
    """A ``staronnx serve`` subprocess that said it is ready, with every line it printed (a
    thread keeps reading, so its pipe never fills; a benchmark reads summaries from them)."""

    proc: subprocess.Popen[str]
    lines: list[str]

    def address(self, door: str) -> str:
        """The address the server printed for ``door`` (``http``, ``grpc`` or ``metrics``)."""
        found = re.search(SERVE_ADDRESSES[door], "\n".join(self.lines))
        if found is None:
            raise ServeNotReady(f"the server printed no {door} address:\n" + "\n".join(self.lines[-20:]))
        return found.group(1)


def start_serve(cmd: list[str], env: dict[str, str], timeout: float = 120.0) -> ServeProcess:
    """Start ``cmd`` (a ``staronnx serve`` command line) and wait for its ``ready`` line; on
    failure the process is killed and :class:`ServeNotReady` raised."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("ready"):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(timeout) or proc.poll() is not None:
        proc.kill()
        proc.wait()
        last = lines[-1] if lines else "no output"
        raise ServeNotReady(f"the server did not start: {last}\n" + "\n".join(lines[-20:]))
    return ServeProcess(proc, lines)
