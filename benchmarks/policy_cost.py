"""What a placement decision costs the host per task, by policy and by stream count.

A GPU's streams are workers to the policy: dmda-family policies price every candidate worker
per task, so a decision over 8 streams and a CPU group is a loop of 9. On an H200, googlenet at
batch 1 with 8 streams ran 2,829 samples/s under eager and 1,880 under dmda with the CPU
groups beside it (benchmarks/results/gpu-h200-2026-11-28.json): at a few hundred microseconds
of GPU work per task, the host's cost per task decides. This prints, side by side in one run,
for eager, dmda and heft with 1, 4 and 8 CUDA streams (``HostRuntime``, the CPU stand-in, so it
runs anywhere; a tiny model, ``--in-flight`` batches at a time):

- ``calls/task``: Python function calls per task over every thread (cProfile): a count, so it
  compares two runs (before and after a change) whatever else the machine was doing;
- ``cpu us/task``: the process's CPU time per task, median of ``--rounds`` alternated rounds;
- ``latency us``: one batch at a time (``run()``), median wall time: what a lone request pays
  for the decision and the hand-overs (dmda and heft prefetch a placed task's inputs even onto
  an idle worker, one more pass through the driver: 60-120 us more than eager here).

Usage: python benchmarks/policy_cost.py [--rounds 3] [--tasks 2048] [--groups none|numa]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import scratch_dir  # noqa: E402
from host_overhead import calls_per_task  # noqa: E402
from overhead import tiny_model  # noqa: E402

from staronnx import CudaOptions, MachineSpec, Runtime, RuntimeSpec, partition  # noqa: E402
from staronnx.partition.autoshares import median_seconds  # noqa: E402
from staronnx.perfmodels import PerfModelStore  # noqa: E402
from staronnx.workers.cudart import HostRuntime  # noqa: E402
from staronnx.partition import PartitionSpec

POLICIES = ("eager", "dmda", "heft")
STREAMS = (1, 4, 8)


def cpu_per_task(rt: Runtime, feeds: dict[str, np.ndarray], in_flight: int, tasks: int) -> float:
    """Process CPU seconds per task over ``tasks`` tasks submitted ``in_flight`` at a time."""
    done, c0 = 0, time.process_time()
    while done < tasks:
        futs = [rt.submit(feeds) for _ in range(in_flight)]
        for f in futs:
            f.result()
        done += in_flight
    return (time.process_time() - c0) / done


def latency_us(rt: Runtime, feeds: dict[str, np.ndarray], n: int = 500) -> float:
    """Median wall time of ``n`` lone requests (each waited for before the next)."""
    return 1e6 * median_seconds(lambda: rt.run(feeds), n, warmup=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=2048)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--groups", default="none", help="CPU groups beside the streams (none: the streams alone)")
    args = ap.parse_args(argv)
    tmp = scratch_dir("staronnx-policy-cost-")
    plan = partition(tiny_model(tmp / "tiny.onnx"), spec=PartitionSpec(parts=1, profile_runs=1),
                     output_dir=tmp / "plan")
    store = PerfModelStore(tmp / "home")
    feeds = {"x": np.ones((8, 16), np.float32)}
    print(f"tiny model, batch 8, HostRuntime streams, CPU groups {args.groups}, {args.in_flight} in flight, "
          f"{args.tasks} tasks a reading, median of {args.rounds} alternated rounds")
    print(f"{'policy':>6}  {'streams':>7}  {'calls/task':>10}  {'cpu us/task':>11}  {'latency us':>10}")
    with contextlib.ExitStack() as stack:
        runtimes = {}
        for policy in POLICIES:
            for n in STREAMS:
                rt = stack.enter_context(Runtime(plan,
                                                 MachineSpec(groups=args.groups, cuda_streams=n),
                                                 RuntimeSpec(policy=policy, store=store,
                                                             cuda=CudaOptions(runtime=HostRuntime()))))
                for _ in range(100 * n):  # perf models calibrated on every stream
                    rt.run(feeds)
                runtimes[policy, n] = rt
        cpu: dict[tuple[str, int], list[float]] = {k: [] for k in runtimes}
        lat: dict[tuple[str, int], list[float]] = {k: [] for k in runtimes}
        for _ in range(args.rounds):  # every setup in turn, round after round: the VM's drift hits all
            for key, rt in runtimes.items():
                cpu[key].append(cpu_per_task(rt, feeds, args.in_flight, args.tasks))
                lat[key].append(latency_us(rt, feeds))
        for (policy, n), rt in runtimes.items():
            calls = calls_per_task(rt, feeds, argparse.Namespace(in_flight=args.in_flight), tasks=args.tasks)
            shown = "-" if calls is None else f"{calls:.0f}"
            print(f"{policy:>6}  {n:>7}  {shown:>10}  {1e6 * statistics.median(cpu[policy, n]):>11.0f}  "
                  f"{statistics.median(lat[policy, n]):>10.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
