"""Signals against real ``python -m staronnx`` processes (issue 12, defect 7).

SIGKILL or SIGTERM in the middle of ``partition`` used to leave a hidden ``.NAME.tmp-XXXX/``
staging folder beside the plan for good; SIGTERM killed the CLI without cleaning up; an
interrupted ``sweep`` did not say what it kept. These tests send the real signals at the
moments that matter (the staging folder is being filled; a sweep has measured a point) and
then look at the disk and at the next run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

from staronnx import partition
from staronnx.bench.results import load_results
from staronnx import fsutil
from staronnx.zoo import chain, inception
from staronnx.partition import PartitionSpec

CLI = [sys.executable, "-m", "staronnx"]
#: one explicit PU this process may run on, so the runtime's group exists on any host
PU = str(min(os.sched_getaffinity(0)))


def _env(home: Path) -> dict[str, str]:
    return {**os.environ, "STARONNX_HOME": str(home)}


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    """A chain whose 40 MB of weights take long enough to export that a signal lands mid-way."""
    path = tmp_path_factory.mktemp("big") / "big.onnx"
    onnx.save(chain(depth=40, width=512), str(path))
    return path


def _staging(parent: Path, name: str, exclude: set[str] = frozenset()) -> list[Path]:
    return [p for p in parent.glob(f".{name}.tmp-*") if p.name not in exclude]


def _partition_and_signal(model: Path, out: Path, sig: int, home: Path) -> tuple[subprocess.Popen, list[Path]]:
    """Start ``partition`` and send ``sig`` once its staging folder holds a first file."""
    before = {p.name for p in _staging(out.parent, out.name)}
    proc = subprocess.Popen(
        [*CLI, "partition", str(model), "-o", str(out), "--parts", "4", "--method", "linear",
         "--costs", "estimate"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(home), text=True,
    )
    deadline = time.monotonic() + 120
    sent = False
    while proc.poll() is None and time.monotonic() < deadline:
        new = _staging(out.parent, out.name, before)
        if new and any(f.name.startswith("part") for f in new[0].iterdir()):
            proc.send_signal(sig)
            sent = True
            break
        time.sleep(0.001)
    proc.wait(timeout=60)
    assert sent, f"partition ended before its staging folder filled: {proc.stderr.read()}"
    return proc, _staging(out.parent, out.name, before)


def test_sigkill_during_partition_leaves_staging_that_the_next_run_removes(big_model, tmp_path):
    out = tmp_path / "plan"
    proc, left = _partition_and_signal(big_model, out, signal.SIGKILL, tmp_path / "home")
    assert proc.returncode == -signal.SIGKILL
    assert len(left) == 1 and left[0].is_dir(), "a killed run leaves its staging folder (nothing can stop SIGKILL)"
    assert str(proc.pid) in left[0].name, "the staging folder names its owner"
    assert not out.exists()

    done = subprocess.run(
        [*CLI, "partition", str(big_model), "-o", str(out), "--parts", "2", "--method", "linear",
         "--costs", "estimate"],
        capture_output=True, text=True, env=_env(tmp_path / "home"), timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert not left[0].exists(), "the next run removes the dead run's staging folder"
    assert _staging(tmp_path, "plan") == []
    assert (out / "plan.json").is_file()


def test_sigterm_during_partition_exits_143_and_removes_its_staging(big_model, tmp_path):
    out = tmp_path / "plan"
    proc, left = _partition_and_signal(big_model, out, signal.SIGTERM, tmp_path / "home")
    err = proc.stderr.read()
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "staronnx: interrupted (SIGTERM)"
    assert left == [] and _staging(tmp_path, "plan") == []
    assert not out.exists()


def test_sigint_during_partition_exits_130_and_removes_its_staging(big_model, tmp_path):
    out = tmp_path / "plan"
    proc, left = _partition_and_signal(big_model, out, signal.SIGINT, tmp_path / "home")
    err = proc.stderr.read()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "staronnx: interrupted (SIGINT)"
    assert left == []


def test_a_live_runs_staging_is_never_removed(tmp_path):
    """Only temporaries whose owner is gone are stale: a concurrent run's stays."""
    model = tmp_path / "m.onnx"
    onnx.save(chain(depth=4, width=8), str(model))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        live = tmp_path / f".plan.tmp-{sleeper.pid}-abc123"
        live.mkdir()
        (live / fsutil.STAGING_MARKER).touch()
        (live / "part0.onnx").write_bytes(b"half")
        dead = tmp_path / f".plan.tmp-{_dead_pid()}-def456"
        dead.mkdir()
        (dead / fsutil.STAGING_MARKER).touch()
        other = tmp_path / f".other.tmp-{_dead_pid()}-ghi789"  # a dead run towards another plan
        other.mkdir()
        (other / fsutil.STAGING_MARKER).touch()
        unrelated = tmp_path / f".notes.tmp-{_dead_pid()}-xyz"  # not ours: no marker, not empty
        unrelated.mkdir()
        (unrelated / "keep.txt").write_text("mine")
        partition(model, spec=PartitionSpec(parts=2, method="linear", costs="estimate"), output_dir=tmp_path / "plan")
        assert live.is_dir() and (live / "part0.onnx").read_bytes() == b"half"
        assert not dead.exists() and not other.exists()
        assert (unrelated / "keep.txt").read_text() == "mine"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_atomic_writes_remove_a_dead_writers_temporary_but_not_a_live_ones(tmp_path):
    target = tmp_path / "results.csv"
    dead = tmp_path / f".results.csv.tmp-{_dead_pid()}-q1w2e3.tmp"
    dead.write_text("half a row")
    live = tmp_path / f".results.csv.tmp-{os.getppid()}-r4t5y6.tmp"
    live.write_text("being written")
    fsutil.atomic_write_text(target, "a,b\n")
    assert target.read_text() == "a,b\n"
    assert not dead.exists()
    assert live.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(f".results.csv.tmp-{os.getpid()}")] == []
    assert fsutil.remove_stale_temporaries(target) == []


def test_a_backup_left_by_a_killed_publish_is_restored(tmp_path):
    """publish_dir renames the old plan to ``.NAME.old-<pid>`` before moving the new one in: a
    kill between the two renames must not lose the old plan."""
    backup = tmp_path / f".plan.old-{_dead_pid()}"
    backup.mkdir()
    (backup / "plan.json").write_text("{}")
    fsutil.remove_stale_temporaries(tmp_path / "plan")
    assert (tmp_path / "plan" / "plan.json").read_text() == "{}"
    assert not backup.exists()


# ---------------------------------------------------------------------------- sweep / run
@pytest.fixture(scope="module")
def small_plan(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("small")
    onnx.save(inception(blocks=2, channels=8, size=16), str(root / "inception.onnx"))
    partition(root / "inception.onnx", [0.7, 0.3], PartitionSpec(costs="estimate"), output_dir=root / "plan")
    return root / "plan"


def _rows_in(csv: Path) -> int:
    try:
        return max(len(csv.read_text().splitlines()) - 1, 0)
    except FileNotFoundError:
        return 0


@pytest.mark.parametrize("sig,code,name", [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")])
def test_interrupted_sweep_keeps_the_points_it_measured_and_says_so(small_plan, tmp_path, sig, code, name):
    out = tmp_path / "res"
    proc = subprocess.Popen(
        [*CLI, "sweep", str(small_plan), "--rates", "40,60,80,100,120", "--batch-sizes", "1",
         "--duration", "1s", "--groups", PU, "-o", str(out), "--no-plots"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(tmp_path / "home"), text=True,
    )
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline and _rows_in(out / "results.csv") < 1:
        time.sleep(0.02)
    assert proc.poll() is None, f"the sweep ended before it could be interrupted: {proc.stderr.read()}"
    time.sleep(0.3)  # into the next point
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == f"staronnx: interrupted ({name})"
    kept = _rows_in(out / "results.csv")
    assert 1 <= kept < 5
    doc = load_results(out)
    assert len(doc["rows"]) == kept
    assert doc["settings"]["interrupted"] == {"signal": name, "points_measured": kept, "points_planned": 5}
    assert f"sweep interrupted: kept {kept} of 5 point(s)" in stdout + stderr
    assert list(out.glob(".*.tmp*")) == []


def test_sigterm_during_run_exits_143_without_a_traceback(small_plan, tmp_path):
    proc = subprocess.Popen(
        [*CLI, "run", str(small_plan), "--requests", "1000000", "--groups", PU],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(tmp_path / "home"), text=True,
    )
    # its first line (this fresh home has no calibrated model) comes once the command runs, past
    # its imports (a fixed sleep was too short on a busy host: SIGTERM then killed the imports),
    # with its signal handlers in place; a moment later it is serving
    first = proc.stderr.readline()
    assert "no calibrated model" in first, first + proc.stderr.read()
    time.sleep(1)
    assert proc.poll() is None, first + proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    stderr = first + stderr
    assert proc.returncode == 143, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "staronnx: interrupted (SIGTERM)"
