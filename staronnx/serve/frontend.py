"""What the HTTP and gRPC front ends of ``staronnx serve`` share: the models and the server's
state, and every answer that does not depend on the transport (a model looked up, Triton's
statistics and repository index, a stopping server's refusal, how a request ended), so that
the two protocols answer alike and count alike.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from staronnx.serve.control import ModelControl
from staronnx.serve.limits import Guard, Limits
from staronnx.serve.metrics import VERSION
from staronnx.serve.models import ModelEndpoint
from staronnx.serve.protocol import ProtocolError, shown, unknown_model
from staronnx.serve.shm import SharedMemoryRegions

log = logging.getLogger("staronnx.serve")


class Frontend:
    """The state one front end answers from. ``guard`` holds the limits, the receive budget and
    the counts shared by both front ends (a default one, with
    :class:`~staronnx.serve.limits.Limits`'s defaults, where none is given)."""

    #: the protocol label of this front end's counts (``staronnx_requests_total{protocol}``)
    protocol = ""

    def __init__(self, models: Mapping[str, ModelEndpoint], server_meta: dict[str, Any], max_body: int,
                 is_ready: Callable[[], bool], guard: Guard | None = None, *,
                 unavailable: Mapping[str, str] | None = None, regions: SharedMemoryRegions | None = None,
                 control: ModelControl | None = None) -> None:
        self.models = models
        #: the system shared-memory regions clients registered (one set for both protocols)
        self.regions = regions if regions is not None else SharedMemoryRegions()
        #: a model repository's model control (None: the models served are fixed)
        self.control = control
        #: models asked for that could not be served, and why (each fails alone: the others serve;
        #: the repository index lists them UNAVAILABLE with the reason)
        self.unavailable: Mapping[str, str] = unavailable if unavailable is not None else {}
        self.server_meta = server_meta
        self.is_ready = is_ready
        self.max_body = max_body
        self.guard = guard if guard is not None else Guard.make(Limits().resolved(max_body, 1024), log)
        #: set once the server closes its connections: a call cancelled then was dropped
        self.closing = False

    def model(self, name: str, version: str | None) -> ModelEndpoint:
        """The model served as ``name`` (and ``version``), or Triton's not-found answer."""
        model = self.models.get(name)
        if model is None:
            why = self.unavailable.get(name)
            if why is not None:
                raise ProtocolError("unavailable", f"model {shown(name)} is not available: {why}")
            raise unknown_model(name, list(self.models))
        model.check_version(version)
        others = getattr(model, "others", None)  # the older versions a version_policy serves beside it
        return others[version] if others and version in others else model

    def model_ready(self, name: str, version: str | None) -> bool:
        if name in self.unavailable and name not in self.models:
            return False
        return self.model(name, version).ready and self.is_ready()

    def statistics(self, name: str | None, version: str | None = None) -> dict[str, Any]:
        """Triton's statistics extension: one model's (by name), or every model's (no name)."""
        if name:
            model = self.models.get(name)
            models = ([self.model(name, version)] if version or model is None
                      else [model, *model.others.values()])
        else:
            models = [m for n in sorted(self.models) for m in (self.models[n], *self.models[n].others.values())]
        return {"model_stats": [m.statistics() for m in models]}

    def repository_entries(self, only_ready: bool) -> list[dict[str, str]]:
        if self.control is not None:
            entries = self.control.index(lambda m: m.ready and self.is_ready())
            return [e for e in entries if e["state"] == "READY"] if only_ready else entries
        ready = {n: m.ready and self.is_ready() for n, m in self.models.items()}
        entries = repository_index(ready, "the server is shutting down", only_ready)
        for e in entries:
            e["version"] = self.models[e["name"]].version
        if not only_ready:
            entries += [{"name": n, "version": VERSION, "state": "UNAVAILABLE", "reason": why}
                        for n, why in self.unavailable.items() if n not in self.models]
            entries.sort(key=lambda e: e["name"])
        return entries

    def stopping(self, model: ModelEndpoint) -> ProtocolError:
        """The refusal of a request to a stopping server, counted (as Triton counts it, and here)."""
        model.stats.refused("REJECTED")
        self.guard.refusals.refuse(self.protocol, "shutting_down")
        return shutting_down(model.name)

    def timed_out(self) -> ProtocolError:
        """The answer to a request not answered within ``--request-timeout``, counted."""
        self.guard.refusals.refuse(self.protocol, "request_timeout")
        return ProtocolError("timeout", f"the request was not answered within --request-timeout "
                                        f"({self.guard.limits.request_timeout:g} s); it was withdrawn")

    def ended(self, exc: BaseException | None = None, status: int = 200) -> None:
        """Count how an inference request ended, the one map of outcomes to counts of every
        handler of both doors: answered with the HTTP ``status`` (a 503 is a refusal, another
        error a failure), or ending in ``exc``: a :class:`ProtocolError` refused (503 /
        UNAVAILABLE) or failed, a cancellation by its client (or dropped by a closing server),
        any other exception failed."""
        if exc is None:
            outcome = "answered" if status < 400 else "refused" if status == 503 else "failed"
        elif isinstance(exc, ProtocolError):
            outcome = "refused" if exc.kind == "unavailable" else "failed"
        elif isinstance(exc, asyncio.CancelledError):
            outcome = "dropped" if self.closing else "cancelled"
        else:
            outcome = "failed"
        self.guard.refusals.outcome(self.protocol, outcome)


def shutting_down(model: str | None = None) -> ProtocolError:
    """503 / UNAVAILABLE to a request that reaches a stopping server."""
    whose = f"model {model!r}: " if model is not None else ""
    return ProtocolError("unavailable", f"{whose}the server is shutting down; send the request to another replica")


def repository_index(ready: Mapping[str, bool], why_not: str, only_ready: bool) -> list[dict[str, str]]:
    """Triton's repository index entries of the models ``ready`` says are ready or not (and
    ``why_not``); only the ready ones for ``only_ready``."""
    return [{"name": n, "version": VERSION, "state": "READY" if ready[n] else "UNAVAILABLE",
             "reason": "" if ready[n] else why_not} for n in sorted(ready) if ready[n] or not only_ready]


async def load_or_unload(frontend: Frontend, name: str, action: str, config: str | None = None,
                         files: Mapping[str, Any] | None = None) -> None:
    """A repository request (``load`` or ``unload``) through model control, or refused where the
    served models are fixed."""
    if frontend.control is None:
        raise refused_load(name, action)
    if action == "load":
        await frontend.control.load(name, config, files)
    else:
        await frontend.control.unload(name)


def refused_load(name: str, action: str) -> ProtocolError:
    return ProtocolError("refused", f"cannot {action} model {shown(name)}: staronnx serve serves the plans "
                                    "it was started with for the life of the process (no model control); "
                                    "restart it with the plans to serve")
