"""staronnx against plain ONNX Runtime on a GPU server, side by side in one run (issue 11).

For each model and batch size, throughput in samples/s with numpy in and numpy out and
``--in-flight`` requests in flight:

- ``ort1``/``ort2``/``ort4``: N plain ``onnxruntime.InferenceSession``s with the CUDA provider,
  one thread each calling ``run()`` (Triton's ``instance_group { count: N }``);
- ``ort-tuned1/2/4``: N sessions as ORT's documentation tunes them for a GPU, one thread each:
  ``enable_cuda_graph``, inputs and outputs bound once to device ``OrtValue``s (IOBinding), the
  host input in pinned memory, each request an ``update_inplace`` copy in, a graph replay
  (``run_with_iobinding``) and a copy of the output back: the best plain ORT can do;
- ``gpu``: staronnx, the 1-part plan on ``--streams`` CUDA workers only (``--groups`` none);
- ``gpu+tps``: ``gpu`` with a driver thread per stream (``thread_per_stream``) instead of one
  per GPU: without graphs every kernel is launched by the thread that runs the task;
- ``graphs``: the same, each (part, batch size) captured as a CUDA graph at warm-up (staronnx's
  default; ``gpu`` is run with ``--no-cuda-graphs``); the row records how many graphs the
  workers captured and replayed, and a "graphs" figure with none replayed fails its check;
- ``gpu+colo``/``graphs+colo``: ``gpu`` and ``graphs`` with the submitting thread on the CUDA
  driver's core (``Runtime.colocate``): whether colocation wins on a GPU, with and without
  graphs (without them the driver launches kernels outside the GIL, which a caller on another
  core overlaps), is what these rows say;
- ``gpu+cpu``: the same plan on the CUDA workers plus the CPU groups, dmda;
- ``split``: the papers' 85/15 METIS plan, heft, CUDA workers plus CPU groups;
- ``auto``: ``--shares auto`` (the split this machine's speeds call for), heft;
- ``cpu``: ORT alone on the CPU cores (what the CPU could add at most);

plus batch-1 latency (median of 30 single requests) for ort1 and each staronnx setup, and the
max relative error of every staronnx setup's outputs against plain ORT's on the same inputs.
Every staronnx plan is calibrated first (perf models under a fresh ``STARONNX_HOME``).  Each row
is written to the JSON (with the checks so far) as soon as it is measured, then printed, so a
run cut short keeps every row it measured; the end adds the acceptance checks (the ratios to
the best ortN, ...).

Models: ``googlenet`` and ``resnet50`` exported from torchvision (random weights, fp32, dynamic
batch) where torch is installed, else the repository's googlenet (``models/``).  ``--device cpu`` runs the
same harness with the CPU provider on a small model (CI's smoke test of this script).

Usage (GPU host): python benchmarks/gpu.py [--models googlenet,resnet50] [--batches 1,8,32]
                  [--seconds 3] [--streams 4] [--in-flight 16] [--setups graphs,gpu+cpu] [--json gpu.json]

Streams: 4 by default.  On an H200 (2026-11-28) googlenet at batch 1 ran 1,115 samples/s with 2
streams (graphs), 1,992 with 4 and 2,829 with 8, against 1,579-1,625 for 4 plain ORT sessions:
with 2 streams staronnx cannot reach ort4's concurrency, whatever its host cost.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).parent))
from _common import GOOGLENET, scratch_dir  # noqa: E402

from staronnx import Runtime, partition  # noqa: E402
from staronnx.calibrate import calibrate  # noqa: E402
from staronnx.partition.autoshares import median_seconds  # noqa: E402
from staronnx.perfmodels import PerfModelStore  # noqa: E402
from staronnx.workers.cudart import capture_safe  # noqa: E402
from staronnx.calibrate import start_workers  # noqa: E402
from staronnx.workers.topology import Topology  # noqa: E402

CUDA = "CUDAExecutionProvider"


# ---------------------------------------------------------------------- models
def export_torchvision(name: str, out: Path) -> Path:
    """torchvision's ``name`` with random weights as an fp32 ONNX model with a dynamic batch."""
    import torch
    import torchvision

    path = out / f"{name}.onnx"
    if path.exists():
        return path
    torch.manual_seed(0)
    kwargs = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
    net = getattr(torchvision.models, name)(weights=None, **kwargs).eval()
    x = torch.randn(1, 3, 224, 224)
    torch.onnx.export(net, x, str(path), input_names=["input"], output_names=["logits"], opset_version=17,
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False)
    return path


def tiny_conv(out: Path) -> Path:
    """A small conv net for ``--device cpu`` smoke runs."""
    from staronnx.zoo import inception

    path = out / "tiny.onnx"
    onnx.save(inception(blocks=2, channels=8, size=16), str(path))
    return path


def model_path(name: str, out: Path, device: str) -> Path:
    if device == "cpu":
        return tiny_conv(out)
    try:
        return export_torchvision(name, out)
    except ImportError:
        if name != "googlenet":
            raise SystemExit(f"{name}: torch/torchvision are not installed here, so it cannot be exported")
        return GOOGLENET


def inputs_for(path: Path, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in sess.get_inputs():
        shape = [batch if not isinstance(d, int) or k == 0 else d for k, d in enumerate(i.shape)]
        feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


# ---------------------------------------------------------------------- measuring
def closed_loop(submit: Callable[[], Future[Any]], wait: Callable[[Future[Any]], Any], in_flight: int,
                seconds: float) -> float:
    """Requests per second with ``in_flight`` outstanding for ``seconds`` (after a warm-up),
    each replaced as soon as it completes, in completion order (perf_analyzer's concurrency
    mode): waiting for them in submission order let one slow request (a batch a CPU group
    took) hold back the window while the GPU idled, which charged a mixed setup for the loop's
    order, not for its placement.  ``wait`` reads a completed future (raises its error)."""
    finished: queue.SimpleQueue[Future[Any]] = queue.SimpleQueue()

    def launch() -> None:
        submit().add_done_callback(finished.put)

    for _ in range(in_flight):  # warm-up
        launch()
    for _ in range(in_flight):
        wait(finished.get())
    done, start = 0, time.perf_counter()
    for _ in range(in_flight):
        launch()
    while time.perf_counter() - start < seconds:
        wait(finished.get())
        done += 1
        launch()
    for _ in range(in_flight):
        wait(finished.get())
        done += 1
    return done / (time.perf_counter() - start)


def ort_sessions(path: Path, n: int, device: str, threads: int | None = None) -> list[ort.InferenceSession]:
    """N plain sessions; on ``cuda``, refused unless ORT really runs them on its CUDA provider
    (a CUDA or cuDNN library it cannot load makes it fall back to the CPU with a log line
    only, and the ortN columns would then be CPU figures in a GPU table)."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    # TF32 off on both sides: outputs comparable to fp32 within 1e-3
    providers: list[Any] = ([(CUDA, {"use_tf32": "0"}), "CPUExecutionProvider"] if device == "cuda"
                            else ["CPUExecutionProvider"])
    with capture_safe():  # never breaks (nor is broken by) a graph staronnx captures meanwhile
        sessions = [ort.InferenceSession(str(path), so, providers=providers) for _ in range(n)]
    if device == "cuda":
        check_on_cuda(sessions[0])
    return sessions


def check_on_cuda(session: ort.InferenceSession) -> None:
    """Exit (one line) when ``session`` did not get ORT's CUDA provider."""
    got = session.get_providers()
    if not got or got[0] != CUDA:
        raise SystemExit(f"benchmarks/gpu.py: a plain ONNX Runtime session asked for {CUDA} runs on {got}: "
                         "ORT fell back to the CPU (a CUDA or cuDNN library it could not load; see its "
                         "warning above), so the ortN baselines would not be GPU figures")


def ort_throughput(sessions: list[ort.InferenceSession], feeds: dict[str, np.ndarray], seconds: float) -> float:
    """Batches/s of N sessions, one thread each calling run() in a loop."""
    for s in sessions:
        s.run(None, feeds)
    counts = [0] * len(sessions)
    stop = threading.Event()

    def loop(i: int) -> None:
        with capture_safe():
            while not stop.is_set():
                sessions[i].run(None, feeds)
                counts[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(sessions))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


class TunedSession:
    """One ORT session with a CUDA graph over device-bound inputs and outputs (ORT's documented
    call shape for ``enable_cuda_graph``: the addresses a graph reads and writes never move).

    ORT keeps a session's graphs per thread, so the first :meth:`run`, which captures (ORT 1.31
    runs, captures and replays in that call), must be on the thread that then calls it.
    ``outputs`` are the model's outputs for ``feeds`` (plain ORT's): their shapes and dtypes
    size the bound output buffers."""

    def __init__(self, path: Path, feeds: dict[str, np.ndarray], outputs: list[np.ndarray]) -> None:
        from staronnx.workers.cudart import PinnedBuffer, runtime_module

        so = ort.SessionOptions()
        so.log_severity_level = 3
        providers = [(CUDA, {"use_tf32": "0", "enable_cuda_graph": "1"}), "CPUExecutionProvider"]
        with capture_safe():
            self.session = ort.InferenceSession(str(path), so, providers=providers)
            check_on_cuda(self.session)
            rt = runtime_module()
            self._pinned = [PinnedBuffer(rt, a.nbytes) for a in feeds.values()]
            self.host: dict[str, np.ndarray] = {}
            for buf, (name, a) in zip(self._pinned, feeds.items(), strict=True):
                view = buf.view(a.dtype, a.shape)
                view[...] = a
                self.host[name] = view
            self.inputs = {name: ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0) for name, a in feeds.items()}
            self.outputs = [ort.OrtValue.ortvalue_from_shape_and_type(list(o.shape), o.dtype.type, "cuda", 0)
                            for o in outputs]
            self.binding = self.session.io_binding()
            for name, v in self.inputs.items():
                self.binding.bind_ortvalue_input(name, v)
            for o, v in zip(self.session.get_outputs(), self.outputs, strict=True):
                self.binding.bind_ortvalue_output(o.name, v)

    def run(self) -> np.ndarray:
        for name, v in self.inputs.items():
            v.update_inplace(self.host[name])
        self.session.run_with_iobinding(self.binding)
        return np.asarray(self.outputs[0].numpy())

    def close(self) -> None:
        for b in self._pinned:
            b.free()


def ort_tuned(path: Path, feeds: dict[str, np.ndarray], outputs: list[np.ndarray], n: int,
              seconds: float) -> tuple[float, np.ndarray]:
    """Batches/s of N :class:`TunedSession`s, one thread each; each thread captures its graph
    (one at a time: a capture in CUDA's global mode breaks on another thread's allocation), then
    all run together.  Also the first session's output, for the error column."""
    sessions = [TunedSession(path, feeds, outputs) for _ in range(n)]
    counts = [0] * n
    lock, ready, go, stop = threading.Lock(), threading.Barrier(n + 1), threading.Event(), threading.Event()
    first: list[np.ndarray] = []
    errors: list[BaseException] = []

    def loop(i: int) -> None:
        try:
            with lock, capture_safe():
                out = sessions[i].run()
                sessions[i].run()
                if i == 0:
                    first.append(out)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
        ready.wait()
        go.wait()
        if errors:
            return
        with capture_safe():
            while not stop.is_set():
                sessions[i].run()
                counts[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    go.set()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    for s in sessions:
        s.close()
    if errors:
        raise errors[0]
    return sum(counts) / elapsed, first[0]


def latency_ms(run: Callable[[], Any], n: int = 30) -> float:
    """Median of ``n`` single requests, after 3 untimed ones."""
    return 1e3 * median_seconds(run, n, warmup=3)


def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / max(float(np.abs(ref).max()), 1e-12))


# ---------------------------------------------------------------------- staronnx setups
def staronnx_setups(path: Path, tmp: Path, args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Plans (1 part, 85/15, auto) and the runtime settings of each setup."""
    streams = args.streams if args.device == "cuda" else 0
    cuda_dev = "cuda" if args.device == "cuda" else "cpu"
    say(f"{path.stem}: partitioning (1 part, 85/15, auto)")
    one = partition(path, parts=1, output_dir=tmp / f"{path.stem}-1", costs="estimate", device=cuda_dev)
    split = partition(path, [0.85, 0.15], output_dir=tmp / f"{path.stem}-85", device=cuda_dev, profile_runs=3)
    auto = partition(path, "auto", output_dir=tmp / f"{path.stem}-auto", device=cuda_dev, profile_runs=3,
                     groups=args.groups, cuda_streams=streams, profile_batch=8)
    say(f"{path.stem}: auto chose {auto.settings['auto_shares']['reason']}")
    setups = {
        "gpu": {"plan": one, "policy": "eager", "groups": "none", "cuda_streams": streams, "cuda_graphs": False},
        "gpu+cpu": {"plan": one, "policy": "dmda", "groups": args.groups, "cuda_streams": streams},
        "split": {"plan": split, "policy": "heft", "groups": args.groups, "cuda_streams": streams},
        "auto": {"plan": auto, "policy": "heft", "groups": args.groups, "cuda_streams": streams},
    }
    if args.device == "cpu":  # no GPU: "gpu" is the CPU groups alone, like gpu+cpu with eager
        setups["gpu"]["groups"] = args.groups
    else:  # the GPU alone with each (part, batch size) captured as a CUDA graph
        setups["graphs"] = {"plan": one, "policy": "eager", "groups": "none", "cuda_streams": streams,
                            "cuda_graphs": True}
        for label, base in (("gpu+colo", "gpu"), ("graphs+colo", "graphs")):
            setups[label] = {**setups[base], "colocate": True}
        # no graphs, a driver thread per stream (StarPU's STARPU_CUDA_THREAD_PER_WORKER): without
        # graphs ORT's run launches every kernel from the calling thread, so one driver for all
        # streams serialises them (the H200's "gpu" read 648 samples/s at batch 1 with 4 streams,
        # ort4 1,625)
        setups["gpu+tps"] = {**setups["gpu"], "thread_per_stream": True}
    keep = [x for x in args.setups.split(",") if x] if args.setups else list(setups)
    unknown = sorted(set(keep) - set(setups))
    if unknown:
        raise SystemExit(f"--setups: unknown {', '.join(unknown)} (have {', '.join(setups)})")
    return {label: setups[label] for label in keep}


def calibrate_setups(setups: dict[str, dict[str, Any]], batches: list[int], store: PerfModelStore,
                     say: Callable[[str], None]) -> None:
    done: set[tuple[str, str, int]] = set()
    for name, s in setups.items():
        key = (s["plan"].hash, s["groups"], s["cuda_streams"])
        if key in done:
            continue
        done.add(key)
        say(f"calibrating {name} ({s['plan'].k} part(s), groups {s['groups']}, {s['cuda_streams']} stream(s))")
        workers = start_workers(s["plan"], groups=s["groups"], cuda_streams=s["cuda_streams"])
        try:
            calibrate(s["plan"], batches, workers=workers, store=store, max_runs=30)
        finally:
            for w in workers:
                w.close()


def measure_model(name: str, args: argparse.Namespace, tmp: Path, say: Callable[[str], None],
                  record: Callable[[dict[str, Any]], None]) -> None:
    """Every batch size's row of ``name``, each handed to ``record`` as soon as it is
    measured."""
    path = model_path(name, tmp, args.device)
    store = PerfModelStore(tmp / "home")
    setups = staronnx_setups(path, tmp, args, say)
    calibrate_setups(setups, args.batches, store, say)
    ncores = len(Topology.from_system().allowed_cores())
    for b in args.batches:
        feeds = inputs_for(path, b)
        row: dict[str, Any] = {"model": name, "batch": b}
        outputs = ort_sessions(path, 1, args.device)[0].run(None, feeds)
        ref = outputs[0]
        for n in (1, 2, 4):
            say(f"{name} b={b}: ort{n}")
            row[f"ort{n}"] = b * ort_throughput(ort_sessions(path, n, args.device), feeds, args.seconds)
        say(f"{name} b={b}: cpu alone")
        row["cpu"] = b * ort_throughput(ort_sessions(path, 1, "cpu", threads=max(ncores - args.streams, 1)),
                                        feeds, min(args.seconds, 2.0))
        row["errors"] = {}
        if args.device == "cuda":
            for n in (1, 2, 4):
                say(f"{name} b={b}: ort-tuned{n}")
                try:
                    rate, tuned_out = ort_tuned(path, feeds, outputs, n, args.seconds)
                except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is a row note
                    row.setdefault("notes", []).append(f"ort-tuned{n}: {type(exc).__name__}: {exc}")
                    continue
                row[f"ort-tuned{n}"] = b * rate
                row.setdefault("tuned_errors", {})[f"ort-tuned{n}"] = rel_error(tuned_out, ref)
            if b == 1 and "ort-tuned1" in row:
                tuned = TunedSession(path, feeds, outputs)
                try:  # on this thread: its own graph, captured by the first (untimed) runs
                    with capture_safe():
                        row["ort-tuned1_lat_ms"] = latency_ms(tuned.run)
                finally:
                    tuned.close()
        for label, s in setups.items():
            say(f"{name} b={b}: staronnx {label}")
            cuda_options = ({"provider_options": {"use_tf32": "0"}, "cuda_graphs": s.get("cuda_graphs", True),
                             "thread_per_stream": s.get("thread_per_stream", False)}
                            if s["cuda_streams"] else None)
            trace = (args.trace / f"trace-{name}-{label.replace('+', '_')}-b{b}.json"
                     if args.trace is not None and label in args.trace_setups else None)
            if trace is not None:  # its figure paid for the trace's spans: the row says so
                row.setdefault("traced", []).append(label)
            with Runtime(s["plan"], policy=s["policy"], cpu_groups=s["groups"], cuda_streams=s["cuda_streams"],
                         store=store, cuda_options=cuda_options, warmup=(b,) if s["cuda_streams"] else (),
                         trace=trace) as rt:
                out = rt.run(feeds)
                row["errors"][label] = rel_error(next(iter(out.values())), ref)
                with rt.colocate() if s.get("colocate") else contextlib.nullcontext():
                    row[label] = b * closed_loop(lambda: rt.submit(feeds), lambda f: f.result(), args.in_flight,
                                                 args.seconds)
                    if b == 1:
                        row[f"{label}_lat_ms"] = latency_ms(lambda: rt.run(feeds))
                graphs = [w.get("graphs") for w in rt.stats()["workers"].values() if w.get("graphs")]
                if graphs:  # what the figure really measured: graphs replayed or not
                    row.setdefault("graph_stats", {})[label] = {k: sum(g[k] for g in graphs) for k in graphs[0]}
        if b == 1:
            sess = ort_sessions(path, 1, args.device)[0]
            row["ort1_lat_ms"] = latency_ms(lambda: sess.run(None, feeds))
        record(row)


# ---------------------------------------------------------------------- report
TUNED = ["ort-tuned1", "ort-tuned2", "ort-tuned4"]
COLUMNS = ["ort1", "ort2", "ort4", *TUNED, "gpu", "gpu+tps", "graphs", "gpu+colo", "graphs+colo", "gpu+cpu", "split",
           "auto", "cpu"]
STARONNX = ["gpu", "gpu+tps", "graphs", "gpu+colo", "graphs+colo", "gpu+cpu", "split", "auto"]


def gpu_alone(row: dict[str, Any]) -> str:
    """The column gpu+cpu is weighed against: the GPU alone with gpu+cpu's graph setting
    (graphs on), else ``gpu`` (a run without the graphs setup: ``--device cpu``, ``--setups``)."""
    return "graphs" if "graphs" in row else "gpu"


def format_row(row: dict[str, Any]) -> str:
    best_ort = max(row[c] for c in ("ort1", "ort2", "ort4"))
    best = max(row.get(c, 0.0) for c in STARONNX)
    cells = " | ".join(f"{row[c]:,.0f}" if c in row else "-" for c in COLUMNS)
    tuned = max((row[c] for c in TUNED if c in row), default=0.0)
    alone = gpu_alone(row)
    mixed = f"{row['gpu+cpu'] / row[alone]:.2f}" if alone in row and "gpu+cpu" in row else "-"
    return (f"| {row['model']} | {row['batch']} | {cells} | {best / best_ort:.2f}x | "
            f"{f'{best / tuned:.2f}x' if tuned else '-'} | {mixed} | {max(row['errors'].values()):.1e} |")


def header() -> str:
    cols = " | ".join(COLUMNS)
    return (f"| model | batch | {cols} | best staronnx / best ortN | / best ort-tuned | gpu+cpu / GPU alone "
            "| max rel err |\n" + "|" + "---|" * (len(COLUMNS) + 6))


def checks(rows: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """Issue 11's acceptance, as (statement, held)."""
    out = []
    for r in rows:
        best_ort = max(r[c] for c in ("ort1", "ort2", "ort4"))
        best = max(r.get(c, 0.0) for c in STARONNX)
        goal = 1.15 if r["batch"] <= 8 else 1.0
        out.append((f"{r['model']} b={r['batch']}: best staronnx {best / best_ort:.2f}x best ortN (>= {goal})",
                    best >= goal * best_ort))
        tuned = max((r[c] for c in TUNED if c in r), default=0.0)
        if tuned:
            out.append((f"{r['model']} b={r['batch']}: best staronnx {best / tuned:.2f}x best ort-tuned (>= 0.95)",
                        best >= 0.95 * tuned))
        alone = gpu_alone(r)
        if alone in r and "gpu+cpu" in r:
            out.append((f"{r['model']} b={r['batch']}: gpu+cpu {r['gpu+cpu'] / r[alone]:.2f}x the GPU alone "
                        f"({alone}, >= 0.98)", r["gpu+cpu"] >= 0.98 * r[alone]))
        for label, g in r.get("graph_stats", {}).items():
            out.append((f"{r['model']} b={r['batch']}: {label} replayed {g['replays']} CUDA graphs "
                        f"({g['captured']} captured, {g['failed']} failed)", g["replays"] > 0 and not g["failed"]))
        err = max(r["errors"].values())
        out.append((f"{r['model']} b={r['batch']}: max relative error {err:.1e} (< 1e-3)", err < 1e-3))
        if "ort1_lat_ms" in r:
            lat = min(r[f"{c}_lat_ms"] for c in STARONNX if f"{c}_lat_ms" in r)
            out.append((f"{r['model']} b=1: best staronnx latency {lat:.2f} ms vs ort1 {r['ort1_lat_ms']:.2f} ms",
                        lat <= r["ort1_lat_ms"]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="googlenet,resnet50")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--streams", type=int, default=4, help="CUDA workers (streams) on the GPU (ort4 runs 4 sessions)")
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--setups", default="", help="the staronnx setups to run, comma-separated (default: all)")
    ap.add_argument("--trace", type=Path, default=None,
                    help="a folder: a Perfetto trace of each --trace-setups setup at each batch size (where the "
                         "time goes: each worker's tasks, the gaps between them)")
    ap.add_argument("--trace-setups", default="graphs,gpu+cpu", help="the setups --trace records")
    ap.add_argument("--groups", default="numa", help="CPU groups beside the GPU (a core per stream is held back)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json", type=Path, default=Path("gpu-benchmark.json"))
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.trace_setups = {x for x in args.trace_setups.split(",") if x}
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda" and CUDA not in ort.get_available_providers():
        print(f"benchmarks/gpu.py needs onnxruntime-gpu's {CUDA} (this onnxruntime has "
              f"{', '.join(ort.get_available_providers())}); use --device cpu for a smoke run", file=sys.stderr)
        return 2
    say = lambda msg: print(f"  .. {msg}", file=sys.stderr, flush=True)  # noqa: E731
    tmp = scratch_dir("staronnx-gpu-bench-")
    os.environ.setdefault("STARONNX_HOME", str(tmp / "home"))
    gpus: list[dict[str, Any]] = []
    if args.device == "cuda":  # which GPU these figures are of (model, memory, capability, UUID)
        from staronnx.workers.cuda import describe_gpus

        gpus = describe_gpus([0])
    print(f"device {args.device}, {args.streams} CUDA stream(s), CPU groups {args.groups}, "
          f"{args.in_flight} requests in flight, {args.seconds:g} s per figure; samples/s", flush=True)
    for g in gpus:
        print(f"GPU cuda{g['device']}: {g['name']}, capability {g['capability']}, {g['sms']} SMs", flush=True)
    print(header(), flush=True)
    rows: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        write_results(args, gpus, rows)  # first: a run cut short keeps every row it measured
        print(format_row(row), flush=True)

    for name in args.models.split(","):
        measure_model(name.strip(), args, tmp, say, record)
    print()
    for text, held in checks(rows):
        print(f"{'PASS' if held else 'FAIL'}  {text}")
    write_results(args, gpus, rows)
    print(f"wrote {args.json}")
    return 0


def write_results(args: argparse.Namespace, gpus: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """The JSON of the rows measured so far, with their checks."""
    from staronnx.fsutil import atomic_write_text

    atomic_write_text(args.json, json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                             "gpus": gpus, "rows": rows, "checks": checks(rows)}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
