"""In-process serving vs the same plan behind ``staronnx serve`` (HTTP binary and gRPC), side by side.

googlenet cut in two, batch-1 requests from ``--clients`` closed-loop clients, batches of up to
``--batch`` formed by the dynamic batcher (``--max-delay``). Three paths:

* in-process: ``Server(Runtime(plan))`` and the clients in one process;
* HTTP binary: ``staronnx serve`` in a subprocess, tritonclient.http.aio with binary tensors;
* gRPC: the same server, tritonclient.grpc.aio.

Measured fairly on a small machine, where the clients' CPU time competes with the server's:

* every path's load comes from a **client process of its own**, started the same way and running
  the same asyncio closed loop (``--clients`` coroutines, each awaiting its answer before
  sending again; in process they await ``Server.submit``'s future, over the network
  tritonclient's aio call), so no path's clients share a GIL with the measuring script;
* the paths are measured **in turn, ``--rounds`` times** (``_common.alternate``), and the
  figures are medians over the rounds, so a machine whose load drifts hits every path alike;
  the ratio to in-process is also given per round (each network row over the in-process row
  of the same round), whose median is the figure the goal is judged on;
* on a machine shared with other work, throughput follows the CPU the others leave, which
  changes within seconds; so each row also measures the **CPU time a sample costs** (the
  client process, plus the server process for the network rows, over the measured window).
  Its ratio (in-process CPU per sample / network CPU per sample) is the share of in-process
  throughput the server keeps when CPU-bound, whatever else runs: the goal's second reading.

Each row gives throughput (samples/s, median over rounds), its ratio to in-process, p50/p99
latency (over every round's requests) and the latency the network path adds over in-process.
The closing lines say whether the goal (>= 0.9x in-process at batch 8) is met.

    .venv/bin/python benchmarks/serve.py [--seconds 8] [--rounds 3] [--clients 16] [--batch 8] [--max-delay 2ms]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GOOGLENET, alternate, scratch_dir  # noqa: E402

PATHS = ("in-process", "HTTP binary", "gRPC")
GOAL = 0.9


# -- the client process (one per row and round) -------------------------------------------------
def cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system) used so far by this process, plus by process ``pid`` if given."""
    own = time.process_time()
    if not pid:
        return own
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return own + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served_counts(metrics_url: str) -> tuple[float, float]:
    """(samples, batches) the server has run so far, from its Triton counters."""
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    counts = {m.group(1): float(m.group(2))
              for m in re.finditer(r'^nv_inference_(count|exec_count)\{model="googlenet"[^}]*\} (\S+)$', text, re.M)}
    return counts.get("count", 0.0), counts.get("exec_count", 0.0)


async def closed_loop(call: Callable[[], Awaitable[None]], clients: int, seconds: float,
                      warmup: float, server_pid: int | None = None,
                      batches: Callable[[], tuple[float, float]] | None = None) -> dict[str, object]:
    """``clients`` coroutines calling ``call()`` back to back; samples/s and latencies (s) measured
    over ``seconds`` after ``warmup`` (a request counts if it started and ended inside), and the
    CPU seconds this process and the server's spent in that window (``cpu_s``): what a sample
    costs in CPU, which other load on the machine does not change the way it changes throughput."""
    loop = asyncio.get_running_loop()
    start_at = loop.time() + warmup
    stop_at = start_at + seconds
    lats: list[float] = []
    cpu: list[float] = []
    counted: list[tuple[float, float]] = []

    async def meter() -> None:
        for at in (start_at, stop_at):
            await asyncio.sleep(max(at - loop.time(), 0.0))
            cpu.append(cpu_seconds(server_pid))
            if batches is not None:
                counted.append(batches())

    async def client() -> None:
        while True:
            t0 = loop.time()
            if t0 >= stop_at:
                return
            await call()
            t1 = loop.time()
            if t0 >= start_at and t1 <= stop_at:
                lats.append(t1 - t0)

    await asyncio.gather(meter(), *(client() for _ in range(clients)))
    mean_batch = float("nan")
    if len(counted) == 2 and counted[1][1] > counted[0][1]:
        mean_batch = (counted[1][0] - counted[0][0]) / (counted[1][1] - counted[0][1])
    return {"throughput": len(lats) / seconds, "latencies": lats, "cpu_s": cpu[1] - cpu[0],
            "cpu_ms_per_sample": (cpu[1] - cpu[0]) * 1e3 / max(len(lats), 1), "mean_batch": mean_batch}


def client_main(args: argparse.Namespace) -> int:
    """Run one row's load and print its figures as one JSON line."""
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)

    async def in_process() -> dict[str, object]:
        from staronnx.durations import parse_duration
        from staronnx.runtime.runtime import Runtime
        from staronnx.serving import Server

        with Runtime(args.plan, policy=args.policy, cpu_groups=args.groups) as rt, \
                Server(rt, args.batch, max_delay=parse_duration(args.max_delay, allow_zero=True)) as server:
            async def call() -> None:
                await asyncio.wrap_future(server.submit({"input": x}))

            def counts() -> tuple[float, float]:  # the server's records, as the Triton counters count
                records = server.records()
                done = [b for b in records.batches if b.done is not None]
                return float(sum(b.size for b in done)), float(len(done))
            return await closed_loop(call, args.clients, args.seconds, args.warmup, args.server_pid, counts)

    async def http() -> dict[str, object]:
        import tritonclient.http as thttp
        import tritonclient.http.aio as aio

        inp = thttp.InferInput("input", [1, 3, 224, 224], "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        out = [thttp.InferRequestedOutput("logits", binary_data=True)]
        async with aio.InferenceServerClient(args.address, conn_limit=args.clients) as client:
            async def call() -> None:
                (await client.infer("googlenet", [inp], outputs=out)).as_numpy("logits")
            return await closed_loop(call, args.clients, args.seconds, args.warmup, args.server_pid,
                                     lambda: served_counts(args.metrics))

    async def grpc() -> dict[str, object]:
        import tritonclient.grpc as tgrpc
        import tritonclient.grpc.aio as aio

        inp = tgrpc.InferInput("input", [1, 3, 224, 224], "FP32")
        inp.set_data_from_numpy(x)
        async with aio.InferenceServerClient(args.address) as client:
            async def call() -> None:
                (await client.infer("googlenet", [inp])).as_numpy("logits")
            return await closed_loop(call, args.clients, args.seconds, args.warmup, args.server_pid,
                                     lambda: served_counts(args.metrics))

    result = asyncio.run({"in-process": in_process, "HTTP binary": http, "gRPC": grpc}[args.client]())
    print(json.dumps(result))
    return 0


# -- the driver ------------------------------------------------------------------------------
def start_server(plan: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str, str, str]:
    cmd = [sys.executable, "-m", "staronnx", "serve", str(plan), "--name", "googlenet", "--http-port", "0",
           "--grpc-port", "0", "--metrics-port", "0", "--batch-size", str(args.batch), "--max-delay", args.max_delay,
           "--groups", args.groups, "--policy", args.policy]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ})
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("ready"):
            break
    else:
        raise SystemExit("server did not start:\n" + "".join(lines))
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
    text = "".join(lines)
    http = re.search(r"HTTP \(KServe v2\) on http://([\d.]+:\d+)", text).group(1)
    grpc_addr = re.search(r"gRPC \(KServe v2\) on ([\d.]+:\d+)", text).group(1)
    metrics = re.search(r"metrics on (http://[\d.]+:\d+/metrics)", text).group(1)
    return proc, http, grpc_addr, metrics


def run_client(path: str, plan: Path, address: str, args: argparse.Namespace,
               server_pid: int | None, metrics: str) -> dict[str, object]:
    cmd = [sys.executable, __file__, "--client", path, "--plan", str(plan), "--address", address,
           *(["--server-pid", str(server_pid), "--metrics", metrics] if server_pid else []),
           "--seconds", str(args.seconds), "--warmup", str(args.warmup), "--clients", str(args.clients),
           "--batch", str(args.batch), "--max-delay", args.max_delay, "--groups", args.groups,
           "--policy", args.policy]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ}, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{path} client failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=GOOGLENET)
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per row and round")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three rows, taken in turn")
    ap.add_argument("--clients", type=int, default=16, help="closed-loop clients (>= 2 x batch fills batches)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-delay", default="2ms")
    ap.add_argument("--groups", default="numa")
    ap.add_argument("--policy", default="heft")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--client", choices=PATHS, help=argparse.SUPPRESS)  # internal: one row's load
    ap.add_argument("--plan", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--address", default="", help=argparse.SUPPRESS)
    ap.add_argument("--server-pid", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--metrics", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        return client_main(args)
    if not args.model.exists():
        print(f"skipped: {args.model} not found")
        return 0

    from staronnx import partition

    tmp = scratch_dir("staronnx-serve-bench-")
    plan = partition(args.model, [0.85, 0.15], output_dir=tmp / "plan", costs="estimate")
    print(f"googlenet, {plan.k} parts, batch-1 requests from {args.clients} closed-loop clients (own process per "
          f"row), batches of up to {args.batch} (max delay {args.max_delay}), {args.seconds:g} s per row, "
          f"{args.rounds} rounds in turn, {os.cpu_count()} cores", flush=True)

    proc, http, grpc_addr, metrics_url = start_server(plan.root, args)
    addresses = {"in-process": "", "HTTP binary": http, "gRPC": grpc_addr}
    runs: dict[str, list[dict[str, object]]] = {p: [] for p in PATHS}

    def measure(path: str) -> Callable[[], float]:
        def once() -> float:
            r = run_client(path, plan.root, addresses[path], args, None if path == "in-process" else proc.pid,
                           metrics_url)
            runs[path].append(r)
            print(f"  round {len(runs[path])}: {path:<12} {r['throughput']:8.1f} samples/s, "
                  f"{r['cpu_ms_per_sample']:6.1f} CPU ms/sample, mean batch {r['mean_batch']:.1f}", flush=True)
            return float(r["throughput"])
        return once

    try:
        medians = alternate({p: measure(p) for p in PATHS}, args.rounds)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)

    base = medians["in-process"]
    base_lat = np.concatenate([np.asarray(r["latencies"]) for r in runs["in-process"]])
    b50, b99 = (float(np.percentile(base_lat, q) * 1e3) for q in (50, 99))
    report: dict[str, dict[str, float]] = {}
    base_cpu = statistics.median(float(r["cpu_ms_per_sample"]) for r in runs["in-process"])
    print(f"\n{'path':<12} {'samples/s':>10} {'x in-proc':>10} {'x per round':>12} {'CPU ms/smp':>11} "
          f"{'x by CPU':>9} {'batch':>6} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8}")
    for path in PATHS:
        lat = np.concatenate([np.asarray(r["latencies"]) for r in runs[path]])
        p50, p99 = (float(np.percentile(lat, q) * 1e3) for q in (50, 99))
        per_round = statistics.median(float(r["throughput"]) / float(b["throughput"])
                                      for r, b in zip(runs[path], runs["in-process"]))
        cpu = statistics.median(float(r["cpu_ms_per_sample"]) for r in runs[path])
        batch = statistics.median(float(r["mean_batch"]) for r in runs[path])
        report[path] = {"throughput": medians[path], "ratio": medians[path] / base, "ratio_per_round": per_round,
                        "cpu_ms_per_sample": cpu, "ratio_by_cpu": base_cpu / cpu, "mean_batch": batch,
                        "p50_ms": p50, "p99_ms": p99, "added_p50_ms": p50 - b50, "added_p99_ms": p99 - b99,
                        "rounds": [float(r["throughput"]) for r in runs[path]]}
        print(f"{path:<12} {medians[path]:>10.1f} {medians[path] / base:>10.2f} {per_round:>12.2f} {cpu:>11.1f} "
              f"{base_cpu / cpu:>9.2f} {batch:>6.1f} {p50:>8.1f} "
              f"{p99:>8.1f} {p50 - b50:>+8.1f} {p99 - b99:>+8.1f}")
    print(f"\nserver exit code after SIGTERM: {rc}")
    for path in PATHS[1:]:
        ratio, by_cpu = report[path]["ratio_per_round"], report[path]["ratio_by_cpu"]
        print(f"goal (>= {GOAL}x in-process at batch {args.batch}): {path} {ratio:.2f}x throughput per round "
              f"({'met' if ratio >= GOAL else 'NOT met'}), {by_cpu:.2f}x by CPU per sample "
              f"({'met' if by_cpu >= GOAL else 'NOT met'})")
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "rows": report},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
