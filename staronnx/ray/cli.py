"""``staronnx serve --ray``: the plans on Ray Serve, in the foreground, until SIGTERM or Ctrl-C.

Every plan is hosted by one deployment whose replicas each run all of them on one shared
runtime, each model with its own queue and target (``--separate-runtimes``: one deployment
per model). Like ``serve run``: connects to the cluster ``$RAY_ADDRESS`` names (``auto`` for the one
started on this machine with ``ray start``), else starts a local one; deploys the application
(:mod:`staronnx.ray.app`); prints where it listens and ``ready``; on SIGTERM/SIGINT deletes
the application (Serve drains each replica: accepted requests finish) and exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Mapping, Union

from staronnx.errors import StaronnxError
from staronnx.serve.batching import target_words
from staronnx.ray.spec import (APP_NAME, ModelSpec, ReplicaSpec, Scaling, forwarded_env, group_models,
                               parse_autoscale)


#: what ``signal.signal`` takes and returns: a handler, SIG_DFL/SIG_IGN, or None (one not set from Python)
_Handler = Union[Callable[[int, FrameType | None], Any], int, signal.Handlers, None]


def scaling_from_options(replicas: int | None, autoscale: str | None, replica_cpus: float | None,
                         replica_gpus: float | None, cuda_streams: int) -> Scaling:
    """The CLI's ``--replicas/--autoscale/--replica-cpus/--replica-gpus`` as a :class:`Scaling`.

    By default a replica asks for this machine's CPUs and, with ``--cuda-streams``, one GPU
    (a runtime drives its first visible GPU; Ray makes it the replica's own): on a cluster of
    machines like this one, that is one replica per machine.
    """
    if replicas is not None and autoscale is not None:
        raise StaronnxError("give either --replicas N or --autoscale MIN:MAX, not both")
    bounds = parse_autoscale(autoscale) if autoscale is not None else None
    cpus = float(len(os.sched_getaffinity(0)) if replica_cpus is None else replica_cpus)  # this process's CPUs
    gpus = (1.0 if cuda_streams > 0 else 0.0) if replica_gpus is None else float(replica_gpus)
    return Scaling(replicas=1 if replicas is None else replicas, autoscale=bounds, replica_cpus=cpus, replica_gpus=gpus)


def capacity_problem(scaling: Scaling, deployments: int, resources: Mapping[str, float]) -> str | None:
    """Why the cluster (``ray.cluster_resources()``) cannot hold the replicas of
    ``deployments`` deployments asked for at start (one shared by every model, or one per
    model), or None. Serve would otherwise wait for them without end and without a word."""
    first = scaling.replicas if scaling.autoscale is None else max(scaling.autoscale[0], 1)
    count = first * deployments
    for key, option, each in (("CPU", "--replica-cpus", scaling.replica_cpus),
                              ("GPU", "--replica-gpus", scaling.replica_gpus)):
        have = float(resources.get(key, 0.0))
        if each > 0 and count * each > have + 1e-9:
            return (f"{count} replica(s) of {each:g} {key}(s) each need {count * each:g} {key}s, and the Ray "
                    f"cluster has {have:g}: lower {option} or the replicas")
    return None


def model_specs(plans: list[Path], names: list[str], settings: Mapping[str, Any], *,
                capacities: Mapping[str, int], targets: Mapping[str, Mapping[str, Any]],
                residency: Mapping[str, str] | None = None,
                lanes: Mapping[str, str] | None = None,
                batching: Mapping[str, Mapping[str, Any]] | None = None) -> list[ModelSpec]:
    """One :class:`ModelSpec` per plan (checked here, before any cluster starts): the settings
    every model shares, its own queue capacity, service target (``latency_ms``, ``priority``)
    the workers that load it (``workers``, ``--model-workers``), its lane (``lane``,
    ``--lane``) and its batching overrides (``batch_axes``, ``batching``: ``--batch-axis``,
    ``--no-batching``, as :func:`staronnx.serve.batching.apply_batching` resolved them)."""
    specs = [ModelSpec(plan=str(Path(p).resolve()), name=n, **settings, queue_capacity=capacities[n],
                       workers=(residency or {}).get(n), lane=(lanes or {}).get(n),
                       **targets.get(n, {}),
                       **dict((batching or {}).get(n, {})))
             for p, n in zip(plans, names)]
    for spec in specs:
        spec.load_plan()  # the plan and its overrides, checked where the user is
    return specs


def describe_deployments(groups: list[ReplicaSpec], scaling: Scaling) -> list[str]:
    """What ``staronnx serve --ray`` announces: each deployment's replicas, and its models."""
    how = (f"autoscaling {scaling.autoscale[0]}..{scaling.autoscale[1]} replicas" if scaling.autoscale
           else f"{scaling.replicas} replica(s)")
    each = f"{how} of {scaling.replica_cpus:g} CPU(s) and {scaling.replica_gpus:g} GPU(s) each"
    lines = []
    for group in groups:
        if group.shared:
            lines.append(f"one runtime per replica for {len(group.models)} models ({group.name}): {each}, "
                         f"policy {group.models[0].policy}, groups {group.models[0].groups}")
        for spec in group.models:
            where = "on the shared replicas" if group.shared else f"{each}, groups {spec.groups}"
            lines.append(f"model {spec.name!r}: plan {spec.plan}, {where}, batches of up to {spec.batch_size}, "
                         f"queue {spec.queue_capacity}" + "".join(f", {w}" for w in target_words(spec.target())))
    return lines


def serve_on_ray(specs: list[ModelSpec], scaling: Scaling, *, separate_runtimes: bool, host: str,
                 http_port: int, max_body: int, say: Callable[[str], None]) -> None:
    """Deploy, announce, wait for SIGTERM/SIGINT, delete the application."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise StaronnxError(f"staronnx serve --ray needs the ray extra ({exc.name} is missing): "
                            "pip install 'staronnx[ray]'") from None
    from staronnx.ray.app import deploy

    groups = group_models(specs, separate_runtimes)  # refused here, before any cluster starts
    own_cluster = not os.environ.get("RAY_ADDRESS")
    stop = threading.Event()
    previous: dict[signal.Signals, _Handler] = {}
    try:
        try:
            # the replicas' and Serve's own logs stay in Ray's log folder on each node
            # (/tmp/ray/session_latest/logs/serve/): streamed here they would bury this
            # command's lines under every retry's traceback
            ray.init(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
        except Exception as exc:  # noqa: BLE001 - no cluster to join or none can start here
            where = f"join the Ray cluster at {os.environ['RAY_ADDRESS']}" if not own_cluster else "start a local Ray cluster"
            first = (str(exc).strip().splitlines() or [""])[0]
            raise StaronnxError(f"could not {where}: {type(exc).__name__}: {first}") from None
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # not Serve's INFO lines among ours
        resources = ray.cluster_resources()  # type: ignore[no-untyped-call]  # (unannotated in Ray)
        problem = capacity_problem(scaling, len(groups), resources)
        if problem and own_cluster:  # nothing will join this machine's own cluster: it would wait forever
            raise StaronnxError(problem)
        if problem:  # a cluster's autoscaler (KubeRay) may add the nodes; Serve waits for them
            say(f"warning: {problem} now; Serve waits until the cluster has them")
        # after ray.init, which installs its own SIGTERM handler (it would end the process at once)
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        url = deploy(specs, scaling, host=host, port=http_port, max_body=max_body, env=forwarded_env(),
                     separate_runtimes=separate_runtimes)
        for line in describe_deployments(groups, scaling):
            say(line)
        say(f"HTTP (KServe v2) on {url} (Ray Serve)")
        say("replica logs: Ray's log folder on each node (/tmp/ray/session_latest/logs/serve/)")
        say("ready (SIGTERM or Ctrl-C drains and stops)")
        while not stop.wait(0.5):
            pass
        say("stopping: deleting the application; replicas finish the requests they accepted")
        serve.delete(APP_NAME)
        if own_cluster:
            serve.shutdown()  # type: ignore[no-untyped-call]  # (unannotated in Ray)
        say("stopped")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if ray.is_initialized():
            ray.shutdown()
