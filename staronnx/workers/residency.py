"""Which workers hold which models, when not every worker can hold every one.

A runtime of several models gives every worker a session of every model's parts by default
(StarPU's way: any worker may run any codelet). A GPU's memory, or a budget of sessions per
worker, does not always allow that: a large model may fit beside a small one only on the CPU
groups, or one model may be kept off the GPU so that another has it to itself. ``residency``
says, per model, which workers load it; the others hold no session of it (no memory, no
warm-up), and the policy places its tasks only on workers that hold them (StarPU's
``can_execute``: :meth:`~staronnx.runtime.sched.Policy.can_run`). Models not named stay on
every worker.

A selector is a comma-separated list of:

- ``cpu`` / ``cuda``: every worker of that kind;
- ``cuda<d>``: every stream of GPU ``d``;
- a worker's name, as ``Runtime.stats()`` lists them (``cpu:numa0``, ``cuda0.s1``).

On the command line: ``--model-workers NAME=SELECTOR`` (repeatable).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from staronnx.errors import StaronnxError

_DEVICE = re.compile(r"cuda(\d+)")


class ResidencyError(StaronnxError, ValueError):
    """A residency that names an unknown model, matches no worker or leaves a model nowhere."""


@dataclass(frozen=True)
class WorkerSlot:
    """A worker as residency sees it before it starts: enough to match a selector."""

    name: str
    kind: str  # "cpu" or "cuda"
    device: int | None = None  # the GPU of a CUDA worker


def parse_model_workers(items: Iterable[str]) -> dict[str, str]:
    """``NAME=SELECTOR`` options (the CLI's ``--model-workers``) as a mapping."""
    return parse_named(items, "--model-workers", "NAME=WORKERS (e.g. ocr=cpu or big=cuda0,cpu:numa0)")


def parse_named(items: Iterable[str], option: str, usage: str, default: str | None = None) -> dict[str, str]:
    """``NAME=VALUE`` options as {name: value} (``default``: a bare ``NAME``'s value; None: the
    value is required); a model named twice is an error, not a silent override. ``usage``
    says what ``option`` takes, in its error."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not name or (sep and not value) or (not sep and default is None):
            raise ResidencyError(f"{option} takes {usage}, got {item!r}")
        if name in out:
            raise ResidencyError(f"{option} names model {name!r} twice")
        out[name] = value or default or ""
    return out


def selects(selector: str, slot: WorkerSlot) -> bool:
    """Whether ``selector`` (see the module docstring) takes in ``slot``."""
    for token in (t.strip() for t in selector.split(",")):
        if token in (slot.kind, slot.name):
            return True
        m = _DEVICE.fullmatch(token)
        if m and slot.kind == "cuda" and slot.device == int(m.group(1)):
            return True
    return False


def model_holders(residency: Mapping[str, str], model_names: Sequence[str],
                  slots: Sequence[WorkerSlot]) -> dict[str, list[int]]:
    """Per model named in ``residency``, the indices of the ``slots`` that hold it. Refuses an
    unknown model, a selector token that matches no worker and a model left on no worker,
    naming what exists."""
    check_models("--model-workers", residency, model_names)
    names = ", ".join(s.name for s in slots)
    return {model: selected(f"--model-workers {model}={selector}", selector, slots,
                            f"matches no worker (workers: {names}; or cpu, cuda, cuda<N>)")
            for model, selector in residency.items()}


def check_models(option: str, named: Iterable[str], model_names: Sequence[str]) -> None:
    """Refuse a model name in ``named`` (what ``option`` was given) that the runtime does not serve."""
    unknown = [n for n in named if n not in model_names]
    if unknown:
        raise ResidencyError(f"{option} names unknown model(s) {', '.join(map(repr, unknown))}; "
                             f"this runtime serves {', '.join(model_names)}")


def selected(given: str, selector: str, slots: Sequence[WorkerSlot], none: str) -> list[int]:
    """The indices of the ``slots`` that ``selector`` takes in. Refuses a token of it that takes
    in none (a typo would otherwise load the model nowhere it was meant to be), saying
    ``given`` (the option as written) and ``none`` (what exists)."""
    for token in (t.strip() for t in selector.split(",")):
        if not token or not any(selects(token, s) for s in slots):
            raise ResidencyError(f"{given}: {token!r} {none}")
    return [i for i, s in enumerate(slots) if selects(selector, s)]
