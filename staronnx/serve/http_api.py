"""The KServe v2 REST API on aiohttp, with Triton's binary-tensor extension.

Why aiohttp: one asyncio event loop then serves HTTP, gRPC (``grpc.aio``) and metrics with no
thread per connection, awaiting the batcher's futures; it is mature, parses HTTP itself
(request size limits, chunked bodies, gzip/deflate request bodies), and ``tritonclient[http]``
depends on it already.

The binary extension: with an ``Inference-Header-Content-Length: L`` header the body is L bytes
of JSON followed by the raw bytes of every input whose ``parameters.binary_data_size`` says
how many, in input order (the header given once, in decimal digits); outputs asked for with
``binary_data: true`` (or every output, with the request parameter ``binary_data_output: true``;
JSON booleans only) come back the same way. So does an output holding a NaN or an infinity,
whatever was asked: JSON has no such numbers, and a response is always valid JSON (Triton's
clients read either form; a client of JSON only sees the output's ``binary_data_size``).

Triton's extensions (:data:`staronnx.serve.app.SERVE_EXTENSIONS`) are served at ``/config``,
``/stats``, an output's ``classification: k`` parameter, ``POST /v2/repository/index`` and
``/v2/systemsharedmemory`` (inputs and outputs placed in registered regions by their
``shared_memory_*`` parameters: :mod:`staronnx.serve.shm`).

A plain inference request (a Content-Length, a small body in one or two segments, a
keep-alive connection) is answered in the lane (:mod:`staronnx.serve.fastpath`) by
:meth:`HttpFrontend.answer_lane`, without aiohttp's per-request objects; every other request,
and every later one on its connection, is aiohttp's, and both answer and count alike.

A hostile or careless client meets the bounds of :mod:`staronnx.serve.limits`: bodies held by
:func:`_receive` within ``--max-body`` and the receive budget (400, 503), timed by
:class:`_BodyWatch` (408) and ``--request-timeout`` (504); heads, idle and surplus connections
by :class:`_Handler` (408, 503); each answered with the protocol's JSON error and ``Connection:
close``. A client that disconnects has its request withdrawn (counted CANCELED); the ``Server``
header names staronnx only, and a 500 says no more than that the log has the details.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, cast

import numpy as np
from aiohttp import web
from aiohttp.http import HttpProcessingError, HttpVersion11
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from staronnx.serve import jsontensors, protocol
from staronnx.serve.fastpath import MAX_HELD, WAIT_S, InferHead, Lane, response_bytes
from staronnx.serve.frontend import Frontend, load_or_unload, shutting_down
from staronnx.serve.limits import Guard, Limits, ReceiveBudget
from staronnx.serve.metrics import VERSION
from staronnx.serve.models import ModelEndpoint
from staronnx.serve.protocol import ProtocolError, cut, invalid
from staronnx.serve.shm import CUDA_REFUSED, REGION, SharedMemoryRegions, check_local, in_shared_memory, local_peer

log = logging.getLogger("staronnx.serve")

HEADER_LENGTH = "Inference-Header-Content-Length"

#: what the ``Server`` header of every response says (aiohttp's default names Python's and its own versions)
SERVER_HEADER = "staronnx"

#: what a 500 says: no more than that (an exception's text may name files, users, secrets)
INTERNAL_ERROR = "internal server error (the server's log has the details)"

#: how long a connection answered before its body arrived whole keeps reading and discarding
#: the rest before it closes, where the front end does not drain it itself (an oversize body,
#: an unknown route; aiohttp's default: 10 s), so that the client reads the answer rather than
#: a reset. An inference request refused while its body arrives (a shutdown, the receive
#: budget) is drained by its handler for as long as the body keeps arriving.
LINGER_S = 1.0

#: a request whose JSON part is at least this long is parsed on a worker thread (googlenet's
#: input as JSON is 3.1 MB, 3.5 ms of parsing that would stall every other client); a smaller one
#: is parsed on the loop, where it costs less than the hand-over to a thread (~50-100 µs)
OFFLOAD_BYTES = 64 * 1024

#: a response with at least this many values to write as JSON text is encoded on a worker thread
OFFLOAD_VALUES = 16384

class DecodedRequest(NamedTuple):
    """A decoded inference request, as the front end, the lane and the Ray ingress run it."""

    #: the JSON header as sent (its parameters, outputs and id are read where they are used)
    header: dict[str, Any]
    inputs: dict[str, np.ndarray]
    #: each input's datatype as the request names it
    datatypes: dict[str, str]
    #: the outputs asked for, in order: (name, whether it goes as binary data)
    wanted: list[tuple[str, bool]]
    #: the request's binary_data_output: the default of an output it asks for without saying
    binary_out: bool


class AnswerSource(Protocol):
    """What encoding an answer reads of its model: a served
    :class:`~staronnx.serve.models.ModelEndpoint`, or the Ray ingress's model information."""

    @property
    def name(self) -> str: ...

    @property
    def output_datatypes(self) -> Mapping[str, str]: ...

#: the request body encodings this server decompresses itself (zlib ``wbits`` of each)
_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class HttpFrontend(Frontend):
    """The REST routes over a set of models; ``app()`` builds the aiohttp application."""

    protocol = "http"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading: set[asyncio.Task[Any]] = set()  # inference handlers still receiving their body
        #: inference handlers cut short by the server, and why ("stopping", "slow", "deadline")
        self._cuts: dict[asyncio.Task[Any], str] = {}
        #: inference handlers that have not answered yet (what a shutdown waits for)
        self.unanswered: set[asyncio.Task[Any]] = set()
        #: every inference handler still running (answered ones may still drop a refused body)
        self.running: set[asyncio.Task[Any]] = set()

    def shutting_down(self) -> None:
        """At SIGTERM (readiness already false): every inference request still arriving (its body
        not all received) is answered 503 now, instead of holding its connection for the whole
        drain and closing it unanswered."""
        for task in list(self._reading):
            self._cut(task, "stopping")

    def _cut(self, task: asyncio.Task[Any], why: str) -> None:
        """Cut ``task`` (an inference handler) short for ``why``; its handler answers for it."""
        if task not in self._cuts and not task.done():
            self._cuts[task] = why
            task.cancel()

    def app(self) -> web.Application:
        # bodies are read by _receive, which refuses those over max_body (client_max_size: what
        # aiohttp's own request.read() would allow, for any handler that calls it)
        app = web.Application(client_max_size=self.max_body, middlewares=[self._errors])
        app.on_response_prepare.append(_server_header)
        r = app.router
        # inference first: aiohttp tries a path's routes in order, each a regular expression, and
        # inference is nearly every request a busy server sees
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            r.add_post(prefix + "/infer", self.infer, expect_handler=self._expect)
        stats = _json(lambda q: self.statistics(q.match_info.get("model"), q.match_info.get("version")))
        r.add_get("/v2", _json(lambda q: self.server_meta))
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.ready)
        r.add_get("/v2/models/stats", stats)  # before /v2/models/{model}: every model's
        r.add_post("/v2/repository/index", self.repository_index, expect_handler=self._expect)
        r.add_post("/v2/repository/models/{model}/load", self.load_model)
        r.add_post("/v2/repository/models/{model}/unload", self.load_model)
        # Triton's shared-memory extensions: system shared memory served, CUDA's refused by name
        shm = "/v2/systemsharedmemory"
        r.add_get(shm + "/status", _json(lambda q: self._local(q.remote).status(None)))
        r.add_get(shm + "/region/{region}/status",
                  _json(lambda q: self._local(q.remote).status(q.match_info["region"])))
        r.add_post(shm + "/region/{region}/register", self.register_region)
        r.add_post(shm + "/region/{region}/unregister", self.unregister_region)
        r.add_post(shm + "/unregister", self.unregister_region)
        cuda = "/v2/cudasharedmemory"
        r.add_get(cuda + "/status", _json(lambda q: []))
        r.add_get(cuda + "/region/{region}/status", self.refuse_cuda)
        r.add_post(cuda + "/region/{region}/register", self.refuse_cuda)
        r.add_post(cuda + "/region/{region}/unregister", self.refuse_cuda)
        r.add_post(cuda + "/unregister", _json(lambda q: {}))  # every region: there are none
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            r.add_get(prefix, _json(lambda q: self._model(q).metadata()))
            r.add_get(prefix + "/ready", self.ready)
            r.add_get(prefix + "/config", _json(lambda q: self._model(q).config()))
            r.add_get(prefix + "/stats", stats)
        return app

    def runner(self, drain_timeout: float) -> web.AppRunner:
        """The app's runner: handlers cancelled when their client goes away (its request is
        withdrawn), bodies left compressed for :func:`decode_body`, malformed HTTP answered in JSON,
        each connection held to the guard's time limits and connection cap (:class:`_Handler`)."""
        return _Runner(self.app(), guard=self.guard, front=self, access_log=None, handle_signals=False,
                       shutdown_timeout=drain_timeout, handler_cancellation=True, auto_decompress=False,
                       lingering_time=LINGER_S, keepalive_timeout=self.guard.limits.idle_timeout)

    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Every error as the protocol's ``{"error": "..."}`` with its status, never a traceback;
        once the server is stopping, every answer closes its connection."""
        try:
            response = await handler(request)
        except ProtocolError as exc:
            response = _answer(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            path = cut(request.path, 100)
            text = {404: f"no such endpoint: {request.method} {path}",
                    405: f"method {request.method} not allowed on {path}"}.get(exc.status, exc.reason)
            response = web.json_response({"error": text}, status=exc.status)
        except ConnectionError:  # the client went away mid-request: nobody to answer, nothing to log
            response = web.Response(status=400)
        except Exception:  # noqa: BLE001 - a server bug answers 500 and keeps serving
            log.exception("internal error on %s %s", request.method, cut(request.path, 100))
            response = web.json_response({"error": INTERNAL_ERROR}, status=500)
        if response.status == 408 or not self.is_ready():  # 408: the rest of a late body is not waited for
            response.force_close()
        return response

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: the ``100 Continue`` only for a body this server will read;
        an unknown model, a body over ``--max-body`` or a stopping server is answered at once,
        so the client never sends a body only to have it refused."""
        if request.headers.get("Expect", "").lower() != "100-continue" or request.version != HttpVersion11:
            return web.json_response({"error": f"Expect: {protocol.cut(request.headers.get('Expect'), 40)} is not "
                                               "supported (only 100-continue)"}, status=417)
        model = None
        try:
            if "model" in request.match_info:
                model = self._model(request)
            _check_length(request, self.max_body)
            if not self.is_ready():
                raise shutting_down()
        except ProtocolError as exc:
            if model is not None:
                model.stats.refused("REJECTED" if exc.kind == "unavailable" else "OTHER")
            self.ended(exc)
            return _answer(exc, close=True)
        request["continued"] = True
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer's own headers are still to come
        return None

    # -- health and metadata --------------------------------------------------------------------
    async def live(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        """The server's readiness, or a model's (503 while not ready)."""
        model = request.match_info.get("model")
        ready = self.is_ready() if model is None else self.model_ready(model, request.match_info.get("version"))
        return web.Response(status=200 if ready else 503)

    def _model(self, request: web.Request) -> ModelEndpoint:
        return self.model(request.match_info["model"], request.match_info.get("version"))

    async def repository_index(self, request: web.Request) -> web.Response:
        """Triton's repository index (read-only): every served model, its version and state;
        ``{"ready": true}`` lists only the ready ones. Its small body is received within the
        limits (:func:`_receive`), under a watch of its own: one too slow is answered 408."""
        body = await self._watched_body(request)
        only_ready = await index_ready(body, request.headers.get("Content-Encoding"), self.max_body)
        return web.json_response(self.repository_entries(only_ready))

    async def register_region(self, request: web.Request) -> web.Response:
        """Register a system shared-memory region: ``{"key": ..., "offset": ..., "byte_size": ...}``."""
        regions = self._local(request.remote)
        doc = await self._small_json(request)
        regions.register(request.match_info["region"], doc.get("key"), doc.get("offset", 0), doc.get("byte_size"))
        return web.json_response({})

    async def unregister_region(self, request: web.Request) -> web.Response:
        """Unregister one region, or every region (no region in the path)."""
        regions = self._local(request.remote)
        await self._small_json(request)
        regions.unregister(request.match_info.get("region"))
        return web.json_response({})

    def _local(self, peer: str | None) -> SharedMemoryRegions:
        """The shared-memory regions, for a client (at address ``peer``) on this machine only."""
        check_local(peer)
        return self.regions

    async def refuse_cuda(self, request: web.Request) -> web.Response:
        raise ProtocolError("invalid", CUDA_REFUSED)

    async def _watched_body(self, request: web.Request) -> bytes | bytearray:
        """A small control request's body, received within the limits under a watch of its own:
        one too slow is answered 408."""
        task = asyncio.current_task()
        assert task is not None
        watch = _BodyWatch(asyncio.get_running_loop(), self.guard.limits, task.cancel)
        try:
            return await _receive(request, self.max_body, self.guard.budget, watch)
        except asyncio.CancelledError:
            if not watch.expired:
                raise
            task.uncancel()
            raise self._too_slow(request, watch) from None
        finally:
            watch.stop()

    async def _small_json(self, request: web.Request) -> dict[str, Any]:
        """A control request's JSON object (an empty body is ``{}``), received within the limits."""
        body = await self._watched_body(request)
        body = await inflate_body(body, request.headers.get("Content-Encoding"), self.max_body)
        doc = _parse_json(body, "the request", json.loads) if body.strip() else {}
        if not isinstance(doc, dict):
            raise invalid("the request body must be a JSON object")
        return doc

    async def load_model(self, request: web.Request) -> web.Response:
        """Load (``{"parameters": {"config": "<JSON>"}}`` overrides its config.pbtxt) or unload a
        model through model control; refused where the served models are fixed."""
        name, action = request.match_info["model"], request.path.rsplit("/", 1)[-1]
        doc = await self._small_json(request)
        params = doc.get("parameters", {})
        if not isinstance(params, dict):
            raise invalid("'parameters' must be a JSON object")
        config = params.get("config")
        if config is not None and not isinstance(config, str):
            raise invalid("parameter 'config' must be a string holding the model config in JSON")
        files = {k: v for k, v in params.items() if k.startswith("file:")}
        await load_or_unload(self, name, action, config, files)
        return web.json_response({})

    # -- inference ------------------------------------------------------------------------------
    async def infer(self, request: web.Request) -> web.StreamResponse:
        """One inference request, answered whatever happens to it: its outcome is counted
        (answered, refused, failed, cancelled by its client, dropped by a closing server), and
        a request cut short by the server (a shutdown while its body arrives, a body too slow,
        ``--request-timeout``) answers 503, 408 or 504 rather than a reset."""
        with _InFlight(self) as flight:
            task = flight.task
            # a body that came whole with its head (nearly every small request) has nothing to time
            watch = _BodyWatch(task.get_loop(), self.guard.limits, functools.partial(self._cut, task, "slow"),
                               armed=not request.content.is_eof())
            try:
                response = await self._infer(request, task, watch)
            except BaseException as exc:
                why = flight.ended(exc)
                if why is None:  # counted; a refusal is answered by the middleware, a client gone by nobody
                    raise
                response = await self._cut_short(request, why, watch)
            else:
                self.ended(status=response.status)
            finally:
                watch.stop()
        return response

    async def _infer(self, request: web.Request, task: asyncio.Task[Any], watch: _BodyWatch) -> web.StreamResponse:
        model = self._model(request)
        t0 = time.perf_counter()
        if not self.is_ready():
            return await self._refuse_body(request, _answer(self.stopping(model)), watch)
        lengths = request.headers.getall(HEADER_LENGTH, [])
        self._reading.add(task)
        try:
            if len(lengths) > 1:
                raise invalid(f"{HEADER_LENGTH} is given {len(lengths)} times; give it once")
            body = await _receive(request, self.max_body, self.guard.budget, watch)
            decoded = await decode_body(
                body, request.headers.get("Content-Encoding"), lengths[0] if lengths else None, self.max_body,
                regions=self.regions if local_peer(request.remote) else None)
        except ProtocolError as exc:
            model.stats.refused("REJECTED" if exc.kind == "unavailable" else "OTHER")  # as Triton counts it
            if exc.kind == "unavailable":  # the receive budget: answered now, the rest of the body dropped
                self.guard.refusals.refuse("http", "receive_budget")
                self.guard.log.warning("refused request bodies", "refused a request body from %s: %s",
                                       request.remote, exc)
                return await self._refuse_body(request, _answer(exc), watch)
            raise
        except asyncio.CancelledError:
            why = self._cuts.get(task)
            if why is not None:
                model.stats.refused("REJECTED" if why == "stopping" else "OTHER")
            raise
        finally:
            self._reading.discard(task)
            watch.stop()
        if not self.is_ready():  # SIGTERM came while its body was decoded: the connection closes after it
            return _answer(self.stopping(model), close=True)
        encoded = await self._run(model, decoded, request.remote, t0)
        return encoded.response()

    async def _run(self, model: ModelEndpoint, request: DecodedRequest, peer: str | None, t0: float) -> Encoded:
        """A decoded request run and its answer encoded (received at ``t0``, from ``peer``): what
        aiohttp's handler and the lane (:meth:`answer_lane`) share once a body is whole."""
        header, inputs, datatypes, wanted, binary_out = request
        for out in header.get("outputs", []):  # a region unknown or too small is refused before the request runs
            if in_shared_memory(out.get("parameters", {})):
                self._local(peer).check_output(out["name"], out["parameters"])
        try:  # a JSON object: a sequence's id and flags, a priority, a queue timeout
            parameters = _params(header, "the inference request")
        except ProtocolError:
            model.stats.refused("OTHER")
            raise
        answer = await model.infer(inputs, datatypes, [n for n, _ in wanted] or None,
                                   decode_s=time.perf_counter() - t0, classes=requested_classes(header),
                                   parameters=parameters or None)
        t2 = time.perf_counter()
        placed = {}  # outputs asked for in shared memory: written there, named in the answer
        for out in header.get("outputs", []):
            params = out.get("parameters", {})
            if in_shared_memory(params) and out["name"] in answer.outputs:
                size = self.regions.write_output(out["name"], answer.outputs[out["name"]], params)
                placed[out["name"]] = {REGION: params[REGION], "shared_memory_byte_size": size}
        encoded = await encode_answer(model, header.get("id"), answer.outputs, dict(wanted), binary_out,
                                      answer.parameters, placed)
        model.stats.encoded(time.perf_counter() - t2)
        return encoded

    async def answer_lane(self, head: InferHead, body: bytes, peer: str | None) -> tuple[bytes, bool]:
        """An inference request of the lane (:mod:`staronnx.serve.fastpath`: its body whole, its
        head plain), answered as :meth:`infer` answers one that aiohttp received: counted the same,
        cut at ``--request-timeout`` (504), errors in the protocol's JSON. Returns the response's
        bytes, and whether the connection closes after it (the server is stopping)."""
        with _InFlight(self) as flight:
            try:
                model = self.model(head.model, head.version)
                t0 = time.perf_counter()
                try:
                    decoded = await decode_body(body, None, head.header_length, self.max_body,
                                                regions=self.regions if local_peer(peer) else None)
                except ProtocolError:
                    model.stats.refused("OTHER")  # as Triton counts it
                    raise
                if not self.is_ready():
                    raise self.stopping(model)
                encoded = await self._run(model, decoded, peer, t0)
            except ProtocolError as exc:
                self.ended(exc)
                encoded = Encoded.error(exc)
            except asyncio.CancelledError as exc:
                if flight.ended(exc) is None:  # counted: the client went away, or the server is closing
                    raise
                encoded = Encoded.error(self._cut_error(self.timed_out(), peer))  # the lane's one cut
            except Exception as exc:  # noqa: BLE001 - a server bug answers 500 and keeps serving
                self.ended(exc)
                log.exception("internal error on POST /v2/models/%s/infer", cut(head.model, 100))
                encoded = Encoded.json({"error": INTERNAL_ERROR}, 500)
            else:
                self.ended()
        close = not self.is_ready()
        return response_bytes(encoded.status, encoded.body, encoded.content_type, encoded.headers, close), close

    async def _cut_short(self, request: web.Request, why: str, watch: _BodyWatch) -> web.StreamResponse:
        """The answer to a request the server cut short: 503 at a shutdown (the rest of the body
        dropped as it arrives), 408 for a body too slow, 504 past ``--request-timeout``."""
        if why == "stopping":
            self.guard.refusals.refuse("http", "shutting_down")
            error = shutting_down()
            self.ended(error)
            return await self._refuse_body(request, _answer(error), watch)
        error = self._too_slow(request, watch) if why == "slow" else self.timed_out()
        return _answer(self._cut_error(error, request.remote), close=not request.content.is_eof())

    def _cut_error(self, error: ProtocolError, peer: str | None) -> ProtocolError:
        """``error``, the answer to a request from ``peer`` that a time limit cut short (a body
        too slow, ``--request-timeout``), counted and logged alike by both handlers."""
        self.ended(error)
        self.guard.log.warning("requests cut short", "cut short a request from %s: %s", peer, error)
        return error

    def _too_slow(self, request: web.Request, watch: _BodyWatch) -> ProtocolError:
        """The answer to a body that arrived too slowly (``watch`` expired), counted."""
        limits = self.guard.limits
        self.guard.refusals.refuse("http", "body_timeout")
        announced = request.content_length if request.content_length is not None else "?"
        return ProtocolError("slow", f"the request body arrived too slowly ({watch.got} of {announced} bytes in "
                                     f"{watch.elapsed():.1f} s; --body-timeout {limits.body_timeout:g} s, "
                                     f"--body-min-rate {limits.body_min_rate:g} bytes/s)")

    async def _refuse_body(self, request: web.Request, response: web.Response, watch: _BodyWatch) -> web.Response:
        """Send ``response`` (a refusal) now and close the connection after it; first read and
        drop what remains of the body for as long as it keeps arriving (the body's time limits),
        so that a client still sending reads the answer instead of a reset. A client that asked
        for ``100 Continue`` and was not given it sends no body: nothing to wait for."""
        response.force_close()
        try:
            await response.prepare(request)
            await response.write_eof()
        except ConnectionError:
            return response
        task = asyncio.current_task()
        assert task is not None
        self.unanswered.discard(task)
        if request.headers.get("Expect", "").lower() == "100-continue" and not request.get("continued"):
            return response
        try:
            await _discard(request.content, watch)
        except asyncio.CancelledError:  # answered already: whoever cuts it short now, nothing is lost
            task.uncancel()
            self._cuts.pop(task, None)
        return response


def _json(answer: Callable[[web.Request], Any]) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A GET handler that answers ``answer(request)`` as JSON."""
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(answer(request))
    return handler


def _answer(exc: ProtocolError, close: bool = False) -> web.Response:
    """The protocol's JSON error with its HTTP status; ``close``: the connection closes after it."""
    response = web.json_response({"error": str(exc)}, status=exc.http_status)
    if close:
        response.force_close()
    return response


def _check_length(request: web.Request, max_body: int) -> None:
    """Refuse a body announced larger than ``max_body`` before reading any of it."""
    if request.content_length is not None and request.content_length > max_body:
        raise invalid(f"request body of {request.content_length} bytes is larger than --max-body ({max_body} bytes)")


async def inflate_body(body: bytes | bytearray, encoding: str | None, max_body: int) -> bytes | bytearray:
    """``body`` decompressed as its Content-Encoding says (off the event loop, never past
    ``max_body``: a small bomb must not stall the other clients while it inflates)."""
    encoding = (encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    wbits = _ENCODINGS.get(encoding)
    if wbits is None:
        raise invalid(f"Content-Encoding {protocol.shown(encoding)} is not supported (gzip, deflate or none)")
    return await asyncio.get_running_loop().run_in_executor(None, _inflate, body, wbits, max_body)


async def decode_body(body: bytes | bytearray, encoding: str | None, header_length: str | None,
                      max_body: int, regions: SharedMemoryRegions | None = None) -> DecodedRequest:
    """A received request body as a :data:`Request`: inflated (:func:`inflate_body`), and a
    large JSON document parsed on a worker thread, so the loop goes on serving the others. Both
    HTTP front ends (``staronnx serve`` and the Ray ingress) read requests through here, so they
    accept the same bodies. ``regions``: the registered shared-memory regions inputs may be read
    from (None: an input placed in shared memory is refused)."""
    body = await inflate_body(body, encoding, max_body)
    length = len(body)
    if header_length is not None:  # the binary extension: the JSON header is the first ``length`` bytes
        if not (header_length.isascii() and header_length.isdigit()):  # int() takes "+210", "2_10", " 7"
            raise invalid(f"{HEADER_LENGTH} must be a decimal number of bytes, got {cut(repr(header_length), 40)}")
        length = int(header_length)
        if length > len(body):
            raise invalid(f"{HEADER_LENGTH} is {length}, but the body has {len(body)} bytes")
    if length < OFFLOAD_BYTES:
        return _decode(body, length, regions)
    return await asyncio.get_running_loop().run_in_executor(_json_pool(), _decode, body, length, regions)


async def encode_answer(model: AnswerSource, request_id: Any, outputs: Mapping[str, np.ndarray],
                        wanted: Mapping[str, bool], binary_out: bool, parameters: Mapping[str, Any] | None = None,
                        placed: Mapping[str, Mapping[str, Any]] | None = None) -> Encoded:
    """The response to a request (:func:`_encode_response`), written on a worker thread when it
    has many values to write as text, as large requests are decoded. ``placed``: the outputs
    already written to shared memory, and the parameters their entries carry instead of data."""
    args = (model, request_id, outputs, wanted, binary_out, parameters, placed)
    # the values written as JSON text (about: an output that is not finite goes binary after all)
    if sum(arr.size for name, arr in outputs.items() if not wanted.get(name, binary_out)) < OFFLOAD_VALUES:
        return _encode_response(*args)
    return await asyncio.get_running_loop().run_in_executor(_json_pool(), _encode_response, *args)


class _BodyWatch:
    """The time limits of a body being received (:mod:`staronnx.serve.limits`): no pause longer
    than ``body_timeout``, and, once ``body_timeout`` has passed, at least ``body_min_rate``
    bytes/s on average since the head arrived. One timer per request, moved
    forward lazily: a chunk only notes its size and time, the timer re-arms itself when it
    fires early, and ``expire`` is called once the body is late. Not ``armed``: no timer at all,
    for a body already whole when its handler starts (it cannot be late)."""

    __slots__ = ("_loop", "_timeout", "_rate", "start", "last", "got", "_handle", "_expire", "expired")

    def __init__(self, loop: asyncio.AbstractEventLoop, limits: Limits, expire: Callable[[], Any],
                 armed: bool = True) -> None:
        self._loop = loop
        self._timeout = limits.body_timeout
        self._rate = limits.body_min_rate
        self.start = self.last = loop.time()
        self.got = 0
        self._expire = expire
        self.expired = False
        self._handle: asyncio.TimerHandle | None = loop.call_at(self.deadline(), self._check) if armed else None

    def deadline(self) -> float:
        """When the body is late, in the loop's time, given what has arrived so far."""
        late = self.last + self._timeout
        if self._rate > 0:
            late = min(late, self.start + self._timeout + self.got / self._rate)
        return late

    def arrived(self, n: int) -> None:
        self.got += n
        self.last = self._loop.time()

    def elapsed(self) -> float:
        return self._loop.time() - self.start

    def _check(self) -> None:
        when = self.deadline()
        if self._loop.time() < when:
            self._handle = self._loop.call_at(when, self._check)
            return
        self._handle = None
        self.expired = True
        self._expire()

    def stop(self) -> None:
        self._handle = _cancel(self._handle)


async def _receive(request: web.Request, max_body: int, budget: ReceiveBudget, watch: _BodyWatch) -> bytes | bytearray:
    """The body's bytes as they arrive, the memory held growing with them.

    A body announced with a Content-Length is kept as the chunks that arrived until half of it
    is there; then one buffer of the whole length is taken, what came is copied in once, and the
    rest is read straight into it (no growth copies: a 3 MB JSON tensor's request costs the loop
    ~1 ms more with a growing bytearray). A body that arrives at once is returned as its one
    chunk, with no copy. A chunked body (no length announced) is joined once at the end. Every
    byte held counts against ``budget`` until the body is whole (503 past it).

    Why not a buffer of the announced length at once: 30 connections that each announced 64 MiB
    and sent nothing held 2 GB.
    """
    _check_length(request, max_body)
    content = request.content
    length = request.content_length
    limit = length if length is not None else max_body
    chunks: list[bytes] = []
    got = held = 0
    buf: bytearray | None = None
    view: memoryview | None = None
    try:
        while True:
            chunk = await content.readany()
            if not chunk:
                break
            n = len(chunk)
            got += n
            watch.arrived(n)
            if got > limit:  # aiohttp's parser never passes Content-Length; refuse rather than guess
                raise invalid(f"the request body is longer than its Content-Length ({length} bytes)" if length is not None
                              else f"request body is larger than --max-body ({max_body} bytes)")
            if view is not None:
                view[got - n:got] = chunk
                continue
            chunks.append(chunk)
            # half of it is here: one buffer for the whole body, the rest read straight into it
            whole = length if length is not None and 2 * got >= length and got < length else None
            if not budget.take(n if whole is None else whole - held):
                raise ProtocolError("unavailable", "the server is receiving as many request bodies as it holds at "
                                                   f"once (--receive-budget, {budget.limit} bytes); retry later")
            if whole is None:
                held += n
                continue
            held = whole
            buf = bytearray(whole)
            view = memoryview(buf)
            pos = 0
            for c in chunks:
                view[pos:pos + len(c)] = c
                pos += len(c)
            chunks = []
        if length is not None and got != length:  # the client went away mid-body
            raise ConnectionError("the request body ended before its Content-Length")
        if buf is not None:
            return buf
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        if view is not None:
            view.release()
        budget.give(held)


async def _discard(content: Any, watch: _BodyWatch) -> None:
    """Read and drop the rest of a body, for as long as it keeps arriving within ``watch``'s
    limits (no memory held: each chunk is dropped as it comes)."""
    watch.stop()
    with contextlib.suppress(TimeoutError, ConnectionError, RuntimeError):
        while not content.is_eof():
            async with asyncio.timeout_at(watch.deadline()):
                chunk = await content.readany()
            if not chunk:
                return
            watch.arrived(len(chunk))


def _inflate(data: bytes | bytearray, wbits: int, max_body: int) -> bytes:
    """``data`` decompressed; stops (400) as soon as the output passes ``max_body`` bytes.

    A gzip body is every member of it, concatenated (RFC 1952: a gzip file is a series of
    members, as ``gzip`` and ``cat a.gz b.gz`` make them); anything after the last member, or
    after a deflate stream, that is not a whole member is refused, never ignored."""
    out: list[bytes] = []
    size = 0
    rest = data
    while True:
        d = zlib.decompressobj(wbits)
        try:
            part = d.decompress(rest, max_body + 1 - size)
        except zlib.error as exc:
            what = "the request body" if not out else f"what follows gzip member {len(out)} of the request body"
            raise invalid(f"{what} is not valid compressed data: {exc}") from None
        size += len(part)
        out.append(part)
        if size > max_body:
            raise invalid(f"the request body decompresses to more than --max-body ({max_body} bytes)")
        if not d.eof:
            raise invalid("the compressed request body is truncated")
        rest = d.unused_data
        if not rest:
            return out[0] if len(out) == 1 else b"".join(out)
        if wbits != _ENCODINGS["gzip"]:
            raise invalid(f"{len(rest)} bytes follow the end of the deflate stream in the request body")


async def index_ready(body: bytes | bytearray, encoding: str | None, max_body: int) -> bool:
    """Whether a repository index request (``{"ready": true}``; an empty body is ``{}``) lists
    only the ready models (both HTTP front ends read it here)."""
    body = await inflate_body(body, encoding, max_body)
    doc = _parse_json(body, "the request", json.loads) if body.strip() else {}
    if not isinstance(doc, dict):
        raise invalid("the request body must be a JSON object")
    only_ready = doc.get("ready", False)
    if not isinstance(only_ready, bool):
        raise invalid(f"'ready' must be true or false, got {protocol.cut(json.dumps(only_ready), 40)}")
    return only_ready


def _parse_json(data: bytes | bytearray, what: str, loads: Callable[[bytes | bytearray], Any]) -> Any:
    try:
        return loads(data)
    except RecursionError:
        raise invalid(f"malformed JSON in {what}: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"malformed JSON in {what}: {cut(exc)}") from None


def requested_classes(header: Mapping[str, Any]) -> dict[str, Any]:
    """Outputs asked for with Triton's ``classification`` parameter, and their k, in a header
    :func:`decode_body` accepted (its outputs named objects, their parameters objects)."""
    return {out["name"]: out["parameters"]["classification"] for out in header.get("outputs", [])
            if out.get("parameters", {}).get("classification") is not None}


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_HEADER


def any_busy(server: Server, quiet: float) -> bool:
    """Whether closing ``server``'s connections now could cut a request on one of them
    (:meth:`_Handler.busy`); a shutdown waits until none is. aiohttp types its connections as its
    own ``RequestHandler``; every one this front end opens is a :class:`_Handler`."""
    return any(isinstance(h, _Handler) and h.busy(quiet) for h in server.connections)


class _Handler(RequestHandler):
    """aiohttp's connection handler, held to the guard's limits.

    * a request it cannot parse (a line or header over its limits, a bad Content-Length) is
      answered with the protocol's JSON error, logged a few lines per window;
    * a connection has ``header_timeout`` to send a whole request head, from its accept or from
      the first byte after a keep-alive pause (a partial head is answered 408, a connection that
      sent nothing is closed); between requests it may idle ``idle_timeout`` (aiohttp's
      keep-alive timer, which aiohttp also starts at the accept: replaced there by this one);
    * past ``max_connections`` open connections, a new connection's request is answered 503
      with ``Connection: close`` (read whole first, so the client reads the answer, not a reset);
    * a plain inference request is answered in the lane (:mod:`staronnx.serve.fastpath`) by
      ``front`` directly, until something the lane does not take hands the connection to aiohttp.
    """

    __slots__ = ("_guard", "_head_timer", "_over", "_partial", "_counted", "_last_data", "_front", "_lane",
                 "_lane_task", "_lane_timer")

    def __init__(self, manager: Server, *, guard: Guard, front: HttpFrontend | None = None, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._front = front
        #: the connection's state in the lane; None once aiohttp serves it
        self._lane: Lane | None = Lane() if front is not None else None
        self._lane_task: asyncio.Task[Any] | None = None
        self._lane_timer: asyncio.TimerHandle | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._over = False
        self._partial = False
        self._counted = False
        self._last_data = 0.0  # loop time of the accept, then of the last bytes received

    def busy(self, quiet: float) -> bool:
        """Whether closing this connection now could cut a request: one is being received or
        handled, or bytes came (or the connection was accepted) less than ``quiet`` s ago, so a
        request may be on its way. A shutdown closes a connection only once it is not busy."""
        if self.transport is None:
            return False
        return (self._request_in_progress or bool(self._messages) or self._partial
                or (self._lane is not None and self._lane.pending) or self._loop.time() - self._last_data < quiet)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._last_data = self._loop.time()
        super().connection_made(transport)
        # aiohttp's idle timer from the accept: the head timer instead
        self._keepalive_handle = _cancel(self._keepalive_handle)
        refusals = self._guard.refusals
        refusals.connections["http"] += 1
        self._counted = True
        if refusals.connections["http"] > self._guard.limits.max_connections:
            self._over = True
            refusals.refuse("http", "too_many_connections")
            self._guard.log.warning("connections refused", "refused a connection from %s: %d connections are open "
                                    "(--max-connections %d)", self.peername, refusals.connections["http"],
                                    self._guard.limits.max_connections)
            self._lane = None
        self._arm_head()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self._counted = False
            self._guard.refusals.connections["http"] -= 1
        self._head_timer = _cancel(self._head_timer)
        self._lane_timer = _cancel(self._lane_timer)
        if self._lane_task is not None:  # its client went away: the request is withdrawn
            self._lane_task.cancel()
        super().connection_lost(exc)

    def _waiting(self) -> bool:
        """Whether the connection waits for a request head (none parsed, none being handled)."""
        return (self._waiter is not None and not self._waiter.done() and not self._messages
                and not (self._lane is not None and self._lane.busy))

    def _arm_head(self) -> None:
        self._head_timer = self._loop.call_later(self._guard.limits.header_timeout, self._head_late)

    def data_received(self, data: bytes) -> None:
        self._last_data = self._loop.time()
        arm = False
        if data and self._waiting():
            self._partial = True
            arm = self._head_timer is None  # the first bytes after a keep-alive pause: a head is on its way
        lane = self._lane
        if lane is not None:
            if self._in_lane(lane, data):
                # a request still arriving in the lane is timed as aiohttp's would be; one that came
                # whole needs no timer, and the keep-alive timer stays (it checks when it fires)
                if arm and self._lane is lane and not lane.busy:
                    self._arm_head()
                return
            data = self._leave_lane()
        if arm:
            self._keepalive_handle = _cancel(self._keepalive_handle)
            self._arm_head()
        count = self._request_count
        super().data_received(data)
        if self._request_count != count:  # a whole head arrived
            self._partial = False
            self._head_timer = _cancel(self._head_timer)

    def _in_lane(self, lane: Lane, data: bytes) -> bool:
        """Whether the lane took ``data`` (False: the connection goes to aiohttp)."""
        front = self._front
        assert front is not None
        if not lane.busy and (self._force_close or not front.is_ready()):
            lane.keep(data)
            return False  # a stopping server's answers (and their Connection: close) are aiohttp's
        got = lane.feed(data, front.max_body)
        if got is True:
            if lane.waiting_for_body() and self._lane_timer is None:
                self._lane_timer = self._loop.call_later(WAIT_S, self._lane_late)
            elif len(lane.held) > MAX_HELD:  # a client pipelining far ahead waits for the answer
                if self.transport is not None:
                    self.transport.pause_reading()
            return True
        if got is False:
            return False
        head, body = got
        self._partial = False  # a whole request arrived: as aiohttp's head would, it stops the head timer
        self._head_timer = _cancel(self._head_timer)
        self._lane_timer = _cancel(self._lane_timer)
        peer = self.peername
        # not started eagerly inside this callback: that added ~1 ms to a lone request's answer
        self._lane_task = asyncio.Task(
            self._answer_lane(lane, front, head, body, peer[0] if isinstance(peer, tuple) else peer), loop=self._loop)
        return True

    async def _answer_lane(self, lane: Lane, front: HttpFrontend, head: InferHead, body: bytes,
                           peer: str | None) -> None:
        data, close = await front.answer_lane(head, body, peer)
        self._lane_task = None
        transport = self.transport
        if transport is None:
            return
        transport.write(data)
        lane.busy = False
        if close:
            self.force_close()
            return
        # idle now: aiohttp's keep-alive timer, as after one of its own answers
        close_time = self._loop.time() + self._keepalive_timeout
        self._next_keepalive_close_time = close_time
        if self._keepalive_handle is None and self._keepalive_timeout > 0:
            self._keepalive_handle = self._loop.call_at(close_time, self._process_keepalive)
        if lane.held:  # the next requests came meanwhile
            held = bytes(lane.held)
            lane.held.clear()
            transport.resume_reading()
            self.data_received(held)

    def _lane_late(self) -> None:
        """A body the lane waited for :data:`~staronnx.serve.fastpath.WAIT_S` is still arriving:
        aiohttp receives it, under the body limits."""
        self._lane_timer = None
        if self._lane is not None and self._lane.waiting_for_body() and self.transport is not None:
            data = self._leave_lane()
            count = self._request_count
            super().data_received(data)
            if self._request_count != count:
                self._partial = False
                self._head_timer = _cancel(self._head_timer)

    def _leave_lane(self) -> bytes:
        """The connection goes to aiohttp for good; the bytes the lane kept, to feed it."""
        assert self._lane is not None
        data = self._lane.handover()
        self._lane = None
        self._lane_timer = _cancel(self._lane_timer)
        self._keepalive_handle = _cancel(self._keepalive_handle)  # aiohttp's own, from its next answer
        return data

    def _head_late(self) -> None:
        """``header_timeout`` passed: close a connection still waiting for (the rest of) a head;
        one that sent part of one is told 408 first."""
        self._head_timer = None
        if self.transport is None or self._force_close or not self._waiting():
            return
        self._guard.refusals.refuse("http", "header_timeout" if self._partial else "idle_timeout")
        if self._partial:
            limit = self._guard.limits.header_timeout
            error = f"the request head did not arrive whole within --header-timeout ({limit:g} s)"
            self._guard.log.warning("requests cut short", "closed a connection from %s: %s", self.peername, error)
            self.transport.write(_canned(408, error))
        self.force_close()

    def _process_keepalive(self) -> None:
        if self._lane is not None and self._lane.pending:  # a request of the lane is on its way
            self._keepalive_handle = None
            return
        transport = self.transport
        super()._process_keepalive()
        if transport is not None and self.transport is None:
            self._guard.refusals.refuse("http", "idle_timeout")

    async def _handle_request(self, request: Any, start_time: float | None,
                              request_handler: Callable[[Any], Awaitable[web.StreamResponse]]) -> Any:
        if self._over:
            request_handler = self._too_many
        return await super()._handle_request(request, start_time, request_handler)

    async def _too_many(self, request: Any) -> web.StreamResponse:
        limit = self._guard.limits.max_connections
        return _closing(503, f"too many connections: this server holds at most {limit} (--max-connections); "
                             "retry later, or reuse a connection")

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("a response was sent already")
        if status >= 500:
            log.error("internal error handling an HTTP request from %s: %s", request.remote,
                      cut(exc if exc is not None else message))
            text = INTERNAL_ERROR
        else:
            said = exc.message if isinstance(exc, HttpProcessingError) else exc
            why = " ".join(str(message or said or "unreadable").split())
            text = f"malformed HTTP request: {cut(why)}"
            self._guard.refusals.refuse("http", "malformed")
            self._guard.log.warning("malformed HTTP requests", "%s (from %s; answered %d)", text, request.remote,
                                    status)
        return _closing(status, text)


def _closing(status: int, error: str) -> web.Response:
    """A JSON error that closes its connection, from the connection handler (outside the app,
    whose hook names the server)."""
    response = web.json_response({"error": error}, status=status, headers={"Server": SERVER_HEADER})
    response.force_close()
    return response


class _InFlight:
    """An inference request in its handler (aiohttp's :meth:`HttpFrontend.infer` or the lane's
    :meth:`HttpFrontend.answer_lane`), for the length of a ``with``: on entry registered where a
    shutdown waits for it (``unanswered``, ``running``) and timed by ``--request-timeout`` (cut
    short, ``"deadline"``, once it passes); on exit unregistered, its timer cancelled, whatever
    happened. What both handlers did by hand, in one small object per request: the lane exists
    to save CPU per request, and this costs it well under a microsecond more (0.3-0.5 µs measured
    on the 2-core host) than the same steps written inline."""

    __slots__ = ("front", "task", "_timer")

    def __init__(self, front: HttpFrontend) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.front = front
        #: the handler's task: what a cut cancels
        self.task = task
        self._timer: asyncio.TimerHandle | None = None

    def __enter__(self) -> _InFlight:
        front, task = self.front, self.task
        deadline = front.guard.limits.request_timeout
        if deadline > 0:
            self._timer = task.get_loop().call_later(deadline, front._cut, task, "deadline")
        front.unanswered.add(task)
        front.running.add(task)
        return self

    def __exit__(self, kind: object, exc: object, traceback: object) -> None:
        front, task = self.front, self.task
        front.unanswered.discard(task)
        front.running.discard(task)
        front._cuts.pop(task, None)
        _cancel(self._timer)

    def ended(self, exc: BaseException) -> str | None:
        """The handler raised ``exc``: why the server cut the request short, where it did (the
        cancellation taken back, so that the handler answers for it and counts that answer);
        otherwise None, ``exc`` counted (:meth:`Frontend.ended`) for the handler to answer or
        re-raise (a cancellation: the client went away, or the server is closing)."""
        if isinstance(exc, asyncio.CancelledError):
            why = self.front._cuts.pop(self.task, None)
            if why is not None:
                self.task.uncancel()
                return why
        self.front.ended(exc)
        return None


def _cancel(timer: asyncio.Handle | None) -> asyncio.TimerHandle | None:
    """Cancel ``timer``, if any; returns what its holder keeps then, None (``t = _cancel(t)``)."""
    if timer is not None:
        timer.cancel()
    return None


def _canned(status: int, error: str) -> bytes:
    """A whole JSON error response, as bytes for a connection with no request to answer."""
    body = json.dumps({"error": error}).encode()
    reason = {408: "Request Timeout", 503: "Service Unavailable"}.get(status, "Error")
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\nServer: {SERVER_HEADER}\r\n\r\n").encode() + body


class _Server(Server):
    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)  # the runner's keywords, the guard among them


class _Runner(web.AppRunner):
    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _Server  # aiohttp has no setting for the class of its connection handlers
        return server


@functools.cache
def _json_pool() -> ThreadPoolExecutor:
    """The thread that parses and writes large JSON tensors, one document at a time.

    One, not the loop's default pool of several: the parse holds the GIL (pysimdjson does not
    release it), so several threads would not parse faster (measured: the same CPU per request
    with 16 clients sending googlenet's 3 MB JSON input), and each thread keeps a parser whose
    buffers grow to the largest document it parsed (up to several times ``--max-body``).
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="staronnx-json")


def _params(obj: Mapping[str, Any], what: str) -> dict[str, Any]:
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise invalid(f"{what}: 'parameters' must be a JSON object")
    return params


def _flag(params: Mapping[str, Any], key: str, default: bool, what: str) -> bool:
    """A boolean parameter (``binary_data``, ``binary_data_output``): JSON ``true`` or ``false``
    only; the string ``"false"`` is truthy to Python and must not turn binary output on."""
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise invalid(f"{what}: parameter {key!r} must be true or false, got {cut(json.dumps(value), 40)}")
    return value


def _decode(body: bytes | bytearray, length: int, regions: SharedMemoryRegions | None = None) -> DecodedRequest:
    """A request body whose first ``length`` bytes are its JSON header, the rest binary tensors
    (and inputs placed in ``regions``' shared memory)."""
    view = memoryview(body)
    header = _parse_json(body if length == len(body) else bytes(view[:length]), "the inference request",
                         jsontensors.loads)
    if not isinstance(header, dict):
        raise invalid("the inference request must be a JSON object")
    binary = view[length:]
    specs = header.get("inputs")
    if not isinstance(specs, list) or not specs:
        raise invalid("the inference request needs a non-empty 'inputs' list")
    inputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    offset = 0
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise invalid(f"inputs[{i}] must be an object with a 'name'")
        name, datatype = spec["name"], cast(str, spec.get("datatype"))  # checked where it is read
        what = f"input {protocol.shown(name)}"
        if name in inputs:
            raise invalid(f"{what} is given twice")
        params = _params(spec, what)
        size = params.get("binary_data_size")
        if in_shared_memory(params):
            if size is not None or "data" in spec:
                raise invalid(f"{what}: give shared_memory_region, binary_data_size or data, one of them")
            if regions is None:
                raise invalid(f"{what}: system shared memory is not served to this client (only to clients on the "
                              "machine of staronnx serve); send the tensor in the request")
            inputs[name] = regions.read_input(name, datatype, spec.get("shape"), params)
        elif size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise invalid(f"{what}: binary_data_size must be a non-negative integer, got {cut(size, 40)}")
            if offset + size > len(binary):
                raise invalid(f"{what}: binary_data_size {size} runs past the end of the body "
                              f"({len(binary) - offset} bytes left)")
            inputs[name] = protocol.from_raw(name, datatype, spec.get("shape"), binary[offset:offset + size])
            offset += size
        elif "data" in spec:
            inputs[name] = protocol.from_values(name, datatype, spec.get("shape"), spec["data"])
        else:
            raise invalid(f"{what} has neither 'data' nor parameters.binary_data_size")
        datatypes[name] = datatype
    if offset != len(binary):
        raise invalid(f"{len(binary) - offset} bytes of binary data follow the inputs that no input claims")
    binary_out = _flag(_params(header, "the request"), "binary_data_output", False, "the request")
    wanted: list[tuple[str, bool]] = []
    outs = header.get("outputs", [])
    if not isinstance(outs, list):
        raise invalid("'outputs' must be a list")
    for i, out in enumerate(outs):
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise invalid(f"outputs[{i}] must be an object with a 'name'")
        what = f"output {protocol.shown(out['name'])}"
        params = _params(out, what)
        if in_shared_memory(params) and regions is None:
            raise invalid(f"{what}: system shared memory is not served to this client (only to clients on the "
                          "machine of staronnx serve); ask for the output in the answer")
        wanted.append((out["name"], _flag(params, "binary_data", binary_out, what)))
    return DecodedRequest(header, inputs, datatypes, wanted, binary_out)


@dataclass(frozen=True, slots=True)
class Encoded:
    """An answer's bytes, before any transport: aiohttp's response (:meth:`response`), the lane's
    bytes (:func:`~staronnx.serve.fastpath.response_bytes`) and the Ray ingress's starlette
    response are made from it. ``header_length``: the binary extension's JSON part, when the
    body carries binary outputs."""

    body: bytes
    content_type: str = "application/json"
    status: int = 200
    header_length: int | None = None

    @classmethod
    def json(cls, doc: Any, status: int = 200) -> Encoded:
        return cls(json.dumps(doc).encode(), "application/json; charset=utf-8", status)

    @classmethod
    def error(cls, exc: ProtocolError) -> Encoded:
        """The protocol's JSON error with its HTTP status."""
        return cls.json({"error": str(exc)}, exc.http_status)

    @property
    def headers(self) -> dict[str, str]:
        """The headers besides Content-Type and Content-Length."""
        return {HEADER_LENGTH: str(self.header_length)} if self.header_length is not None else {}

    def response(self) -> web.Response:
        response = web.Response(body=self.body, status=self.status, headers=self.headers)
        response.content_type = self.content_type.split(";")[0]
        return response


def _encode_response(model: AnswerSource, request_id: Any, outputs: Mapping[str, np.ndarray],
                     wanted: Mapping[str, bool], binary_out: bool,
                     parameters: Mapping[str, Any] | None = None,
                     placed: Mapping[str, Mapping[str, Any]] | None = None) -> Encoded:
    entries: list[dict[str, Any]] = []
    blobs: list[bytes | memoryview] = []  # views of the outputs: the body's join copies them once
    for name, arr in outputs.items():
        datatype = protocol.output_datatype(arr, model.output_datatypes[name])
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
        if placed and name in placed:  # written to shared memory already
            entry["parameters"] = dict(placed[name])
        # JSON has no NaN or infinity: such an output goes with the binary extension, exact
        elif wanted.get(name, binary_out) or not jsontensors.finite(arr):
            raw = protocol.raw_view(arr)
            entry["parameters"] = {"binary_data_size": raw.nbytes if isinstance(raw, memoryview) else len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = jsontensors.json_array(arr)
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model.name, "model_version": getattr(model, "version", VERSION),
                          "outputs": entries}
    if request_id is not None:
        doc["id"] = request_id
    if parameters:
        doc["parameters"] = dict(parameters)
    head = jsontensors.dumps(doc)
    if not blobs:
        return Encoded(head)
    return Encoded(b"".join([head, *blobs]), "application/octet-stream", header_length=len(head))
