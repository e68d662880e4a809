"""``staronnx partition`` and ``staronnx plan show|verify``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from staronnx.cli.display import QUIET_HELP, output_console, partition_warnings, spinner, table_of
from staronnx.cli.gpus import parse_cuda_devices
from staronnx.errors import PartitionError
from staronnx.fsutil import check_writable
from staronnx.modelio import is_fixed
from staronnx.plan import Plan

console = output_console()
plan_app = typer.Typer(help="Inspect and check plans.", no_args_is_help=True)


def partition_cmd(
    model: Annotated[Path, typer.Argument(help="ONNX model file to cut.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Plan folder to write.")],
    shares: Annotated[
        Optional[str],
        typer.Option(help="Target cost share per part, in execution order, e.g. 0.85,0.15; or 'auto': "
                          "the split this machine's speeds call for (1 part where a split cannot pay). "
                          "Default: 2 equal parts."),
    ] = None,
    parts: Annotated[Optional[int], typer.Option(
        help="Number of equal parts, instead of --shares (with it, the two must agree). "
             "Default: 2 when neither is given.")] = None,
    device: Annotated[Literal["cpu", "cuda"], typer.Option(help="Device whose node costs weight the cut.")] = "cpu",
    input_shape: Annotated[
        Optional[list[str]],
        typer.Option(help="NAME=D1xD2x... for inputs with dynamic non-batch dims (repeatable)."),
    ] = None,
    method: Annotated[str, typer.Option(
        help="metis or linear (cut to --shares, placed dynamically), or a placement method that "
             "also picks a device per part: comm-sd, duet, overseer, optimal, ort-static.")] = "metis",
    seed: Annotated[int, typer.Option(help="Seed for METIS and random feeds.")] = 0,
    costs: Annotated[Literal["profile", "estimate"],
                     typer.Option(help="profile (ORT profiler) or estimate (FLOPs).")] = "profile",
    profile_batch: Annotated[int, typer.Option(help="Batch size used while profiling.")] = 8,
    profile_runs: Annotated[int, typer.Option(help="Profiled runs averaged (after one warm-up).")] = 5,
    tolerance: Annotated[float, typer.Option(help="Allowed share deviation per part.")] = 0.02,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing non-empty plan folder.")] = False,
    groups: Annotated[Optional[str], typer.Option(
        help="The CPU groups that will serve the plan (as for run/sweep): what --shares auto times "
             "(default numa), or the devices a placement method places on.")] = None,
    cuda_streams: Annotated[int, typer.Option(
        help="With --shares auto: CUDA workers that will serve the plan (each holds back a core).")] = 0,
    cuda_devices: Annotated[Optional[str], typer.Option(
        help="With --shares auto and --cuda-streams: the GPUs that will serve the plan (0,1 or 0-3 or all), "
             "each timed (or read from --speeds-from), their rates added. Default: 0.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)] = False,
    speeds_from: Annotated[Optional[Path], typer.Option(
        help="With --shares auto: take the speeds from the calibrated perf models of this 1-part "
             "plan of the same model instead of timing the model now.")] = None,
    batch_axis: Annotated[Optional[list[str]], typer.Option(
        help="NAME=AXIS: the axis of input or output NAME that carries the batch, where the graph "
             "cannot tell (e.g. state=1); NAME=none for a per-request value (repeatable). "
             "Kept in the plan: every command batches the same way.")] = None,
    no_batching: Annotated[bool, typer.Option(
        "--no-batching", help="Never batch requests together: one request per task (Triton's "
                              "max_batch_size 0), kept in the plan.")] = False,
    precision: Annotated[Optional[list[str]], typer.Option(
        help="DEVICE=PRECISION, e.g. gpu=fp16: the parts the CUDA workers run converted to fp16 "
             "(onnxconverter-common; each part keeps its fp32 inputs and outputs, so the casts sit at the "
             "cuts), the CPU parts fp32; `plan verify` checks them against the fp32 model.")] = None,
) -> None:
    """Cut MODEL into weighted, acyclic parts and write them as a plan folder."""
    from staronnx.contract import parse_batch_axes
    from staronnx.ortutil import quiet_ort_log
    from staronnx.partition.autoshares import is_auto
    from staronnx.partition.notation import read_input_shapes, read_shares
    from staronnx.partition.api import METHODS, partition
    from staronnx.partition.spec import PartitionSpec
    from staronnx.partition.precision import apply_precision, parse_precision

    if method not in METHODS:
        raise PartitionError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    # the library takes typed values: the option strings are read here, errors naming the flags
    targets = shares if shares is None or is_auto(shares) else read_shares(shares, "--shares")
    shapes = read_input_shapes(input_shape or [], "--input-shape")
    axes = parse_batch_axes(batch_axis or [])
    precisions = parse_precision(precision)  # a bad value is refused before the profiling
    if precisions.get("cuda") == "fp16":
        from staronnx.partition.precision import _converter

        _converter()  # the converter's absence too
    quiet_ort_log()
    if (speeds_from is not None or cuda_streams or cuda_devices is not None) and not is_auto(shares):
        raise PartitionError("--cuda-streams, --cuda-devices and --speeds-from apply to --shares auto only")
    # a plan's GPUs may be read from another host's models (--speeds-from); timing needs them here
    devices = parse_cuda_devices(cuda_devices, cuda_streams, simulated=speeds_from is not None)
    if groups is not None and not is_auto(shares) and method in ("metis", "linear"):
        raise PartitionError("--groups applies to --shares auto and to the placement methods")
    check_writable(output, "--output", folder=True)  # now, not after the whole profiling
    speeds = None
    if speeds_from is not None:
        from staronnx.bench.machine_speeds import speeds_from_plan
        from staronnx.workers.layout import MachineSpec

        speeds = speeds_from_plan(Plan.load(speeds_from), MachineSpec(groups or "numa", cuda_streams, devices),
                                  batch=profile_batch)
    spec = PartitionSpec(parts=parts, method=method, device=device, input_shapes=shapes, seed=seed, costs=costs,
                         profile_batch=profile_batch, profile_runs=profile_runs, tolerance=tolerance, groups=groups,
                         cuda_streams=cuda_streams, cuda_devices=devices, batch_axes=axes, batching=not no_batching)
    with partition_warnings(), spinner(quiet) as progress:
        step = progress.add_task("partitioning")
        plan = partition(model, targets, spec, output_dir=output, force=force, speeds=speeds,
                         progress=lambda msg: progress.update(step, description=msg))
        if precisions:
            progress.update(step, description="converting the GPU parts")
            plan = apply_precision(plan, precisions)
    console.print(f"wrote plan [bold]{plan.root}[/] ({plan.k} parts, {method}, {plan.cost_source})")
    print_plan(plan)


def print_plan(plan: Plan) -> None:
    """Parts, op counts, cost shares, crossing tensors and bytes, as tables; then the model's
    batching contract and what the input shapes given at partition time were for."""
    table = table_of(f"{plan.root.name}: {plan.k} part(s), hash {plan.hash}",
                     ("part", "nodes", "ops", "cost µs", "share", "target", "inputs", "outputs"),
                     left=("ops", "inputs", "outputs"), fold=True)
    for p in plan.parts:
        ops = ", ".join(f"{op}×{n}" for op, n in list(p.op_counts.items())[:5])
        if len(p.op_counts) > 5:
            ops += ", …"
        table.add_row(str(p.index), str(p.nodes), ops, f"{p.cost_us:,.0f}", f"{p.share:.3f}", f"{p.target_share:.3f}",
                      _names(p.inputs), _names(p.outputs))
    console.print(table)
    auto = plan.settings.get("auto_shares")
    if auto:
        predicted = ", ".join(f"{k} {v:,.0f}" for k, v in auto.get("predicted_samples_per_s", {}).items())
        console.print(f"shares auto (batch {auto['batch']}): {auto['reason']}"
                      + (f"; predicted samples/s: {predicted}" if predicted else ""), soft_wrap=True)
    from staronnx.partition.precision import describe

    precision = describe(plan)
    if precision:
        console.print(precision, soft_wrap=True, highlight=False)
    cross = table_of(f"crossing tensors — {plan.cut_bytes_per_sample:,} bytes per sample cut",
                     ("tensor", "dtype", "shape", "bytes/sample", "from", "to"), fold=True)
    for t in plan.crossing:
        cross.add_row(t.name, t.dtype, "x".join(str(d) for d in t.shape), f"{t.bytes_per_sample:,}", str(t.producer),
                      ",".join(map(str, t.consumers)))
    console.print(cross)
    print_contract(plan)


def print_contract(plan: Plan) -> None:
    """The batching contract (where each tensor carries the batch, whether requests share a
    task) and that the sizes given to partition were for profiling: a plan serves every size
    the model accepts (its parts keep the model's dynamic dimensions)."""
    contract = plan.contract
    set_by = f" (set for {', '.join(contract.overridden)})" if contract.overridden else ""
    console.print(f"batching contract{set_by}:", highlight=False)
    for line in contract.describe():
        console.print(f"  {line}", highlight=False, soft_wrap=True)
    dynamic = {t.name for t in plan.inputs if not all(is_fixed(d) for d in t.shape)}
    given = {n: d for n, d in (plan.settings.get("input_shapes") or {}).items() if n in dynamic}
    if given:
        sizes = ", ".join(f"{n}={_shape(d)}" for n, d in given.items())
        console.print(f"input shapes {sizes} were for profiling only: the plan serves every size the model "
                      "accepts (random inputs of plan verify, calibrate and run default to them)",
                      highlight=False, soft_wrap=True)


def _names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit})" if len(names) > limit else "")


@plan_app.command("show")
def show_cmd(plandir: Annotated[Path, typer.Argument(help="Plan folder.")]) -> None:
    """Show a plan's parts, op counts, cost shares, crossing tensors and bytes."""
    print_plan(Plan.load(plandir))


@plan_app.command("verify")
def verify_cmd(
    plandir: Annotated[Path, typer.Argument(help="Plan folder.")],
    model: Annotated[Path, typer.Option(help="The source ONNX model.")],
    batch: Annotated[int, typer.Option(help="Batch size of the random inputs.")] = 1,
    input_shape: Annotated[
        Optional[list[str]], typer.Option(help="NAME=D1xD2x... for dynamic non-batch dims.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the random inputs.")] = 0,
    inputs: Annotated[Optional[Path], typer.Option(
        help="Real inputs instead of random ones: an .npz keyed by the model's input names, "
             "samples along axis 0 (numpy.savez); all its samples form one batch.")] = None,
) -> None:
    """Run MODEL and the chained parts on the same inputs (random, or --inputs); exit 0 only
    when they agree. The batch lands on each input's own batch axis (the plan's contract); a
    model that runs one request per task is verified at batch 1, and says why."""
    from staronnx.ortutil import quiet_ort_log
    from staronnx.partition.notation import read_input_shapes
    from staronnx.verify import random_plan_feeds, runnable_batch, verify_plan

    if batch < 1:
        raise PartitionError(f"--batch must be at least 1, got {batch}")
    if inputs is not None and input_shape:  # else dropped: the file's arrays have their own sizes
        raise PartitionError("--input-shape sizes the random inputs; --inputs brings its own arrays: give one of them")
    quiet_ort_log()
    plan = Plan.load(plandir)
    given = read_input_shapes(input_shape or [], "--input-shape")
    if inputs is not None:
        from staronnx.inputs import load_inputs, samples

        feeds = load_inputs(inputs, plan)
        batch = samples(feeds, plan)
    else:
        batch, note = runnable_batch(plan, batch)  # 1 for a model that runs one request per task
        if note is not None:
            console.print(note, highlight=False, soft_wrap=True)
        feeds = random_plan_feeds(plan, batch, given, seed)
    console.print("inputs: " + ", ".join(f"{n} {_shape(v.shape)}" for n, v in feeds.items()), highlight=False,
                  soft_wrap=True)
    from staronnx.plan import arch_files

    source = f"{inputs}" if inputs is not None else "random inputs"
    ok = True
    for arch in [None, *arch_files(plan)]:  # the plan's own files, then each arch's own (fp16 for cuda)
        report = verify_plan(plan, model, batch=batch, feeds=feeds, arch=arch)
        which = (f"{plan.k} chained parts" if report.arch is None
                 else f"the {report.arch} workers' {report.precision} parts, chained on the CPU")
        whole = "whole model" if report.arch is None else "whole fp32 model"
        table = table_of(f"{whole} vs {which}, batch {batch} ({source})",
                         ("output", "shape", "max abs diff", "max rel diff", "result"), fold=True)
        for o in report.outputs:
            table.add_row(o.name, "x".join(map(str, o.shape)), f"{o.max_abs:.3g}", f"{o.max_rel:.3g}",
                          "[green]OK[/]" if o.ok else "[red]MISMATCH[/]")
        console.print(table)
        what = "" if report.arch is None else f" for the {report.arch} parts ({report.precision})"
        if report.ok:
            console.print(f"OK{what} (tolerance {report.tolerance:g} relative to each output's scale)")
        else:
            console.print(f"MISMATCH{what} (tolerance {report.tolerance:g} relative to each output's scale)"
                          if report.arch else "MISMATCH")
            ok = False
    if not ok:
        raise typer.Exit(1)


def _shape(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


def register(app: typer.Typer) -> None:
    app.command("partition")(partition_cmd)
    app.add_typer(plan_app, name="plan")
