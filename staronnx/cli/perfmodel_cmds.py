"""``staronnx calibrate`` and ``staronnx perfmodel show``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from staronnx.cli.gpus import CUDA_DEVICES_HELP, THREAD_PER_STREAM_HELP, check_cuda_worker_flags, parse_cuda_devices
from staronnx.cli.sweep_cmds import parse_batch_sizes
from staronnx.errors import StaronnxError
from staronnx.fsutil import check_writable
from staronnx.plan import Plan
from staronnx.workers.layout import MachineSpec

if TYPE_CHECKING:
    from staronnx.calibrate import CalibrationReport
    from staronnx.perfmodels import PerfModelStore
    from staronnx.perfmodels.history import PerfRow
    from staronnx.workers.base import Worker

console = Console()
perfmodel_app = typer.Typer(help="Inspect calibrated performance models.", no_args_is_help=True)


def calibrate_cmd(
    plandir: Annotated[Path, typer.Argument(help="Plan folder.")],
    batch_sizes: Annotated[str, typer.Option(help="Batch sizes to calibrate.")] = "1,2,4,8,16",
    groups: Annotated[str, typer.Option(help="CPU grouping policy: numa, package, cores=N, ...")] = "numa",
    cuda_streams: Annotated[int, typer.Option(help="CUDA workers (streams) per GPU; 0 = none.")] = 0,
    cuda_devices: Annotated[Optional[str], typer.Option(help=CUDA_DEVICES_HELP)] = None,
    cuda_graphs: Annotated[bool, typer.Option(
        "--cuda-graphs/--no-cuda-graphs",
        help="Capture each (part, batch size) as a CUDA graph and replay it, as run, sweep and serve do by "
             "default: calibrate with the setting you will run with, so the models hold the times it gives.")] = True,
    thread_per_stream: Annotated[bool, typer.Option(
        "--cuda-thread-per-stream", help=THREAD_PER_STREAM_HELP)] = False,
    max_runs: Annotated[int, typer.Option(help="Cap on runs per (worker, part, batch).")] = 60,
    seed: Annotated[int, typer.Option(help="Seed of the random inputs.")] = 0,
    bus: Annotated[bool, typer.Option("--bus/--no-bus", help="Also measure the bus (NUMA, host<->GPU) if not stored yet.")] = True,
    replace: Annotated[bool, typer.Option("--replace", help="Measure the batch sizes afresh and replace their stored entries (stale ones: measurements above the LP bound); other batch sizes keep theirs.")] = False,
    host: Annotated[bool, typer.Option("--host/--no-host", help="Also measure what serving costs the host beyond the "
                                       "parts (the generator's lag, batching, hand-overs between threads, their CPU) "
                                       "with a few seconds of low-rate serving per batch size: the simulator and the "
                                       "LP bound add it.")] = True,
    input_shape: Annotated[Optional[list[str]], typer.Option(
        help="NAME=D1xD2x... for inputs with dynamic sizes, or several sizes NAME=S1,S2 (or the option "
             "repeated): each is a footprint calibrated apart, e.g. x=1x3x48x200,1x3x48x320. "
             "Default: the sizes the plan was partitioned at.")] = None,
) -> None:
    """Run every part on every worker at each batch size (on each input's own batch axis) and
    each --input-shape until its perf model is calibrated. A model that runs one request per
    task is calibrated at batch 1 only."""
    from staronnx.calibrate import (CalibrationReport, batch_sizes_for, calibrate, calibrate_bus_if_needed,
                                    calibration_steps, check_max_runs, start_workers)
    from staronnx.ortutil import quiet_ort_log
    from staronnx.partition.notation import read_input_shape_sets
    from staronnx.perfmodels import PerfModelStore
    from staronnx.verify import random_plan_feeds

    check_max_runs(max_runs)  # now, not once the workers have loaded the plan
    quiet_ort_log()
    plan = Plan.load(plandir)
    sizes, note = batch_sizes_for(plan, parse_batch_sizes(batch_sizes))
    shape_sets = read_input_shape_sets(input_shape or [], "--input-shape")
    for given in shape_sets:  # one line for a size the plan cannot take, before any worker starts
        random_plan_feeds(plan, 1, given)
    devices = parse_cuda_devices(cuda_devices, cuda_streams)
    check_cuda_worker_flags(cuda_streams, cuda_graphs=cuda_graphs, thread_per_stream=thread_per_stream)
    # the workers run, sweep and serve start with the same flags: a driver thread per stream
    # holds a core back per stream, which changes the CPU groups' widths (their archs)
    machine = MachineSpec(groups, cuda_streams, devices, cuda_graphs, thread_per_stream)
    store = PerfModelStore()
    store.check_writable()  # one line now, not after starting workers and measuring
    workers = start_workers(plan, machine)
    report = CalibrationReport()  # filled as it goes: what an interruption kept is read from it
    steps = calibration_steps(plan, workers, sizes, len(shape_sets))
    try:
        if note is not None:
            console.print(note, highlight=False, soft_wrap=True)
        shapes = "; input shapes " + " and ".join(
            ", ".join(f"{n}={'x'.join(map(str, d))}" for n, d in given.items()) for given in shape_sets
        ) if any(shape_sets) else ""
        console.print(f"calibrating plan {plan.hash} ({plan.k} parts) on {', '.join(w.name for w in workers)}"
                      f"{_drivers_text(workers)}; batch sizes {sizes}{shapes}", highlight=False, soft_wrap=True)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:  # the steps on stdout, where the results are
            task = progress.add_task("calibrating", total=steps)

            def step(msg: str) -> None:
                progress.update(task, advance=1, description=msg)

            calibrate(plan, sizes, workers=workers, store=store, max_runs=max_runs,
                      seed=seed, on_step=step, replace=replace, report=report, input_shapes=shape_sets)
        if report.busy:
            console.print(f"[yellow]warning:[/] {escape(report.busy)}", soft_wrap=True, highlight=False)
        if host and not report.uncalibrated:
            _measure_host(plan, sizes, report, machine, store=store, workers=workers, seed=seed)
    except BaseException:
        if report.interrupted:  # Ctrl-C, SIGTERM: the samples measured so far were stored
            console.print(f"calibration interrupted: kept {report.samples} sample(s) measured in "
                          f"{report.steps_done} of {steps} step(s) (worker x part x batch size) under "
                          f"{store.plan_dir(plan.hash)}; run the same command again to finish "
                          f"(what is calibrated already is not measured again)", highlight=False, soft_wrap=True)
        raise
    finally:
        for w in workers:
            w.close()
    console.print(f"models stored under {store.plan_dir(plan.hash)}")
    if bus:
        with console.status("calibrating the bus"):
            measured = calibrate_bus_if_needed(store, list(devices) if cuda_streams > 0 else [])
        if measured is not None:  # (the model, the memory nodes it links)
            console.print(f"bus model for {', '.join(measured[1])} stored in {store.bus_path()}")
        else:
            console.print("bus: one memory node or already calibrated (nothing to measure)")
    _print_rows(store.rows(plan.hash), plan)
    if report.uncalibrated:
        console.print(f"[yellow]not calibrated (too many outliers within {max_runs} runs):[/] "
                      + ", ".join(f"part {p} {a} batch {b}" for p, a, b in report.uncalibrated))


def _drivers_text(workers: Sequence[Worker]) -> str:
    """Who launches the CUDA workers' tasks, read off the started workers (as serve says it):
    ``, 1 driver thread for 2 streams`` (one per GPU) or ``, 2 driver threads for 2 streams``
    (--cuda-thread-per-stream); empty without CUDA workers."""
    streams = [w for w in workers if w.kind == "cuda"]
    if not streams:
        return ""
    threads = len({w.driver_key or w.name for w in streams})
    return (f", {threads} driver thread{'s' if threads != 1 else ''} for {len(streams)} "
            f"stream{'s' if len(streams) != 1 else ''}")


def _measure_host(plan: Plan, sizes: list[int], report: CalibrationReport, machine: MachineSpec, *,
                  store: PerfModelStore, workers: Sequence[Worker], seed: int) -> None:
    """The host-cost probe (:func:`staronnx.calibrate.calibrate_host`) on the calibration's
    workers, with what it found; a failure is one line (the perf models are kept anyway)."""
    from staronnx.calibrate import HostProbe, calibrate_host, speed_moved

    try:
        with console.status("measuring the host's own work per batch") as status:
            model = calibrate_host(plan, sizes, machine, HostProbe(seed=seed),
                                   store=store, workers=workers, calibration_machine=report.machine,
                                   on_step=lambda msg: status.update(msg))
    except StaronnxError as exc:
        console.print(f"[yellow]host costs not measured:[/] {escape(str(exc))}", soft_wrap=True, highlight=False)
        return
    for b, costs in sorted(model.costs.items()):
        console.print(f"host costs {costs.describe()}", highlight=False, soft_wrap=True)
        if costs.lighter is None:
            console.print(f"host costs: batch {b}: the loaded probe fell behind (the machine could not serve its "
                          "rate); the light probe's figures stand for every rate", highlight=False, soft_wrap=True)
    moved = speed_moved(model)
    if moved:
        console.print(f"[yellow]warning:[/] {escape(moved)}", soft_wrap=True, highlight=False)
    load = model.probe_machine or {}
    if load.get("busy"):
        console.print(f"[yellow]warning:[/] host costs {escape(str(load.get('why')))}", soft_wrap=True,
                      highlight=False)
    console.print(f"host costs stored in {store.host_path(plan.hash)}", highlight=False)


def _fmt_ms(seconds: float) -> str:
    return "-" if not math.isfinite(seconds) else f"{seconds * 1e3:.3f}"


def _print_rows(rows: Sequence[PerfRow], plan: Plan) -> None:
    """One row per (part, arch, footprint); a ``sizes`` column (the hash of the input sizes
    besides the batch, StarPU's footprint) where a part has models of several sizes."""
    table = Table(title=f"perf models of plan {plan.hash} (times in ms)")
    families = len({(r.part, r.arch, r.shape_hash) for r in rows}) > len({(r.part, r.arch) for r in rows})
    columns = ("part", "arch", *(("sizes",) if families else ()), "batch", "n", "mean", "stddev", "outliers",
               "regression a·n^b+c")
    for col in columns:
        table.add_column(col, justify="right" if col not in ("arch", "sizes", "regression a·n^b+c") else "left",
                         no_wrap=col == "sizes")
    for r in sorted(rows, key=lambda r: (r.part, r.arch, r.shape_hash, r.batch)):
        reg = r.regression
        fit = (f"{reg.a * 1e3:.3g}·n^{reg.b:.2f}+{reg.c * 1e3:.3g} (r²={reg.r2:.3f})"
               if reg is not None else "-")
        table.add_row(str(r.part), r.arch, *((r.shape_hash,) if families else ()), str(r.batch), str(r.n),
                      _fmt_ms(r.mean), _fmt_ms(r.stddev), str(r.nerror), fit)
    console.print(table)


def _print_verdict(plan: Plan, store: PerfModelStore, rows: Sequence[PerfRow], spec: MachineSpec) -> None:
    """Which is predicted faster: this plan on the runtime's workers (the LP bound over the
    calibrated models) or the whole model on the fastest arch alone (the sum of its parts)."""
    from staronnx.bench.bound import machine_bound
    from staronnx.bench.machine import build_machine

    try:
        machine = build_machine(plan, spec, store=store, cpu_fallback=False)
    except StaronnxError as exc:
        console.print(f"no prediction against one part: {exc}", soft_wrap=True)
        return
    means = {(r.part, r.arch, r.batch): r.mean for r in rows if math.isfinite(r.mean)}
    for batch in sorted({r.batch for r in rows}):
        alone = {a: sum(means.get((p, a, batch), math.inf) for p in range(plan.k)) for a in machine.archs}
        arch, whole = min(alone.items(), key=lambda kv: kv[1])
        try:
            bound = machine_bound(machine, batch).throughput
        except Exception:  # noqa: BLE001 - a (part, arch) without a model at this batch size
            continue
        if not math.isfinite(whole):
            continue
        one = batch / whole
        faster = "this plan" if bound > one else f"the whole model on {arch} alone"
        console.print(f"batch {batch}: this plan on {len(machine.workers)} worker(s) (LP bound) {bound:,.0f} "
                      f"samples/s; the whole model on {arch} alone {one:,.0f}: {faster} is predicted faster "
                      f"(x{max(bound, one) / min(bound, one):.2f})", soft_wrap=True)


@perfmodel_app.command("show")
def show_cmd(
    plandir: Annotated[Path, typer.Argument(help="Plan folder.")],
    plot: Annotated[Optional[Path], typer.Option(help="Also draw time vs batch size to this PNG.")] = None,
    groups: Annotated[str, typer.Option(help="CPU groups of the comparison (as for run/sweep).")] = "numa",
    cuda_streams: Annotated[int, typer.Option(help="CUDA workers of the comparison.")] = 0,
    cuda_devices: Annotated[Optional[str], typer.Option(help="GPUs of the comparison, --cuda-streams workers on "
                                                             "each (0,1 or 0-3 or all). Default: 0.")] = None,
) -> None:
    """Table of every calibrated model of a plan: part, arch, batch, n, mean, stddev, regression;
    then, per batch size, whether the plan on these workers is predicted faster than the whole
    model on its fastest device alone."""
    from staronnx.perfmodels import PerfModelStore

    if plot is not None:
        check_writable(plot, "--plot")
    # models may come from another host: GPUs not checked against this one's
    machine = MachineSpec(groups, cuda_streams, parse_cuda_devices(cuda_devices, cuda_streams, simulated=True))
    plan = Plan.load(plandir)
    store = PerfModelStore()
    rows = store.rows(plan.hash)
    if not rows:
        raise StaronnxError(f"no perf models for plan {plan.hash} under {store.plan_dir(plan.hash)}; "
                            f"run `staronnx calibrate {plandir}` first")
    _print_rows(rows, plan)
    _print_verdict(plan, store, rows, machine)
    if plot is not None:
        from staronnx.perfmodels.plot import plot_rows

        console.print(f"plot written to {plot_rows(rows, plot, title=f'plan {plan.hash}')}")


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate_cmd)
    app.add_typer(perfmodel_app, name="perfmodel")
