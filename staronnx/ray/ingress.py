"""The KServe v2 HTTP API on Ray Serve's ingress, in front of the model replicas.

The ingress decodes and encodes requests with ``staronnx serve``'s own protocol code
(:mod:`staronnx.serve.http_api`: the JSON header, Triton's binary-tensor extension, the
response layout; :mod:`staronnx.serve.protocol`: datatypes and errors), so a client sees the
same API, errors included, from one server or from a cluster. It holds no model: it passes
decoded tensors, with the model's name, to the replicas of the deployment that serves that
model through Serve's handles (Serve picks the less loaded of two replicas) and needs no CPU
of its own (``num_cpus=0``). Several models may share one deployment (one runtime per replica
hosting them all): then several names map to one handle, and the name travelling with each
call picks the model inside the replica.

Faults: when the replica running a request dies (killed, its machine lost) the request is
**retried once**, on another replica. Inference has no side effects, and a dead replica can
no longer answer, so a retried request is still answered exactly once. A request whose retry
fails too gets a 503 naming the cause; nothing is dropped silently. Other errors are not
retried: a protocol error is the client's (400), a failing part fails its request (500).
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any, Mapping

from staronnx.serve.protocol import ProtocolError, invalid

log = logging.getLogger("staronnx.ray")

_MODEL_ROUTE = re.compile(r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?(?P<tail>/ready|/config|/infer)?/?$")
#: how long a readiness probe waits for a replica's answer
READY_TIMEOUT_S = 5.0


@dataclass
class _ModelInfo:
    """What encoding a response needs of a model (the attributes ``_encode_response`` reads)."""

    name: str
    output_datatypes: dict[str, str]
    metadata: dict[str, Any]


def _retryable() -> tuple[type[BaseException], ...]:
    """Errors that mean the replica is gone (not that the request is bad): every
    ``RayActorError`` (died, unavailable, its node lost) and Serve's own word for it."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError

    return RayActorError, ReplicaUnavailableError


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


class KServeIngress:
    """Routes KServe v2 HTTP requests to the models' deployments (see the module docstring)."""

    def __init__(self, models: Mapping[str, Any], max_body: int = 64 * 2**20) -> None:
        self.models = dict(models)  # model name -> DeploymentHandle of the replicas hosting it
        self.max_body = int(max_body)
        self._info: dict[str, _ModelInfo] = {}
        self._retries = 0

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            return await self._route(request)
        except ProtocolError as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.http_status)
        except _MethodNotAllowed as exc:
            return JSONResponse({"error": str(exc)}, status_code=405)
        except Exception as exc:  # noqa: BLE001 - a bug answers 500 and the ingress keeps serving
            log.exception("internal error on %s %s", request.method, request.url.path)
            return JSONResponse({"error": f"internal server error: {_first_line(exc)}"}, status_code=500)

    async def _route(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, Response

        from staronnx.serve.app import server_metadata

        path, method = request.url.path, request.method
        if path in ("/v2", "/v2/"):
            _only(method, "GET", path)
            return JSONResponse(server_metadata())
        if path == "/v2/health/live":
            _only(method, "GET", path)
            return Response(status_code=200)
        if path == "/v2/health/ready":
            _only(method, "GET", path)
            ready = await asyncio.gather(*(self._ready(n) for n in self.models))
            return Response(status_code=200 if all(ready) else 503)
        m = _MODEL_ROUTE.match(path)
        if m is None:
            raise ProtocolError("not_found", f"no such endpoint: {method} {path}")
        name, tail = m.group("model"), m.group("tail") or ""
        if name not in self.models:
            raise ProtocolError("not_found", f"unknown model {name!r}; this server serves {sorted(self.models)}")
        _check_version(name, m.group("version"))
        if tail == "/infer":
            _only(method, "POST", path)
            return await self._infer(name, request)
        _only(method, "GET", path)
        if tail == "/ready":
            return Response(status_code=200 if await self._ready(name) else 503)
        if tail == "/config":
            return JSONResponse(await self._call(name, "config"))
        return JSONResponse((await self._model_info(name)).metadata)

    # -- inference -----------------------------------------------------------------------------
    async def _infer(self, name: str, request: Any) -> Any:
        from starlette.responses import Response

        from staronnx.serve.http_api import HEADER_LENGTH, _decode_request, _encode_response, _split_body

        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise invalid(f"request body of {length} bytes is larger than --max-body ({self.max_body} bytes)")
        body = await request.body()
        if len(body) > self.max_body:
            raise invalid(f"request body is larger than --max-body ({self.max_body} bytes)")
        header, binary = _split_body(body, request.headers.get(HEADER_LENGTH))
        inputs, datatypes, wanted, binary_out = _decode_request(header, binary)
        reply = await self._call(name, "infer", inputs, datatypes, [n for n, _ in wanted] or None)
        if reply.error is not None:
            raise ProtocolError(*reply.error)
        info = await self._model_info(name)
        encoded = _encode_response(info, header.get("id"), reply.outputs, dict(wanted), binary_out,  # type: ignore[arg-type]
                                   reply.parameters)
        headers = {k: v for k, v in encoded.headers.items() if k.lower() not in ("content-type", "content-length")}
        return Response(content=encoded.body, status_code=encoded.status, media_type=encoded.content_type,
                        headers=headers)

    async def _call(self, name: str, method: str, *args: Any) -> Any:
        """``method`` of model ``name`` on one of the replicas hosting it (the name picks the
        model inside a replica that hosts several); retried once on another if that one dies."""
        from ray.exceptions import RayTaskError
        from ray.serve.exceptions import BackPressureError

        handle = getattr(self.models[name], method)
        first: BaseException | None = None
        for attempt in (1, 2):
            try:
                return await handle.remote(*args, model=name)
            except _retryable() as exc:
                if attempt == 2:
                    raise ProtocolError(
                        "unavailable",
                        f"model {name!r}: the replica running this request died ({_first_line(first)}), "  # type: ignore[arg-type]
                        f"and so did the one it was retried on ({_first_line(exc)}); retry later") from None
                first = exc
                self._retries += 1
                log.warning("model %r: a replica died during %s (%s); retrying once", name, method, _first_line(exc))
            except BackPressureError:
                raise ProtocolError("unavailable", f"model {name!r}: every replica is busy and the queue in "
                                    "front of them is full; retry later") from None
            except RayTaskError as exc:  # the replica raised: a bug there, not the client's fault
                raise ProtocolError("internal", f"model {name!r}: {method} failed on a replica: "
                                    f"{_first_line(exc.cause) if exc.cause else _first_line(exc)}") from None
        raise AssertionError("unreachable")

    async def _model_info(self, name: str) -> _ModelInfo:
        info = self._info.get(name)
        if info is None:
            meta = await self._call(name, "metadata")
            info = _ModelInfo(name, {t["name"]: t["datatype"] for t in meta["outputs"]}, meta)
            self._info[name] = info
        return info

    async def _ready(self, name: str) -> bool:
        try:
            return bool(await asyncio.wait_for(self._call(name, "ready"), READY_TIMEOUT_S))
        except (ProtocolError, asyncio.TimeoutError):
            return False

    def retries(self) -> int:
        """Requests retried since this ingress started (a replica died under them)."""
        return self._retries


class _MethodNotAllowed(Exception):
    """A known path with the wrong method (405, as ``staronnx serve`` answers it)."""


def _only(method: str, allowed: str, path: str) -> None:
    if method != allowed:
        raise _MethodNotAllowed(f"method {method} not allowed on {path}")


def _check_version(name: str, version: str | None) -> None:
    from staronnx.serve.metrics import VERSION

    if version not in (None, "", VERSION):
        raise ProtocolError("not_found", f"model {name!r} has no version {version!r} (it serves version {VERSION})")
