"""Mixed traffic: several models served by one shared runtime, each at its own rate.

``staronnx sweep a/ b/ --rates a=100:400:100,b=50`` and ``staronnx simulate a/ b/ --rates
a=100,b=400`` read a rate (or a range) per model. A *mix* is one point: a rate and a batch
size per model. The points of a mixed sweep are every combination of the models' rates (and
batch sizes), measured on one runtime hosting every model (one set of workers, one policy,
the models' service targets), a :class:`~staronnx.serving.Server` per model fed by its own
open-loop generator, as ``staronnx serve`` serves them. Each point gives one row per model
(the single-model sweep's columns, plus ``model``, ``mix``, the latency target and deadline
misses), and the LP bound over the mix (:func:`~staronnx.bench.bound.mix_bound`): whether the
rates together fit the machine and by what factor they could all grow.

Residency (``--model-workers``) and latency lanes (``--lane``) shape the live runtime, its
bound and its simulation alike; a lane is simulated and bounded as one more worker on its
group's cores, without the OS preemption of the group's worker that it brings live
(:data:`~staronnx.bench.machine.LANE_APPROXIMATION`, in each result's notes).

Why every combination and not a scale factor on one mix: the question a shared machine asks
is how one model's load hurts another's latency (the heavy model pushed to saturation while
the light one stays at a modest rate): a range for one and one rate for the other says it.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from staronnx.errors import StaronnxError
from staronnx.plan import Plan

__all__ = ["MixPoint", "is_per_model", "mix_label", "mix_points", "model_names", "split_per_model"]


def is_per_model(text: str | None) -> bool:
    """Whether an option's text names models (``a=100,b=400``) rather than being one value."""
    return text is not None and "=" in text


def split_per_model(text: str, option: str) -> dict[str, str]:
    """``"a=100:400:100,b=400"`` -> ``{"a": "100:400:100", "b": "400"}``.

    Items are separated by commas; an item without ``=`` continues the model before it, so
    ``a=100,200,b=50`` gives ``a`` two rates: a model's text reads exactly as the
    single-model option does.
    """
    out: dict[str, list[str]] = {}
    current: str | None = None
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        if sep:
            current = name.strip()
            if not current:
                raise StaronnxError(f"{option}: a model name is missing before '=' in {text!r}")
            if current in out:
                raise StaronnxError(f"{option}: model {current!r} is named twice in {text!r}")
            out[current] = [value.strip()] if value.strip() else []
        elif current is None:
            raise StaronnxError(f"{option}: {text!r} mixes a plain value with model=value items; "
                                f"name every model (a=100,b=400)")
        else:
            out[current].append(item)
    for name, values in out.items():
        if not values:
            raise StaronnxError(f"{option}: no value for model {name!r} in {text!r}")
    return {name: ",".join(values) for name, values in out.items()}


def model_names(plans: Sequence[Path], names: Sequence[str] | None) -> list[str]:
    """Each plan's model name: ``--name`` in order, else the plan folder's name; unique
    (``staronnx serve``'s rule, so a sweep's models are named as the server names them)."""
    if names and len(names) != len(plans):
        raise StaronnxError(f"--name given {len(names)} time(s) for {len(plans)} plan(s): give one per plan, in order")
    out = list(names) if names else [Path(p).resolve().name for p in plans]
    for n in out:
        if not n or "/" in n or "=" in n or "," in n:
            raise StaronnxError(f"model name {n!r} cannot be used (no '/', '=' or ','); choose another with --name")
    dupes = sorted({n for n in out if out.count(n) > 1})
    if dupes:
        raise StaronnxError(f"two plans would be named {dupes[0]!r}; tell them apart with --name")
    return out


def check_names(given: Mapping[str, Any], names: Sequence[str], option: str, *, every: bool = True) -> None:
    """Refuse unknown model names in ``option`` and, with ``every``, missing ones."""
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise StaronnxError(f"{option} names model(s) {', '.join(map(repr, unknown))}, which are not given; "
                            f"the models are {', '.join(map(repr, names))}")
    missing = [n for n in names if n not in given]
    if every and missing:
        raise StaronnxError(f"{option} gives no value for model(s) {', '.join(map(repr, missing))}; "
                            f"name every model, e.g. {','.join(f'{n}=...' for n in names)}")


class MixPoint:
    """One point of mixed traffic: a rate (single-sample requests/s) and a batch size per model."""

    __slots__ = ("rates", "batch_sizes")

    def __init__(self, rates: Mapping[str, float], batch_sizes: Mapping[str, int]) -> None:
        self.rates = {n: float(r) for n, r in rates.items()}
        self.batch_sizes = {n: int(b) for n, b in batch_sizes.items()}

    @property
    def label(self) -> str:
        return mix_label(self.rates)

    def dominates(self, other: MixPoint) -> bool:
        """Same batch sizes and every rate at least ``other``'s: congested wherever it is."""
        return (self.batch_sizes == other.batch_sizes
                and all(self.rates[n] >= other.rates[n] for n in self.rates))

    def __repr__(self) -> str:
        return f"MixPoint({self.label}, b {self.batch_sizes})"


def mix_label(rates: Mapping[str, float]) -> str:
    """``"a=100,b=400"``: a mix as the command line writes it."""
    return ",".join(f"{n}={r:g}" for n, r in rates.items())


def _batch_one_where_needed(plans: Mapping[str, Plan], points: Sequence[MixPoint]) -> tuple[list[MixPoint], list[str]]:
    """``points`` with batch 1 for every model that runs one request per task (its other sizes
    mean nothing: :func:`~staronnx.bench.points.runnable_sizes`), points that became equal
    measured once; and a line per such model saying so."""
    from staronnx.bench.points import runnable_sizes

    notes = []
    for name, plan in plans.items():
        _, note = runnable_sizes(plan, [p.batch_sizes[name] for p in points if name in p.batch_sizes])
        if note:
            notes.append(f"{name}: {note}")
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


# ---------------------------------------------------------------------------- the live sweep
def _sim_columns(result: Any, name: str, row: Mapping[str, Any], warmup: float) -> dict[str, Any]:
    """The ``sim_*``/``err_*`` fields of one model's row, from a mixed simulation of its point."""
    from staronnx.bench.fidelity import COMPARED, relative_error

    m = result.metrics(name, warmup=warmup)

    def ms(key: str) -> float | None:
        v = m.get(key)
        return v * 1e3 if isinstance(v, (int, float)) and math.isfinite(v) else None

    out: dict[str, Any] = {
        "sim_throughput": m.get("throughput"), "sim_latency_p50_ms": ms("latency_p50"),
        "sim_latency_p99_ms": ms("latency_p99"), "sim_paper_latency_mean_ms": ms("paper_latency_mean"),
        "sim_congested": bool(m.get("congested")), "sim_deadline_misses": m.get("deadline_misses"),
    }
    for sim_key, live_key, err_key in COMPARED:
        out[err_key] = relative_error(out[sim_key], row.get(live_key))
    return out


def sweep_mix(
    plans: Mapping[str, Plan | str | os.PathLike[str]],
    points: Sequence[MixPoint],
    *,
    targets: Mapping[str, Any] | None = None,
    policy: str = "heft",
    groups: str = "numa",
    cuda_streams: int = 0,
    cuda_devices: Sequence[int] = (0,),
    cuda_graphs: bool = True,
    distribution: str = "constant",
    duration: float = 10.0,
    warmup: float | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    store: Any = None,
    progress: Callable[[Any], None] | None = None,
    seed: int = 0,
    queue_capacity: int = 1024,
    min_batches: int = 10,
    stop_on_congestion: bool = True,
    bound: bool = True,
    label: str | None = None,
    simulate: bool = False,
    max_delay: float | None = None,
    trace: str | os.PathLike[str] | None = None,
    residency: Mapping[str, str] | None = None,
    lanes: Mapping[str, str] | None = None,
    colocate: bool = False,
) -> list[dict[str, Any]]:
    """Measure every mix of ``points`` on one runtime hosting every model; return the rows
    (one per point and model; see the module docstring).

    Each point runs a :class:`~staronnx.serving.Server` per model over ``runtime.model(name)``
    and an open-loop generator per model (model ``i`` seeded ``seed + i``, as
    :func:`~staronnx.bench.simulator.simulate_mix` draws them), all for the same length:
    ``duration`` stretched to ``min_batches`` fills of the slowest-filling model. A point is
    congested when any model is; with ``stop_on_congestion`` the points that dominate a
    congested one (same batch sizes, every rate at least as high) are skipped. ``bound``: the
    LP bound of each mix (:func:`~staronnx.bench.bound.mix_bound`) beside it; ``simulate``:
    each point simulated too, its figures and errors in every model's row. ``residency``
    (model name -> worker selector, ``Runtime(residency=...)``'s) loads those models on the
    selected workers only, in the runtime and in its bound and simulation alike; each model's
    ``held_by`` is in the settings. ``lanes`` (model name -> CPU group selector,
    ``Runtime(lanes=...)``'s; see :mod:`staronnx.workers.lanes`) gives those models latency
    lanes in the live runtime, and the same lanes to its bound and simulation, which model a
    lane as an extra worker on its group's cores and not the OS preempting the group's worker
    for it (:data:`~staronnx.bench.machine.LANE_APPROXIMATION`, in the notes): a lane model's
    simulated latency is a lane's that always gets the core, the heavy models' simulated
    throughput is higher than live by about the lanes' busy share. Other arguments as in
    :func:`staronnx.bench.sweep.sweep`; an unstable point is not measured again here.
    """
    from staronnx.bench.bound import mix_bound
    from staronnx.bench.fidelity import fidelity_summary
    from staronnx.bench.cpuload import LoadWatch
    from staronnx.bench.points import measure_point, point_duration, sample_pool, task_time_ratio, tasks_snapshot, \
        warm_up, workers_delta, workers_snapshot
    from staronnx.bench.results import SweepError, clean, make_row, write_results
    from staronnx.bench.machine import build_machine, machine_inflight, residency_where
    from staronnx.bench.simulator import deadline_misses, simulate_mix
    from staronnx.bench.sweep import POINTS_LANE, SweepEvent, gpus_of, load_columns, point_tracers, simulated_point
    from staronnx.runtime.models import ModelSet
    from staronnx.runtime.runtime import Runtime, warmup_sizes
    from staronnx.serving.arrivals import DISTRIBUTIONS
    from staronnx.signals import signal_name
    from staronnx.workers.residency import ResidencyError

    loaded = {str(n): p if isinstance(p, Plan) else Plan.load(p) for n, p in plans.items()}
    names = list(loaded)
    models = ModelSet(loaded, targets)  # checks the targets' names
    residency = dict(residency or {})
    lanes = dict(lanes or {})
    if not points:
        raise SweepError("no mix to measure")
    for p in points:
        if list(p.rates) != names or list(p.batch_sizes) != names:
            raise SweepError(f"{p!r} does not give a rate and a batch size to each model ({', '.join(names)})")
        if any(not (math.isfinite(r) and r > 0) for r in p.rates.values()) or min(p.batch_sizes.values()) < 1:
            raise SweepError(f"{p!r}: rates must be > 0 requests/s and batch sizes >= 1")
    points, one_per_task = _batch_one_where_needed(loaded, points)
    if distribution not in DISTRIBUTIONS:
        raise SweepError(f"unknown distribution {distribution!r}; choose {' or '.join(DISTRIBUTIONS)}")
    if not (math.isfinite(duration) and duration > 0):
        raise SweepError(f"duration must be > 0 seconds, got {duration!r}")
    warmup = min(1.0, duration / 5) if warmup is None else float(warmup)
    if not 0 <= warmup < duration:
        raise SweepError(f"warmup must be >= 0 and shorter than the duration ({duration} s), got {warmup}")
    notify = progress or (lambda event: None)
    total = len(points)
    sizes_of = {n: sorted({p.batch_sizes[n] for p in points}) for n in names}
    settings: dict[str, Any] = {
        "mixed": True, "plan": None, "plan_hash": None,
        "models": {m.name: {"plan": str(m.plan.root), "plan_hash": m.plan.hash,
                            "latency_target_ms": None if m.target.latency is None else m.target.latency * 1e3,
                            "priority": m.target.priority} for m in models.models},
        "policy": policy, "groups": groups, "cuda_streams": cuda_streams, "cuda_devices": list(cuda_devices),
        "distribution": distribution,
        "duration_s": float(duration), "warmup_s": warmup, "seed": seed, "queue_capacity": queue_capacity,
        "min_batches": min_batches, "engine": "native", "simulate": simulate, "max_delay_s": max_delay,
        "mixes": [{"rates": p.rates, "batch_sizes": p.batch_sizes} for p in points],
        "rates": {n: sorted({p.rates[n] for p in points}) for n in names}, "batch_sizes": sizes_of,
        "residency": residency, "lanes": lanes, "colocate": colocate,
        "label": label or (Path(out_dir).name if out_dir is not None else None),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "front_end": {"kind": "in-process"},
    }
    if cuda_streams:
        settings["gpus"] = gpus_of(cuda_devices)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    bounds: dict[str, Any] = {}
    notes: list[str] = list(one_per_task)

    def save() -> None:
        if out_dir is not None:
            write_results(out_dir, rows, settings=settings, bounds=bounds, skipped=skipped, notes=notes,
                          fidelity=fidelity_summary(rows) if simulate else None)

    machine = None
    if bound or simulate:
        try:
            machine = build_machine(models, groups=groups, cuda_streams=cuda_streams, cuda_devices=cuda_devices,
                                    store=store, lanes=lanes)
            notes.extend(machine.notes)
        except ResidencyError:
            raise  # a lane the runtime would refuse too: refused now, in its words, before it starts
        except StaronnxError as exc:
            missing = " and ".join(m for m, on in (("no LP bound", bound), ("no simulation", simulate)) if on)
            notes.append(f"{missing}: {exc}")
    # a model's holders, as the runtime will choose them (a selector matching no worker is
    # refused here, before the runtime starts, with the runtime's own message)
    where = None if machine is None else residency_where(machine, residency)
    windows: dict[tuple[str, int], int | None] = {}
    for m in models.models:
        for b in sizes_of[m.name]:
            windows[(m.name, b)] = None if machine is None else machine_inflight(machine, b, m.index, where)
    warm = sorted({s for n in names for b in sizes_of[n] for s in warmup_sizes(b, max_delay)}) if cuda_streams else ()
    runtime = Runtime(loaded, policy=policy, cpu_groups=groups, cuda_streams=cuda_streams, cuda_devices=cuda_devices,
                      store=store, trace=trace,
                      targets=targets, warmup=warm, residency=residency, lanes=lanes or None,
                      cuda_options={"cuda_graphs": cuda_graphs} if cuda_streams else None)
    index = 0
    congested: list[MixPoint] = []
    # each mix's simulated schedule where its live mix ran, beside the live trace (as a sweep's)
    tracer, sim_tracer = point_tracers(runtime, simulated=simulate and machine is not None, settings=settings)
    try:
        settings["workers"] = [getattr(w, "name", str(w)) for w in runtime.workers]
        for n in names:  # where each model lives (every worker unless residency or lanes say otherwise)
            settings["models"][n]["held_by"] = list(runtime.model(n).stats().get("held_by", settings["workers"]))
        notify(SweepEvent("start", 0, total))
        save()
        handles = {n: runtime.model(n) for n in names}
        for n in names:
            failed = warm_up(handles[n], loaded[n], sizes_of[n], seed=seed)
            if failed:  # its rows fail the same way and say so
                notes.append(f"{n}: warm-up failed at {failed}")
        pools = {n: sample_pool(loaded[n], seed=seed) for n in names}
        for point in points:
            if stop_on_congestion and any(point.dominates(c) for c in congested):
                skipped.append({"mix": point.label, "batch_sizes": point.batch_sizes,
                                "reason": "a mix it exceeds in every rate was congested"})
                index += 1
                save()
                notify(SweepEvent("skipped", index, total, skipped=[], message=point.label))
                continue
            length = max(point_duration(duration, warmup, point.batch_sizes[n], point.rates[n], min_batches)
                         for n in names)
            notify(SweepEvent("point", index, total, requests=int(sum(length * r for r in point.rates.values())),
                              message=point.label))
            mix = None
            if bound and machine is not None:
                try:
                    mix = mix_bound(machine, point.rates, point.batch_sizes, residency)
                    bounds[f"{point.label} b {mix_label(point.batch_sizes)}"] = mix.as_dict()
                except StaronnxError as exc:
                    notes.append(f"no LP bound for {point.label}: {exc}")
            before, tasks_before, watch = workers_snapshot(runtime), tasks_snapshot(runtime), LoadWatch()
            results: dict[str, tuple[dict[str, Any], Any]] = {}
            errors: list[BaseException] = []

            def measure(i: int, n: str, point: MixPoint = point, length: float = length) -> None:
                try:
                    results[n] = measure_point(
                        handles[n], point.batch_sizes[n], point.rates[n], pools[n], duration=length,
                        warmup=warmup, distribution=distribution, seed=seed + i, queue_capacity=queue_capacity,
                        max_delay=max_delay, max_inflight=windows[(n, point.batch_sizes[n])], colocate=colocate)
                except BaseException as exc:  # noqa: BLE001 - raised again in the sweep's thread
                    errors.append(exc)

            threads = [threading.Thread(target=measure, args=(i, n), name=f"staronnx-mix-{n}", daemon=True)
                       for i, n in enumerate(names)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            load = watch.stop()
            after = workers_snapshot(runtime)
            machine_columns = load_columns(load, task_time_ratio(tasks_before, tasks_snapshot(runtime)))
            began = min(records.start for _, records in results.values())
            if tracer is not None:
                tracer.span(POINTS_LANE, point.label, began, max(records.end for _, records in results.values()),
                            "sweep point")
            sim = None
            if simulate and machine is not None:
                target = simulated_point(sim_tracer, point.label, began, length)
                try:
                    sim = simulate_mix(machine, point.rates, point.batch_sizes, policy=policy, targets=targets,
                                       duration=length, distribution=distribution, seed=seed,
                                       queue_capacity=queue_capacity, max_delay=max_delay, residency=residency,
                                       trace=target)
                except StaronnxError as exc:
                    notes.append(f"{point.label} not simulated: {exc}")
                if sim_tracer is not None:
                    sim_tracer.save()
            point_rows = []
            for m in models.models:
                summary, records = results[m.name]
                row_settings = dict(settings)
                row = make_row(summary, row_settings, duration=length,
                               bound=None if mix is None else mix.throughput[m.name])
                latency = m.target.latency
                answered = sum(1 for r in records.requests if r.done is not None)
                misses = deadline_misses(records, latency)
                row.update(clean({
                    "model": m.name, "mix": point.label, "point": index,
                    "latency_target_ms": None if latency is None else latency * 1e3,
                    "deadline_misses": misses,
                    "deadline_miss_rate": None if misses is None or not answered else misses / answered,
                    "bound_scale": None if mix is None else mix.scale,
                    "bound_feasible": None if mix is None else mix.feasible,
                    "solo_bound_throughput": None if mix is None else mix.solo[m.name],
                }))
                row["label"] = settings["label"]
                row["attempts"] = 1
                row["workers"] = clean(workers_delta(before, after, records.end - records.start))
                row.update(machine_columns)
                row["loadgen"] = clean(records.settings.get("loadgen"))
                row["placement"] = clean(summary.get("placement"))
                if sim is not None:
                    row.update(clean(_sim_columns(sim, m.name, row, warmup)))
                point_rows.append(row)
            rows.extend(point_rows)
            index += 1
            if any(r["congested"] for r in point_rows):
                congested.append(point)
            save()
            notify(SweepEvent("done", index, total, row={"mix": point.label, "rows": point_rows}))
        settings["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        save()
        notify(SweepEvent("end", index, total))
    except BaseException as exc:
        if isinstance(exc, Exception):
            raise
        settings["interrupted"] = {"signal": signal_name(exc), "points_measured": index, "points_planned": total}
        save()
        notify(SweepEvent("interrupted", index, total, message=signal_name(exc)))
        raise
    finally:
        runtime.close()
    return rows
