"""``staronnx run`` and ``staronnx trace plot``."""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
import typer

from staronnx.cli.calibration_check import MODEL_FREE_POLICIES, warn_uncalibrated
from staronnx.cli.display import QUIET_HELP, above, output_console, table_of
from staronnx.cli.display import bar as progress_bar
from staronnx.cli.given import given_on_command_line
from staronnx.cli.gpus import (CUDA_DEVICES_HELP, THREAD_PER_STREAM_HELP, check_cuda_worker_flags, host_core_name,
                               parse_cuda_devices)
from staronnx.errors import StaronnxError
from staronnx.fsutil import check_writable, written_path
from staronnx.workers.layout import MachineSpec

console = output_console()
trace_app = typer.Typer(help="Work with runtime traces.", no_args_is_help=True)


def run_cmd(
    ctx: typer.Context,
    plandir: Annotated[Path, typer.Argument(help="Plan folder.")],
    batch: Annotated[int, typer.Option(help="Batch size of each request.")] = 1,
    requests: Annotated[int, typer.Option(help="Number of requests.")] = 100,
    policy: Annotated[str, typer.Option(help="Scheduling policy: eager, random, ws, lws, dm, dmda, dmdar, dmdas, heft, or static (a placement-method plan run as placed).")] = "heft",
    groups: Annotated[str, typer.Option(help="CPU grouping policy.")] = "numa",
    cuda_streams: Annotated[int, typer.Option(help="CUDA workers per GPU.")] = 0,
    cuda_devices: Annotated[Optional[str], typer.Option(help=CUDA_DEVICES_HELP)] = None,
    cuda_graphs: Annotated[bool, typer.Option(
        "--cuda-graphs/--no-cuda-graphs",
        help="Capture each (part, batch size) as a CUDA graph at warm-up and replay it (fewer "
             "kernel launches at small batches); on by default where a part can be captured.")] = True,
    thread_per_stream: Annotated[bool, typer.Option(
        "--cuda-thread-per-stream", help=THREAD_PER_STREAM_HELP)] = False,
    colocate: Annotated[bool, typer.Option(
        "--colocate", help="Submit from the CUDA driver thread's core, or without --cuda-streams from the first CPU "
                           "worker's (this thread and that one hold the GIL in turn; a hand-over on one core costs "
                           "less than one between two).")] = False,
    max_in_flight: Annotated[int, typer.Option(help="Requests queued at once.")] = 16,
    trace: Annotated[Optional[Path], typer.Option(help="Write a Perfetto/Chrome trace here.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random inputs.")] = 0,
    inputs: Annotated[Optional[Path], typer.Option(
        help="Real inputs: an .npz keyed by the model's input names, samples along axis 0 "
             "(numpy.savez); batches cycle through them. Default: random inputs.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)] = False,
) -> None:
    """Run requests (random inputs, or --inputs) through the runtime; print throughput,
    latency and placement. One warm-up request runs first and is left out of every figure.
    Samples/s counts the samples computed (a model that runs one request per task computes one
    per request, whatever --batch says); a request that fails is counted failed, never as
    throughput, and its error is one line."""
    from staronnx.inputs import batches, load_inputs, samples
    from staronnx.ortutil import quiet_ort_log
    from staronnx.plan import Plan
    from staronnx.runtime.runtime import Runtime
    from staronnx.runtime.spec import RuntimeSpec
    from staronnx.verify import random_plan_feeds, runnable_batch

    if batch < 1 or requests < 1:
        raise StaronnxError("--batch and --requests must be at least 1")
    if max_in_flight < 1:  # else the submit loop pops a request from an empty window
        raise StaronnxError(f"--max-in-flight must be at least 1, got {max_in_flight}")
    if inputs is not None and "seed" in given_on_command_line(ctx):  # else dropped without a word
        raise StaronnxError("--seed seeds the random inputs; --inputs brings its own arrays: give one of them")
    devices = parse_cuda_devices(cuda_devices, cuda_streams)
    check_cuda_worker_flags(cuda_streams, cuda_graphs=cuda_graphs, thread_per_stream=thread_per_stream)
    if trace is not None:
        check_writable(trace, "--trace")  # now, not once every request has run
    quiet_ort_log()
    plan = Plan.load(plandir)
    real = None if inputs is None else load_inputs(inputs, plan)
    if policy.lower() not in MODEL_FREE_POLICIES:
        warn_uncalibrated(plandir, plan, MachineSpec(groups, cuda_streams, devices, cuda_graphs, thread_per_stream))
    batch, note = runnable_batch(plan, batch)
    if note is not None:
        console.print(note, highlight=False, soft_wrap=True)
    if real is None:
        pool = [random_plan_feeds(plan, batch, seed=seed + i) for i in range(min(requests, 8))]
    else:
        n = samples(real, plan)
        pool = batches(real, plan, batch, min(requests, max(1, math.ceil(n / batch))))
        console.print(f"inputs from {inputs}: {n} sample(s)", highlight=False, soft_wrap=True)
    rows = [plan.contract.rows(feeds) for feeds in pool]  # the samples each request computes
    latencies: list[float] = []
    failures: list[tuple[int, BaseException]] = []
    computed = 0
    stats: dict[str, Any] | None = None
    trace_error: OSError | None = None
    try:
        with Runtime(plan, MachineSpec(groups, cuda_streams, devices, cuda_graphs, thread_per_stream),
                     RuntimeSpec(policy, trace=trace, warmup=(batch,) if cuda_streams else ())) as rt:
            try:
                rt.run(pool[0])  # warm-up: first-run allocations stay out of the figures
            except Exception:  # noqa: BLE001 - the requests below fail the same way and are counted
                pass
            warm = rt.stats()
            # the progress bar's thread starts first: only this thread joins the driver's core
            with progress_bar(quiet) as progress, rt.colocate() if colocate else contextlib.nullcontext() as core:
                if core is not None:
                    above(progress, console).print(f"submitting from the {host_core_name(cuda_streams)} (PU {core})",
                                                   highlight=False)
                done = progress.add_task("requests", total=requests)
                start = time.perf_counter()
                inflight: list[tuple[int, float, Any]] = []

                def settle(i: int, t0: float, fut: Any) -> None:
                    nonlocal computed
                    try:
                        fut.result()
                    except Exception as exc:  # noqa: BLE001 - a model's error: counted, said once
                        failures.append((i, exc))
                    else:
                        latencies.append(time.perf_counter() - t0)
                        computed += rows[i % len(pool)]
                    progress.advance(done)

                for i in range(requests):
                    if len(inflight) >= max_in_flight:
                        settle(*inflight.pop(0))
                    inflight.append((i, time.perf_counter(), rt.submit(pool[i % len(pool)])))
                for item in inflight:
                    settle(*item)
                elapsed = time.perf_counter() - start
            stats = since(warm, rt.stats())
    except OSError as exc:
        # the trace is written when the runtime closes: the folder can go away meanwhile; the
        # requests ran, so their results are printed all the same, then the error
        if stats is None or trace is None:
            raise
        trace_error = exc
    completed = len(latencies)
    failed = f", {len(failures)} failed" if failures else ""
    if not completed:
        console.print(f"{requests} requests with {policy} in {elapsed:.2f} s: 0 completed{failed}; 0 samples computed",
                      highlight=False)
        raise failure_error(plan, pool, failures, requests)
    lat = np.array(latencies) * 1e3
    per = rows[0] if len(set(rows)) == 1 else None
    shape = f" x batch {per}" if per is not None else ""
    console.print(
        f"{requests} requests{shape} with {policy} in {elapsed:.2f} s: {completed} completed{failed}; "
        f"{computed} samples computed, {computed / elapsed:.1f} samples/s; latency ms p50 {np.percentile(lat, 50):.2f} "
        f"p90 {np.percentile(lat, 90):.2f} p99 {np.percentile(lat, 99):.2f} max {lat.max():.2f}",
        highlight=False,
    )
    table = table_of("placement (after 1 warm-up request)", ("part/arch", "tasks", "measured ms", "predicted ms"),
                     fold=True)
    for key, row in stats["tasks"].items():
        pred = row["predicted_ms"]
        table.add_row(key, str(row["tasks"]), f"{row['measured_ms']:.3f}", "-" if pred is None else f"{pred:.3f}")
    console.print(table)
    graphs = any("graphs" in row for row in stats["workers"].values())
    drivers = any("driver" in row for row in stats["workers"].values())
    workers = table_of("workers", ("worker", "arch", "tasks", "busy", *(("CUDA graphs",) if graphs else ()),
                                   *(("driver thread",) if drivers else ())), fold=True)
    for name, row in stats["workers"].items():
        cells = [name, row["arch"], str(row["tasks"]), f"{row['busy']:.0%}"]
        if graphs:
            cells.append(graph_summary(row.get("graphs")))
        if drivers:
            cells.append(driver_summary(row.get("driver")))
        workers.add_row(*cells)
    console.print(workers)
    console.print(f"mean queue wait {stats['mean_queue_wait_ms']:.2f} ms")
    if trace_error is not None:
        where = written_path(trace_error.filename) if trace_error.filename else trace
        raise StaronnxError(f"could not write the trace --trace {trace}: {trace_error.strerror or trace_error}"
                            + (f" ({where})" if str(where) != str(trace) else ""))
    if trace is not None:
        console.print(f"trace written to {trace} (open in https://ui.perfetto.dev)")
    if failures:
        raise failure_error(plan, pool, failures, requests)


def driver_summary(driver: dict[str, Any] | None) -> str:
    """The thread that launches a CUDA worker's tasks, and its core: ``cuda0 on PU 3`` (the
    GPU's one driver) or ``cuda0.s1 (own) on PU 2`` (``--cuda-thread-per-stream``)."""
    if driver is None:
        return "-"
    thread: str = driver["thread"]
    return thread + ("" if driver["pu"] is None else f" on PU {driver['pu']}")


def failure_error(plan: Any, pool: list[dict[str, np.ndarray]], failures: list[tuple[int, BaseException]],
                  requests: int) -> StaronnxError:
    """The one line for requests that failed: how many, and the first one's error as the model
    gave it (the input, its axis, what the model requires), never a traceback."""
    from staronnx.verify import model_failure

    index, exc = failures[0]
    first = exc if isinstance(exc, StaronnxError) else model_failure(plan, pool[index % len(pool)], exc)
    return StaronnxError(f"{len(failures)} of {requests} requests failed; the first: {first}")


def graph_summary(graphs: dict[str, int] | None) -> str:
    """A CUDA worker's graphs in one cell: what it captured, replays, and failed captures."""
    if graphs is None:
        return "-"
    text = f"{graphs['captured']} captured, {graphs['replays']} replays"
    return text + (f", {graphs['failed']} failed" if graphs["failed"] else "")


def since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``Runtime.stats()`` over the span between two snapshots, so the warm-up request is in
    no count, mean or busy fraction (the means are weighted back out of the totals)."""
    tasks: dict[str, dict[str, Any]] = {}
    for key, row in after["tasks"].items():
        old = before["tasks"].get(key, {"tasks": 0, "measured_ms": 0.0, "predicted_ms": None})
        n = row["tasks"] - old["tasks"]
        if n <= 0:
            continue

        def mean(field: str, row: dict[str, Any] = row, old: dict[str, Any] = old, n: int = n) -> float | None:
            if row[field] is None:
                return None
            total: float = row[field] * row["tasks"] - (old[field] or 0.0) * old["tasks"]
            return total / n

        tasks[key] = {"tasks": n, "measured_ms": mean("measured_ms"), "predicted_ms": mean("predicted_ms")}
    span = max(after["elapsed_s"] - before["elapsed_s"], 1e-9)
    workers = {}
    for name, row in after["workers"].items():
        old = before["workers"].get(name, {"tasks": 0, "busy": 0.0})
        busy = (row["busy"] * after["elapsed_s"] - old["busy"] * before["elapsed_s"]) / span
        workers[name] = {**row, "tasks": row["tasks"] - old["tasks"], "busy": min(max(busy, 0.0), 1.0)}
    return {**after, "tasks": tasks, "workers": workers}


@trace_app.command("plot")
def plot_cmd(
    trace: Annotated[Path, typer.Argument(help="Trace JSON written by --trace.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="PNG to write.")] = Path("gantt.png"),
    compare: Annotated[Optional[Path], typer.Option(
        help="Another trace on the same clock to draw row by row with this one (default: a sweep's simulated "
             "twin T.sim.json beside T.json, or the live T.json beside T.sim.json).")] = None,
    alone: Annotated[bool, typer.Option("--alone", help="Draw this trace only, not its twin.")] = False,
) -> None:
    """Draw a runtime trace as a Gantt chart (one row per worker; a sweep's tasks coloured by
    point in numeric order; live and simulated rows side by side when both traces exist)."""
    from staronnx.runtime.gantt import plot_trace

    if alone and compare is not None:  # else the comparison was drawn and --alone dropped
        raise StaronnxError("--alone draws this trace only and --compare draws another beside it: give one of them")
    check_writable(output, "--output")
    console.print(f"wrote {plot_trace(trace, output, compare=compare, twin=not alone)}")


def register(app: typer.Typer) -> None:
    app.command("run")(run_cmd)
    app.add_typer(trace_app, name="trace")
