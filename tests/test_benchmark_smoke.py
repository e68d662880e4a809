"""The host-cost benchmarks of issue 19 run end to end (short durations, no timing asserted:
speed is theirs to print), so their rows and goal lines cannot rot between sessions."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, tmp: Path) -> str:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "STARONNX_HOME": str(tmp / "home")})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_policy_cost_counts_each_policy_and_stream_count(tmp_path):
    """``benchmarks/policy_cost.py``: a row per policy and stream count, each with its calls and
    CPU per task and its lone request's latency; the count is the figure that compares runs, and
    a dmda decision over 8 streams costs well under twice its decision over one (it asked each
    stream's perf model once per task, 2.2x, before)."""
    out = _run("policy_cost.py", "--rounds", "1", "--tasks", "128", tmp=tmp_path)
    rows = {(m.group(1), int(m.group(2))): [float(v) for v in m.group(3).split()]
            for m in re.finditer(r"^ *(eager|dmda|heft) +(\d+) +([\d. ]+)$", out, re.MULTILINE)}
    assert sorted(rows) == sorted((p, n) for p in ("eager", "dmda", "heft") for n in (1, 4, 8)), out
    assert all(len(v) == 3 and all(x > 0 for x in v) for v in rows.values()), out
    assert rows["dmda", 8][0] < 1.5 * rows["dmda", 1][0], out


def test_host_overhead_measures_every_stream_count_and_says_the_goals(tmp_path):
    out = _run("host_overhead.py", "--seconds", "0.2", "--rounds", "1", tmp=tmp_path)
    rows = {int(m.group(1)): [float(v.replace(",", "")) for v in m.group(2).split()]
            for m in re.finditer(r"^ +([124]) +([\d,. ]+)$", out, re.MULTILINE)}
    assert sorted(rows) == [1, 2, 4], out
    assert all(len(v) == 9 and all(x > 0 for x in v) for v in rows.values()), out
    assert re.search(r"one stream: [\d.]+ us of host time per task, [\d.]+ colocated \(target <= 40\); 4 streams / 1 "
                     r"stream tasks/s: [\d.]+, [\d.]+ colocated \(target >= 1.0\)", out), out
    calls = re.search(r"python calls per task, 1 and 4 streams .*: (n/a|([\d.]+) and ([\d.]+) \(([\d.]+)x\))", out)
    assert calls, out
    if calls.group(1) != "n/a":  # a task takes dozens of calls (submit, push, pop, run, finish)
        one, four, ratio = (float(calls.group(i)) for i in (2, 3, 4))
        assert 20 < one < 1000 and 20 < four < 1000, out
        assert ratio == pytest.approx(four / one, abs=0.01), out


def test_steadiness_says_how_far_each_cores_speed_strays(tmp_path):
    """``benchmarks/steadiness.py``: every core's speed per window, and one line that says the
    spread and the share of windows a band covers."""
    out = _run("steadiness.py", "--seconds", "1.5", "--window", "0.5", "--band", "5", "--json",
               str(tmp_path / "s.json"), tmp=tmp_path)
    assert re.search(r"machine steadiness: plain ONNX Runtime .* windows of 0.5 s: speed [\d.]+% \(sd\) around each "
                     r"core's mean, slowest to fastest window x[\d.]+; \d+% of windows within 5.0% of the mean", out), out
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["speeds"] and all(v and all(x > 0 for x in v) for v in doc["speeds"].values())


def test_the_simulator_benchmark_prints_the_band_and_the_machines_steadiness(tmp_path):
    """``benchmarks/simulator.py`` on crnn_ocr, two short points: the per-model band line, the
    closing table's "robust" row with its fragile count and the share in the band, and the
    machine's steadiness, also in its JSON."""
    out = _run("simulator.py", "--models", "crnn_ocr", "--rates", "100,300", "--batch-sizes", "1", "--duration",
               "0.5", "--steadiness", "1", "--sim-band", "5", "--json", str(tmp_path / "sim.json"), tmp=tmp_path)
    assert re.search(r"band \(tasks 5% faster and slower\): \d+ steady point\(s\) fragile", out), out
    assert re.search(r"^crnn_ocr +robust +\|.*\| \d+, (?:[\d.]+%|-) of \d+$", out, re.MULTILINE), out
    assert "machine steadiness:" in out
    doc = json.loads((tmp_path / "sim.json").read_text())
    assert doc["steadiness"]["speeds"] and doc["models"][0]["robust"]["band"] == pytest.approx(0.05)


def test_serving_path_measures_the_open_loop_points_and_says_the_goals(tmp_path):
    out = _run("serving_path.py", "--seconds", "0.5", "--rounds", "1", tmp=tmp_path)
    assert re.search(r"single requests through the server: [\d,]+ requests/s", out), out
    modes = re.findall(r"req/s +(plain|colocated): [\d,]+/s, p50 [\d.]+ ms, p99 [\d.]+ ms", out)
    assert modes == ["plain", "colocated"] * 3, out
    if sys.platform == "linux":  # /proc/stat says how long the hypervisor stole the CPUs
        assert len(re.findall(r"lag p99 [\d.]+ ms, CPU [\d.]+ us/request, steal \d+ ms", out)) == 6, out
    else:
        assert len(re.findall(r"lag p99 [\d.]+ ms, CPU [\d.]+ us/request", out)) == 6, out
    assert re.search(r"requests/s \([\d.]+ us of host time per request, [\d.]+ us of CPU\)", out), out
    assert re.search(r"goals: host time <= 25 us/request: (met|not met) .*up to 75 %: (met|not met) plain, "
                     r"(met|not met) colocated \(generator and batcher on the worker's PU \d+\)", out), out


def test_colocation_compares_plain_and_colocated_open_loops_and_says_the_goal(tmp_path):
    out = _run("colocation.py", "--seconds", "0.5", "--rounds", "1", tmp=tmp_path)
    assert re.search(r"capacity, single requests through a plain Server: [\d,]+ requests/s", out), out
    rows = re.findall(r"^ +[\d,]+ +(plain|colocated) +[\d,]+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+", out, re.MULTILINE)
    assert rows == ["plain", "colocated"] * 3, out
    assert re.search(r"goal: colocated, p99 <= 5x p50 and lag p99 <= 1 ms up to 75 %: (met|not met); colocated kept "
                     r"that where plain did not at: ", out), out


@pytest.mark.parametrize("script", ["host_overhead.py", "colocation.py"])
def test_host_cost_benchmarks_on_the_gpu_say_what_is_missing_where_there_is_none(script, tmp_path):
    """``--device cuda`` measures the GPU or nothing: without CUDA, one line naming what is
    missing (never a HostRuntime figure labelled as a GPU one)."""
    from staronnx.workers.cuda import cuda_unavailable_reason

    if cuda_unavailable_reason(0) is None:
        pytest.skip("CUDA is here: the benchmark measures the GPU")
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--device", "cuda", "--seconds", "0.1"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "STARONNX_HOME": str(tmp_path)})
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("--device cuda: CUDA workers need"), done.stderr


@pytest.mark.parametrize("which, steps", [
    ("table", ["models", "table", "table-md"]),
    ("tests", ["pytest-gpu", "host-overhead"]),
    ("host", ["host-overhead-host", "serving-path"]),
    ("serve", ["serve-tail", "serve-googlenet"]),
    ("predictions", ["steadiness", "simulator"]),
])
def test_the_gpu_session_script_runs_its_steps_within_its_budget(which, steps, tmp_path):
    """``benchmarks/gpu_session.sh MODE`` (the device calls of a session with a GPU): every
    step named in the summary, each skipped here by a budget too small to start it, so the
    script's flow is checked where one device call could not afford to find it broken; the
    step logs come back as one tarball beside the summary (a call returns at most 8 files)."""
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_session.sh"), which], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env={**os.environ, "OUT": str(out), "SESSION_SECONDS": "5"})
    assert done.returncode == 0, done.stdout + done.stderr
    gpu, commit, *summary = (out / "summary.txt").read_text().splitlines()
    assert gpu.startswith("gpu: "), gpu  # nvidia-smi's line, or "none"
    assert commit.startswith("commit: "), commit  # what the figures are of
    assert [line.split(":")[0] for line in summary[:-1]] == steps, summary
    assert all("skipped" in line for line in summary[:-1]) and summary[-1].startswith("total: "), summary
    assert sorted(p.name for p in out.iterdir()) == ["logs.tgz", "summary.txt"]


def test_the_infer_benchmark_checks_row_for_row_and_times_four_setups(tmp_path):
    """``benchmarks/infer.py`` on crnn_ocr, 96 rows in shards of 32: infer's outputs equal the
    plain-ORT loop's row for row, the peak RSS is read, and one round times infer, run, the loop
    and infer on the --before workers; the JSON keeps every repeat and where it came from."""
    out_json = tmp_path / "infer.json"
    out = _run("infer.py", "--models", "crnn_ocr", "--rows", "96", "--shard", "32", "--timing-rows", "64",
               "--rounds", "1", "--groups", "0", "--before", "0:1", "--data", str(tmp_path / "data"),
               "--out", str(out_json), tmp=tmp_path)
    assert "outputs equal row for row (96 rows, in order once: True" in out, out
    assert re.search(r"on 0 with 2 in flight: infer / run [\d.]+, infer / ORT loop [\d.]+, "
                     r"infer / infer on 0 with 1 in flight [\d.]+", out), out
    result = json.loads(out_json.read_text())
    model = result["models"][0]
    assert model["check"]["equal"] and model["memory"]["peak_rss"] > 0
    assert (model["groups"], model["max_in_flight"], model["before"]) == ("0", 2, {"groups": "0", "max_in_flight": 1})
    assert {k: len(v) for k, v in model["timing"]["samples_per_s"].items()} == {
        "infer": 1, "run": 1, "ort": 1, "infer_before": 1}
    assert result["provenance"]["commit"] and "infer.py" in result["provenance"]["command"]
