"""One served model: a plan, its runtime and batching server, and the protocol's view of it.

Both front ends call :meth:`ModelEndpoint.infer` from the event loop with decoded numpy
tensors. Everything about the batch follows the plan's batching contract (``plan.contract``,
:mod:`staronnx.contract`), never "axis 0": a ``state [2, batch, 64]`` carries it on axis 1, a
CTC head's ``[time, batch, classes]`` output too, a scalar ``sample_rate`` has none. A request
may carry a batch of its own (along each input's batch axis): its n rows join the batcher's
queue as one request taking n places in a batch (Triton's dynamic batcher does the same), so
requests from many clients are coalesced into batches of at most ``batch_size`` whatever their
own sizes, and the answer is the request's own rows of its batch's outputs (views: no cut into
one-row requests, no concatenation of their answers). One of more rows than a batch holds is cut
into pieces of ``batch_size`` rows (its per-request values, the inputs without a batch axis, go
whole with each) whose answers are concatenated back in order along each output's own batch
axis: passing it through whole would bypass the batcher (a batch of 64 from one client would run
as 64, starving the others and the perf models' calibrated sizes). The door checks a request
once (:meth:`ModelEndpoint.check_request`); the batcher and the runtime trust it. A model that
cannot batch (a fixed batch of 1, an output whose batch axis cannot be told) takes each request
whole, as one task: Triton's ``max_batch_size: 0``.

Each answer to a request that ran in one batch carries, in its response ``parameters``, the
batch it ran in (``staronnx_batch_id``, ``staronnx_batch_size``) and where each part ran
(``staronnx_placement``): what a client needs to compute the papers' latency (that of the
first request of each batch) and the CPU share from the outside (``staronnx sweep --url``).
``GET /v2/models/<name>/config`` says how the model is batched (Triton's ``max_batch_size`` and
``dynamic_batching``, and the contract in its ``parameters``) and which plan and runtime
settings serve it.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from staronnx.contract import BatchContract
from staronnx.errors import InputError, StaronnxError
from staronnx.plan import Plan
from staronnx.runtime.runtime import ModelHandle, Runtime
from staronnx.runtime.task import RequestFuture
from staronnx.serve import protocol
from staronnx.serve.metrics import VERSION, ModelStats, ServeMetrics, triton_statistics
from staronnx.serve.protocol import ProtocolError, invalid, shown
from staronnx.serve.sequences import SequencePolicy, Sequences, request_of
from staronnx.serving.priority import QueuePolicy, QueueRequestError
from staronnx.serving.server import LevelFullError, OverloadError, Server, ServerClosed
from staronnx.serving.spec import ServeSpec
from staronnx.serving.window import inflight_from_models
from staronnx.workers.cuda import CudaWorker

if TYPE_CHECKING:  # the ensemble module reads Triton's config proto, which a door loads only with a repository
    from staronnx.serve.ensemble import EnsembleSpec, Step

#: requests (and batches, and queue samples) whose records a served model keeps: the latest
#: few thousand, enough for any look at recent behaviour, while a server that runs for weeks
#: keeps a constant footprint (the Prometheus counters hold the totals)
RECORDS_KEPT = 4096
#: a served model's batching, which its caller sets the batch size and delays of with
#: ``dataclasses.replace``: the event loop must never block on a full queue, and a server that
#: runs for weeks keeps only recent records
ENDPOINT_SPEC = ServeSpec(1, on_full="reject", keep_records=RECORDS_KEPT)


def check_version(name: str, version: str | None, served: str = VERSION) -> None:
    """Refuse a version of model ``name`` other than the one ``served``, in Triton's wording (a
    plan folder is one immutable version; a repository model is served at one version)."""
    if version not in (None, "", served):
        raise ProtocolError("not_found", f"Request for unknown model: {shown(name)} has no version "
                                         f"{shown(version)} (it serves version {served})")


@dataclass(frozen=True)
class Declared:
    """What a model repository says of a model it serves (:mod:`staronnx.serve.repository`): the
    version served, the effective config (Triton's JSON form, completed from the model), and each
    output's labels (its ``label_filename``)."""

    version: str
    config: Mapping[str, Any]
    labels: Mapping[str, Sequence[str]] = field(default_factory=dict)
    #: tensor name -> (the client's dims, the model's), without the batch: a config's ``reshape``
    reshapes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    #: dynamic_batching.preserve_ordering: answers leave in the order the requests came
    preserve_ordering: bool = False
    #: a stateful model's sequence_batching (:class:`~staronnx.serve.sequences.SequencePolicy`), or None
    sequence: SequencePolicy | None = None
    #: an ensemble's steps (:mod:`staronnx.serve.ensemble`; None: a model of its own)
    ensemble: "EnsembleSpec | None" = None
    #: whether the config's max_queue_size sized its queue (else the server's --queue-capacity)
    queue_sized: bool = False


@dataclass
class Answer:
    """What :meth:`ModelEndpoint.infer` returns: outputs by name, and the response parameters."""

    outputs: dict[str, np.ndarray]
    parameters: dict[str, int | str] = field(default_factory=dict)


class Handoff:
    """The batcher's results handed to the event loop, one wake-up for all that finish together.

    ``asyncio.wrap_future`` wakes the loop once per request: a ``call_soon_threadsafe`` (a write
    to the loop's self-pipe, and a GIL hand-over from the batcher thread) for each of a batch's
    8 futures, and a chained future with callbacks both ways per request. Here a finished future
    is queued under a lock and the loop is woken only when the queue was empty, so a batch costs
    one wake-up, and the loop settles the batch's requests in one callback. Cancelling goes the
    other way explicitly (:meth:`ModelEndpoint.infer` cancels its samples when its client leaves).
    """

    __slots__ = ("loop", "_lock", "_items", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Future[Any], Future[Any]]] = []
        self._scheduled = False

    def watch(self, future: Future[Any]) -> asyncio.Future[Any]:
        """An asyncio future (of this loop) that takes ``future``'s outcome once it is done."""
        waiter = self.loop.create_future()
        future.add_done_callback(functools.partial(self._post, waiter))
        return waiter

    def _post(self, waiter: asyncio.Future[Any], future: Future[Any]) -> None:
        """(Any thread: the batcher's, or the loop's for a cancel.) Queue; wake the loop if idle."""
        with self._lock:
            self._items.append((waiter, future))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody awaits these any more
            pass

    def _drain(self) -> None:
        """(The loop.) Settle every queued waiter."""
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for waiter, future in items:
            if waiter.done():  # its request was cancelled while the result travelled
                continue
            if future.cancelled():
                waiter.cancel()
                continue
            exc = future.exception()
            if exc is not None:
                waiter.set_exception(exc)
            else:
                waiter.set_result(future.result())


def unservable(plan: Plan) -> str | None:
    """Why ``plan`` cannot be served over KServe v2 (a tensor of a type the protocol has no
    datatype for: a sequence, a map, bfloat16, ...), or None. Checked before any runtime starts,
    so that such a model fails alone and the others serve."""
    for kind, tensors in (("input", plan.inputs), ("output", plan.outputs)):
        for t in tensors:
            try:
                protocol.datatype_of(t.dtype)
            except StaronnxError as exc:
                return f"{kind} {t.name!r}: {exc}"
    return None


def has_strings(plan: Plan) -> bool:
    """Whether the model has string (BYTES) inputs or outputs: such tensors live in host memory
    only (a CUDA worker binds device buffers), so the model runs on CPU workers."""
    return any(t.dtype == protocol.STRING_DTYPE.name for t in (*plan.inputs, *plan.outputs))


class ModelEndpoint:
    """A plan served under ``name``; see the module docstring."""

    def __init__(self, name: str, runtime: Runtime | ModelHandle, spec: ServeSpec, *,
                 metrics: ServeMetrics, settings: Mapping[str, Any] | None = None, declared: Declared | None = None
                 ) -> None:
        """``spec``: how its requests are batched (:data:`ENDPOINT_SPEC` with the model's sizes
        is what ``staronnx serve`` gives); without ``max_inflight``, in the window of
        :func:`~staronnx.serving.window.inflight_from_models`. ``declared``: what the model
        repository says of it (None: a plan folder, served as version 1)."""
        self.name = name
        self.declared = declared
        self.version = declared.version if declared is not None else VERSION
        self.settings = dict(settings or {})  # the runtime's options, reported by config()
        self.runtime = runtime
        #: seconds a request may take (--slo-ms); later answers count as deadline misses
        self.latency_target = None if runtime.target is None else runtime.target.latency
        self.plan: Plan = runtime.plan
        self.stats = ModelStats()
        self._metrics = metrics
        self._batch_hist = metrics.batch_size.labels(model=name)
        self._latency_hist = metrics.request_seconds.labels(model=name)
        if spec.max_inflight is None:
            gpus = sorted({w.device_id for w in runtime.workers if isinstance(w, CudaWorker)})
            spec = replace(spec, max_inflight=inflight_from_models(
                self.plan, spec.batch_size, groups=self.settings.get("groups"),
                cuda_streams=int(self.settings.get("cuda_streams") or 0), cuda_devices=gpus or (0,)))
        self.server = Server(runtime, spec, on_executed=self._executed)
        self.inputs = {t.name: t for t in self.plan.inputs}
        self.input_datatypes = {t.name: protocol.datatype_of(t.dtype) for t in self.plan.inputs}
        self.output_datatypes = {t.name: protocol.datatype_of(t.dtype) for t in self.plan.outputs}
        #: the model's batching contract (read once: the plan's overrides were applied on load)
        self.contract: BatchContract = self.plan.contract
        self.labels = _labels(self.plan)
        #: each output's own labels (a repository config's label_filename), over the plan's labels.txt
        self.output_labels: dict[str, Sequence[str]] = dict(declared.labels) if declared is not None else {}
        self.reshapes = dict(declared.reshapes) if declared is not None else {}
        #: the older versions served under the same name (a version_policy that selects several)
        self.others: dict[str, ModelEndpoint] = {}
        #: the answer of the latest request (preserve_ordering: the next one leaves after it)
        self._last_answer: asyncio.Future[None] | None = None
        #: priority levels and queue timeouts (a repository config's dynamic_batching); a model
        #: without takes neither a priority nor a timeout from its requests
        self.queue_policy: QueuePolicy = self.server.queue_policy or NO_QUEUE_POLICY
        #: a stateful model's sequence batcher (its requests go through it to :meth:`run`)
        self.sequences = (Sequences(name, declared.sequence) if declared is not None and declared.sequence is not None
                          else None)
        if declared is not None and declared.preserve_ordering:
            # chosen once per model, not tested per request: mypy refuses assigning a method
            self.infer = self._infer_in_order  # type: ignore[method-assign]
        self.ready = True
        self._handoff: Handoff | None = None  # made on the event loop, at the first request
        #: (batch record, response parameters) of the last one-sample request answered
        self._last_parameters: tuple[Any, dict[str, int | str]] | None = None
        metrics.add(self)
        #: an ensemble's steps; its members' statistics count its runs (one task graph), or its
        #: requests are sent step by step to its members (ensemble_mode steps, as Triton does)
        self.ensemble = declared.ensemble if declared is not None else None
        self._composing: dict[str, Callable[[], dict[str, Any]]] = {}
        if self.ensemble is not None and self.ensemble.mode == "steps":
            self.infer = self._infer_steps  # type: ignore[method-assign]  # as _infer_in_order above
        elif self.ensemble is not None:
            for member in self.ensemble.member_parts or {}:
                self._composing[member] = functools.partial(self._member_counts, member)
                metrics.composing.setdefault(member, {})[name] = self._composing[member]

    # -- what the metrics collector reads ------------------------------------------------------
    def _executed(self, size: int, seconds: float = 0.0) -> None:
        self.stats.executed(size, seconds)
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
        if version in self.others:
            return
        if version not in (None, "", self.version) and self.others:
            raise ProtocolError("not_found", f"Request for unknown model: {shown(self.name)} has no version "
                                             f"{shown(version)} (it serves versions {', '.join(self.versions)})")
        check_version(self.name, version, self.version)

    @property
    def versions(self) -> list[str]:
        """Every version served under this name, latest first."""
        return [self.version, *self.others]

    def metadata(self) -> dict[str, Any]:
        """The v2 model metadata: datatypes and shapes, ``-1`` for a dynamic dimension."""
        hidden = (self.sequences.policy.filled | self.sequences.policy.kept) if self.sequences is not None else ()

        def tensors(specs: Sequence[Any], types: Mapping[str, str]) -> list[dict[str, Any]]:
            return [{"name": t.name, "datatype": types[t.name], "shape": self._client_shape(t)} for t in specs
                    if t.name not in hidden]

        return {"name": self.name, "versions": self.versions,
                "platform": "staronnx" if self.declared is None else "ensemble" if self.ensemble is not None
                else "onnxruntime_onnx",
                "inputs": tensors(self.plan.inputs, self.input_datatypes),
                "outputs": tensors(self.plan.outputs, self.output_datatypes)}

    def _client_shape(self, t: Any) -> list[int]:
        """A tensor's shape as clients see it: the model's, or a config's ``dims`` where it reshapes."""
        shape = protocol.metadata_shape(t.shape)
        if t.name not in self.reshapes:
            return shape
        dims = list(self.reshapes[t.name][0])
        return [-1, *dims] if self.contract.batchable else dims

    def _reshaped(self, arrays: Mapping[str, np.ndarray], to_model: bool) -> dict[str, np.ndarray]:
        """``arrays`` with the reshaped tensors in the model's shape (``to_model``) or the client's,
        the batch (where the model batches) kept in front."""
        out = dict(arrays)
        for name, (client, model) in self.reshapes.items():
            if name not in out:
                continue
            arr = out[name]
            target = model if to_model else client
            lead = [arr.shape[0]] if self.contract.batchable and arr.ndim else []
            try:
                out[name] = arr.reshape([*lead, *target])
            except ValueError:
                raise invalid(f"{'input' if to_model else 'output'} {shown(name)}: shape {list(arr.shape)} cannot be "
                              f"reshaped to {[*lead, *target]} (the config's reshape of dims {list(client)})") from None
        return out

    def config(self) -> dict[str, Any]:
        """Triton's model configuration (``GET /v2/models/<name>/config``, gRPC ``ModelConfig``),
        the fields that apply, with Triton's conventions.

        ``max_batch_size`` and ``dynamic_batching`` tell a client how its samples are batched.
        Triton's config can only say "every tensor has the batch on axis 0": so
        ``max_batch_size`` is the batch size only when the contract batches and every input and
        output carries the batch on axis 0; then ``dims`` leave out that axis (as Triton's do;
        the metadata keeps the full shape with -1). Otherwise ``max_batch_size`` is 0 and ``dims``
        are full shapes: a client sends whole tensors, and the contract is stated in
        ``parameters`` (``batching``, ``batch_axes``, ``batching_reason``); a model whose batch is
        not on axis 0 (a state ``[2, batch, 64]``) is still batched along each tensor's own axis
        (``batching: true``, and ``dynamic_batching`` says how long a partial batch waits). An input
        that looks like an image (C, H, W or H, W, C with 1 or 3 channels) carries its ``format``,
        every other one ``FORMAT_NONE``; an output with labels (``labels.txt`` in the plan
        folder) names the file. ``parameters`` (Triton's string-valued form) also name the plan
        (its folder's name and hash, never its path on the server) and the runtime settings, so a
        remote sweep can check it measures the plan it thinks and record how it was served.
        """
        delay = self.server.max_delay
        contract = self.contract
        leading = contract.batchable and all(a == 0 for a in (*contract.inputs.values(), *contract.outputs.values()))
        params = {"plan_hash": self.plan.hash, "plan": Path(self.plan.root).name,
                  "queue_capacity": self.server.queue_capacity, "max_inflight": self.server.max_inflight,
                  "workers": len(self.runtime.workers),
                  "batch_size": self.server.batch_size if contract.batchable else 1,
                  **_contract_parameters(contract, leading),
                  **self.settings}

        def dims(t: Any, axis: int | None) -> list[int]:
            shape = protocol.metadata_shape(t.shape)
            return shape[1:] if leading and axis == 0 else shape

        inputs = []
        for t in self.plan.inputs:
            d = dims(t, contract.inputs.get(t.name))
            inputs.append({"name": t.name, "data_type": protocol.config_type(self.input_datatypes[t.name]),
                           "format": _image_format(d), "dims": d})
        outputs = []
        for t in self.plan.outputs:
            entry: dict[str, Any] = {"name": t.name, "data_type": protocol.config_type(self.output_datatypes[t.name]),
                                     "dims": dims(t, contract.outputs.get(t.name))}
            if self.labels:
                entry["label_filename"] = LABELS
            outputs.append(entry)
        config: dict[str, Any] = {
            "name": self.name, "platform": "staronnx", "backend": "staronnx",
            "version_policy": {"latest": {"num_versions": 1}},
            "max_batch_size": self.server.batch_size if leading else 0,
        }
        if contract.batchable:  # a model that cannot batch runs each request as it comes
            dynamic: dict[str, Any] = {"max_queue_delay_microseconds": int(round((delay or 0.0) * 1e6))}
            padded = sorted(int(b) for b in self.server.pad_to)
            if padded:  # the sizes a partial batch is padded up to (captured CUDA graphs', a config's)
                dynamic["preferred_batch_size"] = padded
            config["dynamic_batching"] = dynamic
        effective = {
            **config,
            "instance_group": self.instance_groups(),
            "input": inputs, "output": outputs,
            "parameters": {k: {"string_value": str(v)} for k, v in params.items()},
        }
        return effective if self.declared is None else self._as_declared(effective)

    def _as_declared(self, effective: dict[str, Any]) -> dict[str, Any]:
        """A repository model's config: what its config.pbtxt says (completed from the model: its
        tensors as declared, its version policy, file name and staronnx parameters), with the
        batching, instances and parameters as they are served."""
        assert self.declared is not None
        declared = self.declared.config
        out = {**effective, "platform": "onnxruntime_onnx", "backend": "onnxruntime",
               "input": declared.get("input", effective["input"]),
               "output": declared.get("output", effective["output"]),
               "parameters": {**effective["parameters"], **declared.get("parameters", {})}}
        for key in ("version_policy", "default_model_filename", "ensemble_scheduling"):
            if key in declared:
                out[key] = declared[key]
        if self.ensemble is not None:  # Triton's ensemble: its platform, no backend, no instances of its own
            out["platform"] = "ensemble"
            out.pop("backend", None)
        if "sequence_batching" in declared:  # a stateful model: its sequence batcher, not the dynamic one
            out.pop("dynamic_batching", None)
            out["sequence_batching"] = declared["sequence_batching"]
        elif "dynamic_batching" in out:  # the config's ordering and queue policy, with the batching as served
            out["dynamic_batching"] = {**declared.get("dynamic_batching", {}), **out["dynamic_batching"]}
        return out

    def instance_groups(self) -> list[dict[str, Any]]:
        """The workers that hold this model, as Triton's ``instance_group`` says where a model's
        instances run (its tools read it): the CUDA streams per GPU, the GPUs, and the CPU
        workers (CPU groups and lanes)."""
        workers = self.runtime.workers
        try:
            held = set(self.runtime.stats().get("held_by") or [w.name for w in workers])
        except Exception:  # noqa: BLE001 - a closing runtime: every worker
            held = {w.name for w in workers}
        mine = [w for w in workers if w.name in held]
        streams: dict[int, int] = {}
        for w in mine:
            if isinstance(w, CudaWorker):
                streams[w.device_id] = streams.get(w.device_id, 0) + 1
        groups: list[dict[str, Any]] = []
        if streams:  # Triton's count is per GPU listed; a GPU with another count gets its own group
            for count in sorted(set(streams.values())):
                gpus = sorted(d for d, n in streams.items() if n == count)
                groups.append({"name": f"{self.name}_gpu{'_'.join(map(str, gpus))}", "kind": "KIND_GPU",
                               "count": count, "gpus": gpus})
        cpus = sum(1 for w in mine if w.kind != "cuda")
        if cpus:
            groups.append({"name": f"{self.name}_cpu", "kind": "KIND_CPU", "count": cpus})
        return groups

    def statistics(self) -> dict[str, Any]:
        """Triton's statistics extension for this model (``GET /v2/models/<name>/stats``, gRPC
        ``ModelStatistics``), from the counts the metrics report
        (:func:`~staronnx.serve.metrics.triton_statistics` has Triton's definitions), with
        staronnx's own account of how the model is served."""
        s = self._metrics.snapshot(self)  # its runs inside ensembles' task graphs included
        # staronnx's own (HTTP only: Triton's gRPC message has no field for it)
        return {**triton_statistics(self.name, s), "version": self.version, "staronnx": self.service(s)}

    def service(self, snapshot: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """How this model is served on its (maybe shared) runtime: its queue, latency target,
        deadline misses, each worker's busy share spent on its tasks, and the workers that
        hold it."""
        s = snapshot if snapshot is not None else self.stats.snapshot()
        try:
            rs = self.runtime_stats()
            workers = {name: round(float(row.get("busy", 0.0)), 6) for name, row in rs.get("workers", {}).items()}
            held_by = list(rs.get("held_by", workers))
        except Exception:  # noqa: BLE001 - a closing runtime must not fail the statistics
            workers, held_by = {}, []
        return {"queue_length": self.queue_length, "batches_in_flight": self.batches_in_flight,
                "latency_target_ms": None if self.latency_target is None else self.latency_target * 1e3,
                "deadline_misses": s["deadline_misses"], "busy": workers,
                # the workers holding a session of it (--model-workers), all of them by default
                "held_by": held_by,
                **({"sequences": self.sequences.describe()} if self.sequences is not None else {})}

    def classify(self, outputs: dict[str, np.ndarray], classes: Mapping[str, int]) -> None:
        """Triton's classification extension: each output asked for with ``classification: k``
        replaced, in place, by its top ``k`` as BYTES ``"value:index[:label]"``."""
        for name, k in classes.items():
            if name in outputs and k:
                axis = self.contract.outputs.get(name) if self.contract.batchable else None
                outputs[name] = protocol.classify(outputs[name], k, axis, self.output_labels.get(name, self.labels))

    def check_classes(self, classes: Mapping[str, Any]) -> None:
        """Each ``classification: k`` asked for: a non-negative integer, of an output with values to rank."""
        for name, k in classes.items():
            if not isinstance(k, int) or isinstance(k, bool) or k < 0:
                raise invalid(f"output {shown(name)}: classification must be a non-negative integer, "
                              f"got {protocol.cut(repr(k), 40)}")
            if k and self.output_datatypes.get(name) == protocol.BYTES:
                raise invalid(f"output {shown(name)}: a BYTES output has no values to rank; ask for it "
                              "without classification")

    def check(self, inputs: Mapping[str, np.ndarray], datatypes: Mapping[str, str],
              outputs: Sequence[str] | None) -> None:
        """The checks :meth:`run` makes before it submits (the outputs asked for, the inputs'
        names, datatypes and shapes), for a caller that must refuse a request before it changes
        anything: the sequence batcher, where a refused request leaves its sequence as it was."""
        protocol.select_outputs(self.plan.output_names, outputs, self.name)
        self.check_request(self._reshaped(inputs, to_model=True) if self.reshapes else inputs, datatypes)

    def check_request(self, inputs: Mapping[str, np.ndarray], datatypes: Mapping[str, str]) -> int:
        """Names, datatypes, shapes against the plan; returns the request's own batch size."""
        unknown = [n for n in inputs if n not in self.inputs]
        if unknown:
            raise invalid(f"model {self.name!r} has no input(s) {', '.join(shown(n) for n in unknown[:8])}; "
                          f"its inputs are {list(self.inputs)}")
        missing = [n for n in self.inputs if n not in inputs]
        if missing:
            raise invalid(f"model {self.name!r}: missing input(s) {missing}; its inputs are {list(self.inputs)}")
        for name, dt in datatypes.items():
            if dt != self.input_datatypes[name]:
                raise invalid(f"input {name!r}: datatype {shown(dt)}, but model {self.name!r} expects {self.input_datatypes[name]}")
        try:  # then its rows, along each input's own batch axis (1 for a model that takes a request whole)
            self.plan.check_feeds(inputs)
            return self.contract.check_rows(inputs)
        except InputError as exc:
            raise invalid(f"model {self.name!r}: {exc}") from None

    async def _infer_in_order(self, inputs: Mapping[str, np.ndarray], datatypes: Mapping[str, str],
                              outputs: Sequence[str] | None, *, decode_s: float = 0.0,
                              classes: Mapping[str, int] | None = None,
                              parameters: Mapping[str, Any] | None = None) -> Answer:
        """:meth:`infer`, each answer (or refusal) held until the request before it is answered:
        Triton's ``preserve_ordering`` (a later request may finish first on another worker)."""
        previous, mine = self._last_answer, asyncio.get_running_loop().create_future()
        self._last_answer = mine
        try:
            try:
                return await ModelEndpoint.infer(self, inputs, datatypes, outputs, decode_s=decode_s, classes=classes,
                                                 parameters=parameters)
            finally:
                if previous is not None and not previous.done():
                    await asyncio.shield(previous)
        finally:
            if not mine.done():
                mine.set_result(None)

    async def infer(self, inputs: Mapping[str, np.ndarray], datatypes: Mapping[str, str],
                    outputs: Sequence[str] | None, *, decode_s: float = 0.0,
                    classes: Mapping[str, int] | None = None,
                    parameters: Mapping[str, Any] | None = None) -> Answer:
        """One protocol request (already decoded): :meth:`run`, through the sequence batcher for a
        stateful model, which reads the request's ``sequence_id``, ``sequence_start`` and
        ``sequence_end`` from ``parameters`` (a model without ``sequence_batching`` ignores them,
        as Triton's dynamic batcher does)."""
        if self.sequences is not None:
            try:
                sequence = request_of(parameters)
                if classes:  # refused before it joins its sequence: a refused request changes nothing
                    self.check_classes(classes)
            except ProtocolError:
                self.stats.refused("OTHER")
                raise
            return await self.sequences.infer(self, inputs, datatypes, outputs, sequence, decode_s=decode_s,
                                              classes=classes)
        return await self.run(inputs, datatypes, outputs, decode_s=decode_s, classes=classes, parameters=parameters)

    async def run(self, inputs: Mapping[str, np.ndarray], datatypes: Mapping[str, str],
                  outputs: Sequence[str] | None, *, decode_s: float = 0.0,
                  classes: Mapping[str, int] | None = None,
                  parameters: Mapping[str, Any] | None = None) -> Answer:
        """Run one protocol request (already decoded) through the batcher: its outputs by name
        and, for a one-sample request, its batch (see the module docstring). ``parameters``: the
        request's own (``priority`` and ``timeout``, in microseconds, are read here:
        :meth:`queueing`).

        Raises :class:`ProtocolError`: invalid input (INVALID_ARGUMENT), a full queue or a
        closing server (UNAVAILABLE), a part that failed (INTERNAL).
        """
        started = time.perf_counter()
        try:
            names = protocol.select_outputs(self.plan.output_names, outputs, self.name)
            if self.reshapes:  # a config's reshape: the client's dims to the model's shape
                inputs = self._reshaped(inputs, to_model=True)
            n = self.check_request(inputs, datatypes)
            if classes:
                self.check_classes(classes)
            if n > self.server.queue_capacity:
                sized = "its config's max_queue_size" if self.declared is not None and self.declared.queue_sized \
                    else "--queue-capacity"
                raise invalid(f"model {shown(self.name)}: a request of {n} samples cannot be served: the request "
                              f"queue holds at most {self.server.queue_capacity} samples ({sized}); send at "
                              f"most {self.server.queue_capacity} per request")
            asks = parameters is not None and ("priority" in parameters or "timeout" in parameters)
            level, timeout, delay = self.queueing(parameters, n) if asks or self.server.queue_policy else \
                (0, None, False)
        except ProtocolError:
            self.stats.refused("OTHER")
            raise
        futures = self._submit(inputs, n, level)
        self.stats.started()
        handoff = self._handoff
        if handoff is None or handoff.loop is not asyncio.get_running_loop():
            handoff = self._handoff = Handoff(asyncio.get_running_loop())
            self.server.time_delays_on(handoff.loop)  # this loop times its requests' max delay
        expired: list[bool] = []  # set when the queue timeout withdrew a sample still waiting
        timer = (None if timeout is None else
                 handoff.loop.call_later(timeout, self.server.delay, futures) if delay else
                 handoff.loop.call_later(timeout, _withdraw, futures, expired))
        try:
            if len(futures) == 1:  # most requests: no gather (a task and a future fewer)
                rows = [await handoff.watch(futures[0])]
            else:
                rows = await asyncio.gather(*(handoff.watch(f) for f in futures))
            # inside the try: a request whose answer cannot be put together is a failed one
            result = {name: self._join(name, [r[name] for r in rows]) for name in names}
            if self.reshapes:
                result = self._reshaped(result, to_model=False)
            if classes:
                self.classify(result, classes)
        except asyncio.CancelledError:  # the client went away: its samples need not run
            for f in futures:
                f.cancel()
            task = asyncio.current_task()
            if expired and task is not None and not task.cancelling():  # the queue timeout, not the client
                self.stats.finished(ok=False, reason="REJECTED", request_s=time.perf_counter() - started + decode_s)
                raise ProtocolError("unavailable", f"model {self.name!r}: the request waited for its batch longer than "
                                                   f"the queue timeout ({(timeout or 0.0) * 1e6:g} µs, "
                                                   "its queue policy's or its own); it was rejected") from None
            self.stats.finished(ok=False, reason="CANCELED", request_s=time.perf_counter() - started + decode_s)
            raise
        except ServerClosed as exc:
            self.stats.finished(ok=False, reason="REJECTED", request_s=time.perf_counter() - started + decode_s)
            raise ProtocolError("unavailable", f"model {self.name!r}: {exc}") from None
        except ProtocolError:  # an answer that cannot be joined (already worded)
            self.stats.finished(ok=False, reason="BACKEND", request_s=time.perf_counter() - started + decode_s)
            raise
        except Exception as exc:  # noqa: BLE001 - a failing part fails this request only
            self.stats.finished(ok=False, reason="BACKEND", request_s=time.perf_counter() - started + decode_s)
            raise ProtocolError("internal", f"model {self.name!r}: inference failed: {exc}") from None
        finally:
            if timer is not None:
                timer.cancel()
        done = time.perf_counter()
        queue_s, infer_s = _batch_times(futures, started)
        request_s = done - started + decode_s
        self.stats.finished(ok=True, request_s=request_s, queue_s=queue_s, input_s=decode_s, infer_s=infer_s,
                            late=self.latency_target is not None and request_s > self.latency_target)
        self._latency_hist.observe(request_s)
        return Answer(result, self._parameters(futures))

    # -- ensembles ------------------------------------------------------------------------------
    def _member_counts(self, member: str) -> dict[str, Any]:
        """A member's counts from its runs inside this ensemble's task graph (its statistics add
        them, as Triton's composing models count the ensemble's requests)."""
        from staronnx.serve.ensemble import composing_snapshot

        assert self.ensemble is not None and self.ensemble.member_parts is not None
        try:
            tasks = self.runtime_stats().get("tasks", {})
        except Exception:  # noqa: BLE001 - a closing runtime: the counts without the task times
            tasks = {}
        return composing_snapshot(self.stats.snapshot(), tasks, self.ensemble.member_parts[member])

    async def _infer_steps(self, inputs: Mapping[str, np.ndarray], datatypes: Mapping[str, str],
                           outputs: Sequence[str] | None, *, decode_s: float = 0.0,
                           classes: Mapping[str, int] | None = None,
                           parameters: Mapping[str, Any] | None = None) -> Answer:
        """An ensemble request run as Triton runs it: each step a request of its own through its
        member's served model (its own batcher and queue), a step starting once the steps it
        reads from have answered, the tensors between steps through host memory. ``parameters``:
        :meth:`infer`'s, passed on to every step's request as Triton's ensemble scheduler passes
        them (a ``priority`` or ``timeout`` is then its member's to honour or refuse by name)."""
        assert self.ensemble is not None
        started = time.perf_counter()
        try:
            names = protocol.select_outputs(self.plan.output_names, outputs, self.name)
            n = self.check_request(inputs, datatypes)
            if classes:  # as run() checks them: a bad k must not fail the request after its steps ran
                self.check_classes(classes)
        except ProtocolError:
            self.stats.refused("OTHER")
            raise
        self.stats.started()
        values: dict[str, np.ndarray] = dict(inputs)
        try:
            pending = list(self.ensemble.steps)
            while pending:
                ready = [s for s in pending if all(t in values for t in s.input_map.values())]
                answers = await asyncio.gather(*(self._run_step(s, values, parameters) for s in ready))
                for step, answer in zip(ready, answers):
                    values.update({tensor: answer[out] for out, tensor in step.output_map.items()})
                pending = [s for s in pending if s not in ready]
            result = {name: values[name] for name in names}
            if classes:
                self.classify(result, classes)
        except asyncio.CancelledError:
            self.stats.finished(ok=False, reason="CANCELED", request_s=time.perf_counter() - started + decode_s)
            raise
        except ProtocolError:
            self.stats.finished(ok=False, reason="BACKEND", request_s=time.perf_counter() - started + decode_s)
            raise
        elapsed = time.perf_counter() - started
        self.stats.executed(n)
        self.stats.finished(ok=True, request_s=elapsed + decode_s, input_s=decode_s, infer_s=elapsed,
                            late=self.latency_target is not None and elapsed + decode_s > self.latency_target)
        self._latency_hist.observe(elapsed + decode_s)
        return Answer(result, {})

    async def _run_step(self, step: "Step", values: Mapping[str, np.ndarray],
                        parameters: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        """One step's request to its member's served model, with the ensemble request's
        ``parameters``; its refusal names the step."""
        member = self._member(step)
        feeds = {name: values[tensor] for name, tensor in step.input_map.items()}
        types = {name: protocol.datatype_of(v.dtype) for name, v in feeds.items()}
        try:
            answer = await member.infer(feeds, types, list(step.output_map), parameters=parameters)
        except ProtocolError as exc:
            raise ProtocolError(exc.kind, f"ensemble {self.name!r}, step {step.model_name!r}: {exc}") from None
        return answer.outputs

    def _member(self, step: "Step") -> "ModelEndpoint":
        """The served model a step sends its request to (the version it names, else the latest)."""
        served = [m for m in self._metrics.served(step.model_name) if m.ready]
        if step.model_version > 0:
            served = [m for m in served if m.version == str(step.model_version)]
        if not served:
            raise ProtocolError("unavailable", f"ensemble {self.name!r}: its step {step.model_name!r} is not served "
                                               "now (load it: a step-by-step ensemble sends its steps to its members)")
        latest: ModelEndpoint = max(served, key=lambda m: int(m.version) if m.version.isdigit() else 0)
        return latest

    def _parameters(self, futures: Sequence[RequestFuture]) -> dict[str, int | str]:
        """:func:`_batch_parameters`, formatted once per batch: a batch's requests are answered one
        after the other, so the last batch's are kept and its other requests get the same dict
        (shared: the front ends only read it)."""
        batch = futures[0].batch if len(futures) == 1 else None
        last = self._last_parameters
        if batch is not None and last is not None and last[0] is batch:
            return last[1]
        params = _batch_parameters(futures)
        if batch is not None:
            self._last_parameters = (batch, params)
        return params

    def queueing(self, parameters: Mapping[str, Any] | None, n: int = 1) -> tuple[int, float | None, bool]:
        """A request's place in the queue from its ``priority`` and ``timeout`` parameters
        (Triton's, as tritonclient sends them) and the model's queue policy: (its priority level,
        1 the highest; seconds it may wait for its batch, None: no limit; whether it is then
        moved behind the others, DELAY, rather than refused). A priority out of the model's
        range, a timeout its policy does not let a request give, or ``n`` samples more than its
        level's queue holds are refused, naming the setting."""
        priority, timeout_us = protocol.queue_parameters(parameters or {})
        policy = self.queue_policy
        try:
            level = policy.level_of(priority, self.name)
            timeout = policy.timeout_of(level, timeout_us, self.name)
        except QueueRequestError as exc:
            raise invalid(str(exc)) from None
        rules = policy.levels[level - 1]
        if rules.capacity is not None and n > rules.capacity:
            raise invalid(f"model {shown(self.name)}: a request of {n} samples cannot be served at priority level "
                          f"{level}, whose queue holds at most {rules.capacity} (its max_queue_size)")
        return (level if policy.priority_levels else 0), timeout, rules.delay

    def _submit(self, inputs: Mapping[str, np.ndarray], n: int, level: int = 0) -> list[RequestFuture]:
        """The request into the batcher as it is, its ``n`` rows taking ``n`` places in one batch
        (answered with views of the batch's outputs); one of more rows than a batch holds is cut
        into pieces of a batch each along every input's own batch axis (per-request values whole
        with every piece). At priority ``level`` (0: the default); a model that cannot batch takes
        the request whole. All or none: a full queue refuses the whole request."""
        futures: list[RequestFuture] = []
        contract = self.contract
        try:
            if not contract.batchable or n == 1:
                futures.append(self.server.submit(inputs, level=level, checked=True))
            else:  # as it is, n places in a batch; cut only where it holds more rows than a batch
                step = self.server.batch_size
                for i in range(0, n, step):
                    part = inputs if n <= step else contract.take(inputs, i, min(n, i + step))
                    futures.append(self.server.submit(part, level=level, checked=True, rows=min(n, i + step) - i))
        except Exception as exc:  # noqa: BLE001 - whatever the batcher refused, the request is refused whole
            for f in futures:
                f.cancel()
            if isinstance(exc, (OverloadError, ServerClosed)):
                self.stats.refused("REJECTED")
                why = "the server is shutting down" if isinstance(exc, ServerClosed) else str(exc) if isinstance(
                    exc, LevelFullError) else f"the request queue is full ({self.server.queue_capacity} samples " \
                    "waiting); retry later"
                raise ProtocolError("unavailable", f"model {self.name!r}: {why}") from None
            if isinstance(exc, InputError):  # the batcher's own one-sample check (should not happen after ours)
                self.stats.refused("OTHER")
                raise invalid(f"model {self.name!r}: {exc}") from None
            self.stats.refused("BACKEND")  # the batcher failing: this request fails, counted
            raise ProtocolError("internal", f"model {self.name!r}: the batcher refused the request: {exc}") from None
        return futures

    def _join(self, name: str, parts: list[np.ndarray]) -> np.ndarray:
        """Output ``name`` of a client's batch: its samples' answers, in order, along the output's
        own batch axis (a model that cannot batch answers a request in one piece)."""
        if len(parts) == 1:
            return parts[0]
        axis = self.contract.outputs.get(name)
        if axis is None:  # the contract refuses to batch such a model, so its requests are whole
            raise ProtocolError("internal", f"model {self.name!r}: output {name!r} has no batch axis to join "
                                            f"{len(parts)} samples' answers along")
        return np.concatenate(parts, axis=axis)

    def retire(self, why: str) -> None:
        """On the event loop, as the model leaves service (``why``: unloaded, replaced, the server
        shutting down), before :meth:`close` drains it on another thread: a stateful model's
        requests waiting for a sequence slot are refused at once (no slot will be freed for
        them); the older versions served under the same name too."""
        if self.sequences is not None:
            self.sequences.close(why)
        for other in self.others.values():
            other.retire(why)

    def close(self, timeout: float) -> None:
        """Drain the batcher (every accepted request is answered), then stop the runtime; the
        older versions served under the same name too."""
        self.ready = False
        try:
            self.server.close(timeout)
        finally:
            self._metrics.remove(self)
            for member, counts in self._composing.items():  # a reload's new endpoint may hold the name now
                if self._metrics.composing.get(member, {}).get(self.name) is counts:
                    del self._metrics.composing[member][self.name]
            self.runtime.close(timeout)
            for other in self.others.values():
                other.close(timeout)


#: the queue policy of a model without one: a single level, no timeouts, no priorities or timeouts
#: taken from requests (each refused, by name)
NO_QUEUE_POLICY = QueuePolicy()


def _withdraw(futures: Sequence[RequestFuture], expired: list[bool]) -> None:
    """The queue timeout: withdraw the request's samples still waiting for a batch (a sample
    whose batch formed runs on, its answer dropped); ``expired`` says that it happened."""
    if any([f.cancel() for f in futures]):
        expired.append(True)


def _contract_parameters(contract: BatchContract, leading: bool) -> dict[str, str]:
    """The batching contract as config ``parameters`` (Triton's config cannot say it itself):
    whether requests are batched together, each tensor's batch axis (``none``: a per-request
    value, or no batch), and why ``max_batch_size`` is 0 where it is."""
    axes = {**contract.inputs, **contract.outputs}
    params = {"batching": "true" if contract.batchable else "false",
              "batch_axes": ",".join(f"{n}={'none' if a is None else a}" for n, a in axes.items())}
    if not contract.batchable:
        params["batching_reason"] = f"one request per task: {contract.why_not}"
    elif not leading:
        off = [f"{n} on axis {a}" if a is not None else f"{n} has none (a per-request value)"
               for n, a in axes.items() if a != 0]
        params["batching_reason"] = ("requests are batched along each tensor's own batch axis, which Triton's "
                                     f"max_batch_size cannot say ({', '.join(off)}): send full shapes")
    return params


#: the file in a plan folder that names an output's classes, one per line (Triton's label file)
LABELS = "labels.txt"


def _labels(plan: Plan) -> list[str]:
    path = Path(plan.root) / LABELS
    try:
        return path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    except (OSError, UnicodeDecodeError):
        return []


def _image_format(dims: Sequence[int]) -> str:
    """Triton's input ``format`` from a sample's dims: CHW or HWC with 1 or 3 channels."""
    if len(dims) == 3:
        if dims[0] in (1, 3) and dims[2] not in (1, 3):
            return "FORMAT_NCHW"
        if dims[2] in (1, 3) and dims[0] not in (1, 3):
            return "FORMAT_NHWC"
    return "FORMAT_NONE"


def _batch_parameters(futures: Sequence[RequestFuture]) -> dict[str, int | str]:
    """The batch of a one-sample request, as response parameters (none for a client batch,
    whose samples may have run in several batches)."""
    if len(futures) != 1:
        return {}
    batch = futures[0].batch
    if batch is None:
        return {}
    params: dict[str, int | str] = {"staronnx_batch_id": int(batch.id), "staronnx_batch_size": int(batch.size)}
    if batch.placement:
        params["staronnx_placement"] = ",".join(f"{p}={a}" for p, a in sorted(batch.placement.items()))
    return params


def _batch_times(futures: Sequence[RequestFuture], started: float) -> tuple[float, float]:
    """(queue, compute) seconds of a request: until its last sample's batch formed, and that
    batch's run (from the batch records the server attaches to each sample's future)."""
    if len(futures) == 1:  # most requests: no lists
        b = futures[0].batch
        if b is None or b.formed is None or b.done is None:
            return 0.0, 0.0
        return max(b.formed - started, 0.0), max(b.done - b.formed, 0.0)
    batches = [f.batch for f in futures]
    formed = [b.formed for b in batches if b is not None and b.formed is not None]
    done = [b.done for b in batches if b is not None and b.done is not None]
    if not formed or not done:
        return 0.0, 0.0
    queue = max(max(formed) - started, 0.0)
    return queue, max(max(done) - max(formed), 0.0)
