"""The batching overrides a served model is given (``--batch-axis``, ``--no-batching``), and the
checks of the served models' names (each one URL) and of the per-model settings that name them.

A plan's batching contract (:mod:`staronnx.contract`) is read off the model, with the overrides
stored at partition time. Serving may add the user's word where the graph cannot tell (a state
``[2, batch, 64]`` exported without a symbolic batch, a model to run one request per task):
``staronnx serve``, ``staronnx serve --ray`` and a Serve config file resolve them here, against
the served models' tensors, before anything starts, so a misfit is one line naming the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from staronnx.errors import StaronnxError

if TYPE_CHECKING:  # the plans are loaded by the callers; this module stays light
    from staronnx.plan import Plan

_PerModel = TypeVar("_PerModel", bound=Mapping[str, Any])


def served_only(per_model: _PerModel, names: Sequence[str], option: str) -> _PerModel:
    """``per_model`` if every model it names is served, else an error naming the others."""
    unknown = sorted(set(per_model) - set(names))
    if unknown:
        raise StaronnxError(f"{option} names model(s) {', '.join(map(repr, unknown))} that are not served; "
                            f"the models are {', '.join(map(repr, names))}")
    return per_model


def target_words(target: Mapping[str, Any]) -> list[str]:
    """A model's service target (ServiceTarget fields) in words: ``latency target 50 ms``,
    ``priority 1`` (none for no target)."""
    return ([f"latency target {target['latency_ms']:g} ms"] if target.get("latency_ms") is not None else []) + (
        [f"priority {target['priority']}"] if target.get("priority") else [])


def check_names(names: Sequence[str]) -> None:
    """Every model name usable in a URL, and no two plans served under one (one URL each)."""
    for n in names:
        if not n or "/" in n:
            raise StaronnxError(f"model name {n!r} cannot be used in a URL; choose another with --name")
    dupes = sorted({n for n in names if list(names).count(n) > 1})
    if dupes:
        raise StaronnxError(f"two plans would be served as {dupes[0]!r}; tell them apart with --name")


def batching_overrides(items: Sequence[str], tensors: Mapping[str, set[str]]) -> dict[str, list[str]]:
    """``--batch-axis`` items as ``NAME=AXIS`` items per model (``tensors``: each served model's
    input and output names). ``MODEL:NAME=AXIS`` names one model (a tensor name may itself hold
    a ``:``, as TensorFlow's ``input:0``: the prefix counts as a model only when one is served
    under it); an unprefixed item goes to every model with that tensor, and one that none has is
    refused, naming the tensors there are. Items may be comma-separated (``a=0,b=1``)."""
    per_model: dict[str, list[str]] = {}
    for item in items:
        for piece in (p.strip() for p in str(item).split(",") if p.strip()):
            model, sep, rest = piece.partition(":")
            if sep and model in tensors:
                per_model.setdefault(model, []).append(rest)
                continue
            name = piece.partition("=")[0].strip()
            having = [m for m, names in tensors.items() if name in names]
            if not having:
                known = "; ".join(f"{m}: {', '.join(sorted(n))}" for m, n in tensors.items())
                raise StaronnxError(f"--batch-axis {piece!r}: no served model has a tensor {name!r} ({known})")
            for m in having:
                per_model.setdefault(m, []).append(piece)
    return per_model


def apply_batching(plans: Mapping[str, Plan], items: Sequence[str], no_batching: bool) -> dict[str, dict[str, Any]]:
    """``--batch-axis`` items and ``--no-batching`` applied to each loaded plan (model name ->
    :class:`~staronnx.plan.Plan`, through ``plan.set_batching``; a misfit raises one line naming
    the model). Returns what each model was given, ``{"batch_axes": [...], "batching": bool}``
    (the :class:`~staronnx.ray.spec.ModelSpec` fields a Ray replica re-applies to the plan it
    loads); models given nothing are left out."""
    from staronnx.contract import ContractError

    tensors = {m: {*p.input_names, *p.output_names} for m, p in plans.items()}
    axes = batching_overrides(items, tensors)
    given: dict[str, dict[str, Any]] = {}
    for model, plan in plans.items():
        if model not in axes and not no_batching:
            continue
        try:
            plan.set_batching(axes.get(model, []), batching=not no_batching)
        except ContractError as exc:
            raise StaronnxError(f"model {model!r}: {exc}") from None
        given[model] = {"batch_axes": tuple(axes.get(model, [])), "batching": not no_batching}
    return given
