"""Filling the performance models of a plan by running its parts on the real workers.

The scheduler places tasks from predictions, so before serving we run every part on every
worker architecture at every batch size until StarPU's rules call the history calibrated
(10 accepted samples after the dropped first one), at every footprint asked for (StarPU's
footprint is the data sizes: a width-200 and a width-320 batch are different work, measured
apart; ``input_shapes`` lists the sizes). The batch lands on each input's own batch axis (the
plan's contract: a state ``[2, batch, 64]`` grows on axis 1); a model that runs one request per
task is calibrated at batch 1 only (:func:`batch_sizes_for`). Each part is fed the real tensors its
predecessors produce (a reference run of the plan), never random crossing tensors. Workers run
concurrently, as they will while serving; workers of the same architecture (CPU groups of the
same size) feed one shared model, as StarPU's homogeneous CPU models do.
"""

from __future__ import annotations

import shlex
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from staronnx.perfmodels import Footprint, HistoryModel, PerfModelStore
from staronnx.plan import Plan
from staronnx.errors import StaronnxError
from staronnx.verify import model_failure, random_plan_feeds
from staronnx.workers.base import Worker
from staronnx.workers.launch import start_workers  # noqa: F401 - re-exported: its old home
from staronnx.workers.topology import Topology


def calibrate_command(plandir: str | Path, groups: str, cuda_streams: int = 0, cuda_devices: Sequence[int] = (0,),
                      batch_sizes: Sequence[int] = (), replace: bool = False) -> str:
    """The ``staronnx calibrate`` line that fills the perf models of workers started with these
    settings (what a warning or a stale-model note tells the user to run): the GPUs named,
    since each GPU has perf models of its own."""
    cmd = f"staronnx calibrate {shlex.quote(str(plandir))} --groups {shlex.quote(groups)}"
    if batch_sizes:
        cmd += f" --batch-sizes {','.join(str(b) for b in sorted(batch_sizes))}"
    if cuda_streams:
        cmd += f" --cuda-streams {cuda_streams}"
        if tuple(cuda_devices) != (0,):
            cmd += f" --cuda-devices {','.join(map(str, cuda_devices))}"
    return cmd + (" --replace" if replace else "")


@dataclass
class CalibrationReport:
    """What calibration measured: per (part, arch, batch) the samples taken and the mean."""

    models: dict[tuple[int, str], HistoryModel] = field(default_factory=dict)
    runs: dict[tuple[int, str, int], int] = field(default_factory=dict)
    uncalibrated: list[tuple[int, str, int]] = field(default_factory=list)
    #: (worker, part, batch) steps finished, of :func:`calibration_steps`
    steps_done: int = 0
    #: the signal (SIGINT, SIGTERM) that stopped the calibration, or None
    interrupted: str | None = None

    @property
    def samples(self) -> int:
        """Runs measured by this calibration (each one a sample offered to its model)."""
        return sum(self.runs.values())


def calibrate(
    plan: Plan,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
    *,
    workers: Sequence[Worker],
    store: PerfModelStore | None = None,
    max_runs: int = 60,
    seed: int = 0,
    on_step: Callable[[str], None] | None = None,
    replace: bool = False,
    report: CalibrationReport | None = None,
    input_shapes: Sequence[Mapping[str, Sequence[int]]] = ({},),
) -> CalibrationReport:
    """Run every part on every worker at every batch size, at each set of ``input_shapes``
    (name -> dims for the inputs with dynamic sizes; the batch axis's entry is replaced by each
    batch size), until its history is calibrated: one footprint per (batch size, set).

    ``max_runs`` bounds the runs per (worker, part, batch) when measurements keep being
    rejected as outliers (a noisy machine); those entries are reported as uncalibrated.
    Samples are merged into ``store`` (atomically, under its lock) at the end. ``replace``
    measures ``batch_sizes`` afresh and overwrites their stored entries: for models that are
    calibrated but stale (measurements beat their LP bound), which a merge would leave as
    they are since calibrated entries take no new samples. Unlike StarPU's
    ``STARPU_CALIBRATE=2``, which drops a whole model, the batch sizes not asked for keep
    their entries: a calibration names the batch sizes it is about, and the others are
    minutes of measurement that nothing here would replace.

    Interrupted (Ctrl-C, SIGTERM: a ``BaseException`` that is not an ``Exception``), it lets
    each worker finish the run it is in, stores every sample measured so far (the store is
    written atomically), records the signal in ``report.interrupted`` and re-raises; pass
    ``report`` to read then what was kept. With ``replace``, only the batch sizes that took a
    sample replace their stored entries, as at the end of a whole run.
    """
    store = store or PerfModelStore()
    store.check_writable()  # before measuring: samples that cannot be kept are wasted minutes
    report = report if report is not None else CalibrationReport()
    lock = threading.Lock()
    stop = threading.Event()
    measured_fps: dict[tuple[int, str], set[Footprint]] = {}
    for w in workers:
        for part in range(plan.k):
            key = (part, w.arch)
            if key not in report.models:
                report.models[key] = (HistoryModel(part, key[1]) if replace
                                      else store.load(plan.hash, part, key[1]))

    def drive(worker: Worker, batch: int, values: dict[str, np.ndarray]) -> None:
        arch = worker.arch
        for part in range(plan.k):
            if stop.is_set():
                return
            feeds = plan.part_feeds(part, values)
            model = report.models[(part, arch)]
            fp = Footprint.of_feeds(feeds, batch, plan.part_batch_axes(part))  # the engine's, so serving finds these
            with lock:
                measured_fps.setdefault((part, arch), set()).add(fp)
            worker.run(part, feeds)  # warm-up: allocations, kernel selection
            runs = 0
            k = (part, arch, batch)
            while model.needs_samples(fp) and runs < max_runs and not stop.is_set():
                future = worker.submit(part, feeds)
                future.result()
                # kernel time only for CUDA workers: copies are the bus model's business
                with lock:  # (the model is shared by the workers of one arch)
                    model.record(fp, getattr(future, "compute_seconds", None) or future.seconds)
                    report.runs[k] = report.runs.get(k, 0) + 1
                runs += 1
            if stop.is_set():
                return
            with lock:
                report.runs.setdefault(k, 0)
                report.steps_done += 1
            if on_step:
                on_step(f"{worker.name} part {part} batch {batch}: {runs} runs")

    try:
        with ThreadPoolExecutor(max_workers=len(workers), thread_name_prefix="calibrate") as pool:
            try:
                for batch in batch_sizes:
                    for given in input_shapes:
                        feeds = random_plan_feeds(plan, batch, {n: list(d) for n, d in given.items()}, seed=seed)
                        values = _reference(plan, feeds)
                        for future in [pool.submit(drive, w, batch, values) for w in workers]:
                            future.result()
            except BaseException:
                stop.set()  # the pool's exit waits for the runs under way, then nothing more starts
                raise
    except BaseException as exc:
        if isinstance(exc, Exception):
            raise
        from staronnx.signals import signal_name

        report.interrupted = signal_name(exc)
        measured = {(part, arch) for (part, arch, _b), n in report.runs.items() if n}
        for (part, arch), model in report.models.items():
            if (part, arch) not in measured:
                continue
            if replace:
                report.models[(part, arch)] = store.save_measured(plan.hash, model)
            else:
                report.models[(part, arch)] = store.commit(plan.hash, model)
        raise
    for (part, arch), model in report.models.items():
        if replace:
            merged = store.save_measured(plan.hash, model)
        else:
            merged = store.commit(plan.hash, model)
        report.models[(part, arch)] = merged
        for fp in sorted(measured_fps.get((part, arch), ()), key=lambda f: (f.batch, f.shape_hash)):
            if merged.needs_samples(fp):
                report.uncalibrated.append((part, arch, fp.batch))
    return report


def _reference(plan: Plan, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every tensor of a reference run on ``feeds``; a model that fails on them is one line
    naming the input (sizes the model does not accept), not ORT's traceback."""
    try:
        return plan.reference_values(feeds)
    except StaronnxError:
        raise
    except Exception as exc:  # ORT's own classes: the model's error at these sizes
        raise model_failure(plan, feeds, exc) from None


def calibration_steps(plan: Plan, workers: Sequence[Worker], batch_sizes: Sequence[int], shape_sets: int = 1) -> int:
    """Number of (worker, part, batch, input shapes) steps, for a progress bar."""
    return len(workers) * plan.k * len(batch_sizes) * max(shape_sets, 1)


def batch_sizes_for(plan: Plan, batch_sizes: Sequence[int]) -> tuple[list[int], str | None]:
    """The batch sizes a plan can be calibrated at: all of them, or only 1 for a model that
    runs one request per task (it never sees another batch), with the line that says so."""
    sizes = sorted(set(batch_sizes))
    contract = plan.contract
    if contract.batchable or sizes == [1]:
        return sizes, None
    return [1], (f"this model runs one request per task ({contract.why_not}): only batch 1 is calibrated, "
                 f"not {','.join(map(str, sizes))}")



def calibrate_bus_if_needed(
    store: PerfModelStore, cuda_devices: Sequence[int] = (), force: bool = False
) -> tuple[object, list[str]] | None:
    """Measure this host's links (NUMA<->NUMA, host<->GPU) once, as StarPU does per host.

    Returns (bus model, node names) when something was measured; None on a machine with a
    single memory node (nothing to transfer) or when a stored model exists and ``force`` is off.
    """
    from staronnx.workers.memory import calibrate_bus, memory_nodes

    topology = Topology.from_system()
    nodes = memory_nodes(topology, cuda_devices)
    if len(nodes) < 2:
        return None
    if not force and store.load_bus().links:
        return None
    bus = calibrate_bus(nodes, topology=topology)
    store.save_bus(bus)
    return bus, [n.name for n in nodes]
