"""The offline command-line doors on the real exported models (issue 34): partition, plan show,
plan verify, calibrate and run, each through ``staronnx ...`` as a user types it.

The models of ``models/real/`` carry what hand-built test graphs do not: a state whose
batch is on axis 1 (gru_stream), a time-major output (crnn_ocr), a fixed batch of 1
(mobilenet_b1, detector_nms), dynamic image sizes, an ``If`` + ``NonMaxSuppression``. Each
command must batch on each tensor's own axis, never claim a batch it did not run, count a
failure as a failure, and say a model's error in one line.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import realmodels
from _helpers import cli
from staronnx.perfmodels import PerfModelStore
from staronnx.plan import Plan
from staronnx.partition import PartitionSpec

#: ORT's own log line (printed from C++ to the process's stderr, red on a terminal)
ORT_LOG = "[E:onnxruntime"


def _shape_args(name: str) -> list[str]:
    return [a for item in realmodels.input_shapes(name) for a in ("--input-shape", item)]


def _partition(capfd, name: str, out: Path, *extra: str) -> tuple[int, str, str]:
    return cli(capfd, "partition", realmodels.path(name), "-o", out, "--profile-runs", "1", "--profile-batch", "1",
               *_shape_args(name), *extra)


def _one_line_error(err: str) -> str:
    """The one error line of a command's stderr, checking there is no traceback and no ORT log."""
    assert "Traceback" not in err and ORT_LOG not in err, err
    errors = [line for line in err.splitlines() if line.startswith("staronnx: error:")]
    assert len(errors) == 1, err
    return errors[0]


# -- partition and plan show: the batching contract ------------------------------------------
def test_partition_takes_batch_axes_and_no_batching_and_plan_show_states_the_contract(capfd, tmp_path):
    code, out, err = _partition(capfd, "gru_stream", tmp_path / "gru", "--costs", "estimate",
                                "--batch-axis", "state=none")
    assert code == 0, err
    assert "input state: per request (no batch axis)" in out and "batching contract (set for state)" in out
    assert Plan.load(tmp_path / "gru").settings["batch_axes"] == {"state": None}

    code, out, err = _partition(capfd, "crnn_ocr", tmp_path / "crnn", "--costs", "estimate", "--no-batching")
    assert code == 0, err
    assert Plan.load(tmp_path / "crnn").contract.why_not == "batching is off (--no-batching)"
    code, shown, err = cli(capfd, "plan", "show", tmp_path / "crnn")
    assert code == 0, err
    assert "one request per task (max_batch_size 0): batching is off (--no-batching)" in shown

    code, _, err = _partition(capfd, "gru_stream", tmp_path / "bad", "--costs", "estimate", "--batch-axis", "state")
    assert code == 2 and "--batch-axis 'state': expected NAME=AXIS" in _one_line_error(err)


def test_plan_show_says_the_sizes_given_were_for_profiling_and_the_plan_serves_others(capfd, real_plan):
    """A plan cut at one size runs every size the model accepts: crnn cut at width 148 verifies
    at width 200 (its output time-major, the batch on axis 1), the detector cut at 192x256
    verifies at 64x64, the UNet at another height and width."""
    plan = real_plan("crnn_ocr")
    code, out, err = cli(capfd, "plan", "show", plan.root)
    assert code == 0, err
    assert "input image: batch on axis 0" in out and "output log_probs: batch on axis 1" in out
    assert "requests are batched together" in out
    assert re.search(r"input shapes image=1x1x32x148 were for profiling only: the plan serves every size", out), out
    for name, other in (("crnn_ocr", "image=1x1x32x200"), ("detector_nms", "image=1x3x64x64"),
                        ("unet_seg", "image=1x3x32x48")):
        plan = real_plan(name)
        code, out, err = cli(capfd, "plan", "verify", plan.root, "--model", realmodels.path(name),
                             "--input-shape", other, "--batch", 1)
        assert code == 0 and "OK (tolerance" in out, (name, out, err)
        dims = other.split("=")[1]
        assert f"inputs: image {dims}" in out


# -- partition: cuts that mean nothing, ORT's log ---------------------------------------------
def _if_body_model(path: Path) -> Path:
    """A model whose body is one ``If`` (its branches read ``x`` from the outer scope), its two
    outputs handed on by ``Identity`` nodes, as exporters leave them."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    branch = {}
    for name, ops in (("then", ("Relu", "Sigmoid")), ("else", ("Neg", "Tanh"))):
        nodes = [helper.make_node(op, ["x"], [f"{name}{i}"]) for i, op in enumerate(ops)]
        outs = [helper.make_tensor_value_info(f"{name}{i}", TensorProto.FLOAT, None) for i in range(2)]
        branch[name] = helper.make_graph(nodes, name, [], outs)
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["a", "b"], then_branch=branch["then"], else_branch=branch["else"]),
         helper.make_node("Identity", ["a"], ["y"]), helper.make_node("Identity", ["b"], ["z"])],
        "if_body", [helper.make_tensor_value_info("cond", TensorProto.BOOL, []), x],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def test_partition_warns_of_a_part_that_computes_nothing_and_of_missed_shares(capfd, tmp_path):
    model = _if_body_model(tmp_path / "if_body.onnx")
    code, out, err = cli(capfd, "partition", model, "-o", tmp_path / "plan", "--costs", "estimate")
    assert code == 0, err
    plan = Plan.load(tmp_path / "plan")
    idle = [p for p in plan.parts if set(p.op_counts) == {"Identity"}]
    assert idle, [p.op_counts for p in plan.parts]  # the cut the issue saw: the If, then Identity
    warnings = [line for line in err.splitlines() if line.startswith("staronnx: warning:")]
    assert any(f"part {idle[0].index} computes nothing (Identity" in w and "--parts 1" in w for w in warnings), err
    assert any("miss the targets 0.50,0.50 by more than the tolerance 0.02" in w and "--shares" in w
               for w in warnings), err
    assert "parts=1" not in err  # the CLI's words, not the Python API's
    # the same through the Python API: PartitionWarnings, worded for Python
    from staronnx.partition.api import partition
    from staronnx.partition.checks import PartitionWarning

    with pytest.warns(PartitionWarning, match=r"computes nothing .*parts=1"):
        partition(str(model), spec=PartitionSpec(costs="estimate"), output_dir=tmp_path / "api")


def test_a_cut_of_unknown_or_no_bytes_is_named(capfd, tmp_path):
    """A crossing tensor whose size neither shape inference nor a probe run could tell counts 0
    bytes per sample (the issue's If model was cut so), and parts that share no tensor carry
    nothing at all: each is named, with a way out. Here the If's outputs have known sizes, so the
    plan is altered in memory to hold each case."""
    from staronnx.partition.checks import cut_issues

    code, _, err = cli(capfd, "partition", _if_body_model(tmp_path / "if_body.onnx"), "-o", tmp_path / "plan",
                       "--costs", "estimate")
    assert code == 0, err
    plan = Plan.load(tmp_path / "plan")
    assert all(t.bytes_per_sample > 0 for t in plan.crossing)  # sizes known now: no such warning above
    assert "0 bytes per sample" not in err
    plan.crossing[0].bytes_per_sample = 0
    (issue,) = [i for i in cut_issues(plan, 0.02) if "0 bytes per sample" in i.cli]
    assert f"crossing tensor(s) {plan.crossing[0].name!r} (part 0 to 1) carry 0 bytes" in issue.cli
    assert "--parts 1" in issue.cli and "parts=1" in issue.message
    plan.crossing.clear()
    assert any("the cut carries nothing: the 2 parts share no tensor" in i.cli for i in cut_issues(plan, 0.02))


def test_partition_summarises_a_failed_profiling_run_in_one_line_without_ort_log(capfd, tmp_path):
    """UNet heights must be multiples of 4: at 30x30 ONNX Runtime fails inside the graph (a skip
    Concat). Partition falls back to estimated costs and says so once; ORT's red log lines (its
    C++ logger writes to the process's stderr) do not leak."""
    code, out, err = cli(capfd, "partition", realmodels.path("unet_seg"), "-o", tmp_path / "plan",
                         "--input-shape", "image=1x3x30x30", "--profile-runs", "1", "--profile-batch", "1")
    assert code == 0, err
    assert ORT_LOG not in err and ORT_LOG not in out, err
    failed = [line for line in err.splitlines() if "failed to run" in line]
    assert len(failed) == 1, err
    assert failed[0].startswith("staronnx: warning: the model failed to run on cpu at image=1x3x30x30 while profiling "
                                "(Concat node '/Concat': Non concat axis dimensions must match"), failed[0]
    assert "--input-shape" in failed[0] and "estimated from FLOPs and bytes" in out + failed[0]


def test_partition_of_the_detector_prints_no_ort_log(capfd, tmp_path):
    """The detector (If + NonMaxSuppression, data-dependent output size) partitions in 2 and at
    0.85/0.15 with nothing on stderr but staronnx's own one-line warnings."""
    for shares in ([], ["--shares", "0.85,0.15"]):
        code, out, err = _partition(capfd, "detector_nms", tmp_path / f"plan{len(shares)}", *shares)
        assert code == 0, err
        assert ORT_LOG not in err + out
        assert all(line.startswith("staronnx: warning: ") for line in err.splitlines() if line.strip()), err


# -- plan verify --batch -----------------------------------------------------------------------
def test_verify_runs_the_batch_it_names_on_each_inputs_own_axis(capfd, real_plan):
    plan = real_plan("gru_stream")
    code, out, err = cli(capfd, "plan", "verify", plan.root, "--model", realmodels.path("gru_stream"), "--batch", 3)
    assert code == 0, err
    assert "inputs: frame 3x256, state 2x3x64, sample_rate scalar" in out
    assert "batch 3 (random inputs)" in out and "2x3x64" in out and "OK (tolerance" in out


def test_verify_refuses_an_input_shape_for_an_input_the_plan_lacks_or_at_another_rank(capfd, real_plan):
    """``plan verify --input-shape`` used to ignore a name the plan has no input of (a typo ran
    the recorded shape and said OK); now it is one line, as calibrate's, in both doors."""
    from staronnx.errors import PlanError
    from staronnx.verify import feed_shapes

    plan = real_plan("crnn_ocr")
    for given, words in (("imgae=1x1x32x148", "--input-shape names unknown input 'imgae'; the plan's inputs are"),
                         ("image=1x32x148", "--input-shape image=1x32x148: rank 3 given")):
        code, out, err = cli(capfd, "plan", "verify", plan.root, "--model", realmodels.path("crnn_ocr"),
                             "--input-shape", given)
        assert code == 2 and words in _one_line_error(err), err + out
    with pytest.raises(PlanError, match="input_shapes names unknown input 'imgae'"):
        feed_shapes(plan, 1, {"imgae": [1, 1, 32, 148]})


@pytest.mark.parametrize("name", realmodels.ONE_PER_TASK)
def test_verify_of_a_model_that_runs_one_request_per_task_verifies_batch_1_and_says_why(capfd, real_plan, name):
    plan = real_plan(name)
    code, out, err = cli(capfd, "plan", "verify", plan.root, "--model", realmodels.path(name), "--batch", 4)
    assert code == 0, err
    assert "batch 4 is impossible for this model: no input has a dynamic batch dimension" in out
    assert "batch 1 (random inputs)" in out and "batch 4 (random" not in out and "OK (tolerance" in out


def test_a_models_error_is_one_line_naming_the_input_in_verify_and_run(capfd, tmp_path):
    """The issue's ``Input initial_h must have shape {1,4,128}``: a state whose batch axis the
    user declared away (``--batch-axis state=none``) fails inside the model's GRU at batch 2.
    verify and run say so in one line naming ``state`` and its axis; run counts the requests
    failed and reports no throughput."""
    code, _, err = _partition(capfd, "gru_stream", tmp_path / "plan", "--costs", "estimate",
                              "--batch-axis", "state=none")
    assert code == 0, err
    code, out, err = cli(capfd, "plan", "verify", tmp_path / "plan", "--model", realmodels.path("gru_stream"),
                         "--batch", 2)
    line = _one_line_error(err)
    assert code == 2 and "at batch 2 on input 'state' (shape [2, 1, 64]; no batch axis in the plan's contract)" in line
    assert "GRU node '/gru/GRU': Input initial_h must have shape {1,2,64}" in line, line

    code, out, err = cli(capfd, "run", tmp_path / "plan", "--batch", 2, "--requests", 3, "--groups", "1",
                         "--policy", "eager", "-q")
    assert code == 2 and "Traceback" not in err
    assert "0 completed, 3 failed; 0 samples computed" in out and "samples/s" not in out, out
    errors = [line for line in err.splitlines() if line.startswith("staronnx: error:")]
    assert len(errors) == 1 and "3 of 3 requests failed; the first: the model fails at batch 2 on input 'state'" \
        in errors[0], err


# -- run --batch ---------------------------------------------------------------------------------
def test_run_of_a_fixed_batch_model_counts_the_samples_it_computed(capfd, real_plan):
    plan = real_plan("mobilenet_b1")
    code, out, err = cli(capfd, "run", plan.root, "--batch", 4, "--requests", 3, "--groups", "1",
                         "--policy", "eager", "-q")
    assert code == 0, err
    assert "batch 4 is impossible for this model" in out and "one request per task" in out
    assert "3 requests x batch 1 with eager" in out and "3 completed; 3 samples computed" in out, out


def test_run_batches_a_state_on_its_own_axis(capfd, real_plan):
    plan = real_plan("gru_stream")
    code, out, err = cli(capfd, "run", plan.root, "--batch", 3, "--requests", 2, "--groups", "1",
                         "--policy", "eager", "-q")
    assert code == 0, err
    assert "2 requests x batch 3 with eager" in out and "2 completed; 6 samples computed" in out, out


# -- calibrate -----------------------------------------------------------------------------------
def _rows(plan: Plan) -> list:
    return PerfModelStore().rows(plan.hash)


def test_calibrate_puts_each_batch_on_each_inputs_axis(capfd, real_plan, monkeypatch, tmp_path):
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path))
    plan = real_plan("gru_stream")
    code, out, err = cli(capfd, "calibrate", plan.root, "--batch-sizes", "1,2", "--groups", "1", "--max-runs", 12,
                         "--no-bus")
    assert code == 0, err
    assert {(r.part, r.batch) for r in _rows(plan)} == {(p, b) for p in range(plan.k) for b in (1, 2)}


def test_calibrate_of_a_model_that_cannot_batch_calibrates_batch_1_and_says_so(capfd, real_plan, monkeypatch,
                                                                               tmp_path):
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path))
    plan = real_plan("detector_nms")
    code, out, err = cli(capfd, "calibrate", plan.root, "--batch-sizes", "1,2,4", "--groups", "1", "--max-runs", 12,
                         "--no-bus")
    assert code == 0, err
    assert "only batch 1 is calibrated, not 1,2,4" in out and "batch sizes [1]" in out, out
    assert {r.batch for r in _rows(plan)} == {1}


def test_calibrate_measures_each_input_size_as_a_footprint_of_its_own(capfd, real_plan, monkeypatch, tmp_path):
    """StarPU keys a perf model by footprint, the data sizes: width 148 and width 200 of the OCR
    model are two footprints of every part, each calibrated, whether the sizes come comma
    separated or with the option repeated."""
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path))
    plan = real_plan("crnn_ocr")
    for shapes in (["--input-shape", "image=1x1x32x148,1x1x32x200"],
                   ["--input-shape", "image=1x1x32x148", "--input-shape", "image=1x1x32x200"]):
        code, out, err = cli(capfd, "calibrate", plan.root, "--batch-sizes", "1", "--groups", "1", "--max-runs", 12,
                             "--no-bus", "--replace", *shapes)
        assert code == 0, err
        assert "input shapes image=1x1x32x148 and image=1x1x32x200" in out, out
        rows = _rows(plan)
        for part in range(plan.k):
            mine = [r for r in rows if r.part == part]
            assert len({r.shape_hash for r in mine}) == 2 and all(r.batch == 1 and r.n for r in mine), mine
    code, _, err = cli(capfd, "calibrate", plan.root, "--batch-sizes", "1", "--groups", "1", "--no-bus",
                       "--input-shape", "image=1x1x32x148,1x1x32")
    assert code == 2 and "--input-shape image=1x1x32: rank 3 given" in _one_line_error(err)


def test_random_scalar_booleans_are_arrays(capfd):
    """A rank-0 boolean input (an ``If``'s condition) must be fed as an array: ORT refuses a
    ``numpy.bool`` scalar, and profiling then fell back to estimates for every such model."""
    from staronnx.feeds import random_array

    value = random_array(TensorProto.BOOL, [], np.random.default_rng(0))
    assert isinstance(value, np.ndarray) and value.shape == () and value.dtype == np.bool_
