"""The Ray Serve replica: one staronnx Runtime over its machine, behind staronnx's own batcher.

A replica is a ``staronnx serve`` without the network: every model it hosts on one shared
runtime (one set of workers, one policy, each model's service target), each behind the same
:class:`~staronnx.serve.models.ModelEndpoint` (request checks, client batches split into
samples, the :class:`~staronnx.serving.server.Server` batcher and its queue), called by the
ingress deployment with decoded tensors and the model's name.

Why not Serve's ``@serve.batch``: it waits for a handler to return before forming the next batch
(or runs a fixed number concurrently), which feeds one model on one device. A staronnx runtime
wants several batches in flight, sized from its perf models (``inflight_window``), so that a
batch's light part runs on a CPU group while the next one's heavy part runs on the GPU, at the
batch sizes its perf models were calibrated at. One batcher also keeps ``staronnx serve`` and
``staronnx serve --ray`` alike, response parameters (``staronnx_batch_id``...) included.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from staronnx.ray.spec import ReplicaSpec
from staronnx.serving.collector import full_collections_every
from staronnx.workers.lanes import short_switch_interval

if TYPE_CHECKING:
    from staronnx.runtime.runtime import ModelHandle, Runtime
    from staronnx.serve.models import ModelEndpoint

log = logging.getLogger("staronnx.ray")


@dataclass
class Reply:
    """What a replica returns to the ingress: outputs and response parameters, or a protocol
    error as (kind, message). Returned, not raised, so the message reaches the client as the
    server wrote it instead of inside a Ray traceback."""

    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    error: tuple[str, str] | None = None
    #: the replica that answered (its Serve id)
    replica: str = ""
    #: the model's counts on that replica after this request (:meth:`ModelStats.snapshot`):
    #: the ingress sums the latest of every replica for Triton's statistics, which no single
    #: replica can give and Serve has no call to gather
    stats: dict[str, Any] | None = None


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


def health_problem(endpoint: ModelEndpoint, runtime: Any = None) -> str | None:
    """Why the replica serving ``endpoint`` cannot answer requests, or None when it can.

    ``runtime`` is the runtime behind it (default: the endpoint's own; a shared runtime for a
    model hosted beside others, whose handle has no workers of its own to check). Only all
    workers dead makes it unhealthy: with some left it keeps serving (the runtime re-places
    the dead ones' tasks), as :meth:`StaronnxReplica.describe` reports."""
    if not endpoint.ready:
        return "the model endpoint is closed"
    if endpoint.server.closed or not endpoint.server.batching:
        return "the batcher has stopped"
    return runtime_problem(endpoint.runtime if runtime is None else runtime)


def runtime_problem(runtime: Runtime | ModelHandle) -> str | None:
    """Why ``runtime`` cannot run tasks (closed, every worker dead, or no state to report), or None."""
    if runtime.closed:
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


class StaronnxReplica:
    """A replica of one deployment (the class :func:`staronnx.ray.app.build_app` deploys): the
    models of its :class:`~staronnx.ray.spec.ReplicaSpec` on one runtime, each behind its own
    :class:`~staronnx.serve.models.ModelEndpoint` (batcher, queue, statistics).

    Every request names its model (``model=``, which the ingress takes from the URL); None
    names the only one of a one-model replica, as calls made before replicas hosted several.
    """

    def __init__(self, spec: Mapping[str, Any]) -> None:
        #: what Serve's shutdown stops (:meth:`__del__`), the last opened first; made before
        #: anything can fail, since __del__ runs after a failed __init__ too
        self._open = contextlib.ExitStack()
        import ray
        from ray import serve

        self.spec = ReplicaSpec.of(spec)
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id
        # a replica's rank on its node came with Ray 2.5x's ReplicaRank: 0 on a Ray without it
        self.local_rank = int(getattr(getattr(ctx, "rank", None), "local_rank", 0) or 0)
        # (Ray leaves get_assigned_resources unannotated)
        assigned = ray.get_runtime_context().get_assigned_resources()  # type: ignore[no-untyped-call]
        cpus = float(assigned.get("CPU", 0.0))
        share = cpu_share(self.local_rank, cpus) if self.spec.runtime_settings()["pin_cpus"] else None
        if share is not None:
            pin_process(share)
        self.cpus = sorted(os.sched_getaffinity(0))
        # the GPUs Ray gave this replica (CUDA_VISIBLE_DEVICES holds just those, renumbered from
        # 0): the CUDA workers drive every one of them, not only the first
        self.gpus = len(ray.get_gpu_ids())
        self.runtime = open_runtime(self.spec, tuple(range(self.gpus)) or (0,))
        self._open.callback(self.runtime.close, 30.0)  # which merges the perf models learnt since the last save
        if self.runtime.machine.lanes:  # a lane preempts its group's workers within 0.5 ms (staronnx serve's rule)
            self._open.enter_context(short_switch_interval())
        try:
            self.endpoints = open_endpoints(self.spec, self.runtime, self.replica)
        except BaseException:
            self._open.close()
            raise
        self._open.callback(self._drain)
        self._ongoing = 0  # requests inside infer() now (one event loop: no lock)
        gc_interval = float(self.spec.runtime_settings()["gc_interval"])
        if gc_interval > 0:  # as staronnx serve: young collections only, a full one this often
            self._open.enter_context(full_collections_every(gc_interval))
        log.info("staronnx replica %s: models %s on one runtime, PUs %s, %d workers", self.replica,
                 ", ".join(f"{m.name!r} (plan {m.plan})" for m in self.spec.models), self.cpus,
                 len(self.runtime.workers))

    def _endpoint(self, model: str | None) -> ModelEndpoint:
        """The endpoint serving ``model`` (None: the only one); an unknown name is a protocol
        error (not found), though the ingress routes only the names this replica hosts."""
        from staronnx.serve.protocol import unknown_model

        if model is None:
            if len(self.endpoints) == 1:
                return next(iter(self.endpoints.values()))
        else:
            endpoint = self.endpoints.get(model)
            if endpoint is not None:
                return endpoint
        raise unknown_model(str(model), list(self.endpoints))

    # -- requests ---------------------------------------------------------------------------------
    async def infer(self, inputs: Mapping[str, np.ndarray], datatypes: Mapping[str, str],
                    outputs: Sequence[str] | None, model: str | None = None,
                    classes: Mapping[str, int] | None = None) -> Reply:
        """One decoded KServe v2 request for ``model`` through its batcher (see the module
        docstring); ``classes``: outputs asked for with Triton's ``classification: k``. A full
        queue of one model refuses that model only. The reply carries the model's counts here."""
        from staronnx.serve.protocol import ProtocolError

        try:
            endpoint = self._endpoint(model)
        except ProtocolError as exc:
            return Reply(error=(exc.kind, str(exc)), replica=self.replica)
        self._ongoing += 1
        try:
            answer = await endpoint.infer(inputs, datatypes, outputs, classes=classes)
        except ProtocolError as exc:
            return Reply(error=(exc.kind, str(exc)), replica=self.replica, stats=endpoint.stats.snapshot())
        finally:
            self._ongoing -= 1
        return Reply(answer.outputs, {**answer.parameters, "staronnx_replica": self.replica}, replica=self.replica,
                     stats=endpoint.stats.snapshot())

    def metadata(self, model: str | None = None) -> dict[str, Any]:
        return self._endpoint(model).metadata()

    def config(self, model: str | None = None) -> dict[str, Any]:
        return self._endpoint(model).config()

    def ready(self, model: str | None = None) -> bool:
        return health_problem(self._endpoint(model), self.runtime) is None

    def describe(self) -> dict[str, Any]:
        """Who this replica is and how it is doing: pid, PUs, models, workers, health, requests
        (done, and ``ongoing``: accepted and not yet answered)."""
        from staronnx.runtime.runtime import driver_threads

        stats = self.runtime.stats()
        return {"replica": self.replica, "pid": os.getpid(), "local_rank": self.local_rank, "pus": self.cpus,
                "gpus": self.gpus, "gc_thresholds": list(gc.get_threshold()),
                "save_every": self.spec.runtime_settings()["save_every"],
                "models": list(self.endpoints), "ongoing": self._ongoing,
                "workers": sorted(stats.get("workers", {})), "dead_workers": stats.get("dead_workers", []),
                # the thread launching each CUDA worker's tasks (--cuda-thread-per-stream: its own)
                "drivers": driver_threads(stats),
                "pad_to": list(self.runtime.preferred_batch_sizes),
                "problem": self.problem(), "requests_done": stats.get("requests_done")}

    # -- health -----------------------------------------------------------------------------------
    def problem(self) -> str | None:
        """The first model that cannot be served and why, or None (the runtime is checked once)."""
        problem = runtime_problem(self.runtime)
        if problem is not None:
            return problem
        for name, endpoint in self.endpoints.items():
            problem = health_problem(endpoint, self.runtime)
            if problem is not None:
                return problem if len(self.endpoints) == 1 else f"model {name!r}: {problem}"
        return None

    def check_health(self) -> None:
        """Serve's health hook: raising marks this replica unhealthy, and Serve replaces it."""
        problem = self.problem()
        if problem is not None:
            raise RuntimeError(f"staronnx replica {self.replica} ({', '.join(self.endpoints)}): {problem}")

    # -- perf models ------------------------------------------------------------------------------
    def perf_models(self) -> dict[str, Any]:
        """This replica's in-memory perf models: ``{"part.arch": {batch: [n, nerror]}}`` (keys
        ``"model/part.arch"`` when it hosts several models), and how many samples wait to be
        merged into the store."""
        predictor = self.runtime.predictor
        out: dict[str, Any] = {"replica": self.replica, "models": {}, "unsaved": 0}
        if predictor is None:
            return out
        archs = sorted({w["arch"] for w in self.runtime.stats().get("workers", {}).values()})
        hosted = self.runtime.models
        for part, (model, local) in enumerate(hosted.owner):
            prefix = "" if hosted.single else f"{model.name}/"
            for arch in archs:
                history = predictor.model(part, arch)
                out["unsaved"] += history.unsaved_count
                entries = {fp.batch: [e.n, e.nerror] for fp, e in history.entries().items()}
                if entries:
                    out["models"][f"{prefix}{local}.{arch}"] = entries
        return out

    def save_perf_models(self) -> None:
        """Merge what this replica learnt into the store (under the store's lock)."""
        self.runtime.save_perf_models()

    # -- shutdown ---------------------------------------------------------------------------------
    def _drain(self) -> None:
        for endpoint in self.endpoints.values():
            if endpoint.ready:
                endpoint.close(30.0)

    def __del__(self) -> None:
        """Serve's graceful shutdown: drain every model's batcher, then close the runtime
        (which merges the perf models learnt since the last save)."""
        self._open.close()


def open_runtime(spec: ReplicaSpec, cuda_devices: Sequence[int] = (0,)) -> Runtime:
    """The runtime of a replica: every model of ``spec`` on one set of workers, each with its
    service target (a one-model spec is a runtime of one); ``cuda_streams`` CUDA workers on each
    of ``cuda_devices`` (the replica's GPUs)."""
    from staronnx.perfmodels import PerfModelStore
    from staronnx.runtime.runtime import Runtime, warmup_sizes
    from staronnx.runtime.spec import RuntimeSpec
    from staronnx.workers.layout import MachineSpec

    settings = spec.runtime_settings()
    streams = settings["cuda_streams"]
    # as `staronnx serve`: each batch size the batchers form warmed up (and captured) before serving
    warm = sorted({s for m in spec.models for s in warmup_sizes(m.batch_size, m.max_delay)}) if streams else ()
    store = PerfModelStore(settings["home"]) if settings["home"] else None
    plans = {m.name: m.load_plan() for m in spec.models}  # each with its batching overrides
    targets = {m.name: m.target() for m in spec.models if m.target()}
    residency = {m.name: m.workers for m in spec.models if m.workers} if spec.shared else {}
    lanes = {m.name: m.lane for m in spec.models if m.lane} if spec.shared else {}
    machine = MachineSpec(settings["groups"], streams, cuda_devices, settings["cuda_graphs"],
                          settings["thread_per_stream"], residency, lanes, settings["lane_preempt"])
    return Runtime(plans, machine, RuntimeSpec(settings["policy"], engine=settings["engine"], store=store,
                                               save_every=float(settings["save_every"]), calibrate=settings["calibrate"],
                                               targets=targets, warmup=tuple(warm)))


def open_endpoints(spec: ReplicaSpec, runtime: Runtime, replica: str) -> dict[str, ModelEndpoint]:
    """One :class:`~staronnx.serve.models.ModelEndpoint` per model of ``spec``, over its handle
    on the shared ``runtime``; what each model's config reports names the replica, whether the
    runtime is shared and the model's target (as ``staronnx serve``'s do)."""
    from staronnx.serve.metrics import ServeMetrics
    from staronnx.serve.models import ENDPOINT_SPEC, ModelEndpoint

    metrics = ServeMetrics()
    endpoints: dict[str, ModelEndpoint] = {}
    try:
        for m in spec.models:
            settings = {"policy": m.policy, "groups": m.groups, "cuda_streams": m.cuda_streams, "engine": m.engine,
                        "replica": replica, "shared_runtime": spec.shared, **m.target()}
            serving = replace(ENDPOINT_SPEC, batch_size=m.batch_size, max_delay=m.max_delay,
                              queue_capacity=m.queue_capacity)
            endpoints[m.name] = ModelEndpoint(m.name, runtime.model(m.name), serving, metrics=metrics,
                                              settings=settings)
    except BaseException:
        for endpoint in endpoints.values():
            endpoint.close(1.0)
        raise
    return endpoints
