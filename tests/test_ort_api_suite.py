"""``staronnx.InferenceSession`` as a drop-in for ``onnxruntime.InferenceSession`` (issue 39):
the cases ONNX Runtime's own Python API tests hold it to, on small models built here or shipped
in ``onnxruntime.datasets``. Each runs the same calls on ORT's session and staronnx's and compares
what comes back, or checks that an option staronnx cannot honour is refused, naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnxruntime import datasets

import staronnx
from staronnx.partition.checks import PartitionWarning

FAST = {"costs": "estimate"}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    """A private STARONNX_HOME per test: each session partitions its model afresh."""
    root = tmp_path / "home"
    monkeypatch.setenv("STARONNX_HOME", str(root))
    return root


def session(model: Any, sess_options: ort.SessionOptions | None = None, **kwargs: Any) -> staronnx.InferenceSession:
    """A staronnx session as an ORT script opens one (CPU), its cut's costs estimated (quick)."""
    kwargs.setdefault("partition_options", FAST)
    return staronnx.InferenceSession(model, sess_options, providers=["CPUExecutionProvider"], **kwargs)


def save(model: onnx.ModelProto, path: Path) -> str:
    onnx.save(model, str(path))
    return str(path)


def ir3_chain(initializers_as_inputs: bool) -> onnx.ModelProto:
    """An IR-3 model (opset 8) of three nodes whose weights are initializers, listed among the
    graph inputs (as mnist.onnx) or not (as mul_1.onnx): ORT runs both."""
    w1 = helper.make_tensor("w1", TensorProto.FLOAT, [4, 4], np.arange(16, dtype=np.float32) / 16)
    b1 = helper.make_tensor("b1", TensorProto.FLOAT, [4], np.ones(4, dtype=np.float32))
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])]
    if initializers_as_inputs:
        inputs += [helper.make_tensor_value_info("w1", TensorProto.FLOAT, [4, 4]),
                   helper.make_tensor_value_info("b1", TensorProto.FLOAT, [4])]
    graph = helper.make_graph(nodes, "ir3", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
                              [w1, b1])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)], ir_version=3)


def ort_run(model: Any, feeds: dict[str, Any], output_names: list[str] | None = None) -> list[Any]:
    path_or_bytes = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(path_or_bytes, providers=["CPUExecutionProvider"]).run(output_names, feeds)


# -- models ORT loads, staronnx loads ---------------------------------------------------------
def test_ir3_model_whose_initializers_are_not_inputs_runs_as_in_ort():
    """onnxruntime.datasets' mul_1.onnx (IR 3, W an initializer that is no graph input): the
    ONNX checker refuses it, ORT runs it, so staronnx runs it."""
    path = datasets.get_example("mul_1.onnx")
    x = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=np.float32)
    with session(path) as sess:
        assert [i.name for i in sess.get_inputs()] == ["X"]
        np.testing.assert_array_equal(sess.run(["Y"], {"X": x})[0], ort_run(path, {"X": x})[0])


@pytest.mark.parametrize("listed", [False, True], ids=["initializers-not-inputs", "initializers-as-inputs"])
def test_ir3_model_is_cut_into_parts_that_pass_the_checker(tmp_path, listed):
    """An IR-3 model cut in two: each part carries the initializers it reads without listing
    them as inputs (what mnist.onnx's part 0 failed the checker on), and the inputs ORT
    reports are the fed ones only."""
    model = ir3_chain(listed)
    path = save(model, tmp_path / "ir3.onnx")
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    with session(path) as sess:
        assert sess.plan.k == 2
        for index in range(sess.plan.k):
            onnx.checker.check_model(str(sess.plan.part_path(index)))
        assert [i.name for i in sess.get_inputs()] == ["x"]
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(model, {"x": x})[0], rtol=1e-6)


def test_a_model_ort_refuses_is_refused_with_both_reasons(tmp_path):
    """A model the checker refuses is asked of ORT; refused by both, the error says both."""
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Relu", ["x"], ["y"])],
                              "dup", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "dup.onnx")
    with pytest.raises(staronnx.ModelError, match="fails the ONNX checker .* ONNX Runtime cannot load it"):
        session(path)


# -- models that cannot be cut run as one part ------------------------------------------------
def one_node(op: str, elem: int, shape: list[Any], inputs: int = 1, **attrs: Any) -> onnx.ModelProto:
    names = [f"in{i}" for i in range(inputs)]
    graph = helper.make_graph([helper.make_node(op, names, ["out"], **attrs)], op.lower(),
                              [helper.make_tensor_value_info(n, elem, shape) for n in names],
                              [helper.make_tensor_value_info("out", elem, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_one_node_model_is_served_as_one_part_with_a_warning(tmp_path):
    """The default split (85/15) of a one-node model: one part, said in a PartitionWarning,
    never a PartitionError."""
    model = one_node("And", TensorProto.BOOL, [2, 2], inputs=2)
    path = save(model, tmp_path / "and.onnx")
    a = np.array([[True, True], [False, False]])
    b = np.array([[True, False], [True, False]])
    with pytest.warns(PartitionWarning, match="served as one part.*1 node"):
        sess = session(path)
    with sess:
        assert sess.plan.k == 1 and sess.plan.settings["method"] == "whole"
        np.testing.assert_array_equal(sess.run([], {"in0": a, "in1": b})[0], a & b)


def test_partition_serves_a_one_node_model_whole_by_default_and_refuses_explicit_parts(tmp_path):
    """staronnx.partition's default split serves a one-node model whole (warned); parts asked
    for explicitly are refused, naming the node count."""
    model = one_node("Relu", TensorProto.FLOAT, ["n", 4])
    with pytest.warns(PartitionWarning, match="served as one part"):
        plan = staronnx.partition(model, output_dir=tmp_path / "plan", costs="estimate")
    assert plan.k == 1 and plan.parts[0].inputs == ["in0"] and plan.contract.batchable
    with pytest.raises(staronnx.PartitionError, match="cannot cut 1 node"):
        staronnx.partition(model, parts=2, output_dir=tmp_path / "plan2", costs="estimate")


# -- strings, sequences, optionals, pass-through outputs ------------------------------------
@pytest.mark.parametrize("x", [
    np.array([["Olá", "你好"], ["여보세요", "hello"]], dtype=str),
    np.array([[b"this", b"is"], [b"identity", b"test"]]),
    np.array([["a", "b"], ["c", "d"]], dtype=object),
], ids=["str_", "bytes_", "object"])
def test_string_tensors_are_fed_as_numpy_gives_them(tmp_path, x):
    """numpy's str_ and bytes_ arrays are string tensors to ORT, not a wrong dtype."""
    path = save(one_node("Identity", TensorProto.STRING, [2, 2]), tmp_path / "strings.onnx")
    with session(path) as sess:
        assert sess.get_inputs()[0].type == "tensor(string)"
        np.testing.assert_array_equal(sess.run(None, {"in0": x})[0], ort_run(path, {"in0": x})[0])


def sequence_model() -> onnx.ModelProto:
    """A sequence in, a tensor inserted, the sequence and its length out."""
    seq = helper.make_tensor_sequence_value_info("seq", TensorProto.INT64, None)
    nodes = [helper.make_node("SequenceInsert", ["seq", "t"], ["out_seq"]),
             helper.make_node("SequenceLength", ["out_seq"], ["length"])]
    graph = helper.make_graph(nodes, "sequences", [seq, helper.make_tensor_value_info("t", TensorProto.INT64, [2, 3])],
                              [helper.make_tensor_sequence_value_info("out_seq", TensorProto.INT64, None),
                               helper.make_tensor_value_info("length", TensorProto.INT64, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_sequence_inputs_and_outputs_run_as_one_part(tmp_path):
    """Sequences in and out: the model is served whole (warned) and answers as ORT does, its
    getters saying ORT's types."""
    path = save(sequence_model(), tmp_path / "seq.onnx")
    t = np.arange(6, dtype=np.int64).reshape(2, 3)
    feeds = {"seq": [t + 1], "t": t}
    with pytest.warns(PartitionWarning, match="input 'seq' is a seq\\(tensor\\(int64\\)\\)"):
        sess = session(path)
    with sess:
        assert [(i.name, i.type, i.shape) for i in sess.get_inputs()] == [
            ("seq", "seq(tensor(int64))", []), ("t", "tensor(int64)", [2, 3])]
        assert sess.get_outputs()[0].type == "seq(tensor(int64))"
        got, want = sess.run(None, feeds), ort_run(path, feeds)
        assert len(got[0]) == 2 and int(got[1]) == 2
        for a, b in zip(got[0], want[0]):
            np.testing.assert_array_equal(a, b)
        results: list[Any] = []
        sess.run_async(["length"], feeds, lambda res, data, err: results.append((res, err)), None)
        assert int(results[0][0][0]) == 2 and results[0][1] == ""


def test_optional_input_and_output_run_as_one_part(tmp_path):
    """An optional sequence passed through Identity: fed a list, it returns the list."""
    opt = helper.make_optional_type_proto(helper.make_sequence_type_proto(
        helper.make_tensor_type_proto(TensorProto.FLOAT, None)))
    graph = helper.make_graph([helper.make_node("Identity", ["opt_in"], ["opt_out"])], "opt",
                              [helper.make_value_info("opt_in", opt)], [helper.make_value_info("opt_out", opt)])
    path = save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)]), tmp_path / "opt.onnx")
    x = [np.array([1, 2, 3, 4, 5], dtype=np.float32)]
    with session(path) as sess:
        assert sess.get_inputs()[0].type == "optional(seq(tensor(float)))"
        np.testing.assert_array_equal(sess.run(None, {"opt_in": x})[0], x)


def test_a_map_output_of_a_shipped_classifier_runs(tmp_path):
    """onnxruntime.datasets' logreg_iris.onnx: a ZipMap output (a sequence of maps)."""
    path = datasets.get_example("logreg_iris.onnx")
    x = np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32)
    with pytest.warns(PartitionWarning, match="probabilities"):
        sess = session(path)
    with sess:
        assert sess.get_outputs()[1].type == "seq(map(int64,tensor(float)))"
        got, want = sess.run(None, {"float_input": x}), ort_run(path, {"float_input": x})
        np.testing.assert_array_equal(got[0], want[0])
        assert got[1] == want[1]


def test_an_input_returned_as_an_output_is_returned(tmp_path):
    """A graph input that is also a graph output (no node computes it): served whole (by one
    ORT session: staronnx's engine tracks a tensor from the part that writes it), the input
    comes back as it went in."""
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])], "pass",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4]),
                               helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])])
    path = save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "pass.onnx")
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    with pytest.warns(PartitionWarning, match="output 'x' is the input returned as it is"):
        sess = session(path)
    with sess:
        y, back = sess.run(None, {"x": x})
        np.testing.assert_array_equal(y, -np.maximum(x, 0))
        np.testing.assert_array_equal(back, x)
