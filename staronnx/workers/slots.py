"""A CUDA worker's buffer slots: what one (part, input signature) needs, reused call after call.

Everything Python does per task holds the GIL, so nothing is allocated per task: a
:class:`Slot` holds a part's IOBinding bound to device buffers of fixed addresses (what a CUDA
graph captured on it reads and writes), the pinned staging buffers of its inputs and outputs,
its timing events, its run options (its own ``gpu_graph_id``), and the copy lists each task
issues, precomputed: per input (device address, bytes), per output route
(:class:`~staronnx.workers.replicas.OutputRoute`) the write-backs and the outputs kept on the
device. A slot's graph state goes from none (``gpu_graph_id`` -1) to the capture (ORT's first
run of its graph id) to replays; the worker (:mod:`staronnx.workers.cuda`) drives it.

:class:`SlotCache` keeps slots per key; past its bound, the least recently used idle ones are
retired when a new slot is made (never on the hot path: freeing device memory synchronises
the device) and freed on the next creation or at close.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnxruntime as ort

from staronnx.errors import InputError, ModelError
from staronnx.workers.base import Feeds
from staronnx.workers.cudart import GpuEvent
from staronnx.workers.replicas import DeviceTensor, OutputRoute

__all__ = ["GRAPH_CAPTURE", "GRAPH_REPLAY", "NO_GRAPH", "Part", "Slot", "SlotCache", "SlotTensor",
           "check_feeds", "native_run", "numpy_type"]

#: ONNX Runtime type strings -> numpy dtypes the worker can stage and return.
ORT_TO_NUMPY: dict[str, np.dtype] = {
    f"tensor({k})": np.dtype(v)
    for k, v in {
        "float": np.float32, "float16": np.float16, "double": np.float64,
        "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
        "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
        "bool": np.bool_,
    }.items()
}

# A slot's graph state: none (runs with gpu_graph_id -1), the capture (ORT's first run of the
# slot's graph id: regular run, capture and replay in one call), replays.
NO_GRAPH, GRAPH_CAPTURE, GRAPH_REPLAY = range(3)


@dataclass
class Part:
    """One part's session and what the worker needs to know about its signature."""

    session: ort.InferenceSession
    inputs: list[str]
    input_dtypes: list[np.dtype | None]
    input_shapes: list[list[int | str | None]]
    outputs: list[str]
    #: per output: its shape is determined by the input shapes (so it may be pre-allocated).
    static_outputs: list[bool]
    #: ``len(inputs)``, read per task
    n_inputs: int = 0

    @classmethod
    def of(cls, session: ort.InferenceSession) -> Part:
        ins, outs = session.get_inputs(), session.get_outputs()
        symbols = {d for i in ins for d in i.shape if isinstance(d, str)}
        return cls(
            session=session,
            inputs=[i.name for i in ins],
            input_dtypes=[ORT_TO_NUMPY.get(i.type) for i in ins],
            input_shapes=[list(i.shape) for i in ins],
            outputs=[o.name for o in outs],
            n_inputs=len(ins),
            static_outputs=[
                all(isinstance(d, int) or (isinstance(d, str) and d in symbols) for d in o.shape)
                for o in outs
            ],
        )


def native_run(session: ort.InferenceSession, binding: Any) -> tuple[Callable[[Any, Any], None], Any]:
    """``(run, bound)`` such that ``run(bound, options)`` is
    ``session.run_with_iobinding(binding, options)`` through ORT's native method: the Python
    wrapper's checks are for WebGPU graph capture (ORT 1.32 reads ``gpu_graph_id`` back from
    the run options and asks the session about WebGPU on every call, 2-4 us with the GIL
    held), and a CUDA worker's steady run needs none of them. Looked up once per slot, not
    per task. An ORT without these attributes gets its wrapper."""
    try:
        return session._sess.run_with_iobinding, binding._iobinding
    except AttributeError:
        return session.run_with_iobinding, binding


# ---------------------------------------------------------------------- buffer slots
_UNSTAGED = np.empty(0, np.uint8)

@dataclass(eq=False)
class SlotTensor:
    """A tensor's staging: pinned host buffer (and a numpy view of it), device buffer (None:
    ORT allocates), shape; sizes and views computed once, not per task."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    pinned: Any = None  # PinnedBuffer
    device: Any = None  # DeviceBuffer
    #: of ``pinned``, with this dtype and shape (empty until staged: nothing fits in it)
    view: np.ndarray = field(default_factory=lambda: _UNSTAGED)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def free(self) -> None:
        self.view = _UNSTAGED
        for buf in (self.pinned, self.device):
            if buf is not None:
                buf.free()
        self.pinned = self.device = None


#: a fixed slot's copy lists for one output route: the write-backs (as ``Slot.out_copies``), the
#: outputs kept on the device (name, device address, dtype, shape), the tensors the write-backs fill
RoutePlan = tuple[list[tuple[int, int, int]], list[tuple[str, int, np.dtype, tuple[int, ...]]], list["SlotTensor"]]


@dataclass(eq=False)
class Slot:
    """Everything one (part, input signature) needs, reused call after call.

    ``outputs`` is None until the first run has shown the output shapes and types; ``fixed``
    once every output is bound to a buffer of ours (the fast path).
    """

    key: tuple[Any, ...]
    part: int
    binding: Any  # ort.IOBinding
    inputs: list[SlotTensor]
    events: dict[str, GpuEvent]
    run_options: Any  # ort.RunOptions: the worker's (gpu_graph_id -1) or the slot's graph id
    #: ``(run, bound)``: ``run(bound, run_options)`` runs the part on this binding (:func:`native_run`;
    #: with a graph, through the runtime's :meth:`~staronnx.workers.cudart.GpuRuntime.graph_run`)
    native: tuple[Callable[[Any, Any], None], Any]
    #: ``native``'s run without a graph (what the slot falls back to)
    plain_run: Callable[[Any, Any], None]
    outputs: list[SlotTensor] | None = None
    bound: list[bool] = field(default_factory=list)  # output i bound to our device buffer
    fixed: bool = False
    busy: bool = False
    last_used: int = 0
    graph: int = NO_GRAPH
    graph_id: int | None = None
    #: threads (``threading.get_ident()``) on which ORT holds this slot's graph
    graph_threads: set[int] = field(default_factory=set)
    capture_tries: int = 0
    # per task: (device ptr, nbytes) of each input / output, precomputed
    in_copies: list[tuple[Any, int, int]] = field(default_factory=list)  # (tensor, device ptr, nbytes)
    out_copies: list[tuple[int, int, int]] = field(default_factory=list)  # (pinned, device ptr, nbytes)
    in_bytes: int = 0
    out_bytes: int = 0
    #: per :class:`OutputRoute` (by identity), its :data:`RoutePlan`
    routes: dict[OutputRoute, RoutePlan] = field(default_factory=dict)

    def route_plan(self, route: OutputRoute) -> RoutePlan:
        """A fixed slot's copy lists for ``route``, made once per route."""
        assert self.outputs is not None
        plan = ([(t.pinned.ptr, t.device.ptr, t.nbytes) for t in self.outputs if t.name in route.host],
                [(t.name, t.device.ptr, t.dtype, t.shape) for t in self.outputs if t.name in route.device],
                [t for t in self.outputs if t.name in route.host])
        self.routes[route] = plan
        return plan

    def free(self) -> None:
        for t in self.inputs + (self.outputs or []):
            t.free()
        for ev in self.events.values():
            ev.destroy()
        self.events.clear()
        self.binding = None


class SlotCache:
    """Slots per key, at most ``max_slots`` kept (see the module docstring)."""

    def __init__(self, max_slots: int) -> None:
        self.max_slots = max_slots
        self._slots: dict[tuple[Any, ...], list[Slot]] = {}
        self._clock = 0
        self._count = 0
        self.created = 0
        self.retired: list[Slot] = []

    def take(self, key: tuple[Any, ...]) -> Slot | None:
        """An idle slot for ``key``, marked busy; None when there is none (make one)."""
        try:
            slots = self._slots[key]
        except KeyError:  # (a subscript rather than get: this runs per task)
            return None
        for slot in slots:
            if not slot.busy:
                self._clock += 1
                slot.busy = True
                slot.last_used = self._clock
                return slot
        return None

    def add(self, slot: Slot) -> None:
        """Register a new (busy) slot, retiring idle ones beyond ``max_slots``."""
        self._clock += 1
        slot.busy = True
        slot.last_used = self._clock
        self._slots.setdefault(slot.key, []).append(slot)
        self._count += 1
        self.created += 1
        excess = self._count - self.max_slots
        if excess > 0:
            idle = sorted((s for ss in self._slots.values() for s in ss if not s.busy),
                          key=lambda s: s.last_used)
            for old in idle[:excess]:
                self._slots[old.key].remove(old)
                if not self._slots[old.key]:
                    del self._slots[old.key]
                self._count -= 1
                self.retired.append(old)

    def free_retired(self) -> None:
        while self.retired:
            self.retired.pop().free()

    def __len__(self) -> int:
        return self._count

    def all(self) -> list[Slot]:
        return [s for ss in list(self._slots.values()) for s in ss]

    def close(self) -> None:
        for slot in self.all():
            slot.free()
        self._slots.clear()
        self._count = 0
        self.free_retired()


def check_feeds(part: Part, index: int, feeds: Feeds) -> list[np.ndarray]:
    """The feeds as arrays in the session's input order, or an :class:`InputError`."""
    unknown = sorted(set(feeds) - set(part.inputs))
    missing = [n for n in part.inputs if n not in feeds]
    if unknown or missing:
        raise InputError(
            f"part {index} takes inputs {part.inputs}"
            + (f"; missing {missing}" if missing else "")
            + (f"; unknown {unknown}" if unknown else "")
        )
    arrays = []
    for name, dtype, shape in zip(part.inputs, part.input_dtypes, part.input_shapes):
        a = feeds[name]
        if not isinstance(a, (np.ndarray, DeviceTensor)):  # (a pool batch keeps its pinned_ptr)
            a = np.asarray(a)
        if dtype is None:
            raise InputError(f"input {name!r} of part {index} has a type the CUDA worker "
                             "cannot stage (only numeric and bool tensors)")
        if a.dtype != dtype:
            raise InputError(f"input {name!r} of part {index} must be {dtype}, got {a.dtype}")
        fixed_dims_differ = any(isinstance(d, int) and d != n for d, n in zip(shape, a.shape))
        if len(shape) != len(a.shape) or fixed_dims_differ:
            raise InputError(f"input {name!r} of part {index} must have shape {shape}, "
                             f"got {list(a.shape)}")
        arrays.append(a)
    return arrays


def numpy_type(value: Any, name: str) -> np.dtype:
    kind = value.data_type()
    dtype = ORT_TO_NUMPY.get(kind)
    if dtype is None:
        raise ModelError(f"output {name!r} is a {kind}, which the CUDA worker cannot return "
                         "as a numpy array")
    return dtype
