"""The main job on an embedded default: an Inception-style model staronnx builds itself.

It shows the whole path a user takes, without any download: build the model, partition it
85/15 with measured costs, verify that the chained parts compute what the model computes, and
run batches through the parts, reporting what each step produced.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import onnx

from staronnx.calibrate import calibrate, start_workers
from staronnx.ortutil import make_session
from staronnx.runtime.runtime import Runtime
from staronnx.workers.topology import Topology
from staronnx.partition.api import partition
from staronnx.partition.spec import PartitionSpec
from staronnx.plan import Plan
from staronnx.verify import VerifyReport, random_plan_feeds, verify_plan
from staronnx.zoo import inception_demo
from staronnx.workers.layout import MachineSpec


@dataclass
class DemoResult:
    """What the demo did, for printing and for tests."""

    model_path: Path
    model_nodes: int
    plan: Plan
    metis_cut: int
    linear_cut: int
    report: VerifyReport
    batch: int
    batches: int
    whole_seconds: float  # per batch, the whole model in one ORT session
    chained_seconds: float  # per batch, the parts in sequence
    runtime_seconds: float  # per batch, through the runtime with batches in flight
    groups: str
    stats: dict[str, Any]  # Runtime.stats(): per task and per worker counts


def run_demo(workdir: Path | None = None, shares: tuple[float, ...] = (0.85, 0.15), batch: int = 8, batches: int = 10,
             say: Callable[[str], None] = lambda _m: None, groups: str | None = None) -> DemoResult:
    """Build, partition, verify, calibrate and serve the demo model; return what happened."""
    groups = groups or default_demo_groups()
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="staronnx-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    model = inception_demo()
    model_path = root / "inception_demo.onnx"
    onnx.save(model, str(model_path))
    say(f"built an Inception-style model: {len(model.graph.node)} nodes -> {model_path}")

    say(f"partitioning with METIS into shares {shares} (costs profiled on the CPU)")
    plan = partition(model_path, list(shares), output_dir=root / "plan", force=True)
    linear = partition(model_path, list(shares), PartitionSpec(method="linear"), output_dir=root / "plan-linear",
                       force=True)

    say(f"verifying the {plan.k} chained parts against the whole model at batch {batch}")
    report = verify_plan(plan, model_path, batch=batch)

    say(f"running {batches} batches of {batch} through the whole model and through the parts")
    feeds = random_plan_feeds(plan, batch, seed=1)
    whole = make_session(model_path)
    whole.run(None, feeds)
    plan.run_reference(feeds)  # warm-up of the part sessions
    t0 = time.perf_counter()
    for _ in range(batches):
        whole.run(None, feeds)
    t1 = time.perf_counter()
    for _ in range(batches):
        plan.run_reference(feeds)
    t2 = time.perf_counter()

    say(f"calibrating perf models at batch {batch} on CPU groups {groups!r}")
    workers = start_workers(plan, MachineSpec(groups=groups))
    try:
        calibrate(plan, [batch], workers=workers)
    finally:
        for w in workers:
            w.close()
    say(f"serving {batches} batches through the runtime (heft, groups {groups!r})")
    with Runtime(plan, MachineSpec(groups)) as rt:
        rt.run(feeds)
        t3 = time.perf_counter()
        for fut in [rt.submit(feeds) for _ in range(batches)]:
            fut.result()
        t4 = time.perf_counter()
        stats = rt.stats()
    return DemoResult(model_path, len(model.graph.node), plan, plan.cut_bytes_per_sample, linear.cut_bytes_per_sample,
                      report, batch, batches, whole_seconds=(t1 - t0) / batches, chained_seconds=(t2 - t1) / batches,
                      runtime_seconds=(t4 - t3) / batches, groups=groups, stats=stats)


def default_demo_groups() -> str:
    """One group per NUMA node; on a single-node machine, two halves so the parts pipeline."""
    topo = Topology.from_system()
    cores = len(topo.allowed_cores())
    if len(topo.numa_nodes) > 1 or cores < 2:
        return "numa"
    return f"cores={(cores + 1) // 2}"


def summary_lines(result: DemoResult) -> list[str]:
    """Plain-text summary of a demo run."""
    plan = result.plan
    lines = [
        f"model: {result.model_path.name}, {result.model_nodes} nodes",
        f"plan: {plan.root} ({plan.k} parts, hash {plan.hash}, {plan.cost_source})",
    ]
    lines += [f"  part {p.index}: {p.nodes} nodes, share {p.share:.3f} (target {p.target_share:.2f}), "
              f"{len(p.inputs)} input(s), {len(p.outputs)} output(s)" for p in plan.parts]
    lines.append(f"cut: {result.metis_cut:,} bytes/sample with METIS vs {result.linear_cut:,} with the linear split")
    lines += [f"verify {o.name}: max abs diff {o.max_abs:.3g}, rel {o.max_rel:.3g} -> {'OK' if o.ok else 'MISMATCH'}"
              for o in result.report.outputs]
    per_sample_whole = result.whole_seconds / result.batch * 1e3
    per_sample_chain = result.chained_seconds / result.batch * 1e3
    lines.append(
        f"run: batch {result.batch} x {result.batches}: whole model {per_sample_whole:.2f} ms/sample, "
        f"chained parts {per_sample_chain:.2f} ms/sample "
        f"({result.whole_seconds / result.chained_seconds:.2f}x of the whole model's throughput)"
    )
    per_sample_rt = result.runtime_seconds / result.batch * 1e3
    lines.append(
        f"runtime (heft, groups {result.groups}): {per_sample_rt:.2f} ms/sample, "
        f"{result.whole_seconds / result.runtime_seconds:.2f}x the whole model's throughput"
    )
    lines += [f"  {key}: {row['tasks']} tasks, measured {row['measured_ms']:.2f} ms"
              + ("" if row["predicted_ms"] is None else f", predicted {row['predicted_ms']:.2f} ms")
              for key, row in result.stats["tasks"].items()]
    lines += [f"  worker {name}: {row['tasks']} tasks, busy {row['busy']:.0%}"
              for name, row in result.stats["workers"].items()]
    return lines
