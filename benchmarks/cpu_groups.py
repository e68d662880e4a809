"""One ORT session on all cores versus one pinned session per CPU group, side by side.

Question: does splitting the machine's cores into groups (each a staronnx CPU worker running
its own batches concurrently) give more throughput than one ONNX Runtime session using every
core? Both configurations are measured in the same run, alternating rounds so that machine
noise hits both alike; the ratio is what to read. Memory (PSS, shared pages divided among their
users) is reported for 1 worker versus N workers, to show weights are held once.

Usage: python benchmarks/cpu_groups.py [--model M] [--groups cores=1] [--batches 1,8]
                                        [--seconds 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from staronnx.workers.cpu import CpuWorker
from staronnx.workers.cpu_weights import process_memory
from staronnx.workers.groups import make_groups
from staronnx.workers.topology import Topology

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "googlenet.onnx"


def plain_ort_throughput(sess: ort.InferenceSession, feeds: dict, batch: int, seconds: float) -> float:
    """Samples per second of one session, run back to back."""
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        sess.run(None, feeds)
        done += batch
    return done / (time.perf_counter() - start)


def grouped_throughput(workers: list[CpuWorker], feeds: dict, batch: int, seconds: float) -> float:
    """Samples per second of all workers together, each kept busy with two batches in flight."""
    in_flight = {w: [w.submit(0, feeds), w.submit(0, feeds)] for w in workers}
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for w, futures in in_flight.items():
            futures[0].result()
            futures.pop(0)
            done += batch
            futures.append(w.submit(0, feeds))
    elapsed = time.perf_counter() - start
    for futures in in_flight.values():
        for f in futures:
            f.result()
    return done / elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--groups", default="cores=1", help="grouping policy for the grouped run")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--seconds", type=float, default=4.0, help="per measurement round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    topology = Topology.from_system()
    groups = make_groups(topology, args.groups)
    ncores = len(topology.allowed_cores())
    so = ort.SessionOptions()
    so.intra_op_num_threads = ncores
    plain = ort.InferenceSession(str(args.model), so, providers=["CPUExecutionProvider"])
    name = plain.get_inputs()[0].name
    shape = plain.get_inputs()[0].shape

    mem0 = process_memory()["pss"]
    first = CpuWorker(groups[0], [args.model], name="g0").start()
    mem1 = process_memory()["pss"]
    workers = [first] + [CpuWorker(g, [args.model], name=f"g{i}").start() for i, g in enumerate(groups[1:], 1)]
    memn = process_memory()["pss"]

    print(f"model {args.model.name}; {ncores} cores; groups {args.groups}: "
          + "; ".join(g.describe() for g in groups))
    print(f"memory (PSS): 1 worker +{(mem1 - mem0) / 2**20:.1f} MiB, "
          f"{len(workers)} workers +{(memn - mem0) / 2**20:.1f} MiB "
          f"(weights shared: {all(all(w.weights_shared) for w in workers)})")
    print(f"{'batch':>5} {'plain ORT (all cores) samples/s':>32} {'per-group workers samples/s':>28} {'ratio':>7}")
    try:
        for batch in [int(b) for b in args.batches.split(",")]:
            dims = [batch if not isinstance(d, int) else d for d in shape]
            feeds = {name: np.random.default_rng(0).standard_normal(dims).astype(np.float32)}
            plain.run(None, feeds)
            for w in workers:
                w.run(0, feeds)
            a, b = [], []
            for _ in range(args.rounds):
                a.append(plain_ort_throughput(plain, feeds, batch, args.seconds))
                b.append(grouped_throughput(workers, feeds, batch, args.seconds))
            ma, mb = statistics.median(a), statistics.median(b)
            print(f"{batch:>5} {ma:>32.1f} {mb:>28.1f} {mb / ma:>7.2f}")
    finally:
        for w in workers:
            w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
