"""Shared helpers of the ratio benchmarks: timing loops run side by side in one process."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
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


def summary(values: list[float]) -> dict[str, float]:
    """The median of a setup's repeats and their range, as every result file gives them."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio(a: list[float], b: list[float]) -> dict[str, float | bool]:
    """Median of ``a``'s repeats over median of ``b``'s, the ratio's low and high ends from the
    ranges, and whether the ranges are apart: a ratio is claimed only then."""
    return {"median": statistics.median(a) / statistics.median(b), "low": min(a) / max(b), "high": max(a) / min(b),
            "ranges_apart": min(a) > max(b) or max(a) < min(b)}


def git_head(tree: Path = REPO) -> str:
    """The commit a tree is at (a result file's provenance)."""
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def git_dirty(tree: Path = REPO) -> bool:
    """Whether the library or the benchmarks differ from that commit (the figures then come
    from uncommitted code, which a result file says)."""
    return bool(subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--", "staronnx", "benchmarks"],
                               capture_output=True, text=True).stdout.strip())


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


#: what ``staronnx serve`` prints of each door once it listens (the host may be a name or an IPv6
#: address in brackets; HTTP and metrics are https where it serves TLS)
SERVE_ADDRESSES = {"http": r"HTTP \(KServe v2\) on https?://([\w.\[\]:]+)",
                   "grpc": r"gRPC \(KServe v2\) on ([\w.\[\]:]+)",
                   "metrics": r"metrics on (https?://[\w.\[\]:]+/metrics)"}


class ServeNotReady(RuntimeError):
    """``staronnx serve`` exited, or did not say ``ready`` in time; the message's first line
    names its last output line, the lines after it the output's tail."""


@dataclass
class ServeProcess:
    """A ``staronnx serve`` subprocess that said it is ready, with every line it printed (a
    thread keeps reading, so its pipe never fills; benchmarks read summaries and tests read
    errors from them). The one way the tests and the benchmarks start and stop a server."""

    proc: subprocess.Popen[str]
    lines: list[str]
    reader: threading.Thread
    signalled: bool = False

    def address(self, door: str) -> str:
        """Where a client on this machine reaches ``door`` (``http``, ``grpc`` or ``metrics``):
        the address the server printed, a host that listens everywhere as loopback (a TLS
        certificate names 127.0.0.1, not 0.0.0.0)."""
        for line in self.lines:  # printed before 'ready': found near the top
            found = re.search(SERVE_ADDRESSES[door], line)
            if found is not None:
                return found.group(1).replace("0.0.0.0", "127.0.0.1").replace("[::]", "[::1]")
        raise ServeNotReady(f"the server printed no {door} address:\n" + "\n".join(self.lines[-50:]))

    def port(self, door: str) -> int:
        """The port of ``door``, for a client that builds its own address."""
        return int(self.address(door).removesuffix("/metrics").rsplit(":", 1)[1])

    http = property(lambda self: self.address("http"), doc="host:port of KServe v2 over HTTP")
    grpc = property(lambda self: self.address("grpc"), doc="host:port of KServe v2 over gRPC")
    metrics = property(lambda self: self.address("metrics"), doc="the Prometheus metrics URL")

    def rss_mb(self) -> float:
        """Its resident memory, MB (NaN for a zombie: the kernel says none), what the probes of
        memory per connection compare."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def sigterm(self) -> None:
        """SIGTERM, as a user stops the server: it drains, then exits. Once only: a second one
        ends a draining server at once, so :meth:`stop` sends none after this."""
        self.signalled = True
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 120.0) -> int:
        """:meth:`sigterm` (unless sent), then the exit code once every line is read; killed
        after ``timeout`` s (-9, so a check for 0 fails and shows the lines, and nothing is left
        running): a server drains for up to 30 s, longer on a loaded host."""
        if self.proc.poll() is None and not self.signalled:
            self.sigterm()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(10)  # the last lines (bounded: a child of the server may hold the pipe)
        return self.proc.returncode


def start_serve(cmd: list[str], env: dict[str, str], timeout: float = 120.0) -> ServeProcess:
    """Start ``cmd`` (a ``staronnx serve`` command line) and wait for its ``ready`` line; on
    failure the process is killed and :class:`ServeNotReady` raised with its last lines."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("ready"):
                ready.set()
        ready.set()  # its output ended: it exited before 'ready'

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not ready.wait(timeout) or not any(line.startswith("ready") for line in lines) or proc.poll() is not None:
        proc.kill()
        proc.wait()
        reader.join(10)
        last = lines[-1] if lines else "no output"
        raise ServeNotReady(f"the server did not start: {last}\n" + "\n".join(lines[-50:]))
    return ServeProcess(proc, lines, reader)
