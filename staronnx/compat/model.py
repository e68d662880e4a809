"""The model a session was given, as ORT reports it: loaded (with what the session options
change of it), its declared inputs and outputs, and its metadata.

The parts staronnx writes are not the model ORT users asked about (their producer is staronnx,
their inputs are cut tensors), so every getter answers from the source model.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
from google.protobuf.message import DecodeError

from staronnx.compat.errors import InvalidProtobuf, NoGraph, NoSuchFile
from staronnx.errors import ModelError
from staronnx.modelio import load_model, model_sha256
from staronnx.ortutil import option_effects, ort_type_name
from staronnx.partition.whole import fed_inputs, io_specs, is_tensor
from staronnx.plan import Plan, TensorSpec

log = logging.getLogger(__name__)

#: ORT reports an unset ``model_version`` as INT64_MAX
_UNSET_VERSION = 2**63 - 1


@dataclass(frozen=True)
class NodeArg:
    """Like onnxruntime.NodeArg: name, type string, shape with symbolic dims as strings."""

    name: str
    type: str
    shape: list[int | str | None]


@dataclass(frozen=True)
class ModelMetadata:
    """Like onnxruntime.ModelMetadata, read from the source model (not from the parts, which
    staronnx wrote and which would report staronnx as their producer)."""

    producer_name: str = ""
    graph_name: str = ""
    domain: str = ""
    description: str = ""
    graph_description: str = ""
    version: int = _UNSET_VERSION
    custom_metadata_map: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, model: onnx.ModelProto) -> "ModelMetadata":
        return cls(producer_name=model.producer_name, graph_name=model.graph.name, domain=model.domain,
                   description=model.doc_string, graph_description=model.graph.doc_string,
                   version=model.model_version if model.HasField("model_version") else _UNSET_VERSION,
                   custom_metadata_map={p.key: p.value for p in model.metadata_props})


def node_arg(t: TensorSpec) -> NodeArg:
    return NodeArg(t.name, ort_type_name(t.dtype), list(t.shape))


def load_source(path_or_bytes: Any, so: ort.SessionOptions | None) -> tuple[Any, onnx.ModelProto, str] | None:
    """The model as partition() takes it (the path, so the plan records it, or the parsed
    bytes), the validated model, and its hash; None for a plan (a Plan or its folder), which
    runs as it is. With ``so``, the model ORT would build from those options
    (:func:`staronnx.ortutil.option_effects`), a model of its own (its hash covers them)."""
    if isinstance(path_or_bytes, Plan):
        return None
    if not isinstance(path_or_bytes, (str, os.PathLike, bytes, bytearray, memoryview)):
        raise TypeError(f"Unable to load from type '{type(path_or_bytes)}'")
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        proto = onnx.ModelProto()
        try:
            proto.ParseFromString(bytes(path_or_bytes))
        except DecodeError:
            raise InvalidProtobuf("Failed to load model because protobuf parsing failed.") from None
        if not proto.HasField("graph"):  # empty bytes parse; ORT refuses them with INVALID_ARGUMENT
            raise NoGraph("No graph was found in the protobuf.")
        source: Any = proto
    else:
        source = Path(path_or_bytes)
        if source.is_dir():
            return None
        if not source.exists():
            raise NoSuchFile(f"Load model from {source} failed: File doesn't exist")
        if source.stat().st_size == 0:  # ORT's class for it, as for empty bytes
            raise NoGraph(f"Load model from {source} failed: No graph was found in the protobuf.")
    effects = option_effects(so, source) if so is not None else None
    try:
        loaded = load_model(source, supplied=effects.initializers if effects else None)
    except ModelError as exc:
        if isinstance(exc.__context__, DecodeError):
            raise InvalidProtobuf(str(exc)) from None
        raise
    if not effects:
        return source, loaded.model, loaded.sha256
    model = loaded.model
    for vi in model.graph.input:
        for dim, size in zip(vi.type.tensor_type.shape.dim, effects.shapes.get(vi.name, [])):
            if size is not None:
                dim.dim_value = int(size)  # a dim_param or an unknown size that ORT fixed
    # the hash partition() records for the model it is given (this one): a kept plan is found by it
    sha256 = model_sha256(model)
    log.info("the session options change the model: initializers %s given, inputs %s fixed",
             sorted(effects.initializers), sorted(effects.shapes))
    return model, model, sha256


def declared_io(model: onnx.ModelProto) -> Plan:
    """The model's inputs and outputs as it declares them (what ORT's getters report: sequences,
    optionals and maps by ORT's type string), as a plan with no parts: it answers the getters
    and checks feeds before the model is cut."""
    inputs, outputs = io_specs(model)
    return Plan(Path(), [], inputs, outputs, [], 0, {}, {})  # no parts, crossings, source or settings


def unranked_inputs(model: onnx.ModelProto) -> frozenset[str]:
    """The tensor inputs the model declares with no shape at all (not even a rank): ORT takes a
    value of any rank for them, where a declared ``[]`` is a scalar (both read as ``[]``)."""
    return frozenset(vi.name for vi in fed_inputs(model)
                     if is_tensor(vi.type) and not vi.type.tensor_type.HasField("shape"))
