"""What a new user still hits (issue 22), through the doors they use: the real CLI in a
subprocess (``python -m staronnx``), or in process where a failure has to be provoked late.

- an output that cannot be written is one ``staronnx: error:`` line before the work starts
  (and, where it fails late, after the results);
- the suite runs under a private ``STARONNX_HOME`` and ``TMPDIR`` (tests/conftest.py);
- ``sweep-plot`` colours, ``cpu_share.png`` axes; sweep lines whole under a progress bar;
- ``--rates auto``; the README's curl example; Ctrl-C during ``calibrate``;
- ``staronnx --version``; ``staronnx demo`` leaves no temporary folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import onnx
import pytest

from _helpers import cli, read_pty
from staronnx import partition
from staronnx.zoo import inception
from staronnx.partition import PartitionSpec
from staronnx.workers.layout import MachineSpec

CLI = [sys.executable, "-m", "staronnx"]
PU = str(min(os.sched_getaffinity(0)))


def _run(args: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """The CLI in a subprocess, with the suite's environment (its private STARONNX_HOME)."""
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=timeout)


def _error_line(res: subprocess.CompletedProcess | tuple) -> str:
    """The one line a user-facing error prints (and that it is the only thing on stderr)."""
    err = res.stderr if hasattr(res, "stderr") else res[2]
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("staronnx: error: "), err
    return lines[0]


# ---------------------------------------------------------------------------- 1: unwritable outputs
@pytest.fixture
def blocked(tmp_path) -> Path:
    """A folder name nothing can be written under, even by root: its 'parent' is a file."""
    (tmp_path / "ro").write_text("a regular file, not a folder\n")
    return tmp_path / "ro"


def _commands(model: Path, plan: Path, blocked: Path, tmp: Path) -> dict[str, list[str]]:
    trace = tmp / "trace.json"
    trace.write_text('{"traceEvents": []}')
    return {
        "partition": ["partition", model, "--parts", "2", "-o", blocked / "plan"],
        "sweep": ["sweep", plan, "--rates", "10", "--batch-sizes", "1", "--duration", "1s",
                  "--groups", PU, "-o", blocked / "sweep"],
        "perfmodel show": ["perfmodel", "show", plan, "--plot", blocked / "perf.png"],
        "trace plot": ["trace", "plot", trace, "-o", blocked / "g.png"],
        "demo": ["demo", "--workdir", blocked / "demo", "--batches", "2"],
        "run": ["run", plan, "--requests", "3", "--groups", PU, "--trace", blocked / "trace.json"],
    }


@pytest.mark.parametrize("command", ["partition", "sweep", "perfmodel show", "trace plot", "demo", "run"])
def test_an_output_under_a_file_is_one_error_line_naming_it(small, blocked, tmp_path, command):
    model, plan = small
    args = _commands(model, plan, blocked, tmp_path)[command]
    res = _run(args)
    line = _error_line(res)
    assert res.returncode == 2
    assert str(blocked) in line and "not a folder" in line, line
    assert not list(tmp_path.glob("**/.*.tmp*")), "no temporary is left behind"
    # before the work: nothing was measured, nothing printed but the error
    assert "samples/s" not in res.stdout and "wrote plan" not in res.stdout


def test_an_immutable_output_folder_is_refused_before_profiling(small, tmp_path):
    model, _ = small
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode != 0 if shutil.which("chattr") else True:
        pytest.skip("chattr +i is not available here (needs root and a file system that has it)")
    try:
        res = _run(["partition", model, "--parts", "2", "-o", ro / "plan"])
    finally:
        subprocess.run(["chattr", "-i", str(ro)], check=True)
    line = _error_line(res)
    assert res.returncode == 2 and f"{ro / 'plan'}" in line and "--output" in line, line
    assert "Operation not permitted" in line or "Permission denied" in line, line


def test_a_trace_that_fails_at_close_still_prints_the_results(small, tmp_path, capsys, monkeypatch):
    """The trace is written when the runtime closes: a folder that went away meanwhile (the
    early check passed) costs the trace only; the results are printed, then one error line."""
    import staronnx.cli.run_cmds as run_cmds

    _, plan = small
    (tmp_path / "gone").write_text("the trace's folder was replaced by a file")
    monkeypatch.setattr(run_cmds, "check_writable", lambda *a, **k: None)  # it passed, earlier
    code, out, err = cli(capsys, "run", plan, "--requests", "3", "--groups", PU, "--policy", "eager", "--trace",
                         tmp_path / "gone" / "trace.json")
    assert code == 2
    assert "3 requests x batch 1" in out and "samples/s" in out and "placement" in out
    line = _error_line(("", out, err))
    assert f"--trace {tmp_path / 'gone' / 'trace.json'}" in line, line
    assert not list(tmp_path.glob(".*.tmp*"))


# ---------------------------------------------------------------------------- 4: private home
def test_the_suite_runs_under_a_private_home_and_temporary_folder(small, tmp_path):
    from conftest import REAL_HOME, home_changes, snapshot

    from staronnx.perfmodels.store import default_root

    home = Path(os.environ["STARONNX_HOME"])
    assert home.resolve() != REAL_HOME.resolve() and default_root() == home
    assert tempfile.gettempdir() == os.environ["TMPDIR"] and Path(os.environ["TMPDIR"]) != Path("/tmp")
    _, plan = small
    before = snapshot(REAL_HOME)
    # a subprocess that writes perf models, with the environment every test's subprocess gets
    res = _run(["calibrate", plan, "--batch-sizes", "1", "--groups", PU, "--max-runs", "12", "--no-bus"])
    assert res.returncode == 0, res.stderr
    assert list((home / "perfmodels").rglob("*")), "the models went to the private home"
    assert home_changes(before, snapshot(REAL_HOME)) == []


def test_the_isolation_checks_see_a_changed_home_and_a_leaked_temporary(tmp_path):
    from conftest import home_changes, leaked_temporaries, snapshot

    home = tmp_path / "home"
    (home / "perfmodels").mkdir(parents=True)
    (home / "perfmodels" / "a.json").write_text("{}")
    (home / "old.json").write_text("{}")
    before = snapshot(home)
    assert home_changes(before, snapshot(home)) == []
    (home / "perfmodels" / "a.json").write_text('{"more": 1}')
    (home / "perfmodels" / "b.json").write_text("{}")
    (home / "old.json").unlink()
    assert home_changes(before, snapshot(home)) == ["+ perfmodels/b.json", "- old.json", "~ perfmodels/a.json"]
    tmp = tmp_path / "tmp"
    (tmp / "staronnx-demo-abc").mkdir(parents=True)
    (tmp / "pytest-of-someone").mkdir()
    assert leaked_temporaries(tmp) == ["staronnx-demo-abc"]


# ---------------------------------------------------------------------------- 10: version, demo
def test_version():
    res = _run(["--version"])
    import staronnx

    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"staronnx {staronnx.__version__} (onnxruntime ")


def test_demo_without_workdir_removes_its_temporary_folder_and_says_so(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    res = _run(["demo", "--batches", "2", "--batch", "2", "--groups", PU], TMPDIR=str(tmp), COLUMNS="200")
    assert res.returncode == 0, res.stderr
    assert list(tmp.glob("staronnx-*")) == [], "the demo's model and plans are gone"
    assert "removed the demo's temporary folder" in res.stdout and "--workdir" in res.stdout


@pytest.mark.parametrize("flag", ["--batch", "--batches"])
def test_demo_refuses_a_count_below_one_before_its_work(tmp_path, flag):
    """--batch 0 or --batches 0: one line naming the flag, before the model is built, where the demo
    partitioned, verified and calibrated, then ended in a ZeroDivisionError traceback."""
    res = _run(["demo", flag, "0", "--groups", PU, "--workdir", tmp_path / "d"])
    assert res.returncode == 2, res.stdout
    assert _error_line(res) == f"staronnx: error: {flag} must be at least 1, got 0"
    assert not (tmp_path / "d" / "plan").exists()


def test_demo_with_workdir_keeps_it(tmp_path):
    res = _run(["demo", "--batches", "2", "--batch", "2", "--groups", PU, "--workdir", tmp_path / "d"])
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "d" / "plan" / "plan.json").is_file()
    assert "removed" not in res.stdout


# ---------------------------------------------------------------------------- 9: Ctrl-C in calibrate
@pytest.fixture(scope="module")
def slow_plan(tmp_path_factory) -> Path:
    """A plan whose calibration takes seconds at the batch sizes below (a signal lands mid-way)."""
    root = tmp_path_factory.mktemp("slow")
    onnx.save(inception(blocks=4, channels=16, size=32), str(root / "m.onnx"))
    partition(root / "m.onnx", [0.7, 0.3], PartitionSpec(costs="estimate"), output_dir=root / "plan")
    return root / "plan"


def test_ctrl_c_during_calibrate_keeps_the_samples_and_says_how_many(slow_plan, tmp_path):
    """SIGINT as soon as the first step is shown (stdout on a terminal, where the steps are)."""
    import pty
    import re
    import signal

    from staronnx.perfmodels import PerfModelStore
    from staronnx.plan import Plan

    home = tmp_path / "home"
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [*CLI, "calibrate", str(slow_plan), "--batch-sizes", "1,2,4,8,16,32,64", "--groups", PU,
         "--max-runs", "400", "--no-bus"],
        stdout=slave, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "STARONNX_HOME": str(home), "COLUMNS": "300"})
    os.close(slave)
    sent = False

    def interrupt_after_the_first_step(raw: bytes) -> None:
        nonlocal sent
        if not sent and re.search(rb"part \d+ batch \d+: \d+ runs", raw):
            assert proc.poll() is None, "calibration ended before it could be interrupted"
            proc.send_signal(signal.SIGINT)
            sent = True

    raw = read_pty(master, proc, on_output=interrupt_after_the_first_step)
    err = proc.stderr.read()
    proc.wait(timeout=120)
    os.close(master)
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.decode(errors="replace"))
    assert sent, out
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "staronnx: interrupted (SIGINT)"
    m = re.search(r"calibration interrupted: kept (\d+) sample\(s\) measured in (\d+) of (\d+) step", out)
    assert m, out
    kept, done, steps = map(int, m.groups())
    assert kept >= 1 and 1 <= done < steps == 2 * 7
    rows = PerfModelStore(home).rows(Plan.load(slow_plan).hash)
    stored = sum(r.n + r.nerror for r in rows)
    assert 1 <= stored <= kept, (stored, kept)
    assert any(r.calibrated for r in rows), "the finished step's model is stored calibrated"


# ---------------------------------------------------------------------------- 5: plot colours, axes
def _point(b: int, rate: float, latency: float | None, *, congested: bool = False, share: float | None = 1.0) -> dict:
    return {"batch_size": b, "offered_rate": rate, "throughput": rate * (0.5 if congested else 1.0),
            "paper_latency_mean_ms": latency, "paper_latency_std_ms": None if latency is None else latency / 10,
            "cpu_share": share, "congested": congested, "stable": not congested, "policy": "heft",
            "groups": "0", "cuda_streams": 0}


def _written(tmp_path: Path, name: str, rows: list[dict]) -> Path:
    from staronnx.bench.results import write_results

    write_results(tmp_path / name, rows, settings={"label": name})
    return tmp_path / name


def test_sweep_plot_compare_gives_each_sweep_its_own_colour_when_the_first_has_no_steady_point(tmp_path, monkeypatch):
    """The first sweep congested everywhere (no best latency to draw on the left): its
    throughput on the right used to take the default colour, the second sweep's too."""
    from staronnx.bench import plots

    a = _written(tmp_path, "congested", [_point(1, 50, 80.0, congested=True), _point(2, 50, 90.0, congested=True)])
    b = _written(tmp_path, "steady", [_point(1, 50, 5.0), _point(1, 100, 6.0)])
    figures = []
    real = plots.figure_compare
    monkeypatch.setattr(plots, "figure_compare", lambda *a, **k: figures.append(real(*a, **k)) or figures[-1])
    from typer.testing import CliRunner

    from staronnx.cli import app

    res = CliRunner().invoke(app, ["sweep-plot", str(a), "--compare", str(b), "-o", str(tmp_path / "c.png")])
    assert res.exit_code == 0, res.output
    (fig, series), = figures
    assert series == ["congested", "steady"]
    right = {ln.get_label(): ln.get_color() for ln in fig.axes[1].lines if ln.get_label() != "offered"}
    left = {ln.get_label(): ln.get_color() for ln in fig.axes[0].lines}
    assert right["congested"] != right["steady"], right
    assert left["steady"] == right["steady"]


def test_a_batch_size_has_one_colour_in_every_figure_and_cpu_share_starts_at_zero():
    """b=1 has no latency (left out of latency_throughput) but a CPU share: b=2 and b=4 used to
    shift colours between the two figures. One rate per batch size (the rest congested, as
    on a small machine) used to give cpu_share an x axis of 48-52."""
    from matplotlib.colors import to_hex

    from staronnx.bench.plots import figure_cpu_share, figure_latency_throughput

    rows = [_point(1, 50, None), _point(2, 50, 12.0), _point(4, 50, 20.0)]
    lat, _ = figure_latency_throughput(rows)
    share, _ = figure_cpu_share(rows)

    # latency_throughput draws error bars (containers whose first artist is the line)
    lat_c = {c.get_label(): to_hex(c[0].get_color()) for c in lat.axes[0].containers}
    share_c = {ln.get_label(): to_hex(ln.get_color()) for ln in share.axes[0].lines}
    assert set(lat_c) == {"b = 2", "b = 4"} and set(share_c) == {"b = 1", "b = 2", "b = 4"}
    assert all(lat_c[k] == share_c[k] for k in lat_c), (lat_c, share_c)
    low, high = share.axes[0].get_xlim()
    assert low == 0 and 50 < high <= 60
    assert any("no CUDA worker" in t.get_text() for t in share.axes[0].texts)


# ---------------------------------------------------------------------------- 6: lines under a bar
def _screen(data: str, width: int) -> list[str]:
    """What a terminal ``width`` columns wide shows after ``data``: the control sequences rich's
    live display uses (carriage return, newline, cursor up, erase line, autowrap), colours
    dropped. Lines scrolled off the top stay (a terminal's scrollback)."""
    import re

    lines: list[list[str]] = [[]]
    row = col = 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|.|\n", data, re.S):
        if token.startswith("\x1b"):
            code, arg = token[-1], token[2:-1]
            if code == "A":
                row = max(row - int(arg or 1), 0)
            elif code == "K":
                lines[row] = lines[row][:col] if arg in ("", "0") else []
                if arg == "2":
                    lines[row] = [" "] * col
            continue
        if token == "\r":
            col = 0
        elif token == "\n":
            row += 1
            col = 0
        else:
            if col >= width:  # autowrap
                row += 1
                col = 0
            while len(lines) <= row:
                lines.append([])
            line = lines[row]
            line.extend(" " * (col - len(line) + 1)) if len(line) <= col else None
            line[col] = token
            col += 1
        while len(lines) <= row:
            lines.append([])
    return ["".join(ln).rstrip() for ln in lines]


def test_screen_emulation_erases_and_wraps():
    assert _screen("abc\r\ndef\r\x1b[2K\x1b[1A\x1b[2Kxy\n", 10) == ["xy", ""]
    assert _screen("0123456789ab", 10) == ["0123456789", "ab"]


def test_sweep_point_lines_stay_whole_under_the_progress_bar_on_a_150_column_terminal(small, tmp_path):
    """stdout and stderr on one 150-column terminal (as in a shell): each point's line used to
    be printed after the live bar's last line and half erased by its next redraw."""
    import pty
    import re

    _, plan = small
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [*CLI, "sweep", str(plan), "--rates", "10,20,30", "--batch-sizes", "1", "--duration", "1s",
         "--groups", PU, "--policy", "eager", "--no-extend", "-o", str(tmp_path / "res"), "--no-plots"],
        stdin=slave, stdout=slave, stderr=slave, env={**os.environ, "COLUMNS": "150", "TERM": "xterm"})
    os.close(slave)
    raw = read_pty(master, proc).decode(errors="replace")
    proc.wait(timeout=300)
    os.close(master)
    assert proc.returncode == 0, raw[-2000:]
    assert "\x1b[1A" in raw, "the progress display was live (else this test shows nothing)"
    screen = _screen(raw, 150)
    point = re.compile(r"^b=1 @ (\d+) req/s: [0-9.]+ samples/s, papers' latency [0-9.]+ ms \(std [0-9.-]+\), "
                       r"p99 [0-9.]+ ms, (stable|unstable|congested)$")
    whole = [m.group(1) for m in map(point.match, screen) if m]
    assert whole == ["10", "20", "30"], "\n".join(screen)
    assert not any("sweep points" in line for line in screen), "the bar is gone at the end (transient)"


# ---------------------------------------------------------------------------- 8: README curl
def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _logical_lines(lines: list[str]) -> list[str]:
    out, current = [], ""
    for line in lines:
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        out.append(current.strip())
        current = ""
    return [ln for ln in out if ln and not ln.startswith("#")]


def test_the_serve_guides_curl_examples_call_the_server_its_serve_command_starts(tmp_path):
    """The serve guide's serve block and its curl block, run as written (ports made free ones):
    every curl must get a 2xx (the README's example used to post to a model nobody served; the
    curl calls now live in the guide, the README shows Triton's client)."""
    import re
    import signal
    import time

    import test_readme as readme

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    pytest.importorskip("aiohttp", reason="needs the serve extra (pip install 'staronnx[serve]')")
    guide = readme.ROOT / "docs" / "guides" / "serve.md"
    blocks = readme.read_blocks(guide.read_text())
    serve = next(b for b in blocks if any(re.match(r"\s*staronnx serve plan/", ln) for ln in b.lines))
    calls = next(b for b in blocks[blocks.index(serve) + 1:] if any(ln.startswith("curl ") for ln in b.lines))
    serve_line = next(ln for ln in _logical_lines(serve.lines) if ln.startswith("staronnx serve"))
    curls = [ln for ln in _logical_lines(calls.lines) if ln.startswith("curl ")]
    assert curls and any("/infer" in c for c in curls)
    # the plans the serve command names, written by the README's own partition lines
    for name, build in readme.MODELS.items():
        onnx.save(build(), str(tmp_path / name))
    folders = re.findall(r"\s(plan[\w-]*/)", serve_line)
    for folder in folders:
        line = next(ln for b in blocks for ln in _logical_lines(b.lines)
                    if ln.startswith("staronnx partition") and f"-o {folder}" in ln)
        done = subprocess.run(readme.ci_line(line) + " --costs estimate -q", shell=True, cwd=tmp_path,
                              capture_output=True, text=True, env=readme.readme_env(tmp_path), timeout=300)
        assert done.returncode == 0, done.stderr
    ports = dict(zip(("8000", "8001", "8002"), map(str, _free_ports(3)), strict=True))

    def free(text: str) -> str:
        return re.sub(r"\b(8000|8001|8002)\b", lambda m: ports[m.group(1)], text)

    env = readme.readme_env(tmp_path)
    proc = subprocess.Popen(free(serve_line).split("#")[0] + f" --groups {PU}", shell=True, cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen.append(line)
            if not line or line.startswith("ready"):
                break
        assert seen[-1].startswith("ready"), "".join(seen)
        for curl in curls:
            command = free(curl).replace("curl ", "curl -sS --fail-with-body ", 1)
            done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"README: {curl}\n{done.stdout}{done.stderr}"
            if "/infer" in curl:
                assert '"outputs"' in done.stdout, done.stdout
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


# ---------------------------------------------------------------------------- 7: --rates auto
def test_rates_for_spans_the_capacity_with_a_round_step():
    from staronnx.bench.sweep import rates_for

    assert rates_for(501) == [50 * i for i in range(1, 12)]
    for capacity in (0.7, 3, 37, 501, 12_000, 250_000):
        rates = rates_for(capacity)
        assert 6 <= len(rates) <= 16 and rates == sorted(set(rates))
        assert rates[0] <= 0.2 * capacity and capacity <= rates[-1] <= 1.3 * capacity


def _sweep_rates(out: Path) -> list[float]:
    from staronnx.bench.results import load_results

    return sorted({float(r["offered_rate"]) for r in load_results(out)["rows"]})


def test_sweep_rates_default_to_auto_from_the_lp_bound(calibrated_inception, two_groups, tmp_path):
    """No --rates: the range comes from the LP bound over the calibrated perf models, so it
    starts well below what the machine serves (the README's 50:800:50 congested at 50 on a
    small machine: one hollow point per batch size)."""
    from staronnx.bench.bound import machine_bound
    from staronnx.bench.machine import build_machine
    from staronnx.bench.sweep import rates_for
    from staronnx.perfmodels import PerfModelStore

    plan, home = calibrated_inception
    out = tmp_path / "res"
    res = _run(["sweep", plan.root, "--batch-sizes", "1,2", "--groups", two_groups, "--duration", "300ms",
                "-o", out, "--no-plots"], STARONNX_HOME=str(home), COLUMNS="250")
    assert res.returncode == 0, res.stderr
    machine = build_machine(plan, MachineSpec(groups=two_groups), store=PerfModelStore(home), cpu_fallback=False)
    capacity = max(machine_bound(machine, b).throughput for b in (1, 2))
    expected = rates_for(capacity)
    assert "rates auto:" in res.stdout and "LP bound" in res.stdout, res.stdout
    measured = _sweep_rates(out)
    assert measured[0] == expected[0] and set(measured) <= set(expected), (measured, expected)


def test_sweep_rates_auto_probes_the_runtime_when_nothing_is_calibrated(small, tmp_path):
    _, plan = small
    out = tmp_path / "res"
    res = _run(["sweep", plan, "--rates", "auto", "--batch-sizes", "2", "--groups", PU, "--policy", "eager",
                "--duration", "300ms", "-o", out, "--no-plots"], STARONNX_HOME=str(tmp_path / "empty-home"),
               COLUMNS="250")
    assert res.returncode == 0, res.stderr
    assert "closed-loop probe" in res.stdout, res.stdout
    measured = _sweep_rates(out)
    assert measured and measured[0] > 0
