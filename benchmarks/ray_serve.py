"""staronnx on Ray Serve: 1 replica vs 2, and the Serve hop vs plain ``staronnx serve``, side by side.

googlenet cut in two (85/15), batch-1 requests over HTTP (tritonclient.http.aio, binary
tensors), batches of up to ``--batch`` formed by staronnx's batcher in each replica. Rows:

* ``plain serve``: ``staronnx serve --groups <first PU>``: one process, one 1-core CPU group;
* ``ray, 1 replica``: ``staronnx serve --ray --replicas 1 --replica-cpus 1 --groups cores=1``:
  the same 1-core group, inside a Serve replica, behind Serve's HTTP proxy and the KServe
  ingress deployment (two more processes, and two hops, on the request's path);
* ``ray, 2 replicas``: the same with ``--replicas 2``: two replicas, each pinned to a core of its
  own (the replica's CPU share), Serve's router spreading requests over both.

Every row is started through the CLI, as a user would, on one local Ray cluster the benchmark
starts (``--cpus`` logical CPUs) and joins through ``$RAY_ADDRESS``; measured with
``--clients`` closed-loop clients (the load: the same for every row) in a process of their own
(benchmarks/serve.py's client loop), and again with one client (the hop's added latency on an
idle server). Rows are taken in turn, ``--rounds`` times, each server started afresh; figures
are medians over rounds. On a 2-core machine the clients, the proxy and the ingress share the
cores with the replicas: the second replica's gain is bounded by what they leave.

    .venv/bin/python benchmarks/ray_serve.py [--seconds 6] [--rounds 2] [--clients 16] [--batch 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GOOGLENET, ServeProcess, scratch_dir, start_serve  # noqa: E402
from staronnx.partition import PartitionSpec

ROWS = ("plain serve", "ray, 1 replica", "ray, 2 replicas")


# -- the client process (one per row, load and round) -------------------------------------------
def client_main(args: argparse.Namespace) -> int:
    """Closed-loop load on ``args.address`` for one row; its figures as one JSON line."""
    import tritonclient.http as thttp
    import tritonclient.http.aio as aio
    from serve import closed_loop  # benchmarks/serve.py: the same client loop as its rows

    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)

    async def run() -> dict[str, object]:
        inp = thttp.InferInput("input", [1, 3, 224, 224], "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        out = [thttp.InferRequestedOutput("logits", binary_data=True)]
        async with aio.InferenceServerClient(args.address, conn_limit=args.clients) as client:
            async def call() -> None:
                (await client.infer("googlenet", [inp], outputs=out)).as_numpy("logits")
            return await closed_loop(call, args.clients, args.seconds, args.warmup)

    result = asyncio.run(run())
    print(json.dumps({"throughput": result["throughput"], "latencies": result["latencies"]}))
    return 0


def run_client(address: str, clients: int, args: argparse.Namespace) -> dict[str, object]:
    cmd = [sys.executable, __file__, "--client", "--address", address, "--clients", str(clients),
           "--seconds", str(args.seconds), "--warmup", str(args.warmup)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ}, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"client failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the servers --------------------------------------------------------------------------------
def start_server(row: str, plan: Path, args: argparse.Namespace, env: dict[str, str]) -> ServeProcess:
    """The row's server through the CLI, once it says ready."""
    cmd = [sys.executable, "-m", "staronnx", "serve", str(plan), "--name", "googlenet", "--http-port", "0",
           "--batch-size", str(args.batch), "--max-delay", args.max_delay, "--policy", "eager"]
    if row == "plain serve":
        first_pu = min(os.sched_getaffinity(0))
        cmd += ["--grpc-port", "0", "--metrics-port", "0", "--groups", str(first_pu)]
    else:
        replicas = "2" if "2" in row else "1"
        cmd += ["--ray", "--replicas", replicas, "--replica-cpus", "1", "--groups", "cores=1"]
    return start_serve(cmd, env, timeout=600)  # a Ray cluster starts first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=GOOGLENET)
    ap.add_argument("--seconds", type=float, default=6.0, help="measured seconds per row, load and round")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the rows, taken in turn")
    ap.add_argument("--clients", type=int, default=16, help="closed-loop clients of the loaded rows")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-delay", default="2ms")
    ap.add_argument("--cpus", type=int, default=2, help="logical CPUs of the local Ray cluster")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)  # internal: one row's load
    ap.add_argument("--address", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        return client_main(args)
    if not args.model.exists():
        print(f"skipped: {args.model} not found")
        return 0
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        print(f"skipped: the ray extra is not installed ({exc.name}): pip install 'staronnx[ray]'")
        return 0

    from staronnx import partition

    tmp = scratch_dir("staronnx-ray-bench-")
    plan = partition(args.model, [0.85, 0.15], PartitionSpec(costs="estimate"), output_dir=tmp / "plan")
    ctx = ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    env = {**os.environ, "RAY_ADDRESS": ctx.address_info["gcs_address"], "STARONNX_HOME": str(tmp / "home")}
    print(f"googlenet, {plan.k} parts, batch-1 requests over HTTP, batches of up to {args.batch} (max delay "
          f"{args.max_delay}), {args.clients} closed-loop clients (and 1), {args.seconds:g} s per row, "
          f"{args.rounds} rounds in turn, {len(os.sched_getaffinity(0))} cores", flush=True)
    loads = {"loaded": args.clients, "1 client": 1}
    runs: dict[tuple[str, str], list[dict[str, object]]] = {(r, ld): [] for r in ROWS for ld in loads}
    try:
        for rnd in range(1, args.rounds + 1):
            for row in ROWS:
                served = start_server(row, plan.root, args, env)
                try:
                    for load, clients in loads.items():
                        if load == "1 client" and row == "ray, 2 replicas":
                            continue  # one client keeps one replica busy: the 1-replica row says it
                        r = run_client(served.http, clients, args)
                        runs[(row, load)].append(r)
                        lat = np.asarray(r["latencies"]) * 1e3
                        print(f"  round {rnd}: {row:<16} {load:<9} {r['throughput']:8.1f} samples/s, "
                              f"p50 {np.percentile(lat, 50):6.1f} ms", flush=True)
                finally:
                    if (rc := served.stop()) != 0:
                        raise SystemExit(f"{row}: server exited {rc} after SIGTERM")
    finally:
        serve.shutdown()
        ray.shutdown()

    report: dict[str, dict[str, float]] = {}
    print(f"\n{'row':<16} {'load':<9} {'samples/s':>10} {'p50 ms':>8} {'p99 ms':>8}")
    for (row, load), rs in runs.items():
        if not rs:
            continue
        lat = np.concatenate([np.asarray(r["latencies"]) for r in rs]) * 1e3
        fig = {"throughput": statistics.median(float(r["throughput"]) for r in rs),
               "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
               "rounds": [float(r["throughput"]) for r in rs]}
        report[f"{row} / {load}"] = fig
        print(f"{row:<16} {load:<9} {fig['throughput']:>10.1f} {fig['p50_ms']:>8.1f} {fig['p99_ms']:>8.1f}")

    plain, one, two = (report[f"{r} / loaded"] for r in ROWS)
    idle_plain, idle_one = report["plain serve / 1 client"], report["ray, 1 replica / 1 client"]
    print(f"\n2 replicas / 1 replica throughput ({args.clients} clients): {two['throughput'] / one['throughput']:.2f}x")
    print(f"Serve hop, loaded ({args.clients} clients): ray 1 replica / plain serve throughput "
          f"{one['throughput'] / plain['throughput']:.2f}x, p50 {one['p50_ms'] - plain['p50_ms']:+.1f} ms")
    print(f"Serve hop, 1 client: latency p50 {idle_one['p50_ms']:.1f} vs {idle_plain['p50_ms']:.1f} ms "
          f"({idle_one['p50_ms'] - idle_plain['p50_ms']:+.1f} ms, {idle_one['p50_ms'] / idle_plain['p50_ms']:.2f}x), "
          f"throughput {idle_one['throughput'] / idle_plain['throughput']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "rows": report},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
