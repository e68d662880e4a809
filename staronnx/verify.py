"""Checking that a plan computes what its source model computes.

Random feeds of the right dtypes (integers in the range the plan recorded), the whole model on
ORT CPU versus the parts chained on ORT CPU, compared per output. The tolerance follows
DESIGN.md: max abs diff <= 1e-4 relative to the output's scale for floats, equality otherwise.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import onnx

from staronnx.errors import InputError, PlanError, StaronnxError
from staronnx.feeds import random_array
from staronnx.modelio import is_fixed, load_model
from staronnx.ortutil import make_session, ort_failure, ort_type_name
from staronnx.plan import Plan, arch_files

RELATIVE_TOLERANCE = 1e-4
#: a plan's fp16 parts (``partition --precision gpu=fp16``) against the fp32 model: fp16 keeps
#: ~3 significant digits, and a deep network adds every layer's rounding (googlenet's fp16
#: logits differ from fp32's by ~1e-3)
FP16_TOLERANCE = 1e-2


@dataclass
class OutputCheck:
    """Comparison of one output between the whole model and the chained parts."""

    name: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float  # max abs diff / max |reference|
    ok: bool


@dataclass
class VerifyReport:
    outputs: list[OutputCheck]
    batch: int
    #: the architecture whose part files ran (None: the plan's own fp32 files), and the relative
    #: tolerance each output was held to
    arch: str | None = None
    precision: str = "fp32"
    tolerance: float = RELATIVE_TOLERANCE

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)


def feed_shapes(plan: Plan, batch: int, given: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Concrete input shapes: the batch on each input's own batch axis (the plan's contract), the
    rest from the user or the plan's settings.

    A dynamic dim nobody gave a size for cannot be guessed safely, so it is an error that says
    which option to pass. So is a batch above 1 for a model that runs one request per task.
    """
    contract = plan.contract
    if batch != 1 and not contract.batchable:
        raise PlanError(f"batch {batch} is impossible for this model: {contract.why_not}; it runs one request "
                        "per task (use batch 1)")
    specs = {t.name: t for t in plan.inputs}
    for name, sizes in (given or {}).items():  # the user's sizes: an input the plan has, at its rank
        spec = specs.get(name)
        if spec is None:
            why = f"names unknown input {name!r}; the plan's inputs are {plan.input_names}"
            raise PlanError(f"input_shapes {why}", cli=f"--input-shape {why}")
        if len(sizes) != len(spec.shape):
            shown = f"{name}={'x'.join(map(str, sizes))}"
            why = f"rank {len(sizes)} given, the model's input has rank {len(spec.shape)} {spec.shape}"
            raise PlanError(f"input_shapes {shown}: {why}", cli=f"--input-shape {shown}: {why}")
    recorded = {k: list(v) for k, v in plan.settings.get("input_shapes", {}).items()}
    recorded.update(given or {})
    shapes: dict[str, list[int]] = {}
    for spec in plan.inputs:
        dims: list[int] = []
        user = recorded.get(spec.name)
        for axis, d in enumerate(spec.shape):
            if axis == contract.inputs.get(spec.name):
                dims.append(batch)
            elif is_fixed(d):
                dims.append(int(d))
            elif user is not None and axis < len(user) and is_fixed(user[axis]):
                dims.append(int(user[axis]))
            else:
                why = f"input {spec.name!r} has dynamic dimension {d or '?'!r} at axis {axis}"
                raise PlanError(f"{why}; give its size with input_shapes={{{spec.name!r}: [...]}}",
                                cli=f"{why}; give its size with --input-shape {spec.name}=...")
        shapes[spec.name] = dims
    return shapes


def runnable_batch(plan: Plan, batch: int) -> tuple[int, str | None]:
    """The batch a command can run for a requested ``batch``: itself, or 1 for a model that runs
    one request per task, with the line that says so (a command never claims a batch it did
    not run)."""
    contract = plan.contract
    if batch == 1 or contract.batchable:
        return batch, None
    return 1, (f"batch {batch} is impossible for this model: {contract.why_not}; it runs one request per "
               "task, so batch 1 is run")


def random_plan_feeds(plan: Plan, batch: int, given: dict[str, list[int]] | None = None,
                      seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds matching a plan's signature at a batch size."""
    shapes = feed_shapes(plan, batch, given)
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in plan.inputs:
        elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(spec.dtype))
        low_high = spec.value_range  # [low, high) of an integer input, as partition recorded it
        rng_range = (int(low_high[0]), int(low_high[1])) if low_high else None
        feeds[spec.name] = random_array(elem, shapes[spec.name], rng, rng_range)
    return feeds


def compare(name: str, ref: np.ndarray, got: np.ndarray, tolerance: float = RELATIVE_TOLERANCE) -> OutputCheck:
    if ref.shape != got.shape:
        return OutputCheck(name, tuple(got.shape), float("inf"), float("inf"), False)
    if np.issubdtype(ref.dtype, np.floating):
        want, have = ref.astype(np.float64), got.astype(np.float64)
        # a NaN or an infinity where the model has the same one agrees: a state a client sent
        # NaN gives NaN rows in both, and those rows said nothing of the other rows' values
        agree = (np.isnan(want) & np.isnan(have)) | (np.isinf(want) & (want == have))
        with np.errstate(invalid="ignore"):
            diff = np.where(agree, 0.0, np.abs(want - have))
        diff[np.isnan(diff)] = np.inf  # a NaN on one side only is as far off as it gets
        max_abs = float(diff.max()) if diff.size else 0.0
        finite = np.abs(want[np.isfinite(want)])
        scale = float(finite.max()) if finite.size else 0.0
        rel = max_abs / scale if scale > 0 else max_abs
        ok = bool(np.isfinite(max_abs)) and rel <= tolerance
        return OutputCheck(name, tuple(ref.shape), max_abs, rel, ok)
    equal = bool(np.array_equal(ref, got))
    return OutputCheck(name, tuple(ref.shape), 0.0 if equal else 1.0, 0.0 if equal else 1.0, equal)


def _check_same_inputs(plan: Plan, session: Any) -> None:
    """The model must take the plan's inputs (names, ranks, dtypes), or it is not its source."""
    got = {i.name: i for i in session.get_inputs()}
    for spec in plan.inputs:
        arg = got.get(spec.name)
        if arg is None:
            raise PlanError(f"the model has no input {spec.name!r} (it takes {sorted(got)}): is this the plan's "
                            "source model?")
        if len(arg.shape) != len(spec.shape) or arg.type != ort_type_name(spec.dtype):
            raise PlanError(f"the model's input {spec.name!r} is {arg.type} of rank {len(arg.shape)}, the plan's is "
                            f"{spec.dtype} {spec.shape}: is this the plan's source model?")


def verify_plan(plan: Plan, model: onnx.ModelProto | str | os.PathLike[str], batch: int = 1,
                input_shapes: dict[str, list[int]] | None = None, seed: int = 0,
                feeds: Mapping[str, np.ndarray] | None = None, arch: str | None = None) -> VerifyReport:
    """Run the whole model and the chained parts on the same feeds and compare: random ones
    at ``batch``, or ``feeds`` (real inputs, which exercise the paths real data takes).

    ``arch``: chain the part files that architecture's workers load (a plan partitioned with
    ``--precision gpu=fp16`` has fp16 files for ``cuda``), on ONNX Runtime's CPU provider,
    against the fp32 model, within that precision's wider tolerance."""
    loaded = load_model(model)
    source = loaded.path if loaded.path is not None else loaded.model
    if feeds is None:
        feeds = random_plan_feeds(plan, batch, input_shapes, seed)
    else:
        plan.check_feeds(feeds)
        feeds = dict(feeds)
    whole = make_session(source)
    names = [o.name for o in whole.get_outputs()]
    missing = [n for n in plan.output_names if n not in names]
    if missing:
        raise PlanError(f"the model has no output(s) {missing}: is this the plan's source model?")
    _check_same_inputs(plan, whole)
    own = arch is not None and arch in arch_files(plan)
    if own and arch is not None:
        precision = plan.settings["precision"][arch]
    else:  # the plan's own files: fp16 where the model computes in it (an fp16 export)
        precision = "fp16" if any(_holds_half(g) for g in _part_graphs(plan)) else "fp32"
    tolerance = FP16_TOLERANCE if precision == "fp16" else RELATIVE_TOLERANCE
    try:
        reference = dict(zip(names, whole.run(names, feeds)))
        chained = _chain(plan, feeds, arch) if own and arch is not None else plan.run_reference(feeds)
    except StaronnxError:
        raise
    except Exception as exc:  # ORT's own classes (Fail, InvalidArgument, ...): a model's error
        raise model_failure(plan, feeds, exc) from None
    checks = [compare(n, reference[n], chained[n], tolerance) for n in plan.output_names]
    return VerifyReport(outputs=checks, batch=batch, arch=arch if own else None, precision=precision,
                        tolerance=tolerance)


#: element types that round as fp16 does (or worse): a model computing in them is held to
#: :data:`FP16_TOLERANCE`, not fp32's
_HALF = frozenset({onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})


def _holds_half(graph: onnx.GraphProto) -> bool:
    """Whether a part computes in fp16 or bf16: a weight, a Constant or a Cast of that type.

    An fp16 export's plan computes what its model computes, but ONNX Runtime fuses and orders
    fp16 arithmetic differently in the whole model and in its parts: unet_seg in fp16 differed
    by 5e-4 of its scale, fp16's own rounding, and verify called every such plan a MISMATCH
    against fp32's 1e-4."""
    if any(t.data_type in _HALF for t in graph.initializer):
        return True
    for node in graph.node:
        for attr in node.attribute:
            if (node.op_type == "Cast" and attr.name == "to" and attr.i in _HALF) or attr.t.data_type in _HALF:
                return True
            if any(_holds_half(g) for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs)):
                return True
    return False


def _chain(plan: Plan, feeds: Mapping[str, np.ndarray], arch: str) -> dict[str, np.ndarray]:
    """The plan's outputs from ``arch``'s part files run one after another on CPU ORT."""
    plan.check_feeds(feeds)
    files = arch_files(plan)[arch]
    values: dict[str, np.ndarray] = dict(feeds)
    for part in plan.parts:
        sess = make_session(str(plan.root / files[part.index]))
        values.update(zip(part.outputs, sess.run(part.outputs, {n: values[n] for n in part.inputs})))
    return {name: values[name] for name in plan.output_names}


#: ``Input initial_h must have shape ...``: ORT naming one of the failing node's inputs
_NODE_INPUT = re.compile(r"\bInput (\w+)\b")


def _part_graphs(plan: Plan) -> list[onnx.GraphProto]:
    """Each part's graph without its weights (an error path reads only names, so it stays cheap)."""
    return [onnx.load(str(plan.part_path(p.index)), load_external_data=False).graph for p in plan.parts]


def inputs_behind(plan: Plan, node_name: str, node_input: str | None = None) -> list[str]:
    """The model inputs a node of the plan reads, through every part before it: those behind its
    input ``node_input`` (the name its operator's schema gives it, e.g. GRU's ``initial_h``) where
    that is known, else behind all its inputs. Empty when no part has the node."""
    producer: dict[str, onnx.NodeProto] = {}
    target: onnx.NodeProto | None = None
    for graph in _part_graphs(plan):
        for node in graph.node:
            producer.update((o, node) for o in node.output if o)
            if node.name == node_name:
                target = node
    if target is None:
        return []
    starts = list(target.input)
    if node_input is not None:
        try:
            schema = onnx.defs.get_schema(target.op_type, domain=target.domain)
            index = [i.name for i in schema.inputs].index(node_input)
            if index < len(target.input) and target.input[index]:
                starts = [target.input[index]]
        except (onnx.defs.SchemaError, ValueError):
            pass
    found: set[str] = set()
    seen: set[str] = set()
    stack = [t for t in starts if t]
    while stack:
        tensor = stack.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        if tensor in plan.input_names:
            found.add(tensor)
        elif tensor in producer:
            stack.extend(t for t in producer[tensor].input if t)
    return [n for n in plan.input_names if n in found]


def model_failure(plan: Plan, feeds: Mapping[str, np.ndarray], exc: BaseException,
                  what: str = "the model") -> InputError:
    """One line for a model that fails on ``feeds`` (ORT's error, or a staronnx task error it
    caused): the model input(s) the failing node reads, with their shapes and batch axes in the
    plan's contract, and ORT's words for what the node requires. No traceback: the user can act
    on the input and its axis, not on our stack."""
    op, node, message = ort_failure(exc)
    match = _NODE_INPUT.search(message)
    names = inputs_behind(plan, node, match.group(1) if match else None) if node else []
    contract = plan.contract

    def say(name: str) -> str:
        value = feeds.get(name)
        shape = "?" if value is None else (list(value.shape) if value.ndim else "a scalar")
        axis = contract.inputs.get(name)
        where = "no batch axis" if axis is None else f"batch on axis {axis}"
        return f"{name!r} (shape {shape}; {where} in the plan's contract)"

    shown = names or [n for n in plan.input_names if n in feeds]
    label = "input" if len(shown) == 1 else "inputs"
    rows = contract.rows(feeds)
    batch = f" at batch {rows}" if rows > 1 else ""
    at = f"{op} node {node!r}: " if node else ""
    return InputError(f"{what} fails{batch} on {label} {', '.join(say(n) for n in shown)}: {at}{message}")
