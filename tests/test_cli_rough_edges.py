"""The CLI's rough edges from issue 12, through the doors users use (subprocesses and typer's
CliRunner on ``staronnx.cli.app``): stray progress bars, titles, warm-up counts, truncated
names, --parts/--shares, one duration syntax, progress on a terminal only, ``--inputs``."""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from staronnx.cli import app

CLI = [sys.executable, "-m", "staronnx"]
PU = str(min(os.sched_getaffinity(0)))
runner = CliRunner()


def _env(home: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "STARONNX_HOME": str(home), **extra}


def _run(args: list[str], home: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=_env(home), timeout=300, **kw)


def _one_error_line(result: subprocess.CompletedProcess | object) -> str:
    err = result.stderr if hasattr(result, "stderr") else ""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert "Traceback" not in err
    return lines[-1]


LONG = "encoder/layer_{i:02d}/attention/output/dense/BiasAdd_followed_by_a_rather_long_activation_name"


def _long_names_model() -> onnx.ModelProto:
    """A MatMul/Relu chain whose tensors have 90-character names."""
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(6):
        w = f"w{i}"
        inits.append(helper.make_tensor(w, TensorProto.FLOAT, [16, 16], rng.standard_normal(256).astype(np.float32)))
        mm = LONG.format(i=i) + "_mm"
        out = LONG.format(i=i) if i < 5 else "y"
        nodes += [helper.make_node("MatMul", [prev, w], [mm]), helper.make_node("Relu", [mm], [out])]
        prev = out
    graph = helper.make_graph(
        nodes, "long", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


# ---------------------------------------------------------------------------- output
def test_sweep_output_has_no_stray_progress_bar(small, tmp_path):
    _, plan = small
    res = _run(["sweep", str(plan), "--rates", "50", "--batch-sizes", "1", "--duration", "0.5s",
                "--groups", PU, "-o", str(tmp_path / "res"), "--no-plots"], tmp_path / "home")
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    assert "done" not in out and "1/1" not in out, out
    assert "sweep points" not in out and "warm" not in out, "no progress bar when stderr is not a terminal"
    assert "b=1 @ 50 req/s" in res.stdout


def test_plan_title_does_not_say_plan_plan(small):
    _, plan = small
    res = runner.invoke(app, ["plan", "show", str(plan)])
    assert res.exit_code == 0, res.output
    assert "plan plan" not in res.output
    assert "hash" in res.output


def test_tables_fold_long_names_instead_of_cutting_them(tmp_path):
    onnx.save(_long_names_model(), str(tmp_path / "long.onnx"))
    res = runner.invoke(app, ["partition", str(tmp_path / "long.onnx"), "-o", str(tmp_path / "plan"),
                              "--parts", "3", "--method", "linear", "--costs", "estimate"],
                        env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert "…" not in res.output, res.output
    # the crossing table's first column, read down, holds every crossing name whole
    crossing = res.output.split("crossing tensors", 1)[1]
    column = "".join(line.split("│")[1].strip() for line in crossing.splitlines() if line.count("│") > 2)
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    names = [t["name"] for t in plan["crossing"]]
    assert names and all(len(n) > 80 for n in names)
    for name in names:
        assert name in column, (name, column)


def test_run_counts_leave_the_warm_up_out(small, tmp_path):
    _, plan = small
    res = _run(["run", str(plan), "--requests", "30", "--groups", PU], tmp_path / "home")
    assert res.returncode == 0, res.stderr
    per_part: dict[str, int] = {}
    for line in res.stdout.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 3 and re.fullmatch(r"part\d+/\w+", cells[1]):
            part = cells[1].split("/")[0]
            per_part[part] = per_part.get(part, 0) + int(cells[2])
    assert per_part == {"part0": 30, "part1": 30}, res.stdout
    assert "warm-up" in res.stdout


# ---------------------------------------------------------------------------- options
def test_conflicting_parts_and_shares_is_an_error_naming_both(small, tmp_path):
    model, _ = small
    res = _run(["partition", str(model), "-o", str(tmp_path / "p"), "--parts", "3", "--shares", "0.5,0.5",
                "--costs", "estimate"], tmp_path / "home")
    assert res.returncode == 2
    line = _one_error_line(res)
    assert line.startswith("staronnx: error:") and "--parts" in line and "--shares" in line
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("value", ["0", "-1"])
def test_run_refuses_a_max_in_flight_below_one(small, tmp_path, value):
    """--max-in-flight 0 is one line naming the flag, not a traceback (IndexError) once the runtime ran."""
    _, plan = small
    res = _run(["run", str(plan), "--requests", "3", "--groups", PU, "--max-in-flight", value], tmp_path / "home")
    assert res.returncode == 2, res.stderr
    assert _one_error_line(res) == f"staronnx: error: --max-in-flight must be at least 1, got {value}"


@pytest.mark.parametrize("extra, expected", [
    (["--parts", "3"], "--shares auto chooses the number of parts itself: drop --parts"),
    (["--method", "duet"], "--shares auto is for --method metis and linear; 'duet' picks its own parts"),
])
def test_shares_auto_conflicts_name_the_flags(small, tmp_path, extra, expected):
    """--shares auto beside --parts or a placement method is refused in the command line's words, not
    the Python API's (shares='auto', parts)."""
    model, _ = small
    res = _run(["partition", str(model), "-o", str(tmp_path / "p"), "--shares", "auto", "--costs", "estimate",
                *extra], tmp_path / "home")
    assert res.returncode == 2, res.stderr
    assert _one_error_line(res) == f"staronnx: error: {expected}"


@pytest.mark.parametrize("extra", [["--shares", "0.7,0.3"], ["--parts", "4"]])
def test_a_placement_method_refuses_shares_it_would_drop(small, tmp_path, extra):
    """A placement method picks its own parts: --shares or --parts beside it were dropped without a
    word (a plan of 1 part, not the 2 or 4 asked), where --shares auto is refused."""
    model, _ = small
    res = _run(["partition", str(model), "-o", str(tmp_path / "p"), "--method", "duet", "--groups", PU,
                "--costs", "estimate", *extra], tmp_path / "home")
    assert res.returncode == 2, res.stdout
    assert _one_error_line(res) == ("staronnx: error: --method duet picks its own parts (and a device for each): "
                                    "drop --shares and --parts")
    assert not (tmp_path / "p").exists()


def test_trace_plot_refuses_alone_with_compare(tmp_path):
    """--alone ('this trace only') and --compare (another trace beside it) contradict each other: the
    comparison was drawn and --alone dropped without a word."""
    res = _run(["trace", "plot", str(tmp_path / "T.json"), "--compare", str(tmp_path / "U.json"), "--alone",
                "-o", str(tmp_path / "g.png")], tmp_path / "home")
    assert res.returncode == 2, res.stdout
    assert _one_error_line(res) == ("staronnx: error: --alone draws this trace only and --compare draws another "
                                    "beside it: give one of them")


def test_sweep_refuses_a_queue_capacity_below_one(small, tmp_path):
    """--queue-capacity 0: one line before any point (as serve and simulate refuse it), where the
    sweep ran with a queue of the batch size and recorded queue_capacity 0 in its results."""
    _, plan = small
    res = _run(["sweep", str(plan), "--rates", "10", "--batch-sizes", "1", "--duration", "300ms", "--groups", PU,
                "--no-plots", "--queue-capacity", "0", "-o", str(tmp_path / "res")], tmp_path / "home")
    assert res.returncode == 2, res.stdout
    assert _one_error_line(res) == "staronnx: error: --queue-capacity must be at least 1, got 0"
    assert not (tmp_path / "res" / "results.json").exists()


def test_partition_help_says_the_default_is_two_equal_parts():
    res = runner.invoke(app, ["partition", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0
    text = " ".join(res.output.split())
    assert re.search(r"--shares .*2 equal parts", text) and re.search(r"--parts .*default.*2", text), text


@pytest.mark.parametrize("duration,max_delay", [("2s", "5ms"), ("2", "0.005"), ("1500ms", "0")])
def test_simulate_takes_the_sweeps_duration_syntax(calibrated_inception, duration, max_delay, two_groups):
    plan, home = calibrated_inception
    res = runner.invoke(app, ["simulate", str(plan.root), "--rate", "100", "--batch", "2", "--groups", two_groups,
                              "--duration", duration, "--max-delay", max_delay],
                        env={"STARONNX_HOME": str(home)})
    assert res.exit_code == 0, res.output
    assert "throughput" in res.output


def test_a_bad_duration_is_one_line_naming_the_syntax(small, tmp_path):
    _, plan = small
    res = _run(["simulate", str(plan), "--rate", "100", "--batch", "2", "--duration", "ten"], tmp_path / "home")
    assert res.returncode == 2
    line = _one_error_line(res)
    assert line.startswith("staronnx: error:") and "--duration" in line and "10s" in line and "'ten'" in line


# ---------------------------------------------------------------------------- progress
def _with_tty_stderr(args: list[str], home: Path) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal (stdout a pipe); (rc, stdout, terminal text)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=slave, env=_env(home, COLUMNS="120"))
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    out = proc.stdout.read().decode()
    proc.wait(timeout=300)
    os.close(master)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


def test_run_shows_progress_on_a_terminal_only(small, tmp_path):
    _, plan = small
    args = ["run", str(plan), "--requests", "300", "--groups", PU]
    rc, out, tty = _with_tty_stderr(args, tmp_path / "home")
    assert rc == 0, tty
    assert "requests" in tty and "━" in tty and "/300" in tty, tty
    assert "/300" not in out and "samples/s" in out
    rc, out, tty = _with_tty_stderr([*args, "--quiet"], tmp_path / "home")
    assert rc == 0 and "━" not in tty and "/300" not in tty and "samples/s" in out


def test_partition_shows_its_steps_on_a_terminal_only(small, tmp_path):
    model, _ = small
    rc, out, tty = _with_tty_stderr(["partition", str(model), "-o", str(tmp_path / "p"), "--costs", "estimate"],
                                    tmp_path / "home")
    assert rc == 0, tty
    assert "exporting 2 parts" in tty
    assert "exporting" not in out and "wrote plan" in out
    rc, out, tty = _with_tty_stderr(["partition", str(model), "-o", str(tmp_path / "q"), "--costs", "estimate",
                                     "--quiet"], tmp_path / "home")
    assert rc == 0 and "exporting" not in tty


# ---------------------------------------------------------------------------- --inputs
def _npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


def _real(n: int) -> np.ndarray:
    return np.random.default_rng(7).standard_normal((n, 3, 16, 16)).astype(np.float32)


def test_run_feeds_real_inputs(small, tmp_path):
    _, plan = small
    inputs = _npz(tmp_path / "in.npz", x=_real(5))
    res = _run(["run", str(plan), "--inputs", str(inputs), "--requests", "12", "--batch", "2", "--groups", PU],
               tmp_path / "home")
    assert res.returncode == 0, res.stderr
    assert "inputs from" in res.stdout and "5 sample(s)" in res.stdout


def test_plan_verify_with_real_inputs(small, tmp_path):
    model, plan = small
    inputs = _npz(tmp_path / "in.npz", x=_real(3))
    res = runner.invoke(app, ["plan", "verify", str(plan), "--model", str(model), "--inputs", str(inputs)])
    assert res.exit_code == 0, res.output
    assert "3x" in res.output and "OK" in res.output  # the outputs have the file's 3 samples


def test_plan_verify_refuses_input_shapes_beside_real_inputs(small, tmp_path):
    """--input-shape sizes random inputs; beside --inputs (whose arrays have their own sizes) it was
    dropped without a word."""
    model, plan = small
    inputs = _npz(tmp_path / "in.npz", x=_real(3))
    res = _run(["plan", "verify", str(plan), "--model", str(model), "--inputs", str(inputs), "--input-shape",
                "x=1x3x16x16"], tmp_path / "home")
    assert res.returncode == 2, res.stdout
    assert _one_error_line(res) == ("staronnx: error: --input-shape sizes the random inputs; --inputs brings its "
                                    "own arrays: give one of them")


def test_sweep_feeds_real_inputs(small, tmp_path):
    _, plan = small
    inputs = _npz(tmp_path / "in.npz", x=_real(4))
    res = _run(["sweep", str(plan), "--rates", "40", "--batch-sizes", "2", "--duration", "0.5s", "--groups", PU,
                "-o", str(tmp_path / "res"), "--no-plots", "--inputs", str(inputs)], tmp_path / "home")
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "res" / "results.json").read_text())
    assert doc["settings"]["inputs"] == {"path": str(inputs), "samples": 4}
    assert len(doc["rows"]) == 1 and doc["rows"][0]["completed"] > 0


@pytest.mark.parametrize("command", ["run", "verify", "sweep"])
@pytest.mark.parametrize("arrays,expected", [
    ({"y": np.zeros((2, 3, 16, 16), np.float32)}, r"unknown input\(s\) \['y'\].*missing \['x'\]"),
    ({"x": np.zeros((2, 3, 16, 16), np.float64)}, r"input 'x': expected dtype float32, got float64"),
    ({"x": np.zeros((2, 3, 8, 8), np.float32)}, r"input 'x': axis 2 must be 16"),
    ({"x": np.zeros((3, 16, 16), np.float32)}, r"input 'x': expected rank 4"),
])
def test_mismatched_inputs_are_one_line_naming_the_input(small, tmp_path, command, arrays, expected):
    model, plan = small
    inputs = _npz(tmp_path / "bad.npz", **arrays)
    args = {
        "run": ["run", str(plan), "--groups", PU],
        "verify": ["plan", "verify", str(plan), "--model", str(model)],
        "sweep": ["sweep", str(plan), "--rates", "40", "--batch-sizes", "1", "--duration", "0.5s",
                  "--groups", PU, "-o", str(tmp_path / "res"), "--no-plots"],
    }[command]
    res = _run([*args, "--inputs", str(inputs)], tmp_path / "home")
    assert res.returncode == 2, res.stderr
    line = _one_error_line(res)
    assert line.startswith(f"staronnx: error: --inputs {inputs}: "), line
    assert re.search(expected, line), line
    assert not (tmp_path / "res").exists(), "nothing runs before the inputs are checked"


def test_an_unreadable_inputs_file_is_one_line(small, tmp_path):
    _, plan = small
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    res = _run(["run", str(plan), "--inputs", str(bad), "--groups", PU], tmp_path / "home")
    assert res.returncode == 2
    assert _one_error_line(res) == (f"staronnx: error: --inputs {bad}: not an .npz file "
                                    "(write one with numpy.savez(path, NAME=array, ...))")
    np.save(tmp_path / "one.npy", _real(2))
    res = _run(["run", str(plan), "--inputs", str(tmp_path / "one.npy"), "--groups", PU], tmp_path / "home")
    assert res.returncode == 2 and "not an .npz file" in _one_error_line(res)
    res = _run(["run", str(plan), "--inputs", str(tmp_path / "none.npz"), "--groups", PU], tmp_path / "home")
    assert res.returncode == 2
    assert "no such file" in _one_error_line(res)


def test_sweep_refuses_compare_with_no_plots(real_plan, tmp_path):
    """--compare's one use is the overlay plot: with --no-plots the sweep measured every point,
    drew nothing and never said that --compare (and every label after the first) went unused.
    Now one line before any point is measured."""
    plan = real_plan("gru_stream")
    res = _run(["sweep", str(plan.root), "--rates", "10", "--batch-sizes", "1", "--duration", "300ms", "--groups", PU,
                "--no-plots", "--compare", str(tmp_path / "old"), "--labels", "new,old", "-o", str(tmp_path / "res")],
               tmp_path / "home")
    assert res.returncode == 2, res.stdout
    assert _one_error_line(res) == ("staronnx: error: --compare overlays this sweep's plot with other sweeps': it does "
                                    "not go with --no-plots (draw it later with staronnx sweep-plot OUTPUT --compare "
                                    "FOLDER)")
    assert not (tmp_path / "res" / "results.json").exists()


def test_serve_refuses_lane_preempt_without_a_lane(real_plan, tmp_path):
    """``--lane-preempt`` says how the shared workers of a lane's group yield to the lane: with
    no ``--lane`` the server started and served, the flag dropped without a word. Now one line
    before any model loads or port opens."""
    plans = [str(real_plan(n).root) for n in ("gru_stream", "crnn_ocr")]
    res = _run(["serve", *plans, "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--groups", PU,
                "--name", "gru", "--name", "crnn", "--lane-preempt", "nice"], tmp_path / "home",
               stdin=subprocess.DEVNULL)
    assert res.returncode == 2, res.stdout
    assert _one_error_line(res) == ("staronnx: error: --lane-preempt nice says how a lane's group yields to the lane: "
                                    "it needs --lane NAME=GROUPS")


def test_serve_refuses_batch_size_beside_no_batching(real_plan, tmp_path):
    """``--no-batching`` runs every request alone: a ``--batch-size`` beside it (plans given on
    the command line, no repository whose configs may batch) was dropped without a word, the
    start line saying batches of up to 1. Now one line before any model loads."""
    res = _run(["serve", str(real_plan("crnn_ocr").root), "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
                "--groups", PU, "--no-batching", "--batch-size", "8"], tmp_path / "home", stdin=subprocess.DEVNULL)
    assert res.returncode == 2, res.stdout
    assert _one_error_line(res) == ("staronnx: error: --batch-size 8: --no-batching runs every request alone, one per "
                                    "task (a repository model's config.pbtxt may still batch): give one of them")


@pytest.mark.parametrize("mode", [None, "explicit"])
def test_serve_refuses_repository_poll_secs_outside_poll_mode(tmp_path, mode):
    """``--repository-poll-secs`` sets how often poll mode reads the repository again; in the
    other modes nothing polls, and the server started and served the repository once, the flag
    dropped without a word. Now one line before any model loads or port opens."""
    import realmodels

    repo = tmp_path / "repo"
    (repo / "gru" / "1").mkdir(parents=True)
    (repo / "gru" / "1" / "model.onnx").write_bytes(realmodels.path("gru_stream").read_bytes())
    res = _run(["serve", "--model-repository", str(repo), *(["--model-control-mode", mode] if mode else []),
                *(["--load-model", "gru"] if mode == "explicit" else []), "--repository-poll-secs", "5",
                "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--groups", PU], tmp_path / "home",
               stdin=subprocess.DEVNULL)
    assert res.returncode == 2, res.stdout
    assert _one_error_line(res) == ("staronnx: error: --repository-poll-secs sets how often --model-control-mode poll "
                                    f"reads the repository again; the mode is {mode or 'none'}: give "
                                    "--model-control-mode poll or leave it out")


def test_run_refuses_a_seed_beside_real_inputs(real_plan, tmp_path):
    """``run``'s ``--seed`` seeds its random inputs; with ``--inputs`` the requests are the
    file's samples, and the seed was dropped without a word (a user varying it got the same run
    each time). Refused in one line, as ``plan verify`` refuses --input-shape beside --inputs;
    --inputs alone runs as before."""
    import realmodels

    plan = real_plan("crnn_ocr")
    ins, _ = realmodels.reference("crnn_ocr")
    inputs = _npz(tmp_path / "in.npz", **ins)
    base = ["run", str(plan.root), "--requests", "2", "--groups", PU, "--inputs", str(inputs)]
    res = _run([*base, "--seed", "3"], tmp_path / "home")
    assert res.returncode == 2, res.stdout
    assert _one_error_line(res) == ("staronnx: error: --seed seeds the random inputs; --inputs brings its own arrays: "
                                    "give one of them")
    alone = _run(base, tmp_path / "home")
    assert alone.returncode == 0, alone.stdout + alone.stderr


@pytest.mark.parametrize("model, extra", [("mobilenet_b1", ("--batch-size", "8")), ("bert_tiny", ("--no-batching",))])
def test_serve_start_line_says_batches_of_one_for_a_model_run_one_request_per_task(real_plan, tmp_path, model,
                                                                                   extra):
    """A model that runs one request per task (a fixed batch of 1, or --no-batching) forms no
    batch above 1, as its config says (max_batch_size 0, batch_size 1); the start line said
    "batches of up to 8" (--batch-size's, or its default) beside "one request per task",
    contradicting itself."""
    from test_serve import start_server

    served = start_server([real_plan(model).root], tmp_path, "--name", "m", *extra)
    try:
        start = next(line for line in served.lines if line.startswith("model 'm'"))
    finally:
        rc = served.stop()
    assert rc == 0, "\n".join(served.lines)
    assert "batches of up to 1," in start and "one request per task (max_batch_size 0)" in start, start


@pytest.mark.parametrize("args, said", [
    (["sweep", "PLAN", "--rates", "10", "--batch-sizes", "1", "--duration", "1s", "--warmup", "2s", "--no-plots"],
     "--warmup must be shorter than --duration (1 s), got 2 s"),
    (["sweep", "PLAN", "--rates", "10", "--batch-sizes", "1", "--min-batches", "0", "--no-plots"],
     "--min-batches must be at least 1, got 0"),
    (["simulate", "PLAN", "--rate", "10", "--batch", "1", "--requests", "0"], "--requests must be at least 1, got 0"),
    (["simulate", "PLAN", "--rate", "10", "--batch", "1", "--spread", "-1"], "--spread must be >= 0, got -1"),
    (["simulate", "PLAN", "--rate", "10", "--batch", "2", "--queue-capacity", "1"],
     "--queue-capacity must be at least 1, and at least --batch without --max-delay, got 1"),
])
def test_sweep_and_simulate_refusals_name_the_flag(real_plan, tmp_path, args, said):
    """A refused setting is said in the command line's words: ``--min-batches 0`` read
    "min_batches must be >= 1", ``--requests 0`` "n_requests must be >= 1" (the Python
    parameters, which the user never typed)."""
    plan = real_plan("gru_stream")
    for _ in range(3):  # simulate needs the plan calibrated; a loaded host may leave an entry short
        done = _run(["calibrate", str(plan.root), "--batch-sizes", "1,2", "--groups", PU, "--no-bus", "--no-host"],
                    tmp_path / "home")
        assert done.returncode == 0, done.stdout + done.stderr
        if "not calibrated (" not in done.stdout:
            break
    res = _run([str(plan.root) if a == "PLAN" else a for a in args] + ["--groups", PU]
               + (["-o", str(tmp_path / "res")] if args[0] == "sweep" else []), tmp_path / "home")
    assert res.returncode == 2, res.stdout
    assert _one_error_line(res) == f"staronnx: error: {said}"
