"""Which copies a placement needs: the one rule the engine, the predictor, the simulator and
the LP bound share (StarPU's datawizard decisions, ``src/datawizard/coherency.c``).

A request's tensor is a data handle whose valid copies live on memory nodes (``numa0``: host
RAM; ``cuda1``: a GPU's memory), StarPU's MSI states reduced to what an inference DAG needs:
a tensor is written once, by its producer, and only read after that.

- A model input starts valid on the host (:data:`HOST_NODE`).
- A part's output is valid where it was produced, and stays there: a GPU-to-GPU chain keeps
  its intermediates on the device. A request's final output is also written back to the host
  by its producer (:func:`writeback`): that, and only that, comes down at the end.
- A task whose input is not valid on its worker's node fetches it (:func:`fetch`) from the
  cheapest valid copy (:func:`source`, priced by the bus model). The fetched copy is kept as a
  new valid copy on that node when another reader has not started yet (:func:`kept`), so a
  node fetches a tensor once; a lone reader's copy goes straight into the buffers it runs on.
- A tensor of zero bytes is never copied.

A :class:`DataHandle` is the one record of a tensor's state: the nodes it is valid on (what
the policies, the predictor and the simulator see) and, in the engine, its copy on each node
(a host array, a GPU's :class:`~staronnx.workers.replicas.DeviceTensor`) with the copy still in
flight there. Which kind a copy is follows from its node, so nothing asks a copy its class.

Apart from the handle, this module decides; it moves no byte. The engine executes these decisions
(:mod:`staronnx.workers.replicas` and the CUDA worker issue exactly these copies, which
``HostRuntime`` counts), the task-graph core records them per task, the predictor and the
simulator price them with the bus model, and :func:`request_copies` lists them for a whole
placement (what ``benchmarks/data_movement.py`` sets beside the counted copies).

Host nodes are one address space to the workers: a CPU worker on ``numa1`` reads an array on
``numa0`` in place. Such a copy is still decided and priced (a remote NUMA read costs what
the copy would), but nothing moves.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np

    from staronnx.plan import Plan
    from staronnx.runtime.sched import WorkerInfo
    from staronnx.workers.cudart import GpuEvent
    from staronnx.workers.replicas import DeviceMemory, DeviceTensor

#: where model inputs are when a request is submitted, and where final outputs are written back
HOST_NODE = "numa0"

#: ``cost(src, dst, nbytes)`` in seconds: the bus model's ``predict``
CopyCost = Callable[[str, str, int], float]


class Copy(NamedTuple):
    """One copy of one tensor from a memory node to another."""

    name: str
    src: str
    dst: str
    nbytes: int

    @property
    def kind(self) -> str:
        """``h2d``, ``d2h``, ``peer`` (GPU to GPU) or ``host`` (between host nodes)."""
        return copy_kind(self.src, self.dst)


def is_host(node: str) -> bool:
    """Whether ``node`` is host RAM (``numa<i>``) rather than a GPU's memory."""
    return node.startswith("numa")


def copy_kind(src: str, dst: str) -> str:
    """The kind of a ``src -> dst`` copy (what ``HostRuntime`` counts it as)."""
    if is_host(src):
        return "host" if is_host(dst) else "h2d"
    return "d2h" if is_host(dst) else "peer"


class DataHandle:
    """A tensor of one request (StarPU's data handle): the memory nodes holding a valid copy
    (``valid_on``, the core's decisions: what policies price) and the copies themselves (the
    engine's: ``host``, one array for every host node, since host memory is one address space
    to the workers; ``device``, a tensor per GPU node), with how many readers it waits for.

    ``valid_on`` may name a node whose copy is still being made (a prefetch: ``arriving`` until
    the engine has issued it; then ``host_ready``, or the device tensor's own ``ready`` event,
    is what its reader waits on). The simulator keeps no copies. A plain class with slots, not
    a dataclass: one or more are made per task."""

    __slots__ = ("name", "nbytes", "valid_on", "readers_left", "unstarted", "host", "host_ready", "device", "arriving")

    def __init__(self, name: str, nbytes: int, valid_on: frozenset[str] = frozenset(), readers_left: int = 0,
                 host: np.ndarray | None = None) -> None:
        self.name = name
        self.nbytes = nbytes
        #: frozen, and replaced when a node gains a copy: a task's view then shares it instead
        #: of copying a set per input per task
        self.valid_on = frozenset(valid_on)
        #: readers not finished (the copies are dropped at 0) ...
        self.readers_left = readers_left
        #: ... and not started: a fetched copy is kept while some reader has yet to start
        self.unstarted = readers_left
        #: the copy in host memory, and, while it is still coming down from a GPU (a prefetch),
        #: the event its reader waits on with the node that lends it
        self.host = host
        self.host_ready: tuple[GpuEvent, DeviceMemory] | None = None
        #: the copies in GPU memory, by node (None: none); replaced, not changed, when one is
        #: added (a reader may hold the old map)
        self.device: dict[str, DeviceTensor] | None = None
        #: prefetches decided (``valid_on`` names their nodes) and not yet issued by the engine
        self.arriving = 0

    def __repr__(self) -> str:
        return f"DataHandle({self.name!r}, {self.nbytes} B, on {sorted(self.valid_on)})"

    @property
    def shape(self) -> tuple[int, ...]:
        """Its shape (read from a copy: the engine's handles have one while they are read)."""
        if self.host is not None:
            return self.host.shape
        if self.device:
            return next(iter(self.device.values())).shape
        raise RuntimeError(f"{self!r} has no copy to read a shape from")

    def on_device(self, node: str) -> DeviceTensor | None:
        """Its copy in the memory of GPU ``node``, or None."""
        return None if self.device is None else self.device.get(node)

    def add_host(self, array: np.ndarray, ready: tuple[GpuEvent, DeviceMemory] | None = None) -> None:
        """``array`` becomes its host copy unless it has one (``ready``: the copy is still
        coming down, see :attr:`host_ready`)."""
        if self.host is None:
            self.host_ready = ready  # (first: a reader that sees the copy sees that it is in flight)
            self.host = array

    def add_device(self, node: str, tensor: DeviceTensor) -> None:
        """``tensor`` becomes its copy on GPU ``node`` unless it has one there."""
        if self.device is None:
            self.device = {node: tensor}
        elif node not in self.device:
            self.device = {**self.device, node: tensor}

    def drop(self) -> None:
        """Its last reader is done: the copies go (a GPU buffer back to its arena)."""
        self.host = self.host_ready = self.device = None

    def arrived(self, node: str) -> bool:
        """Whether no copy to ``node`` is still in flight (a prefetch there is complete, or
        there was none); the event of one that completed goes back."""
        if not is_host(node):
            t = self.on_device(node)
            return t is None or t.memory.settled(t)
        pending = self.host_ready
        if pending is None:
            return True
        if not pending[1].done(pending[0]):
            return False
        if self.host_ready is pending:  # cleared before the event goes back: another copy may take it
            self.host_ready = None
            pending[1].give_event(pending[0])
        return True

    def wait_host(self) -> None:
        """Wait until its host copy has come down (a prefetch from a GPU still in flight)."""
        pending = self.host_ready
        if pending is not None:
            pending[0].synchronize()
            if self.host_ready is pending:  # (two readers: the first gives the event back)
                self.host_ready = None
                pending[1].give_event(pending[0])


def source(valid_on: Collection[str], dst: str, nbytes: int, cost: CopyCost | None = None) -> str:
    """The valid copy a fetch to ``dst`` reads: the cheapest by ``cost``; on a tie (or without
    a bus model) a host copy first, then by name, so every caller picks the same one."""
    if len(valid_on) == 1:
        return next(iter(valid_on))
    order = sorted(valid_on, key=lambda n: (not is_host(n), n))
    if cost is None:
        return order[0]
    best, best_cost = order[0], math.inf
    for node in order:
        c = cost(node, dst, nbytes)
        c = c if math.isfinite(c) else math.inf
        if c < best_cost:
            best, best_cost = node, c
    return best


def fetch(name: str, nbytes: int, valid_on: Collection[str], dst: str, cost: CopyCost | None = None) -> Copy | None:
    """The copy a reader on ``dst`` needs of a tensor valid on ``valid_on``, or None (valid
    there already, empty, or nowhere valid: nothing to read from)."""
    if dst in valid_on or nbytes <= 0 or not valid_on:
        return None
    return Copy(name, source(valid_on, dst, nbytes, cost), dst, nbytes)


def kept(readers_not_started: int) -> bool:
    """Whether a fetched copy stays valid on its node after its reader: when another reader of
    the tensor has not started yet (it may run on that node and find it there)."""
    return readers_not_started > 0


def writeback(name: str, nbytes: int, node: str, host: str = HOST_NODE) -> Copy | None:
    """The copy of a request's final output produced on ``node`` to the host, or None."""
    return None if is_host(node) or nbytes <= 0 else Copy(name, node, host, nbytes)


def produced_on(node: str, final: bool, host: str = HOST_NODE) -> frozenset[str]:
    """Where a part's output is valid once its producer ran on ``node``: there, and on the
    host too when it is a final output (written back by its producer)."""
    return frozenset((node, host) if final and not is_host(node) else (node,))


def price(copies: Iterable[Copy], cost: CopyCost) -> float:
    """Seconds the bus model gives these copies (one after the other; unknown links: 0)."""
    return sum((t for c in copies if math.isfinite(t := cost(c.src, c.dst, c.nbytes))), 0.0)


def task_copies(inputs: Iterable[tuple[str, int, Collection[str]]], node: str,
                outputs: Iterable[tuple[str, int]] = (), cost: CopyCost | None = None) -> list[Copy]:
    """The copies a task running on ``node`` issues: a fetch per input (name, bytes, valid
    nodes) not valid there, a write-back per final output (name, bytes) when ``node`` is a
    GPU. What the predictor prices for a candidate worker and the simulator charges."""
    out = [c for name, nbytes, valid in inputs if (c := fetch(name, nbytes, valid, node, cost)) is not None]
    out += [c for name, nbytes in outputs if (c := writeback(name, nbytes, node)) is not None]
    return out


def request_copies(parts: Sequence[tuple[Sequence[str], Sequence[str]]], nodes: Sequence[str],
                   nbytes: Mapping[str, int], finals: Collection[str], cost: CopyCost | None = None,
                   host: str = HOST_NODE) -> list[Copy]:
    """Every copy one request makes when its parts (``(inputs, outputs)`` each, producers
    first) run on ``nodes``, one after the other: the rules above, applied in the order the
    core applies them. What a placement costs in copies, before anything runs."""
    readers: Counter[str] = Counter(n for ins, _ in parts for n in ins)
    produced = {n for _, outs in parts for n in outs}
    valid: dict[str, frozenset[str]] = {n: frozenset((host,)) for n in readers if n not in produced}
    copies: list[Copy] = []
    for (ins, outs), node in zip(parts, nodes):
        for name in ins:
            readers[name] -= 1
            c = fetch(name, nbytes.get(name, 0), valid.get(name, ()), node, cost)
            if c is not None:
                copies.append(c)
                if kept(readers[name]):
                    valid[name] = valid[name] | {node}
        for name in outs:
            final = name in finals
            valid[name] = produced_on(node, final, host)
            if final and (w := writeback(name, nbytes.get(name, 0), node, host)) is not None:
                copies.append(w)
    return copies


def tally(copies: Iterable[Copy]) -> dict[str, tuple[int, int]]:
    """``kind -> (copies, bytes)``: what a benchmark sets beside ``HostRuntime``'s counts."""
    out: dict[str, tuple[int, int]] = {}
    for c in copies:
        n, b = out.get(c.kind, (0, 0))
        out[c.kind] = (n + 1, b + c.nbytes)
    return out


def with_writebacks(times: Sequence[Sequence[float]], plan: Plan, workers: Sequence[WorkerInfo],
                    nbytes: Mapping[str, int], cost: CopyCost, first: int = 0) -> list[list[float]]:
    """``times[p][w]`` (seconds of part ``p`` on worker ``w``; rows ``first..`` are ``plan``'s
    parts) plus, on a worker whose memory node is a GPU, the bus time of writing the part's
    final outputs back to the host: the copy its task issues on that worker (what the LP
    bound charges the worker, as the engine and the simulator do). ``plan`` has ``parts``
    (each with ``outputs``) and ``output_names``."""
    out = [list(row) for row in times]
    finals = set(plan.output_names)
    for local, part in enumerate(plan.parts):
        names = [n for n in part.outputs if n in finals]
        if not names:
            continue
        row = out[first + local]
        for w, worker in enumerate(workers):
            node = worker.memory_node
            if not is_host(node) and math.isfinite(row[w]):
                row[w] += price([c for n in names if (c := writeback(n, nbytes.get(n, 0), node)) is not None], cost)
    return out
