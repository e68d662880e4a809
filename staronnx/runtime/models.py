"""Several plans served by one runtime: their parts numbered as one set of codelets, and the
service target of each model.

Why one numbering: StarPU runs every submitted task graph on one set of workers under one
scheduler, each codelet with its own perf model. staronnx does the same by laying the parts
of every hosted plan end to end (model ``a``'s parts 0..ka-1, then model ``b``'s ...): a
worker holds one session per *global* part, a policy sees one DAG made of disjoint pieces
(so heft's upward ranks stay per model), and the perf models stay keyed by (plan hash, the
part's own index, arch), so a model joining a runtime needs no recalibration. A single plan is
a set of one model, whose global and local part numbers coincide: nothing changes for it.

A :class:`ServiceTarget` says how a model wants to be served when it shares the machine:
``latency`` (seconds) turns each request into a deadline (its arrival + the target) that
orders ready tasks earliest deadline first (EDF); ``priority`` is StarPU's task priority
lifted to the model (a higher one runs first, deadlines or not); ``capacity`` bounds the
model's requests inside the runtime, beyond which its submissions are refused
(:class:`ModelOverloaded`) while other models are served as before.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from staronnx.errors import StaronnxError
from staronnx.plan import Plan

__all__ = ["HostedModel", "ModelOverloaded", "ModelSet", "ServiceTarget", "parse_targets"]


class ModelOverloaded(StaronnxError, RuntimeError):
    """A model already has ``capacity`` requests in the runtime: this one is refused, the
    other models' requests are not (a server answers it 503 / UNAVAILABLE)."""

    def __init__(self, model: str, capacity: int) -> None:
        super().__init__(f"model {model!r} has {capacity} requests in the runtime, its capacity: "
                         "it is overloaded; lower its rate or raise its capacity")
        self.model = model
        self.capacity = capacity


@dataclass(frozen=True)
class ServiceTarget:
    """How one model wants to be served on a shared runtime (see the module docstring).

    ``latency``: seconds from a request's arrival to its answer (None: no deadline, the
    model's tasks come after every task with one of the same priority); ``priority``: higher
    runs first; ``capacity``: most requests of this model in the runtime (None: no bound).
    """

    latency: float | None = None
    priority: int = 0
    capacity: int | None = None

    def __post_init__(self) -> None:
        if self.latency is not None and not (self.latency > 0 and math.isfinite(self.latency)):
            raise StaronnxError(f"a latency target must be a positive number of seconds, got {self.latency!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise StaronnxError(f"a model priority must be an integer, got {self.priority!r}")
        if self.capacity is not None and (isinstance(self.capacity, bool) or not isinstance(self.capacity, int)
                                          or self.capacity < 1):
            raise StaronnxError(f"a model capacity must be an integer >= 1, got {self.capacity!r}")

    @classmethod
    def of(cls, value: ServiceTarget | Mapping[str, Any] | None) -> ServiceTarget:
        """A target from itself, a mapping of its fields (``latency_ms`` accepted too), or None."""
        if value is None:
            return cls()
        if isinstance(value, ServiceTarget):
            return value
        fields = dict(value)
        if "latency_ms" in fields:
            ms = fields.pop("latency_ms")
            fields["latency"] = None if ms is None else float(ms) / 1e3
        unknown = sorted(set(fields) - {"latency", "priority", "capacity"})
        if unknown:
            raise StaronnxError(f"unknown service target field(s) {', '.join(unknown)}; "
                                "use latency (s), latency_ms, priority, capacity")
        return cls(**fields)

    def deadline(self, arrival: float) -> float:
        """When a request that arrived at ``arrival`` must be answered (inf: never late)."""
        return arrival + self.latency if self.latency is not None else math.inf


@dataclass(frozen=True)
class HostedModel:
    """One model of a :class:`ModelSet`: its plan, its target and where its parts start."""

    name: str
    plan: Plan
    index: int
    first_part: int
    target: ServiceTarget

    @property
    def parts(self) -> range:
        """Its parts' global numbers."""
        return range(self.first_part, self.first_part + self.plan.k)


class ModelSet:
    """The parts of several plans as one numbering of codelets (see the module docstring).

    Offers what worker launch needs of a plan (``k``, ``part_path``), so the same workers'
    sessions cover every model's parts.
    """

    def __init__(self, plans: Mapping[str, Plan], targets: Mapping[str, ServiceTarget | Mapping[str, Any]] | None = None) -> None:
        if not plans:
            raise StaronnxError("a runtime needs at least one model")
        targets = dict(targets or {})
        unknown = sorted(set(targets) - set(plans))
        if unknown:
            raise StaronnxError(f"service target(s) for unknown model(s) {', '.join(map(repr, unknown))}; "
                                f"the models are {', '.join(map(repr, plans))}")
        self.models: list[HostedModel] = []
        first = 0
        for i, (name, plan) in enumerate(plans.items()):
            if not isinstance(name, str) or not name:
                raise StaronnxError(f"model names must be non-empty strings, got {name!r}")
            self.models.append(HostedModel(name, plan, i, first, ServiceTarget.of(targets.get(name))))
            first += plan.k
        self.by_name = {m.name: m for m in self.models}
        #: global part -> (its model, its own index in that model's plan)
        self.owner: list[tuple[HostedModel, int]] = [(m, p) for m in self.models for p in range(m.plan.k)]
        #: global part -> the tensors it reads (names are the model's own)
        self.part_inputs: list[list[str]] = [list(m.plan.parts[p].inputs) for m, p in self.owner]
        self.preds = [sorted(m.first_part + d for d in deps) for m in self.models for deps in m.plan.dependencies()]
        self.succs: list[list[int]] = [[] for _ in self.owner]
        for p, preds in enumerate(self.preds):
            for d in preds:
                self.succs[d].append(p)

    @classmethod
    def of(cls, plan: Plan | ModelSet) -> ModelSet:
        """``plan`` itself, or a set of that one plan (named after its folder)."""
        if isinstance(plan, ModelSet):
            return plan
        return cls({plan_name(plan): plan})

    @property
    def single(self) -> bool:
        """One model: part labels and statistics read as they always did."""
        return len(self.models) == 1

    @property
    def k(self) -> int:
        """Parts of every model together (what a worker holds a session for)."""
        return len(self.owner)

    def part_path(self, part: int) -> Path:
        model, local = self.owner[part]
        return model.plan.part_path(local)

    def label(self, part: int) -> str:
        """``part<p>`` for a single model, ``<model>/part<p>`` otherwise (stats, traces)."""
        model, local = self.owner[part]
        return f"part{local}" if self.single else f"{model.name}/part{local}"

    def model(self, name: str | None) -> HostedModel:
        """The model ``name``; None names the only one."""
        if name is None:
            if self.single:
                return self.models[0]
            raise StaronnxError(f"this runtime serves several models ({', '.join(self.by_name)}): "
                                "say which with model=")
        try:
            return self.by_name[name]
        except KeyError:
            raise StaronnxError(f"no model {name!r} in this runtime; it serves {', '.join(self.by_name)}") from None

    def devices(self) -> dict[int, str]:
        """Global part -> the device its plan's placement method chose (policy ``static``)."""
        return {m.first_part + p.index: p.device for m in self.models for p in m.plan.parts if p.device}


def name_gaps(given: Iterable[str], names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the names ``given`` that are no model of ``names``, sorted; the models ``given`` leaves
    out, in ``names``' order): what a per-model option must be checked for, each door wording
    its own refusal."""
    given = set(given)
    return sorted(given - set(names)), [n for n in names if n not in given]


def plan_name(plan: Plan) -> str:
    """A plan's default model name: its folder's name (``model`` when it has none)."""
    return Path(plan.root).name or "model"


def load_plans(plans: Plan | str | os.PathLike[str] | Mapping[str, Plan | str | os.PathLike[str]]) -> tuple[dict[str, Plan], bool]:
    """``{name: Plan}`` from a plan, a folder, or a mapping of either; and whether one plan was
    given as such (not as a mapping), which keeps a runtime's single-plan face."""
    if isinstance(plans, Mapping):
        return {str(n): p if isinstance(p, Plan) else Plan.load(p) for n, p in plans.items()}, False
    plan = plans if isinstance(plans, Plan) else Plan.load(plans)
    return {plan_name(plan): plan}, True


def parse_targets(specs: Sequence[str], field: str = "latency_ms") -> dict[str, dict[str, Any]]:
    """``["a=50", "b=20"]`` (a CLI's ``--slo-ms a=50``) as ``{"a": {field: 50.0}, ...}``."""
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        for item in (s for s in spec.split(",") if s.strip()):
            name, sep, value = item.partition("=")
            if not sep or not name.strip():
                raise StaronnxError(f"expected name=value, got {item!r}")
            try:
                number = float(value)
            except ValueError:
                raise StaronnxError(f"{item!r}: {value!r} is not a number") from None
            if field in ("priority", "capacity"):
                if not number.is_integer():  # 1.5 silently became 1: say so instead
                    raise StaronnxError(f"{item!r}: a {field} is a whole number, got {value.strip()!r}")
                number = int(number)
            out.setdefault(name.strip(), {})[field] = number
    return out
