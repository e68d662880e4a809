"""StarPU's scheduling policies, in pure Python, behind :class:`staronnx.runtime.sched.Policy`.

Built by StarPU name with :func:`make_policy`: ``eager`` (one central FIFO), ``random`` (worker
drawn with probability ∝ speedup), ``ws``/``lws`` (work stealing), the dm family in ``dmda.py``
(``dm`` < ``dmda``, + transfer times < ``dmdar``, + ready tasks popped first < ``dmdas``, +
priority-sorted queues, StarPU's recommended policy), ``heft`` (dmdas + upward-rank priorities;
StarPU itself maps "heft" to dmda) and ``static`` (each part on the worker its plan's placement
method chose).

Policies never import ONNX Runtime and read time only through their clock, so the simulator
drives the very same objects as the native engine.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from staronnx.runtime.policies._common import PolicyError
from staronnx.runtime.policies.dmda import DmdaPolicy, DmdarPolicy, DmdasPolicy, DmPolicy
from staronnx.runtime.policies.eager import EagerPolicy
from staronnx.runtime.policies.heft import HeftPolicy, upward_ranks
from staronnx.runtime.policies.random import RandomPolicy
from staronnx.runtime.policies.static import StaticPolicy
from staronnx.runtime.policies.ws import LocalityWorkStealingPolicy, WorkStealingPolicy
from staronnx.runtime.sched import Policy

_REGISTRY: dict[str, Callable[..., Policy]] = {
    "eager": EagerPolicy,
    "random": RandomPolicy,
    "ws": WorkStealingPolicy,
    "lws": LocalityWorkStealingPolicy,
    "dm": DmPolicy,
    "dmda": DmdaPolicy,
    "dmdar": DmdarPolicy,
    "dmdas": DmdasPolicy,
    "heft": HeftPolicy,
    "static": StaticPolicy,
}

#: the dynamic (StarPU) policies; make_policy() also accepts "static", which needs the plan's
#: per-part devices (Runtime fills them in)
POLICIES: tuple[str, ...] = tuple(n for n in _REGISTRY if n != "static")


def policy_options(name: str) -> tuple[str, ...]:
    """The keyword options policy ``name`` accepts (e.g. alpha, beta for the dmda family)."""
    factory = _lookup(name)
    params = inspect.signature(factory).parameters.values()
    return tuple(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


def make_policy(name: str, **options: Any) -> Policy:
    """A fresh policy object by StarPU name; raises PolicyError for unknown names or options."""
    factory = _lookup(name)
    valid = policy_options(name)
    bad = sorted(set(options) - set(valid))
    if bad:
        takes = f"accepts {', '.join(valid)}" if valid else "takes no options"
        raise PolicyError(f"unknown option(s) {', '.join(bad)} for policy {name!r}; it {takes}")
    return factory(**options)


def _lookup(name: str) -> Callable[..., Policy]:
    factory = _REGISTRY.get(name.lower()) if isinstance(name, str) else None
    if factory is None:
        raise PolicyError(f"unknown scheduling policy {name!r}; choose one of {', '.join(POLICIES)}")
    return factory


__all__ = ["POLICIES", "DmPolicy", "DmdaPolicy", "DmdarPolicy", "DmdasPolicy", "EagerPolicy", "HeftPolicy",
           "LocalityWorkStealingPolicy", "PolicyError", "RandomPolicy", "StaticPolicy", "WorkStealingPolicy",
           "make_policy", "policy_options", "upward_ranks"]
