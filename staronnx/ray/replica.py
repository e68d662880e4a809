"""The Ray Serve replica: one staronnx Runtime over its machine, behind staronnx's own batcher.

A replica is a ``staronnx serve`` model without the network: the same
:class:`~staronnx.serve.models.ModelEndpoint` (request checks, client batches split into
samples, the :class:`~staronnx.serving.server.Server` batcher, the runtime), called by the
ingress deployment with decoded tensors.

Why not Serve's ``@serve.batch``: it waits for a handler to return before forming the next batch
(or runs a fixed number concurrently), which feeds one model on one device. A staronnx runtime
wants several batches in flight, sized from its perf models (``inflight_window``), so that a
batch's light part runs on a CPU group while the next one's heavy part runs on the GPU, at the
batch sizes its perf models were calibrated at. One batcher also keeps ``staronnx serve`` and
``staronnx serve --ray`` alike, response parameters (``staronnx_batch_id``...) included.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from staronnx.ray.spec import ModelSpec

log = logging.getLogger("staronnx.ray")


@dataclass
class Reply:
    """What a replica returns to the ingress: outputs and response parameters, or a protocol
    error as (kind, message). Returned, not raised, so the message reaches the client as the
    server wrote it instead of inside a Ray traceback."""

    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    error: tuple[str, str] | None = None


def cpu_share(local_rank: int, cpus: float, allowed: Sequence[int] | None = None) -> list[int] | None:
    """The PUs replica number ``local_rank`` on this machine owns when each asks for ``cpus``.

    Ray counts CPUs but does not pin anything: two replicas given one CPU each would both run
    their workers on every core. Giving replica r the PUs ``[r*c, (r+1)*c)`` of the machine's
    allowed ones (c = ``cpus`` rounded down) makes Ray's accounting true. None when there is no
    whole share to give (less than one CPU asked, or more replicas than cores): the replica
    then keeps the cores it was started with.
    """
    allowed = sorted(os.sched_getaffinity(0)) if allowed is None else sorted(allowed)
    share = int(cpus)
    if share < 1 or local_rank < 0:
        return None
    start = local_rank * share
    if start + share > len(allowed):
        return None
    return allowed[start:start + share]


def pin_process(pus: Sequence[int]) -> None:
    """Confine every thread of this process, and those it starts later, to ``pus``.

    ``os.sched_setaffinity(0, ...)`` moves only the calling thread; the replica's constructor
    may not run on the main thread, and staronnx's topology reads the process's (main thread's)
    affinity to decide which PUs its groups may use, so every thread is moved (``taskset -a``).
    """
    target = set(pus)
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [str(os.getpid())]
    for tid in tasks:
        try:
            os.sched_setaffinity(int(tid), target)
        except (ProcessLookupError, PermissionError, OSError):  # a thread that just ended
            pass


def health_problem(endpoint: Any) -> str | None:
    """Why the replica serving ``endpoint`` cannot answer requests, or None when it can.

    Only all workers dead makes it unhealthy: with some left it keeps serving (the runtime
    re-places the dead ones' tasks), as :meth:`StaronnxReplica.describe` reports."""
    if not getattr(endpoint, "ready", False):
        return "the model endpoint is closed"
    server = endpoint.server
    thread = getattr(server, "_thread", None)
    if server.closed or (thread is not None and not thread.is_alive()):
        return "the batcher has stopped"
    runtime = endpoint.runtime
    if getattr(runtime, "_closed", False):
        return "the runtime is closed"
    try:
        stats = runtime.stats()
    except Exception as exc:  # noqa: BLE001 - a runtime that cannot report is not healthy
        return f"the runtime cannot report its state: {type(exc).__name__}: {exc}"
    workers = stats.get("workers") or {}
    if workers and not any(w.get("alive", True) for w in workers.values()):
        dead = "; ".join(f"{n}: {e}" for n, e in stats.get("dead_workers", [])) or "no detail"
        return f"every worker died ({dead})"
    return None


def _predictor(runtime: Any) -> Any:
    """The native engine's perf-model predictor (None for the starpu engine, whose StarPU
    keeps its own models)."""
    return getattr(getattr(runtime, "_engine", None), "predictor", None)


class StaronnxReplica:
    """One model's replica (the class :func:`staronnx.ray.app.build_app` deploys)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        import ray
        from ray import serve

        from staronnx.perfmodels import PerfModelStore
        from staronnx.plan import Plan
        from staronnx.runtime.runtime import Runtime
        from staronnx.serve.metrics import ServeMetrics
        from staronnx.serve.models import RECORDS_KEPT, ModelEndpoint

        self.spec = ModelSpec.from_dict(spec)
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id
        self.local_rank = int(getattr(getattr(ctx, "rank", None), "local_rank", 0) or 0)
        cpus = float(ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0))
        share = cpu_share(self.local_rank, cpus) if self.spec.pin_cpus else None
        if share is not None:
            pin_process(share)
        self.cpus = sorted(os.sched_getaffinity(0))
        plan = Plan.load(self.spec.plan)
        store = PerfModelStore(self.spec.home) if self.spec.home else None
        runtime = Runtime(plan, policy=self.spec.policy, cpu_groups=self.spec.groups,
                          cuda_streams=self.spec.cuda_streams, engine=self.spec.engine, store=store,
                          calibrate=self.spec.calibrate)
        try:
            self.endpoint = ModelEndpoint(
                self.spec.name, runtime, batch_size=self.spec.batch_size, max_delay=self.spec.max_delay,
                queue_capacity=self.spec.queue_capacity, metrics=ServeMetrics(), keep_records=RECORDS_KEPT,
                settings={"policy": self.spec.policy, "groups": self.spec.groups,
                          "cuda_streams": self.spec.cuda_streams, "engine": self.spec.engine,
                          "replica": self.replica})
        except BaseException:
            runtime.close(1.0)
            raise
        self._ongoing = 0  # requests inside infer() now (one event loop: no lock)
        self._stop = threading.Event()
        self._saver: threading.Thread | None = None
        if self.spec.save_every > 0 and _predictor(runtime) is not None:
            self._saver = threading.Thread(target=self._save_loop, name="staronnx-perfmodel-saver", daemon=True)
            self._saver.start()
        log.info("staronnx replica %s: model %r, plan %s, PUs %s, %d workers", self.replica, self.spec.name,
                 plan.root, self.cpus, len(runtime.workers))

    # -- requests ---------------------------------------------------------------------------------
    async def infer(self, inputs: Mapping[str, np.ndarray], datatypes: Mapping[str, str],
                    outputs: Sequence[str] | None) -> Reply:
        """One decoded KServe v2 request through the batcher (see the module docstring)."""
        from staronnx.serve.protocol import ProtocolError

        self._ongoing += 1
        try:
            answer = await self.endpoint.infer(inputs, datatypes, outputs)
        except ProtocolError as exc:
            return Reply(error=(exc.kind, str(exc)))
        finally:
            self._ongoing -= 1
        return Reply(answer.outputs, {**answer.parameters, "staronnx_replica": self.replica})

    def metadata(self) -> dict[str, Any]:
        return self.endpoint.metadata()

    def config(self) -> dict[str, Any]:
        return self.endpoint.config()

    def ready(self) -> bool:
        return health_problem(self.endpoint) is None

    def describe(self) -> dict[str, Any]:
        """Who this replica is and how it is doing: pid, PUs, workers, health, requests (done,
        and ``ongoing``: accepted and not yet answered)."""
        stats = self.endpoint.runtime.stats()
        return {"replica": self.replica, "pid": os.getpid(), "local_rank": self.local_rank, "pus": self.cpus,
                "ongoing": self._ongoing,
                "workers": sorted(stats.get("workers", {})), "dead_workers": stats.get("dead_workers", []),
                "problem": health_problem(self.endpoint), "requests_done": stats.get("requests_done")}

    # -- health -----------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Serve's health hook: raising marks this replica unhealthy, and Serve replaces it."""
        problem = health_problem(self.endpoint)
        if problem is not None:
            raise RuntimeError(f"staronnx replica {self.replica} ({self.spec.name}): {problem}")

    # -- perf models ------------------------------------------------------------------------------
    def perf_models(self) -> dict[str, Any]:
        """This replica's in-memory perf models: ``{"part.arch": {batch: [n, nerror]}}``, and
        how many samples wait to be merged into the store."""
        predictor = _predictor(self.endpoint.runtime)
        out: dict[str, Any] = {"replica": self.replica, "models": {}, "unsaved": 0}
        if predictor is None:
            return out
        archs = sorted({w["arch"] for w in self.endpoint.runtime.stats().get("workers", {}).values()})
        for part in range(self.endpoint.plan.k):
            for arch in archs:
                model = predictor.model(part, arch)
                out["unsaved"] += model.unsaved_count
                entries = {fp.batch: [e.n, e.nerror] for fp, e in model.entries().items()}
                if entries:
                    out["models"][f"{part}.{arch}"] = entries
        return out

    def save_perf_models(self) -> None:
        """Merge what this replica learnt into the store (under the store's lock)."""
        predictor = _predictor(self.endpoint.runtime)
        if predictor is not None:
            predictor.save()

    def _save_loop(self) -> None:
        while not self._stop.wait(self.spec.save_every):
            try:
                self.save_perf_models()
            except Exception:  # noqa: BLE001 - the next round (or shutdown) tries again
                log.exception("staronnx replica %s: merging perf models failed", self.replica)

    # -- shutdown ---------------------------------------------------------------------------------
    def __del__(self) -> None:
        """Serve's graceful shutdown: drain the batcher, close the runtime (which merges the
        perf models learnt since the last save)."""
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        endpoint = getattr(self, "endpoint", None)
        if endpoint is not None and endpoint.ready:
            endpoint.close(30.0)
