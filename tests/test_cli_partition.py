"""Tests of ``staronnx partition`` and ``staronnx plan show|verify``.

Most run the CLI in-process through :func:`staronnx.cli.main` (fast); one runs the installed
``staronnx`` script in a subprocess. User errors must end with exit code 2, exactly one line
``staronnx: error: ...`` on stderr that names the cause, and nothing written to disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from staronnx import zoo
from staronnx.plan import Plan
from _helpers import cli
import realmodels

STARONNX = Path(sys.executable).parent / "staronnx"


def _save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under a folder with its bytes (to tell that nothing was written)."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(folder.rglob("*"))}


@pytest.fixture
def chain_file(tmp_path) -> Path:
    return _save(zoo.chain(), tmp_path / "chain.onnx")


# --- the happy path --------------------------------------------------------------------------


def test_partition_show_verify_in_a_subprocess(tmp_path):
    model = _save(zoo.inception(), tmp_path / "inception.onnx")
    plan_dir = tmp_path / "plan"

    def run(*args):
        return subprocess.run([str(STARONNX), *map(str, args)], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "COLUMNS": "200"})

    res = run("partition", model, "-o", plan_dir, "--shares", "0.7,0.3", "--profile-runs", "2")
    assert res.returncode == 0, res.stderr
    assert "wrote plan" in res.stdout and "2 parts" in res.stdout
    plan = Plan.load(plan_dir)
    assert [p.target_share for p in plan.parts] == [0.7, 0.3]
    assert plan.cost_source.startswith("profiled on cpu")

    res = run("plan", "show", plan_dir)
    assert res.returncode == 0, res.stderr
    assert plan.hash in res.stdout
    assert f"{plan.cut_bytes_per_sample:,} bytes per sample cut" in res.stdout
    for t in plan.crossing:
        assert t.name in res.stdout

    res = run("plan", "verify", plan_dir, "--model", model, "--batch", "3")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK" in res.stdout and "MISMATCH" not in res.stdout
    assert res.stderr == ""


def test_partition_show_verify_in_process(tmp_path, capsys, chain_file):
    plan_dir = tmp_path / "plan"
    code, out, err = cli(capsys, "partition", chain_file, "-o", plan_dir, "--parts", "3",
                         "--costs", "estimate", "--method", "linear")
    assert code == 0, err
    plan = Plan.load(plan_dir)
    assert plan.k == 3 and plan.settings["method"] == "linear" and plan.settings["costs"] == "estimate"
    code, out, err = cli(capsys, "plan", "show", plan_dir)
    assert code == 0 and "crossing tensors" in out and plan.hash in out
    for batch in ("1", "4"):
        code, out, err = cli(capsys, "plan", "verify", plan_dir, "--model", chain_file, "--batch", batch)
        assert code == 0, out + err
        assert out.rstrip().splitlines()[-1].startswith("OK")


def test_transformer_input_shape_through_the_cli(tmp_path, capsys):
    model = _save(zoo.transformer_block(), tmp_path / "transformer.onnx")
    plan_dir = tmp_path / "plan"
    code, out, err = cli(capsys, "partition", model, "-o", plan_dir, "--parts", "2",
                         "--input-shape", "x=1x6x64", "--costs", "estimate")
    assert code == 0, err
    assert Plan.load(plan_dir).settings["input_shapes"] == {"x": [1, 6, 64]}
    # verify reads the recorded seq length, or takes another one
    assert cli(capsys, "plan", "verify", plan_dir, "--model", model)[0] == 0
    code, out, _ = cli(capsys, "plan", "verify", plan_dir, "--model", model, "--input-shape", "x=1x3x64")
    assert code == 0 and "1x3x64" in out


def test_force_replaces_an_existing_plan(tmp_path, capsys, chain_file):
    plan_dir = tmp_path / "plan"
    assert cli(capsys, "partition", chain_file, "-o", plan_dir, "--parts", "3", "--costs", "estimate")[0] == 0
    code, _, err = cli(capsys, "partition", chain_file, "-o", plan_dir, "--parts", "2",
                       "--costs", "estimate", "--force")
    assert code == 0, err
    assert Plan.load(plan_dir).k == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain.onnx", "plan"]


# --- verify catches a wrong plan -------------------------------------------------------------


def test_verify_reports_a_tampered_part(tmp_path, capsys, chain_file):
    plan_dir = tmp_path / "plan"
    assert cli(capsys, "partition", chain_file, "-o", plan_dir, "--parts", "2", "--costs", "estimate")[0] == 0
    part = plan_dir / "part1.onnx"
    tampered = onnx.load(str(part))
    rng = np.random.default_rng(0)
    for i, t in enumerate(tampered.graph.initializer):
        values = numpy_helper.to_array(t)
        noise = rng.standard_normal(values.shape).astype(values.dtype)
        tampered.graph.initializer[i].CopyFrom(numpy_helper.from_array(noise, t.name))
    onnx.save(tampered, str(part))
    code, out, err = cli(capsys, "plan", "verify", plan_dir, "--model", chain_file)
    assert code == 1
    assert "MISMATCH" in out
    assert out.rstrip().splitlines()[-1] == "MISMATCH"


def test_verify_of_a_plan_with_a_missing_part_is_a_user_error(tmp_path, capsys, chain_file):
    plan_dir = tmp_path / "plan"
    assert cli(capsys, "partition", chain_file, "-o", plan_dir, "--parts", "2", "--costs", "estimate")[0] == 0
    (plan_dir / "part1.onnx").unlink()
    for args in (("plan", "verify", plan_dir, "--model", chain_file), ("plan", "show", plan_dir)):
        code, out, err = cli(capsys, *args)
        assert code == 2
        assert err.strip().splitlines() == [err.strip()] and "part1.onnx" in err and "missing" in err


@pytest.mark.parametrize("what", ["missing", "not-a-plan"])
def test_show_and_verify_of_a_non_plan_folder(tmp_path, capsys, chain_file, what):
    folder = tmp_path / "nothing"
    if what == "not-a-plan":
        folder.mkdir()
    for args in (("plan", "show", folder), ("plan", "verify", folder, "--model", chain_file)):
        code, out, err = cli(capsys, *args)
        assert code == 2, err
        assert err.startswith("staronnx: error: ") and len(err.strip().splitlines()) == 1
        assert "plan" in err and str(folder) in err


@pytest.mark.parametrize("damage", ["a list", "a shape of null", "part inputs of null", "settings of null"])
def test_a_plan_json_of_the_wrong_structure_is_one_line(tmp_path, capsys, damage):
    """plan.json that parses but lacks the structure staronnx writes (another tool's file named
    plan.json, a hand edit) made show, verify and serve end in a traceback (AttributeError:
    'list' object has no attribute 'get'; TypeError: 'NoneType' object is not iterable)."""
    model = realmodels.path("crnn_ocr")
    plan_dir = tmp_path / "plan"
    code, out, err = cli(capsys, "partition", model, "-o", plan_dir, "--costs", "estimate",
                         *[f"--input-shape={s}" for s in realmodels.input_shapes("crnn_ocr")])
    assert code == 0, out + err
    meta = plan_dir / "plan.json"
    data = json.loads(meta.read_text())
    if damage == "a list":
        data = [data]
    elif damage == "a shape of null":
        data["inputs"][0]["shape"] = None
    elif damage == "part inputs of null":
        data["parts"][1]["inputs"] = None
    else:
        data["settings"] = None
    meta.write_text(json.dumps(data))
    for args in (("plan", "show", plan_dir), ("plan", "verify", plan_dir, "--model", model)):
        code, out, err = cli(capsys, *args)
        assert code == 2, out + err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("staronnx: error: ") and "plan.json" in lines[0], err


def test_verify_with_bad_batch_is_a_user_error(tmp_path, capsys, chain_file):
    plan_dir = tmp_path / "plan"
    assert cli(capsys, "partition", chain_file, "-o", plan_dir, "--parts", "2", "--costs", "estimate")[0] == 0
    code, _, err = cli(capsys, "plan", "verify", plan_dir, "--model", chain_file, "--batch", "0")
    assert code == 2 and "--batch" in err


def test_verify_against_the_wrong_model_is_a_user_error(tmp_path, capsys, chain_file):
    # the transformer also has input 'x' and output 'y', but x has rank 3
    plan_dir = tmp_path / "plan"
    assert cli(capsys, "partition", chain_file, "-o", plan_dir, "--parts", "2", "--costs", "estimate")[0] == 0
    other = _save(zoo.transformer_block(), tmp_path / "transformer.onnx")
    code, _, err = cli(capsys, "plan", "verify", plan_dir, "--model", other)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("staronnx: error: ")
    assert "'x'" in lines[0] and "source model" in lines[0]


def test_verify_against_a_model_with_other_input_names(tmp_path, capsys, chain_file):
    plan_dir = tmp_path / "plan"
    assert cli(capsys, "partition", chain_file, "-o", plan_dir, "--parts", "2", "--costs", "estimate")[0] == 0
    renamed = zoo.chain()
    renamed.graph.input[0].name = "inp"
    renamed.graph.node[0].input[0] = "inp"
    other = _save(renamed, tmp_path / "renamed.onnx")
    code, _, err = cli(capsys, "plan", "verify", plan_dir, "--model", other)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "'x'" in err


# --- user errors: exit 2, one line naming the cause, nothing written --------------------------


def _no_input_model() -> onnx.ModelProto:
    const = helper.make_node("Constant", [], ["c"], name="c",
                             value=numpy_helper.from_array(np.ones(4, np.float32)))
    graph = helper.make_graph(
        [const, helper.make_node("Relu", ["c"], ["y"], name="relu")], "no_inputs", [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _bad_model(kind: str, folder: Path) -> Path:
    path = folder / f"{kind}.onnx"
    if kind == "missing":
        return path
    if kind == "truncated":
        data = zoo.chain().SerializeToString()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "text":
        path.write_text("this is not an ONNX model\n")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "no-inputs":
        _save(_no_input_model(), path)
    else:
        raise AssertionError(kind)
    return path


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("missing", ["not found", "missing.onnx"]),
        ("truncated", ["truncated.onnx", "not a valid ONNX model"]),
        ("text", ["text.onnx", "not a valid ONNX model"]),
        ("empty", ["empty.onnx", "empty"]),
        ("no-inputs", ["no-inputs.onnx", "no inputs"]),
    ],
)
def test_unusable_model_files(tmp_path, capsys, kind, says):
    model = _bad_model(kind, tmp_path)
    before = _tree(tmp_path)
    code, out, err = cli(capsys, "partition", model, "-o", tmp_path / "plan", "--parts", "2")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("staronnx: error: "), err
    for word in says:
        assert word in lines[0]
    assert _tree(tmp_path) == before, "nothing may be written"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--shares", "0.5,-0.5"], ["positive"]),
        (["--shares", "0,1"], ["positive"]),
        (["--shares", "0.5,0.4"], ["sum to 1", "0.9"]),
        (["--shares", "0.6,0.6"], ["sum to 1"]),
        (["--shares", "0.5,x"], ["comma-separated"]),
        (["--shares", "0.5,0.5", "--parts", "3"], ["--parts is 3"]),
        (["--parts", "100"], ["100 parts", "17 node"]),
        (["--parts", "0"], ["at least 1"]),
        (["--method", "random"], ["unknown method", "random"]),
        (["--tolerance", "1.5"], ["tolerance"]),
        (["--input-shape", "z=1x32"], ["unknown", "['z']"]),
        (["--input-shape", "x=1x31"], ["axis 1 is fixed to 32"]),
        (["--input-shape", "nonsense"], ["--input-shape expects", "nonsense"]),
    ],
    ids=lambda v: "_".join(v) if isinstance(v, list) else v,
)
def test_impossible_requests(tmp_path, capsys, chain_file, args, says):
    before = _tree(tmp_path)
    code, out, err = cli(capsys, "partition", chain_file, "-o", tmp_path / "plan", *args,
                         "--costs", "estimate")
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("staronnx: error: "), err
    for word in says:
        assert word in lines[0]
    assert _tree(tmp_path) == before, "nothing may be written"


@pytest.mark.parametrize(
    "axis, says",
    [
        ("state=0", ["axis 0 of 'state' is fixed to 2", "cannot carry the batch"]),
        ("state=5", ["axis 5 of 'state' is out of range", "rank 3"]),
        ("frame=1", ["axis 1 of 'frame' is fixed to 256"]),
        ("nosuch=0", ["unknown tensor(s) ['nosuch']"]),
    ],
)
def test_batch_axis_that_does_not_fit_the_model_is_refused_before_any_work(tmp_path, capsys, axis, says):
    """gru_stream's state is [2, batch, 64]: --batch-axis state=0 (or an axis past its rank, a
    fixed size, an unknown name) was profiled, cut and written, and the finished plan then
    failed on every load (show, verify, serve) with the contract's error. Refused up front now."""
    before = _tree(tmp_path)
    code, out, err = cli(capsys, "partition", realmodels.path("gru_stream"), "-o", tmp_path / "plan",
                         "--costs", "estimate", *[f"--input-shape={s}" for s in realmodels.input_shapes("gru_stream")],
                         "--batch-axis", axis)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("staronnx: error: "), err
    for word in says:
        assert word in lines[0]
    assert _tree(tmp_path) == before, "nothing may be written"


def test_batch_axis_that_fits_the_model_is_kept(tmp_path, capsys):
    """The right axis for the state (1, as the graph tells anyway) still cuts, and the plan loads."""
    code, out, err = cli(capsys, "partition", realmodels.path("gru_stream"), "-o", tmp_path / "plan",
                         "--costs", "estimate", *[f"--input-shape={s}" for s in realmodels.input_shapes("gru_stream")],
                         "--batch-axis", "state=1")
    assert code == 0, out + err
    contract = Plan.load(tmp_path / "plan").contract
    assert contract.inputs["state"] == 1 and contract.batchable


def test_a_batch_axis_fixed_to_1_runs_one_request_per_task(tmp_path, capsys):
    """mobilenet_b1 fixes its input to [1, 3, 224, 224]. --batch-axis input=0 --batch-axis
    logits=0 is accepted (a fixed 1 may be a batch exported at 1), and the plan said "requests
    are batched together": a server formed batches ONNX Runtime refuses ("axis 0 must be 1"),
    and plan verify --batch 2 failed. The contract now says why it runs one request per task."""
    model = realmodels.path("mobilenet_b1")
    code, out, err = cli(capsys, "partition", model, "-o", tmp_path / "plan", "--costs", "estimate",
                         "--batch-axis", "input=0", "--batch-axis", "logits=0")
    assert code == 0, out + err
    contract = Plan.load(tmp_path / "plan").contract
    assert not contract.batchable and "fixes its batch axis 0 to 1" in (contract.why_not or "")
    assert "one request per task" in out and "requests are batched together" not in out, out
    code, out, err = cli(capsys, "plan", "verify", tmp_path / "plan", "--model", model, "--batch", "2")
    assert code == 0 and "batch 2 is impossible for this model" in out and "OK" in out, out + err


def test_verify_of_real_inputs_whose_outputs_hold_nan(tmp_path, capsys):
    """A streaming client's state gone NaN (gru_stream's first row) gives NaN rows in the whole
    model's outputs and in the chained parts' alike. verify compared them as NaN - NaN and said
    MISMATCH (max abs diff nan) for a plan that computes exactly what the model computes, and
    the finite rows went unchecked. Equal NaNs agree now; the other rows are compared."""
    code, out, err = cli(capsys, "partition", realmodels.path("gru_stream"), "-o", tmp_path / "plan",
                         "--costs", "estimate", *[f"--input-shape={s}" for s in realmodels.input_shapes("gru_stream")])
    assert code == 0, out + err
    ins, _ = realmodels.reference("gru_stream")
    state = ins["state"].copy()
    state[:, 0, :] = np.nan
    np.savez(tmp_path / "nan.npz", **{**ins, "state": state})
    code, out, err = cli(capsys, "plan", "verify", tmp_path / "plan", "--model", realmodels.path("gru_stream"),
                         "--inputs", tmp_path / "nan.npz")
    assert code == 0 and "MISMATCH" not in out, out + err
    # NaN on one side only, or a finite row that differs, is still a mismatch
    from staronnx.verify import compare

    want = np.array([[np.nan, 1.0], [2.0, 3.0]], np.float32)
    assert compare("y", want, want.copy()).ok
    assert not compare("y", want, np.array([[0.0, 1.0], [2.0, 3.0]], np.float32)).ok
    assert not compare("y", want, np.array([[np.nan, 1.0], [2.0, 3.5]], np.float32)).ok
    assert not compare("y", np.array([np.inf, 1.0]), np.array([-np.inf, 1.0])).ok


def test_non_numeric_shares_with_parts(tmp_path, capsys, chain_file):
    before = _tree(tmp_path)
    code, _, err = cli(capsys, "partition", chain_file, "-o", tmp_path / "plan", "--shares", "a,b",
                       "--parts", "2", "--costs", "estimate")
    assert code == 2 and "comma-separated" in err and len(err.strip().splitlines()) == 1
    assert _tree(tmp_path) == before


def test_dynamic_dim_without_input_shape(tmp_path, capsys):
    model = _save(zoo.transformer_block(), tmp_path / "transformer.onnx")
    before = _tree(tmp_path)
    code, out, err = cli(capsys, "partition", model, "-o", tmp_path / "plan", "--parts", "2",
                         "--costs", "estimate")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("staronnx: error: ")
    assert "'seq'" in lines[0] and "--input-shape x=" in lines[0]
    assert _tree(tmp_path) == before


def test_existing_non_empty_output_folder_without_force(tmp_path, capsys, chain_file):
    out_dir = tmp_path / "plan"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("precious\n")
    (out_dir / "sub").mkdir()
    (out_dir / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = _tree(tmp_path)
    code, out, err = cli(capsys, "partition", chain_file, "-o", out_dir, "--parts", "2", "--costs", "estimate")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--force" in lines[0] and str(out_dir) in lines[0]
    assert _tree(tmp_path) == before, "the folder's content must be untouched"


def test_output_path_that_is_a_file(tmp_path, capsys, chain_file):
    target = tmp_path / "plan"
    target.write_text("a file")
    code, _, err = cli(capsys, "partition", chain_file, "-o", target, "--parts", "2", "--costs", "estimate")
    assert code == 2 and "not a folder" in err
    assert target.read_text() == "a file"


@pytest.mark.skipif("CUDAExecutionProvider" in __import__("onnxruntime").get_available_providers(),
                    reason="CUDA is available here")
def test_cuda_device_without_its_provider(tmp_path, capsys, chain_file):
    before = _tree(tmp_path)
    code, _, err = cli(capsys, "partition", chain_file, "-o", tmp_path / "plan", "--parts", "2",
                       "--device", "cuda")
    assert code == 2 and "CUDAExecutionProvider" in err and len(err.strip().splitlines()) == 1
    assert _tree(tmp_path) == before


# --- help ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "mentions"),
    [
        (["partition"], ["--output", "--shares", "--parts", "--device", "--input-shape", "--method",
                         "--costs", "--force"]),
        (["plan"], ["show", "verify"]),
        (["plan", "show"], ["plandir"]),
        (["plan", "verify"], ["--model", "--batch", "--input-shape", "--seed"]),
    ],
    ids=["partition", "plan", "plan-show", "plan-verify"],
)
def test_help(capsys, monkeypatch, command, mentions):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, err = cli(capsys, *command, "--help")
    assert code == 0, err
    assert "Usage" in out and f"staronnx {' '.join(command)}" in out
    for word in mentions:
        assert word in out, word


def test_help_of_the_installed_script():
    res = subprocess.run([str(STARONNX), "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0
    assert "partition" in res.stdout and "plan" in res.stdout


def _partition_stdout(*args: object) -> subprocess.CompletedProcess[str]:
    """``staronnx partition ARGS`` in a subprocess, stdout a pipe (as ``| tee`` or ``> file``)."""
    return subprocess.run([str(STARONNX), "partition", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "200"})


def test_metis_complaints_stay_out_of_partition_output(tmp_path):
    """GoogLeNet in 40 parts: METIS printf()s "***Cannot bisect a graph with 0 vertices!" (56
    lines) to descriptor 1 where parts come out empty; the command's output is its own."""
    from realmodels import GOOGLENET

    res = _partition_stdout(GOOGLENET, "--parts", "40", "--costs", "estimate", "-o", tmp_path / "plan")
    assert res.returncode == 0, res.stderr
    assert "***" not in res.stdout and "bisect" not in res.stdout and "too many parts" not in res.stdout, \
        res.stdout[:2000]
    assert "***" not in res.stderr
    assert res.stdout.startswith("wrote plan"), res.stdout[:500]


def test_the_highs_banner_stays_out_of_partition_output(tmp_path, two_groups):
    """``--method optimal`` printed "Running HiGHS ... Copyright ..." before the command's output."""
    from realmodels import REAL

    res = _partition_stdout(REAL / "mobilenet_b1.onnx", "--method", "optimal", "--groups", two_groups,
                            "--costs", "estimate", "-o", tmp_path / "plan")
    assert res.returncode == 0, res.stderr
    assert "HiGHS" not in res.stdout and "Copyright" not in res.stdout, res.stdout[:1000]
    assert res.stdout.startswith("wrote plan"), res.stdout[:500]


def test_what_others_print_while_metis_is_captured_comes_out_after(capfd):
    """Descriptor 1 is the whole process's: while METIS's printf()s are kept back, a line another
    thread writes (a server's log while a repository model is cut) was lost with them; it is
    written out after the capture, and only METIS's lines are kept back."""
    import threading

    from staronnx.partition.cquiet import c_stdout_captured, metis_line

    with c_stdout_captured(metis_line) as printed:
        os.write(1, b"***Cannot bisect a graph with 0 vertices!\n")
        writer = threading.Thread(target=os.write, args=(1, b"model 'x': ready\n"))
        writer.start()
        writer.join()
    out = capfd.readouterr().out
    assert out == "model 'x': ready\n", out
    assert printed.text == "***Cannot bisect a graph with 0 vertices!\n"


GPT2_PAST = [f"--input-shape=past_{kind}_{i}=1x2x0x32" for kind in ("key", "value") for i in (0, 1)]


def test_gpt2_prefill_with_an_empty_past_is_profiled_from_the_cli(capsys, tmp_path):
    """An empty KV-cache past (past_sequence 0: the prefill step) is a size the sessions accept;
    --input-shape refused it ("sizes >= 1"), so gpt2's prefill could not be profiled."""
    model = realmodels.path("gpt2_tiny_kv")
    code, out, err = cli(capsys, "partition", model, "--parts", "2", "--profile-runs", "2", "-o", tmp_path / "plan",
                         "--input-shape=input_ids=1x5", "--input-shape=attention_mask=1x5", *GPT2_PAST)
    assert code == 0, err
    plan = Plan.load(tmp_path / "plan")
    assert plan.cost_source.startswith("profiled"), plan.cost_source
    assert "past_key_0=1x2x0x32" in " ".join(out.split())
    code, out, err = cli(capsys, "plan", "verify", tmp_path / "plan", "--model", model)
    assert code == 0, out + err


def test_an_empty_batch_axis_is_refused_by_name(capsys, tmp_path):
    model = realmodels.path("gpt2_tiny_kv")
    code, out, err = cli(capsys, "partition", model, "--parts", "2", "-o", tmp_path / "plan",
                         "--input-shape=input_ids=0x5", "--input-shape=attention_mask=1x5", *GPT2_PAST)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--input-shape input_ids" in lines[0] and "batch axis" in lines[0], err
    assert not (tmp_path / "plan").exists()
