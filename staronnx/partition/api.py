"""``staronnx.partition()``: a model in, a k-part acyclic plan out, cut for this host.

The steps are the ones DESIGN.md lists: check the request, load and shape-infer the model,
choose the shares (``shares="auto"``), run the method's :class:`~staronnx.partition.cut.Cut`
(it measures the node costs it needs), export the parts atomically
(:func:`~staronnx.partition.export.write_plan`, as ``place()`` does).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import onnx

from staronnx.contract import parse_batch_axes
from staronnx.errors import PartitionError
from staronnx.feeds import random_feeds_for_shapes
from staronnx.modelio import LoadedModel, load_model
from staronnx.perfmodels.helpcost import HelpCost
from staronnx.partition.autoshares import (
    SharesChoice,
    WorkerSpeed,
    choose_shares,
    is_auto,
    measure_speeds,
)
from staronnx.partition.checks import say as warn
from staronnx.partition.checks import warn_cut
from staronnx.partition.cut import SHARES_CUTS, Cut, CutRequest, plan_settings
from staronnx.partition.host import cpu_group_sizes, host_devices, host_transfer
from staronnx.partition.export import write_plan
from staronnx.partition.graph import ModelGraph, build_graph, check_batch_axes, resolve_input_shapes
from staronnx.partition.methods.pipeline import PLACEMENT_METHODS
from staronnx.partition.notation import parse_input_shapes, read_shares
from staronnx.partition.spec import PartitionSpec
from staronnx.partition.whole import WHOLE, UncuttableError, too_small, vertex_count, whole_reason, write_whole_plan
from staronnx.plan import Plan, output_dir_for

#: Every method by name: the share cuts (metis, linear) cut to ``shares`` and leave placement
#: to the runtime's policy; the placement methods (comm-sd, duet, overseer, optimal,
#: ort-static) choose a device per node and their own parts.
METHODS: dict[str, Cut] = {**SHARES_CUTS, **PLACEMENT_METHODS}


def parse_shares(shares: Sequence[float] | str | None, parts: int | None) -> list[float]:
    """Target cost share per part, in execution order, checked; equal shares when only k is
    given. A string is read as comma-separated numbers (the CLI reads its own beforehand)."""
    if isinstance(shares, str):
        shares = read_shares(shares, "shares")
    if shares is not None and not isinstance(shares, Sequence):
        hint = f"; for {shares} equal parts pass parts={shares}" if isinstance(shares, int) and shares > 0 else ""
        raise PartitionError(f"shares must be a list of cost shares summing to 1 (e.g. [0.85, 0.15]) or 'auto', "
                             f"got {shares!r}{hint}")
    if shares is not None and parts is not None and len(shares) != parts:
        raise PartitionError(f"shares lists {len(shares)} parts but parts={parts}",
                             cli=f"--shares lists {len(shares)} parts but --parts is {parts}")
    if shares is None:
        if parts is None:
            parts = 2
        if parts < 1:
            raise PartitionError(f"parts must be at least 1, got {parts}",
                                 cli=f"--parts must be at least 1, got {parts}")
        return [1.0 / parts] * parts
    values = [float(s) for s in shares]
    if not values:
        raise PartitionError("shares is empty", cli="--shares is empty")
    if any(not math.isfinite(s) or s <= 0 for s in values):
        raise PartitionError(f"every share must be positive, got {values}")
    if abs(sum(values) - 1.0) > 1e-6:
        raise PartitionError(f"shares must sum to 1 (within 1e-6), got {values} summing to {sum(values):.6g}")
    return values


def partition(
    model_or_path: onnx.ModelProto | str | os.PathLike[str],
    shares: Sequence[float] | str | None = None,
    spec: PartitionSpec = PartitionSpec(),
    *,
    output_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
    speeds: Sequence[WorkerSpeed] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Cut a model into weighted parts that run in sequence with the whole model's outputs.

    ``shares`` are the target cost shares per part in execution order (e.g. ``[0.85, 0.15]``);
    alternatively ``PartitionSpec(parts=k)`` asks for k equal shares. ``spec``
    (:class:`~staronnx.partition.spec.PartitionSpec`) says how to cut: costs are measured on
    its ``device`` with ORT's profiler (``costs="estimate"`` uses FLOP/byte estimates only).
    Without ``output_dir`` the plan is written to a new temporary folder; ``force`` lets it
    replace a plan already there.

    ``shares="auto"`` chooses the split from this machine's speeds
    (:mod:`staronnx.partition.autoshares`): the whole model timed at ``profile_batch`` on the
    CPU workers ``Runtime(plan, MachineSpec(groups, cuda_streams))`` would start here
    (default ``numa``), and on each GPU of ``cuda_devices`` for ``device="cuda"`` (their rates
    add up), or ``speeds`` given (e.g. from calibrated perf models); one part where a split
    cannot pay. The choice and its reason are kept in the plan's settings. A placement method
    places on the CPU groups of ``groups`` (default: one per NUMA node, or two halves of the
    cores), beside the GPU for ``device="cuda"``, and prices transfers with the bus model
    ``staronnx calibrate`` stored (:mod:`staronnx.partition.host`). Only what the request uses
    is read of this host.

    The spec's ``batch_axes`` (input or output name -> axis, None for none) and ``batching=False``
    set the model's batching contract where the graph cannot tell it (:mod:`staronnx.contract`); they are
    kept in the plan's settings, so every command that loads the plan batches the same way.

    A model that cannot be cut (inputs or outputs that are not tensors, an output no node
    computes, a cut that fails) is served whole, as a plan of one part, and so is one with fewer
    nodes than the default two parts (:mod:`staronnx.partition.whole`); a
    :class:`~staronnx.partition.checks.PartitionWarning` says so. More parts than nodes asked
    for explicitly are refused, naming the node count.

    A cut that runs but does not mean what was asked (a part that computes nothing, a crossing
    tensor of 0 bytes, an achieved share further than ``tolerance`` from its target) is said
    with a :class:`~staronnx.partition.checks.PartitionWarning` each, with a way out.
    """
    method, device, profile_batch, profile_runs, tolerance = (spec.method, spec.device, spec.profile_batch,
                                                               spec.profile_runs, spec.tolerance)
    placed = method in PLACEMENT_METHODS
    auto = is_auto(shares)
    devices = host_devices(spec.groups, cuda=device == "cuda") if placed else None
    group_sizes = (cpu_group_sizes(spec.groups or "numa", spec.cuda_streams, spec.cuda_devices)
                   if auto and speeds is None and not placed else None)
    transfer = host_transfer() if placed else None
    say = progress or (lambda _msg: None)
    if auto and spec.parts is not None:
        raise PartitionError("shares='auto' chooses the number of parts itself; leave parts unset",
                             cli="--shares auto chooses the number of parts itself: drop --parts")
    targets = [1.0] if auto else parse_shares(shares, spec.parts)
    if method not in METHODS:
        raise PartitionError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if placed and not auto and (shares is not None or spec.parts is not None):  # else dropped: it makes its own parts
        raise PartitionError(f"method {method!r} picks its own parts (and a device for each): leave shares and "
                             "parts unset", cli=f"--method {method} picks its own parts (and a device for each): "
                                                "drop --shares and --parts")
    if spec.costs not in ("profile", "estimate"):
        raise PartitionError(f"unknown cost source {spec.costs!r}; use 'profile' or 'estimate'")
    if profile_batch < 1 or profile_runs < 1:
        got = f"must be at least 1 (got {profile_batch}, {profile_runs})"
        raise PartitionError(f"profile_batch and profile_runs {got}",
                             cli=f"--profile-batch and --profile-runs {got}")
    if not 0 < tolerance < 1:
        raise PartitionError(f"tolerance must be in (0, 1), got {tolerance}")
    shapes = parse_input_shapes(spec.input_shapes)
    axes = parse_batch_axes(spec.batch_axes)
    out = output_dir_for(output_dir, force)
    if device == "cuda":
        from staronnx.ortutil import providers_for

        providers_for("cuda")  # fail before any work when CUDA is absent

    say("loading model")
    loaded = load_model(model_or_path)
    check_batch_axes(loaded.model, axes)  # before any profiling: a plan that cannot load is never written
    # a placement method profiles per device itself and makes its own parts (shares do not apply)
    request = CutRequest(list(targets), device=device, costs=spec.costs, profile_batch=profile_batch,
                         profile_runs=profile_runs, seed=spec.seed, tolerance=tolerance, input_shapes=shapes,
                         devices=devices, transfer=transfer, progress=say)
    contract = dict(batch_axes=axes or None, batching=None if spec.batching else False)
    reason = whole_reason(loaded.model)
    small = too_small(loaded.model, 2 if auto else len(targets))
    if small is not None and reason is None and not auto and (shares is not None or spec.parts is not None):
        raise PartitionError(f"cannot cut {vertex_count(loaded.model)} node(s) into {len(targets)} parts: k must "
                             "not exceed the node count (without shares or parts, the model is served whole)")
    why_whole = reason if reason is not None else small
    if why_whole is not None:
        return _whole(loaded, why_whole, out, request, contract)
    graph = build_graph(loaded, shapes, axes)
    cut = METHODS[method]
    auto_choice = None
    if auto:
        if placed:
            raise PartitionError(f"shares='auto' is for metis and linear; {method!r} picks its own parts",
                                 cli=f"--shares auto is for --method metis and linear; {method!r} picks its own parts")
        auto_choice = _auto_shares(graph, shapes, spec, group_sizes=group_sizes, speeds=speeds, say=say)
        request.targets = list(auto_choice.shares)
    try:
        result = cut(graph, request)
        settings = plan_settings(method, result.targets, request, device=device, tolerance=tolerance,
                                 placement=result.report,
                                 auto_shares=auto_choice.to_json() if auto_choice is not None else None,
                                 contract=contract)
        say(f"exporting {result.k} parts to {out}")
        plan = write_plan(graph, result, settings, out)
    except UncuttableError as exc:
        return _whole(loaded, f"its cut failed ({exc})", out, request, contract)
    warn_cut(plan, tolerance, shares_cut=not placed)
    return plan


def _whole(loaded: LoadedModel, reason: str, out: os.PathLike[str], request: CutRequest,
           contract: Mapping[str, Any] | None = None) -> Plan:
    """The model served as one part (:mod:`staronnx.partition.whole`), said in one warning:
    a model that runs is never refused for being uncuttable. Its settings are those every plan
    has, with ``whole``: why."""
    name = loaded.path.name if loaded.path is not None else "the model"
    message = f"{name} is served as one part, not cut: {reason}"
    request.progress(message)
    warn(message, message.replace("one part", "one part (--parts 1)", 1))
    settings = plan_settings(WHOLE, [1.0], request, device=request.device, tolerance=request.tolerance,
                             whole=reason, contract=contract)
    return write_whole_plan(loaded, settings, Path(out))


def _auto_shares(graph: ModelGraph, shapes: dict[str, list[int]], spec: PartitionSpec, *,
                 group_sizes: Sequence[int] | None, speeds: Sequence[WorkerSpeed] | None,
                 say: Callable[[str], None]) -> SharesChoice:
    """Measure (unless given) the whole model's speed per worker at ``spec``'s profile batch and
    choose the shares."""
    batch = spec.profile_batch
    if speeds is None:
        assert group_sizes is not None  # partition() reads them for every auto cut without speeds
        feeds = random_feeds_for_shapes(graph.inputs, resolve_input_shapes(graph.inputs, batch, shapes),
                                        model=graph.model, seed=spec.seed)
        # the GPUs are timed where the plan will be served with CUDA workers (--cuda-streams N), or
        # where its costs are the GPU's: a split chosen from the CPU groups' times alone is one part
        on_gpu = spec.device == "cuda" or spec.cuda_streams > 0
        speeds = measure_speeds(graph.model, feeds, group_sizes=group_sizes, cuda=on_gpu,
                                cuda_devices=spec.cuda_devices, cuda_streams=spec.cuda_streams,
                                runs=max(spec.profile_runs, 3), progress=say)
    from staronnx.perfmodels.store import PerfModelStore

    # what a CPU task costs the GPU on this host, as the policies charge it: measured and
    # stored, else the default
    choice = choose_shares(speeds, batch, help=PerfModelStore().load_help_cost() or HelpCost())
    say(f"shares auto: {choice.reason}")
    return choice


__all__ = ["partition", "PartitionSpec", "METHODS", "parse_shares", "parse_input_shapes"]
