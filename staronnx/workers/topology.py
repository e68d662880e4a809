"""The machine as hwloc sees it: packages, NUMA nodes, cores, PUs and the PUs we may use.

Every constructor goes through pyhwloc (the real hwloc library), so a synthetic description or
an XML file exported on a big server is parsed exactly as hwloc would parse it there: that is
what lets the tests check CPU grouping for a 2-package x 2-NUMA x 8-core machine on a 2-core laptop.

Indexes, easy to mix up: PUs and NUMA nodes go by their **OS index** (what ``taskset``,
``os.sched_setaffinity`` and ``numactl`` take); cores by hwloc's **logical index** (core OS
indexes restart at 0 in every package on Linux); packages by their logical index (their OS
index, the physical id, is often sparse or unknown). The allowed PUs are hwloc's allowed cpuset
(cgroups) intersected with the process's affinity (``taskset``), so groups only use PUs the
process can run on; disallowed PUs stay in the tree (INCLUDE_DISALLOWED) so ``render()`` shows them.
"""

from __future__ import annotations

import copy
import functools
import io
import itertools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import pyhwloc
from pyhwloc.bitmap import Bitmap
from pyhwloc.hwobject import ObjType
from pyhwloc.topology import AllowFlags, TopologyFlags

from staronnx.errors import StaronnxError

if TYPE_CHECKING:
    from rich.tree import Tree

__all__ = ["CoreInfo", "NumaInfo", "PackageInfo", "PuInfo", "Topology", "TopologyError", "bind_memory", "format_pus",
           "system_topology"]


class TopologyError(StaronnxError, ValueError):
    """A synthetic description or XML file that hwloc cannot load, or an impossible restriction."""


@dataclass(frozen=True)
class PuInfo:
    """One processing unit (hardware thread)."""

    os_index: int
    logical_index: int
    core: int  # core index (see CoreInfo.index)
    allowed: bool


@dataclass(frozen=True)
class CoreInfo:
    """One core and where it sits.

    ``index`` is hwloc's logical core index; PUs that hwloc places under no core (possible in
    synthetic or exotic topologies) each get a pseudo-core numbered after the real ones, so
    that every PU belongs to exactly one core.
    """

    index: int
    pus: tuple[int, ...]  # OS indexes of all its PUs, allowed or not
    numa: int | None  # OS index of its closest NUMA node
    package: int | None  # logical index of its package, None when hwloc knows no package

    def allowed_pus(self, allowed: frozenset[int]) -> tuple[int, ...]:
        """Its PUs that the process may use."""
        return tuple(p for p in self.pus if p in allowed)


@dataclass(frozen=True)
class NumaInfo:
    """One NUMA node: its memory and the PUs closest to it."""

    os_index: int
    logical_index: int
    pus: tuple[int, ...]
    memory_bytes: int
    package: int | None


@dataclass(frozen=True)
class PackageInfo:
    """One package (socket)."""

    index: int
    pus: tuple[int, ...]
    numa_nodes: tuple[int, ...]


@dataclass(frozen=True)
class Topology:
    """A snapshot of a machine's CPU topology, built by hwloc.

    The dataclass fields hold plain Python values (so a topology compares, prints and crosses
    threads cheaply); ``hw`` keeps the pyhwloc topology for XML export and memory binding.
    Two topologies compare equal when their structure and allowed PUs are equal, whatever
    their source, which is what the XML round-trip tests rely on.
    """

    packages: tuple[PackageInfo, ...]
    numa_nodes: tuple[NumaInfo, ...]
    cores: tuple[CoreInfo, ...]
    pus: tuple[PuInfo, ...]
    allowed_pus: frozenset[int]
    source: str = field(default="", compare=False)
    is_this_system: bool = field(default=False, compare=False)
    hw: pyhwloc.Topology | None = field(default=None, repr=False, compare=False)

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_system(cls) -> Topology:
        """This machine, restricted to the PUs this process may run on."""
        hw = _load(pyhwloc.Topology.from_this_system, "the topology of this system")
        if sys.platform == "linux":  # the one platform with a process's CPU affinity
            allowed = set(hw.allowed_cpuset) & os.sched_getaffinity(os.getpid())
            if allowed and allowed != set(hw.allowed_cpuset):
                # Record the restriction inside hwloc too, so that to_xml() carries it.
                hw.allow(Bitmap.from_sched_set(allowed), None, AllowFlags.CUSTOM)
        return _build(hw, source="system", is_this_system=True)

    @classmethod
    def from_synthetic(cls, description: str) -> Topology:
        """A made-up machine in hwloc's synthetic syntax, e.g. ``"pack:2 numa:2 core:8 pu:2"``."""
        if not description.strip():
            raise TopologyError("empty synthetic topology description")
        what = f"the synthetic topology {description!r}"
        hw = _load(lambda: pyhwloc.Topology.from_synthetic(description), what,
                   lambda exc: f"hwloc rejects {what} ({exc}); write it like 'pack:2 numa:2 core:8 pu:2'")
        return _build(hw, source=f"synthetic:{description}")

    @classmethod
    def from_xml(cls, path: str | os.PathLike[str]) -> Topology:
        """A machine saved by ``lstopo machine.xml`` or :meth:`export_xml`."""
        p = Path(path).expanduser()
        if not p.is_file():
            raise TopologyError(f"topology XML file {str(p)!r} does not exist")
        return _build(_load(lambda: pyhwloc.Topology.from_xml_file(p), f"the topology XML {str(p)!r}"),
                      source=f"xml:{p}")

    # ---------------------------------------------------------------- export
    def to_xml(self) -> str:
        """hwloc's XML for this topology, allowed PUs included."""
        return self._hw().export_xml_buffer()

    def export_xml(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`to_xml` to ``path`` (what ``lstopo file.xml`` writes) and return it."""
        p = Path(path).expanduser()
        p.write_text(self.to_xml(), encoding="utf-8")
        return p

    def with_allowed(self, pus: Iterable[int]) -> Topology:
        """The same machine with only ``pus`` allowed, as a cgroup or ``taskset`` would do.

        The restriction goes into the hwloc topology as well (hwloc's custom allowed cpuset),
        so an XML export of the result remembers it.
        """
        wanted = set(pus)
        unknown = wanted - {p.os_index for p in self.pus}
        if unknown:
            raise TopologyError(
                f"PU(s) {format_pus(unknown)} do not exist; this topology has PUs "
                f"{format_pus(p.os_index for p in self.pus)}"
            )
        if not wanted:
            raise TopologyError("cannot restrict a topology to no PU at all")
        hw = copy.copy(self._hw())
        hw.allow(Bitmap.from_sched_set(wanted), None, AllowFlags.CUSTOM)
        return _build(hw, source=self.source, is_this_system=self.is_this_system)

    # ---------------------------------------------------------------- queries
    @property
    def n_cores(self) -> int:
        return len(self.cores)

    @property
    def n_pus(self) -> int:
        return len(self.pus)

    def core_of_pu(self, pu: int) -> CoreInfo:
        """The core holding PU ``pu`` (OS index)."""
        for pu_info in self.pus:
            if pu_info.os_index == pu:
                return self.cores[pu_info.core]
        raise TopologyError(f"PU {pu} does not exist in this topology")

    def allowed_cores(self) -> list[CoreInfo]:
        """Cores with at least one allowed PU, in logical order."""
        return [c for c in self.cores if c.allowed_pus(self.allowed_pus)]

    def summary(self) -> str:
        """One line: counts of packages, NUMA nodes, cores, PUs and allowed PUs."""
        return (
            f"{len(self.packages)} package(s), {len(self.numa_nodes)} NUMA node(s), "
            f"{self.n_cores} core(s), {self.n_pus} PU(s), {len(self.allowed_pus)} allowed "
            f"({format_pus(self.allowed_pus)})"
        )

    # ---------------------------------------------------------------- display
    def rich_tree(self) -> Tree:
        """The machine as a rich Tree: package > NUMA node > core > PUs.

        rich is imported here, not at module level: only the CLI and logs need it.
        """
        from rich.tree import Tree

        root = Tree(f"[bold]Machine[/bold] ({self.source or 'unknown source'}): {self.summary()}")

        numa_by_index: dict[int | None, NumaInfo] = {n.os_index: n for n in self.numa_nodes}
        package_ids: list[int | None] = [p.index for p in self.packages]
        if any(c.package is None for c in self.cores) or not package_ids:
            package_ids.append(None)
        for pkg in package_ids:
            parent = root if pkg is None else root.add(f"[bold]Package {pkg}[/bold]")
            for numa in sorted({c.numa for c in self.cores if c.package == pkg}, key=lambda n: (n is None, n)):
                info = numa_by_index.get(numa)  # (a core's node may be unknown: its cores hang from the package)
                node = parent if info is None else parent.add(
                    f"[cyan]NUMA node {info.os_index}[/cyan] ({info.memory_bytes / 2**30:.1f} GiB)")
                for core in (c for c in self.cores if c.package == pkg and c.numa == numa):
                    pus = " ".join(f"PU {p}" if p in self.allowed_pus else f"[dim]PU {p} (not allowed)[/dim]"
                                   for p in core.pus)
                    node.add(f"Core {core.index}: {pus}")
        return root

    def render(self, width: int = 100) -> str:
        """The tree as plain text (for logs, tests and terminals without colour)."""
        from rich.console import Console

        buf = io.StringIO()
        Console(file=buf, width=width, color_system=None, highlight=False).print(self.rich_tree())
        return buf.getvalue()

    def _hw(self) -> pyhwloc.Topology:
        if self.hw is None:
            raise TopologyError("this Topology has no hwloc topology attached (built by hand?)")
        return self.hw


# -------------------------------------------------------------------- helpers
@functools.cache
def system_topology() -> Topology:
    """This machine's topology, loaded once per process (what memory binding reads)."""
    return Topology.from_system()


def bind_memory(topology: Topology | None, nodes: Sequence[int], area: memoryview | None = None) -> str:
    """Bind ``area`` (None: the calling thread's later allocations) to the NUMA ``nodes`` of
    ``topology`` (None: this system's): one node BIND, several INTERLEAVE, so pages spread over
    the nodes whose cores use them. Best effort by design, so it never raises: it says what
    happened ("bind to NUMA 1", "skipped: ...", "failed: ...")."""
    try:
        topology = topology or system_topology()
        if not topology.is_this_system or topology.hw is None:
            return "skipped: the topology is not this system's"
        existing = {n.os_index for n in topology.numa_nodes}
        if len(existing) <= 1:
            return "skipped: one NUMA node"
        if not nodes:
            return "skipped: the group has no NUMA node"
        if not set(nodes) <= existing:
            return f"skipped: this machine has no NUMA node {format_pus(set(nodes) - existing)}"
        from pyhwloc.topology import MemBindFlags, MemBindPolicy

        policy = MemBindPolicy.BIND if len(nodes) == 1 else MemBindPolicy.INTERLEAVE
        where = Bitmap.from_sched_set(set(nodes))
        if area is None:
            topology.hw.set_membind(where, policy, MemBindFlags.THREAD | MemBindFlags.BYNODESET)
        else:
            topology.hw.set_area_membind(area, where, policy, MemBindFlags.BYNODESET | MemBindFlags.MIGRATE)
        return f"{policy.name.lower()} to NUMA {','.join(map(str, nodes))}"
    except Exception as exc:  # noqa: BLE001 - best effort by design
        return f"failed: {exc}"


def format_pus(pus: Iterable[int]) -> str:
    """Compact PU list, e.g. ``0-3,8,10-11`` (the syntax of taskset and hwloc)."""
    runs = [[p for _, p in run] for _, run in itertools.groupby(enumerate(sorted(set(pus))), lambda ip: ip[1] - ip[0])]
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) or "none"


def _load(make: Callable[[], pyhwloc.Topology], what: str,
          unreadable: Callable[[Exception], str] | None = None) -> pyhwloc.Topology:
    """``make()`` loaded with disallowed PUs kept, so that the tree shows them and we track
    'allowed' ourselves; ``unreadable(error)`` says why hwloc could not make it."""
    try:
        topo = make()
    except (ValueError, OSError, RuntimeError) as exc:
        raise TopologyError(unreadable(exc) if unreadable else f"hwloc cannot read {what} ({exc})") from None
    try:
        return topo.set_flags(TopologyFlags.INCLUDE_DISALLOWED).load()
    except (ValueError, OSError, RuntimeError) as exc:
        raise TopologyError(f"hwloc cannot load {what} ({exc})") from None


def _build(hw: pyhwloc.Topology, *, source: str, is_this_system: bool = False) -> Topology:
    """Walk the hwloc tree once and copy what grouping needs into plain dataclasses."""
    allowed = frozenset(hw.allowed_cpuset) & frozenset(hw.cpuset)

    numa_objs = [n for n in hw.iter_numa_nodes() if n.cpuset is not None and n.cpuset.weight() > 0]
    numa_sets = {n.os_index: frozenset(n.cpuset or ()) for n in numa_objs}

    def closest_numa(cpus: frozenset[int]) -> int | None:
        # The smallest NUMA node containing the core; ties (DDR + HBM with one cpuset) go to
        # the lowest OS index, which is the DDR node on the machines we know of.
        candidates = [(len(s), idx) for idx, s in numa_sets.items() if cpus <= s]
        return min(candidates)[1] if candidates else None

    def pu_rank(os_index: int) -> int:
        pu = hw.get_pu_obj_by_os_index(os_index)
        return os_index if pu is None else pu.logical_index

    def package_of(obj: Any) -> int | None:
        pkg = obj.get_ancestor_obj_by_type(ObjType.PACKAGE)
        return None if pkg is None else pkg.logical_index

    cores: list[CoreInfo] = []
    pus: list[PuInfo] = []
    core_index_of_obj: dict[int, int] = {}
    pseudo: list[Any] = []  # PU objects without a core: pseudo-cores numbered after real ones
    for core in hw.iter_cores():
        core_index_of_obj[core.logical_index] = len(cores)
        cpus = frozenset(core.cpuset or ())
        cores.append(
            CoreInfo(
                index=core.logical_index,
                pus=tuple(sorted(cpus, key=pu_rank)),
                numa=closest_numa(cpus),
                package=package_of(core),
            )
        )
    for pu in hw.iter_cpus():
        owner = pu.get_ancestor_obj_by_type(ObjType.CORE)
        if owner is None:
            pseudo.append(pu)
            continue
        pus.append(PuInfo(pu.os_index, pu.logical_index, core_index_of_obj[owner.logical_index],
                          pu.os_index in allowed))
    for pu in pseudo:
        idx = len(cores)
        os_index = pu.os_index
        cores.append(CoreInfo(idx, (os_index,), closest_numa(frozenset({os_index})), package_of(pu)))
        pus.append(PuInfo(os_index, pu.logical_index, idx, os_index in allowed))
    pus.sort(key=lambda p: p.logical_index)

    numa_nodes = tuple(
        NumaInfo(
            os_index=n.os_index,
            logical_index=n.logical_index,
            pus=tuple(sorted(numa_sets[n.os_index])),
            memory_bytes=int(n.local_memory or 0),
            package=package_of(n),
        )
        for n in numa_objs
    )
    packages = tuple(
        PackageInfo(
            index=p.logical_index,
            pus=tuple(sorted(p.cpuset or ())),
            numa_nodes=tuple(n.os_index for n in numa_nodes if n.package == p.logical_index),
        )
        for p in hw.iter_packages()
    )
    if not allowed:
        raise TopologyError(f"no allowed PU in the topology of {source}")
    return Topology(
        packages=packages,
        numa_nodes=numa_nodes,
        cores=tuple(cores),
        pus=tuple(pus),
        allowed_pus=allowed,
        source=source,
        is_this_system=is_this_system,
        hw=hw,
    )

