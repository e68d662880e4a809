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

import numpy as np
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


def _gpu_cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--device", "cpu", "--models", "googlenet,encoder",
            "--precisions", "fp32,fp16", "--batches", "1", "--in-flight", "4", "--seconds", "0.2", "--repeats", "2",
            "--sequence", "8", "--json", str(out), *extra]


def test_gpu_benchmark_smoke_on_the_cpu(tmp_path):
    """The fair table's harness end to end on the CPU (its CUDA workers and ort-tuned's streams
    on the stand-in): every setup at most K requests in flight, every repeat and the provenance
    in the JSON, each row in it by the time its line is printed (a run cut short by its step's
    limit keeps every row it measured), the mixed setups traced."""
    out, traces = tmp_path / "gpu.json", tmp_path / "traces"
    proc = subprocess.Popen(_gpu_cmd(out, "--trace", str(traces)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "STARONNX_HOME": str(tmp_path / "home")})
    seen_at_print = {}
    assert proc.stdout is not None
    printed = []
    for line in proc.stdout:
        printed.append(line)
        m = re.match(r"^(\w+/fp\d+/b\d+/k\d+): ", line)
        if m and "skipped" not in line:
            seen_at_print[m.group(1)] = [r["id"] for r in json.loads(out.read_text())["rows"]]
    stderr = proc.stderr.read() if proc.stderr else ""
    assert proc.wait(timeout=600) == 0, stderr[-3000:]
    data = json.loads(out.read_text())
    ids = [r["id"] for r in data["rows"]]
    # measured in the matrix's order: the CNN before the encoder, fp32 before fp16
    assert ids[:2] == ["googlenet/fp32/b1/k4", "encoder/fp32/b1/k4"], ids
    assert seen_at_print["googlenet/fp32/b1/k4"] == ["googlenet/fp32/b1/k4"]
    assert seen_at_print["encoder/fp32/b1/k4"] == ids[:2]
    text = "".join(printed)
    try:
        import onnxconverter_common  # noqa: F401
    except ImportError:  # the fp16 rows say why they did not run, and are left for a later run
        assert "googlenet/fp16/b1/k4: skipped: fp16 rows need onnxconverter-common" in text, text
        assert len(ids) == 2
    (run,) = data["runs"]
    assert run["commit"] and "gpu.py" in run["command"] and run["onnxruntime"] and run["device"]["name"]
    for row in data["rows"]:
        figures = row["figures"]
        assert set(figures) >= {"ort1", "ort2", "ort4", "ort-tuned1", "ort-tuned2", "staronnx-s4"}, sorted(figures)
        assert "ort8" not in figures and "staronnx-s8" not in figures and "ort-tuned4" not in figures
        for label, f in figures.items():
            assert f["in_flight"] <= row["k"], (label, f)
            assert len(f["repeats"]) == 2 and all(x > 0 for x in f["repeats"])
            assert f["min"] <= f["median"] <= f["max"]
        assert max(row["errors"].values()) < (1e-3 if row["precision"] == "fp32" else 1e-2)
        assert row["graph_stats"]["staronnx-s4"]["replays"] > 0
        assert set(row["latency_ms"]) == {"ort1", "ort-tuned1", "staronnx-s4"}
    fp32 = data["rows"][0]
    assert {"gpu+cpu", "auto"} <= set(fp32["figures"]) and fp32["traced"] == ["auto", "gpu+cpu"]
    assert sorted(p.name for p in traces.iterdir()) == [
        f"trace-{m}-fp32-k4-{s}.json" for m in ("encoder", "googlenet") for s in ("auto", "gpu_cpu")]
    assert any("max relative error" in c for c, _ in data["checks"])
    assert re.search(r"^googlenet/fp32/b1/k4: staronnx-s4 / ort[-\w]+ [\d.]+x \((faster|slower|overlap)\)", text, re.M)


def test_the_gpu_table_stops_within_its_budget_and_a_later_run_continues(tmp_path):
    """``--budget``: no row starts that the slowest so far says would overrun; ``--resume``: a
    later run keeps the rows of the same device and measures only the rest, its provenance
    added to the earlier run's; rows of another device are not mixed in."""
    out = tmp_path / "gpu.json"
    env = {**os.environ, "STARONNX_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--device", "cpu", "--models", "googlenet",
           "--precisions", "fp32", "--batches", "1,2", "--in-flight", "2", "--seconds", "0.1", "--repeats", "1",
           "--no-cpu-help"]
    first = subprocess.run([*cmd, "--budget", "0.01", "--json", str(out)], capture_output=True, text=True, timeout=600,
                           env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "stopped before googlenet/fp32/b2/k2" in first.stdout, first.stdout
    assert [r["id"] for r in json.loads(out.read_text())["rows"]] == ["googlenet/fp32/b1/k2"]
    later = tmp_path / "later.json"
    second = subprocess.run([*cmd, "--resume", str(out), "--json", str(later)], capture_output=True, text=True,
                            timeout=600, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    data = json.loads(later.read_text())
    assert [r["id"] for r in data["rows"]] == ["googlenet/fp32/b1/k2", "googlenet/fp32/b2/k2"]
    assert len(data["runs"]) == 2 and "1 row(s) kept" in second.stderr
    other = json.loads(out.read_text())
    other["runs"][-1]["device"]["name"] = "NVIDIA H200"
    out.write_text(json.dumps(other))
    third = subprocess.run([*cmd, "--rows", "1", "--resume", str(out), "--json", str(later)], capture_output=True,
                           text=True, timeout=600, env=env)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "measured on 'NVIDIA H200'" in third.stderr and "starting a new table" in third.stderr
    assert [r["id"] for r in json.loads(later.read_text())["rows"]] == ["googlenet/fp32/b1/k2"]


def test_a_gpu_figure_below_the_bar_is_refused():
    """On a GPU a figure is the median of >= 3 repeats of >= 2 s: less is refused up front."""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--repeats", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and ">= 3 repeats of >= 2 s" in done.stderr, done.stderr


def test_the_matrix_measures_what_matters_most_first():
    gpu = _gpu_bench_module()
    keys = gpu.matrix(["googlenet", "resnet50", "encoder"], ["fp32", "tf32"], [4, 16], [1, 8, 32])
    ids = [k.id for k in keys]
    assert ids[:6] == [f"{m}/fp32/b{b}/k16" for m in ("googlenet", "resnet50") for b in (1, 8, 32)]
    assert ids[6:12] == [f"{m}/fp32/b{b}/k4" for m in ("googlenet", "resnet50") for b in (1, 8, 32)]
    assert ids[12:18] == [f"encoder/fp32/b{b}/k{k}" for k in (16, 4) for b in (1, 8, 32)]
    assert all("/tf32/" in i for i in ids[18:]) and len(ids) == 36


def test_a_ratio_is_claimed_only_where_the_ranges_do_not_overlap():
    gpu = _gpu_bench_module()
    fig = lambda lo, med, hi: {"min": lo, "median": med, "max": hi}  # noqa: E731
    assert gpu.verdict(fig(110, 115, 120), fig(90, 100, 105)) == (1.15, "faster")
    assert gpu.verdict(fig(80, 90, 95), fig(96, 100, 105))[1] == "slower"
    assert gpu.verdict(fig(100, 110, 120), fig(90, 100, 105))[1] == "overlap"
    row = {"figures": {"ort4": fig(90, 100, 105), "ort-tuned2": fig(95, 120, 125), "staronnx-s4": fig(100, 110, 120),
                       "staronnx-s8": fig(126, 130, 140)}}
    assert gpu.headline(row) == {"staronnx": "staronnx-s8", "ort": "ort-tuned2", "ratio": 130 / 120,
                                 "claim": "faster"}


def test_the_models_export_with_a_dynamic_batch_and_sequence(tmp_path):
    """``benchmarks/gpu_models.py`` (the GPU host has torch; this host may not): the encoder,
    made small, exports with both axes dynamic and runs at two shapes."""
    pytest.importorskip("torch", reason="torch is not installed here: the export runs on the GPU host")
    import onnxruntime as ort

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_models
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    path = tmp_path / "enc.onnx"
    gpu_models.export_encoder(path, layers=1, hidden=32, heads=2, ffn=64, vocab=100)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for shape in ((1, 7), (3, 12)):
        (out,) = sess.run(None, {"input_ids": np.random.default_rng(0).integers(0, 100, shape)})
        assert out.shape == (*shape, 32)


def test_every_results_file_the_readme_and_docs_name_exists():
    """A figure is quoted only from a committed result file: each ``benchmarks/results/...``
    file that README.md or a docs page names is in the repository."""
    named = set()
    for page in [REPO / "README.md", *(REPO / "docs").rglob("*.md")]:
        named |= {(page.name, m) for m in re.findall(r"benchmarks/results/([\w.\-]+\.\w+)", page.read_text())}
    missing = [(page, f) for page, f in sorted(named) if not (REPO / "benchmarks" / "results" / f).is_file()]
    assert not missing, missing


def test_the_gpu_session_runs_the_table_in_one_call_that_fits(tmp_path):
    """``gpu_session.sh`` end to end, its python a wrapper that runs the table's harness on the
    CPU (tiny settings appended: argparse keeps the last): the steps in order, each printing its
    budget and its time, their limits (with --kill-after) within 480 s, the harness's own budget
    under its step's limit, continuing from the committed results; the call returns at most 6
    files (summary, JSON, table, one tarball of logs and traces)."""
    import tarfile

    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {tmp_path / "calls.txt"}\n'
        'case "$1" in\n'
        "  benchmarks/gpu_models.py) exit 0 ;;\n"
        f'  benchmarks/gpu.py) exec {sys.executable} "$@" --device cpu --models googlenet --precisions fp32 '
        "--batches 1 --in-flight 4 --seconds 0.1 --repeats 2 --trace-setups staronnx-s4 ;;\n"
        f'  *) exec {sys.executable} "$@" ;;\n'
        "esac\n")
    wrapper.chmod(0o755)
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_session.sh")], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env={**os.environ, "OUT": str(out), "PYTHON": str(wrapper),
                                                      "STARONNX_HOME": str(tmp_path / "home"),
                                                      "MODELS_DIR": str(tmp_path / "models")})
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("gpu: ") and re.match(r"^commit: [0-9a-f]{40}$", summary[1]), summary
    steps = [re.match(r"^(\S+): exit (\d+) in \d+ s \(limit (\d+) s\)$", line) for line in summary[2:-1]]
    assert all(steps), summary
    assert [m.group(1) for m in steps] == ["models", "table", "table-md"], summary
    assert all(m.group(2) == "0" for m in steps), summary
    limits = [int(m.group(3)) for m in steps]
    assert sum(limits) + 5 * len(limits) <= 480, limits  # each --kill-after adds up to 5 s
    assert re.findall(r"^(\S+): budget (\d+) s$", done.stderr, re.M) == [(m.group(1), m.group(3)) for m in steps]
    assert summary[-1].startswith("total: ")
    table_call = next(c for c in (tmp_path / "calls.txt").read_text().splitlines() if c.startswith("benchmarks/gpu.py"))
    harness_budget = float(re.search(r"--budget (\d+)", table_call).group(1))
    assert harness_budget < limits[1] and "--resume benchmarks/results" in table_call
    assert sorted(p.name for p in out.iterdir()) == ["gpu-table.md", "gpu.json", "logs.tgz", "summary.txt"]
    assert [r["id"] for r in json.loads((out / "gpu.json").read_text())["rows"]] == ["googlenet/fp32/b1/k4"]
    assert "| googlenet | fp32 | 1 | 4 |" in (out / "gpu-table.md").read_text()
    with tarfile.open(out / "logs.tgz") as tar:
        names = tar.getnames()
    assert {"logs/models.txt", "logs/table.txt", "logs/table-md.txt"} <= set(names), names
    assert any(n.startswith("logs/traces/trace-googlenet-fp32-k4-staronnx-s4") for n in names), names


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
        "import sys; sys.modules['gpu_bench'] = gpu\n"
        "spec.loader.exec_module(gpu)\n"
        f"path = gpu.cpu_stand_in('googlenet', pathlib.Path({str(tmp_path)!r}), 8)\n"
        "assert gpu.ort_sessions(path, 2, 'cpu')[0].get_providers()[0] == 'CPUExecutionProvider'\n"
        "print('ortN on', gpu.ort_sessions(path, 2, 'cuda')[0].get_providers())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 1 and "ortN on" not in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("benchmarks/gpu.py: a plain ONNX Runtime session asked for CUDAExecutionProvider runs on "
                           "['CPUExecutionProvider']"), done.stderr


def _gpu_bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench_loop", REPO / "benchmarks" / "gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
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


def test_the_gpu_table_is_generated_from_a_results_file(tmp_path):
    """``benchmarks/gpu_table.py`` over a run's JSON prints the table (medians, ranges, the
    ratio claimed or not); the GPU guide's generated section shows the newest committed
    ``gpu-*.json`` that way, or says that none is committed; a file of another kind is refused."""
    results = tmp_path / "results"
    results.mkdir()
    out = results / "gpu-cpu-2026-12-07.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--device", "cpu", "--models",
                           "googlenet", "--precisions", "fp32", "--batches", "1", "--in-flight", "4", "--seconds", "0.1",
                           "--repeats", "2", "--no-cpu-help", "--json", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "STARONNX_HOME": str(tmp_path / "home")})
    assert done.returncode == 0, done.stderr[-3000:]
    table = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_table.py"), str(out)], capture_output=True,
                           text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    assert re.search(r"^\| googlenet \| fp32 \| 1 \| 4 \| [\d,]+ \[[\d,]+-[\d,]+\] \(staronnx-s\d\) \| [\d,]+ "
                     r"\[[\d,]+-[\d,]+\] \(ort[-\w]+\) \| (\*\*[\d.]+x\*\*|~[\d.]+x \(overlap\)) \|", table.stdout,
                     re.M), table.stdout
    assert "median of 2 alternated repeats of 0.1 s" in table.stdout
    sys.path.insert(0, str(REPO / "docs"))
    try:
        import gen_gpu_table
        import gen_results
    finally:
        sys.path.remove(str(REPO / "docs"))
    assert "No GPU run committed yet" in gen_gpu_table.render(tmp_path / "absent")
    assert table.stdout.split("|", 1)[1] in gen_gpu_table.render(results)
    assert table.stdout.split("|", 1)[1] in gen_results.render(results)
    assert gen_gpu_table.MARKER in (REPO / "docs" / "guides" / "gpu.md").read_text()
    (tmp_path / "other.json").write_text('{"rows": []}')
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_table.py"), str(tmp_path / "other.json")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not a benchmarks/gpu.py result" in bad.stderr, bad.stderr


def test_an_ort_tuned_that_cannot_use_graphs_runs_without_and_the_row_says_so(tmp_path, monkeypatch):
    """ORT refuses CUDA graphs for a model whose shape nodes stay on the CPU (the encoder may be
    one): ort-tuned then runs without graphs (ORT at its best where ORT allows), the row notes
    it, and the run goes on."""
    gpu = _gpu_bench_module()
    real = gpu._TunedLane.__init__

    def refuse_graphs(self, *args, graphs=True, **kwargs):
        if graphs:
            raise RuntimeError("This session cannot use the CUDA Graph feature as requested by the user")
        real(self, *args, graphs=graphs, **kwargs)

    monkeypatch.setattr(gpu._TunedLane, "__init__", refuse_graphs)
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("STARONNX_CUDA_RUNTIME", "host")
    out = tmp_path / "gpu.json"
    assert gpu.main(["--device", "cpu", "--models", "googlenet", "--precisions", "fp32", "--batches", "1",
                     "--in-flight", "2", "--seconds", "0.05", "--repeats", "1", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert "ort-tuned1" in row["figures"] and row["figures"]["ort-tuned1"]["median"] > 0
    assert "ort-tuned1 ran without CUDA graphs" in row["notes"]
    assert any(n.startswith("ort-tuned1: RuntimeError: This session cannot use the CUDA Graph") for n in row["notes"])


def test_a_copy_without_history_takes_its_commit_from_the_caller(tmp_path, monkeypatch):
    """A device call runs on a copy of the working tree without .git: the figures' commit is
    then the one the caller wrote into the command (``STARONNX_COMMIT``), said to be so, and
    whether the tree differed from it is unknown rather than guessed."""
    gpu = _gpu_bench_module()
    assert gpu.commit()["commit_from"] == "git" and len(gpu.commit()["commit"]) == 40
    monkeypatch.setattr(gpu, "REPO", tmp_path)
    monkeypatch.setenv("STARONNX_COMMIT", "0123abc")
    assert gpu.commit() == {"commit": "0123abc", "dirty": None, "commit_from": "STARONNX_COMMIT"}
