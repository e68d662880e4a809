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
from typing import Callable

import numpy as np
import onnx

from staronnx.ortutil import make_session
from staronnx.partition.api import partition
from staronnx.plan import Plan
from staronnx.verify import VerifyReport, random_plan_feeds, verify_plan
from staronnx.zoo import inception_demo


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


def run_demo(
    workdir: Path | None = None,
    shares: tuple[float, ...] = (0.85, 0.15),
    batch: int = 8,
    batches: int = 10,
    say: Callable[[str], None] = lambda _m: None,
) -> DemoResult:
    """Build, partition, verify and run the demo model; return what happened."""
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="staronnx-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    model = inception_demo()
    model_path = root / "inception_demo.onnx"
    onnx.save(model, str(model_path))
    say(f"built an Inception-style model: {len(model.graph.node)} nodes -> {model_path}")

    say(f"partitioning with METIS into shares {shares} (costs profiled on the CPU)")
    plan = partition(model_path, list(shares), output_dir=root / "plan", force=True)
    linear = partition(
        model_path, list(shares), output_dir=root / "plan-linear", method="linear", force=True
    )

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
    return DemoResult(
        model_path=model_path,
        model_nodes=len(model.graph.node),
        plan=plan,
        metis_cut=plan.cut_bytes_per_sample,
        linear_cut=linear.cut_bytes_per_sample,
        report=report,
        batch=batch,
        batches=batches,
        whole_seconds=(t1 - t0) / batches,
        chained_seconds=(t2 - t1) / batches,
    )


def summary_lines(result: DemoResult) -> list[str]:
    """Plain-text summary of a demo run."""
    plan = result.plan
    lines = [
        f"model: {result.model_path.name}, {result.model_nodes} nodes",
        f"plan: {plan.root} ({plan.k} parts, hash {plan.hash}, {plan.cost_source})",
    ]
    for p in plan.parts:
        lines.append(
            f"  part {p.index}: {p.nodes} nodes, share {p.share:.3f} (target {p.target_share:.2f}), "
            f"{len(p.inputs)} input(s), {len(p.outputs)} output(s)"
        )
    lines.append(
        f"cut: {result.metis_cut:,} bytes/sample with METIS vs {result.linear_cut:,} with the "
        f"linear split"
    )
    for o in result.report.outputs:
        lines.append(
            f"verify {o.name}: max abs diff {o.max_abs:.3g}, rel {o.max_rel:.3g} -> "
            f"{'OK' if o.ok else 'MISMATCH'}"
        )
    per_sample_whole = result.whole_seconds / result.batch * 1e3
    per_sample_chain = result.chained_seconds / result.batch * 1e3
    lines.append(
        f"run: batch {result.batch} x {result.batches}: whole model {per_sample_whole:.2f} ms/sample, "
        f"chained parts {per_sample_chain:.2f} ms/sample "
        f"({result.whole_seconds / result.chained_seconds:.2f}x of the whole model's throughput)"
    )
    return lines
