"""Triton's sequence batcher for stateful models served from a model repository.

A stateful model (a recurrent net, a streaming recogniser, a voice-activity detector) takes a
stream of requests that belong together, a *sequence*, named by the client's ``sequence_id``
(a non-zero integer or a non-empty string), its first request marked ``sequence_start`` and its
last ``sequence_end``. A config's ``sequence_batching`` says what the server does for it:

* **control inputs** (``control_input``): model inputs the server fills for each request, never
  sent by the client: START and END (the request's flags), READY (always true here: every row of
  a batch is a request), CORRID (the sequence id, in the config's ``data_type``), each in the
  values the config gives (``int32_false_true``, ``fp32_false_true``, ``bool_false_true``);
* **implicit state** (``state``): a model input the server feeds with the model output of the
  sequence's previous request, kept here, between requests, as a numpy array per sequence (the
  host's memory node), and reset at START to ``initial_state`` (zeros, or a file's bytes) or,
  without one, to zeros (Triton leaves it uninitialised; zeros are the defined choice);
* **order and slots**: a sequence's requests run one at a time, in the order they came (its
  state of one request is the next one's input); requests of different sequences share batches
  through the model's batcher (:mod:`staronnx.serving.server`), one row per sequence, since a
  sequence never has two requests in flight. At most ``slots`` sequences are active at once
  (``direct``: ``max_batch_size``, at least 1; ``oldest``: ``max_candidate_sequences``); the
  first request of a sequence beyond them waits, in a backlog, for a sequence to end, or until
  the request's ``timeout`` (Triton's: the sequence is then refused UNAVAILABLE, and over); a
  request's ``priority`` is read by no sequence batcher (Triton's neither);
* **idle release** (``max_sequence_idle_microseconds``, 1 s where the config says 0, as Triton):
  a sequence with no request for that long is released (its slot freed, its state dropped); its
  next request without START is refused, saying so.

What differs from Triton, on purpose: a batch is made of the rows that are ready (no READY=0
rows for empty slots; a partial batch padded up to a ``preferred_batch_size`` repeats its last
row, whose answer is dropped), and ``direct`` batch slots are not pinned to a row position
(a staronnx model has no per-slot state inside it: the state lives here). A request is checked
whole before it joins its sequence, so a refused one (a wrong datatype on the END request)
leaves the sequence as it was.

Where the state lives: host memory, as numpy arrays, because the runtime takes a batch's feeds
as host arrays (:meth:`~staronnx.runtime.runtime.Runtime.submit`; its data handles are its own).
Keeping a sequence's state as a data handle on the memory node of the worker that runs its next
step (a GPU's, without the copy back and forth each step) needs the runtime to take and give
handles; until then a state crosses the bus with the step's other inputs and outputs.

The config side (:func:`policy_of`) checks the section against the ONNX model and refuses what
cannot be honoured by name; the serving side (:class:`Sequences`) runs on the event loop, in
front of the model's :meth:`~staronnx.serve.models.ModelEndpoint.run`.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from staronnx.serve import protocol
from staronnx.serve.protocol import ProtocolError, invalid, shown

# model_config_pb2 is imported where a config is read, not here: the served models import this
# module, and a process that also imports tritonclient.grpc (a test's) must not register the
# ``inference.*`` messages twice (see staronnx.serve.grpc_api)
if TYPE_CHECKING:
    from staronnx.serve.proto.model_config_pb2 import ModelConfig, ModelSequenceBatching


class TensorSpec(Protocol):
    """A model input or output as :func:`policy_of` checks a config against it
    (:class:`staronnx.serve.model_config.TensorSpec` is one: a protocol, as model_config keeps
    the :class:`SequencePolicy` this module makes, and the two do not import each other)."""

    @property
    def name(self) -> str: ...

    @property
    def data_type(self) -> str: ...

    @property
    def dims(self) -> tuple[int, ...]: ...


class _Refusals(Protocol):
    """A model's statistics as the sequence batcher counts in them
    (:class:`staronnx.serve.metrics.ModelStats` is one)."""

    def refused(self, reason: str) -> None: ...


class _Answer(Protocol):
    """An answer's outputs by name (:class:`staronnx.serve.models.Answer` is one)."""

    outputs: dict[str, np.ndarray]


_A = TypeVar("_A", bound=_Answer, covariant=True)


class Endpoint(Protocol[_A]):
    """What the sequence batcher needs of the model it fronts (a
    :class:`staronnx.serve.models.ModelEndpoint`, which holds the batcher: a protocol, so that
    this module and the served models do not import each other)."""

    @property
    def stats(self) -> _Refusals: ...

    def check(self, inputs: Mapping[str, np.ndarray], datatypes: Mapping[str, str],
              outputs: Sequence[str] | None) -> None: ...

    async def run(self, inputs: Mapping[str, np.ndarray], datatypes: Mapping[str, str],
                  outputs: Sequence[str] | None, *, decode_s: float = 0.0,
                  classes: Mapping[str, int] | None = None) -> _A: ...

#: the CORRID data types Triton allows
CORRID_TYPES = ("TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32", "TYPE_STRING")

#: the longest string sequence id (Triton's limit, in bytes)
MAX_STRING_ID_BYTES = 128

#: sequences remembered after they ended or were released, to say so to a late request
REMEMBERED = 4096

#: the folder of a model's initial state files (Triton's)
INITIAL_STATE_FOLDER = "initial_state"

#: ModelSequenceBatching.Control.Kind's values (model_config.proto) -> what the control says
_KINDS = {0: "start", 1: "ready", 2: "end", 3: "corrid"}

#: a flag control's value field -> the model input's type it needs
_FLAG_FIELDS = {"int32_false_true": "TYPE_INT32", "fp32_false_true": "TYPE_FP32", "bool_false_true": "TYPE_BOOL"}


class SequenceConfigError(Exception):
    """A ``sequence_batching`` section that cannot be honoured (turned into the config's error)."""


@dataclass(frozen=True)
class ControlInput:
    """A model input the server fills from the request's sequence: its kind, datatype, the
    values meaning false and true (flags), and the shape of one request's tensor."""

    name: str
    kind: str  # "start", "end", "ready" or "corrid"
    datatype: str  # v2 datatype (INT32, FP32, BOOL, UINT64, ..., BYTES)
    false_true: tuple[int | float | bool, int | float | bool] | None
    shape: tuple[int, ...]

    def value(self, request: SequenceRequest) -> np.ndarray:
        """This control's tensor for one request of ``request``'s sequence."""
        if self.kind == "corrid":
            if self.datatype == protocol.BYTES:
                return np.full(self.shape, str(request.id), dtype=object)
            return np.full(self.shape, request.id, dtype=protocol.DATATYPES[self.datatype])
        assert self.false_true is not None
        flag = {"start": request.start, "end": request.end, "ready": True}[self.kind]
        return np.full(self.shape, self.false_true[int(flag)], dtype=protocol.DATATYPES[self.datatype])


@dataclass(frozen=True)
class ImplicitState:
    """A state the server keeps per sequence: the model input fed with the model output of the
    previous request, its datatype, and its value at the sequence's start."""

    input_name: str
    output_name: str
    datatype: str
    initial: np.ndarray = field(compare=False)
    #: whether the config's output lists the state output (then a client may ask for it)
    visible: bool = False


@dataclass(frozen=True)
class SequencePolicy:
    """A model's ``sequence_batching``, checked against its ONNX graph."""

    strategy: str  # "direct" or "oldest"
    #: sequences active at once (the others wait in the backlog)
    slots: int
    #: seconds a sequence may go without a request before it is released
    idle_s: float
    controls: tuple[ControlInput, ...] = ()
    states: tuple[ImplicitState, ...] = ()
    #: whether the model batches (max_batch_size > 0): then each request carries one row
    batched: bool = True

    @property
    def filled(self) -> frozenset[str]:
        """The model inputs the server fills (clients never send them)."""
        return frozenset([c.name for c in self.controls] + [s.input_name for s in self.states])

    @property
    def kept(self) -> frozenset[str]:
        """The state outputs the server keeps and clients do not see (not listed in the config)."""
        return frozenset(s.output_name for s in self.states if not s.visible)

    @property
    def corrid(self) -> ControlInput | None:
        return next((c for c in self.controls if c.kind == "corrid"), None)

    def warmup_feeds(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A ``model_warmup`` sample's feeds (the client's inputs) with the inputs the server
        fills: each row a sequence of one request (START and END, READY, a CORRID of the row's
        number from 1) on the initial states. The sample runs on the runtime directly, not
        through :class:`Sequences`, so without these it would fail the model's load on inputs
        it may not give; a sequence of one request keeps nothing, so the warm-up leaves no state."""
        rows = next(iter(feeds.values())).shape[0] if self.batched and feeds else 1
        out = dict(feeds)
        for c in self.controls:
            values = [c.value(SequenceRequest(i + 1, start=True, end=True)) for i in range(rows)]
            out[c.name] = np.concatenate(values) if self.batched else values[0]
        for s in self.states:
            out[s.input_name] = np.concatenate([s.initial] * rows) if self.batched else s.initial
        return out


def policy_of(config: ModelConfig, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
              folder: Path) -> SequencePolicy | None:
    """The sequence policy of a (completed) config (a ``ModelConfig`` message), None without
    ``sequence_batching``; each field checked against the model's ``inputs`` and ``outputs`` (a
    mismatch raises :class:`SequenceConfigError` naming the field)."""
    from staronnx.serve.proto import model_config_pb2 as mc  # see the imports above

    if not config.HasField("sequence_batching"):
        return None
    sb = config.sequence_batching
    mbs = config.max_batch_size
    model_in = {t.name: t for t in inputs}
    model_out = {t.name: t for t in outputs}
    declared = {t.name for t in config.input}
    if sb.iterative_sequence:
        raise SequenceConfigError("sequence_batching.iterative_sequence is not honoured by staronnx serve (it re-runs "
                                  "a request inside the server: decoupled models); remove it")
    if sb.HasField("direct") and sb.direct.minimum_slot_utilization:
        raise SequenceConfigError("sequence_batching.direct.minimum_slot_utilization is not honoured by staronnx "
                                  "serve (a batch leaves with the rows that are ready, after max_queue_delay_microseconds)")

    def one_request(dims: Sequence[int]) -> tuple[int, ...]:
        return tuple(d if d > 0 else 1 for d in dims)

    controls: list[ControlInput] = []
    seen: dict[str, str] = {}
    for i, ci in enumerate(sb.control_input):
        where = f"sequence_batching.control_input[{i}] {ci.name!r}"
        model_t = model_in.get(ci.name)
        if model_t is None:
            raise SequenceConfigError(f"{where} is not one of the model's inputs ({', '.join(model_in)})")
        if ci.name in declared:
            raise SequenceConfigError(f"{where} is filled by the server: remove it from the config's input")
        if len(ci.control) != 1:
            raise SequenceConfigError(f"{where}: give exactly one control per control input, got {len(ci.control)}")
        c = ci.control[0]
        kind = _KINDS[c.kind]
        if kind in seen:
            raise SequenceConfigError(f"{where}: CONTROL_SEQUENCE_{kind.upper()} is already given by input "
                                      f"{seen[kind]!r}")
        seen[kind] = ci.name
        model_type = model_t.data_type
        if kind == "corrid":
            if any(getattr(c, f) for f in _FLAG_FIELDS):
                raise SequenceConfigError(f"{where}: CONTROL_SEQUENCE_CORRID takes a data_type, not false/true values")
            type_name = mc.DataType.Name(c.data_type)
            if type_name not in CORRID_TYPES:
                raise SequenceConfigError(f"{where}: CONTROL_SEQUENCE_CORRID data_type {type_name} is not one Triton "
                                          f"allows ({', '.join(CORRID_TYPES)})")
            if type_name != model_type:
                raise SequenceConfigError(f"{where}: CONTROL_SEQUENCE_CORRID data_type {type_name}, but the model's "
                                          f"input is {model_type}")
            controls.append(ControlInput(ci.name, kind, protocol.config_datatype(type_name), None,
                                         one_request(model_t.dims)))
            continue
        given = [f for f in _FLAG_FIELDS if getattr(c, f)]
        if c.data_type != mc.TYPE_INVALID or len(given) != 1:
            raise SequenceConfigError(f"{where}: CONTROL_SEQUENCE_{kind.upper()} takes one of "
                                      f"{', '.join(_FLAG_FIELDS)} (two values: false, true)"
                                      + (", not a data_type" if c.data_type != mc.TYPE_INVALID else ""))
        values = tuple(getattr(c, given[0]))
        if len(values) != 2:
            raise SequenceConfigError(f"{where}: {given[0]} must hold two values (false, true), got {list(values)}")
        if _FLAG_FIELDS[given[0]] != model_type:
            raise SequenceConfigError(f"{where}: {given[0]} needs a {_FLAG_FIELDS[given[0]]} input, but the model's is "
                                      f"{model_type}")
        controls.append(ControlInput(ci.name, kind, protocol.config_datatype(model_type), (values[0], values[1]),
                                     one_request(model_t.dims)))
    listed_out = {t.name for t in config.output}
    states: list[ImplicitState] = []
    for i, st in enumerate(sb.state):
        where = f"sequence_batching.state[{i}]"
        model_t, out_t = model_in.get(st.input_name), model_out.get(st.output_name)
        if model_t is None:
            raise SequenceConfigError(f"{where}: input_name {st.input_name!r} is not one of the model's inputs "
                                      f"({', '.join(model_in)})")
        if out_t is None:
            raise SequenceConfigError(f"{where}: output_name {st.output_name!r} is not one of the model's outputs "
                                      f"({', '.join(model_out)})")
        if st.input_name in declared or st.input_name in seen.values():
            raise SequenceConfigError(f"{where}: input {st.input_name!r} is filled by the server: remove it from the "
                                      "config's input and control inputs")
        type_name = mc.DataType.Name(st.data_type)
        for t in (model_t, out_t):
            if type_name != t.data_type:
                raise SequenceConfigError(f"{where}: data_type {type_name}, but the model's {t.name!r} is "
                                          f"{t.data_type}")
        dims = [1, *st.dims] if mbs > 0 else list(st.dims)
        for t in (model_t, out_t):
            if not protocol.dims_fit(dims, list(t.dims)):
                raise SequenceConfigError(f"{where}: dims {list(st.dims)} do not fit the model's {t.name!r} "
                                          f"{list(t.dims[1:] if mbs > 0 else t.dims)}"
                                          + (" (without the batch dimension, as max_batch_size > 0)" if mbs else ""))
        initial = _initial_state(st, where, mbs, folder)
        states.append(ImplicitState(st.input_name, st.output_name, protocol.config_datatype(type_name), initial,
                                    visible=st.output_name in listed_out))
    if sb.HasField("oldest"):
        strategy = "oldest"
        slots = sb.oldest.max_candidate_sequences if sb.oldest.max_candidate_sequences > 0 else max(1, mbs)
    else:
        strategy, slots = "direct", max(1, mbs)
    idle_us = sb.max_sequence_idle_microseconds  # never 0: model_config.complete_sequence_batching fills it
    return SequencePolicy(strategy, slots, idle_us / 1e6, tuple(controls), tuple(states), batched=mbs > 0)


def _initial_state(st: ModelSequenceBatching.State, where: str, mbs: int, folder: Path) -> np.ndarray:
    """A state's value at a sequence's start: its ``initial_state`` (zeros or a file's bytes,
    row-major), else zeros of its dims with 1 for each variable size."""
    from staronnx.serve.proto import model_config_pb2 as mc  # see the imports above

    type_name = mc.DataType.Name(st.data_type)
    if type_name == "TYPE_STRING":
        raise SequenceConfigError(f"{where}: a TYPE_STRING state is not honoured by staronnx serve (numeric states only)")
    dtype = protocol.DATATYPES[protocol.config_datatype(type_name)]
    if len(st.initial_state) > 1:
        raise SequenceConfigError(f"{where}: initial_state holds {len(st.initial_state)} entries; give one or none")
    if not st.initial_state:
        dims = [1, *st.dims] if mbs > 0 else list(st.dims)
        return _zeros([d if d > 0 else 1 for d in dims], dtype, where)
    init = st.initial_state[0]
    what = f"{where}.initial_state"
    if init.data_type != st.data_type:
        raise SequenceConfigError(f"{what}: data_type {mc.DataType.Name(init.data_type)} differs from the state's "
                                  f"{type_name}")
    if not init.name:
        raise SequenceConfigError(f"{what}: give it a name")
    if len(init.dims) != len(st.dims) or any(d < 1 for d in init.dims) or any(
            s != -1 and d != s for d, s in zip(init.dims, st.dims)):
        raise SequenceConfigError(f"{what}: dims {list(init.dims)} must be fixed sizes that fit the state's "
                                  f"{list(st.dims)}")
    shape = [1, *init.dims] if mbs > 0 else list(init.dims)
    which = init.WhichOneof("state_data")
    if which == "data_file":
        path = folder / INITIAL_STATE_FOLDER / init.data_file
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise SequenceConfigError(f"{what}: data_file {init.data_file!r} cannot be read: {exc}") from None
        need = math.prod(shape) * dtype.itemsize  # Python's integers: numpy's product wraps past 2**63
        if len(raw) < need:
            raise SequenceConfigError(f"{what}: data_file {init.data_file!r} holds {len(raw)} bytes, the state "
                                      f"{shape} needs {need}")
        return np.frombuffer(raw[:need], dtype=dtype).reshape(shape).copy()
    if which != "zero_data" or not init.zero_data:
        raise SequenceConfigError(f"{what}: give zero_data: true or a data_file")
    return _zeros(shape, dtype, what)


def _zeros(shape: list[int], dtype: np.dtype, where: str) -> np.ndarray:
    """A state's zeros, or the config refused where its sizes cannot be made (numpy's ValueError
    past its limits, MemoryError past the host's), rather than the load failing with numpy's error."""
    try:
        return np.zeros(shape, dtype=dtype)
    except (ValueError, MemoryError) as exc:
        raise SequenceConfigError(f"{where}: dims {shape} cannot be made: {exc}") from None


# -- requests -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SequenceRequest:
    """A request's sequence parameters (``sequence_id``, ``sequence_start``, ``sequence_end``);
    ``id`` None where the request names no sequence."""

    id: int | str | None
    start: bool = False
    end: bool = False
    #: the request's ``timeout`` (microseconds; None or 0: none): how long its sequence may wait
    #: in the backlog for a slot, as Triton's sequence batcher reads it
    timeout_us: int | None = None


def request_of(params: Mapping[str, Any] | None) -> SequenceRequest | None:
    """The sequence parameters of a request's ``parameters`` (HTTP's JSON object, gRPC's map as
    plain values), None where it has none. An id of 0 or "" means none, as in Triton."""
    if not params:
        return None
    sid = params.get("sequence_id")
    if sid is None and "sequence_start" not in params and "sequence_end" not in params:
        return None
    flags = []
    for key in ("sequence_start", "sequence_end"):
        value = params.get(key, False)
        if not isinstance(value, bool):
            raise invalid(f"parameter {key!r} must be true or false, got {protocol.cut(value, 40)}")
        flags.append(value)
    if isinstance(sid, bool) or not (sid is None or isinstance(sid, (int, str))):
        raise invalid(f"parameter 'sequence_id' must be an integer or a string, got {protocol.cut(sid, 40)}")
    if isinstance(sid, int) and sid < 0:
        raise invalid(f"parameter 'sequence_id' must be a non-negative integer or a string, got {sid}")
    if isinstance(sid, str) and len(sid.encode()) > MAX_STRING_ID_BYTES:
        raise invalid(f"parameter 'sequence_id' is a string of {len(sid.encode())} bytes; at most "
                      f"{MAX_STRING_ID_BYTES}")
    _, timeout_us = protocol.queue_parameters(params)  # checked as for any model: a non-negative integer
    return SequenceRequest(sid if sid not in (0, "") else None, flags[0], flags[1], timeout_us)


# -- serving ------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Sequence:
    """One active sequence: its requests' turn, its state, its slot, its idle timer."""

    id: int | str
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: requests accepted and not yet answered
    queued: int = 0
    #: whether it holds one of the model's slots (else its first request waits in the backlog)
    slot: bool = False
    #: its state inputs for the next request (None: the initial states)
    states: dict[str, np.ndarray] | None = None
    #: an accepted request carried sequence_end (only a START may follow)
    ending: bool = False
    #: when its last request was answered (monotonic seconds)
    idle_since: float = 0.0
    timer: asyncio.TimerHandle | None = None
    #: why its requests are refused: it waited in the backlog past its request's timeout (Triton
    #: rejects the whole backlog of such a sequence)
    refused: str | None = None


class Sequences:
    """The sequence batcher of one served model (see the module docstring). Lives on the event
    loop: every method runs there, so its bookkeeping needs no lock."""

    def __init__(self, model: str, policy: SequencePolicy) -> None:
        self.model = model
        self.policy = policy
        self._active: dict[int | str, _Sequence] = {}
        self._free = policy.slots
        self._backlog: collections.deque[asyncio.Future[None]] = collections.deque()
        #: sequences that ended or were released: why, for a late request
        self._gone: collections.OrderedDict[int | str, str] = collections.OrderedDict()
        self._datatypes = {**{c.name: c.datatype for c in policy.controls},
                           **{s.input_name: s.datatype for s in policy.states}}
        #: why the model no longer serves (unloaded, replaced, shutting down); None while it does
        self._closed: str | None = None

    def close(self, why: str) -> None:
        """The model is taken out of service (``why``: unloaded, replaced by a reload, the server
        shutting down): the requests waiting in the backlog for a slot are refused now, as is
        every request that reaches its sequence's turn from now on; the sequences' idle timers
        and states are dropped. Without it a backlog request waited for a slot the model would
        never free until an active sequence's idle timeout (a minute or more), then failed."""
        if self._closed is not None:
            return
        self._closed = why
        while self._backlog:
            waiter = self._backlog.popleft()
            if not waiter.done():
                waiter.set_exception(self._refusal())
        for seq in list(self._active.values()):
            if seq.timer is not None:
                seq.timer.cancel()
                seq.timer = None
            seq.states = None

    def _refusal(self) -> ProtocolError:
        return ProtocolError("unavailable", f"model {shown(self.model)}: {self._closed}; its sequences are over")

    async def infer(self, endpoint: Endpoint[_A], inputs: Mapping[str, np.ndarray], datatypes: Mapping[str, str],
                    outputs: Sequence[str] | None, sequence: SequenceRequest | None, *, decode_s: float = 0.0,
                    classes: Mapping[str, int] | None = None) -> _A:
        """One request of a sequence: admitted now (in arrival order), run when its sequence's
        previous request is answered, with the control inputs and states filled in."""
        try:
            if self._closed is not None:
                raise self._refusal()
            self._check(inputs, outputs, sequence)
            assert sequence is not None
            wanted = None if outputs is None else [*outputs, *(s.output_name for s in self.policy.states
                                                               if s.output_name not in outputs)]
            datatypes = {**datatypes, **self._datatypes}
            # the whole request checked before it joins its sequence: a refused one changes nothing
            endpoint.check(self._feeds(inputs, sequence, None), datatypes, wanted)
            seq = self._join(sequence)
        except ProtocolError:
            endpoint.stats.refused("OTHER")
            raise
        seq.queued += 1
        if seq.timer is not None:
            seq.timer.cancel()
            seq.timer = None
        try:
            async with seq.turn:
                if self._closed is not None:  # closed while it waited for its sequence's turn
                    raise self._refusal()
                if seq.refused is not None:  # its sequence timed out in the backlog meanwhile
                    endpoint.stats.refused("REJECTED")
                    raise ProtocolError("unavailable", seq.refused)
                if sequence.start:
                    seq.states = None
                if not seq.slot:
                    try:
                        await self._take_slot(seq, sequence.timeout_us)
                    except ProtocolError:
                        endpoint.stats.refused("REJECTED")
                        raise
                answer = await endpoint.run(self._feeds(inputs, sequence, seq.states), datatypes, wanted,
                                            decode_s=decode_s, classes=classes)
                if self.policy.states:  # copied: an answer may be a view of a batch buffer the runtime reuses
                    seq.states = {s.input_name: np.array(answer.outputs[s.output_name], copy=True)
                                  for s in self.policy.states}
                    for s in self.policy.states:
                        if s.output_name in self.policy.kept or (outputs is not None and s.output_name not in outputs):
                            del answer.outputs[s.output_name]
                return answer
        finally:
            seq.queued -= 1
            seq.idle_since = time.monotonic()
            if sequence.end and seq.queued == 0 and seq.refused is None:
                self._forget(seq, "ended (a request with sequence_end closed it)")
            elif seq.queued == 0 and self._active.get(seq.id) is seq and self._closed is None:
                seq.timer = asyncio.get_running_loop().call_later(self.policy.idle_s, self._expire, seq)

    def _feeds(self, inputs: Mapping[str, np.ndarray], sequence: SequenceRequest,
               states: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """The model's inputs for one request: the client's, the control inputs, the states
        (``states`` None: the initial ones)."""
        feeds = dict(inputs)
        for c in self.policy.controls:
            feeds[c.name] = c.value(sequence)
        for s in self.policy.states:
            feeds[s.input_name] = s.initial if states is None else states[s.input_name]
        return feeds

    def _check(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None,
               sequence: SequenceRequest | None) -> None:
        """Refuse, naming why, a request that a sequence model cannot take whatever its sequence."""
        name = shown(self.model)
        if sequence is None or sequence.id is None:
            raise invalid(f"inference request to model {name} must specify a non-zero or non-empty sequence_id: it "
                          "is a stateful model (sequence_batching); give each request the parameter sequence_id, the "
                          "first of a sequence sequence_start and the last sequence_end")
        sid = sequence.id
        filled = sorted(self.policy.filled & set(inputs))
        if filled:
            raise invalid(f"model {name}: input(s) {', '.join(map(repr, filled))} are filled by the server from the "
                          "sequence (control inputs and implicit state); do not send them")
        kept = sorted(self.policy.kept & set(outputs or ()))
        if kept:
            raise invalid(f"model {name}: output(s) {', '.join(map(repr, kept))} are the state the server keeps; "
                          "list them in the config's output to let clients ask for them")
        if self.policy.batched:
            many = [(n, a.shape[0]) for n, a in inputs.items() if a.ndim and a.shape[0] != 1]
            if many:
                n, r = many[0]
                raise invalid(f"model {name}: input {shown(n)} has a batch of {r}; a request of a sequence carries one "
                              "row (batch 1), the server batches the sequences together")
        corrid = self.policy.corrid
        if corrid is not None:
            _check_corrid(sid, corrid, self.model)

    def _join(self, sequence: SequenceRequest) -> _Sequence:
        """The sequence a request joins (a new one at START), or the request refused: its
        sequence was never started, has ended or was released."""
        sid = sequence.id
        assert sid is not None
        seq = self._active.get(sid)
        if sequence.start:
            if seq is None:
                seq = self._active[sid] = _Sequence(sid)
                self._gone.pop(sid, None)
            seq.ending = sequence.end
            return seq
        if seq is None or seq.ending:
            why = ("ended (a request with sequence_end closed it)" if seq is not None
                   else self._gone.get(sid, "was never started"))
            raise invalid(f"inference request for sequence {_named(sid)} to model {shown(self.model)} must specify "
                          f"the START flag on the first request of the sequence: sequence {_named(sid)} {why}")
        seq.ending = sequence.end
        return seq

    async def _take_slot(self, seq: _Sequence, timeout_us: int | None = None) -> None:
        """A slot for ``seq``: a free one, or its turn in the backlog (FIFO) once one is freed.
        ``timeout_us`` (the waiting request's ``timeout``; None or 0: none): past it the sequence
        leaves the backlog, refused UNAVAILABLE as Triton's sequence batcher refuses it, and so
        is every request of it that waits behind (:attr:`_Sequence.refused`)."""
        if self._free > 0:
            self._free -= 1
            seq.slot = True
            return
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._backlog.append(waiter)
        timer = loop.call_later(timeout_us / 1e6, self._out_of_time, seq, waiter, timeout_us) if timeout_us else None
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._give_slot()  # handed a slot as its client left: pass it on
            elif waiter in self._backlog:
                self._backlog.remove(waiter)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        seq.slot = True

    def _out_of_time(self, seq: _Sequence, waiter: asyncio.Future[None], timeout_us: int) -> None:
        """(A backlog request's timer.) Its sequence waited for a slot past the request's
        timeout: it leaves the backlog and is over, refused with Triton's words."""
        if waiter.done():
            return
        self._backlog.remove(waiter)
        seq.refused = (f"model {shown(self.model)}: sequence {_named(seq.id)} waited for a sequence slot longer "
                       f"than its request's timeout ({timeout_us} µs): timeout of the corresponding sequence has "
                       "been expired")
        self._forget(seq, f"timed out waiting for a sequence slot (its request's timeout, {timeout_us} µs)")
        waiter.set_exception(ProtocolError("unavailable", seq.refused))

    def _give_slot(self) -> None:
        """A slot freed: to the oldest sequence of the backlog, else to the free ones."""
        while self._backlog:
            waiter = self._backlog.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1

    def _forget(self, seq: _Sequence, why: str) -> None:
        """``seq`` is over (ended, or released): its slot freed, its state dropped."""
        if self._active.get(seq.id) is seq:
            del self._active[seq.id]
        if seq.timer is not None:
            seq.timer.cancel()
            seq.timer = None
        seq.states = None
        if seq.slot:
            seq.slot = False
            self._give_slot()
        self._gone[seq.id] = why
        self._gone.move_to_end(seq.id)
        while len(self._gone) > REMEMBERED:
            self._gone.popitem(last=False)

    def _expire(self, seq: _Sequence) -> None:
        """The idle timer: release ``seq`` if it is still idle."""
        seq.timer = None
        if seq.queued or self._active.get(seq.id) is not seq:
            return
        idle_us = (time.monotonic() - seq.idle_since) * 1e6
        self._forget(seq, f"was released after {idle_us:.0f} µs idle (max_sequence_idle_microseconds "
                          f"{self.policy.idle_s * 1e6:.0f})")

    def describe(self) -> dict[str, Any]:
        """What the model's statistics say of its sequences."""
        return {"strategy": self.policy.strategy, "slots": self.policy.slots, "active": len(self._active),
                "backlog": len(self._backlog)}


def _named(sid: int | str) -> str:
    """A sequence id in a message: an integer as it is, a string quoted (and cut)."""
    return str(sid) if isinstance(sid, int) else shown(sid)


def _check_corrid(sid: int | str, corrid: ControlInput, model: str) -> None:
    """Refuse a sequence id the model's CORRID input cannot carry."""
    if corrid.datatype == protocol.BYTES:
        if not isinstance(sid, str):
            raise invalid(f"model {shown(model)}: sequence_id {sid} is an integer, but its CORRID control input "
                          f"{corrid.name!r} is TYPE_STRING: send the sequence_id as a string")
        return
    if isinstance(sid, str):
        raise invalid(f"model {shown(model)}: sequence_id {shown(sid)} is a string, but its CORRID control input "
                      f"{corrid.name!r} is TYPE_{corrid.datatype}: send an integer sequence_id")
    info = np.iinfo(protocol.DATATYPES[corrid.datatype])
    if not info.min <= sid <= info.max:
        raise invalid(f"model {shown(model)}: sequence_id {sid} does not fit its CORRID control input "
                      f"{corrid.name!r} (TYPE_{corrid.datatype}: {info.min} to {info.max})")
