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

Triton's calls answer as ``staronnx serve``'s do (its clients and example programs run
unchanged): statistics (each replica's counts for a model travel back with every reply, and
the ingress sums the latest of each with what it refused itself: Serve has no call that
reaches every replica), the read-only repository index, classification, and Triton's wording
for an unknown model. With several ingress replicas each sums what its own replies carried.

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
import time
from dataclasses import dataclass
from typing import Any, Mapping

from staronnx.ray.replica import Reply
from staronnx.serve.frontend import refused_load, repository_index
from staronnx.serve.metrics import ModelStats
from staronnx.serve.models import check_version
from staronnx.serve.protocol import ProtocolError, cut, invalid, shown, unknown_model

log = logging.getLogger("staronnx.ray")

_MODEL_ROUTE = re.compile(
    r"^/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?(?P<tail>/ready|/config|/infer|/stats)?/?$")
_LOAD_ROUTE = re.compile(r"^/v2/repository/models/(?P<model>[^/]+)/(?P<action>load|unload)/?$")
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
        #: per model, what the ingress itself counted: the requests it refused or could not get
        #: answered, and the time it spent decoding and encoding the answered ones
        self._stats = {name: ModelStats() for name in self.models}
        #: (replica, model) -> that replica's latest counts of the model (see the module doc)
        self._replica_stats: dict[tuple[str, str], dict[str, Any]] = {}

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            return await self._route(request)
        except ProtocolError as exc:
            return JSONResponse({"error": str(exc)}, status_code=exc.http_status)
        except _MethodNotAllowed as exc:
            return JSONResponse({"error": str(exc)}, status_code=405)
        except Exception:  # noqa: BLE001 - a bug answers 500 and the ingress keeps serving
            log.exception("internal error on %s %s", request.method, cut(request.url.path, 100))
            return JSONResponse({"error": "internal server error (the server's log has the details)"},
                                status_code=500)

    async def _route(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, Response

        from staronnx.serve.app import EXTENSIONS, server_metadata

        path, method = request.url.path, request.method
        if path in ("/v2", "/v2/"):
            _only(method, "GET", path)
            return JSONResponse(server_metadata(EXTENSIONS))
        if path == "/v2/health/live":
            _only(method, "GET", path)
            return Response(status_code=200)
        if path == "/v2/health/ready":
            _only(method, "GET", path)
            ready = await asyncio.gather(*(self._ready(n) for n in self.models))
            return Response(status_code=200 if all(ready) else 503)
        if path in ("/v2/models/stats", "/v2/models/stats/"):
            _only(method, "GET", path)
            return JSONResponse({"model_stats": [self.statistics(n) for n in sorted(self.models)]})
        if path in ("/v2/repository/index", "/v2/repository/index/"):
            _only(method, "POST", path)
            return JSONResponse(await self._repository_index(request))
        load = _LOAD_ROUTE.match(path)
        if load is not None:
            _only(method, "POST", path)
            raise refused_load(load.group("model"), load.group("action"))
        m = _MODEL_ROUTE.match(path)
        if m is None:
            raise ProtocolError("not_found", f"no such endpoint: {method} {cut(path, 100)}")
        name, tail = m.group("model"), m.group("tail") or ""
        if name not in self.models:
            raise unknown_model(name, list(self.models))
        check_version(name, m.group("version"))
        if tail == "/infer":
            _only(method, "POST", path)
            return await self._infer(name, request)
        _only(method, "GET", path)
        if tail == "/ready":
            return Response(status_code=200 if await self._ready(name) else 503)
        if tail == "/config":
            return JSONResponse(await self._call(name, "config"))
        if tail == "/stats":
            return JSONResponse({"model_stats": [self.statistics(name)]})
        return JSONResponse((await self._model_info(name)).metadata)

    # -- Triton's statistics and repository index ----------------------------------------------
    def statistics(self, name: str) -> dict[str, Any]:
        """Triton's statistics of model ``name``: the latest counts every replica sent back, plus
        the ingress's own (see the module docstring)."""
        from staronnx.serve.metrics import merge_snapshots, triton_statistics

        replicas = [snap for (_, model), snap in self._replica_stats.items() if model == name]
        return triton_statistics(name, merge_snapshots([self._stats[name].snapshot(), *replicas]))

    def _note(self, name: str, reply: Reply) -> None:
        """Keep the counts a replica's reply carries (none where no model answered), the
        newest of them: concurrent replies arrive in any order, and one taken before another
        request finished must not replace the counts that include it (a client that read the
        statistics after its last answer saw one request fewer)."""
        if reply.stats is None:
            return
        key = (reply.replica, name)
        kept = self._replica_stats.get(key)
        if kept is None or _progress(reply.stats) >= _progress(kept):
            self._replica_stats[key] = reply.stats

    async def _repository_index(self, request: Any) -> list[dict[str, str]]:
        """Triton's repository index, read-only: every model, READY when a replica answers ready;
        ``{"ready": true}`` lists only those."""
        from staronnx.serve.http_api import index_ready

        only_ready = await index_ready(await self._body(request), request.headers.get("content-encoding"),
                                      self.max_body)
        ready = await asyncio.gather(*(self._ready(n) for n in self.models))
        return repository_index(dict(zip(self.models, ready)), "no replica of the model answers ready", only_ready)

    async def _body(self, request: Any) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise invalid(f"request body of {length} bytes is larger than --max-body ({self.max_body} bytes)")
        body: bytes = await request.body()  # (a starlette Request, untyped here)
        if len(body) > self.max_body:
            raise invalid(f"request body is larger than --max-body ({self.max_body} bytes)")
        return body

    # -- inference -----------------------------------------------------------------------------
    async def _infer(self, name: str, request: Any) -> Any:
        from starlette.responses import Response

        from staronnx.serve.http_api import HEADER_LENGTH, decode_body, encode_answer, requested_classes

        stats = self._stats[name]
        t0 = time.perf_counter()
        try:
            header, inputs, datatypes, wanted, binary_out = await decode_body(
                await self._body(request), request.headers.get("content-encoding"),
                request.headers.get(HEADER_LENGTH), self.max_body)
        except ProtocolError:
            stats.refused("OTHER")  # as Triton counts it: a failed request of this model
            raise
        decode_s = time.perf_counter() - t0
        try:
            reply = await self._call(name, "infer", inputs, datatypes, [n for n, _ in wanted] or None,
                                     classes=requested_classes(header) or None)
        except ProtocolError as exc:  # no replica answered: counted here, where it failed
            stats.refused("REJECTED" if exc.kind == "unavailable" else "OTHER")
            raise
        self._note(name, reply)
        if reply.error is not None:  # the replica counted it
            raise ProtocolError(*reply.error)
        info = await self._model_info(name)
        t1 = time.perf_counter()
        encoded = await encode_answer(info, header.get("id"), reply.outputs, dict(wanted), binary_out,
                                      reply.parameters)
        stats.decoded(decode_s)
        stats.encoded(time.perf_counter() - t1)
        headers = {k: v for k, v in encoded.headers.items() if k.lower() not in ("content-type", "content-length")}
        return Response(content=encoded.body, status_code=encoded.status, media_type=encoded.content_type,
                        headers=headers)

    async def _call(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` of model ``name`` on one of the replicas hosting it (the name picks the
        model inside a replica that hosts several); retried once on another if that one dies."""
        from ray.exceptions import RayTaskError
        from ray.serve.exceptions import BackPressureError

        handle = self.models[name].options(method_name=method)
        first: BaseException | None = None
        for attempt in (1, 2):
            try:
                return await handle.remote(*args, model=name, **kwargs)
            except _retryable() as exc:
                if attempt == 2:
                    died = _first_line(first) if first is not None else "no detail"  # (set by attempt 1)
                    raise ProtocolError(
                        "unavailable",
                        f"model {shown(name)}: the replica running this request died ({died}), "
                        f"and so did the one it was retried on ({_first_line(exc)}); retry later") from None
                first = exc
                self._retries += 1
                log.warning("model %r: a replica died during %s (%s); retrying once", name, method, _first_line(exc))
            except BackPressureError:
                raise ProtocolError("unavailable", f"model {shown(name)}: every replica is busy and the queue in "
                                    "front of them is full; retry later") from None
            except RayTaskError as exc:  # the replica raised: a bug there, not the client's fault
                log.error("model %r: %s failed on a replica: %s", name, method,
                          _first_line(exc.cause) if exc.cause else _first_line(exc))
                raise ProtocolError("internal", f"model {shown(name)}: {method} failed on a replica (the "
                                    "server's log has the details)") from None
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


def _progress(snapshot: Mapping[str, Any]) -> tuple[int, int]:
    """How far a replica's counts have come (they only grow): answered, then failed requests."""
    return int(snapshot.get("success", 0)), sum(int(n) for n in (snapshot.get("failure") or {}).values())
