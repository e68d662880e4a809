"""The native engine next to the starpu engine: same plans, same CPU groups, same policy names.

1. Per-task overhead on tiny models (one 16x16 MatMul; and a 2-part chain of two of them, so
   that one crossing tensor goes through the engine's data management): microseconds per
   request through ``Runtime.run`` one at a time ("sync") and with ``--inflight`` requests in
   flight ("pipelined"), minus the same work in a plain ONNX Runtime loop, divided by the
   number of tasks per request.
2. Throughput (samples/s) on the GoogLeNet 85/15 2-part plan at ``--batch``, every part
   calibrated first (``--warmup`` requests) so the dmda family uses its models.

Both engines run in this one process, in turn, round after round (medians are reported), each
started and closed within its round: StarPU allows one instance per process, and its idle
workers poll (Debian's StarPU is built with non-blocking drivers), so an open StarPU runtime
would slow the native one down.  StarPU's files go to a temporary STARPU_HOME.

Usage: python benchmarks/engines.py [--seconds 2] [--rounds 3] [--groups cores=N]
       [--policies eager,dmda] [--batch 4] [--skip-googlenet]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).parent))
from _common import GOOGLENET, rate, scratch_dir

from staronnx import partition
from staronnx.perfmodels import PerfModelStore
from staronnx.plan import Plan
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.workers.layout import MachineSpec
from staronnx.verify import random_plan_feeds
from staronnx.partition import PartitionSpec

ENGINES = ("native", "starpu")


def tiny_chain(path: Path, layers: int) -> Path:
    """``layers`` 16x16 MatMuls (with a Relu between), the tiniest model worth a task."""
    rng = np.random.default_rng(0)
    inits, nodes, cur = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [cur, f"w{i}"], [f"m{i}"], name=f"mm{i}"))
        cur = f"m{i}"
        if i < layers - 1:
            nodes.append(helper.make_node("Relu", [cur], [f"r{i}"], name=f"relu{i}"))
            cur = f"r{i}"
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
                          [helper.make_tensor_value_info(cur, TensorProto.FLOAT, ["batch", 16])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def plain_rate(model: Path, feeds: dict[str, np.ndarray], threads: int, seconds: float) -> float:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    sess.run(None, feeds)
    return rate(lambda: (sess.run(None, feeds), 1)[1], seconds)


def engine_rates(plan: Plan, engine: str, policy: str, groups: str, feeds: dict[str, np.ndarray],
                 seconds: float, inflight: int, warmup: int, store: PerfModelStore,
                 sync: bool = True) -> dict[str, float]:
    """Requests/s one at a time and pipelined, for one engine started (and closed) here."""
    out: dict[str, float] = {}
    with Runtime(plan, MachineSpec(groups=groups), RuntimeSpec(policy=policy, engine=engine, store=store)) as rt:
        for f in [rt.submit(feeds) for _ in range(warmup)]:
            f.result()
        if sync:
            out["sync"] = rate(lambda: (rt.run(feeds), 1)[1], seconds)

        def pipelined() -> int:
            futs = [rt.submit(feeds) for _ in range(inflight)]
            for f in futs:
                f.result()
            return inflight

        out["pipelined"] = rate(pipelined, seconds)
        stats = rt.stats()
    out["workers"] = len(stats["workers"])
    return out


def median_rounds(rounds: int, measures: dict[str, Callable[[], dict[str, float]]]) -> dict[str, dict[str, float]]:
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in measures}
    for _ in range(rounds):
        for name, fn in measures.items():
            samples[name].append(fn())
    return {name: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
            for name, runs in samples.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--groups", default=None,
                    help="CPU groups for both engines (default cores=1, or wider groups so that there "
                         "are at most 4: Debian's StarPU has STARPU_MAXCPUS 4)")
    ap.add_argument("--policies", default="eager,dmda")
    ap.add_argument("--inflight", type=int, default=200)
    ap.add_argument("--model", type=Path, default=GOOGLENET)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--skip-googlenet", action="store_true")
    args = ap.parse_args(argv)
    try:
        from staronnx.engines.starpu import load_binding

        _, lib, install = load_binding()
    except Exception as exc:  # noqa: BLE001 - say why and stop
        print(f"the starpu engine is not usable here: {exc}", file=sys.stderr)
        return 2
    tmp = scratch_dir("staronnx-engines-")
    os.environ["STARPU_HOME"] = str(tmp / "starpu")
    store = PerfModelStore(tmp / "home")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    ncores = len(os.sched_getaffinity(0))
    if args.groups is None:
        args.groups = f"cores={max(1, -(-ncores // lib.STARPU_MAXCPUS))}"
    print(f"StarPU {install.version} ({install.source}); {ncores} cores; groups {args.groups!r}; "
          f"{args.rounds} rounds of {args.seconds:g} s, medians\n")

    # 1. per-task overhead, tiny models
    feeds = {"x": np.ones((1, 16), np.float32)}
    print("per-task overhead (us per task, over plain ORT), tiny 16x16 MatMul model(s), batch 1")
    print(f"{'plan':<24}{'policy':<8}{'engine':<8}{'sync us/req':>12}{'overhead':>10}"
          f"{'pipelined us/req':>18}{'overhead':>10}")
    for layers, parts in ((1, 1), (2, 2)):
        model = tiny_chain(tmp / f"tiny{layers}.onnx", layers)
        plan = partition(model,
                         spec=PartitionSpec(parts=parts, method="linear", costs="estimate", input_shapes=["x=1x16"]),
                         output_dir=tmp / f"tiny{layers}-plan")
        ort_us = 1e6 / statistics.median(plain_rate(model, feeds, 1, args.seconds) for _ in range(args.rounds))
        for policy in policies:
            r = median_rounds(args.rounds, {
                e: (lambda e=e, plan=plan, policy=policy: engine_rates(plan, e, policy, args.groups, feeds, args.seconds,
                                                                    args.inflight, 20, store))
                for e in ENGINES})
            for e in ENGINES:
                sync_us, pipe_us = 1e6 / r[e]["sync"], 1e6 / r[e]["pipelined"]
                print(f"{f'{plan.k} part(s), ORT {ort_us:.1f} us':<24}{policy:<8}{e:<8}{sync_us:>12.1f}"
                      f"{(sync_us - ort_us) / plan.k:>10.1f}{pipe_us:>18.1f}{(pipe_us - ort_us) / plan.k:>10.1f}")
    # 2. throughput, googlenet 2 parts
    if not args.skip_googlenet and args.model.exists():
        split = partition(args.model, [0.85, 0.15], PartitionSpec(profile_runs=2), output_dir=tmp / "g2")
        gfeeds = random_plan_feeds(split, args.batch)
        print(f"\nthroughput, {args.model.name} 2-part 85/15 plan, batch {args.batch}, "
              f"{min(args.inflight, 16)} requests in flight (samples/s)")
        print(f"{'policy':<8}{'native':>10}{'starpu':>10}{'starpu/native':>15}")
        for policy in policies:
            r = median_rounds(args.rounds, {
                e: (lambda e=e, policy=policy: engine_rates(split, e, policy, args.groups, gfeeds, args.seconds * 2,
                                             min(args.inflight, 16), 24, store, sync=False))
                for e in ENGINES})
            nat, sp = r["native"]["pipelined"] * args.batch, r["starpu"]["pipelined"] * args.batch
            print(f"{policy:<8}{nat:>10.1f}{sp:>10.1f}{sp / nat:>15.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
