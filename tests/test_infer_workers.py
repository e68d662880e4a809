"""The CPU workers ``staronnx infer`` runs on when the user names none (``--groups auto``,
:mod:`staronnx.infer.workers`): a worker per core where the sessions fit in memory, wider
groups where they do not, one per NUMA node beside CUDA workers, and the user's own policy kept.
Synthetic hwloc topologies and given memory sizes, so the answers hold on any host."""

from __future__ import annotations

import pytest

from staronnx.infer.workers import AUTO, job_machine, plan_bytes, throughput_groups
from staronnx.workers.groups import make_groups
from staronnx.workers.layout import MachineSpec
from staronnx.workers.topology import Topology

MB = 1 << 20
ONE_NODE = Topology.from_synthetic("pack:1 numa:1 core:8 pu:1")
TWO_NODES = Topology.from_synthetic("pack:2 numa:1 core:4 pu:2")


#: model files whose sessions take 400 MiB each (4 x 96 MiB + 16 MiB)
FILES = 96 * MB


@pytest.mark.parametrize(("available", "want"), [
    (10_000 * MB, "cores=1"),  # 8 sessions (3,200 MiB) in half of it
    (1_600 * MB, "cores=4"),   # 8 or 4 sessions do not fit in 800 MiB, 2 do exactly
    (1_500 * MB, "numa"),      # not even 2: one worker for the node
    (200 * MB, "numa"),
])
def test_groups_are_as_narrow_as_the_memory_allows(available, want):
    assert throughput_groups(FILES, ONE_NODE, available) == want


def test_groups_never_cross_a_numa_node():
    """Two nodes of 4 cores: per core first; then pairs; then one group per node (cores=4 is
    the node, so it is said as numa)."""
    assert throughput_groups(FILES, TWO_NODES, 10_000 * MB) == "cores=1"
    assert len(make_groups(TWO_NODES, "cores=1")) == 8
    assert throughput_groups(FILES, TWO_NODES, 3_200 * MB) == "cores=2"  # 4 x 400 MiB in 1,600 MiB
    assert throughput_groups(FILES, TWO_NODES, 1_000 * MB) == "numa"


def test_a_users_policy_and_cuda_workers_keep_their_groups(tmp_path):
    """``auto`` is resolved only when asked for; beside CUDA workers it is one group per node."""
    import realmodels
    from staronnx.infer import plan_for

    plan = plan_for(realmodels.path("crnn_ocr"))
    assert plan_bytes(plan) >= realmodels.path("crnn_ocr").stat().st_size
    mine = MachineSpec("0")
    assert job_machine(mine, plan) is mine
    assert job_machine(MachineSpec(AUTO, cuda_streams=2), plan).groups == "numa"
    assert job_machine(MachineSpec(AUTO), plan, ONE_NODE, 10_000 * MB).groups == "cores=1"
    assert job_machine(MachineSpec(AUTO), plan, ONE_NODE, 1 * MB).groups == "numa"
