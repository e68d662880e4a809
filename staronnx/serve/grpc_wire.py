"""ModelInfer's answer put on the wire with each raw output copied once.

Built as a protobuf message, an output crossed memory three times: ``tobytes`` (protobuf takes
bytes, not a view), ``raw_output_contents.append`` (into the message's own memory) and
``SerializeToString``; 66 µs each for a 4 MB output, measured. Here the message is serialized
without its raw outputs and they are written after it, each as its field's key, its length and
the array's own memory: one join, one copy. That is the same message for every reader:
protobuf's wire format lets a message's fields come in any order, and a repeated field's
elements are read in the order they come (the encoding section of protobuf's documentation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from staronnx.serve.proto import grpc_predict_v2_pb2 as pb

_LENGTH_DELIMITED = 2
_BYTE = [bytes((i,)) for i in range(0x80)]


def _key(message: Any, field: str) -> bytes:
    """The wire key of a length-delimited ``field`` of ``message``: its number and wire type."""
    return _varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | _LENGTH_DELIMITED)


def _varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf varint: 7 bits a byte, low bits first, the high bit set on all
    but the last byte."""
    if n <= 0x7F:  # most lengths of small outputs, and the stream's key: one byte
        return _BYTE[n]
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_RAW_OUTPUT = _key(pb.ModelInferResponse, "raw_output_contents")
_INFER_RESPONSE = _key(pb.ModelStreamInferResponse, "infer_response")


class InferAnswer:
    """A ModelInferResponse as ``head`` (every field but ``raw_output_contents``) and ``raws``
    (the raw outputs, in order: bytes, or a view of an array's memory; empty for an output
    written to shared memory), put together only on the wire."""

    __slots__ = ("head", "raws")

    def __init__(self, head: pb.ModelInferResponse, raws: Sequence[bytes | memoryview]) -> None:
        self.head = head
        self.raws = raws

    def pieces(self) -> list[bytes | memoryview]:
        """The serialized message, in pieces to be joined."""
        out: list[bytes | memoryview] = [self.head.SerializeToString()]
        for raw in self.raws:
            out += (_RAW_OUTPUT, _varint(len(raw)), raw)
        return out

    def message(self) -> pb.ModelInferResponse:
        """The whole message as a protobuf object (copies the outputs; for tests and tools)."""
        message: pb.ModelInferResponse = pb.ModelInferResponse.FromString(serialize_infer(self))
        return message


def serialize_infer(answer: InferAnswer) -> bytes:
    """ModelInfer's response serializer."""
    return b"".join(answer.pieces())


def serialize_stream(answer: InferAnswer | pb.ModelStreamInferResponse) -> bytes:
    """ModelStreamInfer's response serializer: an answer as the stream response's
    ``infer_response``, or a stream response as it is (an error message)."""
    if not isinstance(answer, InferAnswer):
        return bytes(answer.SerializeToString())
    pieces = answer.pieces()
    return b"".join([_INFER_RESPONSE, _varint(sum(len(p) for p in pieces)), *pieces])
