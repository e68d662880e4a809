"""``staronnx simulate``: what-if serving from the perf models, in seconds instead of hours.

Runs the discrete-event simulator (:mod:`staronnx.bench.simulator`) with the runtime's own
policy on this machine or a synthetic one, and prints what a live sweep point would report
(through :func:`staronnx.serving.metrics.summarize`, the live runs' metrics) next to the LP
throughput bound (:mod:`staronnx.bench.bound`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from staronnx.cli.calibration_check import warn_uncalibrated
from staronnx.cli.display import output_console
from staronnx.errors import StaronnxError

console = output_console()


def _scale(text: str | None) -> float | tuple[float, ...] | None:
    """``--cuda-scale``: one factor, or one per part separated by commas."""
    if text is None:
        return None
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise StaronnxError(f"--cuda-scale takes a number or one per part (0.1,0.3), got {text!r}") from None
    return values[0] if len(values) == 1 else values


def _with_pus(description: str) -> str:
    """hwloc's synthetic syntax needs a PU level; ``"pack:2 numa:2 core:8"`` means one per core."""
    return description if "pu:" in description else f"{description.strip()} pu:1"


def _ms(seconds: Any) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.2f}"


def simulate_cmd(
    plandir: Annotated[Path, typer.Argument(help="Plan folder (calibrated: staronnx calibrate).")],
    rate: Annotated[float, typer.Option(help="Offered load, single-sample requests per second.")],
    batch: Annotated[int, typer.Option(help="Batch size b (a batch leaves when full).")],
    policy: Annotated[str, typer.Option(help="Scheduling policy (eager, random, ws, lws, dm, dmda, dmdar, dmdas, heft).")] = "heft",
    groups: Annotated[str, typer.Option(help="CPU grouping policy (numa, package, cores=N, ...).")] = "numa",
    synthetic: Annotated[str | None, typer.Option(help="Simulate a made-up machine, e.g. 'pack:2 numa:2 core:8'.")] = None,
    cuda_streams: Annotated[int, typer.Option(help="CUDA workers (streams) on device 0.")] = 0,
    cuda_scale: Annotated[str | None, typer.Option(
        help="What-if GPU: its time = this factor x the widest CPU group's (one, or one per part).")] = None,
    distribution: Annotated[str, typer.Option(help="Arrivals: constant or poisson.")] = "constant",
    duration: Annotated[str, typer.Option(help="Simulated arrivals: 10s, 500ms, 2m, or plain seconds.")] = "10s",
    requests: Annotated[int | None, typer.Option(help="Number of requests (instead of --duration).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of arrivals and execution-time draws.")] = 0,
    max_delay: Annotated[str | None, typer.Option(
        help="How long the oldest request may wait before a partial batch leaves: 5ms, 0.005, 0 (none).")] = None,
    spread: Annotated[float, typer.Option(help="Scale of the models' standard deviations (0: means only).")] = 1.0,
    queue_capacity: Annotated[int, typer.Option(help="Server queue capacity (arrivals beyond it are rejected).")] = 1024,
) -> None:
    """Simulate serving a plan from its perf models; print throughput, latency, placement and
    the LP throughput bound."""
    from staronnx.bench.bound import machine_bound
    from staronnx.bench.simulator import build_machine, simulate
    from staronnx.durations import parse_duration
    from staronnx.plan import Plan
    from staronnx.workers.topology import Topology

    seconds = parse_duration(duration, option="--duration")
    delay = None if max_delay is None else parse_duration(max_delay, allow_zero=True, option="--max-delay")
    plan = Plan.load(plandir)
    if synthetic is None:  # a made-up machine borrows this one's models by design (see the notes)
        warn_uncalibrated(plandir, plan, groups=groups, cuda_streams=cuda_streams,
                          skip_archs=["cuda0"] if cuda_scale is not None else ())
    topology = Topology.from_synthetic(_with_pus(synthetic)) if synthetic else None
    machine = build_machine(plan, groups=groups, topology=topology, cuda_streams=cuda_streams,
                            cuda_scale=_scale(cuda_scale))
    result = simulate(
        machine=machine, rate=rate, batch_size=batch, policy=policy, duration=seconds,
        n_requests=requests, distribution=distribution, seed=seed, max_delay=delay,
        spread=spread, queue_capacity=queue_capacity,
    )
    bound = machine_bound(machine, batch)
    m = result.metrics()
    names = ", ".join(f"{w.name} ({w.arch})" for w in result.workers)
    console.print(f"simulated {plan.root} with {policy} on {len(result.workers)} worker(s): {names}",
                  highlight=False)
    console.print(
        f"offered {m['offered_rate']:.1f} req/s, batch {batch}: throughput {m['throughput']:.1f} samples/s; "
        f"papers' latency {_ms(m['paper_latency_mean'])} ms (std {_ms(m['paper_latency_std'])}); "
        f"per request p50 {_ms(m['latency_p50'])} ms, p99 {_ms(m['latency_p99'])} ms; "
        f"{m['rejected']} rejected; {'CONGESTED' if m['congested'] else 'stable load'}",
        highlight=False,
    )
    achieved = m["throughput"] / bound.throughput if bound.throughput > 0 else math.nan
    binding = ", ".join(b.name for b in bound.binding) or "-"
    console.print(
        f"LP bound {bound.throughput:.1f} samples/s at batch {batch} "
        f"(achieved / bound {achieved:.1%}); binding: {binding}",
        highlight=False,
    )

    table = Table(title="placement (simulated vs LP optimum)")
    for col in ("part", "arch", "tasks", "share", "LP share"):
        table.add_column(col, overflow="fold")
    lp_share = bound.arch_share()
    keys = sorted(set(result.placement) | set(lp_share))
    for part, arch in keys:
        n = result.placement.get((part, arch), 0)
        share = result.share(part).get(arch, 0.0)
        table.add_row(str(part), arch, str(n), f"{share:.0%}", f"{lp_share.get((part, arch), 0.0):.0%}")
    console.print(table)
    workers = Table(title="workers")
    for col in ("worker", "arch", "memory node", "busy", "LP busy"):
        workers.add_column(col, overflow="fold")
    for w in result.workers:
        workers.add_row(w.name, w.arch, w.memory_node, f"{result.busy[w.name]:.0%}",
                        f"{bound.utilization.get(w.name, 0.0):.0%}")
    console.print(workers)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False)
    console.print(f"({result.events} events in {result.wall_seconds:.2f} s)", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate_cmd)
