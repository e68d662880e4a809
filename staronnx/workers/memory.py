"""Memory nodes and the copies between them, measured.

StarPU keeps a replica of each piece of data per *memory node* (host RAM per NUMA node, each
GPU's memory) and predicts transfers with a bus model (STARPU_MODEL.md §2 "Bus", §3).  This
module names the nodes the way :mod:`staronnx.perfmodels.bus` does (``numa0``, ``cuda1``),
records copies as :class:`CopyRecord` (size and measured duration: what a CUDA worker's copy
log holds) and calibrates the bus with StarPU's recipe (32 tiny copies for latency, 32 copies
of 32 MiB for bandwidth).

Placement is best effort, because it depends on the machine:

- host buffers are bound to their NUMA node with hwloc (``set_area_membind``) before their
  pages are first touched; on a one-node machine, a topology that is not this system's, or a
  node that does not exist, the buffer is ordinary memory and :attr:`HostAllocator.outcomes`
  says why;
- host<->GPU copies are timed from page-locked (pinned) buffers, because a copy from pageable
  memory is synchronous and slower; a pinned buffer is allocated by a thread bound to the host
  node's cores (:func:`pinned_near`), so its pages land on that node.

Nothing here needs a GPU until a ``cuda`` node is used; cuda-bindings is imported then.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from staronnx.perfmodels.bus import (BANDWIDTH_BYTES, LATENCY_BYTES, REPEATS, BusModel, LinkCost, calibrate_link,
                                     run_on_cpus)

from staronnx.workers.cudart import Buffer, CudaRuntime, GpuRuntime, capture_safe, host_runtime_from_env
from staronnx.workers.topology import Topology, bind_memory, system_topology

__all__ = ["CopyLog", "CopyRecord", "HostAllocator", "MemoryNode", "calibrate_bus", "memory_nodes",
           "pinned_near"]

log = logging.getLogger(__name__)

NodeKind = Literal["host", "cuda"]
_PREFIX = {"host": "numa", "cuda": "cuda"}
_NAME_RE = re.compile(r"^(numa|cuda)(\d+)$")


# ---------------------------------------------------------------------------- nodes
@dataclass(frozen=True, order=True)
class MemoryNode:
    """A place where a tensor can live: host RAM of NUMA node ``index``, or GPU ``index``.

    ``index`` is the NUMA node's OS index (what ``numactl`` shows) or the CUDA device ordinal.
    """

    kind: NodeKind
    index: int

    def __post_init__(self) -> None:
        if self.kind not in _PREFIX:
            raise ValueError(f"memory node kind must be 'host' or 'cuda', got {self.kind!r}")
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise ValueError(f"memory node index must be an int >= 0, got {self.index!r}")

    @property
    def name(self) -> str:
        """``numa<i>`` or ``cuda<i>``: the names the bus model and traces use."""
        return f"{_PREFIX[self.kind]}{self.index}"

    @property
    def is_host(self) -> bool:
        return self.kind == "host"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @classmethod
    def parse(cls, name: str | MemoryNode) -> MemoryNode:
        """``"numa1"`` -> ``MemoryNode("host", 1)``; a MemoryNode is returned unchanged."""
        if isinstance(name, MemoryNode):
            return name
        m = _NAME_RE.match(name.strip()) if isinstance(name, str) else None
        if not m:
            raise ValueError(f"memory node names look like 'numa0' or 'cuda1', got {name!r}")
        return cls("host" if m.group(1) == "numa" else "cuda", int(m.group(2)))

    def __str__(self) -> str:
        return self.name


def memory_nodes(topology: Topology | None, cuda_devices: Iterable[int] = ()) -> list[MemoryNode]:
    """Every memory node of a machine: one per NUMA node of ``topology``, then one per GPU.

    A topology without NUMA information (or ``None``) still has host memory: ``numa0``.
    """
    host = sorted({n.os_index for n in topology.numa_nodes}) if topology is not None else []
    nodes = [MemoryNode("host", i) for i in (host or [0])]
    devices = list(cuda_devices)
    for d in devices:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ValueError(f"CUDA device ids are ints >= 0, got {d!r}")
    return nodes + [MemoryNode("cuda", d) for d in sorted(set(devices))]


# ---------------------------------------------------------------------------- copy log
@dataclass(frozen=True)
class CopyRecord:
    """One finished copy: node names, bytes moved, seconds it took (``start``: perf_counter)."""

    src: str
    dst: str
    nbytes: int
    seconds: float
    start: float | None = None


class CopyLog:
    """A thread-safe, bounded log of :class:`CopyRecord` (the oldest records drop first)."""

    def __init__(self, maxlen: int | None = 100_000) -> None:
        self._records: deque[CopyRecord] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def add(self, record: CopyRecord) -> CopyRecord:
        with self._lock:
            self._records.append(record)
        return record

    def records(self) -> list[CopyRecord]:
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def __len__(self) -> int:
        return len(self._records)



# ---------------------------------------------------------------------------- host memory
class HostAllocator:
    """Allocates host buffers on a given NUMA node, as far as this machine allows.

    ``topology`` defaults to this system's (loaded on first use).  :attr:`outcomes` maps each
    node name to what happened the last time ("bind to NUMA 1", "skipped: ...", "failed: ...").
    """

    def __init__(self, topology: Topology | None = None) -> None:
        self._topology = topology
        self.outcomes: dict[str, str] = {}

    @property
    def topology(self) -> Topology | None:
        if self._topology is None:
            try:
                self._topology = system_topology()
            except Exception as exc:  # noqa: BLE001 - placement is best effort
                log.debug("no hwloc topology of this system (%s); host buffers are not bound", exc)
        return self._topology

    def empty(self, node: MemoryNode, nbytes: int) -> np.ndarray:
        """A 1-D uint8 buffer of ``nbytes`` whose pages were first touched after binding."""
        if not node.is_host:
            raise ValueError(f"{node} is not host memory")
        buf = np.empty(nbytes, dtype=np.uint8)
        self.outcomes[node.name] = (bind_memory(self._topology, [node.index], memoryview(buf)) if nbytes
                                    else "skipped: empty buffer")
        buf.fill(0)  # first touch: the kernel places the pages now, under the binding
        return buf

    def cpus_of(self, node: MemoryNode) -> list[int]:
        """Allowed PUs closest to a host node (empty when unknown)."""
        topo = self.topology
        if topo is None or not topo.is_this_system:
            return []
        return [p for numa in topo.numa_nodes if numa.os_index == node.index for p in numa.pus if p in topo.allowed_pus]


# ---------------------------------------------------------------------------- host <-> GPU
def pinned_near(runtime: GpuRuntime, cpus: Sequence[int], nbytes: int) -> Buffer:
    """Pinned memory first touched by a thread bound to ``cpus`` (so its pages land on their
    NUMA node), allocated in thread-local capture mode: :func:`run_on_cpus`'s helper thread is
    new, so in CUDA's default global mode, where a ``cudaHostAlloc`` during another thread's
    graph capture fails (900) and breaks that capture (901)."""

    def allocate() -> Buffer:
        with capture_safe(runtime):
            return runtime.pinned(nbytes)

    return run_on_cpus(cpus, allocate)


# ---------------------------------------------------------------------------- calibration
def calibrate_bus(
    nodes: Sequence[MemoryNode | str],
    *,
    bandwidth_bytes: int = BANDWIDTH_BYTES,
    latency_bytes: int = LATENCY_BYTES,
    repeats: int = REPEATS,
    topology: Topology | None = None,
    runtime: GpuRuntime | None = None,
    model: BusModel | None = None,
) -> BusModel:
    """Measure latency and bandwidth of every directed link between ``nodes``.

    StarPU's recipe (``perfmodel_bus.c``): ``repeats`` copies of ``latency_bytes`` give the
    latency, ``repeats`` copies of ``bandwidth_bytes`` the bandwidth, through
    :func:`staronnx.perfmodels.bus.calibrate_link` (one untimed copy first, medians).

    - host -> host: numpy copies between buffers bound to each node;
    - host <-> GPU: ``cudaMemcpyAsync`` between a pinned buffer placed on the host node and a
      device buffer, waited on with an event;
    - GPU -> GPU: ``cudaMemcpyPeerAsync`` (staged through the host when peer access is off,
      which the measurement then reflects).

    Returns ``model`` (a new :class:`BusModel` by default) with one entry per link.  A single
    host node and no GPU gives an empty model, which predicts 0 like StarPU's.
    """
    parsed = list(dict.fromkeys(MemoryNode.parse(n) for n in nodes))
    model = model if model is not None else BusModel()
    allocator = HostAllocator(topology)
    hosts = [n for n in parsed if n.is_host]
    gpus = [n for n in parsed if n.is_cuda]

    def measure(copy: Callable[[int], object]) -> LinkCost:
        return calibrate_link(copy, bandwidth_bytes=bandwidth_bytes,
                              latency_bytes=latency_bytes, repeats=repeats)

    for src in hosts:
        for dst in hosts:
            if src != dst:
                a, b = allocator.empty(src, bandwidth_bytes), allocator.empty(dst, bandwidth_bytes)
                # The destination's cores do the copy: a worker pulls its inputs.
                cost = run_on_cpus(allocator.cpus_of(dst), lambda: measure(lambda n: np.copyto(b[:n], a[:n])))
                model.set(src.name, dst.name, cost)
    if not gpus:
        return model
    # the stand-in the CUDA workers run on ($STARONNX_CUDA_RUNTIME), if any: the links of the
    # GPUs they drive, not of a GPU this machine may not have
    rt: GpuRuntime = runtime or host_runtime_from_env() or CudaRuntime()
    # in thread-local capture mode: the calibration allocates, frees and synchronises, which in
    # global mode would fail (900) and break any graph a CUDA worker is capturing meanwhile (901)
    with capture_safe(rt):
        for gpu in gpus:
            for host in hosts:
                up, down = _calibrate_host_gpu(host, gpu, allocator, rt, bandwidth_bytes, measure)
                model.set(host.name, gpu.name, up)
                model.set(gpu.name, host.name, down)
        for src in gpus:
            for dst in gpus:
                if src != dst:
                    model.set(src.name, dst.name, _calibrate_peer(src, dst, rt, bandwidth_bytes, measure))
    return model


_Measure = Callable[[Callable[[int], object]], LinkCost]


def _calibrate_host_gpu(host: MemoryNode, gpu: MemoryNode, allocator: HostAllocator,
                        rt: GpuRuntime, nbytes: int, measure: _Measure) -> tuple[LinkCost, LinkCost]:
    """(host -> gpu, gpu -> host) between a pinned buffer on ``host`` and device memory, each
    copy issued on a stream and waited for with an event."""
    rt.set_device(gpu.index)
    device = rt.device_buffer(nbytes)
    pinned = pinned_near(rt, allocator.cpus_of(host), nbytes)
    stream = rt.stream()
    done = rt.event(timing=False)
    try:
        pinned.view(np.uint8, (nbytes,)).fill(1)

        def copy(up: bool, n: int) -> None:
            rt.set_device(gpu.index)
            if up:
                rt.copy_h2d(device.ptr, pinned.ptr, n, stream)
            else:
                rt.copy_d2h(pinned.ptr, device.ptr, n, stream)
            done.record(stream)
            done.synchronize()

        return measure(lambda n: copy(True, n)), measure(lambda n: copy(False, n))
    finally:
        rt.set_device(gpu.index)
        stream.synchronize()
        done.destroy()
        stream.destroy()
        pinned.free()
        device.free()


def _calibrate_peer(src: MemoryNode, dst: MemoryNode, rt: GpuRuntime, nbytes: int,
                    measure: _Measure) -> LinkCost:
    rt.set_device(dst.index)
    dst_buf = rt.device_buffer(nbytes)
    rt.set_device(src.index)
    src_buf = rt.device_buffer(nbytes)
    stream = rt.stream()
    done = rt.event(timing=False)
    try:
        def peer_copy(n: int) -> None:
            rt.set_device(src.index)
            rt.copy_peer(dst_buf.ptr, dst.index, src_buf.ptr, src.index, n, stream)
            done.record(stream)
            done.synchronize()

        return measure(peer_copy)
    finally:
        rt.set_device(src.index)
        stream.synchronize()
        done.destroy()
        stream.destroy()
        src_buf.free()
        rt.set_device(dst.index)
        dst_buf.free()
