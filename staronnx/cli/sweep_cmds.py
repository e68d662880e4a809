"""``staronnx sweep``, ``staronnx sweep-plot`` and ``staronnx optimize-batch``: the command
line's text (rates, batch sizes, durations) parsed here, the work done by
:func:`staronnx.bench.sweep.sweep`, :mod:`staronnx.bench.plots` and
:func:`staronnx.bench.optimize.optimize_batch`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import Progress, TaskID
from rich.table import Table

from staronnx.cli.calibration_check import warn_uncalibrated
from staronnx.cli.display import QUIET_HELP, above, output_console, table_of
from staronnx.cli.display import bar as progress_bar
from staronnx.cli.given import given_on_command_line
from staronnx.cli.gpus import (CUDA_DEVICES_HELP, THREAD_PER_STREAM_HELP, check_cuda_worker_flags, cuda_summary,
                               host_core_name, parse_cuda_devices)
from staronnx.cli.serve_cmd import MODEL_WORKERS_HELP
from staronnx.cli.simulate_cmd import SIM_LANE_HELP, GroupsOption, NameOption, PolicyOption, PriorityOption, \
    SloOption, check_models_options, models_options
from staronnx.durations import parse_duration
from staronnx.errors import StaronnxError
from staronnx.fsutil import check_writable
from staronnx.workers.layout import MachineSpec

if TYPE_CHECKING:  # the bench is imported when a command runs, not when the CLI starts
    from staronnx.bench.sweep import SweepEvent

console = output_console()


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def parse_rates(text: str) -> list[float]:
    """``--rates``: ``"50:800:50"`` (start:stop:step, stop included), ``"100,200,400"``, or both
    mixed -> sorted distinct rates."""
    rates: list[float] = []
    for item in (s.strip() for s in str(text).split(",")):
        if not item:
            continue
        try:
            if ":" in item:
                bits = [float(x) for x in item.split(":")]
                if len(bits) == 2:
                    bits.append(bits[0])
                if len(bits) != 3:
                    raise ValueError
                start, stop, step = bits
                if step <= 0 or stop < start:
                    raise ValueError
                n = math.floor((stop - start) / step + 1e-9) + 1
                rates.extend(start + i * step for i in range(n))
            else:
                rates.append(float(item))
        except ValueError:
            raise StaronnxError(
                f"--rates expects requests/s like 50:800:50 (start:stop:step) or 100,200,400; got {text!r}"
            ) from None
    if not rates or any(not (math.isfinite(r) and r > 0) for r in rates):
        raise StaronnxError(f"--rates needs at least one positive rate, got {text!r}")
    return sorted({round(r, 9) for r in rates})


def parse_batch_sizes(text: str) -> list[int]:
    """``--batch-sizes``: ``"1,2,4,8,16"`` -> sorted distinct positive ints."""
    try:
        sizes = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise StaronnxError(f"--batch-sizes expects positive integers like 1,2,4,8, got {text!r}")
    return sorted(set(sizes))


def _labels(text: str | None, count: int) -> list[str] | None:
    if text is None:
        return None
    labels = [s.strip() for s in text.split(",")]
    if len(labels) != count:
        raise StaronnxError(f"--labels has {len(labels)} names for {count} result folder(s)")
    return labels


class _Bars:
    """Rich progress bars driven by the sweep's :class:`~staronnx.bench.sweep.SweepEvent`: a bar
    over the points and one over a point's requests; a line per measured point (per mix, with a
    part per model, for several models)."""

    def __init__(self, progress: Progress, mixed: bool = False) -> None:
        self.progress = progress
        self.mixed = mixed
        self.points: TaskID | None = None
        self.requests: TaskID | None = None
        #: points measured and planned so far, for the interruption message
        self.measured = 0
        self.total = 0

    @staticmethod
    def _bar(task: TaskID | None) -> TaskID:
        """A bar the ``start`` event made (every other event comes after it)."""
        if task is None:
            raise RuntimeError("a sweep event before the sweep's start event, or a per-point bar in a mixed sweep")
        return task

    def __call__(self, event: SweepEvent) -> None:
        p = self.progress
        if event.kind == "start":
            self.total = event.total
            self.points = p.add_task("mixes" if self.mixed else "sweep points", total=event.total)
            self.requests = None if self.mixed else p.add_task("warming up", total=None)
        elif event.kind == "point" and self.mixed:
            p.update(self._bar(self.points), description=f"mix {event.message}")
        elif event.kind == "warmup" and not self.mixed:
            p.update(self._bar(self.requests), description=f"warmed up batch {event.batch_size}")
        elif event.kind == "point":
            again = " (again, longer: unstable)" if event.attempt > 1 else ""
            p.reset(self._bar(self.requests), total=event.requests,
                    description=f"b={event.batch_size} @ {event.rate:g} req/s{again}")
        elif event.kind == "requests" and not self.mixed:
            p.update(self._bar(self.requests), completed=event.submitted, total=event.requests)
        elif event.kind == "done":
            self.measured += 1
            p.update(self._bar(self.points), completed=event.index)
            above(p, console).print(_done_line(event.row or {}, self.mixed), highlight=False)
        elif event.kind == "skipped":
            p.update(self._bar(self.points), completed=event.index)
            why = event.message or f"congested at {event.rate:g} req/s"
            above(p, console).print(f"[dim]{event.message}: skipped (a lower mix was congested)[/]" if self.mixed else
                                    f"[dim]b={event.batch_size}: {escape(why)}; skipping "
                                    f"{', '.join(f'{r:g}' for r in event.skipped)}[/]")
        elif event.kind in ("end", "interrupted"):
            if event.kind == "end":
                p.update(self._bar(self.points), completed=event.total)
            if self.requests is not None:  # the per-point bar means nothing once the sweep stops
                p.remove_task(self.requests)
                self.requests = None


def _done_line(row: dict[str, Any], mixed: bool) -> str:
    """What a measured point prints: its figures (a mix: each model's)."""
    from staronnx.bench.results import row_state

    if mixed:
        return f"{row['mix']}: " + "; ".join(
            f"{r['model']} {_fmt(r.get('throughput'), 1)} samples/s p99 {_fmt(r.get('latency_p99_ms'))} ms"
            + (f" ({r['deadline_misses']} late)" if r.get("deadline_misses") is not None else "")
            + (f" {_state_markup(r)}" if row_state(r) in ("failed", "congested") else "") for r in row["rows"])
    return (f"b={row.get('batch_size')} @ {_fmt(row.get('offered_rate'), 0)} req/s: "
            f"{_fmt(row.get('throughput'), 1)} samples/s, papers' latency "
            f"{_fmt(row.get('paper_latency_mean_ms'))} ms (std {_fmt(row.get('paper_latency_std_ms'))}), "
            f"p99 {_fmt(row.get('latency_p99_ms'))} ms, {_state_markup(row)}")


def _state_markup(row: dict[str, Any]) -> str:
    """A point's state as the progress line shows it: failed with its reason, in red."""
    from staronnx.bench.results import row_state

    state = row_state(row)
    if state == "failed":
        return f"[red]failed[/] ({escape(str(row.get('notes') or 'its requests failed'))})"
    return {"congested": "[red]congested[/]", "unstable": "[yellow]unstable[/]"}.get(state, state)


def _busy_cell(row: dict[str, Any]) -> str:
    """``busy (others 47%)`` for a point measured beside other work, ``slowed (tasks x1.71)`` for
    one whose tasks ran that much slower than at the points before it, both where both held
    (a busy loop beside a worker does both), else empty."""
    from staronnx.bench.cpuload import BUSY_SHARE
    from staronnx.bench.sweep import others_share

    if not row.get("machine_busy"):
        return ""
    said = []
    if others_share(row) > BUSY_SHARE or not row.get("machine_slowed"):
        said.append(f"busy (others {others_share(row):.0%})")
    if row.get("machine_slowed"):
        said.append(f"slowed (tasks x{row['machine_slowed']:.2f})")
    return ", ".join(said)


def _print_point_notes(rows: list[dict[str, Any]]) -> None:
    """Each point's own notes (why its requests failed), one line each, under its table."""
    for r in rows:
        if r.get("notes"):
            where = (f"mix {r['mix']} model {r['model']}" if "model" in r
                     else f"b={r['batch_size']} @ {_fmt(r['offered_rate'], 0)} req/s")
            console.print(f"{where}: {r.get('state') or 'note'}: {r['notes']}", highlight=False, soft_wrap=True,
                          markup=False)


def _print_fidelity(rows: list[dict[str, Any]]) -> None:
    """Simulated vs measured, point by point, then the aggregate errors."""
    from staronnx.bench.fidelity import KNEE, describe_band, fidelity_summary

    simulated = [r for r in rows if "sim_throughput" in r]
    if not simulated:
        console.print("[yellow]no point could be simulated (calibrate the plan: staronnx calibrate)[/]")
        return
    mixed = any("model" in r for r in simulated)  # a mixed sweep: a row per mix and model
    banded = any("sim_fragile" in r for r in simulated)
    table = table_of("simulator vs measurement (error = simulated / measured - 1)",
                     (*(("mix", "model") if mixed else ()), "b", "offered", "thr. live", "thr. sim", "error",
                      "p50 live", "p50 sim", "error", "latency live", "latency sim", "error",
                      *(("sim band",) if banded else ()), "congested live/sim", "machine"), left=("mix", "model"))

    def pct(v: Any) -> str:
        return "-" if v is None else f"{v:+.1%}"

    for r in simulated:
        table.add_row(
            *((str(r.get("mix")), str(r.get("model"))) if mixed else ()),
            str(r["batch_size"]), _fmt(r["offered_rate"], 0), _fmt(r.get("throughput"), 1),
            _fmt(r.get("sim_throughput"), 1), pct(r.get("err_throughput")), _fmt(r.get("latency_p50_ms")),
            _fmt(r.get("sim_latency_p50_ms")), pct(r.get("err_latency_p50")), _fmt(r.get("paper_latency_mean_ms")),
            _fmt(r.get("sim_paper_latency_mean_ms")), pct(r.get("err_paper_latency")),
            *((_band_cell(r),) if banded else ()),
            f"{_fmt(bool(r.get('congested')))}/{_fmt(bool(r.get('sim_congested')))}", _busy_cell(r))
    console.print(table)
    f = fidelity_summary(rows)
    if f.get("busy_points") and not f["simulated_points"]:  # nothing quiet to judge by: say so, show them all
        console.print("[yellow]every point was measured beside other work: the errors below are the other work's "
                      "as much as the simulator's[/]")
        f = fidelity_summary([{**r, "machine_busy": False} for r in rows])
    elif f.get("busy_points"):
        console.print(f"[yellow]{f['busy_points']} point(s) measured beside other work left out of the errors "
                      "below[/] (their error is the other work's as much as the simulator's)")
    for key, name in (("throughput", "throughput (all points)"), ("latency_p50", "p50 latency (steady points)"),
                      ("paper_latency", "papers' latency (steady points)")):
        st = f[key]
        if not st["points"]:
            continue
        console.print(
            f"{name}: median |error| {st['median_abs']:.1%}, max {st['max_abs']:.1%}, "
            f"{st['within_target']:.0%} of {st['points']} point(s) within {f['target']:.0%}", highlight=False)
    if f.get("knee_points"):
        st = f["paper_latency_below_knee"]
        below = (f"; below it, papers' latency median |error| {st['median_abs']:.1%}, max {st['max_abs']:.1%}"
                 if st["points"] else "")
        console.print(f"{f['knee_points']} steady point(s) at the knee (offered >= {KNEE:.0%} of the LP bound: a few "
                      f"per cent of capacity move their latency by tens of per cent){below}", highlight=False)
    if f["congestion_agreement"] is not None:
        console.print(f"congestion called alike on {f['congestion_agreement']:.0%} of points", highlight=False)
    if (band := describe_band(f)) is not None:
        console.print(band, highlight=False)


def _band_cell(r: dict[str, Any]) -> str:
    """A point's papers' latency with its tasks the band faster .. slower ("cong." where that
    end congests), "fragile" where the band tips it (:func:`~staronnx.bench.fidelity.band_columns`)."""
    if "sim_fragile" not in r:
        return "-"
    ends = ["cong." if r.get(f"sim_congested_{e}") else _fmt(r.get(f"sim_paper_latency_{e}_ms"))
            for e in ("fast", "slow")]
    return f"{ends[0]}..{ends[1]}" + (" fragile" if r.get("sim_fragile") else "")


def _print_notes(output: Path) -> None:
    """What ``results.json`` notes (why the bound or the simulation is missing), where the
    user reads."""
    from staronnx.bench.results import load_results

    try:
        notes = load_results(output).get("notes") or []
    except (OSError, StaronnxError):
        return
    for note in notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True, markup=False)


def _summary_table(rows: list[dict[str, Any]]) -> Table:
    from staronnx.bench.results import row_state

    busy = any(r.get("machine_busy") for r in rows)
    table = table_of("sweep (papers' latency: first request of each batch)",
                     ("b", "offered", "throughput", "latency ms", "std", "p50", "p99", "CPU share", "/bound", "state",
                      *(("machine",) if busy else ())), left=("state", "machine"))
    for r in rows:
        state = row_state(r)
        table.add_row(
            str(r["batch_size"]), _fmt(r["offered_rate"], 0), _fmt(r.get("throughput"), 1),
            _fmt(r.get("paper_latency_mean_ms")), _fmt(r.get("paper_latency_std_ms")),
            _fmt(r.get("latency_p50_ms")), _fmt(r.get("latency_p99_ms")),
            "-" if r.get("cpu_share") is None else f"{r['cpu_share']:.0%}",
            "-" if r.get("achieved_over_bound") is None else f"{r['achieved_over_bound']:.0%}",
            state, *((_busy_cell(r),) if busy else ()))
    return table


def sweep_cmd(
    ctx: typer.Context,
    plandirs: Annotated[list[Path], typer.Argument(
        metavar="PLANDIR...",
        help="Plan folder (calibrate it first for predictions and the bound); several are served together "
             "by one runtime, each at its own rates (--rates a=100:400:100,b=50).")],
    rates: Annotated[str, typer.Option(help="Offered rates, requests/s: start:stop:step (stop included), a,b,c, "
                                            "or auto: about 10 rates up to 110% of what this machine serves (the LP "
                                            "bound of the calibrated perf models, else a 1 s closed-loop probe). "
                                            "Several models: rates per model, a=100:400:100,b=50 (every "
                                            "combination is a point).")] = "auto",
    batch_sizes: Annotated[str, typer.Option(help="Batch sizes b (a batch leaves when full); several models: each size "
                                                  "for all at once, or per model, a=4,8,b=1.")] = "1,2,4,8,16",
    name: NameOption = None,
    slo_ms: SloOption = None,
    priority: PriorityOption = None,
    policy: PolicyOption = "heft",
    groups: GroupsOption = "numa",
    cuda_streams: Annotated[int, typer.Option(help="CUDA workers (streams) per GPU; 0 = none.")] = 0,
    cuda_devices: Annotated[str | None, typer.Option(help=CUDA_DEVICES_HELP)] = None,
    cuda_graphs: Annotated[bool, typer.Option(
        "--cuda-graphs/--no-cuda-graphs",
        help="With --cuda-streams: capture every batch size of the sweep as CUDA graphs at warm-up. Not "
             "with --url (the server's workers are started with its own flags).")] = True,
    thread_per_stream: Annotated[bool, typer.Option(
        "--cuda-thread-per-stream", help=THREAD_PER_STREAM_HELP)] = False,
    colocate: Annotated[bool, typer.Option(
        "--colocate", help="The load generator and the batcher run on the CUDA driver thread's core during each "
                           "point, or without --cuda-streams on the first CPU worker's (they hold the GIL in turn with "
                           "it; a hand-over on one core costs less than one between two). Not with --url; with "
                           "several models, every model's "
                           "generator and batcher.")] = False,
    distribution: Annotated[str, typer.Option(help="Arrivals: constant (the papers) or poisson.")] = "constant",
    duration: Annotated[str, typer.Option(help="Arrivals per point: 10s, 500ms, 2m (longer for slow batch fills).")] = "10s",
    warmup: Annotated[str | None, typer.Option(help="Start of each point left out of the figures (default min(1 s, duration/5)).")] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for results.csv, results.json and the plots.")] = Path("results"),
    compare: Annotated[list[Path] | None, typer.Option(help="Other sweep folders to overlay with this one (repeatable).")] = None,
    labels: Annotated[str | None, typer.Option(help="Comparison labels, this sweep first, comma-separated.")] = None,
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Draw the PNG figures.")] = True,
    queue_capacity: Annotated[int, typer.Option(help="Server queue capacity (an overflow marks congestion).")] = 1024,
    min_batches: Annotated[int, typer.Option(help="Stretch a point to at least this many batch fills.")] = 10,
    extend: Annotated[bool, typer.Option("--extend/--no-extend", help="Measure an unstable point once more, twice as long (one model: a mix of several is measured once).")] = True,
    seed: Annotated[int, typer.Option(help="Seed of the inputs and of Poisson arrivals.")] = 0,
    engine: Annotated[str, typer.Option(help="native or starpu.")] = "native",
    max_delay: Annotated[str | None, typer.Option(
        help="Triton-style dynamic batching: a batch of at most b leaves once its oldest request waited this long (5ms).")] = None,
    trace: Annotated[Path | None, typer.Option(
        help="Write a Perfetto trace of the sweep here: tasks per worker, batch fills, batches, queue length.")] = None,
    simulate: Annotated[bool, typer.Option("--simulate/--no-simulate",
        help="Also simulate every measured point from the perf models; report the simulator's error.")] = False,
    sim_band: Annotated[float | None, typer.Option(
        "--sim-band", metavar="PERCENT",
        help="With --simulate: also simulate each point with its tasks this many per cent faster and slower "
             "(the machine's speed noise; default 5): a point the band moves past 15 % or across congestion is "
             "marked fragile, and the report says which live points lie within the band. 0: no band.")] = None,
    inputs: Annotated[Path | None, typer.Option(
        help="Real inputs: an .npz keyed by the model's input names, samples along axis 0 "
             "(numpy.savez); requests cycle through them. Default: random inputs.")] = None,
    url: Annotated[str | None, typer.Option(
        help="Sweep a running `staronnx serve` over the network (http://HOST:PORT, its HTTP port, or "
             "grpc://HOST:PORT, its gRPC port) through tritonclient instead of a runtime in this process; the "
             "batch size, max delay and runtime settings are then the server's.")] = None,
    model: Annotated[str | None, typer.Option(
        help="With --url: the served model's name (default: the plan folder's name).")] = None,
    check: Annotated[Path | None, typer.Option(
        "--check", metavar="MODEL.onnx",
        help="With --url: hold every answer against plain onnxruntime's answer to that request's own inputs "
             "(MODEL.onnx: the model the plan was cut from; CPU, one thread, once per distinct request). An "
             "answer that differs counts as a failed request, the difference in the point's notes.")] = None,
    model_workers: Annotated[list[str] | None, typer.Option("--model-workers", help=MODEL_WORKERS_HELP)] = None,
    lane: Annotated[list[str] | None, typer.Option("--lane", help=SIM_LANE_HELP)] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)] = False,
) -> None:
    """Measure latency and throughput over rates x batch sizes on the live runtime (or through a
    `staronnx serve` with --url); write CSV, JSON and the papers' plots. Several plans: every
    mix on one runtime hosting every model (:func:`staronnx.bench.mix.sweep_mix`), a row per
    point and model; ``--model-workers`` loads some models on some workers only, in the live
    runtime, its bound and its simulation; ``--lane`` gives models latency lanes, in all three
    alike (the bound and the simulation without the OS preemption: a note says so)."""
    from staronnx.bench.mix import is_per_model, sweep_mix
    from staronnx.bench.points import runnable_sizes
    from staronnx.bench.remote import remote_sweep
    from staronnx.bench.spec import BAND, RunSpec, SweepSpec
    from staronnx.bench.sweep import sweep
    from staronnx.inputs import load_inputs
    from staronnx.plan import Plan

    if url is not None and cuda_devices is not None:
        raise StaronnxError("--cuda-devices picks this process's GPUs; with --url the GPUs are the server's "
                            "(staronnx serve --cuda-devices)")
    if url is not None:  # the server's CUDA workers: it does not report these, so they cannot be checked
        dropped = [flag for name_, flag in (("cuda_graphs", "--cuda-graphs" if cuda_graphs else "--no-cuda-graphs"),
                                            ("thread_per_stream", "--cuda-thread-per-stream"))
                   if name_ in given_on_command_line(ctx)]
        if dropped:
            raise StaronnxError(f"{', '.join(dropped)}: with --url the CUDA workers are the server's, started with "
                                "its own flags (staronnx serve " + " ".join(dropped) + "), which a sweep over the "
                                "network can neither set nor check; leave them out with --url")
    devices = parse_cuda_devices(cuda_devices, cuda_streams)
    check_cuda_worker_flags(cuda_streams, cuda_graphs=cuda_graphs, thread_per_stream=thread_per_stream)
    check_models_options(plandirs, model_workers, lane)
    mixed = bool(len(plandirs) > 1 or is_per_model(rates) or is_per_model(batch_sizes) or name or slo_ms or priority)
    if mixed:
        unsupported = [flag for flag, value in (("--url", url), ("--model", model), ("--compare", compare),
                                                ("--inputs", inputs), ("--labels", labels), ("--check", check))
                       if value] + (["--engine"] if engine != "native" else [])
        # a mix is measured once (with every model's rate it is long enough): --extend was dropped unsaid
        unsupported += ["--extend"] if extend and "extend" in given_on_command_line(ctx) else []
        if unsupported:
            raise StaronnxError(f"{', '.join(unsupported)} do(es) not go with several models (a mixed sweep)")
        labels_, targets, residency, lanes = models_options(plandirs, names=name, slo_ms=slo_ms, priority=priority,
                                                            model_workers=model_workers, lane=lane)
        points = _mix_points(rates, batch_sizes, labels_)
    elif colocate and (url is not None or engine != "native"):
        raise StaronnxError("--colocate runs the load generator on a worker thread's core: it needs the native engine, "
                            "and does not go with --url")
    else:
        auto = rates.strip().lower() == "auto"
        rate_list = [] if auto else parse_rates(rates)
        sizes = parse_batch_sizes(batch_sizes)
        if url is None and model is not None:
            raise StaronnxError("--model names a model served at --url; give --url too")
        elif url is None and check is not None:
            raise StaronnxError("--check holds a served model's answers against onnxruntime's; give --url too")
        if check is not None and not check.is_file():  # now, not after the header
            raise StaronnxError(f"--check {check}: no such model file (give the .onnx the plan was cut from)")
    if queue_capacity < 1:  # else each point silently queued its batch size and recorded 0
        raise StaronnxError(f"--queue-capacity must be at least 1, got {queue_capacity}")
    if sim_band is not None and not simulate:
        raise StaronnxError("--sim-band sets the band of the simulated points: give --simulate too")
    if sim_band is not None and not 0 <= sim_band < 100:
        raise StaronnxError(f"--sim-band is a percentage in [0, 100) (5: tasks 5 % faster and slower), got {sim_band:g}")
    seconds = parse_duration(duration, option="--duration")
    warm = None if warmup is None else parse_duration(warmup, allow_zero=True, option="--warmup")
    delay = None if max_delay is None else parse_duration(max_delay, allow_zero=True, option="--max-delay")
    extra = list(compare or [])
    if extra and not plots:  # the overlay is a plot: it was skipped with the others, without a word
        raise StaronnxError("--compare overlays this sweep's plot with other sweeps': it does not go with --no-plots "
                            "(draw it later with staronnx sweep-plot OUTPUT --compare FOLDER)")
    names = _labels(labels, 1 + len(extra))
    for d in extra:
        if not (d / "results.json").is_file():
            raise StaronnxError(f"--compare {d}: no results.json there (a folder written by staronnx sweep)")
    check_writable(output, "--output", folder=True)  # now, not after the first point
    if trace is not None:
        check_writable(trace, "--trace")
    # the flags, parsed once into the sweep's specs (colocate: --url refused it above); a mix
    # is measured once per point (with every model's rate it is long enough)
    machine = MachineSpec(groups, cuda_streams, devices, cuda_graphs=cuda_graphs, thread_per_stream=thread_per_stream,
                          residency=residency if mixed else {}, lanes=lanes if mixed else {})
    plans = {n: Plan.load(d) for n, d in zip(labels_ if mixed else [""], plandirs)}
    for d, plan in zip(plandirs, plans.values()):
        if url is None:  # over the network the groups are the server's
            warn_uncalibrated(d, plan, machine)
    spec = SweepSpec(RunSpec(distribution, seconds, warm, seed, queue_capacity, min_batches, delay, colocate),
                     policy=policy, engine=engine, points=points if mixed else (),
                     targets=targets if mixed else None, extend=extend and not mixed, simulate=simulate,
                     sim_band=BAND if sim_band is None else sim_band / 100,
                     label=names[0] if names and not mixed else None, out_dir=output, trace=trace)
    if mixed:
        console.print(
            f"sweeping {len(plans)} model(s) on one runtime ({', '.join(f'{n}: {p.k} parts' for n, p in plans.items())}) "
            f"with {policy}, groups {groups}{cuda_summary(cuda_streams, devices)}"
            + "".join(f", {n} on {sel} only" for n, sel in residency.items())
            + "".join(f", {n} on lanes ({sel})" for n, sel in lanes.items())
            + (", load generators on the " + host_core_name(cuda_streams) if colocate else "") + ": "
            f"{len(points)} mix(es), {seconds:g} s per point, {distribution} arrivals -> {output}", highlight=False)

        def measure(bars: _Bars) -> list[dict[str, Any]]:
            return sweep_mix(plans, spec, machine=machine, progress=bars)
    else:
        plan = plans[""]
        if inputs is not None:
            load_inputs(inputs, plan)  # refused now, before the header and the rates' probe
        if auto:
            rate_list = _auto_rates(plan, sizes, machine, url=url, policy=policy, engine=engine, seed=seed,
                                    model=model)
        console.print(
            f"sweeping plan {plan.hash} ({plan.k} parts) "
            + (f"served at {url}: its batch size x " if url else f"with {policy}, groups {groups}"
               f"{cuda_summary(cuda_streams, devices)}"
               f"{', load generator on the ' + host_core_name(cuda_streams) if colocate else ''}: "
               f"{len(runnable_sizes(plan, sizes)[0])} batch size(s) x ") +
            f"{len(rate_list)} rate(s), {seconds:g} s per point, {distribution} arrivals -> {output}",
            highlight=False)

        def measure(bars: _Bars) -> list[dict[str, Any]]:
            if url is None:
                return sweep(plan, rate_list, sizes, spec, machine=machine, inputs=inputs, progress=bars)
            # over the network: the server's settings, except those named on the command line
            given = given_on_command_line(ctx)
            asked = dict(policy=policy, groups=groups, cuda_streams=cuda_streams, engine=engine,
                         queue_capacity=queue_capacity, max_delay=delay)
            return remote_sweep(plan, url, rate_list, sizes if "batch_sizes" in given else None, spec, model=model,
                                expect={k: v for k, v in asked.items() if k in given}, check=check, inputs=inputs,
                                progress=bars)
    rows = _with_bars(quiet, mixed, output, measure)
    _report(output, rows, (_mix_table if mixed else _summary_table)(rows), simulate=simulate, trace=trace,
            draw=(lambda: _draw(output, extra, names, output / "compare.png")) if plots and rows else None)


def _mix_points(rates: str, batch_sizes: str, names: list[str]) -> list[Any]:
    """``--rates a=...,b=...`` and ``--batch-sizes`` (one list for all, or per model) as the
    mixes of a mixed sweep: every combination."""
    from staronnx.bench.mix import is_per_model, per_model
    from staronnx.bench.sweep import mix_points

    if rates.strip().lower() == "auto" or not is_per_model(rates):
        raise StaronnxError(f"several models need rates per model: --rates "
                            f"{','.join(f'{n}=R' for n in names)} (each like 100 or 50:400:50)")
    per_rates = per_model(rates, names, "--rates")
    sizes: Any = parse_batch_sizes(batch_sizes) if not is_per_model(batch_sizes) else {
        n: parse_batch_sizes(text) for n, text in per_model(batch_sizes, names, "--batch-sizes").items()}
    return mix_points({n: parse_rates(per_rates[n]) for n in names}, sizes, names)


def _with_bars(quiet: bool, mixed: bool, output: Path, run: Callable[[_Bars], list[dict[str, Any]]]
               ) -> list[dict[str, Any]]:
    """``run`` the sweep under progress bars; interrupted (Ctrl-C, SIGTERM), say what is kept."""
    with progress_bar(quiet) as progress:
        bars = _Bars(progress, mixed)
        try:
            return run(bars)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # Ctrl-C, SIGTERM: say what is kept, then stop
                above(progress, console).print(
                    f"sweep interrupted: kept {bars.measured} of {bars.total} {'mix(es)' if mixed else 'point(s)'} in "
                    f"{output / 'results.csv'} and {output / 'results.json'}", highlight=False, soft_wrap=True)
            raise


def _report(output: Path, rows: Any, table: Any, *, simulate: bool, trace: Path | None,
            draw: Callable[[], None] | None) -> None:
    """What a finished sweep (one model or a mix) prints: its table, notes, the simulator's
    fidelity, where its files and trace are, then its plots."""
    console.print(table)
    _print_point_notes(rows)
    _print_notes(output)
    if simulate:
        _print_fidelity(rows)
    console.print(f"results: {output / 'results.csv'}, {output / 'results.json'}")
    if trace is not None:
        console.print(f"trace: {trace} (open it in https://ui.perfetto.dev)")
        from staronnx.bench.sweep import simulated_trace_path

        if simulate and simulated_trace_path(trace).is_file():
            console.print(f"simulated schedule: {simulated_trace_path(trace)} (each simulated point where its live "
                          "point ran: open both to compare)", highlight=False)
    if draw is not None:
        draw()


def _mix_table(rows: list[dict[str, Any]]) -> Table:
    """One line per mix and model: what each model got of the shared runtime."""
    table = table_of("mixed sweep (several models on one runtime; latencies in ms)",
                     ("mix", "model", "b", "offered", "throughput", "p50", "p99", "target", "late", "LP scale",
                      "state"), left=("mix", "model", "state"))
    from staronnx.bench.results import row_state

    for r in rows:
        state = row_state(r)
        late = "-" if r.get("deadline_misses") is None else f"{r['deadline_misses']}/{r.get('completed')}"
        table.add_row(str(r["mix"]), str(r["model"]), str(r["batch_size"]), _fmt(r["offered_rate"], 0),
                      _fmt(r.get("throughput"), 1), _fmt(r.get("latency_p50_ms")), _fmt(r.get("latency_p99_ms")),
                      _fmt(r.get("latency_target_ms"), 0), late, _fmt(r.get("bound_scale")), state)
    return table


def _auto_rates(plan: Any, sizes: list[int], machine: MachineSpec, *, url: str | None, policy: str, engine: str,
                seed: int, model: str | None = None) -> list[float]:
    """``--rates auto``: the range from the LP bound or a closed-loop probe, said on stdout."""
    from staronnx.bench.sweep import auto_rates

    if url is not None:  # the server's runtime cannot be probed from here: its perf models only
        from staronnx.bench.remote import served_runtime

        # the server's workers and batch size, not this command line's defaults: a server with
        # CUDA streams bounded as CPU groups alone got rates far below what it serves
        served = served_runtime(url, plan, model)
        chosen = auto_rates(plan, [served.batch_size],
                            MachineSpec(str(served.runtime.get("groups") or machine.groups), served.cuda_streams,
                                        served.cuda_devices), probe_seconds=None)
        if chosen is None:
            raise StaronnxError("--rates auto with --url needs the plan's calibrated perf models on this "
                                "host (staronnx calibrate); or give --rates, e.g. 10:100:10")
        rates = chosen.rates
        console.print(f"rates auto: {len(rates)} rates from {rates[0]:g} to {rates[-1]:g} req/s (the LP bound "
                      f"over the calibrated perf models: {chosen.capacity:,.0f} samples/s)", highlight=False)
        return rates
    with console.status("probing the runtime's throughput for --rates auto"):
        chosen = auto_rates(plan, sizes, machine, policy=policy, engine=engine, seed=seed)
    assert chosen is not None  # probed where there is no bound
    console.print(chosen.describe(), highlight=False, soft_wrap=True)
    return chosen.rates


def _draw(output: Path, extra: list[Path], names: list[str] | None, compare_png: Path) -> None:
    from staronnx.bench.plots import PlotError, compare, plot_results

    try:
        for png in plot_results(output):
            console.print(f"plot: {png}")
    except PlotError as exc:
        console.print(f"[yellow]no plots: {exc}[/]")
    if extra:
        console.print(f"plot: {compare([output, *extra], names, compare_png)}")


def sweep_plot_cmd(
    results: Annotated[list[Path], typer.Argument(help="Sweep folder(s); two or more are overlaid.")],
    compare: Annotated[list[Path] | None, typer.Option(
        help="Another sweep folder to overlay with the first (repeatable), as sweep --compare does.")] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Comparison PNG (several folders; default compare.png) or folder for the figures (one).")] = None,
    labels: Annotated[str | None, typer.Option(help="Comparison labels, comma-separated, in the order the folders are given.")] = None,
) -> None:
    """Redraw a sweep folder's figures, or overlay several sweep folders in one plot."""
    from staronnx.bench import plots

    folders = [*results, *(compare or [])]
    if labels is not None and len(folders) == 1:  # one folder's figures are redrawn as they were: no label
        raise StaronnxError("--labels names the sweeps overlaid in one plot: give two folders or more (a sweep's "
                            "own label is set when it runs: staronnx sweep --labels NAME)")
    if output is not None:
        check_writable(output, "--output", folder=len(folders) == 1)
    for d in compare or []:
        if not (d / "results.json").is_file():
            raise StaronnxError(f"--compare {d}: no results.json there (a folder written by staronnx sweep)")
    if len(folders) == 1:
        for png in plots.plot_results(folders[0], output):
            console.print(f"plot: {png}")
        return
    out = output or Path("compare.png")
    console.print(f"plot: {plots.compare(folders, _labels(labels, len(folders)), out)}")


def optimize_batch_cmd(
    ctx: typer.Context,
    plandir: Annotated[Path, typer.Argument(help="Plan folder, calibrated (staronnx calibrate).")],
    rate: Annotated[float, typer.Option(help="Offered load, single-sample requests per second.")],
    slo_ms: Annotated[float | None, typer.Option(help="Papers'-latency objective in ms: maximize headroom under it.")] = None,
    batch_sizes: Annotated[str, typer.Option(help="Candidate batch sizes.")] = "1,2,4,8,16",
    policy: Annotated[str, typer.Option(help="Scheduling policy.")] = "heft",
    groups: GroupsOption = "numa",
    cuda_streams: Annotated[int, typer.Option(help="CUDA workers (streams) per GPU; 0 = none.")] = 0,
    cuda_devices: Annotated[str | None, typer.Option(help=CUDA_DEVICES_HELP)] = None,
    cuda_graphs: Annotated[bool, typer.Option(
        "--cuda-graphs/--no-cuda-graphs",
        help="With --cuda-streams: capture every candidate batch size as CUDA graphs at warm-up for the live "
             "measurements, as sweep and serve do.")] = True,
    thread_per_stream: Annotated[bool, typer.Option(
        "--cuda-thread-per-stream", help=THREAD_PER_STREAM_HELP)] = False,
    colocate: Annotated[bool, typer.Option(
        "--colocate", help="Each live measurement's load generator and batcher run on the CUDA driver thread's core, "
                           "or without --cuda-streams on the first CPU worker's (as sweep --colocate).")] = False,
    distribution: Annotated[str, typer.Option(help="Arrivals: constant or poisson.")] = "constant",
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Measure the predicted best and its neighbours live.")] = True,
    sim_duration: Annotated[str, typer.Option(help="Simulated arrivals per candidate.")] = "20s",
    verify_duration: Annotated[str, typer.Option(help="Live measurement per verified candidate.")] = "3s",
    max_verify: Annotated[int, typer.Option(help="At most this many live measurements (hill-climb from the prediction).")] = 4,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the result as JSON here.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of arrivals, draws and inputs.")] = 0,
) -> None:
    """Choose the batch size for a rate: simulate every candidate from the perf models, then
    verify the best ones live; print predicted vs measured."""
    from staronnx.bench.optimize import optimize_batch
    from staronnx.bench.spec import OptimizeSpec
    from staronnx.fsutil import atomic_write_text
    from staronnx.plan import Plan

    # how the live measurements run, given with --no-verify, which measures none: said, not dropped
    live_only = [flag for name_, flag in (("verify_duration", "--verify-duration"), ("max_verify", "--max-verify"),
                                          ("colocate", "--colocate")) if name_ in given_on_command_line(ctx)]
    if not verify and live_only:
        raise StaronnxError(f"{', '.join(live_only)}: how the live measurements run, and --no-verify measures "
                            "none (the prediction alone): leave them out or drop --no-verify")
    sizes = parse_batch_sizes(batch_sizes)
    if slo_ms is not None and not (math.isfinite(slo_ms) and slo_ms > 0):  # in the ms given, not the seconds
        raise StaronnxError(f"--slo-ms must be a positive number of ms, got {slo_ms:g}")
    devices = parse_cuda_devices(cuda_devices, cuda_streams)
    check_cuda_worker_flags(cuda_streams, cuda_graphs=cuda_graphs, thread_per_stream=thread_per_stream)
    if json_out is not None:
        check_writable(json_out, "--json")
    machine = MachineSpec(groups, cuda_streams, devices, cuda_graphs, thread_per_stream)
    warn_uncalibrated(plandir, Plan.load(plandir), machine)
    with console.status("optimizing") as status:
        spec = OptimizeSpec(slo=None if slo_ms is None else slo_ms / 1e3, batch_sizes=sizes, policy=policy,
                            distribution=distribution, verify=verify,
                            sim_duration=parse_duration(sim_duration, option="--sim-duration"),
                            verify_duration=parse_duration(verify_duration, option="--verify-duration"),
                            max_verify=max_verify, seed=seed, colocate=colocate)
        result = optimize_batch(plandir, rate, spec, machine=machine, progress=lambda msg: status.update(msg))
    table = table_of(f"batch size at {rate:g} req/s ({result.objective}); latencies in ms",
                     ("b", "pred. latency", "pred. p99", "pred. thr.", "meas. latency", "meas. p99", "meas. thr.",
                      "error", "LP bound", "note"), left=("note",))
    for cand in result.candidates:
        r = cand.row()
        note = [text for text, on in (
            ("predicted best", cand.batch_size == result.predicted_best),
            ("[bold]chosen[/]", verify and cand.batch_size == result.best),
            ("congested (sim)", r["predicted_congested"]), ("congested (live)", r["measured_congested"]),
            (f"[red]failed (live)[/]: {r['measured_failed']} request(s)", r["measured_state"] == "failed")) if on]
        why = result.rejected.get(cand.batch_size)
        if why is not None and why not in ("congested", "its requests failed"):
            note.append(f"[yellow]too slow ({'live' if verify else 'sim'})[/]: {escape(why)}")
        table.add_row(
            str(cand.batch_size), _fmt(r["predicted_latency_ms"]), _fmt(r["predicted_p99_ms"]),
            _fmt(r["predicted_throughput"], 1), _fmt(r["measured_latency_ms"]), _fmt(r["measured_p99_ms"]),
            _fmt(r["measured_throughput"], 1),
            "-" if r["latency_error"] is None else f"{r['latency_error']:+.0%}",
            _fmt(r["bound_throughput"], 0), ", ".join(note))
    console.print(table)
    chosen = result.candidate(result.best)
    how = "measured" if verify else "predicted"
    lat = chosen.measured_latency_ms if verify else chosen.predicted_latency_ms
    slo = "" if result.slo_met is None else (" (meets the SLO)" if result.slo_met else " [yellow](SLO not met)[/]")
    if not result.keeps_up:  # never "meets the SLO": it did not serve the rate
        slo = (f" [red]but it does not keep up with {rate:g} req/s[/] ({escape(result.rejected[result.best])}); "
               "no candidate did")
    console.print(f"batch size {result.best}: {how} papers' latency {_fmt(lat)} ms{slo}")
    if result.rejected:
        console.print(f"rejected (do not keep up with the rate, {how}): "
                      + "; ".join(f"b={b}: {why}" for b, why in result.rejected.items()), highlight=False,
                      soft_wrap=True, markup=False)
    if result.generator_core is not None:
        console.print(f"measured with the load generator on the {host_core_name(cuda_streams)} (PU {result.generator_core})",
                      highlight=False)
    if result.cuda_graphs:
        console.print(f"measured with CUDA graphs of batch sizes {', '.join(map(str, result.cuda_graphs))} (captured "
                      "at warm-up, as sweep and serve capture theirs)", highlight=False)
    for line in result.notes:
        console.print(f"note: {line}", highlight=False, soft_wrap=True, markup=False)
    if json_out is not None:
        atomic_write_text(json_out, json.dumps(result.as_dict(), indent=1, default=str) + "\n")
        console.print(f"written to {json_out}")


def register(app: typer.Typer) -> None:
    app.command("sweep")(sweep_cmd)
    app.command("sweep-plot")(sweep_plot_cmd)
    app.command("optimize-batch")(optimize_batch_cmd)
