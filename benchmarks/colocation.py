"""The sweeps' open loop against a CUDA worker, plain and colocated, side by side (runs anywhere).

What a sweep measures on a GPU at batch 1-8 is bounded by the host: the load generator, the
batcher and the CUDA driver thread all hold the GIL in turn. :meth:`Runtime.colocate
<staronnx.runtime.runtime.Runtime.colocate>` runs the generator and the batcher on the driver's
core (``staronnx sweep --colocate``); this compares the two on a CUDA worker driven by
:class:`~staronnx.workers.cudart.HostRuntime` (CPU groups ``none``, one stream, one 16x16 MatMul,
so what is left is host cost):

1. ``capacity``: single requests through a plain :class:`~staronnx.serving.Server` as fast as
   they are accepted (requests/s), the reference the open-loop rates are fractions of;
2. ``open loop``: the papers' generator (constant arrivals, batches of ``--batch``, max delay
   2 ms) at 50/75/100 % of that capacity, each rate plain and colocated in turn, ``--rounds``
   times (medians): achieved rate, p50, p99 (and their ratio), the generator's lag, congestion.

Goal (issue 19's serving goal, on the CUDA path): colocated, p99 <= 5x p50 and generator lag
p99 <= 1 ms up to 75 % of capacity. The last line says whether it was met, and at which rates
colocation kept up where the plain run did not.

``--device cuda`` runs the same on the GPU (``--cuda-graphs`` with graphs captured).

Usage: python benchmarks/colocation.py [--seconds 3] [--rounds 3] [--batch 8] [--device host|cuda] [--cuda-graphs]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import cuda_worker_options, rate, scratch_dir  # noqa: E402
from overhead import tiny_model  # noqa: E402

from staronnx import MachineSpec, Runtime, RuntimeSpec, partition  # noqa: E402
from staronnx.bench.points import measure_point  # noqa: E402
from staronnx.perfmodels import PerfModelStore  # noqa: E402
from staronnx.serving import ServeSpec, Server  # noqa: E402
from staronnx.partition import PartitionSpec
from staronnx.bench.spec import RunSpec

FRACTIONS = (0.5, 0.75, 1.0)


def capacity(rt: Runtime, batch: int, seconds: float) -> float:
    """Single-sample requests/s through a plain Server, submitted as fast as they are accepted."""
    sample = {"x": np.ones((1, 16), np.float32)}

    def burst() -> int:
        with Server(rt, ServeSpec(batch, queue_capacity=1 << 20)) as server:
            futs = [server.submit(sample) for _ in range(200 * batch)]
            for f in futs:
                f.result()
        return 200 * batch

    return rate(burst, seconds)


def point(rt: Runtime, batch: int, offered: float, seconds: float, colocate: bool) -> dict[str, Any]:
    summary, records = measure_point(rt, batch, offered, [{"x": np.ones((1, 16), np.float32)}],
                                     RunSpec(duration=seconds, warmup=min(1.0, seconds / 3), max_delay=0.002,
                                             colocate=colocate))
    return {"throughput": summary["throughput"], "p50": summary["latency_p50"], "p99": summary["latency_p99"],
            "lag": records.settings["loadgen"]["lag_p99_s"], "congested": bool(summary["congested"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", choices=("host", "cuda"), default="host",
                    help="host: HostRuntime stands in for CUDA (default, runs anywhere); cuda: the GPU")
    ap.add_argument("--cuda-graphs", action="store_true", help="CUDA workers with graphs on")
    args = ap.parse_args(argv)
    cuda_options, where = cuda_worker_options(args.device)
    tmp = scratch_dir("staronnx-colocation-")
    plan = partition(tiny_model(tmp / "tiny.onnx"), spec=PartitionSpec(parts=1, profile_runs=1),
                     output_dir=tmp / "plan")
    with Runtime(plan, MachineSpec("none", 1, cuda_graphs=args.cuda_graphs),
                 RuntimeSpec("eager", store=PerfModelStore(tmp / "home"), cuda=cuda_options)) as rt:
        rt.run({"x": np.ones((args.batch, 16), np.float32)})
        cap = capacity(rt, args.batch, args.seconds)
        print(f"one stream, {where} (groups none), tiny model, batches of up to {args.batch} "
              f"(max delay 2 ms), {args.rounds} round(s) of {args.seconds:g} s per point")
        print(f"  capacity, single requests through a plain Server: {cap:,.0f} requests/s")
        print(f"  {'offered':>9}  {'mode':<9}  {'achieved':>9}  {'p50 ms':>7}  {'p99 ms':>7}  {'p99/p50':>7}  "
              f"{'lag p99 ms':>10}")
        met, kept_up = True, []
        for frac in FRACTIONS:
            offered = frac * cap
            runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
            for _ in range(args.rounds):  # plain and colocated in turn: the VM's drift hits both
                for colocate in (False, True):
                    runs[colocate].append(point(rt, args.batch, offered, args.seconds, colocate))
            fine = {}
            for colocate in (False, True):
                rs = runs[colocate]
                med = {k: statistics.median(r[k] for r in rs) for k in ("throughput", "p50", "p99", "lag")}
                congested = any(r["congested"] for r in rs)
                ratio = med["p99"] / med["p50"]
                fine[colocate] = ratio <= 5 and med["lag"] <= 1e-3 and not congested
                print(f"  {offered:>9,.0f}  {'colocated' if colocate else 'plain':<9}  {med['throughput']:>9,.0f}  "
                      f"{med['p50'] * 1e3:>7.2f}  {med['p99'] * 1e3:>7.2f}  {ratio:>7.1f}  {med['lag'] * 1e3:>10.2f}"
                      + ("  (congested)" if congested else ""))
            if frac <= 0.75:
                met &= fine[True]
            if fine[True] and not fine[False]:
                kept_up.append(f"{frac:.0%}")
        print(f"  goal: colocated, p99 <= 5x p50 and lag p99 <= 1 ms up to 75 %: {'met' if met else 'not met'}; "
              f"colocated kept that where plain did not at: {', '.join(kept_up) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
