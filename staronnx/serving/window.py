"""How many batches a served plan keeps in flight, from its perf models.

:func:`~staronnx.serving.spec.inflight_window` is the rule over each worker's time for one
batch; this module gives it those times: the plan's footprints at the batch size
(:func:`profile_plan`, computed as the engine and calibration compute them), each part's time
on each worker's arch, summed over the parts. The live server (:func:`inflight_from_models`,
from the stored perf models) and the simulator (:func:`plan_window` over its own table) size
the window by this one code, so a sweep's simulated points keep the server's window.

It lives in ``serving`` (not in ``bench``, where the simulator uses it too) because the
network front end sizes its windows with it and must not depend on the benchmarks.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from staronnx.errors import StaronnxError
from staronnx.perfmodels import Footprint, PerfModelStore
from staronnx.plan import Plan
from staronnx.runtime.predictor import PerfPredictor
from staronnx.serving.spec import inflight_window
from staronnx.workers.layout import MachineSpec, layout
from staronnx.workers.topology import Topology


class PartTimes(Protocol):
    """Predicted seconds of a part on an arch at a footprint (NaN where no model can say): the
    simulator's table, or the stored perf models as they are."""

    def predict(self, part: int, arch: str, fp: Footprint) -> float: ...


@dataclass(frozen=True)
class PlanProfile:
    """What the engine sees of one batch size: each part's footprint and every tensor's bytes."""

    batch: int
    footprints: tuple[Footprint, ...]
    nbytes: Mapping[str, int]


_PROFILES: dict[tuple[str, str, int], PlanProfile] = {}
_PROFILES_LOCK = threading.Lock()


def profile_plan(plan: Plan, batch: int) -> PlanProfile:
    """Footprints and tensor sizes at ``batch``, computed exactly like the engine and calibration.

    One reference run of the plan (ONNX Runtime, CPU) per batch size, cached per process, so a
    sweep pays it once per size. Shapes, hence footprints, rarely depend on values; feeds are
    drawn with calibration's seed anyway so data-dependent shapes agree too.
    """
    from staronnx.verify import random_plan_feeds

    key = (str(plan.root), plan.hash, int(batch))
    with _PROFILES_LOCK:
        cached = _PROFILES.get(key)
    if cached is not None:
        return cached
    values = plan.reference_values(random_plan_feeds(plan, batch, seed=0))
    profile = PlanProfile(
        batch=int(batch),
        footprints=tuple(Footprint.of_feeds(plan.part_feeds(p.index, values), batch, plan.part_batch_axes(p.index))
                         for p in plan.parts),
        nbytes={name: int(v.nbytes) for name, v in values.items()},
    )
    with _PROFILES_LOCK:
        _PROFILES[key] = profile
    return profile


def plan_window(times: PartTimes, plan: Plan, batch: int, archs: Sequence[str], first_part: int = 0) -> int:
    """The server's in-flight window (:func:`~staronnx.serving.spec.inflight_window`, the one
    rule) over the time of a batch of ``batch`` through ``plan`` (its parts numbered from
    ``first_part`` in ``times``) on a worker of each of ``archs``: the unknown-machine window
    where some part has no time on some arch (NaN, which the rule counts as unknown)."""
    try:
        fps = profile_plan(plan, batch).footprints
        return inflight_window([sum(times.predict(first_part + p, a, fp) for p, fp in enumerate(fps))
                                for a in archs])
    except Exception:  # noqa: BLE001 - a plan that cannot be profiled, models that cannot be read: no basis
        return inflight_window([None] * len(archs))


class _StoredTimes:
    """:class:`PartTimes` of the stored perf models as they are (no arch borrows another's)."""

    def __init__(self, predictor: PerfPredictor) -> None:
        self._predictor = predictor

    def predict(self, part: int, arch: str, fp: Footprint) -> float:
        return self._predictor.model(part, arch).predict(fp)


def inflight_from_models(plan: Plan, batch_size: int, *, groups: str | None, cuda_streams: int,
                         cuda_devices: Sequence[int] = (0,)) -> int | None:
    """The batches to keep in flight on the workers of these settings, from the plan's perf models
    (:func:`plan_window`, as sweeps and the simulator size them): with a GPU and CPU groups,
    dmda gives a CPU group a batch only behind a GPU queue as long as that group's time. None
    (the Server's default) where some worker's arch has no models of its own (each GPU of
    ``cuda_devices`` has its own): borrowed times are no basis for a window.
    """
    store = PerfModelStore()
    try:
        spec = MachineSpec(groups or "numa", cuda_streams, tuple(cuda_devices))
        archs = [w.arch for w in layout(spec, Topology.from_system()).workers]
    except StaronnxError:
        return None
    if not {key.arch for key in store.list(plan.hash)}.issuperset(archs):
        return None
    return plan_window(_StoredTimes(PerfPredictor(plan.hash, store)), plan, batch_size, archs)
