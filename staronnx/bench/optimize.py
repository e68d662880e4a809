"""Pick the batch size for a rate: predict every candidate in simulation, verify the best live.

    result = optimize_batch(plan, 300, OptimizeSpec(batch_sizes=[1, 2, 4, 8, 16]), machine=MachineSpec(groups="numa"))
    print(result.best, result.predicted_best)

**Objective** (:func:`choose`): without an SLO, the lowest papers' latency among the batch
sizes that keep up with the rate; with one, the most headroom (LP bound) among those that meet
it. A candidate keeps up when its requests did not fail, it is not congested and it serves at
least :data:`KEEP_UP` of the offered rate (:func:`shortfall`): one that served 24.5 samples/s of
30 offered is rejected, whatever its latency over a short run, and never "meets the SLO". When
no candidate keeps up, the one that served the most is returned, flagged (``keeps_up`` False,
the reasons in ``rejected``).

**Prediction, then verification.** The simulator serves the rate at every candidate from the
perf models. It knows nothing the models do not (the runtime's overhead, interference), so the
predicted best and its neighbours are then measured live, with a short hill-climb
(:func:`next_candidate`). The answer is the best *measured*; every verified candidate carries
both figures.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

from staronnx.bench.bound import machine_bound, stale_models_note
from staronnx.bench.points import measure_point, point_duration, runnable_sizes, sample_pool, warm_up
from staronnx.bench.results import clean_dict
from staronnx.bench.machine import SimMachine, build_machine
from staronnx.bench.simulator import simulate
from staronnx.errors import StaronnxError
from staronnx.perfmodels import PerfModelStore
from staronnx.plan import Plan
from staronnx.serving.arrivals import DISTRIBUTIONS
from staronnx.runtime.policies import policy_options
from staronnx.runtime.runtime import Runtime, warmup_sizes
from staronnx.runtime.spec import RuntimeSpec
from staronnx.workers.layout import MachineSpec
from staronnx.bench.spec import OptimizeSpec, RunSpec, SimSpec

if TYPE_CHECKING:
    from staronnx.bench.sweep import SweptRuntime

LATENCY = "paper_latency_mean"


class OptimizeError(StaronnxError, ValueError):
    """The optimizer cannot run as asked (no candidates, bad rate or SLO, no perf models)."""


@dataclass
class Candidate:
    """One batch size: its simulated figures and, if verified, its measured ones (seconds)."""

    batch_size: int
    predicted: dict[str, Any]
    measured: dict[str, Any] | None = None
    bound: float | None = None  # LP throughput bound at this batch size (samples/s)

    @staticmethod
    def _ms(metrics: Mapping[str, Any] | None, key: str = LATENCY) -> float | None:
        if not metrics:
            return None
        v = metrics.get(key)
        return v * 1e3 if isinstance(v, (int, float)) and math.isfinite(v) else None

    @property
    def predicted_latency_ms(self) -> float | None:
        return self._ms(self.predicted)

    @property
    def measured_latency_ms(self) -> float | None:
        return self._ms(self.measured)

    @property
    def latency_error(self) -> float | None:
        """(predicted - measured) / measured of the papers' latency, when both exist."""
        p, m = self.predicted_latency_ms, self.measured_latency_ms
        return (p - m) / m if p is not None and m else None

    def row(self) -> dict[str, Any]:
        """A flat summary (latencies in ms) for tables and JSON."""
        out: dict[str, Any] = {"batch_size": self.batch_size, "bound_throughput": self.bound}
        for tag, m in (("predicted", self.predicted), ("measured", self.measured)):
            out[f"{tag}_latency_ms"] = self._ms(m)
            out[f"{tag}_latency_std_ms"] = self._ms(m, "paper_latency_std")
            out[f"{tag}_p50_ms"] = self._ms(m, "latency_p50")
            out[f"{tag}_p99_ms"] = self._ms(m, "latency_p99")
            out[f"{tag}_throughput"] = None if not m else m.get("throughput")
            out[f"{tag}_congested"] = None if not m else bool(m.get("congested"))
        out["measured_failed"] = None if not self.measured else int(self.measured.get("failed") or 0)
        out["measured_state"] = None if not self.measured else self.measured.get("state")
        out["predicted_served"] = None if not self.predicted else served_rate(self.predicted)
        out["measured_served"] = None if not self.measured else served_rate(self.measured)
        out["latency_error"] = self.latency_error
        return out


@dataclass
class Optimization:
    """The optimizer's answer."""

    rate: float
    slo: float | None
    candidates: list[Candidate]
    predicted_best: int
    best: int  # the measured best among the verified (the predicted best without verification)
    verified: list[int] = field(default_factory=list)
    slo_met: bool | None = None
    notes: list[str] = field(default_factory=list)
    #: batch size -> why it was rejected (:func:`shortfall`): over the measured candidates when
    #: verified, else over the predicted ones
    rejected: dict[int, str] = field(default_factory=dict)
    #: the PU the live measurements ran their load generator on (``colocate``), else None
    generator_core: int | None = None
    #: the batch sizes whose CUDA graphs the live measurements replayed (the runtime's
    #: preferred batch sizes, what a partial batch is padded to); empty without graphs
    cuda_graphs: list[int] = field(default_factory=list)

    @property
    def keeps_up(self) -> bool:
        """Whether the answer keeps up with the rate (measured when verified): when it does
        not, no candidate did and it is only the one that served the most."""
        return self.best not in self.rejected

    @property
    def objective(self) -> str:
        return ("lowest papers' latency" if self.slo is None
                else f"most headroom with papers' latency <= {self.slo * 1e3:g} ms")

    def candidate(self, batch_size: int) -> Candidate:
        return next(c for c in self.candidates if c.batch_size == batch_size)

    def measured(self) -> dict[int, dict[str, Any]]:
        """Batch size -> the live figures of each verified candidate (every one of them was
        measured: a measurement that raises ends the optimization)."""
        return {b: m for b in self.verified if (m := self.candidate(b).measured) is not None}

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe (NaN -> None), latencies in ms."""
        return clean_dict({
            "rate": self.rate, "slo_ms": None if self.slo is None else self.slo * 1e3,
            "objective": self.objective, "predicted_best": self.predicted_best, "best": self.best,
            "verified": self.verified, "slo_met": self.slo_met, "notes": self.notes,
            "keeps_up": self.keeps_up, "rejected": {str(b): why for b, why in self.rejected.items()},
            "generator_core": self.generator_core, "cuda_graphs": self.cuda_graphs,
            "candidates": [c.row() for c in self.candidates],
        })


def _finite(v: object) -> TypeGuard[int | float]:
    """A number that is neither NaN nor infinite (a figure a run may leave None or NaN)."""
    return isinstance(v, (int, float)) and math.isfinite(v)


def _failed(metrics: Mapping[str, Any]) -> bool:
    """Whether a measurement's requests failed: it is never the answer while another served."""
    return metrics.get("state") == "failed" or bool(metrics.get("failed"))


#: a candidate keeps up when it serves at least this share of the offered rate (less one batch
#: over the measured window: see :func:`shortfall`)
KEEP_UP = 0.95


def served_rate(metrics: Mapping[str, Any]) -> float | None:
    """Samples/s a run served over its measurement window (its throughput), None if unknown."""
    thr = metrics.get("throughput")
    return float(thr) if _finite(thr) else None


def shortfall(metrics: Mapping[str, Any], rate: float | None = None) -> str | None:
    """Why a candidate's run did not keep up with its offered rate (one line), or None when it
    did: its requests failed, it was congested, or it served under :data:`KEEP_UP` of the rate
    (``metrics["offered_rate"]``, else ``rate``; neither known: only the first two count).

    Why not only the congestion test: it needs the backlog to grow by two batches and 5 % of
    the requests over the last half of the run, which a short live point of large batches at a
    rate 20 % over what the machine serves need not reach; the samples served say it at once.
    One batch over the window is forgiven (batches complete whole: a window holding ten
    batches counts nine or eleven by where its edges fall)."""
    if _failed(metrics):
        return "its requests failed"
    if metrics.get("congested"):
        return "congested"
    offered = metrics.get("offered_rate", rate)
    served = served_rate(metrics)
    span = metrics.get("measured_s")
    batch = metrics.get("batch_size")
    slack = batch / span if _finite(span) and span > 0 and _finite(batch) else 0.0
    if _finite(offered) and offered > 0 and served is not None and served < KEEP_UP * offered - slack:
        return f"served {served:.1f} samples/s of the {offered:g} offered"
    if not _finite(metrics.get(LATENCY)):
        return "no latency measured"
    return None


def choose(metrics: Mapping[int, Mapping[str, Any]], slo: float | None = None,
           bounds: Mapping[int, float | None] | None = None, rate: float | None = None) -> tuple[int, bool | None]:
    """The objective of the module docstring over ``{batch size: summarize() figures}``:
    (batch size, whether the SLO is met: None without an SLO). With an SLO (seconds), ties in
    headroom go to the lower latency, and when no size meets it the lowest latency is chosen,
    flagged as not met."""
    if not metrics:
        raise OptimizeError("no candidate to choose from")
    bounds = bounds or {}
    ok = {b: m for b, m in metrics.items() if shortfall(m, rate) is None}
    if not ok:  # nothing keeps up (congested, failed, too slow): the most served, then the lowest latency
        def key(b: int) -> tuple[bool, float, float]:
            served = served_rate(metrics[b])
            lat = metrics[b].get(LATENCY)
            return (_failed(metrics[b]), -(served if served is not None else 0.0), lat if _finite(lat) else math.inf)
        return min(metrics, key=key), (False if slo is not None else None)
    fastest = min(ok, key=lambda b: (ok[b][LATENCY], b))
    if slo is None:
        return fastest, None
    within = [b for b in ok if ok[b][LATENCY] <= slo]
    if not within:
        return fastest, False

    def headroom(b: int) -> tuple[float, float]:
        cap = bounds.get(b)
        return (-(cap if _finite(cap) else 0.0), ok[b][LATENCY])

    return min(within, key=headroom), True


def rejections(metrics: Mapping[int, Mapping[str, Any] | None], rate: float | None = None) -> dict[int, str]:
    """Batch size -> why it cannot be the answer (:func:`shortfall`), for those that did not
    keep up; candidates without figures are left out."""
    return {b: why for b, m in sorted(metrics.items()) if m and (why := shortfall(m, rate)) is not None}


def next_candidate(order: Sequence[int], measured: Mapping[int, Mapping[str, Any]], slo: float | None = None,
                   bounds: Mapping[int, float | None] | None = None, rate: float | None = None) -> int | None:
    """The next batch size to measure live, or None when the measured best is confirmed.

    When even the best measured does not keep up, the rate needs more capacity: the next
    larger unmeasured size (bigger batches cost less per sample). Otherwise, when the best sits
    at an edge of the measured sizes, the unmeasured neighbour beyond it (a smaller size lowers
    the batch-fill wait; a larger one may win at high load or give more headroom).
    """
    if not measured:
        return None
    best, _ = choose(measured, slo, bounds, rate)
    done = sorted(measured)
    if _failed(measured[best]):  # even the best failed: no other size is worth measuring blind
        return None
    if shortfall(measured[best], rate) is not None:  # congested or too slow: more capacity
        bigger = [b for b in order if b > done[-1]]
        return bigger[0] if bigger else None
    i = list(order).index(best)
    if best == done[0] and i > 0 and order[i - 1] not in measured:
        return order[i - 1]
    if best == done[-1] and i + 1 < len(order) and order[i + 1] not in measured:
        return order[i + 1]
    return None


def optimize_batch(plan: Plan | str | os.PathLike[str], rate: float, spec: OptimizeSpec = OptimizeSpec(), *,
                   machine: MachineSpec = MachineSpec(), store: PerfModelStore | None = None,
                   runtime: SweptRuntime | None = None,
                   sim_machine: SimMachine | None = None, progress: Callable[[str], None] | None = None
                   ) -> Optimization:
    """Choose ``b`` for ``rate`` requests/s among ``spec.batch_sizes`` (see the module docstring).

    ``spec.slo``: papers' latency objective in seconds (None: minimize the latency). The
    runtime's settings (``machine`` and ``spec.policy``) are simulated and measured alike. Each
    candidate gets ``sim_duration`` seconds of simulated arrivals, each live measurement
    ``verify_duration`` (both stretched to ``min_batches`` batch fills); ``verify`` measures the
    predicted best and its ``neighbours`` on each side live, at most ``max_verify`` in all
    (:func:`next_candidate`). ``runtime`` (left open) and ``sim_machine`` (the simulated twin of
    ``machine``) are reused where given; ``progress`` hears a line per step.
    """
    slo, seed = spec.slo, spec.seed
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    if not (_finite(rate) and rate > 0):
        raise OptimizeError(f"rate must be a positive number of requests/s, got {rate!r}")
    if slo is not None and not (_finite(slo) and slo > 0):
        raise OptimizeError(f"the latency SLO must be > 0 seconds, got {slo!r}")
    # settings that fail every candidate alike: said as themselves, not once per candidate after the notes
    if spec.distribution not in DISTRIBUTIONS:
        raise OptimizeError(f"unknown distribution {spec.distribution!r}; choose {' or '.join(DISTRIBUTIONS)}")
    policy_options(spec.policy)  # PolicyError for an unknown policy
    if spec.verify and spec.max_verify < 1:
        raise OptimizeError(f"max_verify must be at least 1 with verify (verify=False measures nothing), got "
                            f"{spec.max_verify}", cli=f"--max-verify must be at least 1 (--no-verify measures "
                                                      f"nothing), got {spec.max_verify}")
    sizes = sorted({int(b) for b in spec.batch_sizes})
    if not sizes or sizes[0] < 1:
        raise OptimizeError(f"batch sizes must be integers >= 1, got {list(spec.batch_sizes)}")
    sizes, left_out = runnable_sizes(plan, sizes)
    say = progress or (lambda msg: None)
    notes: list[str] = [left_out] if left_out else []
    sim = sim_machine if sim_machine is not None else build_machine(plan, machine, store=store)
    notes.extend(sim.notes)

    candidates: list[Candidate] = []
    for b in sizes:
        length = point_duration(spec.sim_duration, min(1.0, spec.sim_duration / 5), b, rate, spec.min_batches)
        say(f"simulating batch {b} at {rate:g} req/s ({length:.1f} s of arrivals)")
        try:
            res = simulate(sim, rate, b, SimSpec(policy=spec.policy, duration=length, distribution=spec.distribution,
                                                 seed=seed))
        except StaronnxError as exc:
            notes.append(f"batch {b} left out: {exc}")
            continue
        figures = res.metrics(warmup=min(1.0, length / 5))
        try:
            bound = machine_bound(sim, b).throughput
        except StaronnxError:
            bound = None
        candidates.append(Candidate(b, dict(figures), bound=bound))
    if not candidates:
        raise OptimizeError("no batch size could be simulated: " + "; ".join(notes))
    bounds = {c.batch_size: c.bound for c in candidates}
    predicted = {c.batch_size: c.predicted for c in candidates}
    predicted_best, slo_met = choose(predicted, slo, bounds, rate)
    result = Optimization(rate=float(rate), slo=slo, candidates=candidates, predicted_best=predicted_best,
                          best=predicted_best, slo_met=slo_met, notes=notes, rejected=rejections(predicted, rate))
    if not spec.verify:
        if not result.keeps_up:
            most = f"; batch {predicted_best} serves the most" if len(predicted) > 1 else ""
            notes.append(f"no candidate is predicted to keep up with {rate:g} req/s{most}")
        return result

    order = [c.batch_size for c in candidates]
    at = order.index(predicted_best)
    around = order[max(0, at - spec.neighbours): at + spec.neighbours + 1]
    # max_verify bounds these too: the predicted best first, then its nearest neighbours
    result.verified = sorted(sorted(around, key=lambda b: abs(order.index(b) - at))[:spec.max_verify])
    own = runtime is None
    live: SweptRuntime
    if runtime is None:
        # each candidate's CUDA graphs captured at warm-up, as sweep and serve capture theirs:
        # without them every live candidate ran ungraphed, unlike what it was chosen for
        warm = tuple(sorted({s for b in order for s in warmup_sizes(b, None)})) if machine.cuda_streams else ()
        live = Runtime(plan, machine, RuntimeSpec(spec.policy, store=store, warmup=warm))
    else:
        live = runtime
    result.cuda_graphs = sorted(int(b) for b in live.preferred_batch_sizes)
    try:
        samples = sample_pool(plan, seed=seed)

        def measure(b: int) -> None:
            failed = warm_up(live, plan, [b], seed=seed)
            if failed:  # the measurement fails the same way and says so
                notes.append(f"warm-up failed at {failed}")
            length = point_duration(spec.verify_duration, min(1.0, spec.verify_duration / 5), b, rate, spec.min_batches)
            say(f"measuring batch {b} at {rate:g} req/s for {length:.1f} s")
            summary, records = measure_point(live, b, rate, samples,
                                             RunSpec(spec.distribution, length, min(1.0, length / 5), seed,
                                                     colocate=spec.colocate))
            result.candidate(b).measured = dict(summary)
            if summary["state"] == "failed":
                notes.append(f"batch {b} measured live: {summary['notes']}")
            if spec.colocate:
                result.generator_core = records.settings.get("loadgen", {}).get("core")

        for b in result.verified:
            measure(b)
        # hill-climb (up to max_verify live points): see next_candidate()
        while len(result.verified) < spec.max_verify:
            nxt = next_candidate(order, result.measured(), slo, bounds, rate)
            if nxt is None:
                break
            measure(nxt)
            result.verified = sorted([*result.verified, nxt])
    finally:
        if own:
            live.close()
    measured = result.measured()
    result.best, result.slo_met = choose(measured, slo, bounds, rate)
    result.rejected = rejections(measured, rate)
    if not result.keeps_up:
        most = f"; batch {result.best} served the most" if len(measured) > 1 else ""
        result.notes.append(f"no measured candidate keeps up with {rate:g} req/s{most}: more capacity or larger "
                            "batches are needed")
    if result.best != predicted_best:
        result.notes.append(f"measurement overruled the prediction: batch {result.best} beat batch {predicted_best}")
    stale = stale_models_note(
        plan, [(b, (result.candidate(b).measured or {}).get("throughput"), result.candidate(b).bound)
               for b in result.verified], machine)
    if stale:
        result.notes.append(stale)
    return result
