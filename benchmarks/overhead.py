"""Per-task overhead of the native engine, and its throughput next to a plain ORT loop.

1. A tiny model (one small MatMul): time per request through ``Runtime.run`` (one at a time,
   and pipelined with many in flight) minus the time of the same ``session.run`` in plain ORT,
   in microseconds.
2. GoogLeNet at batch 8 on one worker (one CPU group holding every core): staronnx throughput
   / plain ORT loop throughput with the same thread count (target >= 0.95), for the whole model
   as a 1-part plan and for the 2-part 85/15 plan.

Usage: python benchmarks/overhead.py [--seconds 3] [--rounds 3] [--model googlenet.onnx]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).parent))
from _common import GOOGLENET, alternate, rate, scratch_dir  # noqa: E402
from staronnx import partition
from staronnx.perfmodels import PerfModelStore
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.workers.layout import MachineSpec
from staronnx.verify import random_plan_feeds
from staronnx.workers.topology import Topology
from staronnx.partition import PartitionSpec


def tiny_model(path: Path) -> Path:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])], [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def plain_session(path: Path, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", type=Path, default=GOOGLENET)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    ncores = len(Topology.from_system().allowed_cores())
    tmp = scratch_dir("staronnx-bench-")
    store = PerfModelStore(tmp / "home")
    one_group = f"0-{ncores - 1}" if ncores > 1 else "0"

    # 1. per-task overhead on a tiny model
    tiny = tiny_model(tmp / "tiny.onnx")
    plan = partition(tiny, spec=PartitionSpec(parts=1, profile_runs=1), output_dir=tmp / "tiny-plan")
    feeds = {"x": np.ones((1, 16), np.float32)}
    sess = plain_session(tiny, ncores)
    with Runtime(plan, MachineSpec(groups=one_group), RuntimeSpec(policy="eager", store=store)) as rt:
        rt.run(feeds)

        def pipelined() -> int:
            futs = [rt.submit(feeds) for _ in range(200)]
            for f in futs:
                f.result()
            return 200

        r = alternate({
            "ort": lambda: rate(lambda: (sess.run(None, feeds), 1)[1], args.seconds),
            "sync": lambda: rate(lambda: (rt.run(feeds), 1)[1], args.seconds),
            "pipelined": lambda: rate(pipelined, args.seconds),
        }, args.rounds)
    ort_us = 1e6 / r["ort"]
    print(f"tiny model: plain ORT {ort_us:.1f} us/run; staronnx run() {1e6 / r['sync']:.1f} us/request "
          f"(overhead {1e6 / r['sync'] - ort_us:.1f} us); pipelined {1e6 / r['pipelined']:.1f} us/request "
          f"(overhead {1e6 / r['pipelined'] - ort_us:.1f} us per task)")

    # 2. googlenet batch N on one worker, whole model and 2-part plan
    whole = partition(args.model, spec=PartitionSpec(parts=1, costs="estimate"), output_dir=tmp / "g1")
    split = partition(args.model, [0.85, 0.15], output_dir=tmp / "g2")
    gfeeds = random_plan_feeds(whole, args.batch)
    gsess = plain_session(args.model, ncores)
    gsess.run(None, gfeeds)
    results = {}
    for label, p in (("1 part", whole), ("2 parts 85/15", split)):
        with Runtime(p, MachineSpec(groups=one_group), RuntimeSpec(policy="heft", store=store)) as rt:
            rt.run(gfeeds)

            def engine() -> int:
                futs = [rt.submit(gfeeds) for _ in range(4)]
                for f in futs:
                    f.result()
                return 4 * args.batch

            r = alternate({
                "ort": lambda: rate(lambda: (gsess.run(None, gfeeds), args.batch)[1], args.seconds),
                "staronnx": lambda: rate(engine, args.seconds),
            }, args.rounds)
        results[label] = r
        print(f"{args.model.name} batch {args.batch}, one worker of {ncores} cores, {label}: "
              f"plain ORT {r['ort']:.1f} samples/s, staronnx {r['staronnx']:.1f} samples/s, "
              f"ratio {r['staronnx'] / r['ort']:.3f} (target >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
