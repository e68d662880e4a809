"""Throughput/latency sweeps: the StarONNX papers' evaluation, point by point, on the live runtime.

    rows = sweep(plan, [50, 100, 200], [1, 4, 8], SweepSpec(RunSpec(duration=10.0), out_dir="results/"),
                 machine=MachineSpec(groups="numa"))

For every batch size ``b`` and offered rate ``rho``, single-sample requests arrive open-loop
at ``rho`` and a :class:`~staronnx.serving.Server` forms batches of exactly ``b`` (the papers'
model); each row is what :func:`~staronnx.serving.summarize` measures over the point's window
(:mod:`staronnx.bench.results` lists the columns; :mod:`staronnx.bench.points` measures one).

Why it runs the way it does:

- **One runtime for the whole sweep**, every batch size warmed up before any measurement.
- **Rates ascending per batch size; stop at congestion**: once a batch size is congested
  every higher rate would be too, so the rest are skipped (``results.json`` lists them) —
  where most of a naive sweep's time would go.
- **Stability** (perf_analyzer's rule): a point that is neither stable nor congested is
  measured once more, twice as long, and that measurement is kept (``extended``).
- **The bound**: where perf models exist, the LP bound of :mod:`staronnx.bench.bound` per
  batch size, and each point's achieved/bound.
- Results are rewritten after every point, so an interrupted sweep keeps what it measured
  (``settings.interrupted`` says a signal stopped it).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from staronnx.bench.bound import MixBound, batch_bounds, mix_bound, stale_models_note
from staronnx.bench.cpuload import BUSY_SHARE, LoadWatch, MachineLoad
from staronnx.bench.fidelity import band_columns, fidelity_summary, sim_columns
from staronnx.bench.machine import SimMachine, build_machine, machine_inflight, residency_where
from staronnx.bench.points import (TaskSampler, measure_point, point_duration, runnable_sizes, sample_pool,
                                   task_time_ratio, tasks_snapshot, warm_up, workers_delta, workers_snapshot)
from staronnx.bench.results import SweepError, clean, clean_dict, make_row, write_results
from staronnx.bench.simulator import MixResult, TraceInto, deadline_misses, simulate_mix
from staronnx.bench.spec import FrontEnd, MixPoint, RunSpec, SimSpec, SweepSpec, mix_label
from staronnx.errors import StaronnxError
from staronnx.perfmodels import PerfModelStore
from staronnx.inputs import batch_of, load_inputs, samples as input_samples
from staronnx.plan import Plan
from staronnx.runtime.models import HostedModel, ModelSet, load_plans
from staronnx.runtime.runtime import Runtime, driver_threads, warmup_sizes
from staronnx.runtime.spec import RuntimeSpec
from staronnx.runtime.trace import Tracer
from staronnx.serving.arrivals import DISTRIBUTIONS
from staronnx.serving.records import RunRecords
from staronnx.signals import signal_name
from staronnx.verify import random_plan_feeds
from staronnx.workers.residency import ResidencyError
from staronnx.workers.layout import MachineSpec

#: trace lane (thread id) of the sweep's points, clear of the workers' lanes
POINTS_LANE = 100_000


@dataclass
class SweepEvent:
    """What the sweep tells its ``progress`` callback.

    ``kind``: ``"start"`` (``total`` points planned), ``"warmup"`` (one batch size warmed up),
    ``"point"`` (a point starts: ``requests`` to submit), ``"requests"`` (``submitted`` so far,
    about 100 calls per point), ``"done"`` (a point measured: ``row``), ``"skipped"``
    (``skipped`` rates of a batch size left out after congestion), ``"end"``, or
    ``"interrupted"`` (stopped by the signal named in ``message``).
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


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class SweptRuntime(Protocol):
    """What a sweep measures through: a :class:`~staronnx.runtime.runtime.Runtime` (its
    :class:`~staronnx.runtime.runtime.ModelHandle` for one model of several) or a served one
    (:class:`~staronnx.bench.remote.RemoteRuntime`). A sweep of several models reads each one's
    handle off the :class:`~staronnx.runtime.runtime.Runtime` hosting them (:func:`_hosted`)."""

    @property
    def workers(self) -> Sequence[_Named]: ...

    @property
    def tracer(self) -> Tracer | None: ...  # the trace being recorded

    @property
    def preferred_batch_sizes(self) -> tuple[int, ...]: ...  # what a partial batch is padded to

    def submit(self, feeds: Mapping[str, np.ndarray]) -> Any: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def _hosted(runtime: SweptRuntime, name: str) -> SweptRuntime:
    """Model ``name``'s handle of the runtime a sweep of several models measures through: a
    :class:`~staronnx.runtime.runtime.Runtime` hosting them all (a served one hosts one)."""
    if not isinstance(runtime, Runtime):
        raise SweepError(f"a sweep of several models measures through a Runtime hosting them all, "
                         f"not a {type(runtime).__name__}")
    return runtime.model(name)


@dataclass
class _Results:
    """What the sweep has so far, rewritten to ``out_dir`` after every point."""

    out_dir: str | os.PathLike[str] | None
    settings: dict[str, Any]
    fidelity: bool
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    bounds: dict[Any, dict[str, Any]] = field(default_factory=dict)  # batch size (one model) or mix -> its bound
    notes: list[str] = field(default_factory=list)

    def save(self) -> None:
        if self.out_dir is not None:
            write_results(self.out_dir, self.rows, settings=self.settings, bounds=self.bounds,
                          skipped=self.skipped, notes=self.notes,
                          fidelity=fidelity_summary(self.rows) if self.fidelity else None)


# ---------------------------------------------------------------------------- points
# A point (:class:`~staronnx.bench.spec.MixPoint`) is a rate and a batch size per model (one
# model: a (batch size, rate) pair of the grid); several models' points are their mixes
# (:mod:`staronnx.bench.mix` reads them off the command line).
def batch_one_where_needed(plans: Mapping[str, Plan], points: Sequence[MixPoint]) -> tuple[list[MixPoint], list[str]]:
    """``points`` with batch 1 for every model that runs one request per task (its other sizes
    mean nothing: :func:`~staronnx.bench.points.runnable_sizes`), points that became equal
    measured once; and a line per such model saying so (named where there are several)."""
    notes = []
    for name, plan in plans.items():
        _, note = runnable_sizes(plan, [p.batch_sizes[name] for p in points if name in p.batch_sizes])
        if note:
            notes.append(note if len(plans) == 1 else f"{name}: {note}")
    if not notes:
        return list(points), []
    kept: dict[tuple[Any, ...], MixPoint] = {}
    for p in points:
        sizes = {n: (b if n not in plans or plans[n].contract.batchable else 1) for n, b in p.batch_sizes.items()}
        point = MixPoint(p.rates, sizes)
        kept.setdefault((tuple(point.rates.items()), tuple(sizes.items())), point)
    return list(kept.values()), notes


def mix_points(rates: Mapping[str, Sequence[float]], batch_sizes: Mapping[str, Sequence[int]] | Sequence[int],
               names: Sequence[str]) -> list[MixPoint]:
    """Every combination of the models' rates, for each batch-size setting.

    ``batch_sizes`` per model (every combination too), or one list whose each size applies to
    every model at once. Ordered by batch sizes, then rates ascending (the first model's rate
    varying slowest), so a congested point is met before the points that dominate it.
    """
    if isinstance(batch_sizes, Mapping):
        settings = [dict(zip(names, combo)) for combo in itertools.product(*(sorted(batch_sizes[n]) for n in names))]
    else:
        settings = [{n: int(b) for n in names} for b in sorted(batch_sizes)]
    combos = list(itertools.product(*(sorted(rates[n]) for n in names)))
    return [MixPoint(dict(zip(names, combo)), b) for b in settings for combo in combos]


def _check_mixes(names: Sequence[str], points: Sequence[MixPoint]) -> None:
    """Every mix gives each model a rate > 0 and a batch size >= 1; SweepError otherwise (one
    model's points: its rates and batch sizes named as such)."""
    if len(names) == 1:
        rates, sizes = sorted({p.rates[names[0]] for p in points}), sorted({p.batch_sizes[names[0]] for p in points})
        if not rates or any(not (math.isfinite(r) and r > 0) for r in rates):
            raise SweepError(f"rates must be positive numbers of requests/s, got {rates}")
        if not sizes or sizes[0] < 1:
            raise SweepError(f"batch sizes must be integers >= 1, got {sizes}")
    if not points:
        raise SweepError("no mix to measure")
    for p in points:
        if list(p.rates) != list(names) or list(p.batch_sizes) != list(names):
            raise SweepError(f"{p!r} does not give a rate and a batch size to each model ({', '.join(names)})")
        if any(not (math.isfinite(r) and r > 0) for r in p.rates.values()) or min(p.batch_sizes.values()) < 1:
            raise SweepError(f"{p!r}: rates must be > 0 requests/s and batch sizes >= 1")


def _check_run(run: RunSpec) -> float:
    """The warm-up seconds of each point; SweepError naming the argument that cannot be run."""
    duration, max_delay = run.duration, run.max_delay
    if run.distribution not in DISTRIBUTIONS:
        raise SweepError(f"unknown distribution {run.distribution!r}; choose {' or '.join(DISTRIBUTIONS)}")
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not (
            math.isfinite(duration) and duration > 0):
        raise SweepError(f"duration must be > 0 seconds, got {duration!r}")
    warmup = min(1.0, duration / 5) if run.warmup is None else float(run.warmup)
    if not (0 <= warmup < duration):
        raise SweepError(f"warmup must be >= 0 and shorter than the duration ({duration} s), got {warmup}",
                         cli=f"--warmup must be shorter than --duration ({duration:g} s), got {warmup:g} s")
    if run.min_batches < 1:
        raise SweepError(f"min_batches must be >= 1, got {run.min_batches}",
                         cli=f"--min-batches must be at least 1, got {run.min_batches}")
    if max_delay is not None and not (math.isfinite(max_delay) and max_delay >= 0):
        raise SweepError(f"max_delay must be >= 0 seconds, got {max_delay}")
    return warmup


def _unprofiled_shapes(plan: Plan, inputs: Mapping[str, np.ndarray]) -> str | None:
    """A line saying that the simulation and the LP bound price other shapes than the real
    ``inputs`` have (a dynamic width or sequence length other than the one the plan was
    profiled at: another footprint, with other times), None when one sample of each agrees."""
    ours = batch_of(inputs, plan, 1, 0)
    profiled = random_plan_feeds(plan, 1)
    differ = [f"{n} {list(ours[n].shape)} (profiled {list(a.shape)})" for n, a in profiled.items()
              if n in ours and ours[n].shape != a.shape]
    if not differ:
        return None
    return ("the LP bound and the simulation price the shapes the plan was profiled at, not the --inputs' "
            "(another footprint, other times): " + ", ".join(differ))


def sweep(plan: Plan | str | os.PathLike[str] | Mapping[str, Plan | str | os.PathLike[str]],
          rates: Sequence[float] = (), batch_sizes: Sequence[int] = (), spec: SweepSpec = SweepSpec(), *,
          machine: MachineSpec = MachineSpec(), store: PerfModelStore | None = None,
          runtime: SweptRuntime | None = None,
          inputs: Mapping[str, np.ndarray] | str | os.PathLike[str] | None = None, front_end: FrontEnd | None = None,
          progress: Progress | None = None) -> list[dict[str, Any]]:
    """Measure every (batch size, rate) point on one runtime; return the rows (see the module doc).

    One body for one model and several: a plan is a set of one model, whose points are its
    (batch size, rate) pairs; several (``plan`` a mapping name -> plan, with ``spec.points`` and
    ``spec.targets``, and the machine's ``residency`` and ``lanes``:
    :func:`~staronnx.bench.mix.sweep_mix`) share the runtime, one generator and server per model.

    ``spec`` (:class:`~staronnx.bench.spec.SweepSpec`) says how: each point's traffic
    (``spec.run``: ``duration`` seconds of arrivals, stretched to ``min_batches`` batch fills,
    of which ``warmup``, default ``min(1, duration / 5)``, is left out; ``max_delay``: batches
    of *at most* ``b`` leave once their oldest request waited this long; ``colocate``: the load
    generator and the batcher run on the runtime's host core,
    :meth:`~staronnx.runtime.runtime.Runtime.colocate`), whether an unstable, uncongested point
    is measured once more, twice as long (``extend``), and what is computed beside it:
    ``bound`` and ``simulate`` need calibrated perf models (``store``, default
    ``$STARONNX_HOME``); ``simulate`` replays every measured point in the simulator,
    prediction and error beside the measurement (:mod:`staronnx.bench.fidelity`), and again
    with its tasks ``sim_band`` faster and slower (:func:`~staronnx.bench.fidelity.band_columns`:
    which points a drift of the machine's speed that small tips; 0: no band).

    ``machine``: the runtime's workers, and its simulated twin's and the bound's alike.
    ``runtime``: an open one to use instead (it stays open; its own ``trace=``). ``inputs``:
    real inputs, an ``.npz`` path (recorded) or its arrays. ``front_end``: over the network,
    each point's batching front end and what ``settings.front_end`` records of it
    (:func:`~staronnx.bench.remote.remote_sweep`).
    """
    run_spec, points, bound, simulate, sim_band = spec.run, spec.points, spec.bound, spec.simulate, spec.sim_band
    inputs_path = inputs if isinstance(inputs, (str, os.PathLike)) else None
    loaded, one = load_plans(plan)
    models = ModelSet(loaded, spec.targets)  # checks the targets' names
    names, first = list(loaded), models.models[0].plan
    residency, lanes = dict(machine.residency), dict(machine.lanes)
    if one:  # a set of one model: its points are its (batch size, rate) pairs
        points = mix_points({names[0]: sorted({float(r) for r in rates})}, sorted({int(b) for b in batch_sizes}),
                            names)
    _check_mixes(names, points)
    points, notes = batch_one_where_needed(loaded, points)
    warmup = _check_run(run_spec)
    if not 0.0 <= sim_band < 1.0:
        raise SweepError(f"sim_band is a share of the tasks' time in [0, 1) (0.05: 5 % faster and slower), "
                         f"got {sim_band!r}")
    if isinstance(inputs, (str, os.PathLike)):
        inputs_path, inputs = inputs, load_inputs(inputs, first)
    elif inputs is not None:
        first.check_feeds(inputs)
    notify = progress or (lambda event: None)
    total = len(points)
    rates_of = {n: sorted({p.rates[n] for p in points}) for n in names}
    sizes_of = {n: sorted({p.batch_sizes[n] for p in points}) for n in names}
    settings: dict[str, Any] = {
        "plan": str(first.root) if one else None, "plan_hash": first.hash if one else None, "policy": spec.policy,
        "groups": machine.groups, "cuda_streams": machine.cuda_streams, "cuda_devices": list(machine.cuda_devices),
        "distribution": run_spec.distribution, "duration_s": float(run_spec.duration), "warmup_s": warmup,
        "rates": rates_of[names[0]] if one else rates_of, "batch_sizes": sizes_of[names[0]] if one else sizes_of,
        "seed": run_spec.seed, "queue_capacity": run_spec.queue_capacity, "min_batches": run_spec.min_batches,
        "engine": spec.engine, "label": spec.label or (Path(spec.out_dir).name if spec.out_dir is not None else None),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "simulate": simulate, "max_delay_s": run_spec.max_delay,
        "sim_band": sim_band if simulate else None,
        "front_end": dict(front_end.settings) if front_end is not None else {"kind": "in-process"},
        "colocate": run_spec.colocate,
    }
    if not one:
        settings.update(mixed=True, residency=residency, lanes=lanes, mixes=[
            {"rates": p.rates, "batch_sizes": p.batch_sizes} for p in points], models={
            m.name: {"plan": str(m.plan.root), "plan_hash": m.plan.hash, "priority": m.target.priority,
                     "latency_target_ms": None if m.target.latency is None else m.target.latency * 1e3}
            for m in models.models})
    if inputs is not None:
        settings["inputs"] = {"path": None if inputs_path is None else str(inputs_path),
                              "samples": input_samples(inputs, first)}
    if machine.cuda_streams and front_end is None:  # which GPUs these figures come from (over the network: unknown)
        settings["gpus"] = gpus_of(machine.cuda_devices)
    results = _Results(spec.out_dir, settings, fidelity=simulate, notes=notes)
    # one simulated twin of the runtime serves the LP bound, the simulated points and the
    # in-flight window (a slow worker is only chosen behind a long enough queue: the same
    # window the simulator uses, so live and simulated points agree)
    twin: SimMachine | None = None
    if bound or simulate:
        try:
            twin = build_machine(models, machine, store=store)
            results.notes.extend(twin.notes)
        except ResidencyError:
            raise  # a lane the runtime would refuse too: refused now, in its words, before it starts
        except StaronnxError as exc:
            missing = " and ".join(m for m, on in (("no LP bound", bound), ("no simulation", simulate)) if on)
            results.notes.append(f"{missing}: {exc}")
    # a model's holders, as the runtime will choose them (a selector matching no worker is
    # refused here, before the runtime starts, with the runtime's own message)
    where = None if twin is None else residency_where(twin, residency)
    windows = {(m.name, b): None if twin is None else machine_inflight(twin, b, m.index, where)
               for m in models.models for b in sizes_of[m.name]}
    if twin is not None and inputs is not None:
        other = _unprofiled_shapes(first, inputs)
        results.notes += [other] if other else []
    if twin is not None and bound and one:
        results.bounds, bound_notes = batch_bounds(twin, sizes_of[names[0]])
        results.notes.extend(bound_notes)
    own = runtime is None
    if runtime is None:
        warm = sorted({s for n in names for b in sizes_of[n] for s in warmup_sizes(b, run_spec.max_delay)}) \
            if machine.cuda_streams else ()
        runtime = Runtime(first if one else loaded, machine,
                          RuntimeSpec(spec.policy, store=store, engine=spec.engine, trace=spec.trace,
                                      targets=spec.targets or {}, warmup=warm))
    # what the live Server pads a partial batch up to (the runtime's captured sizes): the
    # simulated twin of each point must pad the same way
    padding = tuple(sorted({int(m) for m in runtime.preferred_batch_sizes}))
    settings["pad_to"] = list(padding)
    run = _Run(runtime, models, one, notify, total, results, windows, extend=spec.extend,
               run=replace(run_spec, warmup=warmup),
               server_factory=None if front_end is None else front_end.server_factory)
    try:
        settings["workers"] = [w.name for w in runtime.workers]
        # the thread that launches each CUDA worker's tasks: the GPU's one driver, or its own
        # (--cuda-thread-per-stream), read off the runtime that measured
        settings["drivers"] = driver_threads(runtime.stats())
        for n in ([] if one else names):  # where each model lives (every worker unless residency or lanes say otherwise)
            settings["models"][n]["held_by"] = list(_hosted(runtime, n).stats().get("held_by", settings["workers"]))
        notify(SweepEvent("start", 0, total))
        results.save()
        tasks_before, watch = tasks_snapshot(runtime), LoadWatch()
        for m in models.models:
            for b in sizes_of[m.name]:
                failed = warm_up(run.handles[m.name], m.plan, [b], seed=run_spec.seed, inputs=inputs)
                if failed:  # its points fail the same way and say so: measured, not a traceback
                    results.notes.append(f"{'' if one else m.name + ': '}warm-up failed at {failed}")
                notify(SweepEvent("warmup", 0, total, batch_size=b))
        check = calibration_check(task_time_ratio(tasks_before, tasks_snapshot(runtime)), watch.stop())
        settings["calibration_check"] = check.pop("settings")
        results.notes.extend(check["notes"])
        run.pools = {m.name: sample_pool(m.plan, seed=run_spec.seed, inputs=inputs) for m in models.models}
        sim_twin = twin if simulate else None  # what replays each measured point
        tracer, sim_tracer = point_tracers(runtime, simulated=sim_twin is not None, settings=settings)
        skipped: set[int] = set()
        struck: set[tuple[tuple[str, int], ...]] = set()  # batch sizes whose last point congested on a busy machine
        for i, point in enumerate(points):
            if i in skipped:
                continue
            label_ = run.label(point)
            mix = None
            if bound and twin is not None and not one:
                try:
                    mix = mix_bound(twin, point.rates, point.batch_sizes, residency)
                    results.bounds[f"{point.label} b {mix_label(point.batch_sizes)}"] = mix.as_dict()
                except StaronnxError as exc:
                    results.notes.append(f"no LP bound for {point.label}: {exc}")
            bounds = ({n: results.bounds.get(point.batch_sizes[n], {}).get("throughput") for n in names} if one
                      else {n: None if mix is None else mix.throughput[n] for n in names})
            rows, began = run.measure(point, tracer, bounds=bounds, length=max(
                point_duration(run_spec.duration, warmup, point.batch_sizes[n], point.rates[n], run_spec.min_batches)
                for n in names))
            for m, row in zip(models.models, rows):
                flag_slowed(row, reference_ratio(results.rows, None if one else m.name, point.batch_sizes[m.name],
                                                 settings["calibration_check"].get("task_time_ratio")))
                if not one:
                    row.update(_mix_columns(m, run.records[m.name], run.index, point, mix))
            if sim_twin is not None and all(r["state"] == "failed" for r in rows):
                results.notes.append(f"{label_} not simulated: its requests failed")
            elif sim_twin is not None:
                length = float(rows[0]["duration_s"])
                target = simulated_point(sim_tracer, label_, began, length)
                try:
                    def replay(slowdown: float = 1.0, into: TraceInto | None = None) -> MixResult:
                        largest = max(point.batch_sizes.values())
                        return simulate_mix(sim_twin, point.rates, point.batch_sizes, SimSpec(
                            policy=spec.policy, targets=spec.targets, duration=length, seed=run_spec.seed,
                            distribution=run_spec.distribution, slowdown=slowdown,
                            queue_capacity=max(run_spec.queue_capacity, largest), max_delay=run_spec.max_delay,
                            residency=residency, pad_to=[m for m in padding if m <= largest] if one else ()),
                            trace=into)

                    sim = replay(into=target)
                    # the same point on a machine sim_band faster and slower: what its drift would do
                    band = (replay(1.0 - sim_band), replay(1.0 + sim_band)) if sim_band > 0 else None
                    for m, row in zip(models.models, rows):
                        nominal = sim_columns(sim.metrics(m.name, warmup=warmup), row, deadlines=not one,
                                              task_time_ratio=sim.task_time_ratio)
                        if band is not None:
                            fast, slow = band
                            nominal.update(band_columns(fast.metrics(m.name, warmup=warmup),
                                                        slow.metrics(m.name, warmup=warmup), nominal, row, sim_band))
                        row.update(clean(nominal))
                except StaronnxError as exc:
                    results.notes.append(f"{label_} not simulated: {exc}")
                if sim_tracer is not None:
                    sim_tracer.save()  # after every point, as results.json: a stopped sweep keeps its points
            run.done(point, rows)
            served_none = all(r["state"] == "failed" and not r["completed"] for r in rows)
            # a congested point measured on a busy or slowed machine stops the sweep only when
            # the point before it congested too: one stall must not end a batch size's sweep
            congested = any(r["congested"] for r in rows)
            key = tuple(sorted(point.batch_sizes.items()))
            stops = congested and (not any(r.get("machine_busy") for r in rows) or key in struck)
            struck.discard(key)
            if congested and not stops:
                struck.add(key)
            if served_none or (spec.stop_on_congestion and stops):
                # every request failed: higher rates would fail alike (and take as long)
                rest = [j for j in range(i + 1, total) if j not in skipped and points[j].dominates(point)]
                skipped.update(rest)
                run.skip(point, [points[j] for j in rest], served_none)
        busy = busy_note(results.rows)
        if busy:
            results.notes.append(busy)
        if one:
            stale = stale_models_note(
                first, [(r["batch_size"], r["throughput"], r["bound_throughput"]) for r in results.rows], machine)
            results.notes += [stale] if stale else []
        settings["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        results.save()
        notify(SweepEvent("end", run.index, total))
    except BaseException as exc:
        if isinstance(exc, Exception):
            raise
        # Ctrl-C, SIGTERM: the finished points are on disk already; record that the sweep
        # stopped early, so nobody mistakes a partial sweep for a whole one
        settings["interrupted"] = {"signal": signal_name(exc), "points_measured": len(results.rows) // len(names),
                                   "points_planned": total}
        results.save()
        notify(SweepEvent("interrupted", run.index, total, message=signal_name(exc)))
        raise
    finally:
        if own:
            runtime.close()
    return results.rows


def _mix_columns(m: HostedModel, records: RunRecords, index: int, point: MixPoint,
                 mix: MixBound | None) -> dict[str, Any]:
    """The columns a model's row of a mixed sweep adds: which model and mix, its deadline
    misses, and the mix's LP bound."""
    latency = m.target.latency
    misses, rate = deadline_misses(records, latency)
    return clean_dict({
        "model": m.name, "mix": point.label, "point": index,
        "latency_target_ms": None if latency is None else latency * 1e3,
        "deadline_misses": misses, "deadline_miss_rate": rate,
        "bound_scale": None if mix is None else mix.scale,
        "bound_feasible": None if mix is None else mix.feasible,
        "solo_bound_throughput": None if mix is None else mix.solo[m.name],
    })


class _Run:
    """What measuring a sweep's points shares: handles, samples, windows, results, progress."""

    def __init__(self, runtime: SweptRuntime, models: ModelSet, one: bool, notify: Progress, total: int,
                 results: _Results, windows: Mapping[tuple[str, int], int | None], *, extend: bool,
                 run: RunSpec, server_factory: Callable[..., Any] | None) -> None:
        self.runtime, self.models, self.one, self.notify, self.total = runtime, models, one, notify, total
        self.results, self.windows, self.extend, self.run = results, windows, extend, run
        self.server_factory = server_factory
        # one model: the runtime itself is its handle (a runtime passed in may serve no other)
        self.handles = {models.models[0].name: runtime} if one else {
            m.name: _hosted(runtime, m.name) for m in models.models}
        self.pools: dict[str, list[dict[str, np.ndarray]]] = {}
        self.records: dict[str, RunRecords] = {}  # each model's at the last point
        self.index = 0

    def single(self, point: MixPoint) -> tuple[int | None, float | None]:
        """One model's point as its (batch size, rate), what its events carry; None for a mix."""
        if not self.one:
            return None, None
        (b,), (rate,) = point.batch_sizes.values(), point.rates.values()
        return b, rate

    def label(self, point: MixPoint) -> str:
        """``b=4 @ 100 req/s`` for one model, the mix (``a=100,b=400``) for several."""
        b, rate = self.single(point)
        return point.label if rate is None else f"b={b} @ {rate:g} req/s"

    def measure(self, point: MixPoint, tracer: Any, *, length: float,
                bounds: Mapping[str, float | None]) -> tuple[list[dict[str, Any]], float]:
        """Measure one point (once more, twice as long, when unstable and ``extend``): a row per
        model, and when the measured attempt's arrivals began (the runtime's clock)."""
        attempt, extended = 1, False
        names = list(self.handles)
        b, rate = self.single(point)
        while True:
            expected = math.ceil(length * sum(point.rates.values()))
            self.notify(SweepEvent("point", self.index, self.total, b, rate, requests=expected, attempt=attempt,
                                   message="" if self.one else point.label))
            step = max(1, expected // 100)

            def on_submit(i: int, n: int, _attempt: int = attempt) -> None:
                if (i + 1) % step == 0 or i + 1 == n:
                    self.notify(SweepEvent("requests", self.index, self.total, b, rate, requests=n, submitted=i + 1,
                                           attempt=_attempt))

            before, tasks_before = workers_snapshot(self.runtime), tasks_snapshot(self.runtime)
            watch = LoadWatch()
            began = time.perf_counter()
            with TaskSampler(self.runtime) as sampler:  # the tasks' speed per window (flag_slowed)
                measured = self._measure_models(point, length, on_submit)
            load = watch.stop()
            after, tasks_after = workers_snapshot(self.runtime), tasks_snapshot(self.runtime)
            first = measured[names[0]][0]
            if tracer is not None:
                tracer.span(POINTS_LANE, self.label(point) + (" (again)" if attempt > 1 else ""), began,
                            time.perf_counter(), "sweep point",
                            {"state": first["state"], "congested": bool(first["congested"]),
                             "stable": bool(first["stable"])} if self.one else None)
            if self.extend and attempt == 1 and any(s["state"] == "unstable" for s, _ in measured.values()):
                attempt, extended, length = 2, True, 2 * length
                continue
            break
        rows = []
        machine_columns = load_columns(load, task_time_ratio(tasks_before, tasks_after))
        for n in names:
            summary, records = measured[n]
            self.records[n] = records
            row = make_row(summary, self.results.settings, duration=length, extended=extended, bound=bounds[n])
            row.update(label=self.results.settings["label"], attempts=attempt,
                       workers=clean(workers_delta(before, after, records.end - records.start)),
                       windows=clean(summary.get("windows")), loadgen=clean(records.settings.get("loadgen")),
                       placement=clean(summary.get("placement")), **machine_columns,
                       task_time_ratio_windows=clean([sampler.ratio(w["start"], w["end"])
                                                      for w in summary.get("windows") or ()]))
            rows.append(row)
        return rows, min(records.start for _, records in measured.values())

    def _measure_models(self, point: MixPoint, length: float, on_submit: Callable[[int, int], None]
                        ) -> dict[str, tuple[dict[str, Any], Any]]:
        """Every model's open loop at its rate, for ``length`` seconds: model ``i`` seeded
        ``seed + i`` (as :func:`~staronnx.bench.simulator.simulate_mix` draws them), each in a
        thread of its own; one model's in this thread, which a signal stops."""
        out: dict[str, tuple[dict[str, Any], Any]] = {}
        errors: list[BaseException] = []

        def measure(i: int, n: str) -> None:
            try:
                b = point.batch_sizes[n]
                out[n] = measure_point(
                    self.handles[n], b, point.rates[n], self.pools[n],
                    replace(self.run, duration=length, seed=self.run.seed + i),
                    on_submit=on_submit if self.one else None, max_inflight=self.windows.get((n, b)),
                    server_factory=self.server_factory)
            except BaseException as exc:  # noqa: BLE001 - raised again in the sweep's thread
                errors.append(exc)

        if self.one:
            measure(0, next(iter(self.handles)))
        else:
            threads = [threading.Thread(target=measure, args=(i, n), name=f"staronnx-mix-{n}", daemon=True)
                       for i, n in enumerate(self.handles)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        return out

    def done(self, point: MixPoint, rows: list[dict[str, Any]]) -> None:
        """Keep a measured point's rows and say so."""
        self.results.rows.extend(rows)
        self.index += 1
        self.results.save()
        self.notify(SweepEvent("done", self.index, self.total, *self.single(point),
                               row=rows[0] if self.one else {"mix": point.label, "rows": rows},
                               attempt=rows[0]["attempts"]))

    def skip(self, stopped: MixPoint, rest: list[MixPoint], served_none: bool) -> None:
        """Leave out the points that exceed ``stopped`` in every rate (its batch size's higher
        rates, for one model): they would congest, or fail, alike."""
        if not rest:
            return
        b, rate = self.single(stopped)
        if rate is not None:
            why = f"every request failed at {rate:g} req/s" if served_none else f"congested at {rate:g} req/s"
            rates = [r for p in rest for r in p.rates.values()]
            self.results.skipped.extend({"batch_size": b, "offered_rate": r, "reason": why} for r in rates)
            self.index += len(rest)
            self.results.save()
            self.notify(SweepEvent("skipped", self.index, self.total, b, rate, skipped=rates, message=why))
            return
        for p in rest:
            self.results.skipped.append({"mix": p.label, "batch_sizes": p.batch_sizes,
                                         "reason": "a mix it exceeds in every rate was congested"})
            self.index += 1
            self.results.save()
            self.notify(SweepEvent("skipped", self.index, self.total, skipped=[], message=p.label))


#: tasks' measured time over their perf models' beyond which the calibration check speaks
#: (either way: 1.25 or 1 / 1.25)
DRIFT = 1.25
#: a point whose tasks ran this much slower than the points before it (same model and batch
#: size; the first: the warm-up) is flagged busy: the machine slowed under it (the calibration
#: check's :data:`DRIFT`). A VM's host can take the CPU without the guest's /proc/stat counting
#: steal: on the development VM, googlenet's tasks ran x1.71 their models for one point against
#: x0.99-1.05 at the seven before it, and points whose tasks ran 1.25-1.3x slower than their
#: neighbours lost 10-20 % of their capacity for seconds (a queue at 75 % of the bound). Points
#: offered above their LP bound are not held to it (:func:`flag_slowed`)
SLOWED = DRIFT


def reference_ratio(rows: Sequence[Mapping[str, Any]], model: str | None, batch_size: int,
                    warmup: float | None) -> float | None:
    """The tasks' speed a point is held to (:func:`flag_slowed`): the median
    ``task_time_ratio`` of the earlier points of the same model and batch size that were not
    busy, else the warm-up's (``warmup``, the calibration check's)."""
    import statistics

    earlier = [r["task_time_ratio"] for r in rows if r.get("batch_size") == batch_size and r.get("model") == model
               and not r.get("machine_busy") and isinstance(r.get("task_time_ratio"), (int, float))]
    return statistics.median(earlier) if earlier else warmup


def flag_slowed(row: dict[str, Any], reference: float | None) -> None:
    """Flag ``row`` busy (``machine_slowed``: how much slower) when its tasks ran
    :data:`SLOWED` times slower than ``reference``, over the point or in one of its measurement
    windows (``task_time_ratio_windows``: a slowdown of one window leaves a backlog that sets
    the latency of the windows after it): work the guest cannot see took the CPUs. A congested
    point only when it was offered under its LP bound: past the capacity the host's threads and
    a growing queue slow short tasks anyway (tens of microseconds each, behind the GIL), and
    congestion is what the point is expected to show."""
    row.setdefault("machine_slowed", None)
    ratio = row.get("task_time_ratio")
    if not isinstance(ratio, (int, float)) or not reference or reference <= 0:
        return
    windows = [x for x in row.get("task_time_ratio_windows") or () if isinstance(x, (int, float))]
    worst = max([ratio, *windows])
    if worst < SLOWED * reference:
        return
    bound = row.get("bound_throughput")
    under = isinstance(bound, (int, float)) and bound > 0 and float(row["offered_rate"]) <= bound
    if row.get("congested") and not under:
        return
    row["machine_slowed"] = worst / reference
    if worst > ratio:  # a window's reading flagged it
        ran = (f"in one of its {len(windows)} windows its tasks ran x{worst:.2f} their perf models "
               f"(x{ratio:.2f} over the point)")
    else:
        ran = f"its tasks ran x{ratio:.2f} their perf models"
    why = (f"{ran} against x{reference:.2f} at the points before it: the machine ran slower"
           f"{' for a while' if worst > ratio else ''} (the hypervisor or work /proc does not show)")
    row["busy_why"] = f"{row['busy_why']}; {why}" if row.get("machine_busy") and row.get("busy_why") else why
    row["machine_busy"] = True


def calibration_check(ratio: float | None, load: MachineLoad | None) -> dict[str, Any]:
    """The sweep's check of its perf models: the warm-up's tasks (every batch size, every
    worker) timed by the engine against what the models predicted. Returns ``settings`` (what
    ``settings.calibration_check`` keeps) and ``notes``, a line where they disagree by more than
    :data:`DRIFT` or the warm-up ran beside other work."""
    out: dict[str, Any] = {"settings": clean({"task_time_ratio": ratio,
                                               "machine": None if load is None else load.as_dict()}), "notes": []}
    if ratio is not None and not (1 / DRIFT <= ratio <= DRIFT):
        how = "slower" if ratio > 1 else "faster"
        why = ("others use the cores now (see the next note)" if load is not None and load.busy
               else "the models were calibrated on a " + ("quieter" if ratio > 1 else "busier") + " machine")
        out["notes"].append(f"calibration check: the warm-up's tasks ran x{ratio:.2f} their perf models' times "
                            f"({how}): {why}; the bound and the simulation are off by as much (recalibrate on a "
                            "quiet machine: staronnx calibrate --replace)")
    if load is not None and load.busy:
        out["notes"].append(f"calibration check: the runs before the first point were {load.why}")
    return out


def others_share(row: Mapping[str, Any]) -> float:
    """The CPU share others and the hypervisor took while a row's point was measured."""
    return (row.get("others_cpu_share") or 0.0) + (row.get("steal_share") or 0.0)


def busy_note(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """One line when some points were measured beside other work (``machine_busy``)."""
    busy = [r for r in rows if r.get("machine_busy")]
    if not busy:
        return None
    worst = max(busy, key=others_share)
    slowed = [r for r in busy if r.get("machine_slowed")]
    also = (f"; {len(slowed)} of them because their tasks ran {SLOWED:g}x or more slower than at the points before "
            "(the machine slowed, unseen in /proc)") if slowed else ""
    return (f"{len(busy)} of {len(rows)} point(s) measured beside other work (machine_busy: other processes or the "
            f"hypervisor took over {BUSY_SHARE:.0%} of the CPUs, up to {others_share(worst):.1%} at "
            f"b={worst['batch_size']} @ "
            f"{worst['offered_rate']:g} req/s{also}): their figures are the machine's as much as the plan's, and the "
            "simulator's error summary leaves them out")


def load_columns(load: MachineLoad | None, ratio: float | None) -> dict[str, Any]:
    """What a row records of the machine while its point was measured
    (:mod:`staronnx.bench.cpuload`; ``machine_busy``: others or the hypervisor took more than
    :data:`~staronnx.bench.cpuload.BUSY_SHARE` of the CPUs) and ``task_time_ratio``, tasks'
    measured time over their perf models'; None where ``/proc/stat`` could not be read."""
    figures = (None,) * 4 if load is None else (load.busy, load.others_share, load.steal_share, load.own_cores)
    return clean_dict({**dict(zip(("machine_busy", "others_cpu_share", "steal_share", "own_cpu_cores"), figures)),
                       "task_time_ratio": ratio, "busy_why": None if load is None else load.why,
                       "machine": None if load is None else load.as_dict()})


def gpus_of(devices: Sequence[int]) -> list[dict[str, Any]]:
    """The GPUs a sweep runs on as results record them (model, memory, compute capability; a
    stand-in says it is one), read in CUDA's thread-local capture mode so that a runtime
    already capturing graphs in this process is not disturbed."""
    from staronnx.ortutil import cuda_capture_safe
    from staronnx.workers.cuda_env import describe_gpus

    with cuda_capture_safe():
        return describe_gpus(devices)


def simulated_trace_path(trace: str | os.PathLike[str]) -> Path:
    """Where a sweep with ``--simulate`` writes its simulated schedule beside the live trace at
    ``trace``: ``sweep.json`` -> ``sweep.sim.json``."""
    path = Path(trace)
    return path.with_name(f"{path.stem}.sim{path.suffix or '.json'}")


def point_tracers(runtime: SweptRuntime, *, simulated: bool, settings: dict[str, Any]) -> tuple[Any, Any]:
    """The live trace of a sweep (the runtime's) and, for a ``simulated`` sweep, one for its
    simulated points on the same clock and lanes, so the two line up side by side; None where
    there is no live trace."""
    tracer = runtime.tracer
    if tracer is None:
        return None, None
    tracer.lane(POINTS_LANE, "sweep points")
    if not simulated:
        return tracer, None
    sim = Tracer(simulated_trace_path(tracer.path), origin=tracer.origin)
    for i, worker in enumerate(runtime.workers):
        sim.lane(i, worker.name)
    sim.lane(POINTS_LANE, "sweep points (simulated)")
    settings["simulated_trace"] = str(sim.path)
    return tracer, sim


def simulated_point(sim_tracer: Any, label: str, began: float, length: float) -> TraceInto | None:
    """Where a simulated point draws its schedule: into ``sim_tracer`` from when its live point
    ``began``, marked on its lane; None without a simulated trace."""
    if sim_tracer is None:
        return None
    sim_tracer.span(POINTS_LANE, f"{label} (simulated)", began, began + length, "sweep point")
    return TraceInto(sim_tracer, began)


# ---------------------------------------------------------------------------- --rates auto
#: how many rates an automatic range has, and how far above the capacity it reaches
AUTO_RATES = 10
AUTO_TOP = 1.1


@dataclass
class AutoRates:
    """Rates derived from what the runtime can serve: ``capacity`` samples/s, from ``source``."""

    rates: list[float]
    capacity: float
    source: str  # "bound" (LP bound over calibrated perf models) or "probe" (closed loop, measured)
    detail: str

    def describe(self) -> str:
        step = self.rates[1] - self.rates[0] if len(self.rates) > 1 else self.rates[0]
        return (f"rates auto: {self.rates[0]:g}:{self.rates[-1]:g}:{step:g} req/s "
                f"({len(self.rates)} rates, up to {AUTO_TOP:.0%} of {self.detail})")


def _nice(x: float) -> float:
    """``x`` rounded to the nearest (on a log scale) of 1, 2, 2.5 or 5 times a power of ten."""
    if not (math.isfinite(x) and x > 0):
        return 1.0
    power: float = 10 ** math.floor(math.log10(x))  # an int from 1 up, as the rates have always been
    return min((m * power for m in (1, 2, 2.5, 5, 10)), key=lambda v: abs(math.log(v / x)))


def rates_for(capacity: float, count: int = AUTO_RATES, top: float = AUTO_TOP) -> list[float]:
    """``count`` evenly spaced rates (requests/s, one sample each) with a round step, from about
    ``capacity / count`` up to about ``top * capacity``: most points below what the runtime
    serves, the last ones past it, where a batch size congests."""
    step = _nice(top * capacity / count)
    n = max(2, math.floor(top * capacity / step + 1e-9))
    return [round(step * i, 9) for i in range(1, n + 1)]


def auto_rates(plan: Plan, batch_sizes: Sequence[int], machine: MachineSpec = MachineSpec(), *, seed: int = 0,
               store: PerfModelStore | None = None, probe_seconds: float | None = 1.0, policy: str = "heft",
               engine: str = "native") -> AutoRates | None:
    """The rates a sweep of ``plan`` should offer on this machine, so that its plots show each
    batch size's curve up to where it congests instead of one congested point per batch size.

    From the LP bound over the calibrated perf models (the largest over ``batch_sizes``), else
    from ``probe_seconds`` of a closed loop on the runtime itself (:func:`_probe`); None where
    there is no bound and no probe (a served runtime cannot be probed from here).
    """
    sizes, _ = runnable_sizes(plan, batch_sizes)  # a model of one request per task: batch 1
    try:
        bounds, _ = batch_bounds(build_machine(plan, machine, store=store, cpu_fallback=False), sizes)
    except StaronnxError:
        bounds = {}
    throughputs: dict[int, float] = {b: v["throughput"] for b, v in bounds.items()
                                     if math.isfinite(v["throughput"]) and v["throughput"] > 0}
    if throughputs:
        b = max(throughputs, key=lambda size: throughputs[size])
        capacity = throughputs[b]
        return AutoRates(rates_for(capacity), capacity, "bound",
                         f"the LP bound over the calibrated perf models, {capacity:,.0f} samples/s at b={b}")
    if probe_seconds is None:
        return None
    b = sizes[-1]
    capacity = _probe(plan, b, machine, policy=policy, engine=engine, seconds=probe_seconds, seed=seed)
    return AutoRates(rates_for(capacity), capacity, "probe",
                     f"a {probe_seconds:g} s closed-loop probe, {capacity:,.0f} samples/s at b={b}; "
                     f"no calibrated perf models for the LP bound")


def _probe(plan: Plan, batch: int, machine: MachineSpec, *, policy: str, engine: str, seconds: float,
           seed: int) -> float:
    """Samples/s the runtime serves with batches of ``batch`` back to back, two per worker in
    flight (closed loop): the most it serves."""
    feeds = random_plan_feeds(plan, batch, seed=seed)
    with Runtime(plan, machine, RuntimeSpec(policy, engine=engine)) as rt:
        rt.run(feeds)  # warm-up
        depth = max(2, 2 * len(rt.stats()["workers"]))
        inflight = [rt.submit(feeds) for _ in range(depth)]
        done = 0
        start = time.perf_counter()
        while True:
            inflight.pop(0).result()
            done += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds and done >= depth:
                break
            inflight.append(rt.submit(feeds))
        for fut in inflight:
            fut.result()
    return done * batch / elapsed
