"""``--shares auto``: the split from measured or calibrated speeds, one part where it cannot pay.

The rule is pure arithmetic over per-worker times, checked on the figures measured on the H100
host (issue 11) and on made-up machines; the measuring path runs for real through the CLI
(ONNX Runtime sessions on this machine's CPU groups), and ``--speeds-from`` reads real
calibrated perf models of a 1-part plan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from staronnx import partition
from staronnx.errors import PartitionError
from staronnx.partition.autoshares import WorkerSpeed, choose_shares, concurrent_seconds, is_auto
from staronnx.partition import PartitionSpec
from staronnx.perfmodels import PerfModelStore
from staronnx.perfmodels.helpcost import HelpCost
from staronnx.zoo import inception


def test_is_auto():
    assert is_auto("auto") and is_auto(" AUTO ") and not is_auto("0.5,0.5") and not is_auto(None)


#: a host whose CPU tasks cost its GPU nothing (a slow GPU that never waits for the host): the
#: split's arithmetic alone, as these tests check it
FREE = HelpCost.free()


def test_h100_googlenet_batch8_gives_a_small_cpu_tail():
    # issue 11: ort1 3,647 samples/s on the GPU, 389 on a 14-core group, batch 8
    speeds = [WorkerSpeed("cuda0", "cuda", 8 / 3647), WorkerSpeed("cpu14", "cpu", 8 / 389)]
    choice = choose_shares(speeds, 8, help=FREE)
    assert choice.parts == 2
    assert 0.05 <= choice.shares[1] <= 0.12 and abs(sum(choice.shares) - 1) < 1e-9
    assert choice.predicted["split"] > 1.03 * choice.predicted["one part"]
    assert "cpu14" in choice.reason and "cuda0" in choice.reason


def test_a_cpu_worth_too_little_gives_one_part():
    # resnet50 batch 32 on the H100: 5,587 vs 109 samples/s: the CPU adds ~2 %
    speeds = [WorkerSpeed("cuda0", "cuda", 32 / 5587), WorkerSpeed("cpu14", "cpu", 32 / 109)]
    choice = choose_shares(speeds, 32)
    assert choice.shares == [1.0] and "one part" in choice.reason
    assert choice.predicted["split"] < 1.03 * choice.predicted["one part"]


def test_the_papers_p100_machine_gives_about_their_split():
    # a P100-era GPU only ~5x the CPU groups together: the CPU takes a sizeable tail
    speeds = [WorkerSpeed("cuda0", "cuda", 0.010), WorkerSpeed("cpu8", "cpu", 0.10, count=2)]
    choice = choose_shares(speeds, 8, help=FREE)
    assert choice.parts == 2 and 0.12 <= choice.shares[1] <= 0.2


def test_alike_workers_give_one_part():
    choice = choose_shares([WorkerSpeed("cpu1", "cpu", 0.03, count=2)], 4)
    assert choice.shares == [1.0] and "within" in choice.reason
    one = choose_shares([WorkerSpeed("cpu2", "cpu", 0.03)], 4)
    assert one.shares == [1.0] and "single worker" in one.reason
    near = choose_shares([WorkerSpeed("cpu4", "cpu", 0.02), WorkerSpeed("cpu2", "cpu", 0.035)], 4)
    assert near.shares == [1.0]


def test_a_costly_transfer_or_task_can_cancel_the_split():
    speeds = [WorkerSpeed("cuda0", "cuda", 0.002), WorkerSpeed("cpu14", "cpu", 0.02)]
    assert choose_shares(speeds, 8, help=FREE).parts == 2
    assert choose_shares(speeds, 8, transfer_seconds=0.002, help=FREE).shares == [1.0]
    assert choose_shares(speeds, 8, fixed_cost=0.005, help=FREE).shares == [1.0]  # dilutes the CPU's 10 %


def test_several_gpus_add_up_and_leave_the_cpu_a_smaller_tail():
    """Two H100s beside the same CPU group: the fast class is both GPUs (their rates add up), so
    the CPU's tail halves; it used to be priced against one GPU, the second ignored."""
    gpu, cpu = WorkerSpeed("cuda0", "cuda", 8 / 3647), WorkerSpeed("cpu14", "cpu", 8 / 389)
    one = choose_shares([gpu, cpu], 8, help=FREE)
    two = choose_shares([gpu, WorkerSpeed("cuda1", "cuda", 8 / 3647), cpu], 8, help=FREE)
    assert two.predicted["one part"] == pytest.approx(2 * one.predicted["one part"], rel=0.05)
    assert one.parts == 2 and (two.parts == 1 or two.shares[1] < 0.75 * one.shares[1]), (one.reason, two.reason)
    assert "cuda0 + cuda1" in two.reason
    four = choose_shares([WorkerSpeed(f"cuda{d}", "cuda", 8 / 3647) for d in range(4)] + [cpu], 8, help=FREE)
    assert four.shares == [1.0] and "cuda0 + cuda1 + cuda2 + cuda3 alone" in four.reason


def test_the_h200_batch8_split_that_lost_is_no_longer_chosen():
    """The H200 row of 2026-11-28 at batch 8: the GPU alone 5,477 samples/s with 4 streams, a CPU
    group ~400 (docs/guides/gpu.md). Free help predicts a 7 % CPU tail worth about +4 %, the split
    that ran 26 % below the GPU alone; charged what a CPU task costs the GPU (the H200's 13 %),
    the split predicts a loss and one part is kept, and the reason says the charge."""
    speeds = [WorkerSpeed("cuda0", "cuda", 8 / 5477, streams=4), WorkerSpeed("cpu15", "cpu", 8 / 400)]
    assert choose_shares(speeds, 8, help=FREE).parts == 2
    charged = choose_shares(speeds, 8)
    assert charged.shares == [1.0] and "charged 13% of the GPU" in charged.reason, charged.reason
    assert charged.predicted["split"] < charged.predicted["one part"]


def test_a_gain_within_the_gpus_own_spread_is_not_taken():
    """A split predicted +5 % beside a GPU whose three timings spread 8 % is within that GPU's
    noise: one part, the reason naming the spread; the same GPU timed steady keeps the split."""
    cpu = WorkerSpeed("cpu14", "cpu", 8 / 389)
    steady = choose_shares([WorkerSpeed("cuda0", "cuda", 8 / 3647), cpu], 8, help=FREE)
    assert steady.parts == 2
    gain = steady.predicted["split"] / steady.predicted["one part"] - 1
    noisy = choose_shares([WorkerSpeed("cuda0", "cuda", 8 / 3647, spread=gain + 0.02), cpu], 8, help=FREE)
    assert noisy.shares == [1.0] and "run-to-run spread" in noisy.reason, noisy.reason


def test_bad_speeds_are_refused():
    with pytest.raises(PartitionError, match="> 0"):
        choose_shares([WorkerSpeed("cpu1", "cpu", 0.0)], 1)
    with pytest.raises(PartitionError):
        choose_shares([], 1)


# ------------------------------------------------------------------ through the doors
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("auto") / "inception.onnx"
    onnx.save(inception(blocks=2, channels=8, size=16), str(path))
    return path


def test_partition_api_with_given_speeds_cuts_the_chosen_split(model, tmp_path, monkeypatch):
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path / "home"))  # a home of its own: the cost below stays here
    PerfModelStore().save_help_cost(FREE)  # this host's measured cost: its CPU help is free
    speeds = [WorkerSpeed("cuda0", "cuda", 8 / 3647), WorkerSpeed("cpu14", "cpu", 8 / 389)]
    plan = partition(model, "auto", PartitionSpec(profile_runs=1), speeds=speeds, output_dir=tmp_path / "p")
    auto = plan.settings["auto_shares"]
    assert plan.k == 2 and auto["shares"] == plan.settings["shares"]
    assert abs(plan.parts[1].target_share - auto["shares"][1]) < 1e-9
    with pytest.raises(PartitionError, match="parts"):
        partition(model, "auto", PartitionSpec(parts=2), output_dir=tmp_path / "q")


def _cli(*args: str, home) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "staronnx", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "STARONNX_HOME": str(home), "COLUMNS": "200"})


def test_cli_shares_auto_times_this_machine_and_says_why(model, tmp_path, two_groups):
    out = tmp_path / "plan"
    done = _cli("partition", str(model), "--shares", "auto", "--groups", two_groups, "-o", str(out),
                "--profile-runs", "2", home=tmp_path / "home")
    assert done.returncode == 0, done.stderr
    settings = json.loads((out / "plan.json").read_text())["settings"]
    auto = settings["auto_shares"]
    # two alike one-core groups: whole batches over both beat a split
    assert auto["shares"] == [1.0] and [s["name"] for s in auto["speeds"]] == ["cpu1"]
    assert auto["speeds"][0]["count"] == 2 and auto["speeds"][0]["seconds"] > 0
    assert "shares auto" in done.stdout and "one part" in done.stdout
    shown = _cli("plan", "show", str(out), home=tmp_path / "home")
    assert shown.returncode == 0 and "shares auto" in shown.stdout
    bad = _cli("partition", str(model), "--shares", "0.5,0.5", "--groups", two_groups, "-o", str(tmp_path / "x"),
               home=tmp_path / "home")
    assert bad.returncode == 2 and "--shares auto" in bad.stderr


def test_cli_shares_auto_from_a_calibrated_one_part_plan(model, tmp_path, two_groups):
    home = tmp_path / "home"
    one = tmp_path / "one"
    assert _cli("partition", str(model), "--parts", "1", "-o", str(one), "--profile-runs", "1",
                home=home).returncode == 0
    missing = _cli("partition", str(model), "--shares", "auto", "--speeds-from", str(one), "--groups", two_groups,
                   "-o", str(tmp_path / "x"), home=home)
    assert missing.returncode == 2 and "calibrate" in missing.stderr, missing.stderr
    cal = _cli("calibrate", str(one), "--batch-sizes", "8", "--groups", two_groups, "--no-bus", home=home)
    assert cal.returncode == 0, cal.stderr
    out = tmp_path / "auto"
    done = _cli("partition", str(model), "--shares", "auto", "--speeds-from", str(one), "--groups", two_groups,
                "-o", str(out), home=home)
    assert done.returncode == 0, done.stderr
    auto = json.loads((out / "plan.json").read_text())["settings"]["auto_shares"]
    assert auto["speeds"][0]["name"] == "cpu1" and auto["speeds"][0]["count"] == 2
    assert auto["shares"] == [1.0]
    two = _cli("partition", str(model), "--shares", "auto", "--speeds-from", str(out / ".." / "auto"),
               "-o", str(tmp_path / "y"), home=home)
    assert two.returncode == 2  # not calibrated (and 1 part) -> one clear line


def test_cli_shares_auto_from_the_models_of_every_gpu_named(model, tmp_path, two_groups):
    """``partition --shares auto --speeds-from ONE --cuda-streams 1 --cuda-devices 0,1``: a speed
    per GPU, each from its own models (read, not timed: no GPU needed), and a CPU tail sized
    against both GPUs: smaller than against GPU 0 alone."""
    from staronnx.plan import Plan
    from test_simulator import write_models

    home = tmp_path / "home"
    one = tmp_path / "one"
    assert _cli("partition", str(model), "--parts", "1", "-o", str(one), "--profile-runs", "1",
                home=home).returncode == 0
    # the whole model: 1 ms a batch of 8 on each GPU, 10 ms on each one-core group
    write_models(PerfModelStore(home), Plan.load(one), {(0, "cuda0"): 1e-3, (0, "cuda1"): 1e-3, (0, "cpu1"): 1e-2},
                 batches=(8,))
    PerfModelStore(home).save_help_cost(FREE)  # a host whose CPU help was measured free
    choices = {}
    for devices in ("0", "0,1"):
        out = tmp_path / f"auto{devices}"
        done = _cli("partition", str(model), "--shares", "auto", "--speeds-from", str(one), "--groups", two_groups,
                    "--cuda-streams", "1", "--cuda-devices", devices, "-o", str(out), home=home)
        assert done.returncode == 0, done.stderr
        choices[devices] = json.loads((out / "plan.json").read_text())["settings"]["auto_shares"]
    assert [s["name"] for s in choices["0,1"]["speeds"]] == ["cuda0", "cuda1", "cpu1"]
    assert [s["name"] for s in choices["0"]["speeds"]] == ["cuda0", "cpu1"]
    tail = {d: c["shares"][1] if len(c["shares"]) == 2 else 0.0 for d, c in choices.items()}
    assert 0 < tail["0"] and tail["0,1"] < tail["0"], choices
    refused = _cli("partition", str(model), "--shares", "0.5,0.5", "--cuda-devices", "0", "-o", str(tmp_path / "x"),
                   home=home)
    assert refused.returncode == 2 and "--shares auto only" in refused.stderr, refused.stderr


def test_perfmodel_show_says_whether_the_plan_or_one_part_is_predicted_faster(calibrated_inception, two_groups):
    plan, home = calibrated_inception
    shown = _cli("perfmodel", "show", str(plan.root), "--groups", two_groups, home=home)
    assert shown.returncode == 0, shown.stderr
    verdicts = [line for line in shown.stdout.splitlines() if "is predicted faster" in line]
    assert verdicts and all("LP bound" in v and "alone" in v for v in verdicts)


def test_cli_placement_method_places_on_the_groups_given_and_runs_as_placed(model, tmp_path, two_groups):
    out = tmp_path / "duet"
    home = tmp_path / "home"
    done = _cli("partition", str(model), "--method", "duet", "--groups", two_groups, "-o", str(out),
                "--profile-runs", "1", home=home)
    assert done.returncode == 0, done.stderr
    devices = {p["device"] for p in json.loads((out / "plan.json").read_text())["parts"]}
    assert devices <= {f"cpu:pus{pu}" for pu in two_groups.split(";")}
    run = _cli("run", str(out), "--policy", "static", "--groups", two_groups, "--requests", "4", home=home)
    assert run.returncode == 0, run.stderr


def test_concurrent_seconds_runs_every_call_at_once_on_its_own_thread():
    """How a GPU is timed for its streams: each call loops on its own thread, all at once (a
    barrier every call must reach each round would break if they ran one after another), each
    thread inside ``enter``; the figure is wall time per call over all of them."""
    import threading
    from contextlib import contextmanager

    sessions = [ort_session() for _ in range(3)]
    feeds = {"x": np.ones((2, 4), np.float32)}
    meet = threading.Barrier(3, timeout=30)
    entered: list[str] = []
    runs: list[int] = [0, 0, 0]

    def call(i: int):
        def run():
            meet.wait()  # every thread in the same round
            runs[i] += 1
            return sessions[i].run(None, feeds)
        return run

    @contextmanager
    def enter():
        entered.append(threading.current_thread().name)
        yield

    seconds = concurrent_seconds([call(i) for i in range(3)], rounds=5, warmup=2, enter=enter)
    assert seconds > 0
    assert runs == [7, 7, 7]
    assert sorted(entered) == ["speed-0", "speed-1", "speed-2"]


def test_concurrent_seconds_raises_a_calls_error_on_the_caller():
    def bad():
        raise RuntimeError("CUDA failure 2: out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        concurrent_seconds([bad, lambda: None], rounds=2)
    with pytest.raises(ValueError, match="at least one call"):
        concurrent_seconds([], rounds=2)


def test_a_gpu_timed_with_its_streams_is_named_with_them():
    """The reason says at which concurrency the GPU was timed (a split that looked like a win
    against one batch's latency must say what it was weighed against)."""
    speeds = [WorkerSpeed("cuda0", "cuda", 8 / 5400, streams=4), WorkerSpeed("cpu15", "cpu", 8 / 292)]
    choice = choose_shares(speeds, 8)
    assert "cuda0 (4 streams)" in choice.reason
    assert choice.to_json()["speeds"][0]["streams"] == 4


def ort_session():
    """A real one-node ONNX Runtime session (Relu over a 2x4 input)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_cli_shares_auto_with_cuda_streams_times_the_gpu(model, tmp_path, two_groups, monkeypatch):
    """``partition --shares auto --cuda-streams N`` (docs/guides/gpu.md's command) times the whole
    model on the GPU with N sessions at once, beside the CPU groups: without ``--device cuda`` it
    timed the CPU groups alone, and a GPU user got a split chosen as on a CPU-only machine. Here on
    the CUDA stand-in (STARONNX_CUDA_RUNTIME=host: the CPU provider in the GPU's place)."""
    monkeypatch.setenv("STARONNX_CUDA_RUNTIME", "host")
    out = tmp_path / "plan"
    done = _cli("partition", str(model), "--shares", "auto", "--cuda-streams", "2", "--groups", two_groups,
                "-o", str(out), "--profile-runs", "2", home=tmp_path / "home")
    assert done.returncode == 0, done.stderr
    speeds = json.loads((out / "plan.json").read_text())["settings"]["auto_shares"]["speeds"]
    gpu = [s for s in speeds if s["name"] == "cuda0"]
    assert len(gpu) == 1 and gpu[0]["streams"] == 2 and gpu[0]["seconds"] > 0, speeds
