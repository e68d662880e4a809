"""``staronnx serve`` against hostile and careless clients (issue 36), on loopback only.

Four probes, each against a server of its own (``python -m staronnx serve`` in a subprocess on
free ports of 127.0.0.1), each bounded in count and time:

* **memory**: ``--connections`` connections (500) each announce a 64 MiB body to the repository
  index (no model name needed), half of them then silent, half sending a byte a second; the
  server's RSS before and while they are held (goal: < 200 MB more than idle), and the service
  well-behaved clients get meanwhile (``--good-clients`` closed-loop HTTP clients in a process of
  their own, tiny model): p50/p99 and errors, unloaded then loaded (goal: p99 within 2x, 0 errors);
* **closing**: with ``--timeout`` (2 s) as the header, body and keep-alive timeouts, an equal
  share of the connections of each kind (silent after the accept, silent after one keep-alive
  request, a head at a byte a second, a 64 MiB body announced and never sent, a body at a byte
  a second): when each was closed (goal: the configured timeout), and the well-behaved clients'
  service meanwhile (same goal);
* **drain**: ``--drain-runs`` (5) SIGTERM runs per protocol: ``--drain-clients`` (32)
  closed-loop clients send 64-sample requests to a model of a few ms a sample (their queue far
  longer than ``--drain-timeout``, 1 s), the server gets SIGTERM after 2 s, the clients go on
  until it is gone; each request answered, refused (503 / UNAVAILABLE from the server), refused
  a connection (the listener closed: never accepted) or dropped (a reset, a close without an
  answer, CANCELLED or any other error). Goal: dropped = 0;
* **rapid reset**: one connection sends HTTP/2 HEADERS + RST_STREAM pairs for ``--flood-seconds``
  while 8 gRPC clients call the tiny model in closed loop (goal: 0 of their calls failed), and
  2,000 concurrent calls on one channel (goal: all answered).

    .venv/bin/python benchmarks/serve_abuse.py [--connections 500] [--timeout 2] [--drain-runs 5]
        [--drain-clients 32] [--flood-seconds 8] [--seconds 5] [--rounds 2] [--good-clients 8]
        [--probes memory,closing,drain,reset] [--json out.json]

The well-behaved clients are measured unloaded then loaded, ``--rounds`` times in turn, and the
goal is judged on the median ratio (this machine is shared: a single pair is noise).

The default run takes about 2-3 minutes on a 2-core machine; every count and duration scales
with its option.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import selectors
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ServeProcess, scratch_dir, start_serve  # noqa: E402
from staronnx.partition import PartitionSpec

HOST = "127.0.0.1"
ANNOUNCE = b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nContent-Length: 67108864\r\n\r\n"
#: samples per drain request, and the slow model's width
DRAIN_ROWS, WIDTH = 64, 256


# -- models and servers ------------------------------------------------------------------------
def build_plans(root: Path) -> dict[str, Path]:
    """The tiny model (2 MatMuls, 8 wide) and the slow one (160 MatMuls of one 256x256 weight)."""
    import onnx
    from onnx import TensorProto, helper

    from staronnx import partition
    from staronnx.zoo import chain

    onnx.save(chain(depth=2, width=8), str(root / "tiny.onnx"))
    w = helper.make_tensor("w", TensorProto.FLOAT, [WIDTH, WIDTH],
                           (np.random.default_rng(0).standard_normal((WIDTH, WIDTH)) / WIDTH).astype(np.float32).ravel())
    nodes, prev = [], "x"
    for i in range(160):
        nodes.append(helper.make_node("MatMul", [prev, "w"], [f"h{i}" if i < 159 else "y"]))
        prev = f"h{i}"
    graph = helper.make_graph(nodes, "slow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(root / "slow.onnx"))
    out = {}
    for name in ("tiny", "slow"):
        plan = partition(root / f"{name}.onnx", spec=PartitionSpec(parts=1, method="linear", costs="estimate"),
                         output_dir=root / name)
        out[name] = Path(plan.root)
    return out


def start(plan: Path, name: str, home: Path, *args: str) -> ServeProcess:
    cmd = [sys.executable, "-m", "staronnx", "serve", str(plan), "--name", name, "--host", HOST, "--http-port", "0",
           "--grpc-port", "0", "--metrics-port", "0", "--policy", "eager", "--groups", "0", *args]
    return start_serve(cmd, {**os.environ, "STARONNX_HOME": str(home)})


# -- well-behaved clients (a process of their own) ---------------------------------------------
TINY_BODY = json.dumps({"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32",
                                    "data": [0.25 * i for i in range(8)]}]}).encode()


async def _good_clients(port: int, clients: int, seconds: float) -> dict[str, Any]:
    import aiohttp

    url = f"http://{HOST}:{port}/v2/models/tiny/infer"
    lat: list[float] = []
    errors: list[str] = []
    end = time.perf_counter() + seconds

    async def one() -> None:
        async with aiohttp.ClientSession() as session:
            while time.perf_counter() < end:
                t = time.perf_counter()
                try:
                    async with session.post(url, data=TINY_BODY, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                        await resp.read()
                        if resp.status != 200:
                            errors.append(f"HTTP {resp.status}")
                            continue
                except Exception as exc:  # noqa: BLE001 - every failure is an error of the service
                    errors.append(type(exc).__name__)
                    continue
                lat.append(time.perf_counter() - t)

    await asyncio.gather(*(one() for _ in range(clients)))
    lat.sort()
    pick = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3) if lat else (lambda q: float("nan"))
    return {"n": len(lat), "errors": len(errors), "first_error": errors[0] if errors else "", "p50_ms": pick(0.5),
            "p99_ms": pick(0.99)}


def good_clients(port: int, clients: int, seconds: float) -> subprocess.Popen:
    """Start the well-behaved clients; ``finish`` reads their figures."""
    return subprocess.Popen([sys.executable, __file__, "--client", str(port), str(clients), str(seconds)],
                            stdout=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=300)
    return json.loads(out.strip().splitlines()[-1])


# -- hostile connections -----------------------------------------------------------------------
@dataclass
class Conn:
    kind: str
    sock: socket.socket
    opened: float
    slow: bytes = b""  # what it trickles, a byte a second
    sent: int = 0
    reply: bytes = b""
    answered: float | None = None  # when the server's first bytes came
    closed: float | None = None


def open_conns(port: int, kinds: dict[str, int]) -> list[Conn]:
    """Connections of each kind: ``silent`` (nothing after the accept), ``keepalive`` (one
    request answered, then nothing), ``slow_head`` (a head at a byte a second), ``announce`` (a
    64 MiB body announced, nothing sent), ``slow_body`` (the same, a byte a second)."""
    conns = []
    for kind, n in kinds.items():
        for _ in range(n):
            s = socket.create_connection((HOST, port), timeout=30)
            c = Conn(kind, s, time.monotonic())
            if kind == "keepalive":
                s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
                s.recv(65536)
                c.opened = time.monotonic()
            elif kind == "slow_head":
                c.slow = b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100000
            elif kind in ("announce", "slow_body"):
                s.sendall(ANNOUNCE)
                c.slow = b" " * 100000 if kind == "slow_body" else b""
            s.setblocking(False)
            conns.append(c)
    return conns


class Watcher:
    """A thread that trickles each slow connection's bytes (one a second) and notes when the
    server answers and closes each connection."""

    def __init__(self, conns: list[Conn]) -> None:
        self.conns = conns
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for c in self.conns:
            sel.register(c.sock, selectors.EVENT_READ, c)
        next_tick = time.monotonic()
        while not self.stop.is_set() and sel.get_map():
            now = time.monotonic()
            if now >= next_tick:
                for c in self.conns:
                    if c.closed is None and c.slow and c.sent < len(c.slow):
                        try:
                            c.sock.send(c.slow[c.sent:c.sent + 1])
                            c.sent += 1
                        except OSError:
                            pass
                next_tick = now + 1.0
            for key, _ in sel.select(timeout=max(0.0, min(0.2, next_tick - time.monotonic()))):
                c = key.data
                try:
                    data = c.sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if data:
                    if c.answered is None:
                        c.answered = time.monotonic()
                    c.reply += data
                    continue
                c.closed = time.monotonic()
                sel.unregister(c.sock)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for c in self.conns:
            c.sock.close()


# -- probes --------------------------------------------------------------------------------------
def probe_memory(plans: dict[str, Path], home: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``--rounds`` rounds, each the well-behaved clients unloaded, then with the connections held."""
    s = start(plans["tiny"], "tiny", home)
    rounds = []
    try:
        finish(good_clients(s.port("http"), args.good_clients, 1.0))  # warm-up
        idle = s.rss_mb()
        peak, still_open, n = idle, 0, 0
        for _ in range(args.rounds):
            unloaded = finish(good_clients(s.port("http"), args.good_clients, args.seconds))
            conns = open_conns(s.port("http"), {"announce": args.connections // 2,
                                                "slow_body": args.connections - args.connections // 2})
            watch = Watcher(conns)
            time.sleep(1.0)
            clients = good_clients(s.port("http"), args.good_clients, args.seconds)
            while clients.poll() is None:
                peak = max(peak, s.rss_mb())
                time.sleep(0.1)
            loaded = finish(clients)
            still_open = min(still_open, sum(c.closed is None for c in conns)) if n else sum(c.closed is None
                                                                                              for c in conns)
            n = len(conns)
            watch.close()
            rounds.append((unloaded, loaded))
    finally:
        s.stop()
    return {"idle_mb": idle, "peak_mb": peak, "rounds": rounds, "connections": n, "still_open": still_open}


def probe_closing(plans: dict[str, Path], home: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``--rounds`` rounds, each the well-behaved clients unloaded, then while a fresh set of
    hostile connections of every kind is opened and closed by the server."""
    t = f"{args.timeout:g}s"
    s = start(plans["tiny"], "tiny", home, "--header-timeout", t, "--body-timeout", t, "--idle-timeout", t)
    kinds = ("silent", "keepalive", "slow_head", "announce", "slow_body")
    share = max(1, args.connections // len(kinds))
    conns: list[Conn] = []
    rounds = []
    try:
        finish(good_clients(s.port("http"), args.good_clients, 1.0))
        for _ in range(args.rounds):
            unloaded = finish(good_clients(s.port("http"), args.good_clients, args.seconds))
            clients = good_clients(s.port("http"), args.good_clients, args.seconds)
            mine = open_conns(s.port("http"), {k: share for k in kinds})
            watch = Watcher(mine)
            loaded = finish(clients)
            deadline = time.monotonic() + args.timeout * 4 + 10
            while any(c.closed is None for c in mine) and time.monotonic() < deadline:
                time.sleep(0.1)
            watch.close()
            conns += mine
            rounds.append((unloaded, loaded))
    finally:
        s.stop()
    rows = {}
    for kind in kinds:
        mine = [c for c in conns if c.kind == kind]
        times = sorted(c.closed - c.opened for c in mine if c.closed is not None)
        answers = sorted(c.answered - c.opened for c in mine if c.answered is not None)
        rows[kind] = {"n": len(mine), "closed": len(times), "answered_408": sum(c.reply.startswith(b"HTTP/1.1 408")
                                                                                for c in mine),
                      "answer_median_s": statistics.median(answers) if answers else float("nan"),
                      "min_s": times[0] if times else float("nan"),
                      "median_s": statistics.median(times) if times else float("nan"),
                      "max_s": times[-1] if times else float("nan")}
    return {"timeout_s": args.timeout, "rows": rows, "rounds": rounds}


def _http_body() -> tuple[bytes, dict[str, str]]:
    raw = np.full((DRAIN_ROWS, WIDTH), 0.5, np.float32).tobytes()
    head = json.dumps({"inputs": [{"name": "x", "shape": [DRAIN_ROWS, WIDTH], "datatype": "FP32",
                                   "parameters": {"binary_data_size": len(raw)}}],
                       "parameters": {"binary_data_output": True}}).encode()
    return head + raw, {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}


async def _drain_http(port: int, clients: int, sigterm: Any) -> list[str]:
    import aiohttp

    body, headers = _http_body()
    url = f"http://{HOST}:{port}/v2/models/slow/infer"
    outcomes: list[str] = []
    gone = asyncio.Event()

    async def one() -> None:
        session = aiohttp.ClientSession()
        try:
            while not gone.is_set():
                try:
                    async with session.post(url, data=body, headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=120)) as resp:
                        await resp.read()
                        outcomes.append("answered" if resp.status == 200 else
                                        "refused" if resp.status == 503 else f"HTTP {resp.status}")
                except aiohttp.ClientConnectorError:  # the listener is closed: never accepted
                    outcomes.append("not accepted")
                    gone.set()
                except Exception as exc:  # noqa: BLE001 - a reset or a close without an answer
                    outcomes.append(f"dropped ({type(exc).__name__})")
        finally:
            await session.close()

    tasks = [asyncio.ensure_future(one()) for _ in range(clients)]
    await asyncio.sleep(2.0)
    sigterm()
    await asyncio.wait(tasks, timeout=120)
    return outcomes


async def _drain_grpc(port: int, clients: int, sigterm: Any) -> list[str]:
    import grpc
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name="slow")
    req.inputs.add(name="x", datatype="FP32", shape=[DRAIN_ROWS, WIDTH])
    req.raw_input_contents.append(np.full((DRAIN_ROWS, WIDTH), 0.5, np.float32).tobytes())
    data = req.SerializeToString()
    outcomes: list[str] = []
    gone = asyncio.Event()

    async def one() -> None:
        async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            while not gone.is_set():
                try:
                    await call(data, timeout=120, wait_for_ready=False)
                    outcomes.append("answered")
                except grpc.aio.AioRpcError as exc:
                    details = exc.details() or ""
                    if exc.code() == grpc.StatusCode.UNAVAILABLE and ("shutting down" in details or
                                                                     "closed" in details and "model" in details):
                        outcomes.append("refused")
                    elif exc.code() == grpc.StatusCode.UNAVAILABLE and ("failed to connect" in details.lower()
                                                                       or "connection refused" in details.lower()):
                        outcomes.append("not accepted")
                        gone.set()
                    else:
                        outcomes.append(f"dropped ({exc.code().name}: {details[:60]})")

    tasks = [asyncio.ensure_future(one()) for _ in range(clients)]
    await asyncio.sleep(2.0)
    sigterm()
    await asyncio.wait(tasks, timeout=120)
    return outcomes


def probe_drain(plans: dict[str, Path], home: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for protocol in ("http", "grpc"):
        for run in range(1, args.drain_runs + 1):
            s = start(plans["slow"], "slow", home, "--batch-size", "8", "--queue-capacity", "65536",
                      "--drain-timeout", f"{args.drain_timeout:g}s")
            port = s.port(protocol)
            fn = _drain_http if protocol == "http" else _drain_grpc
            sent = {}

            def sigterm(s: ServeProcess = s) -> None:
                sent["at"] = time.monotonic()
                s.sigterm()

            outcomes = asyncio.run(fn(port, args.drain_clients, sigterm))
            rc = s.stop()
            stopped = time.monotonic() - sent["at"]
            summary = next((line for line in s.lines if line.startswith("inference requests:")), "")
            tally = {k: outcomes.count(k) for k in set(outcomes)}
            dropped = {k: v for k, v in tally.items() if k.startswith("dropped") or k.startswith("HTTP ")}
            rows.append({"protocol": protocol, "run": run, "answered": tally.get("answered", 0),
                         "refused": tally.get("refused", 0), "not_accepted": tally.get("not accepted", 0),
                         "dropped": sum(dropped.values()), "dropped_kinds": dropped, "exit": rc,
                         "stop_s": stopped, "server_says": summary})
    return rows


def _hpack(index: int | None, name: bytes, value: bytes) -> bytes:
    if index is None:
        return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value
    return (bytes([index]) if index < 15 else b"\x0f" + bytes([index - 15])) + bytes([len(value)]) + value


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _flood(port: int, seconds: float, stats: dict[str, int]) -> None:
    """HEADERS of a ModelInfer call then RST_STREAM(CANCEL), 500 pairs a write, on one connection
    (a new one whenever the server closes it)."""
    addr = f"{HOST}:{port}".encode()
    block = (b"\x83\x86" + _hpack(4, b":path", b"/inference.GRPCInferenceService/ModelInfer") + _hpack(1, b"", addr)
             + _hpack(31, b"", b"application/grpc") + _hpack(None, b"te", b"trailers"))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with socket.create_connection((HOST, port), timeout=5) as c:
                stats["connections"] += 1
                c.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b""))
                c.recv(65536)
                c.sendall(_frame(4, 1, 0, b""))
                stream = 1
                while time.monotonic() < end and stream < 2**30:
                    c.sendall(b"".join(_frame(1, 4, stream + 2 * i, block) + _frame(3, 0, stream + 2 * i,
                                                                                     struct.pack(">I", 8))
                                       for i in range(500)))
                    stream += 1000
                    stats["pairs"] += 500
        except OSError:
            stats["connection errors"] += 1


async def _grpc_closed_loop(port: int, clients: int, seconds: float) -> dict[str, Any]:
    import grpc
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name="tiny")
    req.inputs.add(name="x", datatype="FP32", shape=[1, 8])
    req.raw_input_contents.append(np.arange(8, dtype=np.float32).tobytes())
    data = req.SerializeToString()
    ok, failed, lat = 0, [], []
    end = time.perf_counter() + seconds

    async def one() -> None:
        nonlocal ok
        async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            while time.perf_counter() < end:
                t = time.perf_counter()
                try:
                    await call(data, timeout=60)
                    ok += 1
                    lat.append(time.perf_counter() - t)
                except grpc.aio.AioRpcError as exc:
                    failed.append(exc.code().name)

    await asyncio.gather(*(one() for _ in range(clients)))
    lat.sort()
    return {"ok": ok, "failed": len(failed), "codes": {c: failed.count(c) for c in set(failed)},
            "p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1e3 if lat else float("nan")}


async def _burst(port: int, n: int) -> dict[str, int]:
    import grpc
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name="tiny")
    req.inputs.add(name="x", datatype="FP32", shape=[1, 8])
    req.raw_input_contents.append(np.arange(8, dtype=np.float32).tobytes())
    data = req.SerializeToString()
    async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

        async def one() -> str:
            try:
                await call(data, timeout=120)
                return "OK"
            except grpc.aio.AioRpcError as exc:
                return exc.code().name

        codes = await asyncio.gather(*(one() for _ in range(n)))
    return {c: codes.count(c) for c in set(codes)}


def probe_reset(plans: dict[str, Path], home: Path, args: argparse.Namespace) -> dict[str, Any]:
    s = start(plans["tiny"], "tiny", home, "--queue-capacity", "8192")
    try:
        quiet = asyncio.run(_grpc_closed_loop(s.port("grpc"), 8, min(args.seconds, args.flood_seconds)))
        stats = {"connections": 0, "pairs": 0, "connection errors": 0}
        flood = threading.Thread(target=_flood, args=(s.port("grpc"), args.flood_seconds, stats))
        flood.start()
        time.sleep(0.3)
        others = asyncio.run(_grpc_closed_loop(s.port("grpc"), 8, args.flood_seconds - 0.6))
        flood.join()
        burst = asyncio.run(_burst(s.port("grpc"), args.burst))
        rss = s.rss_mb()
    finally:
        s.stop()
    return {"quiet": quiet, "flooded": others, "flood": stats, "burst": burst, "rss_mb": rss}


# -- report ----------------------------------------------------------------------------------------
def met(ok: bool) -> str:
    return "met" if ok else "NOT MET"


def service(rounds: list[tuple[dict[str, Any], dict[str, Any]]], args: argparse.Namespace, when: str) -> None:
    """The well-behaved clients' rows: each round unloaded then loaded, and the goal on the
    median over rounds of loaded p99 / unloaded p99."""
    ratios = []
    for i, (u, lo) in enumerate(rounds, 1):
        ratios.append(lo["p99_ms"] / u["p99_ms"])
        print(f"  round {i}, {args.good_clients} well-behaved HTTP clients: unloaded p50 {u['p50_ms']:.2f} ms "
              f"p99 {u['p99_ms']:.2f} ms ({u['n']} requests, {u['errors']} errors); {when} p50 {lo['p50_ms']:.2f} ms "
              f"p99 {lo['p99_ms']:.2f} ms ({lo['n']} requests, {lo['errors']} errors{' ' + lo['first_error'] if lo['errors'] else ''})")
    ratio = statistics.median(ratios)
    errors = sum(lo["errors"] for _, lo in rounds)
    print(f"  p99 {when} / unloaded, median of rounds: {ratio:.2f} (goal <= 2, 0 errors): "
          f"{met(ratio <= 2 and errors == 0)}")


def report(res: dict[str, Any], args: argparse.Namespace) -> None:
    m = res.get("memory")
    if m:
        grew = m["peak_mb"] - m["idle_mb"]
        print(f"\nmemory: {m['connections']} connections each announcing a 64 MiB body (half silent, half at 1 byte/s; "
              f"{m['still_open']} of them still open when the clients stopped)")
        print(f"  server RSS idle {m['idle_mb']:.0f} MB, with the connections {m['peak_mb']:.0f} MB: +{grew:.0f} MB "
              f"(goal < 200 MB): {met(grew < 200)}")
        service(m["rounds"], args, "while the connections are held")
    c = res.get("closing")
    if c:
        t = c["timeout_s"]
        print(f"\nclosing: --header-timeout, --body-timeout, --idle-timeout {t:g} s (body min rate 1 KiB/s); "
              "a connection answered 408 is closed after aiohttp's 1 s lingering close")
        print(f"  {'kind':<11} {'n':>5} {'closed':>7} {'408':>5} {'408 at s':>9} {'closed: min s':>14} {'median s':>9} "
              f"{'max s':>7}  expected")
        expected = {"silent": "header timeout", "keepalive": "idle timeout", "slow_head": "header timeout",
                    "announce": "body timeout", "slow_body": "body timeout (min rate)"}
        ok = True
        for kind, r in c["rows"].items():
            print(f"  {kind:<11} {r['n']:>5} {r['closed']:>7} {r['answered_408']:>5} {r['answer_median_s']:>9.2f} "
                  f"{r['min_s']:>14.2f} {r['median_s']:>9.2f} {r['max_s']:>7.2f}  {expected[kind]} ({t:g} s)")
            ok = ok and r["closed"] == r["n"] and r["max_s"] <= t + 1.5
        print(f"  goal (each connection closed at its timeout, + the 1 s lingering after a 408): {met(ok)}")
        service(c["rounds"], args, "while they are opened and closed")
    d = res.get("drain")
    if d:
        print(f"\ndrain: {args.drain_clients} closed-loop clients, {DRAIN_ROWS}-sample requests of a few ms a sample, "
              f"SIGTERM after 2 s, --drain-timeout {args.drain_timeout:g} s")
        print(f"  {'protocol':<8} {'run':>3} {'answered':>9} {'503/UNAV.':>10} {'dropped':>8} {'not accepted':>13} "
              f"{'exit':>5} {'stop s':>7}")
        for r in d:
            print(f"  {r['protocol']:<8} {r['run']:>3} {r['answered']:>9} {r['refused']:>10} {r['dropped']:>8} "
                  f"{r['not_accepted']:>13} {r['exit']:>5} {r['stop_s']:>7.2f}"
                  + (f"  {r['dropped_kinds']}" if r["dropped"] else ""))
        for protocol in ("http", "grpc"):
            mine = [r for r in d if r["protocol"] == protocol]
            print(f"  {protocol}: answered {sum(r['answered'] for r in mine)}, 503/UNAVAILABLE "
                  f"{sum(r['refused'] for r in mine)}, dropped {sum(r['dropped'] for r in mine)}")
        print(f"  server's own exit line (last run): {d[-1]['server_says']}")
        print(f"  goal dropped = 0: {met(all(r['dropped'] == 0 for r in d))}")
    r = res.get("reset")
    if r:
        q, f = r["quiet"], r["flooded"]
        print(f"\nrapid reset: one connection sent {r['flood']['pairs']:,} HEADERS + RST_STREAM pairs in "
              f"{args.flood_seconds:g} s ({r['flood']['connections']} connection(s)); server RSS after {r['rss_mb']:.0f} MB")
        print(f"  8 other gRPC clients: quiet {q['ok']} calls p99 {q['p99_ms']:.2f} ms; flooded {f['ok']} calls, "
              f"{f['failed']} failed {f['codes'] or ''} p99 {f['p99_ms']:.2f} ms (goal 0 failed): {met(f['failed'] == 0)}")
        print(f"  {args.burst} concurrent calls on one channel: {r['burst']} (goal all OK): "
              f"{met(r['burst'] == {'OK': args.burst})}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=500)
    ap.add_argument("--timeout", type=float, default=2.0, help="header, body and keep-alive timeout of the closing probe")
    ap.add_argument("--seconds", type=float, default=5.0, help="each measurement of the well-behaved clients")
    ap.add_argument("--good-clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="unloaded/loaded rounds of the memory and closing probes")
    ap.add_argument("--drain-runs", type=int, default=5)
    ap.add_argument("--drain-clients", type=int, default=32)
    ap.add_argument("--drain-timeout", type=float, default=1.0)
    ap.add_argument("--flood-seconds", type=float, default=8.0)
    ap.add_argument("--burst", type=int, default=2000)
    ap.add_argument("--probes", default="memory,closing,drain,reset")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--client", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        port, clients, seconds = args.client
        print(json.dumps(asyncio.run(_good_clients(int(port), int(clients), float(seconds)))))
        return
    t0 = time.monotonic()
    root = scratch_dir("serve-abuse-")
    plans = build_plans(root)
    print(f"serve_abuse: staronnx serve on {HOST}, {os.cpu_count()} CPUs; the tiny model (2 MatMuls) and a slow one "
          f"(160 MatMuls, 256 wide)")
    res: dict[str, Any] = {}
    probes = {"memory": probe_memory, "closing": probe_closing, "drain": probe_drain, "reset": probe_reset}
    for name in args.probes.split(","):
        res[name] = probes[name](plans, root / "home", args)
    report(res, args)
    print(f"\n({time.monotonic() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
