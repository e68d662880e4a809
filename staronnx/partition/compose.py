"""Several plans composed into one: the plan of a pipeline of models (a Triton ensemble).

Why compose plans rather than merge the ONNX graphs and cut the merged graph again: each
member keeps the parts it was cut into (its own ``parts``/``shares``, its parts' placements),
so a light pre- or post-processing member stays a part of its own that the policy can put on
another CPU group than the heavy member's, and a member cut in two for a GPU and a CPU keeps
that cut. Nothing has to be measured or cut again, and a member whose file did not change keeps
its cached plan. The composed plan is an ordinary plan folder (``plan.json`` and one ONNX file
per part): the runtime runs one task graph per batch over every member's parts, the data layer
keeps each intermediate tensor on the memory node that produced it (a member's output read by
the next member is a crossing tensor like any other), and ``calibrate``, ``simulate`` and
``bound`` take it as they take any plan.

Each part file is copied with its tensors renamed: a member's inputs and outputs take the names
the composition gives them (the ensemble's tensor names), every other tensor is prefixed with the
member's label (``label/name``), so two members may use the same names (or be the same model
twice) without clashing. A member's dynamic dimensions are renamed the same way (``label.height``)
except its batch dimension, which becomes the composed plan's one :data:`BATCH` symbol: a batch
of the composition is a batch of every member. A member output nothing reads (an output the
ensemble does not map) is dropped from its part's outputs, as Triton drops it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import onnx

from staronnx.errors import PlanError
from staronnx.fsutil import atomic_dir
from staronnx.modelio import save_model
from staronnx.partition.graph import subgraphs
from staronnx.partition.whole import part_sha256
from staronnx.plan import PRECISION_SETTING, PartSpec, Plan, TensorSpec

#: the batch dimension's name in a composed plan (every member's batch symbol becomes it)
BATCH = "batch"


@dataclass(frozen=True)
class Member:
    """One member of a composition: its plan, a label unique in the composition (the prefix of
    its own tensor names), and the names its inputs and outputs take in the composed plan."""

    label: str
    plan: Plan
    #: member input or output name -> the composed plan's name (inputs must all be named)
    names: Mapping[str, str]


def compose(members: Sequence[Member], inputs: Sequence[str], outputs: Sequence[str], directory: Path,
            settings: Mapping[str, Any], shapes: Mapping[str, Sequence[int | str | None]] | None = None) -> Plan:
    """The plan running ``members`` in the order given (a member's producers before it), written
    to ``directory`` (atomically) and loaded. ``inputs``/``outputs``: the composed plan's; each
    input must be some member's input, each output some member's output. ``shapes``: a tensor's
    shape where the caller knows it better than the members (an ensemble's declared dims: a fixed
    size there replaces a member's dynamic one, so requests are checked against it).
    Raises :class:`PlanError` naming what does not fit."""
    _check_members(members, inputs, outputs)
    producers: dict[str, tuple[int, TensorSpec]] = {}  # composed name -> (global part, the member's spec)
    consumers: dict[str, list[int]] = {}
    input_specs: dict[str, TensorSpec] = {}
    layout: list[tuple[Member, PartSpec, dict[str, str], dict[str, str]]] = []
    for m in members:
        renames, symbols = _renames(m)
        first = len(layout)
        for part in m.plan.parts:
            index = first + part.index
            for name in part.inputs:
                new = renames[name]
                consumers.setdefault(new, []).append(index)
                if name in m.plan.input_names and new not in producers and new not in input_specs:
                    input_specs[new] = _renamed_spec(m.plan.tensor(name), new, symbols)
            for name in part.outputs:
                new = renames[name]
                if new in producers or new in input_specs:
                    raise PlanError(f"tensor {new!r} is produced twice (member {m.label!r} and another)")
                producers[new] = (index, _renamed_spec(m.plan.tensor(name), new, symbols))
            layout.append((m, part, renames, symbols))
    unproduced = [n for n in outputs if n not in producers]
    if unproduced:
        raise PlanError(f"output(s) {unproduced} are produced by no member")
    stray = sorted(n for n in consumers if n not in producers and n not in inputs)
    if stray:
        raise PlanError(f"tensor(s) {stray} are read by a member but are neither an input nor produced by a member")
    missing = [n for n in inputs if n not in input_specs]
    if missing:
        raise PlanError(f"input(s) {missing} are read by no member")
    wanted = set(outputs) | set(consumers)
    total = sum(p.cost_us for _, p, _, _ in layout) or 1.0
    directory = Path(directory).absolute()
    with atomic_dir(directory) as staging:
        parts: list[PartSpec] = []
        for index, (m, part, renames, symbols) in enumerate(layout):
            kept = [renames[o] for o in part.outputs if renames[o] in wanted]
            if not kept:
                raise PlanError(f"member {m.label!r}: part {part.index}'s outputs are read by nothing (map at least "
                                "one of the member's outputs to a tensor the ensemble uses)")
            model = onnx.load(str(m.plan.part_path(part.index)))
            _rename_model(model, renames, symbols, kept, f"{m.label}/")
            path = staging / f"part{index}.onnx"
            save_model(model, path)
            fed = list(dict.fromkeys(renames[i] for i in part.inputs))  # two inputs fed one tensor: one input
            parts.append(replace(part, index=index, file=path.name, inputs=fed,
                                 outputs=kept, share=round(part.cost_us / total, 6),
                                 target_share=round(part.cost_us / total, 6), sha256=part_sha256(path)))
        crossing = [replace(spec, producer=p, consumers=sorted(set(consumers[n])))
                    for n, (p, spec) in producers.items() if n in consumers]
        recorded = _input_shapes(members, inputs, shapes)
        plan = Plan(
            root=directory,
            parts=parts,
            inputs=[_shaped(replace(input_specs[n], consumers=sorted(set(consumers[n]))), shapes) for n in inputs],
            outputs=[_shaped(replace(producers[n][1], producer=producers[n][0], consumers=[]), shapes)
                     for n in outputs],
            crossing=crossing,
            cut_bytes_per_sample=sum(t.bytes_per_sample * len(t.consumers) for t in crossing),
            source={"members": [{"label": m.label, "plan": m.plan.hash, "sha256": m.plan.source.get("sha256")}
                                for m in members],
                    "sha256": hashlib.sha256(json.dumps([m.plan.hash for m in members]).encode()).hexdigest()},
            settings={**dict(settings), **({"input_shapes": {**recorded, **settings.get("input_shapes", {})}}
                                           if recorded or settings.get("input_shapes") else {})},
            cost_source=",".join(sorted({m.plan.cost_source for m in members if m.plan.cost_source})),
        )
        plan.hash = plan.compute_hash()
        plan.write_json(staging)
    return Plan.load(directory)


def _check_members(members: Sequence[Member], inputs: Sequence[str], outputs: Sequence[str]) -> None:
    """Refuse what a composition cannot hold: labels twice, a member input left unnamed, a
    member with its own per-architecture files (fp16), a composed name that looks like a
    member's own prefixed name."""
    labels = [m.label for m in members]
    if len(set(labels)) != len(labels):
        raise PlanError(f"member labels must be unique, got {labels}")
    for m in members:
        unnamed = [n for n in m.plan.input_names if n not in m.names]
        if unnamed:
            raise PlanError(f"member {m.label!r}: input(s) {unnamed} are not mapped to any tensor")
        unknown = [n for n in m.names if n not in m.plan.input_names and n not in m.plan.output_names]
        if unknown:
            raise PlanError(f"member {m.label!r} has no input or output {unknown}; its inputs are "
                            f"{m.plan.input_names}, its outputs {m.plan.output_names}")
        if m.plan.settings.get(PRECISION_SETTING):
            raise PlanError(f"member {m.label!r} has part files of its own per architecture (fp16): composing those "
                            "is not supported; serve the member with fp32 parts")
    for name in (*inputs, *outputs, *(n for m in members for n in m.names.values())):
        if any(name.startswith(label + "/") for label in labels):
            raise PlanError(f"tensor name {name!r} starts with a member's label and a slash, which the composition "
                            "keeps for the members' own tensors: rename it")


def _renames(m: Member) -> tuple[dict[str, str], dict[str, str]]:
    """A member's tensor renames (its inputs and outputs to the composed names, its crossing
    tensors prefixed) and its dimension renames (its batch symbol to :data:`BATCH`, the others
    prefixed)."""
    renames = {t.name: f"{m.label}/{t.name}" for t in m.plan.crossing}
    renames.update({n: f"{m.label}/{n}" for n in m.plan.output_names})  # outputs nothing maps keep a name
    renames.update(m.names)
    symbol = m.plan.contract.symbol  # read off the shapes, whether or not the member batches on its own
    symbols: dict[str, str] = {}
    for t in (*m.plan.inputs, *m.plan.outputs, *m.plan.crossing):
        for d in t.shape:
            if isinstance(d, str) and d not in symbols:
                symbols[d] = BATCH if d == symbol else f"{m.label}.{d}"
    return renames, symbols


def _renamed_spec(spec: TensorSpec, name: str, symbols: Mapping[str, str]) -> TensorSpec:
    return replace(spec, name=name, shape=[symbols.get(d, d) if isinstance(d, str) else d for d in spec.shape],
                   consumers=list(spec.consumers))


def _shaped(spec: TensorSpec, shapes: Mapping[str, Sequence[int | str | None]] | None) -> TensorSpec:
    """``spec`` with the fixed sizes ``shapes`` gives it where it is dynamic (same rank only)."""
    given = (shapes or {}).get(spec.name)
    if given is None or len(given) != len(spec.shape):
        return spec
    shape = [g if isinstance(g, int) and g > 0 and not isinstance(d, int) else d for d, g in zip(spec.shape, given)]
    return replace(spec, shape=shape)


def _input_shapes(members: Sequence[Member], inputs: Sequence[str],
                  shapes: Mapping[str, Sequence[int | str | None]] | None) -> dict[str, list[int]]:
    """The sizes recorded for each composed input's dynamic dimensions (what ``calibrate`` and
    ``simulate`` size a plan's inputs with): its first reader's, with the caller's fixed sizes
    over them."""
    out: dict[str, list[int]] = {}
    for name in inputs:
        for m in members:
            member_input = next((k for k, v in m.names.items() if v == name and k in m.plan.input_names), None)
            dims = m.plan.settings.get("input_shapes", {}).get(member_input) if member_input else None
            if dims is not None:
                given = list((shapes or {}).get(name) or [])
                out[name] = [int(g) if i < len(given) and isinstance(g := given[i], int) and g > 0 else int(d)
                             for i, d in enumerate(dims)]
                break
    return out


def _rename_model(model: onnx.ModelProto, renames: Mapping[str, str], symbols: Mapping[str, str],
                  outputs: Sequence[str], prefix: str) -> None:
    """Rename, in place, a part file's boundary tensors as ``renames`` says and every other
    tensor with the member's ``prefix``, its dynamic dimensions as ``symbols`` says, and keep
    only ``outputs`` (already renamed) as graph outputs."""
    names = _all_names(model.graph)
    mapping = {n: renames.get(n, prefix + n) for n in names if n}
    _rename_graph(model.graph, mapping)
    keep = set(outputs)
    kept = [o for o in model.graph.output if o.name in keep]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    fed = list({i.name: i for i in model.graph.input}.values())  # two inputs mapped to one tensor: one input
    del model.graph.input[:]
    model.graph.input.extend(fed)
    for vi in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        for dim in vi.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param in symbols:
                dim.dim_param = symbols[dim.dim_param]


def _all_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name a graph and its subgraphs (If, Loop, Scan bodies) define or read."""
    names = {i.name for i in graph.input} | {o.name for o in graph.output} | {t.name for t in graph.initializer}
    names |= {t.values.name for t in graph.sparse_initializer} | {v.name for v in graph.value_info}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        for sub in subgraphs(node):
            names |= _all_names(sub)
    return names


def _rename_graph(graph: onnx.GraphProto, mapping: Mapping[str, str]) -> None:
    """Apply ``mapping`` to every tensor name of ``graph`` and its subgraphs (one mapping for all
    scopes: every name gets the same new name wherever it appears, so outer-scope references
    from a subgraph stay bound)."""
    for vi in (*graph.input, *graph.output, *graph.value_info):
        vi.name = mapping.get(vi.name, vi.name)
    for t in graph.initializer:
        t.name = mapping.get(t.name, t.name)
    for st in graph.sparse_initializer:
        st.values.name = mapping.get(st.values.name, st.values.name)
        st.indices.name = mapping.get(st.indices.name, st.indices.name)
    for node in graph.node:
        node.input[:] = [mapping.get(n, n) if n else n for n in node.input]
        node.output[:] = [mapping.get(n, n) if n else n for n in node.output]
        for sub in subgraphs(node):
            _rename_graph(sub, mapping)
