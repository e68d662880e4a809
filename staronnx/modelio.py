"""Reading ONNX models the way every staronnx command needs them.

A user hands us a path (or a ModelProto); before anything else we want one clear error for a
missing, truncated or non-ONNX file, the model's content hash (plans record it so a plan can be
matched to its source), and unique node names (the ORT profiler and the partitioner identify
nodes by name). Models over 2 GB keep their weights in external files; everything here works
on them without serialising the whole model into one protobuf.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeGuard
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from staronnx.errors import ModelError

log = logging.getLogger(__name__)

#: protobuf cannot serialise a message over 2 GiB; stay clear of the limit.
PROTOBUF_LIMIT = 2**31 - 2**24


@dataclass
class LoadedModel:
    """A model ready for partitioning, with where it came from."""

    model: onnx.ModelProto
    path: Path | None
    sha256: str

    @property
    def graph(self) -> onnx.GraphProto:
        return self.model.graph


def file_sha256(path: Path, extra: list[Path] | None = None) -> str:
    """Content hash of a model file (and its external data files), streamed to bound memory."""
    digest = hashlib.sha256()
    for p in [path, *(extra or [])]:
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _external_locations(model: onnx.ModelProto) -> dict[str, str]:
    """The external data file of each initializer that has one, by initializer name."""
    return {t.name: next((e.value for e in t.external_data if e.key == "location"), "")
            for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}


def load_model(model_or_path: onnx.ModelProto | str | os.PathLike[str],
               supplied: Mapping[str, np.ndarray] | None = None) -> LoadedModel:
    """Load and validate a model; raise :class:`ModelError` naming the cause when it is unusable.

    ``supplied``: initializer values given in memory (ORT's ``add_initializer`` and
    ``add_external_initializers``), which replace the model's own, external or not (an external
    file of theirs need not exist); the hash covers them, as another model's would."""
    if isinstance(model_or_path, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(model_or_path)
        _supply(model, supplied)
        digest = hashlib.sha256(_stripped_bytes(model)).hexdigest()
        path = None
    else:
        path = Path(model_or_path)
        if not path.exists():
            raise ModelError(f"model file not found: {path}")
        if path.is_dir():
            raise ModelError(f"model path is a directory, not an ONNX file: {path}")
        if path.stat().st_size == 0:
            raise ModelError(f"model file is empty: {path}")
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as exc:  # protobuf raises DecodeError, but be broad: any parse failure
            raise ModelError(f"{path} is not a valid ONNX model (truncated or not ONNX): {exc}") from None
        _supply(model, supplied)
        externals = [path.parent / name for name in sorted(set(_external_locations(model).values()) - {""})]
        missing = [p for p in externals if not p.exists()]
        if missing:
            raise ModelError(f"{path}: external data file missing: {missing[0]}")
        try:
            onnx.load_external_data_for_model(model, str(path.parent))
        except Exception as exc:
            raise ModelError(f"{path}: cannot read external data: {exc}") from None
        digest = file_sha256(path, externals)
        if supplied:
            digest = hashlib.sha256((digest + values_digest(supplied)).encode()).hexdigest()
    upgrade_ir3(model)
    _check(model, path)
    name_nodes(model.graph)
    return LoadedModel(model=model, path=path, sha256=digest)


#: the first IR version in which an initializer need not be a graph input
_IR_INITIALIZERS_FREE = 4


def upgrade_ir3(model: onnx.ModelProto) -> bool:
    """Write an IR < 4 model as IR 4, in place; True when it was.

    IR 3 wants every initializer listed among the graph inputs, and ONNX Runtime runs such files
    whether they list them or not (``onnxruntime.datasets``' mul_1.onnx lists none), with each
    initializer a constant either way. The checker refuses the files that do not list them, and
    every part cut from either kind would be one (a part carries only the initializers it
    reads). In IR 4 an initializer need not be an input, and one that is not is a constant, so
    dropping them from the inputs keeps the meaning ORT gives the file, for the model and for
    each of its parts."""
    if model.ir_version >= _IR_INITIALIZERS_FREE:
        return False
    constants = {t.name for t in model.graph.initializer}
    kept = [vi for vi in model.graph.input if vi.name not in constants]
    if len(kept) != len(model.graph.input):
        del model.graph.input[:]
        model.graph.input.extend(kept)
    model.ir_version = _IR_INITIALIZERS_FREE
    return True


def missing_external(model: onnx.ModelProto, base: Path) -> set[str]:
    """The initializers whose external data file is not in ``base`` (a model read without its
    external data)."""
    return {name for name, location in _external_locations(model).items() if not (base / location).is_file()}


def _supply(model: onnx.ModelProto, supplied: Mapping[str, np.ndarray] | None) -> None:
    """Replace the named initializers' values, in place (their data then lives in the model)."""
    for tensor in model.graph.initializer:
        if supplied and tensor.name in supplied:
            tensor.CopyFrom(numpy_helper.from_array(np.asarray(supplied[tensor.name]), tensor.name))


def values_digest(values: Mapping[str, np.ndarray]) -> str:
    """A digest of named values (initializers given in memory): what tells two variants apart."""
    digest = hashlib.sha256()
    for name in sorted(values):
        array = np.ascontiguousarray(values[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        digest.update(array.tobytes() if array.dtype != object else repr(array.tolist()).encode())
    return digest.hexdigest()


def model_sha256(model: onnx.ModelProto) -> str:
    """The hash :func:`load_model` gives a model in memory (what a plan cut from it records)."""
    return hashlib.sha256(_stripped_bytes(model)).hexdigest()


def _stripped_bytes(model: onnx.ModelProto) -> bytes:
    """Serialisable bytes of a model, large weights replaced by their digests (for hashing)."""
    if model_nbytes(model) < PROTOBUF_LIMIT:
        whole: bytes = model.SerializeToString(deterministic=True)
        return whole
    stripped = strip_weights(model)
    digest = hashlib.sha256(stripped.SerializeToString(deterministic=True))
    for t in model.graph.initializer:
        digest.update(t.raw_data)
    return digest.digest()


def _check(model: onnx.ModelProto, path: Path | None) -> None:
    graph = model.graph
    where = str(path) if path else "model"
    if not model.HasField("graph") or (len(graph.node) == 0 and len(graph.output) == 0):
        raise ModelError(f"{where} has no graph (empty or not an ONNX model)")
    init_names = {t.name for t in graph.initializer}
    if all(i.name in init_names for i in graph.input):
        raise ModelError(f"{where} has no inputs: nothing to feed, nothing to partition")
    if len(graph.output) == 0:
        raise ModelError(f"{where} has no outputs")
    if len(graph.node) == 0:
        raise ModelError(f"{where} has no nodes")
    try:
        if model_nbytes(model) < PROTOBUF_LIMIT:
            onnx.checker.check_model(model)
        elif path is not None:
            onnx.checker.check_model(str(path))  # reads external data by path, no 2 GB limit
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0]
        refusal = _ort_refusal(model, path)
        if refusal is not None:
            raise ModelError(f"{where} fails the ONNX checker ({first}) and ONNX Runtime cannot load it "
                             f"either: {refusal}") from None
        # what ONNX Runtime runs, staronnx runs: its parts are checked again when they are cut
        log.info("%s fails the ONNX checker (%s), but ONNX Runtime loads it: accepted", where, first)


def _ort_refusal(model: onnx.ModelProto, path: Path | None) -> str | None:
    """Why ONNX Runtime cannot load the model (its first line), or None when it can: the
    acceptance that decides, where the ONNX checker is stricter than the runtime that runs
    the model (no optimisation: only whether it loads; ORT's own session class, whatever a
    program put at ``onnxruntime.InferenceSession``)."""
    import onnxruntime as ort
    from onnxruntime.capi.onnxruntime_inference_collection import InferenceSession as OrtSession

    so = ort.SessionOptions()
    so.log_severity_level = 4  # its refusal comes back as the exception, worded here
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    whole = path is None or model_nbytes(model) < PROTOBUF_LIMIT
    try:
        OrtSession(model.SerializeToString() if whole else str(path), so, providers=["CPUExecutionProvider"],
                   read_config_from_model=0)
    except Exception as exc:  # noqa: BLE001 - ORT's own classes (Fail, InvalidGraph, ...)
        text = str(exc).strip()
        return text.splitlines()[0] if text else type(exc).__name__
    return None


def dim_of(dim: onnx.TensorShapeProto.Dimension) -> int | str | None:
    """A declared dimension as staronnx records it: a size, a symbol, or None (unknown).

    A negative ``dim_value`` is how Paddle2ONNX and some other exporters write a dynamic axis,
    and ONNX Runtime runs it as one; read as a size it would fix the axis to -1, so it is
    dynamic here too.
    """
    if dim.HasField("dim_value") and dim.dim_value >= 0:
        return int(dim.dim_value)
    return dim.dim_param or None


def is_fixed(dim: object) -> TypeGuard[int]:
    """Whether a recorded dimension is a size (not a symbol, None, or a negative marker)."""
    return isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0


def name_nodes(graph: onnx.GraphProto) -> None:
    """Give every top-level node a unique, non-empty name (in place).

    ORT's profiler reports per-node times by name and plans list nodes by name, so an empty or
    duplicated name would silently merge two nodes' costs.
    """
    seen: set[str] = set()
    for i, node in enumerate(graph.node):
        name = node.name or f"{node.op_type}_{i}"
        while name in seen:
            name = f"{name}_{i}"
        node.name = name
        seen.add(name)


def model_nbytes(model: onnx.ModelProto) -> int:
    """Approximate serialised size, dominated by weights, without serialising."""
    # sized from dims: reading raw_data would copy every weight out of the protobuf
    total = sum(tensor_nbytes(t) for t in model.graph.initializer)
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                total += tensor_nbytes(attr.t)
    return total + 1_000_000


def tensor_nbytes(t: onnx.TensorProto) -> int:
    """Bytes a tensor's values take, from its dims and type."""
    return int(np.prod(t.dims)) * dtype_itemsize(t.data_type)  # a scalar's empty dims: 1


def dtype_itemsize(elem_type: int) -> int:
    """Bytes per element of an ONNX element type (strings count as 8, an estimate)."""
    if elem_type == onnx.TensorProto.STRING:
        return 8
    try:
        return int(np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize)
    except Exception:
        return 4


def strip_weights(model: onnx.ModelProto, threshold: int = 1024) -> onnx.ModelProto:
    """A copy of the model whose large initializers point to no data.

    Shape inference and the checker only need initializer dims and types, and this keeps them
    working on models over the 2 GB protobuf limit. The copy is never run or saved.
    """
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)  # an in-memory copy: no serialisation, so no 2 GB limit
    for t in stripped.graph.initializer:
        large = tensor_nbytes(t) > threshold  # from dims: no copy of the weight's bytes
        if large or t.data_location == onnx.TensorProto.EXTERNAL:
            t.ClearField("raw_data")
            t.data_location = onnx.TensorProto.EXTERNAL
            del t.external_data[:]
            t.external_data.add(key="location", value="__staronnx_stripped__")
            t.external_data.add(key="length", value=str(tensor_nbytes(t)))
    return stripped


#: Parts above this size keep their weights in an external file: ORT can then map them, and
#: no single protobuf comes near the 2 GB limit.
EXTERNAL_DATA_THRESHOLD = 2**30


def save_model(model: onnx.ModelProto, path: Path) -> None:
    """Save a model, moving weights to an external file when it is large (>= 1 GiB)."""
    onnx.save_model(model, str(path), save_as_external_data=model_nbytes(model) >= EXTERNAL_DATA_THRESHOLD,
                    all_tensors_to_one_file=True, location=path.name + ".data", size_threshold=1024)
