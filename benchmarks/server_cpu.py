"""Server CPU per request, this tree against an older commit, side by side (issue 51, item 1).

What a user of a small model pays for is the request path, not the model: this benchmark serves
a trivial model (a 2-layer, 16-wide MatMul chain, one part) with each tree's own ``staronnx
partition`` and ``staronnx serve`` on loopback, loads it with ``--clients`` closed-loop
tritonclient clients spread over ``--procs`` client processes (one request of one row each,
answer awaited before the next), first over HTTP (binary tensors) then over gRPC, and reads the
**server process's CPU time** (utime + stime from ``/proc/<pid>/stat``) at the start and the end
of the measured window. The figure is that CPU time divided by the requests answered inside the
window: microseconds of server CPU per request. Each window also gives the server threads'
voluntary context switches per request (the thread hand-offs a request costs) and the mean
batch the server formed (its Triton counters): clients slowed by other load fill batches less,
and a request's share of a batch's fixed costs grows, so read the CPU figure with the batch.

* The old tree is a ``git worktree`` of ``--old`` (default 364fdda) under ``/tmp``, made if
  missing; each tree runs with its own ``PYTHONPATH``, the same interpreter and venv.
* Rounds alternate old / new (``--rounds``, default 3); the figures are medians with their range,
  and the new/old ratio is the median of the per-round ratios.
* CPU time per request is much less disturbed by other load on the machine than throughput or
  latency (the server's CPU is its own whatever else runs), but a loaded machine still changes
  cache and scheduling behaviour: the JSON records the load average at the start and the end.
* ``--profile DIR`` runs the new tree's server under cProfile (Python 3.12's profiler sees every
  thread) for one extra HTTP + gRPC window and writes its stats there, with the top entries
  printed. cProfile's times are wall time (a thread waiting on a lock is charged): for where the
  CPU goes, sample the server with ``py-spy record -f raw -p PID`` while a window runs.

    .venv/bin/python benchmarks/server_cpu.py [--seconds 5] [--rounds 3] [--old 364fdda]
        [--clients 16] [--procs 4] [--batch 8] [--max-delay 2ms] [--protocols gRPC] [--out result.json]
        [--profile DIR]

``--protocols gRPC`` (or ``HTTP``) measures one door alone: a shorter run to iterate on one of them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, ServeProcess, git_head, scratch_dir, start_serve  # noqa: E402

PROTOCOLS = ("HTTP", "gRPC")
#: the trivial model's width (input x and output y are [batch, WIDTH])
WIDTH = 16
MODEL = "trivial"


# -- the client process ----------------------------------------------------------------------
def client_main(args: argparse.Namespace) -> int:
    """``--clients`` coroutines calling the server back to back until ``--stop-at`` (wall
    time); prints how many answers arrived inside [``--start-at``, ``--stop-at``]."""
    import asyncio

    import numpy as np

    x = np.random.default_rng(0).standard_normal((args.rows, WIDTH), dtype=np.float32)

    async def drive() -> int:
        answered = 0
        if args.client == "HTTP":
            import tritonclient.http as thttp
            import tritonclient.http.aio as haio

            inp = thttp.InferInput("x", [args.rows, WIDTH], "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            out = [thttp.InferRequestedOutput("y", binary_data=True)]
            client = haio.InferenceServerClient(args.address, conn_limit=args.clients)

            async def call() -> None:
                (await client.infer(MODEL, [inp], outputs=out)).as_numpy("y")
        else:
            import tritonclient.grpc as tgrpc
            import tritonclient.grpc.aio as gaio

            inp = tgrpc.InferInput("x", [args.rows, WIDTH], "FP32")
            inp.set_data_from_numpy(x)
            client = gaio.InferenceServerClient(args.address)

            async def call() -> None:
                (await client.infer(MODEL, [inp])).as_numpy("y")

        async def one() -> None:
            nonlocal answered
            while time.time() < args.stop_at:
                await call()
                if args.start_at <= time.time() <= args.stop_at:
                    answered += 1

        try:
            await asyncio.gather(*(one() for _ in range(args.clients)))
        finally:
            await client.close()
        return answered

    print(json.dumps({"answered": asyncio.run(drive())}))
    return 0


# -- the driver -------------------------------------------------------------------------------
def server_cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` so far, every thread included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_switches(pid: int) -> int:
    """Voluntary context switches of process ``pid``'s threads so far: each is a thread that
    went to sleep (a hand-off to another thread, or a wait for work), so their count per request
    tells the thread hand-offs a request costs, which load on the machine does not change."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except OSError:  # a thread that ended meanwhile
            continue
        m = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", text, re.M)
        total += int(m.group(1)) if m else 0
    return total


def served_counts(metrics_url: str) -> tuple[float, float]:
    """(samples, batches) the server has run so far, from its Triton counters: their ratio over
    a window is the mean batch it formed, which sets how far a batch's fixed costs are shared
    (a loaded machine slows the clients, so batches fill less and each request costs more)."""
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    counts = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^nv_inference_(count|exec_count)\{model="' + MODEL + r'"[^}]*\} (\S+)$', text, re.M)}
    return counts.get("count", 0.0), counts.get("exec_count", 0.0)


def tree_env(tree: Path, home: Path) -> dict[str, str]:
    """The environment a tree's commands run in: its own package first on the path, a scratch
    ``STARONNX_HOME`` (perf models and caches stay out of the user's). The commands run with
    ``python -P``: ``-m`` otherwise puts the working directory first on the path, ahead of
    ``PYTHONPATH``, and run from a checkout both "trees" would import that checkout's package."""
    return {**os.environ, "PYTHONPATH": str(tree), "STARONNX_HOME": str(home)}


def old_tree(commit: str) -> Path:
    """A worktree of ``commit`` under /tmp, made once and kept (it is reused across runs)."""
    path = Path(f"/tmp/old-{commit}")
    if not (path / "staronnx").is_dir():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), commit], check=True,
                       stdout=subprocess.DEVNULL)
    return path


def cut_plan(tree: Path, model: Path, out: Path, home: Path) -> Path:
    """The trivial model cut into a one-part plan by ``tree``'s own ``staronnx partition``."""
    subprocess.run([sys.executable, "-P", "-m", "staronnx", "partition", str(model), "-o", str(out), "--shares", "1",
                    "-q", "--force"], check=True, env=tree_env(tree, home), stdout=subprocess.DEVNULL)
    return out


def start_server(tree: Path, plan: Path, args: argparse.Namespace, home: Path,
                 profile: Path | None = None) -> ServeProcess:
    """``tree``'s ``staronnx serve`` of ``plan`` on free loopback ports, once it says it is ready."""
    head = [sys.executable, "-P", *(["-m", "cProfile", "-o", str(profile)] if profile else []), "-m", "staronnx"]
    cmd = [*head, "serve", str(plan), "--name", MODEL, "--http-port", "0", "--grpc-port", "0",
           "--metrics-port", "0", "--batch-size", str(args.batch), "--max-delay", args.max_delay]
    return start_serve(cmd, tree_env(tree, home), timeout=300)


def measure(proc: subprocess.Popen[str], protocol: str, address: str, metrics: str,
            args: argparse.Namespace) -> dict[str, float]:
    """One window of ``protocol`` load: server CPU µs per answered request, and requests/s."""
    start_at = time.time() + args.warmup + 1.0  # the client processes' start-up comes first
    stop_at = start_at + args.seconds
    per_proc = [args.clients // args.procs + (i < args.clients % args.procs) for i in range(args.procs)]
    clients = [subprocess.Popen([sys.executable, __file__, "--client", protocol, "--address", address,
                                 "--clients", str(n), "--rows", str(args.rows), "--start-at", repr(start_at),
                                 "--stop-at", repr(stop_at)],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ""})
               for n in per_proc if n]
    time.sleep(max(0.0, start_at - time.time()))
    cpu0, sw0, n0 = server_cpu_seconds(proc.pid), server_switches(proc.pid), served_counts(metrics)
    time.sleep(max(0.0, stop_at - time.time()))
    cpu1, sw1, n1 = server_cpu_seconds(proc.pid), server_switches(proc.pid), served_counts(metrics)
    answered = 0
    for c in clients:
        out, _ = c.communicate(timeout=120)
        if c.returncode != 0:
            raise SystemExit(f"a {protocol} client process failed (exit {c.returncode})")
        answered += json.loads(out.strip().splitlines()[-1])["answered"]
    return {"server_cpu_us_per_request": (cpu1 - cpu0) * 1e6 / max(answered, 1),
            "switches_per_request": (sw1 - sw0) / max(answered, 1),
            "mean_batch": (n1[0] - n0[0]) / max(n1[1] - n0[1], 1.0),
            "requests_per_s": answered / args.seconds, "answered": answered, "server_cpu_s": cpu1 - cpu0}


def round_of(tree: Path, plan: Path, args: argparse.Namespace, home: Path,
             profile: Path | None = None) -> dict[str, dict[str, float]]:
    """One server of ``tree``: an HTTP window, then a gRPC window."""
    s = start_server(tree, plan, args, home, profile)
    try:
        return {p: measure(s.proc, p, {"HTTP": s.http, "gRPC": s.grpc}[p], s.metrics, args) for p in args.protocols}
    finally:
        s.stop(60)


def print_profile(path: Path, top: int) -> None:
    import pstats

    stats = pstats.Stats(str(path))
    stats.sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per protocol and round")
    ap.add_argument("--warmup", type=float, default=1.5, help="seconds of load before each window")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each old then new (alternated)")
    ap.add_argument("--old", default="364fdda", help="the commit to compare against")
    ap.add_argument("--clients", type=int, default=16, help="closed-loop clients in all")
    ap.add_argument("--procs", type=int, default=4, help="client processes the clients are spread over")
    ap.add_argument("--batch", type=int, default=8, help="the server's --batch-size")
    ap.add_argument("--rows", type=int, default=1, help="rows per request (a client's own batch)")
    ap.add_argument("--max-delay", default="2ms", help="the server's --max-delay")
    ap.add_argument("--out", type=Path, help="write every repeat and the medians here as JSON")
    ap.add_argument("--profile", type=Path, help="also profile the new tree's server (cProfile) into this folder")
    ap.add_argument("--top", type=int, default=25, help="profile entries printed")
    ap.add_argument("--new-only", action="store_true", help="measure only this tree (no old worktree)")
    ap.add_argument("--protocols", type=lambda s: [p.strip() for p in s.split(",")], default=list(PROTOCOLS),
                    help="the doors measured, comma-separated, in order (default HTTP,gRPC)")
    # the client process's own arguments
    ap.add_argument("--client", choices=PROTOCOLS, help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--stop-at", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if set(args.protocols) - set(PROTOCOLS) or not args.protocols:
        ap.error(f"--protocols: choose among {','.join(PROTOCOLS)}, got {','.join(args.protocols)}")
    if args.client:
        return client_main(args)

    import onnx

    sys.path.insert(0, str(REPO))
    from staronnx.zoo import chain

    tmp = scratch_dir("staronnx-server-cpu-")
    model = tmp / "trivial.onnx"
    onnx.save(chain(depth=2, width=WIDTH), model)
    trees = {"new": REPO} if args.new_only else {"old": old_tree(args.old), "new": REPO}
    plans = {k: cut_plan(t, model, tmp / f"plan-{k}" / MODEL, tmp / f"home-{k}") for k, t in trees.items()}
    load = [os.getloadavg()]
    print(f"server CPU per request: trivial model (chain 2 x {WIDTH}), {args.clients} closed-loop clients in "
          f"{args.procs} processes, {args.rows} row(s) a request, batches of up to {args.batch} (max delay {args.max_delay}), {args.seconds:g} s "
          f"per protocol, {args.rounds} rounds alternated; load average {load[0][0]:.2f} on {os.cpu_count()} CPUs")
    repeats: dict[str, list[dict[str, dict[str, float]]]] = {k: [] for k in trees}
    for r in range(args.rounds):
        for k, tree in trees.items():
            res = round_of(tree, plans[k], args, tmp / f"home-{k}")
            repeats[k].append(res)
            print(f"  round {r + 1} {k:>3}: " + ", ".join(
                f"{p} {res[p]['server_cpu_us_per_request']:.0f} µs/request ({res[p]['requests_per_s']:.0f} req/s, "
                f"{res[p]['switches_per_request']:.2f} switches/request, mean batch {res[p]['mean_batch']:.1f})"
                for p in args.protocols), flush=True)
    load.append(os.getloadavg())
    summary: dict[str, dict[str, object]] = {}
    for p in args.protocols:
        row: dict[str, object] = {}
        for k in trees:
            v = [rep[p]["server_cpu_us_per_request"] for rep in repeats[k]]
            row[k] = {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v)}
        if "old" in trees:
            ratios = [n[p]["server_cpu_us_per_request"] / o[p]["server_cpu_us_per_request"]
                      for o, n in zip(repeats["old"], repeats["new"])]
            row["new_over_old"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        summary[p] = row
        line = "  ".join(f"{k} {row[k]['median_us']:.0f} µs [{row[k]['min_us']:.0f}-{row[k]['max_us']:.0f}]"
                         for k in trees)
        if "old" in trees:
            rr = row["new_over_old"]
            line += f"  new/old {rr['median']:.2f} [{rr['min']:.2f}-{rr['max']:.2f}]"
        print(f"{p:>5}: {line}")
    print(f"load average {load[0][0]:.2f} -> {load[-1][0]:.2f} (the machine was shared: CPU per request "
          "moves less than wall time with load, but it moves)")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        stats = args.profile / "server.prof"
        round_of(REPO, plans["new"], args, tmp / "home-new", profile=stats)
        print(f"\nprofile of the new tree's server ({stats}), by own time:")
        print_profile(stats, args.top)
    if args.out:
        from importlib.metadata import PackageNotFoundError, version

        def installed(name: str) -> str:
            try:
                return version(name)
            except PackageNotFoundError:
                return "absent"

        args.out.write_text(json.dumps({
            "command": [sys.executable, *sys.argv], "summary": summary, "repeats": repeats,
            "trees": {k: {"path": str(t), "commit": git_head(t)} for k, t in trees.items()},
            "settings": {k: getattr(args, k) for k in ("seconds", "warmup", "rounds", "clients", "procs", "batch",
                                                       "rows", "max_delay")},
            "versions": {"python": platform.python_version(),
                         **{n: installed(n) for n in ("numpy", "onnxruntime", "aiohttp", "grpcio", "tritonclient")}},
            "machine": {"cpus": os.cpu_count(), "loadavg_start": load[0], "loadavg_end": load[-1],
                        "platform": platform.platform()},
        }, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
