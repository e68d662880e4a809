"""What a Ray deployment of staronnx is made of, as plain data: checked once, on the driver.

:class:`ModelSpec` is one plan served by a replica (everything ``staronnx serve`` takes for a
model); :class:`Scaling` is how many replicas run and what each one asks Ray for. Both are
plain dataclasses so that they travel to replicas by value, and so that the CLI, the Serve
config builder and the tests share one set of checks and one wording of the errors.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from staronnx.errors import StaronnxError

#: the name of the Serve application ``staronnx serve --ray`` deploys
APP_NAME = "staronnx"
#: the ingress deployment's name (the model deployments are ``staronnx-<model>``)
INGRESS_NAME = "staronnx-ingress"


def deployment_name(model: str) -> str:
    """The Serve deployment that serves ``model`` (what a Serve config's ``deployments`` names)."""
    return f"staronnx-{model}"


@dataclass(frozen=True)
class ModelSpec:
    """One plan as a replica serves it: the runtime's and the batcher's settings.

    ``home`` is the ``STARONNX_HOME`` whose perf models the replica reads and merges what it
    learns into (None: the replica's own environment, or ``~/.cache/staronnx``): a folder on a
    network filesystem shared by every machine is safe, since models are kept per host and
    merged under a lock. ``save_every`` is how often (seconds) a replica merges what it learnt,
    so a replica that is killed loses at most that much; 0 merges only at shutdown.
    ``pin_cpus`` confines each replica on a machine to its own share of the cores (see
    :func:`staronnx.ray.replica.cpu_share`), so two replicas on one machine never share one.
    """

    plan: str
    name: str
    policy: str = "heft"
    groups: str = "numa"
    cuda_streams: int = 0
    engine: str = "native"
    batch_size: int = 8
    max_delay: float = 0.0
    queue_capacity: int = 1024
    calibrate: int | None = None
    home: str | None = None
    save_every: float = 60.0
    pin_cpus: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise StaronnxError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.queue_capacity < 1:
            raise StaronnxError(f"queue_capacity must be at least 1, got {self.queue_capacity}")
        if self.max_delay < 0:
            raise StaronnxError(f"max_delay must be >= 0 seconds, got {self.max_delay}")
        if self.save_every < 0:
            raise StaronnxError(f"save_every must be >= 0 seconds (0 = at shutdown only), got {self.save_every}")
        if not self.name or "/" in self.name:
            raise StaronnxError(f"model name {self.name!r} cannot be used in a URL; choose another")
        from staronnx.workers.groups import policy_reserve

        policy_reserve(self.groups)  # its syntax, here: a replica would fail only after Serve's retries

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise StaronnxError(f"unknown model setting(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(data))


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
    """How many replicas of each model run, and what each asks Ray for.

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

    def deployment_options(self, spec: ModelSpec, env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``Deployment.options(...)`` for ``spec``'s model deployment."""
        max_ongoing = self.max_ongoing or max(32, 4 * spec.batch_size)
        actor: dict[str, Any] = {"num_cpus": self.replica_cpus, "num_gpus": self.replica_gpus}
        if env:
            actor["runtime_env"] = {"env_vars": dict(env)}
        opts: dict[str, Any] = {
            "name": deployment_name(spec.name),
            "ray_actor_options": actor,
            "max_ongoing_requests": max_ongoing,
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
                "target_ongoing_requests": self.target_ongoing or float(2 * spec.batch_size),
            }
        else:
            opts["num_replicas"] = self.replicas
        return opts


#: the environment a replica inherits from the command that deploys it, when set there: where
#: perf models live and how much a replica records (the cluster's own environment otherwise).
#: Not STARONNX_HOSTNAME: models are kept per machine, and each replica must file its own
#: under its own machine's name.
FORWARDED_ENV = ("STARONNX_HOME", "STARONNX_CALIBRATE")


def forwarded_env() -> dict[str, str]:
    return {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
