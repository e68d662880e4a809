"""The checks of tests/test_grpc_wire.py, run in an interpreter of their own: staronnx's
generated ``inference.*`` messages and tritonclient's cannot be registered in one process, and a
pytest worker may already hold tritonclient's."""

from __future__ import annotations

import numpy as np

from staronnx.serve import protocol
from staronnx.serve.grpc_wire import InferAnswer, serialize_infer, serialize_stream
from staronnx.serve.proto import grpc_predict_v2_pb2 as pb


def _answer(arrays: dict[str, np.ndarray]) -> tuple[InferAnswer, object]:
    """The answer as grpc_api builds it, and the message protobuf builds from the same outputs."""
    head = pb.ModelInferResponse(model_name="m", model_version="1", id="req-7")
    head.parameters["sequence_id"].int64_param = 42
    whole = pb.ModelInferResponse()
    whole.CopyFrom(head)
    raws: list[bytes | memoryview] = []
    for name, array in arrays.items():
        for message in (head, whole):
            message.outputs.add(name=name, datatype="FP32", shape=list(array.shape))
        raws.append(protocol.raw_view(array))
        whole.raw_output_contents.append(protocol.to_raw(array))
    for message in (head, whole):  # an output written to shared memory: an empty entry
        message.outputs.add(name="placed", datatype="FP32", shape=[4])
    raws.append(b"")
    whole.raw_output_contents.append(b"")
    return InferAnswer(head, raws), whole


def answer_reads_back_as_protobufs_message(rows: int) -> None:
    arrays = {"y": np.arange(rows * 4, dtype=np.float32).reshape(rows, 4),
              "view": np.ones((8, 6), np.float32)[:, ::2]}  # not contiguous: copied to row-major
    answer, whole = _answer(arrays)
    assert pb.ModelInferResponse.FromString(serialize_infer(answer)) == whole
    assert answer.message() == whole
    stream = pb.ModelStreamInferResponse.FromString(serialize_stream(answer))
    assert stream.infer_response == whole and stream.error_message == ""


def stream_error_is_written_as_it_is() -> None:
    error = pb.ModelStreamInferResponse(error_message="model 'm': bad input")
    error.infer_response.id = "req-8"
    assert pb.ModelStreamInferResponse.FromString(serialize_stream(error)) == error
