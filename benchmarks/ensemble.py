"""Where the CPUs pay (issue 50, item 3): a pipeline of real models served three ways, side by side.

One ``staronnx serve --model-repository`` process serves the members of a pipeline
(``benchmarks/_ensemble_repo.py``: by default ``text_reader``, ``unet_seg`` -> ``text_mask`` ->
``crnn_ocr`` -> ``ctc_greedy``, two real models) and two ensembles of them, on explicit CPU
groups (``--groups``, default two groups of one core: the light members free to run on their
own group while the heavy one runs on the other). Three columns, measured in alternated rounds:

* ``graph``: staronnx's ensemble, one task graph per request (or batch) over every member's
  parts, placed together by the policy, intermediates left where they were produced;
* ``steps``: the same ensemble with ``ensemble_mode: "steps"``, each step a request of its own
  through its member's own batcher, as Triton schedules an ensemble;
* ``chain``: no ensemble: the client sends each member its request in turn and carries the
  tensors between them.

Per column: throughput at ``--inflight`` requests in flight (closed loop, ``--seconds`` a round),
and p50/p99 at one fixed rate (open loop: ``--rate``, default half the slowest column's median
throughput), median and range over ``--rounds`` rounds; with ``--p99-target-ms T``, also the
highest rate each column serves within a p99 of T (``--target-steps`` rates per column). The
closing line compares graph with steps (the issue's goal: at least 1.2x the throughput at the
same p99 target on the 2-core VM).
After the rounds the server stops, and the ensemble's plan runs alone on a runtime with the same
groups and policy for ``--trace-seconds`` with a trace: where the policy put each member's parts
(per worker), a Perfetto trace and a Gantt chart written beside the results.

With ``--cuda-streams N`` the server (and the trace's runtime) has CUDA workers too, so the
heavy member can run on the GPU while the light ones take the CPU groups: the GPU variant, for
``benchmarks/gpu_session.sh``.

    .venv/bin/python benchmarks/ensemble.py [--seconds 10] [--rounds 3] [--groups '0;1'] [--pipeline text_reader]

Writes ``benchmarks/results/ensemble-<date>.json`` (``--out``): every repeat, the machine, the
versions, the commit and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ensemble_repo as er  # noqa: E402
from _common import REPO, git_dirty, git_head, scratch_dir, start_serve, summary  # noqa: E402

COLUMNS = ("graph", "steps", "chain")

#: pipeline -> (input name, datatype, member chain as (member, its input, its output))
PIPELINES: dict[str, tuple[str, str, list[tuple[str, str, str]]]] = {
    "text_reader": ("IMAGE", "FP32", [("unet_seg", "image", "logits"), ("text_mask", "logits", "prob"),
                                      ("crnn_ocr", "image", "log_probs"), ("ctc_greedy", "log_probs", "ids")]),
    "seg_pipeline": ("RAW", "UINT8", [("preprocess", "raw", "image"), ("unet_seg", "image", "logits"),
                                      ("text_mask", "logits", "prob")]),
}


def write_repository(root: Path, pipeline: str) -> Path:
    """The members, the pipeline's ensemble (one task graph) and its step-by-step twin."""
    config = er.ENSEMBLES[pipeline]
    steps = config.replace(f'"{pipeline}"', f'"{pipeline}_steps"').replace(
        "ensemble_scheduling", 'parameters { key: "ensemble_mode" value: { string_value: "steps" } }\n'
                               "ensemble_scheduling", 1)
    er.write_repository(root, {pipeline: config, f"{pipeline}_steps": steps})
    return root


def request(pipeline: str, width: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if pipeline == "text_reader":
        return er.text_image(rng, 1, width)
    return er.raw_image(rng, 1, 64, width)


class Server:
    """``staronnx serve`` in a subprocess, on free ports; its output lines kept."""

    def __init__(self, repo: Path, home: Path, args: argparse.Namespace) -> None:
        cmd = [sys.executable, "-m", "staronnx", "serve", "--model-repository", str(repo), "--http-port", "0",
               "--grpc-port", "0", "--metrics-port", "0", "--groups", args.groups, "--policy", args.policy,
               "--batch-size", str(args.batch_size), "--max-delay", args.max_delay,
               "--cuda-streams", str(args.cuda_streams), "--drain-timeout", "10s", *shlex.split(args.server_args)]
        env = {**os.environ, "STARONNX_HOME": str(home), "PYTHONPATH": str(REPO)}
        self.served = start_serve(cmd, env, timeout=300)
        self.lines, self.grpc, self.http = self.served.lines, self.served.grpc, self.served.http

    def plan_of(self, model: str) -> str:
        line = next(x for x in self.lines if x.startswith(f"model {model!r}"))
        return re.search(r"plan (\S+) \(", line).group(1)  # type: ignore[union-attr]

    def stop(self) -> int:
        return self.served.stop(60)


def caller(server: Server, pipeline: str, column: str, feed: np.ndarray) -> Callable[[], None]:
    """One request of ``column`` (its own gRPC client: one per client thread)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc)
    name, datatype, chain = PIPELINES[pipeline]

    def infer(model: str, tensor: str, value: np.ndarray, dtype: str, output: str) -> np.ndarray:
        t = grpcclient.InferInput(tensor, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        out = client.infer(model, [t], outputs=[grpcclient.InferRequestedOutput(output)]).as_numpy(output)
        assert out is not None
        return out

    if column in ("graph", "steps"):
        model = pipeline if column == "graph" else f"{pipeline}_steps"
        output = "IDS" if pipeline == "text_reader" else "PROB"

        def whole() -> None:
            infer(model, name, feed, datatype, output)

        return whole

    def chained() -> None:
        value, dtype = feed, datatype
        for member, tensor, output in chain:
            value = infer(member, tensor, value, dtype, output)
            dtype = {"float32": "FP32", "int64": "INT64", "uint8": "UINT8"}[value.dtype.name]

    return chained


def closed_loop(server: Server, pipeline: str, column: str, feed: np.ndarray, inflight: int,
                seconds: float) -> float:
    """Requests per second with ``inflight`` clients each sending its next request on an answer."""
    calls = [caller(server, pipeline, column, feed) for _ in range(inflight)]
    done = [0] * inflight
    stop = time.perf_counter() + seconds

    def loop(i: int) -> None:
        while time.perf_counter() < stop:
            calls[i]()
            done[i] += 1

    start = time.perf_counter()
    on_threads(loop, inflight, column)
    return sum(done) / (time.perf_counter() - start)


def on_threads(work: Callable[[int], None], count: int, column: str) -> None:
    """``work(i)`` on ``count`` threads at once, until each returns; a request that failed on
    any of them ends the benchmark, naming the column."""
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # noqa: BLE001 - reported once every thread has ended
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"{column}: a request failed: {errors[0]}")


def open_loop(server: Server, pipeline: str, column: str, feed: np.ndarray, rate: float, seconds: float,
              senders: int = 16) -> dict[str, float]:
    """Latency (ms, from each request's scheduled time) at a constant ``rate`` for ``seconds``."""
    calls = [caller(server, pipeline, column, feed) for _ in range(senders)]
    n = max(1, int(rate * seconds))
    start = time.perf_counter() + 0.05
    latencies: list[float] = []
    lock = threading.Lock()
    next_index = [0]

    def sending(i: int) -> None:
        while True:
            with lock:
                k = next_index[0]
                next_index[0] += 1
            if k >= n:
                return
            due = start + k / rate
            time.sleep(max(0.0, due - time.perf_counter()))
            calls[i]()
            with lock:
                latencies.append((time.perf_counter() - due) * 1e3)

    on_threads(sending, senders, column)
    arr = np.array(latencies)
    return {"p50_ms": float(np.percentile(arr, 50)), "p99_ms": float(np.percentile(arr, 99)),
            "achieved_per_s": len(arr) / max(time.perf_counter() - start, 1e-9)}


def at_p99_target(server: Server, args: argparse.Namespace, feed: np.ndarray,
                  closed: dict[str, list[float]]) -> dict[str, Any]:
    """Per column, the highest offered rate whose p99 stays within ``--p99-target-ms``: rates
    from a quarter of the column's closed-loop throughput up to all of it (``--target-steps``
    of them), the columns alternated at each step; the median over rounds of the best rate met."""
    steps = [0.25 + 0.75 * i / max(1, args.target_steps - 1) for i in range(args.target_steps)]
    best: dict[str, list[float]] = {c: [] for c in COLUMNS}
    points: dict[str, list[dict[str, float]]] = {c: [] for c in COLUMNS}
    for _ in range(args.rounds):
        met = {c: 0.0 for c in COLUMNS}
        for fraction in steps:
            for column in COLUMNS:
                rate = fraction * statistics.median(closed[column])
                lat = open_loop(server, args.pipeline, column, feed, rate, args.seconds)
                points[column].append({"rate_per_s": rate, **lat})
                if lat["p99_ms"] <= args.p99_target_ms:
                    met[column] = max(met[column], lat["achieved_per_s"])
        for column in COLUMNS:
            best[column].append(met[column])
            print(f"{column:>5}: {met[column]:8.1f} req/s within p99 {args.p99_target_ms:g} ms")
    out: dict[str, Any] = {"target_ms": args.p99_target_ms, "best_per_s": best, "points": points,
                           "median_per_s": {c: statistics.median(v) for c, v in best.items()}}
    steps_best = out["median_per_s"]["steps"]
    out["graph_over_steps"] = out["median_per_s"]["graph"] / steps_best if steps_best else None
    return out


def trace_placement(plan_dir: str, args: argparse.Namespace, pipeline: str, feed: np.ndarray,
                    out: Path) -> dict[str, Any]:
    """Run the ensemble's plan alone on a runtime like the server's, with a trace: per worker,
    how many tasks of each member it ran; the trace and its Gantt chart written to ``out``."""
    from staronnx.plan import Plan
    from staronnx.runtime.gantt import plot_trace
    from staronnx.runtime.runtime import Runtime
    from staronnx.runtime.spec import RuntimeSpec
    from staronnx.workers.layout import MachineSpec

    plan = Plan.load(plan_dir)
    name = PIPELINES[pipeline][0]
    owner = {}
    first = 0
    for s in plan.settings.get("steps", []):
        for p in range(first, first + int(s["parts"])):
            owner[p] = s["label"]
        first += int(s["parts"])
    trace = out.with_suffix(".trace.json")
    runtime = Runtime(plan,
                      MachineSpec(groups=args.groups, cuda_streams=args.cuda_streams),
                      RuntimeSpec(policy=args.policy, trace=trace))
    try:
        stop = time.perf_counter() + args.trace_seconds
        pending: list[Any] = []
        while time.perf_counter() < stop:
            pending = [f for f in pending if not f.done()]
            while len(pending) < args.inflight:
                pending.append(runtime.submit({name: feed}))
            pending[0].result()
        for f in pending:
            f.result()
    finally:
        runtime.close()
    events = json.loads(Path(trace).read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    per_worker: dict[str, Counter[str]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "task":
            part = int(re.sub(r"\D", "", str(e["name"])) or 0)
            per_worker.setdefault(lanes.get(e["tid"], str(e["tid"])), Counter())[owner.get(part, str(part))] += 1
    gantt = None
    try:
        gantt = str(plot_trace(Path(trace), out.with_suffix(".gantt.png"), title=f"{pipeline}: one task graph"))
    except Exception as exc:  # noqa: BLE001 - no matplotlib: the trace alone
        print(f"no Gantt chart: {exc}")
    return {"trace": str(trace), "gantt": gantt,
            "tasks_per_worker": {w: dict(c) for w, c in sorted(per_worker.items())}}


def provenance(args: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime

    commit, dirty = git_head(), git_dirty()
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "cpus": os.cpu_count(),
            "affinity": sorted(os.sched_getaffinity(0)), "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(), "onnxruntime": onnxruntime.__version__, "numpy": np.__version__,
            "commit": commit, "dirty": dirty, "command": shlex.join([sys.executable, *sys.argv]),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline", choices=sorted(PIPELINES), default="text_reader")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds per column per round (each phase)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds per column before the rounds (perf models)")
    ap.add_argument("--inflight", type=int, default=4, help="requests in flight for the throughput")
    ap.add_argument("--rate", type=float, default=None, help="requests/s for the p99 (default: half the slowest "
                                                             "column's median throughput)")
    ap.add_argument("--groups", default="0;1", help="the server's --groups (default: two groups of one core)")
    ap.add_argument("--policy", default="dmda")
    ap.add_argument("--cuda-streams", type=int, default=0, help="CUDA workers per GPU (the GPU variant)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--server-args", default="", help="more options for staronnx serve, e.g. '--no-cuda-graphs'")
    ap.add_argument("--max-delay", default="1ms")
    ap.add_argument("--width", type=int, default=128, help="image width of every request (a multiple of 4)")
    ap.add_argument("--trace-seconds", type=float, default=2.0)
    ap.add_argument("--p99-target-ms", type=float, default=None,
                    help="also find, per column, the highest rate whose p99 stays within this target (the issue's "
                         "goal: graph >= 1.2x steps at the same p99 target)")
    ap.add_argument("--target-steps", type=int, default=5, help="rates tried per column for --p99-target-ms")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--note", default="", help="a note kept with the results (a loaded machine, a smoke run)")
    args = ap.parse_args()
    out = args.out or REPO / "benchmarks" / "results" / f"ensemble-{args.pipeline}-{time.strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    work = scratch_dir("staronnx-ensemble-bench-")
    repo = write_repository(work / "models", args.pipeline)
    feed = request(args.pipeline, args.width)
    result: dict[str, Any] = {"provenance": provenance(args), "note": args.note, "pipeline": args.pipeline,
                              "throughput_per_s": {c: [] for c in COLUMNS}, "latency": {c: [] for c in COLUMNS}}
    server = Server(repo, work / "home", args)
    try:
        result["server"] = next((x for x in server.lines if x.startswith("one runtime")), "")
        result["device"] = (f"{len(os.sched_getaffinity(0))} CPUs ({platform.processor() or platform.machine()}), "
                            f"groups {args.groups}" + (f", {args.cuda_streams} CUDA stream(s) per GPU"
                                                       if args.cuda_streams else ", no GPU"))
        print(f"{result['device']}; {result['server']}")
        for column in COLUMNS:  # the perf models learn every member's tasks before anything counts
            closed_loop(server, args.pipeline, column, feed, args.inflight, args.warmup)
        for r in range(args.rounds):
            for column in COLUMNS:
                rps = closed_loop(server, args.pipeline, column, feed, args.inflight, args.seconds)
                result["throughput_per_s"][column].append(rps)
                print(f"round {r + 1} {column:>5}: {rps:8.1f} req/s at {args.inflight} in flight")
        rate = args.rate or 0.5 * min(statistics.median(v) for v in result["throughput_per_s"].values())
        result["rate_per_s"] = rate
        for r in range(args.rounds):
            for column in COLUMNS:
                lat = open_loop(server, args.pipeline, column, feed, rate, args.seconds)
                result["latency"][column].append(lat)
                print(f"round {r + 1} {column:>5}: p50 {lat['p50_ms']:7.1f} ms, p99 {lat['p99_ms']:7.1f} ms at "
                      f"{rate:.1f} req/s")
        if args.p99_target_ms:
            result["at_p99_target"] = at_p99_target(server, args, feed, result["throughput_per_s"])
        plan_dir = server.plan_of(args.pipeline)
    finally:
        rc = server.stop()
        result["server_exit"] = rc
    result["summary"] = {c: {"throughput_per_s": summary(result["throughput_per_s"][c]),
                             "p99_ms": summary([x["p99_ms"] for x in result["latency"][c]]),
                             "p50_ms": summary([x["p50_ms"] for x in result["latency"][c]])} for c in COLUMNS}
    s = result["summary"]
    result["graph_over_steps"] = s["graph"]["throughput_per_s"]["median"] / s["steps"]["throughput_per_s"]["median"]
    result["graph_over_chain"] = s["graph"]["throughput_per_s"]["median"] / s["chain"]["throughput_per_s"]["median"]
    result["placement"] = trace_placement(plan_dir, args, args.pipeline, feed, out)
    out.write_text(json.dumps(result, indent=1, default=str))
    for c in COLUMNS:
        t, p = s[c]["throughput_per_s"], s[c]["p99_ms"]
        print(f"{c:>5}: {t['median']:8.1f} req/s ({t['min']:.1f}-{t['max']:.1f}), p99 {p['median']:7.1f} ms "
              f"({p['min']:.1f}-{p['max']:.1f}) at {rate:.1f} req/s")
    print(f"graph / steps throughput: {result['graph_over_steps']:.2f}x (goal >= 1.2x), graph / chain: "
          f"{result['graph_over_chain']:.2f}x; placement per worker: {result['placement']['tasks_per_worker']}")
    target = result.get("at_p99_target")
    if target is not None:
        ratio = target["graph_over_steps"]
        print(f"within p99 {target['target_ms']:g} ms: " + ", ".join(
            f"{c} {v:.1f} req/s" for c, v in target["median_per_s"].items())
              + (f"; graph / steps {ratio:.2f}x (goal >= 1.2x)" if ratio is not None else "; steps never met it"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
