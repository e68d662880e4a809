"""The perf-model store under stress (issue 12, defects 4, 5 and 6).

* 4: two calibrations of one plan at once, in two real processes, must add up their samples:
  StarPU's reset rule (errors >= samples empties an entry) is for one run's drifting
  measurements, never for another process's.
* 5: a read-only ``STARONNX_HOME`` (a read-only bind mount when running as root, where chmod
  does not stop writes; chmod otherwise): serving reads the models and learns in memory with
  one warning, ``calibrate`` says in one line that it cannot write.
* 6: ``perfmodel show`` (a reader) leaves a corrupt model file where it is, with a warning.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from staronnx.perfmodels import (
    Footprint,
    HistoryModel,
    PerfModelCorruptWarning,
    PerfModelStore,
    PerfModelStoreReadOnly,
)

FP = Footprint(1, 0)
PLAN = "p0123456789abcdef"


def staronnx(*args: object, home: Path, prefix: list[str] | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [*(prefix or []), sys.executable, "-m", "staronnx", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "STARONNX_HOME": str(home)})


# -- 6: readers warn, writers set aside ------------------------------------------------------


def test_perfmodel_show_leaves_a_corrupt_file_in_place(calibrated_inception, tmp_path):
    plan, home = calibrated_inception
    copy = tmp_path / "home"
    shutil.copytree(home, copy)
    store = PerfModelStore(copy)
    path = store.path(store.list(plan.hash)[0])
    path.write_text('{"format": "staronnx-perfmodel", "vers')  # truncated
    before = sorted(p.name for p in path.parent.iterdir())
    res = staronnx("perfmodel", "show", plan.root, home=copy)
    assert res.returncode == 0, res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if path.name in ln]  # one line, as a user reads it
    assert line.startswith("staronnx: warning: performance model") and "not valid JSON" in line, res.stderr
    assert ".py:" not in res.stderr, res.stderr
    assert sorted(p.name for p in path.parent.iterdir()) == before  # nothing renamed
    # a writer sets it aside before writing a fresh model
    key = next(k for k in store.list(plan.hash) if store.path(k) == path)
    fresh = HistoryModel(key.part, key.arch)
    fresh.record(FP, 1.0)
    fresh.record(FP, 1.0)
    with pytest.warns(PerfModelCorruptWarning, match="moved aside"):
        store.commit(plan.hash, fresh)
    assert len(list(path.parent.glob(path.name + ".corrupt-*"))) == 1
    assert store.load(plan.hash, key.part, key.arch).entry(FP).n == 1


# -- 4: two processes' samples add up ---------------------------------------------------------


def _calibrate_one(root: str, seconds: float, barrier, results) -> None:  # type: ignore[no-untyped-def]
    """Child: load the (empty) model, measure 11 times, wait for the other, then commit."""
    store = PerfModelStore(root, host="h")
    model = store.load(PLAN, 0, "cpu1")
    barrier.wait()
    for _ in range(11):  # the first is dropped: 10 accepted, calibrated in this run
        model.record(FP, seconds)
    barrier.wait()  # both runs measured before either merges, as in two calibrations at once
    merged = store.commit(PLAN, model)
    results.put((seconds, merged.entry(FP).n))


def test_two_runs_measuring_different_times_keep_all_their_samples(tmp_path):
    """Run A measured 1 ms, run B (a loaded machine) 3 ms: outside each other's +-50 % band.
    Merging B after A used to count B's samples as A's outliers and reset the entry."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    procs = [ctx.Process(target=_calibrate_one, args=(str(tmp_path), s, barrier, results))
             for s in (0.001, 0.003)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    entry = PerfModelStore(tmp_path, host="h").load(PLAN, 0, "cpu1").entry(FP)
    assert entry is not None
    assert entry.n == 20, outcomes  # 10 + 10: nothing thrown away
    assert entry.sum == pytest.approx(10 * 0.001 + 10 * 0.003)


def test_a_run_that_resets_drops_what_it_loaded_but_keeps_what_others_added(tmp_path):
    """The reset still cures a stale model (the machine changed), but only for what that run
    saw: samples another process committed meanwhile stay."""
    store = PerfModelStore(tmp_path, host="h")
    old = HistoryModel(0, "cpu1")
    for _ in range(11):
        old.record(FP, 1.0)
    store.save(PLAN, old)  # a stale calibration: 10 samples of 1 s
    run = store.load(PLAN, 0, "cpu1")
    other = store.load(PLAN, 0, "cpu1")
    for _ in range(4):
        other.record(FP, 1.1)  # within the band of the stale model: accepted
    store.commit(PLAN, other)
    for _ in range(30):
        run.record(FP, 2.0)  # the machine got slower: outliers, a reset, then 2 s samples
    merged = store.commit(PLAN, run)
    entry = merged.entry(FP)
    assert entry is not None
    n_two = run.entry(FP).n - 4  # the run's own 2 s samples (its view holds the other's 4 too)
    assert entry.n == 4 + n_two
    assert entry.sum == pytest.approx(4 * 1.1 + 2.0 * n_two)


def test_two_calibrate_commands_at_once_lose_no_entry(calibrated_inception, tmp_path, two_groups):
    plan, _ = calibrated_inception
    home = tmp_path / "home"
    args = ["calibrate", plan.root, "--groups", two_groups, "--batch-sizes", "1,4", "--no-bus",
            "--max-runs", "200"]
    env = {**os.environ, "STARONNX_HOME": str(home)}
    procs = [subprocess.Popen([sys.executable, "-m", "staronnx", *map(str, args)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    store = PerfModelStore(home)
    keys = store.list(plan.hash)
    assert {(k.part, k.arch) for k in keys} == {(0, "cpu1"), (1, "cpu1")}
    for key in keys:
        for row in store.load(plan.hash, key.part, key.arch).rows():
            assert row.n >= 10, (key, row)  # calibrated: no run's samples were thrown away


# -- 5: a read-only home ----------------------------------------------------------------------


def _read_only(home: Path) -> list[str]:
    """Make ``home`` read-only for a child process; return the command prefix that does it.

    Not root: chmod. Root ignores permissions, so a read-only bind mount in a private mount
    namespace (``unshare -m``), which refuses writes to root too. Skips if neither works.
    """
    if os.geteuid() != 0:
        for p in [home, *home.rglob("*")]:
            mode = p.stat().st_mode
            p.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        return []
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("running as root without unshare: no way to make a folder read-only")
    script = f'mount --bind "{home}" "{home}" && mount -o remount,bind,ro "{home}" && exec "$@"'
    prefix = [unshare, "-m", "sh", "-c", script, "sh"]
    probe = subprocess.run([*prefix, "touch", str(home / "probe")], capture_output=True, text=True)
    if probe.returncode == 0 or (home / "probe").exists():
        (home / "probe").unlink(missing_ok=True)
        pytest.skip("cannot make a read-only mount here (no CAP_SYS_ADMIN)")
    return prefix


@pytest.fixture
def read_only_home(tmp_path) -> tuple[Path, list[str]]:
    home = tmp_path / "rohome"
    (home / "weights").mkdir(parents=True)  # as any earlier run leaves it
    yield home, _read_only(home)
    for p in [home, *home.rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)


def test_calibrate_into_a_read_only_home_is_one_line(calibrated_inception, read_only_home, two_groups):
    plan, _ = calibrated_inception
    home, prefix = read_only_home
    res = staronnx("calibrate", plan.root, "--groups", two_groups, "--batch-sizes", "1",
                   home=home, prefix=prefix)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("staronnx: error: cannot write"), res.stderr
    assert str(home) in lines[0]


def test_run_and_sweep_serve_from_a_read_only_home(calibrated_inception, read_only_home, tmp_path, two_groups):
    """The home holds no model of this plan: the runtime learns (in memory) while it serves."""
    plan, _ = calibrated_inception
    home, prefix = read_only_home
    res = staronnx("run", plan.root, "--groups", two_groups, "--requests", "30", home=home, prefix=prefix)
    assert res.returncode == 0, res.stderr
    assert "samples/s" in res.stdout
    assert "Traceback" not in res.stderr
    assert res.stderr.count("cannot write performance models") == 1, res.stderr
    assert "not shared" not in res.stderr  # the weights cache moved to /tmp quietly
    res = staronnx("sweep", plan.root, "--groups", two_groups, "--batch-sizes", "1", "--rates", "50",
                   "--duration", "1s", "--no-plots", "-o", tmp_path / "results", home=home, prefix=prefix)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    assert (tmp_path / "results" / "results.csv").exists()


def test_store_raises_one_clear_error_when_it_cannot_write(tmp_path):
    """A home under a regular file cannot be written by anyone, root included."""
    (tmp_path / "file").write_text("")
    store = PerfModelStore(tmp_path / "file" / "home", host="h")
    assert len(store.load(PLAN, 0, "cpu1")) == 0  # reading works: nothing there
    with pytest.raises(PerfModelStoreReadOnly, match="cannot write performance models"):
        store.check_writable()
    model = store.load(PLAN, 0, "cpu1")
    model.record(FP, 1.0)
    model.record(FP, 1.0)
    with pytest.raises(PerfModelStoreReadOnly):
        store.commit(PLAN, model)
    assert model.unsaved_count == 2  # kept for a later commit
