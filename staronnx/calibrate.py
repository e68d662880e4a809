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

Each run is a task pinned to its worker through the native engine
(:meth:`~staronnx.runtime.engine.NativeEngine.pin`, StarPU's ``execute_on_specific_worker``):
the same launch, copies and wait as serving, on the thread that drives the worker.

Calibration reads the machine's load while it measures (:mod:`staronnx.bench.cpuload`): samples
taken beside other work are that work's as much as the plan's, and :attr:`CalibrationReport.busy`
says so. :func:`calibrate_host` then measures what serving costs the host beyond the parts
(:mod:`staronnx.perfmodels.host`), which the simulator and the LP bound add to the models.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from staronnx.perfmodels import Footprint, HistoryModel, HostCosts, HostModel, PerfModelStore
from staronnx.plan import Plan
from staronnx.errors import StaronnxError
from staronnx.verify import model_failure, random_plan_feeds
from staronnx.workers.base import Worker
from staronnx.workers.launch import start_workers as start_workers  # noqa: F401 - the workers to calibrate on
from staronnx.workers.layout import MachineSpec
from staronnx.workers.topology import Topology


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
    #: the machine's load while it measured (:class:`~staronnx.bench.cpuload.MachineLoad` as a
    #: dict: others' CPU, steal, its own), None where /proc/stat cannot be read
    machine: dict[str, Any] | None = None

    @property
    def busy(self) -> str | None:
        """One line when its samples were taken beside other work (they are then the other
        work's as much as the plan's: every prediction built on them is off), else None."""
        if not self.machine or not self.machine.get("busy"):
            return None
        return (f"calibration {self.machine.get('why')}; its times are inflated by as much: calibrate again on a "
                "quiet machine (--replace)")

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
    from staronnx.bench.cpuload import LoadWatch

    check_max_runs(max_runs)
    store = store or PerfModelStore()
    store.check_writable()  # before measuring: samples that cannot be kept are wasted minutes
    report = report if report is not None else CalibrationReport()
    watch = LoadWatch()
    lock = threading.Lock()
    stop = threading.Event()
    measured_fps: dict[tuple[int, str], set[Footprint]] = {}
    for arch in (w.arch for w in workers):
        for part in range(plan.k):
            if (part, arch) not in report.models:
                report.models[part, arch] = HistoryModel(part, arch) if replace else store.load(plan.hash, part, arch)

    def drive(wid: int, batch: int, values: dict[str, np.ndarray]) -> None:
        worker = workers[wid]
        arch = worker.arch
        for part in range(plan.k):
            if stop.is_set():
                return
            feeds = plan.part_feeds(part, values)
            model = report.models[(part, arch)]
            fp = Footprint.of_feeds(feeds, batch, plan.part_batch_axes(part))  # the engine's, so serving finds these
            with lock:
                measured_fps.setdefault((part, arch), set()).add(fp)
            engine.pin(wid, part, feeds)[0].result()  # warm-up: allocations, kernel selection
            runs = 0
            k = (part, arch, batch)
            while model.needs_samples(fp) and runs < max_runs and not stop.is_set():
                ran = engine.pin(wid, part, feeds)[0].result()
                # kernel time only for CUDA workers: copies are the bus model's business
                with lock:  # (the model is shared by the workers of one arch)
                    model.record(fp, ran.seconds)
                    report.runs[k] = report.runs.get(k, 0) + 1
                runs += 1
            if stop.is_set():
                return
            with lock:
                report.runs.setdefault(k, 0)
                report.steps_done += 1
            if on_step:
                on_step(f"{worker.name} part {part} batch {batch}: {runs} runs")

    interrupted: BaseException | None = None  # Ctrl-C, SIGTERM: what was measured is kept, then re-raised
    engine = _pinning_engine(plan, workers)  # every run is a task pinned to its worker
    try:
        with ThreadPoolExecutor(max_workers=len(workers), thread_name_prefix="calibrate") as pool:
            try:
                for batch in batch_sizes:
                    for given in input_shapes:
                        feeds = random_plan_feeds(plan, batch, {n: list(d) for n, d in given.items()}, seed=seed)
                        values = _reference(plan, feeds)
                        for future in [pool.submit(drive, wid, batch, values) for wid in range(len(workers))]:
                            future.result()
            except BaseException:
                stop.set()  # the pool's exit waits for the runs under way, then nothing more starts
                raise
    except Exception:
        raise
    except BaseException as exc:
        interrupted = exc
    finally:
        engine.close()
    load = watch.stop()
    report.machine = None if load is None else load.as_dict()
    if interrupted is not None:
        from staronnx.signals import signal_name

        report.interrupted = signal_name(interrupted)
    measured = {(part, arch) for (part, arch, _b), n in report.runs.items() if n}
    for (part, arch), model in report.models.items():
        if interrupted is not None and (part, arch) not in measured:
            continue
        merged = (store.save_measured if replace else store.commit)(plan.hash, model)
        report.models[(part, arch)] = merged
        for fp in sorted(measured_fps.get((part, arch), ()), key=lambda f: (f.batch, f.shape_hash)):
            if interrupted is None and merged.needs_samples(fp):
                report.uncalibrated.append((part, arch, fp.batch))
    if interrupted is not None:
        raise interrupted
    return report


def check_max_runs(max_runs: int) -> None:
    """Refuse a cap that allows no run: every entry then stays uncalibrated, which the report
    would blame on outliers that were never measured."""
    if max_runs < 1:
        raise StaronnxError(f"max_runs must be at least 1 (runs per worker, part and batch size), got {max_runs}",
                            cli=f"--max-runs must be at least 1 (runs per worker, part and batch size), got {max_runs}")


def _pinning_engine(plan: Plan, workers: Sequence[Worker]) -> Any:
    """The native engine over ``workers``, for tasks pinned to them
    (:meth:`~staronnx.runtime.engine.NativeEngine.pin`): calibration runs each part through
    the same launch, copies and wait as serving does (on a CUDA worker, on the thread that
    drives it), with no request, no policy decision, and a perf model of its own that is
    never saved (the report's models are what calibration keeps)."""
    from staronnx.runtime.engine import NativeEngine
    from staronnx.runtime.policies import make_policy
    from staronnx.runtime.predictor import PerfPredictor

    return NativeEngine(plan, workers, make_policy("eager"), PerfPredictor(plan.hash, None))


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


# ---------------------------------------------------------------------------- the host's own work
#: the host-cost probe's load, a share of the LP bound: low enough that each batch meets idle
#: workers (what the costs are defined on), high enough to be over in a few seconds
HOST_PROBE_LOAD = 0.2
#: ... and again at this share, where the threads stay awake (:mod:`staronnx.perfmodels.host`:
#: the costs fall with the load); under the capacity once the host's costs are counted, unless
#: they are most of a request's time (then that probe falls behind and is left out)
HOST_PROBE_LOADED = 0.4
#: batches the probe serves per batch size (fewer when that takes over ``max_seconds``)
HOST_PROBE_BATCHES = 20


def cold_interval(batch: int, bound: float) -> float:
    """The time between two batches (seconds) at which a worker is idle for
    :data:`~staronnx.perfmodels.host.COLD_IDLE_S` before most tasks in the normal course: twice
    that idle time, plus twice a batch's share of the LP bound (a request's tasks and their
    hand-overs). Where the light probe's batches come closer (a model of short tasks, whose
    bound is thousands of requests/s), a task after a long idle is a rare one, after a stall
    of the machine, and runs slower for that: crnn_ocr's read x1.3-1.7 their models at 500 req/s
    where every task of a 250 req/s sweep point, all of them cold, ran x1.0."""
    from staronnx.perfmodels.host import COLD_IDLE_S

    return 2 * COLD_IDLE_S + 2 * batch / bound if bound > 0 else 2 * COLD_IDLE_S


def probe_sizes(sizes: Sequence[int]) -> list[int]:
    """The batch sizes the host probe measures: the smallest, the largest and the one nearest
    their geometric middle (the costs of a size between are those of the nearest measured:
    they grow slowly with the batch, and three sizes keep the probe to seconds)."""
    sizes = sorted(set(sizes))
    if len(sizes) <= 3:
        return sizes
    middle = min(sizes[1:-1], key=lambda b: abs(math.log(b) - (math.log(sizes[0]) + math.log(sizes[-1])) / 2))
    return [sizes[0], middle, sizes[-1]]


@dataclass(frozen=True)
class HostProbe:
    """How :func:`calibrate_host` probes: the policy its runtime schedules with, the seed of its
    inputs and arrivals, the batches each run aims for, and the longest a run may take (s)."""

    policy: str = "heft"
    seed: int = 0
    batches: int = HOST_PROBE_BATCHES
    max_seconds: float = 4.0


def calibrate_host(
    plan: Plan,
    batch_sizes: Sequence[int],
    machine_spec: MachineSpec = MachineSpec(),
    probe: HostProbe = HostProbe(),
    *,
    store: PerfModelStore | None = None,
    workers: Sequence[Worker] | None = None,
    calibration_machine: Mapping[str, Any] | None = None,
    on_step: Callable[[str], None] | None = None,
) -> HostModel:
    """Measure what serving costs the host beyond the parts' ONNX Runtime time, per batch size
    (:class:`~staronnx.perfmodels.host.HostCosts`), and store it beside the plan's perf models
    for these workers. Needs the plan calibrated (its LP bound sets the probe's rate).

    Per batch size (:func:`probe_sizes` of them): two short open-loop runs, at
    :data:`HOST_PROBE_LOAD` and at :data:`HOST_PROBE_LOADED` of the LP bound (the costs fall with
    the load: :meth:`HostCosts.at_rate`), and before them, where the light run's batches come too
    close for workers to idle between them, a slower one whose tasks give the cold scale
    (:func:`cold_interval`), through the very Server, load generator and runtime a sweep point
    uses (``workers``: already started ones, else the runtime starts its own), traced. Each batch
    that ran alone gives its launch (formed -> first task), its hand-overs (a task's end -> its
    successor's start, on the same worker or another, idle one), its finish (last task's end ->
    answered) and its tasks' time against their models; the generator reports its lag; the
    process's CPU time less the CPU workers' task time is the host's CPU. The machine's load
    meanwhile (:mod:`staronnx.bench.cpuload`) is kept with them, and ``calibration_machine`` (the
    calibration's, :attr:`CalibrationReport.machine`). ``machine_spec``: the workers measured (those
    ``workers`` were started from, when given); ``probe``: how (:class:`HostProbe`).
    """
    import tempfile

    from staronnx.bench.bound import machine_bound
    from staronnx.bench.cpuload import LoadWatch, _own_cpu, compute_threads, thread_cpu
    from staronnx.bench.machine import build_machine
    from staronnx.bench.points import measure_point, sample_pool, warm_up
    from staronnx.bench.spec import RunSpec
    from staronnx.runtime.runtime import Runtime
    from staronnx.runtime.spec import RuntimeSpec

    store = store if store is not None else PerfModelStore()
    say = on_step or (lambda msg: None)
    seed, spec = probe.seed, machine_spec
    machine = build_machine(plan, spec, store=store, cpu_fallback=False, host=False)
    sizes = probe_sizes(batch_sizes_for(plan, batch_sizes)[0])
    bounds = {b: machine_bound(machine, b, host_costs=False).throughput for b in sizes}
    runs: list[_ProbeRun] = []
    with tempfile.TemporaryDirectory(prefix="staronnx-host-") as tmp:
        trace = Path(tmp) / "probe.json"
        # the probe's runtime reads a copy of the models: what it learns (the flush's partial
        # batches, sizes nobody calibrated) must not land in the store as half-filled entries
        scratch = _scratch_store(store, plan.hash, Path(tmp) / "home")
        runtime = Runtime(plan, spec, RuntimeSpec(probe.policy, store=scratch, workers=workers, trace=trace))
        try:
            names = [w.name for w in runtime.workers]
            inline = all(w.kind == "cpu" for w in machine.workers)  # the Server resolves on the worker's thread
            compute = compute_threads(names)
            samples = sample_pool(plan, seed=seed)
            total = LoadWatch()
            for b in sizes:
                warm_up(runtime, plan, [b], rounds=1, seed=seed)
                # light and loaded; first, where the light probe's batches come too close for
                # a worker to idle, a slower one for the tasks' cold scale alone
                cold_rate = b / cold_interval(b, bounds[b])
                loads = [(HOST_PROBE_LOAD * bounds[b], 0.3, "light"), (HOST_PROBE_LOADED * bounds[b], 1.0, "loaded")]
                if cold_rate < loads[0][0]:
                    loads.insert(0, (cold_rate, 0.3, "cold"))
                for rate, shortest, kind in loads:
                    seconds = min(probe.max_seconds, max(shortest, probe.batches * b / rate))
                    say(f"host costs: batch {b} at {rate:.0f} req/s for {seconds:.1f} s")
                    own, workers_cpu = _own_cpu(), sum(thread_cpu(compute).values())
                    _, records = measure_point(runtime, b, rate, samples,
                                               RunSpec(duration=seconds, warmup=0.0, seed=seed))
                    host_cpu = (_own_cpu() - own) - (sum(thread_cpu(compute).values()) - workers_cpu)
                    runs.append(_ProbeRun(b, records, host_cpu, inline, rate, seconds, kind == "loaded",
                                          cold_only=kind == "cold", idles=rate <= cold_rate))
            probe_load = total.stop()
            assert runtime.tracer is not None
            origin = runtime.tracer.origin
            runtime.tracer.save()
            events = _trace_tasks(trace)
        finally:
            runtime.close()
    deps = plan.dependencies()
    tasks = {id(run): _run_tasks(run, events, origin) for run in runs}
    light = {run.batch: _host_costs(run, tasks[id(run)], origin, deps) for run in runs
             if not run.loaded and not run.cold_only}
    loaded: dict[int, HostCosts] = {}
    for run in runs:
        if run.loaded and _kept_up(run):
            heavier = _host_costs(run, tasks[id(run)], origin, deps)
            if _generator_kept_up(run, heavier):
                loaded[run.batch] = heavier
    _fit_cpu_per_request(light)
    _fit_cpu_per_request(loaded)
    scales = {b: _task_scales(_scale_tasks([run for run in runs if run.batch == b], tasks), plan.k) for b in light}
    costs = {b: _two_loads(light[b], loaded.get(b), scales[b]) for b in light}
    model = HostModel(names, machine.free_pus, costs,
                      probe_machine=None if probe_load is None else probe_load.as_dict(),
                      calibration_machine=dict(calibration_machine) if calibration_machine else None,
                      measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    store.save_host(plan.hash, model)
    return model


def _scratch_store(store: PerfModelStore, plan_hash: str, root: Path) -> PerfModelStore:
    """A store under ``root`` holding a copy of ``store``'s models of the plan and its bus."""
    import shutil

    scratch = PerfModelStore(root, host=store.host)
    if store.plan_dir(plan_hash).is_dir():
        shutil.copytree(store.plan_dir(plan_hash), scratch.plan_dir(plan_hash))
    if store.bus_path().is_file():
        scratch.bus_path().parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(store.bus_path(), scratch.bus_path())
    return scratch


@dataclass
class _ProbeRun:
    """One batch size's probe at one rate: its records, the CPU its threads other than the
    workers' used (seconds), whether the Server answered on the workers' threads (a CPU-only
    runtime), the offered rate and how long it was offered, and whether it was the loaded one."""

    batch: int
    records: Any
    host_cpu_s: float
    inline: bool
    rate: float
    seconds: float
    loaded: bool
    #: a run for the tasks' cold scale alone (its other figures are the light run's)
    cold_only: bool = False
    #: whether its batches come far enough apart for workers to idle between them
    #: (:func:`cold_interval`): its tasks after an idle worker are the normal cold ones
    idles: bool = False


def _kept_up(run: _ProbeRun) -> bool:
    """Whether the probe served what it was offered (a loaded probe past the capacity measures
    a queue, not the host's costs)."""
    answered = sum(1 for r in run.records.requests if r.done is not None)
    return answered >= 0.9 * run.rate * run.seconds


def _generator_kept_up(run: _ProbeRun, costs: HostCosts) -> bool:
    """Whether the load generator kept to its schedule: its median lag under the time between
    two batches (1 ms at least). A generator that falls further behind was starved of CPU (the
    machine stalled, or the host's threads cannot keep up at that rate): its lag is a queue,
    and a simulation that added it to every request would answer tens of ms late."""
    return costs.lag_s <= max(run.batch / run.rate, 1e-3)


def _two_loads(light: HostCosts, loaded: HostCosts | None, scales: _Scales) -> HostCosts:
    """The loaded figures with the light ones beside them; hand-overs the loaded probe could
    not see (no batch ran alone) are the light probe's; the tasks' scales
    (:func:`_task_scales`) are both loads' alike."""
    light = scales.apply(light)
    if loaded is None:
        return light
    loaded = scales.apply(loaded)
    if not loaded.batches:
        loaded = dataclasses.replace(loaded, launch_s=light.launch_s, wake_s=light.wake_s, gap_s=light.gap_s,
                                     finish_s=light.finish_s)
    return dataclasses.replace(loaded, lighter=light)


@dataclass
class _TraceTask:
    request: int
    part: int
    worker: int
    start: float  # seconds on the tracer's clock (from its origin)
    end: float
    predicted: float | None  # seconds
    #: how long its worker had been idle when it started (its previous task's end; inf: the first)
    idle: float = math.inf


def _trace_tasks(path: Path) -> list[_TraceTask]:
    """The task events of a runtime trace (:mod:`staronnx.runtime.trace`), each with its
    worker's idle time before it."""
    import json

    data = json.loads(path.read_text())
    out = []
    for e in data.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") != "task" or not str(e.get("name", "")).startswith("part"):
            continue
        args = e.get("args") or {}
        if args.get("failed"):
            continue
        start = e["ts"] / 1e6
        predicted = args.get("predicted_ms")
        out.append(_TraceTask(int(args.get("request", -1)), int(e["name"][4:]), int(e["tid"]), start,
                              start + e["dur"] / 1e6, None if predicted is None else predicted / 1e3))
    last_end: dict[int, float] = {}
    for t in sorted(out, key=lambda t: t.start):
        t.idle = t.start - last_end.get(t.worker, -math.inf)
        last_end[t.worker] = max(t.end, last_end.get(t.worker, -math.inf))
    return out


def _run_tasks(run: _ProbeRun, events: Sequence[_TraceTask], origin: float) -> list[list[_TraceTask]]:
    """A probe run's tasks, per request, in the order the requests began (its tasks start
    before its last result: the next probe follows at once)."""
    t0, t1 = run.records.start - origin, run.records.end - origin
    by_request: dict[int, list[_TraceTask]] = {}
    for ev in events:
        if t0 <= ev.start <= t1:
            by_request.setdefault(ev.request, []).append(ev)
    return sorted(by_request.values(), key=lambda ts: min(t.start for t in ts))


def speed_moved(model: HostModel) -> str | None:
    """Why the host probe's tasks say the machine's speed moved since the perf models were
    calibrated (seconds before, on the same workers), or None: a batch size whose tasks ran
    warm at :data:`~staronnx.bench.sweep.DRIFT` or more off their models, overall (a small
    part's own scale can sit at x1.3 for good: its model leaves out what serving adds to it).
    On a VM the host can slow or speed the guest by a third within a minute (googlenet's
    probe once read x0.62): every prediction from those models is off by as much."""
    from staronnx.bench.sweep import DRIFT

    off = {b: c.task_scale for b, c in sorted(model.costs.items()) if not 1 / DRIFT <= c.task_scale <= DRIFT}
    if not off:
        return None
    said = ", ".join(f"x{x:.2f} at batch {b}" for b, x in off.items())
    how = "faster" if all(x < 1 for x in off.values()) else "slower" if all(x > 1 for x in off.values()) else "off"
    return (f"the host probe's tasks ran {said} their perf models ({how}) seconds after those were calibrated: "
            "the machine's speed moved meanwhile, and the simulator and the LP bound inherit it (calibrate again "
            "with --replace when the machine is steady)")


def _scale_tasks(runs: Sequence[_ProbeRun], tasks: Mapping[int, Sequence[Sequence[_TraceTask]]]) -> list[_TraceTask]:
    """The tasks one batch size's scales are read from (``tasks``: per run's ``id``, its tasks
    per request): every load's (what sets a task's scale is its worker's idle time before it,
    not the load), but a task after an idle worker only from a run whose workers idle in the
    normal course (:attr:`_ProbeRun.idles`): elsewhere that idle was a stall."""
    from staronnx.perfmodels.host import COLD_IDLE_S

    return [t for run in runs for ts in tasks[id(run)] for t in ts if run.idles or t.idle < COLD_IDLE_S]


#: tasks of one kind (a part, warm or cold) below which its scale comes from the others
_SCALE_SAMPLES = 8
#: the share of a kind's tasks left out at each end before its scale is taken: one task of
#: 0.2 ms descheduled for a millisecond must not set a part's scale from a probe of 20 batches
_SCALE_TRIM = 0.1


@dataclass(frozen=True)
class _Scales:
    """The tasks' wall time over their perf models, overall and per part of the plan, for a
    task right behind another on its worker (warm) and after the worker idled (cold)."""

    warm: float
    cold: float
    part_warm: tuple[float, ...]
    part_cold: tuple[float, ...]

    def apply(self, costs: HostCosts) -> HostCosts:
        return dataclasses.replace(costs, task_scale=self.warm, cold_task_scale=self.cold,
                                   part_scales=self.part_warm, part_cold_scales=self.part_cold)


def _task_scales(tasks: Sequence[_TraceTask], parts: int) -> _Scales:
    """The tasks' wall time over their models, per part and warm / cold: a task that started
    within :data:`~staronnx.perfmodels.host.COLD_IDLE_S` of its worker's previous one is warm.

    Kept apart by part because parts differ more than warm and cold do, and the two are
    confounded at a light load: there a warm task is nearly always a later part right behind
    the first on the same worker, and a cold one a first part; one scale per warmth would give
    the first part, at the knee where it runs warm, the later part's scale (unet_seg at batch
    4: warm x1.17-1.28, the later part's, for a first part that runs x0.92-0.97 either way).
    A part seen only cold or only warm runs alike either way: another part's cold / warm is
    no guide (googlenet's first part, seen only cold by the probe, took x1.04 warm from its
    second part's cold / warm, and ran x0.96-1.0 back to back at the knee). Every
    task counts, alone or not: at load, tasks on other cores share the memory bus and caches,
    and that is what serving costs; each kind's scale is a mean with :data:`_SCALE_TRIM` of
    its tasks left out at either end. A part with too few tasks of either kind takes the
    overall scales."""
    from staronnx.perfmodels.host import COLD_IDLE_S

    def scale(ts: Sequence[_TraceTask]) -> float | None:
        ts = [t for t in ts if t.predicted]
        if len(ts) < _SCALE_SAMPLES:
            return None
        ts = sorted(ts, key=lambda t: (t.end - t.start) / (t.predicted or 1.0))  # (all predicted, filtered above)
        cut = int(len(ts) * _SCALE_TRIM)
        kept = ts[cut:len(ts) - cut]
        predicted = sum(t.predicted or 0.0 for t in kept)
        return sum(t.end - t.start for t in kept) / predicted if predicted > 0 else None

    def warmth(ts: Sequence[_TraceTask]) -> tuple[list[_TraceTask], list[_TraceTask]]:
        return [t for t in ts if t.idle < COLD_IDLE_S], [t for t in ts if t.idle >= COLD_IDLE_S]

    overall = scale(tasks) or 1.0
    warm_all, cold_all = warmth(tasks)
    warm, cold = scale(warm_all), scale(cold_all)
    part_warm, part_cold = [], []
    for p in range(parts):
        w, c = (scale(ts) for ts in warmth([t for t in tasks if t.part == p]))
        part_warm.append(w or c or warm or overall)
        part_cold.append(c or w or cold or overall)
    return _Scales(warm or overall, cold or overall, tuple(part_warm), tuple(part_cold))


def _host_costs(run: _ProbeRun, groups: Sequence[list[_TraceTask]], origin: float,
                deps: Sequence[set[int]]) -> HostCosts:
    """The costs of one probe run (``groups``: its tasks per request, :func:`_run_tasks`): per
    batch that ran alone, launch, hand-overs and finish read off the trace (medians), the
    generator's lag and the host's CPU per batch. The tasks' scales are both loads' together
    (:func:`_task_scales`, set by :func:`_two_loads`)."""
    import statistics

    records = run.records
    batches = sorted((b for b in records.batches if b.done is not None), key=lambda b: b.formed)
    launch: list[float] = []
    wake: list[float] = []
    gap: list[float] = []
    finish: list[float] = []
    alone = 0
    for i, record in enumerate(batches):
        formed, done = record.formed - origin, record.done - origin
        previous_done = batches[i - 1].done - origin if i else -math.inf
        following = batches[i + 1].formed - origin if i + 1 < len(batches) else math.inf
        if previous_done > formed or following < done:  # not alone: another batch overlapped it
            continue
        tasks = next((ts for ts in groups if formed <= min(t.start for t in ts) and max(t.end for t in ts) <= done),
                     None)
        if tasks is None or len({t.part for t in tasks}) != len(deps):
            continue
        alone += 1
        part = {t.part: t for t in tasks}
        launch.append(min(t.start for t in tasks) - formed)
        finish.append(done - max(t.end for t in tasks))
        for t in tasks:
            if not deps[t.part]:
                continue
            pred = max((part[d] for d in deps[t.part]), key=lambda x: x.end)
            (gap if pred.worker == t.worker else wake).append(max(t.start - pred.end, 0.0))
    def median(xs: list[float], default: float = 0.0) -> float:
        return statistics.median(xs) if xs else default

    launch_s = median(launch)
    # the generator's lag, per batch: a full batch forms as its last request is submitted, so
    # formed - that request's scheduled arrival is how late the generator was (a median: one
    # descheduled wake-up on a shared machine must not set it)
    arrivals = {r.id: r.arrival for r in records.requests}
    lags = [b.formed - max(arrivals[i] for i in b.request_ids) for b in records.batches
            if b.size == run.batch and all(i in arrivals for i in b.request_ids)]
    done_batches = sum(1 for b in records.batches if b.done is not None)
    return HostCosts(
        batch=run.batch, launch_s=launch_s, wake_s=median(wake, launch_s / 2), gap_s=median(gap),
        finish_s=median(finish), lag_s=max(median(lags), 0.0),
        cpu_per_batch_s=max(run.host_cpu_s / done_batches, 0.0) if done_batches else 0.0,
        batches=alone, finish_on_worker=run.inline,
        rate=run.rate)


def _fit_cpu_per_request(costs: dict[int, HostCosts]) -> None:
    """Split each size's host CPU per batch into a per-request and a per-batch part: the slope
    of CPU per batch over the batch size (least squares over the sizes measured, at least 0);
    one size alone: a request's share as if the batch cost one request more."""
    sizes = sorted(costs)
    if len(sizes) >= 2:
        xs = np.array(sizes, dtype=np.float64)
        ys = np.array([costs[b].cpu_per_batch_s for b in sizes])
        slope = float(np.polyfit(xs, ys, 1)[0])
        per_request = {b: min(max(slope, 0.0), costs[b].cpu_per_batch_s / b) for b in sizes}
    else:
        per_request = {b: costs[b].cpu_per_batch_s / (b + 1) for b in sizes}
    for b in sizes:
        costs[b] = dataclasses.replace(costs[b], cpu_per_request_s=per_request[b])
