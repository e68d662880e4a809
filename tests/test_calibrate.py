"""Calibration on real workers fills StarPU-style history models; the CLI shows and plots them."""

from __future__ import annotations

import os

import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from staronnx import partition
from staronnx.calibrate import calibrate, start_workers
from staronnx.perfmodels import PerfModelStore
from staronnx.zoo import inception
from staronnx.partition import PartitionSpec
from staronnx.workers.layout import MachineSpec


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("calib")
    model = root / "inception.onnx"
    onnx.save(inception(blocks=2, channels=8, size=16), str(model))
    return partition(model, [0.7, 0.3], PartitionSpec(profile_runs=2), output_dir=root / "plan")


def test_calibrate_fills_every_part_arch_batch(small_plan, tmp_path, two_groups):
    store = PerfModelStore(tmp_path)
    workers = start_workers(small_plan, MachineSpec(groups=two_groups))
    try:
        report = calibrate(small_plan, [1, 3], workers=workers, store=store)
        archs = {w.arch for w in workers}
    finally:
        for w in workers:
            w.close()
    assert archs == {"cpu1"}
    assert not report.uncalibrated
    rows = store.rows(small_plan.hash)
    seen = {(r.part, r.arch, r.batch) for r in rows if r.n >= 10}
    assert seen == {(p, "cpu1", b) for p in range(small_plan.k) for b in (1, 3)}
    for r in rows:
        assert r.mean > 0 and r.prediction == pytest.approx(r.mean)

    # a second calibration finds the models calibrated and runs nothing more
    workers = start_workers(small_plan, MachineSpec(groups=two_groups))
    try:
        again = calibrate(small_plan, [1, 3], workers=workers, store=store)
    finally:
        for w in workers:
            w.close()
    assert sum(again.runs.values()) == 0


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "STARONNX_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "staronnx", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_cli_calibrate_show_and_plot(small_plan, tmp_path):
    home = tmp_path / "home"
    shown = _cli("perfmodel", "show", str(small_plan.root), home=home)
    assert shown.returncode == 2 and "staronnx calibrate" in shown.stderr
    done = _cli("calibrate", str(small_plan.root), "--batch-sizes", "1,2", home=home)
    assert done.returncode == 0, done.stderr
    png = tmp_path / "pm.png"
    shown = _cli("perfmodel", "show", str(small_plan.root), "--plot", str(png), home=home)
    assert shown.returncode == 0, shown.stderr
    lines = [ln for ln in shown.stdout.splitlines() if ln.startswith("│")]
    parts_batches = {(ln.split("│")[1].strip(), ln.split("│")[3].strip()) for ln in lines}
    assert {(str(p), str(b)) for p in range(small_plan.k) for b in (1, 2)} <= parts_batches
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_batch_sizes_is_a_clear_error(small_plan, tmp_path):
    out = _cli("calibrate", str(small_plan.root), "--batch-sizes", "0,x", home=tmp_path)
    assert out.returncode == 2 and "--batch-sizes" in out.stderr


def test_an_interrupted_replacing_calibration_keeps_the_batch_sizes_it_did_not_reach(small_plan, tmp_path):
    """``--replace`` cut short after its first step: that step's footprint replaces the stored
    one, and every footprint it never reached keeps its calibrated entry (they used to be
    dropped with the whole stored model, minutes of measurement gone)."""
    from staronnx.calibrate import CalibrationReport

    store = PerfModelStore(tmp_path)
    pu = str(sorted(os.sched_getaffinity(0))[0])
    workers = start_workers(small_plan, MachineSpec(groups=pu))
    try:
        calibrate(small_plan, [1, 3], workers=workers, store=store)
        before = {(r.part, r.batch): r for r in store.rows(small_plan.hash)}

        def interrupt(step: str) -> None:
            raise KeyboardInterrupt

        report = CalibrationReport()
        with pytest.raises(KeyboardInterrupt):
            calibrate(small_plan, [1, 3], workers=workers, store=store, replace=True, on_step=interrupt,
                      report=report)
        arch = workers[0].arch
    finally:
        for w in workers:
            w.close()
    assert report.interrupted and report.steps_done == 1 and set(report.runs) == {(0, arch, 1)}
    after = {(r.part, r.batch): r for r in store.rows(small_plan.hash)}
    assert set(after) == set(before) == {(p, b) for p in range(small_plan.k) for b in (1, 3)}
    for key in set(before) - {(0, 1)}:  # never reached: as calibrated before
        assert (after[key].n, after[key].mean, after[key].calibrated) == (before[key].n, before[key].mean, True), key
    # the step that ran starts over from its own samples (the first one dropped, as StarPU does),
    # not merged into the stored ones; fewer where StarPU's reset (outliers >= samples) emptied
    # the entry mid-run, which 40 us tasks on a busy machine can meet
    fresh = after[(0, 1)].n + after[(0, 1)].nerror
    assert before[(0, 1)].n > 0 and 0 < fresh <= report.runs[(0, arch, 1)] - 1


def test_cli_calibrate_replace_rewrites_the_batch_sizes_named_and_keeps_the_others(small_plan, tmp_path):
    """``staronnx calibrate --replace --batch-sizes 2`` measures batch 2 afresh and overwrites
    its entries; batch 1's, calibrated before and not named, stay as they were. (A completed
    replacing run used to write its fresh, batch-2-only models over the stored ones, so
    every batch size it was not asked about lost its calibration.)"""
    from staronnx.perfmodels import HistoryModel
    from staronnx.perfmodels.store import ModelKey

    home = tmp_path / "home"
    done = _cli("calibrate", str(small_plan.root), "--batch-sizes", "1,2", home=home)
    assert done.returncode == 0, done.stderr
    store = PerfModelStore(home)
    before = {(r.part, r.arch, r.batch): r for r in store.rows(small_plan.hash)}
    archs = {arch for _, arch, _ in before}
    # make batch 2 stale: 100 s a run, as a model measured on a far slower machine would say
    for part in range(small_plan.k):
        for arch in archs:
            key = ModelKey(small_plan.hash, part, arch)
            stale = HistoryModel(part, arch)
            for fp in [fp for fp in store.load(small_plan.hash, part, arch).entries() if fp.batch == 2]:
                for _ in range(12):
                    stale.record(fp, 100.0)
            store.update(key, lambda disk, stale=stale: disk.overwrite(stale))
    assert all(r.mean == pytest.approx(100.0) for r in store.rows(small_plan.hash) if r.batch == 2)

    done = _cli("calibrate", str(small_plan.root), "--batch-sizes", "2", "--replace", home=home)
    assert done.returncode == 0, done.stderr
    after = {(r.part, r.arch, r.batch): r for r in store.rows(small_plan.hash)}
    assert set(after) == set(before)
    for key, row in after.items():
        if key[2] == 1:  # not named: as calibrated before
            assert (row.n, row.mean) == (before[key].n, before[key].mean), key
        else:  # named: measured afresh, the stale 100 s gone
            assert row.calibrated and row.mean < 1.0, (key, row)


def test_calibration_runs_as_tasks_pinned_to_each_worker_through_the_engine(small_plan, tmp_path):
    """Calibration goes the way serving goes (StarPU's execute_on_specific_worker): a device's
    two CUDA streams are driven by one engine thread, so every upload of the calibration comes
    from that one thread (each worker's own queue would have used its own two), and each
    arch's perf models (the streams share one) are filled with kernel times."""
    from staronnx.workers.cudart import HostRuntime

    rt = HostRuntime()
    store = PerfModelStore(tmp_path)
    workers = start_workers(small_plan, MachineSpec(groups="none", cuda_streams=2), cuda_options={"runtime": rt})
    try:
        report = calibrate(small_plan, [2], workers=workers, store=store, max_runs=30)
    finally:
        for w in workers:
            w.close()
    assert [w.name for w in workers] == ["cuda0.s0", "cuda0.s1"]
    assert len(rt.copy_threads) == 1
    assert report.samples >= small_plan.k * 10 and not report.uncalibrated  # one model per arch
    assert {(r.part, r.arch) for r in store.rows(small_plan.hash)} == {(p, "cuda0") for p in range(small_plan.k)}


@pytest.mark.parametrize("runs", ["0", "-3"])
def test_max_runs_below_one_is_refused_not_blamed_on_outliers(real_plan, tmp_path, runs):
    """``--max-runs 0`` allowed no run: every entry stayed uncalibrated and the command exited 0
    saying "not calibrated (too many outliers within 0 runs)", outliers nobody measured. Now one
    line before any worker starts, and nothing is stored."""
    plan = real_plan("gru_stream")
    out = _cli("calibrate", str(plan.root), "--batch-sizes", "1", "--max-runs", runs, "--no-bus", "--no-host",
               home=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stdout + out.stderr
    assert out.stderr.strip() == (f"staronnx: error: --max-runs must be at least 1 (runs per worker, part and batch "
                                  f"size), got {runs}")
    assert "outliers" not in out.stdout
    assert PerfModelStore(tmp_path).rows(plan.hash) == []
