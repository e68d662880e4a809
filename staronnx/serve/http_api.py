"""The KServe v2 REST API on aiohttp, with Triton's binary-tensor extension.

Why aiohttp: one asyncio event loop then serves HTTP, gRPC (``grpc.aio``) and metrics with no
thread per connection, awaiting the batcher's futures; it is mature, parses HTTP itself
(request size limits, chunked bodies, gzip/deflate request bodies), and ``tritonclient[http]``
depends on it already.

The binary extension: with an ``Inference-Header-Content-Length: L`` header the body is L bytes
of JSON followed by the raw bytes of every input whose ``parameters.binary_data_size`` says
how many, in input order; outputs asked for with ``binary_data`` (or every output, with the
request parameter ``binary_data_output``) come back the same way.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import numpy as np
from aiohttp import web

from staronnx.serve import protocol
from staronnx.serve.metrics import VERSION
from staronnx.serve.models import ModelEndpoint
from staronnx.serve.protocol import ProtocolError, invalid

log = logging.getLogger("staronnx.serve")

HEADER_LENGTH = "Inference-Header-Content-Length"


class HttpFrontend:
    """The REST routes over a set of models; ``app()`` builds the aiohttp application."""

    def __init__(self, models: Mapping[str, ModelEndpoint], server_meta: dict[str, Any], max_body: int,
                 is_ready: Callable[[], bool]) -> None:
        self.models = models
        self.server_meta = server_meta
        self.max_body = max_body
        self.is_ready = is_ready

    def app(self) -> web.Application:
        # aiohttp refuses bodies over client_max_size itself (we turn its 413 into the protocol's 400)
        app = web.Application(client_max_size=self.max_body, middlewares=[_errors])
        r = app.router
        r.add_get("/v2", self.server_metadata)
        r.add_get("/v2/health/live", self.live)
        r.add_get("/v2/health/ready", self.ready)
        for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
            r.add_get(prefix, self.model_metadata)
            r.add_get(prefix + "/ready", self.model_ready)
            r.add_get(prefix + "/config", self.model_config)
            r.add_post(prefix + "/infer", self.infer)
        return app

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
            raise ProtocolError("not_found", f"unknown model {name!r}; this server serves {sorted(self.models)}")
        model.check_version(request.match_info.get("version"))
        return model

    async def model_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(self._model(request).metadata())

    async def model_config(self, request: web.Request) -> web.Response:
        return web.json_response(self._model(request).config())

    async def model_ready(self, request: web.Request) -> web.Response:
        model = self._model(request)
        return web.Response(status=200 if model.ready and self.is_ready() else 503)

    # -- inference ------------------------------------------------------------------------------
    async def infer(self, request: web.Request) -> web.Response:
        model = self._model(request)
        t0 = time.perf_counter()
        try:
            header, inputs, datatypes, wanted, binary_out = await self._read(request)
        except ProtocolError:
            model.stats.refused("OTHER")  # counted as Triton does: a failed request of this model
            raise
        t1 = time.perf_counter()
        answer = await model.infer(inputs, datatypes, [n for n, _ in wanted] or None, decode_s=t1 - t0)
        t2 = time.perf_counter()
        response = _encode_response(model, header.get("id"), answer.outputs, dict(wanted), binary_out,
                                    answer.parameters)
        model.stats.encoded(time.perf_counter() - t2)
        return response

    async def _read(self, request: web.Request) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, str],
                                                         list[tuple[str, bool]], bool]:
        if request.content_length is not None and request.content_length > self.max_body:
            raise invalid(f"request body of {request.content_length} bytes is larger than --max-body ({self.max_body} bytes)")
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise invalid(f"request body is larger than --max-body ({self.max_body} bytes)") from None
        header, binary = _split_body(body, request.headers.get(HEADER_LENGTH))
        return (header, *_decode_request(header, binary))


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
        text = {404: f"no such endpoint: {request.method} {request.path}",
                405: f"method {request.method} not allowed on {request.path}"}.get(exc.status, exc.reason)
        return web.json_response({"error": text}, status=exc.status)
    except ConnectionError:  # the client went away mid-request: nobody to answer, nothing to log
        return web.Response(status=400)
    except Exception as exc:  # noqa: BLE001 - a server bug answers 500 and keeps serving
        log.exception("internal error on %s %s", request.method, request.path)
        return web.json_response({"error": f"internal server error: {type(exc).__name__}: {exc}"}, status=500)


def _split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], memoryview]:
    """The JSON header (parsed) and the binary tail of a request body."""
    if header_length is None:
        json_part, tail = body, memoryview(b"")
    else:
        try:
            length = int(header_length)
        except ValueError:
            raise invalid(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
        if not 0 <= length <= len(body):
            raise invalid(f"{HEADER_LENGTH} is {length}, but the body has {len(body)} bytes")
        view = memoryview(body)
        json_part, tail = bytes(view[:length]), view[length:]
    try:
        header = json.loads(json_part)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"malformed JSON in the inference request: {exc}") from None
    if not isinstance(header, dict):
        raise invalid("the inference request must be a JSON object")
    return header, tail


def _params(obj: Mapping[str, Any], what: str) -> dict[str, Any]:
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise invalid(f"{what}: 'parameters' must be a JSON object")
    return params


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
            raise invalid(f"input {name!r} is given twice")
        datatype = spec.get("datatype")
        size = _params(spec, f"input {name!r}").get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise invalid(f"input {name!r}: binary_data_size must be a non-negative integer, got {size!r}")
            if offset + size > len(binary):
                raise invalid(f"input {name!r}: binary_data_size {size} runs past the end of the body "
                              f"({len(binary) - offset} bytes left)")
            inputs[name] = protocol.from_raw(name, datatype, spec.get("shape"), binary[offset:offset + size])
            offset += size
        elif "data" in spec:
            inputs[name] = protocol.from_values(name, datatype, spec.get("shape"), spec["data"])
        else:
            raise invalid(f"input {name!r} has neither 'data' nor parameters.binary_data_size")
        datatypes[name] = datatype
    if offset != len(binary):
        raise invalid(f"{len(binary) - offset} bytes of binary data follow the inputs that no input claims")
    binary_out = bool(_params(header, "the request").get("binary_data_output", False))
    wanted: list[tuple[str, bool]] = []
    outs = header.get("outputs", [])
    if not isinstance(outs, list):
        raise invalid("'outputs' must be a list")
    for i, out in enumerate(outs):
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise invalid(f"outputs[{i}] must be an object with a 'name'")
        wanted.append((out["name"], bool(_params(out, f"output {out['name']!r}").get("binary_data", binary_out))))
    return inputs, datatypes, wanted, binary_out


def _encode_response(model: ModelEndpoint, request_id: Any, outputs: Mapping[str, np.ndarray],
                     wanted: Mapping[str, bool], binary_out: bool,
                     parameters: Mapping[str, Any] | None = None) -> web.Response:
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, arr in outputs.items():
        entry: dict[str, Any] = {"name": name, "datatype": model.output_datatypes[name], "shape": list(arr.shape)}
        if wanted.get(name, binary_out):
            raw = protocol.to_raw(arr)
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = arr.ravel().tolist()
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model.name, "model_version": VERSION, "outputs": entries}
    if request_id is not None:
        doc["id"] = request_id
    if parameters:
        doc["parameters"] = dict(parameters)
    head = json.dumps(doc).encode()
    if not blobs:
        return web.Response(body=head, content_type="application/json")
    return web.Response(body=b"".join([head, *blobs]), content_type="application/octet-stream",
                        headers={HEADER_LENGTH: str(len(head))})
