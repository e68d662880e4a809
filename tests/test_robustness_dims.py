"""Inputs whose dynamic axes are written ``dim_value: -1`` (issue 12, defect 9).

Paddle2ONNX and some other exporters mark a dynamic axis with ``dim_value: -1`` instead of a
``dim_param``; ONNX Runtime treats it as dynamic, so must staronnx: partition, verify, plan
feeds, runtime checks and ``--input-shape`` (which also accepts ``-1``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from staronnx.partition.graph import model_inputs
from staronnx import SessionSpec
from staronnx.plan import Plan
from staronnx.verify import random_plan_feeds
from _helpers import cli


def paddle_style_model() -> onnx.ModelProto:
    """x: float[-1, 3, -1, -1] -> conv -> relu -> conv -> relu -> global mean -> y: float[-1, 4]."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("ReduceMean", ["r2"], ["y"], name="mean", axes=[2, 3], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "paddle_style",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, -1, -1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 4])],
        initializer=[w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.fixture
def model_file(tmp_path) -> Path:
    path = tmp_path / "paddle.onnx"
    onnx.save(paddle_style_model(), str(path))
    assert [d.dim_value for d in onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim] \
        == [-1, 3, -1, -1]
    return path


def test_negative_dims_are_read_as_dynamic(model_file):
    [spec] = model_inputs(onnx.load(str(model_file)))
    assert spec.shape[1] == 3
    assert [d is None or isinstance(d, str) for d in spec.shape] == [True, False, True, True]


@pytest.mark.parametrize("given", ["x=1x3x48x192", "x=-1x3x48x192"])
def test_partition_and_verify_through_the_cli(tmp_path, capsys, model_file, given):
    plan_dir = tmp_path / "plan"
    code, out, err = cli(capsys, "partition", model_file, "--parts", "2", "--costs", "estimate",
                         "--input-shape", given, "-o", plan_dir)
    assert code == 0, err
    data = json.loads((plan_dir / "plan.json").read_text())
    assert not any(isinstance(d, int) and d < 0 for t in data["inputs"] + data["outputs"]
                   + data["crossing"] for d in t["shape"])
    code, out, err = cli(capsys, "plan", "verify", plan_dir, "--model", model_file)
    assert code == 0, out + err
    assert out.rstrip().splitlines()[-1].startswith("OK")
    code, out, err = cli(capsys, "plan", "verify", plan_dir, "--model", model_file, "--batch", "3")
    assert code == 0, out + err


def test_without_a_shape_the_error_suggests_a_form_the_cli_accepts(tmp_path, capsys, model_file):
    code, _, err = cli(capsys, "partition", model_file, "--parts", "2", "--costs", "estimate",
                       "-o", tmp_path / "plan")
    assert code == 2
    line = err.strip()
    assert line.startswith("staronnx: error:") and "--input-shape x=" in line, line
    suggested = line.split("--input-shape ", 1)[1].split()[0].rstrip(";,.)")
    assert "-1" not in suggested and "N" in suggested


def test_plan_feeds_and_runtime_checks_of_a_legacy_plan_with_negative_dims(tmp_path, capsys, model_file, two_groups):
    """A plan.json written before the fix recorded -1: it loads, feeds and runs as dynamic."""
    plan_dir = tmp_path / "plan"
    assert cli(capsys, "partition", model_file, "--parts", "2", "--costs", "estimate",
               "--input-shape", "x=1x3x8x16", "-o", plan_dir)[0] == 0
    meta = plan_dir / "plan.json"
    data = json.loads(meta.read_text())
    for t in data["inputs"]:
        t["shape"] = [-1 if not isinstance(d, int) else d for d in t["shape"]]
    meta.write_text(json.dumps(data))
    plan = Plan.load(plan_dir)
    feeds = random_plan_feeds(plan, 2)
    assert feeds["x"].shape == (2, 3, 8, 16)
    plan.check_feeds({"x": np.zeros((5, 3, 4, 4), np.float32)})
    out = plan.run_reference(feeds)
    assert out["y"].shape == (2, 4)
    from staronnx import InferenceSession

    with InferenceSession(plan, spec=SessionSpec(cpu_groups=two_groups)) as sess:
        assert [d for d in sess.get_inputs()[0].shape][1] == 3
        assert not any(isinstance(d, int) and d < 0 for d in sess.get_inputs()[0].shape)
        got = sess.run(None, feeds)[0]
    np.testing.assert_allclose(got, out["y"], rtol=1e-5, atol=1e-6)


def test_a_negative_dim_other_than_minus_one_is_rejected(tmp_path, capsys, model_file):
    code, _, err = cli(capsys, "partition", model_file, "--parts", "2", "--costs", "estimate",
                       "--input-shape", "x=1x3x-2x192", "-o", tmp_path / "plan")
    assert code == 2 and "--input-shape" in err
