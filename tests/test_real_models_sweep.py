"""The measuring doors on the real exported models (issue 34): ``sweep`` (live, ``--simulate``,
``--url`` against a ``staronnx serve``), ``optimize-batch`` and ``simulate``, and failures
reported as failures.

Each kind of ``models/real/`` goes through the CLI as a user runs it: a batch on
axis 1 of a state plus a scalar per-request input (gru_stream), dynamic sizes (crnn_ocr's
width, bert_tiny's sequence), a fixed batch of 1 (mobilenet_b1) and data-dependent outputs
(detector_nms). A model that runs one request per task is measured and simulated at batch 1
only, said in one line. Over the network, ``sweep --check MODEL.onnx`` holds every answer
against plain onnxruntime's answer to that request's own inputs. Points are short (a fraction
of a second, one or two rates, batch 1 and 2, one one-PU CPU group): no timing is asserted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import realmodels
from _helpers import cli
from staronnx.plan import Plan
from staronnx.partition import PartitionSpec

pytestmark = pytest.mark.timeout(300)

#: one one-PU CPU group, whatever the host
PU = str(min(os.sched_getaffinity(0)))
#: each kind of real model the measuring doors must handle
KINDS = ("gru_stream", "crnn_ocr", "bert_tiny", "mobilenet_b1", "detector_nms")
#: what a short point looks like on the command line
SHORT = ("--duration", "0.3s", "--warmup", "0", "--min-batches", "2", "--no-extend", "--no-plots", "--quiet")


def _results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


@pytest.fixture(scope="module")
def calibrated(real_plan):
    """``calibrated(name)``: the model's shared plan, calibrated through the CLI at batch 1 and 2
    on one one-PU group (what the simulator and the LP bound need); once per module."""
    done: dict[str, Plan] = {}

    def get(name: str, capsys) -> Plan:
        if name not in done:
            plan = real_plan(name)
            # on a loaded host the outlier rule can leave an entry short of its samples within
            # the cap (then the sweep has no simulation and no bound): calibrate again, the
            # store keeps what the first run learnt
            for _ in range(3):
                code, out, err = cli(capsys, "calibrate", plan.root, "--batch-sizes", "1,2", "--groups", PU)
                assert code == 0, out + err
                if "not calibrated (" not in out:
                    break
            assert "not calibrated (" not in out, out
            done[name] = plan
        return done[name]

    return get


# -- 1. failures are failures --------------------------------------------------------------------
def test_a_point_whose_requests_failed_is_failed_with_the_first_error(fragile_plan, tmp_path, capsys):
    """Every request fails inside ONNX Runtime (``x`` of width 9 passes every signature check,
    part 1's MatMul needs 8): the point is ``failed`` with ORT's reason in its notes, 0
    samples/s, nothing else skipped for congestion; not ``congested`` with empty notes, and
    no traceback (the warm-up's failure is a note, not the end of the sweep)."""
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.ones((4, 9), np.float32))
    out = tmp_path / "out"
    code, stdout, stderr = cli(capsys, "sweep", fragile_plan.root, "--inputs", bad, "--rates", "40,80",
                               "--batch-sizes", "1", "--groups", PU, *SHORT, "-o", out)
    assert code == 0, stdout + stderr
    assert "Traceback" not in stdout + stderr
    doc = _results(out)
    (row,) = doc["rows"]  # every request failed at 40 req/s: 80 would fail alike, and is skipped
    assert row["state"] == "failed", row
    assert row["failed"] > 0 and row["completed"] == 0 and row["throughput"] == 0, row
    assert "MatMul" in row["notes"] and "failed" in row["notes"], row["notes"]
    assert doc["skipped"] == [{"batch_size": 1, "offered_rate": 80.0, "reason": "every request failed at 40 req/s"}]
    assert any(n.startswith("warm-up failed at batch 1") for n in doc["notes"]), doc["notes"]
    # the table and the point's line say failed, with the reason, where the user reads
    assert "│ failed" in stdout and "congested" not in stdout, stdout
    assert "b=1 @ 40 req/s: failed:" in stdout and "MatMul" in stdout, stdout
    assert (out / "results.csv").read_text().splitlines()[1].count("failed") >= 1


# -- 2. the doors on each kind -------------------------------------------------------------------
@pytest.mark.parametrize("name", KINDS)
def test_sweep_simulate_optimize_on_each_kind(name, calibrated, tmp_path, capsys):
    """A short live sweep with its simulation, ``optimize-batch`` and ``simulate`` work on each
    kind; a model that runs one request per task is measured, simulated and bounded at batch 1
    only, and each door says so in one line (never a traceback, never a figure for batch 2)."""
    plan = calibrated(name, capsys)
    one_per_task = name in realmodels.ONE_PER_TASK
    assert plan.contract.batchable is not one_per_task
    said = "batch size(s) 2 left out, batch 1 only: this model runs one request per task"

    out = tmp_path / "sweep"
    code, stdout, stderr = cli(capsys, "sweep", plan.root, "--rates", "40", "--batch-sizes", "1,2",
                               "--groups", PU, "--simulate", *SHORT, "-o", out)
    assert code == 0 and "Traceback" not in stdout + stderr, stdout + stderr
    doc = _results(out)
    sizes = [1] if one_per_task else [1, 2]
    assert [r["batch_size"] for r in doc["rows"]] == sizes and doc["settings"]["batch_sizes"] == sizes
    for r in doc["rows"]:
        assert r["state"] != "failed" and r["failed"] == 0 and r["completed"] > 0, r
        assert r.get("sim_throughput") is not None and r.get("bound_throughput") is not None, (r, doc["notes"])
    assert sorted(doc["bounds"]) == [str(b) for b in sizes]
    assert (said in stdout) is one_per_task and (said in " ".join(doc["notes"])) is one_per_task, stdout

    js = tmp_path / "opt.json"
    code, stdout, stderr = cli(capsys, "optimize-batch", plan.root, "--rate", "40", "--batch-sizes", "1,2",
                               "--groups", PU, "--sim-duration", "0.5s", "--verify-duration", "0.3s",
                               "--max-verify", "1", "--json", js)
    assert code == 0 and "Traceback" not in stdout + stderr, stdout + stderr
    result = json.loads(js.read_text())
    assert [c["batch_size"] for c in result["candidates"]] == sizes
    assert result["best"] in sizes and all(c["measured_state"] != "failed" for c in result["candidates"]
                                           if c["measured_state"] is not None)
    assert (said in stdout) is one_per_task, stdout

    code, stdout, stderr = cli(capsys, "simulate", plan.root, "--rate", "40", "--batch", "2", "--groups", PU,
                               "--duration", "0.5s")
    assert code == 0 and "Traceback" not in stdout + stderr, stdout + stderr
    ran = 1 if one_per_task else 2
    assert f"batch {ran}: throughput" in stdout and f"at batch {ran} " in stdout, stdout
    assert (said in stdout) is one_per_task, stdout


def test_simulated_sweep_says_when_its_inputs_are_not_the_profiled_size(calibrated, tmp_path, capsys):
    """crnn_ocr cut and calibrated at width 148, swept with real inputs of width 200: the live
    points run at 200, and the notes say the bound and the simulation priced 148 (another
    footprint), instead of passing a prediction of another size off as this one's."""
    plan = calibrated("crnn_ocr", capsys)
    real = tmp_path / "wide.npz"
    np.savez(real, image=np.random.default_rng(0).standard_normal((4, 1, 32, 200)).astype(np.float32))
    out = tmp_path / "out"
    code, stdout, stderr = cli(capsys, "sweep", plan.root, "--inputs", real, "--rates", "40", "--batch-sizes", "1",
                               "--groups", PU, "--simulate", *SHORT, "-o", out)
    assert code == 0, stdout + stderr
    doc = _results(out)
    assert doc["rows"][0]["state"] != "failed" and doc["rows"][0]["completed"] > 0
    said = [n for n in doc["notes"] if n.startswith("the LP bound and the simulation price the shapes")]
    assert len(said) == 1 and "image [1, 1, 32, 200] (profiled [1, 1, 32, 148])" in said[0], doc["notes"]


def test_mixed_sweep_runs_a_one_request_per_task_model_at_batch_1(real_plan, tmp_path, capsys):
    """Several models on one runtime at --batch-sizes 2: the model that cannot batch
    (mobilenet_b1) runs at batch 1 beside crnn_ocr's batches of 2, said in one line."""
    out = tmp_path / "mix"
    code, stdout, stderr = cli(capsys, "sweep", real_plan("crnn_ocr").root, real_plan("mobilenet_b1").root,
                               "--name", "ocr", "--name", "mob", "--rates", "ocr=20,mob=10", "--batch-sizes", "2",
                               "--groups", PU, *SHORT, "-o", out)
    assert code == 0 and "Traceback" not in stdout + stderr, stdout + stderr
    doc = _results(out)
    assert {r["model"]: r["batch_size"] for r in doc["rows"]} == {"ocr": 2, "mob": 1}
    assert all(r["state"] != "failed" and r["completed"] > 0 for r in doc["rows"]), doc["rows"]
    assert any(n.startswith("mob: batch size(s) 2 left out, batch 1 only") for n in doc["notes"]), doc["notes"]


# -- 3. sweep --url: the served contract, and every answer its own request's ---------------------
def _perturbed(name: str, folder: Path) -> Path:
    """The model with its largest weight scaled: same inputs and outputs, other answers."""
    model = onnx.load(str(realmodels.path(name)))
    biggest = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)) if t.dims else 0)
    biggest.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(biggest) * 1.5, biggest.name))
    path = folder / f"{name}-other.onnx"
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def served(real_plan, tmp_path_factory):
    """One ``staronnx serve`` of a fixed-batch-1 model (mob), a model with its batch on axis 1
    of its state and a scalar per-request input (gru) and the fragile chain (frag): batches
    of up to 4, 20 ms max delay (concurrent requests of different inputs share batches)."""
    import onnx as _onnx

    from staronnx import partition
    from staronnx.zoo import fragile
    from test_serve import start_server

    root = tmp_path_factory.mktemp("served")
    _onnx.save(fragile(), str(root / "fragile.onnx"))
    frag = partition(root / "fragile.onnx",
                     spec=PartitionSpec(parts=2, method="linear", input_shapes=["x=1x8"], costs="estimate"),
                     output_dir=root / "frag")
    plans = {"mob": real_plan("mobilenet_b1"), "gru": real_plan("gru_stream"), "frag": frag}
    s = start_server([p.root for p in plans.values()], root, *(a for n in plans for a in ("--name", n)),
                     "--policy", "eager", "--batch-size", "4", "--max-delay", "20ms", "--queue-capacity", "256")
    s.plans = plans
    yield s
    rc = s.stop()
    assert rc == 0, "\n".join(s.lines)


def _remote(capsys, served, model: str, out: Path, *args: object) -> tuple[int, str, str]:
    return cli(capsys, "sweep", served.plans[model].root, "--url", f"http://{served.http}", "--model", model,
               "--duration", "0.4s", "--warmup", "0", "--no-extend", "--no-plots", "--quiet", "-o", out, *args)


def test_sweep_url_fixed_batch_1_each_answer_is_its_own(served, tmp_path, capsys):
    """mobilenet_b1 is served one request per task (max_batch_size 0): the sweep reads it from
    the config, measures batch 1 only (batch 2 left out in one line) and every concurrent
    answer equals ORT's answer to that request's own image."""
    out = tmp_path / "mob"
    code, stdout, stderr = _remote(capsys, served, "mob", out, "--rates", "40", "--batch-sizes", "1,2",
                                   "--check", realmodels.path("mobilenet_b1"))
    assert code == 0 and "Traceback" not in stdout + stderr, stdout + stderr
    doc = _results(out)
    (row,) = doc["rows"]
    assert row["batch_size"] == 1 and row["state"] != "failed", row
    assert row["failed"] == 0 and row["completed"] == row["requests"] > 0, row
    assert doc["settings"]["front_end"]["batching"] is False
    assert doc["settings"]["front_end"]["check"] == str(realmodels.path("mobilenet_b1"))
    assert "batch size(s) 2 left out, batch 1 only: this model runs one request per task" in stdout


def test_sweep_url_batch_on_axis_1_each_answer_is_its_own(served, tmp_path, capsys):
    """gru_stream's state carries the batch on axis 1 and sample_rate is a scalar: the sweep
    sends one-sample requests of that shape ([2, 1, 64] and a rank-0 scalar), the server
    batches concurrent ones (fewer batches than answers), and every answer, warm-up batches of
    4 included, is ORT's answer to its own request."""
    out = tmp_path / "gru"
    code, stdout, stderr = _remote(capsys, served, "gru", out, "--rates", "150",
                                   "--check", realmodels.path("gru_stream"))
    assert code == 0 and "Traceback" not in stdout + stderr, stdout + stderr
    doc = _results(out)
    (row,) = doc["rows"]
    assert row["batch_size"] == 4 and row["state"] != "failed" and row["notes"] == "", row
    assert row["failed"] == 0 and row["completed"] == row["requests"] > 0, row
    assert row["batches"] < row["completed"], row  # requests with different inputs shared batches
    assert not doc["notes"] or not any("warm-up failed" in n for n in doc["notes"]), doc["notes"]


def test_sweep_url_check_counts_a_wrong_answer_as_failed(served, tmp_path, capsys):
    """Held against another model's answers (the same graph, other weights), every answer
    differs: each is a failed request, the point ``failed``, the output named in its notes.
    (What makes the two tests above able to fail.)"""
    out = tmp_path / "other"
    code, stdout, stderr = _remote(capsys, served, "gru", out, "--rates", "40",
                                   "--check", _perturbed("gru_stream", tmp_path))
    assert code == 0 and "Traceback" not in stdout + stderr, stdout + stderr
    (row,) = _results(out)["rows"]
    assert row["state"] == "failed" and row["completed"] == 0 and row["failed"] > 0, row
    assert "is not onnxruntime's answer to this request's own inputs" in row["notes"], row["notes"]


def test_sweep_url_failed_requests_are_failed_with_the_servers_reason(served, tmp_path, capsys):
    """Over the network too: requests the server fails (HTTP 500 from ORT inside it) make a
    ``failed`` point whose notes carry the server's message."""
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.ones((4, 9), np.float32))
    out = tmp_path / "frag"
    code, stdout, stderr = _remote(capsys, served, "frag", out, "--rates", "40", "--inputs", bad)
    assert code == 0 and "Traceback" not in stdout + stderr, stdout + stderr
    (row,) = _results(out)["rows"]
    assert row["state"] == "failed" and row["completed"] == 0 and row["failed"] > 0, row
    assert "inference failed" in row["notes"] and "MatMul" in row["notes"], row["notes"]


def test_sweep_check_needs_a_served_model(fragile_plan, tmp_path, capsys):
    code, _, err = cli(capsys, "sweep", fragile_plan.root, "--rates", "40", "--check", tmp_path / "m.onnx",
                       "-o", tmp_path / "out")
    assert code == 2 and err.startswith("staronnx: error: ") and "give --url too" in err, err


@pytest.mark.parametrize("flags, named", [
    (("--no-cuda-graphs",), "--no-cuda-graphs"), (("--cuda-graphs",), "--cuda-graphs"),
    (("--cuda-thread-per-stream",), "--cuda-thread-per-stream"),
    (("--cuda-thread-per-stream", "--no-cuda-graphs"), "--no-cuda-graphs, --cuda-thread-per-stream")])
def test_sweep_url_refuses_the_cuda_worker_flags_by_name(real_plan, tmp_path, capsys, flags, named):
    """Over the network the CUDA workers are the server's, and its configuration says nothing of
    their graphs or driver threads: ``sweep --url ... --no-cuda-graphs`` used to measure the
    server as it was started and record nothing of the flag, as if it had been honoured. It is
    refused by name, before any request is sent (the address here has no server at all)."""
    plan = real_plan("gru_stream")
    code, out, err = cli(capsys, "sweep", plan.root, "--url", "http://127.0.0.1:9", "--rates", "40",
                         "--batch-sizes", "1", *flags, "-o", tmp_path / "out", *SHORT)
    assert code == 2 and "Traceback" not in out + err, out + err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"staronnx: error: {named}: with --url the CUDA workers are the server's"), err
    assert not (tmp_path / "out" / "results.json").exists()
