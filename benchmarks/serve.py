"""In-process serving vs the same plan behind ``staronnx serve`` (HTTP binary and gRPC), side by side.

googlenet cut in two, batch-1 requests from ``--clients`` closed-loop client threads, batches of
up to ``--batch`` formed by the dynamic batcher (``--max-delay``). Three rows, one run:

* in-process: ``Server(Runtime(plan))`` and threads calling ``submit(...).result()``, measured
  first and last (the baseline is their mean, so drifting load on a shared machine hits both);
* HTTP binary: ``staronnx serve`` in a subprocess, tritonclient.http with binary tensors;
* gRPC: the same server, tritonclient.grpc.

Each row gives throughput (samples/s), its ratio to in-process, p50/p99 latency and the
latency the network path adds over in-process (p50 and p99 differences). The clients run on
the same host as the server, so on a small machine their CPU time is part of the price.

    .venv/bin/python benchmarks/serve.py [--seconds 10] [--clients 16] [--batch 8] [--max-delay 2ms]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GOOGLENET  # noqa: E402


def closed_loop(call: Callable[[int], Callable[[], None]], clients: int, seconds: float,
                warmup: float) -> tuple[float, np.ndarray]:
    """``clients`` threads, each calling its own ``call(i)()`` back to back; (samples/s, latencies s)."""
    stop_at = time.perf_counter() + warmup + seconds
    start_at = time.perf_counter() + warmup
    lats: list[list[float]] = [[] for _ in range(clients)]
    counts = [0] * clients

    def worker(i: int) -> None:
        fn = call(i)
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            fn()
            t1 = time.perf_counter()
            if t0 >= start_at and t1 <= stop_at:
                lats[i].append(t1 - t0)
                counts[i] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / seconds, np.array([x for row in lats for x in row])


def start_server(plan: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str, str]:
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
    http = re.search(r"http://([\d.]+:\d+)\n", text).group(1)
    grpc_addr = re.search(r"gRPC \(KServe v2\) on ([\d.]+:\d+)", text).group(1)
    return proc, http, grpc_addr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=GOOGLENET)
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per row")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--clients", type=int, default=16, help="closed-loop client threads (>= 2 x batch fills batches)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-delay", default="2ms")
    ap.add_argument("--groups", default="numa")
    ap.add_argument("--policy", default="heft")
    args = ap.parse_args(argv)
    if not args.model.exists():
        print(f"skipped: {args.model} not found")
        return 0

    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp

    from staronnx import partition
    from staronnx.bench.sweep import parse_duration
    from staronnx.runtime.runtime import Runtime
    from staronnx.serving import Server

    tmp = Path(tempfile.mkdtemp(prefix="staronnx-serve-bench-"))
    plan = partition(args.model, [0.85, 0.15], output_dir=tmp / "plan", costs="estimate")
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    rows: dict[str, tuple[float, np.ndarray]] = {}
    print(f"googlenet, {plan.k} parts, batch-1 requests from {args.clients} clients, batches of up to "
          f"{args.batch} (max delay {args.max_delay}), {args.seconds:g} s per row, {os.cpu_count()} cores", flush=True)

    def in_process() -> tuple[float, np.ndarray]:
        with Runtime(plan, policy=args.policy, cpu_groups=args.groups) as rt, \
                Server(rt, args.batch, max_delay=parse_duration(args.max_delay, allow_zero=True)) as server:
            return closed_loop(lambda i: (lambda: server.submit({"input": x}).result()),
                               args.clients, args.seconds, args.warmup)

    # in-process first and last, their mean the baseline: a shared machine's load drifts
    first = in_process()
    print("in-process done", flush=True)

    proc, http, grpc_addr = start_server(plan.root, args)
    try:
        def http_call(i: int) -> Callable[[], None]:
            c = thttp.InferenceServerClient(http)
            inp = thttp.InferInput("input", [1, 3, 224, 224], "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            out = [thttp.InferRequestedOutput("logits", binary_data=True)]
            return lambda: c.infer("googlenet", [inp], outputs=out).as_numpy("logits")

        def grpc_call(i: int) -> Callable[[], None]:
            c = tgrpc.InferenceServerClient(grpc_addr)
            inp = tgrpc.InferInput("input", [1, 3, 224, 224], "FP32")
            inp.set_data_from_numpy(x)
            return lambda: c.infer("googlenet", [inp]).as_numpy("logits")

        rows["HTTP binary"] = closed_loop(http_call, args.clients, args.seconds, args.warmup)
        print("HTTP done", flush=True)
        rows["gRPC"] = closed_loop(grpc_call, args.clients, args.seconds, args.warmup)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)

    last = in_process()
    rows = {"in-process 1": first, "in-process 2": last, **rows}
    base_thr, base_lat = (first[0] + last[0]) / 2, np.concatenate([first[1], last[1]])
    b50, b99 = (np.percentile(base_lat, q) * 1e3 for q in (50, 99))
    print(f"\n{'path':<12} {'samples/s':>10} {'x in-proc':>10} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8}")
    for name, (thr, lat) in rows.items():
        p50, p99 = (np.percentile(lat, q) * 1e3 for q in (50, 99))
        print(f"{name:<12} {thr:>10.1f} {thr / base_thr:>10.2f} {p50:>8.1f} {p99:>8.1f} "
              f"{p50 - b50:>+8.1f} {p99 - b99:>+8.1f}")
    print(f"\nserver exit code after SIGTERM: {rc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
