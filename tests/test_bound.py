"""The LP throughput bound on cases small enough to solve by hand."""

from __future__ import annotations

import math

import pytest

from staronnx.bench.bound import BoundError, FlowTensor, lp_bound
from staronnx.runtime.sched import WorkerInfo

MS = 1e-3
GPU = WorkerInfo(0, "gpu", "cuda0", "cuda", "cuda0")
CPU = WorkerInfo(1, "cpu", "cpu4", "cpu", "numa0", ncores=4)


def test_one_part_on_two_identical_workers():
    bound = lp_bound([[10 * MS, 10 * MS]], batch_size=4)
    assert bound.throughput == pytest.approx(2 * 4 / (10 * MS))
    assert bound.batches_per_s == pytest.approx(200)
    assert sum(bound.assignment.values()) == pytest.approx(1.0)
    assert {b.name for b in bound.binding} == {"worker w0", "worker w1"}
    assert all(u == pytest.approx(1.0) for u in bound.utilization.values())


@pytest.mark.parametrize("a, c", [(4 * MS, 2 * MS), (1 * MS, 9 * MS), (5 * MS, 5 * MS)])
def test_a_two_part_chain_on_two_identical_workers(a, c):
    bound = lp_bound([[a, a], [c, c]], batch_size=8)
    assert bound.throughput == pytest.approx(8 / ((a + c) / 2))


def test_the_gpu_keeps_the_part_it_is_best_at_and_shares_the_other():
    # part 0: 10x faster on the GPU, part 1: 3x; the CPU should take part 1 only
    bound = lp_bound([[1 * MS, 10 * MS], [1 * MS, 3 * MS]], 1, [GPU, CPU])
    # GPU: R + (R - s) <= 1000 with s = part-1 batches/s on the CPU <= 1000/3
    assert bound.throughput == pytest.approx(2000 / 3)
    assert bound.assignment[(0, "gpu")] == pytest.approx(1.0)
    assert bound.assignment[(1, "cpu")] == pytest.approx(0.5)
    assert bound.arch_share() == pytest.approx({(0, "cuda0"): 1.0, (1, "cpu4"): 0.5, (1, "cuda0"): 0.5})
    prices = {b.name: b.shadow_price for b in bound.binding}
    # one more second per second of GPU: +500 samples/s; of CPU: +1000/6
    assert prices == pytest.approx({"worker gpu": 500.0, "worker cpu": 1000 / 6})


def test_a_worker_that_cannot_run_a_part_is_skipped_for_it():
    bound = lp_bound([[10 * MS, math.nan], [5 * MS, 5 * MS]], 1)
    # w0 must run all of part 0 (10 ms per batch: R <= 100) and leaves part 1 to w1 (5 ms)
    assert bound.assignment.get((0, "w1"), 0.0) == 0.0
    assert bound.batches_per_s == pytest.approx(100.0)
    assert bound.assignment[(1, "w1")] == pytest.approx(1.0)
    with pytest.raises(BoundError, match="part 0"):
        lp_bound([[math.nan, math.inf]], 1)


def test_degenerate_inputs_are_refused():
    with pytest.raises(BoundError, match="unbounded"):
        lp_bound([[0.0]], 1)
    with pytest.raises(BoundError):
        lp_bound([], 1)
    with pytest.raises(BoundError, match="batch_size"):
        lp_bound([[1.0]], 0)
    with pytest.raises(BoundError, match="workers"):
        lp_bound([[1.0, 1.0]], 1, [GPU])


NUMA0 = WorkerInfo(0, "a", "cpu1", "cpu", "numa0")
NUMA1 = WorkerInfo(1, "b", "cpu1", "cpu", "numa1")


def test_copies_to_another_memory_node_lower_the_bound():
    times = [[10 * MS, 10 * MS]]
    x = [FlowTensor("x", 1000, None, (0,))]
    free = lp_bound(times, 1, [NUMA0, NUMA1], tensors=x)
    assert free.throughput == pytest.approx(200)
    costly = lp_bound(times, 1, [NUMA0, NUMA1], tensors=x, transfer=lambda s, d, n: 5 * MS)
    # the numa1 worker spends 10 + 5 ms per batch: 100 + 66.7 batches/s
    assert costly.throughput == pytest.approx(100 + 1000 / 15)
    assert costly.transfers[("x", "numa1")] == pytest.approx(1000 / 15)
    assert any(b.kind == "node" and "numa1" in b.name for b in costly.binding)


def test_a_crossing_tensor_is_copied_only_when_its_parts_are_split_across_nodes():
    # a chain: keeping both parts of a batch on one node avoids every copy but the input's
    times = [[4 * MS, 4 * MS], [4 * MS, 4 * MS]]
    tensors = [FlowTensor("x", 100, None, (0,)), FlowTensor("h", 100, 0, (1,))]
    bound = lp_bound(times, 1, [NUMA0, NUMA1], tensors=tensors, transfer=lambda s, d, n: 1 * MS)
    # numa0: whole chains at 8 ms; numa1: whole chains at 8 ms + 1 ms for the input
    assert bound.throughput == pytest.approx(1000 / 8 + 1000 / 9)
    assert ("h", "numa0") not in bound.transfers and ("h", "numa1") not in bound.transfers


def test_one_memory_node_is_exact_whatever_the_bus_says():
    times = [[4 * MS, 6 * MS], [2 * MS, 3 * MS]]
    tensors = [FlowTensor("x", 10**6, None, (0,)), FlowTensor("h", 10**6, 0, (1,))]
    plain = lp_bound(times, 2, [NUMA0, WorkerInfo(1, "c", "cpu1", "cpu", "numa0")])
    priced = lp_bound(times, 2, [NUMA0, WorkerInfo(1, "c", "cpu1", "cpu", "numa0")], tensors=tensors,
                      transfer=lambda s, d, n: 1.0)
    assert priced.throughput == pytest.approx(plain.throughput)
    # the parts have the same speed ratio on both workers: each runs whole chains (6 and 9 ms)
    assert plain.throughput == pytest.approx(2 * (1 / (6 * MS) + 1 / (9 * MS)))
