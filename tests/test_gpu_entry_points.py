"""Every public door that takes ``cuda_streams=`` / ``--cuda-streams``, on a real GPU.

Issue 11: on the H100 host, ``Runtime(plan, cuda_streams=N)`` and therefore ``staronnx run``,
``calibrate``, ``sweep`` and ``optimize-batch`` with ``--cuda-streams`` failed at once (the CUDA
workers were never started); the gpu tests of the worker built their own workers, so none
caught it.  These go through the doors users use: the Python API and the CLI in a subprocess
(which inherits this environment).  They skip cleanly where ONNX Runtime has no CUDA provider;
``test_launch.py`` runs the same Runtime door on every machine with the CUDA pipeline on the
CPU provider.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from staronnx import CudaOptions, InferenceSession, MachineSpec, Runtime, RuntimeSpec, SessionSpec, partition
from staronnx.perfmodels import PerfModelStore
from staronnx.verify import random_plan_feeds
from staronnx.workers.cuda import cuda_unavailable_reason
from staronnx.zoo import inception
from staronnx.partition import PartitionSpec

REASON = cuda_unavailable_reason(0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(REASON is not None, reason=f"needs a GPU with ONNX Runtime's CUDA provider: {REASON}"),
]

#: TF32 off in tests: exact fp32 kernels, comparable to the CPU reference
STRICT = CudaOptions(provider_options={"use_tf32": "0"})


@pytest.fixture(scope="module")
def gplan(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-doors")
    model = root / "inception.onnx"
    onnx.save(inception(blocks=2, channels=8, size=16), str(model))
    plan = partition(model, [0.8, 0.2], PartitionSpec(profile_runs=1), output_dir=root / "plan")
    plan.source_model = model  # type: ignore[attr-defined]
    return plan


def _cli(home: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "STARONNX_HOME": str(home), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "staronnx", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


def _close(a: np.ndarray, b: np.ndarray) -> None:
    scale = max(float(np.abs(b).max()), 1e-6)
    assert float(np.abs(a - b).max()) / scale < 1e-3


# ------------------------------------------------------------------ Python API
@pytest.mark.parametrize("policy", ["eager", "dmda", "heft"])
def test_runtime_with_cuda_streams_serves_on_the_gpu(gplan, tmp_path, policy):
    feeds = [random_plan_feeds(gplan, b, seed=i) for i, b in enumerate([1, 4, 8, 2] * 4)]
    with Runtime(gplan,
                 MachineSpec(cuda_streams=2),
                 RuntimeSpec(policy=policy, cuda=STRICT, store=PerfModelStore(tmp_path))) as rt:
        assert [w.kind for w in rt.workers][:2] == ["cuda", "cuda"]
        results = [f.result(timeout=120) for f in [rt.submit(f) for f in feeds]]
        stats = rt.stats()
    for f, r in zip(feeds, results):
        _close(r["logits"], gplan.run_reference(f)["logits"])
    assert sum(row["tasks"] for key, row in stats["tasks"].items() if key.endswith("cuda0")) > 0


def test_inference_session_facade_with_cuda_streams(gplan):
    x = random_plan_feeds(gplan, 3, seed=7)
    sess = InferenceSession(gplan, spec=SessionSpec(cuda_streams=1, runtime=RuntimeSpec(cuda=STRICT)))
    try:
        (out,) = sess.run(None, x)
    finally:
        sess.close()
    _close(out, gplan.run_reference(x)["logits"])


# ------------------------------------------------------------------ CLI
def test_cli_run_calibrate_sweep_optimize_with_cuda_streams(gplan, tmp_path):
    home = tmp_path / "home"
    plan = str(gplan.root)
    run = _cli(home, "run", plan, "--batch", "4", "--requests", "40", "--cuda-streams", "2", "--policy", "dmda")
    assert run.returncode == 0, run.stderr
    assert "cuda0" in run.stdout and "samples/s" in run.stdout

    cal = _cli(home, "calibrate", plan, "--batch-sizes", "1,4", "--cuda-streams", "2", "--groups", "numa")
    assert cal.returncode == 0, cal.stderr
    assert "cuda0" in cal.stdout

    out = tmp_path / "sweep"
    sweep = _cli(home, "sweep", plan, "--rates", "50,100", "--batch-sizes", "1,4", "--cuda-streams", "2",
                 "--duration", "1s", "--no-plots", "-o", str(out))
    assert sweep.returncode == 0, sweep.stderr
    assert json.loads((out / "results.json").read_text())["settings"]["cuda_streams"] == 2

    opt = _cli(home, "optimize-batch", plan, "--rate", "100", "--slo-ms", "200", "--batch-sizes", "1,4",
               "--cuda-streams", "2", "--verify-duration", "1s", "--json", str(tmp_path / "opt.json"))
    assert opt.returncode == 0, opt.stderr
    assert json.loads((tmp_path / "opt.json").read_text())

    sim = _cli(home, "simulate", plan, "--rate", "100", "--batch", "4", "--cuda-streams", "2")
    assert sim.returncode == 0, sim.stderr
    assert "cuda0" in sim.stdout


def test_cli_partition_on_the_gpu_then_verify(gplan, tmp_path):
    out = tmp_path / "plan-cuda"
    part = _cli(tmp_path / "home", "partition", str(gplan.source_model), "--shares", "0.85,0.15",
                "--device", "cuda", "-o", str(out))
    assert part.returncode == 0, part.stderr
    ver = _cli(tmp_path / "home", "plan", "verify", str(out), "--model", str(gplan.source_model), "--batch", "4")
    assert ver.returncode == 0 and "OK" in ver.stdout, ver.stdout + ver.stderr


def test_cli_run_with_cuda_graphs(gplan, tmp_path):
    run = _cli(tmp_path / "home", "run", str(gplan.root), "--batch", "4", "--requests", "60", "--cuda-streams", "2",
               "--cuda-graphs", "--groups", "none", "--policy", "eager")
    assert run.returncode == 0, run.stderr
    assert "cuda0" in run.stdout and "samples/s" in run.stdout


def test_cli_partition_shares_auto_times_each_gpu_named(gplan, tmp_path):
    """``--shares auto --device cuda --cuda-devices 0 --cuda-streams 2``: the GPU is timed through
    CUDA sessions on the ordinal named (a provider option per GPU), as many at once as the plan's
    streams, and the plan says which and how many."""
    out = tmp_path / "plan-auto"
    part = _cli(tmp_path / "home", "partition", str(gplan.source_model), "--shares", "auto", "--device", "cuda",
                "--cuda-streams", "2", "--cuda-devices", "0", "--profile-runs", "2", "-o", str(out))
    assert part.returncode == 0, part.stderr
    speeds = json.loads((out / "plan.json").read_text())["settings"]["auto_shares"]["speeds"]
    assert speeds[0]["name"] == "cuda0" and speeds[0]["kind"] == "cuda" and speeds[0]["seconds"] > 0
    assert speeds[0]["streams"] == 2


def test_the_gpu_is_described_as_results_record_it():
    """``describe_gpus`` (``staronnx topology``, a sweep's ``settings.gpus``) reads the real GPU:
    its model, memory and compute capability through cudaGetDeviceProperties."""
    from staronnx.workers.cuda import describe_gpus

    (first, *_) = describe_gpus([0])
    assert first["device"] == 0 and first["name"] and "HostRuntime" not in first["name"]
    assert first["memory_bytes"] > 2**30 and re.fullmatch(r"\d+\.\d+", first["capability"]) and first["sms"] > 0


def test_serve_exports_tritons_gpu_metrics(gplan, tmp_path):
    """``serve --cuda-streams 1`` on a GPU: /metrics carries Triton's nv_gpu_* (NVML) for the GPU
    served from, labelled with its UUID, as Triton's dashboards read them."""
    import urllib.request

    # what it cannot run here is a skip, never an error: NVML first, then the server's own
    # extra, then the serving tests' helper (which skips where Triton's clients are absent)
    pytest.importorskip("pynvml", reason="nvidia-ml-py (the gpu extra's NVML) is not installed")
    for module in ("aiohttp", "grpc", "prometheus_client"):
        pytest.importorskip(module, reason=f"staronnx serve needs the serve extra ({module} is not installed)")
    from test_serve import start_server

    served = start_server([gplan.root], tmp_path, "--name", "g", "--cuda-streams", "1", "--groups", "none")
    try:
        text = urllib.request.urlopen(served.metrics, timeout=10).read().decode()
    finally:
        assert served.stop() == 0, "\n".join(served.lines)
    total = re.search(r'^nv_gpu_memory_total_bytes\{gpu_uuid="(GPU-[0-9a-f-]{36})"\} (\S+)$', text, re.M)
    assert total and float(total.group(2)) > 2**30, text[-3000:]
    assert re.search(r'^nv_gpu_utilization\{gpu_uuid="GPU-', text, re.M)
