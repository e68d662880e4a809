"""Latency lanes: a worker of its own for a latency-bound model, that the OS lets preempt the others.

A task scheduler cannot preempt a task that already runs: ONNX Runtime gives no way to stop a
``Run()`` halfway. So on a runtime shared by a heavy model flooding every CPU group and a light
model with a latency target, a light request waits, at best (EDF), for the heavy task in
front of it to end: tens of ms for a googlenet part, where the light model computes in one.
Separate runtimes (Triton's instance groups) escape that only by oversubscribing the cores:
the OS time-slices the two models' threads, so the light task starts at once but runs at half
speed beside the heavy one.

A lane keeps both halves of that and drops the cost: each selected CPU group gets one more
worker (``lane:<group>``, a thread pinned to the same cores) that holds only the lane models,
and the group's own worker runs at a lower OS priority, set in its thread before its sessions
exist so that ONNX Runtime's pool threads inherit it. When a lane task arrives, the kernel
preempts the heavy task for it, and the heavy task resumes where it stopped; the lane is idle
the rest of the time, so the heavy model keeps its throughput. How much lower (``preempt``):

- ``idle`` (default): the shared workers run as ``SCHED_IDLE``, which any other thread preempts
  at its wake-up. Measured on the 2-core VM (googlenet saturating both cores, a light CNN at
  20/s): the lane's wake-up waited up to 4-8 ms on the run queue at ``nice`` +10 and almost
  never under ``SCHED_IDLE``. The cost: every other busy process of the machine also comes
  first, so use it where the machine serves.
- ``nice``: ``nice`` +:data:`LANE_NICE`: a runnable lane weighs 1024 against 110 (90 % of the
  core), but the kernel may let the heavy task finish its time slice first (a scheduler tick,
  4 ms at 250 Hz): for machines shared with other work.

Only priorities are *lowered*: an unprivileged process may do that, never raise one, so lanes
work without root or ``CAP_SYS_NICE``. The GIL is the other wait: a lane thread that wakes needs
it, and a thread running Python holds it up to the interpreter's switch interval (5 ms), so
whoever serves a runtime with lanes shortens that interval to :data:`LANE_SWITCH_INTERVAL`
while it serves (``with short_switch_interval():``; ``staronnx serve --lane`` does): a
process-wide setting is the caller's choice, not a ``Runtime``'s side effect. On that VM a
waking lane also waited up to 5 ms for the GIL; with both remedies ``benchmarks/multi_model.py``
gives the light model a p99 of 3.2-4.2 ms against 7.5-8.0 ms with separate runtimes, the heavy
model keeping 0.96x their throughput.

The lane is a worker like any other for the scheduler: same arch (it shares the group's perf
models) and its own queue. A model with lanes runs on its lanes only: on a group's shared
worker its task would wait for the heavy task running there and then run at that worker's
lowered priority (a policy that believes an overrunning heavy task is about to end would
send it there). ``--model-workers NAME=lane,cpu`` lets the shared workers run it too.

On the command line: ``staronnx serve a/ b/ --lane b`` (every CPU group) or ``--lane
b=cpu:pus0`` (those groups); ``Runtime(..., lanes={"b": "cpu"})`` in Python. CUDA workers get no
lane (a GPU's equivalent would be a stream of higher priority).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from staronnx.process_settings import SharedSetting
from staronnx.workers.residency import ResidencyError, WorkerSlot, check_models, parse_named, selected

__all__ = ["LANE_NICE", "LANE_PREEMPT", "LANE_SWITCH_INTERVAL", "LanePlan", "check_preempt", "lower_priority",
           "parse_lanes", "plan_lanes", "short_switch_interval"]

log = logging.getLogger(__name__)

#: how much lower the shared workers of a group with a lane run under ``preempt="nice"``
#: (``nice`` increment): at 10 a runnable lane thread weighs 1024/(1024+110) = 90 % of the core
LANE_NICE = 10
#: how a group's shared workers yield to its lane: ``idle`` (SCHED_IDLE) or ``nice`` (+LANE_NICE)
LANE_PREEMPT = ("idle", "nice")
#: the interpreter's switch interval while a runtime with lanes serves (seconds)
LANE_SWITCH_INTERVAL = 0.0005


def parse_lanes(items: Iterable[str]) -> dict[str, str]:
    """``NAME`` or ``NAME=CPU_GROUPS`` options (the CLI's ``--lane``) as {model: selector}; a bare
    name means every CPU group (``cpu``)."""
    return parse_named(items, "--lane", "NAME or NAME=CPU_GROUPS (e.g. ocr or ocr=cpu:numa0)", "cpu")


@dataclass(frozen=True)
class LanePlan:
    """Which CPU groups get a lane and which models each lane holds."""

    #: per lane, in group order: (index of its CPU group's slot, the models it holds)
    lanes: tuple[tuple[int, tuple[str, ...]], ...]

    @property
    def groups(self) -> frozenset[int]:
        """The CPU slots whose workers run lowered (they share their cores with a lane)."""
        return frozenset(slot for slot, _ in self.lanes)


def plan_lanes(lanes: Mapping[str, str], model_names: Sequence[str], cpu_slots: Sequence[WorkerSlot]) -> LanePlan:
    """The lanes that ``lanes`` (model -> CPU group selector) asks for, one per selected group,
    holding every lane model that selects it. Refuses an unknown model, a runtime with a
    single model (a lane preempts *other* models' tasks), a selector that names no CPU group
    (CUDA workers have no lane) and a runtime without CPU groups, naming what exists."""
    if not lanes:
        return LanePlan(())
    check_models("--lane", lanes, model_names)
    if len(model_names) < 2:
        raise ResidencyError("--lane gives a model a worker that preempts the other models' tasks: it needs a runtime "
                             "shared by several models")
    if set(lanes) >= set(model_names):
        raise ResidencyError("--lane names every model: a lane preempts the models without one, so at least one "
                             "model must stay off the lanes")
    if not cpu_slots:
        raise ResidencyError("--lane needs CPU groups: lanes are CPU workers (this runtime has CUDA workers only)")
    names = ", ".join(s.name for s in cpu_slots)
    per_group: dict[int, list[str]] = {}
    for model, selector in lanes.items():
        for i in selected(f"--lane {model}={selector}", selector, cpu_slots,
                          f"names no CPU group (CPU groups: {names}; or cpu; CUDA workers get no lane)"):
            per_group.setdefault(i, []).append(model)
    return LanePlan(tuple((i, tuple(per_group[i])) for i in sorted(per_group)))


def check_preempt(preempt: str) -> str:
    """``preempt`` if it is one of :data:`LANE_PREEMPT`, else a clear error."""
    if preempt not in LANE_PREEMPT:
        raise ResidencyError(f"--lane-preempt takes {' or '.join(LANE_PREEMPT)}, got {preempt!r}")
    return preempt


def lower_priority(preempt: str, who: str) -> str | None:
    """Lower the calling thread's OS priority below a lane's (Linux: scheduling policy and
    ``nice`` are per thread, and threads it creates inherit them): ``idle`` makes it
    ``SCHED_IDLE``, ``nice`` adds :data:`LANE_NICE` to its nice value. Returns what it now runs
    as (``"SCHED_IDLE"``, ``"nice 10"``), or None where the OS refuses (the lane then still gets
    a thread of its own, only not a head start). ``who`` names the worker in the warning."""
    check_preempt(preempt)
    tid = threading.get_native_id()
    try:
        if preempt == "idle":
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return "SCHED_IDLE"
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(now + LANE_NICE, 19))
        return f"nice {os.getpriority(os.PRIO_PROCESS, tid)}"
    except (OSError, AttributeError) as exc:  # not Linux, or a sandbox without these calls
        log.warning("%s: cannot lower its priority for the lanes beside it (%s); lane tasks will share "
                    "its cores instead of preempting it", who, exc)
        return None


def _short_interval() -> float:
    found = sys.getswitchinterval()
    sys.setswitchinterval(min(found, LANE_SWITCH_INTERVAL))
    return found


#: the interpreter's switch interval at most :data:`LANE_SWITCH_INTERVAL` while held
#: (process-wide, so counted: the last of nested or concurrent users restores the value the
#: first found)
short_switch_interval = SharedSetting(_short_interval, sys.setswitchinterval).held
