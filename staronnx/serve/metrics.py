"""Prometheus metrics of the network server: Triton's names where Triton has one, staronnx's own
for what only a heterogeneous scheduler knows.

Why Triton's names: dashboards and alerts written for Triton (``nv_inference_request_success``,
``nv_inference_exec_count``, ...) then work on staronnx unchanged. prometheus_client appends
``_total`` to every counter it exposes, which would rename them, so those few are exposed
*untyped* under their exact names (``rate()`` works on them all the same); everything else
is a regular prometheus_client metric.

Counts are kept per model in :class:`ModelStats` (plain numbers under a lock: one request
touches several of them at once) and read by :class:`ServeCollector` at scrape time, which
also asks each runtime for its per-(part, arch) task counts, worker busy fractions and
perf-model errors, so the scrape reads the runtime's own bookkeeping instead of a second copy.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as _Tally
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, GCCollector, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, UnknownMetricFamily

#: the model version every plan is served as (a plan folder is one immutable version)
VERSION = "1"

#: failure reasons, as Triton labels nv_inference_request_failure
REASONS = ("REJECTED", "BACKEND", "OTHER", "CANCELED")


@dataclass
class ModelStats:
    """Cumulative request counts and durations of one model (what Triton's counters report)."""

    success: int = 0
    failure: _Tally[str] = field(default_factory=_Tally)
    inference_count: int = 0  # samples run (a batch of 8 counts 8)
    exec_count: int = 0  # batches run: inference_count / exec_count = mean batch size
    pending: int = 0  # requests accepted and not yet answered
    request_us: float = 0.0
    queue_us: float = 0.0
    input_us: float = 0.0
    infer_us: float = 0.0
    output_us: float = 0.0
    fail_us: float = 0.0  # cumulative duration of the failed requests (Triton's fail.ns)
    last_inference_ms: int = 0  # wall clock of the last answer, ms since the epoch (0: none yet)
    deadline_misses: int = 0  # requests answered later than the model's latency target
    batches: dict[int, list[float]] = field(default_factory=dict)  # batch size -> [executions, run seconds]
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def started(self) -> None:
        with self._lock:
            self.pending += 1

    def finished(self, *, ok: bool, reason: str = "OTHER", request_s: float = 0.0, queue_s: float = 0.0,
                 input_s: float = 0.0, infer_s: float = 0.0, output_s: float = 0.0, late: bool = False) -> None:
        """One request answered (``ok``) or failed for ``reason``; durations in seconds;
        ``late``: answered after its model's latency target."""
        with self._lock:
            self.deadline_misses += late
            self.pending -= 1
            self.last_inference_ms = int(time.time() * 1000)
            if not ok:
                self.failure[reason] += 1
                self.fail_us += request_s * 1e6
                return
            self.success += 1
            self.request_us += request_s * 1e6
            self.queue_us += queue_s * 1e6
            self.input_us += input_s * 1e6
            self.infer_us += infer_s * 1e6
            self.output_us += output_s * 1e6

    def encoded(self, seconds: float) -> None:
        """Time spent encoding a response (after the request counted as answered)."""
        with self._lock:
            self.output_us += seconds * 1e6

    def decoded(self, seconds: float) -> None:
        """Time a front end spent decoding a request answered by another process's endpoint (the
        Ray ingress, whose replicas count the rest): part of its duration and of compute_input."""
        with self._lock:
            self.request_us += seconds * 1e6
            self.input_us += seconds * 1e6

    def refused(self, reason: str) -> None:
        """A request failed before it was accepted (bad input, full queue)."""
        with self._lock:
            self.failure[reason] += 1

    def executed(self, batch_size: int, seconds: float = 0.0) -> None:
        """One batch of ``batch_size`` samples ran, in ``seconds`` (submit to done)."""
        with self._lock:
            self.exec_count += 1
            self.inference_count += batch_size
            row = self.batches.setdefault(batch_size, [0, 0.0])
            row[0] += 1
            row[1] += seconds

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            counts = {k: v for k, v in vars(self).items() if k != "_lock"}
            return {**counts, "failure": dict(self.failure),
                    "batches": {size: tuple(row) for size, row in self.batches.items()}}


def merge_snapshots(snapshots: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One model's counts over several :meth:`ModelStats.snapshot` (the replicas of a Ray
    deployment and the ingress in front of them): every count and duration summed, the last
    inference the latest. Each snapshot only ever grows, so a sum of the latest ones does too."""
    out = ModelStats().snapshot()
    for s in snapshots:
        for key, value in s.items():
            if key == "failure":
                out[key] = dict(_Tally(out[key]) + _Tally(value))
            elif key == "batches":
                for size, (n, secs) in value.items():
                    was = out[key].get(size, (0, 0.0))
                    out[key][size] = (was[0] + n, was[1] + secs)
            elif key == "last_inference_ms":
                out[key] = max(out[key], value)
            elif key in out:
                out[key] += value
    return out


def triton_statistics(name: str, s: Mapping[str, Any]) -> dict[str, Any]:
    """Triton's statistics extension for model ``name`` from its counts ``s`` (a
    :meth:`ModelStats.snapshot`): the document ``GET /v2/models/<name>/stats`` and gRPC
    ``ModelStatistics`` carry.

    As Triton defines them: ``success``/``fail`` count the requests answered and failed with
    their cumulative end-to-end durations; ``queue`` and ``compute_input``/``compute_infer``/
    ``compute_output`` the cumulative times of the successful ones (waiting for a batch,
    decoding the request, their batches' runs, encoding the response); ``inference_count``
    samples run, ``execution_count`` batches run, and ``batch_stats`` the batches of each size
    with their cumulative run times. Durations in nanoseconds.
    """
    ok = s["success"]

    def d(count: int, us: float) -> dict[str, int]:
        return {"count": int(count), "ns": int(round(us * 1e3))}

    return {
        "name": name, "version": VERSION, "last_inference": s["last_inference_ms"],
        "inference_count": s["inference_count"], "execution_count": s["exec_count"],
        "inference_stats": {
            "success": d(ok, s["request_us"]), "fail": d(sum(s["failure"].values()), s["fail_us"]),
            "queue": d(ok, s["queue_us"]), "compute_input": d(ok, s["input_us"]),
            "compute_infer": d(ok, s["infer_us"]), "compute_output": d(ok, s["output_us"]),
            "cache_hit": d(0, 0), "cache_miss": d(0, 0),
        },
        "response_stats": {},
        "batch_stats": [{"batch_size": size, "compute_input": d(n, 0), "compute_infer": d(n, secs * 1e6),
                         "compute_output": d(n, 0)}
                        for size, (n, secs) in sorted(s["batches"].items())],
        "memory_usage": [],
    }


class ServedModel(Protocol):
    """What the collector reads from a served model (:class:`staronnx.serve.models.ModelEndpoint`)."""

    name: str
    version: str
    stats: ModelStats
    #: the model's latency target in seconds (None: none)
    latency_target: float | None

    def runtime_stats(self) -> dict[str, Any]: ...

    @property
    def queue_length(self) -> int: ...

    @property
    def batches_in_flight(self) -> int: ...


_TRITON = (
    # (name, help, snapshot key): untyped but the pending count, labelled by model and version
    ("nv_inference_request_success", "Number of successful inference requests", "success"),
    ("nv_inference_count", "Number of inferences performed (a batch of n counts n)", "inference_count"),
    ("nv_inference_exec_count", "Number of model executions (batches) performed", "exec_count"),
    ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds (queue + compute)",
     "request_us"),
    ("nv_inference_queue_duration_us", "Cumulative time requests spent waiting for a batch, in microseconds",
     "queue_us"),
    ("nv_inference_compute_input_duration_us", "Cumulative time decoding request tensors, in microseconds",
     "input_us"),
    ("nv_inference_compute_infer_duration_us", "Cumulative time the runtime took over the requests' batches, "
     "in microseconds", "infer_us"),
    ("nv_inference_compute_output_duration_us", "Cumulative time encoding response tensors, in microseconds",
     "output_us"),
    ("nv_inference_pending_request_count", "Requests accepted and not yet answered", "pending"),  # a gauge
)


class ServeCollector:
    """Renders every model's counts and its runtime's state at scrape time."""

    def __init__(self, models: Sequence[ServedModel],
                 composing: Mapping[str, Mapping[str, Callable[[], dict[str, Any]]]] | None = None) -> None:
        self.models = list(models)
        #: member name -> ensemble name -> the member's counts from that ensemble's task graph
        self.composing = composing if composing is not None else {}

    def snapshot(self, model: ServedModel) -> dict[str, Any]:
        """A model's counts, with its runs inside ensembles' task graphs (Triton counts a
        composing model's share of every ensemble request it serves)."""
        own = model.stats.snapshot()
        composed = [counts() for counts in list(self.composing.get(model.name, {}).values())]
        return merge_snapshots([own, *composed]) if composed else own

    def collect(self) -> Iterator[Any]:
        labels = ["model", "version"]
        snaps = [(m, self.snapshot(m)) for m in self.models]
        fail = UnknownMetricFamily("nv_inference_request_failure", "Number of failed inference requests, by reason",
                                   labels=[*labels, "reason"])
        for m, s in snaps:
            for reason in REASONS:
                fail.add_metric([m.name, m.version, reason], s["failure"].get(reason, 0))
        yield fail
        for name, doc, key in _TRITON:
            fam = (GaugeMetricFamily if key == "pending" else UnknownMetricFamily)(name, doc, labels=labels)
            for m, s in snaps:
                fam.add_metric([m.name, m.version], s[key])
            yield fam
        yield from self._staronnx()

    def _staronnx(self) -> Iterator[Any]:
        queue = GaugeMetricFamily("staronnx_queue_length", "Requests waiting in the batcher's queue", labels=["model"])
        inflight = GaugeMetricFamily("staronnx_batches_in_flight", "Batches handed to the runtime, not yet done",
                                     labels=["model"])
        tasks = CounterMetricFamily("staronnx_tasks", "Tasks run, per part and worker architecture",
                                    labels=["model", "part", "arch"])
        busy = GaugeMetricFamily("staronnx_worker_busy_ratio",
                                 "Fraction of the runtime's lifetime each worker spent running this model's "
                                 "tasks (models sharing a runtime share its workers)",
                                 labels=["model", "worker", "arch"])
        misses = CounterMetricFamily("staronnx_deadline_misses", "Requests answered later than the model's "
                                     "latency target (--slo-ms)", labels=["model"])
        target = GaugeMetricFamily("staronnx_latency_target_seconds", "The model's latency target (--slo-ms)",
                                   labels=["model"])
        error = GaugeMetricFamily("staronnx_perfmodel_prediction_error_ratio",
                                  "Mean predicted / mean measured task time - 1, per part and arch "
                                  "(0 = the perf model describes the machine)", labels=["model", "part", "arch"])
        for m in self.models:
            queue.add_metric([m.name], m.queue_length)
            inflight.add_metric([m.name], m.batches_in_flight)
            misses.add_metric([m.name], m.stats.snapshot()["deadline_misses"])
            if m.latency_target is not None:
                target.add_metric([m.name], m.latency_target)
            try:
                st = m.runtime_stats()
            except Exception:  # noqa: BLE001 - a closing runtime must not fail the whole scrape
                continue
            for key, row in st.get("tasks", {}).items():
                part, _, arch = key.partition("/")
                tasks.add_metric([m.name, part, arch], row["tasks"])
                pred, meas = row.get("predicted_ms"), row.get("measured_ms")
                if pred and meas:  # 0 or None: never predicted (uncalibrated)
                    error.add_metric([m.name, part, arch], pred / meas - 1.0)
            for worker, row in st.get("workers", {}).items():
                busy.add_metric([m.name, worker, str(row.get("arch", ""))], float(row.get("busy", 0.0)))
        yield from (queue, inflight, tasks, busy, error, misses, target)


class ServeMetrics:
    """The registry a server exposes on ``/metrics``: the collector plus two histograms."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        #: member name -> ensemble name -> the member's counts from its runs inside that ensemble's
        #: task graph (a one-task-graph ensemble registers them; the member's statistics add them)
        self.composing: dict[str, dict[str, Callable[[], dict[str, Any]]]] = {}
        self.collector = ServeCollector([], self.composing)
        self.registry.register(self.collector)
        # what every Python exporter shows (prometheus_client's default registry has them):
        # the process's CPU, memory and file descriptors, and its cycle collections per
        # generation (python_gc_collections_total), which stop every thread of the server
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.batch_size = Histogram(
            "staronnx_batch_size", "Requests per batch the runtime ran (dynamic batching at work)",
            ["model"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=self.registry)
        self.request_seconds = Histogram(
            "staronnx_request_duration_seconds", "Latency of successful inference requests, server side",
            ["model"], buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10),
            registry=self.registry)

    def add(self, model: ServedModel) -> None:
        self.collector.models.append(model)

    def remove(self, model: ServedModel) -> None:
        """Stop reporting ``model`` (unloaded, or replaced by a reload)."""
        if model in self.collector.models:
            self.collector.models.remove(model)

    def served(self, name: str) -> list[Any]:
        """The served models named ``name`` (each version served is one), in the order they were
        added: where a step-by-step ensemble finds its members."""
        return [m for m in self.collector.models if m.name == name]

    def snapshot(self, model: ServedModel) -> dict[str, Any]:
        """``model``'s counts, its runs inside ensembles' task graphs included (see :attr:`composing`)."""
        return self.collector.snapshot(model)
