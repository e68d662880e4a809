"""The KServe v2 REST API on aiohttp, with Triton's binary-tensor extension.

Why aiohttp: one asyncio event loop then serves HTTP, gRPC (``grpc.aio``) and metrics with no
thread per connection, awaiting the batcher's futures; it is mature, parses HTTP itself
(request size limits, chunked bodies, gzip/deflate request bodies), and ``tritonclient[http]``
depends on it already.

The binary extension: with an ``Inference-Header-Content-Length: L`` header the body is L bytes
of JSON followed by the raw bytes of every input whose ``parameters.binary_data_size`` says
how many, in input order; outputs asked for with ``binary_data`` (or every output, with the
request parameter ``binary_data_output``) come back the same way.

Triton's extensions served here: model configuration (``/config``), statistics (``/stats``),
classification (an output's ``classification: k`` parameter), and the repository index
(``POST /v2/repository/index``; loading and unloading are refused: a plan is served for the
life of the process).

What a hostile client meets: a body is read whole up to ``--max-body`` and decompressed
(gzip, deflate) by this module, off the event loop, never past ``--max-body``; JSON nested too
deep, shapes of more than 64 dimensions, request lines or headers over aiohttp's limits all
answer 400 with the protocol's JSON error and one log line; a client that disconnects has its
request withdrawn (counted CANCELED); the ``Server`` header names staronnx only, and a 500 says
no more than that the log has the details.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from staronnx.serve import jsontensors, protocol
from staronnx.serve.metrics import VERSION
from staronnx.serve.models import ModelEndpoint
from staronnx.serve.protocol import ProtocolError, cut, invalid, unknown_model

log = logging.getLogger("staronnx.serve")

HEADER_LENGTH = "Inference-Header-Content-Length"

#: what the ``Server`` header of every response says (aiohttp's default names Python's and its own versions)
SERVER_HEADER = "staronnx"

#: how long a connection answered before its body arrived whole (an error, a shutdown) keeps
#: reading and discarding the rest before it closes (aiohttp's default: 10 s), so that the
#: client reads the answer rather than a reset
LINGER_S = 1.0

#: a request whose JSON part is at least this long is parsed on a worker thread (googlenet's
#: input as JSON is 3.1 MB, 3.5 ms of parsing that would stall every other client); a smaller one
#: is parsed on the loop, where it costs less than the hand-over to a thread (~50-100 µs)
OFFLOAD_BYTES = 64 * 1024

#: a response with at least this many values to write as JSON text is encoded on a worker thread
OFFLOAD_VALUES = 16384

#: the request body encodings this server decompresses itself (zlib ``wbits`` of each)
_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class HttpFrontend:
    """The REST routes over a set of models; ``app()`` builds the aiohttp application."""

    def __init__(self, models: Mapping[str, ModelEndpoint], server_meta: dict[str, Any], max_body: int,
                 is_ready: Callable[[], bool]) -> None:
        self.models = models
        self.server_meta = server_meta
        self.max_body = max_body
        self.is_ready = is_ready
        self._reading: set[asyncio.Task[Any]] = set()  # inference handlers still receiving their body
        self._stopped: set[asyncio.Task[Any]] = set()  # those of them stopped by shutting_down()

    def shutting_down(self) -> int:
        """At SIGTERM (readiness already false): every inference request still arriving (its body
        not all received) is answered 503 now, instead of holding its connection for the whole
        drain and closing it unanswered. Returns how many."""
        for task in list(self._reading):
            self._stopped.add(task)
            task.cancel()
        return len(self._stopped)

    def app(self) -> web.Application:
        # bodies are read by _receive, which refuses those over max_body (client_max_size: what
        # aiohttp's own request.read() would allow, for any handler that calls it)
        app = web.Application(client_max_size=self.max_body, middlewares=[_errors])
        app.on_response_prepare.append(_server_header)
        r = app.router
        # inference first: aiohttp tries a path's routes in order, each a regular expression, and
        # inference is nearly every request a busy server sees
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            r.add_post(prefix + "/infer", self.infer)
        r.add_get("/v2", self.server_metadata)
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.ready)
        r.add_get("/v2/models/stats", self.statistics)  # before /v2/models/{model}: every model's
        r.add_post("/v2/repository/index", self.repository_index)
        r.add_post("/v2/repository/models/{model}/load", self.refuse_load)
        r.add_post("/v2/repository/models/{model}/unload", self.refuse_load)
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            r.add_get(prefix, self.model_metadata)
            r.add_get(prefix + "/ready", self.model_ready)
            r.add_get(prefix + "/config", self.model_config)
            r.add_get(prefix + "/stats", self.statistics)
        return app

    def runner(self, drain_timeout: float) -> web.AppRunner:
        """The app's runner: handlers cancelled when their client goes away (its request is
        withdrawn), bodies left compressed for :meth:`_read`, malformed HTTP answered in JSON."""
        return _Runner(self.app(), access_log=None, handle_signals=False, shutdown_timeout=drain_timeout,
                       handler_cancellation=True, auto_decompress=False, lingering_time=LINGER_S)

    # -- health and metadata --------------------------------------------------------------------
    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(self.server_meta)

    async def live(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.is_ready() else 503)

    def _model(self, request: web.Request) -> ModelEndpoint:
        name = request.match_info["model"]
        model = self.models.get(name)
        if model is None:
            raise unknown_model(name, list(self.models))
        model.check_version(request.match_info.get("version"))
        return model

    async def model_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(self._model(request).metadata())

    async def model_config(self, request: web.Request) -> web.Response:
        return web.json_response(self._model(request).config())

    async def model_ready(self, request: web.Request) -> web.Response:
        model = self._model(request)
        return web.Response(status=200 if model.ready and self.is_ready() else 503)

    async def statistics(self, request: web.Request) -> web.Response:
        """Triton's statistics extension: one model's (by name), or every model's."""
        models = [self._model(request)] if "model" in request.match_info else [
            self.models[n] for n in sorted(self.models)]
        return web.json_response({"model_stats": [m.statistics() for m in models]})

    async def repository_index(self, request: web.Request) -> web.Response:
        """Triton's repository index (read-only): every served model, its version and state;
        ``{"ready": true}`` lists only the ready ones."""
        body = await _read_json_object(request, self.max_body)
        only_ready = bool(body.get("ready", False))
        return web.json_response(repository_index(self.models, self.is_ready(), only_ready))

    async def refuse_load(self, request: web.Request) -> web.Response:
        raise refused_load(request.match_info["model"], request.path.rsplit("/", 1)[-1])

    # -- inference ------------------------------------------------------------------------------
    async def infer(self, request: web.Request) -> web.Response:
        model = self._model(request)
        t0 = time.perf_counter()
        if not self.is_ready():
            return _shutting_down(model)
        task = asyncio.current_task()
        assert task is not None
        self._reading.add(task)
        try:
            header, inputs, datatypes, wanted, binary_out = await self._read(request)
        except ProtocolError:
            model.stats.refused("OTHER")  # counted as Triton does: a failed request of this model
            raise
        except asyncio.CancelledError:
            if task not in self._stopped:  # the client went away
                raise
            task.uncancel()
            return _shutting_down(model)
        finally:
            self._reading.discard(task)
            self._stopped.discard(task)
        if not self.is_ready():  # SIGTERM came while its body was decoded
            return _shutting_down(model)
        t1 = time.perf_counter()
        answer = await model.infer(inputs, datatypes, [n for n, _ in wanted] or None, decode_s=t1 - t0,
                                   classes=requested_classes(header))
        t2 = time.perf_counter()
        response = await encode_answer(model, header.get("id"), answer.outputs, dict(wanted), binary_out,
                                       answer.parameters)
        model.stats.encoded(time.perf_counter() - t2)
        return response

    async def _read(self, request: web.Request) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, str],
                                                         list[tuple[str, bool]], bool]:
        body = await _receive_limited(request, self.max_body)
        return await decode_body(body, request.headers.get("Content-Encoding"), request.headers.get(HEADER_LENGTH),
                                 self.max_body)


def _shutting_down(model: ModelEndpoint) -> web.Response:
    """503 to a request that arrives (or is still arriving) once the server is stopping; the
    connection closes after it (no waiting for the rest of a body)."""
    model.stats.refused("REJECTED")
    resp = web.json_response({"error": f"model {model.name!r}: the server is shutting down; send the request "
                                       "to another replica"}, status=503)
    resp.force_close()
    return resp


def repository_index(models: Mapping[str, ModelEndpoint], server_ready: bool, only_ready: bool) -> list[dict[str, str]]:
    """Triton's repository index entries: name, version, state (READY or UNAVAILABLE), reason."""
    out = []
    for name in sorted(models):
        ready = models[name].ready and server_ready
        if only_ready and not ready:
            continue
        out.append({"name": name, "version": VERSION, "state": "READY" if ready else "UNAVAILABLE",
                    "reason": "" if ready else "the server is shutting down"})
    return out


def refused_load(name: str, action: str) -> ProtocolError:
    return ProtocolError("refused", f"cannot {action} model {protocol.shown(name)}: staronnx serve serves the plans "
                                    "it was started with for the life of the process (no model control); "
                                    "restart it with the plans to serve")


async def _receive_limited(request: web.Request, max_body: int) -> bytes | bytearray:
    """The request body as sent (still compressed, if it is), refused past ``max_body`` bytes."""
    if request.content_length is not None and request.content_length > max_body:
        raise invalid(f"request body of {request.content_length} bytes is larger than --max-body ({max_body} bytes)")
    return await _receive(request, max_body)


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
                      max_body: int) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, str],
                                              list[tuple[str, bool]], bool]:
    """A received request body as (JSON header, inputs, their datatypes, outputs asked for,
    binary default): inflated (:func:`inflate_body`), and a large JSON document parsed on a
    worker thread, so the loop goes on serving the others. Both HTTP front ends (``staronnx
    serve`` and the Ray ingress) read requests through here, so they accept the same bodies."""
    body = await inflate_body(body, encoding, max_body)
    if _json_bytes(body, header_length) < OFFLOAD_BYTES:
        return _decode(body, header_length)
    return await asyncio.get_running_loop().run_in_executor(_json_pool(), _decode, body, header_length)


async def encode_answer(model: Any, request_id: Any, outputs: Mapping[str, np.ndarray], wanted: Mapping[str, bool],
                        binary_out: bool, parameters: Mapping[str, Any] | None = None) -> web.Response:
    """The response to a request (:func:`_encode_response`), written on a worker thread when it
    has many values to write as text, as large requests are decoded."""
    args = (model, request_id, outputs, wanted, binary_out, parameters)
    if _json_values(outputs, wanted, binary_out) < OFFLOAD_VALUES:
        return _encode_response(*args)
    return await asyncio.get_running_loop().run_in_executor(_json_pool(), _encode_response, *args)


async def _receive(request: web.Request, max_body: int) -> bytes | bytearray:
    """The body's bytes as they arrive, into one buffer of the announced Content-Length.

    Why not ``request.read()``: it grows a bytearray chunk by chunk (each growth past the
    allocator's in-place limit copies all that came before: ~1 ms of a 3 MB JSON tensor's
    request, on the event loop) and then copies the whole into ``bytes``. A chunked body (no
    length announced) is joined once at the end.
    """
    content = request.content
    length = request.content_length
    if length is not None:
        buf = bytearray(length)
        view = memoryview(buf)
        got = 0
        while True:
            chunk = await content.readany()
            if not chunk:
                break
            end = got + len(chunk)
            if end > length:  # aiohttp's parser never passes Content-Length; refuse rather than guess
                raise invalid(f"the request body is longer than its Content-Length ({length} bytes)")
            view[got:end] = chunk
            got = end
        view.release()
        if got != length:  # the client went away mid-body
            raise ConnectionError("the request body ended before its Content-Length")
        return buf
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await content.readany()
        if not chunk:
            break
        size += len(chunk)
        if size > max_body:
            raise invalid(f"request body is larger than --max-body ({max_body} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def _inflate(data: bytes, wbits: int, max_body: int) -> bytes:
    """``data`` decompressed; stops (400) as soon as the output passes ``max_body`` bytes."""
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(data, max_body + 1)
    except zlib.error as exc:
        raise invalid(f"the request body is not valid compressed data: {exc}") from None
    if len(out) > max_body:
        raise invalid(f"the request body decompresses to more than --max-body ({max_body} bytes)")
    if not d.eof:
        raise invalid("the compressed request body is truncated")
    return out


async def _read_json_object(request: web.Request, max_body: int) -> dict[str, Any]:
    """A small JSON object body (empty body: ``{}``)."""
    body = await inflate_body(await _receive_limited(request, max_body), request.headers.get("Content-Encoding"),
                              max_body)
    return json_object(body)


def json_object(body: bytes | bytearray) -> dict[str, Any]:
    """A small JSON object request body, such as the repository index's (empty: ``{}``)."""
    if not body.strip():
        return {}
    doc = _loads(body)
    if not isinstance(doc, dict):
        raise invalid("the request body must be a JSON object")
    return doc


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data)
    except RecursionError:
        raise invalid("malformed JSON in the request: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"malformed JSON in the request: {cut(exc)}") from None


def requested_classes(header: Mapping[str, Any]) -> dict[str, Any]:
    """Outputs asked for with Triton's ``classification`` parameter, and their k."""
    out: dict[str, Any] = {}
    for spec in header.get("outputs") or []:
        k = _params(spec, "output").get("classification") if isinstance(spec, dict) else None
        if k is not None and isinstance(spec.get("name"), str):
            out[spec["name"]] = k
    return out


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_HEADER


class _Handler(RequestHandler):
    """aiohttp's connection handler, answering a request it cannot parse (a line or header over
    its limits, a bad Content-Length) with the protocol's JSON error and one log line."""

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("a response was sent already")
        if status >= 500:
            log.error("internal error handling an HTTP request from %s: %s", request.remote,
                      cut(exc if exc is not None else message))
            text = "internal server error (the server's log has the details)"
        else:
            why = " ".join(str(message or (exc and getattr(exc, "message", exc)) or "unreadable").split())
            text = f"malformed HTTP request: {cut(why)}"
            log.warning("%s (from %s; answered %d)", text, request.remote, status)
        resp = web.json_response({"error": text}, status=status, headers={"Server": SERVER_HEADER})
        resp.force_close()
        return resp


class _Server(Server):
    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _Server
        return server


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Every error as the protocol's ``{"error": "..."}`` with its status; never a traceback."""
    try:
        return await handler(request)
    except ProtocolError as exc:
        return web.json_response({"error": str(exc)}, status=exc.http_status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        path = cut(request.path, 100)
        text = {404: f"no such endpoint: {request.method} {path}",
                405: f"method {request.method} not allowed on {path}"}.get(exc.status, exc.reason)
        return web.json_response({"error": text}, status=exc.status)
    except ConnectionError:  # the client went away mid-request: nobody to answer, nothing to log
        return web.Response(status=400)
    except Exception:  # noqa: BLE001 - a server bug answers 500 and keeps serving
        log.exception("internal error on %s %s", request.method, cut(request.path, 100))
        return web.json_response({"error": "internal server error (the server's log has the details)"}, status=500)


_JSON_POOL: ThreadPoolExecutor | None = None


def _json_pool() -> ThreadPoolExecutor:
    """The thread that parses and writes large JSON tensors, one document at a time.

    One, not the loop's default pool of several: the parse holds the GIL (pysimdjson does not
    release it), so several threads would not parse faster (measured: the same CPU per request
    with 16 clients sending googlenet's 3 MB JSON input), and each thread keeps a parser whose
    buffers grow to the largest document it parsed (up to several times ``--max-body``).
    """
    global _JSON_POOL
    if _JSON_POOL is None:
        _JSON_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="staronnx-json")
    return _JSON_POOL


def _json_bytes(body: bytes, header_length: str | None) -> int:
    """How many bytes of ``body`` are JSON (all of it, or the binary extension's header part)."""
    if header_length is None:
        return len(body)
    if not (header_length.isascii() and header_length.isdigit()):
        return 0  # refused by _split_body, at once
    return min(int(header_length), len(body))


def _decode(body: bytes, header_length: str | None) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, str],
                                                             list[tuple[str, bool]], bool]:
    """A request body as (JSON header, inputs, their datatypes, outputs asked for, binary default)."""
    header, binary = _split_body(body, header_length)
    return (header, *_decode_request(header, binary))


def _json_values(outputs: Mapping[str, np.ndarray], wanted: Mapping[str, bool], binary_out: bool) -> int:
    """How many output values a response writes as JSON text (about: an output that is not
    finite goes binary after all)."""
    return sum(arr.size for name, arr in outputs.items() if not wanted.get(name, binary_out))


def _split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], memoryview]:
    """The JSON header (parsed) and the binary tail of a request body."""
    if header_length is None:
        json_part, tail = body, memoryview(b"")
    else:
        if not (header_length.isascii() and header_length.isdigit()):  # int() takes "+210", "2_10", " 7"
            raise invalid(f"{HEADER_LENGTH} must be a decimal number of bytes, got {cut(repr(header_length), 40)}")
        length = int(header_length)
        if not 0 <= length <= len(body):
            raise invalid(f"{HEADER_LENGTH} is {length}, but the body has {len(body)} bytes")
        view = memoryview(body)
        json_part, tail = bytes(view[:length]), view[length:]
    try:
        header = jsontensors.loads(json_part)
    except RecursionError:
        raise invalid("malformed JSON in the inference request: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"malformed JSON in the inference request: {cut(exc)}") from None
    if not isinstance(header, dict):
        raise invalid("the inference request must be a JSON object")
    return header, tail


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


def _decode_request(header: dict[str, Any], binary: memoryview) -> tuple[
        dict[str, np.ndarray], dict[str, str], list[tuple[str, bool]], bool]:
    """Inputs as arrays, their datatypes, the outputs asked for (name, binary?), binary default."""
    specs = header.get("inputs")
    if not isinstance(specs, list) or not specs:
        raise invalid("the inference request needs a non-empty 'inputs' list")
    inputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    offset = 0
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise invalid(f"inputs[{i}] must be an object with a 'name'")
        name = spec["name"]
        if name in inputs:
            raise invalid(f"input {protocol.shown(name)} is given twice")
        datatype = spec.get("datatype")
        size = _params(spec, f"input {protocol.shown(name)}").get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise invalid(f"input {protocol.shown(name)}: binary_data_size must be a non-negative integer, got {cut(size, 40)}")
            if offset + size > len(binary):
                raise invalid(f"input {protocol.shown(name)}: binary_data_size {size} runs past the end of the body "
                              f"({len(binary) - offset} bytes left)")
            inputs[name] = protocol.from_raw(name, datatype, spec.get("shape"), binary[offset:offset + size])
            offset += size
        elif "data" in spec:
            inputs[name] = protocol.from_values(name, datatype, spec.get("shape"), spec["data"])
        else:
            raise invalid(f"input {protocol.shown(name)} has neither 'data' nor parameters.binary_data_size")
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
        wanted.append((out["name"], _flag(_params(out, what), "binary_data", binary_out, what)))
    return inputs, datatypes, wanted, binary_out


def _encode_response(model: ModelEndpoint, request_id: Any, outputs: Mapping[str, np.ndarray],
                     wanted: Mapping[str, bool], binary_out: bool,
                     parameters: Mapping[str, Any] | None = None) -> web.Response:
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, arr in outputs.items():
        datatype = protocol.output_datatype(arr, model.output_datatypes[name])
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
        # JSON has no NaN or infinity: such an output goes with the binary extension, exact
        if wanted.get(name, binary_out) or not jsontensors.finite(arr):
            raw = protocol.to_raw(arr)
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = protocol.to_values(arr) if arr.dtype == object else jsontensors.json_array(arr)
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model.name, "model_version": VERSION, "outputs": entries}
    if request_id is not None:
        doc["id"] = request_id
    if parameters:
        doc["parameters"] = dict(parameters)
    head = jsontensors.dumps(doc)
    if not blobs:
        return web.Response(body=head, content_type="application/json")
    return web.Response(body=b"".join([head, *blobs]), content_type="application/octet-stream",
                        headers={HEADER_LENGTH: str(len(head))})
