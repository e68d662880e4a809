"""``staronnx.partition()``: a model in, a k-part acyclic plan out.

The steps are the ones DESIGN.md lists: check the request, load and shape-infer the model,
measure node costs on the target device, cut (METIS + acyclic repair, or the linear baseline),
export the parts atomically.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Sequence

import numpy as np
import onnx

from staronnx.errors import PartitionError
from staronnx.modelio import load_model
from staronnx.partition.autoshares import (
    SharesChoice,
    WorkerSpeed,
    choose_shares,
    cpu_group_sizes,
    is_auto,
    measure_speeds,
)
from staronnx.partition.acyclic import CutModel, Refiner, make_acyclic, score
from staronnx.partition.costs import NodeCosts, estimated_costs, profile_costs
from staronnx.partition.export import write_plan
from staronnx.partition.graph import ModelGraph, build_graph
from staronnx.partition.linear import linear_ranks
from staronnx.partition.methods.pipeline import PLACEMENT_METHODS, PlacementMethod
from staronnx.partition.metis import metis_parts
from staronnx.plan import Plan, output_dir_for

#: A shares method maps (graph, costs, targets, seed, tolerance) to a part index per vertex such
#: that every edge goes from a part to the same or a later one. A placement method
#: (:class:`~staronnx.partition.methods.PlacementMethod`: comm-sd, duet, overseer, optimal,
#: ort-static) decides a device per vertex from costs on every device and makes its own parts;
#: ``partition()`` hands it the graph and records each part's device.
Method = Callable[[ModelGraph, np.ndarray, np.ndarray, int, float], np.ndarray] | PlacementMethod


def _metis(graph: ModelGraph, costs: np.ndarray, targets: np.ndarray, seed: int, tol: float) -> np.ndarray:
    """Best acyclic plan over a few METIS seeds (METIS's result varies a lot with the seed)."""
    cm = CutModel.from_graph(graph, costs)
    best, best_score = None, math.inf
    for trial in range(4):
        parts = metis_parts(graph, costs, targets, seed + trial)
        ranks = make_acyclic(cm, parts, targets, tol=tol, seed=seed + trial)
        s = score(cm, ranks, targets, tol)
        if s < best_score:
            best, best_score = ranks, s
    assert best is not None
    return best


def _linear(graph: ModelGraph, costs: np.ndarray, targets: np.ndarray, seed: int, tol: float) -> np.ndarray:
    return linear_ranks(costs, targets)


METHODS: dict[str, Method] = {"metis": _metis, "linear": _linear, **PLACEMENT_METHODS}


def parse_shares(shares: Sequence[float] | str | None, parts: int | None) -> list[float]:
    """Target cost share per part, in execution order; equal shares when only k is given."""
    if isinstance(shares, str):
        try:
            shares = [float(s) for s in shares.split(",") if s.strip()]
        except ValueError:
            raise PartitionError(f"shares must be comma-separated numbers, got {shares!r}",
                                 cli=f"--shares must be comma-separated numbers, got {shares!r}") from None
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


def parse_input_shapes(items: Sequence[str] | dict[str, Sequence[int]] | None) -> dict[str, list[int]]:
    """``NAME=1x3x224x224`` strings (or a dict) into name -> dims."""
    if not items:
        return {}
    if isinstance(items, dict):
        return {k: [int(d) for d in v] for k, v in items.items()}
    shapes: dict[str, list[int]] = {}
    for item in items:
        name, sep, dims = item.rpartition("=")
        try:
            values = [int(d) for d in dims.lower().split("x")]
        except ValueError:
            values = []
        # -1: "as the model says" (the batch on a dynamic axis 0), as exporters write it
        if not sep or not name or not values or any(d <= 0 and d != -1 for d in values):
            raise PartitionError(
                f"input_shapes expects 'NAME=D1xD2x...' (sizes >= 1, or -1 for the model's), "
                f"got {item!r}",
                cli=f"--input-shape expects NAME=D1xD2x... (sizes >= 1, or -1 for the model's), "
                f"got {item!r}",
            )
        shapes[name] = values
    return shapes


def partition(
    model_or_path: onnx.ModelProto | str | os.PathLike[str],
    shares: Sequence[float] | str | None = None,
    *,
    parts: int | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    method: str = "metis",
    device: str = "cpu",
    input_shapes: Sequence[str] | dict[str, Sequence[int]] | None = None,
    seed: int = 0,
    costs: str = "profile",
    profile_batch: int = 8,
    profile_runs: int = 5,
    tolerance: float = 0.02,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
    groups: str | None = None,
    cuda_streams: int = 0,
    speeds: Sequence[WorkerSpeed] | None = None,
) -> Plan:
    """Cut a model into weighted parts that run in sequence with the whole model's outputs.

    ``shares`` are the target cost shares per part in execution order (e.g. ``[0.85, 0.15]``);
    alternatively ``parts=k`` asks for k equal shares. Costs are measured on ``device`` with
    ORT's profiler (``costs="estimate"`` uses FLOP/byte estimates only). Without
    ``output_dir`` the plan is written to a new temporary folder.

    ``shares="auto"`` chooses the split from this machine's speeds
    (:mod:`staronnx.partition.autoshares`): the whole model timed at ``profile_batch`` on the
    CPU groups ``Runtime(cpu_groups=groups, cuda_streams=cuda_streams)`` would start, and on
    the GPU for ``device="cuda"``, or ``speeds`` given (e.g. from calibrated perf models); one
    part where a split cannot pay.  The choice and its reason are kept in the plan's settings.
    ``groups`` (default ``numa`` there) is also the CPU groups a placement method places on
    (default: one per NUMA node, or two halves of the cores), named like the workers that
    ``Runtime(cpu_groups=groups)`` starts, which ``policy="static"`` needs.
    """
    say = progress or (lambda _msg: None)
    auto = is_auto(shares)
    if auto and parts is not None:
        raise PartitionError("shares='auto' chooses the number of parts itself; leave parts unset")
    targets = np.array([1.0] if auto else parse_shares(shares, parts))
    if method not in METHODS:
        raise PartitionError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if costs not in ("profile", "estimate"):
        raise PartitionError(f"unknown cost source {costs!r}; use 'profile' or 'estimate'")
    if profile_batch < 1 or profile_runs < 1:
        got = f"must be at least 1 (got {profile_batch}, {profile_runs})"
        raise PartitionError(f"profile_batch and profile_runs {got}",
                             cli=f"--profile-batch and --profile-runs {got}")
    if not 0 < tolerance < 1:
        raise PartitionError(f"tolerance must be in (0, 1), got {tolerance}")
    shapes = parse_input_shapes(input_shapes)
    out = output_dir_for(output_dir, force)
    if device == "cuda":
        from staronnx.ortutil import providers_for

        providers_for("cuda")  # fail before any work when CUDA is absent

    say("loading model")
    loaded = load_model(model_or_path)
    graph = build_graph(loaded, shapes)
    k = len(targets)
    if k > len(graph):
        raise PartitionError(
            f"cannot cut {len(graph)} node(s) into {k} parts: k must not exceed the node count"
        )
    chosen = METHODS[method]
    auto_choice = None
    if auto:
        if isinstance(chosen, PlacementMethod):
            raise PartitionError(f"shares='auto' is for metis and linear; {method!r} picks its own parts")
        auto_choice = _auto_shares(graph, shapes, device=device, groups=groups or "numa", cuda_streams=cuda_streams,
                                   speeds=speeds, batch=profile_batch, runs=profile_runs, seed=seed, say=say)
        targets = np.array(auto_choice.shares)
        k = len(targets)
    placement = None
    if isinstance(chosen, PlacementMethod):
        # decides a device per node (CPU groups of this machine, plus the GPU for --device cuda)
        # and its own number of parts; --shares/--parts do not apply. It profiles per device
        # itself, so nothing is profiled here.
        placement = chosen.place_graph(
            graph, devices=(groups or "") + ("+cuda" if device == "cuda" else "") or None, costs=costs,
            profile_batch=profile_batch, profile_runs=profile_runs, seed=seed, input_shapes=shapes, progress=say,
        )
        ranks, k, targets = placement.ranks, placement.k, np.array(placement.shares())
        node_costs: NodeCosts = placement.node_costs(profile_batch, profile_runs, costs)
    else:
        if costs == "profile":
            say(f"profiling {len(graph)} nodes on {device} (batch {profile_batch}, {profile_runs} runs)")
            node_costs = profile_costs(
                graph, device=device, batch=profile_batch, runs=profile_runs, input_shapes=shapes, seed=seed
            )
        else:
            node_costs = estimated_costs(graph, batch=profile_batch)
        say(f"cutting into {k} parts with {method}")
        ranks = chosen(graph, node_costs.micros, targets, seed, tolerance)
    cm = CutModel.from_graph(graph, node_costs.micros)
    if not cm.is_monotone(ranks) or len(set(ranks.tolist())) != k:
        raise PartitionError(f"method {method!r} produced an invalid cut (a bug: please report)")
    settings = {
        "method": method,
        "shares": [float(t) for t in targets],
        "parts": k,
        "device": device,
        "seed": seed,
        "costs": costs,
        "profile_batch": profile_batch,
        "profile_runs": profile_runs,
        "tolerance": tolerance,
        "input_shapes": {n: list(d) for n, d in shapes.items()},
        **({"placement": placement.settings()} if placement is not None else {}),
        **({"auto_shares": auto_choice.to_json()} if auto_choice is not None else {}),
    }
    say(f"exporting {k} parts to {out}")
    plan = write_plan(graph, ranks, node_costs, list(targets), settings, out)
    return placement.annotate(plan) if placement is not None else plan


def _auto_shares(
    graph: ModelGraph, shapes: dict[str, list[int]], *, device: str, groups: str, cuda_streams: int,
    speeds: Sequence[WorkerSpeed] | None, batch: int, runs: int, seed: int, say: Callable[[str], None],
) -> SharesChoice:
    """Measure (unless given) the whole model's speed per worker and choose the shares."""
    if speeds is None:
        from staronnx.feeds import random_feeds_for_shapes
        from staronnx.partition.graph import resolve_input_shapes

        feeds = random_feeds_for_shapes(graph.inputs, resolve_input_shapes(graph.inputs, batch, shapes),
                                        model=graph.model, seed=seed)
        speeds = measure_speeds(graph.model, feeds, group_sizes=cpu_group_sizes(groups, cuda_streams),
                                cuda=device == "cuda", runs=max(runs, 3), progress=say)
    choice = choose_shares(speeds, batch)
    say(f"shares auto: {choice.reason}")
    return choice


__all__ = ["partition", "METHODS", "parse_shares", "parse_input_shapes", "Refiner"]
