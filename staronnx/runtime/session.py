"""``staronnx.InferenceSession``: ONNX Runtime's call shape over a staronnx Runtime.

Existing code switches with one line::

    sess = staronnx.InferenceSession("model.onnx", providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    logits, = sess.run(None, {"input": x})

The constructor is ORT's, so that scripts written for ORT run unchanged; staronnx's own settings
(``shares``, ``policy``, ``cpu_groups``, ``cuda_streams``, any ``Runtime`` option) are
keyword-only so that none of them can be mistaken for an ORT argument. Providers choose the
workers, as they choose ORT's devices; where CUDA cannot run, the session warns and serves on the
CPU, as ORT falls back. Misuse raises what ORT raises, each also a
:class:`~staronnx.errors.StaronnxError`.

A model (a file or bytes) is partitioned once and the plan kept under
``$STARONNX_HOME/plans/<model hash>-<settings hash>/``, as perf models are: the next session of
the same model and settings reuses it (and its calibrated perf models). A plan folder or
:class:`Plan` is used as it is.

A model with a dynamic size besides the batch (a sequence length, an image's height and width, a
KV cache's past) needs no option, as ORT needs none: partitioning must run the model at some
size to time it, and no size is safe to guess (a UNet wants multiples of its strides, a decoder's
mask must match its cache), so the session is cut at its first run's shapes, which are valid by
construction, and that one plan then serves every size the model accepts. That first run
therefore takes seconds; the plan is kept, and the next session of the model starts at once.

Whatever ONNX Runtime runs, the session runs: a model that cannot be cut is served whole
(:mod:`staronnx.partition.whole`, said in a PartitionWarning); one whose inputs or outputs
staronnx's workers cannot carry runs as one ORT session in this process. The split is the
session's own choice unless ``shares`` is given, so only then does it warn where the cut misses
the shares (or has a part that computes nothing): a drop-in user chose nothing to change.

ONNX Runtime's options, each honoured, said (``OptionNotApplied``, a warning naming it: settings
of ORT's own pools, allocators and logs, which each worker sets for its cores), or refused
(``NotImplementedError`` naming it):

==============================================  ==========================================================
option                                          here
==============================================  ==========================================================
``providers``, ``provider_options``             honoured: CUDA workers (``device_id``, CUDA's options) or CPU
``intra_op_num_threads``                        honoured: one CPU group of that many cores
``enable_profiling``, ``profile_file_prefix``   honoured: staronnx's trace, in ORT's format and file name
``optimized_model_filepath`` (+ its config      honoured: ORT writes the whole optimised model for these
entries for external initializers)              options (the parts are not it)
``add_initializer``                             honoured: the value replaces the model's before the cut
``add_external_initializers`` (and ``..._from_  honoured: the values stand for the external data
files_in_memory``)
``add_free_dimension_override_by_name`` /       honoured: the inputs' sizes are fixed before the cut
``..._by_denotation``
the model's ``ort_config`` (where ORT reads     honoured: read as ORT reads it (``get_session_options``)
it: ``ORT_LOAD_CONFIG_FROM_MODEL=1``)
``session.record_ep_graph_assignment_info``     honoured: ``get_provider_graph_assignment_info`` (CPU)
``inter_op_num_threads``, ``execution_mode``,   said, each with why (``_UNAPPLIED``, ``_CONFIG_ENTRIES``):
``execution_order``, ``graph_optimization...``  parts run in parallel on the workers, each part's
arena, pattern, reuse, determinism, log levels  operators in sequence, at ORT's full optimisation
< 2, pool/allocator config entries              level, with ORT's allocators, logging fatal errors
``session.load_model_format=ORT``, ``.ort``     refused: an ORT-format model cannot be cut
``add_provider``/``add_provider_for_devices``   refused: name the providers to InferenceSession
``register_custom_ops_library``                 not read back: a model needing it is refused at load
                                                (the checker and ORT both refuse it)
RunOptions: an active LoRA adapter;             honoured: a variant of the model with the adapter's
overridable initializers fed by name            parameters (cut once; the last 4 kept)
RunOptions ``terminate``                        honoured: the run does not start
RunOptions log levels, arena shrinkage,         said (once per session)
``gpu_graph_id``
==============================================  ==========================================================
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import types
import warnings
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from filelock import FileLock
from google.protobuf.message import DecodeError
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_state
from onnxruntime.capi.onnxruntime_inference_collection import InferenceSession as OrtSession
from onnxruntime.capi.onnxruntime_inference_collection import check_and_normalize_provider_args

from staronnx.contract import parse_batch_axes
from staronnx.errors import InputError, ModelError, PlanError, StaronnxError
from staronnx.modelio import is_fixed, load_model, values_digest
from staronnx.ortutil import QUIET, AdapterProbe, option_effects, option_values, ort_type_name, write_optimized
from staronnx.partition.checks import targets_by_default
from staronnx.partition.graph import model_inputs
from staronnx.partition.whole import io_specs, too_small, value_spec, whole_reason
from staronnx.perfmodels.store import default_root
from staronnx.plan import PLAN_VERSION, Plan, TensorSpec, _numpy_dtype
from staronnx.runtime.engine import EngineClosed
from staronnx.runtime.policies import policy_options
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.task import RequestFuture, TaskError
from staronnx.workers.cuda import CudaWorker
from staronnx.workers.cuda_env import cuda_unavailable_reason, missing_device
from staronnx.workers.cudart import host_runtime_from_env
from staronnx.workers.topology import Topology

log = logging.getLogger(__name__)

CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"
#: CUDA workers a session starts when CUDA is asked for and ``cuda_streams`` is not given: two
#: streams overlap one batch's copies with another's compute (the StarONNX papers' best small N)
DEFAULT_CUDA_STREAMS = 2
#: ORT keyword arguments accepted for compatibility; staronnx has no use for them
_ORT_KWARGS = frozenset({"enable_fallback", "disabled_optimizers", "read_config_from_model"})
#: the split a session asks for when given none: the StarONNX papers' 85/15. A model with fewer
#: nodes than that is served whole instead (partition's default split), with a warning
DEFAULT_SHARES = (0.85, 0.15)
#: variants of a model (other initializers: LoRA adapters) whose runtimes a session keeps
MAX_VARIANTS = 4
#: ORT reports an unset ``model_version`` as INT64_MAX
_UNSET_VERSION = 2**63 - 1
#: how long a session waits for another process partitioning the same model (seconds)
PLAN_LOCK_TIMEOUT = 3600.0
#: what a session's settings record as its ``input_shapes`` when the model is cut at its first
#: run: one plan serves every size, so whichever first run made it, the next session reuses it
AT_FIRST_RUN = "at the first run's shapes"


# -- errors of ORT's types (ORT's pybind11 classes have no type stubs: Any to mypy) ------------
class InvalidArgument(InputError, _ort_state.InvalidArgument):  # type: ignore[misc]
    """A feed or output name ORT would reject with INVALID_ARGUMENT; caught by either
    ``except onnxruntime...InvalidArgument`` (ORT scripts) or ``except ValueError`` (staronnx's)."""


class NoSuchFile(ModelError, _ort_state.NoSuchFile):  # type: ignore[misc]
    """The model file does not exist (ORT's NO_SUCHFILE)."""


class InvalidProtobuf(ModelError, _ort_state.InvalidProtobuf):  # type: ignore[misc]
    """The model is not a parsable ONNX protobuf (ORT's INVALID_PROTOBUF)."""


class NotRecorded(StaronnxError, _ort_state.Fail):  # type: ignore[misc]
    """get_provider_graph_assignment_info() without the config entry that records it (ORT's Fail)."""


#: what ORT's run methods take: the outputs asked (None or [] for all), the feeds, the run's options
type _Names = Sequence[str] | None
type _Feeds = Mapping[str, Any]
type _RunOptions = ort.RunOptions | None

#: the config entry that makes a session record which provider runs each node (ORT's)
RECORD_ASSIGNMENT = "session.record_ep_graph_assignment_info"

#: TaskError classes that are also ORT's, by ORT's class (None: an ORT class that cannot be a base)
_task_error_types: dict[type, type[TaskError] | None] = {}


def _ort_task_error(exc: TaskError) -> TaskError:
    """A failed part's error that is also of ONNX Runtime's own class (``Fail``,
    ``RuntimeException``, ...), so ``except`` clauses written for ORT still catch it."""
    cause = exc.__cause__
    if not isinstance(cause, Exception) or not type(cause).__module__.startswith("onnxruntime"):
        return exc
    kind = type(cause)
    if kind not in _task_error_types:
        try:
            _task_error_types[kind] = types.new_class(kind.__name__, (TaskError, kind),
                                                      exec_body=lambda ns: ns.update(__module__=__name__))
        except TypeError:
            _task_error_types[kind] = None
    compat = _task_error_types[kind]
    if compat is None:
        return exc
    err: TaskError = compat.__new__(compat)
    TaskError.__init__(err, exc.part, exc.worker, cause)
    return err


# -- what ORT's getters return --------------------------------------------------------------
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


def _arg(t: TensorSpec) -> NodeArg:
    return NodeArg(t.name, ort_type_name(t.dtype), list(t.shape))


# -- providers -> workers -------------------------------------------------------------------
def _providers(providers: Sequence[str | tuple[str, Mapping[str, Any]]] | None,
               provider_options: Sequence[Mapping[str, Any]] | None,
               cuda_stand_in: bool = False) -> dict[str, dict[str, str]]:
    """ORT's two provider spellings as one ordered {name: options}, checked by ORT's own code;
    providers this ORT lacks are dropped after ORT's warning, as ORT drops them (not CUDA's where
    a stand-in CUDA runtime is given)."""
    available = ort.get_available_providers() + ([CUDA_EP] if cuda_stand_in else [])
    names, options = check_and_normalize_provider_args(providers, provider_options, available)
    return {name: opts for name, opts in zip(names, options) if name in available}


def _cuda_streams(asked: dict[str, dict[str, str]] | None, cuda_streams: int | None, stand_in: Any = None) -> int:
    """How many CUDA workers to start: with ``providers=None``, ``cuda_streams``; with providers
    naming CUDA, where CUDA can run (``stand_in``: the CUDA runtime the workers use instead of
    this machine's, asked in its place), and otherwise none, with ORT's warning of a fallback."""
    if asked is None:
        return int(cuda_streams or 0)
    if CUDA_EP not in asked:
        if cuda_streams:
            raise ValueError(f"cuda_streams={cuda_streams} needs {CUDA_EP} in providers "
                             f"(providers here: {', '.join(asked) or 'none'})")
        return 0
    device = _device_id(asked)
    reason = cuda_unavailable_reason(device) if stand_in is None else missing_device(device, stand_in.device_count())
    if reason is not None:
        warnings.warn(f"{CUDA_EP} cannot run here, falling back to {CPU_EP}: {reason}", UserWarning, stacklevel=3)
        return 0
    return DEFAULT_CUDA_STREAMS if cuda_streams is None else int(cuda_streams)


# -- plans made for a session ---------------------------------------------------------------
def _load_source(path_or_bytes: Any, so: ort.SessionOptions | None) -> tuple[Any, onnx.ModelProto, str] | None:
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
        source: Any = proto
    else:
        source = Path(path_or_bytes)
        if source.is_dir():
            return None
        if not source.exists():
            raise NoSuchFile(f"Load model from {source} failed: File doesn't exist")
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
    sha256 = hashlib.sha256((loaded.sha256 + json.dumps(effects.shapes, sort_keys=True)).encode()).hexdigest()
    log.info("the session options change the model: initializers %s given, inputs %s fixed",
             sorted(effects.initializers), sorted(effects.shapes))
    return model, model, sha256




# -- ORT's SessionOptions, honoured or said ---------------------------------------------------
#: what an ORT config embedded in a model (metadata "ort_config": {"session_options": {...}})
#: may set, as ORT reads it, each with the type its value takes
_CONFIG_OPTIONS: dict[str, Callable[[Any], Any]] = {
    "intra_op_num_threads": int,
    "inter_op_num_threads": int,
    "execution_mode": lambda v: ort.ExecutionMode(int(v)),
    "graph_optimization_level": lambda v: ort.GraphOptimizationLevel(int(v)),
    "enable_profiling": lambda v: bool(int(v)),
}


class OptionNotApplied(UserWarning):
    """A SessionOptions or RunOptions setting of ORT's pools, allocators or logs, which staronnx's
    workers set for their cores themselves. Settings that change what a model computes are
    applied, or refused with a NotImplementedError naming them."""


def _reads_config(kwargs: Mapping[str, Any]) -> bool:
    """Whether ORT would read the model's embedded config: ``read_config_from_model=1``, or
    else ``$ORT_LOAD_CONFIG_FROM_MODEL`` == "1" (ORT's rule)."""
    if "read_config_from_model" in kwargs:
        return int(kwargs["read_config_from_model"]) == 1
    return os.environ.get("ORT_LOAD_CONFIG_FROM_MODEL") == "1"


def _model_config(model: onnx.ModelProto) -> dict[str, Any]:
    """The session options an ORT config embedded in the model sets ({} without one)."""
    text = next((p.value for p in model.metadata_props if p.key == "ort_config"), None)
    if text is None:
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelError(f"the model's ort_config metadata is not JSON: {exc}") from None
    options = config.get("session_options", {}) if isinstance(config, dict) else {}
    unknown = sorted(set(options) - set(_CONFIG_OPTIONS))
    if unknown:
        raise ModelError(f"the model's ort_config sets {unknown[0]!r}, which ONNX Runtime does not read from a "
                         f"model (it reads {', '.join(_CONFIG_OPTIONS)})")
    return {key: _CONFIG_OPTIONS[key](value) for key, value in options.items()}


def _with_config(so: ort.SessionOptions | None, config: Mapping[str, Any]) -> ort.SessionOptions | None:
    """The options a session runs with: ``so`` with the model's config over it, as ORT applies
    it (a copy: the caller's object is not changed, and its config entries are not carried)."""
    if not config:
        return so
    effective = ort.SessionOptions()
    for name, value in {**(option_values(so, _COPIED) if so is not None else {}), **config}.items():
        setattr(effective, name, value)
    return effective


type _Options = ort.SessionOptions | ort.RunOptions


def _config_entry(so: _Options, key: str) -> str | None:
    get = so.get_run_config_entry if isinstance(so, ort.RunOptions) else so.get_session_config_entry
    try:
        return str(get(key))
    except RuntimeError:  # ORT's answer for a key never set
        return None


def _refuse_options(so: ort.SessionOptions | None, path_or_bytes: Any) -> None:
    """Options staronnx cannot honour and that change what runs: a NotImplementedError naming
    each, before anything is done."""
    ort_file = isinstance(path_or_bytes, (str, os.PathLike)) and str(path_or_bytes).endswith(".ort")
    if ort_file or so is not None and _config_entry(so, "session.load_model_format") == "ORT":
        raise NotImplementedError("session.load_model_format=ORT: staronnx cuts ONNX models; an ORT-format model "
                                  "cannot be partitioned (give the .onnx file it was converted from)")
    if so is not None and so.has_providers():
        raise NotImplementedError("SessionOptions.add_provider / add_provider_for_devices: staronnx starts its "
                                  "workers from InferenceSession(..., providers=[...]); name the providers there")


def _unapplied(options: _Options, given: _Options) -> list[str]:
    """What ``options`` set that staronnx's workers do not apply, each with why: attributes off
    ORT's defaults, a log level below warnings, and config entries (of ``given``, the caller's
    object, which a copy does not carry)."""
    run = isinstance(options, ort.RunOptions)
    attributes, entries = ({}, _RUN_ENTRIES) if run else (_UNAPPLIED, _CONFIG_ENTRIES)
    values, defaults = option_values(options, attributes), option_values(type(options)(), attributes)
    said = [f"{name}={values[name]!s} ({why})" for name, why in attributes.items() if values[name] != defaults[name]]
    if 0 <= options.log_severity_level < 2 or options.log_verbosity_level > 0:
        logs = "each part's session logs only fatal errors" + ("" if run else ": its errors reach Python as exceptions")
        said.append(f"log_severity_level={options.log_severity_level} ({logs})")
    values = {key: _config_entry(given, key) for key in entries}
    return said + [f"config entry {key}={value} ({entries[key]})" for key, value in values.items() if value is not None]


_SEQUENTIAL = "parts run in parallel on staronnx's workers; each part's operators run in sequence"
_ALLOCATOR = "each worker's session keeps ORT's default allocator"
#: SessionOptions attributes that staronnx's workers do not apply (each part's ORT session is a
#: worker's, sized to its CPU group and run one operator at a time), each with why
_UNAPPLIED = {
    "inter_op_num_threads": _SEQUENTIAL,
    "execution_mode": _SEQUENTIAL,
    "execution_order": "each part's session orders its own operators",
    "graph_optimization_level": "each part's session optimises at ORT's full level (optimized_model_filepath "
                                "is written at the level asked)",
    "enable_cpu_mem_arena": _ALLOCATOR,
    "enable_mem_pattern": _ALLOCATOR,
    "enable_mem_reuse": _ALLOCATOR,
    "use_deterministic_compute": "each part's session uses ORT's default kernels",
}
#: SessionOptions attributes that a copy carries (ORT's object cannot be copied)
_COPIED = (*_UNAPPLIED, "intra_op_num_threads", "enable_profiling", "profile_file_prefix", "optimized_model_filepath",
           "log_severity_level", "log_verbosity_level", "logid", "use_per_session_threads")
#: SessionOptions config entries that staronnx's workers do not apply, each with why (those it
#: applies: the optimized model's external initializer settings, the graph assignment record)
_CONFIG_ENTRIES = {
    "session.use_env_allocators": "each worker's session keeps its own allocator",
    "session.disable_prepacking": "each worker's session prepacks its part's weights (or shares them)",
    "session.intra_op.allow_spinning": "each worker decides its pool's spinning",
    "session.inter_op.allow_spinning": "each worker decides its pool's spinning",
    "session.intra_op_thread_affinities": "each worker pins its pool to its CPU group",
    "session.set_denormal_as_zero": "each part's session keeps ORT's default",
    "session.disable_cpu_ep_fallback": "parts run on CPU workers whatever the providers",
}
#: RunOptions config entries that staronnx's workers do not apply, each with why
_RUN_ENTRIES = {
    "memory.enable_memory_arena_shrinkage": "each worker's session keeps its arena",
    "gpu_graph_id": "the CUDA workers choose their own graphs",
    "run.disable_synchronize_execution_providers": "the workers synchronise their own devices",
}


def _stand_in(runtime_options: Mapping[str, Any]) -> Any:
    """The runtime the CUDA workers will drive instead of CUDA, if any: the one ``cuda_options``
    gives them, else ``$STARONNX_CUDA_RUNTIME``'s (as CudaWorker picks it)."""
    return (runtime_options.get("cuda_options") or {}).get("runtime") or host_runtime_from_env()


def _device_id(asked: Mapping[str, Mapping[str, Any]]) -> int:
    """The GPU the CUDA provider's options name (ORT's ``device_id``, 0 by default)."""
    value = (asked.get(CUDA_EP) or {}).get("device_id", 0)
    try:
        device = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{CUDA_EP} option device_id must be a CUDA device ordinal (0, 1, ...), "
                         f"got {value!r}") from None
    if device < 0:
        raise ValueError(f"{CUDA_EP} option device_id must be >= 0, got {device}")
    return device


def _cores_for_threads(threads: int, cuda_drivers: int = 0) -> str:
    """ORT's ``intra_op_num_threads`` as CPU groups: one group of the first ``threads`` cores
    this process may use (one PU each), so the session computes on that many threads as ORT's
    would. ``cuda_drivers`` more cores are reserved for the GPU driver threads where the machine
    has them, as the default groups do (an explicit list alone reserves none)."""
    topology = Topology.from_system()
    allowed = topology.allowed_cores()
    cores = allowed[:threads]
    pus = ",".join(str(core.allowed_pus(topology.allowed_pus)[0]) for core in cores)
    spare = len(allowed) - len(cores)
    return pus + (f",reserve={min(cuda_drivers, spare)}" if cuda_drivers and spare else "")


def _plan_dir(sha256: str, shares: Any, options: Mapping[str, Any], groups: str, cuda_streams: int) -> Path:
    """Where a session's plan of this model and these settings lives: keyed by what besides the
    model decides the cut (the workers only where the cut is timed on them: ``shares="auto"``, a
    placement method)."""
    settings: dict[str, Any] = {"plan_version": PLAN_VERSION, "shares": shares, "options": dict(options)}
    if shares == "auto" or "method" in options:
        settings.update(groups=groups, cuda_streams=cuda_streams)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return default_root() / "plans" / f"{sha256[:16]}-{key}"


def _kept_plan(folder: Path, sha256: str, say: bool = False) -> Plan | None:
    """The plan in ``folder`` when it is this model's and intact, else None (``say``: log why
    an existing one is not used, before it is made again)."""
    if not folder.exists():
        return None
    try:
        plan = Plan.load(folder)
    except PlanError as exc:
        why = f"is unusable ({exc})"
    else:
        if plan.source.get("sha256") == sha256:
            return plan
        why = "is of another model"
    if say:
        log.warning("plan %s %s; partitioning again", folder, why)
    return None


def _partition_options(partition_options: Mapping[str, Any] | None,
                       input_shapes: Sequence[str] | Mapping[str, Sequence[int]] | None) -> dict[str, Any]:
    """What goes to partition(): ``partition_options`` with ``input_shapes`` (a keyword of its
    own, as partition's errors name it) in it; given in both places it is refused, not merged."""
    options = dict(partition_options or {})
    if input_shapes is not None:
        if "input_shapes" in options:
            raise TypeError("input_shapes given twice: as input_shapes= and in partition_options; give it once")
        options["input_shapes"] = input_shapes
    placed = sorted({"output_dir", "force"} & options.keys())
    if placed:
        raise TypeError(f"partition_options cannot set {placed[0]}: a session's plan lives under "
                        "STARONNX_HOME; for a plan elsewhere, staronnx.partition(model, "
                        "output_dir=...) and pass that folder")
    return options


def _unsized(model: onnx.ModelProto, batch_axes: dict[str, int | None]) -> list[str]:
    """The model's dynamic sizes that partition cannot choose itself ("image: height"): every
    dynamic axis of an input but its batch axis (which partition sets to its profiling batch);
    none for a model served whole, which is not profiled (:mod:`staronnx.partition.whole`)."""
    if whole_reason(model) is not None:
        return []
    return [f"{spec.name}: {d or f'axis {axis}'}" for spec in model_inputs(model, batch_axes)
            for axis, d in enumerate(spec.shape) if not is_fixed(d) and axis != spec.batch_axis]


def _first_run_shapes(feeds: Mapping[str, np.ndarray]) -> dict[str, list[int]]:
    """A first run's feed shapes as partition's ``input_shapes`` (scalars have none to give;
    a zero size, an empty KV cache at a decoder's prefill, is a size the model runs)."""
    return {name: [int(d) for d in value.shape] for name, value in feeds.items() if value.ndim}


def _declared(model: onnx.ModelProto) -> Plan:
    """The model's inputs and outputs as it declares them (what ORT's getters report: sequences,
    optionals and maps by ORT's type string), as a plan with no parts: it answers the getters
    and checks feeds before the model is cut."""
    inputs, outputs = io_specs(model)
    return Plan(Path(), [], inputs, outputs, [], 0, {}, {})  # no parts, crossings, source or settings


def _overridable(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The initializers a run may override (IR >= 4: those also listed as graph inputs), as ORT's
    ``get_overridable_initializers`` lists them; what a LoRA adapter sets."""
    if model.ir_version < 4:
        return []
    listed = {vi.name for vi in model.graph.input}
    return [t for t in model.graph.initializer if t.name in listed]


def _runs_on_workers(plan: Plan) -> str | None:
    """Why staronnx's workers cannot run the plan, or None when they can: they hand on tensors
    priced by their bytes (a sequence has none), and the engine tracks each tensor from the one
    part that writes it (an input returned as an output is written by none)."""
    odd = next((t for t in (*plan.inputs, *plan.outputs) if "(" in t.dtype), None)
    if odd is not None:
        return f"{odd.name!r} is a {odd.dtype}, and staronnx's workers hand on tensors only"
    fed = set(plan.input_names)
    passed = next((n for n in plan.output_names if n in fed), None)
    if passed is not None:
        return f"output {passed!r} is an input returned as it is, which staronnx's engine does not track"
    return None


class _OrtPart:
    """The one part of a plan that staronnx's workers cannot run (:func:`_runs_on_workers`), run
    by one ONNX Runtime session in this process, on the CPU, answering what a session asks of its
    Runtime."""

    def __init__(self, plan: Plan, threads: int = 0) -> None:
        so = ort.SessionOptions()
        so.log_severity_level = QUIET  # its errors reach the caller as exceptions
        so.intra_op_num_threads = max(threads, 0)  # 0: ORT's default
        self._session: OrtSession | None = OrtSession(str(plan.part_path(0)), so, providers=[CPU_EP])
        self._outputs = plan.output_names
        self.workers: list[Any] = []
        self.tracer = None

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        if self._session is None:
            raise EngineClosed("the session is closed; no new requests are accepted")
        return dict(zip(self._outputs, self._session.run(self._outputs, dict(feeds))))

    def submit(self, feeds: Mapping[str, Any]) -> RequestFuture:
        """The outputs, computed in this call, as a settled future."""
        future = RequestFuture(-1)
        try:
            future.set_result(self.run(feeds))
        except Exception as exc:  # noqa: BLE001 - the future carries it, as a worker's would
            future.set_exception(exc)
        return future

    def close(self) -> None:
        self._session = None


_READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR})


#: ORT methods refused, with what to do instead
_REFUSED: dict[str, str] = {
    "run_with_ortvaluevector": "use run_with_ort_values(output_names, {name: OrtValue})",
    "get_tuning_results": "kernel tuning is per worker session; staronnx tunes nothing across them",
    "set_tuning_results": "kernel tuning is per worker session; staronnx tunes nothing across them",
    "release_captured_graph": "CUDA graphs belong to the CUDA workers (cuda_options={'cuda_graphs': False})",
    "create_ortvalue_from_shape_and_type": "use onnxruntime.OrtValue.ortvalue_from_shape_and_type (host memory)",
    "set_ep_dynamic_options": "providers are fixed when the workers start; create a new session",
}


# -- IOBinding --------------------------------------------------------------------------------
class IOBinding:
    """ORT's IOBinding for host memory: inputs bound as arrays or CPU OrtValues, outputs
    returned as OrtValues or written into bound ones. Staronnx moves data between devices
    itself (pinned buffers, prefetch), so device pointers are refused: bind host arrays."""

    def __init__(self, session: "InferenceSession") -> None:
        self._session = session
        self._inputs: dict[str, np.ndarray] = {}
        self._outputs: dict[str, ort.OrtValue | None] = {}
        self._results: list[ort.OrtValue] = []

    def bind_cpu_input(self, name: str, arr_on_cpu: np.ndarray) -> None:
        self._inputs[name] = arr_on_cpu

    def bind_input(self, name: str, device_type: str, device_id: int, element_type: Any,
                   shape: Sequence[int], buffer_ptr: int) -> None:
        raise NotImplementedError("staronnx binds host memory only: use bind_cpu_input(name, array) "
                                  "or bind_ortvalue_input(name, cpu_ortvalue)")

    def bind_ortvalue_input(self, name: str, ortvalue: ort.OrtValue) -> None:
        self._inputs[name] = _host_array(ortvalue, name)

    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0,
                    element_type: Any = None, shape: Sequence[int] | None = None,
                    buffer_ptr: int | None = None) -> None:
        if device_type != "cpu" or buffer_ptr is not None:
            raise NotImplementedError("staronnx returns outputs in host memory only: use "
                                      "bind_output(name) or bind_ortvalue_output(name, cpu_ortvalue)")
        self._outputs[name] = None

    def bind_ortvalue_output(self, name: str, ortvalue: ort.OrtValue) -> None:
        _host_array(ortvalue, name)  # refuses device memory now, not at run
        self._outputs[name] = ortvalue

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()

    def synchronize_inputs(self) -> None:
        """Nothing to wait for: bound inputs are host arrays."""

    def synchronize_outputs(self) -> None:
        """Nothing to wait for: run_with_iobinding returns once outputs are on the host."""

    def get_outputs(self) -> list[ort.OrtValue]:
        return list(self._results)

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        return [v.numpy() for v in self._results]

    def _run(self) -> None:
        names = list(self._outputs) or self._session._io.output_names
        try:
            arrays = self._session.run(names, self._inputs)
        except ValueError as exc:
            raise RuntimeError(f"Error in execution: {exc}") from exc  # ORT's type here
        results = []
        for name, array in zip(names, arrays):
            value = self._outputs.get(name)
            if value is None:
                value = ort.OrtValue.ortvalue_from_numpy(array)
            else:
                value.update_inplace(np.ascontiguousarray(array))
            results.append(value)
        self._results = results


def _host_memory() -> ort.OrtMemoryInfo:
    """Host memory as ORT's CPU provider describes it."""
    return ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)


class _CSession:
    """The part of ORT's C session (``InferenceSession._sess``) that scripts call directly:
    ``run_with_ort_values`` on C OrtValues, answered with ORT's OrtValueVector, and ``run``."""

    def __init__(self, session: "InferenceSession") -> None:
        self._session = session

    def run(self, output_names: _Names, input_feed: _Feeds, run_options: _RunOptions = None) -> list[np.ndarray]:
        return self._session.run(output_names, input_feed, run_options)

    def run_with_ort_values(self, feeds: _Feeds, output_names: _Names, run_options: _RunOptions = None) -> Any:
        vector = _ort_state.OrtValueVector()
        for value in self._session.run_with_ort_values(output_names, feeds, run_options):
            vector.push_back(value._ortvalue)
        return vector

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"staronnx.InferenceSession._sess has no {name!r}: it stands for ORT's C session only in "
                             "run and run_with_ort_values; use the session's own methods")


def _owned(array: np.ndarray) -> ort.OrtValue:
    """An OrtValue holding its own copy of ``array`` (one that points into a numpy array
    would outlive it inside an OrtValueVector)."""
    if array.dtype == object:
        return ort.OrtValue.ortvalue_from_numpy(array)  # ORT copies strings into its own tensor
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), array.dtype)
    value.update_inplace(np.ascontiguousarray(array))
    return value


def _array(value: Any, name: str, spec: TensorSpec | None = None) -> Any:
    """A feed as the workers take it: lists and host OrtValues as arrays, as ORT accepts them (a
    sequence, optional or map input's value goes as given)."""
    if isinstance(value, ort.OrtValue):
        return _host_array(value, name)
    if isinstance(value, np.ndarray) or spec is not None and "(" in spec.dtype:
        return value
    return np.asarray(value, dtype=_numpy_dtype(spec.dtype) if spec else None)


def _host_array(value: Any, name: str) -> np.ndarray:
    """An OrtValue's data as a host array; device OrtValues are refused, since staronnx's
    workers copy to their own device themselves."""
    if value.device_name().lower() != "cpu":
        raise NotImplementedError(f"{name!r}: staronnx takes host OrtValues only (this one is on "
                                  f"{value.device_name()}); pass OrtValue.ortvalue_from_numpy(array)")
    return np.asarray(value.numpy())


# -- what a session holds, released without close() too ----------------------------------------
class _Held:
    """What a session started and must stop: its runners and temporary folders. Kept apart from
    the session, so that they are released when the session is collected or the interpreter
    exits without ``close()`` (ORT's users never call it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runners: list[Any] = []
        #: a private plan's folder (read-only home), and where a trace ended goes at close
        self.scratch: list[Path] = []

    def add(self, runner: Runtime | _OrtPart) -> Runtime | _OrtPart:
        with self._lock:
            self._runners.append(runner)
        return runner

    def stop(self, runner: Any) -> None:
        with self._lock:
            if runner in self._runners:
                self._runners.remove(runner)
        runner.close()

    def temporary(self, prefix: str) -> Path:
        """A new temporary folder, removed with the rest."""
        folder = Path(tempfile.mkdtemp(prefix=prefix))
        self.scratch.append(folder)
        return folder

    def remove_scratch(self) -> None:
        while self.scratch:
            shutil.rmtree(self.scratch.pop(), ignore_errors=True)

    def release(self) -> None:
        """Stop every runner (one that fails to stop is logged, the others still stop), then
        remove the temporary plan folder."""
        with self._lock:
            runners, self._runners = self._runners, []
        try:
            for runner in runners:
                try:
                    runner.close()
                except Exception:  # noqa: BLE001 - the next runner must stop too
                    log.exception("stopping a session's workers failed")
        finally:
            self.remove_scratch()


#: what the sessions alive hold, released at exit before the interpreter joins its threads (as a
#: plain ORT session's process, this one's exits at once): threading's own exit hook, as
#: concurrent.futures uses, since atexit runs only after every non-daemon thread is joined
_LIVE: weakref.WeakSet[_Held] = weakref.WeakSet()


def _release_all() -> None:
    for held in list(_LIVE):
        held.release()


threading._register_atexit(_release_all)  # type: ignore[attr-defined]


# -- the session ------------------------------------------------------------------------------
def _called_from_staronnx(depth: int = 3) -> bool:
    """Whether the construction comes from staronnx's own code (a worker, a plan's reference
    session), within ``depth`` frames of the caller (a program's wrapper may stand between)."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        module = frame.f_globals.get("__name__", "")
        if module.startswith("staronnx.") and module != __name__:
            return True
        frame = frame.f_back
    return False


class InferenceSession:
    """Drop-in for ``onnxruntime.InferenceSession`` backed by the staronnx runtime."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Where a program made this class ``onnxruntime.InferenceSession`` (the one-line switch),
        staronnx's own code asking that name for a part's session gets ORT's: a part cut again by
        staronnx would partition without end, each session waiting on its own plan's lock."""
        if ort.InferenceSession is not OrtSession and _called_from_staronnx():
            return OrtSession(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        path_or_bytes: str | os.PathLike[str] | bytes | Plan,
        sess_options: ort.SessionOptions | None = None,
        providers: Sequence[str | tuple[str, Mapping[str, Any]]] | None = None,
        provider_options: Sequence[Mapping[str, Any]] | None = None,
        *,
        shares: Sequence[float] | str | None = DEFAULT_SHARES,
        policy: str = "heft",
        cpu_groups: str | None = None,
        cuda_streams: int | None = None,
        input_shapes: Sequence[str] | Mapping[str, Sequence[int]] | None = None,
        partition_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """``input_shapes`` (``["image=1x3x256x256"]``): the size a model with dynamic sizes is
        cut at when the session opens, instead of at its first run's shapes. ``partition_options``
        go to :func:`staronnx.partition` (e.g. ``{"costs": "estimate"}``); other keywords go to
        :class:`Runtime` (``store``, ``trace``, ``engine``, ``cuda_options``, ...). ORT's
        settings that choose hardware keep their meaning: the CUDA provider's ``device_id`` is the
        GPU the CUDA workers drive; ``sess_options.intra_op_num_threads = N`` gives the session one
        CPU group of N cores (``cpu_groups`` decides instead when given; default: one per NUMA node)."""
        #: what runs the plan: a Runtime over the workers, or for a plan they cannot run, an _OrtPart
        self._runtime: Runtime | _OrtPart | None = None
        self._plan: Plan | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        self._held = _Held()
        self._finalizer = weakref.finalize(self, self._held.release)  # when collected, without close()
        _LIVE.add(self._held)
        if sess_options is not None and not isinstance(sess_options, ort.SessionOptions):
            hint = (" (staronnx's shares are keyword-only: shares=[...])"
                    if isinstance(sess_options, (list, tuple)) else "")
            raise TypeError(f"sess_options must be an onnxruntime.SessionOptions, got "
                            f"{type(sess_options).__name__}{hint}")
        runtime_options = {k: v for k, v in kwargs.items() if k not in _ORT_KWARGS}
        self._check_runtime_options(runtime_options)
        _refuse_options(sess_options, path_or_bytes)
        self._sess_options = sess_options
        self._adapters: AdapterProbe | None = None
        self._assignments: tuple[list[OrtSession], list[Any]] | None = None
        #: the RunOptions settings not applied that this session has warned of
        self._said: set[str] = set()
        #: how this session cuts its model (None for a plan), and the runtimes of variants of the model
        #: with other initializers (a LoRA adapter's), by their values
        self._cut_model: Callable[..., Plan] | None = None
        self._variants: dict[str, Runtime | _OrtPart] = {}
        #: the model as loaded (source, model, hash; None for a plan), its metadata, its inputs and
        #: outputs as it declares them, and the initializers a run may override
        self._loaded = _load_source(path_or_bytes, sess_options)
        model = self._loaded[1] if self._loaded is not None else None
        self._meta = ModelMetadata.of(model) if model is not None else None
        self._model = _declared(model) if model is not None else None
        self._overridable = _overridable(model) if model is not None else []
        config = _model_config(model) if model is not None and _reads_config(kwargs) else {}
        #: the options this session runs with (the caller's, with the model's embedded config over them)
        self._options = effective = _with_config(sess_options, config)
        unapplied = _unapplied(effective, sess_options or effective) if effective is not None else []
        if unapplied:
            warnings.warn(OptionNotApplied("staronnx.InferenceSession does not apply sess_options."
                                           + "; ".join(unapplied)), stacklevel=2)
        self._threads = int(effective.intra_op_num_threads) if effective is not None else 0
        #: what the workers were asked (set_providers starts them again from here, with other providers)
        self._asked = (cuda_streams, dict(runtime_options), cpu_groups, policy)
        self._streams, self._runtime_args = self._workers(providers, provider_options, cuda_streams)

        if model is not None and effective is not None and effective.optimized_model_filepath:
            # the whole model, optimised as ORT writes it for these options (staronnx's parts are not it)
            model_arg = bytes(path_or_bytes) if isinstance(path_or_bytes, (bytes, bytearray, memoryview)) \
                else str(path_or_bytes)
            write_optimized(model_arg, sess_options or effective, list(self._provider_options),
                            config.get("graph_optimization_level"))
        options = _partition_options(partition_options, input_shapes)
        try:
            self._plan = self._plan_for(path_or_bytes, shares, options, self._runtime_args["cpu_groups"], self._streams)
            self._profile_path, self._profile_start = self._profiling(effective, self._runtime_args)
            if self._plan is not None:
                self._runtime = self._start(self._plan)
            else:
                policy_options(policy)  # an unknown policy fails here, not at the first run
        except BaseException:
            self._finalizer()  # what was started before the failure, and a private plan
            raise

    def _workers(self, providers: Any, provider_options: Any, cuda_streams: int | None) -> tuple[int, dict[str, Any]]:
        """The CUDA streams and the Runtime's arguments for ORT's provider arguments, with what the
        session was given (``self._asked``); ``self._provider_options`` records the providers in use."""
        _, given, cpu_groups, policy = self._asked
        runtime_options = dict(given)
        stand_in = _stand_in(runtime_options)
        asked = None if providers is None else _providers(providers, provider_options, stand_in is not None)
        streams = _cuda_streams(asked, cuda_streams, stand_in)
        self._provider_options = {CPU_EP: {}} if asked is None else dict(asked)
        self._provider_options.setdefault(CPU_EP, {})
        if streams and asked is not None and "cuda_devices" not in runtime_options:
            runtime_options["cuda_devices"] = (_device_id(asked),)
        if cpu_groups is None:
            drivers = len(runtime_options.get("cuda_devices", (0,))) if streams else 0  # one per GPU
            cpu_groups = _cores_for_threads(self._threads, drivers) if self._threads > 0 else "numa"
        cuda_given = {k: v for k, v in self._provider_options.get(CUDA_EP, {}).items()
                      if k not in ("device_id", "user_compute_stream", "has_user_compute_stream")}
        if streams and cuda_given:
            # ORT's CUDA options (gpu_mem_limit, arena settings, ...) go to every CUDA worker;
            # the device and the stream are each worker's own, so those are not passed
            cuda_options = dict(runtime_options.get("cuda_options") or {})
            cuda_options["provider_options"] = {**cuda_given, **dict(cuda_options.get("provider_options") or {})}
            runtime_options["cuda_options"] = cuda_options
        return streams, dict(policy=policy, cpu_groups=cpu_groups, cuda_streams=streams, **runtime_options)

    def _start(self, plan: Plan) -> Runtime | _OrtPart:
        """What runs the plan: a :class:`Runtime` over staronnx's workers, or for a plan they
        cannot run, one ORT session on the CPU (said, and warned of where CUDA was asked for)."""
        why = _runs_on_workers(plan)
        if why is None:
            return self._held.add(Runtime(plan, **self._runtime_args))
        if self._streams:
            warnings.warn(f"{CUDA_EP} is not used for this model: it runs as one ONNX Runtime session on the "
                          f"CPU ({why})", UserWarning, stacklevel=4)
        log.info("running the model as one ONNX Runtime session in this process: %s", why)
        return self._held.add(_OrtPart(plan, self._threads))

    @staticmethod
    def _check_runtime_options(options: Mapping[str, Any]) -> None:
        own = {"self", "plan", "policy", "cpu_groups", "cuda_streams"}  # set by the session
        accepted = set(inspect.signature(Runtime.__init__).parameters) - own
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise TypeError(f"InferenceSession() got an unexpected keyword argument {unknown[0]!r} "
                            f"(staronnx options: shares, policy, cpu_groups, cuda_streams, input_shapes, "
                            f"partition_options, {', '.join(sorted(accepted))})")

    def _plan_for(self, path_or_bytes: Any, shares: Any, options: dict[str, Any], groups: str,
                  streams: int) -> Plan | None:
        """The plan to run: the one given, the one kept for this model and settings, or a new
        cut. None when the model is cut at its first run (by :meth:`_runner`)."""
        if self._loaded is None:
            return path_or_bytes if isinstance(path_or_bytes, Plan) else Plan.load(path_or_bytes)
        source, model, sha256 = self._loaded
        # the user's own shares are warned of where the cut misses them; the session's are not
        by_default = shares is DEFAULT_SHARES
        if by_default and too_small(model, len(shares)):
            shares = None  # partition's default split, which serves a model too small to cut whole
        if shares is not None and not isinstance(shares, str):
            shares = [float(s) for s in shares]
        from staronnx.partition.api import partition

        unsized = [] if "input_shapes" in options else _unsized(model, parse_batch_axes(options.get("batch_axes")))

        def cut_model(src: Any, sha: str, feeds: Mapping[str, Any] | None = None) -> Plan:
            """``src`` (this model, or a variant of it with other initializers) cut with this
            session's settings: at ``feeds``' shapes for a model with dynamic sizes."""
            settings, asked = dict(options), dict(options)
            if unsized:
                assert feeds is not None
                log.info("cutting %s at a run's shapes %s (its dynamic sizes: %s); the plan serves every size",
                         self._meta.graph_name if self._meta else "the model", _first_run_shapes(feeds),
                         ", ".join(unsized))
                settings["input_shapes"], asked["input_shapes"] = _first_run_shapes(feeds), AT_FIRST_RUN
            make = functools.partial(partition, src, shares, groups=groups, cuda_streams=streams, **settings)
            with targets_by_default() if by_default else contextlib.nullcontext():
                return self._kept_or_made(sha, _plan_dir(sha, shares, asked, groups, streams), make)

        self._cut_model = cut_model
        if not unsized:
            return cut_model(source, sha256)
        folder = _plan_dir(sha256, shares, {**options, "input_shapes": AT_FIRST_RUN}, groups, streams)
        with contextlib.suppress(OSError):  # a home that cannot be read: cut at the first run
            return _kept_plan(folder, sha256)
        return None

    def _kept_or_made(self, sha256: str, folder: Path, make: Callable[..., Plan]) -> Plan:
        """The plan kept in ``folder`` when it is this model's and intact, else made there; where the
        home cannot be written, this session's own in a temporary folder. The lock makes concurrent
        sessions of one model partition it once: the others wait and load it (partition publishes
        the folder atomically, so a killed run leaves only a staging folder the next writer sweeps)."""
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(folder) + ".lock", timeout=PLAN_LOCK_TIMEOUT):
                plan = _kept_plan(folder, sha256, say=True)
                return plan if plan is not None else make(output_dir=folder, force=True)
        except OSError as exc:
            if exc.errno not in _READ_ONLY:
                raise
            why = exc.strerror or str(exc)
        # a home that cannot be written: this session's own plan, removed at close
        warnings.warn(f"cannot keep plans under {default_root()} ({why}); this "
                      "session's plan lives in a temporary folder until close(). Set "
                      "STARONNX_HOME to a writable folder to partition once.", UserWarning, stacklevel=4)
        return make(output_dir=self._held.temporary("staronnx-session-") / "plan")

    @property
    def plan(self) -> Plan:
        """The plan this session runs. A model cut at its first run has none before that run."""
        if self._plan is None:
            raise RuntimeError("this session's model is cut at its first run's shapes and has not run yet; "
                               "pass input_shapes=[...] to InferenceSession to cut it when the session opens")
        return self._plan

    def _profiling(self, so: ort.SessionOptions | None, runtime_options: dict[str, Any]) -> tuple[Path | None, int]:
        """``enable_profiling`` records staronnx's trace (Chrome/Perfetto JSON, ORT's profile
        format) at ORT's file name, so a profiling script finds its file where it expects."""
        if runtime_options.get("trace") is None and so is not None and so.enable_profiling:
            stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
            runtime_options["trace"] = Path(f"{so.profile_file_prefix or 'onnxruntime_profile_'}_{stamp}.json")
        trace = runtime_options.get("trace")
        return (Path(trace), time.time_ns()) if trace is not None else (None, 0)

    # -- getters ----------------------------------------------------------------------------
    @property
    def _io(self) -> Plan:
        """The inputs and outputs the getters report and feeds are checked against: the source
        model's, as it declares them (ORT's), or a plan's given as it is."""
        return self._model if self._model is not None else self.plan

    def get_inputs(self) -> list[NodeArg]:
        return [_arg(t) for t in self._io.inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [_arg(t) for t in self._io.outputs]

    def get_overridable_initializers(self) -> list[NodeArg]:
        """The initializers a run may replace (fed by name or set by a LoRA adapter: a variant of
        the model, see :meth:`run`), as the model declares them."""
        declared = {vi.name: vi for vi in self._loaded[1].graph.input} if self._loaded is not None else {}
        return [_arg(value_spec(declared[t.name])) for t in self._overridable if t.name in declared]

    def get_providers(self) -> list[str]:
        # a session started at its first run has its CUDA workers decided already
        runtime = self._runtime
        cuda = bool(self._streams) if runtime is None else any(isinstance(w, CudaWorker) for w in runtime.workers)
        return ([CUDA_EP] if cuda else []) + [CPU_EP]

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        """The options of the providers in use: CUDA's as the first CUDA worker's part 0
        session reports them (ORT's full set), else as given."""
        out = {name: dict(self._provider_options.get(name, {})) for name in self.get_providers()}
        workers = self._runtime.workers if self._runtime is not None else []
        worker = next((w for w in workers if isinstance(w, CudaWorker)), None)
        if CUDA_EP in out and worker is not None:
            with contextlib.suppress(Exception):
                out[CUDA_EP] = dict(worker.provider_options(0).get(CUDA_EP, out[CUDA_EP]))
        return out

    def get_session_options(self) -> ort.SessionOptions:
        """The options this session runs with: those given, with the model's embedded ORT
        config over them where ORT would read it (see the module's table of what each does)."""
        return self._options if self._options is not None else ort.SessionOptions()

    def get_modelmeta(self) -> ModelMetadata:
        """The source model's metadata: from the model given, or for a plan from the model
        file it records (empty metadata when that file is gone)."""
        if self._meta is None:
            path = self.plan.source.get("path")
            self._meta = ModelMetadata()
            if path and Path(path).is_file():
                with contextlib.suppress(Exception):
                    self._meta = ModelMetadata.of(onnx.load(path, load_external_data=False))
        return self._meta

    def get_profiling_start_time_ns(self) -> int:
        return self._profile_start

    def end_profiling(self) -> str:
        """Write the trace so far and return its file name ('' when not profiling, or after
        the first call, as ORT)."""
        path, self._profile_path = self._profile_path, None
        tracer = self._runtime.tracer if self._runtime is not None else None
        if path is None or tracer is None:
            return ""
        saved = tracer.save()
        # profiling ends here, as ORT's does: the trace the runtime writes again when it stops
        # goes to a folder removed then, not over the file the caller now owns (or removed)
        tracer.path = self._held.temporary("staronnx-trace-") / saved.name
        return str(saved)

    def set_providers(self, providers: Any = None, provider_options: Any = None) -> None:
        """ORT's: the workers start again for these providers (all available ones for None),
        on the same plan; a provider ORT does not know is refused with ORT's RuntimeError.
        Requests in flight finish on the workers they started on."""
        known = set(ort.get_all_providers()) | ({CUDA_EP} if _stand_in(self._asked[1]) is not None else set())
        if providers is None:
            providers = ort.get_available_providers()
        names = [item[0] if isinstance(item, tuple) else item for item in providers]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise RuntimeError(f"Unknown Provider Type: {unknown[0]}")  # ORT's words and type
        started = self._workers(providers, provider_options, self._asked[0] if CUDA_EP in names else None)
        with self._start_lock:
            if self._closed:
                raise EngineClosed("the session is closed")
            old = [*self._variants.values(), *([self._runtime] if self._runtime is not None else [])]
            self._variants.clear()
            self._streams, self._runtime_args = started
            self._runtime = self._start(self._plan) if self._plan is not None else None
        for runner in old:
            self._held.stop(runner)

    def get_input_memory_infos(self) -> list[ort.OrtMemoryInfo]:
        """Where each input is taken from: host memory (the workers copy it to their device)."""
        return [_host_memory() for _ in self._io.inputs]

    def get_output_memory_infos(self) -> list[ort.OrtMemoryInfo]:
        """Where each output is returned: host memory."""
        return [_host_memory() for _ in self._io.outputs]

    def get_input_epdevices(self) -> list[Any]:
        """The device each input is taken on: the CPU execution provider's (host memory)."""
        cpu = next((d for d in ort.get_ep_devices() if d.ep_name == CPU_EP), None)
        return [cpu for _ in self._io.inputs]

    def get_provider_graph_assignment_info(self) -> list[Any]:
        """Which provider runs each node, as ORT answers it for each part's session on a CPU worker
        (the parts' nodes are the model's). Needs ORT's config entry (else ORT's Fail); refused with
        CUDA workers, where each part runs on the CPU or the GPU as the policy places its batch."""
        given = self._sess_options
        if given is None or _config_entry(given, RECORD_ASSIGNMENT) != "1":
            raise NotRecorded(f"[ONNXRuntimeError] : 1 : FAIL : Session configuration entry '{RECORD_ASSIGNMENT}' "
                              'must be set to "1" to retrieve EP graph assignment information.')
        if self._streams:
            raise NotImplementedError("get_provider_graph_assignment_info: with CUDA workers each part runs where "
                                      "the policy places its batch (runtime.stats() counts where they ran)")
        if self._assignments is None:
            so = ort.SessionOptions()
            so.log_severity_level = QUIET
            so.add_session_config_entry(RECORD_ASSIGNMENT, "1")
            sessions = [OrtSession(str(self.plan.part_path(i)), so, providers=[CPU_EP]) for i in range(self.plan.k)]
            # the answers point into their sessions: the sessions live as long as this one
            self._assignments = (sessions, [s for session in sessions
                                            for s in session.get_provider_graph_assignment_info()])
        return list(self._assignments[1])

    @property
    def _sess(self) -> "_CSession":
        """What scripts reach as ORT's C session (``session._sess.run_with_ort_values``)."""
        return _CSession(self)

    def disable_fallback(self) -> None:
        """Nothing to turn off: fallback happens at construction only (CUDA missing -> CPU workers)."""

    def enable_fallback(self) -> None:
        """Nothing to turn on: fallback happens at construction only."""

    # -- running ----------------------------------------------------------------------------
    def _feeds(self, input_feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """ORT's feed checks: a missing input is a ValueError, anything else wrong with a feed an
        InvalidArgument."""
        names, io = list(input_feed.keys()), self._io  # a feed that is no mapping fails here, as in ORT
        missing = [n for n in io.input_names if n not in input_feed]
        if missing:
            raise InputError(f"Required inputs ({missing}) are missing from input feed ({names}).")
        specs = {t.name: t for t in io.inputs}
        feeds = {name: _array(value, name, specs.get(name)) for name, value in input_feed.items()}
        try:
            io.check_feeds(feeds)
        except InputError as exc:
            raise InvalidArgument(str(exc)) from None
        return feeds

    def _outputs(self, output_names: _Names) -> list[str]:
        if isinstance(output_names, str):
            raise TypeError("output_names must be a list of names (or None), not one string")
        names, known = list(output_names or self._io.output_names), self._io.output_names
        unknown = [n for n in names if n not in known]
        if unknown:
            raise InvalidArgument(f"Invalid output name:{unknown[0]}; the outputs are {known}")
        return names

    def _split(self, input_feed: _Feeds, run_options: _RunOptions) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The feeds (checked: :meth:`_feeds`), and the overridable initializers this run
        replaces (ORT's two ways: fed by name, or set by ``run_options``' active LoRA adapters,
        read back from ORT)."""
        if run_options is not None:
            if run_options.terminate:
                raise RuntimeError("Exiting due to terminate flag being set to true.")  # ORT's words
            said = [s for s in _unapplied(run_options, run_options) if s not in self._said]
            if said:
                self._said.update(said)  # once per session each
                said_text = "staronnx.InferenceSession does not apply run_options." + "; ".join(said)
                warnings.warn(OptionNotApplied(said_text), stacklevel=3)
        if not self._overridable:
            return self._feeds(input_feed), {}  # as given: a feed that is no mapping fails where ORT's does
        names = {t.name for t in self._overridable}
        overrides: dict[str, np.ndarray] = {}
        if run_options is not None:
            if self._adapters is None:
                self._adapters = AdapterProbe(self._overridable)
            overrides.update(self._adapters.values(run_options))
        for name in names & input_feed.keys():
            overrides[name] = _array(input_feed[name], name)
        return self._feeds({k: v for k, v in input_feed.items() if k not in names}), overrides

    def _runner(self, feeds: Mapping[str, Any], overrides: Mapping[str, np.ndarray]) -> Runtime | _OrtPart:
        """What runs this request: the session's runtime (for a model cut at its first run, started
        now at ``feeds``' shapes: concurrent first runs wait for one cut, and a cut that fails
        leaves the session as it was, for the next run to try at its own shapes), or with
        initializers overridden, the runtime of that variant of the model (cut once, kept for the
        next runs that give the same values; the :data:`MAX_VARIANTS` last used are kept)."""
        if not overrides and self._runtime is not None:
            return self._runtime
        with self._start_lock:
            if self._closed:
                raise EngineClosed("the session is closed; no new requests are accepted")
            if not overrides:
                if self._runtime is None:
                    assert self._loaded is not None and self._cut_model is not None  # a model cut at its first run
                    try:
                        plan = self._cut_model(self._loaded[0], self._loaded[2], feeds)
                        self._runtime = self._start(plan)
                    except BaseException:
                        self._held.remove_scratch()  # a private plan (read-only home) made before the failure
                        raise
                    self._plan = plan
                return self._runtime
            key = values_digest(overrides)
            runner = self._variants.pop(key, None)
            if runner is None:
                assert self._loaded is not None and self._cut_model is not None
                variant = load_model(self._loaded[1], supplied=overrides)
                log.info("initializers %s overridden: running a variant of the model", sorted(overrides))
                runner = self._start(self._cut_model(variant.model, variant.sha256, feeds))
            self._variants[key] = runner  # the most recently used last
            while len(self._variants) > MAX_VARIANTS:
                self._held.stop(self._variants.pop(next(iter(self._variants))))
        return runner

    def run(self, output_names: _Names, input_feed: _Feeds, run_options: _RunOptions = None) -> list[np.ndarray]:
        """Outputs in the order asked (all, in the model's order, for None or []), as ORT
        returns them. Of ``run_options``, what changes the answer is honoured: an active LoRA
        adapter (a variant of the model with its parameters) and ``terminate``; its log and
        memory settings are ORT's own sessions' (the workers')."""
        names = self._outputs(output_names)
        feeds, overrides = self._split(input_feed, run_options)
        try:
            values = self._runner(feeds, overrides).run(feeds)
        except TaskError as exc:
            raise _ort_task_error(exc) from exc.__cause__
        return [values[n] for n in names]

    def run_async(self, output_names: _Names, input_feed: _Feeds | None = None,
                  callback: Callable[[list[np.ndarray], Any, str], None] | None = None, user_data: Any = None,
                  run_options: _RunOptions = None) -> None:
        """ORT's form: ``callback(results, user_data, err)`` from a worker thread once the
        outputs are ready (``err`` is '' on success; on failure results are [] and ``err`` the
        message). A missing input raises here, as in ORT; a first run's failed cut is reported
        through the callback. For a future, use :meth:`submit`."""
        if callback is None or input_feed is None:
            raise TypeError("run_async(output_names, input_feed, callback, user_data) is ONNX "
                            "Runtime's callback form; for a future of the outputs use submit(input_feed)")
        try:
            names = self._outputs(output_names)
            feeds, overrides = self._split(input_feed, run_options)
        except InvalidArgument as exc:  # ORT reports these through the callback
            _call_back(callback, [], user_data, str(exc))
            return
        try:
            runtime = self._runner(feeds, overrides)
        except EngineClosed:
            raise
        except Exception as exc:  # noqa: BLE001 - a first run's cut failed: reported as its run's error
            _call_back(callback, [], user_data, str(exc))
            return
        future = runtime.submit(feeds)

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            results = [] if exc is not None else [f.result()[n] for n in names]
            _call_back(callback, results, user_data, "" if exc is None else str(exc))

        future.add_done_callback(done)

    def submit(self, input_feed: Mapping[str, Any]) -> RequestFuture:
        """A future (concurrent.futures, awaitable) of the outputs dict: staronnx's own
        asynchronous form, for pipelining many requests without callbacks."""
        feeds, overrides = self._split(input_feed, None)
        return self._runner(feeds, overrides).submit(feeds)

    def run_with_ort_values(self, output_names: _Names, input_dict_ort_values: Mapping[str, ort.OrtValue],
                            run_options: _RunOptions = None) -> list[ort.OrtValue]:
        """Host OrtValues in (ORT's or its C ones: :meth:`_sess`), host OrtValues out."""
        feeds = {k: _host_array(v, k) for k, v in input_dict_ort_values.items()}
        return [_owned(a) for a in self.run(output_names, feeds, run_options)]

    def io_binding(self) -> IOBinding:
        return IOBinding(self)

    def run_with_iobinding(self, iobinding: IOBinding, run_options: _RunOptions = None) -> None:
        if not isinstance(iobinding, IOBinding):
            raise TypeError("run_with_iobinding takes the IOBinding this session's io_binding() made")
        iobinding._run()

    def __getattr__(self, name: str) -> Any:
        """ORT methods that have no meaning over staronnx's workers: one line saying so and
        what to use, instead of an AttributeError that reads like a typo."""
        why = _REFUSED.get(name)
        if why is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        def refused(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"staronnx.InferenceSession.{name}: {why}")

        return refused

    @property
    def runtime(self) -> Runtime | _OrtPart:
        if self._runtime is None:
            if self._plan is None and not self._closed:
                raise RuntimeError("this session's workers start at its first run, which cuts the model at its "
                                   "shapes; pass input_shapes=[...] to InferenceSession to start them when it opens")
            raise RuntimeError("this InferenceSession failed to start")
        return self._runtime

    def close(self) -> None:
        """Stop the workers. A plan kept under ``$STARONNX_HOME`` stays for the next session;
        one made in a temporary folder (read-only home) is removed."""
        with self._start_lock:  # a first run's cut in progress finishes first; none starts after
            self._closed = True
            self._variants.clear()
        self._finalizer()  # stops every runner, once

    def __enter__(self) -> "InferenceSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# the constructor's signature is __init__'s, ORT's (__new__ only hands staronnx's own calls to ORT)
InferenceSession.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    list(inspect.signature(InferenceSession.__init__).parameters.values())[1:])


def _call_back(callback: Callable[..., None], results: list[np.ndarray], user_data: Any, err: str) -> None:
    """A user's callback runs on a worker's thread: what it raises is logged, not allowed to
    take the worker down."""
    try:
        callback(results, user_data, err)
    except Exception:  # noqa: BLE001
        log.exception("run_async callback raised")
