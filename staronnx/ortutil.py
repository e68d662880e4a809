"""Creating ONNX Runtime sessions from in-memory or on-disk models, large ones included, and
asking ONNX Runtime what a SessionOptions or RunOptions changes in a model."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper
from onnxruntime.capi.onnxruntime_inference_collection import InferenceSession as OrtSession

from staronnx.errors import DeviceError
from staronnx.modelio import PROTOBUF_LIMIT, missing_external, model_nbytes, save_model


#: ORT's log severities: 3 logs errors, 4 only fatal ones. Every error ORT logs while running a
#: session also comes back to Python as an exception, which staronnx words in one line; the log
#: would print it a second time, raw and red, on stderr (the C++ logger bypasses Python's).
QUIET = 4

_ORT_ELEMENT_NAMES = {"float32": "float", "float64": "double", "object": "string", "str": "string"}

# ``OrtSession`` (imported above) is ONNX Runtime's own class, whatever a program put at
# ``onnxruntime.InferenceSession`` (``onnxruntime.InferenceSession = staronnx.InferenceSession``,
# the one-line switch done for a whole program): staronnx's own sessions must be ORT's, or each
# would partition its model again, with itself.


def ort_type_name(dtype: str) -> str:
    """ORT's NodeArg.type for a plan's dtype: a numpy name as a tensor's (float32 ->
    'tensor(float)'), and ORT's own type string as it is for what is not a tensor
    ('seq(tensor(int64))', 'optional(tensor(float))', 'map(string,tensor(float))')."""
    if "(" in dtype:
        return dtype
    return f"tensor({_ORT_ELEMENT_NAMES.get(dtype, dtype)})"


def value_type_name(tp: onnx.TypeProto) -> str:
    """ORT's type string of an ONNX value type ('tensor(float)', 'seq(tensor(int64))',
    'optional(seq(tensor(float)))', 'map(int64,tensor(float))'), as ``NodeArg.type`` says it."""
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        return f"tensor({_element_name(tp.tensor_type.elem_type)})"
    if kind == "sparse_tensor_type":
        return f"sparse_tensor({_element_name(tp.sparse_tensor_type.elem_type)})"
    if kind == "sequence_type":
        return f"seq({value_type_name(tp.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({value_type_name(tp.optional_type.elem_type)})"
    if kind == "map_type":
        return f"map({_element_name(tp.map_type.key_type)},{value_type_name(tp.map_type.value_type)})"
    return "unknown"


def _element_name(elem_type: int) -> str:
    """ORT's name of an element type: float, double, int64, string, bool, float16, ..."""
    if elem_type == onnx.TensorProto.UNDEFINED:
        return "undefined"
    name: str = onnx.TensorProto.DataType.Name(elem_type)
    return name.lower()


def providers_for(device: str) -> list[str]:
    """ORT providers for a device name, failing clearly when the device's provider is absent."""
    available = ort.get_available_providers()
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise DeviceError(f"device 'cuda' needs ONNX Runtime's CUDAExecutionProvider, which this install lacks "
                              f"(available: {', '.join(available)}); install staronnx[gpu] (onnxruntime-gpu) on a "
                              "machine with an NVIDIA GPU")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    raise DeviceError(f"unknown device {device!r}; use 'cpu' or 'cuda'")


@contextlib.contextmanager
def cuda_capture_safe() -> Iterator[None]:
    """Run the block in CUDA's thread-local stream-capture mode (cudaThreadExchangeStreamCaptureMode),
    so a plain CUDA session created or run here neither fails with error 900 nor breaks a CUDA
    graph that a staronnx worker captures meanwhile in another thread. A no-op without
    cuda-bindings (no CUDA call can happen then)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        yield
        return
    modes = cudart.cudaStreamCaptureMode
    err, prev = cudart.cudaThreadExchangeStreamCaptureMode(modes.cudaStreamCaptureModeThreadLocal)
    try:
        yield
    finally:
        if int(err) == 0:
            cudart.cudaThreadExchangeStreamCaptureMode(prev)


def make_session(model: onnx.ModelProto | str | os.PathLike[str], *, optimize: bool = True,
                 providers: Sequence[str | tuple[str, dict[str, str]]] | None = None,
                 options: ort.SessionOptions | None = None) -> OrtSession:
    """An ORT session; models over protobuf's 2 GB limit go through a temporary file. Without
    ``options``, ORT logs nothing below a fatal error (:data:`QUIET`): its errors reach the caller
    as exceptions, which partition, verify and the probes summarise in one line."""
    so = options
    if so is None:
        so = ort.SessionOptions()
        so.log_severity_level = QUIET
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    providers = list(providers or ["CPUExecutionProvider"])
    # a model's embedded ORT config is its serving session's, not this one's (which would profile)
    if not isinstance(model, onnx.ModelProto):
        return OrtSession(str(model), so, providers=providers, read_config_from_model=0)
    if model_nbytes(model) < PROTOBUF_LIMIT:
        return OrtSession(model.SerializeToString(), so, providers=providers, read_config_from_model=0)
    with tempfile.TemporaryDirectory(prefix="staronnx-session-") as tmp:
        path = Path(tmp) / "model.onnx"
        save_model(model, path)
        # ORT reads the external weights while building the session, so the folder can go after.
        return OrtSession(str(path), so, providers=providers, read_config_from_model=0)


def quiet_ort_log() -> None:
    """Sessions that set no log level of their own (a plan's reference sessions) log nothing below
    a fatal error either: a command's user reads ORT's errors as staronnx's one line, not twice."""
    ort.set_default_logger_severity(QUIET)


#: ``[ONNXRuntimeError] : 1 : FAIL : `` before ORT's message (and what a task error put before it)
_ORT_PREFIX = re.compile(r"^.*?\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*\w+\s*:\s*", re.DOTALL)
#: ``Non-zero status code returned while running GRU node. Name:'/gru/GRU' Status Message: ...``
_NODE_FAILED = re.compile(r"Non-zero status code returned while running (\w+) node\. Name:'([^']*)' "
                          r"Status Message:\s*(.*)", re.DOTALL)
#: a C++ source location ORT puts before some messages: ``concatbase.h:135 PrepareForComputeImpl ``
_SOURCE_LOCATION = re.compile(r"^\S+\.(?:h|cc|cpp|cu):\d+ \S+ ")


def ort_failure(exc: BaseException) -> tuple[str | None, str | None, str]:
    """(op type, node name, message) of an error ONNX Runtime raised while running a model (or a
    staronnx task error whose cause it is), in one line without ORT's prefixes and source
    locations; op type and node name are None where ORT named no node."""
    cause = exc.__cause__ if exc.__cause__ is not None and type(exc.__cause__).__module__.startswith("onnxruntime") \
        else exc
    text = _ORT_PREFIX.sub("", str(cause).strip(), count=1)
    op = node = None
    found = _NODE_FAILED.search(text)
    if found is not None:
        op, node, text = found.group(1), found.group(2), found.group(3)
    text = _SOURCE_LOCATION.sub("", text.strip())
    return op, node, " ".join(text.split()) or type(cause).__name__


# -- what a SessionOptions or RunOptions changes, asked of ONNX Runtime -----------------------
# ORT keeps some options where Python cannot read them back (add_initializer,
# add_external_initializers, the free dimension overrides, a RunOptions' active LoRA adapters).
# A session that runs the model elsewhere (staronnx's parts) asks ORT itself what they change: a
# probe model of the model's interface only (its inputs, and one Identity per initializer whose
# placeholder holds nothing), loaded with the user's options, answers with what ORT put in place.

#: a probe's placeholder for an initializer: empty, so what comes back non-empty was put there
_PLACEHOLDER_DIMS = (0,)
#: the opset of the probes' Identity nodes (every element type ORT has)
_PROBE_OPSET = 21


def option_values(so: ort.SessionOptions, names: Iterable[str]) -> dict[str, Any]:
    """``so``'s attributes ``names``, by name."""
    # ORT's SessionOptions is a pybind11 object with no __dict__ and no copy: read by name
    return {name: getattr(so, name) for name in names}


@contextlib.contextmanager
def borrowed(so: ort.SessionOptions, **values: object) -> Iterator[ort.SessionOptions]:
    """The caller's SessionOptions with ``values`` set for the block and restored after: a probe
    or a writer session must not profile, write the optimised model or log as the user's does
    (ORT's cannot be copied; a session opened on it in another thread meanwhile sees the values)."""
    saved = option_values(so, values)
    try:
        for name, value in values.items():
            setattr(so, name, value)
        yield so
    finally:
        for name, value in saved.items():
            setattr(so, name, value)


@dataclasses.dataclass
class OptionEffects:
    """What a SessionOptions changes in the model ORT builds from it: initializer values given
    in memory (``add_initializer``, ``add_external_initializers``, external files given in memory),
    and input shapes the free dimension overrides fixed (only the inputs they changed)."""

    initializers: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    shapes: dict[str, list[int | str | None]] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.initializers or self.shapes)


def _probe_model(sources: Sequence[str], elem_types: Sequence[int], inputs: Sequence[onnx.ValueInfoProto] = (),
                 initializers: Sequence[onnx.TensorProto] = ()) -> tuple[list[str], onnx.ModelProto]:
    """A model returning each of ``sources`` (its inputs or initializers) through an Identity: the
    probes' names, and the model."""
    probes = [f"__staronnx_probe_{i}" for i in range(len(sources))]
    nodes = [helper.make_node("Identity", [source], [probe]) for source, probe in zip(sources, probes)]
    outputs = [helper.make_tensor_value_info(probe, t, None) for probe, t in zip(probes, elem_types)]
    graph = helper.make_graph(nodes, "staronnx_probe", list(inputs), outputs, list(initializers))
    return probes, helper.make_model(graph, opset_imports=[helper.make_opsetid("", _PROBE_OPSET)])


def _placeholder(tensor: onnx.TensorProto, missing: bool) -> onnx.TensorProto:
    """An initializer's stand-in in a probe: empty, or for one whose external file is missing,
    the reference itself (ORT fills it from what the options give, or refuses the probe)."""
    if missing:
        stand_in = onnx.TensorProto()
        stand_in.CopyFrom(tensor)
        return stand_in
    return helper.make_tensor(tensor.name, tensor.data_type, list(_PLACEHOLDER_DIMS), [])


def option_effects(so: ort.SessionOptions, source: Path | onnx.ModelProto) -> OptionEffects | None:
    """Ask ORT what ``so`` changes in the model (a file, or a model whose external files are in the
    current folder): the initializer values it supplies and the input dimensions it fixes. None
    where the model cannot be read yet (load_model then says why). A probe ORT refuses is ORT's
    own error, as its session's would be, except for an external file that is missing and not
    given: load_model names that file."""
    if isinstance(source, onnx.ModelProto):
        model, base = source, Path.cwd()
    else:
        try:
            model, base = onnx.load(str(source), load_external_data=False), source.parent
        except Exception:  # noqa: BLE001 - not a model: load_model words it
            return None
    missing = missing_external(model, base)
    effects, told = OptionEffects(), {}
    inits = list(model.graph.initializer)
    constants = {t.name for t in inits}
    free = [vi for vi in model.graph.input if vi.name not in constants and vi.type.HasField("tensor_type")
            and any(not d.HasField("dim_value") for d in vi.type.tensor_type.shape.dim)]
    try:
        # the probes write no file, log nothing and optimise nothing (ORT would fold an Identity
        # of a constant before the initializer given replaces it)
        with borrowed(so, optimized_model_filepath="", enable_profiling=False, log_severity_level=QUIET,
                      graph_optimization_level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
            if inits:
                probes, probe = _probe_model([t.name for t in inits], [t.data_type for t in inits],
                                             initializers=[_placeholder(t, t.name in missing) for t in inits])
                values = OrtSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(probes, {})
                for tensor, value in zip(inits, values):
                    if tensor.name in missing or tuple(np.shape(value)) != _PLACEHOLDER_DIMS:
                        effects.initializers[tensor.name] = np.asarray(value)
            if free:
                _, probe = _probe_model([vi.name for vi in free], [vi.type.tensor_type.elem_type for vi in free], free)
                session = OrtSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"])
                told = {arg.name: list(arg.shape) for arg in session.get_inputs()}
    except Exception:
        if missing:
            return None
        raise
    for vi in free:
        dims = vi.type.tensor_type.shape.dim
        fixed: list[int | str | None] = [t if isinstance(t, int) and not d.HasField("dim_value") else None
                                         for d, t in zip(dims, told[vi.name])]
        if any(f is not None for f in fixed):
            effects.shapes[vi.name] = fixed
    return effects


class AdapterProbe:
    """The values a RunOptions' active LoRA adapters give the model's overridable initializers
    (IR >= 4 initializers that are also graph inputs), read from ORT: ``run_options`` keeps its
    adapters where Python cannot see them."""

    def __init__(self, overridable: Sequence[onnx.TensorProto]) -> None:
        self.names = [t.name for t in overridable]
        self._probes, probe = _probe_model(
            self.names, [t.data_type for t in overridable],
            [helper.make_tensor_value_info(t.name, t.data_type, None) for t in overridable],
            [_placeholder(t, False) for t in overridable])
        self._session = make_session(probe, optimize=False)

    def values(self, run_options: ort.RunOptions) -> dict[str, np.ndarray]:
        """The overridable initializers the active adapters set, by name ({} with none active)."""
        out = self._session.run(self._probes, {}, run_options)
        return {n: np.asarray(v) for n, v in zip(self.names, out) if tuple(np.shape(v)) != _PLACEHOLDER_DIMS}


def write_optimized(model: str | bytes, so: ort.SessionOptions, providers: Sequence[str],
                    optimization_level: ort.GraphOptimizationLevel | None = None) -> None:
    """Have ORT write ``so.optimized_model_filepath`` as it would for its own session (the whole
    model, optimised for ``providers``): a session opened for that and dropped, which neither
    profiles nor reads the model's config (``optimization_level``: the level that config set)."""
    values: dict[str, object] = {"enable_profiling": False}
    if optimization_level is not None:
        values["graph_optimization_level"] = optimization_level
    with borrowed(so, **values):
        OrtSession(model, so, providers=list(providers), read_config_from_model=0)
