"""``staronnx serve``'s process: models, the three listeners, one event loop, graceful shutdown.

One asyncio loop runs the HTTP API, the gRPC API and the metrics endpoint; the batchers and
the runtimes run in their own threads, and the loop only awaits their futures, so a slow
model never blocks the listeners. Both front ends share one guard
(:mod:`staronnx.serve.limits`), its connection cap derived from the raised open-file limit.

Shutdown answers every request it accepted. On SIGTERM/SIGINT readiness turns false; a request
whose body is still arriving, and every inference request sent from then on, is answered 503 /
UNAVAILABLE with ``Connection: close`` (never reset, never held). Each batcher runs what it
holds for up to ``--drain-timeout``; what is still queued then is answered 503 / UNAVAILABLE
(the batcher fails it with ``ServerClosed``). Once every handler has sent its answer (and
refused uploads have finished sending, within the drain), the HTTP listener takes the
connections already waiting in its accept queue (closing a listener resets them) and answers
them too, then the listeners close, each runtime closes, and the process exits 0 with one line
saying how many inference requests were answered, refused and dropped (0).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import ipaddress
import logging
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from staronnx.errors import StaronnxError
from staronnx.serve import protocol
from staronnx.serve.batching import check_names
from staronnx.serve.limits import Guard, Limits, RefusalCollector, raise_open_files
from staronnx.serve.metrics import ServeMetrics
from staronnx.serve.control import ModelControl
from staronnx.serve.models import ModelEndpoint
from staronnx.serve.shm import SharedMemoryRegions
from staronnx.serve.tls import Tls
from staronnx.serving.collector import full_collections_every
from staronnx.serving.server import hold_frozen, release_frozen

if TYPE_CHECKING:  # imported where the front ends start (aiohttp's app is not needed before)
    from staronnx.serve.http_api import HttpFrontend

#: ``staronnx serve --gc-interval``'s default: seconds between full cycle collections
GC_INTERVAL_S = 30.0


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30}


def parse_size(text: str, option: str | None = None) -> int:
    """Bytes from ``64MiB``, ``10MB``, ``512k`` or a bare number of bytes; ``option``
    (``"--max-body"``) starts the error message, so the user knows which value to fix."""
    where = f"{option}: " if option else ""
    m = _SIZE.match(text)
    if not m:
        raise StaronnxError(f"{where}sizes look like 64MiB, 10MB, 512KiB or 1048576; got {text!r}")
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if value < 1:
        raise StaronnxError(f"{where}a size must be at least 1 byte, got {text!r}")
    return value


def model_names(plans: list[Path], names: list[str] | None) -> list[str]:
    """Each plan's model name: ``--name`` in order, else the plan folder's name; unique."""
    if names and len(names) != len(plans):
        raise StaronnxError(f"--name given {len(names)} time(s) for {len(plans)} plan(s): give one per plan, in order")
    out = list(names) if names else [p.resolve().name for p in plans]
    check_names(out)
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
    limits: Limits = field(default_factory=Limits)
    #: TLS on every listener (None: plain text, loopback only unless --insecure)
    tls: Tls | None = None


#: the listen backlog of the HTTP and metrics sockets (aiohttp's own default is 128)
BACKLOG = 1024

#: after the batchers are closed, how long refused uploads may go on sending (at least) before
#: the connections close; and how long a connection taken from the accept queue at the end has
#: to send its request and read its 503
LINGER_S = 2.0

#: at the end of a shutdown, how long an HTTP connection must have been silent (since its accept
#: or its last bytes) before it is closed (a client that just connected sends its request within
#: it), and how long gRPC calls are held before its listener stops
QUIET_S = 0.25

#: addresses that only this machine reaches (``--host`` may name them without ``--insecure``)
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def check_exposure(host: str, insecure: bool, tls: bool = False) -> None:
    """Refuse to listen on an address other machines reach with neither TLS (``--tls-cert``) nor
    ``--insecure``: in plain text, anyone on the way reads the tensors, and anyone who reaches the
    server can run the models (and read their configuration). With TLS the traffic is encrypted
    (and with ``--tls-client-ca`` only holders of its certificates are answered); without it,
    put a TLS-terminating proxy in front, as Triton and KServe expect."""
    if insecure or tls:
        return
    try:
        loopback = all(ipaddress.ip_address(info[4][0]).is_loopback
                       for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        loopback = host in LOOPBACK
    if not loopback:
        raise StaronnxError(f"--host {host} would expose the server to other machines with no TLS and no "
                            "authentication: give --tls-cert and --tls-key (and --tls-client-ca for client "
                            "certificates), or put a TLS-terminating proxy (nginx, Envoy, a service mesh) in front "
                            "and pass --insecure to listen there anyway")


#: the protocol extensions this server serves, by Triton's names (a client may test for them):
#: binary tensors over HTTP, the classification output parameter, model configuration,
#: statistics, and the repository index (loading and unloading through model control, with
#: --model-repository; refused otherwise); the Ray ingress serves these too
EXTENSIONS = ["binary_tensor_data", "classification", "model_configuration", "model_repository", "statistics"]

#: what ``staronnx serve`` serves besides: system shared memory (co-located clients only), and
#: sequences (stateful repository models: sequence_id, sequence_start and sequence_end, over
#: HTTP, gRPC and gRPC's ModelStreamInfer; :mod:`staronnx.serve.sequences`)
SERVE_EXTENSIONS = [*EXTENSIONS, "sequence", "system_shared_memory"]


def server_metadata(extensions: Sequence[str]) -> dict[str, object]:
    """The server metadata: the installed distribution's version, the ``extensions`` served."""
    return {"name": "staronnx", "version": protocol.staronnx_version(), "extensions": list(extensions)}


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
    """A listening socket, or one clear line naming the port and the flag to change. ``::``
    listens on IPv4 too where the system can (as gRPC's listener does)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        dual = family == socket.AF_INET6 and host in ("::", "") and socket.has_dualstack_ipv6()
        return socket.create_server((host, port), family=family, backlog=BACKLOG, dualstack_ipv6=dual)
    except (OSError, socket.gaierror) as exc:
        raise _cannot_listen(host, port, what, f": {exc.strerror or exc}") from None


def _cannot_listen(host: str, port: int, what: str, why: str) -> StaronnxError:
    return StaronnxError(f"cannot listen on {host}:{port} for {what}{why} (choose another --{what}-port, or 0 for a "
                         "free one)")


async def serve(models: Sequence[ModelEndpoint], metrics: ServeMetrics, listen: Listen,
                say: Callable[[str], None] = print, gc_interval: float = GC_INTERVAL_S,
                colocate: Callable[[], contextlib.AbstractContextManager[int | None]] | None = None,
                colocate_on: str = "CUDA driver's core", unavailable: Mapping[str, str] | None = None,
                control: ModelControl | None = None, poll_every: float | None = None) -> None:
    """Serve ``models`` until SIGTERM/SIGINT; then drain and close them. Memory the requests free
    is kept for the next ones (:func:`keep_freed_memory`). ``gc_interval`` > 0: only young cycle
    collections run on their own, and a full one runs that often
    (:mod:`staronnx.serving.collector`); 0: Python's own thresholds. ``colocate``: the block
    in which the event loop's thread runs on the CUDA driver's core, or the first CPU worker's
    (:meth:`~staronnx.runtime.runtime.Runtime.colocate`), entered once the listeners are up, so
    gRPC's own threads, started with them, keep every core; ``colocate_on`` says which.
    ``unavailable``: models that were asked for but cannot be served, and why (listed UNAVAILABLE
    with the reason by the repository index; requests to them are refused with it). ``control``:
    the model control of a model repository (:mod:`staronnx.serve.control`), whose served models
    and unavailable ones are then these (loads and unloads change them while serving);
    ``poll_every``: seconds between two reads of the repository (poll mode)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from staronnx.serve.grpc_api import GrpcFrontend, make_server
    from staronnx.serve.http_api import HttpFrontend, _server_header, any_busy

    keep_freed_memory()
    if control is not None:  # the front ends read the models control changes
        by_name, unavailable = control.models, control.unavailable
    else:
        by_name = {m.name: m for m in models}
    meta = server_metadata(SERVE_EXTENSIONS)
    state = {"ready": True}

    def is_ready() -> bool:
        return state["ready"]

    open_files = raise_open_files()
    limits = listen.limits.resolved(listen.max_body, open_files)
    guard = Guard.make(limits, logging.getLogger("staronnx.serve"))
    metrics.registry.register(RefusalCollector(guard.refusals, guard.budget))

    # bind everything first: a port in use fails the start before anything is announced
    http_sock = _bind(listen.host, listen.http_port, "http")
    metrics_sock = _bind(listen.host, listen.metrics_port, "metrics")
    regions = SharedMemoryRegions()  # registered over either protocol, used by both
    grpc_front = GrpcFrontend(by_name, meta, listen.max_body, is_ready, guard, unavailable=unavailable,
                              regions=regions, control=control)
    grpc_server = make_server(grpc_front)
    target = f"[{listen.host}]" if ":" in listen.host else listen.host
    cause = ""
    try:
        address = f"{target}:{listen.grpc_port}"
        grpc_port = (grpc_server.add_secure_port(address, listen.tls.grpc_credentials()) if listen.tls is not None
                     else grpc_server.add_insecure_port(address))
    except RuntimeError as exc:
        grpc_port, cause = 0, f": {exc}"
    if grpc_port == 0:
        http_sock.close()
        metrics_sock.close()
        raise _cannot_listen(listen.host, listen.grpc_port, "grpc", cause)

    http_front = HttpFrontend(by_name, meta, listen.max_body, is_ready, guard, unavailable=unavailable,
                              regions=regions, control=control)
    http_runner = http_front.runner(listen.drain_timeout)

    async def metrics_handler(request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    metrics_app = web.Application()
    metrics_app.router.add_get("/metrics", metrics_handler)
    metrics_app.on_response_prepare.append(_server_header)
    metrics_runner = web.AppRunner(metrics_app, access_log=None, handle_signals=False, shutdown_timeout=1.0,
                                   keepalive_timeout=limits.idle_timeout)

    await http_runner.setup()
    await metrics_runner.setup()
    ssl_context = listen.tls.ssl_context() if listen.tls is not None else None
    http_site = web.SockSite(http_runner, http_sock, backlog=BACKLOG, ssl_context=ssl_context)
    await http_site.start()
    await web.SockSite(metrics_runner, metrics_sock, backlog=BACKLOG, ssl_context=ssl_context).start()
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
    log_flusher = loop.create_task(_flush_log_every(guard))
    poller = loop.create_task(control.poll_forever(poll_every)) if control is not None and poll_every else None

    scheme = "https" if listen.tls is not None else "http"
    say(f"HTTP (KServe v2) on {scheme}://{target}:{http_sock.getsockname()[1]}")
    say(f"gRPC (KServe v2) on {target}:{grpc_port}" + (" (TLS)" if listen.tls is not None else ""))
    say(f"metrics on {scheme}://{target}:{metrics_sock.getsockname()[1]}/metrics")
    if listen.tls is not None:
        say(listen.tls.words())
    say(limits_text(limits, open_files))
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
    if poller is not None:
        poller.cancel()
    models = list(by_name.values())  # what is served now (model control may have changed it)
    say("stopping: no new requests; draining the ones accepted")
    sys.stdout.flush()
    state["ready"] = False
    drain_end = loop.time() + listen.drain_timeout
    # 1. requests still arriving are answered 503 now; each batcher runs what it holds until
    #    the drain ends, and what is still queued then is answered 503 / UNAVAILABLE
    http_front.shutting_down()
    for m in models:  # a stateful model's backlog: no request can end a sequence and free its slot now
        m.retire("the server is shutting down")
    await loop.run_in_executor(None, _close_batchers, models, listen.drain_timeout)
    # 2. every handler has its outcome now: let each send it, and refused uploads finish sending
    await _until(lambda: not http_front.unanswered and not grpc_front.unanswered, loop.time() + LINGER_S)
    await _until(lambda: not http_front.running, max(drain_end, loop.time() + LINGER_S))
    # 3. the HTTP listener answers the connections waiting in its accept queue, then closes;
    #    each connection closes once no request is on its way on it; gRPC's calls are held
    #    meanwhile and answered once its stop has begun (grpcio cancels a call that reaches its
    #    core as it stops: one per busy client, CANCELLED, unless held). A handler still running
    #    now is cut (counted dropped)
    grpc_front.hold()  # gRPC calls from now on wait, and are answered just before its listener stops
    held_until = loop.time() + QUIET_S  # long enough for every busy client's next call to be held
    await _close_listener(http_site, http_sock, http_runner, http_front)
    server = http_runner.server  # closing a connection whose request is on its way resets it unanswered
    if server is not None:
        await _until(lambda: not any_busy(server, QUIET_S), loop.time() + LINGER_S)
    await asyncio.sleep(max(0.0, held_until - loop.time()))
    http_front.closing = grpc_front.closing = True
    http_runner._shutdown_timeout = 1.0  # handlers were waited for above
    # gRPC: the stop first (its GOAWAY: a client's next call goes to the closed port), then the
    # held calls are answered UNAVAILABLE within its grace
    stopping = asyncio.ensure_future(grpc_server.stop(1.0))
    await asyncio.sleep(0)
    grpc_front.release()
    await asyncio.gather(stopping, http_runner.cleanup())
    log_flusher.cancel()
    guard.log.flush()
    await loop.run_in_executor(None, _close_models, models, listen.drain_timeout)
    await metrics_runner.cleanup()
    regions.close()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    say(summary_text(guard))
    say("stopped")


def limits_text(limits: Limits, open_files: int) -> str:
    """The start line that says what each connection and request is held to."""
    deadline = f"{limits.request_timeout:g} s" if limits.request_timeout > 0 else "none"
    return (f"limits: {limits.max_connections} connections per protocol (open files {open_files}), "
            f"request head {limits.header_timeout:g} s, body pauses {limits.body_timeout:g} s and at least "
            f"{limits.body_min_rate:g} bytes/s, keep-alive idle {limits.idle_timeout:g} s, request deadline {deadline}, "
            f"{limits.receive_budget} bytes of bodies in reception, {limits.grpc_max_streams} gRPC streams per "
            "connection")


def summary_text(guard: Guard) -> str:
    """The exit line: how the inference requests ended, over both protocols."""
    r = guard.refusals
    return (f"inference requests: {r.total('answered')} answered, {r.total('refused')} refused (503 / UNAVAILABLE), "
            f"{r.total('failed')} failed (another error), {r.total('cancelled')} cancelled by their client, "
            f"{r.total('dropped')} dropped unanswered")


async def _flush_log_every(guard: Guard) -> None:
    """Sum up the log lines held back (:class:`~staronnx.serve.limits.LogLimiter`) every window."""
    while True:
        await asyncio.sleep(guard.log.window)
        guard.log.flush()


async def _until(done: Callable[[], bool], deadline: float) -> None:
    """Wait (polling: the front ends' sets change on the loop) until ``done()`` or ``deadline``."""
    loop = asyncio.get_running_loop()
    while not done() and loop.time() < deadline:
        await asyncio.sleep(0.01)


async def _close_listener(site: web.SockSite, sock: socket.socket, runner: web.AppRunner,
                          front: HttpFrontend) -> None:
    """Stop listening for HTTP without resetting anyone: the connections the kernel already
    accepted into the listen queue are taken and handled (each request answered 503 with
    ``Connection: close``) before the listener closes in the same step (closing a listener
    resets the connections still queued on it), and given :data:`LINGER_S` to be answered."""
    loop = asyncio.get_running_loop()
    queued: list[socket.socket] = []
    sock.setblocking(False)
    with contextlib.suppress(OSError):  # BlockingIOError: the queue is empty; anything else: nothing more to take
        while True:
            queued.append(sock.accept()[0])
    await site.stop()  # no await between the last accept and the close
    sock.close()
    server = runner.server  # set by the runner's setup, before the listener opened
    if not queued or server is None:
        for conn in queued:
            conn.close()
        return
    before = server.requests_count
    for conn in queued:
        conn.setblocking(False)
        try:
            await loop.connect_accepted_socket(server, conn)
        except OSError:
            conn.close()
    await _until(lambda: server.requests_count - before >= len(queued) and not front.running,
                 loop.time() + LINGER_S)


def _close_batchers(models: Sequence[ModelEndpoint], timeout: float) -> None:
    """Each batcher runs what it holds for what remains of ``timeout``, then fails the rest
    with ``ServerClosed`` (each request answered 503 / UNAVAILABLE by its front end)."""
    deadline = time.monotonic() + timeout
    for m in models:
        m.server.close(max(deadline - time.monotonic(), 0.0))


def _close_models(models: Sequence[ModelEndpoint], timeout: float) -> None:
    for m in models:
        m.close(timeout)
