"""Measuring one sweep point on a live runtime: warm-up, the sample pool, one open-loop point.

Shared by the sweep and the batch-size optimizer's live verification, so both measure a
point the same way: a fresh :class:`~staronnx.serving.Server` per point on one shared runtime,
a point long enough to hold ``min_batches`` batch fills, and the runtime left idle before the
next point starts.

Every door that measures or simulates batch sizes asks :func:`runnable_sizes` first: a model
that runs one request per task (``plan.contract.batchable`` is False: a fixed batch of 1, an
output whose batch axis cannot be told) has only batch 1 to measure, and a figure for a batch
that never ran would be a lie. Failures are watched too (:func:`measure_point`): a point whose
requests failed is reported ``failed`` with the first reason, never as a load too high.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from staronnx.bench.spec import RunSpec
from staronnx.inputs import batch_of, samples as input_samples
from staronnx.plan import Plan
from staronnx.serving import ServeSpec, Server, make_arrivals, run_open_loop, summarize
from staronnx.serving.records import RunRecords, error_line
from staronnx.verify import random_plan_feeds


def runnable_sizes(plan: Plan, batch_sizes: Sequence[int]) -> tuple[list[int], str | None]:
    """The batch sizes of ``batch_sizes`` that mean something for ``plan`` (sorted, distinct),
    and one line saying which were left out and why (None when none was).

    A model that runs one request per task (:attr:`~staronnx.contract.BatchContract.batchable`
    False) is measured, simulated and bounded at batch 1 only: its requests never share a task,
    so a "batch of 4" would be four tasks labelled as one batch.
    """
    sizes = sorted({int(b) for b in batch_sizes})
    contract = plan.contract
    if contract.batchable or sizes == [1]:
        return sizes, None
    left = [b for b in sizes if b != 1]
    return [1], (f"batch size(s) {', '.join(map(str, left))} left out, batch 1 only: this model runs one request "
                 f"per task (max_batch_size 0): {contract.why_not}")


def sample_pool(plan: Plan, count: int = 16, seed: int = 0,
                inputs: Mapping[str, np.ndarray] | None = None) -> list[dict[str, np.ndarray]]:
    """Single-sample requests (one sample on each input's own batch axis) reused round-robin by
    the generator: random ones, or each sample of real ``inputs`` (see :mod:`staronnx.inputs`).

    Random requests share their per-request values (the inputs without a batch axis, a scalar
    ``sample_rate``): the server batches only requests that agree on them (Triton's rule), and a
    sweep of batch size ``b`` measures batches of ``b``, as its simulation and bound assume,
    not requests waiting in several queues for a partner of the same value.
    """
    if inputs is not None:
        return [batch_of(inputs, plan, 1, i) for i in range(input_samples(inputs, plan))]
    pool = [random_plan_feeds(plan, 1, seed=seed + i) for i in range(count)]
    shared = [name for name, axis in plan.contract.inputs.items() if axis is None]
    if plan.contract.batchable and shared:
        for sample in pool[1:]:
            sample.update({name: pool[0][name] for name in shared if name in pool[0]})
    return pool


def point_duration(duration: float, warmup: float, batch_size: int, rate: float, min_batches: int) -> float:
    """A point's length: ``duration``, stretched to hold ``min_batches`` batch fills after warm-up."""
    return max(duration, warmup + min_batches * batch_size / rate)


def warm_up(runtime: Any, plan: Plan, batch_sizes: Sequence[int], *, rounds: int = 3, seed: int = 0,
            inputs: Mapping[str, np.ndarray] | None = None) -> str | None:
    """Run bursts of batches of every size through the runtime before measuring; why the first
    batch that failed did (one line), None when all ran.

    Each burst submits more batches than there are workers, so queues build and the policy
    spreads them: every worker meets every size (allocations, kernel choice) before the first
    measured point. Tasks cannot be sent to a given worker directly: the engine's serving
    loops own the worker threads. A model's failure (ONNX Runtime refusing the batch) is
    returned, not raised: the points that follow fail the same way and say so, where a raise
    would end the whole sweep in a traceback.
    """
    n_workers = max(1, len(runtime.workers))
    for b in batch_sizes:
        feeds = random_plan_feeds(plan, b, seed=seed) if inputs is None else batch_of(inputs, plan, b, 0)
        for _ in range(rounds):
            futures = [runtime.submit(feeds) for _ in range(3 * n_workers)]
            errors = [f.exception() for f in futures]
            failed = next((e for e in errors if e is not None), None)
            if failed is not None:
                return f"batch {b}: {error_line(failed)}"
    return None


class PointServer(Protocol):
    """What a point serves through: the part of :class:`Server` that :func:`measure_point` and
    :func:`~staronnx.serving.run_open_loop` use, which a front end over the network
    (:class:`~staronnx.bench.remote.RemoteServer`) has too."""

    @property
    def clock(self) -> Callable[[], float]: ...

    def submit(self, sample: Mapping[str, np.ndarray], arrival: float | None = None) -> Future[Any]: ...

    def flush(self) -> None: ...

    def wait_idle(self, timeout: float | None = None) -> int: ...

    def records(self, *, since: float | None = None, offered_rate: float | None = None,
                start: float | None = None) -> RunRecords: ...

    def close(self, timeout: float | None = 30.0) -> None: ...


#: builds a point's front end from the runtime and the point's ServeSpec (:class:`Server`'s arguments)
ServerFactory = Callable[[Any, ServeSpec], PointServer]


class _Watched:
    """A point's front end (a :class:`Server` or what stands in for it), with a few of its
    requests' futures watched for the first failure's reason, for front ends whose records do
    not say it (a request's ``error``).

    Watching costs a callback per watched request on the serving path, so only the first
    :attr:`FIRST` requests and then one in :attr:`EVERY` are watched, and none once a reason is
    known: a model that fails every request is caught at once, a rare failure most often."""

    FIRST = 16
    EVERY = 64

    def __init__(self, server: PointServer) -> None:
        self.server = server
        self.clock = server.clock
        self.error: str | None = None
        self._n = 0

    def submit(self, sample: Mapping[str, np.ndarray], arrival: float | None = None) -> Future[Any]:
        future = self.server.submit(sample, arrival=arrival)
        self._n += 1
        if self.error is None and (self._n <= self.FIRST or self._n % self.EVERY == 0):
            future.add_done_callback(self._seen)
        return future

    def _seen(self, future: Future[Any]) -> None:
        if self.error is None and not future.cancelled():
            exc = future.exception()
            if exc is not None:
                self.error = error_line(exc)

    def flush(self) -> None:
        self.server.flush()

    def wait_idle(self, timeout: float | None = None) -> int:
        return self.server.wait_idle(timeout)

    def records(self, *, since: float | None = None, offered_rate: float | None = None,
                start: float | None = None) -> RunRecords:
        return self.server.records(since=since, offered_rate=offered_rate, start=start)


def measure_point(runtime: Any, batch_size: int, rate: float, samples: Sequence[Mapping[str, np.ndarray]],
                  run: RunSpec, *, drain_timeout: float | None = None,
                  on_submit: Callable[[int, int], None] | None = None, max_inflight: int | None = None,
                  server_factory: ServerFactory | None = None) -> tuple[dict[str, Any], RunRecords]:
    """Serve ``rate`` requests/s in batches of ``batch_size`` for ``run.duration`` s, its traffic
    and batching as ``run`` says (:class:`~staronnx.bench.spec.RunSpec`: its ``warmup`` left
    out of the summary, default ``min(1, duration / 5)``); (summary, records).

    Batches leave only when full, or, with ``max_delay`` (Triton's dynamic batching), once
    their oldest request waited that long. After the schedule the generator waits at most
    ``drain_timeout`` s (default ``max(5, duration/2)``) for outstanding results, then closes
    the server with a short timeout, so a congested point does not spend minutes draining a
    full queue (what is cut counts as pending). ``server_factory`` builds the batching front
    end instead of :class:`Server`, with the same arguments (the runtime and a ServeSpec)
    (:class:`staronnx.bench.remote.RemoteServer` sends the requests over the network).
    ``colocate``: the generator (this thread) and the server's batcher run on the runtime's host
    core (its CUDA driver's, or without CUDA workers its first CPU worker's) for the point
    (:meth:`~staronnx.runtime.runtime.Runtime.colocate`), where the threads that hold the GIL
    in turn hand it over cheapest; the records' ``loadgen`` settings name that core (``core``:
    None when the block had none to give).
    """
    duration = run.duration
    warmup = min(1.0, duration / 5) if run.warmup is None else run.warmup
    factory: ServerFactory = server_factory or Server
    block = runtime.colocate() if run.colocate else contextlib.nullcontext()
    arrivals = make_arrivals(run.distribution, rate, seed=run.seed)
    drain = max(5.0, duration / 2) if drain_timeout is None else drain_timeout
    n = len(samples)
    with block as core:
        server = factory(runtime, ServeSpec(batch_size, run.max_delay, max(run.queue_capacity, batch_size),
                                            max_inflight=max_inflight, colocate=run.colocate))
        watched = _Watched(server)
        try:
            # run_open_loop declares a Server; it uses the PointServer part of one, which _Watched has
            records = run_open_loop(watched, arrivals, lambda i: samples[i % n],  # type: ignore[arg-type]
                                    duration=duration, drain_timeout=drain, on_submit=on_submit)
        finally:
            server.close(timeout=2.0)
            wait_idle(runtime)
    if records.first_error is None:
        records.first_error = watched.error
    records.settings["distribution"] = run.distribution
    if run.colocate:
        records.settings.setdefault("loadgen", {})["core"] = core
    return summarize(records, warmup=warmup), records


def _stats(runtime: Any) -> dict[str, Any]:
    """``runtime.stats()``, or {} for a stand-in runtime that keeps none."""
    try:
        return dict(runtime.stats())
    except Exception:  # noqa: BLE001 - a stand-in runtime without stats
        return {}


def wait_idle(runtime: Any, timeout: float = 30.0) -> bool:
    """Wait until the runtime has no request in flight (a cut-off point's batches finish), so
    the next point starts on idle workers; False after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if int(_stats(runtime).get("in_flight", 0)) == 0:
            return True
        time.sleep(0.01)
    return False


def workers_snapshot(runtime: Any) -> dict[str, tuple[int, float]]:
    """worker name -> (tasks done, busy seconds) so far, from ``Runtime.stats()``."""
    stats = _stats(runtime)
    elapsed = float(stats.get("elapsed_s", 0.0))
    return {name: (int(w.get("tasks", 0)), float(w.get("busy", 0.0)) * elapsed)
            for name, w in (stats.get("workers") or {}).items()}


def tasks_snapshot(runtime: Any) -> dict[str, tuple[int, float, float]]:
    """``"part<p>/<arch>"`` -> (tasks, measured seconds, predicted seconds) so far, from
    ``Runtime.stats()`` (means times counts: the predictions of the tasks that had one)."""
    out = {}
    for key, row in (_stats(runtime).get("tasks") or {}).items():
        n = int(row.get("tasks") or 0)
        measured = row.get("measured_ms")
        predicted = row.get("predicted_ms")
        out[key] = (n, (measured or 0.0) * n / 1e3,
                    predicted * n / 1e3 if isinstance(predicted, (int, float)) and math.isfinite(predicted) else math.nan)
    return out


def task_time_ratio(before: Mapping[str, tuple[int, float, float]],
                    after: Mapping[str, tuple[int, float, float]]) -> float | None:
    """The tasks' measured time over their perf models' predictions between two
    :func:`tasks_snapshot` (every task run meanwhile, weighted by its time): 1.0 where the
    models still fit the machine, above it where tasks ran slower than calibrated (others on
    the cores, or models calibrated on a quieter machine); None without predictions."""
    measured = predicted = 0.0
    for key, (n, m, p) in after.items():
        n0, m0, p0 = before.get(key, (0, 0.0, 0.0))
        if n <= n0 or not (math.isfinite(p) and math.isfinite(p0)):
            continue
        measured += m - m0
        predicted += p - p0
    return measured / predicted if predicted > 0 else None


#: tasks a window needs for its own speed (:meth:`TaskSampler.ratio`): fewer read the noise
WINDOW_TASKS = 20


class TaskSampler:
    """The runtime's task totals (:func:`tasks_snapshot`) every ``interval`` s while a point
    runs, on the load generator's clock, so the tasks' speed can be read per measurement window.

    Over a whole point a machine that slowed for one window of three moves the tasks' ratio by
    a third only, while near the capacity the backlog it left sets the latency of every window
    after: unet_seg at batch 1, 450 req/s, read p50 3.8, 309 and 119 ms in its three windows,
    its tasks x1.08 the points before over the point, unflagged.
    """

    def __init__(self, runtime: Any, interval: float = 0.1, clock: Callable[[], float] = time.perf_counter) -> None:
        self.runtime, self.interval, self.clock = runtime, interval, clock
        self.samples: list[tuple[float, dict[str, tuple[int, float, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="staronnx-task-sampler", daemon=True)

    def _take(self) -> None:
        self.samples.append((self.clock(), tasks_snapshot(self.runtime)))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._take()

    def __enter__(self) -> TaskSampler:
        self._take()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._take()

    def ratio(self, start: float, end: float) -> float | None:
        """The tasks' time over their models between the samples around ``start`` and ``end``
        (the last at or before ``start``, the first at or after ``end``); None where fewer than
        :data:`WINDOW_TASKS` tasks ran between them or nothing had a prediction."""
        if not self.samples:
            return None
        before = max((s for s in self.samples if s[0] <= start), key=lambda s: s[0], default=self.samples[0])[1]
        after = min((s for s in self.samples if s[0] >= end), key=lambda s: s[0], default=self.samples[-1])[1]
        ran = sum(max(n - before.get(key, (0, 0.0, 0.0))[0], 0) for key, (n, _, _) in after.items())
        return task_time_ratio(before, after) if ran >= WINDOW_TASKS else None


def workers_delta(before: Mapping[str, tuple[int, float]], after: Mapping[str, tuple[int, float]],
                  seconds: float) -> dict[str, dict[str, float]]:
    """Per worker, what it did between two :func:`workers_snapshot`: tasks, share of the
    tasks, busy fraction of ``seconds``."""
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
