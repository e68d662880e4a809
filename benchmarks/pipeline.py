"""A 2-part plan pipelined over two one-core groups versus one ORT session on both cores.

The StarONNX idea on a CPU-only box: part 0 of batch i+1 runs on one group while part 1 of
batch i runs on the other, each on its own core with no intra-op synchronisation. Measured side
by side in one run (alternating rounds); the ratio is staronnx / plain ORT throughput.

Usage: python benchmarks/pipeline.py [--shares 0.5,0.5] [--batch 8] [--policy heft]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).parent))
from _common import GOOGLENET, alternate, rate, scratch_dir  # noqa: E402

from staronnx import partition  # noqa: E402
from staronnx.calibrate import calibrate, start_workers  # noqa: E402
from staronnx.perfmodels import PerfModelStore  # noqa: E402
from staronnx.runtime.runtime import Runtime  # noqa: E402
from staronnx.runtime.spec import RuntimeSpec
from staronnx.verify import random_plan_feeds  # noqa: E402
from staronnx.workers.topology import Topology  # noqa: E402
from staronnx.workers.layout import MachineSpec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=GOOGLENET)
    ap.add_argument("--shares", default="0.5,0.5")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--policy", default="heft")
    ap.add_argument("--groups", default="cores=1")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--in-flight", type=int, default=4)
    args = ap.parse_args(argv)
    ncores = len(Topology.from_system().allowed_cores())
    tmp = scratch_dir("staronnx-bench-")
    store = PerfModelStore(tmp / "home")
    plan = partition(args.model, args.shares, output_dir=tmp / "plan")
    print(f"plan: shares {[p.share for p in plan.parts]}, cut {plan.cut_bytes_per_sample:,} B/sample")
    workers = start_workers(plan, MachineSpec(groups=args.groups))
    try:
        calibrate(plan, [args.batch], workers=workers, store=store)
    finally:
        for w in workers:
            w.close()
    feeds = random_plan_feeds(plan, args.batch)
    so = ort.SessionOptions()
    so.intra_op_num_threads = ncores
    sess = ort.InferenceSession(str(args.model), so, providers=["CPUExecutionProvider"])
    sess.run(None, feeds)
    with Runtime(plan, MachineSpec(groups=args.groups), RuntimeSpec(policy=args.policy, store=store)) as rt:
        rt.run(feeds)

        def engine() -> int:
            futs = [rt.submit(feeds) for _ in range(args.in_flight)]
            for f in futs:
                f.result()
            return args.in_flight * args.batch

        r = alternate({
            "ort": lambda: rate(lambda: (sess.run(None, feeds), args.batch)[1], args.seconds),
            "staronnx": lambda: rate(engine, args.seconds),
        }, args.rounds)
        stats = rt.stats()
    print(f"{args.model.name} batch {args.batch}: one ORT session on {ncores} cores "
          f"{r['ort']:.1f} samples/s; staronnx {args.policy} on {args.groups} "
          f"{r['staronnx']:.1f} samples/s; ratio {r['staronnx'] / r['ort']:.3f}")
    for key, row in stats["tasks"].items():
        print(f"  {key}: {row['tasks']} tasks, measured {row['measured_ms']:.1f} ms, "
              f"predicted {row['predicted_ms'] if row['predicted_ms'] is None else round(row['predicted_ms'], 1)} ms")
    for name, row in stats["workers"].items():
        print(f"  {name}: {row['tasks']} tasks, busy {row['busy']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
