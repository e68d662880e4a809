"""Memory nodes, measured copies and bus calibration (staronnx.workers.memory).

Host<->host copies and calibration run for real.  The host<->GPU code paths run with
:class:`~staronnx.workers.cudart.HostRuntime` (host memory standing in for pinned and device
buffers), which checks their bookkeeping, not CUDA itself.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from staronnx.perfmodels.bus import BusModel
from staronnx.workers.cudart import CudaError, HostRuntime
from staronnx.workers.memory import (
    CopyLog,
    CopyRecord,
    HostAllocator,
    MemoryNode,
    calibrate_bus,
    memory_nodes,
)
from staronnx.workers.topology import Topology

# Small calibrations: the tests check the plumbing, not this machine's bus.
SMALL_BW, SMALL_REPEATS = 1 << 20, 4


# ---------------------------------------------------------------- naming
def test_nodes_are_named_like_the_bus_model() -> None:
    assert MemoryNode("host", 0).name == "numa0"
    assert MemoryNode("cuda", 3).name == "cuda3"
    assert str(MemoryNode("host", 1)) == "numa1"
    assert MemoryNode("host", 1).is_host and not MemoryNode("host", 1).is_cuda
    assert MemoryNode("cuda", 0).is_cuda


@pytest.mark.parametrize("name", ["numa0", "numa12", "cuda0", "cuda7"])
def test_parse_round_trips(name: str) -> None:
    assert MemoryNode.parse(name).name == name
    node = MemoryNode.parse(name)
    assert MemoryNode.parse(node) is node


@pytest.mark.parametrize("bad", ["gpu0", "numa", "cuda-1", "NUMA0", "", "numa0x"])
def test_parse_rejects_other_names(bad: str) -> None:
    with pytest.raises(ValueError, match="numa0"):
        MemoryNode.parse(bad)


@pytest.mark.parametrize("kind,index", [("disk", 0), ("host", -1), ("cuda", 1.0), ("host", True)])
def test_invalid_nodes_are_rejected(kind: str, index: object) -> None:
    with pytest.raises(ValueError):
        MemoryNode(kind, index)  # type: ignore[arg-type]


def test_memory_nodes_lists_numa_nodes_then_gpus() -> None:
    topo = Topology.from_synthetic("pack:2 numa:2 core:2 pu:1")
    nodes = memory_nodes(topo, [1, 0])
    assert [n.name for n in nodes] == ["numa0", "numa1", "numa2", "numa3", "cuda0", "cuda1"]


def test_memory_nodes_without_numa_information_still_has_host_memory() -> None:
    assert [n.name for n in memory_nodes(None)] == ["numa0"]
    assert [n.name for n in memory_nodes(None, [0])] == ["numa0", "cuda0"]
    with pytest.raises(ValueError, match="CUDA device ids"):
        memory_nodes(None, [-1])


def test_memory_nodes_of_this_system() -> None:
    nodes = memory_nodes(Topology.from_system())
    assert nodes and all(n.is_host for n in nodes)
    assert nodes == sorted(nodes)


# ---------------------------------------------------------------- host copies
def test_copy_log_keeps_records_in_order_until_cleared() -> None:
    log = CopyLog()
    first = log.add(CopyRecord("numa0", "numa1", 1 << 16, 1e-4, start=0.0))
    log.add(CopyRecord("numa1", "numa0", 40, 1e-6))
    assert len(log) == 2 and log.records()[0] == first
    assert [(r.src, r.dst, r.nbytes) for r in log.records()] == [
        ("numa0", "numa1", 1 << 16), ("numa1", "numa0", 40)]
    log.clear()
    assert len(log) == 0


def test_copy_log_is_bounded() -> None:
    log = CopyLog(maxlen=3)
    for i in range(5):
        log.add(CopyRecord("numa0", "numa1", i, 1.0))
    assert [r.nbytes for r in log.records()] == [2, 3, 4]


def test_host_allocator_is_best_effort() -> None:
    synthetic = HostAllocator(Topology.from_synthetic("pack:1 numa:2 core:2 pu:1"))
    buf = synthetic.empty(MemoryNode("host", 1), 4096)
    assert buf.nbytes == 4096 and buf.dtype == np.uint8 and not buf.any()
    assert synthetic.outcomes["numa1"].startswith("skipped")

    system = HostAllocator()
    buf = system.empty(MemoryNode("host", 99), 100)  # no such node: still memory
    assert buf.nbytes == 100
    assert system.outcomes["numa99"].startswith(("skipped", "failed"))
    with pytest.raises(ValueError, match="not host memory"):
        system.empty(MemoryNode("cuda", 0), 8)


# ---------------------------------------------------------------- bus calibration
def test_calibrate_bus_between_host_nodes() -> None:
    model = calibrate_bus([MemoryNode("host", 0), "numa1"],
                          bandwidth_bytes=SMALL_BW, repeats=SMALL_REPEATS)
    assert isinstance(model, BusModel)
    assert sorted(str(link) for link in model.links) == ["numa0->numa1", "numa1->numa0"]
    for cost in model.links.values():
        assert cost.latency > 0
        assert cost.bandwidth > 0
    assert model.predict("numa0", "numa1", 1 << 20) > model.predict("numa0", "numa1", 1)


def test_calibrate_bus_with_one_node_is_empty() -> None:
    model = calibrate_bus(["numa0"], bandwidth_bytes=SMALL_BW, repeats=SMALL_REPEATS)
    assert model.links == {}
    assert model.predict("numa0", "numa1", 1 << 20) == 0.0


def test_calibrate_bus_fills_a_given_model() -> None:
    model = BusModel()
    filled = calibrate_bus(["numa0", "numa1"], model=model,
                           bandwidth_bytes=SMALL_BW, repeats=SMALL_REPEATS)
    assert filled is model
    assert len(model.links) == 2


def test_calibrate_bus_gpu_links_with_a_host_runtime() -> None:
    rt = HostRuntime(devices=2)  # two GPUs stood in for (a third ordinal is refused, as CUDA does)
    nodes = ["numa0", "cuda0", "cuda1"]
    model = calibrate_bus(nodes, runtime=rt, bandwidth_bytes=SMALL_BW, repeats=SMALL_REPEATS)
    links = sorted(str(link) for link in model.links)
    assert links == ["cuda0->cuda1", "cuda0->numa0", "cuda1->cuda0", "cuda1->numa0",
                     "numa0->cuda0", "numa0->cuda1"]
    assert all(c.bandwidth > 0 and c.latency >= 0 for c in model.links.values())
    assert rt.stats.live == 0  # every pinned and device buffer was freed


def test_calibrating_the_bus_breaks_no_graph_capture_under_way() -> None:
    """The bus is calibrated (a Runtime does it when it starts) while a CUDA worker captures
    a graph: every allocation, free and wait it makes, the pinned buffers its helper thread
    allocates on the host node's cores included, is in thread-local capture mode, so none
    fails with 900 and the capture is not invalidated (901)."""
    capturer, rt = HostRuntime(), HostRuntime()
    opened, release, outcome = threading.Event(), threading.Event(), []

    def capture() -> None:  # a CUDA worker's thread, in the middle of a capture
        try:
            with capturer.capturing():
                opened.set()
                release.wait(30)
            outcome.append("captured")
        except CudaError as exc:
            outcome.append(exc.code)

    thread = threading.Thread(target=capture)
    thread.start()
    try:
        assert opened.wait(10)
        model = calibrate_bus(["numa0", "cuda0"], runtime=rt, bandwidth_bytes=SMALL_BW, repeats=SMALL_REPEATS)
    finally:
        release.set()
        thread.join(10)
    assert outcome == ["captured"]
    assert sorted(str(link) for link in model.links) == ["cuda0->numa0", "numa0->cuda0"]
    assert rt.stats.live == 0
