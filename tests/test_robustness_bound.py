"""Measurements above the LP bound mean stale perf models (issue 12, defect 8).

The models of the shared calibrated plan are made 1000x slow on a copy of its home (as if
calibrated on a machine under heavy load): the LP bound falls to a few samples/s, and a live
point at 50 requests/s beats it. ``optimize-batch`` and ``sweep`` must say the models are
stale and give the ``staronnx calibrate ... --replace`` line that fixes them, which must work.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from staronnx.perfmodels import PerfModelStore

SLOWER = 1000.0


def staronnx(*args: object, home: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "staronnx", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "STARONNX_HOME": str(home)})


@pytest.fixture
def stale_home(calibrated_inception, tmp_path) -> tuple[object, Path]:
    plan, home = calibrated_inception
    copy = tmp_path / "home"
    shutil.copytree(home, copy)
    store = PerfModelStore(copy)
    for key in store.list(plan.hash):
        path = store.path(key)
        data = json.loads(path.read_text())
        for e in data["entries"]:
            e["sum"] *= SLOWER
            e["sum2"] *= SLOWER**2
        path.write_text(json.dumps(data))
    return plan, copy


def _stale_line(text: str) -> str:
    joined = " ".join(text.split())  # rich wraps long lines
    assert "above the LP bound" in joined and "stale" in joined, text
    return joined


def test_optimize_batch_says_the_models_are_stale(stale_home, two_groups):
    plan, home = stale_home
    res = staronnx("optimize-batch", plan.root, "--groups", two_groups, "--rate", "50",
                   "--batch-sizes", "1,2", "--sim-duration", "2s", "--verify-duration", "1s",
                   "--max-verify", "2", home=home)
    assert res.returncode == 0, res.stderr
    line = _stale_line(res.stdout)
    assert "staronnx calibrate" in line and "--replace" in line and f"--groups {shlex.quote(two_groups)}" in line


def test_sweep_says_the_models_are_stale_and_recalibrating_fixes_them(stale_home, tmp_path, two_groups):
    plan, home = stale_home
    out = tmp_path / "results"
    res = staronnx("sweep", plan.root, "--groups", two_groups, "--batch-sizes", "1", "--rates", "50",
                   "--duration", "1s", "--no-plots", "-o", out, home=home)
    assert res.returncode == 0, res.stderr
    _stale_line(res.stdout + res.stderr)
    notes = json.loads((out / "results.json").read_text())["notes"]
    [note] = [n for n in notes if "above the LP bound" in n]
    command = note.split("`")[1]
    assert command.startswith("staronnx calibrate ") and command.endswith("--replace")
    before = {k: store_mean(home, plan, k) for k in PerfModelStore(home).list(plan.hash)}
    res = staronnx(*shlex.split(command)[1:], "--no-bus", home=home)
    assert res.returncode == 0, res.stderr
    for key, mean in before.items():
        assert store_mean(home, plan, key) < mean / 10  # measured afresh, not merged


def store_mean(home: Path, plan, key) -> float:  # type: ignore[no-untyped-def]
    row = next(r for r in PerfModelStore(home).load(plan.hash, key.part, key.arch).rows() if r.batch == 1)
    return row.mean


def test_the_stale_note_recalibrates_the_cuda_workers_measured(real_plan, tmp_path, monkeypatch):
    """Measured above the bound on CUDA workers with a driver thread per stream and no graphs,
    the note's ``staronnx calibrate ... --replace`` line left both flags out: run as told, it
    calibrated other workers (one driver per GPU: a wider CPU group, graphs captured), and the
    stale models of the ones measured stayed stale. The line now carries them, and calibrates
    those very workers (HostRuntime stands in for the GPU)."""
    from staronnx.bench.bound import stale_models_note
    from staronnx.workers.layout import MachineSpec

    monkeypatch.setenv("STARONNX_CUDA_RUNTIME", "host")
    plan = real_plan("gru_stream")
    machine = MachineSpec("none", 2, (0,), cuda_graphs=False, thread_per_stream=True)
    note = stale_models_note(plan, [(1, 500.0, 10.0)], machine)
    assert note is not None
    command = note.split("`")[1]
    assert command.endswith("--batch-sizes 1 --cuda-streams 2 --no-cuda-graphs --cuda-thread-per-stream --replace")
    res = staronnx(*shlex.split(command)[1:], "--no-bus", "--no-host", "--max-runs", "30", home=tmp_path / "home")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 driver threads for 2 streams" in res.stdout, res.stdout
