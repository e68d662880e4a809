"""``Runtime``: a plan, workers and a policy, served through futures.

    with Runtime("plan/", policy="heft", cpu_groups="numa") as rt:
        outputs = rt.run({"input": x})
        futures = [rt.submit(f) for f in feeds]        # concurrent.futures-compatible
        for out in rt.map(stream, max_in_flight=8):    # backpressure
            ...
        print(rt.stats())

Inputs are checked against the plan's signature before any task exists, so a bad request
raises ValueError (InputError) at once and never reaches a worker.

``cuda_streams=N`` starts N CUDA workers per GPU, each on a core held back from the CPU
groups (see :mod:`staronnx.workers.launch`); ``cuda_options`` go to every
:class:`~staronnx.workers.cuda.CudaWorker` (``cudnn_conv_algo_search``, ``provider_options``
such as ``gpu_mem_limit``, ``prefetch``).

``calibrate`` is StarPU's ``STARPU_CALIBRATE`` for either engine (default
``$STARONNX_CALIBRATE``, else 0): 0 freezes calibrated models, 1 keeps recording every
execution while serving, 2 replaces the stored models with this run's measurements.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from staronnx.errors import StaronnxError
from staronnx.perfmodels import PerfModelStore
from staronnx.plan import Plan
from staronnx.runtime.engine import EngineClosed, NativeEngine
from staronnx.runtime.predictor import PerfPredictor, calibrate_mode
from staronnx.runtime.sched import WorkerInfo
from staronnx.runtime.task import RequestFuture
from staronnx.runtime.trace import Tracer

ENGINES = ("native", "starpu")


def _worker_info(index: int, worker: Any) -> WorkerInfo:
    group = getattr(worker, "group", None)
    if group is not None:
        numa = group.numa if group.numa is not None else 0
        return WorkerInfo(index, worker.name, f"cpu{group.n_cores}", "cpu", f"numa{numa}", group.n_cores)
    device = getattr(worker, "device_id")
    return WorkerInfo(index, worker.name, f"cuda{device}", "cuda", f"cuda{device}", 1)


class Runtime:
    """Serve a plan on this machine's CPU groups (and CUDA streams) with a StarPU-style policy."""

    def __init__(
        self,
        plan: Plan | str | os.PathLike[str],
        policy: str = "heft",
        cpu_groups: str = "numa",
        cuda_streams: int = 0,
        trace: str | os.PathLike[str] | None = None,
        *,
        engine: str = "native",
        store: PerfModelStore | None = None,
        policy_options: Mapping[str, Any] | None = None,
        workers: Sequence[Any] | None = None,
        calibrate: int | None = None,
        cuda_options: Mapping[str, Any] | None = None,
    ) -> None:
        from staronnx.workers.launch import start_workers
        from staronnx.runtime.policies import make_policy

        if engine not in ENGINES:
            raise StaronnxError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
        if engine == "starpu":
            # StarPU's own workers, schedulers and perf models (staronnx.engines.starpu); the
            # engine has the native one's submit/stats/close, so everything below is shared.
            from staronnx.engines.starpu import StarpuEngine

            if workers is not None:
                raise StaronnxError("engine='starpu' starts its own StarPU workers; workers= is for engine='native'")
            self.plan = plan if isinstance(plan, Plan) else Plan.load(plan)
            self.policy_name = policy
            self._workers, self._own_workers = [], False
            options = dict(policy_options or {})
            if "calibrate" not in options and (calibrate is not None or "STARONNX_CALIBRATE" in os.environ):
                options["calibrate"] = calibrate_mode(calibrate)
            self._engine = StarpuEngine(self.plan, policy, cpu_groups, cuda_streams, trace, options)
            self._closed = False
            self._close_lock = threading.Lock()
            return
        self.plan = plan if isinstance(plan, Plan) else Plan.load(plan)
        self.policy_name = policy
        options = dict(policy_options or {})
        if policy == "static" and "devices" not in options:
            devices = {p.index: p.device for p in self.plan.parts if getattr(p, "device", None)}
            if len(devices) != self.plan.k:
                raise StaronnxError(
                    "policy 'static' needs a plan whose parts name their device (partition with "
                    "--method comm-sd, duet, overseer or optimal)"
                )
            options["devices"] = devices
        policy_obj = make_policy(policy, **options)  # fail before starting workers
        mode = calibrate_mode(calibrate)
        own = workers is None
        self._workers = list(workers) if workers is not None else start_workers(
            self.plan, groups=cpu_groups, cuda_streams=cuda_streams, cuda_options=dict(cuda_options or {}))
        self._own_workers = own
        try:
            infos = [_worker_info(i, w) for i, w in enumerate(self._workers)]
            store = store if store is not None else PerfModelStore()
            predictor = PerfPredictor(self.plan.hash, store, calibrate=mode)
            tracer = Tracer(trace, origin=0.0) if trace is not None else None
            self._engine = NativeEngine(self.plan, self._workers, infos, policy_obj, predictor, tracer)
            if tracer is not None:
                tracer.origin = self._engine.started_at
        except BaseException:
            self._close_workers()
            raise
        self._closed = False
        self._close_lock = threading.Lock()

    # -- context manager ---------------------------------------------------------------------
    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -----------------------------------------------------------------------------
    def submit(self, feeds: Mapping[str, np.ndarray]) -> RequestFuture:
        """Queue one batch; the future resolves to {output name: array} (or the task's error)."""
        if self._closed:
            raise EngineClosed("the runtime is closed; no new requests are accepted")
        self.plan.check_feeds(feeds)
        return self._engine.submit(feeds)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Submit one batch and wait for its outputs."""
        return self.submit(feeds).result()

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
        """Per-worker busy fraction, tasks per (part, arch), mean queue wait, predicted vs measured."""
        out = self._engine.stats()
        out["policy"] = self.policy_name
        return out

    @property
    def tracer(self) -> Tracer | None:
        """The trace being recorded (``trace=``), which servers and sweeps add their spans to."""
        return getattr(self._engine, "tracer", None)

    @property
    def workers(self) -> list[Any]:
        """The workers tasks run on: staronnx's own, or StarPU's as seen through the engine
        (each with ``name`` and ``arch``), so sweeps and warm-ups size themselves alike."""
        if self._workers:
            return list(self._workers)
        return list(getattr(self._engine, "workers", ()))

    # -- shutdown -----------------------------------------------------------------------------
    def close(self, timeout: float | None = 30.0) -> None:
        """Drain in-flight work for up to ``timeout`` s, cancel the rest, stop every thread."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._engine.close(timeout)
        finally:
            self._close_workers()

    def _close_workers(self) -> None:
        if not getattr(self, "_own_workers", True):
            return
        for w in self._workers:
            try:
                w.close()
            except Exception:  # noqa: BLE001 - close the others anyway
                pass
