"""The Serve application: one ingress in front of one deployment per plan.

    app = build_app([ModelSpec(plan="plan/", name="googlenet", groups="cores=1")],
                    Scaling(replicas=2, replica_cpus=1))
    serve.run(app, name="staronnx", route_prefix="/")

:func:`build` is the same for Serve config files (``import_path: staronnx.ray.app:build``, its
``args`` as in ``deploy/serve-config.yaml``), and :func:`deploy` is what
``staronnx serve --ray`` does.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any, Mapping, Sequence

from staronnx.errors import StaronnxError
from staronnx.ray.spec import APP_NAME, INGRESS_NAME, ModelSpec, Scaling, parse_autoscale

#: the Serve config ``args`` :func:`build` takes besides the model settings
_SCALING_ARGS = {"replicas", "autoscale", "replica_cpus", "replica_gpus", "max_ongoing", "target_ongoing",
                 "ingress_replicas"}
_MODEL_ARGS = {"policy", "groups", "cuda_streams", "engine", "batch_size", "max_delay", "queue_capacity",
               "calibrate", "home", "save_every", "pin_cpus"}


def build_app(specs: Sequence[ModelSpec], scaling: Scaling | None = None, *, max_body: int = 64 * 2**20,
              env: Mapping[str, str] | None = None) -> Any:
    """The ingress bound to one model deployment per spec (a ``ray.serve`` Application)."""
    from ray import serve

    from staronnx.ray.ingress import KServeIngress
    from staronnx.ray.replica import StaronnxReplica

    if not specs:
        raise StaronnxError("no plan to serve")
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise StaronnxError(f"two plans would be served as {dupes[0]!r}; tell them apart with --name")
    scaling = scaling or Scaling()
    handles = {spec.name: serve.deployment(StaronnxReplica).options(**scaling.deployment_options(spec, env))
               .bind(spec.to_dict()) for spec in specs}
    ingress = serve.deployment(KServeIngress).options(
        name=INGRESS_NAME, num_replicas=scaling.ingress_replicas, ray_actor_options={"num_cpus": 0},
        # the ingress only awaits the replicas: it can hold every request the models may queue
        max_ongoing_requests=max(1000, sum(s.queue_capacity for s in specs)))
    return ingress.bind(handles, max_body)


def build(args: Mapping[str, Any]) -> Any:
    """Serve config builder (``import_path: staronnx.ray.app:build``); see
    ``deploy/serve-config.yaml`` for the ``args`` it takes."""
    from staronnx.durations import parse_duration
    from staronnx.serve.app import model_names, parse_size

    args = dict(args)
    unknown = sorted(set(args) - _SCALING_ARGS - _MODEL_ARGS - {"plans", "names", "max_body"})
    if unknown:
        raise StaronnxError(f"unknown staronnx.ray.app:build arg(s) {unknown}; known: "
                            f"{sorted(_SCALING_ARGS | _MODEL_ARGS | {'plans', 'names', 'max_body'})}")
    plans = args.get("plans")
    if isinstance(plans, str):
        plans = [plans]
    if not plans:
        raise StaronnxError("staronnx.ray.app:build needs 'plans': a list of plan folders")
    paths = [Path(p) for p in plans]
    names = model_names(paths, args.get("names"))
    model = {k: args[k] for k in _MODEL_ARGS if k in args}
    for key in ("max_delay", "save_every"):
        if isinstance(model.get(key), str):
            model[key] = parse_duration(model[key], allow_zero=True)
    scaling = {k: args[k] for k in _SCALING_ARGS if k in args}
    if isinstance(scaling.get("autoscale"), str):
        scaling["autoscale"] = parse_autoscale(scaling["autoscale"])
    if "autoscale" in scaling and "replicas" in scaling:
        raise StaronnxError("give either 'replicas' or 'autoscale', not both")
    max_body = args.get("max_body", 64 * 2**20)
    if isinstance(max_body, str):
        max_body = parse_size(max_body)
    specs = [ModelSpec(plan=str(p), name=n, **model) for p, n in zip(paths, names)]
    return build_app(specs, Scaling(**scaling), max_body=int(max_body))


def free_port(host: str) -> int:
    """A port free on ``host`` now (Serve's proxy needs a number, not 0)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listening_on(host: str, port: int) -> tuple[str, int]:
    """The host and port of the HTTP proxy Serve runs on this cluster (those asked for, where
    the running controller cannot say: its client is not public API)."""
    try:
        from ray.serve.context import _get_global_client

        options = _get_global_client().http_config
        return str(options.host or host), int(options.port or port)
    except Exception:  # noqa: BLE001 - a Ray version without it: what we asked for is what it took
        return host, port


def deploy(specs: Sequence[ModelSpec], scaling: Scaling, *, host: str, port: int, max_body: int,
           env: Mapping[str, str] | None = None) -> str:
    """Start Serve's HTTP proxy on ``host:port`` (0: a free port), run the application, wait
    until every replica is up; returns the base URL."""
    from ray import serve

    port = port or free_port(host)
    serve.start(http_options={"host": host, "port": port})
    # Serve already running on this cluster keeps its own proxy (and says it ignores ours):
    # announce where it really listens, not where we asked it to
    host, port = listening_on(host, port)
    try:
        serve.run(build_app(specs, scaling, max_body=max_body, env=env), name=APP_NAME, route_prefix="/",
                  logging_config={"enable_access_log": False, "log_level": "WARNING"})
    except RuntimeError as exc:  # a replica that cannot start: the cause its deployment reports
        cause = _failed_deployment_cause() or _error_line(str(exc))
        raise StaronnxError(f"the Ray Serve application did not start: {cause}") from None
    target = f"[{host}]" if ":" in host else host
    return f"http://{target}:{port}"


def _error_line(text: str) -> str:
    """The last line of a Ray error text that names an exception (the cause, not the frames)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = next((ln for ln in reversed(lines) if "Error" in ln or "Exception" in ln), lines[-1] if lines else text)
    return re.sub(r"^(?:[A-Za-z_]\w*\.)+(?=\w+(?:Error|Exception)\b)", "", line)  # a.b.PolicyError -> PolicyError


def _failed_deployment_cause() -> str | None:
    """``deployment: cause`` of the first deployment of the application that failed, from
    ``serve.status()`` (serve.run only says that *some* deployment failed)."""
    from ray import serve

    try:
        app = serve.status().applications.get(APP_NAME)
    except Exception:  # noqa: BLE001 - the controller is gone too: the caller's message stands
        return None
    for name, dep in (app.deployments.items() if app is not None else ()):
        if str(dep.status).rsplit(".", 1)[-1] in ("DEPLOY_FAILED", "UNHEALTHY") and dep.message:
            return f"{name}: {_error_line(dep.message)}"
    return None
