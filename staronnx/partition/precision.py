"""Per-device precision: a plan's parts in fp16 on the GPU, fp32 on the CPU (issue 48, item 3).

A GPU runs fp16 at several times its fp32 rate while a CPU gains nothing from it, and a part
may run on either (the policy places each task), so precision belongs to a part's
implementation per architecture (StarPU's codelet), not to the part: ``--precision gpu=fp16``
keeps every part's fp32 file for the CPU workers and writes beside it an fp16 file that the
CUDA workers load instead. The conversion is onnxconverter-common's
``convert_float_to_float16`` (a maintained converter; its default block list keeps the ops that
have no fp16 kernel in fp32) with ``keep_io_types``: each fp16 part takes and gives the same
fp32 tensors as its fp32 twin, so the casts sit at the cuts, the tensors that cross between
parts and devices keep their types, and the user's inputs and outputs are the model's.

The choice and the files are kept in the plan's settings (so its hash, and the perf models
keyed by it, change with it): ``settings["precision"] = {"cuda": "fp16", "cpu": "fp32",
"converter": ..., "files": {"cuda": [one name per part]}}``. ``staronnx plan verify`` runs
each architecture's chain against the fp32 model, fp16 with the wider tolerance
:data:`FP16_TOLERANCE` that it states.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx

from staronnx.errors import PartitionError
from staronnx.fsutil import atomic_write_bytes
from staronnx.plan import PRECISION_SETTING, Plan, arch_files
from staronnx.verify import FP16_TOLERANCE

#: what the user may write for a device, and the architecture the runtime calls it
DEVICES = {"gpu": "cuda", "cuda": "cuda", "cpu": "cpu"}
PRECISIONS = ("fp32", "fp16")
INSTALL_HINT = "pip install onnxconverter-common"


def parse_precision(items: Sequence[str] | str | None) -> dict[str, str]:
    """``gpu=fp16`` (or ``cuda=fp16``, ``cpu=fp32``; comma-separated or repeated) as
    ``{arch: precision}``; an error naming the flag and what it accepts otherwise."""
    if items is None:
        return {}
    texts = [items] if isinstance(items, str) else list(items)
    out: dict[str, str] = {}
    for item in (t.strip() for text in texts for t in text.split(",") if t.strip()):
        device, sep, value = item.partition("=")
        arch = DEVICES.get(device.strip().lower())
        value = value.strip().lower()
        if not sep or arch is None or value not in PRECISIONS:
            raise PartitionError(f"--precision {item}: write DEVICE=PRECISION with DEVICE gpu or cpu and PRECISION "
                                 f"{' or '.join(PRECISIONS)} (e.g. --precision gpu=fp16)")
        if arch == "cpu" and value != "fp32":
            raise PartitionError(f"--precision {item}: the CPU parts stay fp32 (a CPU gains nothing from fp16, and "
                                 "ONNX Runtime's CPU provider has few fp16 kernels); fp16 is for gpu=fp16")
        out[arch] = value
    return out


def _converter() -> Any:
    try:
        from onnxconverter_common import float16
    except ImportError:
        raise PartitionError(f"--precision gpu=fp16 needs onnxconverter-common's fp16 converter: {INSTALL_HINT}") \
            from None
    return float16


def fp16_name(file: str) -> str:
    """The fp16 twin of a part file: ``part1.onnx`` -> ``part1.cuda-fp16.onnx``."""
    stem = file[:-5] if file.endswith(".onnx") else file
    return f"{stem}.cuda-fp16.onnx"


#: fp16's largest finite value and smallest subnormal: what the converter clamps the weights and
#: constants to. Its own defaults (1e4 and 1e-7) changed values fp16 holds exactly: gru_stream's
#: ``16000 / sample_rate`` became ``10000 / sample_rate``, and its state drifted 6 % from fp32's
FP16_MAX = 65504.0
FP16_TINY = 5.96e-08

#: the suffix of a part output's name inside its fp16 twin (see :func:`outputs_apart`)
INNER = "__staronnx_fp16_inner"


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)]


def _read_names(graph: onnx.GraphProto) -> set[str]:
    """Every name the graph's nodes read, their subgraphs' included (captures, body outputs)."""
    names: set[str] = set()
    for node in graph.node:
        names.update(node.input)
        for sub in _subgraphs(node):
            names |= _read_names(sub)
            names.update(o.name for o in sub.output)
    return names


def _rename_reads(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        for sub in _subgraphs(node):
            _rename_reads(sub, old, new)
            for out in sub.output:
                if out.name == old:
                    out.name = new


def outputs_apart(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a part whose outputs no node of its own reads: each such output is computed
    under an inner name, read there, and handed out through an Identity.

    A part's output is often read inside the part too (a crossing tensor that another node of
    the part also takes: bert_tiny's ``last_hidden_state``, which the pooler reads). The
    converter's ``keep_io_types`` then casts the output back to fp32 while its readers keep the
    name and expect fp16, and ONNX Runtime refused to load the twin ("Type (tensor(float16)) ...
    does not match expected type (tensor(float))"). The Identity is the only reader of each
    output left, so the cast lands after it."""
    from onnx import helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    read = _read_names(graph)
    for name in [o.name for o in graph.output if o.name in read]:
        inner = name + INNER
        for node in graph.node:
            for i, made in enumerate(node.output):
                if made == name:
                    node.output[i] = inner
        _rename_reads(graph, name, inner)
        graph.node.append(helper.make_node("Identity", [inner], [name], name=inner + "_out"))
    return out


def cast_as_typed(graph: onnx.GraphProto) -> None:
    """Make each ``Cast(to=FLOAT)`` the converter typed fp16 cast to FLOAT16 (in place).

    The converter turns every fp32 value's type into fp16 but leaves a Cast's ``to`` alone, so a
    ``Cast(to=FLOAT)`` (gru_stream's sample rate, gpt2's mask, detector_nms's grid) made an fp32
    value its fp16 readers refused at load. Casting to fp16 is what the converter meant."""
    typed = {v.name: v.type.tensor_type.elem_type for v in (*graph.value_info, *graph.output)}
    for node in graph.node:
        if node.op_type == "Cast" and node.output and typed.get(node.output[0]) == onnx.TensorProto.FLOAT16:
            for attr in node.attribute:
                if attr.name == "to" and attr.i == onnx.TensorProto.FLOAT:
                    attr.i = onnx.TensorProto.FLOAT16
        for sub in _subgraphs(node):
            cast_as_typed(sub)


def apply_precision(plan: Plan, precision: dict[str, str]) -> Plan:
    """Write the fp16 part files ``precision`` asks for beside ``plan``'s and record them in its
    settings; the plan, reloaded. fp32 everywhere (or nothing asked) leaves the plan as it is."""
    if precision.get("cuda", "fp32") == "fp32":
        return plan
    float16 = _converter()
    # every part is converted in memory first: a part the converter fails on leaves the plan
    # folder as it was, not with some parts' fp16 files written
    files, digests, blobs = [], [], []
    for part in plan.parts:
        model = onnx.load(str(plan.part_path(part.index)))
        if float16.check_if_fp16_ready(model.graph):
            # a part of a model exported in fp16 (or mixed precision) already is what the GPU
            # runs: the converter refuses it ("already converted to float16"), which ended the
            # command in a traceback after the plan was written; its twin is the part as it is
            half = model
        else:
            half = float16.convert_float_to_float16(outputs_apart(model), keep_io_types=True,
                                                    min_positive_val=FP16_TINY, max_finite_val=FP16_MAX)
            cast_as_typed(half.graph)
        name = fp16_name(part.file)
        data = half.SerializeToString()
        files.append(name)
        blobs.append(data)
        digests.append(hashlib.sha256(data).hexdigest())
    from onnxconverter_common import __version__ as version

    plan.settings[PRECISION_SETTING] = {
        "cuda": "fp16", "cpu": "fp32", "files": {"cuda": files}, "sha256": {"cuda": digests},
        "converter": f"onnxconverter-common {version} convert_float_to_float16(keep_io_types=True, "
                     f"min_positive_val={FP16_TINY:g}, max_finite_val={FP16_MAX:g})",
        "tolerance": FP16_TOLERANCE}
    plan.hash = plan.compute_hash()
    # each file by a temporary and a rename (a reader, or a crash mid-way, never sees half a
    # part), and plan.json, which names them and their digests, last
    for name, data in zip(files, blobs, strict=True):
        atomic_write_bytes(plan.root / name, data)
    plan.write_json(plan.root)
    return Plan.load(plan.root)


def describe(plan: Plan) -> str | None:
    """One line for ``plan show``: which parts run in which precision, or None for fp32 only."""
    setting = plan.settings.get(PRECISION_SETTING)
    if not setting:
        return None
    return (f"precision: cuda parts {setting['cuda']}, cpu parts {setting['cpu']} (the casts at the cuts: every "
            f"part keeps its fp32 inputs and outputs); converted by {setting['converter']}")


def part_path(plan: Plan, index: int, arch: str) -> Path:
    """The file ``arch``'s workers load for part ``index``."""
    files = arch_files(plan).get(arch)
    return plan.root / files[index] if files else plan.part_path(index)
