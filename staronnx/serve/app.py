"""``staronnx serve``'s process: models, the three listeners, one event loop, graceful shutdown.

One asyncio loop runs the HTTP API, the gRPC API and the metrics endpoint; the batchers and
the runtimes run in their own threads, and the loop only awaits their futures, so a slow
model never blocks the listeners. On SIGTERM/SIGINT readiness turns false; a request whose
body is still arriving, and every inference request sent from then on, is answered 503 /
UNAVAILABLE (never reset, never held); once every request already accepted is answered (or
``--drain-timeout`` passed) the listeners close, each batcher drains, each runtime closes, and
the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import importlib.metadata
import re
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from staronnx.errors import StaronnxError
from staronnx.serve.metrics import ServeMetrics
from staronnx.serve.models import ModelEndpoint
from staronnx.serving.collector import full_collections_every
from staronnx.serving.server import hold_frozen, release_frozen

#: ``staronnx serve --gc-interval``'s default: seconds between full cycle collections
GC_INTERVAL_S = 30.0


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30}


def parse_size(text: str) -> int:
    """Bytes from ``64MiB``, ``10MB``, ``512k`` or a bare number of bytes."""
    m = _SIZE.match(text)
    if not m:
        raise StaronnxError(f"sizes look like 64MiB, 10MB, 512KiB or 1048576; got {text!r}")
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if value < 1:
        raise StaronnxError(f"a size must be at least 1 byte, got {text!r}")
    return value


def model_names(plans: list[Path], names: list[str] | None) -> list[str]:
    """Each plan's model name: ``--name`` in order, else the plan folder's name; unique."""
    if names and len(names) != len(plans):
        raise StaronnxError(f"--name given {len(names)} time(s) for {len(plans)} plan(s): give one per plan, in order")
    out = list(names) if names else [p.resolve().name for p in plans]
    for n in out:
        if not n or "/" in n:
            raise StaronnxError(f"model name {n!r} cannot be used in a URL; choose another with --name")
    dupes = sorted({n for n in out if out.count(n) > 1})
    if dupes:
        raise StaronnxError(f"two plans would be served as {dupes[0]!r}; tell them apart with --name")
    return out


@dataclass
class Listen:
    """Where to listen; a port of 0 takes a free one (the bound ports are printed)."""

    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    max_body: int = 64 * 2**20
    drain_timeout: float = 30.0


#: the protocol extensions this server serves, by Triton's names (a client may test for them):
#: binary tensors over HTTP, the classification output parameter, model configuration,
#: statistics, and the repository index (read-only: loading and unloading are refused)
EXTENSIONS = ["binary_tensor_data", "classification", "model_configuration", "model_repository", "statistics"]


def server_metadata(extensions: Sequence[str] = ("binary_tensor_data",)) -> dict[str, object]:
    """The server metadata; ``extensions``: those the front end calling serves (``staronnx
    serve``'s own: :data:`EXTENSIONS`)."""
    return {"name": "staronnx", "version": _version(), "extensions": list(extensions)}


def _version() -> str:
    """The installed distribution's version (pyproject reads it from ``staronnx.__version__``)."""
    try:
        return importlib.metadata.version("staronnx")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree on PYTHONPATH
        return "unknown"


#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: largest block glibc may serve from its heaps instead of mapping it (its own ceiling on 64 bits)
KEEP_BLOCKS_UP_TO = 32 * 2**20

#: free memory glibc keeps at the top of a heap before giving it back to the system
KEEP_FREE_UP_TO = 256 * 2**20


def keep_freed_memory(blocks: int = KEEP_BLOCKS_UP_TO, free: int = KEEP_FREE_UP_TO) -> bool:
    """Have glibc's malloc keep the memory a request frees for the next one, instead of handing
    it back to the kernel; True where that was applied (glibc), False elsewhere (no change).

    Why: a server's requests allocate the same multi-MB buffers over and over (a request body,
    the JSON parser's and numpy's temporaries, a batch). With glibc's defaults a block over the
    mmap threshold is mapped for each request and unmapped when freed, and a heap is trimmed as
    soon as 128 KiB sit free at its top, so request after request faults its buffers in again,
    page by page, each page zeroed by the kernel first. Measured: 330-520 page faults per 2.6 MB
    JSON request on this server (of 661 pages), 2-11 with these settings; an aiohttp loop that
    only receives 2.9 MB bodies spent 2.5-2.9 ms of CPU on each, 1.3 ms with them. The process
    keeps what it used at its peak (about ``--max-body`` times the requests in flight) instead
    of returning it between requests, which is what a long-running server wants.

    Both settings go together: a trim threshold alone also fixes the mmap threshold at its
    128 KiB default, so every large block would be mapped and unmapped (4.8 ms in that loop).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, Windows): its allocator has no such knob
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not mallopt(_M_MMAP_THRESHOLD, blocks):  # musl's mallopt accepts nothing
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, free))


def _bind(host: str, port: int, what: str) -> socket.socket:
    """A listening socket, or one clear line naming the port and the flag to change."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=1024)
    except (OSError, socket.gaierror) as exc:
        raise StaronnxError(f"cannot listen on {host}:{port} for {what}: {exc.strerror or exc} "
                            f"(choose another --{what}-port, or 0 for a free one)") from None


async def serve(models: Sequence[ModelEndpoint], metrics: ServeMetrics, listen: Listen,
                say: Callable[[str], None] = print, gc_interval: float = GC_INTERVAL_S,
                colocate: Callable[[], contextlib.AbstractContextManager[int | None]] | None = None,
                colocate_on: str = "CUDA driver's core") -> None:
    """Serve ``models`` until SIGTERM/SIGINT; then drain and close them. Memory the requests free
    is kept for the next ones (:func:`keep_freed_memory`). ``gc_interval`` > 0: only young cycle
    collections run on their own, and a full one runs that often
    (:mod:`staronnx.serving.collector`); 0: Python's own thresholds. ``colocate``: the block
    in which the event loop's thread runs on the CUDA driver's core, or the first CPU worker's
    (:meth:`~staronnx.runtime.runtime.Runtime.colocate`), entered once the listeners are up, so
    gRPC's own threads, started with them, keep every core; ``colocate_on`` says which."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from staronnx.serve.grpc_api import GrpcFrontend, make_server
    from staronnx.serve.http_api import HttpFrontend, _server_header

    keep_freed_memory()
    by_name = {m.name: m for m in models}
    meta = server_metadata(EXTENSIONS)
    state = {"ready": True}

    def is_ready() -> bool:
        return state["ready"]

    # bind everything first: a port in use fails the start before anything is announced
    http_sock = _bind(listen.host, listen.http_port, "http")
    metrics_sock = _bind(listen.host, listen.metrics_port, "metrics")
    grpc_server = make_server(GrpcFrontend(by_name, meta, is_ready), listen.max_body)
    target = f"[{listen.host}]" if ":" in listen.host else listen.host
    try:
        grpc_port = grpc_server.add_insecure_port(f"{target}:{listen.grpc_port}")
    except RuntimeError as exc:
        grpc_port = 0
        cause = f": {exc}"
    else:
        cause = ""
    if grpc_port == 0:
        http_sock.close()
        metrics_sock.close()
        raise StaronnxError(f"cannot listen on {listen.host}:{listen.grpc_port} for grpc{cause} "
                            "(choose another --grpc-port, or 0 for a free one)")

    http_front = HttpFrontend(by_name, meta, listen.max_body, is_ready)
    http_runner = http_front.runner(listen.drain_timeout)

    async def metrics_handler(request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    metrics_app = web.Application()
    metrics_app.router.add_get("/metrics", metrics_handler)
    metrics_app.on_response_prepare.append(_server_header)
    metrics_runner = web.AppRunner(metrics_app, access_log=None, handle_signals=False, shutdown_timeout=1.0)

    await http_runner.setup()
    await metrics_runner.setup()
    await web.SockSite(http_runner, http_sock).start()
    await web.SockSite(metrics_runner, metrics_sock).start()
    await grpc_server.start()
    # what exists now (aiohttp's and gRPC's machinery, the imports since the batchers froze the
    # process) lives as long as the server: out of the cycle collector's full walks, which took
    # 15-25 ms with every thread stopped, three or four times in five seconds under load (p99)
    gc.collect()
    hold_frozen()
    serving = contextlib.ExitStack()  # what holds while serving: the loop's core, the collector's setting
    core = serving.enter_context(colocate()) if colocate is not None else None
    if gc_interval > 0:
        serving.enter_context(full_collections_every(gc_interval))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    host = target
    say(f"HTTP (KServe v2) on http://{host}:{http_sock.getsockname()[1]}")
    say(f"gRPC (KServe v2) on {host}:{grpc_port}")
    say(f"metrics on http://{host}:{metrics_sock.getsockname()[1]}/metrics")
    say(f"cycle collector: young objects only, a full collection every {gc_interval:g} s" if gc_interval > 0
        else "cycle collector: Python's own thresholds")
    if colocate is not None:
        say(f"event loop and batchers on the {colocate_on} (PU {core})" if core is not None
            else f"event loop and batchers where they are: no {colocate_on} to join")
    say("ready (SIGTERM or Ctrl-C drains and stops)")
    sys.stdout.flush()

    try:
        await stop.wait()
    finally:
        serving.close()
        release_frozen()
    say("stopping: no new requests; draining the ones accepted")
    sys.stdout.flush()
    state["ready"] = False
    # requests still arriving are answered 503 / UNAVAILABLE (never reset, never held); the
    # listeners stay open, answering so, until every accepted request is answered (or
    # drain_timeout), then close, each waiting for the handlers still encoding their answers
    http_front.shutting_down()
    deadline = loop.time() + listen.drain_timeout
    while any(m.stats.snapshot()["pending"] for m in models) and loop.time() < deadline:
        await asyncio.sleep(0.01)
    left = max(deadline - loop.time(), 1.0)
    http_runner._shutdown_timeout = left  # what remains of drain_timeout
    await asyncio.gather(grpc_server.stop(left), http_runner.cleanup())
    await loop.run_in_executor(None, _close_models, models, listen.drain_timeout)
    await metrics_runner.cleanup()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    say("stopped")


def _close_models(models: Sequence[ModelEndpoint], timeout: float) -> None:
    for m in models:
        m.close(timeout)
