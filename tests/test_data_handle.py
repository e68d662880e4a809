"""A tensor's data handle (issue 51, item 4): one record of where a tensor is valid (what the
core and the policies read) and of its copies there (what the engine hands its workers), on
HostRuntime, the CUDA stand-in; and the engine issues the copies it decides under its lock
only once that lock is released."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import onnx
import pytest

from staronnx import Runtime, partition
from staronnx.perfmodels import PerfModelStore
from staronnx.plan import Plan
from staronnx.runtime.datawizard import DataHandle
from staronnx.workers.cudart import HostRuntime
from staronnx.workers.replicas import DeviceMemory
from staronnx.zoo import chain

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
    return partition(str(root / "chain.onnx"), parts=1, output_dir=root / "plan", costs="estimate")


def test_a_prefetch_decided_under_the_engines_lock_is_issued_after_it(one_part, tmp_path):
    """dmda places a task when it is pushed and its input's upload is decided then; the copy
    itself runs once the engine's lock is free, so the other workers are not held up by it."""
    rt = _LockProbe()
    with Runtime(one_part, policy="dmda", cpu_groups="none", cuda_streams=1, store=PerfModelStore(tmp_path),
                 cuda_options={"runtime": rt}) as runtime:
        rt.runtime = runtime
        xs = [np.random.default_rng(i).standard_normal((4, 8)).astype(np.float32) for i in range(6)]
        for fut in [runtime.submit({"x": x}) for x in xs]:
            fut.result(timeout=60)
        rt.runtime = None
        stats = runtime.stats()
    assert rt.lock_free and all(rt.lock_free), rt.lock_free
    assert stats["requests_failed"] == 0 and stats["prefetch"]["moved"] == len(xs)
