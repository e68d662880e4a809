"""ORT's SessionOptions and RunOptions: what a session honours, and what it says it does not.

Each part runs in a worker's own ORT session, sized to its CPU group: settings of ORT's thread
pools, allocators and logs are the workers' to choose, so a session given them warns
(:class:`OptionNotApplied`, each with why) instead of silently dropping them; settings that
change what runs are honoured, or refused with a NotImplementedError naming them. The table of
every option is in :mod:`staronnx.compat.session`'s docstring.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import onnx
import onnxruntime as ort

from staronnx.errors import ModelError
from staronnx.ortutil import option_values

#: the config entry that makes a session record which provider runs each node (ORT's)
RECORD_ASSIGNMENT = "session.record_ep_graph_assignment_info"


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


def reads_config(kwargs: Mapping[str, Any]) -> bool:
    """Whether ORT would read the model's embedded config: ``read_config_from_model=1``, or
    else ``$ORT_LOAD_CONFIG_FROM_MODEL`` == "1" (ORT's rule)."""
    if "read_config_from_model" in kwargs:
        return int(kwargs["read_config_from_model"]) == 1
    return os.environ.get("ORT_LOAD_CONFIG_FROM_MODEL") == "1"


def model_config(model: onnx.ModelProto) -> dict[str, Any]:
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


def with_config(so: ort.SessionOptions | None, config: Mapping[str, Any]) -> ort.SessionOptions | None:
    """The options a session runs with: ``so`` with the model's config over it, as ORT applies
    it (a copy: the caller's object is not changed, and its config entries are not carried)."""
    if not config:
        return so
    effective = ort.SessionOptions()
    for name, value in {**(option_values(so, _COPIED) if so is not None else {}), **config}.items():
        setattr(effective, name, value)
    return effective


type _Options = ort.SessionOptions | ort.RunOptions


def config_entry(so: _Options, key: str) -> str | None:
    get = so.get_run_config_entry if isinstance(so, ort.RunOptions) else so.get_session_config_entry
    try:
        return str(get(key))
    except RuntimeError:  # ORT's answer for a key never set
        return None


def refuse_options(so: ort.SessionOptions | None, path_or_bytes: Any) -> None:
    """Options staronnx cannot honour and that change what runs: a NotImplementedError naming
    each, before anything is done."""
    ort_file = isinstance(path_or_bytes, (str, os.PathLike)) and str(path_or_bytes).endswith(".ort")
    if ort_file or so is not None and config_entry(so, "session.load_model_format") == "ORT":
        raise NotImplementedError("session.load_model_format=ORT: staronnx cuts ONNX models; an ORT-format model "
                                  "cannot be partitioned (give the .onnx file it was converted from)")
    if so is not None and so.has_providers():
        raise NotImplementedError("SessionOptions.add_provider / add_provider_for_devices: staronnx starts its "
                                  "workers from InferenceSession(..., providers=[...]); name the providers there")


def not_applied(options: _Options, given: _Options) -> list[str]:
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
    values = {key: config_entry(given, key) for key in entries}
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
_DEFAULT_GRAPH = "each part's session optimises its graph with ORT's default transformers and kernels"
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
    # what ORT computes or accepts: the workers' sessions are made with ORT's defaults, so their
    # answers can differ from a session given these (said, never silently dropped)
    "optimization.enable_gelu_approximation": _DEFAULT_GRAPH,
    "optimization.disable_specified_optimizers": _DEFAULT_GRAPH,
    "optimization.enable_cast_chain_elimination": _DEFAULT_GRAPH,
    "optimization.constant_folding_max_output_size_in_bytes": _DEFAULT_GRAPH,
    "session.graph_optimizations_loop_level": _DEFAULT_GRAPH,
    "session.disable_quant_qdq": _DEFAULT_GRAPH,
    "session.enable_quant_qdq_cleanup": _DEFAULT_GRAPH,
    "session.disable_double_qdq_remover": _DEFAULT_GRAPH,
    "session.disable_qdq_constant_folding": _DEFAULT_GRAPH,
    "session.disable_aot_function_inlining": _DEFAULT_GRAPH,
    "session.qdqisint8allowed": _DEFAULT_GRAPH,
    "session.x64quantprecision": _DEFAULT_GRAPH,
    "session.strict_shape_type_inference": "each part's session loads with ORT's default checks",
    "session.allow_released_opsets_only": "each part's session loads with ORT's default checks",
}
#: RunOptions config entries that staronnx's workers do not apply, each with why
_RUN_ENTRIES = {
    "memory.enable_memory_arena_shrinkage": "each worker's session keeps its arena",
    "gpu_graph_id": "the CUDA workers choose their own graphs",
    "run.disable_synchronize_execution_providers": "the workers synchronise their own devices",
}
