"""The serving path's own cost: single requests through the batcher vs whole batches, side by side.

On the H100 host the server congested at 2,700 req/s (batch 8) against a closed-loop capacity
of 6,000-11,000 samples/s: the load generator, batcher, futures and callbacks, all Python
threads sharing one GIL, were a bottleneck of their own.  This measures that path on a model
whose compute is negligible (one 16x16 MatMul), so what is left is host cost:

1. ``batches``: the runtime alone, ``--in-flight`` batches of ``--batch`` submitted at a time
   (samples/s), the ceiling;
2. ``server``: the same runtime behind :class:`~staronnx.serving.Server`, single-sample requests
   submitted as fast as they are accepted (requests/s) and the host microseconds per request;
3. ``open loop``: the papers' open-loop generator at 25/50/75 % of (2): achieved throughput,
   p50/p99 latency and the generator's lag.

Usage: python benchmarks/serving_path.py [--batch 8] [--seconds 3] [--rounds 3] [--policy eager]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import alternate, rate  # noqa: E402
from overhead import tiny_model  # noqa: E402

from staronnx import Runtime, partition  # noqa: E402
from staronnx.bench.points import measure_point  # noqa: E402
from staronnx.perfmodels import PerfModelStore  # noqa: E402
from staronnx.serving import Server  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--policy", default="eager")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="staronnx-serving-path-"))
    plan = partition(tiny_model(tmp / "tiny.onnx"), parts=1, output_dir=tmp / "plan", profile_runs=1)
    pu = sorted(os.sched_getaffinity(0))[0]
    sample = {"x": np.ones((1, 16), np.float32)}
    batch = {"x": np.ones((args.batch, 16), np.float32)}
    with Runtime(plan, policy=args.policy, cpu_groups=str(pu), store=PerfModelStore(tmp / "home")) as rt:
        rt.run(batch)

        def batches() -> int:
            futs = [rt.submit(batch) for _ in range(args.in_flight)]
            for f in futs:
                f.result()
            return args.in_flight * args.batch

        def served() -> int:
            server = Server(rt, args.batch, queue_capacity=1 << 20)
            n = 2000 * args.batch
            futs = [server.submit(sample) for _ in range(n)]
            for f in futs:
                f.result()
            server.close()
            return n

        r = alternate({"batches": lambda: rate(batches, args.seconds),
                       "server": lambda: rate(served, args.seconds)}, args.rounds)
        print(f"one worker (PU {pu}), policy {args.policy}, batch {args.batch}, tiny model (host cost only)")
        print(f"  whole batches through the runtime: {r['batches']:,.0f} samples/s")
        print(f"  single requests through the server: {r['server']:,.0f} requests/s "
              f"({1e6 / r['server']:.1f} us of host time per request), "
              f"ratio {r['server'] / r['batches']:.2f}")
        print("  open loop (constant arrivals), rate: achieved, p50, p99, generator lag p99")
        samples = [sample] * 8
        for frac in (0.25, 0.5, 0.75):
            offered = frac * r["server"]
            summary, records = measure_point(rt, args.batch, offered, samples, duration=args.seconds, warmup=1.0)
            lag = records.settings["loadgen"]["lag_p99_s"]
            print(f"  {offered:>9,.0f} req/s: {summary['throughput']:,.0f}/s, p50 {summary['latency_p50'] * 1e3:.2f} ms, "
                  f"p99 {summary['latency_p99'] * 1e3:.2f} ms, lag p99 {lag * 1e3:.2f} ms"
                  + (" (congested)" if summary["congested"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
