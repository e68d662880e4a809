"""``staronnx simulate``: what-if serving from the perf models, in seconds instead of hours.

Runs the discrete-event simulator (:mod:`staronnx.bench.simulator`) with the runtime's own
policy on this machine or a synthetic one, and prints what a live sweep point would report
(through :func:`staronnx.serving.metrics.summarize`, the live runs' metrics) next to the LP
throughput bound (:mod:`staronnx.bench.bound`).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from staronnx.cli.calibration_check import warn_uncalibrated
from staronnx.cli.display import output_console, table_of
from staronnx.cli.given import given_on_command_line
from staronnx.cli.gpus import check_cuda_worker_flags, parse_cuda_devices
from staronnx.cli.serve_cmd import LANE_HELP, MODEL_WORKERS_HELP, model_lanes, model_residency
from staronnx.errors import StaronnxError
from staronnx.fsutil import check_writable
from staronnx.workers.layout import MachineSpec

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


def _one_plan_batch(text: str | None, plan: Any, name: str | None = None) -> int:
    """The batch one plan (model ``name`` of several) is simulated at: ``--batch``, one
    positive integer. A model that runs one request per task has batch 1 only (its default),
    said in one line when a larger one was asked (as ``run`` and ``plan verify`` say it), never
    a figure for a batch its server would never form."""
    from staronnx.bench.points import runnable_sizes

    if text is None and plan.contract.batchable:
        raise StaronnxError("give --batch (the batch size b)")
    if text is not None and not re.fullmatch(r"\s*[+-]?\d+\s*", text):
        raise StaronnxError(f"--batch expects a positive integer (or NAME=B,... for several models), got {text!r}")
    if text is not None and int(text) < 1:
        raise StaronnxError(f"--batch must be >= 1, got {int(text)}")
    sizes, note = runnable_sizes(plan, [1 if text is None else int(text)])
    if note:
        console.print(f"note: {'' if name is None else name + ': '}{note}", highlight=False, soft_wrap=True,
                      markup=False)
    return sizes[0]


def _batches(text: str | None, plans: dict[str, Any], several: bool) -> dict[str, int]:
    """``--batch`` per model: one size for all (``4``) or one per model (``a=8,b=1``), each
    read as :func:`_one_plan_batch` reads one plan's."""
    from staronnx.bench.mix import is_per_model, per_model

    texts = per_model(str(text), list(plans), "--batch") if is_per_model(text) else dict.fromkeys(plans, text)
    return {n: _one_plan_batch(texts[n], plan, n if several else None) for n, plan in plans.items()}


def mix_rates(text: str | None, names: list[str]) -> dict[str, float]:
    """``--rates a=100,b=400``: one rate per model (every model named)."""
    from staronnx.bench.mix import per_model

    if text is None:
        raise StaronnxError(f"several models need a rate each: --rates {','.join(f'{n}=R' for n in names)}")
    out: dict[str, float] = {}
    for n, v in per_model(text, names, "--rates").items():
        try:
            out[n] = float(v)
        except ValueError:
            raise StaronnxError(f"--rates: model {n!r} needs one rate in requests/s here, got {v!r}") from None
        if not (math.isfinite(out[n]) and out[n] > 0):
            raise StaronnxError(f"--rates: model {n!r} needs a positive rate, got {v!r}")
    return out


def what_if_gpus(plans: Any, devices: tuple[int, ...], cuda_scale: str | None) -> list[str]:
    """The GPU archs of a simulation whose times come from elsewhere by design, so that no
    warning asks to calibrate them: all with ``--cuda-scale``; else, where some GPU of it is
    calibrated (the others borrow its times), those this machine lacks (``calibrate`` could not
    reach them); none where no GPU is calibrated (the simulation needs some GPU's models)."""
    from staronnx.perfmodels import PerfModelStore
    from staronnx.workers.cuda_env import visible_cuda_devices

    if cuda_scale is not None:
        return [f"cuda{d}" for d in devices]
    store = PerfModelStore()
    calibrated = {row.arch for plan in plans for row in store.rows(plan.hash) if row.calibrated}
    if not any(f"cuda{d}" in calibrated for d in devices):
        return []
    visible = visible_cuda_devices()
    return [f"cuda{d}" for d in devices if d >= visible]


def check_models_options(plandirs: list[Path], model_workers: list[str] | None, lane: list[str] | None) -> None:
    """Refuse ``--model-workers`` and ``--lane`` for one plan (``simulate`` and ``sweep`` alike)."""
    if model_workers and len(plandirs) < 2:
        raise StaronnxError("--model-workers keeps a model on some workers of a runtime shared by several models; "
                            "give several plans (one plan runs on every worker: choose them with --groups and "
                            "--cuda-streams)")
    if lane and len(plandirs) < 2:
        raise StaronnxError("--lane gives a model a worker that preempts the other models' tasks on a runtime shared "
                            "by several models; give several plans (one plan has no other model to preempt)")


def models_options(plandirs: list[Path], *, names: list[str] | None, slo_ms: list[str] | None,
                   priority: list[str] | None, model_workers: list[str] | None, lane: list[str] | None
                   ) -> tuple[list[str], dict[str, Any], dict[str, str], dict[str, str]]:
    """The options of several models, read once for ``simulate`` and ``sweep``: each model's
    name (``--name``, else its folder's), service target (``--slo-ms``, ``--priority``),
    residency (``--model-workers``) and lanes (``--lane``)."""
    from staronnx.bench.mix import model_names
    from staronnx.cli.serve_cmd import service_targets

    labels = model_names(plandirs, names)
    return (labels, service_targets(labels, slo_ms or [], priority or []),
            model_residency(model_workers or [], labels), model_lanes(lane or [], labels))


#: the lane help of ``simulate`` and ``sweep``: ``staronnx serve``'s, plus what the simulation leaves out
SIM_LANE_HELP = (LANE_HELP + " Simulated (simulate, sweep --simulate) as one more worker per group holding the "
                 "lane models only; the OS preemption of the group's worker is not modelled (see the notes).")


#: the options ``simulate`` and ``sweep`` share (one text each, one parse)
NameOption = Annotated[list[str] | None, typer.Option(help="Model name, one per plan in order (repeatable; several plans).")]
SloOption = Annotated[list[str] | None, typer.Option(
    "--slo-ms", help="A model's latency target in ms, NAME=MS (repeatable, or a=50,b=20): its tasks are ordered by "
                     "deadline, and answers later than the target are counted as deadline misses.")]
PriorityOption = Annotated[list[str] | None, typer.Option(
    "--priority", help="A model's priority, NAME=N (repeatable): its tasks run before those of lower priority.")]
PolicyOption = Annotated[str, typer.Option(help="Scheduling policy (eager, random, ws, lws, dm, dmda, dmdar, dmdas, heft).")]
GroupsOption = Annotated[str, typer.Option(help="CPU grouping policy: numa, package, cores=N, ...")]


def simulate_cmd(
    ctx: typer.Context,
    plandirs: Annotated[list[Path], typer.Argument(
        metavar="PLANDIR...",
        help="Plan folder(s) (calibrated: staronnx calibrate); several share one simulated runtime, "
             "each at its own rate (--rates a=100,b=400).")],
    rate: Annotated[float | None, typer.Option(help="Offered load, single-sample requests per second (one plan).")] = None,
    batch: Annotated[str | None, typer.Option(
        help="Batch size b (a batch leaves when full); with several plans one for all, or one per model: a=8,b=1. "
             "A model that runs one request per task (max_batch_size 0) has batch 1 only, the default.")] = None,
    rates: Annotated[str | None, typer.Option(
        help="Mixed traffic: a rate per model, a=100,b=400 (names: the plan folders' or --name).")] = None,
    name: NameOption = None,
    slo_ms: SloOption = None,
    priority: PriorityOption = None,
    policy: PolicyOption = "heft",
    groups: GroupsOption = "numa",
    synthetic: Annotated[str | None, typer.Option(help="Simulate a made-up machine, e.g. 'pack:2 numa:2 core:8'.")] = None,
    cuda_streams: Annotated[int, typer.Option(help="CUDA workers (streams) per GPU; 0 = none.")] = 0,
    cuda_devices: Annotated[str | None, typer.Option(help=(
        "The simulated machine's GPUs, --cuda-streams workers on each: CUDA ordinals like 0,1 or 0-3, or all "
        "(every GPU visible here). GPUs this machine lacks or never calibrated take the times and bus links of "
        "the lowest calibrated GPU (a note says so). Default: 0."))] = None,
    cuda_scale: Annotated[str | None, typer.Option(
        help="What-if GPU: its time = this factor x the widest CPU group's (one, or one per part).")] = None,
    thread_per_stream: Annotated[bool, typer.Option(
        "--cuda-thread-per-stream", help="With --cuda-streams: the simulated machine's CUDA workers each have a driver "
                                         "thread and a core held back, as run, sweep and serve lay them out with this "
                                         "flag (narrower CPU groups).")] = False,
    distribution: Annotated[str, typer.Option(help="Arrivals: constant or poisson.")] = "constant",
    duration: Annotated[str, typer.Option(help="Simulated arrivals: 10s, 500ms, 2m, or plain seconds.")] = "10s",
    requests: Annotated[int | None, typer.Option(help="Number of requests (instead of --duration; one plan).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of arrivals and execution-time draws.")] = 0,
    max_delay: Annotated[str | None, typer.Option(
        help="How long the oldest request may wait before a partial batch leaves: 5ms, 0.005, 0 (none).")] = None,
    spread: Annotated[float, typer.Option(help="Scale of the models' standard deviations (0: means only).")] = 1.0,
    queue_capacity: Annotated[int, typer.Option(help="Server queue capacity, per model (arrivals beyond it are rejected).")] = 1024,
    model_workers: Annotated[list[str] | None, typer.Option("--model-workers", help=MODEL_WORKERS_HELP)] = None,
    lane: Annotated[list[str] | None, typer.Option("--lane", help=SIM_LANE_HELP)] = None,
    trace: Annotated[Path | None, typer.Option(
        help="Write the simulated schedule here as a Perfetto trace (ui.perfetto.dev), laid out as run/sweep "
             "--trace lay out a live one: a lane per worker, tasks, dependencies, batch fills, the queue.")] = None,
    band: Annotated[float, typer.Option(
        "--band", metavar="PERCENT",
        help="Also simulate with every task this many per cent faster and slower (a machine's drift from its "
             "calibration) and say how far that moves the answer: near the capacity a few per cent tip a rate "
             "into congestion. 0: no band.")] = 5.0,
) -> None:
    """Simulate serving a plan from its perf models; print throughput, latency, placement and
    the LP throughput bound."""
    from staronnx.bench.machine import build_machine
    from staronnx.bench.simulator import MixResult, simulate_mix
    from staronnx.bench.spec import SimSpec
    from staronnx.durations import parse_duration
    from staronnx.plan import Plan
    from staronnx.runtime.models import plan_name
    from staronnx.workers.topology import Topology

    if requests is not None and "duration" in given_on_command_line(ctx):  # else --duration was dropped unsaid
        raise StaronnxError("--requests and --duration both say how long the simulated traffic lasts: give one of "
                            "them")
    seconds = parse_duration(duration, option="--duration")
    delay = None if max_delay is None else parse_duration(max_delay, allow_zero=True, option="--max-delay")
    devices = parse_cuda_devices(cuda_devices, cuda_streams, simulated=True)
    check_cuda_worker_flags(cuda_streams, thread_per_stream=thread_per_stream)
    if cuda_scale is not None and not cuda_streams:  # else dropped: a machine without CUDA workers was simulated
        raise StaronnxError("--cuda-scale sets the time of the simulated CUDA workers: it needs --cuda-streams N")
    if not 0 <= band < 100:
        raise StaronnxError(f"--band is a percentage in [0, 100) (5: tasks 5 % faster and slower), got {band:g}")
    if trace is not None:
        check_writable(trace, "--trace")
    check_models_options(plandirs, model_workers, lane)
    several = bool(len(plandirs) > 1 or rates is not None or slo_ms or priority or name)
    if several:  # a rate and a batch per model, the models' targets, residency and lanes
        if rate is not None:
            raise StaronnxError("--rate is for one plan; give each model its rate with --rates a=100,b=400")
        if requests is not None:
            raise StaronnxError("--requests is for one plan; several models run for --duration")
        labels, targets, residency, lanes = models_options(plandirs, names=name, slo_ms=slo_ms, priority=priority,
                                                           model_workers=model_workers, lane=lane)
        plans = {n: Plan.load(d) for n, d in zip(labels, plandirs)}
        offered = mix_rates(rates, labels)
    elif rate is None:
        raise StaronnxError("give --rate (requests/s), or --rates NAME=R,... for several models")
    else:  # one plan: a set of one, named as its machine names it
        plan = Plan.load(plandirs[0])
        labels = [plan_name(plan)]
        plans, offered = {labels[0]: plan}, {labels[0]: rate}
        targets, residency, lanes = {}, {}, {}
    sizes = _batches(batch, plans, several)
    machine_spec = MachineSpec(groups, cuda_streams, devices, thread_per_stream=thread_per_stream, lanes=lanes)
    if synthetic is None:  # a made-up machine borrows this one's models by design (see the notes)
        for d, plan in zip(plandirs, plans.values()):
            warn_uncalibrated(d, plan, machine_spec, skip_archs=what_if_gpus(plans.values(), devices, cuda_scale))
    topology = Topology.from_synthetic(_with_pus(synthetic)) if synthetic else None
    machine = build_machine(plans if several else plans[labels[0]], machine_spec, topology=topology,
                            cuda_scale=_scale(cuda_scale))
    spec = SimSpec(policy=policy, targets=targets, duration=seconds, n_requests=requests, distribution=distribution,
                   seed=seed, max_delay=delay, spread=spread, queue_capacity=queue_capacity, residency=residency)

    def run(slowdown: float = 1.0, into: Path | None = None) -> MixResult:
        return simulate_mix(machine, offered, sizes, replace(spec, slowdown=slowdown), trace=into)

    result = run(into=trace)
    if several:
        _print_mix(result, machine, labels, offered, sizes, residency, lanes, policy)
    else:
        _print_one(result, machine, labels[0], sizes[labels[0]], policy)
    runs = [result]
    if band > 0:  # the same traffic on a machine that much faster and slower
        fast, slow = run(1 - band / 100), run(1 + band / 100)
        runs += [fast, slow]
        for n in labels:
            _print_band(n if several else None, result.metrics(n), fast.metrics(n), slow.metrics(n), band / 100)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False)
    console.print(f"({sum(r.events for r in runs)} events in {sum(r.wall_seconds for r in runs):.2f} s"
                  + (", the band's two runs included)" if len(runs) > 1 else ")"), highlight=False)
    if trace is not None:
        console.print(f"trace: {trace} (open it in https://ui.perfetto.dev)", highlight=False)


def _print_band(name: str | None, nominal: dict[str, Any], fast: dict[str, Any], slow: dict[str, Any],
                band: float) -> None:
    """One line: how far a drift of ``band`` moves a model's answer, and whether it tips it
    (:func:`~staronnx.bench.fidelity.band_columns`' rule: past 15 % or across congestion)."""
    from staronnx.bench.fidelity import TARGET, band_columns, sim_columns

    cols = band_columns(fast, slow, sim_columns(nominal, {}), {}, band)

    def ends(key: str) -> str:
        return " .. ".join("congested" if cols[f"sim_congested_{e}"] else
                           "-" if (ms := cols[f"{key}_{e}_ms"]) is None else f"{ms:.2f}" for e in ("fast", "slow"))

    if not cols["sim_fragile"]:
        verdict = f"robust: a drift that small moves it less than {TARGET:.0%}"
    elif cols["sim_congested_slow"] and not nominal.get("congested"):
        verdict = (f"fragile: {band:.0%} slower congests (the rate is within {band:.0%} of what this machine "
                   "serves: a machine that drifts that much tips it)")
    elif nominal.get("congested") and not cols["sim_congested_fast"]:
        verdict = f"fragile: {band:.0%} faster keeps up (the rate is within {band:.0%} of the capacity)"
    else:
        verdict = f"fragile: a drift that small moves the latency by more than {TARGET:.0%}"
    console.print(f"{'' if name is None else name + ': '}with every task {band:.0%} faster .. slower: papers' latency "
                  f"{ends('sim_paper_latency')} ms, p50 {ends('sim_latency_p50')} "
                  f"ms; {verdict}", highlight=False)


def _print_one(result: Any, machine: Any, label: str, batch_size: int, policy: str) -> None:
    """One plan's figures: throughput and latencies against the LP bound, placement and
    workers, simulated beside the LP optimum."""
    from staronnx.bench.bound import machine_bound

    bound = machine_bound(machine, batch_size)
    m = result.metrics(label)
    names = ", ".join(f"{w.name} ({w.arch})" for w in result.workers)
    console.print(f"simulated {machine.plan.root} with {policy} on {len(result.workers)} worker(s): {names}",
                  highlight=False)
    console.print(
        f"offered {m['offered_rate']:.1f} req/s, batch {batch_size}: throughput {m['throughput']:.1f} samples/s; "
        f"papers' latency {_ms(m['paper_latency_mean'])} ms (std {_ms(m['paper_latency_std'])}); "
        f"per request p50 {_ms(m['latency_p50'])} ms, p99 {_ms(m['latency_p99'])} ms; "
        f"{m['rejected']} rejected; {'CONGESTED' if m['congested'] else 'stable load'}",
        highlight=False)
    achieved = m["throughput"] / bound.throughput if bound.throughput > 0 else math.nan
    binding = ", ".join(b.name for b in bound.binding) or "-"
    console.print(
        f"LP bound {bound.throughput:.1f} samples/s at batch {batch_size} "
        f"(achieved / bound {achieved:.1%}); binding: {binding}",
        highlight=False)
    table = table_of("placement (simulated vs LP optimum)", ("part", "arch", "tasks", "share", "LP share"), fold=True)
    lp_share = bound.arch_share()
    for part, arch in sorted(set(result.placement) | set(lp_share)):
        table.add_row(str(part), arch, str(result.placement.get((part, arch), 0)),
                      f"{result.share(label, part).get(arch, 0.0):.0%}", f"{lp_share.get((part, arch), 0.0):.0%}")
    console.print(table)
    workers = table_of("workers", ("worker", "arch", "memory node", "busy", "LP busy"), fold=True)
    for w in result.workers:
        workers.add_row(w.name, w.arch, w.memory_node, f"{result.busy[w.name]:.0%}",
                        f"{bound.utilization.get(w.name, 0.0):.0%}")
    console.print(workers)


def _print_mix(result: Any, machine: Any, labels: list[str], offered: dict[str, float], sizes: dict[str, int],
               residency: dict[str, str], lanes: dict[str, str], policy: str) -> None:
    """Several models on one simulated runtime: per-model throughput, latencies and deadline
    misses, the LP bound of the mix, each worker's time per model, where each model was kept."""
    from staronnx.bench.bound import mix_bound

    bound = mix_bound(machine, offered, sizes, residency=residency)
    workers = ", ".join(f"{w.name} ({w.arch})" for w in result.workers)
    console.print(f"simulated {len(labels)} model(s) on one runtime with {policy} on {len(result.workers)} "
                  f"worker(s): {workers}"
                  + "".join(f"; {n} on {', '.join(result.held_by[n])} only" for n in residency if n not in lanes)
                  + "".join(f"; {n} on lanes {', '.join(w for w in result.held_by[n] if w.startswith('lane:'))}"
                            + (f" and {', '.join(others)}" if (others := [w for w in result.held_by[n]
                                                                          if not w.startswith('lane:')]) else "")
                            for n in lanes), highlight=False)
    table = table_of("per model (latencies in ms; misses: answers later than the target)",
                     ("model", "b", "offered", "throughput", "p50", "p99", "papers' latency", "target", "misses",
                      "rejected", "load"), left=("model", "load"))
    for n in labels:
        m = result.metrics(n)
        target = result.targets[n]
        misses = "-" if m["deadline_misses"] is None else f"{m['deadline_misses']}/{m['completed']}"
        bits = [f"{target.latency * 1e3:g} ms" if target.latency is not None else "",
                f"prio {target.priority}" if target.priority else ""]
        table.add_row(n, str(sizes[n]), f"{m['offered_rate']:.1f}", f"{m['throughput']:.1f}", _ms(m["latency_p50"]),
                      _ms(m["latency_p99"]), _ms(m["paper_latency_mean"]), " ".join(b for b in bits if b) or "-",
                      misses, str(m["rejected"]), "CONGESTED" if m["congested"] else "stable")
    console.print(table)
    verdict = "the rates fit together" if bound.feasible else "[red]the rates together exceed the machine[/]"
    console.print(
        f"LP bound of the mix: scale x{bound.scale:.4g} ({verdict}; every rate could be multiplied by "
        f"{bound.scale:.4g}); binding: {', '.join(b.name for b in bound.binding) or '-'}", highlight=False)
    console.print("LP per model: " + "; ".join(
        f"{n} {bound.throughput[n]:.1f} samples/s at that scale, {bound.solo[n]:.1f} alone" for n in labels),
        highlight=False)
    busy = table_of("workers (busy share per model: simulated / LP at the bound)", ("worker", "arch", "busy", *labels),
                    fold=True)
    for w in result.workers:
        busy.add_row(w.name, w.arch, f"{result.busy[w.name]:.0%}",
                     *(f"{result.busy_by_model[n][w.name]:.0%} / {bound.busy[n][w.name]:.0%}" for n in labels))
    console.print(busy)


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate_cmd)
