"""``staronnx.InferenceSession`` as a drop-in for ``onnxruntime.InferenceSession`` (issue 39):
the cases ONNX Runtime's own Python API tests hold it to, on small models built here or shipped
in ``onnxruntime.datasets``. Each runs the same calls on ORT's session and staronnx's and compares
what comes back, or checks that an option staronnx cannot honour is refused, naming it."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import staronnx
from staronnx import SessionSpec

# ORT's sample models; a trimmed onnxruntime-gpu (the GPU host's) leaves them out
datasets = pytest.importorskip("onnxruntime.datasets", reason="onnxruntime.datasets (ORT's sample models) is not installed")

from staronnx.partition.checks import PartitionWarning
from staronnx.partition import PartitionSpec

FAST = {"costs": "estimate"}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    """A private STARONNX_HOME per test: each session partitions its model afresh."""
    root = tmp_path / "home"
    monkeypatch.setenv("STARONNX_HOME", str(root))
    return root


def session(model: Any, sess_options: ort.SessionOptions | None = None, **kwargs: Any) -> staronnx.InferenceSession:
    """A staronnx session as an ORT script opens one (CPU), its cut's costs estimated (quick)."""
    return staronnx.InferenceSession(model, sess_options, providers=["CPUExecutionProvider"],
                                     spec=SessionSpec(**{"partition_options": FAST, **kwargs}))


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
        plan = staronnx.partition(model, spec=PartitionSpec(costs="estimate"), output_dir=tmp_path / "plan")
    assert plan.k == 1 and plan.parts[0].inputs == ["in0"] and plan.contract.batchable
    with pytest.raises(staronnx.PartitionError, match="cannot cut 1 node"):
        staronnx.partition(model, spec=PartitionSpec(parts=2, costs="estimate"), output_dir=tmp_path / "plan2")


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


def unranked_model() -> onnx.ModelProto:
    """``x`` declared with no shape at all (a tensor of any rank), added to a ranked ``b``."""
    nodes = [helper.make_node("Neg", ["x"], ["n"]), helper.make_node("Relu", ["n"], ["r"]),
             helper.make_node("Add", ["r", "b"], ["y"])]
    graph = helper.make_graph(nodes, "unranked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
                                                  helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_input_the_model_gives_no_shape_takes_any_rank_as_in_ort(tmp_path):
    """An input declared with no shape (exporters write one for a dynamic-rank tensor) takes a
    value of any rank in ORT; the session took scalars only, refusing an array with
    InvalidArgument 'expected rank 0'. Each run form answers as ORT, and a wrong dtype or a wrong
    size of the ranked input is still ORT's InvalidArgument."""
    path = save(unranked_model(), tmp_path / "unranked.onnx")
    b = np.array([0.5, -1.0, 2.0], dtype=np.float32)
    with session(path) as sess:
        assert [(i.name, i.shape) for i in sess.get_inputs()] == [("x", []), ("b", [3])]
        for x in (np.float32(-2.0), np.arange(6, dtype=np.float32).reshape(2, 3) - 3,
                  np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 4, 3)):
            feeds = {"x": np.asarray(x), "b": b}
            want = ort_run(path, feeds)[0]
            got = sess.run(None, feeds)[0]
            assert got.shape == want.shape
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(sess.submit(feeds).result()["y"], want)
            results: list[Any] = []
            sess.run_async(["y"], feeds, lambda res, data, err: results.append((res, err)), None)
            for _ in range(500):  # the callback runs on a worker's thread
                if results:
                    break
                time.sleep(0.01)
            assert results and results[0][1] == "", results
            np.testing.assert_array_equal(results[0][0][0], want)
        for bad in ({"x": np.ones((2, 3), np.float64), "b": b}, {"x": np.ones((2, 3), np.float32), "b": b[:2]}):
            with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument):
                ort_run(path, bad)
            with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument):
                sess.run(None, bad)



def test_an_input_of_no_shape_beside_a_dynamic_size_takes_any_rank_after_the_first_run(tmp_path):
    """An input of no shape beside one with a dynamic size (``t``: [N, T]), so the session is
    cut at its first run's shapes: the first run's rank of ``x`` was given to the cut, which
    fixed it in the parts, and the next run of another rank failed inside a part (ORT's
    'Invalid rank for input: x'), where ORT runs it. The cut leaves ``x`` open."""
    nodes, prev = [], "x"
    for i in range(30):  # enough nodes to be cut
        nodes.append(helper.make_node("Neg" if i % 2 else "Relu", [prev], [f"a{i}"]))
        prev = f"a{i}"
    nodes += [helper.make_node("ReduceSum", [prev], ["s"], keepdims=0), helper.make_node("Add", ["t", "s"], ["y"])]
    graph = helper.make_graph(nodes, "unranked_beside_dynamic",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("t", TensorProto.FLOAT, ["N", "T"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T"])])
    path = save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "unranked2.onnx")
    t = np.arange(10, dtype=np.float32).reshape(2, 5)
    with session(path) as sess:
        for x in (np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), np.full(4, -0.5, np.float32),
                  np.float32(-2.0), np.ones((2, 2, 2), np.float32)):
            feeds = {"x": np.asarray(x), "t": t}
            np.testing.assert_allclose(sess.run(None, feeds)[0], ort_run(path, feeds)[0], rtol=1e-6)

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


# -- SessionOptions and RunOptions: honoured, or said ------------------------------------------
def lora_model() -> onnx.ModelProto:
    """y = x @ w + (x @ a) @ b, with a and b overridable initializers (IR >= 4 initializers that
    are graph inputs too): what a LoRA adapter sets."""
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.eye(4, dtype=np.float32).ravel())
    a = helper.make_tensor("a", TensorProto.FLOAT, [4, 1], np.zeros(4, dtype=np.float32))
    b = helper.make_tensor("b", TensorProto.FLOAT, [1, 4], np.zeros(4, dtype=np.float32))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("MatMul", ["x", "a"], ["xa"]),
             helper.make_node("MatMul", ["xa", "b"], ["xab"]), helper.make_node("Add", ["xw", "xab"], ["y"])]
    graph = helper.make_graph(nodes, "lora", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
                                              helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, "rank"]),
                                              helper.make_tensor_value_info("b", TensorProto.FLOAT, ["rank", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w, a, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_optimized_model_filepath_is_written_as_ort_writes_it(tmp_path):
    """optimized_model_filepath: the whole model, optimised by ORT for these options (with the
    external initializers file its config entries ask for), where ORT writes it."""
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.bin")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "10")
    path = save(ir3_chain(False), tmp_path / "ir3.onnx")
    with session(path, so):
        written = onnx.load(so.optimized_model_filepath)
        assert (tmp_path / "weights.bin").is_file()
        assert [vi.name for vi in written.graph.input] == ["x"]
    assert not any(p.name.startswith("onnxruntime_profile") for p in Path.cwd().iterdir())


def test_add_initializer_replaces_the_models_own():
    """SessionOptions.add_initializer: the parts carry the value given, as ORT's session does."""
    so = ort.SessionOptions()
    w = ort.OrtValue.ortvalue_from_numpy(np.array([[2.0, 1.0], [4.0, 3.0], [6.0, 5.0]], dtype=np.float32))
    so.add_initializer("W", w)
    path = datasets.get_example("mul_1.onnx")
    x = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=np.float32)
    want = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    with session(path, so) as sess:
        got = sess.run(None, {"X": x})[0]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, x * w.numpy())


@pytest.mark.parametrize("how", ["by name", "as a file in memory"])
def test_external_initializers_given_in_memory_stand_for_a_missing_file(tmp_path, how):
    """An initializer whose external file is absent, given through the options (by name, or the
    file's bytes): the model loads and computes with those values. (The initializer is a graph
    input too, as in ORT's own test model: ONNX's shape inference cannot read external data.)"""
    pads = np.array([0, 0, 1, 1], dtype=np.int64)
    tensor = onnx.TensorProto(name="pads", data_type=TensorProto.INT64, dims=[4],
                              data_location=TensorProto.EXTERNAL)
    tensor.external_data.add(key="location", value="pads_not_on_disk.bin")
    tensor.external_data.add(key="offset", value="0")
    tensor.external_data.add(key="length", value=str(pads.nbytes))
    graph = helper.make_graph([helper.make_node("Pad", ["x", "pads"], ["y"])], "pad",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2]),
                               helper.make_tensor_value_info("pads", TensorProto.INT64, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [tensor])
    path = save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "pad.onnx")
    so = ort.SessionOptions()
    if how == "by name":
        so.add_external_initializers(["pads"], [ort.OrtValue.ortvalue_from_numpy(pads)])
    else:
        content = pads.tobytes()  # ORT reads it where it is: it must outlive the sessions
        so.add_external_initializers_from_files_in_memory(["pads_not_on_disk.bin"], [content], [len(content)])
    x = np.array([[1.0, 2.0]], dtype=np.float32)
    want = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with session(path, so) as sess:
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], want)
    np.testing.assert_array_equal(want, np.pad(x, [(0, 1), (0, 1)]))
    with pytest.raises(staronnx.ModelError, match="external data file missing"):
        session(path, ort.SessionOptions())


@pytest.mark.parametrize("how", ["name", "denotation"])
def test_free_dimension_overrides_fix_the_inputs(tmp_path, how):
    """Free dimension overrides (by name or by denotation) fix the inputs' sizes, as ORT's
    get_inputs reports them, and feeds are checked against them."""
    model = one_node("Abs", TensorProto.FLOAT, ["Dim1", "Dim2", 5])
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[0].denotation, dims[1].denotation = "DATA_BATCH", "DATA_CHANNEL"
    path = save(model, tmp_path / "abs.onnx")
    so = ort.SessionOptions()
    if how == "name":
        so.add_free_dimension_override_by_name("Dim1", 4)
        so.add_free_dimension_override_by_name("Dim2", 6)
    else:
        so.add_free_dimension_override_by_denotation("DATA_BATCH", 4)
        so.add_free_dimension_override_by_denotation("DATA_CHANNEL", 6)
    with session(path, so) as sess:
        assert sess.get_inputs()[0].shape == ort.InferenceSession(path, so).get_inputs()[0].shape == [4, 6, 5]
        x = -np.ones((4, 6, 5), dtype=np.float32)
        np.testing.assert_array_equal(sess.run(None, {"in0": x})[0], -x)
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="axis 0 must be 4"):
            sess.run(None, {"in0": x[:2]})


def test_the_ort_config_in_a_model_is_read_where_ort_reads_it(tmp_path, monkeypatch):
    """A model's ort_config metadata: read with ORT_LOAD_CONFIG_FROM_MODEL=1 (profiling starts,
    the thread counts are the session's), ignored without, as ORT does."""
    model = ir3_chain(False)
    helper.set_model_props(model, {"ort_config": '{"session_options": {"inter_op_num_threads": 5, '
                                                 '"intra_op_num_threads": 1, "enable_profiling": 1}}'})
    path = save(model, tmp_path / "config.onnx")
    monkeypatch.chdir(tmp_path)
    with session(path) as plain:
        assert plain.get_session_options().inter_op_num_threads == 0
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    with pytest.warns(staronnx.compat.OptionNotApplied, match="inter_op_num_threads=5"):
        sess = session(path)
    with sess:
        options = sess.get_session_options()
        assert (options.inter_op_num_threads, options.intra_op_num_threads, options.enable_profiling) == (5, 1, True)
        sess.run(None, {"x": np.ones((3, 4), dtype=np.float32)})
        assert Path(sess.end_profiling()).is_file()


def test_options_the_workers_do_not_apply_are_said():
    """Performance settings of ORT's own pools are warned of, each named, not silently dropped:
    the session's, and a run's (once per session)."""
    so = ort.SessionOptions()
    so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    so.enable_mem_pattern = False
    so.add_session_config_entry("session.use_env_allocators", "1")
    with pytest.warns(staronnx.compat.OptionNotApplied,
                      match="execution_mode=.*enable_mem_pattern=False.*session.use_env_allocators=1"):
        sess = session(datasets.get_example("mul_1.onnx"), so)
    run = ort.RunOptions()
    run.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    x = np.ones((3, 2), dtype=np.float32)
    with sess:
        with pytest.warns(staronnx.compat.OptionNotApplied, match="enable_memory_arena_shrinkage=cpu:0"):
            sess.run(None, {"X": x}, run)
        with warnings.catch_warnings():
            warnings.simplefilter("error", staronnx.compat.OptionNotApplied)
            sess.run(None, {"X": x}, run)


@pytest.mark.parametrize("entry", ["optimization.enable_gelu_approximation", "session.disable_quant_qdq",
                                   "optimization.disable_specified_optimizers", "session.strict_shape_type_inference"])
def test_config_entries_that_change_what_ort_computes_are_said(entry):
    """Config entries that change ORT's answers or what it accepts (Gelu approximated, QDQ
    kept, optimizers off, strict inference) are not applied by the workers' sessions: each is
    said, as the module's table promises of every option, not silently dropped (bert_tiny
    with the Gelu approximation differs from ORT's by 1.4e-5, with no word)."""
    so = ort.SessionOptions()
    so.add_session_config_entry(entry, "1")
    with pytest.warns(staronnx.compat.OptionNotApplied, match=f"config entry {entry}=1"):
        session(datasets.get_example("mul_1.onnx"), so).close()


def test_a_lora_adapter_in_run_options_is_applied(tmp_path):
    """RunOptions.add_active_adapter: the adapter's parameters replace the overridable
    initializers for that run (a variant of the model, cut once); without it the base model
    answers; feeding them by name does the same, as ORT allows."""
    model = lora_model()
    path = save(model, tmp_path / "lora.onnx")
    adapter_file = tmp_path / "lora.onnx_adapter"
    params = {"a": np.ones((4, 1), dtype=np.float32), "b": np.full((1, 4), 2.0, dtype=np.float32)}
    adapter = ort.AdapterFormat()
    adapter.set_adapter_version(1)
    adapter.set_model_version(1)
    adapter.set_parameters({k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in params.items()})
    adapter.export_adapter(str(adapter_file))
    lora = ort.LoraAdapter()
    lora.Load(str(adapter_file))
    with_adapter = ort.RunOptions()
    with_adapter.add_active_adapter(lora)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    reference = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    with session(path) as sess:
        assert [i.name for i in sess.get_overridable_initializers()] == ["a", "b"]
        np.testing.assert_allclose(sess.run(None, {"x": x}, ort.RunOptions())[0], x)
        adapted = sess.run(None, {"x": x}, with_adapter)[0]
        np.testing.assert_allclose(adapted, reference.run(None, {"x": x}, with_adapter)[0])
        np.testing.assert_allclose(adapted, x + (x @ params["a"]) @ params["b"])
        np.testing.assert_allclose(sess.run(None, {"x": x, **params})[0], adapted)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], x)


def test_an_overridable_initializer_fed_with_the_wrong_type_or_shape_is_refused_as_ort_refuses_it(tmp_path, home):
    """A fed initializer is checked as an input is, before anything is cut: the wrong dtype or a
    size its declared shape fixes is ORT's InvalidArgument naming it, and no variant of the
    model is cut for it (it was: a plan made in the home, then ONNX Runtime's load failure)."""
    path = save(lora_model(), tmp_path / "lora.onnx")
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    reference = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    bad = {"wrong dtype": {"a": np.ones((4, 1), np.float64)}, "wrong size": {"b": np.ones((1, 5), np.float32)},
           "wrong rank": {"a": np.ones(4, np.float32)}}
    with session(path) as sess:
        plans = sorted((home / "plans").iterdir())
        for why, fed in bad.items():
            with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument):
                reference.run(None, {"x": x, **fed})
            with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match=next(iter(fed))):
                sess.run(None, {"x": x, **fed})
        assert sorted((home / "plans").iterdir()) == plans, "a variant was cut for a feed ORT refuses"
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], x)


def test_run_options_terminate_stops_the_run():
    """RunOptions.terminate: the run does not start, with ORT's words."""
    options = ort.RunOptions()
    options.terminate = True
    x = np.ones((3, 2), dtype=np.float32)
    with session(datasets.get_example("mul_1.onnx")) as sess, pytest.raises(RuntimeError, match="terminate flag"):
        sess.run(None, {"X": x}, options)



def test_run_options_terminate_raises_ort_s_fail_in_every_run_form():
    """ORT raises its Fail for a terminated run (run, run_with_ort_values): a script's
    'except Fail' catches staronnx's too."""
    options = ort.RunOptions()
    options.terminate = True
    x = np.ones((3, 2), dtype=np.float32)
    path = datasets.get_example("mul_1.onnx")
    for sess in (ort.InferenceSession(path, providers=["CPUExecutionProvider"]), session(path)):
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="terminate flag"):
            sess.run(None, {"X": x}, options)
        with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="terminate flag"):
            sess.run_with_ort_values(None, {"X": ort.OrtValue.ortvalue_from_numpy(x)}, options)
        if hasattr(sess, "close"):
            sess.close()

# -- ORT's methods ---------------------------------------------------------------------------
def add_mul_add(tmp_path: Path) -> str:
    nodes = [helper.make_node("Add", ["a", "b"], ["s"], name="add_0"),
             helper.make_node("Mul", ["s", "b"], ["m"], name="mul_0"),
             helper.make_node("Add", ["m", "a"], ["c"], name="add_1")]
    graph = helper.make_graph(nodes, "add_mul_add", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2])
                                                     for n in "ab"],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 2])])
    return save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "amd.onnx")


def test_memory_infos_and_ep_devices_say_host_memory(tmp_path):
    path = add_mul_add(tmp_path)
    reference = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    with session(path) as sess:
        for get in ("get_input_memory_infos", "get_output_memory_infos"):
            got, want = getattr(sess, get)(), getattr(reference, get)()
            assert [(m.name, m.device_id, m.mem_type) for m in got] == [(m.name, m.device_id, m.mem_type) for m in want]
        assert [d.ep_name for d in sess.get_input_epdevices()] == [d.ep_name for d in reference.get_input_epdevices()]


def test_graph_assignment_info_is_ort_answer_for_the_parts(tmp_path):
    """With ORT's config entry, which provider runs each node of each part (all three nodes,
    over both parts, on the CPU); without it, ORT's Fail with ORT's words."""
    path = add_mul_add(tmp_path)
    with session(path) as sess, pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail,
                                              match="record_ep_graph_assignment_info' must be set"):
        sess.get_provider_graph_assignment_info()
    so = ort.SessionOptions()
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    with session(path, so) as sess:
        assert sess.plan.k == 2
        subgraphs = sess.get_provider_graph_assignment_info()
        assert {s.ep_name for s in subgraphs} == {"CPUExecutionProvider"}
        assert sorted(f"{n.op_type}/{n.name}" for s in subgraphs for n in s.get_nodes()) == [
            "Add/add_0", "Add/add_1", "Mul/mul_0"]


def test_set_providers_starts_the_workers_again(tmp_path):
    """set_providers: a provider ORT does not know is ORT's RuntimeError; a known one starts
    the workers again, on the same plan, and the session answers as before."""
    path = add_mul_add(tmp_path)
    feeds = {"a": np.ones((2, 2), np.float32), "b": np.full((2, 2), 2.0, np.float32)}
    with session(path) as sess:
        before, first = sess.run(None, feeds)[0], sess.runtime
        with pytest.raises(RuntimeError, match="Unknown Provider Type: InvalidProvider"):
            sess.set_providers(["InvalidProvider"])
        sess.set_providers(["CPUExecutionProvider"])
        assert sess.runtime is not first and sess.get_providers() == ["CPUExecutionProvider"]
        np.testing.assert_array_equal(sess.run(None, feeds)[0], before)
        with pytest.raises(staronnx.runtime.engine.EngineClosed):
            first.run(feeds)


def test_the_c_session_run_with_ort_values_answers_an_ort_value_vector(tmp_path):
    path = add_mul_add(tmp_path)
    feeds = {n: ort.OrtValue.ortvalue_from_numpy(np.ones((2, 2), np.float32)) for n in "ab"}
    with session(path) as sess:
        vector = sess._sess.run_with_ort_values({n: v._get_c_value() for n, v in feeds.items()}, ["c"],
                                               ort.RunOptions())
        assert isinstance(vector, ort.capi.onnxruntime_pybind11_state.OrtValueVector) and len(vector) == 1


# -- sessions clean up as ORT's do -----------------------------------------------------------
def run_script(tmp_path: Path, body: str) -> str:
    """Run ``body`` in a fresh Python (its STARONNX_HOME private) and return its stdout."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          env={**__import__("os").environ, "STARONNX_HOME": str(tmp_path / "home")})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_session_never_closed_stops_its_workers_before_the_process_waits_on_them(tmp_path):
    """ORT's users never call close(): at exit, the workers are stopped before Python's exit
    hooks run (the workers' own hook then has no worker left to wait 5 s for), and a session
    garbage-collected stops its workers' threads."""
    out = run_script(tmp_path, f"""
        import atexit, gc, threading
        import numpy as np
        import staronnx

        def open_one():
            sess = staronnx.InferenceSession({add_mul_add(tmp_path)!r}, providers=["CPUExecutionProvider"],
                                             spec=staronnx.SessionSpec(partition_options={{"costs": "estimate"}}))
            sess.run(None, {{"a": np.ones((2, 2), np.float32), "b": np.ones((2, 2), np.float32)}})
            return sess, {{w.name for w in sess.runtime.workers}}

        def alive(names):
            return sorted(t.name for t in threading.enumerate() if t.name in names)

        dropped, names = open_one()
        assert alive(names), "the workers run while the session is open"
        del dropped
        gc.collect()
        print("after gc:", alive(names))
        kept, names = open_one()
        atexit.register(lambda: print("at exit:", alive(names), flush=True))  # runs before the workers' own hook
    """)
    assert "after gc: []" in out and "at exit: []" in out, out


def test_a_program_that_makes_staronnx_its_ort_session_class_still_runs(tmp_path):
    """onnxruntime.InferenceSession = staronnx.InferenceSession for a whole program: staronnx's
    own sessions of the parts stay ORT's (they partitioned again and deadlocked on their plan's
    lock)."""
    out = run_script(tmp_path, f"""
        import numpy as np
        import onnxruntime
        import staronnx

        onnxruntime.InferenceSession = staronnx.InferenceSession
        sess = onnxruntime.InferenceSession({add_mul_add(tmp_path)!r}, providers=["CPUExecutionProvider"],
                                            spec=staronnx.SessionSpec(partition_options={{"costs": "estimate"}}))
        out = sess.run(None, {{"a": np.ones((2, 2), np.float32), "b": np.ones((2, 2), np.float32)}})[0]
        print(type(sess).__module__, sess.plan.k, out.tolist())
    """)
    assert out.strip() == "staronnx.compat.session 2 [[3.0, 3.0], [3.0, 3.0]]"


# -- every model of onnx's backend test data that ORT runs ------------------------------------
BACKEND = Path(onnx.__file__).parent / "backend" / "test" / "data"


def backend_case(folder: Path) -> tuple[dict[str, np.ndarray], list[Any]] | None:
    """(feeds, ORT's outputs) of a backend test model's first data set, None where ORT cannot
    run it (there staronnx owes nothing)."""
    model = onnx.load(str(folder / "model.onnx"))
    constants = {t.name for t in model.graph.initializer}
    names = [vi.name for vi in model.graph.input if vi.name not in constants]
    feeds = {}
    for name, file in zip(names, sorted((folder / "test_data_set_0").glob("input_*.pb"))):
        tensor = onnx.TensorProto()
        tensor.ParseFromString(file.read_bytes())
        feeds[name] = onnx.numpy_helper.to_array(tensor)
    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        return feeds, ort.InferenceSession(str(folder / "model.onnx"), so, providers=["CPUExecutionProvider"]).run(
            None, feeds)
    except Exception:  # noqa: BLE001 - ORT's refusal: not a case
        return None


@pytest.mark.parametrize("folder", sorted(p.parent for p in BACKEND.glob("*/*/model.onnx")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_backend_test_model_ort_runs_runs_with_ort_answer(folder):
    """Each model of onnx's backend test data (as this onnx wheel ships it) that ORT runs:
    staronnx's session opens it (cut, or served whole) and answers ORT's answer."""
    case = backend_case(folder)
    if case is None:
        pytest.skip("ONNX Runtime cannot run this model either")
    feeds, want = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PartitionWarning)
        sess = session(str(folder / "model.onnx"))
    with sess:
        got = sess.run(None, feeds)
    for a, b in zip(got, want):
        if np.asarray(b).dtype == object:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
