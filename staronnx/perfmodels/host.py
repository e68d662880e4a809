"""The host's own work per batch: what serving costs beyond ONNX Runtime's time in the parts.

The perf models time each part inside ONNX Runtime. A served request costs more: the load
generator submits it a little late (a sleeping thread wakes tens of microseconds after its
time), the server concatenates the batch's samples and submits it, the policy places each
task, a worker thread is woken and takes the GIL, the finished task's successors are pushed and
another worker woken, the batch's outputs are split and each request's future settled. At low
rates that is the whole gap between a simulated latency and a live one (11.3 ms simulated
against 11.6-12.6 ms live, googlenet at batch 1); near the knee its CPU time matters more:
where the CPU groups cover every core, the generator's, the batcher's and the engine's threads
run on the workers' cores, and their CPU comes out of the workers' time.

Those costs fall as the load rises: at a low rate every request wakes the generator, the
batcher and a worker from sleep, and the tasks run on cold caches; near the capacity the
threads stay awake and a request's share of that work shrinks (crnn_ocr at batch 4: the
process's CPU per request fell from 0.89 to 0.64 ms between 10 % and 100 % of the capacity).
The tasks themselves run slower on a worker that has been idle (its core halted, its caches and
the hypervisor's placement gone cold: unet_seg's first part 1.12x its model after 10 ms idle,
1.0x right after another task), so the probe times them apart: :attr:`HostCosts.task_scale` for
a task that starts within :data:`COLD_IDLE_S` of its worker's previous one,
:attr:`HostCosts.cold_task_scale` after a longer idle time. At a low rate nearly every task is
a cold one, near the capacity nearly none is. Parts differ more than that (unet_seg's second
part runs x1.2 its model where its first runs x0.95), and at a low rate the warm tasks are
nearly all later parts right behind the first on its worker, so the scales are kept per part
(:attr:`HostCosts.part_scales`, :attr:`HostCosts.part_cold_scales`): a first part running
warm at the knee keeps its own.

So the probe measures each batch size twice, at a light and at a loaded rate, and a simulation
at rate ``r`` takes the figures of ``r`` on a curve through both (:meth:`HostCosts.at_rate`,
beyond the loaded rate too); the LP bound, which is about the capacity, takes those of the rate
it finds (:func:`~staronnx.bench.bound.machine_bound`).

``staronnx calibrate`` measures them (:func:`staronnx.calibrate.calibrate_host`: a short
low-rate serving run per batch size through the real Server and runtime, traced) and keeps
them beside the plan's perf models (:meth:`PerfModelStore.save_host`), per worker layout and
batch size, as :class:`HostCosts`. The simulator and the LP bound read them
(:mod:`staronnx.bench.machine`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

#: a task that starts this long or longer after its worker's previous task ended runs at the
#: cold scale (:attr:`HostCosts.cold_task_scale`); sooner, at the warm one
COLD_IDLE_S = 2e-3


@dataclass(frozen=True)
class HostCosts:
    """What serving a batch of ``batch`` costs the host beyond its tasks' ONNX Runtime time
    (seconds; medians over the probe's batches, each measured on idle workers)."""

    batch: int
    #: the batch formed -> its first task starts: concatenation, submit, the policy, and the
    #: wake-up of an idle worker (:attr:`wake_s` of it)
    launch_s: float
    #: a task pushed to an idle worker -> it starts running (thread wake-up and the GIL): a
    #: successor on another worker than its predecessor's waits this long
    wake_s: float
    #: a task's end -> the next task of the same request on the same worker starts (the
    #: engine's bookkeeping between two tasks, no wake-up)
    gap_s: float
    #: the last task's end -> the batch's requests answered (split, futures settled)
    finish_s: float
    #: the load generator's mean lateness behind its schedule (counted in latencies, as live)
    lag_s: float
    #: host CPU per batch on the threads other than the workers' (the load generator, the
    #: batcher, the callers), of which :attr:`cpu_per_request_s` per request; the rest is per
    #: batch. What the workers' own threads do between tasks is :attr:`gap_s` and, where
    #: :attr:`finish_on_worker`, :attr:`finish_s`
    cpu_per_batch_s: float
    cpu_per_request_s: float = 0.0
    #: the tasks' wall time while serving over their perf models' mean (1: the models hold),
    #: for a task that starts within :data:`COLD_IDLE_S` of its worker's previous one
    task_scale: float = 1.0
    #: batches the medians are over
    batches: int = 0
    #: whether the batch's last worker answers it on its own thread (a runtime of CPU workers
    #: only: the Server splits and settles there), which keeps that worker from its next task
    #: for :attr:`finish_s`; else the batcher's thread does it
    finish_on_worker: bool = False
    #: the offered rate (requests/s) they were measured at (0: unknown, an older store)
    rate: float = 0.0
    #: the same figures measured at a lower rate (None: one load only); these are the loaded ones
    lighter: HostCosts | None = None
    #: the tasks' scale after their worker idled :data:`COLD_IDLE_S` or longer (None: as
    #: :attr:`task_scale`, a store written before it was measured)
    cold_task_scale: float | None = None
    #: per part of the plan (its local index), its tasks' warm and cold scales (empty: a store
    #: written before they were measured, every part at :attr:`task_scale` /
    #: :attr:`cold_scale`). Parts differ more than warm and cold do (unet_seg: its first part
    #: x0.93-0.98 its model, its second x1.19-1.25, warm or cold alike), and at a light load the
    #: warm tasks are nearly all a second part right behind its first on the same worker: one
    #: warm scale for every part would be the second part's, given to the first at the knee
    part_scales: tuple[float, ...] = ()
    part_cold_scales: tuple[float, ...] = ()

    @property
    def cold_scale(self) -> float:
        """The scale of a task that starts on a worker idle for :data:`COLD_IDLE_S` or more."""
        return self.task_scale if self.cold_task_scale is None else self.cold_task_scale

    def scale_after(self, idle_s: float, part: int | None = None) -> float:
        """The scale of a task of ``part`` (the plan's index; None: the tasks' overall) that
        starts ``idle_s`` after its worker's previous task."""
        cold = idle_s >= COLD_IDLE_S
        scales = self.part_cold_scales if cold else self.part_scales
        if part is not None and 0 <= part < len(scales):
            return scales[part]
        return self.cold_scale if cold else self.task_scale

    def warm_scale(self, part: int | None = None) -> float:
        """The scale of a task of ``part`` that starts right behind another on its worker (the
        LP bound's: at the capacity no worker idles)."""
        return self.scale_after(0.0, part)

    @property
    def submit_s(self) -> float:
        """The CPU part of :attr:`launch_s`: the batch's launch less the wake-up."""
        return max(self.launch_s - self.wake_s, 0.0)

    def cpu_split(self) -> tuple[float, float]:
        """(per request, per batch beyond its requests') host CPU seconds."""
        per_request = max(self.cpu_per_request_s, 0.0)
        return per_request, max(self.cpu_per_batch_s - per_request * self.batch, 0.0)

    def at_rate(self, rate: float) -> HostCosts:
        """The costs of serving ``rate`` requests/s: the lighter figures at or below their rate;
        above it each figure on ``a + c / rate`` through both measurements (at least 0): the
        share of batches that find their threads asleep (wake-ups, cold caches) falls with the
        rate, so a figure tends to what a batch costs threads that never sleep (``a``) and keeps
        falling past the loaded rate towards the capacity, where the simulator's knee and the
        LP bound need it. The generator's lag excepted: it is already in a simulation's arrival
        times, and barely moves with the load."""
        light = self.lighter
        if light is None or self.rate <= light.rate:
            return self
        if rate <= light.rate:
            return replace(light, lag_s=self.lag_s, lighter=None)
        inv_low, inv_high, inv = 1.0 / light.rate, 1.0 / self.rate, 1.0 / rate

        def at(low: float, high: float) -> float:
            c = (low - high) / (inv_low - inv_high)
            return max(high + c * (inv - inv_high), 0.0)

        # the figures blended between the two loads (named one by one: each is a float)
        return replace(
            self, rate=rate, lighter=None,
            launch_s=at(light.launch_s, self.launch_s), wake_s=at(light.wake_s, self.wake_s),
            gap_s=at(light.gap_s, self.gap_s), finish_s=at(light.finish_s, self.finish_s),
            cpu_per_batch_s=at(light.cpu_per_batch_s, self.cpu_per_batch_s),
            cpu_per_request_s=at(light.cpu_per_request_s, self.cpu_per_request_s),
            task_scale=at(light.task_scale, self.task_scale),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)  # (``lighter`` too, nested)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HostCosts:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known and k != "lighter"}
        if values.get("cold_task_scale") is None:
            values.pop("cold_task_scale", None)
        for k in _PER_PART:
            scales = values.get(k) or ()
            if not isinstance(scales, (list, tuple)):
                raise ValueError(f"host cost {k} must be a list of numbers (one per part), got {scales!r}")
            values[k] = tuple(scales)
        for k, v in values.items():
            if k in _PER_PART:
                bad = [x for x in v if not (isinstance(x, (int, float)) and math.isfinite(x) and x > 0)]
                if bad:
                    raise ValueError(f"host cost {k} must hold positive finite numbers, got {bad[0]!r}")
            elif k not in ("batch", "finish_on_worker") and not (isinstance(v, (int, float)) and math.isfinite(v)):
                raise ValueError(f"host cost {k} must be a finite number, got {v!r}")
        lighter = data.get("lighter")
        return cls(**values, lighter=None if lighter is None else cls.from_dict(lighter))

    def describe(self) -> str:
        """One line of what it says, in microseconds (the lighter load's figures after the
        loaded ones)."""
        at = f" (at {self.rate:.4g} req/s)" if self.rate else ""
        light = "" if self.lighter is None else f"; at {self.lighter.rate:.4g} req/s: " + self.lighter._figures()
        return f"b={self.batch}: {self._figures()}{at}{light}"

    def _figures(self) -> str:
        def xs(scales: tuple[float, ...], overall: float) -> str:
            return ", ".join(f"x{x:.3f}" for x in scales) if scales else f"x{overall:.3f}"

        per = " per part" if self.part_scales else ""
        return (f"launch {self.launch_s * 1e6:.0f} us (wake-up {self.wake_s * 1e6:.0f}), "
                f"same-worker gap {self.gap_s * 1e6:.0f} us, finish {self.finish_s * 1e6:.0f} us, generator lag "
                f"{self.lag_s * 1e6:.0f} us, host CPU {self.cpu_per_batch_s * 1e6:.0f} us a batch "
                f"({self.cpu_per_request_s * 1e6:.0f} a request), tasks {xs(self.part_scales, self.task_scale)} "
                f"their models{per}"
                + ("" if self.cold_task_scale is None and not self.part_cold_scales else
                   f" ({xs(self.part_cold_scales, self.cold_scale)} after the worker idled {COLD_IDLE_S * 1e3:g} ms)"))


#: the per-part figures (tuples, one per part of the plan)
_PER_PART = ("part_scales", "part_cold_scales")

@dataclass
class HostModel:
    """A plan's host costs on one worker layout, per batch size, with how they were taken."""

    workers: list[str]
    #: PUs the process could run on outside every CPU group (0: the host's threads share the
    #: workers' cores, and their CPU comes out of the workers' time)
    free_pus: int
    costs: dict[int, HostCosts] = field(default_factory=dict)
    #: the machine's load while they were measured (:class:`~staronnx.bench.cpuload.MachineLoad`
    #: as a dict), and while the plan's perf models were calibrated
    probe_machine: dict[str, Any] | None = None
    calibration_machine: dict[str, Any] | None = None
    measured_at: str | None = None

    @property
    def layout(self) -> str:
        return layout_key(self.workers)

    def at(self, batch: int) -> HostCosts | None:
        """The costs of the measured batch size nearest ``batch`` (on a log scale; ties: the
        larger), None when nothing was measured. A batch size between two measured ones takes
        the per-request CPU of the nearest and its other figures: the probe's sizes are the
        calibration's, so what serving runs was measured."""
        return self.costs[min(self.costs, key=lambda b: (abs(math.log(b / batch)), -b))] if self.costs else None

    def as_dict(self) -> dict[str, Any]:
        return {"workers": list(self.workers), "free_pus": self.free_pus,
                "costs": {str(b): c.as_dict() for b, c in sorted(self.costs.items())},
                "probe_machine": self.probe_machine, "calibration_machine": self.calibration_machine,
                "measured_at": self.measured_at}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HostModel:
        costs = {int(b): HostCosts.from_dict(c) for b, c in (data.get("costs") or {}).items()}
        return cls(list(data.get("workers") or []), int(data.get("free_pus") or 0), costs,
                   data.get("probe_machine"), data.get("calibration_machine"), data.get("measured_at"))


def layout_key(workers: list[str] | tuple[str, ...]) -> str:
    """The key host costs are kept under: the workers' names, in the runtime's order."""
    return ",".join(workers)
