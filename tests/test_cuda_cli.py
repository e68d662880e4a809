"""The CUDA options through the doors users use (`staronnx serve`, `staronnx sweep`), on a
machine without a GPU: ``STARONNX_CUDA_RUNTIME=host`` runs the CUDA workers' whole pipeline
(staging, pinned batches, warm-up, CUDA graph captures and replays, padding) on HostRuntime."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from staronnx import partition
from staronnx.zoo import chain
from staronnx.partition import PartitionSpec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cudacli")
    onnx.save(chain(depth=4, width=8), str(root / "chain.onnx"))
    plan = partition(root / "chain.onnx", spec=PartitionSpec(parts=2, method="linear", costs="estimate"),
                     output_dir=root / "plan")
    return root / "chain.onnx", plan.root


@pytest.fixture
def host_cuda(monkeypatch, tmp_path):
    monkeypatch.setenv("STARONNX_CUDA_RUNTIME", "host")
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path / "home"))


@pytest.mark.parametrize("graphs", [True, False])
def test_serve_captures_its_batch_sizes_and_pads_partial_batches(tiny, tmp_path, host_cuda, graphs):
    import tritonclient.http as httpclient

    from test_serve import start_server

    model, plan = tiny
    served = start_server([plan], tmp_path, "--name", "tiny", "--policy", "eager", "--cuda-streams", "1",
                          "--batch-size", "4", "--max-delay", "1ms", *([] if graphs else ["--no-cuda-graphs"]))
    try:
        start = next(line for line in served.lines if line.startswith("model 'tiny'"))
        if graphs:
            assert "CUDA graphs of batch sizes 1, 2, 4" in start
        else:
            assert "CUDA graphs" not in start
        client = httpclient.InferenceServerClient(served.http)
        ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        name = ref.get_inputs()[0].name
        for rows in (1, 3, 4):  # 3 leaves as a partial batch: padded to 4 when graphs were captured
            x = np.random.default_rng(rows).standard_normal((rows, 8)).astype(np.float32)
            inp = httpclient.InferInput(name, list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            got = client.infer("tiny", [inp]).as_numpy(ref.get_outputs()[0].name)
            np.testing.assert_allclose(got, ref.run(None, {name: x})[0], rtol=1e-5, atol=1e-5)
        # Triton's preferred_batch_size: the captured sizes a partial batch is padded up to
        batching = client.get_model_config("tiny")["dynamic_batching"]
        assert batching.get("preferred_batch_size") == ([1, 2, 4] if graphs else None), batching
        client.close()
    finally:
        rc = served.stop()
    assert rc == 0, "\n".join(served.lines)
    assert not any("capture" in line and "failed" in line for line in served.lines), "\n".join(served.lines)


@pytest.mark.parametrize("graphs", [True, False])
def test_sweep_with_cuda_streams_and_graphs_on_or_off(tiny, tmp_path, host_cuda, graphs):
    _, plan = tiny
    out = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "staronnx", "sweep", str(plan), "--rates", "200", "--batch-sizes", "2",
         "--duration", "0.5s", "--cuda-streams", "1", "--groups", "none", "--policy", "eager", "--no-plots", "-q",
         *([] if graphs else ["--no-cuda-graphs"]), "-o", str(out)],
        capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "results.json").read_text())
    rows = doc["rows"]
    assert rows and all(r.get("throughput", 0) > 0 for r in rows)
    # the sizes the live Server padded partial batches to (the captured graphs), which the
    # fidelity replay pads to as well
    assert doc["settings"]["pad_to"] == ([2] if graphs else [])


def test_sweep_colocate_runs_the_points_from_the_drivers_core(tiny, tmp_path, host_cuda):
    _, plan = tiny
    out = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "staronnx", "sweep", str(plan), "--rates", "200", "--batch-sizes", "2",
         "--duration", "0.5s", "--cuda-streams", "1", "--groups", "none", "--policy", "eager", "--no-plots",
         "--colocate", "-o", str(out)],
        capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "load generator on the CUDA driver's core" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["colocate"] is True
    assert results["rows"] and all(r.get("throughput", 0) > 0 for r in results["rows"])


def test_sweep_colocate_without_cuda_streams_runs_the_points_from_the_first_cpu_workers_core(tiny, tmp_path):
    _, plan = tiny
    pu = sorted(os.sched_getaffinity(0))[-1]
    out = tmp_path / "s"
    proc = subprocess.run(
        [sys.executable, "-m", "staronnx", "sweep", str(plan), "--rates", "200", "--batch-sizes", "2",
         "--duration", "0.5s", "--groups", str(pu), "--policy", "eager", "--colocate", "--no-plots", "-o", str(out)],
        capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "load generator on the first CPU worker's core" in proc.stdout, proc.stdout
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert rows and {r["loadgen"]["core"] for r in rows} == {pu}, rows
    refused = subprocess.run(
        [sys.executable, "-m", "staronnx", "sweep", str(plan), "--rates", "200", "--batch-sizes", "2", "--colocate",
         "--url", "http://127.0.0.1:9", "--no-plots", "-o", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert refused.returncode == 2 and "does not go with --url" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr


def test_run_colocate_submits_from_the_drivers_core(tiny, tmp_path, host_cuda):
    _, plan = tiny
    proc = subprocess.run(
        [sys.executable, "-m", "staronnx", "run", str(plan), "--requests", "50", "--batch", "2", "--cuda-streams", "1",
         "--groups", "none", "--policy", "eager", "--colocate"],
        capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"submitting from the CUDA driver's core \(PU \d+\)", proc.stdout), proc.stdout
    assert "50 requests x batch 2 with eager" in proc.stdout
    pu = sorted(os.sched_getaffinity(0))[-1]
    cpu = subprocess.run([sys.executable, "-m", "staronnx", "run", str(plan), "--requests", "20", "--groups", str(pu),
                          "--policy", "eager", "--colocate"],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert cpu.returncode == 0, cpu.stdout + cpu.stderr
    assert f"submitting from the first CPU worker's core (PU {pu})" in cpu.stdout, cpu.stdout


# -- --cuda-devices: several GPUs (HostRuntime standing in for two) --------------------------------
@pytest.fixture
def two_gpus(monkeypatch, tmp_path):
    monkeypatch.setenv("STARONNX_CUDA_RUNTIME", "host:2")
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path / "home"))


def _cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "staronnx", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def test_run_drives_every_gpu_named(tiny, two_gpus):
    """``run --cuda-devices 0,1``: a CUDA worker per stream on each GPU, each its own arch, both
    running tasks (it used to be GPU 0 only: the runtime never asked launch for another). The
    random policy places each task at push on either GPU alike (120 tasks: one GPU left idle has
    odds of 2**-119); eager lets whichever driver thread is awake take them, and on a busy
    2-core host one of them once took all 120."""
    _, plan = tiny
    done = _cli("run", str(plan), "--requests", "60", "--cuda-streams", "1", "--cuda-devices", "0,1",
                "--groups", "none", "--policy", "random", "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {m.group(1): int(m.group(2)) for m in re.finditer(r"│ (cuda\d\.s0) +│ cuda\d +│ (\d+) ", done.stdout)}
    assert set(rows) == {"cuda0.s0", "cuda1.s0"} and all(n > 0 for n in rows.values()), done.stdout
    again = _cli("run", str(plan), "--requests", "10", "--cuda-streams", "1", "--cuda-devices", "all",
                 "--groups", "none", "-q")
    assert again.returncode == 0 and "cuda1.s0" in again.stdout, again.stdout + again.stderr


@pytest.mark.parametrize("argv, says", [
    (["--cuda-streams", "1", "--cuda-devices", "0-2"], "--cuda-devices 0-2: no GPU 2 here (2 visible: 0..1)"),
    (["--cuda-streams", "1", "--cuda-devices", "1,1"], "CUDA ordinals, each once"),
    (["--cuda-streams", "1", "--cuda-devices", "gpu0"], "CUDA ordinals, each once"),
    (["--cuda-devices", "0"], "it needs --cuda-streams N"),
])
@pytest.mark.parametrize("command", ["run", "calibrate", "serve"])
def test_cuda_devices_refusals_are_one_line_before_anything_starts(tiny, two_gpus, command, argv, says):
    _, plan = tiny
    done = _cli(command, str(plan), *argv, "--groups", "none", timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert says in done.stderr, done.stderr


def test_serve_on_ray_leaves_the_gpus_to_ray(tiny, two_gpus):
    _, plan = tiny
    done = _cli("serve", str(plan), "--ray", "--cuda-streams", "1", "--cuda-devices", "0", timeout=120)
    assert done.returncode == 2 and "with --ray each replica drives the GPUs Ray gives it" in done.stderr, done.stderr


def test_calibrate_and_serve_on_two_gpus(tiny, tmp_path, two_gpus):
    """``calibrate --cuda-devices 0,1`` stores a perf model per GPU (cuda0, cuda1); ``serve
    --cuda-devices 0,1`` answers from both GPUs' workers, as its metrics show."""
    import tritonclient.http as httpclient

    from staronnx.perfmodels import PerfModelStore
    from staronnx.plan import Plan
    from test_serve import start_server

    model, plan = tiny
    done = _cli("calibrate", str(plan), "--batch-sizes", "1", "--cuda-streams", "1", "--cuda-devices", "0,1",
                "--groups", "none", "--max-runs", "20")
    assert done.returncode == 0, done.stdout + done.stderr
    archs = {r.arch for r in PerfModelStore().rows(Plan.load(plan).hash)}
    assert archs == {"cuda0", "cuda1"}, archs
    served = start_server([plan], tmp_path, "--name", "tiny", "--policy", "eager", "--cuda-streams", "1",
                          "--cuda-devices", "0,1", "--groups", "none", "--batch-size", "1", "--max-delay", "0ms")
    try:
        client = httpclient.InferenceServerClient(served.http, concurrency=8)
        ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        name = ref.get_inputs()[0].name
        xs = [np.random.default_rng(i).standard_normal((1, 8)).astype(np.float32) for i in range(40)]
        pending = []
        for x in xs:
            inp = httpclient.InferInput(name, list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            pending.append((x, client.async_infer("tiny", [inp])))
        for x, req in pending:
            got = req.get_result().as_numpy(ref.get_outputs()[0].name)
            np.testing.assert_allclose(got, ref.run(None, {name: x})[0], rtol=1e-5, atol=1e-5)
        client.close()
        import urllib.request

        text = urllib.request.urlopen(served.metrics, timeout=10).read().decode()
        # Triton's config says where the instances run, and the sizes a partial batch is padded to
        config = json.loads(urllib.request.urlopen(f"http://{served.http}/v2/models/tiny/config", timeout=10).read())
        assert config["instance_group"] == [{"name": "tiny_gpu0_1", "kind": "KIND_GPU", "count": 1, "gpus": [0, 1]}]
        # a worker on each GPU serves the model (which of them ran these few tasks is eager's choice)
        workers = set(re.findall(r'staronnx_worker_busy_ratio\{arch="cuda\d",model="tiny",worker="(cuda\d\.s0)"\}', text))
        assert workers == {"cuda0.s0", "cuda1.s0"}, text[:3000]
        assert 'staronnx_tasks_total{arch="cuda' in text
    finally:
        rc = served.stop()
    assert rc == 0, "\n".join(served.lines)


def test_a_mixed_sweep_and_optimize_batch_colocate_their_load_generators(tiny, tmp_path, host_cuda):
    """``--colocate`` on a mixed sweep (every model's generator and batcher) and on
    optimize-batch's live measurements: each says the core it measured from, the CUDA driver's."""

    from staronnx.perfmodels import PerfModelStore
    from staronnx.plan import Plan
    from test_simulator import write_models

    model, plan = tiny
    other = partition(model, spec=PartitionSpec(parts=1, costs="estimate"), output_dir=tmp_path / "other").root
    out = tmp_path / "mix"
    done = subprocess.run(
        [sys.executable, "-m", "staronnx", "sweep", str(plan), str(other), "--name", "a", "--name", "b",
         "--rates", "a=100,b=100", "--batch-sizes", "2", "--duration", "0.5s", "--cuda-streams", "1",
         "--groups", "none", "--policy", "eager", "--no-plots", "-q", "--colocate", "-o", str(out)],
        capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "load generators on the CUDA driver's core" in done.stdout, done.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["colocate"] is True
    assert [g["name"].startswith("HostRuntime") for g in results["settings"]["gpus"]] == [True]
    cores = {r["model"]: r["loadgen"]["core"] for r in results["rows"]}
    assert set(cores) == {"a", "b"} and len(set(cores.values())) == 1 and isinstance(cores["a"], int), cores

    write_models(PerfModelStore(), Plan.load(plan), {(0, "cuda0"): 1e-3, (1, "cuda0"): 1e-3}, batches=(1, 2))
    report = tmp_path / "opt.json"
    done = subprocess.run(
        [sys.executable, "-m", "staronnx", "optimize-batch", str(plan), "--rate", "100", "--batch-sizes", "1,2",
         "--cuda-streams", "1", "--groups", "none", "--sim-duration", "1s", "--verify-duration", "0.5s",
         "--max-verify", "1", "--colocate", "--json", str(report)],
        capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    core = json.loads(report.read_text())["generator_core"]
    assert core == cores["a"] and f"on the CUDA driver's core (PU {core})" in done.stdout, done.stdout


# -- --cuda-thread-per-stream: a driver thread per stream (StarPU's STARPU_CUDA_THREAD_PER_WORKER) --
@pytest.mark.parametrize("own", [False, True])
def test_run_says_who_drives_each_stream(tiny, host_cuda, own):
    """``run --cuda-thread-per-stream``: each stream's tasks are launched by a thread of its own,
    which the worker table reads off the runtime (one GPU's driver otherwise)."""
    _, plan = tiny
    proc = _cli("run", str(plan), "--requests", "30", "--batch", "2", "--cuda-streams", "2", "--groups", "none",
                "--policy", "eager", *(["--cuda-thread-per-stream"] if own else []))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "driver thread" in proc.stdout
    rows = {m.group(1): m.group(2) for m in re.finditer(r"(cuda0\.s[01]) .*│ (cuda0(?:\.s[01] \(own\))?)\s*│",
                                                         proc.stdout)}
    assert rows == ({"cuda0.s0": "cuda0.s0 (own)", "cuda0.s1": "cuda0.s1 (own)"} if own
                    else {"cuda0.s0": "cuda0", "cuda0.s1": "cuda0"}), proc.stdout


def test_sweep_and_topology_take_a_thread_per_stream(tiny, tmp_path, host_cuda):
    """``sweep --cuda-thread-per-stream`` measures with a driver per stream (its results say which
    thread drove each worker); ``topology`` shows each stream's driver on a core of its own."""
    _, plan = tiny
    out = tmp_path / "sweep"
    proc = _cli("sweep", str(plan), "--rates", "200", "--batch-sizes", "2", "--duration", "0.5s", "--cuda-streams",
                "2", "--groups", "none", "--policy", "eager", "--no-plots", "-q", "--cuda-thread-per-stream",
                "-o", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "results.json").read_text())
    assert doc["settings"]["drivers"] == {"cuda0.s0": "cuda0.s0 (own)", "cuda0.s1": "cuda0.s1 (own)"}
    assert doc["rows"] and all(r["throughput"] > 0 for r in doc["rows"])
    shown = {}
    for own in (False, True):
        topo = _cli("topology", "--synthetic", "pack:1 numa:1 core:8 pu:1", "--cuda-streams", "2",
                    *(["--cuda-thread-per-stream"] if own else []))
        assert topo.returncode == 0, topo.stdout + topo.stderr
        shown[own] = re.findall(r"cuda0\.s\d .*driver thread on PU (\d+)", topo.stdout)
    assert len(set(shown[False])) == 1 and len(shown[False]) == 2  # one driver for the GPU
    assert len(set(shown[True])) == 2  # a core each


@pytest.mark.parametrize("own", [False, True])
def test_serve_says_how_many_threads_drive_its_streams(tiny, tmp_path, host_cuda, own):
    """``serve --cuda-thread-per-stream``: the model's start line reads, off the started runtime,
    one driver thread per stream (one for the GPU otherwise)."""
    from test_serve import start_server

    _, plan = tiny
    served = start_server([plan], tmp_path, "--name", "tiny", "--policy", "eager", "--cuda-streams", "2",
                          "--groups", "none", "--batch-size", "2", *(["--cuda-thread-per-stream"] if own else []))
    try:
        start = next(line for line in served.lines if line.startswith("model 'tiny'"))
    finally:
        rc = served.stop()
    assert rc == 0, "\n".join(served.lines)
    assert ("2 driver threads for 2 streams" if own else "1 driver thread for 2 streams") in start, start


def _calibrate(plan: Path, *args: str) -> subprocess.CompletedProcess:
    """``staronnx calibrate PLAN ARGS`` until every entry is calibrated: on a loaded host the
    outlier rule can leave one short of its samples within the cap (the store keeps what each
    run learnt, so a second run finishes it)."""
    for _ in range(3):
        done = _cli("calibrate", str(plan), "--max-runs", "30", "--no-bus", "--no-host", *args)
        assert done.returncode == 0, done.stdout + done.stderr
        if "not calibrated (" not in done.stdout:
            break
    assert "not calibrated (" not in done.stdout, done.stdout
    return done


def test_calibrate_takes_the_cuda_worker_flags_run_takes(real_plan, host_cuda):
    """``calibrate`` starts the workers ``run`` starts with the same flags: it took
    ``--cuda-streams`` and ``--cuda-devices`` but not ``--cuda-thread-per-stream`` nor
    ``--cuda-graphs/--no-cuda-graphs``, so a user who runs with a driver thread per stream (a
    core held back per stream, narrower CPU groups) could not calibrate those workers at all
    ("No such option"). Now it does, says how many threads drive its streams, and the run with
    the same flags finds every model calibrated (no warning), after warning, uncalibrated, with
    the calibrate command for these very workers."""
    plan = real_plan("gru_stream").root
    flags = ("--cuda-streams", "2", "--groups", "none", "--cuda-thread-per-stream", "--no-cuda-graphs")
    before = _cli("run", str(plan), "--requests", "2", "--batch", "1", "--policy", "dmda", *flags)
    assert before.returncode == 0, before.stdout + before.stderr
    # the command the warning says to run calibrates these very workers
    assert re.search(r"run staronnx calibrate .* --cuda-streams 2 --no-cuda-graphs --cuda-thread-per-stream$",
                     before.stderr.strip()), before.stderr
    done = _calibrate(plan, "--batch-sizes", "1", *flags)
    assert "2 driver threads for 2 streams" in done.stdout, done.stdout
    ran = _cli("run", str(plan), "--requests", "4", "--batch", "1", "--policy", "dmda", *flags)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "no calibrated model" not in ran.stderr, ran.stderr
    assert re.search(r"cuda0\.s1 .*│ cuda0\.s1 \(own\)", ran.stdout), ran.stdout


def test_optimize_batch_measures_its_candidates_with_their_cuda_graphs(real_plan, host_cuda):
    """``optimize-batch --cuda-streams N`` verified its candidates live on a runtime that captured
    no CUDA graph (it never named the sizes to warm up), while ``sweep`` and ``serve`` with the
    same flags capture every batch size they run: the measured column was of another runtime
    than the one the answer is for. Each candidate's graph is now captured at warm-up and the
    result says which sizes were measured with graphs."""
    import json as _json

    plan = real_plan("gru_stream").root
    flags = ("--cuda-streams", "1", "--groups", "none")
    _calibrate(plan, "--batch-sizes", "1,2", *flags)
    out = Path(os.environ["STARONNX_HOME"]).parent / "opt.json"
    opt = _cli("optimize-batch", str(plan), "--rate", "50", "--batch-sizes", "1,2", "--sim-duration", "1s",
               "--verify-duration", "0.5s", "--max-verify", "2", "--policy", "eager", "--json", str(out), *flags)
    assert opt.returncode == 0, opt.stdout + opt.stderr
    doc = _json.loads(out.read_text())
    assert doc["cuda_graphs"] == [1, 2], doc
    assert "measured with CUDA graphs of batch sizes 1, 2" in opt.stdout, opt.stdout


def test_optimize_batch_takes_the_cuda_worker_flags_sweep_takes(real_plan, host_cuda):
    """``optimize-batch`` measures live on the workers sweep would start with the same flags, but
    took neither ``--no-cuda-graphs`` nor ``--cuda-thread-per-stream`` ("No such option"): a user
    could not ask it about the runtime they serve with. Both are parsed into the same MachineSpec:
    without graphs nothing is captured, and a driver per stream is calibrated and measured."""
    import json as _json

    plan = real_plan("gru_stream").root
    flags = ("--cuda-streams", "2", "--groups", "none", "--cuda-thread-per-stream")
    _calibrate(plan, "--batch-sizes", "1", *flags)
    out = Path(os.environ["STARONNX_HOME"]).parent / "opt.json"
    opt = _cli("optimize-batch", str(plan), "--rate", "50", "--batch-sizes", "1", "--sim-duration", "1s",
               "--verify-duration", "0.5s", "--policy", "eager", "--no-cuda-graphs", "--json", str(out), *flags)
    assert opt.returncode == 0, opt.stdout + opt.stderr
    assert "no calibrated model" not in opt.stderr, opt.stderr
    doc = _json.loads(out.read_text())
    assert doc["cuda_graphs"] == [] and doc["verified"] == [1], doc
    assert "CUDA graphs" not in opt.stdout, opt.stdout


_COMMANDS = {
    "run": ("run", "PLAN", "--requests", "2"),
    "calibrate": ("calibrate", "PLAN", "--batch-sizes", "1", "--no-bus", "--no-host"),
    "sweep": ("sweep", "PLAN", "--rates", "20", "--batch-sizes", "1", "--duration", "0.3s", "--no-plots", "-q"),
    "optimize-batch": ("optimize-batch", "PLAN", "--rate", "20", "--batch-sizes", "1", "--no-verify"),
    "topology": ("topology",)}
_OWN = (("--cuda-thread-per-stream",),
        "--cuda-thread-per-stream sets how the CUDA workers run: it needs --cuda-streams N")
_BOTH = (("--no-cuda-graphs", "--cuda-thread-per-stream"),
         "--no-cuda-graphs and --cuda-thread-per-stream set how the CUDA workers run: they need --cuda-streams N")


@pytest.mark.parametrize("command, flags, says", [
    *(pytest.param(c, *_OWN, id=f"{c}-own") for c in _COMMANDS),
    *(pytest.param(c, *_BOTH, id=f"{c}-both") for c in _COMMANDS if c != "topology")])  # topology: no graphs
def test_cuda_worker_flags_without_cuda_streams_are_refused(real_plan, tmp_path, host_cuda, command, flags, says):
    """``--cuda-thread-per-stream`` and ``--no-cuda-graphs`` say how the CUDA workers run; without
    ``--cuda-streams`` there are none and the flag was dropped without a word (the command ran on
    the CPU groups, exit 0), where ``--cuda-devices`` alone is refused. Now one line, as it is."""
    plan = str(real_plan("gru_stream").root)
    args = [plan if a == "PLAN" else a for a in _COMMANDS[command]]
    if command == "sweep":
        args += ["-o", str(tmp_path / "res")]
    done = _cli(*args, *flags)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert done.stderr.strip() == f"staronnx: error: {says}", done.stderr
