"""Throughput/latency sweeps: the StarONNX papers' evaluation, point by point, on the live runtime.

    rows = sweep(plan, rates=[50, 100, 200], batch_sizes=[1, 4, 8], groups="numa",
                 duration=10.0, out_dir="results/")

For every batch size ``b`` and offered rate ``rho`` the sweep serves single-sample requests
arriving open-loop at ``rho`` (constant interval or Poisson) through a
:class:`~staronnx.serving.Server` that forms batches of exactly ``b`` (the papers' model: a
batch leaves when full), and reports what :func:`~staronnx.serving.summarize` measures over the
point's window: achieved throughput, the papers' latency (the latency of the first request of
each batch: mean over batches, with std as its spread), per-request p50 ... p99.9, the share
of each part run on each arch, congestion, stability.

How the sweep is run, and why:

- **One runtime for the whole sweep**: workers and ORT sessions start once; every batch size
  is warmed up first (bursts of batches, so that every worker allocates and selects kernels
  for that size before any measurement).
- **Rates ascending per batch size; stop at congestion**: once a batch size is congested
  (its backlog keeps growing, or the queue overflowed) every higher rate would be too: the
  remaining points are skipped (listed in ``results.json`` under ``skipped``), which is where
  most of a naive sweep's time would go.
- **Stability** (perf_analyzer's rule, computed by the metrics): three windows agree within
  10 %. A point that is neither stable nor congested is measured once more, twice as long,
  and that second measurement is kept (``extended``).
- **Long enough to fill batches**: a point lasts at least ``min_batches`` batch-fill times
  (``b / rho``), so slow rates with big batches still see enough batches.
- **The bound**: where perf models exist, the LP throughput bound of
  :mod:`staronnx.bench.bound` is recorded per batch size, and each point's achieved/bound.

Results are rewritten after every point (atomically), so an interrupted sweep keeps what it
measured (a sweep stopped by Ctrl-C or SIGTERM says so in ``settings.interrupted``): ``results.csv`` (one row per measured point, latencies in ms) and ``results.json``
(the same rows with per-window, generator and per-worker detail, the settings, the bounds and
the skipped points).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from staronnx.bench.fidelity import COLUMNS as SIM_COLUMNS
from staronnx.bench.fidelity import fidelity_summary, simulate_row
from staronnx.errors import StaronnxError
from staronnx.fsutil import atomic_write_text
from staronnx.plan import Plan
from staronnx.serving import Server, make_arrivals, run_open_loop, summarize
from staronnx.signals import signal_name

FORMAT = "staronnx-sweep"
VERSION = 1
RESULTS_CSV = "results.csv"
RESULTS_JSON = "results.json"
#: trace lane (thread id) of the sweep's points, clear of the workers' lanes
POINTS_LANE = 100_000

#: summarize() keys in seconds, written in milliseconds under ``<key>_ms``
_MS_KEYS = (
    "paper_latency_mean", "paper_latency_std", "paper_latency_p95", "paper_latency_max",
    "latency_mean", "latency_p50", "latency_p90", "latency_p95", "latency_p99", "latency_p999",
    "latency_max",
)
#: the fixed CSV columns, in order; ``share_part<p>_<arch>`` columns follow
COLUMNS = (
    "batch_size", "offered_rate", "achieved_arrival_rate", "throughput",
    *(f"{k}_ms" for k in _MS_KEYS),
    "cpu_share", "congested", "stable", "extended",
    "requests", "completed", "rejected", "failed", "pending", "batches",
    "queue_mean", "queue_max", "backlog_growth",
    "bound_throughput", "achieved_over_bound",
    "duration_s", "warmup_s", "measured_s",
    "policy", "groups", "cuda_streams", "distribution", "max_delay_ms",
)


class SweepError(StaronnxError, ValueError):
    """A sweep that cannot run as asked (bad rates, batch sizes, durations)."""


# ---------------------------------------------------------------------------- parsing
def parse_rates(text: str) -> list[float]:
    """``"50:800:50"`` (start:stop:step, stop included), ``"100,200,400"``, or both mixed."""
    rates: list[float] = []
    for item in (s.strip() for s in str(text).split(",")):
        if not item:
            continue
        try:
            if ":" in item:
                bits = [float(x) for x in item.split(":")]
                if len(bits) == 2:
                    bits.append(bits[0])
                if len(bits) != 3:
                    raise ValueError
                start, stop, step = bits
                if step <= 0 or stop < start:
                    raise ValueError
                n = math.floor((stop - start) / step + 1e-9) + 1
                rates.extend(start + i * step for i in range(n))
            else:
                rates.append(float(item))
        except ValueError:
            raise SweepError(
                f"--rates expects requests/s like 50:800:50 (start:stop:step) or 100,200,400; got {text!r}"
            ) from None
    if not rates or any(not (math.isfinite(r) and r > 0) for r in rates):
        raise SweepError(f"--rates needs at least one positive rate, got {text!r}")
    return sorted({round(r, 9) for r in rates})


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,2,4,8,16"`` -> sorted distinct positive ints."""
    try:
        sizes = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s < 1 for s in sizes):
        raise SweepError(f"--batch-sizes expects positive integers like 1,2,4,8, got {text!r}")
    return sorted(set(sizes))


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(ms|s|m|min)?\s*$", re.IGNORECASE)


def parse_duration(text: str | float, *, allow_zero: bool = False, option: str | None = None) -> float:
    """Seconds from ``"10s"``, ``"500ms"``, ``"2m"`` or a bare number of seconds (> 0, or
    >= 0 with ``allow_zero``: a warm-up or a batching delay may be none at all).

    The one duration syntax of every command (sweep, simulate, optimize-batch); ``option``
    (``"--duration"``) starts the error message, so the user knows which value to fix.
    """
    where = f"{option}: " if option else ""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _DURATION.match(str(text))
        if not m:
            raise SweepError(f"{where}durations look like 10s, 500ms, 2m or 1.5 (seconds); got {text!r}")
        value = float(m.group(1)) * {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0}[(m.group(2) or "s").lower()]
    if not (math.isfinite(value) and (value >= 0 if allow_zero else value > 0)):
        raise SweepError(f"{where}a duration must be {'>=' if allow_zero else '>'} 0 seconds, got {text!r}")
    return value


# ---------------------------------------------------------------------------- progress
@dataclass
class SweepEvent:
    """What the sweep tells its ``progress`` callback.

    ``kind``: ``"start"`` (``total`` points planned), ``"warmup"`` (one batch size warmed up),
    ``"point"`` (a point starts: ``requests`` to submit), ``"requests"`` (``submitted`` so far,
    throttled to about 100 calls per point), ``"done"`` (a point measured: ``row``),
    ``"skipped"`` (``skipped`` rates of a batch size left out after congestion), ``"end"``, or
    ``"interrupted"`` (stopped by a signal, named in ``message``; the results on disk hold the
    points measured so far).
    ``index`` counts points measured or skipped so far, out of ``total``.
    """

    kind: str
    index: int = 0
    total: int = 0
    batch_size: int | None = None
    rate: float | None = None
    requests: int = 0
    submitted: int = 0
    attempt: int = 1
    row: dict[str, Any] | None = None
    skipped: list[float] = field(default_factory=list)
    message: str = ""


Progress = Callable[[SweepEvent], None]


# ---------------------------------------------------------------------------- one point
def sample_pool(plan: Plan, count: int = 16, seed: int = 0,
                inputs: Mapping[str, np.ndarray] | None = None) -> list[dict[str, np.ndarray]]:
    """Single-sample requests (batch dimension 1) reused round-robin by the generator: random
    ones, or each sample of real ``inputs`` (see :mod:`staronnx.inputs`)."""
    if inputs is not None:
        from staronnx.inputs import batch_of, samples

        return [batch_of(inputs, plan, 1, i) for i in range(samples(inputs, plan))]
    from staronnx.verify import random_plan_feeds

    return [random_plan_feeds(plan, 1, seed=seed + i) for i in range(count)]


def point_duration(duration: float, warmup: float, batch_size: int, rate: float, min_batches: int) -> float:
    """A point's length: ``duration``, stretched to hold ``min_batches`` batch fills after warm-up."""
    return max(duration, warmup + min_batches * batch_size / rate)


def measure_point(
    runtime: Any,
    batch_size: int,
    rate: float,
    samples: Sequence[Mapping[str, np.ndarray]],
    *,
    duration: float,
    warmup: float,
    distribution: str = "constant",
    seed: int = 0,
    queue_capacity: int = 1024,
    drain_timeout: float | None = None,
    on_submit: Callable[[int, int], None] | None = None,
    max_delay: float | None = None,
    max_inflight: int | None = None,
    server_factory: Callable[..., Any] | None = None,
) -> tuple[dict[str, Any], Any]:
    """Serve ``rate`` requests/s in batches of ``batch_size`` for ``duration`` s; (summary, records).

    A fresh :class:`Server` on the shared runtime; batches leave only when full, or, with
    ``max_delay`` (Triton's dynamic batching), once their oldest request waited that long. After the
    schedule, the generator waits at most ``drain_timeout`` s (default: ``max(5, duration/2)``)
    for outstanding results, then the server is closed with a short timeout, so a congested
    point does not spend minutes draining a full queue (what is cut counts as pending).
    ``server_factory`` builds the batching front end instead of :class:`Server` (same
    arguments; :class:`staronnx.bench.remote.RemoteServer` sends the requests over the network).
    """
    arrivals = make_arrivals(distribution, rate, seed=seed)
    drain = max(5.0, duration / 2) if drain_timeout is None else drain_timeout
    n = len(samples)
    server = (server_factory or Server)(runtime, batch_size=batch_size, max_delay=max_delay,
                                       max_inflight=max_inflight, queue_capacity=max(queue_capacity, batch_size))
    try:
        records = run_open_loop(server, arrivals, lambda i: samples[i % n], duration=duration,
                                drain_timeout=drain, on_submit=on_submit)
    finally:
        server.close(timeout=2.0)
        wait_idle(runtime)
    records.settings["distribution"] = distribution
    return summarize(records, warmup=warmup), records


def wait_idle(runtime: Any, timeout: float = 30.0) -> bool:
    """Wait until the runtime has no request in flight (a cut-off point's batches finish), so
    the next point starts on idle workers; False after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            busy = int(runtime.stats().get("in_flight", 0))
        except Exception:  # noqa: BLE001 - a stand-in runtime without stats
            return True
        if busy == 0:
            return True
        time.sleep(0.01)
    return False


def _workers_snapshot(runtime: Any) -> dict[str, tuple[int, float]]:
    """worker name -> (tasks done, busy seconds) so far, from ``Runtime.stats()``."""
    try:
        stats = runtime.stats()
    except Exception:  # noqa: BLE001 - a stand-in runtime without stats
        return {}
    elapsed = float(stats.get("elapsed_s", 0.0))
    return {name: (int(w.get("tasks", 0)), float(w.get("busy", 0.0)) * elapsed)
            for name, w in (stats.get("workers") or {}).items()}


def _workers_delta(before: Mapping[str, tuple[int, float]], after: Mapping[str, tuple[int, float]],
                   seconds: float) -> dict[str, dict[str, float]]:
    out = {}
    total = sum(max(after[n][0] - before.get(n, (0, 0.0))[0], 0) for n in after)
    for name, (tasks, busy) in after.items():
        t0, b0 = before.get(name, (0, 0.0))
        out[name] = {
            "tasks": tasks - t0,
            "task_share": (tasks - t0) / total if total else 0.0,
            "busy": max(busy - b0, 0.0) / seconds if seconds > 0 else math.nan,
        }
    return out


# ---------------------------------------------------------------------------- rows and files
def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf -> None, numpy scalars -> Python, tuples -> lists, recursively."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def make_row(summary: Mapping[str, Any], settings: Mapping[str, Any], *, duration: float,
             extended: bool = False, bound: float | None = None) -> dict[str, Any]:
    """One sweep row from a :func:`summarize` result (latencies converted to ms)."""
    row: dict[str, Any] = {
        "batch_size": int(summary["batch_size"]),
        "offered_rate": float(summary["offered_rate"]),
        "achieved_arrival_rate": summary.get("achieved_arrival_rate"),
        "throughput": summary.get("throughput"),
    }
    for key in _MS_KEYS:
        v = summary.get(key)
        row[f"{key}_ms"] = v * 1e3 if isinstance(v, (int, float)) and math.isfinite(v) else None
    share = summary.get("cpu_share")
    row["cpu_share"] = share
    row["congested"] = bool(summary.get("congested"))
    row["stable"] = bool(summary.get("stable"))
    row["extended"] = bool(extended)
    for key in ("requests", "completed", "rejected", "failed", "pending", "batches",
                "queue_mean", "queue_max", "backlog_growth"):
        row[key] = summary.get(key)
    thr = summary.get("throughput")
    row["bound_throughput"] = bound
    row["achieved_over_bound"] = (
        thr / bound if bound and isinstance(thr, (int, float)) and math.isfinite(thr) and bound > 0 else None)
    row["duration_s"] = duration
    row["warmup_s"] = summary.get("warmup_s")
    row["measured_s"] = summary.get("measured_s")
    for key in ("policy", "groups", "cuda_streams", "distribution"):
        row[key] = settings.get(key)
    delay = settings.get("max_delay_s")
    row["max_delay_ms"] = None if delay is None else delay * 1e3
    for part, archs in sorted((summary.get("placement") or {}).items()):
        for arch, frac in sorted(archs.items()):
            row[f"share_{part}_{arch}"] = frac
    return _clean(row)


def share_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ``share_part<p>_<arch>`` columns present in any row, sorted by part then arch."""
    cols = {k for r in rows for k in r if k.startswith("share_")}

    def key(c: str) -> tuple[int, str]:
        m = re.match(r"share_part([0-9]+)_(.*)", c)
        return (int(m.group(1)), m.group(2)) if m else (1 << 30, c)

    return sorted(cols, key=key)


def rows_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """CSV text: the fixed :data:`COLUMNS`, the simulator's columns where a row has them, then
    the share columns; empty cells for None."""
    simulated = [c for c in SIM_COLUMNS if any(c in r for r in rows)]
    columns = [*COLUMNS, *simulated, *share_columns(rows)]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({c: _csv_cell(r.get(c)) for c in columns})
    return buf.getvalue()


def _csv_cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def write_results(out_dir: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]], *,
                  settings: Mapping[str, Any] | None = None, bounds: Mapping[Any, Any] | None = None,
                  skipped: Sequence[Mapping[str, Any]] = (), notes: Sequence[str] = (),
                  fidelity: Mapping[str, Any] | None = None) -> tuple[Path, Path]:
    """Write ``results.csv`` and ``results.json`` into ``out_dir``, each atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / RESULTS_CSV, out / RESULTS_JSON
    atomic_write_text(csv_path, rows_csv(rows))
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "settings": _clean(dict(settings or {})),
        "bounds": _clean({str(k): v for k, v in (bounds or {}).items()}),
        "rows": _clean(list(rows)),
        "skipped": _clean(list(skipped)),
        "notes": list(notes),
    }
    if fidelity is not None:
        doc["fidelity"] = _clean(dict(fidelity))
    atomic_write_text(json_path, json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return csv_path, json_path


def load_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A sweep's ``results.json`` (give the folder or the file), checked for its format."""
    p = Path(path)
    if p.is_dir():
        p = p / RESULTS_JSON
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise SweepError(f"no sweep results at {p} (run `staronnx sweep ... -o {p.parent}` first)") from None
    except json.JSONDecodeError as exc:
        raise SweepError(f"{p} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SweepError(f"{p} is not a staronnx sweep result (format {FORMAT!r})")
    return doc


def load_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The measured rows of a sweep folder (or its ``results.json``)."""
    return list(load_results(path)["rows"])


# ---------------------------------------------------------------------------- bound
def batch_bounds(machine: Any, batch_sizes: Sequence[int]) -> tuple[dict[int, dict[str, Any]], list[str]]:
    """LP throughput bound per batch size on a :class:`~staronnx.bench.simulator.SimMachine`
    (where its perf models allow), with notes on what failed."""
    from staronnx.bench.bound import machine_bound

    notes: list[str] = []
    out: dict[int, dict[str, Any]] = {}
    for b in batch_sizes:
        try:
            bound = machine_bound(machine, b)
        except StaronnxError as exc:
            notes.append(f"no LP bound at batch {b}: {exc}")
            continue
        out[b] = {
            "throughput": bound.throughput,
            "binding": [x.name for x in bound.binding],
            "arch_share": {f"part{p}/{a}": x for (p, a), x in bound.arch_share().items()},
        }
    return out, notes


def _sim_machine(plan: Plan, *, groups: str, cuda_streams: int, store: Any, notes: list[str],
                 missing: str) -> Any:
    """The simulated twin of the sweep's runtime (for the LP bound and the simulation), or
    None, noted as ``missing``, where the plan has no perf models to build it from."""
    from staronnx.bench.simulator import build_machine

    try:
        machine = build_machine(plan, groups=groups, cuda_streams=cuda_streams, store=store)
    except StaronnxError as exc:
        notes.append(f"{missing}: {exc}")
        return None
    notes.extend(machine.notes)
    return machine


# ---------------------------------------------------------------------------- warm-up
def warm_up(runtime: Any, plan: Plan, batch_sizes: Sequence[int], *, rounds: int = 3, seed: int = 0,
            inputs: Mapping[str, np.ndarray] | None = None) -> None:
    """Run bursts of batches of every size through the runtime before measuring.

    Each burst submits several batches at once, more than there are workers, so queues build
    and the policy spreads them: every worker meets every size (allocations, kernel choice)
    before the first measured point. Tasks cannot be sent to a given worker directly: the
    engine's serving loops own the worker threads.
    """
    from staronnx.verify import random_plan_feeds

    from staronnx.inputs import batch_of

    n_workers = max(1, len(getattr(runtime, "workers", ()) or ()))
    for b in batch_sizes:
        feeds = random_plan_feeds(plan, b, seed=seed) if inputs is None else batch_of(inputs, plan, b, 0)
        for _ in range(rounds):
            futures = [runtime.submit(feeds) for _ in range(3 * n_workers)]
            for f in futures:
                f.result()


# ---------------------------------------------------------------------------- the sweep
def sweep(
    plan: Plan | str | os.PathLike[str],
    rates: Sequence[float],
    batch_sizes: Sequence[int],
    *,
    policy: str = "heft",
    groups: str = "numa",
    cuda_streams: int = 0,
    distribution: str = "constant",
    duration: float = 10.0,
    warmup: float | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    store: Any = None,
    progress: Progress | None = None,
    seed: int = 0,
    queue_capacity: int = 1024,
    min_batches: int = 10,
    extend: bool = True,
    stop_on_congestion: bool = True,
    bound: bool = True,
    engine: str = "native",
    runtime: Any = None,
    label: str | None = None,
    simulate: bool = False,
    max_delay: float | None = None,
    trace: str | os.PathLike[str] | None = None,
    inputs: Mapping[str, np.ndarray] | str | os.PathLike[str] | None = None,
    inputs_path: str | os.PathLike[str] | None = None,
    server_factory: Callable[..., Any] | None = None,
    front_end: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Measure every (batch size, rate) point on one runtime; return the rows (see the module doc).

    Args:
        plan: a plan or its folder.
        rates: offered single-sample requests per second (sorted ascending per batch size).
        batch_sizes: the ``b`` of the papers' batches (a batch leaves when full).
        policy, groups, cuda_streams, engine: the runtime's settings.
        distribution: ``"constant"`` interval (the papers) or ``"poisson"``.
        duration: seconds of arrivals per point (stretched to ``min_batches`` batch fills).
        warmup: seconds at the start of each point left out of the measurement window
            (default ``min(1, duration / 5)``).
        out_dir: where ``results.csv`` and ``results.json`` go, rewritten after every point.
        store: the perf-model store (default ``$STARONNX_HOME``): predictions and the bound.
        progress: called with a :class:`SweepEvent` as the sweep advances.
        queue_capacity: the server's queue (an overflow rejects and marks the point congested).
        extend: measure an unstable, uncongested point once more, twice as long.
        stop_on_congestion: skip a batch size's higher rates once it is congested.
        bound: record the LP throughput bound per batch size (needs calibrated models).
        runtime: an open runtime to use instead of starting one (it stays open).
        label: a name for this sweep in comparisons (default: the output folder's name).
        simulate: also replay every measured point in the simulator from the perf models and
            record prediction and relative error beside the measurement
            (:mod:`staronnx.bench.fidelity`; ``results.json`` gets a ``fidelity`` summary).
        max_delay: seconds; batches of *at most* ``b`` leave once their oldest request waited
            this long (Triton-style dynamic batching) instead of only when full.
        trace: a Perfetto/Chrome trace of the whole sweep, written when it ends: every task on
            its worker's lane, the server's batch fills, batches and queue length, and one span
            per point on a "sweep points" lane (for a runtime passed in, its own ``trace=``).
        inputs: real inputs instead of random ones: an ``.npz`` path or its arrays, keyed by
            input name with the samples along axis 0 (:mod:`staronnx.inputs`); requests cycle
            through the samples. ``inputs_path`` names the file in ``results.json`` when the
            arrays are given.
        server_factory, front_end: over the network, the batching front end of each point
            (see :func:`measure_point`) and what ``settings.front_end`` records about it
            (:func:`staronnx.bench.remote.remote_sweep`); in process by default.
    """
    from staronnx.serving.arrivals import DISTRIBUTIONS

    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    rates = sorted({float(r) for r in rates})
    batch_sizes = sorted({int(b) for b in batch_sizes})
    if not rates or any(not (math.isfinite(r) and r > 0) for r in rates):
        raise SweepError(f"rates must be positive numbers of requests/s, got {rates}")
    if not batch_sizes or batch_sizes[0] < 1:
        raise SweepError(f"batch sizes must be integers >= 1, got {batch_sizes}")
    if distribution not in DISTRIBUTIONS:
        raise SweepError(f"unknown distribution {distribution!r}; choose {' or '.join(DISTRIBUTIONS)}")
    duration = parse_duration(duration)
    warmup = min(1.0, duration / 5) if warmup is None else float(warmup)
    if not (0 <= warmup < duration):
        raise SweepError(f"warmup must be >= 0 and shorter than the duration ({duration} s), got {warmup}")
    if min_batches < 1:
        raise SweepError(f"min_batches must be >= 1, got {min_batches}")
    if max_delay is not None and not (math.isfinite(max_delay) and max_delay >= 0):
        raise SweepError(f"max_delay must be >= 0 seconds, got {max_delay}")
    if isinstance(inputs, (str, os.PathLike)):
        from staronnx.inputs import load_inputs

        inputs_path, inputs = inputs, load_inputs(inputs, plan)
    elif inputs is not None:
        plan.check_feeds(inputs)
    notify = progress or (lambda event: None)
    total = len(rates) * len(batch_sizes)
    settings: dict[str, Any] = {
        "plan": str(plan.root), "plan_hash": plan.hash, "policy": policy, "groups": groups,
        "cuda_streams": cuda_streams, "distribution": distribution, "duration_s": duration,
        "warmup_s": warmup, "rates": rates, "batch_sizes": batch_sizes, "seed": seed,
        "queue_capacity": queue_capacity, "min_batches": min_batches, "engine": engine,
        "label": label or (Path(out_dir).name if out_dir is not None else None),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "simulate": simulate, "max_delay_s": max_delay,
        "front_end": dict(front_end) if front_end is not None else {"kind": "in-process"},
    }
    if inputs is not None:
        from staronnx.inputs import samples as _samples

        settings["inputs"] = {"path": None if inputs_path is None else str(inputs_path),
                              "samples": _samples(inputs, plan)}
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    bounds: dict[int, dict[str, Any]] = {}
    notes: list[str] = []
    # one simulated twin of the runtime serves the LP bound and the simulated points
    machine: Any = None
    if bound or simulate:
        missing = " and ".join(m for m, on in (("no LP bound", bound), ("no simulation", simulate)) if on)
        machine = _sim_machine(plan, groups=groups, cuda_streams=cuda_streams, store=store, notes=notes,
                               missing=missing)
    if bound and machine is not None:
        bounds, bound_notes = batch_bounds(machine, batch_sizes)
        notes.extend(bound_notes)
    simulator = machine if simulate else None
    # the in-flight window the perf models call for (a slow worker is only chosen behind a long
    # enough queue); the same the simulator uses, so live and simulated points agree
    windows: dict[int, int] = {}
    if machine is not None:
        from staronnx.bench.simulator import machine_inflight

        windows = {b: machine_inflight(machine, b) for b in batch_sizes}

    def save() -> None:
        if out_dir is not None:
            write_results(out_dir, rows, settings=settings, bounds=bounds, skipped=skipped, notes=notes,
                          fidelity=fidelity_summary(rows) if simulator is not None else None)

    own = runtime is None
    if own:
        from staronnx.runtime.runtime import Runtime

        runtime = Runtime(plan, policy=policy, cpu_groups=groups, cuda_streams=cuda_streams, store=store,
                          engine=engine, trace=trace)
    try:
        settings["workers"] = [getattr(w, "name", str(w)) for w in (getattr(runtime, "workers", ()) or ())]
        notify(SweepEvent("start", 0, total))
        save()
        for b in batch_sizes:
            warm_up(runtime, plan, [b], seed=seed, inputs=inputs)
            notify(SweepEvent("warmup", 0, total, batch_size=b))
        samples = sample_pool(plan, seed=seed, inputs=inputs)
        tracer = getattr(runtime, "tracer", None)
        if tracer is not None:
            tracer.lane(POINTS_LANE, "sweep points")
        index = 0
        for b in batch_sizes:
            bnd = bounds.get(b, {}).get("throughput")
            for j, rate in enumerate(rates):
                length = point_duration(duration, warmup, b, rate, min_batches)
                summary, attempt, extended = None, 1, False
                while True:
                    expected = math.ceil(length * rate)
                    notify(SweepEvent("point", index, total, b, rate, requests=expected, attempt=attempt))
                    step = max(1, expected // 100)

                    def on_submit(i: int, n: int, _b: int = b, _r: float = rate, _a: int = attempt,
                                  _step: int = step, _at: int = index) -> None:
                        if (i + 1) % _step == 0 or i + 1 == n:
                            notify(SweepEvent("requests", _at, total, _b, _r, requests=n, submitted=i + 1,
                                              attempt=_a))

                    before = _workers_snapshot(runtime)
                    began = time.perf_counter()
                    summary, records = measure_point(
                        runtime, b, rate, samples, duration=length, warmup=warmup, distribution=distribution,
                        seed=seed, queue_capacity=queue_capacity, on_submit=on_submit, max_delay=max_delay,
                        max_inflight=windows.get(b), server_factory=server_factory,
                    )
                    after = _workers_snapshot(runtime)
                    if tracer is not None:
                        tracer.span(POINTS_LANE, f"b={b} @ {rate:g} req/s" + (" (again)" if attempt > 1 else ""),
                                    began, time.perf_counter(), "sweep point",
                                    {"congested": bool(summary["congested"]), "stable": bool(summary["stable"])})
                    if extend and attempt == 1 and not summary["stable"] and not summary["congested"]:
                        attempt, extended, length = 2, True, 2 * length
                        continue
                    break
                row = make_row(summary, settings, duration=length, extended=extended, bound=bnd)
                row["label"] = settings["label"]
                row["attempts"] = attempt
                row["workers"] = _clean(_workers_delta(before, after, records.end - records.start))
                row["windows"] = _clean(summary.get("windows"))
                row["loadgen"] = _clean(records.settings.get("loadgen"))
                row["placement"] = _clean(summary.get("placement"))
                if simulator is not None:
                    try:
                        row.update(_clean(simulate_row(simulator, row, policy=policy, distribution=distribution,
                                                       seed=seed, queue_capacity=queue_capacity,
                                                       warmup=warmup, max_delay=max_delay)))
                    except StaronnxError as exc:
                        notes.append(f"b={b} @ {rate:g} req/s not simulated: {exc}")
                rows.append(row)
                index += 1
                save()
                notify(SweepEvent("done", index, total, b, rate, row=row, attempt=attempt))
                if stop_on_congestion and row["congested"] and j + 1 < len(rates):
                    rest = rates[j + 1:]
                    skipped.extend({"batch_size": b, "offered_rate": r, "reason": f"congested at {rate:g} req/s"}
                                   for r in rest)
                    index += len(rest)
                    save()
                    notify(SweepEvent("skipped", index, total, b, rate, skipped=list(rest)))
                    break
        from staronnx.bench.optimize import stale_models_note  # optimize imports this module

        stale = stale_models_note(plan, [(r["batch_size"], r["throughput"], r["bound_throughput"]) for r in rows],
                                  groups=groups, cuda_streams=cuda_streams)
        if stale:
            notes.append(stale)
        settings["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        save()
        notify(SweepEvent("end", index, total))
    except BaseException as exc:
        if isinstance(exc, Exception):
            raise
        # Ctrl-C, SIGTERM: the finished points are on disk already; record that the sweep
        # stopped early, so nobody mistakes a partial sweep for a whole one
        settings["interrupted"] = {"signal": signal_name(exc), "points_measured": len(rows),
                                   "points_planned": total}
        save()
        notify(SweepEvent("interrupted", index, total, message=signal_name(exc)))
        raise
    finally:
        if own:
            runtime.close()
    return rows


# ---------------------------------------------------------------------------- reading rows
def best_per_rate(rows: Sequence[Mapping[str, Any]], metric: str = "paper_latency_mean_ms",
                  *, include_congested: bool = False) -> dict[float, dict[str, Any]]:
    """Per offered rate, the row with the lowest ``metric`` among uncongested points."""
    best: dict[float, dict[str, Any]] = {}
    for r in rows:
        v = r.get(metric)
        if v is None or (r.get("congested") and not include_congested):
            continue
        rate = float(r["offered_rate"])
        if rate not in best or v < best[rate][metric]:
            best[rate] = dict(r)
    return dict(sorted(best.items()))
