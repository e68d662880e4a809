"""The KServe v2 gRPC API on ``grpc.aio``, with stubs generated from ``proto/grpc_predict_v2.proto``.

Why grpcio: it is gRPC's reference implementation (HTTP/2, flow control, deadlines,
cancellation, message size limits all in its C core), and ``grpc.aio`` runs its handlers on the
same asyncio loop as the HTTP front end, so both await the same batcher.

Inputs come as ``raw_input_contents`` (what tritonclient sends: one bytes entry per input) or
as typed ``contents``; outputs always go back as ``raw_output_contents``, as Triton does. A
message larger than ``--max-body`` is refused by gRPC's core with RESOURCE_EXHAUSTED before any
handler sees it (gRPC's standard answer to an oversized message, and it costs no memory).

The generated module registers the ``inference.*`` messages in protobuf's default pool, as
``tritonclient.grpc`` does with its own copy: import this server and ``tritonclient.grpc`` in
separate processes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc
import numpy as np

from staronnx.serve import protocol
from staronnx.serve.metrics import VERSION
from staronnx.serve.models import ModelEndpoint
from staronnx.serve.proto import grpc_predict_v2_pb2 as pb
from staronnx.serve.proto import grpc_predict_v2_pb2_grpc as pb_grpc
from staronnx.serve.protocol import ProtocolError, invalid

log = logging.getLogger("staronnx.serve")


class GrpcFrontend(pb_grpc.GRPCInferenceServiceServicer):
    """The servicer: every RPC of the v2 service, errors as gRPC status codes."""

    def __init__(self, models: Mapping[str, ModelEndpoint], server_meta: dict[str, Any],
                 is_ready: Callable[[], bool]) -> None:
        self.models = models
        self.server_meta = server_meta
        self.is_ready = is_ready

    def _model(self, name: str, version: str) -> ModelEndpoint:
        model = self.models.get(name)
        if model is None:
            raise ProtocolError("not_found", f"unknown model {name!r}; this server serves {sorted(self.models)}")
        model.check_version(version)
        return model

    async def ServerLive(self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.is_ready())

    async def ServerMetadata(self, request: pb.ServerMetadataRequest,
                             context: grpc.aio.ServicerContext) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**self.server_meta)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext) -> pb.ModelReadyResponse:
        model = await _guard(context, lambda: self._model(request.name, request.version))
        return pb.ModelReadyResponse(ready=model.ready and self.is_ready())

    async def ModelMetadata(self, request: pb.ModelMetadataRequest,
                            context: grpc.aio.ServicerContext) -> pb.ModelMetadataResponse:
        model = await _guard(context, lambda: self._model(request.name, request.version))
        meta = model.metadata()
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]], outputs=[tensor(**t) for t in meta["outputs"]])

    async def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext) -> pb.ModelInferResponse:
        try:
            model = self._model(request.model_name, request.model_version)
            t0 = time.perf_counter()
            try:
                inputs, datatypes = _decode_inputs(request)
            except ProtocolError:
                model.stats.refused("OTHER")
                raise
            wanted = [o.name for o in request.outputs] or None
            answer = await model.infer(inputs, datatypes, wanted, decode_s=time.perf_counter() - t0)
        except ProtocolError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.grpc_code), str(exc))
            raise AssertionError("unreachable") from None
        t2 = time.perf_counter()
        response = pb.ModelInferResponse(model_name=model.name, model_version=VERSION, id=request.id)
        for key, value in answer.parameters.items():
            if isinstance(value, int):
                response.parameters[key].int64_param = value
            else:
                response.parameters[key].string_param = str(value)
        for name, arr in answer.outputs.items():
            response.outputs.add(name=name, datatype=model.output_datatypes[name], shape=list(arr.shape))
            response.raw_output_contents.append(protocol.to_raw(arr))
        model.stats.encoded(time.perf_counter() - t2)
        return response


async def _guard(context: grpc.aio.ServicerContext, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except ProtocolError as exc:
        await context.abort(getattr(grpc.StatusCode, exc.grpc_code), str(exc))


def _decode_inputs(request: pb.ModelInferRequest) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Arrays from raw_input_contents (one per input, in order) or from typed contents."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise invalid(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs "
                      "(one per input, in input order)")
    inputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    for i, tensor in enumerate(request.inputs):
        name = tensor.name
        if name in inputs:
            raise invalid(f"input {name!r} is given twice")
        shape = list(tensor.shape)
        if raw:
            if tensor.HasField("contents"):
                raise invalid(f"input {name!r}: both contents and raw_input_contents are set; use one")
            inputs[name] = protocol.from_raw(name, tensor.datatype, shape, raw[i])
        else:
            field = protocol.GRPC_CONTENTS.get(tensor.datatype)
            if field is None:
                if tensor.datatype in protocol.DATATYPES:
                    raise invalid(f"input {name!r}: {tensor.datatype} travels only in raw_input_contents")
                protocol.from_values(name, tensor.datatype, shape, [])  # raises: unknown datatype
            inputs[name] = protocol.from_values(name, tensor.datatype, shape, list(getattr(tensor.contents, field)))
        datatypes[name] = tensor.datatype
    if not inputs:
        raise invalid("the inference request has no inputs")
    return inputs, datatypes


def make_server(frontend: GrpcFrontend, max_body: int) -> grpc.aio.Server:
    """A grpc.aio server with the servicer and a message size limit of ``max_body`` bytes."""
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_body),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),  # a port taken by another process must fail, not be shared
    ])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(frontend, server)
    return server
