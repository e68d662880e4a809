"""What a task run by a CPU group costs the GPU beside it: the perf model of CPU help.

A policy that weighs a CPU group against a GPU by their predicted end times alone treats the CPU
as free for the GPU. It is not. While a CPU group runs a task, the GPU's driver thread shares the
host with it: the GIL between ONNX Runtime calls, the host core and memory bandwidth the CPU
group's threads take, the hand-over of one more task; and a task whose inputs live in a GPU's
memory is copied out over the GPU's bus (the copy is driven by that GPU's driver thread). On the
H200 of 2026-11-28 (googlenet fp32, 16 host cores) that cost was larger than the help:
``gpu+cpu`` ran 0.92x the GPU alone at batch 32 with 4 streams, 0.66x at batch 1 with 8.

So each CPU task is charged, on the GPU side, :meth:`HelpCost.gpu_seconds`:

    ``host_share x L_cpu + task_s + copies out of the GPU's memory``

and it frees, on the GPU, the device time the task would have taken there, ``L_gpu / streams``
(a GPU's streams overlap, so one stream's task holds ``1/streams`` of the device).  A CPU group
takes a task only where it finishes earlier there *and* the GPU side finishes its own work
earlier (:func:`helped_end`): where the cost is at least the device time freed, the GPU alone
would have done the work sooner, whatever the CPU's queue says.

``host_share`` is the fraction of the GPU side's throughput a running CPU task takes. Its default
is what the H200 row at batch 32 says: the CPU group ran about 400 samples/s (the 7 % tail
``--shares auto`` chose at batch 8 with a predicted +4.9 % solves to 50 batches/s of 8), so had
it run all the time, ``7,334 = 400 + 7,998 x (1 - f)`` gives ``f = 0.13``. A machine measures its
own (the GPU's throughput with the CPU groups idle and busy), stores it
(:meth:`~staronnx.perfmodels.store.PerfModelStore.save_help_cost`; the predictor reads it and the
policies charge it), or passes it as the policy option ``help_cost``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["HelpCost", "H200_HOST_SHARE", "gpu_task_scale", "helped_end"]

#: the share of the GPU side's throughput a running CPU task took on the H200 (see the module)
H200_HOST_SHARE = 0.13
#: a task's fixed host cost (decision, hand-over, wake-up): autoshares' FIXED_TASK_SECONDS
TASK_SECONDS = 100e-6


@dataclass(frozen=True)
class HelpCost:
    """The GPU-side cost of one CPU task (see the module docstring): the option ``help_cost`` of
    the dmda family and heft, else the host's stored one, else this default (the H200's)."""

    #: fraction of the GPU side's throughput lost while a CPU task runs (GIL, host core, memory)
    host_share: float = H200_HOST_SHARE
    #: the driver's host time per extra task (a decision, a hand-over, a wake-up)
    task_s: float = TASK_SECONDS

    def __post_init__(self) -> None:
        if not (math.isfinite(self.host_share) and 0.0 <= self.host_share < 1.0):
            raise ValueError(f"help_cost host_share must be in [0, 1), got {self.host_share!r}")
        if not (math.isfinite(self.task_s) and self.task_s >= 0.0):
            raise ValueError(f"help_cost task_s must be finite and >= 0, got {self.task_s!r}")

    def as_dict(self) -> dict[str, float]:
        return {"host_share": self.host_share, "task_s": self.task_s}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HelpCost:
        """From :meth:`as_dict`'s fields (others, such as a store file's header, are ignored); a
        ValueError names what is missing (the store then warns once and charges the default,
        where a KeyError ended ``partition --shares auto`` in a traceback)."""
        if "host_share" not in data:
            raise ValueError("a help cost needs host_share")
        return cls(host_share=float(data["host_share"]), task_s=float(data.get("task_s", TASK_SECONDS)))

    @classmethod
    def free(cls) -> HelpCost:
        """No cost: StarPU's decision, for a host where CPU help costs the GPU nothing."""
        return cls(host_share=0.0, task_s=0.0)

    def gpu_seconds(self, cpu_length: float, copies_out_of_gpu: float = 0.0) -> float:
        """GPU-side time one CPU task of ``cpu_length`` seconds costs, with
        ``copies_out_of_gpu`` the bus time of its inputs copied from a GPU's memory (the bus
        model's price, :meth:`~staronnx.perfmodels.bus.BusModel.predict`)."""
        return self.host_share * cpu_length + self.task_s + max(copies_out_of_gpu, 0.0)


def helped_end(cpu_end: float, gpu_end: float, gpu_device_s: float, cost: float) -> float:
    """The end a CPU candidate is weighed by: when the work in flight is done if it takes the
    task, ``max(cpu_end, gpu_end - gpu_device_s + cost)``, against ``gpu_end`` if the GPU
    does (``gpu_device_s``: the device time the task takes the GPU; ``cost``:
    :meth:`HelpCost.gpu_seconds`). Infinite where the cost is at least the device time freed:
    the GPU alone would have finished sooner, so the CPU is no candidate at all."""
    if not (cost < gpu_device_s):
        return math.inf
    return max(cpu_end, gpu_end - gpu_device_s + cost)


def gpu_task_scale(cost: HelpCost | None, cpu_tasks_running: int) -> float:
    """How much longer a GPU task takes while ``cpu_tasks_running`` CPU tasks run beside it:
    ``1 / (1 - host_share x n)`` (the GPU side keeps ``1 - host_share`` of its throughput per
    running CPU task; capped at 10x). What a simulator multiplies a GPU task's time by, so
    that it predicts the loss the policies' estimate avoids (1.0 without a cost or a CPU task)."""
    if cost is None or cpu_tasks_running <= 0:
        return 1.0
    return 1.0 / (1.0 - min(cost.host_share * cpu_tasks_running, 0.9))
