"""A Triton model configuration (``config.pbtxt``) read into what ``staronnx serve`` does with it.

The file is parsed with protobuf's text format against the ``model_config.proto`` in the tree
(:mod:`staronnx.serve.proto.model_config_pb2`), so a misspelt field or a wrong type is one error
naming the file and line. A missing or partial config is completed from the ONNX model, as
Triton's auto-complete does: the inputs and outputs (names, types, dims) from the graph, and,
where the config does not write ``max_batch_size``, that from the model's batching contract
(:mod:`staronnx.contract`): the batch size staronnx serves with (``--batch-size``) where every
tensor carries the batch on axis 0, else 0.

Every field is either honoured or refused by name (:func:`check_honoured`): a config is never
served as if a field meant something it does not here. What is honoured, and what it sets:

* ``name`` (must be the folder's), ``platform: "onnxruntime_onnx"`` / ``backend: "onnxruntime"``
  (any other is refused, and that model alone is unavailable), ``default_model_filename``;
* ``max_batch_size`` > 0: requests are batched along axis 0 up to that size (the model's tensors
  must all carry the batch there); 0: each request runs alone (Triton's non-batching model);
* ``input``/``output``: ``name``, ``data_type``, ``dims`` (-1 for a dynamic size; without the batch
  dimension when ``max_batch_size`` > 0), an input's ``format``, an output's ``label_filename``:
  each checked against the ONNX model, a mismatch refused; ``reshape`` (the model's shape where
  the client's ``dims`` differ: a request's tensor is reshaped to it, an answer's back to ``dims``);
* ``dynamic_batching``: ``max_queue_delay_microseconds`` (how long a partial batch waits);
  ``preferred_batch_size`` (the sizes a partial batch is padded up to, as staronnx pads to its
  captured CUDA graphs' sizes: the extra rows are dropped again, so answers are unchanged);
  ``preserve_ordering`` (each answer leaves after the answer to the request before it);
  ``priority_levels`` and ``default_priority_level`` (a batch takes the waiting requests of level
  1, the highest, first, then level 2's, ...; arrival order within a level; a request's
  ``priority`` parameter names its level, 0 or none the default one, one out of range is
  refused by name, as is any priority sent to a model without levels);
  ``default_queue_policy`` and ``priority_queue_policy`` (per level; a level without its own gets
  the default one, :mod:`staronnx.serving.priority`): ``max_queue_size`` (requests of that level
  waiting at once, a request beyond it refused, 503 / UNAVAILABLE, naming the level; without
  levels, the queue's capacity; 0: the server's ``--queue-capacity``, which also bounds the
  levels together unless each has a size), ``default_timeout_microseconds`` with
  ``timeout_action`` REJECT (a request still waiting for its batch after that long is refused,
  503 / UNAVAILABLE) or DELAY (it is moved behind the requests of its level still within their
  timeouts, ahead of the lower levels: it runs, later), and ``allow_timeout_override`` (a
  request's ``timeout`` parameter, in microseconds, as tritonclient's ``infer(timeout=...)``
  sends it, shortens its timeout, never lengthens it; where the default is 0, no limit, any
  timeout a request gives applies, where Triton's own scheduler ignores it). A request that
  gives a timeout where its level does not allow it is refused by name;
* ``version_policy`` (latest N, all, specific): every version selected is served, the latest
  when a request names none;
* ``instance_group`` (:mod:`staronnx.serve.instances`): an instance is one of the server's
  workers holding the model, shared with the other models it holds. ``KIND_GPU``: ``count`` CUDA
  streams on each GPU of ``gpus`` (every GPU the server drives when it lists none; all their
  streams when it gives no count); ``KIND_CPU``: ``count`` CPU groups (all of them without a count);
  ``KIND_AUTO``: every worker, or with a count as ``KIND_GPU`` on a server with CUDA streams and
  ``KIND_CPU`` on one without; several groups add up. More instances than the server has
  streams per GPU (``--cuda-streams``) or CPU groups (``--groups``), a GPU it does not drive
  (``--cuda-devices``), ``gpus`` on a CPU group and ``KIND_MODEL`` are refused, naming the flag
  that gives them. A model loaded after the start (explicit model control) on some workers only
  is refused (list it in ``--load-model``), as is any such model with ``--separate-runtimes``;
* ``optimization { cuda { graphs } }``: must agree with the server's CUDA graphs (``--cuda-streams``
  and ``--cuda-graphs``, which every model of its shared runtime has or not);
* ``model_warmup`` (``zero_data`` or ``random_data`` inputs): run ``count`` times at load, before
  the model is ready; a warm-up that fails fails the load, with its reason. A stateful model's
  sample gives its client inputs only: the server fills the control inputs and the initial
  states, each row a sequence of one request (a sample that names one of them is refused);
* ``parameters``: staronnx's own settings (:data:`PARAMETERS`);
* ``sequence_batching`` (a stateful model): control inputs, implicit state, the ``direct`` and
  ``oldest`` strategies, the idle time, each checked against the model (the guide "Serve a
  stateful model" and :mod:`staronnx.serve.sequences` say what is honoured and how); a
  strategy's queue delay, preferred batch sizes and ordering set the batcher as
  ``dynamic_batching``'s do.
* ``platform: "ensemble"`` with ``ensemble_scheduling``: the steps' members composed into one
  task graph (:mod:`staronnx.serve.ensemble`, the guide *Serve a pipeline*).

Refused (for now, with the flag that does it where there is one): shape tensors, ragged
batches, optional inputs, an instance group's ``profile``, ``passive``, ``host_policy``,
``secondary_devices`` and ``rate_limiter``, the other optimization settings, warm-up data from
files, and every other field.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from google.protobuf import json_format, text_format

from staronnx.errors import StaronnxError
from staronnx.serve import protocol
from staronnx.serve.instances import InstanceGroup
from staronnx.serve.proto import model_config_pb2 as mc
from staronnx.serving.priority import MAX_LEVELS, LevelPolicy, QueuePolicy

if TYPE_CHECKING:  # sequences reads configs; the policy it makes is set on the settings here
    from staronnx.serve.sequences import SequencePolicy

CONFIG_FILE = "config.pbtxt"
#: Triton's idle time where the config gives none (its SEQUENCE_IDLE_DEFAULT_MICROSECONDS)
DEFAULT_IDLE_US = 1_000_000
DEFAULT_MODEL_FILENAME = "model.onnx"

#: the platform and backend names that mean ONNX Runtime (empty: the model file tells)
ONNX_PLATFORMS = ("", "onnxruntime_onnx")
ONNX_BACKENDS = ("", "onnxruntime")

#: staronnx's own settings in ``parameters`` (Triton's string values), and what each does
PARAMETERS = {
    "parts": "parts the model is cut into (1: served whole; the default)",
    "shares": "target cost share per part, e.g. 0.85,0.15 (instead of parts)",
    "partition_method": "metis or linear (how the parts are cut)",
    "input_shapes": "NAME=D1xD2x... sizes of dynamic dimensions for the partitioner's cost estimate",
    "slo_ms": "the model's latency target in ms (as --slo-ms)",
    "priority": "the model's priority on the shared workers (as --priority)",
}

#: the fields honoured at each level (anything else that is set is refused by name)
_HONOURED = {
    "ModelConfig": {"name", "platform", "backend", "max_batch_size", "input", "output", "dynamic_batching",
                    "version_policy", "parameters", "default_model_filename", "instance_group", "optimization",
                    "model_warmup", "sequence_batching"},
    "ModelOptimizationPolicy": {"cuda"},
    "Cuda": {"graphs"},
    "ModelWarmup": {"name", "batch_size", "inputs", "count"},
    "Input": {"data_type", "dims", "zero_data", "random_data"},
    "ModelInput": {"name", "data_type", "dims", "format", "reshape"},
    "ModelOutput": {"name", "data_type", "dims", "label_filename", "reshape"},
    "ModelTensorReshape": {"shape"},
    "ModelDynamicBatching": {"max_queue_delay_microseconds", "default_queue_policy", "preferred_batch_size",
                             "preserve_ordering", "priority_levels", "default_priority_level",
                             "priority_queue_policy"},
    "ModelQueuePolicy": {"max_queue_size", "default_timeout_microseconds", "timeout_action",
                         "allow_timeout_override"},
    "ModelInstanceGroup": {"name", "kind", "count", "gpus"},
    "ModelVersionPolicy": {"latest", "all", "specific"},
    # sequence_batching: checked against the model by staronnx.serve.sequences.policy_of
    "ModelSequenceBatching": {"max_sequence_idle_microseconds", "control_input", "state", "direct", "oldest",
                              "iterative_sequence"},
    "ControlInput": {"name", "control"},
    "Control": {"kind", "int32_false_true", "fp32_false_true", "bool_false_true", "data_type"},
    "State": {"input_name", "output_name", "data_type", "dims", "initial_state", "use_same_buffer_for_input_output",
              "use_growable_memory"},
    "InitialState": {"data_type", "dims", "zero_data", "data_file", "name"},
    "StrategyDirect": {"max_queue_delay_microseconds", "minimum_slot_utilization"},
    "StrategyOldest": {"max_candidate_sequences", "preferred_batch_size", "max_queue_delay_microseconds",
                       "preserve_ordering"},
}

#: what to do instead, for the refused fields a user is likeliest to write
_INSTEAD = {
    "ensemble_scheduling": 'an ensemble is served with platform: "ensemble"',
    "graph": "ONNX Runtime's graph optimization level is its own",
    "input_data_file": "give zero_data or random_data",
}


class ConfigError(StaronnxError):
    """A config that cannot be served as written: the message names the model and the field."""


@dataclass(frozen=True)
class TensorSpec:
    """An input or output as the ONNX model declares it: its config type and full dims (-1: dynamic)."""

    name: str
    data_type: str
    dims: tuple[int, ...]


@dataclass
class ModelSettings:
    """What a model's config asks of staronnx: the batcher's settings, the plan's, the target."""

    #: largest batch; 0: each request runs alone
    max_batch_size: int
    #: seconds a partial batch waits (None: the server's --max-delay)
    max_delay: float | None = None
    #: requests waiting (None: the server's --queue-capacity)
    queue_capacity: int | None = None
    #: how the plan is cut (the settings that shape it: part of its cache key)
    plan: dict[str, Any] = field(default_factory=dict)
    #: service target fields (``latency_ms``, ``priority``)
    target: dict[str, Any] = field(default_factory=dict)
    #: output name -> label file (relative to the model's folder)
    labels: dict[str, str] = field(default_factory=dict)
    #: batch sizes a partial batch is padded up to (dynamic_batching.preferred_batch_size)
    pad_to: tuple[int, ...] | None = None
    #: dynamic_batching.preserve_ordering: answers leave in the order the requests came
    preserve_ordering: bool = False
    #: priority levels and each level's queue policy (None: one queue, no timeout)
    queue_policy: QueuePolicy | None = None
    #: the instance groups, as the server's workers are to hold the model (:mod:`staronnx.serve.instances`)
    instances: tuple[InstanceGroup, ...] = ()
    #: optimization.cuda.graphs where the config says (None: it does not)
    cuda_graphs: bool | None = None
    #: tensor name -> (the client's dims, the model's), without the batch: the config's reshapes
    reshapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    #: sequence_batching checked against the model, set where the model is loaded; None: not a
    #: stateful model
    sequence: SequencePolicy | None = None


def read_config(folder: Path) -> tuple[mc.ModelConfig, bool]:
    """``folder/config.pbtxt`` parsed (an empty config where there is none), and whether it
    writes ``max_batch_size`` (protobuf cannot tell a written 0 from an absent field, and
    ``max_batch_size: 0`` means a model that does not batch, while no value means "from the model")."""
    path = folder / CONFIG_FILE
    config = mc.ModelConfig()
    if not path.is_file():
        return config, False
    try:
        text = path.read_text(encoding="utf-8")
        text_format.Parse(text, config)
    except (text_format.ParseError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    # the field's name as a token of the text (not in a comment or a string), wherever it stands:
    # a config may write it after another field on one line
    tokens = text_format.Tokenizer(text.splitlines())
    written = False
    while not (written or tokens.AtEnd()):
        written = tokens.token == "max_batch_size"
        tokens.NextToken()
    return config, written


def parse_override(text: str) -> tuple[mc.ModelConfig, bool]:
    """A load request's config (Triton's JSON form of the config), and whether it writes
    ``max_batch_size``; a document that does not parse is refused saying why."""
    import json

    config = mc.ModelConfig()
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("the config must be a JSON object")
        json_format.ParseDict(doc, config)
    except (ValueError, json_format.ParseError) as exc:
        raise ConfigError(f"the config of the load request is not a model config in JSON: {exc}") from None
    return config, "max_batch_size" in doc or "maxBatchSize" in doc  # both names parse (protobuf's JSON)


def as_dict(config: mc.ModelConfig) -> dict[str, Any]:
    """The config as Triton's JSON form (what ``get_model_config`` answers over HTTP), dims and
    versions as numbers (protobuf's JSON writes 64-bit integers as strings)."""
    doc: dict[str, Any] = json_format.MessageToDict(config, preserving_proto_field_name=True)
    sb = doc.get("sequence_batching")
    if sb is not None:  # 64-bit integers as numbers, as elsewhere
        if "max_sequence_idle_microseconds" in sb:
            sb["max_sequence_idle_microseconds"] = int(sb["max_sequence_idle_microseconds"])
        for strategy in ("direct", "oldest"):
            if "max_queue_delay_microseconds" in sb.get(strategy, {}):
                sb[strategy]["max_queue_delay_microseconds"] = int(sb[strategy]["max_queue_delay_microseconds"])
        for state in sb.get("state", []):
            state["dims"] = [int(d) for d in state.get("dims", [])]
            for init in state.get("initial_state", []):
                init["dims"] = [int(d) for d in init.get("dims", [])]
    for tensor in (*doc.get("input", []), *doc.get("output", [])):
        tensor["dims"] = [int(d) for d in tensor.get("dims", [])]
        if "reshape" in tensor:
            tensor["reshape"]["shape"] = [int(d) for d in tensor["reshape"].get("shape", [])]
    specific = doc.get("version_policy", {}).get("specific")
    if specific is not None:
        specific["versions"] = [int(v) for v in specific.get("versions", [])]
    _numbers(config, doc)
    return doc


def _numbers(message: Any, doc: dict[str, Any]) -> None:
    """Every 64-bit integer of ``doc`` (``message`` in JSON) as a number, in place, as Triton's
    JSON writes them (dynamic_batching's priority levels and queue timeouts, a step's
    model_version...): protobuf's JSON writes them as strings."""
    from google.protobuf.descriptor import FieldDescriptor as F

    for f in message.DESCRIPTOR.fields:
        if f.name not in doc:
            continue
        value = getattr(message, f.name)
        if f.cpp_type in (F.CPPTYPE_INT64, F.CPPTYPE_UINT64):
            doc[f.name] = [int(v) for v in doc[f.name]] if f.is_repeated else int(doc[f.name])
        elif f.message_type is not None and f.message_type.GetOptions().map_entry:
            if f.message_type.fields_by_name["value"].message_type is not None:
                for key, item in value.items():
                    _numbers(item, doc[f.name][str(key)])
        elif f.message_type is not None:
            for item, item_doc in (zip(value, doc[f.name]) if f.is_repeated else [(value, doc[f.name])]):
                _numbers(item, item_doc)


def check_honoured(config: mc.ModelConfig) -> None:
    """Refuse, by its path in the config, the first field set that staronnx does not honour."""
    for path, message, fields in _walk(config, ""):
        kind = message.DESCRIPTOR.name
        honoured = _HONOURED.get(kind)
        if honoured is None:
            continue
        for f, _ in fields:
            if f.name not in honoured:
                where = f"{path}.{f.name}" if path else f.name
                instead = _INSTEAD.get(f.name)
                raise ConfigError(f"config field {where} is not honoured by staronnx serve"
                                  + (f" ({instead})" if instead else "") + "; remove it to serve this model")
    unknown = sorted(set(config.parameters) - set(PARAMETERS))
    if unknown:
        raise ConfigError(f"config parameters {', '.join(map(repr, unknown))} are not staronnx settings; "
                          f"those are: {', '.join(f'{k} ({v})' for k, v in PARAMETERS.items())}")


def _walk(message: Any, path: str) -> Iterable[tuple[str, Any, list[tuple[Any, Any]]]]:
    """``message`` and each sub-message of a kind with honoured fields, with their set fields and
    their path in the config (``dynamic_batching.default_queue_policy``, ``input[1]``)."""
    fields = message.ListFields()
    yield path, message, fields
    if message.DESCRIPTOR.name not in _HONOURED:
        return
    for f, value in fields:
        if f.message_type is None:
            continue
        where = f"{path}.{f.name}" if path else f.name
        if f.message_type.GetOptions().map_entry:
            if f.message_type.fields_by_name["value"].message_type is not None:
                for key, item in value.items():
                    yield from _walk(item, f"{where}[{key!r}]")
            continue
        if f.is_repeated:
            for i, item in enumerate(value):
                yield from _walk(item, f"{where}[{i}]")
        else:
            yield from _walk(value, where)


def onnx_signature(model_path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The ONNX model's graph inputs (not initializers) and outputs as config tensors."""
    import onnx
    from google.protobuf.message import DecodeError

    try:  # a file that does not parse fails its model alone (the others serve), naming the file
        model = onnx.load(str(model_path), load_external_data=False)
    except (DecodeError, OSError) as exc:
        raise ConfigError(f"{model_path.parent.name}/{model_path.name} is not an ONNX model that can be read: "
                          f"{exc}") from None
    initializers = {t.name for t in model.graph.initializer}

    def specs(values: Sequence[Any]) -> list[TensorSpec]:
        out = []
        for v in values:
            if v.name in initializers:
                continue
            tt = v.type.tensor_type
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type) if tt.elem_type else np.dtype(object)
            try:
                datatype = protocol.datatype_of(dtype)
            except StaronnxError as exc:
                raise ConfigError(f"tensor {v.name!r}: {exc}") from None
            dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
            out.append(TensorSpec(v.name, protocol.config_type(datatype), dims))
        return out

    return specs(model.graph.input), specs(model.graph.output)


def hidden_tensors(config: mc.ModelConfig) -> tuple[set[str], set[str]]:
    """The inputs and outputs a config's ``sequence_batching`` keeps from clients (control and
    state inputs; state outputs its ``output`` does not list): config completion leaves them
    out of the served config."""
    if not config.HasField("sequence_batching"):
        return set(), set()
    sb = config.sequence_batching
    listed = {t.name for t in config.output}
    inputs = {c.name for c in sb.control_input} | {s.input_name for s in sb.state}
    return inputs, {s.output_name for s in sb.state if s.output_name not in listed}


def complete_sequence_batching(config: mc.ModelConfig) -> None:
    """Fill, in place, what Triton's config normalisation fills in a ``sequence_batching``
    section: the idle time, and the ``direct`` strategy where none is named."""
    if not config.HasField("sequence_batching"):
        return
    sb = config.sequence_batching
    if not sb.max_sequence_idle_microseconds:
        sb.max_sequence_idle_microseconds = DEFAULT_IDLE_US
    if sb.WhichOneof("strategy_choice") is None:
        sb.direct.SetInParent()


def complete(config: mc.ModelConfig, name: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
             batch_size: int, batches_on_axis0: bool, batch_written: bool = True) -> mc.ModelConfig:
    """``config`` with what it leaves out filled from the model, and what it says checked against
    it (a copy; the caller's is left as it is). ``batch_size``: the server's --batch-size;
    ``batches_on_axis0``: whether the model's contract batches every tensor on axis 0;
    ``batch_written``: whether the config writes max_batch_size (else it comes from the model)."""
    out = mc.ModelConfig()
    out.CopyFrom(config)
    if out.name and out.name != name:
        raise ConfigError(f"config name {out.name!r} differs from its folder's name {name!r}")
    out.name = name
    if not batch_written and out.max_batch_size == 0 and batches_on_axis0:
        out.max_batch_size = batch_size  # Triton's auto-complete: a model that batches gets a batch size
    mbs = out.max_batch_size
    if mbs < 0:
        raise ConfigError(f"max_batch_size must be 0 or more, got {mbs}")
    if mbs > 0 and not batches_on_axis0:
        raise ConfigError(f"max_batch_size {mbs} says every tensor carries the batch on axis 0, but this model's "
                          "do not (see `staronnx plan show`); set max_batch_size: 0")

    def served_dims(t: TensorSpec) -> list[int]:
        return list(t.dims[1:]) if mbs > 0 else list(t.dims)

    complete_sequence_batching(out)
    hidden = hidden_tensors(out)  # filled or kept by the server: not the clients' tensors
    for kind, declared, actual, server_side in (("input", out.input, inputs, hidden[0]),
                                                ("output", out.output, outputs, hidden[1])):
        by_name = {t.name: t for t in actual}
        given = {t.name for t in declared}
        for t in declared:
            model_t = by_name.get(t.name)
            if model_t is None:
                raise ConfigError(f"{kind} {t.name!r} of the config is not one of the model's ({', '.join(by_name)})")
            if t.data_type != mc.TYPE_INVALID and mc.DataType.Name(t.data_type) != model_t.data_type:
                raise ConfigError(f"{kind} {t.name!r}: the config says {mc.DataType.Name(t.data_type)}, the model "
                                  f"{model_t.data_type}")
            t.data_type = mc.DataType.Value(model_t.data_type)
            want = served_dims(model_t)
            if t.HasField("reshape"):  # the model's shape is the reshape; the client's, dims
                if not protocol.dims_fit(list(t.reshape.shape), want):
                    raise ConfigError(f"{kind} {t.name!r}: the config's reshape {list(t.reshape.shape)} does not fit "
                                      f"the model's {want}")
                sizes = [int(np.prod(d)) for d in (t.dims, t.reshape.shape) if all(x > 0 for x in d)]
                if not t.dims or (len(sizes) == 2 and sizes[0] != sizes[1]):
                    raise ConfigError(f"{kind} {t.name!r}: dims {list(t.dims)} and reshape {list(t.reshape.shape)} "
                                      "must hold as many values")
                continue
            if t.dims and not protocol.dims_fit(list(t.dims), want):
                raise ConfigError(f"{kind} {t.name!r}: the config's dims {list(t.dims)} do not fit the model's "
                                  f"{want}" + (" (without the batch dimension, as max_batch_size > 0)" if mbs else ""))
            if not t.dims:
                t.dims.extend(want)
        for t in actual:  # the ones the config leaves out
            if t.name not in given and t.name not in server_side:
                entry = declared.add()
                entry.name, entry.data_type = t.name, mc.DataType.Value(t.data_type)
                entry.dims.extend(served_dims(t))
    return out


def settings(config: mc.ModelConfig) -> ModelSettings:
    """What an (honoured, completed) config asks of the batcher, the plan and the target."""
    out = ModelSettings(max_batch_size=config.max_batch_size)
    if config.HasField("sequence_batching"):  # its strategy's batching settings, as dynamic_batching's
        sb = config.sequence_batching
        strategy = sb.oldest if sb.HasField("oldest") else sb.direct
        out.max_delay = strategy.max_queue_delay_microseconds / 1e6
        if sb.HasField("oldest"):
            out.preserve_ordering = sb.oldest.preserve_ordering
            out.pad_to = _pad_to(sb.oldest.preferred_batch_size, "sequence_batching.oldest", config.max_batch_size)
    elif config.HasField("dynamic_batching"):  # one or the other (a oneof)
        db = config.dynamic_batching
        out.max_delay = db.max_queue_delay_microseconds / 1e6
        out.preserve_ordering = db.preserve_ordering
        out.queue_policy = queue_policy(db)
        out.pad_to = _pad_to(db.preferred_batch_size, "dynamic_batching", config.max_batch_size)
        if out.queue_policy is not None and out.queue_policy.priority_levels:
            caps = [level.capacity for level in out.queue_policy.levels]
            if all(caps):  # every level bounded: the queue holds them all (else --queue-capacity bounds it)
                out.queue_capacity = sum(c for c in caps if c)
        elif db.default_queue_policy.max_queue_size > 0:
            out.queue_capacity = int(db.default_queue_policy.max_queue_size)
    params = {k: v.string_value.strip() for k, v in config.parameters.items()}
    if "parts" in params and "shares" in params:
        raise ConfigError("parameters 'parts' and 'shares' both given; give one")
    try:
        if "parts" in params:
            out.plan["parts"] = int(params["parts"])
            if out.plan["parts"] < 1:
                raise ValueError(params["parts"])
        if "shares" in params:
            out.plan["shares"] = [float(s) for s in params["shares"].split(",")]
        if "slo_ms" in params:
            out.target["latency_ms"] = float(params["slo_ms"])
            if not (out.target["latency_ms"] > 0 and np.isfinite(out.target["latency_ms"])):
                # refused here, by name: the runtime's own check stopped the whole server, in seconds
                raise ConfigError(f"parameter slo_ms must be a positive number of milliseconds, got "
                                  f"{params['slo_ms']!r}")
        if "priority" in params:
            out.target["priority"] = int(params["priority"])
    except ValueError as exc:
        raise ConfigError(f"a parameter's value does not read as a number: {exc}") from None
    if "partition_method" in params:
        out.plan["method"] = params["partition_method"]
    if "input_shapes" in params:
        out.plan["input_shapes"] = sorted(s.strip() for s in params["input_shapes"].split(";") if s.strip())
    out.labels = {o.name: o.label_filename for o in config.output if o.label_filename}
    out.reshapes = {t.name: (tuple(t.dims), tuple(t.reshape.shape))
                    for t in (*config.input, *config.output) if t.HasField("reshape")}
    if config.optimization.HasField("cuda"):
        out.cuda_graphs = config.optimization.cuda.graphs
    out.instances = instance_groups(config)
    return out


def _pad_to(sizes: Sequence[int], where: str, mbs: int) -> tuple[int, ...] | None:
    """``where``'s preferred_batch_size: the sizes a partial batch is padded up to (None: none given)."""
    if not sizes:
        return None
    out = sorted(set(sizes))
    if out[0] < 1 or out[-1] > max(mbs, 1):
        raise ConfigError(f"{where}.preferred_batch_size {out} must lie between 1 and max_batch_size ({mbs})")
    return tuple(out)


def queue_policy(db: mc.ModelDynamicBatching) -> QueuePolicy | None:
    """The priority levels and queue policies of ``dynamic_batching`` (Triton's: level 1 the
    highest, ``priority_queue_policy`` per level over ``default_queue_policy``), or None where
    it asks for nothing past one queue without timeouts."""
    levels, default = int(db.priority_levels), int(db.default_priority_level)
    if levels > MAX_LEVELS:
        raise ConfigError(f"dynamic_batching.priority_levels {levels}: staronnx serve takes up to {MAX_LEVELS} levels")
    if levels == 0:
        if default or db.priority_queue_policy:
            field_name = "default_priority_level" if default else "priority_queue_policy"
            raise ConfigError(f"dynamic_batching.{field_name} is given without priority_levels; set priority_levels "
                              "(the number of levels, 1 the highest) or remove it")
    else:
        if not 1 <= default <= levels:
            raise ConfigError(f"dynamic_batching.default_priority_level {default} must lie between 1 and "
                              f"priority_levels ({levels}): the level of a request that names none")
        stray = sorted(k for k in db.priority_queue_policy if not 1 <= k <= levels)
        if stray:
            raise ConfigError(f"dynamic_batching.priority_queue_policy names level(s) {stray} outside 1 to "
                              f"priority_levels ({levels})")
    fallback = _level_policy(db.default_queue_policy)
    per_level = tuple(_level_policy(db.priority_queue_policy[k]) if k in db.priority_queue_policy else fallback
                      for k in range(1, max(levels, 1) + 1))
    policy = QueuePolicy(per_level, default_level=default or 1, priority_levels=levels)
    plain = levels == 0 and not (fallback.timeout or fallback.delay or fallback.allow_override)
    return None if plain else policy


def _level_policy(policy: mc.ModelQueuePolicy) -> LevelPolicy:
    """One ``ModelQueuePolicy`` as the batcher reads it (0: no limit, no timeout)."""
    return LevelPolicy(capacity=int(policy.max_queue_size) or None,
                       timeout=policy.default_timeout_microseconds / 1e6 or None,
                       delay=policy.timeout_action == mc.ModelQueuePolicy.DELAY,
                       allow_override=policy.allow_timeout_override)


def instance_groups(config: mc.ModelConfig) -> tuple[InstanceGroup, ...]:
    """The config's ``instance_group`` entries as values (``KIND_MODEL`` refused: staronnx has
    no backend that places its own instances)."""
    out = []
    for i, group in enumerate(config.instance_group):
        where = f"instance_group[{i}]" + (f" {group.name!r}" if group.name else "")
        if group.kind == mc.ModelInstanceGroup.KIND_MODEL:
            raise ConfigError(f"{where}: KIND_MODEL is not honoured by staronnx serve (its workers are CPU groups and "
                              "CUDA streams): give KIND_CPU, KIND_GPU or KIND_AUTO")
        if group.count < 0:
            raise ConfigError(f"{where}: count must be 1 or more, got {group.count}")
        kind = {mc.ModelInstanceGroup.KIND_CPU: "cpu", mc.ModelInstanceGroup.KIND_GPU: "gpu"}.get(group.kind, "auto")
        out.append(InstanceGroup(where, kind, int(group.count) or None, tuple(int(g) for g in group.gpus)))
    return tuple(out)


class WarmupSample(NamedTuple):
    """One ``model_warmup`` sample ready to run: its name in messages, its runs, its feeds."""

    what: str
    runs: int
    feeds: dict[str, np.ndarray]


def warmup_feeds(config: mc.ModelConfig, seed: int = 0,
                 filled: frozenset[str] = frozenset()) -> list[WarmupSample]:
    """Each ``model_warmup`` sample of a completed config as (name, count, feeds): every input of
    the model, of its declared type, ``dims`` (after the sample's ``batch_size`` where the model
    batches), zeros or random values; a sample that does not fit the model is refused, as is one
    that gives an input of ``filled`` (a stateful model's control inputs and states, which the
    server fills: :meth:`~staronnx.serve.sequences.SequencePolicy.warmup_feeds`)."""
    rng = np.random.default_rng(seed)
    declared = {t.name: t for t in config.input}
    out = []
    for i, sample in enumerate(config.model_warmup):
        what = f"model_warmup[{i}]" + (f" {sample.name!r}" if sample.name else "")
        given_filled = sorted(filled & set(sample.inputs))
        if given_filled:
            raise ConfigError(f"{what}: input(s) {', '.join(map(repr, given_filled))} are filled by the server from "
                              "the sequence (control inputs and implicit state); give the model's other inputs only")
        missing = sorted(set(declared) - set(sample.inputs))
        unknown = sorted(set(sample.inputs) - set(declared))
        if missing or unknown:
            raise ConfigError(f"{what}: its inputs must be the model's ({', '.join(declared)}); "
                              + ("missing " + ", ".join(missing) if missing else "unknown " + ", ".join(unknown)))
        if config.max_batch_size > 0 and not 1 <= sample.batch_size <= config.max_batch_size:
            raise ConfigError(f"{what}: batch_size {sample.batch_size} must lie between 1 and max_batch_size "
                              f"({config.max_batch_size})")
        feeds = {}
        for name, given in sample.inputs.items():
            if given.data_type != declared[name].data_type:
                raise ConfigError(f"{what}: input {name!r} is {mc.DataType.Name(given.data_type)}, the model's "
                                  f"{mc.DataType.Name(declared[name].data_type)}")
            dims = [sample.batch_size, *given.dims] if config.max_batch_size > 0 else list(given.dims)
            if any(d < 0 for d in dims):
                raise ConfigError(f"{what}: input {name!r} needs sizes for every dimension, got {list(given.dims)}")
            type_name = mc.DataType.Name(given.data_type)[len("TYPE_"):]
            try:  # sizes past what numpy can make (ValueError) or this host can hold (MemoryError)
                if type_name == "STRING":
                    values = rng.integers(0, 10, size=dims) if given.random_data else np.zeros(dims, dtype=np.int64)
                    feeds[name] = values.astype(str).astype(object)
                else:
                    dtype = protocol.DATATYPES[type_name]
                    if given.random_data and dtype.kind == "f":
                        feeds[name] = (rng.random(dims) * 2 - 1).astype(dtype)
                    elif given.random_data:
                        feeds[name] = rng.integers(0, 2, size=dims).astype(dtype)
                    else:
                        feeds[name] = np.zeros(dims, dtype)
            except (ValueError, MemoryError) as exc:
                raise ConfigError(f"{what}: input {name!r} of dims {list(given.dims)} cannot be made: {exc}") from None
            if declared[name].HasField("reshape"):  # the sample is in the config's dims, as a client's request:
                shape = list(declared[name].reshape.shape)  # the runtime takes the model's (its reshape)
                try:
                    feeds[name] = feeds[name].reshape([sample.batch_size, *shape] if config.max_batch_size > 0
                                                      else shape)
                except ValueError:
                    raise ConfigError(f"{what}: input {name!r} of dims {list(given.dims)} cannot be reshaped to the "
                                      f"config's reshape {shape}") from None
        out.append(WarmupSample(what, max(1, sample.count), feeds))
    return out


def pick_versions(config: mc.ModelConfig, versions: Sequence[int], name: str) -> list[int]:
    """The versions ``version_policy`` selects among the folder's ``versions``, latest first
    (Triton's default: the latest only); a policy that selects none is refused."""
    if not versions:
        raise ConfigError(f"model {name!r} has no version folder (a number) holding its model file")
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which is None:
        return [max(versions)]
    if which == "latest":
        n = policy.latest.num_versions or 1
        chosen = sorted(versions)[-n:]
    elif which == "all":
        chosen = list(versions)
    else:
        chosen = sorted(set(policy.specific.versions) & set(versions))
        missing = sorted(set(policy.specific.versions) - set(versions))
        if missing:
            raise ConfigError(f"version_policy names version(s) {missing} that model {name!r} does not have "
                              f"(it has {sorted(versions)})")
    if not chosen:
        raise ConfigError(f"version_policy selects none of the versions of model {name!r} ({sorted(versions)})")
    return sorted(chosen, reverse=True)
