"""What a new user meets first (issue 12): sweep-plot --compare, the warning when a command has
no calibrated model for its workers, option help without a ``<bool>`` metavar, and
``staronnx.Server`` in the public API. Every case goes through the CLI, in a subprocess."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import staronnx
from staronnx.bench.sweep import sweep
from staronnx.bench.spec import RunSpec, SweepSpec
from staronnx.workers.layout import MachineSpec

PNG = b"\x89PNG\r\n\x1a\n"


def _cli(*args: str, home: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "STARONNX_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "staronnx", *args], check=False, capture_output=True,
                          text=True, env=env, timeout=timeout)


def _one_pu() -> str:
    """An explicit one-PU CPU group ("cpu1" on any host): the first PU this process may use."""
    return str(min(os.sched_getaffinity(0)))


# -- sweep-plot --compare ----------------------------------------------------------------------
def test_sweep_plot_compare_overlays_folders(calibrated_inception, tmp_path):
    plan, home = calibrated_inception
    from staronnx.perfmodels import PerfModelStore

    for name in ("a", "b"):
        sweep(plan, [50.0], [1], SweepSpec(RunSpec(duration=0.3), out_dir=tmp_path / name, extend=False),
              machine=MachineSpec(groups=_one_pu()), store=PerfModelStore(home))
    out = tmp_path / "both.png"
    done = _cli("sweep-plot", str(tmp_path / "a"), "--compare", str(tmp_path / "b"), "--labels", "first,second",
                "-o", str(out), home=home)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == PNG
    assert f"plot: {out}" in done.stdout
    # folders given positionally still work, and both ways may be mixed
    done = _cli("sweep-plot", str(tmp_path / "a"), str(tmp_path / "b"), "--compare", str(tmp_path / "a"),
                "-o", str(tmp_path / "three.png"), home=home)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "three.png").read_bytes()[:8] == PNG
    # a --compare folder that is not a sweep: one line, exit 2
    bad = _cli("sweep-plot", str(tmp_path / "a"), "--compare", str(tmp_path), home=home)
    assert bad.returncode == 2
    assert bad.stderr.startswith("staronnx: error: --compare") and "Traceback" not in bad.stderr


# -- no calibrated model: one warning line on stderr -------------------------------------------
@pytest.fixture
def half_calibrated(calibrated_inception, tmp_path) -> tuple[staronnx.Plan, Path]:
    """The shared calibrated plan with part 1's models taken away (part 0 stays calibrated)."""
    plan, home = calibrated_inception
    copy = tmp_path / "home"
    shutil.copytree(home, copy)
    removed = [p for p in copy.rglob("part1.*.json")]
    assert removed
    for p in removed:
        p.unlink()
    return plan, copy


WARNING = re.compile(r"^staronnx: warning: no calibrated model for (.+?): run (staronnx calibrate .+)$", re.M)


def _warnings(stderr: str) -> list[tuple[str, str]]:
    return WARNING.findall(stderr)


def test_run_warns_once_about_the_missing_part(half_calibrated):
    plan, home = half_calibrated
    pu = _one_pu()
    done = _cli("run", str(plan.root), "--batch", "2", "--requests", "30", "--groups", pu, home=home)
    assert done.returncode == 0, done.stderr
    found = _warnings(done.stderr)
    assert found == [("part 1 on cpu1", f"staronnx calibrate {plan.root} --groups {pu}")], done.stderr
    assert "samples/s" in done.stdout  # and it still ran


def test_no_warning_when_every_part_is_calibrated(calibrated_inception):
    plan, home = calibrated_inception
    done = _cli("simulate", str(plan.root), "--rate", "50", "--batch", "2", "--groups", _one_pu(),
                "--duration", "1", home=home)
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr


def test_uncalibrated_policies_do_not_warn(half_calibrated):
    """eager never asks for a prediction: nothing to warn about."""
    plan, home = half_calibrated
    done = _cli("run", str(plan.root), "--requests", "5", "--groups", _one_pu(), "--policy", "eager", home=home)
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr


def test_sweep_warns_and_prints_its_notes(half_calibrated, tmp_path):
    plan, home = half_calibrated
    pu = _one_pu()
    out = tmp_path / "res"
    done = _cli("sweep", str(plan.root), "--rates", "50", "--batch-sizes", "1", "--groups", pu, "--duration", "300ms",
                "--no-extend", "--no-plots", "-o", str(out), home=home)
    assert done.returncode == 0, done.stderr
    assert _warnings(done.stderr) == [("part 1 on cpu1", f"staronnx calibrate {plan.root} --groups {pu}")]
    # what results.json notes (why the bound column shows "-") is printed too
    import json

    notes = json.loads((out / "results.json").read_text())["notes"]
    assert notes
    for note in notes:
        assert f"note: {note}" in done.stdout


def test_simulate_and_optimize_warn_about_cuda_workers_without_models(calibrated_inception):
    """A CUDA stream with no cuda0 models (and no --cuda-scale what-if): the warning names both
    parts on cuda0 and the calibrate command that would fill them."""
    plan, home = calibrated_inception
    pu = _one_pu()
    done = _cli("simulate", str(plan.root), "--rate", "50", "--batch", "2", "--groups", pu, "--cuda-streams", "1",
                "--duration", "1", home=home)
    found = _warnings(done.stderr)
    assert found == [("parts 0, 1 on cuda0", f"staronnx calibrate {plan.root} --groups {pu} --cuda-streams 1")], \
        done.stderr + done.stdout
    assert "Traceback" not in done.stderr
    done = _cli("optimize-batch", str(plan.root), "--rate", "50", "--batch-sizes", "1,2", "--groups", pu,
                "--cuda-streams", "1", "--no-verify", "--sim-duration", "1s", home=home)
    assert _warnings(done.stderr) == found, done.stderr + done.stdout
    assert "Traceback" not in done.stderr
    # a what-if GPU (--cuda-scale) borrows the CPU's models on purpose: no warning
    done = _cli("simulate", str(plan.root), "--rate", "50", "--batch", "2", "--groups", pu, "--cuda-streams", "1",
                "--cuda-scale", "0.5", "--duration", "1", home=home)
    assert done.returncode == 0, done.stderr
    assert not _warnings(done.stderr)


def test_simulate_refuses_cuda_scale_without_cuda_workers(calibrated_inception):
    """--cuda-scale times the simulated CUDA workers: without --cuda-streams there are none, and the
    simulation ran on the CPU groups alone as if the what-if GPU had been asked for and found wanting."""
    plan, home = calibrated_inception
    done = _cli("simulate", str(plan.root), "--rate", "50", "--batch", "2", "--groups", _one_pu(),
                "--cuda-scale", "0.5", "--duration", "1", home=home)
    assert done.returncode == 2, done.stdout
    assert done.stderr.strip().splitlines()[-1] == ("staronnx: error: --cuda-scale sets the time of the simulated "
                                                    "CUDA workers: it needs --cuda-streams N"), done.stderr


# -- help ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [[], ["sweep"], ["run"], ["plan", "show"], ["perfmodel", "show"], ["demo"]])
def test_help_shows_no_bool_metavar(command, tmp_path):
    done = _cli(*command, "--help", home=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--help" in done.stdout
    assert "<bool>" not in done.stdout, done.stdout
    if command == ["sweep"]:
        # flags keep their two forms; options with values keep their type
        assert re.search(r"--plots\s+--no-plots", done.stdout)
        assert re.search(r"--rates\s+<str>", done.stdout)


# -- public API ----------------------------------------------------------------------------------
def test_server_is_public():
    from staronnx.serving import Server

    assert staronnx.Server is Server
    assert "Server" in staronnx.__all__
