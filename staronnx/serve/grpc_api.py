"""The KServe v2 gRPC API on ``grpc.aio``, with stubs generated from ``proto/grpc_predict_v2.proto``
(Triton's GRPCInferenceService: KServe's calls plus the bidirectional ModelStreamInfer,
ModelConfig, ModelStatistics, RepositoryIndex and the system shared-memory calls (:mod:`staronnx.serve.shm`), which Triton's
tools call; RepositoryModelLoad/Unload go to model control (:mod:`staronnx.serve.control`) and
answer FAILED_PRECONDITION where it is off, registering CUDA shared memory INVALID_ARGUMENT, the
other Triton calls UNIMPLEMENTED).

Why grpcio: it is gRPC's reference implementation (HTTP/2, flow control, deadlines,
cancellation, message size limits all in its C core), and ``grpc.aio`` runs its handlers on the
same asyncio loop as the HTTP front end, so both await the same batcher.

What it costs: grpcio's core runs a unary call as four completion-queue events (the call, its
message, the answer sent, the call closed), and ``grpc.aio`` hands each one from its poller
thread to the loop through a socket pair (a ``write`` there, a ``recv(1)`` and a loop turn here),
the core waking the poller back when the loop completes an operation. Measured on the 2-core
host with a trivial model (issue 51): 29-38 system calls and 5-9 thread switches per call, 20 or
so of the calls in that hand-off; an echo handler answering at once costs 190-260 µs of server
CPU per call there, most of the 230-340 µs a served call costs (HTTP: 180-260 µs, under one
switch per request). grpcio's own threaded server measured no cheaper once its handler waits
for the batcher (13-15 switches per call).

Inputs come as ``raw_input_contents`` (what tritonclient sends: one bytes entry per input), as
typed ``contents`` or from a registered shared-memory region; outputs go back as
``raw_output_contents``, as Triton does (an empty entry for one written to shared memory), each
written onto the wire straight from the output's memory (:mod:`staronnx.serve.grpc_wire`). A
message larger than ``--max-body`` is refused by gRPC's core with RESOURCE_EXHAUSTED before any
handler sees it (gRPC's standard answer to an oversized message, and it costs no memory). A
message that does not decode is INVALID_ARGUMENT (the handlers are registered with deserializers
that catch protobuf's DecodeError; grpc's own answer would be UNKNOWN).

Against hostile and careless clients, gRPC's core holds the limits (:func:`make_server` says
how, :mod:`staronnx.serve.limits` why); an inference call not answered within
``--request-timeout`` is withdrawn and answered DEADLINE_EXCEEDED (one timer for all calls:
:mod:`staronnx.serve.grpc_deadlines`). A stopping server answers
UNAVAILABLE, never CANCELLED: its calls are all answered before the listener closes
(:mod:`staronnx.serve.app`). Every call a handler refuses is counted, in the model's
``nv_inference_request_failure`` and in ``staronnx_requests_total{protocol="grpc"}``.

The generated module registers the ``inference.*`` messages in protobuf's default pool, as
``tritonclient.grpc`` does with its own copy: import this server and ``tritonclient.grpc`` in
separate processes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from collections.abc import AsyncIterator
from typing import Any, NoReturn, TypeAlias

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from staronnx.serve import protocol
from staronnx.serve.frontend import Frontend, load_or_unload
from staronnx.serve.grpc_deadlines import Deadlines
from staronnx.serve.grpc_wire import InferAnswer, serialize_infer, serialize_stream
from staronnx.serve.proto import grpc_predict_v2_pb2 as pb
from staronnx.serve.proto import model_config_pb2 as mc
from staronnx.serve.protocol import ProtocolError, invalid, shown
from staronnx.serve.shm import CUDA_REFUSED, REGION, SharedMemoryRegions, check_local, local_peer

SERVICE = "inference.GRPCInferenceService"

#: requests of one ``ModelStreamInfer`` stream read and not yet answered (their answers handed to
#: gRPC): past it the stream reads no more until an answer is written, so a client that sends
#: without reading its answers meets HTTP/2's flow control instead of growing the server's memory
#: by an answer a request; a sequence client (a request at a time) or a pipelining one (the
#: model's queue is the limit that decides) never reaches it
STREAM_IN_FLIGHT = 256

Ctx: TypeAlias = grpc.aio.ServicerContext


class GrpcFrontend(Frontend):
    """The servicer: the RPCs of :meth:`served`, errors as gRPC status codes."""

    protocol = "grpc"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: inference calls not answered yet (what a shutdown waits for before the listener closes)
        self.unanswered = 0
        #: cleared for the last moments of a shutdown (:meth:`hold`): calls wait for it before they are refused
        self.unheld = asyncio.Event()
        self.unheld.set()
        #: ``--request-timeout`` of the inference calls in flight
        self.deadlines = Deadlines(self.guard.limits.request_timeout)

    def served(self) -> dict[str, Callable[[Any, Ctx], Any]]:
        """The RPCs served, by name (gRPC's core answers the others UNIMPLEMENTED)."""
        return {rpc.__name__: rpc for rpc in (
            self.ServerLive, self.ServerReady, self.ModelReady, self.ServerMetadata, self.ModelMetadata,
            self.ModelInfer, self.ModelConfig, self.ModelStatistics, self.RepositoryIndex,
            self.RepositoryModelLoad, self.RepositoryModelUnload,
            self.SystemSharedMemoryStatus, self.SystemSharedMemoryRegister, self.SystemSharedMemoryUnregister,
            self.CudaSharedMemoryStatus, self.CudaSharedMemoryRegister, self.CudaSharedMemoryUnregister)}

    def hold(self) -> None:
        """From now on, calls to a stopping server wait before they are answered UNAVAILABLE,
        until :meth:`release`. Why: grpcio cancels (CANCELLED, not UNAVAILABLE) every call that
        reaches its core while the server stops, and a client told UNAVAILABLE at once sends its
        next call at once; held, every busy client's call is in a handler when the stop begins
        (its GOAWAY sent), and is answered then, within the stop's grace: the client's next call
        goes to the closed port (measured: 30 of 32 tight-loop clients lost a call to CANCELLED
        at the stop; none with the hold). :meth:`release` answers them, once
        :meth:`grpc.aio.Server.stop` has begun."""
        self.unheld.clear()

    def release(self) -> None:
        self.unheld.set()

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Ctx) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Ctx) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.is_ready())

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Ctx) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**self.server_meta)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Ctx) -> pb.ModelReadyResponse:
        try:
            ready = self.model_ready(request.name, request.version)
        except ProtocolError as exc:
            if exc.kind != "not_found":
                raise
            # Triton answers ready=false (status OK) for a model or version it does not serve:
            # tritonclient's is_model_ready then returns False rather than raising
            ready = False
        return pb.ModelReadyResponse(ready=ready)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Ctx) -> pb.ModelMetadataResponse:
        meta = self.model(request.name, request.version).metadata()
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]], outputs=[tensor(**t) for t in meta["outputs"]])

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Ctx) -> pb.ModelConfigResponse:
        config = self.model(request.name, request.version).config()
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, mc.ModelConfig()))

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context: Ctx) -> pb.ModelStatisticsResponse:
        # ignore_unknown_fields: the "staronnx" section (targets, busy shares) has no field in
        # Triton's message; HTTP clients get it
        response = pb.ModelStatisticsResponse()
        json_format.ParseDict(self.statistics(request.name, request.version), response, ignore_unknown_fields=True)
        return response

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: Ctx) -> pb.RepositoryIndexResponse:
        response = pb.RepositoryIndexResponse()
        json_format.ParseDict({"models": self.repository_entries(request.ready)}, response)
        return response

    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context: Ctx) -> pb.RepositoryModelLoadResponse:
        params = request.parameters
        config = params["config"].string_param if "config" in params else None
        files = {k: v.bytes_param for k, v in params.items() if k.startswith("file:")}
        await load_or_unload(self, request.model_name, "load", config, files)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context: Ctx) -> pb.RepositoryModelUnloadResponse:
        await load_or_unload(self, request.model_name, "unload")
        return pb.RepositoryModelUnloadResponse()

    async def SystemSharedMemoryStatus(self, request: pb.SystemSharedMemoryStatusRequest,
                                       context: Ctx) -> pb.SystemSharedMemoryStatusResponse:
        check_local(context.peer())
        response = pb.SystemSharedMemoryStatusResponse()
        for region in self.regions.status(request.name):
            response.regions[region["name"]].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
        return response

    async def SystemSharedMemoryRegister(self, request: pb.SystemSharedMemoryRegisterRequest,
                                         context: Ctx) -> pb.SystemSharedMemoryRegisterResponse:
        check_local(context.peer())
        self.regions.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request: pb.SystemSharedMemoryUnregisterRequest,
                                           context: Ctx) -> pb.SystemSharedMemoryUnregisterResponse:
        check_local(context.peer())
        self.regions.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request: pb.CudaSharedMemoryStatusRequest,
                                     context: Ctx) -> pb.CudaSharedMemoryStatusResponse:
        if request.name:
            raise invalid(CUDA_REFUSED)
        return pb.CudaSharedMemoryStatusResponse()  # no region: none can be registered

    async def CudaSharedMemoryRegister(self, request: pb.CudaSharedMemoryRegisterRequest, context: Ctx) -> NoReturn:
        raise invalid(CUDA_REFUSED)

    async def CudaSharedMemoryUnregister(self, request: pb.CudaSharedMemoryUnregisterRequest,
                                         context: Ctx) -> pb.CudaSharedMemoryUnregisterResponse:
        if request.name:
            raise invalid(CUDA_REFUSED)
        return pb.CudaSharedMemoryUnregisterResponse()  # every region: there are none

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Ctx) -> InferAnswer:
        """Registered as it is, not behind :func:`_checked` (a coroutine more per request on the
        loop that every RPC shares), so it answers an undecodable request itself. Every call's
        outcome is counted; one not answered within ``--request-timeout`` is withdrawn and
        answered DEADLINE_EXCEEDED."""
        try:
            return await self._counted(request, context)
        except ProtocolError as exc:
            await _abort(context, exc)

    async def _counted(self, request: pb.ModelInferRequest, context: Ctx) -> InferAnswer:
        """:meth:`_infer`, its outcome counted, withdrawn past ``--request-timeout``; a refusal
        raises its :class:`ProtocolError` (counted) for the caller to answer."""
        self.unanswered += 1
        call = self.deadlines.enter()
        try:
            try:
                response = await self._infer(request, context)
            except asyncio.CancelledError:
                if self.deadlines.withdrawn(call):
                    raise self.timed_out() from None
                raise
        except BaseException as exc:
            self.ended(exc)
            raise
        finally:
            self.unanswered -= 1
            self.deadlines.leave(call)
        self.ended()
        return response

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Ctx) -> AsyncIterator[Any]:
        """Triton's bidirectional stream (tritonclient's ``start_stream``/``async_stream_infer``,
        what its sequence clients use): each request read is run as :meth:`ModelInfer` runs one,
        started in the order it came (so a sequence's requests join it in order), and its answer
        written back as it is ready; a refused request is answered with its ``error_message`` and
        the stream stays open. The stream ends once the client has sent its last request and
        every answer is written; a client that leaves cancels what it had in flight."""
        answers: asyncio.Queue[InferAnswer | pb.ModelStreamInferResponse | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()
        room = asyncio.Semaphore(STREAM_IN_FLIGHT)  # read and not yet answered (see STREAM_IN_FLIGHT)

        async def one(request: Any) -> None:
            response: InferAnswer | pb.ModelStreamInferResponse
            try:
                response = await self._counted(request, context)  # written as the stream's infer_response
            except ProtocolError as exc:
                response = pb.ModelStreamInferResponse(error_message=str(exc))
                if type(request) is not _Undecodable:  # the request it answers, for the client's bookkeeping
                    response.infer_response.id = request.id
                    response.infer_response.model_name = request.model_name
                    response.infer_response.model_version = request.model_version
            await answers.put(response)

        async def read() -> None:
            try:
                incoming = aiter(requests)
                while True:
                    await room.acquire()  # a place for the next request before it is read
                    try:
                        request = await anext(incoming)
                    except StopAsyncIteration:
                        break
                    task = asyncio.ensure_future(one(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                while running:
                    await asyncio.wait(set(running))
            finally:
                answers.put_nowait(None)  # the last answer is written: the stream ends

        reader = asyncio.ensure_future(read())
        try:
            while (answer := await answers.get()) is not None:
                yield answer
                room.release()  # gRPC took the answer: the reader may read one more request
            failed = None if reader.cancelled() else reader.exception()
            if failed is not None:  # reading the client's requests failed: the stream fails with it
                raise failed
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()

    async def _infer(self, request: pb.ModelInferRequest, context: Ctx) -> InferAnswer:
        if type(request) is _Undecodable:
            raise request.error
        model = self.model(request.model_name, request.model_version)
        if not self.is_ready():  # stopping: answered UNAVAILABLE (after the hold, if one is on), never reset
            await self.unheld.wait()
            raise self.stopping(model)
        t0 = time.perf_counter()
        placed = {o.name: _parameters(o.parameters) for o in request.outputs if REGION in o.parameters}
        try:
            # the peer is read only for a tensor in shared memory (most requests have none)
            inputs, datatypes = _decode_inputs(request, lambda: self.regions if local_peer(context.peer()) else None)
            for name, params in placed.items():  # refused before the request runs, as its inputs are
                check_local(context.peer())
                self.regions.check_output(name, params)
        except ProtocolError:
            model.stats.refused("OTHER")
            raise
        wanted = [o.name for o in request.outputs] or None
        # the value as sent (run() refuses one that is no non-negative integer, as over HTTP): reading
        # int64_param alone made a string or bool classification 0, the output sent unclassified
        classes = {o.name: _parameters(o.parameters)["classification"] for o in request.outputs
                   if "classification" in o.parameters}
        answer = await model.infer(inputs, datatypes, wanted, decode_s=time.perf_counter() - t0, classes=classes,
                                   parameters=_parameters(request.parameters) if request.parameters else None)
        t2 = time.perf_counter()
        response = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=request.id)
        raws: list[bytes | memoryview] = []
        for key, value in answer.parameters.items():
            if isinstance(value, int):
                response.parameters[key].int64_param = value
            else:
                response.parameters[key].string_param = str(value)
        for name, arr in answer.outputs.items():
            entry = response.outputs.add(name=name, datatype=protocol.output_datatype(arr, model.output_datatypes[name]),
                                         shape=list(arr.shape))
            if name in placed:  # written to its region; an empty raw entry keeps the others' positions
                size = self.regions.write_output(name, arr, placed[name])
                entry.parameters[REGION].string_param = str(placed[name][REGION])
                entry.parameters["shared_memory_byte_size"].int64_param = size
                raws.append(b"")
            else:
                raws.append(protocol.raw_view(arr))
        model.stats.encoded(time.perf_counter() - t2)
        return InferAnswer(response, raws)


async def _abort(context: Ctx, exc: ProtocolError) -> NoReturn:
    """End the call with ``exc``'s status code and message (``abort`` raises)."""
    await context.abort(grpc.StatusCode[exc.grpc_code], str(exc))
    raise AssertionError("unreachable")


def _parameters(params: Any) -> dict[str, Any]:
    """A protobuf map of InferParameter as plain values (each its one set field)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, which) if which else None
    return out


def _decode_inputs(request: pb.ModelInferRequest, local_regions: Callable[[], SharedMemoryRegions | None]
                   ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Arrays from raw_input_contents (one per input, in order; an input placed in shared memory
    has none, or an empty one), from typed contents, or from a registered shared-memory region.
    ``local_regions``: the regions this client may read (None for a client on another machine),
    asked only for an input placed in shared memory."""
    raw = request.raw_input_contents
    placed = [REGION in t.parameters for t in request.inputs]
    if raw and len(raw) != len(request.inputs) and len(raw) != placed.count(False):
        raise invalid(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs "
                      "(one per input, in input order)")
    if raw and len(raw) != len(request.inputs):  # entries only for the inputs not in shared memory
        it = iter(raw)
        raw = [b"" if p else next(it) for p in placed]
    if raw and len(raw) != len(request.inputs):
        raise invalid(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs "
                      "(one per input, in input order)")
    inputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    for i, tensor in enumerate(request.inputs):
        name = tensor.name
        if name in inputs:
            raise invalid(f"input {shown(name)} is given twice")
        shape = list(tensor.shape)
        if placed[i]:
            regions = local_regions()
            if regions is None:
                raise invalid(f"input {shown(name)}: system shared memory is not served to this client (only to "
                              "clients on the machine of staronnx serve); send the tensor in the request")
            if (raw and raw[i]) or tensor.HasField("contents"):
                raise invalid(f"input {shown(name)}: placed in shared memory and given in the request; give one")
            inputs[name] = regions.read_input(name, tensor.datatype, shape, _parameters(tensor.parameters))
        elif raw:
            if tensor.HasField("contents"):
                raise invalid(f"input {shown(name)}: both contents and raw_input_contents are set; use one")
            inputs[name] = protocol.from_raw(name, tensor.datatype, shape, raw[i])
        else:
            field = protocol.GRPC_CONTENTS.get(tensor.datatype)
            values: list[Any] = []  # an unknown datatype: from_values refuses it by name
            if field is not None:
                # the contents field is named by the datatype (protobuf has no other way to read one by name)
                values = list(getattr(tensor.contents, field))
            elif tensor.datatype in protocol.DATATYPES:
                raise invalid(f"input {shown(name)}: {tensor.datatype} travels only in raw_input_contents")
            inputs[name] = protocol.from_values(name, tensor.datatype, shape, values)
        datatypes[name] = tensor.datatype
    if not inputs:
        raise invalid("the inference request has no inputs")
    return inputs, datatypes


#: the largest value of any of gRPC core's integer channel arguments (a C ``int``): 2**31 - 1, its
#: largest message (2 GiB - 1) among them
GRPC_MAX_INT = 2**31 - 1

#: calls gRPC's core may queue for the application, per stream one connection may hold: the
#: queue of a few connections' full streams before calls are rejected at random (its soft
#: limit; twice that, its hard limit)
PENDING_PER_STREAM_LIMIT = 4


class _Undecodable:
    """What a request that does not parse deserializes to: its handler answers ``error``."""

    def __init__(self, rpc: str, data: bytes, exc: Exception) -> None:
        self.error = invalid(f"the {rpc} request ({len(data)} bytes) is not a valid {SERVICE}/{rpc} message: "
                             f"{protocol.cut(exc, 100)}")


def _deserializer(rpc: str, cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return _Undecodable(rpc, data, exc)
    return parse


def _checked(frontend: GrpcFrontend, method: Callable[[Any, Ctx], Any]) -> Callable[..., Any]:
    """``method`` answering an undecodable request INVALID_ARGUMENT and a protocol error with its
    status, and held with the inference calls at the end of a shutdown (:meth:`GrpcFrontend.hold`)."""
    async def handler(request: Any, context: Ctx) -> Any:
        if isinstance(request, _Undecodable):
            await _abort(context, request.error)
        await frontend.unheld.wait()
        try:
            return await method(request, context)
        except ProtocolError as exc:
            await _abort(context, exc)
    return handler


def _held(frontend: GrpcFrontend, method: Callable[[Any, Ctx], AsyncIterator[Any]]) -> Callable[..., Any]:
    """A streaming ``method`` held with the inference calls at the end of a shutdown."""
    async def handler(requests: Any, context: Ctx) -> AsyncIterator[Any]:
        await frontend.unheld.wait()
        async for answer in method(requests, context):
            yield answer
    return handler


def make_server(frontend: GrpcFrontend) -> grpc.aio.Server:
    """A grpc.aio server with the servicer, and the frontend's ``--max-body`` and limits in gRPC's
    core: at most ``--grpc-max-streams`` concurrent calls per connection (HTTP/2 SETTINGS: a
    client queues the rest, and a flood of HEADERS + RST_STREAM, the "rapid reset" attack, closes
    that connection, not the other clients' calls), ``--max-connections`` connections,
    ``--header-timeout`` for a handshake, ``--idle-timeout`` for a connection with no call.

    What holds a burst and a rapid-reset flood, measured on grpcio 1.85 (2,000 concurrent calls
    on one channel; one connection sending HEADERS + RST_STREAM pairs while 8 clients make 40
    calls each):

    * gRPC's defaults (no stream limit): 64-195 of the 2,000 CANCELLED, 287 of 320 flooded;
      the core queues every call not yet taken by the application, and past 1,000 of them
      (``grpc.server.max_pending_requests``; 3,000 its hard limit) rejects new ones at random,
      and a flood of reset calls keeps that queue full;
    * ``grpc.max_concurrent_streams`` 100: the flood is harmless (the core's overload protection,
      on by default, refuses a connection's streams past the limit while its earlier ones are
      still allocated), but a burst loses 850-1,250 of its 2,000 calls (REFUSED_STREAM, which
      grpcio's clients do not retry: UNAVAILABLE), since a stream stays allocated a while
      after the client saw it close; with overload protection off the burst passes and the
      flood fails 291 of 320;
    * ``--grpc-max-streams`` (4,096) with the pending-call limits raised above what the streams
      of a few connections can hold: 0 of the 2,000 and 0 of the 320 failed.
    """
    limits = frontend.guard.limits
    streams = limits.grpc_max_streams
    options: list[tuple[str, Any]] = [
        # held to GRPC_MAX_INT below (protobuf's own limit too): a --max-body past it still holds
        # HTTP bodies to the flag
        ("grpc.max_receive_message_length", frontend.max_body),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),  # a port taken by another process must fail, not be shared
        ("grpc.max_concurrent_streams", streams),
        ("grpc.http.overload_protection", 1),  # the default, named: streams count until deallocated
        ("grpc.server.max_pending_requests", PENDING_PER_STREAM_LIMIT * streams),
        ("grpc.server.max_pending_requests_hard_limit", 2 * PENDING_PER_STREAM_LIMIT * streams),
        ("grpc.max_allowed_incoming_connections", limits.max_connections),
        ("grpc.server_handshake_timeout_ms", max(1, int(limits.header_timeout * 1000))),
        ("grpc.max_connection_idle_ms", max(1, int(limits.idle_timeout * 1000))),
    ]
    # every integer channel argument is a C int in gRPC's core: a flag past it (--idle-timeout 30d
    # in milliseconds, 4 x --grpc-max-streams pending calls) would fail the server's creation with
    # OverflowError, where 2**31 - 1 (24.8 days, 2 billion) already means "no limit" in practice
    options = [(key, min(value, GRPC_MAX_INT) if isinstance(value, int) else value) for key, value in options]
    server = grpc.aio.server(options=options)
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    handlers = {}
    for rpc, method_handler in frontend.served().items():
        method = service.methods_by_name[rpc]
        handlers[rpc] = grpc.unary_unary_rpc_method_handler(
            # ModelInfer answers an undecodable request itself (see its docstring)
            method_handler if rpc == "ModelInfer" else _checked(frontend, method_handler),
            request_deserializer=_deserializer(rpc, GetMessageClass(method.input_type)),
            response_serializer=serialize_infer if rpc == "ModelInfer" else
            GetMessageClass(method.output_type).SerializeToString)
    method = service.methods_by_name["ModelStreamInfer"]
    handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        _held(frontend, frontend.ModelStreamInfer),
        request_deserializer=_deserializer("ModelStreamInfer", GetMessageClass(method.input_type)),
        response_serializer=serialize_stream)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    return server
