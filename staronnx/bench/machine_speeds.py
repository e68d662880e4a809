"""Per-worker speeds of a whole model, read from the calibrated perf models of a 1-part plan.

``staronnx partition --shares auto --speeds-from PLAN`` chooses its split from these rather
than from a fresh timing: calibration measured every worker arch with the runtime's own
workers (CUDA streams, pinned CPU groups), many samples each, which is what the split will run on.
"""

from __future__ import annotations

from staronnx.bench.machine import SimulationError, build_machine
from staronnx.partition.autoshares import WorkerSpeed
from staronnx.perfmodels import PerfModelStore
from staronnx.plan import Plan
from staronnx.workers.layout import MachineSpec

__all__ = ["speeds_from_plan"]


def speeds_from_plan(plan: Plan, machine: MachineSpec = MachineSpec(), *, batch: int,
                     store: PerfModelStore | None = None) -> list[WorkerSpeed]:
    """One :class:`WorkerSpeed` per worker arch of the runtime ``machine`` starts for ``plan``:
    one per GPU, from its own models."""
    if plan.k != 1:
        why = f"a 1-part plan of the model (partition it with {{}} and calibrate it); {plan.root} has {plan.k} parts"
        raise SimulationError("speeds_from_plan needs " + why.format("parts=1"),
                              cli="--speeds-from needs " + why.format("--parts 1"))
    twin = build_machine(plan, machine, store=store, cpu_fallback=False)
    times = twin.mean_times(batch)[0]
    by_arch: dict[str, WorkerSpeed] = {}
    for worker, seconds in zip(twin.workers, times):
        seen = by_arch.get(worker.arch)
        count = 1 if worker.kind == "cuda" else (seen.count + 1 if seen else 1)
        by_arch[worker.arch] = WorkerSpeed(worker.arch, worker.kind, float(seconds), count)
    return list(by_arch.values())
