"""Triton ensembles (``platform: "ensemble"``, ``ensemble_scheduling { step [...] }``) served as
one task graph.

Triton runs each step of an ensemble as a request of its own through its member's scheduler,
the tensors between steps through host memory, every member's instances competing for the
devices blind to each other. staronnx composes the members' plans into one plan
(:mod:`staronnx.partition.compose`): an ensemble request is one task graph of every member's
parts, placed together by the runtime's policy (a light member on one CPU group while the heavy
one runs on another, or on a GPU), each intermediate tensor staying on the memory node that
produced it (the data layer copies it only where the next part runs, a copy dmda/heft price
like any other), and the ensemble batches as a whole: its requests are batched by its own
batcher (up to its ``max_batch_size``, waiting at most the server's ``--max-delay``: Triton's
config has no ``dynamic_batching`` beside ``ensemble_scheduling``), and the batch runs through
every member. The members stay servable on their own, each from its own folder.

The parameter ``ensemble_mode: "steps"`` serves an ensemble the way Triton does instead: each
step a request of its own through the member's own batcher (the benchmark's baseline).

Statistics are Triton's: the ensemble counts its requests; each member counts, beside its own
requests, its runs inside the ensemble's task graph (one per ensemble request and batch), with
the time of its own tasks as its compute time (:func:`composing_snapshot`, read from the
runtime's per-part bookkeeping when the statistics or the metrics are read).

What is checked at load, and refused naming the cause:

* the steps: each names a model of the repository (not the ensemble itself; no cycle through
  nested ensembles), maps every input of its member (``input_map``: member input -> ensemble
  tensor) and the outputs it uses (``output_map``: member output -> ensemble tensor); each
  ensemble tensor is produced once, every ensemble input is read by a step, every output is
  produced by one, and the steps form no cycle;
* the members: a member with ``sequence_batching`` (its state lives across requests, not in one
  task graph) is refused; where the ensemble batches (``max_batch_size`` > 0) every member must
  batch at least as much (Triton's rule); each ensemble input and output must have the type of
  the member tensor it is mapped to, and dims that fit it;
* a step whose output count varies per request (a detector's boxes fed to a classifier as its
  batch): with ``max_batch_size: 0`` each request is its own task graph and the counts flow
  through as shapes; batching such an ensemble across requests would need a host task between
  the members (not built), so a batched ensemble whose tensors do not all carry one batch is
  refused, saying so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from staronnx.serve import model_config as mcfg
from staronnx.serve import protocol
from staronnx.serve.proto import model_config_pb2 as mc

if TYPE_CHECKING:  # imported where a plan is composed: the CLI's start stays light
    from staronnx.plan import Plan

PLATFORM = "ensemble"

#: how an ensemble is served: one task graph per batch (staronnx's), or step by step (Triton's)
MODES = ("graph", "steps")

#: the fields an ensemble's config may set (its members' configs say the rest)
HONOURED = {"name", "platform", "max_batch_size", "input", "output", "ensemble_scheduling", "parameters"}

#: the staronnx parameters an ensemble takes
PARAMETERS = {
    "input_shapes": "NAME=D1xD2x...;... sizes of the ensemble inputs' dynamic dimensions that calibrate and simulate "
                    "size its plan with (default: its members')",
    "ensemble_mode": "graph (one task graph per batch, the default) or steps (each step its own request, as Triton)",
    "slo_ms": mcfg.PARAMETERS["slo_ms"],
    "priority": mcfg.PARAMETERS["priority"],
}

@dataclass(frozen=True)
class Step:
    """One step: its member (and version, -1: the latest served), and its tensor maps."""

    model_name: str
    model_version: int
    #: member input -> ensemble tensor
    input_map: Mapping[str, str]
    #: member output -> ensemble tensor
    output_map: Mapping[str, str]


@dataclass(frozen=True)
class EnsembleSpec:
    """An ensemble as staronnx serves it: its steps in an order where producers come first."""

    name: str
    steps: tuple[Step, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    mode: str = "graph"
    #: member name -> the composed plan's parts that are its (graph mode; for its statistics)
    member_parts: Mapping[str, tuple[int, ...]] | None = None

    def labels(self) -> list[str]:
        """Each step's label in the composed plan: its member's name, numbered where a member
        appears in several steps."""
        seen: dict[str, int] = {}
        out = []
        for s in self.steps:
            n = seen.get(s.model_name, 0)
            seen[s.model_name] = n + 1
            out.append(s.model_name if n == 0 else f"{s.model_name}#{n + 1}")
        return out


def is_ensemble(config: mc.ModelConfig) -> bool:
    """Whether a config describes an ensemble (its platform, or its ensemble_scheduling)."""
    return bool(config.platform == PLATFORM or config.HasField("ensemble_scheduling"))


def read(config: mc.ModelConfig, name: str) -> EnsembleSpec:
    """The ensemble of ``config``, its fields and steps checked (not yet its members)."""
    if config.platform != PLATFORM:
        raise mcfg.ConfigError("ensemble_scheduling goes with platform: \"ensemble\"" if not config.platform else
                               f"ensemble_scheduling goes with platform \"ensemble\", not {config.platform!r}")
    if config.backend:
        raise mcfg.ConfigError(f"an ensemble has no backend (got {config.backend!r}); remove it")
    for f, _ in config.ListFields():
        if f.name not in HONOURED:
            raise mcfg.ConfigError(f"config field {f.name} is not honoured for an ensemble by staronnx serve (its "
                                   "members' configs say how each member runs); remove it to serve this ensemble")
    if config.name and config.name != name:
        raise mcfg.ConfigError(f"config name {config.name!r} differs from its folder's name {name!r}")
    scheduling = config.ensemble_scheduling
    if scheduling.max_inflight_requests:
        raise mcfg.ConfigError("ensemble_scheduling.max_inflight_requests is not honoured by staronnx serve (one "
                               "ensemble request is one task graph; the ensemble's queue bounds them: "
                               "dynamic_batching.default_queue_policy.max_queue_size)")
    unknown = sorted(set(config.parameters) - set(PARAMETERS))
    if unknown:
        raise mcfg.ConfigError(f"config parameters {', '.join(map(repr, unknown))} are not settings of an ensemble; "
                               f"those are: {', '.join(f'{k} ({v})' for k, v in PARAMETERS.items())}")
    mode = config.parameters["ensemble_mode"].string_value.strip() if "ensemble_mode" in config.parameters else "graph"
    if mode not in MODES:
        raise mcfg.ConfigError(f"parameter ensemble_mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not config.input or not config.output:
        raise mcfg.ConfigError("an ensemble's config must declare its inputs and outputs (name, data_type, dims): "
                               "they are not read off a model file")
    for t in (*config.input, *config.output):
        if t.data_type == mc.TYPE_INVALID or not t.dims:
            raise mcfg.ConfigError(f"ensemble tensor {t.name!r}: give its data_type and dims")
        if t.HasField("reshape"):
            raise mcfg.ConfigError(f"ensemble tensor {t.name!r}: reshape is not honoured on an ensemble (give it on "
                                   "the member)")
    if not scheduling.step:
        raise mcfg.ConfigError("ensemble_scheduling has no step")
    steps = []
    for i, s in enumerate(scheduling.step):
        where = f"ensemble_scheduling.step[{i}]"
        if not s.model_name:
            raise mcfg.ConfigError(f"{where}: model_name is missing")
        if s.model_namespace:
            raise mcfg.ConfigError(f"{where}: model_namespace is not honoured by staronnx serve")
        if s.model_name == name:
            raise mcfg.ConfigError(f"{where}: the ensemble {name!r} cannot be a step of itself")
        if not s.input_map or not s.output_map:
            raise mcfg.ConfigError(f"{where} ({s.model_name!r}): give its input_map and output_map")
        steps.append(Step(s.model_name, int(s.model_version) if s.model_version > 0 else -1,
                          dict(s.input_map), dict(s.output_map)))
    inputs = tuple(t.name for t in config.input)
    outputs = tuple(t.name for t in config.output)
    return EnsembleSpec(name, _ordered(steps, inputs, outputs), inputs, outputs, mode)


def _ordered(steps: Sequence[Step], inputs: Sequence[str], outputs: Sequence[str]) -> tuple[Step, ...]:
    """The steps in an order where each runs after the steps producing its inputs; refused
    where a tensor is produced twice, read but never produced, or the steps form a cycle."""
    producer: dict[str, int] = {}
    for i, s in enumerate(steps):
        for tensor in s.output_map.values():
            if tensor in inputs:
                raise mcfg.ConfigError(f"ensemble tensor {tensor!r} is an input of the ensemble and an output of step "
                                       f"{s.model_name!r}: a tensor has one producer")
            if tensor in producer:
                raise mcfg.ConfigError(f"ensemble tensor {tensor!r} is produced by two steps "
                                       f"({steps[producer[tensor]].model_name!r} and {s.model_name!r})")
            producer[tensor] = i
    read_by = {t for s in steps for t in s.input_map.values()}
    for s in steps:
        for member_input, tensor in s.input_map.items():
            if tensor not in producer and tensor not in inputs:
                raise mcfg.ConfigError(f"step {s.model_name!r} reads ensemble tensor {tensor!r} (its input "
                                       f"{member_input!r}), which is neither an ensemble input nor any step's output")
    unread = [t for t in inputs if t not in read_by]
    if unread:
        raise mcfg.ConfigError(f"ensemble input(s) {unread} are read by no step")
    unproduced = [t for t in outputs if t not in producer]
    if unproduced:
        raise mcfg.ConfigError(f"ensemble output(s) {unproduced} are produced by no step (map them in a step's "
                               "output_map)")
    order: list[int] = []
    ready = set(inputs)
    left = list(range(len(steps)))
    while left:
        runnable = [i for i in left if all(t in ready for t in steps[i].input_map.values())]
        if not runnable:
            names = sorted({steps[i].model_name for i in left})
            raise mcfg.ConfigError(f"the steps {names} form a cycle: each waits for a tensor another of them produces")
        order += runnable
        ready.update(t for i in runnable for t in steps[i].output_map.values())
        left = [i for i in left if i not in runnable]
    return tuple(steps[i] for i in order)


# -- members ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemberView:
    """What the ensemble checks of a loaded member: its name, version, effective config
    (Triton's JSON form) and plan."""

    name: str
    version: str
    config: Mapping[str, Any]
    plan: Plan


def refuse_sequence_member(step: Step, config: mc.ModelConfig) -> None:
    """A member that keeps state between requests cannot run inside one task graph."""
    if config.HasField("sequence_batching"):
        raise mcfg.ConfigError(f"step {step.model_name!r} is a sequence model (sequence_batching): its state lives "
                               "across requests of one sequence, which an ensemble's task graph cannot carry; serve "
                               "it on its own")


def check_members(spec: EnsembleSpec, config: mc.ModelConfig, members: Sequence[MemberView]) -> None:
    """Each step's member against the ensemble: batching, the tensors' types and dims."""
    mbs = config.max_batch_size
    declared = {t.name: t for t in (*config.input, *config.output)}
    sides = [({t["name"]: t for t in m.config.get("input", [])}, {t["name"]: t for t in m.config.get("output", [])})
             for m in members]  # each member's inputs and outputs by name
    for step, m, (ins, outs) in zip(spec.steps, members, sides):
        member_mbs = int(m.config.get("max_batch_size", 0))
        if mbs > 0 and member_mbs < mbs:
            raise mcfg.ConfigError(f"ensemble {spec.name!r} allows batches of {mbs}, but its step {step.model_name!r} "
                                   + ("does not batch (max_batch_size 0)" if member_mbs == 0 else
                                      f"allows at most {member_mbs}") + ": lower the ensemble's max_batch_size"
                                   + (" to 0" if member_mbs == 0 else f" to {member_mbs} or less"))
        unmapped = sorted(set(ins) - set(step.input_map))
        if unmapped:
            raise mcfg.ConfigError(f"step {step.model_name!r}: input(s) {unmapped} of the member are not in its "
                                   "input_map (every input of a member must be fed)")
        for kind, mapping, own in (("input", step.input_map, ins), ("output", step.output_map, outs)):
            for member_name, tensor in mapping.items():
                if member_name not in own:
                    raise mcfg.ConfigError(f"step {step.model_name!r}: {kind}_map names {member_name!r}, which is not "
                                           f"an {kind} of the member (its {kind}s: {', '.join(sorted(own))})")
                if tensor not in declared:
                    continue  # an intermediate: its producer's and consumers' types are compared below
                t = declared[tensor]
                theirs = own[member_name]
                if mc.DataType.Name(t.data_type) != theirs["data_type"]:
                    raise mcfg.ConfigError(f"ensemble tensor {tensor!r} is {mc.DataType.Name(t.data_type)}, but {kind} "
                                           f"{member_name!r} of step {step.model_name!r} is {theirs['data_type']}")
                ours = _full_dims(list(t.dims), mbs)
                member = _full_dims(list(theirs.get("dims", [])), member_mbs)
                if not protocol.dims_fit(ours, member):
                    raise mcfg.ConfigError(f"ensemble tensor {tensor!r} has dims {ours} (batch included), which do "
                                           f"not fit {kind} {member_name!r} of step {step.model_name!r}: {member}")
    produced = {tensor: (step.model_name, outs[member_name]["data_type"])
                for step, (_, outs) in zip(spec.steps, sides) for member_name, tensor in step.output_map.items()}
    for step, (ins, _) in zip(spec.steps, sides):
        for member_name, tensor in step.input_map.items():
            if tensor in produced and produced[tensor][1] != ins[member_name]["data_type"]:
                raise mcfg.ConfigError(f"ensemble tensor {tensor!r} is {produced[tensor][1]} as step "
                                       f"{produced[tensor][0]!r} produces it, but step {step.model_name!r} reads it "
                                       f"as {ins[member_name]['data_type']}")


def _full_dims(dims: list[int], mbs: int) -> list[int]:
    return [-1, *dims] if mbs > 0 else dims


def declared_shapes(config: mc.ModelConfig) -> dict[str, list[int | str | None]]:
    """The ensemble's inputs and outputs as full shapes (its fixed sizes; None where dynamic)."""
    return {t.name: [None if d < 0 else int(d) for d in _full_dims(list(t.dims), config.max_batch_size)]
            for t in (*config.input, *config.output)}


# -- the composed plan ----------------------------------------------------------------------------
def composed_plan(spec: EnsembleSpec, config: mc.ModelConfig, members: Sequence[MemberView],
                  root: Path) -> Plan:
    """The ensemble's plan: its members' plans composed (:func:`staronnx.partition.compose.compose`),
    kept under ``root`` (:mod:`staronnx.partition.plan_cache`) by the members' plan hashes (their
    files' hashes and the settings that cut them), the steps and the ensemble's tensors. The plan
    batches as the ensemble's max_batch_size says; a batched ensemble whose tensors do not all
    carry one batch is refused."""
    from staronnx.errors import PlanError
    from staronnx.partition.compose import Member, compose
    from staronnx.partition.plan_cache import kept_or_made, plan_folder

    labels = spec.labels()
    shapes = declared_shapes(config)
    settings: dict[str, Any] = {
        "ensemble": spec.name,
        "steps": [{"label": label, "model": s.model_name, "version": m.version, "parts": m.plan.k,
                   "input_map": dict(sorted(s.input_map.items())), "output_map": dict(sorted(s.output_map.items()))}
                  for label, s, m in zip(labels, spec.steps, members)],
    }
    given = _given_shapes(config, spec)
    if given:
        settings["input_shapes"] = given
    keyed = {"plans": [m.plan.hash for m in members], "inputs": list(spec.inputs), "outputs": list(spec.outputs),
             "shapes": shapes, **settings}
    steps = [Member(label, m.plan, {**s.input_map, **s.output_map})
             for label, s, m in zip(labels, spec.steps, members)]
    try:
        plan = kept_or_made(plan_folder(root, "ensemble", keyed),
                            lambda folder: compose(steps, spec.inputs, spec.outputs, folder, settings, shapes))
    except PlanError as exc:
        raise mcfg.ConfigError(f"its members cannot be composed into one task graph: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - onnx's or a bug's: this ensemble fails alone, saying so
        raise mcfg.ConfigError(f"composing its members into one task graph failed ({type(exc).__name__}: "
                               f"{exc}); please report it") from None
    contract = plan.contract
    if config.max_batch_size == 0:
        if contract.batchable:
            plan.set_batching([], batching=False)  # each request alone, as Triton's non-batching model
        return plan
    off = [f"{n} (axis {a})" for n, a in (*contract.inputs.items(), *contract.outputs.items()) if a != 0]
    if not contract.batchable or off:
        why = contract.why_not if not contract.batchable else "tensors without the batch on axis 0: " + ", ".join(off)
        raise mcfg.ConfigError(
            f"ensemble {spec.name!r} has max_batch_size {config.max_batch_size}, but its task graph cannot batch "
            f"requests together ({why}). Where a step's output count varies per request (a detector's boxes fed to "
            "a classifier), serve the ensemble with max_batch_size: 0 (each request its own task graph, the counts "
            "flowing through as shapes); a host task that re-batches between members is not built")
    return plan


def _given_shapes(config: mc.ModelConfig, spec: EnsembleSpec) -> dict[str, list[int]]:
    """The ensemble's ``input_shapes`` parameter (``NAME=1x3x32x128;...``), checked."""
    if "input_shapes" not in config.parameters:
        return {}
    text = config.parameters["input_shapes"].string_value
    try:
        given = dict(_shape_item(item) for item in text.split(";") if item.strip())
    except ValueError:
        raise mcfg.ConfigError(f"parameter input_shapes reads NAME=D1xD2x...;NAME=... (sizes as numbers), got "
                               f"{text!r}") from None
    unknown = sorted(set(given) - set(spec.inputs))
    if unknown:
        raise mcfg.ConfigError(f"parameter input_shapes names {unknown}, which are not inputs of the ensemble "
                               f"({', '.join(spec.inputs)})")
    return dict(sorted(given.items()))


def _shape_item(item: str) -> tuple[str, list[int]]:
    name, _, dims = item.strip().partition("=")
    return name.strip(), [int(d) for d in dims.lower().split("x")]


def member_parts(plan: Plan) -> dict[str, tuple[int, ...]]:
    """Each member's parts in a composed plan (laid out step after step, as its settings list
    them), for its statistics."""
    out: dict[str, list[int]] = {}
    first = 0
    for s in plan.settings.get("steps", []):
        count = int(s.get("parts", 0))
        out.setdefault(str(s["model"]), []).extend(range(first, first + count))
        first += count
    return {k: tuple(v) for k, v in out.items()}


# -- statistics -----------------------------------------------------------------------------------
def composing_snapshot(ensemble: Mapping[str, Any], tasks: Mapping[str, Mapping[str, Any]],
                       parts: Sequence[int]) -> dict[str, Any]:
    """A member's statistics from its runs inside a one-task-graph ensemble, as Triton counts a
    composing model's: a request and an execution per ensemble request and batch, the samples
    run, and as compute time the member's own tasks (``tasks``: the ensemble's per-part task
    counts and mean measured ms from its runtime, keyed ``part<p>/<arch>``); it waits in no
    queue of its own."""
    from staronnx.serve.metrics import ModelStats

    out = ModelStats().snapshot()
    for key in ("success", "inference_count", "exec_count", "last_inference_ms"):
        out[key] = ensemble.get(key, 0)
    out["batches"] = dict(ensemble.get("batches", {}))
    wanted = {f"part{p}" for p in parts}
    out["infer_us"] = out["request_us"] = sum((float(row.get("tasks", 0)) * float(row.get("measured_ms") or 0.0) * 1e3
                                               for key, row in tasks.items() if key.split("/", 1)[0] in wanted), 0.0)
    return out

