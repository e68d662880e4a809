"""An ONNX model as the weighted DAG the partitioner cuts.

Vertices are the model's top-level nodes (Constant nodes excepted: they are copied into every
part that reads them, like initializers). Edges are tensors, weighted by bytes per sample.
Control-flow nodes (If/Loop/Scan) are single vertices whose inputs include the outer-scope
tensors their subgraphs read, so a cut can never separate a subgraph from its captures.

Byte sizes come from ONNX shape inference run twice on concrete shapes (batch 1 and batch 2):
the axes that double are the batch axes, which tells both the bytes per sample and which
dimensions of a crossing tensor must stay symbolic in the exported parts.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import shape_inference

from staronnx import contract
from staronnx.errors import ModelError, PartitionError
from staronnx.modelio import LoadedModel, dim_of, dtype_itemsize, is_fixed, strip_weights

@dataclass
class TensorInfo:
    """What the partitioner knows of one tensor."""

    name: str
    elem_type: int = 0
    shape1: tuple[int, ...] | None = None  # concrete shape at batch 1
    batch_axes: tuple[int, ...] = ()  # axes whose size is proportional to the batch
    sym_shape: list[int | str | None] | None = None  # for exported part inputs/outputs

    @property
    def batched(self) -> bool:
        return bool(self.batch_axes)

    @property
    def bytes_per_sample(self) -> int:
        """Bytes at batch 1 (for a tensor that does not scale with the batch: its full size)."""
        if self.shape1 is None:
            return 0
        return int(np.prod(self.shape1, dtype=np.int64)) * dtype_itemsize(self.elem_type)

    @property
    def dtype(self) -> str:
        if not self.elem_type:
            return "unknown"
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.elem_type)).name


@dataclass
class InputSpec:
    """A model input as users feed it: dims are ints or the names of dynamic dims."""

    name: str
    elem_type: int
    shape: list[int | str | None]
    #: the axis that carries the batch (the model's batching contract), None: a per-request value
    batch_axis: int | None = None

    @property
    def dtype(self) -> str:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.elem_type)).name


@dataclass
class ModelGraph:
    """The model's DAG of vertices and byte-weighted tensor edges."""

    loaded: LoadedModel
    nodes: list[onnx.NodeProto]  # vertices, in a topological order
    node_inputs: list[list[str]]  # per vertex: distinct inputs, outer-scope captures included
    const_nodes: dict[str, onnx.NodeProto]  # tensor name -> Constant node producing it
    initializers: dict[str, onnx.TensorProto]  # dense and sparse (SparseTensorProto) weights
    inputs: list[InputSpec]
    outputs: list[str]
    producer: dict[str, int]  # tensor -> vertex producing it
    consumers: dict[str, list[int]]  # tensor -> vertices reading it
    tensors: dict[str, TensorInfo]
    batch_symbol: str = "batch"
    preds: list[list[int]] = field(default_factory=list)
    succs: list[list[int]] = field(default_factory=list)

    @property
    def model(self) -> onnx.ModelProto:
        return self.loaded.model

    def __len__(self) -> int:
        return len(self.nodes)

    def edges(self) -> list[tuple[int, int, int]]:
        """Vertex-to-vertex edges (u, v, bytes), parallel tensors between a pair summed."""
        weights: dict[tuple[int, int], int] = {}
        for t, u, readers in self.links():
            nbytes = self.tensors[t].bytes_per_sample if t in self.tensors else 0
            for v in readers:
                weights[(u, v)] = weights.get((u, v), 0) + nbytes
        return [(u, v, w) for (u, v), w in sorted(weights.items())]

    def links(self) -> list[tuple[str, int, list[int]]]:
        """(tensor, producing vertex, the other vertices that read it, sorted) per produced tensor."""
        return [(t, self.producer[t], sorted(set(users) - {self.producer[t]}))
                for t, users in self.consumers.items() if t in self.producer]


def is_copied_constant(node: onnx.NodeProto) -> bool:
    """A Constant node: no vertex of its own, copied into every part that reads it."""
    return node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.output) == 1


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """A node's subgraphs (If, Loop, Scan bodies): each GRAPH attribute's body and GRAPHS one's."""
    return [g for attr in node.attribute for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs)]


def subgraph_captures(node: onnx.NodeProto) -> list[str]:
    """Outer-scope tensor names read by a node's subgraphs (recursively)."""
    return list(dict.fromkeys(name for g in subgraphs(node) for name in _graph_free_names(g)))


def _graph_free_names(graph: onnx.GraphProto) -> list[str]:
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.name for t in graph.sparse_initializer}
    free: list[str] = []
    for node in graph.node:
        for name in list(node.input) + subgraph_captures(node):
            if name and name not in defined:
                free.append(name)
        defined.update(o for o in node.output if o)
    for out in graph.output:
        if out.name not in defined:
            free.append(out.name)
    return free


def priority_topological(preds: list[list[int]], succs: list[list[int]], key: Sequence[float]) -> list[int]:
    """Kahn's order taking the ready node with the smallest ``key`` (then smallest index)."""
    n = len(preds)
    indeg = [len(set(p)) for p in preds]
    heap = [(key[v], v) for v in range(n) if indeg[v] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        _, u = heapq.heappop(heap)
        order.append(u)
        for v in set(succs[u]):
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, (key[v], v))
    if len(order) != n:
        raise ValueError("the graph has a cycle")
    return order


def _producers(nodes: list[onnx.NodeProto]) -> dict[str, int]:
    """Tensor name -> index of the node producing it."""
    return {o: i for i, n in enumerate(nodes) for o in n.output if o}


def _adjacency(producer: dict[str, int], inputs_of: list[list[str]]) -> tuple[list[list[int]], list[list[int]]]:
    """Per vertex, the distinct other vertices it reads from and those that read it, sorted."""
    preds = [sorted({producer[t] for t in ins if t in producer} - {v}) for v, ins in enumerate(inputs_of)]
    succs: list[list[int]] = [[] for _ in inputs_of]
    for v, ps in enumerate(preds):
        for u in ps:
            succs[u].append(v)
    return preds, succs


def _topological(nodes: list[onnx.NodeProto], inputs_of: list[list[str]]) -> list[int]:
    """Kahn's order, ties broken by the file's order, so valid files keep their order."""
    try:
        return priority_topological(*_adjacency(_producers(nodes), inputs_of), range(len(nodes)))
    except ValueError:
        raise ModelError("the model's graph has a cycle; ONNX graphs must be acyclic") from None


def model_inputs(model: onnx.ModelProto, batch_axes: dict[str, int | None] | None = None) -> list[InputSpec]:
    """The inputs users feed (graph inputs that are not initializers), each with its batch axis
    (:mod:`staronnx.contract`: the symbol the model's tensors share; ``batch_axes`` overrides)."""
    init = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in init:
            continue
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            raise ModelError(f"input {vi.name!r} is not a tensor; staronnx feeds tensors only")
        shape: list[int | str | None] = [dim_of(d) for d in tt.shape.dim] if tt.HasField("shape") else []
        specs.append(InputSpec(vi.name, tt.elem_type, shape))
    symbol = contract.batch_symbol({i.name: i.shape for i in specs}, declared_outputs(model))
    for spec in specs:
        spec.batch_axis = (batch_axes[spec.name] if batch_axes and spec.name in batch_axes
                           else contract.input_axis(spec.shape, symbol))
    return specs


def check_batch_axes(model: onnx.ModelProto, axes: Mapping[str, int | None]) -> None:
    """Refuse ``batch_axes`` overrides that do not fit the model (an unknown tensor, an axis past
    its rank, a fixed size other than 1), with the words the plan's contract would use.

    The plan's contract applies them whenever it is loaded: unchecked before the cut, the model
    was profiled and its plan written, and then the plan failed on every load (``show``,
    ``verify``, ``serve``) with the error the cut should have given before any work."""
    if not axes:
        return
    constants = {t.name for t in model.graph.initializer} | {t.values.name for t in model.graph.sparse_initializer}
    inputs: dict[str, list[int | str | None] | None] = {}
    for vi in model.graph.input:
        if vi.name in constants:
            continue
        tt = vi.type.tensor_type
        known = vi.type.HasField("tensor_type") and tt.HasField("shape")
        inputs[vi.name] = [dim_of(d) for d in tt.shape.dim] if known else None
    contract.BatchContract.read(inputs, declared_outputs(model), batch_axes=axes)


def declared_outputs(model: onnx.ModelProto) -> dict[str, list[int | str | None] | None]:
    """The graph outputs' shapes as the model declares them (None where it declares none)."""
    out: dict[str, list[int | str | None] | None] = {}
    for vi in model.graph.output:
        tt = vi.type.tensor_type
        out[vi.name] = [dim_of(d) for d in tt.shape.dim] if vi.type.HasField("tensor_type") and tt.HasField("shape") else None
    return out


def resolve_input_shapes(
    inputs: list[InputSpec], batch: int, given: dict[str, list[int]] | None
) -> dict[str, list[int]]:
    """Concrete feed shapes at a batch size: each input's batch axis (its contract's) takes
    ``batch``, the rest from the user.

    A dynamic dimension other than the batch has no safe default, so it must be given. A given
    ``-1`` means "as the model says": the batch on a dynamic axis 0, the model's size on a fixed
    axis, and still a missing size on any other dynamic axis.
    """
    given = given or {}
    unknown = set(given) - {i.name for i in inputs}
    if unknown:
        raise _shape_error(
            lambda arg: f"{arg} names unknown input(s) {sorted(unknown)}; "
            f"the model's inputs are {[i.name for i in inputs]}"
        )
    shapes: dict[str, list[int]] = {}
    for spec in inputs:
        user = given.get(spec.name)
        if user is not None and spec.shape and len(user) != len(spec.shape):
            rank = len(user)
            raise _shape_error(
                lambda arg: f"{arg} {spec.name}: rank {rank} given, the model's input has "
                f"rank {len(spec.shape)} {spec.shape}"
            )
        if not spec.shape:  # rank unknown to the model: take what was given as it is
            shapes[spec.name] = [int(u) for u in user or []]
            continue
        if user is None:
            user = [-1] * len(spec.shape)
        dims: list[int] = []
        for axis, (d, u) in enumerate(zip(spec.shape, user)):
            if is_fixed(d):
                if is_fixed(u) and u != d:
                    raise _shape_error(
                        lambda arg: f"{arg} {spec.name}: axis {axis} is fixed to {d} in the "
                        f"model, {u} given"
                    )
                dims.append(int(d))
            elif axis == spec.batch_axis:
                if u == 0:
                    # the batch axis is profiled at the profile batch, whatever is given: an empty
                    # batch would be silently replaced, and cannot be profiled anyway
                    name = spec.name
                    raise _shape_error(
                        lambda arg: f"{arg} {name}=...: axis {axis} is its batch axis, which is profiled at the "
                        "profile batch size, never 0 (a dimension other than the batch, such as an empty "
                        "KV-cache past, may be 0)"
                    )
                dims.append(batch)
            elif is_fixed(u):
                dims.append(int(u))
            else:
                example = "x".join(
                    str(x) if is_fixed(x) else "1" if i == spec.batch_axis else "N" for i, x in enumerate(spec.shape)
                )
                raise _shape_error(
                    lambda arg: f"input {spec.name!r} has dynamic dimension {d or '?'!r} at axis "
                    f"{axis}; give its size, e.g. {arg}",
                    python=f"input_shapes=[{spec.name + '=' + example!r}]",
                    cli=f"--input-shape {spec.name}={example}",
                )
        shapes[spec.name] = dims
    return shapes


def _shape_error(message: Callable[[str], str], python: str = "input_shapes",
                 cli: str = "--input-shape") -> PartitionError:
    """A shape error naming ``partition()``'s argument, and the CLI's option for the CLI."""
    return PartitionError(message(python), cli=message(cli))


#: what shape inference (or a probe) tells of a tensor: its element type (0: unknown) and its dims
#: (each a size, a symbol or None), None where the rank is unknown
Inferred = tuple[int, list[int | str | None] | None]


def _infer(stripped: onnx.ModelProto, shapes: dict[str, list[int]] | None) -> dict[str, Inferred]:
    """Run ONNX shape inference on a weight-stripped model (see ``strip_weights``); return
    name -> (elem_type, dims) with None for unknown dims."""
    m = onnx.ModelProto()
    m.CopyFrom(stripped)
    del m.graph.value_info[:]
    if shapes is not None:
        for vi in m.graph.input:
            if vi.name in shapes:
                tt = vi.type.tensor_type
                tt.ClearField("shape")
                for d in shapes[vi.name]:
                    tt.shape.dim.add().dim_value = int(d)
    try:
        inferred = shape_inference.infer_shapes(m, strict_mode=False, data_prop=True)
    except Exception:
        inferred = m
    out: dict[str, Inferred] = {}
    for vi in (*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input):
        if not vi.type.HasField("tensor_type"):
            continue
        tt = vi.type.tensor_type
        out[vi.name] = (tt.elem_type, [dim_of(d) for d in tt.shape.dim] if tt.HasField("shape") else None)
    return out


def _concrete(dims: list[int | str | None] | None) -> tuple[int, ...] | None:
    if dims is None:
        return None
    sizes = [d for d in dims if isinstance(d, int)]
    return tuple(sizes) if len(sizes) == len(dims) else None


def build_graph(
    loaded: LoadedModel, input_shapes: dict[str, list[int]] | None = None,
    batch_axes: dict[str, int | None] | None = None,
) -> ModelGraph:
    """Turn a loaded model into the partitioner's DAG with byte-weighted edges."""
    g = loaded.graph
    initializers: dict[str, onnx.TensorProto] = {t.name: t for t in g.initializer}
    initializers.update({t.values.name: t for t in g.sparse_initializer})
    const_nodes: dict[str, onnx.NodeProto] = {}
    vertices: list[onnx.NodeProto] = []
    for node in g.node:
        if is_copied_constant(node):
            const_nodes[node.output[0]] = node
        else:
            vertices.append(node)
    if not vertices:
        raise ModelError("the model has only Constant nodes: nothing to partition")
    inputs = model_inputs(loaded.model, batch_axes)
    input_names = {i.name for i in inputs}
    # a node with subgraphs (If, Loop, Scan) also reads what its bodies capture from outside
    node_inputs = [list(dict.fromkeys([t for t in node.input if t] + subgraph_captures(node))) for node in vertices]
    order = _topological(vertices, node_inputs)
    vertices = [vertices[i] for i in order]
    node_inputs = [node_inputs[i] for i in order]

    producer = _producers(vertices)
    consumers: dict[str, list[int]] = {}
    for v, names in enumerate(node_inputs):
        for t in names:
            known = t in producer or t in initializers or t in const_nodes or t in input_names
            if not known:
                raise ModelError(f"node {vertices[v].name!r} reads {t!r}, which nothing produces")
            consumers.setdefault(t, []).append(v)
    outputs = [o.name for o in g.output]
    for o in outputs:
        if o not in producer:
            raise ModelError(
                f"output {o!r} is not computed by any node (it is an input, initializer or "
                "constant); staronnx partitions computed outputs only"
            )

    # the symbol the exported parts' batch axes take: the model's own, "batch" where it has none
    batch_symbol = _batch_symbol(inputs)

    tensors = _tensor_infos(loaded.model, inputs, input_shapes, producer, batch_symbol)
    preds, succs = _adjacency(producer, node_inputs)
    return ModelGraph(
        loaded=loaded,
        nodes=vertices,
        node_inputs=node_inputs,
        const_nodes=const_nodes,
        initializers=initializers,
        inputs=inputs,
        outputs=outputs,
        producer=producer,
        consumers=consumers,
        tensors=tensors,
        batch_symbol=batch_symbol,
        preds=preds,
        succs=succs,
    )


def _batch_symbol(inputs: list[InputSpec]) -> str:
    """The symbol of the first input's batch axis that has one, "batch" where none has."""
    for spec in inputs:
        if spec.batch_axis is not None and spec.batch_axis < len(spec.shape):
            dim = spec.shape[spec.batch_axis]
            if isinstance(dim, str):
                return dim
    return "batch"


def _tensor_infos(
    model: onnx.ModelProto,
    inputs: list[InputSpec],
    input_shapes: dict[str, list[int]] | None,
    producer: dict[str, int],
    batch_symbol: str,
) -> dict[str, TensorInfo]:
    shapes1 = resolve_input_shapes(inputs, 1, input_shapes)
    shapes2 = resolve_input_shapes(inputs, 2, input_shapes)
    stripped = strip_weights(model)  # once: copying the weights three times costs seconds per GB
    symbolic = _infer(stripped, None)
    at1 = _infer(stripped, shapes1)
    at2 = _infer(stripped, shapes2)
    names = list(producer) + [i.name for i in inputs]
    missing = [n for n in names if _concrete(at1.get(n, (0, None))[1]) is None or not at1[n][0]]
    if missing:  # what a real run tells of them (of those names only)
        at1.update(_probe(model, missing, shapes1))
        at2.update(_probe(model, missing, shapes2))
    infos: dict[str, TensorInfo] = {}
    for name in names:
        elem, dims1 = at1.get(name, (0, None))
        _, dims2 = at2.get(name, (0, None))
        s1, s2 = _concrete(dims1), _concrete(dims2)
        batch_axes: tuple[int, ...] = ()
        if s1 is not None and s2 is not None and len(s1) == len(s2):
            batch_axes = tuple(i for i, (a, b) in enumerate(zip(s1, s2)) if b == 2 * a and a > 0)
        sym_elem, sym_dims = symbolic.get(name, (elem, None))
        sym: list[int | str | None] | None = None
        rank = len(s1) if s1 is not None else (len(sym_dims) if sym_dims is not None else None)
        if rank is not None:
            sym = []
            for axis in range(rank):
                known = sym_dims[axis] if sym_dims is not None and axis < len(sym_dims) else None
                if axis in batch_axes:
                    # a dim that is exactly the batch shares its symbol; a merged one does not
                    size = s1[axis] if s1 is not None else 1
                    sym.append(batch_symbol if size == 1 else f"{batch_symbol}*{size}")
                else:
                    sym.append(known if isinstance(known, (int, str)) else None)
        infos[name] = TensorInfo(
            name=name, elem_type=elem or sym_elem, shape1=s1, batch_axes=batch_axes, sym_shape=sym
        )
    return infos


def _probe(
    model: onnx.ModelProto, names: list[str], shapes: dict[str, list[int]]
) -> dict[str, Inferred]:
    """Shapes shape inference could not tell, read off a real ORT run with them as outputs."""
    from staronnx.feeds import random_feeds_for_shapes
    from staronnx.ortutil import make_session

    m = onnx.ModelProto()
    m.CopyFrom(model)
    existing = {o.name for o in m.graph.output}
    for n in names:
        if n not in existing:
            m.graph.output.add().name = n
    try:
        sess = make_session(m, optimize=False)
        feeds = random_feeds_for_shapes(model_inputs(model), shapes, model=model)
        values = sess.run(names, feeds)
    except Exception:
        return {}
    out: dict[str, Inferred] = {}
    for n, val in zip(names, values):
        if isinstance(val, np.ndarray):
            out[n] = (int(onnx.helper.np_dtype_to_tensor_dtype(val.dtype)), list(val.shape))
    return out
