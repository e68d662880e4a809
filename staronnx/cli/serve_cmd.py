"""``staronnx serve``: plans over the network (KServe v2 HTTP + gRPC, Prometheus metrics)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from staronnx.cli.given import given_on_command_line
from staronnx.cli.gpus import (CUDA_DEVICES_HELP, THREAD_PER_STREAM_HELP, check_cuda_worker_flags, host_core_name,
                               parse_cuda_devices)
from staronnx.errors import ModelError, StaronnxError
from staronnx.serve.batching import served_only, target_words

if TYPE_CHECKING:
    from staronnx.runtime.registry import Worker


def _port(value: int, flag: str) -> int:
    if not 0 <= value <= 65535:
        raise StaronnxError(f"--{flag} must be between 0 (a free port) and 65535, got {value}")
    return value


#: the flags of staronnx serve's own listeners, which --ray does not start (Ray Serve's proxy takes
#: HTTP with its own limits): given with --ray, they are refused rather than ignored
NOT_ON_RAY = ("grpc_port", "metrics_port", "drain_timeout", "header_timeout", "body_timeout", "body_min_rate",
              "idle_timeout", "request_timeout", "max_connections", "receive_budget", "grpc_max_streams")


def serve_cmd(
    ctx: typer.Context,
    plans: Annotated[Optional[list[Path]], typer.Argument(
        help="Plan folder(s); each is served as a model named after its folder.")] = None,
    name: Annotated[list[str] | None, typer.Option(help="Model name, one per plan in order (repeatable).")] = None,
    model_repository: Annotated[list[Path] | None, typer.Option(
        "--model-repository", help=REPOSITORY_HELP)] = None,
    model_control_mode: Annotated[str, typer.Option(
        help="With --model-repository: none (every model loaded at start, for good), explicit (--load-model at "
             "start, then load and unload requests) or poll (every model, and the repository read again every "
             "--repository-poll-secs).")] = "none",
    load_model: Annotated[list[str] | None, typer.Option(
        "--load-model", help="With --model-control-mode explicit: a model to load at start (repeatable; * for "
                             "all).")] = None,
    repository_poll_secs: Annotated[float, typer.Option(
        help="With --model-control-mode poll: seconds between two reads of the repository.")] = 15.0,
    tls_cert: Annotated[Optional[Path], typer.Option(
        help="TLS on every listener (HTTP, gRPC, metrics): the server's certificate chain (PEM); with --tls-key. "
             "A --host other machines reach then needs no --insecure.")] = None,
    tls_key: Annotated[Optional[Path], typer.Option(help="The private key (PEM) of --tls-cert.")] = None,
    tls_client_ca: Annotated[Optional[Path], typer.Option(
        help="Mutual TLS: answer only clients presenting a certificate this CA (PEM) signed, on every "
             "listener.")] = None,
    exit_on_error: Annotated[bool, typer.Option(
        "--exit-on-error/--no-exit-on-error",
        help="Refuse to start when a model asked for cannot be served (Triton's default); by default that model "
             "alone is left out, UNAVAILABLE with its reason, and the others serve.")] = False,
    host: Annotated[str, typer.Option(help="Address to listen on; an address other machines reach (0.0.0.0, ::, a "
                                           "LAN address) also needs --insecure.")] = "127.0.0.1",
    insecure: Annotated[bool, typer.Option(
        "--insecure", help="Listen on a --host other machines reach, with no TLS and no authentication (put a "
                           "TLS-terminating proxy in front, as Triton and KServe expect).")] = False,
    http_port: Annotated[int, typer.Option(help="KServe v2 HTTP/REST port; 0 = a free port (printed).")] = 8000,
    grpc_port: Annotated[int, typer.Option(help="KServe v2 gRPC port; 0 = a free port (printed).")] = 8001,
    metrics_port: Annotated[int, typer.Option(help="Prometheus /metrics port; 0 = a free port (printed).")] = 8002,
    policy: Annotated[str, typer.Option(help="Scheduling policy: eager, random, ws, lws, dm, dmda, dmdar, dmdas, heft, or static.")] = "heft",
    groups: Annotated[str, typer.Option(help="CPU grouping policy: numa, package, cores=N, ...")] = "numa",
    cuda_streams: Annotated[int, typer.Option(help="CUDA workers (streams) per GPU; 0 = none.")] = 0,
    cuda_devices: Annotated[Optional[str], typer.Option(
        help=CUDA_DEVICES_HELP + " Not with --ray (Ray gives each replica its GPUs: --replica-gpus).")] = None,
    engine: Annotated[str, typer.Option(help="native or starpu.")] = "native",
    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs/--no-cuda-graphs", help=HELP["cuda_graphs"])] = True,
    thread_per_stream: Annotated[bool, typer.Option(
        "--cuda-thread-per-stream", help=THREAD_PER_STREAM_HELP)] = False,
    colocate: Annotated[bool, typer.Option("--colocate", help=HELP["colocate"])] = False,
    batch_size: Annotated[int, typer.Option(help="Largest batch the batcher forms from the clients' samples.")] = 8,
    batch_axis: Annotated[list[str] | None, typer.Option(
        "--batch-axis", help=BATCH_AXIS_HELP)] = None,
    no_batching: Annotated[bool, typer.Option(
        "--no-batching", help="Run every request alone, one per task (Triton's max_batch_size 0), still "
                              "concurrently on every worker: for a model whose batch the graph cannot tell.")] = False,
    max_delay: Annotated[str, typer.Option(
        help="Dynamic batching: a partial batch leaves once its oldest sample waited this long (0 = as soon as a "
             "worker slot is free, Triton's default).")] = "0ms",
    queue_capacity: Annotated[list[str] | None, typer.Option(
        help="Samples waiting for a batch, per model; beyond it that model's requests get 503 / UNAVAILABLE. "
             "N for every model, NAME=N for one (repeatable; default 1024).")] = None,
    max_body: Annotated[str, typer.Option(help="Largest request body (HTTP) or message (gRPC): 64MiB, 10MB, ...")] = "64MiB",
    drain_timeout: Annotated[str, typer.Option(help=HELP["drain_timeout"])] = "30s",
    header_timeout: Annotated[str, typer.Option(help=HELP["header_timeout"])] = "10s",
    body_timeout: Annotated[str, typer.Option(help=HELP["body_timeout"])] = "30s",
    body_min_rate: Annotated[str, typer.Option(help=HELP["body_min_rate"])] = "1KiB",
    idle_timeout: Annotated[str, typer.Option(help=HELP["idle_timeout"])] = "75s",
    request_timeout: Annotated[str, typer.Option(help=HELP["request_timeout"])] = "120s",
    max_connections: Annotated[Optional[int], typer.Option(
        help="Connections each protocol holds; past it HTTP answers 503 and gRPC's core closes the connection. "
             "Default: from the open-file limit, which is raised to its hard limit at start.")] = None,
    receive_budget: Annotated[Optional[str], typer.Option(
        help="Bytes of request bodies being received at once over all connections (memory is taken as bytes "
             "arrive); a body past it gets 503. Default: 16 x --max-body.")] = None,
    grpc_max_streams: Annotated[int, typer.Option(
        help="Concurrent gRPC calls per connection (HTTP/2 max_concurrent_streams): a client queues the rest, "
             "and a rapid-reset flood is refused past it on its own connection.")] = 4096,
    save_every: Annotated[str, typer.Option(
        help="How often the perf models learnt while serving are merged into $STARONNX_HOME (0 = at shutdown "
             "only): a server that is killed loses at most that much of what it learnt.")] = "60s",
    gc_interval: Annotated[str, typer.Option(
        help="Python's cycle collector while serving: young objects only, and a full collection this often "
             "(0 = Python's own thresholds, whose collections of older objects stopped every thread for 5-37 ms "
             "several times a second under load); with --ray, in every replica.")] = "30s",
    ray: Annotated[bool, typer.Option("--ray", help="Serve on Ray Serve: replicas on the cluster $RAY_ADDRESS names "
                                      "(else a local one) behind one KServe v2 HTTP endpoint on --http-port (needs the ray extra).")] = False,
    replicas: Annotated[int | None, typer.Option(help="With --ray: replicas, each hosting every model (default 1; of each model with --separate-runtimes).")] = None,
    autoscale: Annotated[str | None, typer.Option(help="With --ray: MIN:MAX replicas, scaled with the load.")] = None,
    replica_cpus: Annotated[float | None, typer.Option(
        help="With --ray: CPUs each replica asks Ray for and is pinned to (default: all of this machine's).")] = None,
    replica_gpus: Annotated[float | None, typer.Option(
        help="With --ray: GPUs each replica asks Ray for (default 1 with --cuda-streams, else 0).")] = None,
    slo_ms: Annotated[list[str] | None, typer.Option(
        "--slo-ms", help="A model's latency target in ms, NAME=MS (repeatable, or a=50,b=20): its requests' "
                         "tasks run earliest deadline first on the shared workers; later answers count as "
                         "deadline misses.")] = None,
    priority: Annotated[list[str] | None, typer.Option(
        "--priority", help="A model's priority, NAME=N (repeatable): its tasks run before those of lower "
                           "priority, deadlines or not (default 0).")] = None,
    model_workers: Annotated[list[str] | None, typer.Option(
        "--model-workers", help=MODEL_WORKERS_HELP)] = None,
    lane: Annotated[list[str] | None, typer.Option("--lane", help=LANE_HELP)] = None,
    lane_preempt: Annotated[str, typer.Option(help=LANE_PREEMPT_HELP)] = "idle",
    separate_runtimes: Annotated[bool, typer.Option(
        "--separate-runtimes", help="One runtime per model (each with its own CPU groups and CUDA streams on the "
                                    "same cores and GPU) instead of one shared runtime for all; with --ray, one "
                                    "deployment per model.")] = False,
) -> None:
    """Serve plans with the KServe v2 protocol over HTTP and gRPC (Triton's clients work
    unchanged), with Prometheus metrics; SIGTERM or Ctrl-C drains and exits 0.

    Several plans share one runtime: one set of workers runs every model's parts under one
    policy, each model with its own batcher and queue (a full queue refuses that model only).
    --model-repository serves a Triton model repository as it is (config.pbtxt, version folders),
    with Triton's model control (--model-control-mode).
    With --ray, each replica of one deployment is such a shared runtime."""
    import contextlib
    from dataclasses import replace

    from staronnx.durations import parse_duration
    from staronnx.workers.lanes import check_preempt, short_switch_interval
    from staronnx.workers.layout import MachineSpec

    try:
        import aiohttp  # noqa: F401
        import grpc  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError as exc:
        raise StaronnxError(f"staronnx serve needs the serve extra ({exc.name} is missing): "
                            "pip install 'staronnx[serve]'") from None

    from staronnx.plan import Plan
    from staronnx.runtime.models import plan_name
    from staronnx.runtime.runtime import ModelHandle, Runtime, warmup_sizes
    from staronnx.runtime.spec import RuntimeSpec
    from staronnx.serve.app import Listen, check_exposure, model_names, parse_size, serve
    from staronnx.serve.batching import apply_batching, check_names
    from staronnx.serve.control import ModelControl, model_stamp
    from staronnx.serve.metrics import ServeMetrics
    from staronnx.serve.models import ENDPOINT_SPEC, Declared, ModelEndpoint, has_strings, unservable
    from staronnx.serve.tls import Tls

    plans = list(plans or [])
    if not plans and not model_repository:
        raise StaronnxError("give plan folders to serve, --model-repository DIR, or both")
    if ray and model_repository:
        raise StaronnxError("--model-repository is served by staronnx serve itself, not on Ray (yet): drop --ray")
    control_mode, to_load, poll_every = model_control(
        model_control_mode, load_model or [], repository_poll_secs, bool(model_repository),
        poll_given="repository_poll_secs" in given_on_command_line(ctx))
    in_repository: list[tuple[str, Path]] = []
    if model_repository:  # imported only here: it loads the model-config proto, which tritonclient also registers
        from staronnx.serve import repository

        in_repository = repository.scan(model_repository)
        unknown = sorted(to_load - {n for n, _ in in_repository} - {"*"})
        if unknown:
            raise StaronnxError(f"--load-model {', '.join(unknown)}: no such model in the repository "
                                f"({', '.join(n for n, _ in in_repository) or 'empty'})")
    names = model_names(plans, name)
    names = [*names, *(n for n, _ in in_repository)]
    check_names(names)
    tls = Tls.load(tls_cert, tls_key, tls_client_ca)
    if tls is not None and ray:
        raise StaronnxError("--tls-cert is served by staronnx serve itself, not on Ray: terminate TLS in front of "
                            "Ray Serve's proxy")
    ignored = [n for n in NOT_ON_RAY if n in given_on_command_line(ctx)] if ray else []
    if ignored:
        raise StaronnxError(f"{', '.join('--' + n.replace('_', '-') for n in ignored)}: settings of staronnx serve's "
                            "own listeners, which --ray does not start (Ray Serve's proxy serves HTTP, with its own "
                            "limits and port); leave them out with --ray")
    check_exposure(host, insecure, tls is not None)
    if batch_size < 1:
        raise StaronnxError(f"--batch-size must be at least 1, got {batch_size}")
    capacities, any_capacity = queue_capacities(names, queue_capacity or [])
    if not ray and (replicas, autoscale, replica_cpus, replica_gpus) != (None, None, None, None):
        raise StaronnxError("--replicas, --autoscale, --replica-cpus and --replica-gpus go with --ray")
    targets = service_targets(names, slo_ms or [], priority or [])
    service_targets_cli = {n: dict(t) for n, t in targets.items()}  # what a model loaded later gets from the flags
    if targets and separate_runtimes:
        from staronnx.ray.spec import TARGETS_NEED_SHARING  # the same words as on Ray

        raise StaronnxError(TARGETS_NEED_SHARING)
    residency = model_residency(model_workers or [], names)
    residency_cli = dict(residency)  # what the flags say (over a config's instance_group, at every load)
    if residency and (separate_runtimes or len(names) < 2):
        raise StaronnxError("--model-workers places models on the workers of one shared runtime; it needs several "
                            "models and does not go with --separate-runtimes")
    lanes = model_lanes(lane or [], names)
    check_preempt(lane_preempt)
    if not lanes and "lane_preempt" in given_on_command_line(ctx):  # else dropped without a word
        raise StaronnxError(f"--lane-preempt {lane_preempt} says how a lane's group yields to the lane: it needs "
                            "--lane NAME=GROUPS")
    if no_batching and not model_repository and "batch_size" in given_on_command_line(ctx):  # else dropped
        raise StaronnxError(f"--batch-size {batch_size}: --no-batching runs every request alone, one per task (a "
                            "repository model's config.pbtxt may still batch): give one of them")
    if lanes and (separate_runtimes or len(names) < 2):
        raise StaronnxError("--lane gives a model workers that preempt the other models' tasks on one shared runtime; "
                            "it needs several models and does not go with --separate-runtimes")
    collect_every = parse_duration(gc_interval, allow_zero=True, option="--gc-interval")
    if colocate and (ray or engine != "native"):
        raise StaronnxError("--colocate runs the serving threads on a worker thread's core: it needs the native engine, "
                            "and does not go with --ray")
    if ray and cuda_devices is not None:
        raise StaronnxError("--cuda-devices picks this machine's GPUs; with --ray each replica drives the GPUs Ray "
                            "gives it (--replica-gpus)")
    devices = parse_cuda_devices(cuda_devices, cuda_streams)
    check_cuda_worker_flags(cuda_streams, cuda_graphs=cuda_graphs, thread_per_stream=thread_per_stream)
    delay = parse_duration(max_delay, allow_zero=True, option="--max-delay")
    # every model's batching but its queue's capacity (and its window: from its perf models)
    serving = replace(ENDPOINT_SPEC, batch_size=batch_size, max_delay=delay, colocate=colocate)
    save_s = parse_duration(save_every, allow_zero=True, option="--save-every")
    body = parse_size(max_body, "--max-body")
    http_port = _port(http_port, "http-port")
    if not ray:  # on Ray only --http-port listens; here a port given twice failed at its second bind, models loaded
        taken: dict[int, str] = {}
        for flag, port in (("--http-port", http_port), ("--grpc-port", grpc_port), ("--metrics-port", metrics_port)):
            if port and port in taken:
                raise StaronnxError(f"{taken[port]} and {flag} are both {port}: each listener needs a port of its own "
                                    "(0 takes a free one)")
            taken[port] = flag
    # every plan and its batching checked before any runtime or cluster starts (a replica applies them again)
    loaded = [Plan.load(p) for p in plans]
    overrides = apply_batching(dict(zip(names, loaded)), batch_axis or [], no_batching)
    names = names[:len(loaded)]  # the plan folders' models; the repository's join once loaded
    plan_models = list(names)

    def say(line: str) -> None:
        print(line, flush=True)

    if ray:  # staronnx.ray: the same models on Ray Serve (HTTP only), each replica a shared runtime
        from staronnx.ray.cli import model_specs, scaling_from_options, serve_on_ray

        scaling = scaling_from_options(replicas, autoscale, replica_cpus, replica_gpus, cuda_streams)
        ray_specs = model_specs(plans, names, {"policy": policy, "groups": groups, "cuda_streams": cuda_streams,
                                           "cuda_graphs": cuda_graphs, "thread_per_stream": thread_per_stream,
                                           "engine": engine, "batch_size": batch_size, "lane_preempt": lane_preempt,
                                           "max_delay": delay, "save_every": save_s, "gc_interval": collect_every},
                            capacities=capacities, targets=targets, residency=residency, lanes=lanes,
                            batching=overrides)
        serve_on_ray(ray_specs, scaling, separate_runtimes=separate_runtimes, host=host, http_port=http_port,
                     max_body=body, say=say)
        return
    # every model's batcher: the flags', a repository model's as its config says
    specs = {n: replace(serving, queue_capacity=capacities[n]) for n in names}
    declared: dict[str, Declared] = {}
    unavailable: dict[str, str] = {}
    stamps: dict[str, Any] = {}
    warmups: dict[str, Any] = {}  # repository models with model_warmup samples to run before serving
    older_of: dict[str, str] = {}  # NAME@VERSION -> NAME: the older versions a version_policy serves beside the latest
    # the CUDA streams and CPU groups the server starts: what a config's instance_group maps onto
    slots = repository.machine_workers(groups, cuda_streams, devices, thread_per_stream) if in_repository else []
    for model_name, folder in in_repository:
        if control_mode == "explicit" and model_name not in to_load and "*" not in to_load:
            continue  # loaded on request
        stamps[model_name] = model_stamp(folder, dict(in_repository))
        try:
            found = repository.load(model_name, folder, batch_size, folders=dict(in_repository))
            wants = repository.workers_for(found, slots, separate_runtimes, cuda_graphs)
        except StaronnxError as exc:  # this model fails alone
            unavailable[model_name] = str(exc)
            continue
        base = replace(serving, queue_capacity=capacities[model_name])  # --queue-capacity N or NAME=N
        target = {**found.settings.target, **targets.get(model_name, {})}
        for version in (found, *found.older):  # the older versions run as models of their own, keyed NAME@VERSION
            key = model_name if version is found else f"{model_name}@{version.version}"
            if key != model_name:
                older_of[key] = model_name
            if wants is not None:
                residency[key] = residency.get(model_name, wants)
            names.append(key)
            loaded.append(version.plan)
            specs[key] = repository.serve_spec(version, base, delay)
            if target:
                targets[key] = target
            declared[key] = repository.declared(version)
            warmups[key] = version
    # a model that cannot be served fails alone: said, listed UNAVAILABLE with its reason, the others serve
    unavailable.update({n: why for n, why in ((n, unservable(p)) for n, p in zip(names, loaded)) if why is not None})
    for model_name, why in unavailable.items():
        say(f"model {model_name!r} is not served: {why}")
    if unavailable and exit_on_error:
        raise refuse_unservable(unavailable)
    # explicit and poll modes may start with nothing served: their models come with a load request or the next poll
    if not names and control_mode == "none":  # an empty repository: nothing failed, so no reason to join
        raise StaronnxError(f"no model to serve: --model-repository {' '.join(map(str, model_repository or []))} "
                            "holds no model folder (<model>/<version>/model.onnx)")

    def drop_unavailable() -> None:
        """The models that cannot be served leave what the runtimes are built from; with none left
        to serve (and none to load later), the start is refused with every reason."""
        nonlocal names, loaded, targets, residency, lanes
        if all(n in unavailable for n in names) and control_mode == "none":
            raise StaronnxError("no model can be served: " + "; ".join(f"{n}: {w}" for n, w in unavailable.items()))
        loaded = [p for n, p in zip(names, loaded) if n not in unavailable]
        names = [n for n in names if n not in unavailable]
        targets = {n: v for n, v in targets.items() if n not in unavailable}
        residency = {n: v for n, v in residency.items() if n not in unavailable}
        lanes = {n: v for n, v in lanes.items() if n not in unavailable}

    drop_unavailable()
    # the targets of the models loaded now: the runtime refuses one for a model it does not hold (a
    # repository model loaded later gets its --slo-ms/--priority from service_targets_cli)
    targets = {n: t for n, t in targets.items() if n in names}
    for flag, given in (("--model-workers", residency), ("--lane", lanes)):
        later = [n for n in given if n not in names]  # a repository model explicit mode loads on request
        if later:
            raise StaronnxError(f"{flag} {', '.join(later)}: the model is not loaded at start, and the shared runtime "
                                "cannot take a model while it runs: list it in --load-model")
    if cuda_streams:  # string tensors live in host memory: such a model runs on the CPU groups only
        for model_name, plan in [(n, p) for n, p in zip(names, loaded) if has_strings(p)]:
            if separate_runtimes:
                raise StaronnxError(f"model {model_name!r} has string tensors, which run on CPU workers only: serve it "
                                    "on the shared runtime (without --separate-runtimes), or without --cuda-streams")
            residency[model_name] = "cpu"
            say(f"model {model_name!r} has string tensors: it runs on the CPU groups only")
    listen = Listen(host=host, http_port=http_port, grpc_port=_port(grpc_port, "grpc-port"),
                    metrics_port=_port(metrics_port, "metrics-port"), max_body=body,
                    drain_timeout=parse_duration(drain_timeout, option="--drain-timeout"),
                    limits=serve_limits(header_timeout, body_timeout, body_min_rate, idle_timeout, request_timeout,
                                        max_connections, receive_budget, grpc_max_streams, body), tls=tls)
    metrics = ServeMetrics()
    if cuda_streams:  # Triton's nv_gpu_* metrics of the GPUs served from (NVML; one line where it is missing)
        from staronnx.serve.gpu_metrics import gpu_collector

        gpus = gpu_collector(devices)
        if gpus is not None:
            metrics.registry.register(gpus)
    models: list[ModelEndpoint] = []
    shared: Runtime | None = None
    control: ModelControl | None = None
    machine = MachineSpec(groups, cuda_streams, devices, cuda_graphs, thread_per_stream)
    options = RuntimeSpec(policy, engine=engine, save_every=save_s,
                          warmup=warmup_sizes(batch_size, delay) if cuda_streams else ())
    def leave_out(exc: ModelError) -> bool:
        """A model whose parts ONNX Runtime cannot load (an op of an unknown domain, a type its
        kernels lack) fails alone, as one refused at load: said, UNAVAILABLE with ONNX Runtime's
        reason, the others served (True: the model named by the error was left out)."""
        culprits = [n for n, p in zip(names, loaded) if str(p.root) in str(exc)]
        if not culprits:
            return False
        for model_name in culprits:
            say(f"model {model_name!r} is not served: {exc}")
            unavailable[model_name] = str(exc)
        if exit_on_error:
            raise refuse_unservable(unavailable) from None
        drop_unavailable()
        return True

    try:
        while (len(loaded) > 1 or residency) and not separate_runtimes:
            try:
                shared = Runtime(dict(zip(names, loaded)),
                                 replace(machine, residency=residency, lanes=lanes, lane_preempt=lane_preempt),
                                 replace(options, targets=targets))
                break
            except ModelError as exc:
                if not leave_out(exc):
                    raise
        if shared is not None:
            held = {n: shared.model(n).stats().get("held_by", []) for n in (*residency, *lanes)}
            say(f"one runtime for {len(loaded)} models: {len(shared.workers)} workers, policy {policy}"
                + "".join(f"; {n}: {', '.join(target_words(t)) or 'no target'}" for n, t in targets.items())
                + "".join(f"; {n} on {', '.join(held[n])} only" for n in residency)
                + "".join(f"; {n} has lanes {', '.join(w for w in held[n] if w.startswith('lane:'))}" for n in lanes)
                + _lowered_text(shared.workers))
        def endpoint_of(model_name: str, runtime: Any, spec: Any, decl: Declared | None,
                        target: dict[str, Any]) -> ModelEndpoint:
            """The served model of a runtime (closed again if the endpoint cannot be made)."""
            try:
                return ModelEndpoint(model_name, runtime, spec, metrics=metrics, declared=decl,
                                     settings={"policy": policy, "groups": groups, "cuda_streams": cuda_streams,
                                               **({"cuda_devices": ",".join(map(str, devices))}
                                                  if cuda_streams else {}),
                                               "engine": engine, "shared_runtime": isinstance(runtime, ModelHandle),
                                               **target})
            except BaseException:
                runtime.close()
                raise

        for model_name, plan in zip(names, loaded):
            runtime: Runtime | ModelHandle
            if shared is not None:
                runtime = shared.model(model_name)
            else:
                try:
                    runtime = Runtime(plan, machine, replace(options, targets={plan_name(plan): targets[model_name]}
                                                             if model_name in targets else {}))
                except ModelError as exc:
                    if not leave_out(exc):
                        raise
                    continue
            spec = specs[model_name]
            warm_runs = 0
            if model_name in warmups:
                try:
                    warm_runs = repository.warm(warmups[model_name], runtime)
                except StaronnxError as exc:  # this model fails alone
                    say(f"model {model_name!r} is not served: {exc}")
                    unavailable[model_name] = str(exc)
                    if shared is None:
                        runtime.close()
                    if exit_on_error:  # a model asked for cannot be served, as one refused at load
                        raise refuse_unservable(unavailable) from None
                    continue
            endpoint = endpoint_of(older_of.get(model_name, model_name), runtime, spec, declared.get(model_name),
                                   targets.get(model_name, {}))
            if model_name in older_of:  # answers under its model's name, when a request names its version
                primary = next((m for m in models if m.name == older_of[model_name]), None)
                if primary is None:  # its latest version failed: this one is not served either
                    endpoint.close(1.0)
                else:
                    primary.others[endpoint.version] = endpoint
            else:
                models.append(endpoint)
            graphs = runtime.preferred_batch_sizes if isinstance(runtime, Runtime) else ()
            origin = (f"version {declared[model_name].version} of the repository, " if model_name in declared else "")
            origin += f"warmed up ({warm_runs} runs), " if warm_runs else ""
            say(f"model {older_of.get(model_name, model_name)!r}: {origin}plan {plan.root} ({plan.k} parts, {policy}, groups {groups}), "
                f"batches of up to {spec.batch_size if plan.contract.batchable else 1}, "
                f"max delay {(spec.max_delay or 0.0) * 1e3:g} ms, "
                f"{endpoint.server.max_inflight} batches in flight"
                + (f", CUDA graphs of batch sizes {', '.join(map(str, graphs))}" if graphs else "")
                + (f", {driver_text(runtime)}" if cuda_streams and isinstance(runtime, Runtime) else "")
                + f"; {contract_text(plan)}")

        def open_later(model_name: str, folder: Path, config: str | None) -> ModelEndpoint:
            """A repository model loaded while serving (every version its policy selects, the latest
            answering under its name)."""
            found = repository.load(model_name, folder, batch_size, override=config,
                                    folders=dict(repository.scan(model_repository or [])))
            opened: list[ModelEndpoint] = []
            try:
                for version in (found, *found.older):
                    key = model_name if version is found else f"{model_name}@{version.version}"
                    opened.append(open_version(model_name, key, version))
            except BaseException:
                for endpoint in opened:
                    endpoint.close(1.0)
                raise
            opened[0].others = {e.version: e for e in opened[1:]}
            return opened[0]

        def open_version(model_name: str, key: str, found: Any) -> ModelEndpoint:
            """One version of a model loaded while serving: on the shared runtime where it is
            already there (as ``key``) with the same plan, contract and target, else on a runtime
            of its own (the shared runtime cannot take models while it runs)."""
            target = {**found.settings.target, **service_targets_cli.get(model_name, {})}
            # a model not in the repository at start has no entry: --queue-capacity N still holds for it
            spec = repository.serve_spec(found, replace(serving, queue_capacity=capacities.get(
                model_name, any_capacity)), delay)
            decl = repository.declared(found)
            wants = repository.workers_for(found, slots, False, cuda_graphs)
            if shared is not None and key in shared.model_names:
                handle = shared.model(key)
                # the workers it was given at start (the flag's, else its config's; strings: the CPU groups)
                held = residency_cli.get(model_name, wants) if key == model_name or wants is not None else None
                held = "cpu" if cuda_streams and has_strings(found.plan) else held
                if (handle.plan.hash == found.plan.hash and handle.plan.contract == found.plan.contract
                        and targets.get(key, {}) == target and residency.get(key) == held):
                    repository.warm(found, handle)
                    return endpoint_of(model_name, handle, spec, decl, target)
            if wants is not None:
                raise StaronnxError(f"instance_group keeps the model on some workers ({wants}) of the shared runtime, "
                                    "which cannot take a model while it runs: list it in --load-model to load it at "
                                    "start")
            unfit = unservable(found.plan)
            if unfit is not None:
                raise StaronnxError(unfit)
            if cuda_streams and has_strings(found.plan):
                raise StaronnxError("its string tensors run on CPU workers only, and a runtime of its own would have "
                                    "CUDA workers: list it in --load-model to load it at start")
            runtime = Runtime(found.plan, machine,
                              replace(options, targets={plan_name(found.plan): target} if target else {}))
            try:
                repository.warm(found, runtime)
            except BaseException:
                runtime.close()
                raise
            return endpoint_of(model_name, runtime, spec, decl, target)

        if model_repository:  # plan folders alone: the models are fixed (load and unload refused as ever)
            control = ModelControl(control_mode, model_repository, open_later, {m.name: m for m in models},
                                   unavailable, fixed=plan_models, drain_timeout=listen.drain_timeout)
            control.stamps.update(stamps)
        run, loop_name = event_loop_runner()
        say(f"event loop: {loop_name}")
        # lanes: a waking lane waits for the GIL at most the switch interval, held short while serving
        with short_switch_interval() if lanes else contextlib.nullcontext():
            run(serve(models, metrics, listen, say=say, gc_interval=collect_every,
                      colocate=models[0].server.runtime.colocate if colocate and models else None,
                      colocate_on=host_core_name(cuda_streams), unavailable=unavailable, control=control,
                      poll_every=poll_every))
    finally:
        for m in [*models, *(control.models.values() if control is not None else ())]:
            m.close(1.0)  # after a clean stop these are no-ops; after a failed start they free the workers
        if shared is not None:
            shared.close(1.0)


def model_control(mode: str, load_model: list[str], poll_secs: float, repository: bool, *,
                  poll_given: bool = False) -> tuple[str, set[str], float | None]:
    """``--model-control-mode``, ``--load-model`` and ``--repository-poll-secs`` checked together:
    (mode, the models to load at start, seconds between polls or None). ``poll_given``: the
    user gave ``--repository-poll-secs`` (its default is only poll mode's)."""
    from staronnx.serve.control import MODES

    mode = mode.strip().lower()
    if mode not in MODES:
        raise StaronnxError(f"--model-control-mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode != "none" and not repository:
        raise StaronnxError(f"--model-control-mode {mode} controls the models of a --model-repository")
    if load_model and mode != "explicit":
        raise StaronnxError("--load-model goes with --model-control-mode explicit (the other modes load every model)")
    if poll_given and mode != "poll":  # else dropped without a word: only poll mode reads the repository again
        raise StaronnxError(f"--repository-poll-secs sets how often --model-control-mode poll reads the repository "
                            f"again; the mode is {mode}: give --model-control-mode poll or leave it out")
    if mode == "poll" and not poll_secs > 0:
        raise StaronnxError(f"--repository-poll-secs must be above 0, got {poll_secs:g}")
    return mode, set(load_model), poll_secs if mode == "poll" else None


def serve_limits(header_timeout: str, body_timeout: str, body_min_rate: str, idle_timeout: str,
                 request_timeout: str, max_connections: int | None, receive_budget: str | None,
                 grpc_max_streams: int, max_body: int) -> Any:
    """The flags of what each connection and request is held to, as
    :class:`~staronnx.serve.limits.Limits` (the derived ones left 0: filled in at start)."""
    from staronnx.durations import parse_duration
    from staronnx.serve.app import parse_size
    from staronnx.serve.limits import Limits

    if max_connections is not None and max_connections < 1:
        raise StaronnxError(f"--max-connections must be at least 1, got {max_connections}")
    if grpc_max_streams < 1:
        raise StaronnxError(f"--grpc-max-streams must be at least 1, got {grpc_max_streams}")
    rate = 0 if body_min_rate.strip() in ("0", "0B") else parse_size(body_min_rate, "--body-min-rate")
    budget = parse_size(receive_budget, "--receive-budget") if receive_budget is not None else 0
    if budget and budget < max_body:
        raise StaronnxError(f"--receive-budget ({budget} bytes) must hold at least one body of --max-body "
                            f"({max_body} bytes)")
    return Limits(header_timeout=parse_duration(header_timeout, option="--header-timeout"),
                  body_timeout=parse_duration(body_timeout, option="--body-timeout"),
                  body_min_rate=float(rate),
                  idle_timeout=parse_duration(idle_timeout, option="--idle-timeout"),
                  request_timeout=parse_duration(request_timeout, allow_zero=True, option="--request-timeout"),
                  max_connections=max_connections or 0, receive_budget=budget, grpc_max_streams=grpc_max_streams)


#: samples a model's queue holds when --queue-capacity does not say
DEFAULT_QUEUE_CAPACITY = 1024


def queue_capacities(names: list[str], specs: list[str]) -> tuple[dict[str, int], int]:
    """``--queue-capacity`` values (``N`` for every model, ``NAME=N`` for one) per model, and the
    capacity of a model no ``NAME=N`` names (one added to the repository while serving gets it, as
    those there at start do)."""
    given: dict[str, int] = {}  # NAME -> N, and "" -> every model's N
    for item in (s.strip() for spec in specs for s in spec.split(",") if s.strip()):
        name, _, value = item.rpartition("=")
        n = int(value) if value.strip().lstrip("+-").isdigit() else None
        if n is None or n < 1:
            raise StaronnxError(f"--queue-capacity takes N or NAME=N, got {item!r}" if n is None
                                else f"--queue-capacity must be at least 1, got {item!r}")
        given[name] = n
    default = given.pop("", DEFAULT_QUEUE_CAPACITY)
    served_only(given, names, "--queue-capacity")
    return {n: given.get(n, default) for n in names}, default


def refuse_unservable(unavailable: dict[str, str]) -> StaronnxError:
    """--exit-on-error's refusal: the models asked for that cannot be served, each with its reason."""
    return StaronnxError(f"--exit-on-error: {len(unavailable)} model(s) cannot be served: "
                         + "; ".join(f"{n}: {w}" for n, w in unavailable.items()))


def service_targets(names: list[str], slo_ms: list[str], priority: list[str]) -> dict[str, dict[str, Any]]:
    """``--slo-ms``/``--priority`` as {model: ServiceTarget fields}; unknown names refused."""
    from staronnx.runtime.models import parse_targets

    parsed = {}
    for flag, items, field in (("--slo-ms", slo_ms, "latency_ms"), ("--priority", priority, "priority")):
        try:  # the flag named: both read NAME=N, and a bad item alone does not say which flag it came from
            parsed[field] = parse_targets(items, field)
        except StaronnxError as exc:
            raise StaronnxError(f"{flag}: {exc}") from None
    targets = parsed["latency_ms"]
    for name, fields in targets.items():  # said in the ms given, not as the seconds ServiceTarget checks
        ms = fields["latency_ms"]
        if not (math.isfinite(ms) and ms > 0):
            raise StaronnxError(f"--slo-ms {name}={ms:g}: a latency target must be a positive number of ms")
    for name, fields in parsed["priority"].items():
        targets.setdefault(name, {}).update(fields)
    return served_only(targets, names, "--slo-ms/--priority")


def _lowered_text(workers: Sequence[Worker]) -> str:
    """What the start line says of the shared workers that yield to lanes, so an operator sees
    the priorities ``ps``/``top`` will show (or that the OS refused them)."""
    from staronnx.workers.cpu import CpuWorker

    lowered = [w for w in workers if isinstance(w, CpuWorker) and w.lowered]
    if not lowered:
        return ""
    runs = {w.priority or "unchanged (the OS refused)" for w in lowered}
    return f"; {', '.join(w.name for w in lowered)} yield to the lanes ({', '.join(sorted(runs))})"


def driver_text(runtime: Any) -> str:
    """Who launches the CUDA workers' tasks, read off the started runtime: ``1 driver thread for
    2 streams`` (one per GPU) or ``2 driver threads for 2 streams`` (--cuda-thread-per-stream)."""
    from staronnx.runtime.runtime import driver_threads

    drivers = driver_threads(runtime.stats())
    threads, streams = len(set(drivers.values())), len(drivers)
    return f"{threads} driver thread{'s' if threads != 1 else ''} for {streams} stream{'s' if streams != 1 else ''}"


#: the help of the options whose text is too long to stand in the signature
HELP = {
    "cuda_graphs": ("With --cuda-streams: capture CUDA graphs of the batch sizes served (powers of two up to "
                    "--batch-size) at start-up; partial batches are padded up to them."),
    "colocate": ("Run the event loop and the batchers on the CUDA driver thread's core, or without --cuda-streams "
                 "on the first CPU worker's, sharing its compute (StarPU's STARPU_MAIN_THREAD_BIND). They hold the "
                 "GIL in turn with that thread, and a hand-over on one core costs less than one between two; off by "
                 "default, since a driver running ONNX Runtime without CUDA graphs launches kernels without the "
                 "GIL, which the loop then no longer overlaps."),
    "drain_timeout": ("On SIGTERM/SIGINT, how long accepted requests may take to finish; those still queued then "
                      "are answered 503 / UNAVAILABLE."),
    "header_timeout": ("How long a connection has to send a whole request head, from its accept or its first byte "
                       "after a keep-alive pause (nginx's client_header_timeout); also gRPC's handshake."),
    "body_timeout": ("Longest pause in a request body; once it has passed, the body must also average "
                     "--body-min-rate (408, connection closed)."),
    "body_min_rate": ("Bytes per second a request body must average after --body-timeout (a slowloris sending a "
                      "byte a second is closed); 0 = pauses only."),
    "idle_timeout": "How long a keep-alive connection (HTTP) or a connection with no call (gRPC) may idle.",
    "request_timeout": ("Deadline of a whole inference request (body, queue, inference): later, it is withdrawn and "
                        "answered 504 / DEADLINE_EXCEEDED; 0 = none."),
}


BATCH_AXIS_HELP = ("The axis of an input or output that carries the batch, where the model cannot tell: NAME=AXIS "
                   "(state=1), NAME=none for an input without one (a per-request value), MODEL:NAME=AXIS for one "
                   "of several models (repeatable, or a=0,b=1). Unprefixed, it applies to every model with that "
                   "tensor.")


def contract_text(plan: Any) -> str:
    """How a model's requests are batched, for its start line."""
    contract = plan.contract
    if not contract.batchable:
        return f"one request per task (max_batch_size 0): {contract.why_not}"
    off = {n: a for n, a in {**contract.inputs, **contract.outputs}.items() if a != 0}
    if not off:
        return "batched on axis 0"
    return "batched on each tensor's own axis (" + ", ".join(
        f"{n}: {'none, per request' if a is None else a}" for n, a in off.items()) + "; max_batch_size 0)"


REPOSITORY_HELP = ("A Triton model repository to serve (repeatable): <model>/config.pbtxt (optional; completed from "
                   "the model) and <model>/<version>/model.onnx. Each model's plan is cut on load and cached under "
                   "$STARONNX_HOME; a model that cannot be served is listed UNAVAILABLE with its reason, the others "
                   "serve.")


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_cmd)


MODEL_WORKERS_HELP = ("Load a model on some workers only, NAME=WORKERS (repeatable): cpu, cuda, cuda<N> or worker "
                      "names (cpu:numa0, cuda0.s1), comma-separated; the others hold no session of it and the "
                      "policy never places its tasks there (GPU memory, or a GPU kept for another model). "
                      "Default: every worker holds every model.")


def model_residency(items: list[str], names: list[str]) -> dict[str, str]:
    """``--model-workers`` of a mix, as ``staronnx serve`` reads it: NAME=WORKERS items, every
    NAME one of the models (the selectors are checked against the workers when they exist)."""
    from staronnx.workers.residency import parse_model_workers

    return served_only(parse_model_workers(items), names, "--model-workers")


LANE_HELP = ("Give a model a lane, NAME or NAME=CPU_GROUPS (repeatable; default every CPU group): a worker of "
             "its own on each of those groups, pinned to the same cores, that the OS lets preempt the other "
             "models' tasks (the groups' shared workers run at a lower priority), so a light, latency-bound "
             "model never waits for a heavy model's task to end. Pair it with --slo-ms.")


LANE_PREEMPT_HELP = ("How the shared workers of a group with a lane yield to it: idle (SCHED_IDLE: preempted at "
                     "once; any other busy process of the machine also comes first) or nice (nice +10: the "
                     "lane takes 90 % of the core, maybe a scheduler tick late; for machines shared with "
                     "other work).")


def model_lanes(items: list[str], names: list[str]) -> dict[str, str]:
    """``--lane`` items as {model: CPU groups}, every model one that is served."""
    from staronnx.workers.lanes import parse_lanes

    return served_only(parse_lanes(items), names, "--lane")


def event_loop_runner() -> tuple[Any, str]:
    """How the server's event loop runs: uvloop where it is installed (the serve extra brings
    it on Linux and macOS), else asyncio's own loop. grpc.aio's per-call machinery, not
    staronnx's handler, is most of a gRPC request's event-loop time (~250 of ~280 us), and
    uvloop served 9 % more gRPC requests/s for 10 % less server CPU per call on the 2-core
    benchmark host."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.run, "asyncio"
    from uvloop._version import __version__  # what ``uvloop.__version__`` is, without the re-export

    return uvloop.run, f"uvloop {__version__}"
