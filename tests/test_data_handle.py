"""A tensor's data handle (issue 51, item 4): one record of where a tensor is valid (what the
core and the policies read) and of its copies there (what the engine hands its workers), on
HostRuntime, the CUDA stand-in; and the engine issues the copies it decides under its lock
only once that lock is released."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import onnx
import pytest

from staronnx import CudaOptions, MachineSpec, Runtime, RuntimeSpec, partition
from staronnx.perfmodels import PerfModelStore
from staronnx.plan import Plan
from staronnx.runtime.datawizard import DataHandle
from staronnx.workers.cudart import HostRuntime
from staronnx.workers.replicas import DeviceMemory
from staronnx.zoo import chain
from staronnx.partition import PartitionSpec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def memory():
    rt = HostRuntime()
    node = DeviceMemory(rt, 0)
    yield rt, node
    node.close()


def test_a_handle_keeps_one_copy_per_node_and_reads_its_shape_from_any(memory):
    rt, node = memory
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    h = DataHandle("x", x.nbytes, frozenset({"numa0"}), readers_left=2, host=x)
    assert h.shape == (3, 4) and h.on_device("cuda0") is None
    t = node.upload(x)
    h.add_device("cuda0", t)
    h.add_device("cuda0", node.upload(x))  # a second copy to a node that has one is not kept
    assert h.on_device("cuda0") is t
    np.testing.assert_array_equal(node.download(t), x)
    on_gpu = DataHandle("y", x.nbytes, frozenset({"cuda0"}))
    on_gpu.add_device("cuda0", t)
    assert on_gpu.shape == (3, 4)  # from its GPU copy: it has no host one
    h.drop()
    assert h.host is None and h.on_device("cuda0") is None
    with pytest.raises(RuntimeError, match="no copy"):
        _ = h.shape


def test_a_copy_in_flight_has_arrived_once_its_event_says_so(memory):
    rt, node = memory
    x = np.ones((2, 8), np.float32)
    h = DataHandle("x", x.nbytes, frozenset({"numa0", "cuda0"}), host=x)
    h.add_device("cuda0", node.upload(x, wait=False))  # a prefetch: a ready event to wait on
    rt.hold_events(1)
    assert not h.arrived("cuda0")
    assert h.arrived("cuda0") and h.on_device("cuda0").ready is None  # the event went back

    down = DataHandle("y", x.nbytes, frozenset({"cuda0", "numa0"}))
    t = node.upload(x)
    down.add_device("cuda0", t)
    array, ready = node.download_async(t)
    assert ready is None  # no pinned pool: a copy to pageable memory is done when it returns
    down.add_host(array)
    assert down.arrived("numa0")
    np.testing.assert_array_equal(down.host, x)


def test_a_download_still_in_flight_is_waited_for_by_its_reader(memory):
    rt, node = memory
    from staronnx.workers.pinned_pool import PinnedPool

    pool = PinnedPool(rt.pinned)
    pinned = DeviceMemory(rt, 0, pool)
    try:
        x = np.full((4, 4), 3.0, np.float32)
        t = pinned.upload(x)
        h = DataHandle("y", x.nbytes, frozenset({"cuda0", "numa0"}))
        h.add_device("cuda0", t)
        array, ready = pinned.download_async(t)
        assert ready is not None
        h.add_host(array, (ready, pinned))
        rt.hold_events(1)
        assert not h.arrived("numa0")
        h.wait_host()
        assert h.host_ready is None and h.arrived("numa0")
        np.testing.assert_array_equal(h.host, x)
    finally:
        pinned.close()
        pool.close()


def test_a_round_trip_through_a_gpu_stages_in_reused_pinned_memory():
    """DeviceMemory's upload and download (the runtime's copies outside a task's launch): the
    bytes come back equal, a smaller upload reuses the pool's staging buffer, and closing the
    node and the pool frees every buffer."""
    from staronnx.workers.pinned_pool import PinnedPool

    rt = HostRuntime()
    pool = PinnedPool(rt.pinned)
    node = DeviceMemory(rt, 0, pool)
    data = np.random.default_rng(0).standard_normal((4, 33)).astype(np.float32)
    try:
        back = node.download(node.upload(data))
        np.testing.assert_array_equal(back, data)
        del back
        allocs = rt.stats.pinned_allocs
        np.testing.assert_array_equal(node.download(node.upload(data[:2])), data[:2])  # smaller: reused
        assert rt.stats.pinned_allocs == allocs
    finally:
        node.close()
        pool.close()
    assert rt.stats.live == 0


class _LockProbe(HostRuntime):
    """Asks, at each upload the submitting thread issues, whether another thread can read the
    runtime's statistics meanwhile (they take the engine's lock)."""

    def __init__(self) -> None:
        super().__init__()
        self.runtime: Runtime | None = None
        self.lock_free: list[bool] = []

    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if self.runtime is not None and threading.current_thread() is threading.main_thread():
            reader = threading.Thread(target=self.runtime.stats)
            reader.start()
            reader.join(10)
            self.lock_free.append(not reader.is_alive())
        super().copy_h2d(dst, src, nbytes, stream)


@pytest.fixture(scope="module")
def one_part(tmp_path_factory) -> Plan:
    root = tmp_path_factory.mktemp("handle")
    onnx.save(chain(depth=2, width=8), str(root / "chain.onnx"))
    return partition(str(root / "chain.onnx"), spec=PartitionSpec(parts=1, costs="estimate"), output_dir=root / "plan")


def test_a_prefetch_decided_under_the_engines_lock_is_issued_after_it(one_part, tmp_path):
    """dmda places a task when it is pushed and its input's upload is decided then; the copy
    itself runs once the engine's lock is free, so the other workers are not held up by it."""
    rt = _LockProbe()
    with Runtime(one_part,
                 MachineSpec(groups="none", cuda_streams=1),
                 RuntimeSpec(policy="dmda", store=PerfModelStore(tmp_path), cuda=CudaOptions(runtime=rt))) as runtime:
        rt.runtime = runtime
        xs = [np.random.default_rng(i).standard_normal((4, 8)).astype(np.float32) for i in range(6)]
        for fut in [runtime.submit({"x": x}) for x in xs]:
            fut.result(timeout=60)
        rt.runtime = None
        stats = runtime.stats()
    assert rt.lock_free and all(rt.lock_free), rt.lock_free
    assert stats["requests_failed"] == 0 and stats["prefetch"]["moved"] == len(xs)


class _SlowUpload(HostRuntime):
    """Uploads issued by the submitting thread take a while: its worker takes the task first
    and finds the input still being issued."""

    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.05)
        super().copy_h2d(dst, src, nbytes, stream)


def test_a_task_whose_input_is_still_being_issued_waits_for_it(one_part, tmp_path):
    """The worker a task was placed on may take it while the thread that decided its prefetch
    is still issuing the copy; it waits for the copy rather than fetching the input itself,
    and reads the right values."""
    import onnxruntime as ort

    rt = _SlowUpload()
    ref = ort.InferenceSession(str(one_part.root / "part0.onnx"), providers=["CPUExecutionProvider"])
    with Runtime(one_part,
                 MachineSpec(groups="none", cuda_streams=1),
                 RuntimeSpec(policy="dmda", store=PerfModelStore(tmp_path), cuda=CudaOptions(runtime=rt))) as runtime:
        xs = [np.random.default_rng(i).standard_normal((4, 8)).astype(np.float32) for i in range(5)]
        futures = [runtime.submit({"x": x}) for x in xs]
        for x, fut in zip(xs, futures):
            np.testing.assert_allclose(fut.result(timeout=60)["y"], ref.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)
        stats = runtime.stats()
    assert stats["prefetch"]["moved"] == len(xs) and stats["prefetch"]["hits"] == len(xs)
    assert rt.copy_counts()["h2d"][0] == len(xs)  # each input uploaded once, by its prefetch
