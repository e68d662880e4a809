"""Mixed traffic: several models served by one shared runtime, each at its own rate.

``staronnx sweep a/ b/ --rates a=100:400:100,b=50`` and ``staronnx simulate a/ b/ --rates
a=100,b=400`` read a rate (or a range) per model. A *mix* is one point: a rate and a batch
size per model. The points of a mixed sweep are every combination of the models' rates (and
batch sizes), measured on one runtime hosting every model (one set of workers, one policy,
the models' service targets), a :class:`~staronnx.serving.Server` per model fed by its own
open-loop generator, as ``staronnx serve`` serves them. Each point gives one row per model
(the single-model sweep's columns, plus ``model``, ``mix``, the latency target and deadline
misses), and the LP bound over the mix (:func:`~staronnx.bench.bound.mix_bound`): whether the
rates together fit the machine and by what factor they could all grow.

Residency (``--model-workers``) and latency lanes (``--lane``) shape the live runtime, its
bound and its simulation alike (:data:`~staronnx.bench.machine.LANE_APPROXIMATION` says what
the simulated lanes leave out).

Why every combination and not a scale factor on one mix: the question a shared machine asks
is how one model's load hurts another's latency (the heavy model pushed to saturation while
the light one stays at a modest rate): a range for one and one rate for the other says it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from staronnx.bench.spec import SweepSpec
from staronnx.bench.sweep import Progress, sweep
from staronnx.errors import StaronnxError
from staronnx.perfmodels import PerfModelStore
from staronnx.plan import Plan
from staronnx.runtime.models import name_gaps
from staronnx.workers.layout import MachineSpec


def is_per_model(text: str | None) -> bool:
    """Whether an option's text names models (``a=100,b=400``) rather than being one value."""
    return text is not None and "=" in text


def split_per_model(text: str, option: str) -> dict[str, str]:
    """``"a=100:400:100,b=400"`` -> ``{"a": "100:400:100", "b": "400"}``.

    Items are separated by commas; an item without ``=`` continues the model before it, so
    ``a=100,200,b=50`` gives ``a`` two rates: a model's text reads exactly as the
    single-model option does.
    """
    out: dict[str, list[str]] = {}
    current: str | None = None
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        if sep:
            current = name.strip()
            if not current:
                raise StaronnxError(f"{option}: a model name is missing before '=' in {text!r}")
            if current in out:
                raise StaronnxError(f"{option}: model {current!r} is named twice in {text!r}")
            out[current] = [value.strip()] if value.strip() else []
        elif current is None:
            raise StaronnxError(f"{option}: {text!r} mixes a plain value with model=value items; "
                                f"name every model (a=100,b=400)")
        else:
            out[current].append(item)
    for name, values in out.items():
        if not values:
            raise StaronnxError(f"{option}: no value for model {name!r} in {text!r}")
    return {name: ",".join(values) for name, values in out.items()}


def model_names(plans: Sequence[Path], names: Sequence[str] | None) -> list[str]:
    """Each plan's model name: ``--name`` in order, else the plan folder's name; unique
    (``staronnx serve``'s rule, so a sweep's models are named as the server names them)."""
    if names and len(names) != len(plans):
        raise StaronnxError(f"--name given {len(names)} time(s) for {len(plans)} plan(s): give one per plan, in order")
    out = list(names) if names else [Path(p).resolve().name for p in plans]
    for n in out:
        if not n or "/" in n or "=" in n or "," in n:
            raise StaronnxError(f"model name {n!r} cannot be used (no '/', '=' or ','); choose another with --name")
    dupes = sorted({n for n in out if out.count(n) > 1})
    if dupes:
        raise StaronnxError(f"two plans would be named {dupes[0]!r}; tell them apart with --name")
    return out


def per_model(text: str, names: Sequence[str], option: str) -> dict[str, str]:
    """``option``'s text per model (:func:`split_per_model`), which must name every model of
    ``names`` and no other."""
    given = split_per_model(text, option)
    unknown, missing = name_gaps(given, names)
    if unknown:
        raise StaronnxError(f"{option} names model(s) {', '.join(map(repr, unknown))}, which are not given; "
                            f"the models are {', '.join(map(repr, names))}")
    if missing:
        raise StaronnxError(f"{option} gives no value for model(s) {', '.join(map(repr, missing))}; "
                            f"name every model, e.g. {','.join(f'{n}=...' for n in names)}")
    return given


# ---------------------------------------------------------------------------- the live sweep
def sweep_mix(plans: Mapping[str, Plan | str | os.PathLike[str]], spec: SweepSpec, *,
              machine: MachineSpec = MachineSpec(), store: PerfModelStore | None = None,
              progress: Progress | None = None) -> list[dict[str, Any]]:
    """Measure every mix of ``spec.points`` (:func:`~staronnx.bench.sweep.mix_points`) on one
    runtime hosting every model, each with its ``spec.targets`` entry; return the rows (one per
    point and model): :func:`staronnx.bench.sweep.sweep` over several models, the machine's
    ``residency`` and ``lanes`` keeping some models on some workers. Model ``i`` is seeded
    ``seed + i``, as :func:`~staronnx.bench.simulator.simulate_mix` draws it; with
    ``stop_on_congestion`` the points that dominate a congested one (same batch sizes, every
    rate at least as high) are skipped. ``staronnx sweep`` measures an unstable mix once
    (``extend=False``): with every model's rate it is long enough.
    """
    return sweep(dict(plans), (), (), spec, machine=machine, store=store, progress=progress)
