"""One served model: a plan, its runtime and batching server, and the protocol's view of it.

Both front ends call :meth:`ModelEndpoint.infer` from the event loop with decoded numpy
tensors. A request may carry a batch of its own (axis 0 of its batched inputs): it is *split*
into single samples that join the batcher's queue like everyone else's, so requests from many
clients are coalesced into batches of at most ``batch_size`` whatever their own sizes, and the
answers are concatenated back in order. Passing a client's batch through whole would bypass
the batcher (a batch of 64 from one client would run as 64, starving the others and the
perf models' calibrated sizes).

Each answer to a one-sample request carries, in its response ``parameters``, the batch its
sample ran in (``staronnx_batch_id``, ``staronnx_batch_size``) and where each part ran
(``staronnx_placement``): what a client needs to compute the papers' latency (that of the
first request of each batch) and the CPU share from the outside (``staronnx sweep --url``).
``GET /v2/models/<name>/config`` says how the model is batched (Triton's ``max_batch_size`` and
``dynamic_batching``) and which plan and runtime settings serve it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from staronnx.errors import InputError
from staronnx.plan import Plan
from staronnx.runtime.runtime import Runtime
from staronnx.serve import protocol
from staronnx.serve.metrics import VERSION, ModelStats, ServeMetrics
from staronnx.serve.protocol import ProtocolError, invalid
from staronnx.serving.server import OverloadError, Server, ServerClosed

#: requests (and batches, and queue samples) whose records a served model keeps: the latest
#: few thousand, enough for any look at recent behaviour, while a server that runs for weeks
#: keeps a constant footprint (the Prometheus counters hold the totals)
RECORDS_KEPT = 4096


@dataclass
class Answer:
    """What :meth:`ModelEndpoint.infer` returns: outputs by name, and the response parameters."""

    outputs: dict[str, np.ndarray]
    parameters: dict[str, int | str] = field(default_factory=dict)


class MeteredRuntime:
    """The runtime as the batcher sees it, counting every batch it is handed.

    The batching :class:`~staronnx.serving.server.Server` talks to a runtime through
    ``submit(feeds)``; standing in between is how the executions and their sizes are counted
    without reaching into the server.
    """

    def __init__(self, runtime: Any, on_batch: Any) -> None:
        self.runtime = runtime
        self.plan: Plan = runtime.plan
        self._on_batch = on_batch
        self._batched = [t.name for t in self.plan.inputs if t.shape and not isinstance(t.shape[0], int)]

    @property
    def workers(self) -> list[Any]:
        return list(getattr(self.runtime, "workers", ()) or ())

    @property
    def tracer(self) -> Any:
        return getattr(self.runtime, "tracer", None)

    def submit(self, feeds: Mapping[str, np.ndarray]) -> Future:  # type: ignore[type-arg]
        future = self.runtime.submit(feeds)
        size = int(feeds[self._batched[0]].shape[0]) if self._batched else 1
        future.add_done_callback(lambda f: None if f.cancelled() or f.exception() else self._on_batch(size))
        return future


def inflight_from_models(plan: Plan, batch_size: int, *, groups: str | None, cuda_streams: int) -> int | None:
    """The batches to keep in flight on this plan's runtime, from its perf models, as sweeps and
    the simulator size them (:func:`~staronnx.bench.simulator.machine_inflight`).

    Why not the Server's default (two per worker): with a GPU and CPU groups, dmda only gives a
    batch to a CPU group once the GPU's queue is longer than that group's whole time, so a
    window too short for that leaves the CPUs idle however high the load. None (the default)
    where the plan has no models for these workers yet.
    """
    from staronnx.bench.simulator import build_machine, machine_inflight
    from staronnx.errors import StaronnxError

    try:
        machine = build_machine(plan, groups=groups or "numa", cuda_streams=cuda_streams)
    except StaronnxError:
        return None
    if machine.table.sources:  # some arch's times borrowed from another: no basis for a window
        return None
    return machine_inflight(machine, batch_size)


class ModelEndpoint:
    """A plan served under ``name``; see the module docstring."""

    def __init__(self, name: str, runtime: Any, *, batch_size: int, max_delay: float,
                 queue_capacity: int, metrics: ServeMetrics, settings: Mapping[str, Any] | None = None,
                 keep_records: int | None = RECORDS_KEPT, max_inflight: int | None = None) -> None:
        self.name = name
        self.settings = dict(settings or {})  # the runtime's options, reported by config()
        self.runtime = runtime
        self.plan: Plan = runtime.plan
        self.stats = ModelStats()
        self._metrics = metrics
        self._batch_hist = metrics.batch_size.labels(model=name)
        self._latency_hist = metrics.request_seconds.labels(model=name)
        if max_inflight is None:
            max_inflight = inflight_from_models(self.plan, batch_size, groups=self.settings.get("groups"),
                                                cuda_streams=int(self.settings.get("cuda_streams") or 0))
        self.server = Server(MeteredRuntime(runtime, self._executed), batch_size, max_delay=max_delay,
                             queue_capacity=queue_capacity, on_full="reject", keep_records=keep_records,
                             max_inflight=max_inflight,
                             batch_memory=runtime.batch_array if isinstance(runtime, Runtime) else None)
        self.inputs = {t.name: t for t in self.plan.inputs}
        self.input_datatypes = {t.name: protocol.datatype_of(t.dtype) for t in self.plan.inputs}
        self.output_datatypes = {t.name: protocol.datatype_of(t.dtype) for t in self.plan.outputs}
        self._batched_in = {t.name for t in self.plan.inputs if t.shape and not isinstance(t.shape[0], int)}
        self._batched_out = {t.name for t in self.plan.outputs if t.shape and not isinstance(t.shape[0], int)}
        self.ready = True
        metrics.add(self)

    # -- what the metrics collector reads ------------------------------------------------------
    def _executed(self, size: int) -> None:
        self.stats.executed(size)
        self._batch_hist.observe(size)

    def runtime_stats(self) -> dict[str, Any]:
        return self.runtime.stats()

    @property
    def queue_length(self) -> int:
        return self.server.queue_length

    @property
    def batches_in_flight(self) -> int:
        return self.server.in_flight

    # -- protocol -------------------------------------------------------------------------------
    def check_version(self, version: str | None) -> None:
        if version not in (None, "", VERSION):
            raise ProtocolError("not_found", f"model {self.name!r} has no version {version!r} (it serves version {VERSION})")

    def metadata(self) -> dict[str, Any]:
        """The v2 model metadata: datatypes and shapes, ``-1`` for a dynamic dimension."""
        def tensors(specs: Sequence[Any], types: Mapping[str, str]) -> list[dict[str, Any]]:
            return [{"name": t.name, "datatype": types[t.name], "shape": protocol.metadata_shape(t.shape)}
                    for t in specs]

        return {"name": self.name, "versions": [VERSION], "platform": "staronnx",
                "inputs": tensors(self.plan.inputs, self.input_datatypes),
                "outputs": tensors(self.plan.outputs, self.output_datatypes)}

    def config(self) -> dict[str, Any]:
        """Triton's model configuration (``GET /v2/models/<name>/config``), the fields that apply.

        ``max_batch_size`` and ``dynamic_batching`` tell a client how its samples are batched;
        ``parameters`` (Triton's string-valued form) name the plan and the runtime settings, so
        a remote sweep can check it measures the plan it thinks and record how it was served.
        """
        delay = self.server.max_delay
        params = {"plan_hash": self.plan.hash, "plan": str(self.plan.root),
                  "queue_capacity": self.server.queue_capacity, "max_inflight": self.server.max_inflight,
                  "workers": len(getattr(self.runtime, "workers", ()) or ()),
                  **self.settings}
        meta = self.metadata()

        def tensors(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [{"name": t["name"], "data_type": "TYPE_" + t["datatype"], "dims": t["shape"]} for t in specs]

        return {
            "name": self.name, "platform": "staronnx", "backend": "staronnx",
            "max_batch_size": self.server.batch_size,
            "dynamic_batching": {"max_queue_delay_microseconds": int(round((delay or 0.0) * 1e6))},
            "input": tensors(meta["inputs"]), "output": tensors(meta["outputs"]),
            "parameters": {k: {"string_value": str(v)} for k, v in params.items()},
        }

    def check_request(self, inputs: Mapping[str, np.ndarray], datatypes: Mapping[str, str]) -> int:
        """Names, datatypes, shapes against the plan; returns the request's own batch size."""
        unknown = [n for n in inputs if n not in self.inputs]
        if unknown:
            raise invalid(f"model {self.name!r} has no input(s) {unknown}; its inputs are {list(self.inputs)}")
        missing = [n for n in self.inputs if n not in inputs]
        if missing:
            raise invalid(f"model {self.name!r}: missing input(s) {missing}; its inputs are {list(self.inputs)}")
        for name, dt in datatypes.items():
            if dt != self.input_datatypes[name]:
                raise invalid(f"input {name!r}: datatype {dt}, but model {self.name!r} expects {self.input_datatypes[name]}")
        try:
            self.plan.check_feeds(inputs)
        except InputError as exc:
            raise invalid(f"model {self.name!r}: {exc}") from None
        rows = {n: int(inputs[n].shape[0]) for n in self._batched_in}
        if len(set(rows.values())) > 1:
            raise invalid(f"model {self.name!r}: the batched inputs disagree on the batch size (axis 0): {rows}")
        n = next(iter(rows.values()), 1)
        if n < 1:
            raise invalid(f"model {self.name!r}: input {next(iter(rows))!r} has an empty batch (axis 0 is 0)")
        return n

    async def infer(self, inputs: Mapping[str, np.ndarray], datatypes: Mapping[str, str],
                    outputs: Sequence[str] | None, *, decode_s: float = 0.0) -> Answer:
        """Run one protocol request (already decoded) through the batcher: its outputs by name
        and, for a one-sample request, its batch (see the module docstring).

        Raises :class:`ProtocolError`: invalid input (INVALID_ARGUMENT), a full queue or a
        closing server (UNAVAILABLE), a part that failed (INTERNAL).
        """
        started = time.perf_counter()
        try:
            names = protocol.select_outputs(self.plan.output_names, outputs, self.name)
            n = self.check_request(inputs, datatypes)
        except ProtocolError:
            self.stats.refused("OTHER")
            raise
        futures = self._submit(inputs, n)
        self.stats.started()
        try:
            rows = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        except asyncio.CancelledError:  # the client went away: its samples need not run
            for f in futures:
                f.cancel()
            self.stats.finished(ok=False, reason="CANCELED")
            raise
        except ServerClosed as exc:
            self.stats.finished(ok=False, reason="REJECTED")
            raise ProtocolError("unavailable", f"model {self.name!r}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a failing part fails this request only
            self.stats.finished(ok=False, reason="BACKEND")
            raise ProtocolError("internal", f"model {self.name!r}: inference failed: {exc}") from None
        result = {name: self._join(name, [r[name] for r in rows]) for name in names}
        done = time.perf_counter()
        queue_s, infer_s = _batch_times(futures, started)
        self.stats.finished(ok=True, request_s=done - started + decode_s, queue_s=queue_s, input_s=decode_s,
                            infer_s=infer_s)
        self._latency_hist.observe(done - started + decode_s)
        return Answer(result, _batch_parameters(futures))

    def _submit(self, inputs: Mapping[str, np.ndarray], n: int) -> list[Future]:  # type: ignore[type-arg]
        """One sample per row into the batcher; all or none (a full queue refuses the whole request)."""
        futures: list[Future] = []  # type: ignore[type-arg]
        try:
            for i in range(n):
                sample = {k: (v[i:i + 1] if k in self._batched_in else v) for k, v in inputs.items()}
                futures.append(self.server.submit(sample))
        except (OverloadError, ServerClosed) as exc:
            for f in futures:
                f.cancel()
            self.stats.refused("REJECTED")
            why = "the server is shutting down" if isinstance(exc, ServerClosed) else (
                f"the request queue is full ({self.server.queue_capacity} samples waiting); retry later")
            raise ProtocolError("unavailable", f"model {self.name!r}: {why}") from None
        except InputError as exc:  # the batcher's own one-sample check (should not happen after ours)
            for f in futures:
                f.cancel()
            self.stats.refused("OTHER")
            raise invalid(f"model {self.name!r}: {exc}") from None
        return futures

    def _join(self, name: str, parts: list[np.ndarray]) -> np.ndarray:
        if len(parts) == 1 or name not in self._batched_out:
            return parts[0]
        return np.concatenate(parts, axis=0)

    def close(self, timeout: float) -> None:
        """Drain the batcher (every accepted request is answered), then stop the runtime."""
        self.ready = False
        try:
            self.server.close(timeout)
        finally:
            self.runtime.close(timeout)


def _batch_parameters(futures: Sequence[Future]) -> dict[str, int | str]:  # type: ignore[type-arg]
    """The batch of a one-sample request, as response parameters (none for a client batch,
    whose samples may have run in several batches)."""
    if len(futures) != 1:
        return {}
    batch = getattr(futures[0], "batch", None)
    if batch is None:
        return {}
    params: dict[str, int | str] = {"staronnx_batch_id": int(batch.id), "staronnx_batch_size": int(batch.size)}
    if batch.placement:
        params["staronnx_placement"] = ",".join(f"{p}={a}" for p, a in sorted(batch.placement.items()))
    return params


def _batch_times(futures: Sequence[Future], started: float) -> tuple[float, float]:  # type: ignore[type-arg]
    """(queue, compute) seconds of a request: until its last sample's batch formed, and that
    batch's run (from the batch records the server attaches to each sample's future)."""
    batches = [getattr(f, "batch", None) for f in futures]
    formed = [b.formed for b in batches if b is not None and b.formed is not None]
    done = [b.done for b in batches if b is not None and b.done is not None]
    if not formed or not done:
        return 0.0, 0.0
    queue = max(max(formed) - started, 0.0)
    return queue, max(max(done) - max(formed), 0.0)
