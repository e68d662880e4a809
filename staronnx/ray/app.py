"""The Serve application: one ingress in front of the deployment(s) that host the plans.

    app = build_app([ModelSpec(plan="a/", name="googlenet", groups="cores=1"),
                     ModelSpec(plan="b/", name="ocr", latency_ms=50)],
                    Scaling(replicas=2, replica_cpus=1))
    serve.run(app, name="staronnx", route_prefix="/")

By default every model is hosted by one deployment (``staronnx-shared``, or ``staronnx-<model>``
for a single one) whose replicas each run all of them on one shared runtime, as ``staronnx
serve`` does on one machine; ``separate_runtimes=True`` deploys one deployment per model
instead. :func:`build` is the same for Serve config files (``import_path:
staronnx.ray.app:build``, its ``args`` as in ``deploy/serve-config.yaml``), and :func:`deploy`
is what ``staronnx serve --ray`` does.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any, Mapping, Sequence

from staronnx.errors import StaronnxError
from staronnx.ray.spec import (APP_NAME, INGRESS_NAME, RUNTIME_FIELDS, ModelSpec, ReplicaSpec, Scaling,
                               group_models, parse_autoscale)

#: the Serve config ``args`` :func:`build` takes besides the model settings
_SCALING_ARGS = {"replicas", "autoscale", "replica_cpus", "replica_gpus", "max_ongoing", "target_ongoing",
                 "ingress_replicas"}
#: settings given once for every model: its runtime's, and its batcher's size and delay
_MODEL_ARGS = {*RUNTIME_FIELDS, "batch_size", "max_delay"}
#: settings given once for every model or per model ({name: value}, or "name=value" items)
_PER_MODEL_ARGS = {"queue_capacity", "slo_ms", "priority"}
_OTHER_ARGS = {"plans", "names", "max_body", "separate_runtimes", "batch_axes", "batching"}
_KNOWN_ARGS = _SCALING_ARGS | _MODEL_ARGS | _PER_MODEL_ARGS | _OTHER_ARGS


def build_app(specs: Sequence[ModelSpec], scaling: Scaling | None = None, *, max_body: int = 64 * 2**20,
              env: Mapping[str, str] | None = None, separate_runtimes: bool = False) -> Any:
    """The ingress bound to the deployment(s) serving ``specs`` (a ``ray.serve`` Application):
    one hosting every model on a shared runtime per replica, or one per model
    (``separate_runtimes``); ``scaling`` applies to each."""
    from staronnx.ray.ingress import KServeIngress

    groups = group_models(specs, separate_runtimes)
    scaling = scaling or Scaling()
    handles = _deployments(groups, scaling, env)
    ingress = _deployment(KServeIngress).options(
        name=INGRESS_NAME, num_replicas=scaling.ingress_replicas, ray_actor_options={"num_cpus": 0},
        # the ingress only awaits the replicas: it can hold every request the models may queue
        max_ongoing_requests=max(1000, sum(s.queue_capacity for s in specs)))
    return ingress.bind(handles, max_body)


def _deployment(cls: type) -> Any:
    """``serve.deployment(cls)``: a Serve Deployment of the class. Ray's stubs type
    ``serve.deployment`` as its decorator-factory overload, which has no ``options``."""
    from ray import serve

    make: Any = serve.deployment
    return make(cls)


def _deployments(groups: Sequence[ReplicaSpec], scaling: Scaling, env: Mapping[str, str] | None) -> dict[str, Any]:
    """Model name -> the bound deployment hosting it; the models of a shared deployment all
    map to the same one (Serve builds it once and hands the ingress one handle for them)."""
    from staronnx.ray.replica import StaronnxReplica

    handles: dict[str, Any] = {}
    for group in groups:
        options = scaling.deployment_options(group, env)
        bound = _deployment(StaronnxReplica).options(**options).bind(group.to_dict())
        handles.update({m.name: bound for m in group.models})
    return handles


def build(args: Mapping[str, Any]) -> Any:
    """Serve config builder (``import_path: staronnx.ray.app:build``); see
    ``deploy/serve-config.yaml`` for the ``args`` it takes.

    ``queue_capacity`` is one number for every model or ``{name: N}``; ``slo_ms`` and
    ``priority`` are ``{name: value}`` (or ``"name=value"`` items, as on the command line);
    ``separate_runtimes: true`` gives each model its own deployment (and refuses targets);
    ``batch_axes`` (``[MODEL:]NAME=AXIS`` items) and ``batching: false`` override the plans'
    batching contracts as ``--batch-axis`` and ``--no-batching`` do."""
    from staronnx.serve.app import model_names

    args = dict(args)
    unknown = sorted(set(args) - _KNOWN_ARGS)
    if unknown:
        raise StaronnxError(f"unknown staronnx.ray.app:build arg(s) {unknown}; known: {sorted(_KNOWN_ARGS)}")
    plans = args.get("plans")
    if isinstance(plans, str):
        plans = [plans]
    if not plans:
        raise StaronnxError("staronnx.ray.app:build needs 'plans': a list of plan folders")
    paths = [_plan_path(p) for p in plans]
    names = model_names(paths, args.get("names"))
    model = _model_settings(args)
    own = per_model_settings(names, args)
    for n, given in _batching(paths, names, args).items():
        own[n].update(given)
    specs = [ModelSpec(plan=str(p), name=n, **model, **own[n]) for p, n in zip(paths, names)]
    return build_app(specs, _scaling(args), max_body=_max_body(args),
                     separate_runtimes=_flag(args.get("separate_runtimes", False), "separate_runtimes"))


def _plan_path(given: Any) -> Path:
    """A config's plan folder, absolute: a relative one is resolved here, against the folder the
    application is built in (Ray Serve builds it in its runtime_env's ``working_dir`` when the
    config gives one, as it imports the code from there; else where ``serve run`` / ``serve
    deploy`` left the process), as ``staronnx ray`` resolves it against the caller's folder.
    Kept relative, each replica resolved it against its own working folder, on its own node."""
    if not isinstance(given, (str, os.PathLike)):
        raise StaronnxError(f"'plans' takes plan folder paths, got {given!r}")
    path = Path(given).expanduser()
    if path.is_absolute():
        return path
    here = Path.cwd()
    resolved = (here / path).resolve()
    if not resolved.is_dir():
        raise StaronnxError(f"plan folder {str(given)!r} is not found in {here}: a relative plan path in a Serve "
                            "config is read from the application's working folder (its runtime_env "
                            "working_dir, or where serve run was started); give an absolute path")
    return resolved


def _batching(paths: Sequence[Path], names: Sequence[str], args: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A Serve config's ``batch_axes`` (``[MODEL:]NAME=AXIS`` items, as ``--batch-axis``) and
    ``batching: false`` (``--no-batching``), resolved per model against the plans' tensors."""
    from staronnx.plan import Plan
    from staronnx.serve.batching import apply_batching

    items = args.get("batch_axes") or []
    if isinstance(items, str):
        items = [items]
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise StaronnxError(f"'batch_axes' takes '[MODEL:]NAME=AXIS' items, got {items!r}")
    batching = _flag(args.get("batching", True), "batching")
    if not items and batching:
        return {}
    return apply_batching({n: Plan.load(p) for p, n in zip(paths, names)}, list(items), not batching)


def _model_settings(args: Mapping[str, Any]) -> dict[str, Any]:
    """The settings every model takes alike, durations parsed (``2ms``)."""
    from staronnx.durations import parse_duration

    model = {k: args[k] for k in _MODEL_ARGS if k in args}
    for key in ("max_delay", "save_every", "gc_interval"):
        if isinstance(model.get(key), str):
            model[key] = parse_duration(model[key], allow_zero=True)
    return model


def _scaling(args: Mapping[str, Any]) -> Scaling:
    scaling = {k: args[k] for k in _SCALING_ARGS if k in args}
    if isinstance(scaling.get("autoscale"), str):
        scaling["autoscale"] = parse_autoscale(scaling["autoscale"])
    if "autoscale" in scaling and "replicas" in scaling:
        raise StaronnxError("give either 'replicas' or 'autoscale', not both")
    return Scaling(**scaling)


def _max_body(args: Mapping[str, Any]) -> int:
    from staronnx.serve.app import parse_size

    max_body = args.get("max_body", 64 * 2**20)
    return int(parse_size(max_body) if isinstance(max_body, str) else max_body)


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise StaronnxError(f"{key!r} is true or false, got {value!r}")
    return value


def per_model_settings(names: Sequence[str], args: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``queue_capacity``, ``slo_ms`` and ``priority`` of a Serve config as ModelSpec fields
    per model (``queue_capacity``, ``latency_ms``, ``priority``); a name not served is refused."""
    own: dict[str, dict[str, Any]] = {n: {} for n in names}
    for key, field in (("queue_capacity", "queue_capacity"), ("slo_ms", "latency_ms"), ("priority", "priority")):
        given = args.get(key)
        if key == "queue_capacity" and isinstance(given, int) and not isinstance(given, bool):
            given = {n: given for n in names}  # one number for every model
        for n, value in (_by_name(given, key, names) if given is not None else {}).items():
            own[n][field] = value
    return own


def _by_name(value: Any, key: str, names: Sequence[str]) -> dict[str, Any]:
    """``{name: value}`` from a mapping or ``"name=value"`` items (a string or a list), each
    value checked to be a number (a whole one for a capacity or a priority)."""
    from staronnx.runtime.models import parse_targets
    from staronnx.serve.batching import served_only

    if isinstance(value, Mapping):
        items = [f"{n}={v}" for n, v in value.items()]
    elif isinstance(value, str):
        items = [value]
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        items = list(value)
    else:
        raise StaronnxError(f"{key!r} takes {{name: value}} or 'name=value' items, got {value!r}")
    kind = "latency_ms" if key == "slo_ms" else ("capacity" if key == "queue_capacity" else "priority")
    try:
        parsed = {n: fields[kind] for n, fields in parse_targets(items, kind).items()}
    except StaronnxError as exc:
        raise StaronnxError(f"{key!r}: {exc}") from None
    return served_only(parsed, names, repr(key))


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

        client = _get_global_client()
        if client is None:  # no controller to ask: what we asked for is what it took
            return host, port
        options = client.http_config
        return str(options.host or host), int(options.port or port)
    except Exception:  # noqa: BLE001 - a Ray version without it: what we asked for is what it took
        return host, port


def deploy(specs: Sequence[ModelSpec], scaling: Scaling, *, host: str, port: int, max_body: int,
           env: Mapping[str, str] | None = None, separate_runtimes: bool = False) -> str:
    """Start Serve's HTTP proxy on ``host:port`` (0: a free port), run the application, wait
    until every replica is up; returns the base URL."""
    from ray import serve

    port = port or free_port(host)
    serve.start(http_options={"host": host, "port": port})
    # Serve already running on this cluster keeps its own proxy (and says it ignores ours):
    # announce where it really listens, not where we asked it to
    host, port = listening_on(host, port)
    try:
        serve.run(build_app(specs, scaling, max_body=max_body, env=env, separate_runtimes=separate_runtimes),
                  name=APP_NAME, route_prefix="/",
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
