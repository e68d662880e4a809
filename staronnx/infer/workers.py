"""The CPU workers a batch-inference job runs on when the user names none (``--groups auto``).

A server answers requests one batch at a time and wants each batch fast: one worker per NUMA
node, its session's intra-op threads spread over the node's cores. An offline job wants rows
per second, and there a worker per core does more work with the same cores: each core runs its
own batch, with no intra-op split to wait on and no pool thread spinning while another is
behind, and a core the job's reader or writer takes for a moment slows one batch, not all of
them (the advice ONNX Runtime gives for throughput: several sessions of one thread each). On
the 2-core development machine, per-core workers with two batches each ran jobs at 1.04x
(crnn_ocr, the ranges of 5 rounds apart), 1.06x (unet_seg) and 1.02x (googlenet) the samples/s
of one two-core worker with two batches in flight, the default before
(``benchmarks/results/infer-groups-2026-12-07.json``).

Each worker holds a session of every part, so the number of workers is bounded by memory: the
groups are as small as the sessions allow within :data:`MEMORY_SHARE` of the memory available,
and one per NUMA node where even that does not fit. A job with CUDA workers keeps one CPU group
per NUMA node: beside a GPU, a CPU worker is worth its place only when it is fast on one batch.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from staronnx.plan import Plan
from staronnx.workers.groups import make_groups
from staronnx.workers.layout import MachineSpec
from staronnx.workers.topology import Topology

#: the groups policy that :func:`job_machine` resolves for the job
AUTO = "auto"
#: the share of the available memory the workers' sessions may take together
MEMORY_SHARE = 0.5
#: a session's memory: its model files' bytes times this (the weights, ORT's prepacked copies,
#: the activations' arena) plus :data:`SESSION_BASE_BYTES`. Measured as a second worker's peak
#: RSS in a job at batch 8: googlenet (26.5 MB of file) +97 MB, crnn_ocr (0.9 MB) +9 MB
SESSION_OVER_FILES = 4.0
SESSION_BASE_BYTES = 16 << 20


def job_machine(machine: MachineSpec, plan: Plan, topology: Topology | None = None,
                available_bytes: int | None = None) -> MachineSpec:
    """``machine`` with its ``auto`` groups replaced by :func:`throughput_groups`'s (any other
    policy is the user's and kept)."""
    if machine.groups != AUTO:
        return machine
    if machine.cuda_streams:
        return replace(machine, groups="numa")
    return replace(machine, groups=throughput_groups(plan_bytes(plan), topology, available_bytes))


def throughput_groups(session_files_bytes: int, topology: Topology | None = None,
                      available_bytes: int | None = None) -> str:
    """The smallest groups (``cores=1``, ``cores=2``, ``cores=4``, ...) whose sessions, one per
    group of ``session_files_bytes`` of model files each, fit in :data:`MEMORY_SHARE` of
    ``available_bytes`` (this machine's available memory by default); ``numa`` where none do."""
    topology = topology or Topology.from_system()
    budget = MEMORY_SHARE * (available_bytes if available_bytes is not None else available_memory())
    per_session = SESSION_OVER_FILES * session_files_bytes + SESSION_BASE_BYTES
    widest = max((group.n_cores for group in make_groups(topology, "numa")), default=1)
    size = 1
    while size < widest:
        if len(make_groups(topology, f"cores={size}")) * per_session <= budget:
            return f"cores={size}"
        size *= 2
    return "numa"


def default_window(workers: int) -> int:
    """Batches a job keeps in flight when the user gives no ``max_in_flight``: two per worker, so
    each worker has its next batch queued as it ends one."""
    return max(2, 2 * workers)


def plan_bytes(plan: Plan) -> int:
    """The bytes of the plan's model files (its parts and their external data)."""
    return sum(p.stat().st_size for p in Path(plan.root).iterdir() if p.is_file() and p.name != "plan.json")


def available_memory() -> int:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable``; all of the
    physical memory where /proc is not there to say)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

