"""A model served whole, as a plan of one part: what ONNX Runtime runs, a plan runs.

:func:`staronnx.partition.partition` cuts a model's DAG of tensors into parts. Some models ORT
runs cannot be cut that way, or not into the parts asked:

- fewer nodes than the default two parts (a one-node model; parts asked for explicitly are
  refused instead, naming the node count);
- inputs or outputs that are not tensors (sequences, optionals, maps): a cut weighs tensors by
  their bytes per sample, and parts hand tensors to each other;
- an output that no node computes (a graph input or an initializer returned as it is);
- a cut that fails (a part the checker refuses, a method that cannot meet the request):
  :class:`UncuttableError`.

Such a model becomes a plan of one part, the model itself (IR-3 initializers repaired on load,
see :func:`staronnx.modelio.upgrade_ir3`), and partition says so in one
:class:`~staronnx.partition.checks.PartitionWarning`. No costs are measured: one part takes all
of them, whatever they are. Its inputs and outputs keep ORT's types: a tensor's dtype is its
numpy name, as in every plan, anything else ORT's type string (``seq(tensor(int64))``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from staronnx import contract
from staronnx.errors import PartitionError
from staronnx.feeds import integer_ranges
from staronnx.fsutil import atomic_dir
from staronnx.modelio import LoadedModel, dim_of, dtype_itemsize, file_sha256, is_fixed, save_model
from staronnx.ortutil import value_type_name
from staronnx.partition.graph import is_copied_constant
from staronnx.plan import PartSpec, Plan, TensorSpec

#: what the plan's settings record as the method of a model served whole
WHOLE = "whole"


class UncuttableError(PartitionError):
    """A cut of this model failed where the model itself runs (a part the ONNX checker refuses,
    an invalid cut): partition serves the model whole instead of refusing it."""


def vertex_count(model: onnx.ModelProto) -> int:
    """The nodes a cut places (Constant nodes are copied into every part that reads them)."""
    return sum(1 for n in model.graph.node if not is_copied_constant(n))


def is_tensor(tp: onnx.TypeProto) -> bool:
    kind: str | None = tp.WhichOneof("value")
    return kind == "tensor_type"


def whole_reason(model: onnx.ModelProto) -> str | None:
    """Why the model cannot be cut into tensor-handing parts at all, or None."""
    g = model.graph
    odd = [f"input {vi.name!r} is a {value_type_name(vi.type)}" for vi in fed_inputs(model) if not is_tensor(vi.type)]
    odd += [f"output {vi.name!r} is a {value_type_name(vi.type)}" for vi in g.output if not is_tensor(vi.type)]
    if odd:
        return f"{odd[0]}, and parts hand on tensors only"
    computed = {o for n in g.node for o in n.output if o}
    passed = [vi.name for vi in g.output if vi.name not in computed]
    if passed:
        what = "input" if passed[0] in {vi.name for vi in g.input} else "initializer or constant"
        return f"output {passed[0]!r} is the {what} returned as it is, which no part computes"
    return None


def too_small(model: onnx.ModelProto, parts: int) -> str | None:
    """Why the model cannot be cut into ``parts`` parts for want of nodes, or None."""
    count = vertex_count(model)
    return f"it has {count} node(s) to place, fewer than {parts} parts" if parts > count else None


def _element_dtype(elem_type: int) -> str:
    """A tensor's dtype as plans name it: numpy's name, ONNX's (lower case) where numpy has none."""
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name
    except (KeyError, TypeError, ValueError):
        name: str = onnx.TensorProto.DataType.Name(elem_type)
        return name.lower()


def value_spec(vi: onnx.ValueInfoProto) -> TensorSpec:
    """A graph input's or output's spec: a tensor's dtype and declared shape (symbols as
    strings, unknown sizes None), or ORT's type string and no shape for anything else."""
    if not is_tensor(vi.type):
        return TensorSpec(vi.name, value_type_name(vi.type), [], batched=False)
    tt = vi.type.tensor_type
    shape = [dim_of(d) for d in tt.shape.dim] if tt.HasField("shape") else []
    fixed = int(np.prod([d for d in shape if is_fixed(d)], dtype=np.int64))  # (is_fixed: sizes only)
    return TensorSpec(vi.name, _element_dtype(tt.elem_type), shape,
                      bytes_per_sample=fixed * dtype_itemsize(tt.elem_type))


def fed_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs a caller feeds: those that are not initializers (an initializer listed
    as an input too is an overridable default in IR >= 4, which ORT does not list either)."""
    constants = {t.name for t in model.graph.initializer} | {t.values.name for t in model.graph.sparse_initializer}
    return [vi for vi in model.graph.input if vi.name not in constants]


def io_specs(model: onnx.ModelProto) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The model's inputs (those fed) and outputs as plan specs, each input marked batched
    where the batching contract finds its batch axis."""
    inputs = [value_spec(vi) for vi in fed_inputs(model)]
    outputs = [value_spec(vi) for vi in model.graph.output]
    symbol = contract.batch_symbol({t.name: t.shape for t in inputs}, {t.name: t.shape for t in outputs})
    for spec in (*inputs, *outputs):
        spec.batched = bool(spec.shape) and contract.input_axis(spec.shape, symbol) is not None
    return inputs, outputs


def _without_ort_config(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model without the ORT config it may embed: the session that serves the plan reads
    that config; each worker's session of the part would read it again (ORT does where
    ``ORT_LOAD_CONFIG_FROM_MODEL=1``) and profile, or size its pools, on its own."""
    kept = [p for p in model.metadata_props if p.key != "ort_config"]
    if len(kept) == len(model.metadata_props):
        return model
    part = onnx.ModelProto()
    part.CopyFrom(model)
    del part.metadata_props[:]
    part.metadata_props.extend(kept)
    return part


def model_source(loaded: LoadedModel) -> dict[str, Any]:
    """What a plan records of its source model (its hash is part of the plan's)."""
    model = loaded.model
    return {"path": str(loaded.path) if loaded.path else None, "sha256": loaded.sha256,
            "nodes": len(model.graph.node), "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import}}


def part_sha256(path: Path) -> str:
    """A part file's hash, with its external weights (``<file>.data``) where it has them."""
    data = path.with_name(path.name + ".data")
    return file_sha256(path, [data] if data.exists() else [])


def write_whole_plan(loaded: LoadedModel, settings: dict[str, Any], directory: Path) -> Plan:
    """The model itself as part 0 of a one-part plan in ``directory`` (written atomically, as
    every plan is); return the loaded Plan."""
    model = loaded.model
    inputs, outputs = io_specs(model)
    ranges = integer_ranges(model)
    for spec in inputs:
        spec.consumers = [0]
        if spec.name in ranges:
            spec.value_range = list(ranges[spec.name])
    for spec in outputs:
        spec.producer = 0
    directory = Path(directory).absolute()
    with atomic_dir(directory) as staging:
        path = staging / "part0.onnx"
        save_model(_without_ort_config(model), path)
        part = PartSpec(index=0, file=path.name, inputs=[t.name for t in inputs],
                        outputs=[t.name for t in outputs], nodes=len(model.graph.node),
                        op_counts=dict(Counter(node.op_type for node in model.graph.node).most_common()),
                        cost_us=0.0, share=1.0, target_share=1.0, sha256=part_sha256(path))
        plan = Plan(root=directory, parts=[part], inputs=inputs, outputs=outputs, crossing=[], cut_bytes_per_sample=0,
                    source=model_source(loaded), settings=settings, cost_source="none: one part takes every cost")
        plan.hash = plan.compute_hash()
        plan.write_json(staging)
    return Plan.load(directory)
