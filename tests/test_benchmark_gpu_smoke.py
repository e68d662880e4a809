"""The GPU session's parts that can rot between the sessions that have a GPU, checked here.

``benchmarks/gpu.py`` runs end to end (its CPU smoke mode: same harness, CPU provider, tiny
model) and writes each row as it is measured; ``benchmarks/gpu_session.sh`` runs the table
before anything optional, within its budget; and ``pytest -m gpu`` collects, and skips what it
cannot run, on a host with only the GPU host's packages (no tritonclient, no ray, no pynvml:
a ``sitecustomize`` on ``PYTHONPATH`` makes importing them fail, as it does there).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: what the GPU host lacks (its image: python 3.12, numpy, onnx, torch, onnxruntime-gpu)
ABSENT = ("tritonclient", "ray", "pynvml")

_HIDE = """\
import sys

ABSENT = {absent!r}


class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Absent())
"""

#: a pytest plugin that lifts the module-level "needs a GPU" skipif, so a GPU test's own
#: skips (what the host lacks) are reached here
_GPU_HERE = """\
import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        module = item.getparent(pytest.Module)
        module.own_markers[:] = [m for m in module.own_markers if m.name != "skipif"]
"""


def _gpu_host_env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "gpu-host-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_HIDE.format(absent=ABSENT))
    (site / "gpu_here.py").write_text(_GPU_HERE)
    return {**os.environ, "PYTHONPATH": str(site)}


def test_gpu_benchmark_smoke_on_the_cpu(tmp_path):
    """The table's harness end to end; each row is in the JSON by the time its line is printed
    (a run cut short by its step's limit keeps every row it measured)."""
    out = tmp_path / "gpu.json"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--device", "cpu", "--models", "tiny", "--batches", "1,2",
         "--seconds", "0.2", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "STARONNX_HOME": str(tmp_path / "home")},
    )
    seen_at_print = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.match(r"^\| tiny \| (\d+) \|", line)
        if m:
            seen_at_print[int(m.group(1))] = [r["batch"] for r in json.loads(out.read_text())["rows"]]
    stderr = proc.stderr.read() if proc.stderr else ""
    assert proc.wait(timeout=600) == 0, stderr[-3000:]
    assert seen_at_print == {1: [1], 2: [1, 2]}
    data = json.loads(out.read_text())
    assert [r["batch"] for r in data["rows"]] == [1, 2]
    for row in data["rows"]:
        assert all(row[c] > 0 for c in ("ort1", "ort2", "ort4", "gpu", "gpu+cpu", "split", "auto", "cpu"))
        assert max(row["errors"].values()) < 1e-3
    assert any("max relative error" in text for text, _ in data["checks"])


def test_the_gpu_session_runs_the_table_before_anything_optional_within_its_budget(tmp_path):
    """Every step of ``gpu_session.sh`` (a stand-in python that returns at once): the GPU tests,
    then the table, then the optional measurements, their limits within the session's budget
    and within run.sh's session step (540 s); the tests run over the modules holding GPU tests."""
    calls = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    stub.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexit 0\n')
    stub.chmod(0o755)
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_session.sh")], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env={**os.environ, "OUT": str(out), "PYTHON": str(stub)})
    assert done.returncode == 0, done.stdout + done.stderr
    steps = [re.match(r"^(\S+): exit 0 in \d+ s \(limit (\d+) s\)$", line)
             for line in (out / "summary.txt").read_text().splitlines()[1:-1]]  # after the GPU's line
    assert all(steps), (out / "summary.txt").read_text()
    assert [m.group(1) for m in steps] == ["pytest-gpu", "gpu-table", "gpu-table-8streams", "host-overhead"]
    assert sum(int(m.group(2)) for m in steps) <= 540
    pytest_call = calls.read_text().splitlines()[0]
    assert pytest_call.startswith("-m pytest -m gpu ")
    assert "tests/test_cuda_worker.py" in pytest_call and "tests/test_gpu_entry_points.py" in pytest_call


def test_the_gpu_tests_collect_with_only_the_gpu_hosts_packages(tmp_path):
    """``pytest -m gpu`` over the whole suite where tritonclient, ray and pynvml are absent:
    modules that need them are skipped with the reason, none fails to collect."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-rs", "tests"], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=_gpu_host_env(tmp_path))
    text = done.stdout + done.stderr
    assert done.returncode == 0 and not re.search(r"^ERROR |\b\d+ errors?\b", text, re.M), text[-4000:]
    assert "needs Triton's clients" in text, text[-4000:]
    assert re.search(r"\b[1-9]\d* tests? collected|\d+/\d+ tests collected", text), text[-2000:]


def test_a_gpu_test_that_needs_what_the_host_lacks_skips(tmp_path):
    """``test_serve_exports_tritons_gpu_metrics`` on a host without NVML (nor Triton's clients):
    skipped, saying why, where it used to fail importing the serving tests' helpers."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "gpu_here", "-p", "no:cacheprovider", "-rs", "-q",
                           "tests/test_gpu_entry_points.py::test_serve_exports_tritons_gpu_metrics"],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=_gpu_host_env(tmp_path))
    text = done.stdout + done.stderr
    assert done.returncode == 0 and "1 skipped" in text, text[-4000:]
    assert "nvidia-ml-py" in text, text[-4000:]


def test_a_plain_ort_baseline_that_fell_back_to_the_cpu_is_refused(tmp_path):
    """ORT asked for its CUDA provider where it cannot start one (a library it cannot load;
    here, a CPU-only onnxruntime) runs on the CPU with a log line only: the table's ortN
    baselines refuse such a session, in one line, rather than fill a GPU table with CPU figures."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider: no fallback to provoke")
    code = (
        "import importlib.util, pathlib\n"
        f"spec = importlib.util.spec_from_file_location('gpu_bench', {str(REPO / 'benchmarks' / 'gpu.py')!r})\n"
        "gpu = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(gpu)\n"
        f"path = gpu.tiny_conv(pathlib.Path({str(tmp_path)!r}))\n"
        "assert gpu.ort_sessions(path, 2, 'cpu')[0].get_providers()[0] == 'CPUExecutionProvider'\n"
        "print('ortN on', gpu.ort_sessions(path, 2, 'cuda')[0].get_providers())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 1 and "ortN on" not in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("benchmarks/gpu.py: a plain ONNX Runtime session asked for CUDAExecutionProvider runs on "
                           "['CPUExecutionProvider']"), done.stderr


def test_gpu_benchmark_runs_only_the_setups_named(tmp_path):
    """``--setups`` (how a lent GPU's short call measures more streams): only the staronnx setups
    named are built, calibrated and measured; the baselines run as always; an unknown name is
    refused, naming what there is."""
    out = tmp_path / "gpu.json"
    env = {**os.environ, "STARONNX_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--device", "cpu", "--models", "tiny", "--batches", "1",
           "--seconds", "0.2", "--json", str(out)]
    traces = tmp_path / "traces"
    done = subprocess.run([*cmd, "--setups", "gpu+cpu,split", "--trace", str(traces), "--trace-setups", "gpu+cpu"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert sorted(row["errors"]) == ["gpu+cpu", "split"]
    # --trace: a Perfetto trace of the setup named (its tasks as complete events), and the row
    # says that setup's figure paid for it
    assert [p.name for p in traces.iterdir()] == ["trace-tiny-gpu_cpu-b1.json"]
    events = json.loads((traces / "trace-tiny-gpu_cpu-b1.json").read_text())["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)
    assert row["traced"] == ["gpu+cpu"]
    assert row["gpu+cpu"] > 0 and row["split"] > 0 and row["ort4"] > 0
    assert "gpu" not in row and "auto" not in row
    bad = subprocess.run([*cmd, "--setups", "gpu+cpu,warp"], capture_output=True, text=True, timeout=600, env=env)
    assert bad.returncode != 0
    assert "--setups: unknown warp" in bad.stderr and "gpu+cpu" in bad.stderr


def _gpu_bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench_loop", REPO / "benchmarks" / "gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_closed_loop_replaces_requests_in_completion_order():
    """One request that completes only after 30 others (a batch a CPU group took) does not hold
    back the window: the loop replaces each request as it completes, as perf_analyzer's
    concurrency mode does. Waiting in submission order would stall here (the slow one waits
    for completions that need new submissions): the loop would never return."""
    import itertools
    import queue
    import threading
    from concurrent.futures import Future

    gpu = _gpu_bench_module()
    pending: queue.SimpleQueue = queue.SimpleQueue()
    numbers = itertools.count()
    slow: list[Future] = []
    completed = [0]

    def submit() -> Future:
        f: Future = Future()
        if next(numbers) == 10:  # the 11th request: inside the measured window
            slow.append(f)
        else:
            pending.put(f)
        return f

    def complete() -> None:
        while (f := pending.get()) is not None:
            f.set_result({"y": 1})
            completed[0] += 1
            if completed[0] == 40 and slow:
                slow[0].set_result({"y": 1})

    completer = threading.Thread(target=complete, daemon=True)
    completer.start()
    result: list[float] = []
    loop = threading.Thread(target=lambda: result.append(gpu.closed_loop(submit, lambda f: f.result(), 4, 0.2)),
                            daemon=True)
    loop.start()
    loop.join(timeout=60)
    pending.put(None)
    assert not loop.is_alive(), "the closed loop waited for its slow request while nothing else was submitted"
    assert slow and slow[0].done() and result and result[0] > 0
