"""CPU groups: which cores each CPU worker owns.

A CPU worker runs one ONNX Runtime session per part with one intra-op thread per core of its
group, so the grouping decides both the number of CPU workers the scheduler sees and how wide
each one is.  StarPU groups by NUMA node for the same reason we do: a group that stays inside
one NUMA node keeps its weights and activations in local memory.

Policies (``make_groups(topology, policy)``), one base term plus optional ``reserve=N``:

``numa`` (default)
    One group per NUMA node.
``package`` (alias ``socket``)
    One group per package; a group may then span several NUMA nodes.
``cores=N``
    Groups of N cores that never cross a NUMA node.  When a node's core count is not a
    multiple of N, **its remainder forms a smaller last group** (8 cores with ``cores=3`` give
    3+3+2): leaving cores idle would waste them, and the scheduler's perf models learn that the
    smaller group is slower.
``"0-3;4-7"``
    Explicit groups of PU OS indexes (``;`` between groups, ``,`` and ``a-b`` inside one).
    PUs must exist, be allowed and appear once.  A group's core count is the number of
    distinct cores its PUs touch.
``reserve=N``
    Combinable with any base term (``numa,reserve=1``): N cores are held back for the threads
    that drive GPUs (one per CUDA stream, StarPU's "GPU driver threads each take a CPU core").
    They are taken first, from the end of the last NUMA node (spilling into the previous node
    when that one is too small), listed in :attr:`CpuGroups.reserved`, and never given to a
    group.  An explicit list may not name a reserved PU.

Only allowed PUs are used (cgroups, taskset: see :mod:`staronnx.workers.topology`); a core whose
PUs are all disallowed is skipped, a core with some disallowed PUs keeps only the allowed ones.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import overload

from staronnx.errors import StaronnxError
from staronnx.workers.topology import CoreInfo, Topology, format_pus

__all__ = ["CpuGroup", "CpuGroups", "GroupError", "make_groups", "policy_reserve", "DEFAULT_POLICY"]

DEFAULT_POLICY = "numa"

_HELP = (
    "use 'numa', 'package', 'cores=N', an explicit PU list such as '0-3;4-7', "
    "each optionally followed by ',reserve=N'"
)


class GroupError(StaronnxError, ValueError):
    """A CPU group policy that is malformed or impossible on this topology."""


@dataclass(frozen=True)
class CpuGroup:
    """The cores (and their PUs) one CPU worker owns.

    ``core_pus[i]`` are the PUs of ``cores[i]`` that belong to the group; the worker thread is
    pinned to :attr:`first_pu` and ONNX Runtime's extra intra-op threads to the other cores
    (:meth:`ort_thread_affinities`).
    """

    id: int
    name: str
    cores: tuple[int, ...]
    core_pus: tuple[tuple[int, ...], ...]
    numa_nodes: tuple[int, ...]
    package: int | None

    @property
    def pus(self) -> tuple[int, ...]:
        """All the group's PU OS indexes, core by core."""
        return tuple(p for pus in self.core_pus for p in pus)

    @property
    def n_cores(self) -> int:
        return len(self.cores)

    @property
    def first_pu(self) -> int:
        """The PU the worker thread itself runs on."""
        return self.core_pus[0][0]

    @property
    def numa(self) -> int | None:
        """The group's NUMA node when it has exactly one, else None (a package spanning two)."""
        return self.numa_nodes[0] if len(self.numa_nodes) == 1 else None

    def ort_thread_affinities(self) -> str | None:
        """Value for ORT's ``session.intra_op_thread_affinities``, or None for a 1-core group.

        ORT wants one entry per intra-op thread *other than the caller* (``;``-separated,
        exactly ``intra_op_num_threads - 1`` of them), each a ``,``-list of **1-based** logical
        processor ids; on Linux id ``k`` is CPU ``k - 1``.  Thread ``i`` gets every PU of core
        ``i`` so that the kernel may use either hyperthread of it.
        """
        if self.n_cores <= 1:
            return None
        return ";".join(",".join(str(p + 1) for p in pus) for pus in self.core_pus[1:])

    def describe(self) -> str:
        """One line for logs: name, cores, PUs, NUMA node(s)."""
        numa = ",".join(map(str, self.numa_nodes)) or "?"
        return f"{self.name}: {self.n_cores} core(s), PUs {format_pus(self.pus)}, NUMA {numa}"


@dataclass(frozen=True)
class CpuGroups(Sequence[CpuGroup]):
    """The groups of a policy, plus the cores it held back; iterates over the groups."""

    policy: str
    groups: tuple[CpuGroup, ...]
    reserved: tuple[tuple[int, ...], ...] = ()  # one tuple of allowed PUs per reserved core
    reserved_cores: tuple[int, ...] = ()

    @property
    def reserved_pus(self) -> tuple[int, ...]:
        return tuple(p for pus in self.reserved for p in pus)

    @overload
    def __getitem__(self, i: int) -> CpuGroup: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[CpuGroup]: ...
    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self.groups[i]

    def __len__(self) -> int:
        return len(self.groups)


# ------------------------------------------------------------------------- parsing
@dataclass(frozen=True)
class _Policy:
    kind: str  # numa | package | cores | explicit
    size: int = 0
    explicit: tuple[tuple[int, ...], ...] = ()
    reserve: int | None = None  # None: no reserve= term


_EXPLICIT = re.compile(r"^[\d\s,;\-]+$")


def _parse_int(text: str, what: str, policy: str, minimum: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise GroupError(f"{what} needs an integer, got {text.strip()!r} in policy {policy!r}") from None
    if value < minimum:
        raise GroupError(f"{what} must be >= {minimum}, got {value} in policy {policy!r}")
    return value


def _parse_explicit(text: str, policy: str) -> tuple[tuple[int, ...], ...]:
    groups: list[tuple[int, ...]] = []
    for gi, chunk in enumerate(text.split(";")):
        pus: list[int] = []
        for token in (t.strip() for t in chunk.split(",")):
            if not token:
                continue
            m = re.fullmatch(r"(\d+)\s*(?:-\s*(\d+))?", token)
            if not m:
                raise GroupError(f"{token!r} is not a PU number or range a-b in policy {policy!r}")
            lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
            if lo > hi:
                raise GroupError(f"PU range {token!r} is backwards in policy {policy!r}")
            for p in range(lo, hi + 1):
                if p in pus:
                    raise GroupError(f"PU {p} is listed twice in group {gi} of policy {policy!r}")
                pus.append(p)
        if not pus:
            raise GroupError(f"group {gi} of the explicit policy {policy!r} is empty")
        groups.append(tuple(pus))
    return tuple(groups)


def _parse(policy: str) -> _Policy:
    text = policy.strip() or DEFAULT_POLICY
    # Explicit lists contain commas, so pull the reserve=N terms out first and keep the rest whole.
    terms = [t.strip() for t in text.split(",")]
    reserve_terms = [t for t in terms if re.match(r"^reserve\b", t)]
    base = ",".join(t for t in terms if not re.match(r"^reserve\b", t)).strip().strip(",")
    if len(reserve_terms) > 1:
        raise GroupError(f"reserve= is given {len(reserve_terms)} times in policy {policy!r}")
    reserve = None
    if reserve_terms:
        m = re.fullmatch(r"reserve\s*=\s*(.*)", reserve_terms[0])
        if not m:
            raise GroupError(f"write reserve=N, not {reserve_terms[0]!r}, in policy {policy!r}")
        reserve = _parse_int(m.group(1), "reserve", policy, 0)
    base = base or DEFAULT_POLICY
    low = base.lower()
    if low == "numa":
        return _Policy("numa", reserve=reserve)
    if low in ("package", "socket"):
        return _Policy("package", reserve=reserve)
    m = re.fullmatch(r"cores\s*=\s*(.*)", low)
    if m:
        return _Policy("cores", size=_parse_int(m.group(1), "cores", policy, 1), reserve=reserve)
    if _EXPLICIT.match(base):
        return _Policy("explicit", explicit=_parse_explicit(base, policy), reserve=reserve)
    words = [w.strip() for w in base.split(",") if w.strip()]
    if len(words) > 1:
        raise GroupError(f"policy {policy!r} has several base terms ({', '.join(words)}); pick one: {_HELP}")
    raise GroupError(f"unknown CPU group policy {base!r}: {_HELP}")


def policy_reserve(policy: str) -> int | None:
    """The cores ``policy`` holds back for GPU threads: N for ``reserve=N``, 0 for an explicit PU
    list (its author chose every core), ``None`` when it leaves the choice to the caller."""
    spec = _parse(policy)
    return 0 if spec.kind == "explicit" and not spec.reserve else spec.reserve


# ------------------------------------------------------------------------- building
def _reserve(topo: Topology, cores: list[CoreInfo], n: int, policy: str) -> list[CoreInfo]:
    """The last n usable cores, walking back from the end of the last NUMA node."""
    if n == 0:
        return []
    if n >= len(cores):
        raise GroupError(
            f"reserve={n} leaves no core for CPU groups: only {len(cores)} allowed core(s) "
            f"(PUs {format_pus(topo.allowed_pus)}) in policy {policy!r}"
        )
    numa_rank = {numa.os_index: i for i, numa in enumerate(topo.numa_nodes)}
    ordered = sorted(cores, key=lambda c: (numa_rank.get(c.numa, -1) if c.numa is not None else -1, c.index))
    return ordered[-n:]


def _group(gid: int, name: str, cores: list[CoreInfo], allowed: frozenset[int]) -> CpuGroup:
    numas = sorted({c.numa for c in cores if c.numa is not None})
    packages = {c.package for c in cores}
    return CpuGroup(
        id=gid,
        name=name,
        cores=tuple(c.index for c in cores),
        core_pus=tuple(c.allowed_pus(allowed) for c in cores),
        numa_nodes=tuple(numas),
        package=packages.pop() if len(packages) == 1 else None,
    )


def _by_key(
    cores: list[CoreInfo], key: Callable[[CoreInfo], int | None]
) -> list[tuple[int | None, list[CoreInfo]]]:
    """Cores bucketed by ``key`` (NUMA node, package), buckets in order of first core."""
    buckets: dict[int | None, list[CoreInfo]] = {}
    for c in cores:
        buckets.setdefault(key(c), []).append(c)
    return list(buckets.items())


def make_groups(topology: Topology, policy: str = DEFAULT_POLICY) -> CpuGroups:
    """Split the allowed cores of ``topology`` into CPU groups according to ``policy``.

    Raises :class:`GroupError` naming the cause when the policy is malformed or impossible.
    """
    spec = _parse(policy)
    allowed = topology.allowed_pus
    usable = topology.allowed_cores()
    reserved = _reserve(topology, usable, spec.reserve or 0, policy)
    reserved_ids = {c.index for c in reserved}
    usable = [c for c in usable if c.index not in reserved_ids]

    groups: list[CpuGroup] = []
    if spec.kind in ("numa", "package"):
        for at, cores in _by_key(usable, lambda c: c.numa if spec.kind == "numa" else c.package):
            groups.append(_group(len(groups), f"{spec.kind}{at}" if at is not None else "machine", cores, allowed))
    elif spec.kind == "cores":
        for numa, cores in _by_key(usable, lambda c: c.numa):
            for start in range(0, len(cores), spec.size):
                chunk = cores[start : start + spec.size]
                cores_name = (f"core{chunk[0].index}" if len(chunk) == 1
                              else f"cores{chunk[0].index}-{chunk[-1].index}")
                name = f"numa{numa}.{cores_name}"
                groups.append(_group(len(groups), name, chunk, allowed))
    else:
        groups = _explicit_groups(topology, spec, reserved, policy)

    if not groups:
        raise GroupError(f"policy {policy!r} gives no CPU group on this topology ({topology.summary()})")
    return CpuGroups(
        policy=policy.strip() or DEFAULT_POLICY,
        groups=tuple(groups),
        reserved=tuple(c.allowed_pus(allowed) for c in reserved),
        reserved_cores=tuple(c.index for c in reserved),
    )


def _explicit_groups(
    topo: Topology, spec: _Policy, reserved: list[CoreInfo], policy: str
) -> list[CpuGroup]:
    existing = {p.os_index for p in topo.pus}
    reserved_pus = {p for c in reserved for p in c.allowed_pus(topo.allowed_pus)}
    owner: dict[int, int] = {}
    groups: list[CpuGroup] = []
    for gid, pus in enumerate(spec.explicit):
        for p in pus:
            if p not in existing:
                raise GroupError(
                    f"PU {p} does not exist; this topology has PUs {format_pus(existing)} "
                    f"(policy {policy!r})"
                )
            if p not in topo.allowed_pus:
                raise GroupError(
                    f"PU {p} is not allowed for this process (allowed PUs: "
                    f"{format_pus(topo.allowed_pus)}; see taskset/cgroups) in policy {policy!r}"
                )
            if p in reserved_pus:
                raise GroupError(
                    f"PU {p} is reserved (reserve={spec.reserve} holds back PUs "
                    f"{format_pus(reserved_pus)}) in policy {policy!r}"
                )
            if p in owner:
                raise GroupError(
                    f"PU {p} is in groups {owner[p]} and {gid}; explicit groups must not "
                    f"overlap (policy {policy!r})"
                )
            owner[p] = gid
        # Cores in order of first appearance, each with the listed PUs in listed order, so the
        # first PU the user wrote is the one the worker thread runs on.
        by_core: dict[CoreInfo, list[int]] = {}
        for p in pus:
            by_core.setdefault(topo.core_of_pu(p), []).append(p)
        base = _group(gid, f"pus{format_pus(pus)}", list(by_core), topo.allowed_pus)
        groups.append(replace(base, core_pus=tuple(tuple(ps) for ps in by_core.values())))
    return groups
