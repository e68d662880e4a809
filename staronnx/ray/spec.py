"""What a Ray deployment of staronnx is made of, as plain data: checked once, on the driver.

:class:`ModelSpec` is one plan served by a replica (everything ``staronnx serve`` takes for a
model); :class:`ReplicaSpec` is what one deployment's replicas host: every model on one shared
runtime (the default), or a single model (``--separate-runtimes``); :class:`Scaling` is how many
replicas run and what each one asks Ray for. All are plain dataclasses so that they travel to
replicas by value, and so that the CLI, the Serve config builder and the tests share one set of
checks and one wording of the errors.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Sequence

from staronnx.errors import StaronnxError
from staronnx.runtime.models import ServiceTarget
from staronnx.serve.batching import check_names
from staronnx.serving.spec import ServeSpec

#: the name of the Serve application ``staronnx serve --ray`` deploys
APP_NAME = "staronnx"
#: the ingress deployment's name (a one-model deployment is ``staronnx-<model>``)
INGRESS_NAME = "staronnx-ingress"
#: the deployment whose replicas host several models on one shared runtime
SHARED_NAME = "staronnx-shared"
#: the ModelSpec fields that set up a replica's runtime (and its process), rather than one
#: model's batcher: the models sharing a runtime must agree on them
RUNTIME_FIELDS = ("policy", "groups", "cuda_streams", "cuda_graphs", "thread_per_stream", "engine", "calibrate",
                  "home", "save_every", "pin_cpus", "lane_preempt", "gc_interval")
#: what --separate-runtimes refuses: both order the tasks of models sharing one scheduler
TARGETS_NEED_SHARING = ("latency targets and priorities (--slo-ms, --priority; slo_ms, priority in a Serve config) "
                        "order the tasks of models sharing one runtime; they do not go with --separate-runtimes "
                        "(separate_runtimes)")


def deployment_name(model: str) -> str:
    """The Serve deployment that serves ``model`` alone (what a Serve config's ``deployments``
    names); models sharing a runtime are all served by :data:`SHARED_NAME`."""
    return f"staronnx-{model}"


@dataclass(frozen=True)
class ModelSpec:
    """One plan as a replica serves it: the runtime's and the batcher's settings.

    ``home`` is the ``STARONNX_HOME`` whose perf models the replica reads and merges what it
    learns into (None: the replica's own environment, or ``~/.cache/staronnx``): a folder on a
    network filesystem shared by every machine is safe, since models are kept per host and
    merged under a lock. ``save_every`` is how often (seconds) a replica merges what it learnt,
    so a replica that is killed loses at most that much; 0 merges only at shutdown.
    ``gc_interval``: the replica's cycle collector collects young objects only, and everything
    this often (seconds; 0: Python's own thresholds), as ``staronnx serve --gc-interval`` does.
    ``pin_cpus`` confines each replica on a machine to its own share of the cores (see
    :func:`staronnx.ray.replica.cpu_share`), so two replicas on one machine never share one.
    ``latency_ms`` and ``priority`` are the model's service target on a shared runtime
    (``--slo-ms``, ``--priority``; :class:`~staronnx.runtime.models.ServiceTarget`), and
    ``workers`` the workers of that runtime that load it (``--model-workers``; see
    :mod:`staronnx.workers.residency`), ``lane`` the CPU groups that give it a lane
    (``--lane``; see :mod:`staronnx.workers.lanes`), ``lane_preempt`` how the shared workers of
    a group with a lane yield to it (``--lane-preempt``). ``batch_axes`` (``NAME=AXIS`` items)
    and ``batching`` (False: each request alone) override the plan's batching contract
    (``--batch-axis``, ``--no-batching``; :mod:`staronnx.contract`): each replica applies them
    to the plan it loads, so every replica batches (or not) as the user said.
    """

    plan: str
    name: str
    # the model's own: its batcher, target, workers and batching
    batch_size: int = 8
    max_delay: float = 0.0
    queue_capacity: int = 1024
    latency_ms: float | None = None
    priority: int = 0
    workers: str | None = None  # None: every worker of the runtime
    lane: str | None = None  # None: no lane
    batch_axes: tuple[str, ...] = ()  # empty: the plan's
    batching: bool = True
    # the replica's runtime's (:data:`RUNTIME_FIELDS`), which models sharing it must agree on
    policy: str = "heft"
    groups: str = "numa"
    cuda_streams: int = 0
    #: with cuda_streams: capture CUDA graphs of the batch sizes served, warmed up as the replica
    #: starts (``--no-cuda-graphs``: off), and a driver thread per stream (``--cuda-thread-per-stream``)
    cuda_graphs: bool = True
    thread_per_stream: bool = False
    engine: str = "native"
    calibrate: int | None = None
    pin_cpus: bool = True
    home: str | None = None
    save_every: float = 60.0
    gc_interval: float = 30.0
    lane_preempt: str = "idle"

    def __post_init__(self) -> None:
        """Refuses here, on the driver, what a replica would refuse only after Serve's retries."""
        from staronnx.contract import parse_batch_axes
        from staronnx.workers.groups import GroupError, policy_reserve
        from staronnx.workers.layout import NO_CPU, MachineSpec

        items = (self.batch_axes,) if isinstance(self.batch_axes, str) else self.batch_axes
        object.__setattr__(self, "batch_axes", tuple(str(i) for i in items))  # a config's list travels as a tuple
        parse_batch_axes(self.batch_axes)
        if not isinstance(self.batching, bool):
            raise StaronnxError(f"batching is true or false, got {self.batching!r}")
        self.serve_spec()  # the batcher's checks
        if self.save_every < 0:
            raise StaronnxError(f"save_every must be >= 0 seconds (0 = at shutdown only), got {self.save_every}")
        if self.gc_interval < 0:
            raise StaronnxError(f"gc_interval must be >= 0 seconds (0 = Python's own thresholds), got {self.gc_interval}")
        check_names([self.name])
        MachineSpec(self.groups, self.cuda_streams, lane_preempt=self.lane_preempt)  # the runtime's checks
        if self.groups.strip().lower() == NO_CPU:  # the GPU alone (launch's own word for it)
            if not self.cuda_streams:
                raise GroupError("CPU groups 'none' leaves no worker at all: add CUDA streams (--cuda-streams N)")
        else:
            policy_reserve(self.groups)  # the groups' syntax (the replica's machine lays them out)
        try:
            ServiceTarget.of(self.target())
        except StaronnxError as exc:
            raise StaronnxError(f"model {self.name!r}: {exc}") from None

    def target(self) -> dict[str, Any]:
        """The model's service target as ServiceTarget fields (empty: none)."""
        out: dict[str, Any] = {}
        if self.latency_ms is not None:
            out["latency_ms"] = self.latency_ms
        if self.priority:
            out["priority"] = self.priority
        return out

    def serve_spec(self) -> ServeSpec:
        """How a replica batches this model's requests."""
        return ServeSpec(self.batch_size, max_delay=self.max_delay, queue_capacity=self.queue_capacity)

    def load_plan(self) -> Any:
        """The plan, with the batching overrides of this spec applied (what a replica serves)."""
        from staronnx.plan import Plan

        plan = Plan.load(self.plan)
        if self.batch_axes or not self.batching:
            plan.set_batching(list(self.batch_axes), batching=self.batching)
        return plan

    def runtime_settings(self) -> dict[str, Any]:
        """The fields a replica's runtime is built from (:data:`RUNTIME_FIELDS`)."""
        return {f: v for f, v in asdict(self).items() if f in RUNTIME_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise StaronnxError(f"unknown model setting(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(data))


@dataclass(frozen=True)
class ReplicaSpec:
    """The models one deployment's replicas host, all on one shared runtime.

    Why share: StarPU's way, and ``staronnx serve``'s. Replicas of one model each beside
    replicas of another would pin their CPU groups to the same cores and open their own
    streams on the same GPU, with schedulers blind to each other; one runtime per replica runs
    every model's parts under one policy, ordering their tasks by each model's target, while
    each model keeps its own batcher and queue (a full one refuses that model only). A spec of
    one model is what ``--separate-runtimes`` deploys per model (and what a single plan is).
    """

    models: tuple[ModelSpec, ...]

    def __post_init__(self) -> None:
        refuse_duplicates(self.models)
        first = self.models[0]
        for field_name in RUNTIME_FIELDS:
            values = {repr(m.runtime_settings()[field_name]) for m in self.models}
            if len(values) > 1:
                raise StaronnxError(
                    f"models sharing a runtime share its {field_name!r}, but they give {', '.join(sorted(values))}; "
                    "give one value for all, or serve them with separate runtimes")
        placed = [f"{field_name}={getattr(first, field_name)!r}" for field_name in ("workers", "lane")
                  if getattr(first, field_name)]
        if len(self.models) == 1 and placed:
            # open_runtime applies them to a shared runtime only: alone, they were dropped unsaid
            raise StaronnxError(
                f"model {first.name!r}: {' and '.join(placed)} place a model on the workers of a runtime it shares "
                "with other models (--model-workers, --lane); a replica hosting it alone has none: leave them out, "
                "or serve it beside other models without separate runtimes")
        if len(self.models) > 1 and first.engine != "native":
            raise StaronnxError(f"the {first.engine} engine serves one plan; several models share a runtime on the "
                                "native engine (or serve them with separate runtimes)")

    @property
    def name(self) -> str:
        """Its Serve deployment: named after its model when it hosts one, else :data:`SHARED_NAME`."""
        return deployment_name(self.models[0].name) if len(self.models) == 1 else SHARED_NAME

    @property
    def shared(self) -> bool:
        """Whether its replicas host several models on one runtime."""
        return len(self.models) > 1

    @property
    def batch_size(self) -> int:
        """Samples one round of batches takes, one of each model (what sizes Serve's limits)."""
        return sum(m.batch_size for m in self.models)

    @property
    def queue_capacity(self) -> int:
        """Samples its models' queues hold together."""
        return sum(m.queue_capacity for m in self.models)

    def runtime_settings(self) -> dict[str, Any]:
        """The runtime's settings, which every model agrees on (checked above)."""
        return self.models[0].runtime_settings()

    def to_dict(self) -> dict[str, Any]:
        return {"models": [m.to_dict() for m in self.models]}

    @classmethod
    def of(cls, spec: ReplicaSpec | ModelSpec | Mapping[str, Any]) -> ReplicaSpec:
        """A spec from itself, a :class:`ModelSpec`, or a dict of either (a replica is bound to
        a dict): ``{"models": [...]}``, or one ModelSpec's dict as replicas took before models
        could share one."""
        if isinstance(spec, ReplicaSpec):
            return spec
        if isinstance(spec, ModelSpec):
            return cls((spec,))
        data = dict(spec)
        if set(data) == {"models"}:
            return cls(tuple(m if isinstance(m, ModelSpec) else ModelSpec.from_dict(m) for m in data["models"]))
        return cls((ModelSpec.from_dict(data),))


def group_models(specs: Sequence[ModelSpec], separate_runtimes: bool = False) -> list[ReplicaSpec]:
    """The deployments that serve ``specs``: one hosting them all on a shared runtime, or
    (``separate_runtimes``) one per model. Targets need the shared form: refused otherwise."""
    refuse_duplicates(specs)
    if not separate_runtimes:
        return [ReplicaSpec(tuple(specs))]
    if any(s.target() for s in specs):
        raise StaronnxError(TARGETS_NEED_SHARING)
    return [ReplicaSpec((s,)) for s in specs]


def refuse_duplicates(specs: Sequence[ModelSpec]) -> None:
    """No plan to serve, or two served under one name (one URL): refused, saying how to fix it."""
    if not specs:
        raise StaronnxError("no plan to serve")
    check_names([s.name for s in specs])


_AUTOSCALE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_autoscale(text: str) -> tuple[int, int]:
    """``MIN:MAX`` replicas (``1:4``); MIN may be 0 (scale to zero), MAX >= max(MIN, 1)."""
    m = _AUTOSCALE.match(text)
    if not m:
        raise StaronnxError(f"--autoscale takes MIN:MAX replicas such as 1:4, got {text!r}")
    lo, hi = int(m.group(1)), int(m.group(2))
    if hi < 1 or hi < lo:
        raise StaronnxError(f"--autoscale {text}: MAX must be at least 1 and at least MIN")
    return lo, hi


@dataclass(frozen=True)
class Scaling:
    """How many replicas of each deployment run (the shared one, or each model's with
    ``--separate-runtimes``), and what each asks Ray for.

    ``replica_cpus``/``replica_gpus`` are a replica's ``ray_actor_options``: ask for a whole
    machine's cores and GPUs, and Ray places one replica per machine (two replicas never share
    one's resources); ask for less, and several share a machine, each pinned to its own cores.
    ``target_ongoing`` is the autoscaler's goal per replica: enough requests in flight to fill
    batches of ``batch_size`` on every worker, hence a multiple of it.
    """

    replicas: int = 1
    autoscale: tuple[int, int] | None = None
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    max_ongoing: int | None = None
    target_ongoing: float | None = None
    ingress_replicas: int = 1

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise StaronnxError(f"--replicas must be at least 1, got {self.replicas}")
        if self.replica_cpus < 0 or self.replica_gpus < 0:
            raise StaronnxError("--replica-cpus and --replica-gpus must be >= 0")
        if self.ingress_replicas < 1:
            raise StaronnxError(f"ingress_replicas must be at least 1, got {self.ingress_replicas}")

    def deployment_options(self, spec: ReplicaSpec | ModelSpec, env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``Deployment.options(...)`` for the deployment serving ``spec``.

        A replica of one model takes ``max_ongoing`` requests (a few batches' worth) and Serve
        queues the rest in front of the replicas, up to the model's queue capacity. A replica
        hosting several models takes every request its models' own queues may hold: were Serve
        to stop routing at a lower count, one flooded model would fill that count and its
        neighbours' requests would wait (or be refused) behind it, while the replica's
        per-model queues refuse the flooded model alone (503 for it only).
        """
        spec = ReplicaSpec.of(spec)
        batches = sum(max(32, 4 * m.batch_size) for m in spec.models)
        default_ongoing = batches if not spec.shared else batches + spec.queue_capacity
        actor: dict[str, Any] = {"num_cpus": self.replica_cpus, "num_gpus": self.replica_gpus}
        if env:
            actor["runtime_env"] = {"env_vars": dict(env)}
        opts: dict[str, Any] = {
            "name": spec.name,
            "ray_actor_options": actor,
            "max_ongoing_requests": self.max_ongoing or default_ongoing,
            # requests waiting for a replica beyond this are refused (503), like a full queue
            "max_queued_requests": spec.queue_capacity,
            "health_check_period_s": 5.0,
            "health_check_timeout_s": 30.0,
            "graceful_shutdown_timeout_s": 30.0,
        }
        if self.autoscale is not None:
            lo, hi = self.autoscale
            opts["autoscaling_config"] = {
                "min_replicas": lo, "max_replicas": hi, "initial_replicas": max(lo, 1),
                # about two batches of each model in flight per replica
                "target_ongoing_requests": self.target_ongoing or float(2 * spec.batch_size),
            }
        else:
            opts["num_replicas"] = self.replicas
        return opts


#: the environment a replica inherits from the command that deploys it, when set there: where
#: perf models live and how much a replica records (the cluster's own environment otherwise).
#: Not STARONNX_HOSTNAME: models are kept per machine, and each replica must file its own
#: under its own machine's name.
FORWARDED_ENV = ("STARONNX_HOME", "STARONNX_CALIBRATE", "STARONNX_CUDA_RUNTIME")


def forwarded_env() -> dict[str, str]:
    return {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
