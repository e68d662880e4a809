"""``Runtime``: a plan, workers and a policy, served through futures.

    with Runtime("plan/", MachineSpec(groups="numa"), RuntimeSpec(policy="heft")) as rt:
        outputs = rt.run({"input": x})
        futures = [rt.submit(f) for f in feeds]        # concurrent.futures-compatible
        for out in rt.map(stream, max_in_flight=8):    # backpressure
            ...
        print(rt.stats())

Inputs are checked against the plan's signature before any task exists, so a bad request
raises ValueError (InputError) at once and never reaches a worker.

``MachineSpec(cuda_streams=N)`` starts N CUDA workers (streams) per GPU, driven by one engine
thread per GPU on a core held back from the CPU groups (see :mod:`staronnx.workers.layout`;
``thread_per_stream=True``: a thread and a core per stream); ``RuntimeSpec(cuda=CudaOptions(...))``
goes to every :class:`~staronnx.workers.cuda.CudaWorker` (``provider_options`` such as
``gpu_mem_limit``, a ``runtime`` standing in for CUDA). ``RuntimeSpec(warmup=(1, 2, 4, 8))`` runs
those batch sizes on every CUDA worker before serving, capturing their CUDA graphs one at a
time; :attr:`Runtime.preferred_batch_sizes` then lists them and a
:class:`~staronnx.serving.Server` pads partial batches up to them, so no capture ever stalls
the workers while serving.

Several models share one runtime when given by name (StarPU's way: every task graph on one
set of workers under one scheduler, each part with its own perf model)::

    with Runtime({"googlenet": "googlenet-plan/", "tiny": "tiny-plan/"},
                 spec=RuntimeSpec(targets={"tiny": ServiceTarget(latency=0.020)})) as rt:
        fut = rt.submit(feeds, model="tiny")          # or rt.model("tiny").submit(feeds)
        print(rt.model("tiny").stats()["deadline_misses"])

Each worker holds a session of every model's parts, unless the machine's ``residency`` keeps a
model on some workers only (``{"tiny": "cpu"}``: GPU memory, or a GPU left to the heavy model),
where its tasks then go (``stats()["models"][name]["held_by"]``), or its ``lanes`` give a model
workers of its own that preempt the others' tasks. One policy places every task; a model's
:class:`~staronnx.runtime.models.ServiceTarget` turns its requests into deadlines that ordered
queues serve first (EDF), and its ``capacity`` refuses that model's requests only
(:class:`~staronnx.runtime.models.ModelOverloaded`). :meth:`Runtime.model` gives a handle with a
one-model runtime's face (``plan``, ``submit``, ``stats``) for a batching
:class:`~staronnx.serving.Server` per model.

``calibrate`` is StarPU's ``STARPU_CALIBRATE`` for either engine (default
``$STARONNX_CALIBRATE``, else 0): 0 freezes calibrated models, 1 keeps recording every
execution while serving, 2 replaces the stored models with this run's measurements.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from staronnx.errors import StaronnxError
from staronnx.plan import Plan
from staronnx.runtime.engine import EngineClosed
from staronnx.runtime.models import HostedModel, ModelSet, ServiceTarget, load_plans
from staronnx.runtime.registry import Worker, engine_factory
from staronnx.runtime.predictor import PerfPredictor
from staronnx.runtime.spec import EngineSettings, RuntimeSpec
from staronnx.runtime.task import RequestFuture
from staronnx.runtime.trace import Tracer
from staronnx.workers.colocate import Colocation
from staronnx.workers.cuda import CudaWorker
from staronnx.workers.layout import MachineSpec
from staronnx.workers.pinned_pool import PinnedPool

log = logging.getLogger(__name__)


def driver_threads(stats: Mapping[str, Any]) -> dict[str, str]:
    """CUDA worker name -> the thread that launches its tasks (the GPU's one driver, or
    ``<worker> (own)`` with ``thread_per_stream``), read off :meth:`Runtime.stats`; empty where
    the stats name no workers (a remote server's)."""
    return {n: w["driver"]["thread"] for n, w in stats.get("workers", {}).items() if "driver" in w}


def warmup_sizes(max_batch: int, max_delay: float | None = 0.0) -> tuple[int, ...]:
    """The batch sizes a server of batches up to ``max_batch`` warms up (and captures CUDA
    graphs for): powers of two below it and itself, Triton's preferred batch sizes; only
    ``max_batch`` when batches always leave full (``max_delay=None``, the papers' batcher)."""
    if max_delay is None:
        return (max_batch,)
    return tuple(sorted({max_batch, *(1 << i for i in range(max(max_batch - 1, 0).bit_length()))}))


class Runtime:
    """Serve a plan (or several, by name) on this machine's CPU groups (and CUDA streams) with
    a StarPU-style policy."""

    #: a Server passes each batch's oldest arrival, from which a latency target counts
    takes_arrival = True

    def __init__(self, plan: Plan | str | os.PathLike[str] | Mapping[str, Plan | str | os.PathLike[str]],
                 machine: MachineSpec | None = None, spec: RuntimeSpec | None = None) -> None:
        """``machine``: the workers to start (default: one CPU group per NUMA node); with lanes, the
        caller holds :func:`~staronnx.workers.lanes.short_switch_interval` while it serves, so that
        a waking lane waits at most 0.5 ms for the GIL (a process-wide setting the runtime leaves
        alone). ``spec``: how to serve (policy, engine, trace, perf models, warm-up, targets)."""
        #: the workers this runtime asked for and how it serves, as given (its engine starts them)
        self.machine, self.spec = machine, spec = machine or MachineSpec(), spec or RuntimeSpec()
        engine = spec.engine
        factory = engine_factory(engine)  # an unknown engine fails before the plan loads
        plans, _ = load_plans(plan)
        self.models = ModelSet(plans, spec.targets)
        #: the one model a ``model=None`` request is for (None: several are served)
        self._only = self.models.models[0] if self.models.single else None
        if (machine.residency or machine.lanes) and (engine != "native" or spec.workers is not None):
            raise StaronnxError("lanes are workers the native engine starts, and residency chooses which of them "
                                "load each model; neither goes with engine='starpu' or workers=[...]")
        self.policy_name = spec.policy
        settings = EngineSettings(**vars(spec), machine=machine)
        self._engine = factory(self.models, settings)
        graphs = any(isinstance(w, CudaWorker) and w.graph_parts for w in self._engine.workers)
        #: the batch sizes whose CUDA graphs were captured at warm-up (Triton's preferred batch
        #: sizes): a Server pads a partial batch up to one of them; () without graphs
        self.preferred_batch_sizes: tuple[int, ...] = tuple(sorted(set(settings.warmup))) if graphs else ()
        self._pinned: PinnedPool | None = next(
            (w.pinned_pool for w in self._engine.workers if isinstance(w, CudaWorker)), None)
        self._colocation = Colocation(self._engine.workers)
        self._closed = False
        self._close_lock = threading.Lock()
        self._stop_saving = threading.Event()
        self._saver: threading.Thread | None = None
        if spec.save_every > 0 and self._engine.predictor is not None:
            self._saver = threading.Thread(target=self._save_loop, args=(float(spec.save_every),),
                                           name="staronnx-perfmodel-saver", daemon=True)
            self._saver.start()

    # -- perf models --------------------------------------------------------------------------
    def save_perf_models(self) -> None:
        """Merge the perf-model samples learnt since the last merge into the store now
        (atomically, under the store's lock; the native engine's, StarPU keeps its own)."""
        if self._engine.predictor is not None:
            self._engine.predictor.save()

    def _save_loop(self, every: float) -> None:
        while not self._stop_saving.wait(every):
            try:
                self.save_perf_models()
            except Exception:  # noqa: BLE001 - the next round (or close) tries again
                log.exception("merging the perf models learnt while serving failed; retrying in %g s", every)

    # -- context manager ---------------------------------------------------------------------
    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- models -------------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The plan served (a runtime of several models: ask :meth:`model` for one's)."""
        if not self.models.single:
            raise StaronnxError(f"this runtime serves several models ({', '.join(self.model_names)}); "
                                "use runtime.model(name).plan")
        return self.models.models[0].plan

    @property
    def target(self) -> ServiceTarget | None:
        """The only model's service target (None for a runtime of several: see :meth:`model`)."""
        return self.models.models[0].target if self.models.single else None

    @property
    def model_names(self) -> list[str]:
        """The hosted models' names, in part order."""
        return [m.name for m in self.models.models]

    def model(self, name: str | None = None) -> ModelHandle:
        """A handle on one hosted model with a one-model runtime's face (``plan``,
        ``submit``, ``stats``, ...), e.g. for a :class:`~staronnx.serving.Server`."""
        return ModelHandle(self, self.models.model(name))

    # -- requests -----------------------------------------------------------------------------
    def submit(self, feeds: Mapping[str, np.ndarray], model: str | None = None, *,
               arrival: float | None = None, checked: bool = False) -> RequestFuture:
        """Queue one batch of ``model`` (None: the only one); the future resolves to
        {output name: array} (or the task's error). ``arrival`` (``time.perf_counter()``;
        default now) is when the batch's oldest request arrived: its model's latency target
        counts from there. ``checked``: the caller formed ``feeds`` from requests it already
        checked against this plan (the serving batcher): the plan's checks are not run again."""
        if self._closed:
            raise EngineClosed("the runtime is closed; no new requests are accepted")
        hosted = self._only if model is None and self._only is not None else self.models.model(model)
        if not checked:
            hosted.plan.check_feeds(feeds)
        return self._engine.submit(feeds, hosted.index, arrival)

    def batch_array(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """Memory to assemble a batch in before :meth:`submit`: pinned when CUDA workers may
        run it, so they copy it to the device without staging it first (the serving batcher
        concatenates into it), plain otherwise."""
        if self._pinned is None:
            return np.empty(shape, dtype)
        return self._pinned.array(shape, dtype)

    @property
    def host_core(self) -> int | None:
        """Where :meth:`colocate` runs a caller: the PU of the first CUDA driver thread (None
        while it is not pinned: CPU groups ``none`` outside a block), or, without CUDA workers,
        the first CPU worker's PU (its group's first)."""
        return self._colocation.core

    def colocate(self) -> contextlib.AbstractContextManager[int | None]:
        """A block in which the calling thread runs on the CUDA driver's core (StarPU's
        ``STARPU_MAIN_THREAD_BIND``), for a thread that submits many small tasks: a caller and
        the driver hold the GIL in turn, and on one core each hand-over is cheaper (see
        :mod:`staronnx.workers.colocate`; 30 vs 44-47 µs of host time per task on the 2-core
        development VM). Without CPU groups, the driver threads are pinned to a core while a
        block runs. Without CUDA workers, the block runs on the first CPU worker's PU, sharing
        it with that worker's compute (see :mod:`staronnx.workers.colocate`: worth it for short
        tasks). Yields that PU, or None where there is none (the block runs where it was).
        Threads started inside the block inherit the pin. Blocks may overlap, in any threads
        (a server's batcher and its caller)."""
        if self._closed:
            raise EngineClosed("the runtime is closed; its workers have no core left to join")
        return self._colocation.block()

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Submit one batch and wait for its outputs."""
        outputs: dict[str, np.ndarray] = self.submit(feeds).result()
        return outputs

    def map(self, feeds: Iterable[Mapping[str, np.ndarray]], max_in_flight: int = 8) -> Iterator[dict[str, np.ndarray]]:
        """Results in input order, with at most ``max_in_flight`` requests queued (backpressure)."""
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        window: deque[RequestFuture] = deque()
        for item in feeds:
            if len(window) >= max_in_flight:
                yield window.popleft().result()
            window.append(self.submit(item))
        while window:
            yield window.popleft().result()

    def stats(self) -> dict[str, Any]:
        """Per-worker busy fraction, tasks per (part, arch), mean queue wait, predicted vs
        measured; ``models``: each hosted model's requests, deadline misses and busy shares."""
        out = self._engine.stats()
        out["policy"] = self.policy_name
        return out

    def model_stats(self, name: str | None = None) -> dict[str, Any]:
        """One model's view: requests (in flight, done, failed), deadline misses, its target,
        each worker's busy share spent on it, its tasks per (part, arch)."""
        hosted = self.models.model(name)
        out = self._engine.model_stats(hosted.index)
        out["policy"] = self.policy_name
        return out

    @property
    def tracer(self) -> Tracer | None:
        """The trace being recorded (``trace=``), which servers and sweeps add their spans to."""
        return self._engine.tracer

    @property
    def predictor(self) -> PerfPredictor | None:
        """The perf models the native engine learns from every task (None for the starpu
        engine, whose StarPU keeps its own): what a replica reports of its models."""
        return self._engine.predictor

    @property
    def workers(self) -> Sequence[Worker]:
        """The workers tasks run on (each with ``name``, ``kind`` and ``arch``): staronnx's own, or
        StarPU's as seen through the engine, so sweeps and warm-ups size themselves alike."""
        return self._engine.workers

    # -- shutdown -----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called: it takes no request after (a health check's
        question, before it asks the workers)."""
        return self._closed

    def close(self, timeout: float | None = 30.0) -> None:
        """Drain in-flight work for up to ``timeout`` s, cancel the rest, stop every thread."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop_saving.set()
        if self._saver is not None:
            self._saver.join()
        self._engine.close(timeout)  # merges what was learnt since the last save


class ModelHandle:
    """One model of a shared :class:`Runtime`, with a one-model runtime's face: what a
    batching :class:`~staronnx.serving.Server` and ``staronnx serve`` need (``plan``,
    ``submit``, ``stats``, ``workers``, ...). Closing it closes nothing: the runtime owns the
    workers every model shares."""

    #: the Server passes each batch's oldest arrival, from which the latency target counts
    takes_arrival = True

    def __init__(self, runtime: Runtime, hosted: HostedModel) -> None:
        self.runtime = runtime
        self.name = hosted.name
        self.plan = hosted.plan
        self.target = hosted.target

    def submit(self, feeds: Mapping[str, np.ndarray], arrival: float | None = None, *,
               checked: bool = False) -> RequestFuture:
        return self.runtime.submit(feeds, self.name, arrival=arrival, checked=checked)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs: dict[str, np.ndarray] = self.submit(feeds).result()
        return outputs

    def batch_array(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        return self.runtime.batch_array(shape, dtype)

    def stats(self) -> dict[str, Any]:
        """This model's share of the runtime (:meth:`Runtime.model_stats`)."""
        return self.runtime.model_stats(self.name)

    @property
    def preferred_batch_sizes(self) -> tuple[int, ...]:
        return self.runtime.preferred_batch_sizes

    def colocate(self) -> contextlib.AbstractContextManager[int | None]:
        return self.runtime.colocate()

    @property
    def workers(self) -> Sequence[Worker]:
        return self.runtime.workers

    @property
    def tracer(self) -> Tracer | None:
        return self.runtime.tracer

    @property
    def closed(self) -> bool:
        return self.runtime.closed

    def close(self, timeout: float | None = 30.0) -> None:
        """Nothing to free: the shared runtime is closed by its owner."""

    def __repr__(self) -> str:
        return f"ModelHandle({self.name!r}, {self.plan.k} parts, {self.target})"
