"""``staronnx infer`` and :func:`staronnx.infer.infer`: a dataset in, its outputs out.

Every check goes through a door a user takes (the command, in process or as a subprocess that
is killed; the Python function) on the real exported models of ``models/real/``, and compares
each row's output with what plain ONNX Runtime answers to that row's inputs. No timing is
asserted: a subprocess is stopped once its first shards exist, whenever that is.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import realmodels
from _helpers import cli
from staronnx.infer import InferSpec, OutputError, RowError, infer, read_outputs
from staronnx.workers.layout import MachineSpec

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

#: one CPU group of one core: the same on any host, busy or not
ONE_CORE = "0"


def _ort(name: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return realmodels.ort_outputs(name, feeds)


def _assert_rows(got: dict, want_rows: list[dict[str, np.ndarray]], ids: np.ndarray, tol: float = 1e-4) -> None:
    """Row ``i`` of ``got`` (row id ``ids[i]``) equals ORT's answer for that row."""
    assert list(got["row_id"]) == list(ids)
    for name in want_rows[0]:
        for i, row_id in enumerate(ids):
            want = want_rows[int(row_id)][name]
            have = np.asarray(got[name][i])
            assert have.shape == want.shape, (name, row_id, have.shape, want.shape)
            scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
            assert float(np.abs(have - want).max(initial=0.0)) <= tol * scale, (name, row_id)


# -- datasets ----------------------------------------------------------------------------------------
def crnn_rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 1, 32, 64)).astype(np.float32)


def crnn_reference(x: np.ndarray) -> list[dict[str, np.ndarray]]:
    """ORT's answer per row, row-major (the CTC head's batch is its axis 1)."""
    out = _ort("crnn_ocr", {"image": x})["log_probs"]
    return [{"log_probs": out[:, i]} for i in range(len(x))]


def npz_shards(folder: Path, arrays: dict[str, np.ndarray], per_shard: int, axis: dict[str, int] | None = None,
               shared: dict[str, np.ndarray] | None = None) -> Path:
    """``arrays`` cut into .npz shards of ``per_shard`` samples along each one's axis."""
    folder.mkdir(parents=True, exist_ok=True)
    axis = axis or {}
    n = next(a.shape[axis.get(k, 0)] for k, a in arrays.items())
    for i, lo in enumerate(range(0, n, per_shard)):
        part = {k: np.take(a, np.arange(lo, min(lo + per_shard, n)), axis=axis.get(k, 0)) for k, a in arrays.items()}
        np.savez(folder / f"shard-{i}.npz", **part, **(shared or {}))
    return folder


# -- the command, end to end ---------------------------------------------------------------------------
def test_cli_npz_shards_to_parquet_row_for_row(tmp_path, capsys):
    """A folder of .npz shards (cut at 70 rows, output shards at 64, batches of 8: every edge
    falls elsewhere) through crnn_ocr, whose output has its batch on axis 1: one Parquet row per
    sample, in order, equal to ORT's answer row for row."""
    x = crnn_rows(200)
    src = npz_shards(tmp_path / "in", {"image": x}, 70)
    code, out, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", src, "-o", tmp_path / "out",
                         "--batch-size", 8, "--shard-rows", 64, "--groups", ONE_CORE, "-q")
    assert code == 0, err
    assert "200 samples written" in out
    shards = sorted(p.name for p in (tmp_path / "out").glob("part-*.parquet"))
    assert shards == [f"part-{i:05d}.parquet" for i in range(4)]
    table = pq.read_table(tmp_path / "out" / shards[0])
    assert table.column_names == ["row_id", "log_probs"]
    assert isinstance(table.schema.field("log_probs").type, pa.FixedShapeTensorType) is False  # time is dynamic
    got = read_outputs(tmp_path / "out")
    _assert_rows(got, crnn_reference(x), np.arange(200))
    summary = json.loads((tmp_path / "out" / "_SUCCESS.json").read_text())
    assert summary["written"] == 200 and summary["skipped"] == 0


def test_cli_without_groups_runs_a_worker_per_core_and_says_so(tmp_path, capsys):
    """No --groups: a throughput job gets a worker per core (crnn_ocr's sessions fit in memory on
    any host), two batches in flight each; the summary line and _SUCCESS.json say which, and the
    rows are ORT's."""
    from staronnx.workers.groups import make_groups
    from staronnx.workers.topology import Topology

    x = crnn_rows(120, seed=3)
    src = npz_shards(tmp_path / "in", {"image": x}, 50)
    code, out, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", src, "-o", tmp_path / "out",
                         "--batch-size", 4, "-q")
    assert code == 0, err
    cores = len(make_groups(Topology.from_system(), "cores=1"))
    summary = json.loads((tmp_path / "out" / "_SUCCESS.json").read_text())
    assert (summary["groups"], summary["workers"], summary["max_in_flight"]) == ("cores=1", cores, max(2, 2 * cores))
    assert f"on {cores} worker{'s' if cores != 1 else ''}, groups cores=1)" in out
    _assert_rows(read_outputs(tmp_path / "out"), crnn_reference(x), np.arange(120))


def test_cli_chooses_the_batch_size_and_writes_one_npz(tmp_path, capsys):
    """Without --batch-size the batch is measured on the dataset's rows and said; an output
    named .npz is one file (row_id and each output, samples along axis 0)."""
    x = crnn_rows(90, seed=1)
    np.savez(tmp_path / "in.npz", image=x)
    code, out, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", tmp_path / "in.npz",
                         "-o", tmp_path / "out.npz", "--groups", ONE_CORE, "-q")
    assert code == 0, err
    assert "chosen for throughput" in out and "1: " in out
    with np.load(tmp_path / "out.npz") as z:
        assert sorted(z.files) == ["log_probs", "row_id"]
        got = {k: z[k] for k in z.files}
    assert not (tmp_path / "out.npz.parts").exists()
    _assert_rows(got, crnn_reference(x), np.arange(90))


def test_cli_parquet_tensor_column_one_row_per_task(tmp_path, capsys):
    """mobilenet_b1 (exported at batch 1: one row per task) from a Parquet tensor column of
    [3, 224, 224] samples; its fixed-shape output comes back as a tensor column."""
    x = np.random.default_rng(2).standard_normal((5, 3, 224, 224)).astype(np.float32)
    pq.write_table(pa.table({"input": pa.FixedShapeTensorArray.from_numpy_ndarray(x)}), tmp_path / "in.parquet")
    code, out, err = cli(capsys, "infer", realmodels.path("mobilenet_b1"), "-i", tmp_path / "in.parquet",
                         "-o", tmp_path / "out", "--groups", ONE_CORE, "-q")
    assert code == 0, err
    table = pq.read_table(next((tmp_path / "out").glob("part-*.parquet")))
    assert isinstance(table.schema.field("logits").type, pa.FixedShapeTensorType)
    got = read_outputs(tmp_path / "out")
    want = [{"logits": _ort("mobilenet_b1", {"input": x[i:i + 1]})["logits"][0]} for i in range(5)]
    _assert_rows(got, want, np.arange(5))


def test_cli_images_of_two_sizes_and_outputs_of_any_length(tmp_path, capsys):
    """detector_nms: images of two sizes as nested lists, its outputs (boxes per image: 0 or
    more) as nested lists, each row its own."""
    rng = np.random.default_rng(3)
    imgs = [(rng.random((3, h, w)) * 2).astype(np.float32) for h, w in ((64, 64), (96, 128), (64, 64), (96, 128))]
    col = pa.array([i.tolist() for i in imgs], type=pa.list_(pa.list_(pa.list_(pa.float32()))))
    pq.write_table(pa.table({"image": col}), tmp_path / "in.parquet")
    code, _, err = cli(capsys, "infer", realmodels.path("detector_nms"), "-i", tmp_path / "in.parquet",
                       "-o", tmp_path / "out.parquet", "--groups", ONE_CORE, "-q")
    assert code == 0, err
    got = read_outputs(tmp_path / "out.parquet")
    want = [_ort("detector_nms", {"image": im[None]}) for im in imgs]
    _assert_rows(got, want, np.arange(4))


def test_state_on_axis_1_and_a_shared_scalar(tmp_path):
    """gru_stream through the function: its state carries the batch on axis 1, its sample rate
    is one scalar for every row (stored once in each shard)."""
    rng = np.random.default_rng(4)
    frame = rng.standard_normal((37, 256)).astype(np.float32)
    state = rng.standard_normal((2, 37, 64)).astype(np.float32)
    rate = np.array(16000, np.int64)
    src = npz_shards(tmp_path / "in", {"frame": frame, "state": state}, 10, axis={"state": 1},
                     shared={"sample_rate": rate})
    report = infer(realmodels.path("gru_stream"), src, tmp_path / "out",
                   InferSpec(batch_size=4, shard_rows=16), MachineSpec(ONE_CORE))
    assert report.written == 37 and report.batch_size == 4
    whole = _ort("gru_stream", {"frame": frame, "state": state, "sample_rate": rate})
    want = [{"prob": whole["prob"][i], "state_out": whole["state_out"][:, i]} for i in range(37)]
    _assert_rows(read_outputs(tmp_path / "out"), want, np.arange(37))


def test_function_over_an_iterable_of_feeds(tmp_path):
    """Any iterable of feeds (a generator of requests of 1 to 5 rows) is a dataset: rows are
    re-batched across items, ids count rows."""
    x = crnn_rows(23, seed=5)
    sizes = [1, 5, 3, 2, 5, 4, 3]

    def feeds():
        lo = 0
        for s in sizes:
            yield {"image": x[lo:lo + s]}
            lo += s

    report = infer(realmodels.path("crnn_ocr"), feeds(), tmp_path / "out", InferSpec(batch_size=4),
                   MachineSpec(ONE_CORE))
    assert report.written == 23 and report.total_rows is None
    _assert_rows(read_outputs(tmp_path / "out"), crnn_reference(x), np.arange(23))


# -- bad rows ------------------------------------------------------------------------------------------
def _ocr_table_with_bad_rows(tmp_path: Path) -> tuple[Path, list[np.ndarray]]:
    """12 crnn_ocr rows as nested lists: row 4 has height 31 (the model fixes 32), row 7 is
    null, the others good."""
    rng = np.random.default_rng(6)
    rows: list = [rng.standard_normal((1, 32, 64)).astype(np.float32) for _ in range(12)]
    rows[4] = rng.standard_normal((1, 31, 64)).astype(np.float32)
    values = [None if i == 7 else r.tolist() for i, r in enumerate(rows)]
    col = pa.array(values, type=pa.list_(pa.list_(pa.list_(pa.float32()))))
    pq.write_table(pa.table({"image": col}), tmp_path / "bad.parquet")
    return tmp_path / "bad.parquet", rows


def test_bad_rows_fail_the_job_by_row_id(tmp_path, capsys):
    src, _ = _ocr_table_with_bad_rows(tmp_path)
    code, _, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", src, "-o", tmp_path / "out",
                       "--batch-size", 4, "--groups", ONE_CORE, "-q")
    assert code == 2
    assert "row 4 of the dataset cannot run" in err and "'image'" in err and "--on-error skip" in err


def test_bad_rows_skipped_and_listed(tmp_path, capsys):
    src, rows = _ocr_table_with_bad_rows(tmp_path)
    code, out, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", src, "-o", tmp_path / "out",
                         "--batch-size", 4, "--on-error", "skip", "--groups", ONE_CORE, "-q")
    assert code == 0, err
    assert "2 row(s) skipped (row ids 4, 7)" in out
    errors = json.loads((tmp_path / "out" / "_errors.json").read_text())
    assert [e["row_id"] for e in errors] == [4, 7]
    assert "32" in errors[0]["error"] and "null" in errors[1]["error"]
    got = read_outputs(tmp_path / "out")
    good = [i for i in range(12) if i not in (4, 7)]
    want = [{"log_probs": _ort("crnn_ocr", {"image": r[None]})["log_probs"][:, 0]} if i in good else {}
            for i, r in enumerate(rows)]
    _assert_rows(got, want, np.array(good))


def test_a_row_the_model_fails_on_is_found_in_its_batch(tmp_path, capsys):
    """bert_tiny with one token id past its vocabulary: ORT fails the whole batch; the batch is
    run again row by row, only that row is skipped, its neighbours written."""
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 1000, (10, 9)).astype(np.int64)
    ids[6, 3] = 5000
    mask = np.ones_like(ids)
    np.savez(tmp_path / "in.npz", input_ids=ids, attention_mask=mask, token_type_ids=np.zeros_like(ids))
    code, out, err = cli(capsys, "infer", realmodels.path("bert_tiny"), "-i", tmp_path / "in.npz",
                         "-o", tmp_path / "out", "--batch-size", 5, "--on-error", "skip", "--groups", ONE_CORE, "-q")
    assert code == 0, err
    assert "1 row(s) skipped (row ids 6)" in out
    got = read_outputs(tmp_path / "out")
    keep = [i for i in range(10) if i != 6]
    want = {i: _ort("bert_tiny", {"input_ids": ids[i:i + 1], "attention_mask": mask[i:i + 1],
                                  "token_type_ids": np.zeros_like(ids[i:i + 1])}) for i in keep}
    rows = [{k: v[0] for k, v in want[i].items()} if i in want else {} for i in range(10)]
    _assert_rows(got, rows, np.array(keep))


def test_a_shard_of_the_wrong_dtype_is_reported_as_its_rows(tmp_path):
    x = crnn_rows(12, seed=8)
    src = npz_shards(tmp_path / "in", {"image": x}, 4)
    np.savez(src / "shard-1.npz", image=x[4:8].astype(np.float64))
    report = infer(realmodels.path("crnn_ocr"), src, tmp_path / "out", InferSpec(batch_size=4, on_error="skip"),
                   MachineSpec(ONE_CORE))
    assert [e["row_id"] for e in report.skipped] == [4, 5, 6, 7]
    assert "float32" in report.skipped[0]["error"]
    got = read_outputs(tmp_path / "out")
    want = crnn_reference(x)
    _assert_rows(got, want, np.array([0, 1, 2, 3, 8, 9, 10, 11]))
    with pytest.raises(RowError, match="rows 4..7"):
        infer(realmodels.path("crnn_ocr"), src, tmp_path / "out2", InferSpec(batch_size=4), MachineSpec(ONE_CORE))


# -- stopped and resumed -----------------------------------------------------------------------------
def _start(args: list[object]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "staronnx", "infer", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_shards(folder: Path, proc: subprocess.Popen, count: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(list(folder.glob("part-*.parquet"))) >= count:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job ended before its {count}th shard: {proc.communicate()}")
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"no {count} shards in {timeout} s")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_killed_halfway_and_resumed(tmp_path, how):
    """unet_seg over 1,200 rows in shards of 100: the job is killed (a crash: SIGKILL) or stopped
    (SIGTERM) once two shards exist, then resumed: the output has every row once, in order, each
    ORT's answer, and the finished shards were not written again."""
    x = np.random.default_rng(9).standard_normal((1200, 3, 64, 64)).astype(np.float32)
    src = npz_shards(tmp_path / "in", {"image": x}, 300)
    out = tmp_path / "out"
    args = [realmodels.path("unet_seg"), "-i", src, "-o", out, "--batch-size", 4, "--shard-rows", 100,
            "--groups", ONE_CORE, "-q"]
    proc = _start(args)
    _wait_for_shards(out, proc, 2)
    proc.send_signal(signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    if how == "SIGTERM":
        assert proc.returncode == 143, err
        assert "--resume" in err and "interrupted (SIGTERM)" in err
    else:
        assert proc.returncode == -signal.SIGKILL
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    assert 2 <= len(kept) < 12, f"{len(kept)} shards: not stopped halfway"
    assert not (out / "_SUCCESS.json").exists()

    again = _start(args)  # without --resume: refused, nothing touched
    _, err = again.communicate(timeout=120)
    assert again.returncode == 2 and "--resume" in err
    resumed = _start([*args, "--resume"])
    stdout, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert "written before, kept" in stdout
    for name, mtime in kept.items():
        assert (out / name).stat().st_mtime_ns == mtime, f"{name} was written again"
    done = _start([*args, "--resume"])  # once more: nothing left
    stdout, err = done.communicate(timeout=120)
    assert done.returncode == 0 and "all 1200 rows" in stdout and "nothing left to run" in stdout, err
    got = read_outputs(out)
    assert list(got["row_id"]) == list(range(1200))  # no row missing, none twice
    want = np.concatenate([_ort("unet_seg", {"image": x[lo:lo + 100]})["logits"] for lo in range(0, 1200, 100)])
    assert np.abs(got["logits"] - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max()))


# -- refusals ------------------------------------------------------------------------------------------
def test_refusals_name_the_cause(tmp_path, capsys):
    x = crnn_rows(8, seed=10)
    np.savez(tmp_path / "in.npz", image=x)
    model = realmodels.path("crnn_ocr")
    base = ["infer", model, "-i", tmp_path / "in.npz", "--groups", ONE_CORE, "-q"]
    code, _, err = cli(capsys, *base, "-o", tmp_path / "o1", "--resume", "--overwrite")
    assert code == 2 and "resume and overwrite" in err
    code, _, err = cli(capsys, *base, "-o", tmp_path / "o1", "--on-error", "ignore")
    assert code == 2 and "on_error 'ignore'" in err
    code, _, err = cli(capsys, *base, "-o", tmp_path / "o1", "--format", "csv")
    assert code == 2 and "--format 'csv'" in err
    code, _, err = cli(capsys, "infer", model, "-i", tmp_path / "nope.npz", "-o", tmp_path / "o1", "-q")
    assert code == 2 and "no such file" in err
    np.savez(tmp_path / "wrong.npz", pixels=x)
    code, _, err = cli(capsys, "infer", model, "-i", tmp_path / "wrong.npz", "-o", tmp_path / "o1", "-q")
    assert code == 2 and "unknown input(s) ['pixels']" in err and "missing ['image']" in err
    pq.write_table(pa.table({"pixels": [1.0]}), tmp_path / "wrong.parquet")
    code, _, err = cli(capsys, "infer", model, "-i", tmp_path / "wrong.parquet", "-o", tmp_path / "o1", "-q")
    assert code == 2 and "no column for input(s) ['image']" in err
    # a finished job, then the same output for another dataset: --resume refuses, naming what changed
    assert cli(capsys, *base, "-o", tmp_path / "o2", "--batch-size", 4)[0] == 0
    np.savez(tmp_path / "other.npz", image=crnn_rows(9, seed=11))
    code, _, err = cli(capsys, "infer", model, "-i", tmp_path / "other.npz", "-o", tmp_path / "o2", "--resume", "-q")
    assert code == 2 and "written by another job" in err and "source" in err
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    code, _, err = cli(capsys, *base, "-o", tmp_path / "theirs", "--overwrite")
    assert code == 2 and "no staronnx infer wrote" in err
    assert (tmp_path / "theirs" / "notes.txt").read_text() == "mine"


def test_npz_output_refuses_rows_of_different_shapes(tmp_path):
    rng = np.random.default_rng(12)
    imgs = [(rng.random((3, h, 64)) * 2).astype(np.float32) for h in (64, 96)]
    col = pa.array([i.tolist() for i in imgs], type=pa.list_(pa.list_(pa.list_(pa.float32()))))
    pq.write_table(pa.table({"image": col}), tmp_path / "in.parquet")
    with pytest.raises(OutputError, match="write Parquet"):
        infer(realmodels.path("detector_nms"), tmp_path / "in.parquet", tmp_path / "out",
              InferSpec(output_format="npz"), MachineSpec(ONE_CORE))


def test_cuda_workers_and_every_worker_option(tmp_path, capsys, monkeypatch):
    """The CUDA workers' door (their whole pipeline on the CPU stand-in, as CI has no GPU), with
    every worker option the command takes, into a folder of .npz shards."""
    monkeypatch.setenv("STARONNX_CUDA_RUNTIME", "host")
    x = crnn_rows(30, seed=13)
    np.savez(tmp_path / "in.npz", image=x)
    code, out, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", tmp_path / "in.npz", "-o",
                         tmp_path / "out", "--format", "npz", "--batch-size", 4, "--max-in-flight", 3,
                         "--shard-rows", 16, "--cuda-streams", 2, "--cuda-devices", "0", "--no-cuda-graphs",
                         "--cuda-thread-per-stream", "--groups", "none", "--policy", "eager", "-q")
    assert code == 0, err
    assert "30 samples written" in out and "batch 4, 3 in flight" in out
    assert sorted(p.name for p in (tmp_path / "out").glob("part-*")) == ["part-00000.npz", "part-00001.npz"]
    _assert_rows(read_outputs(tmp_path / "out"), crnn_reference(x), np.arange(30))


def test_progress_bar_on_a_terminal_says_samples_per_second_and_eta(tmp_path):
    """On a terminal the job shows a bar (rows done of the total, samples/s, ETA) that is gone
    when it ends, leaving the summary line."""
    import pty

    from _helpers import read_pty

    x = np.random.default_rng(14).standard_normal((600, 3, 64, 64)).astype(np.float32)
    np.savez(tmp_path / "in.npz", image=x)
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "staronnx", "infer", str(realmodels.path("unet_seg")), "-i",
                             str(tmp_path / "in.npz"), "-o", str(tmp_path / "out"), "--batch-size", "2",
                             "--groups", ONE_CORE], stdin=slave, stdout=slave, stderr=slave,
                            env={**os.environ, "COLUMNS": "150", "TERM": "xterm"})
    os.close(slave)
    raw = read_pty(master, proc).decode(errors="replace")
    proc.wait(timeout=300)
    os.close(master)
    assert proc.returncode == 0, raw[-2000:]
    assert "/600" in raw and "samples/s" in raw and "ETA" in raw, raw[-2000:]
    assert "600 samples written" in raw


def test_arrow_file_with_state_rows_and_a_per_row_scalar(tmp_path):
    """gru_stream from an Arrow IPC (Feather) file: a row's state ``[2, 64]`` goes to the model's
    axis 1, and its sample rate (a scalar the model takes once per batch) changes halfway, so the
    rows of each rate run in batches of their own."""
    import pyarrow.feather as feather

    rng = np.random.default_rng(15)
    frame = rng.standard_normal((12, 256)).astype(np.float32)
    state = rng.standard_normal((12, 2, 64)).astype(np.float32)
    rate = np.array([16000] * 5 + [8000] * 7, dtype=np.int64)
    feather.write_feather(pa.table({"frame": pa.FixedShapeTensorArray.from_numpy_ndarray(frame),
                                    "state": pa.FixedShapeTensorArray.from_numpy_ndarray(state),
                                    "sample_rate": rate}), tmp_path / "in.arrow")
    report = infer(realmodels.path("gru_stream"), tmp_path / "in.arrow", tmp_path / "out",
                   InferSpec(batch_size=4), MachineSpec(ONE_CORE))
    assert report.written == 12
    want = []
    for i in range(12):
        one = _ort("gru_stream", {"frame": frame[i:i + 1], "state": state[i][:, None], "sample_rate": np.array(rate[i])})
        want.append({"prob": one["prob"][0], "state_out": one["state_out"][:, 0]})
    _assert_rows(read_outputs(tmp_path / "out"), want, np.arange(12))


def test_bad_first_rows_without_a_batch_size_are_reported_by_row_id(tmp_path, capsys):
    """Without --batch-size the batch is measured on the dataset's first rows: rows the model
    refuses (a first shard of the wrong dtype) or fails on (a token id past bert_tiny's
    vocabulary) are not measured but reported by row id like any other, and the others written."""
    x = crnn_rows(12, seed=16)
    src = npz_shards(tmp_path / "in", {"image": x}, 4)
    np.savez(src / "shard-0.npz", image=x[:4].astype(np.float64))
    code, out, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", src, "-o", tmp_path / "out",
                         "--on-error", "skip", "--groups", ONE_CORE, "-q")
    assert code == 0, err
    assert "4 row(s) skipped (row ids 0, 1, 2, 3)" in out and "chosen for throughput" in out
    _assert_rows(read_outputs(tmp_path / "out"), crnn_reference(x), np.arange(4, 12))
    code, _, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", src, "-o", tmp_path / "out2",
                       "--groups", ONE_CORE, "-q")
    assert code == 2 and re.search(r"rows? 0(\.\.[1-3])? of the dataset cannot run", err), err  # the batch chosen

    rng = np.random.default_rng(17)
    ids = rng.integers(0, 1000, (8, 9)).astype(np.int64)
    ids[1, 2] = 5000
    mask = np.ones_like(ids)
    np.savez(tmp_path / "bert.npz", input_ids=ids, attention_mask=mask, token_type_ids=np.zeros_like(ids))
    code, out, err = cli(capsys, "infer", realmodels.path("bert_tiny"), "-i", tmp_path / "bert.npz",
                         "-o", tmp_path / "bert", "--on-error", "skip", "--groups", ONE_CORE, "-q")
    assert code == 0, err
    assert "1 row(s) skipped (row ids 1)" in out
    assert list(read_outputs(tmp_path / "bert")["row_id"]) == [0, 2, 3, 4, 5, 6, 7]


def test_rows_larger_than_the_probe_limit_run_alone(tmp_path):
    """A row whose inputs alone pass the batch-size probe's limit on a batch's bytes (a 68 MiB
    volume): without a batch size the job measures batch 1 and runs it, rather than measuring none."""
    import onnx
    from onnx import TensorProto, helper

    from staronnx.infer.batchsize import MAX_BATCH_BYTES

    width = MAX_BATCH_BYTES // 4 + 1024  # float32 values: one row holds more than the limit
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "neg.onnx")
    x = np.random.default_rng(18).standard_normal((2, width)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    report = infer(tmp_path / "neg.onnx", tmp_path / "in.npz", tmp_path / "out", InferSpec(), MachineSpec(ONE_CORE))
    assert report.written == 2 and report.batch_size == 1
    assert report.choice is not None and list(report.choice.measured) == [1]
    got = read_outputs(tmp_path / "out")
    assert list(got["row_id"]) == [0, 1] and np.array_equal(got["y"], -x)


def test_an_empty_dataset_gives_an_empty_parquet_file(tmp_path, capsys):
    """A dataset of no rows into one .parquet file: a Parquet file of no rows and the job's
    columns, which Parquet readers open (not a file of no bytes)."""
    np.savez(tmp_path / "in.npz", image=np.zeros((0, 1, 32, 64), np.float32))
    code, out, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", tmp_path / "in.npz",
                         "-o", tmp_path / "out.parquet", "--batch-size", 4, "--groups", ONE_CORE, "-q")
    assert code == 0, err
    assert "0 samples written" in out
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.num_rows == 0 and table.column_names == ["row_id", "log_probs"]
    assert len(read_outputs(tmp_path / "out.parquet")["row_id"]) == 0


def test_overwrite_leaves_no_skipped_rows_of_the_job_before(tmp_path, capsys):
    """A single-file output whose job skipped rows, written again with --overwrite by a job that
    skips none: no errors file is left beside it listing rows the new output holds."""
    src, _ = _ocr_table_with_bad_rows(tmp_path)
    out = tmp_path / "out.parquet"
    base = ["infer", realmodels.path("crnn_ocr"), "-o", out, "--batch-size", 4, "--groups", ONE_CORE, "-q"]
    code, stdout, err = cli(capsys, *base, "-i", src, "--on-error", "skip")
    assert code == 0 and "row ids 4, 7" in stdout, err
    assert (tmp_path / "out.parquet.errors.json").exists()
    x = crnn_rows(12, seed=19)
    np.savez(tmp_path / "good.npz", image=x)
    code, stdout, err = cli(capsys, *base, "-i", tmp_path / "good.npz", "--overwrite")
    assert code == 0 and "skipped" not in stdout, err
    assert not (tmp_path / "out.parquet.errors.json").exists()
    _assert_rows(read_outputs(out), crnn_reference(x), np.arange(12))


def test_a_format_other_than_the_output_files_suffix_is_refused(tmp_path, capsys):
    """--format npz with --output out.parquet (or parquet with out.npz) would write one format
    under the other's name, a file neither read_outputs nor the other format's readers open: it
    is refused, naming both; the matching --format runs."""
    np.savez(tmp_path / "in.npz", image=crnn_rows(3, seed=20))
    base = ["infer", realmodels.path("crnn_ocr"), "-i", tmp_path / "in.npz", "--batch-size", 2, "--groups", ONE_CORE,
            "-q"]
    for name, fmt in (("out.parquet", "npz"), ("out.npz", "parquet")):
        code, _, err = cli(capsys, *base, "-o", tmp_path / name, "--format", fmt)
        assert code == 2 and f"--format {fmt}" in err and name in err, err
        assert not (tmp_path / name).exists()
    code, _, err = cli(capsys, *base, "-o", tmp_path / "out.npz", "--format", "npz")
    assert code == 0, err
    assert list(read_outputs(tmp_path / "out.npz")["row_id"]) == [0, 1, 2]


def test_a_shard_whose_rows_were_all_skipped_reads_back_as_arrays(tmp_path, capsys):
    """--on-error skip where every row of an output shard is bad (a .npz shard of the wrong
    dtype, output shards of its size): read_outputs still gives each output as one [N, ...]
    array of the rows written, as it does without that shard (an empty Parquet shard's column
    says nothing of the rows' shape)."""
    x = crnn_rows(12, seed=21)
    src = npz_shards(tmp_path / "in", {"image": x}, 4)
    np.savez(src / "shard-1.npz", image=x[4:8].astype(np.float64))
    code, out, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", src, "-o", tmp_path / "out",
                         "--batch-size", 4, "--shard-rows", 4, "--on-error", "skip", "--groups", ONE_CORE, "-q")
    assert code == 0 and "row ids 4, 5, 6, 7" in out, err
    got = read_outputs(tmp_path / "out")
    assert isinstance(got["log_probs"], np.ndarray) and got["log_probs"].shape[0] == 8
    _assert_rows(got, crnn_reference(x), np.array([0, 1, 2, 3, 8, 9, 10, 11]))


def test_function_over_a_pyarrow_table_or_dataset(tmp_path):
    """A pyarrow Table, RecordBatch or Dataset in memory is a dataset for the function as its
    file is (open_source's promise): a column per input, one row per sample."""
    import pyarrow.dataset as ds

    x = crnn_rows(10, seed=22)
    table = pa.table({"image": pa.FixedShapeTensorArray.from_numpy_ndarray(x)})
    for i, src in enumerate((table, table.to_batches()[0], ds.dataset(table))):
        report = infer(realmodels.path("crnn_ocr"), src, tmp_path / f"out{i}", InferSpec(batch_size=4),
                       MachineSpec(ONE_CORE))
        assert report.written == 10 and report.total_rows == 10
        _assert_rows(read_outputs(tmp_path / f"out{i}"), crnn_reference(x), np.arange(10))


def test_a_compressed_npz_of_python_objects_is_refused_by_name(tmp_path, capsys):
    """An .npz member of Python objects (a pickle) is refused with the member's name and what to
    do, whether numpy.savez stored it or numpy.savez_compressed compressed it (that one ended
    in a traceback of numpy's ValueError)."""
    strings = np.array([["a"], ["b"]], dtype=object)
    for save in (np.savez, np.savez_compressed):
        path = tmp_path / f"{save.__name__}.npz"
        save(path, image=strings)
        code, _, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", path, "-o", tmp_path / save.__name__,
                           "--batch-size", 2, "--groups", ONE_CORE, "-q")
        assert code == 2 and f"{path.name}[image]: holds Python objects" in err, err


def test_a_single_npy_file_for_a_model_of_several_inputs_is_named(tmp_path, capsys):
    """One .npy file given to a model of three inputs: the refusal names that file, as
    --inputs gave it, not the folder it lies in."""
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "ids.npy", np.zeros((4, 9), np.int64))
    code, _, err = cli(capsys, "infer", realmodels.path("bert_tiny"), "-i", tmp_path / "data" / "ids.npy",
                       "-o", tmp_path / "out", "--batch-size", 2, "--groups", ONE_CORE, "-q")
    assert code == 2 and f"--inputs {tmp_path / 'data' / 'ids.npy'}: .npy shards hold one array" in err, err


def test_resume_names_the_parquet_dataset_by_another_path(tmp_path, capsys, monkeypatch):
    """A job stopped at a bad row, read from a Parquet file named relative to the working folder,
    resumes with the same file named by its absolute path (or from another folder): the dataset
    is the same one, so --resume carries on rather than refusing it as another job's."""
    src, rows = _ocr_table_with_bad_rows(tmp_path)
    monkeypatch.chdir(tmp_path)
    base = ["infer", realmodels.path("crnn_ocr"), "-o", tmp_path / "out", "--batch-size", 2, "--shard-rows", 4,
            "--groups", ONE_CORE, "-q"]
    code, _, err = cli(capsys, *base, "-i", src.name)
    assert code == 2 and "row 4 of the dataset cannot run" in err, err
    assert [p.name for p in (tmp_path / "out").glob("part-*")] == ["part-00000.parquet"]
    monkeypatch.chdir(tmp_path.parent)
    code, out, err = cli(capsys, *base, "-i", src, "--resume", "--on-error", "skip")
    assert code == 0, err
    assert "(4 written before, kept)" in out and "row ids 4, 7" in out
    assert list(read_outputs(tmp_path / "out")["row_id"]) == [i for i in range(12) if i not in (4, 7)]


def test_function_over_one_mapping_of_arrays(tmp_path):
    """One mapping of input name -> array (a dict, or what numpy.load gives for an .npz) is a
    dataset of its rows, as the .npz file is: not an iterable of its keys."""
    x = crnn_rows(6, seed=23)
    np.savez(tmp_path / "in.npz", image=x)
    with np.load(tmp_path / "in.npz") as npz:
        for i, src in enumerate(({"image": x}, npz)):
            report = infer(realmodels.path("crnn_ocr"), src, tmp_path / f"out{i}", InferSpec(batch_size=4),
                           MachineSpec(ONE_CORE))
            assert report.written == 6
            _assert_rows(read_outputs(tmp_path / f"out{i}"), crnn_reference(x), np.arange(6))


def test_one_npz_file_refuses_rows_of_different_shapes_across_shards(tmp_path, capsys):
    """detector_nms's boxes per image differ from row to row: into one .npz file, shards of one
    row each are fine alone but cannot be joined into one array per output; the job says so as
    it does for one shard (write Parquet), not with numpy's ValueError at the end."""
    rng = np.random.default_rng(3)
    np.savez(tmp_path / "in.npz", image=(rng.random((4, 3, 64, 64)) * 2).astype(np.float32))
    code, _, err = cli(capsys, "infer", realmodels.path("detector_nms"), "-i", tmp_path / "in.npz",
                       "-o", tmp_path / "out.npz", "--shard-rows", 1, "--groups", ONE_CORE, "-q")
    assert code == 2 and "rows of different shapes" in err and "write Parquet" in err, err


def test_resumed_iterable_counts_the_rows_written_before(tmp_path):
    """A dataset of unknown length (a list of feeds), finished and resumed: the report and the
    progress count the 10 rows written before, not whole shards (12 for 3 shards of 4)."""
    x = crnn_rows(10, seed=24)
    feeds = [{"image": x[i:i + 2]} for i in range(0, 10, 2)]
    spec = InferSpec(batch_size=2, shard_rows=4)
    assert infer(realmodels.path("crnn_ocr"), feeds, tmp_path / "out", spec, MachineSpec(ONE_CORE)).written == 10
    seen: list[int] = []
    report = infer(realmodels.path("crnn_ocr"), feeds, tmp_path / "out", InferSpec(batch_size=2, shard_rows=4,
                   resume=True), MachineSpec(ONE_CORE), progress=lambda done, total: seen.append(done))
    assert (report.written, report.resumed_rows) == (0, 10)
    assert seen[-1] == 10
    _assert_rows(read_outputs(tmp_path / "out"), crnn_reference(x), np.arange(10))


def test_a_null_inside_a_rows_list_is_reported_by_row_id(tmp_path, capsys):
    """A null value inside a row's list (a token id missing from bert_tiny's input_ids, a pixel
    of crnn_ocr's image) is a null like a null row: reported by row id with --on-error skip,
    not a TypeError that ends the job (int64) nor a NaN run silently (float32)."""
    ids = [[1, 2, 3, 4], [5, None, 7, 8], [9, 10, 11, 12]]
    ones = pa.array([[1] * 4] * 3, pa.list_(pa.int64()))
    pq.write_table(pa.table({"input_ids": pa.array(ids, pa.list_(pa.int64())), "attention_mask": ones,
                             "token_type_ids": pa.array([[0] * 4] * 3, pa.list_(pa.int64()))}), tmp_path / "ids.parquet")
    code, out, err = cli(capsys, "infer", realmodels.path("bert_tiny"), "-i", tmp_path / "ids.parquet", "-o",
                         tmp_path / "out", "--batch-size", 2, "--on-error", "skip", "--groups", ONE_CORE, "-q")
    assert code == 0, err
    assert "1 row(s) skipped (row ids 1)" in out and "null" in out
    assert list(read_outputs(tmp_path / "out")["row_id"]) == [0, 2]

    rows = crnn_rows(3, seed=25)
    values = [r.tolist() for r in rows]
    values[2][0][5][7] = None
    col = pa.array(values, type=pa.list_(pa.list_(pa.list_(pa.float32()))))
    pq.write_table(pa.table({"image": col}), tmp_path / "image.parquet")
    code, out, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", tmp_path / "image.parquet", "-o",
                         tmp_path / "out2", "--batch-size", 2, "--groups", ONE_CORE, "-q")
    assert code == 2 and "row 2 of the dataset cannot run" in err and "null" in err, err


def test_one_parquet_file_is_joined_without_holding_the_output(tmp_path):
    """An output named .parquet is joined from its shards at the end: the job's peak memory stays
    that of the same job into a folder, not the whole output's (192 MiB here) more. Peak RSS of
    each command, measured by a parent process that runs it alone."""
    import onnx
    from onnx import TensorProto, helper

    width = 1 << 18  # 1 MiB of float32 per row
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "neg.onnx")
    x = np.random.default_rng(26).standard_normal((192, width)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    measure = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    peaks = {}
    for out in ("out", "out.parquet"):
        res = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "staronnx", "infer",
                              str(tmp_path / "neg.onnx"), "-i", str(tmp_path / "in.npz"), "-o", str(tmp_path / out),
                              "--batch-size", "4", "--groups", ONE_CORE, "-q"], capture_output=True, text=True)
        code, kib = res.stdout.split()[-2:]
        assert code == "0", res.stderr
        peaks[out] = int(kib) * 1024
    assert peaks["out.parquet"] - peaks["out"] < 96 << 20, peaks
    got = read_outputs(tmp_path / "out.parquet")
    assert list(got["row_id"]) == list(range(192)) and np.array_equal(got["y"], -x)


def test_parquet_shards_are_as_readable_as_the_other_files(tmp_path, capsys):
    """A Parquet shard gets the mode of every other file the job writes (the umask's, as
    _manifest.json and .npz shards get), not the 0600 of the temporary file it was written as:
    a team's other accounts, or a Spark job under its own user, read the output."""
    import stat

    np.savez(tmp_path / "in.npz", image=crnn_rows(3, seed=27))
    code, _, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", tmp_path / "in.npz", "-o", tmp_path / "out",
                       "--batch-size", 2, "--groups", ONE_CORE, "-q")
    assert code == 0, err
    want = stat.S_IMODE((tmp_path / "out" / "_manifest.json").stat().st_mode)
    assert stat.S_IMODE((tmp_path / "out" / "part-00000.parquet").stat().st_mode) == want


def test_overwrite_removes_only_what_the_job_wrote(tmp_path, capsys):
    """--overwrite replaces an earlier job's output: its manifest, shards, error lists and
    summary go, a file of the user's that lies beside them (notes on the run) stays."""
    src, _ = _ocr_table_with_bad_rows(tmp_path)
    base = ["infer", realmodels.path("crnn_ocr"), "-o", tmp_path / "out", "--batch-size", 4, "--shard-rows", 4,
            "--on-error", "skip", "--groups", ONE_CORE, "-q"]
    assert cli(capsys, *base, "-i", src)[0] == 0
    (tmp_path / "out" / "notes.txt").write_text("mine")
    x = crnn_rows(5, seed=28)
    np.savez(tmp_path / "good.npz", image=x)
    code, _, err = cli(capsys, *base, "-i", tmp_path / "good.npz", "--overwrite")
    assert code == 0, err
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "_SUCCESS.json", "_manifest.json", "notes.txt", "part-00000.parquet", "part-00001.parquet"]
    _assert_rows(read_outputs(tmp_path / "out"), crnn_reference(x), np.arange(5))


def test_the_batch_size_probe_holds_no_more_rows_than_its_largest_batch(tmp_path):
    """Rows of 8 MiB from a generator, no batch size: the probe's largest batch is 64 MiB
    (MAX_BATCH_BYTES, 8 rows), so it reads that many rows, not 64 of them (512 MiB held before
    the first batch ran). Counted as the generator's arrays alive at once (weakref.finalize)."""
    import weakref

    import onnx
    from onnx import TensorProto, helper

    from staronnx.infer.batchsize import MAX_BATCH_BYTES

    width = 1 << 21  # 8 MiB of float32 per row
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "neg.onnx")
    alive = [0, 0]  # now, most

    def gone() -> None:
        alive[0] -= 1

    def rows():
        for i in range(70):
            x = np.full((1, width), i, np.float32)
            alive[0] += 1
            alive[1] = max(alive)
            weakref.finalize(x, gone)
            yield {"x": x}

    report = infer(tmp_path / "neg.onnx", rows(), tmp_path / "out", InferSpec(), MachineSpec(ONE_CORE))
    assert report.written == 70 and report.batch_size <= MAX_BATCH_BYTES // (4 * width)
    # the sample (8 rows) and the job's own window, bundles and read-ahead of batches of 8 at most
    assert alive[1] < 64, alive


def test_rows_on_axis_1_of_an_npy_are_read_a_chunk_at_a_time(tmp_path):
    """An input whose rows lie on axis 1 (a state's [layers, batch, hidden]) read from a .npy:
    a chunk at a time from the file, as rows on axis 0 are, so the job's peak memory does not
    grow with the dataset (it loaded the whole array for every chunk: 128 MiB more at 160 rows
    than at 32). Peak RSS of each command, measured by a parent process that runs it alone."""
    import onnx
    from onnx import TensorProto, helper

    width = 1 << 17  # 1 MiB of float32 per row on the two layers
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, "batch", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, "batch", width])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "neg.onnx")
    measure = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    peaks = {}
    for n in (32, 160):
        x = np.random.default_rng(n).standard_normal((2, n, width)).astype(np.float32)
        (tmp_path / f"in{n}").mkdir()
        np.save(tmp_path / f"in{n}" / "x.npy", x)
        res = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "staronnx", "infer",
                              str(tmp_path / "neg.onnx"), "-i", str(tmp_path / f"in{n}"), "-o", str(tmp_path / f"out{n}"),
                              "--batch-size", "4", "--groups", ONE_CORE, "-q"], capture_output=True, text=True)
        code, kib = res.stdout.split()[-2:]
        assert code == "0", res.stderr
        peaks[n] = int(kib) * 1024
        got = read_outputs(tmp_path / f"out{n}")
        assert list(got["row_id"]) == list(range(n)) and np.array_equal(got["y"], -np.moveaxis(x, 1, 0))
        del x, got
    assert peaks[160] - peaks[32] < 48 << 20, peaks


def test_compressed_npz_shards_are_loaded_one_shard_at_a_time(tmp_path):
    """A folder of numpy.savez_compressed shards: each shard's members are loaded whole when the
    job reaches it, one shard at a time (the sources module's promise), not every shard's when
    the dataset is opened: the peak memory of 10 shards is that of 2 (it held 128 MiB more).
    Peak RSS of each command, measured by a parent process that runs it alone."""
    import onnx
    from onnx import TensorProto, helper

    width = 1 << 18  # 1 MiB of float32 per row, 16 rows per shard
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "neg.onnx")
    measure = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    peaks = {}
    for shards in (2, 10):
        folder = tmp_path / f"in{shards}"
        folder.mkdir()
        for i in range(shards):
            np.savez_compressed(folder / f"shard-{i}.npz", x=np.full((16, width), i, np.float32))
        res = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "staronnx", "infer",
                              str(tmp_path / "neg.onnx"), "-i", str(folder), "-o", str(tmp_path / f"out{shards}"),
                              "--batch-size", "4", "--groups", ONE_CORE, "-q"], capture_output=True, text=True)
        code, kib = res.stdout.split()[-2:]
        assert code == "0", res.stderr
        peaks[shards] = int(kib) * 1024
        got = read_outputs(tmp_path / f"out{shards}")
        assert list(got["row_id"]) == list(range(16 * shards))
        assert np.array_equal(got["y"][:, 0], -np.repeat(np.arange(shards, dtype=np.float32), 16))
        del got
    assert peaks[10] - peaks[2] < 48 << 20, peaks


def test_a_job_that_stopped_before_its_first_shard_leaves_nothing_to_resume(tmp_path, capsys):
    """A job refused as it starts (an unknown --policy, checked once the output is prepared)
    wrote no shard: the corrected command runs as given, not refused as 'not empty' until
    --resume or --overwrite is added."""
    np.savez(tmp_path / "in.npz", image=crnn_rows(3, seed=29))
    base = ["infer", realmodels.path("crnn_ocr"), "-i", tmp_path / "in.npz", "-o", tmp_path / "out", "--batch-size", 2,
            "--groups", ONE_CORE, "-q"]
    code, _, err = cli(capsys, *base, "--policy", "fastest")
    assert code == 2 and "unknown scheduling policy 'fastest'" in err, err
    code, out, err = cli(capsys, *base)
    assert code == 0 and "3 samples written" in out, err
    assert list(read_outputs(tmp_path / "out")["row_id"]) == [0, 1, 2]


def test_a_model_output_named_row_id_is_refused_by_name(tmp_path, capsys):
    """An output named ``row_id`` would take the place of the row ids' column in every shard (the
    ids lost, the output read back as them): the job is refused before anything is written,
    naming the output and what to do."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["row_id"])], "neg",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("row_id", TensorProto.FLOAT, ["batch", 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "neg.onnx")
    np.savez(tmp_path / "in.npz", x=np.ones((3, 4), np.float32))
    code, _, err = cli(capsys, "infer", tmp_path / "neg.onnx", "-i", tmp_path / "in.npz", "-o", tmp_path / "out",
                       "--batch-size", 2, "--groups", ONE_CORE, "-q")
    assert code == 2 and "output named 'row_id'" in err and "rename that output" in err, err
    assert not (tmp_path / "out").exists()


def test_a_parquet_folder_is_read_in_name_order_with_only_its_dataset_files(tmp_path, capsys):
    """A folder of Parquet shards is read as a folder of .npz shards is: in name order (shard-2
    before shard-10), its partition subfolders too; a README, a job's skipped-rows list, _SUCCESS
    and hidden files beside the shards are not the dataset's; and a job's output kept inside its
    input folder is not read back as input by the next job."""
    x = crnn_rows(12, seed=30)
    data = tmp_path / "data"
    (data / "late").mkdir(parents=True)
    for i, name in enumerate(["shard-2", "shard-10", "late/shard-1"]):  # rows 0-3, 4-7, 8-11 in name order
        col = pa.FixedShapeTensorArray.from_numpy_ndarray(x[4 * i:4 * i + 4])
        pq.write_table(pa.table({"image": col}), data / f"{name}.parquet")
    (data / "README.md").write_text("images of text lines, one per row\n")
    (data / "_SUCCESS").write_text("")
    (data / "shard-2.errors.json").write_text("[]")
    base = ["infer", realmodels.path("crnn_ocr"), "-i", data, "--batch-size", 4, "--groups", ONE_CORE, "-q"]
    order = np.concatenate([x[8:12], x[0:4], x[4:8]])  # late/ first, then shard-2, then shard-10
    for _ in range(2):  # the second job finds the first one's output inside its input folder
        code, _, err = cli(capsys, *base, "-o", data / "out", "--overwrite")
        assert code == 0, err
        got = read_outputs(data / "out")
        _assert_rows(got, crnn_reference(order), np.arange(12))


def test_a_folder_of_npz_shards_takes_upper_case_suffixes_and_leaves_hidden_files_out(tmp_path, capsys):
    """shard-1.NPZ is a shard as shard-0.npz is (it was skipped without a word, its rows missing),
    and the files a copy from macOS leaves (._shard-0.npz, not an archive) are not shards (they
    failed the job)."""
    x = crnn_rows(6, seed=31)
    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "shard-0.npz", image=x[:3])
    np.savez(data / "shard-1.NPZ", image=x[3:])
    (data / "._shard-0.npz").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    code, _, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", data, "-o", tmp_path / "out",
                       "--batch-size", 3, "--groups", ONE_CORE, "-q")
    assert code == 0, err
    _assert_rows(read_outputs(tmp_path / "out"), crnn_reference(x), np.arange(6))


@pytest.mark.parametrize("name", ["out.parquet", "out.npz"])
def test_resume_of_a_finished_single_file_job_says_it_is_done(tmp_path, capsys, name):
    """A job whose output is one file finished (its shards joined, the parts folder gone); the
    same command with --resume (a retry loop, a rerun of a pipeline step) is a no-op that says
    every row was written before, its skipped rows still reported, the file left as it was. It
    was refused ("exists; --overwrite replaces it"), as if the job had never run. The same file
    for another dataset, or a file no job wrote, is still refused by name."""
    src, _ = _ocr_table_with_bad_rows(tmp_path)
    out = tmp_path / name
    base = ["infer", realmodels.path("crnn_ocr"), "-i", src, "-o", out, "--batch-size", 4, "--shard-rows", 5,
            "--on-error", "skip", "--groups", ONE_CORE, "-q"]
    code, _, err = cli(capsys, *base)
    assert code == 0, err
    assert not out.with_name(name + ".parts").exists()
    before = out.read_bytes()
    code, stdout, err = cli(capsys, *base, "--resume")
    assert code == 0, err
    assert "all 12 rows" in stdout and "nothing left to run" in stdout, stdout
    assert "2 row(s) skipped (row ids 4, 7)" in stdout, stdout
    assert out.read_bytes() == before
    assert list(read_outputs(out)["row_id"]) == [0, 1, 2, 3, 5, 6, 8, 9, 10, 11]
    if name.endswith(".npz"):
        with np.load(out) as z:  # the manifest rides in the zip comment, not as an entry
            assert sorted(z.files) == ["log_probs", "row_id"]

    np.savez(tmp_path / "other.npz", image=crnn_rows(9, seed=11))
    code, _, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", tmp_path / "other.npz", "-o", out,
                       "--batch-size", 4, "--shard-rows", 5, "--on-error", "skip", "--groups", ONE_CORE, "-q",
                       "--resume")
    assert code == 2 and "written by another job" in err and "source" in err, err
    theirs = tmp_path / ("theirs" + out.suffix)
    theirs.write_bytes(b"not a job's output")
    code, _, err = cli(capsys, *[theirs if a == out else a for a in base], "--resume")
    assert code == 2 and "keeps no manifest" in err, err
    assert theirs.read_bytes() == b"not a job's output"


def test_a_resumed_generator_does_not_hold_the_rows_written_before(tmp_path):
    """A generator's job stopped midway (its source failed at row 200) and resumed with a fresh
    generator: the rows before the resume point are read again (a generator cannot seek) but
    dropped as read. The job's first look at its rows (the warm-up) kept every item up to the
    resume point, so a resumed job held everything written before in memory at once (every
    row of the finished shards here; a day's images in a real job). The output holds every row
    once, in order."""
    import weakref

    x = crnn_rows(240, seed=32)

    def failing():
        for i in range(200):
            yield {"image": x[i:i + 1].copy()}
        raise OSError("the source went away")

    with pytest.raises(OSError, match="went away"):
        infer(realmodels.path("crnn_ocr"), failing(), tmp_path / "out", InferSpec(batch_size=4, shard_rows=20),
              MachineSpec(ONE_CORE))
    done = 20 * len(list((tmp_path / "out").glob("part-*.parquet")))
    assert done >= 40, done
    alive_before: list[int] = []
    refs: list[weakref.ref] = []

    def again():
        for i in range(240):
            if i <= done:  # the rows written before, as the first row to run is read
                alive_before.append(sum(r() is not None for r in refs))
            row = x[i:i + 1].copy()
            refs.append(weakref.ref(row))
            yield {"image": row}
            del row

    report = infer(realmodels.path("crnn_ocr"), again(), tmp_path / "out", InferSpec(batch_size=4, shard_rows=20,
                   resume=True), MachineSpec(ONE_CORE))
    assert (report.written, report.resumed_rows) == (240 - done, done)
    assert max(alive_before) <= 4, f"{max(alive_before)} of the {done} rows written before held at once"
    _assert_rows(read_outputs(tmp_path / "out"), crnn_reference(x), np.arange(240))


def test_an_overwrite_of_a_single_file_that_stopped_resumes(tmp_path, capsys):
    """out.parquet holds an earlier job's rows; a job for another dataset with --overwrite stops
    at a bad row, saying its shards are kept for --resume (the old file stays until it is
    done). The same command with --resume --on-error skip carries on from those shards; it was
    refused ("exists; --overwrite replaces it"), and --overwrite would start again."""
    np.savez(tmp_path / "first.npz", image=crnn_rows(6, seed=33))
    out = tmp_path / "out.parquet"
    model = realmodels.path("crnn_ocr")
    opts = ["--batch-size", 2, "--shard-rows", 2, "--groups", ONE_CORE, "-q"]
    assert cli(capsys, "infer", model, "-i", tmp_path / "first.npz", "-o", out, *opts)[0] == 0
    src, rows = _ocr_table_with_bad_rows(tmp_path)
    code, _, err = cli(capsys, "infer", model, "-i", src, "-o", out, *opts, "--overwrite")
    assert code == 2 and "row 4 of the dataset cannot run" in err and "--resume" in err, err
    kept = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("out.parquet.parts/part-*.parquet")}
    assert sorted(kept) == ["part-00000.parquet", "part-00001.parquet"]
    code, stdout, err = cli(capsys, "infer", model, "-i", src, "-o", out, *opts, "--resume", "--on-error", "skip")
    assert code == 0, err
    assert "4 written before, kept" in stdout and "2 row(s) skipped (row ids 4, 7)" in stdout, stdout
    good = [i for i in range(12) if i not in (4, 7)]
    want = [{"log_probs": _ort("crnn_ocr", {"image": r[None]})["log_probs"][:, 0]} if i in good else {}
            for i, r in enumerate(rows)]
    _assert_rows(read_outputs(out), want, np.array(good))
    assert not (tmp_path / "out.parquet.parts").exists()
    code, stdout, err = cli(capsys, "infer", model, "-i", src, "-o", out, *opts, "--resume", "--on-error", "skip")
    assert code == 0 and "all 12 rows" in stdout, err


def test_a_batch_1_export_with_one_channel_takes_parquet_rows_with_or_without_the_batch_axis(tmp_path):
    """A model exported at batch 1 whose next size is 1 too (a grayscale image, [1, 1, 4, 5]):
    Parquet rows of the sample ([1, 4, 5]) had their channel taken for the batch-1 axis and
    dropped, so every row was refused ('expected rank 4, got shape [1, 4, 5]'). Rows written
    with the batch axis ([1, 1, 4, 5]) run as before; both give ORT's answer per row."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["t"]), helper.make_node("Relu", ["t"], ["y"])], "gray",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, 5])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "gray.onnx")
    x = np.random.default_rng(34).standard_normal((6, 1, 4, 5)).astype(np.float32)
    import onnxruntime as ort

    ref = ort.InferenceSession(str(tmp_path / "gray.onnx"), providers=["CPUExecutionProvider"])
    want = [{"y": ref.run(None, {"x": x[i:i + 1]})[0][0]} for i in range(6)]
    for name, rows in (("sample", x), ("with-batch-axis", x.reshape(6, 1, 1, 4, 5).copy())):
        pq.write_table(pa.table({"x": pa.FixedShapeTensorArray.from_numpy_ndarray(rows)}), tmp_path / f"{name}.parquet")
        report = infer(tmp_path / "gray.onnx", tmp_path / f"{name}.parquet", tmp_path / f"out-{name}",
                       InferSpec(on_error="skip"), MachineSpec(ONE_CORE))
        assert report.skipped == [] and report.written == 6, (name, report.skipped[:1])
        _assert_rows(read_outputs(tmp_path / f"out-{name}"), want, np.arange(6))


@pytest.mark.parametrize("fmt", ["parquet", "npz"])
def test_shards_from_100000_on_are_read_back_in_order(tmp_path, capsys, fmt):
    """Shard k is part-{k:05d}: from shard 100000 on the name has six digits, and sorted by name
    part-100000 came before part-10001, so read_outputs (and the join of a single-file output)
    put a long job's last rows in its middle (--shard-rows 100 reaches it at 10 million rows).
    Three shards a job wrote, renamed as shards 9999, 10001 and 100000 of such a job, read back
    in shard order."""
    np.savez(tmp_path / "in.npz", image=crnn_rows(3, seed=35))
    out = tmp_path / "out"
    code, _, err = cli(capsys, "infer", realmodels.path("crnn_ocr"), "-i", tmp_path / "in.npz", "-o", out,
                       "--batch-size", 1, "--shard-rows", 1, "--format", fmt, "--groups", ONE_CORE, "-q")
    assert code == 0, err
    for k, index in enumerate([9999, 10001, 100000]):
        (out / f"part-{k:05d}.{fmt}").rename(out / f"part-{index:05d}.{fmt}")
    assert list(read_outputs(out)["row_id"]) == [0, 1, 2]


def test_a_dataset_of_the_wrong_dtype_fails_at_row_0_without_reading_to_its_end(tmp_path):
    """float64 rows for crnn_ocr's float32 input (a common slip: numpy's default dtype) with
    --on-error fail: the job fails naming row 0. Every batch was refused before it ran, held no
    inputs, and so never filled the reader's bundle: the job read the whole dataset (6,000
    rows here; a day's images in a real job) before it reported row 0."""
    read = 0

    def rows():
        nonlocal read
        for _ in range(6000):
            read += 1
            yield {"image": np.zeros((1, 1, 32, 64), np.float64)}

    with pytest.raises(RowError, match="row 0 of the dataset cannot run.*float32"):
        infer(realmodels.path("crnn_ocr"), rows(), tmp_path / "out", InferSpec(batch_size=1), MachineSpec(ONE_CORE))
    assert read < 3000, f"{read} rows read to fail at row 0"


def test_without_a_batch_size_a_dataset_of_the_wrong_dtype_is_not_read_to_its_end_first(tmp_path):
    """The same slip without --batch-size (the default): the batch-size probe and then the
    warm-up each looked through the whole dataset for rows the model takes before the job
    began, so a dataset of float64 rows was read twice to its end before row 0 was reported.
    They now look through a bounded number of rows."""
    read = 0

    class Rows:  # an iterable read again from its start each time (a list, a dataset object)
        def __iter__(self):
            nonlocal read
            for _ in range(8000):
                read += 1
                yield {"image": np.zeros((1, 1, 32, 64), np.float64)}

    with pytest.raises(RowError, match="row 0 of the dataset cannot run.*float32"):
        infer(realmodels.path("crnn_ocr"), Rows(), tmp_path / "out", InferSpec(), MachineSpec(ONE_CORE))
    assert read < 8000, f"{read} rows read to fail at row 0"


@pytest.mark.parametrize("fmt", ["npz", "parquet"])
def test_a_single_file_output_kept_in_its_input_folder_is_not_read_as_input(tmp_path, capsys, fmt):
    """-o data/preds.npz beside the dataset's shards: the next job over data/ (a rerun with
    --overwrite, a --resume) read preds.npz as a shard of the dataset and was refused ('unknown
    input(s) ['log_probs', 'row_id']'), as an output folder kept there is not. The file keeps
    its job's manifest, which tells it apart."""
    x = crnn_rows(10, seed=36)
    data = tmp_path / "data"
    if fmt == "npz":
        npz_shards(data, {"image": x}, 4)
    else:
        data.mkdir()
        for i, lo in enumerate(range(0, 10, 4)):
            col = pa.FixedShapeTensorArray.from_numpy_ndarray(x[lo:lo + 4])
            pq.write_table(pa.table({"image": col}), data / f"shard-{i}.parquet")
    out = data / f"preds.{fmt}"
    base = ["infer", realmodels.path("crnn_ocr"), "-i", data, "-o", out, "--batch-size", 4, "--groups", ONE_CORE, "-q"]
    assert cli(capsys, *base)[0] == 0
    code, stdout, err = cli(capsys, *base, "--overwrite")
    assert code == 0 and "10 samples written" in stdout, err
    _assert_rows(read_outputs(out), crnn_reference(x), np.arange(10))
    code, stdout, err = cli(capsys, *base, "--resume")
    assert code == 0 and "all 10 rows" in stdout, err


def test_a_fortran_ordered_npy_is_read_a_chunk_at_a_time(tmp_path):
    """A dataset saved from a Fortran-ordered array (a transposed feature matrix: numpy.save
    keeps its order) was loaded whole for every chunk: the job's peak memory grew with the
    dataset (and the file was read once per chunk). It is read a chunk at a time, as a
    C-ordered one is, and every row is ORT's. Peak RSS of each command, measured by a parent
    process that runs it alone."""
    import onnx
    from onnx import TensorProto, helper

    width = 1 << 18  # 1 MiB of float32 per row
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "neg",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "neg.onnx")
    measure = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    peaks = {}
    for n in (32, 160):
        x = np.asfortranarray(np.random.default_rng(n).standard_normal((n, width)).astype(np.float32))
        (tmp_path / f"in{n}").mkdir()
        np.save(tmp_path / f"in{n}" / "x.npy", x)
        res = subprocess.run([sys.executable, "-c", measure, sys.executable, "-m", "staronnx", "infer",
                              str(tmp_path / "neg.onnx"), "-i", str(tmp_path / f"in{n}"), "-o", str(tmp_path / f"out{n}"),
                              "--batch-size", "4", "--groups", ONE_CORE, "-q"], capture_output=True, text=True)
        code, kib = res.stdout.split()[-2:]
        assert code == "0", res.stderr
        peaks[n] = int(kib) * 1024
        got = read_outputs(tmp_path / f"out{n}")
        assert list(got["row_id"]) == list(range(n)) and np.array_equal(got["y"], -x)
        del x, got
    assert peaks[160] - peaks[32] < 48 << 20, peaks


def test_a_model_with_external_weights_keeps_its_plan_and_sees_new_weights(tmp_path, caplog):
    """A model saved with external data (model.onnx + model.onnx.data): the one-part plan a job
    makes is kept for the next job, as a model of one file's is. It was made again by every job
    (its weights copied again), each saying the kept plan 'is of another model': the kept plan
    records the model's hash with its weights, looked up by the file's alone. New weights in
    model.onnx.data (the .onnx unchanged) still give a new plan and the new outputs."""
    import logging

    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32])],
                              [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "mm.onnx",
              save_as_external_data=True, location="mm.onnx.data", size_threshold=0)

    x = np.random.default_rng(37).standard_normal((6, 64)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    from staronnx.infer import plan_for

    def run(out: str) -> dict:
        infer(tmp_path / "mm.onnx", tmp_path / "in.npz", tmp_path / out, InferSpec(batch_size=2), MachineSpec(ONE_CORE))
        want = ort.InferenceSession(str(tmp_path / "mm.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        got = read_outputs(tmp_path / out)
        np.testing.assert_allclose(got["y"], want, rtol=1e-5, atol=1e-5)
        return got

    run("out1")
    plan_json = plan_for(tmp_path / "mm.onnx").root / "plan.json"
    made = plan_json.stat().st_ino
    with caplog.at_level(logging.WARNING):
        run("out2")
    assert "is of another model" not in caplog.text
    assert plan_json.stat().st_ino == made, "the kept plan was made again"
    # retrained weights, the graph file as it was (the tensor's raw bytes are the whole data file)
    assert (tmp_path / "mm.onnx.data").stat().st_size == w.nbytes
    (tmp_path / "mm.onnx.data").write_bytes((w[::-1] * 2).tobytes())
    first = read_outputs(tmp_path / "out1")["y"]
    assert not np.allclose(run("out3")["y"], first)


def test_a_model_whose_outputs_mix_the_batch_runs_a_row_per_task(tmp_path, capsys):
    """A dynamic batch in, outputs that do not keep it apart (a detector's boxes of every image
    in one list, a batch-index column beside them; here NonZero's indices): requests cannot
    share a task, but each row can run alone. The dataset was refused ('no input holds rows
    (the model's rows lie along {})'). So was any dataset of a plan cut with batching off
    (crnn_ocr here), whose inputs the contract still reads. Each row is ORT's answer."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from staronnx import partition
    from staronnx.partition import PartitionSpec

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("NonZero", ["r"], ["nz"]),
                               helper.make_node("Transpose", ["nz"], ["y"], perm=[1, 0])], "flat",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, ["K", 2])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "flat.onnx")
    x = np.random.default_rng(38).standard_normal((7, 4)).astype(np.float32)
    np.savez(tmp_path / "flat.npz", x=x)
    code, _, err = cli(capsys, "infer", tmp_path / "flat.onnx", "-i", tmp_path / "flat.npz", "-o", tmp_path / "out1",
                       "--groups", ONE_CORE, "-q")
    assert code == 0, err
    ref = ort.InferenceSession(str(tmp_path / "flat.onnx"), providers=["CPUExecutionProvider"])
    got = read_outputs(tmp_path / "out1")
    assert list(got["row_id"]) == list(range(7))
    for i in range(7):
        np.testing.assert_array_equal(np.asarray(got["y"][i]).reshape(-1, 2), ref.run(None, {"x": x[i:i + 1]})[0])

    plan = partition(realmodels.path("crnn_ocr"), None, PartitionSpec(parts=1, batching=False, costs="estimate",
                                                                      input_shapes=["image=1x1x32x64"]),
                     output_dir=tmp_path / "plan")
    assert not plan.contract.batchable
    images = crnn_rows(5, seed=39)
    np.savez(tmp_path / "ocr.npz", image=images)
    code, _, err = cli(capsys, "infer", tmp_path / "plan", "-i", tmp_path / "ocr.npz", "-o", tmp_path / "out2",
                       "--groups", ONE_CORE, "-q")
    assert code == 0, err
    _assert_rows(read_outputs(tmp_path / "out2"), crnn_reference(images), np.arange(5))


def test_a_resume_passes_the_parquet_row_groups_written_before_unread(tmp_path, capsys):
    """One Parquet file of 40 rows in row groups of 10; the job stops at a null in row 25 (after
    shards 0 and 1, rows 0-19). The resume read and decoded every row before row 20 again only
    to drop it (a crash at 90% of one large file read 90% of it again). Row groups wholly before
    the resume point are now passed by their metadata: shown here by damaging the first row
    group's data after the first run (its size and time kept, so the dataset is the job's): the
    resume does not touch it, where it failed on it."""
    import os

    x = crnn_rows(40, seed=40)
    rows = [None if i == 25 else x[i].tolist() for i in range(40)]
    src = tmp_path / "data.parquet"
    pq.write_table(pa.table({"image": pa.array(rows, type=pa.list_(pa.list_(pa.list_(pa.float32()))))}), src,
                   row_group_size=10)
    base = ["infer", realmodels.path("crnn_ocr"), "-i", src, "-o", tmp_path / "out", "--batch-size", 5,
            "--shard-rows", 10, "--groups", ONE_CORE, "-q"]
    code, _, err = cli(capsys, *base)
    assert code == 2 and "row 25" in err, err
    assert sorted(p.name for p in (tmp_path / "out").glob("part-*.parquet")) == ["part-00000.parquet",
                                                                                "part-00001.parquet"]
    column = pq.ParquetFile(src).metadata.row_group(0).column(0)
    st = src.stat()
    with open(src, "r+b") as fh:  # the first row group's pages overwritten
        fh.seek(column.data_page_offset)
        fh.write(b"\xff" * column.total_compressed_size)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, out, err = cli(capsys, *base, "--resume", "--on-error", "skip")
    assert code == 0, err
    assert "20 written before, kept" in out and "1 row(s) skipped (row ids 25)" in out, out
    got = read_outputs(tmp_path / "out")
    good = [i for i in range(40) if i != 25]
    assert list(got["row_id"]) == good
    want = crnn_reference(x)
    _assert_rows({"row_id": got["row_id"][20:], "log_probs": got["log_probs"][20:]}, want, np.array(good[20:]))


def test_a_second_job_on_an_output_being_written_is_refused(tmp_path):
    """A job writes out/ (held here, in a thread, by its generator waiting halfway); a second
    job on the same output, with --overwrite (another dataset) or --resume, went ahead: the
    first removed or written under the second, a folder of one job's manifest and the other's
    rows. The second is refused, naming why; the first ends whole, and leaves no lock behind."""
    import threading

    x = crnn_rows(12, seed=41)
    halfway, go_on = threading.Event(), threading.Event()

    def rows():
        for i in range(12):
            if i == 8:
                halfway.set()
                go_on.wait(120)
            yield {"image": x[i:i + 1]}

    out = tmp_path / "out"
    result: dict = {}

    def first() -> None:
        try:
            result["report"] = infer(realmodels.path("crnn_ocr"), rows(), out, InferSpec(batch_size=2, shard_rows=4),
                                     MachineSpec(ONE_CORE))
        except BaseException as exc:  # noqa: BLE001 - checked below
            result["error"] = exc

    job = threading.Thread(target=first)
    job.start()
    try:
        assert halfway.wait(120)
        np.savez(tmp_path / "other.npz", image=crnn_rows(3, seed=42))
        for spec in (InferSpec(batch_size=2, shard_rows=4, overwrite=True), InferSpec(batch_size=2, shard_rows=4,
                                                                                       resume=True)):
            with pytest.raises(OutputError, match="another staronnx infer job is writing"):
                infer(realmodels.path("crnn_ocr"), tmp_path / "other.npz", out, spec, MachineSpec(ONE_CORE))
    finally:
        go_on.set()
        job.join(120)
    assert "error" not in result, result
    assert result["report"].written == 12
    _assert_rows(read_outputs(out), crnn_reference(x), np.arange(12))
    assert sorted(p.name for p in out.iterdir()) == ["_SUCCESS.json", "_manifest.json", "part-00000.parquet",
                                                     "part-00001.parquet", "part-00002.parquet"]


def test_a_resumed_shard_without_skipped_rows_drops_the_list_its_stopped_run_wrote(tmp_path, capsys):
    """A shard's skipped rows are listed before the shard is written; a job stopped between the
    two (here: the shard file removed, the state a crash there leaves) and resumed where those
    rows now run (a batch size the model takes: this one cannot run a row alone, as a row that
    failed for want of memory runs later) kept the old list: the rows written were reported
    skipped too ('8 row(s) skipped'), in _errors.json and the report."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "pairs"], ["p"]), helper.make_node("Reshape", ["p", "rows"], ["y"])],
        "pairs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(np.array([2, -1], np.int64), "pairs"),
         numpy_helper.from_array(np.array([-1, 3], np.int64), "rows")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "pairs.onnx")
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    np.savez(tmp_path / "in.npz", x=x)
    out = tmp_path / "out"
    base = ["infer", tmp_path / "pairs.onnx", "-i", tmp_path / "in.npz", "-o", out, "--shard-rows", 4,
            "--on-error", "skip", "--groups", ONE_CORE, "-q"]
    code, stdout, err = cli(capsys, *base, "--batch-size", 1)
    assert code == 0 and "8 row(s) skipped" in stdout, (stdout, err)
    (out / "part-00001.parquet").unlink()  # stopped after shard 1's list, before shard 1
    (out / "_SUCCESS.json").unlink()
    code, stdout, err = cli(capsys, *base, "--batch-size", 2, "--resume")
    assert code == 0, err
    assert "4 row(s) skipped (row ids 0, 1, 2, 3)" in stdout, stdout
    assert [e["row_id"] for e in json.loads((out / "_errors.json").read_text())] == [0, 1, 2, 3]
    got = read_outputs(out)
    assert list(got["row_id"]) == [4, 5, 6, 7] and np.array_equal(got["y"], x[4:])


def test_one_npz_file_is_joined_from_its_shards_a_shard_at_a_time(tmp_path):
    """A job writing one ``out.npz`` joins its shards at the end: the join loaded every shard,
    concatenated them and built the zip in memory, so the whole output was held about three times
    at the end of a job whose memory is otherwise bounded by a shard. It streams each output's
    member into the zip now (the tracemalloc peak of the job stays under the output's size); the
    file loads as before, rows equal to the parts the job wrote."""
    import tracemalloc

    src = tmp_path / "in.npz"
    np.savez(src, image=crnn_rows(3200, seed=3))
    out = tmp_path / "out.npz"
    spec = InferSpec(batch_size=16, shard_rows=64, output_format="npz")
    tracemalloc.start()
    try:
        infer(realmodels.path("crnn_ocr"), src, out, spec, MachineSpec(ONE_CORE))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    with np.load(out) as z:
        assert sorted(z.files) == ["log_probs", "row_id"]
        got = {n: z[n] for n in z.files}
    assert list(got["row_id"]) == list(range(3200))
    total = sum(v.nbytes for v in got.values())
    want = _ort("crnn_ocr", {"image": crnn_rows(3200, seed=3)})["log_probs"]
    np.testing.assert_allclose(got["log_probs"], np.moveaxis(want, 1, 0), atol=1e-4)
    assert peak < 1.5 * total, (peak, total)  # the old join: over 3 times the output
