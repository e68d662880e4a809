"""``staronnx run`` and ``staronnx trace plot``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from staronnx.cli.calibration_check import MODEL_FREE_POLICIES, warn_uncalibrated
from staronnx.errors import StaronnxError

console = Console()
trace_app = typer.Typer(help="Work with runtime traces.", no_args_is_help=True)


def run_cmd(
    plandir: Annotated[Path, typer.Argument(help="Plan folder.")],
    batch: Annotated[int, typer.Option(help="Batch size of each request.")] = 1,
    requests: Annotated[int, typer.Option(help="Number of requests.")] = 100,
    policy: Annotated[str, typer.Option(help="Scheduling policy: eager, random, ws, lws, dm, dmda, dmdar, dmdas, heft, or static (a placement-method plan run as placed).")] = "heft",
    groups: Annotated[str, typer.Option(help="CPU grouping policy.")] = "numa",
    cuda_streams: Annotated[int, typer.Option(help="CUDA workers per GPU.")] = 0,
    max_in_flight: Annotated[int, typer.Option(help="Requests queued at once.")] = 16,
    trace: Annotated[Optional[Path], typer.Option(help="Write a Perfetto/Chrome trace here.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random inputs.")] = 0,
) -> None:
    """Run random inputs through the runtime; print throughput, latency and placement."""
    from staronnx.plan import Plan
    from staronnx.runtime.runtime import Runtime
    from staronnx.verify import random_plan_feeds

    if batch < 1 or requests < 1:
        raise StaronnxError("--batch and --requests must be at least 1")
    plan = Plan.load(plandir)
    if policy.lower() not in MODEL_FREE_POLICIES:
        warn_uncalibrated(plandir, plan, groups=groups, cuda_streams=cuda_streams)
    pool = [random_plan_feeds(plan, batch, seed=seed + i) for i in range(min(requests, 8))]
    latencies: list[float] = []
    with Runtime(plan, policy=policy, cpu_groups=groups, cuda_streams=cuda_streams, trace=trace) as rt:
        rt.run(pool[0])  # warm-up
        start = time.perf_counter()
        inflight = []
        for i in range(requests):
            if len(inflight) >= max_in_flight:
                t0, fut = inflight.pop(0)
                fut.result()
                latencies.append(time.perf_counter() - t0)
            inflight.append((time.perf_counter(), rt.submit(pool[i % len(pool)])))
        for t0, fut in inflight:
            fut.result()
            latencies.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - start
        stats = rt.stats()
    lat = np.array(latencies) * 1e3
    console.print(
        f"{requests} requests x batch {batch} with {policy} in {elapsed:.2f} s: "
        f"{requests * batch / elapsed:.1f} samples/s; latency ms p50 {np.percentile(lat, 50):.2f} "
        f"p90 {np.percentile(lat, 90):.2f} p99 {np.percentile(lat, 99):.2f} max {lat.max():.2f}",
        highlight=False,
    )
    table = Table(title="placement")
    for col in ("part/arch", "tasks", "measured ms", "predicted ms"):
        table.add_column(col)
    for key, row in stats["tasks"].items():
        pred = row["predicted_ms"]
        table.add_row(key, str(row["tasks"]), f"{row['measured_ms']:.3f}", "-" if pred is None else f"{pred:.3f}")
    console.print(table)
    workers = Table(title="workers")
    for col in ("worker", "arch", "tasks", "busy"):
        workers.add_column(col)
    for name, row in stats["workers"].items():
        workers.add_row(name, row["arch"], str(row["tasks"]), f"{row['busy']:.0%}")
    console.print(workers)
    console.print(f"mean queue wait {stats['mean_queue_wait_ms']:.2f} ms")
    if trace is not None:
        console.print(f"trace written to {trace} (open in https://ui.perfetto.dev)")


@trace_app.command("plot")
def plot_cmd(
    trace: Annotated[Path, typer.Argument(help="Trace JSON written by --trace.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="PNG to write.")] = Path("gantt.png"),
) -> None:
    """Draw a runtime trace as a Gantt chart (one row per worker)."""
    from staronnx.runtime.gantt import plot_trace

    console.print(f"wrote {plot_trace(trace, output)}")


def register(app: typer.Typer) -> None:
    app.command("run")(run_cmd)
    app.add_typer(trace_app, name="trace")
