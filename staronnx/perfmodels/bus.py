"""Bus model: how long moving bytes between two memory nodes takes.

dmda adds the predicted transfer time of every input that is not yet on a worker's memory node
to that worker's expected finish (STARPU_MODEL.md §1, §2), so the bus model decides how
strongly the scheduler favours locality. As in StarPU (``src/core/perfmodel/perfmodel_bus.c``)
each directed link between memory nodes has a latency (seconds) and a bandwidth (bytes/s):

    predict(src, dst, nbytes) = latency + shared_by * nbytes / bandwidth

StarPU uses ``shared_by = 2 * ngpus`` (the GPUs sharing the bus); pass that to reproduce it
exactly, or 1 for a plain estimate. Links that were not measured directly are routed through
up to :data:`MAX_HOPS` measured links (latencies add, slownesses ``1/bandwidth`` add), like
StarPU's indirect routes. A transfer between unconnected nodes predicts 0, like StarPU's
"NaN gives 0"; :meth:`BusModel.has_route` tells the two cases apart.

Memory nodes are named ``<kind><index>``: ``numa0``, ``numa1`` (host RAM per NUMA node),
``cuda0`` (a GPU's memory). Measurements come from :func:`calibrate_link`, given any copy
callable (the workers code plugs pinned host<->GPU copies in), and from
:func:`calibrate_host_numa`, which measures numpy copies between NUMA nodes of this host.
"""

from __future__ import annotations

import logging
import math
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

log = logging.getLogger("staronnx.perfmodels")

MiB = 1 << 20
#: StarPU's calibration: 32 copies of 32 MiB for bandwidth, 32 copies of 1 byte for latency.
BANDWIDTH_BYTES = 32 * MiB
LATENCY_BYTES = 1
REPEATS = 32
#: Longest chain of measured links an indirect route may use (StarPU considers up to 4 hops).
MAX_HOPS = 4

_NODE_RE = re.compile(r"^[a-z][a-z_]*[0-9]+$")
_T = TypeVar("_T")


@dataclass(frozen=True, order=True)
class Link:
    """A directed link between two memory nodes (copies may be asymmetric)."""

    src: str
    dst: str

    def __post_init__(self) -> None:
        if _check_node(self.src) == _check_node(self.dst):
            raise ValueError(f"a link joins two different nodes, got {self.src} -> {self.dst}")

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}"


def _check_node(name: str) -> str:
    """``name`` when it names a memory node, else a ValueError saying what one looks like."""
    if not isinstance(name, str) or not _NODE_RE.match(name):
        raise ValueError(f"memory node names look like 'numa0' or 'cuda1', got {name!r}")
    return name


@dataclass(frozen=True)
class LinkCost:
    """Latency in seconds and bandwidth in bytes per second of one link."""

    latency: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"latency must be finite and >= 0 seconds, got {self.latency!r}")
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"bandwidth must be finite and > 0 bytes/s, got {self.bandwidth!r}")

    def time(self, nbytes: int, shared_by: float = 1.0) -> float:
        """Seconds to move ``nbytes`` over this link."""
        return self.latency + shared_by * nbytes / self.bandwidth


class BusModel:
    """Latency and bandwidth per directed link, with multi-hop routing for missing links."""

    def __init__(self, links: Mapping[Link, LinkCost] | None = None) -> None:
        self._links: dict[Link, LinkCost] = dict(links or {})
        # Per (src, dst): Pareto-optimal routes as (total latency, total 1/bandwidth).
        self._routes: dict[tuple[str, str], list[tuple[float, float]]] = {}
        self._lock = threading.Lock()

    def set(self, src: str, dst: str, cost: LinkCost) -> None:
        """Record the measured cost of the ``src -> dst`` link."""
        with self._lock:
            self._links[Link(src, dst)] = cost
            self._routes.clear()

    def cost(self, src: str, dst: str) -> LinkCost | None:
        """The directly measured cost of ``src -> dst``, or ``None``."""
        return self._links.get(Link(src, dst))

    @property
    def links(self) -> dict[Link, LinkCost]:
        return dict(self._links)

    def nodes(self) -> list[str]:
        return sorted({n for link in self._links for n in (link.src, link.dst)})

    def _candidates(self, src: str, dst: str) -> list[tuple[float, float]]:
        key = (src, dst)
        with self._lock:
            cached = self._routes.get(key)
            if cached is not None:
                return cached
            out_links: dict[str, list[tuple[str, LinkCost]]] = {}
            for link, cost in self._links.items():
                out_links.setdefault(link.src, []).append((link.dst, cost))
            found: list[tuple[float, float]] = []

            def walk(node: str, seen: frozenset[str], lat: float, slow: float, hops: int) -> None:
                for nxt, cost in out_links.get(node, ()):
                    if nxt in seen:
                        continue
                    total = (lat + cost.latency, slow + 1.0 / cost.bandwidth)
                    if nxt == dst:
                        found.append(total)
                    elif hops + 1 < MAX_HOPS:
                        walk(nxt, seen | {nxt}, *total, hops + 1)

            walk(src, frozenset({src}), 0.0, 0.0, 0)
            # Keep only routes not beaten on both latency and slowness: any nbytes picks one.
            found.sort()
            pareto: list[tuple[float, float]] = []
            for lat, slow in found:
                if not pareto or slow < pareto[-1][1]:
                    pareto.append((lat, slow))
            self._routes[key] = pareto
            return pareto

    def has_route(self, src: str, dst: str) -> bool:
        """Whether a transfer ``src -> dst`` has a prediction (same node, or linked)."""
        return _check_node(src) == _check_node(dst) or bool(self._candidates(src, dst))

    def predict(self, src: str, dst: str, nbytes: int, *, shared_by: float = 1.0) -> float:
        """Predicted seconds to copy ``nbytes`` from ``src`` to ``dst``.

        0 for the same node, for ``nbytes == 0`` and for nodes with no known route (StarPU
        turns an unknown transfer time into 0 rather than poisoning the finish-time sums).
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes == 0 or src == dst:
            return 0.0
        return min((lat + shared_by * nbytes * slow for lat, slow in self._candidates(src, dst)), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: a list of links with latency (s) and bandwidth (bytes/s)."""
        return {
            "units": {"latency": "seconds", "bandwidth": "bytes/s"},
            "links": [
                {"src": link.src, "dst": link.dst, "latency": c.latency, "bandwidth": c.bandwidth}
                for link, c in sorted(self._links.items())
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BusModel:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` (or a subclass) on bad content."""
        try:
            links = {}
            for raw in data["links"]:
                link = Link(raw["src"], raw["dst"])
                if link in links:
                    raise ValueError(f"link {link} appears twice")
                links[link] = LinkCost(float(raw["latency"]), float(raw["bandwidth"]))
            return cls(links)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed bus model: {exc!r}") from exc


def calibrate_link(
    copy: Callable[[int], object],
    *,
    bandwidth_bytes: int = BANDWIDTH_BYTES,
    latency_bytes: int = LATENCY_BYTES,
    repeats: int = REPEATS,
    clock: Callable[[], float] = time.perf_counter,
) -> LinkCost:
    """Measure a link by timing ``copy(nbytes)``, which must move ``nbytes`` and return only
    once the copy is complete (synchronise the stream for device copies).

    Like StarPU: ``repeats`` tiny copies give the latency and ``repeats`` large copies the
    bandwidth. Each size is copied once untimed first (page faults, lazy driver setup), and the
    median is used so one preempted copy on a busy machine does not skew the result. The
    latency is subtracted from the large copies' time, so that ``predict`` reproduces the
    measured large-copy time exactly.
    """
    if repeats < 1 or bandwidth_bytes <= latency_bytes or latency_bytes < 0:
        raise ValueError("need repeats >= 1 and bandwidth_bytes > latency_bytes >= 0")

    def timed(nbytes: int) -> float:
        copy(nbytes)
        samples = []
        for _ in range(repeats):
            start = clock()
            copy(nbytes)
            samples.append(clock() - start)
        return max(statistics.median(samples), 0.0)

    latency = timed(latency_bytes)
    big = timed(bandwidth_bytes)
    moving = big - latency
    if moving <= 0:  # clock too coarse to see the latency: fall back to StarPU's plain ratio
        moving = big
    if moving <= 0:
        raise RuntimeError("the copy took no measurable time; use a larger bandwidth_bytes")
    return LinkCost(latency=latency, bandwidth=bandwidth_bytes / moving)


# -- host NUMA nodes --------------------------------------------------------------------------


def _parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def host_numa_nodes(sysfs: str | Path = "/sys/devices/system/node") -> dict[int, list[int]]:
    """NUMA node index -> CPUs of that node this process may run on (empty nodes omitted).

    Falls back to a single node 0 with every allowed CPU when sysfs has no NUMA information
    (non-Linux, containers hiding it).
    """
    allowed = set(os.sched_getaffinity(0)) if sys.platform == "linux" else set()  # Linux has affinities
    nodes: dict[int, list[int]] = {}
    root = Path(sysfs)
    for entry in sorted(root.glob("node[0-9]*")) if root.is_dir() else []:
        try:
            cpus = _parse_cpulist((entry / "cpulist").read_text())
        except OSError:
            continue
        usable = [c for c in cpus if not allowed or c in allowed]
        if usable:
            nodes[int(entry.name[4:])] = usable
    if not nodes:
        nodes[0] = sorted(allowed) if allowed else [0]
    return nodes


def run_on_cpus(cpus: Sequence[int], fn: Callable[[], _T]) -> _T:
    """Run ``fn`` in a helper thread bound to ``cpus`` (here, when there are none), so the
    memory it allocates is first-touched on their NUMA node (Linux places a page where it is
    first written): buffers land on a node without libnuma, and the caller's affinity is left
    alone. A thread that cannot be bound still runs ``fn``. The helper thread is new: per-thread
    state is at its default there (CUDA's current device, and its global capture mode, in
    which a pinned allocation breaks another thread's graph capture), so ``fn`` sets what it
    needs (:func:`staronnx.workers.memory.pinned_near`)."""
    if not cpus or sys.platform != "linux":  # binding a thread to CPUs is Linux's
        return fn()

    def bound() -> _T:
        try:
            os.sched_setaffinity(0, set(cpus))  # pid 0 = this thread on Linux
        except OSError as exc:
            log.debug("cannot bind a helper thread to %s: %s", list(cpus), exc)
        return fn()

    with ThreadPoolExecutor(1, thread_name_prefix="staronnx-near-node") as pool:
        return pool.submit(bound).result()


def calibrate_host_numa(
    nodes: Mapping[int, Sequence[int]] | None = None,
    *,
    bandwidth_bytes: int = BANDWIDTH_BYTES,
    latency_bytes: int = LATENCY_BYTES,
    repeats: int = REPEATS,
    pairs: Iterable[tuple[int, int]] | None = None,
) -> BusModel:
    """Measure numpy copies between host buffers on every ordered pair of NUMA nodes.

    ``nodes`` maps a NUMA node index to CPUs on it (default: :func:`host_numa_nodes`). The
    source buffer is first-touched by a thread bound to the source node, the destination by
    one bound to the destination node, and the copies run on the destination node (a worker
    pulls its inputs). A single-node host yields a model without links, which predicts 0.
    """
    topology = {int(k): list(v) for k, v in (nodes or host_numa_nodes()).items()}
    todo = list(pairs) if pairs is not None else [
        (i, j) for i in sorted(topology) for j in sorted(topology) if i != j
    ]
    model = BusModel()
    for i, j in todo:
        src = run_on_cpus(topology[i], lambda: np.full(bandwidth_bytes, 1, dtype=np.uint8))
        dst = run_on_cpus(topology[j], lambda: np.full(bandwidth_bytes, 2, dtype=np.uint8))

        def copy(nbytes: int, src: np.ndarray = src, dst: np.ndarray = dst) -> None:
            np.copyto(dst[:nbytes], src[:nbytes])

        measure = partial(calibrate_link, copy, bandwidth_bytes=bandwidth_bytes, latency_bytes=latency_bytes,
                          repeats=repeats)
        model.set(f"numa{i}", f"numa{j}", run_on_cpus(topology[j], measure))
        del src, dst
    return model
