"""Tests of :mod:`staronnx.zoo`.

Each zoo model must be valid ONNX, run in onnxruntime on CPU at several batch sizes with
finite outputs of the declared shapes, and actually have the structure it exists to exercise
(otherwise the partitioner tests built on it would silently test less than they claim).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx.reference import ReferenceEvaluator

from staronnx import zoo

NAMES = sorted(zoo.ZOO)


# --- helpers -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models() -> dict[str, onnx.ModelProto]:
    return {name: build() for name, build in zoo.ZOO.items()}


_SESSIONS: dict[int, ort.InferenceSession] = {}


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    key = id(model)
    if key not in _SESSIONS:
        _SESSIONS[key] = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return _SESSIONS[key]


def _dims(vi: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


def _concrete(dims: list[int | str], batch: int, seq: int) -> tuple[int, ...]:
    sizes = {"batch": batch, "seq": seq}
    return tuple(sizes[d] if isinstance(d, str) else d for d in dims)


def _feeds(model: onnx.ModelProto, batch: int, seq: int = 5, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        shape = _concrete(_dims(vi), batch, seq)
        if vi.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            feeds[vi.name] = rng.integers(0, 10_000, shape, dtype=np.int64)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = _session(model)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        yield from attr.graphs


def _all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for sub in _subgraphs(node):
            yield from _all_nodes(sub)


def _reads(graph: onnx.GraphProto) -> set[str]:
    """Names read by the nodes of ``graph`` and of its subgraphs, and by subgraph outputs."""
    names: set[str] = set()
    for node in graph.node:
        names.update(node.input)
        for sub in _subgraphs(node):
            names |= _reads(sub)
            names.update(o.name for o in sub.output)
    return names


def _outer_refs(sub: onnx.GraphProto) -> set[str]:
    """Names a subgraph reads that it neither produces nor holds as initializer or input."""
    local = {i.name for i in sub.initializer} | {i.name for i in sub.input}
    local |= {o for n in _all_nodes(sub) for o in n.output}
    return {n for n in _reads(sub) if n and n not in local}


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in graph.node for o in n.output}


def _check_runs(model: onnx.ModelProto, batch: int, seq: int = 5) -> dict[str, np.ndarray]:
    """Run at ``batch``/``seq`` and check every output's shape against its declaration."""
    out = _run(model, _feeds(model, batch, seq))
    for vi in model.graph.output:
        assert out[vi.name].shape == _concrete(_dims(vi), batch, seq), vi.name
        assert np.isfinite(out[vi.name]).all(), vi.name
    return out


# --- every zoo model ---------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_checker_passes_with_full_check(models, name):
    m = models[name]
    onnx.checker.check_model(m, full_check=True)
    assert m.opset_import[0].version == zoo.OPSET
    assert m.ir_version == zoo.IR_VERSION


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch", [1, 3])
def test_runs_with_declared_output_shapes(models, name, batch):
    seq = 5 if batch == 1 else 7
    outs = _check_runs(models[name], batch, seq)
    assert set(outs) == {o.name for o in models[name].graph.output}


@pytest.mark.parametrize("name", NAMES)
def test_batch_dim_is_symbolic_everywhere(models, name):
    for vi in [*models[name].graph.input, *models[name].graph.output]:
        assert _dims(vi)[0] == "batch", vi.name


@pytest.mark.parametrize("name", NAMES)
def test_node_names_unique_and_nonempty(models, name):
    names = [n.name for n in _all_nodes(models[name].graph)]
    assert all(names)
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", NAMES)
def test_no_dead_nodes(models, name):
    g = models[name].graph
    used = _reads(g) | {o.name for o in g.output}
    dead = [n.name for n in g.node if not any(o in used for o in n.output)]
    assert not dead
    assert all(i.name in used for i in g.input)


@pytest.mark.parametrize("name", sorted(set(NAMES) - {"if"}))
def test_samples_of_a_batch_are_independent(models, name):
    """Row 0 of a batch-3 run equals a batch-1 run of that row, so a runtime may split
    batches. (Not so for ``if``: its condition sums the whole batch, by design.)"""
    m = models[name]
    feeds = _feeds(m, 3, 5, seed=7)
    full = _run(m, feeds)
    first = _run(m, {k: v[:1] for k, v in feeds.items()})
    for k in full:
        np.testing.assert_allclose(full[k][:1], first[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["chain", "if", "transformer", "wide_and_deep", "wide_fanout"])
def test_onnx_reference_agrees_with_onnxruntime(models, name):
    m = models[name]
    feeds = _feeds(m, 2, 5, seed=3)
    ref = ReferenceEvaluator(m).run(None, feeds)
    ours = _run(m, feeds)
    for vi, r in zip(m.graph.output, ref, strict=True):
        np.testing.assert_allclose(ours[vi.name], r, rtol=1e-4, atol=1e-4)


def test_builders_are_deterministic_in_seed():
    assert zoo.chain(seed=3).SerializeToString() == zoo.chain(seed=3).SerializeToString()
    assert zoo.chain(seed=3).SerializeToString() != zoo.chain(seed=4).SerializeToString()
    assert zoo.if_model(seed=1).SerializeToString() == zoo.if_model(seed=1).SerializeToString()


# --- structure of each model -------------------------------------------------------------


def test_chain_structure():
    m = zoo.chain(depth=4, width=8)
    assert len(m.graph.node) == 3 * 4 - 1
    assert {n.op_type for n in m.graph.node} == {"MatMul", "Add", "Relu"}
    assert _dims(m.graph.input[0]) == ["batch", 8]


def test_residual_has_skip_adds_between_activations(models):
    g = models["residual"].graph
    inits = {i.name for i in g.initializer}
    skips = [n for n in g.node if n.op_type == "Add" and not set(n.input) & inits]
    assert len(skips) == 3
    # The skip input of each Add comes from the block input, not from the node just before.
    producers = _producers(g)
    order = {n.name: i for i, n in enumerate(g.node)}
    for add in skips:
        srcs = [order.get(producers[t].name, -1) if t in producers else -1 for t in add.input]
        assert order[add.name] - min(srcs) > 3


def test_inception_structure(models):
    m = models["inception"]
    concats = [n for n in m.graph.node if n.op_type == "Concat"]
    assert len(concats) == 3 and all(len(n.input) == 4 for n in concats)
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("Gemm") == 1 and ops.count("GlobalAveragePool") == 1 and ops.count("Flatten") == 1
    pools = [n for n in m.graph.node if n.op_type == "MaxPool"]
    strides = sorted(next(a.ints[0] for a in p.attribute if a.name == "strides") for p in pools)
    assert strides.count(1) == 3 and strides.count(2) >= 1
    assert [o.name for o in m.graph.output] == ["logits"]
    assert _dims(m.graph.output[0]) == ["batch", 10]


def test_inception_demo_is_substantive_and_runs():
    m = zoo.inception_demo()
    onnx.checker.check_model(m, full_check=True)
    assert 50 <= len(m.graph.node) <= 150
    assert sum(n.op_type == "Concat" and len(n.input) == 4 for n in m.graph.node) == zoo.INCEPTION_DEMO_SIZES["blocks"]
    _check_runs(m, batch=2)


def test_transformer_has_two_symbolic_dims_and_attention_ops(models):
    m = models["transformer"]
    assert _dims(m.graph.input[0]) == ["batch", "seq", 64]
    assert _dims(m.graph.output[0]) == ["batch", "seq", 64]
    ops = {n.op_type for n in m.graph.node}
    assert {"LayerNormalization", "Softmax", "Erf", "Shape", "Gather", "Concat", "Reshape", "Transpose"} <= ops
    for seq in (1, 5, 7, 12):
        _check_runs(m, batch=2, seq=seq)


def test_transformer_rejects_heads_not_dividing_d_model():
    with pytest.raises(ValueError, match="multiple of heads"):
        zoo.transformer_block(d_model=30, heads=4)


def test_wide_fanout_branches_leave_input_and_differ_in_depth(models):
    g = models["wide_fanout"].graph
    readers = [n for n in g.node if "x" in n.input]
    assert len(readers) >= 8
    producers = _producers(g)

    def depth(t: str) -> int:
        n = producers.get(t)
        return 0 if n is None else 1 + max(depth(i) for i in n.input)

    (merge,) = [n for n in g.node if n.op_type == "Concat"]
    assert len(merge.input) == 10
    assert len({depth(t) for t in merge.input}) >= 3


def test_if_subgraph_reads_outer_node_outputs(models):
    m = models["if"]
    g = m.graph
    (if_node,) = [n for n in g.node if n.op_type == "If"]
    outer_nodes = {o for n in g.node for o in n.output}
    outer_inits = {i.name for i in g.initializer}
    produced_before = {o for n in g.node[: list(g.node).index(if_node)] for o in n.output}
    branches = {a.name: a.g for a in if_node.attribute}
    then_g, else_g = branches["then_branch"], branches["else_branch"]
    for sub in (then_g, else_g):
        refs = _outer_refs(sub)
        assert refs & outer_nodes - outer_inits, sub.name  # reads a tensor computed in-graph
        assert refs <= outer_nodes | outer_inits | {i.name for i in g.input}
        assert refs & outer_nodes <= produced_before
    assert _outer_refs(then_g) & outer_inits  # an outer-scope initializer
    assert else_g.initializer  # and a branch-local one
    # cond is computed in-graph, and nodes come both before and after the If.
    assert if_node.input[0] in outer_nodes
    idx = list(g.node).index(if_node)
    assert 0 < idx < len(g.node) - 1


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_if_both_branches_run_and_match_reference(models, sign):
    m = models["if"]
    x = (sign * np.abs(np.random.default_rng(0).standard_normal((3, 16)))).astype(np.float32)
    ours = _run(m, {"x": x})["y"]
    (ref,) = ReferenceEvaluator(m).run(None, {"x": x})
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


def test_if_branches_give_different_results(models):
    """Flipping the condition alone (same h, via a copy of the model with cond negated)
    changes y, so the two branches really compute different things."""
    m = onnx.ModelProto()
    m.CopyFrom(models["if"])
    cond = next(n for n in m.graph.node if n.op_type == "Greater")
    cond.op_type = "Less"
    x = np.random.default_rng(5).standard_normal((2, 16)).astype(np.float32)
    a = _run(models["if"], {"x": x})["y"]
    b = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert not np.allclose(a, b)


def test_detector_has_six_heads_and_two_outputs(models):
    m = models["detector"]
    assert [o.name for o in m.graph.output] == ["boxes", "scores"]
    assert _dims(m.graph.output[0]) == ["batch", 1008, 4]
    assert _dims(m.graph.output[1]) == ["batch", 1008, 5]
    producers = _producers(m.graph)
    heads = [producers[n.input[0]] for n in m.graph.node if n.op_type == "Transpose"]
    assert len(heads) == 6 and all(h.op_type == "Conv" for h in heads)
    concats = [n for n in m.graph.node if n.op_type == "Concat"]
    assert sorted(len(n.input) for n in concats) == [3, 3]
    scores = _check_runs(m, batch=2)["scores"]
    assert ((scores >= 0) & (scores <= 1)).all()


def test_wide_and_deep_accepts_any_int64_ids(models):
    m = models["wide_and_deep"]
    assert [(i.name, i.type.tensor_type.elem_type) for i in m.graph.input] == [
        ("ids", onnx.TensorProto.INT64),
        ("dense", onnx.TensorProto.FLOAT),
    ]
    inits = {i.name for i in m.graph.initializer}
    lookups = [n for n in m.graph.node if n.op_type == "Gather" and n.input[0] in inits]
    assert len(lookups) == len(zoo.WIDE_AND_DEEP_VOCABS)
    ids = np.array([[-1, 0, 2**62, -(2**62), 999, 10**9, 7, -123456789]] * 2, dtype=np.int64)
    dense = np.zeros((2, 13), dtype=np.float32)
    out = _run(m, {"ids": ids, "dense": dense})["logit"]
    assert out.shape == (2, 1) and np.isfinite(out).all()


# --- random_dag --------------------------------------------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_nodes=st.integers(1, 60),
    seed=st.integers(0, 2**31 - 1),
    max_fanin=st.integers(1, 4),
    batch=st.integers(1, 4),
)
def test_random_dag_is_valid_and_runs(n_nodes, seed, max_fanin, batch):
    m = zoo.random_dag(n_nodes, seed, max_fanin=max_fanin)
    onnx.checker.check_model(m, full_check=True)
    g = m.graph
    assert len(g.node) == n_nodes
    assert 1 <= len(g.input) <= 2 and len(g.output) >= 1
    reads = _reads(g)
    assert all(i.name in reads for i in g.input)
    # Outputs are exactly the node outputs nothing reads: no dead nodes, nothing missing.
    assert {o.name for o in g.output} == {n.output[0] for n in g.node} - reads
    assert all(len([i for i in n.input if not i.startswith("w_")]) <= max_fanin for n in g.node)
    out = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, _feeds(m, batch, seed=seed % 1000)
    )
    assert all(o.shape == (batch, 16) and np.isfinite(o).all() for o in out)


def test_random_dag_deterministic_and_seed_dependent():
    a = zoo.random_dag(30, seed=11).SerializeToString()
    assert a == zoo.random_dag(30, seed=11).SerializeToString()
    assert a != zoo.random_dag(30, seed=12).SerializeToString()


def test_random_dag_has_fanout_and_fanin():
    fanouts, fanins = [], []
    for seed in range(10):
        g = zoo.random_dag(40, seed).graph
        counts: dict[str, int] = {}
        for n in g.node:
            for t in n.input:
                counts[t] = counts.get(t, 0) + 1
            fanins.append(sum(not t.startswith("w_") for t in n.input))
        fanouts.append(max(counts.values()))
    assert max(fanouts) >= 3 and max(fanins) == 3


@pytest.mark.parametrize("kwargs", [dict(n_nodes=0, seed=0), dict(n_nodes=5, seed=0, max_fanin=0)])
def test_random_dag_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError):
        zoo.random_dag(**kwargs)
