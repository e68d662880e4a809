"""Was the machine ours while we measured? Other processes' CPU and the hypervisor's steal.

A sweep point, a calibration or a host-cost probe measures times; on a machine shared with other
work (a build, another benchmark, a neighbour VM) those times are the other work's as much as
ours, and a prediction compared with them looks wrong when the machine lied. So every
measurement reads ``/proc/stat`` (per CPU: busy and steal ticks) and this process's own CPU time
(every thread, :func:`os.times`) before and after, over the CPUs the process may run on
(:func:`os.sched_getaffinity`: the workers' cores and wherever the host's threads run), and
:func:`machine_load` says what others took:

- ``others_cpu_s``: the busy time of those CPUs (user, nice, system, irq, softirq) less this
  process's own CPU time: other processes and the kernel's own threads. A lower bound: where
  the process may run on more CPUs than it used, its own time is taken off all of them;
- ``steal_s``: time the hypervisor gave to other guests while these vCPUs wanted to run;
- ``own_cpu_s``: what the measured run itself used (its cores' worth: ``own_cores``).

A measurement is **busy** when others and steal together took more than :data:`BUSY_SHARE` of
the CPUs' time (over at least :data:`MIN_CAPACITY_S` CPU-seconds: shorter, ticks are noise) (on a quiet VM the kernel's threads and daemons take about 1 %; one other busy
process on 2 cores takes 50 %). Where ``/proc/stat`` cannot be read (not Linux), nothing is
said: :func:`snapshot` returns None and so does :func:`machine_load`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

#: others' CPU plus steal, as a share of the measured CPUs' time, above which a measurement is
#: called busy
BUSY_SHARE = 0.05

#: CPU-seconds a reading must span to say anything: /proc/stat counts 10 ms ticks, so over a
#: few ticks one tick is tens of per cent
MIN_CAPACITY_S = 0.5

#: /proc/stat columns after the cpu name: user nice system idle iowait irq softirq steal ...
_BUSY_COLUMNS = (0, 1, 2, 5, 6)
_STEAL_COLUMN = 7


@dataclass(frozen=True)
class CpuSnapshot:
    """Cumulative CPU times at one moment (seconds)."""

    wall: float  # time.monotonic()
    busy: dict[int, float]  # cpu -> busy seconds so far (user, nice, system, irq, softirq)
    steal: dict[int, float]  # cpu -> seconds stolen by the hypervisor so far
    own: float  # this process's CPU seconds so far (user + system, every thread)


def parse_proc_stat(text: str, tick: float) -> tuple[dict[int, float], dict[int, float]]:
    """(busy, steal) seconds per CPU from the text of ``/proc/stat`` (``cpuN`` lines; ``tick``:
    seconds per clock tick)."""
    busy: dict[int, float] = {}
    steal: dict[int, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            cpu = int(name[3:])
            ticks = [int(x) for x in rest.split()]
        except ValueError:
            continue
        busy[cpu] = sum(ticks[i] for i in _BUSY_COLUMNS if i < len(ticks)) * tick
        steal[cpu] = (ticks[_STEAL_COLUMN] if len(ticks) > _STEAL_COLUMN else 0) * tick
    return busy, steal


def _read_proc_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


def _own_cpu() -> float:
    """This process's CPU seconds, every thread (dead ones too), to the microsecond (getrusage
    sums the scheduler's own accounting, where os.times counts 10 ms ticks)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def thread_cpu(native_ids: Collection[int]) -> dict[int, float]:
    """CPU seconds so far of each of this process's threads in ``native_ids`` that is alive
    (``/proc/self/task/<id>/schedstat``: the scheduler's nanoseconds on a CPU)."""
    out = {}
    for tid in native_ids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return out


def compute_threads(worker_names: Collection[str]) -> set[int]:
    """The native ids of the threads that compute: the Python threads named after a worker
    (the engine names each worker's thread after it) and every thread Python does not know
    (ONNX Runtime's intra-op pools). What is left of the process's CPU is the host's: the load
    generator, the batcher, the callers."""
    import threading

    python = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    try:
        alive = {int(x) for x in os.listdir("/proc/self/task")}
    except OSError:
        return set()
    names = set(worker_names)
    return {tid for tid in alive if tid not in python or python[tid] in names}


def _clock() -> float:
    return time.monotonic()


def snapshot(read: Callable[[], str] | None = None, own: Callable[[], float] | None = None,
             clock: Callable[[], float] | None = None) -> CpuSnapshot | None:
    """The CPU times now, None where ``/proc/stat`` cannot be read. ``read``, ``own`` and
    ``clock`` stand in for the kernel (an injected reading); by default the module's readers,
    looked up at each call."""
    try:
        text = (read or _read_proc_stat)()
        tick = 1.0 / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    busy, steal = parse_proc_stat(text, tick)
    if not busy:
        return None
    return CpuSnapshot((clock or _clock)(), busy, steal, float((own or _own_cpu)()))


@dataclass(frozen=True)
class MachineLoad:
    """What the CPUs did between two snapshots, and whether others took a share worth saying."""

    seconds: float
    cpus: tuple[int, ...]
    own_cpu_s: float
    others_cpu_s: float
    steal_s: float
    busy: bool
    why: str | None  # one line when busy

    @property
    def capacity_s(self) -> float:
        """The CPUs' time over the interval (CPU-seconds)."""
        return self.seconds * len(self.cpus)

    @property
    def others_share(self) -> float:
        return self.others_cpu_s / self.capacity_s if self.capacity_s > 0 else 0.0

    @property
    def steal_share(self) -> float:
        return self.steal_s / self.capacity_s if self.capacity_s > 0 else 0.0

    @property
    def own_cores(self) -> float:
        """Cores' worth of CPU the measured run used (own CPU seconds per second)."""
        return self.own_cpu_s / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (what ``results.json`` keeps per point)."""
        return {"seconds": self.seconds, "cpus": list(self.cpus), "own_cpu_s": self.own_cpu_s,
                "own_cores": self.own_cores, "others_cpu_s": self.others_cpu_s, "others_share": self.others_share,
                "steal_s": self.steal_s, "steal_share": self.steal_share, "busy": self.busy, "why": self.why}


def machine_load(before: CpuSnapshot | None, after: CpuSnapshot | None, cpus: Collection[int] | None = None,
                 threshold: float = BUSY_SHARE) -> MachineLoad | None:
    """Others' CPU, steal and our own between two snapshots over ``cpus`` (default: the CPUs
    this process may run on, those both snapshots know); None without both snapshots."""
    if before is None or after is None:
        return None
    allowed = set(os.sched_getaffinity(0)) if cpus is None else set(cpus)
    chosen = tuple(sorted(c for c in allowed if c in before.busy and c in after.busy))
    seconds = max(after.wall - before.wall, 0.0)
    if not chosen or seconds <= 0:
        return None
    busy = sum(after.busy[c] - before.busy[c] for c in chosen)
    steal = sum(after.steal.get(c, 0.0) - before.steal.get(c, 0.0) for c in chosen)
    own = max(after.own - before.own, 0.0)
    others = max(busy - own, 0.0)
    capacity = seconds * len(chosen)
    share = (others + steal) / capacity
    why = None
    if capacity < MIN_CAPACITY_S:  # too short to tell a tick from a neighbour
        share = 0.0
    if share > threshold:
        parts = [f"other processes used {others:.2f} of {capacity:.2f} CPU-seconds ({others / capacity:.0%})"]
        if steal > 0:
            parts.append(f"the hypervisor stole {steal / capacity:.0%}")
        why = f"measured beside other work on CPU(s) {','.join(map(str, chosen))}: {', '.join(parts)}"
    return MachineLoad(seconds, chosen, own, others, max(steal, 0.0), share > threshold, why)


class LoadWatch:
    """A snapshot now, :meth:`stop` later: ``with LoadWatch() as w: ...; w.load``."""

    def __init__(self, cpus: Collection[int] | None = None, read: Callable[[], str] | None = None,
                 own: Callable[[], float] | None = None) -> None:
        self.cpus = cpus
        self._read, self._own = read, own
        self.before = snapshot(read, own)
        self.load: MachineLoad | None = None

    def stop(self) -> MachineLoad | None:
        self.load = machine_load(self.before, snapshot(self._read, self._own), self.cpus)
        return self.load

    def __enter__(self) -> LoadWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
