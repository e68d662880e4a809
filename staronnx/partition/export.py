"""The one way every method's :class:`~staronnx.partition.cut.Parts` become a plan folder.

Each part is a checker-valid ONNX model: its own nodes in topological order, copies of the
initializers and Constant nodes it reads, inputs for the model inputs and crossing tensors it
reads (batch dimensions symbolic), outputs for what other parts or the caller read. The folder
is staged and renamed into place whole (:func:`staronnx.fsutil.atomic_dir`): an interrupted
run leaves no half plan, and what a SIGKILL leaves the next export beside it removes.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from staronnx.feeds import integer_ranges
from staronnx.fsutil import atomic_dir
from staronnx.modelio import save_model
from staronnx.partition.cut import Parts
from staronnx.partition.graph import ModelGraph
from staronnx.partition.whole import UncuttableError, model_source, part_sha256
from staronnx.plan import PartSpec, Plan, TensorSpec


def _value_info(graph: ModelGraph, name: str) -> onnx.ValueInfoProto:
    info = graph.tensors.get(name)
    if info is None or not info.elem_type:
        raise UncuttableError(f"cannot export tensor {name!r}: its element type is unknown")
    return helper.make_tensor_value_info(name, info.elem_type, info.sym_shape)


def _part_model(
    graph: ModelGraph, members: list[int], inputs: list[str], outputs: list[str], index: int
) -> onnx.ModelProto:
    src = graph.model
    needed = {t for v in members for t in graph.node_inputs[v]}
    consts = [graph.const_nodes[t] for t in graph.const_nodes if t in needed]
    inits = [graph.initializers[t] for t in graph.initializers if t in needed]
    sparse = [i for i in inits if isinstance(i, onnx.SparseTensorProto)]
    inits = [i for i in inits if not isinstance(i, onnx.SparseTensorProto)]
    g = helper.make_graph(
        nodes=[*consts, *(graph.nodes[v] for v in members)],
        name=f"{src.graph.name or 'model'}_part{index}",
        inputs=[_value_info(graph, t) for t in inputs],
        outputs=[_value_info(graph, t) for t in outputs],
        initializer=inits,
        sparse_initializer=sparse,
    )
    # IR 4 at least: a part lists as inputs only what it is fed, never the initializers it carries
    model = helper.make_model(
        g, opset_imports=list(src.opset_import), producer_name="staronnx", ir_version=max(src.ir_version, 4)
    )
    model.functions.extend(src.functions)
    return model


def build_plan_layout(
    graph: ModelGraph, ranks: np.ndarray
) -> tuple[list[list[int]], list[list[str]], list[list[str]]]:
    """Members, inputs and outputs of each part, in deterministic order."""
    k = int(ranks.max()) + 1
    members = [[v for v in range(len(graph)) if ranks[v] == r] for r in range(k)]
    model_inputs = [i.name for i in graph.inputs]
    model_outputs = set(graph.outputs)
    inputs: list[list[str]] = []
    outputs: list[list[str]] = []
    for r in range(k):
        # what its nodes read that no node of its own makes and no initializer or Constant holds
        reads = list(dict.fromkeys(t for v in members[r] for t in graph.node_inputs[v]
                                   if not (t in graph.producer and ranks[graph.producer[t]] == r)
                                   and t not in graph.initializers and t not in graph.const_nodes))
        inputs.append([t for t in model_inputs if t in reads] + [t for t in reads if t not in model_inputs])
        # what its nodes make that the caller or another part reads
        outputs.append([t for v in members[r] for t in graph.nodes[v].output if t and (
            t in model_outputs or any(ranks[c] != r for c in graph.consumers.get(t, [])))])
    return members, inputs, outputs


def write_plan(graph: ModelGraph, cut: Parts, settings: dict[str, Any], directory: Path) -> Plan:
    """Export every part (with its device, if placed) and plan.json into ``directory``
    atomically; return the loaded Plan."""
    ranks, costs = cut.ranks, cut.costs
    if (len(ranks) != len(graph) or sorted(set(ranks.tolist())) != list(range(cut.k))
            or any(ranks[u] > ranks[v] for v in range(len(graph)) for u in graph.preds[v])
            or (cut.devices is not None and len(cut.devices) != cut.k)):
        raise UncuttableError(f"method {settings.get('method')!r} produced an invalid cut (a bug: please report)")
    members, inputs, outputs = build_plan_layout(graph, ranks)
    directory = Path(directory).absolute()
    total = float(costs.micros.sum()) or 1.0
    # the staging folder is named after this process: what a killed run leaves, the next removes
    with atomic_dir(directory) as staging:
        specs: list[PartSpec] = []
        for r, nodes in enumerate(members):
            path = staging / f"part{r}.onnx"
            save_model(_part_model(graph, nodes, inputs[r], outputs[r], r), path)
            try:
                onnx.checker.check_model(str(path))
            except onnx.checker.ValidationError as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise UncuttableError(f"part {r} fails the ONNX checker: {first}") from None
            cost = float(costs.micros[nodes].sum())
            specs.append(PartSpec(
                index=r, file=path.name, inputs=inputs[r], outputs=outputs[r], nodes=len(nodes),
                op_counts=dict(Counter(graph.nodes[v].op_type for v in nodes).most_common()),
                cost_us=round(cost, 3), share=round(cost / total, 6), target_share=float(cut.targets[r]),
                sha256=part_sha256(path),
                device=cut.devices[r] if cut.devices is not None else None,
            ))
        crossing = _crossing_specs(graph, inputs, outputs)
        plan = Plan(
            root=directory,
            parts=specs,
            inputs=_input_specs(graph, inputs),
            outputs=_output_specs(graph, outputs),
            crossing=crossing,
            cut_bytes_per_sample=sum(t.bytes_per_sample * len(t.consumers) for t in crossing),
            source=model_source(graph.loaded),
            settings=settings,
            cost_source=costs.source,
        )
        plan.hash = plan.compute_hash()
        plan.write_json(staging)
    return Plan.load(directory)


def _input_specs(graph: ModelGraph, part_inputs: list[list[str]]) -> list[TensorSpec]:
    ranges = integer_ranges(graph.model)
    specs = []
    for spec in graph.inputs:
        info = graph.tensors.get(spec.name)
        specs.append(TensorSpec(
            name=spec.name, dtype=spec.dtype,
            # a batch axis the model left unnamed (-1) takes the plan's batch symbol
            shape=[graph.batch_symbol if axis == spec.batch_axis and d is None else d
                   for axis, d in enumerate(spec.shape)],
            bytes_per_sample=info.bytes_per_sample if info else 0, batched=bool(info and info.batched),
            producer=None, consumers=[r for r, ins in enumerate(part_inputs) if spec.name in ins],
            value_range=list(ranges[spec.name]) if spec.name in ranges else None))
    return specs


def _tensor_spec(graph: ModelGraph, name: str, producer: int, consumers: list[int]) -> TensorSpec:
    info = graph.tensors[name]
    return TensorSpec(name=name, dtype=info.dtype, shape=list(info.sym_shape or []),
                      bytes_per_sample=info.bytes_per_sample, batched=info.batched,
                      producer=producer, consumers=consumers)


def _output_specs(graph: ModelGraph, part_outputs: list[list[str]]) -> list[TensorSpec]:
    return [_tensor_spec(graph, name, next(r for r, outs in enumerate(part_outputs) if name in outs), [])
            for name in graph.outputs]


def _crossing_specs(
    graph: ModelGraph, part_inputs: list[list[str]], part_outputs: list[list[str]]
) -> list[TensorSpec]:
    specs = []
    model_inputs = {i.name for i in graph.inputs}
    for r, outs in enumerate(part_outputs):
        for name in outs:
            consumers = [c for c, ins in enumerate(part_inputs) if name in ins and c != r]
            if consumers and name not in model_inputs:
                specs.append(_tensor_spec(graph, name, r, consumers))
    return specs

