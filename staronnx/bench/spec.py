"""What a measurement is asked to do, as values: the traffic of a point (:class:`RunSpec`), a
sweep over points (:class:`SweepSpec`, several models' points being :class:`MixPoint`), a
simulated run (:class:`SimSpec`), the batch-size search (:class:`OptimizeSpec`) and a sweep's
front end over the network (:class:`FrontEnd`).

The machine is a :class:`~staronnx.workers.layout.MachineSpec` beside them, never their field:
``staronnx sweep``, ``staronnx simulate`` and ``staronnx optimize`` parse their flags into these
once, and a script keeps one spec to run the same measurement on other plans or machines
(``dataclasses.replace(run, seed=1)`` for a variant). Nothing is checked here that the function
running the spec checks in its own words (a sweep's duration, a simulation's queue).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from staronnx.runtime.models import ServiceTarget
    from staronnx.runtime.sched import Policy

__all__ = ["BAND", "MixPoint", "RunSpec", "SweepSpec", "SimSpec", "OptimizeSpec", "FrontEnd", "mix_label"]

#: how much slower and faster than its perf models a sweep also simulates each point (the
#: machine's speed noise, see :mod:`staronnx.bench.fidelity`): 5 %, about the spread of this
#: project's VM
BAND = 0.05


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


@dataclass(frozen=True)
class RunSpec:
    """How one live point offers its traffic and batches it (:func:`~staronnx.bench.points.measure_point`,
    every point of a sweep, the optimizer's live checks).

    Args:
        distribution: arrivals: ``constant`` (the papers) or ``poisson``.
        duration: seconds of arrivals per point (a sweep stretches it to ``min_batches`` fills).
        warmup: seconds at the start of a point left out of its figures; None: ``min(1, duration / 5)``.
        seed: the inputs' and Poisson arrivals' seed (model ``i`` of a mix draws ``seed + i``).
        queue_capacity: requests the server queues; an overflow marks congestion.
        min_batches: a point lasts at least this many batch fills.
        max_delay: Triton's dynamic batching: a batch of at most ``b`` leaves once its oldest
            request waited this long (s); None: batches leave full (the papers' model).
        colocate: the load generator and the batcher run on the runtime's host core
            (:meth:`~staronnx.runtime.runtime.Runtime.colocate`).
    """

    distribution: str = "constant"
    duration: float = 10.0
    warmup: float | None = None
    seed: int = 0
    queue_capacity: int = 1024
    min_batches: int = 10
    max_delay: float | None = None
    colocate: bool = False


@dataclass(frozen=True)
class SweepSpec:
    """A sweep's settings beside its machine (:func:`~staronnx.bench.sweep.sweep`).

    Args:
        run: each point's traffic and batching.
        policy: the scheduling policy of the runtime, its simulated twin and its bound.
        engine: ``native`` or ``starpu``.
        points: several models' mixes (:func:`~staronnx.bench.sweep.mix_points`); one model's
            points are its rates x batch sizes instead.
        targets: model name -> its service target (latency, priority), several models.
        extend: measure an unstable, uncongested point once more, twice as long.
        stop_on_congestion: skip the rates above a congested one (same batch sizes).
        bound: the LP bound per point (needs calibrated perf models).
        simulate: replay every measured point in the simulator, prediction beside measurement.
        sim_band: with ``simulate``, the share faster and slower each point is simulated again
            (:func:`~staronnx.bench.fidelity.band_columns`; 0: no band).
        label: the sweep's name in its rows (default: the output folder's name).
        out_dir: where results are written after every point (None: nowhere).
        trace: a Perfetto trace of the sweep, written there (a runtime given keeps its own).
    """

    run: RunSpec = RunSpec()
    policy: str = "heft"
    engine: str = "native"
    points: Sequence[MixPoint] = ()
    targets: Mapping[str, ServiceTarget | Mapping[str, Any]] | None = None
    extend: bool = True
    stop_on_congestion: bool = True
    bound: bool = True
    simulate: bool = False
    sim_band: float = BAND
    label: str | None = None
    out_dir: str | os.PathLike[str] | None = None
    trace: str | os.PathLike[str] | None = None


@dataclass(frozen=True)
class SimSpec:
    """A simulated run's settings beside its machine (:func:`~staronnx.bench.simulator.simulate`,
    :func:`~staronnx.bench.simulator.simulate_mix`).

    Args:
        policy: a policy by name, or an object of one (used as it is).
        policy_options: the named policy's options (the random policy gets ``seed`` unless told).
        targets: model name -> its service target (latency, priority) or its fields.
        duration: seconds of arrivals (None: ``n_requests`` decides).
        n_requests: requests per model instead of a duration.
        distribution: arrivals: ``constant`` or ``poisson``.
        seed: model ``i`` draws its arrivals with ``seed + i``, as a live sweep does.
        max_delay: a partial batch leaves once its oldest request waited this long (s).
        queue_capacity: the server's queue (None: unbounded).
        spread: scales the perf models' standard deviations (0: every task takes its mean).
        drain: go on after the last arrival until every accepted request is answered.
        charge_transfers: price data movements with the bus model.
        residency: model name -> the workers that hold it (:mod:`staronnx.workers.residency`).
        pad_to: the live server's padding of partial batches, priced at the padded size.
        host_costs: what serving costs the host beyond the tasks, as calibration measured it.
        slowdown: every task takes that many times its draw (a machine running slower).
    """

    policy: str | Policy = "heft"
    policy_options: Mapping[str, Any] | None = None
    targets: Mapping[str, ServiceTarget | Mapping[str, Any]] | None = None
    duration: float | None = 10.0
    n_requests: int | None = None
    distribution: str = "constant"
    seed: int = 0
    max_delay: float | None = None
    queue_capacity: int | None = 1024
    spread: float = 1.0
    drain: bool = True
    charge_transfers: bool = True
    residency: Mapping[str, str] = field(default_factory=dict)
    pad_to: Sequence[int] = ()
    host_costs: bool = True
    slowdown: float = 1.0


@dataclass(frozen=True)
class OptimizeSpec:
    """How :func:`~staronnx.bench.optimize.optimize_batch` chooses a batch size for a rate.

    Args:
        slo: the papers' latency objective (s); None: the lowest latency that keeps up.
        batch_sizes: the candidates.
        policy: the scheduling policy, simulated and live alike.
        distribution: arrivals: ``constant`` or ``poisson``.
        sim_duration: seconds of simulated arrivals per candidate.
        verify: measure the predicted best (and its ``neighbours`` each side) live.
        verify_duration: seconds of arrivals per live measurement.
        neighbours: candidates each side of the predicted best measured live.
        max_verify: live measurements at most, the hill-climb's included.
        min_batches: a simulation or measurement lasts at least this many batch fills.
        seed: the inputs' and arrivals' seed.
        colocate: as ``sweep --colocate`` (:meth:`~staronnx.runtime.runtime.Runtime.colocate`).
    """

    slo: float | None = None
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16)
    policy: str = "heft"
    distribution: str = "constant"
    sim_duration: float = 20.0
    verify: bool = True
    verify_duration: float = 3.0
    neighbours: int = 1
    max_verify: int = 4
    min_batches: int = 10
    seed: int = 0
    colocate: bool = False


@dataclass(frozen=True)
class FrontEnd:
    """Where a sweep's requests go instead of an in-process :class:`~staronnx.serving.server.Server`:
    ``server_factory`` builds each point's batching front end (the Server's arguments), and
    ``settings`` is what the results record of it (``settings.front_end``: kind, URL, protocol)."""

    server_factory: Callable[..., Any]
    settings: Mapping[str, Any]
