"""In-process serving vs the same plan behind ``staronnx serve``, side by side, and the server's
tail latency (issue 21).

**googlenet set** (``--suite googlenet``): googlenet cut in two, batch-1 requests from
``--clients`` closed-loop clients, batches of up to ``--batch`` formed by the dynamic batcher
(``--max-delay``). Four paths:

* in-process: ``Server(Runtime(plan))`` and the clients in one process;
* HTTP binary: ``staronnx serve`` in a subprocess, tritonclient.http.aio with binary tensors;
* HTTP JSON: the same server, JSON tensors both ways (the KServe default of most HTTP clients
  and curl): the body tritonclient writes (150,528 FP32 values as text, 3.1 MB), generated once
  as perf_analyzer prepares its requests, posted by aiohttp; each answer parsed by tritonclient;
* gRPC: the same server, tritonclient.grpc.aio.

**tail set** (``--suite tail``): a trivial model (a 2-layer, 16-wide MatMul chain, one part),
batches of up to ``--batch`` with ``--max-delay``, over HTTP binary and gRPC: the capacity at
``--clients`` closed-loop clients, p50/p99 at ``--tail-clients`` (64), and open-loop Poisson
arrivals at 25/50/75 % of the capacity measured in the same round, each with p99/p50 (a request's
latency counts from its scheduled arrival, so a late client does not hide queueing).

Measured fairly on a small machine, where the clients' CPU time competes with the server's:

* every row's load comes from a **client process of its own**, started the same way and running
  the same asyncio loop (closed: ``--clients`` coroutines, each awaiting its answer before
  sending again; in process they await ``Server.submit``'s future, over the network
  tritonclient's aio call), so no path's clients share a GIL with the measuring script; a
  network client freezes its state and leaves its cycle collector off while it measures
  (``quiet_gc``): its own collections would otherwise be most of the p99 it reports;
* the paths are measured **in turn, ``--rounds`` times** (``_common.alternate``), and the
  figures are medians over the rounds, so a machine whose load drifts hits every path alike;
  the ratios are also given per round (each row over the reference row of the same round),
  whose median is the figure the goals are judged on;
* on a machine shared with other work, throughput follows the CPU the others leave, which
  changes within seconds; so each row also measures the **CPU time a sample costs** (the
  client process, plus the server process for the network rows, over the measured window).
  Its ratio (in-process CPU per sample / network CPU per sample) is the share of in-process
  throughput the server keeps when CPU-bound, whatever else runs: the goal's second reading.

The googlenet rows give throughput (samples/s, median over rounds), the ratio to in-process,
p50/p99 latency (over every round's requests) and the latency the network path adds; the closing
lines say whether the goals are met: >= 0.9x in-process at batch 8 for HTTP binary and gRPC,
HTTP JSON >= 0.95x HTTP binary's requests/s. The tail rows close with issue 21's goals: p99 at 64
clients <= 30 ms (HTTP) and <= 40 ms (gRPC), open-loop p99 <= 5x p50 up to 75 % of capacity.

    .venv/bin/python benchmarks/serve.py [--suite all|googlenet|tail] [--seconds 8] [--tail-seconds 5]
        [--rounds 3] [--clients 16] [--tail-clients 64] [--batch 8] [--max-delay 2ms] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GOOGLENET, ServeProcess, alternate, scratch_dir, start_serve  # noqa: E402
from staronnx.partition import PartitionSpec

PATHS = ("in-process", "HTTP binary", "HTTP JSON", "gRPC")
GOAL = 0.9
#: issue 21: JSON tensors serve at least this share of binary HTTP's requests/s on googlenet
JSON_GOAL = 0.95
#: the network paths of the tail-latency set (trivial model)
TAIL_PATHS = ("HTTP binary", "gRPC")
#: open-loop points of the tail set, as fractions of the capacity measured in the same round
OPEN_FRACTIONS = (0.25, 0.5, 0.75)
#: issue 21's tail goals: p99 at 64 closed-loop clients (ms) and open-loop p99/p50
TAIL_P99_MS = {"HTTP binary": 30.0, "gRPC": 40.0}
TAIL_RATIO = 5.0
#: the trivial model's width (input x and output y are [batch, TRIVIAL_WIDTH])
TRIVIAL_WIDTH = 16


# -- the client process (one per row and round) -------------------------------------------------
def cpu_split(pid: int | None) -> tuple[float, float]:
    """(this process's CPU seconds so far, process ``pid``'s; 0 without one): which side of a
    network row a sample's CPU goes to, the client's or the server's."""
    own = time.process_time()
    if not pid:
        return own, 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return own, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_figures(cpu: list[tuple[float, float]], samples: int) -> dict[str, float]:
    """CPU seconds over the window and ms per sample, in all and split client / server."""
    client = cpu[-1][0] - cpu[0][0]
    server = cpu[-1][1] - cpu[0][1]
    n = max(samples, 1)
    return {"cpu_s": client + server, "cpu_ms_per_sample": (client + server) * 1e3 / n,
            "client_cpu_ms_per_sample": client * 1e3 / n, "server_cpu_ms_per_sample": server * 1e3 / n}


def served_counts(metrics_url: str, model: str = "googlenet") -> tuple[float, float]:
    """(samples, batches) the server has run so far, from its Triton counters."""
    import urllib.request

    if not metrics_url:
        return 0.0, 0.0
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    counts = {m.group(1): float(m.group(2))
              for m in re.finditer(r'^nv_inference_(count|exec_count)\{model="' + re.escape(model) + r'"[^}]*\} (\S+)$',
                                   text, re.M)}
    return counts.get("count", 0.0), counts.get("exec_count", 0.0)


async def closed_loop(call: Callable[[], Awaitable[None]], clients: int, seconds: float,
                      warmup: float, server_pid: int | None = None,
                      batches: Callable[[], tuple[float, float]] | None = None) -> dict[str, object]:
    """``clients`` coroutines calling ``call()`` back to back; samples/s and latencies (s) measured
    over ``seconds`` after ``warmup`` (a request counts if it started and ended inside), and the
    CPU seconds this process and the server's spent in that window (``cpu_s``): what a sample
    costs in CPU, which other load on the machine does not change the way it changes throughput."""
    loop = asyncio.get_running_loop()
    start_at = loop.time() + warmup
    stop_at = start_at + seconds
    lats: list[float] = []
    cpu: list[tuple[float, float]] = []
    counted: list[tuple[float, float]] = []

    async def meter() -> None:
        for at in (start_at, stop_at):
            await asyncio.sleep(max(at - loop.time(), 0.0))
            cpu.append(cpu_split(server_pid))
            if batches is not None:
                counted.append(batches())

    async def client() -> None:
        while True:
            t0 = loop.time()
            if t0 >= stop_at:
                return
            await call()
            t1 = loop.time()
            if t0 >= start_at and t1 <= stop_at:
                lats.append(t1 - t0)

    await asyncio.gather(meter(), *(client() for _ in range(clients)))
    mean_batch = float("nan")
    if len(counted) == 2 and counted[1][1] > counted[0][1]:
        mean_batch = (counted[1][0] - counted[0][0]) / (counted[1][1] - counted[0][1])
    return {"throughput": len(lats) / seconds, "latencies": lats, **_cpu_figures(cpu, len(lats)),
            "mean_batch": mean_batch}


async def open_loop(call: Callable[[], Awaitable[None]], rate: float, seconds: float, warmup: float,
                    server_pid: int | None = None, seed: int = 0) -> dict[str, object]:
    """Poisson arrivals at ``rate`` requests/s, each sent at its scheduled time whatever is still
    outstanding; a request's latency runs from its *scheduled* arrival (a client running late
    does not hide queueing), counted if scheduled inside the measured window.

    A request the server refuses is counted in ``failed``, not raised: on a machine whose
    neighbours take CPU mid-row, a rate set from the capacity measured a moment before can
    exceed what the server has now, and an overloaded gRPC server's core cancels calls past
    its backlog limit (CANCELLED); one refusal used to end the whole row, and the run."""
    loop = asyncio.get_running_loop()
    rng = np.random.default_rng(seed)
    start_at = loop.time() + warmup
    stop_at = start_at + seconds
    lats: list[float] = []
    tasks: set[asyncio.Task[None]] = set()
    cpu: list[tuple[float, float]] = []
    failed = 0

    async def one(at: float) -> None:
        nonlocal failed
        try:
            await call()
        except Exception:  # noqa: BLE001 - a refusal (503, UNAVAILABLE, CANCELLED): counted, reported
            if start_at <= at < stop_at:
                failed += 1
            return
        if start_at <= at < stop_at:
            lats.append(loop.time() - at)

    at = loop.time()
    measuring = False
    while at < stop_at:
        at += float(rng.exponential(1.0 / rate))
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if not measuring and at >= start_at:
            measuring = True
            cpu.append(cpu_split(server_pid))
        task = asyncio.create_task(one(at))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    cpu.append(cpu_split(server_pid))
    await asyncio.gather(*tasks)
    sent = len(lats)
    return {"throughput": sent / seconds, "latencies": lats, **_cpu_figures(cpu, sent), "mean_batch": float("nan"),
            "failed": failed}


def quiet_gc() -> None:
    """Keep the load generator's own cycle collections out of the latencies it measures.

    A Python client pays for the objects of every request in flight: with its collector on,
    a 64-client closed loop saw full collections of 17-19 ms, and an open loop at 1,500 req/s
    spent 2.5 of its 6 s collecting (pauses up to 0.5 s), so its "latency" was its own. The
    client's state is frozen and the collector left off for the few seconds of a row (reference
    counting still frees every request's objects); the server, which is what is measured, keeps
    its collector as it would in production. perf_analyzer, Triton's load generator, has no
    collector at all.
    """
    gc.collect()
    gc.freeze()
    gc.disable()


def client_main(args: argparse.Namespace) -> int:
    """Run one row's load and print its figures as one JSON line."""
    if args.model_name == "trivial":
        x = np.random.default_rng(0).standard_normal((1, TRIVIAL_WIDTH)).astype(np.float32)
        in_name, out_name = "x", "y"
    else:
        x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
        in_name, out_name = "input", "logits"
    model = args.model_name

    async def drive(call: Callable[[], Awaitable[None]]) -> dict[str, object]:
        quiet_gc()
        if args.rate:
            return await open_loop(call, args.rate, args.seconds, args.warmup, args.server_pid)
        return await closed_loop(call, args.clients, args.seconds, args.warmup, args.server_pid,
                                 lambda: served_counts(args.metrics, model))

    async def in_process() -> dict[str, object]:
        from staronnx.durations import parse_duration
        from staronnx.runtime.runtime import Runtime
        from staronnx.runtime.spec import RuntimeSpec
        from staronnx.workers.layout import MachineSpec
        from staronnx.serving import ServeSpec, Server

        with Runtime(args.plan, MachineSpec(groups=args.groups), RuntimeSpec(policy=args.policy)) as rt, \
                Server(rt, ServeSpec(args.batch, max_delay=parse_duration(args.max_delay, allow_zero=True))) as server:
            async def call() -> None:
                await asyncio.wrap_future(server.submit({"input": x}))

            def counts() -> tuple[float, float]:  # the server's records, as the Triton counters count
                records = server.records()
                done = [b for b in records.batches if b.done is not None]
                return float(sum(b.size for b in done)), float(len(done))
            return await closed_loop(call, args.clients, args.seconds, args.warmup, args.server_pid, counts)

    async def http() -> dict[str, object]:
        import tritonclient.http as thttp
        import tritonclient.http.aio as aio

        inp = thttp.InferInput(in_name, list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        out = [thttp.InferRequestedOutput(out_name, binary_data=True)]
        limit = 1024 if args.rate else args.clients
        async with aio.InferenceServerClient(args.address, conn_limit=limit) as client:
            async def call() -> None:
                (await client.infer(model, [inp], outputs=out)).as_numpy(out_name)
            return await drive(call)

    async def http_json() -> dict[str, object]:
        """JSON tensors both ways. The body is the one tritonclient sends (``data`` a flat list of
        the input's values), generated once, as perf_analyzer prepares its requests: the client's
        own ``json.dumps`` of 150,528 floats per call (~40 ms) would measure the client; the
        response is parsed per call by tritonclient (``as_numpy``), as a client must."""
        import aiohttp
        import tritonclient.http as thttp
        import tritonclient.http.aio as aio

        inp = thttp.InferInput(in_name, list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=False)
        out = [thttp.InferRequestedOutput(out_name, binary_data=False)]
        body, json_size = aio.InferenceServerClient.generate_request_body([inp], outputs=out)
        assert json_size is None  # all JSON: no binary tail
        url = f"http://{args.address}/v2/models/{model}/infer"
        headers = {"Content-Type": "application/json"}
        connector = aiohttp.TCPConnector(limit=1024 if args.rate else args.clients)
        async with aiohttp.ClientSession(connector=connector) as session:
            async def call() -> None:
                async with session.post(url, data=body, headers=headers) as resp:
                    text = await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {text[:200]!r}")
                aio.InferenceServerClient.parse_response_body(text).as_numpy(out_name)
            return await drive(call)

    async def grpc() -> dict[str, object]:
        import tritonclient.grpc as tgrpc
        import tritonclient.grpc.aio as aio

        inp = tgrpc.InferInput(in_name, list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        async with aio.InferenceServerClient(args.address) as client:
            async def call() -> None:
                (await client.infer(model, [inp])).as_numpy(out_name)
            return await drive(call)

    result = asyncio.run({"in-process": in_process, "HTTP binary": http, "HTTP JSON": http_json,
                          "gRPC": grpc}[args.client]())
    print(json.dumps(result))
    return 0


# -- the driver ------------------------------------------------------------------------------
def start_server(plan: Path, args: argparse.Namespace, name: str = "googlenet") -> ServeProcess:
    cmd = [sys.executable, "-m", "staronnx", "serve", str(plan), "--name", name, "--http-port", "0",
           "--grpc-port", "0", "--metrics-port", "0", "--batch-size", str(args.batch), "--max-delay", args.max_delay,
           "--groups", args.groups, "--policy", args.policy, "--gc-interval", args.gc_interval,
           *(["--cuda-streams", str(args.cuda_streams)] if args.cuda_streams else []),
           *(["--colocate"] if args.colocate else [])]
    # the served plan is a scratch one: its perf models go to a scratch home beside it, not
    # into the user's ~/.cache/staronnx (a benchmark must leave the machine as it found it)
    env = {**os.environ, "STARONNX_HOME": str(plan.parent / "staronnx-home")}
    return start_serve(cmd, env)


def run_client(path: str, plan: Path, address: str, args: argparse.Namespace,
               server_pid: int | None, metrics: str, *, model: str = "googlenet", clients: int | None = None,
               rate: float = 0.0, seconds: float | None = None) -> dict[str, object]:
    cmd = [sys.executable, __file__, "--client", path, "--plan", str(plan), "--address", address,
           *(["--server-pid", str(server_pid), "--metrics", metrics] if server_pid else []),
           "--seconds", str(seconds or args.seconds), "--warmup", str(args.warmup),
           "--clients", str(clients or args.clients), "--rate", str(rate), "--model-name", model,
           "--batch", str(args.batch), "--max-delay", args.max_delay, "--groups", args.groups,
           "--policy", args.policy]
    env = {**os.environ, "STARONNX_HOME": str(Path(plan).parent / "staronnx-home")}  # as start_server's
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{path} client failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def percentiles(runs: list[dict[str, object]]) -> tuple[float, float]:
    """p50 and p99 (ms) over every round's requests."""
    lat = np.concatenate([np.asarray(r["latencies"], dtype=float) for r in runs]) if runs else np.zeros(1)
    if lat.size == 0:
        return float("nan"), float("nan")
    return float(np.percentile(lat, 50) * 1e3), float(np.percentile(lat, 99) * 1e3)


def googlenet_suite(args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, float]]:
    """In-process, HTTP binary, HTTP JSON and gRPC on googlenet, in turn, ``--rounds`` times."""
    from staronnx import partition

    plan = partition(args.model, [0.85, 0.15], PartitionSpec(costs="estimate"), output_dir=tmp / "plan")
    print(f"googlenet, {plan.k} parts, batch-1 requests from {args.clients} closed-loop clients (own process per "
          f"row), batches of up to {args.batch} (max delay {args.max_delay}), {args.seconds:g} s per row, "
          f"{args.rounds} rounds in turn, {os.cpu_count()} cores", flush=True)

    served = start_server(plan.root, args)
    addresses = {"in-process": "", "HTTP binary": served.http, "HTTP JSON": served.http, "gRPC": served.grpc}
    runs: dict[str, list[dict[str, object]]] = {p: [] for p in PATHS}

    def measure(path: str) -> Callable[[], float]:
        def once() -> float:
            r = run_client(path, plan.root, addresses[path], args, None if path == "in-process" else served.proc.pid,
                           served.metrics)
            runs[path].append(r)
            print(f"  round {len(runs[path])}: {path:<12} {r['throughput']:8.1f} samples/s, "
                  f"{r['cpu_ms_per_sample']:6.1f} CPU ms/sample (client {r['client_cpu_ms_per_sample']:.1f}, "
                  f"server {r['server_cpu_ms_per_sample']:.1f}), mean batch {r['mean_batch']:.1f}", flush=True)
            return float(r["throughput"])
        return once

    try:
        medians = alternate({p: measure(p) for p in PATHS}, args.rounds)
    finally:
        rc = served.stop(60)

    base = medians["in-process"]
    b50, b99 = percentiles(runs["in-process"])
    report: dict[str, dict[str, float]] = {}
    base_cpu = statistics.median(float(r["cpu_ms_per_sample"]) for r in runs["in-process"])
    print(f"\n{'path':<12} {'samples/s':>10} {'x in-proc':>10} {'x per round':>12} {'CPU ms/smp':>11} "
          f"{'x by CPU':>9} {'batch':>6} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8}")
    for path in PATHS:
        p50, p99 = percentiles(runs[path])
        per_round = statistics.median(float(r["throughput"]) / float(b["throughput"])
                                      for r, b in zip(runs[path], runs["in-process"]))
        cpu = statistics.median(float(r["cpu_ms_per_sample"]) for r in runs[path])
        client_cpu = statistics.median(float(r["client_cpu_ms_per_sample"]) for r in runs[path])
        server_cpu = statistics.median(float(r["server_cpu_ms_per_sample"]) for r in runs[path])
        batch = statistics.median(float(r["mean_batch"]) for r in runs[path])
        report[path] = {"throughput": medians[path], "ratio": medians[path] / base, "ratio_per_round": per_round,
                        "cpu_ms_per_sample": cpu, "client_cpu_ms_per_sample": client_cpu,
                        "server_cpu_ms_per_sample": server_cpu, "ratio_by_cpu": base_cpu / cpu, "mean_batch": batch,
                        "p50_ms": p50, "p99_ms": p99, "added_p50_ms": p50 - b50, "added_p99_ms": p99 - b99,
                        "rounds": [float(r["throughput"]) for r in runs[path]]}
        print(f"{path:<12} {medians[path]:>10.1f} {medians[path] / base:>10.2f} {per_round:>12.2f} {cpu:>11.1f} "
              f"{base_cpu / cpu:>9.2f} {batch:>6.1f} {p50:>8.1f} "
              f"{p99:>8.1f} {p50 - b50:>+8.1f} {p99 - b99:>+8.1f}")
    print(f"\nserver exit code after SIGTERM: {rc}")
    for path in ("HTTP binary", "gRPC"):
        ratio, by_cpu = report[path]["ratio_per_round"], report[path]["ratio_by_cpu"]
        print(f"goal (>= {GOAL}x in-process at batch {args.batch}): {path} {ratio:.2f}x throughput per round "
              f"({'met' if ratio >= GOAL else 'NOT met'}), {by_cpu:.2f}x by CPU per sample "
              f"({'met' if by_cpu >= GOAL else 'NOT met'})")
    # JSON tensors against binary HTTP, round by round (issue 21)
    json_round = statistics.median(float(j["throughput"]) / float(b["throughput"])
                                   for j, b in zip(runs["HTTP JSON"], runs["HTTP binary"]))
    json_cpu = report["HTTP binary"]["cpu_ms_per_sample"] / report["HTTP JSON"]["cpu_ms_per_sample"]
    report["HTTP JSON"]["ratio_to_binary_per_round"] = json_round
    report["HTTP JSON"]["ratio_to_binary_by_cpu"] = json_cpu
    print(f"goal (JSON >= {JSON_GOAL}x binary HTTP): {json_round:.2f}x requests/s per round "
          f"({'met' if json_round >= JSON_GOAL else 'NOT met'}), {json_cpu:.2f}x by CPU per sample "
          f"({'met' if json_cpu >= JSON_GOAL else 'NOT met'})")
    # where JSON's extra CPU goes (medians of the rounds): the server's share is staronnx's to cut
    extra = {side: report["HTTP JSON"][f"{side}_cpu_ms_per_sample"] - report["HTTP binary"][f"{side}_cpu_ms_per_sample"]
             for side in ("client", "server")}
    print(f"JSON's extra CPU per sample over binary HTTP: {sum(extra.values()):+.1f} ms "
          f"(client {extra['client']:+.1f}, server {extra['server']:+.1f})")
    return report


def trivial_plan(tmp: Path) -> Path:
    """A one-part plan of a two-layer 16-wide MatMul chain: serving overhead, not compute."""
    import onnx

    from staronnx import partition
    from staronnx.zoo import chain

    model = tmp / "trivial.onnx"
    onnx.save(chain(depth=2, width=TRIVIAL_WIDTH), model)
    return partition(model, [1.0], PartitionSpec(costs="estimate"), output_dir=tmp / "trivial-plan").root


def tail_suite(args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, float]]:
    """Issue 21's tail set on the trivial model, per protocol and round: the capacity at
    ``--clients`` closed-loop clients, the latency at ``--tail-clients``, and open-loop Poisson
    points at 25/50/75 % of the capacity just measured."""
    plan = trivial_plan(tmp)
    print(f"tail set: trivial model (chain 2 x {TRIVIAL_WIDTH}), batches of up to {args.batch} (max delay "
          f"{args.max_delay}), closed loop at {args.clients} and {args.tail_clients} clients, open loop at "
          f"{', '.join(f'{f:.0%}' for f in OPEN_FRACTIONS)} of capacity, {args.tail_seconds:g} s per row, "
          f"{args.rounds} rounds in turn", flush=True)
    served = start_server(plan, args, name="trivial")
    addresses = {"HTTP binary": served.http, "gRPC": served.grpc}
    rows = [f"closed {args.clients}", f"closed {args.tail_clients}", *(f"open {f:.0%}" for f in OPEN_FRACTIONS)]
    runs: dict[tuple[str, str], list[dict[str, object]]] = {(p, r): [] for p in TAIL_PATHS for r in rows}

    def measure(path: str) -> Callable[[], float]:
        def once() -> float:
            def row(name: str, **kw: object) -> dict[str, object]:
                r = run_client(path, plan, addresses[path], args, served.proc.pid, served.metrics, model="trivial",
                               seconds=args.tail_seconds, **kw)
                runs[(path, name)].append(r)
                p50, p99 = percentiles([r])
                print(f"  round {len(runs[(path, name)])}: {path:<12} {name:<11} {r['throughput']:8.1f} req/s "
                      f"p50 {p50:6.2f} ms p99 {p99:6.2f} ms"
                      + (f", {r['failed']} refused (server overloaded)" if r.get("failed") else ""), flush=True)
                return r
            capacity = float(row(rows[0], clients=args.clients)["throughput"])
            row(rows[1], clients=args.tail_clients)
            for f, name in zip(OPEN_FRACTIONS, rows[2:]):
                row(name, rate=max(f * capacity, 1.0))
            return capacity
        return once

    try:
        alternate({p: measure(p) for p in TAIL_PATHS}, args.rounds)
    finally:
        rc = served.stop(60)
    report: dict[str, dict[str, float]] = {}
    print(f"\n{'path':<12} {'row':<11} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'p99/p50':>8} {'refused':>8} "
          f"{'client us/req':>14} {'server us/req':>14}")
    for path in TAIL_PATHS:
        for name in rows:
            rs = runs[(path, name)]
            p50, p99 = percentiles(rs)
            tput = statistics.median(float(r["throughput"]) for r in rs)
            failed = sum(int(r.get("failed", 0)) for r in rs)
            # where the CPU of a request goes (client process, server process), over the measured
            # window: an open-loop client that costs more per request than a closed one leaves the
            # server less of the machine than the capacity row had
            client_us = statistics.median(float(r.get("client_cpu_ms_per_sample", math.nan)) * 1e3 for r in rs)
            server_us = statistics.median(float(r.get("server_cpu_ms_per_sample", math.nan)) * 1e3 for r in rs)
            report[f"{path} / {name}"] = {"throughput": tput, "p50_ms": p50, "p99_ms": p99, "p99_over_p50": p99 / p50,
                                          "failed": failed, "rounds": [float(r["throughput"]) for r in rs],
                                          "client_cpu_us_per_request": client_us,
                                          "server_cpu_us_per_request": server_us}
            print(f"{path:<12} {name:<11} {tput:>9.1f} {p50:>8.2f} {p99:>8.2f} {p99 / p50:>8.1f} {failed:>8d} "
                  f"{client_us:>14.0f} {server_us:>14.0f}")
    print(f"\nserver exit code after SIGTERM: {rc}")
    for path in TAIL_PATHS:
        p99 = report[f"{path} / {rows[1]}"]["p99_ms"]
        worst = max(report[f"{path} / {n}"]["p99_over_p50"] for n in rows[2:])
        print(f"goal ({path}): p99 at {args.tail_clients} clients {p99:.1f} ms <= {TAIL_P99_MS[path]:g} "
              f"({'met' if p99 <= TAIL_P99_MS[path] else 'NOT met'}); open-loop p99/p50 up to 75 % "
              f"{worst:.1f} <= {TAIL_RATIO:g} ({'met' if worst <= TAIL_RATIO else 'NOT met'})")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=GOOGLENET)
    ap.add_argument("--suite", choices=("googlenet", "tail", "all"), default="all",
                    help="googlenet: the four paths on googlenet; tail: the tail-latency set on a trivial model")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per row and round")
    ap.add_argument("--tail-seconds", type=float, default=5.0, help="measured seconds per row of the tail set")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the rows, taken in turn")
    ap.add_argument("--clients", type=int, default=16, help="closed-loop clients (>= 2 x batch fills batches)")
    ap.add_argument("--tail-clients", type=int, default=64, help="closed-loop clients of the tail set's latency row")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-delay", default="2ms")
    ap.add_argument("--groups", default="numa")
    ap.add_argument("--policy", default="heft")
    ap.add_argument("--gc-interval", default="30s",
                    help="the server's --gc-interval (0: Python's own collector thresholds, to compare)")
    ap.add_argument("--cuda-streams", type=int, default=0,
                    help="CUDA workers of the server (STARONNX_CUDA_RUNTIME=host runs them on the CPU)")
    ap.add_argument("--colocate", action="store_true",
                    help="the server's event loop and batchers on the CUDA driver's core (serve --colocate)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--client", choices=PATHS, help=argparse.SUPPRESS)  # internal: one row's load
    ap.add_argument("--plan", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--address", default="", help=argparse.SUPPRESS)
    ap.add_argument("--server-pid", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--metrics", default="", help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)  # open loop at this rate
    ap.add_argument("--model-name", default="googlenet", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        return client_main(args)
    tmp = scratch_dir("staronnx-serve-bench-")
    out: dict[str, object] = {"settings": {k: str(v) for k, v in vars(args).items()}}
    if args.suite in ("googlenet", "all"):
        if args.model.exists():
            out["rows"] = googlenet_suite(args, tmp)
        else:
            print(f"skipped: {args.model} not found")
    if args.suite in ("tail", "all"):
        if args.suite == "all":
            print()
        out["tail"] = tail_suite(args, tmp)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
