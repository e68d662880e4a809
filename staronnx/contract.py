"""A model's batching contract: per input and output, the axis that carries the batch, or none.

Real exported models do not all put the batch on axis 0: a recurrent state is
``[layers, batch, hidden]``, a CTC head emits ``[time, batch, classes]``, a sample rate is a
scalar, and many files are exported with a fixed batch of 1. Everything that batches requests
(the server, client batches split per sample, random feeds at a batch size, calibration's
footprints) reads the same contract, so that a request's answer is computed from that request's
inputs alone:

- an input with a batch axis is concatenated and sliced along it;
- an input without one (a scalar ``sample_rate``) is a per-request value: requests are batched
  together only when they agree on it (and on every non-batch dimension: :meth:`signature`);
- a model that cannot batch (no symbolic batch dimension shared by its inputs, or an output whose
  batch axis cannot be told) runs one request per task, Triton's ``max_batch_size: 0``.

The batch dimension is the symbol the inputs share (the name exporters give to a dynamic axis:
``batch``, ``N``, ``batch_size``), preferring one named like a batch, then one found at axis 0.
Outputs carry the batch on the axis the same symbol names in the plan's shapes (which partition
reads off shape inference at batch 1 and 2). Where the graph cannot tell, the user says:
``batch_axes={"state": 1}`` (``--batch-axis state=1``), ``None``/``none`` for no batch axis, or
``batching=False`` (``--no-batching``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from staronnx.errors import InputError, StaronnxError

Shape = Sequence[int | str | None]

#: names exporters give a batch dimension (torch's dynamic_axes, tf2onnx, Optimum, hand-written)
_BATCH_NAME = re.compile(r"^(batch(_?size)?|bs|n|b|batch_?\w*|\w*_batch)$", re.IGNORECASE)


def take_rows(axes: Mapping[str, int | None], feeds: Mapping[str, np.ndarray], start: int, stop: int
              ) -> dict[str, np.ndarray]:
    """Rows ``start:stop`` of each tensor along its axis in ``axes`` (views); a tensor whose
    axis is None (or that ``axes`` does not name) whole."""
    out: dict[str, np.ndarray] = {}
    for name, value in feeds.items():
        axis = axes.get(name)
        out[name] = value if axis is None else value[(slice(None),) * axis + (slice(start, stop),)]
    return out


class ContractError(StaronnxError, ValueError):
    """A batch-axis override that does not fit the model (unknown name, axis out of range)."""


def _symbols(shape: Shape | None) -> list[tuple[int, str]]:
    return [(axis, d) for axis, d in enumerate(shape or ()) if isinstance(d, str) and d]


def batch_symbol(inputs: Mapping[str, Shape | None], outputs: Mapping[str, Shape | None] = {}) -> str | None:
    """The symbolic dimension that carries the batch, or None when the inputs share none.

    A candidate appears at most once in each tensor that has it, in at least one input, and is
    either named like a batch or found at axis 0 of some input (a dynamic image size ``height``
    at axis 2 is never taken for the batch). Among candidates: batch-like names first, then the
    one in most tensors, then the one at axis 0 most often.
    """
    scores: dict[str, list[int]] = {}
    for shapes, is_input in ((inputs, True), (outputs, False)):
        for shape in shapes.values():
            syms = _symbols(shape)
            names = [s for _, s in syms]
            for axis, s in syms:
                if names.count(s) != 1:
                    scores.setdefault(s, [0, 0, 0, 0])[3] += 1  # repeated: disqualified
                    continue
                row = scores.setdefault(s, [0, 0, 0, 0])
                row[0] += 1 if is_input else 0
                row[1] += 1
                row[2] += 1 if (axis == 0 and is_input) else 0
    best: tuple[tuple[int, int, int], str] | None = None
    for s, (n_in, n_all, at0, repeated) in scores.items():
        if not n_in or repeated:
            continue
        named = bool(_BATCH_NAME.match(s))
        if not (named or at0):
            continue
        key = (int(named), n_all, at0)
        if best is None or key > best[0]:
            best = (key, s)
    return best[1] if best else None


def _fixed_at(shape: Shape | None, axis: int) -> bool:
    """Whether ``shape`` fixes ``axis`` to a size (an int >= 0, not a symbol or unknown)."""
    if shape is None or axis >= len(shape):
        return False
    d = shape[axis]
    return isinstance(d, int) and not isinstance(d, bool) and d >= 0


def axis_of(shape: Shape | None, symbol: str | None) -> int | None:
    """The axis of ``shape`` that is exactly ``symbol`` (None when it has none)."""
    if symbol is None:
        return None
    for axis, d in enumerate(shape or ()):
        if d == symbol:
            return axis
    return None


#: the name partition gives a batch dimension the model left unnamed (``-1`` in the file)
UNNAMED = "batch"


def input_axis(shape: Shape | None, symbol: str | None) -> int | None:
    """An input's batch axis: where ``symbol`` is; without a shared symbol, an unnamed dynamic
    axis 0 (files that write -1 for every dynamic size, as Paddle's exporter does)."""
    if symbol is not None:
        return axis_of(shape, symbol)
    return 0 if shape and shape[0] is None else None


def parse_batch_axes(items: Sequence[str] | Mapping[str, int | None] | None) -> dict[str, int | None]:
    """``NAME=AXIS`` items (the CLI's ``--batch-axis``; ``none`` for no batch axis) or a mapping,
    as a mapping; a malformed item raises :class:`ContractError` naming it."""
    if items is None:
        return {}
    if isinstance(items, Mapping):
        out: dict[str, int | None] = {}
        for name, axis in items.items():
            if axis is not None and (isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or axis < 0):
                raise ContractError(f"batch_axes[{name!r}] must be an axis (an integer >= 0) or None, got {axis!r}")
            out[str(name)] = None if axis is None else int(axis)
        return out
    out = {}
    for item in items:
        for piece in (p for p in str(item).split(",") if p.strip()):
            name, sep, value = piece.partition("=")
            value = value.strip().lower()
            if not sep or not name.strip() or not (value.isdigit() or value in ("none", "-")):
                raise ContractError(f"--batch-axis {piece!r}: expected NAME=AXIS (e.g. state=1) or NAME=none")
            out[name.strip()] = None if value in ("none", "-") else int(value)
    return out


@dataclass(frozen=True)
class BatchContract:
    """Where each tensor of a model carries the batch; see the module docstring."""

    #: input name -> batch axis, None for a per-request value (no batch axis)
    inputs: Mapping[str, int | None]
    #: output name -> batch axis, None when it has none
    outputs: Mapping[str, int | None]
    #: why requests cannot be batched together (None: they can)
    why_not: str | None = None
    #: the symbolic batch dimension read off the model (None: none)
    symbol: str | None = None
    #: names whose axis the user set (shown by ``plan show``)
    overridden: tuple[str, ...] = ()
    _unbatched: tuple[str, ...] = field(default=(), repr=False, compare=False)
    _batched: tuple[tuple[str, int], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_unbatched", tuple(n for n, a in self.inputs.items() if a is None))
        object.__setattr__(self, "_batched", tuple((n, a) for n, a in self.inputs.items() if a is not None))

    # -- reading ------------------------------------------------------------------------------
    @classmethod
    def read(cls, inputs: Mapping[str, Shape | None], outputs: Mapping[str, Shape | None], *,
             batch_axes: Mapping[str, int | None] | None = None, batching: bool = True) -> BatchContract:
        """The contract of a model with these (symbolic) input and output shapes, with the user's
        overrides: ``batch_axes`` (name -> axis or None) and ``batching=False``."""
        overrides = dict(batch_axes or {})
        unknown = [n for n in overrides if n not in inputs and n not in outputs]
        if unknown:
            raise ContractError(f"batch axis given for unknown tensor(s) {unknown}; the model's inputs are "
                                f"{list(inputs)} and its outputs {list(outputs)}")
        for name, axis in overrides.items():
            shape = inputs.get(name, outputs.get(name))
            if axis is not None and shape is not None and axis >= len(shape):
                raise ContractError(f"batch axis {axis} of {name!r} is out of range: it has rank {len(shape)} {list(shape)}")
            if axis is not None and shape is not None and isinstance(shape[axis], int) and shape[axis] != -1:
                if shape[axis] != 1:  # a fixed 1 can be a batch exported at 1; anything else cannot
                    raise ContractError(f"batch axis {axis} of {name!r} is fixed to {shape[axis]} in the model "
                                        f"({list(shape)}): it cannot carry the batch")
        symbol = batch_symbol(inputs, outputs)
        ins = {n: overrides[n] if n in overrides else input_axis(s, symbol) for n, s in inputs.items()}
        # a plan names an output axis that doubled with the batch at partition time "batch"
        # where the model left its batch unnamed
        outs = {n: overrides[n] if n in overrides else axis_of(s, symbol or UNNAMED) for n, s in outputs.items()}
        why: str | None = None
        if not batching:
            why = "batching is off (--no-batching)"
        elif not any(a is not None for a in ins.values()):
            fixed = [n for n, s in inputs.items() if s and isinstance(s[0], int)]
            why = ("no input has a dynamic batch dimension" +
                   (f" (the model fixes {fixed[0]!r} to {list(inputs[fixed[0]] or [])})" if fixed else ""))
        elif fixed := [n for n, a in ins.items() if a is not None and _fixed_at(inputs.get(n), a)]:
            # the override may name a fixed 1 (a batch exported at 1), but ONNX Runtime checks a
            # fed input against its declared sizes: every batch of 2 or more would be refused
            shape = list(inputs[fixed[0]] or [])
            why = (f"input {fixed[0]!r} fixes its batch axis {ins[fixed[0]]} to {shape[ins[fixed[0]] or 0]} "
                   f"({shape}), and ONNX Runtime runs it at that size only")
        else:
            lost = [n for n, a in outs.items() if a is None]
            if lost:
                why = (f"output {lost[0]!r} ({list(outputs[lost[0]] or [])}) has no axis that is the batch, so a "
                       "batch's answer cannot be split per request with certainty")
        return cls(inputs=ins, outputs=outs, why_not=why, symbol=symbol, overridden=tuple(overrides))

    @property
    def batchable(self) -> bool:
        """Whether requests may share a task (Triton's ``max_batch_size > 0``)."""
        return self.why_not is None

    @property
    def leading(self) -> bool:
        """Whether every batched tensor has the batch on axis 0 (what Triton's config can say)."""
        return all(a in (0, None) for a in (*self.inputs.values(), *self.outputs.values()))

    def describe(self) -> list[str]:
        """One line per tensor, for ``plan show`` and error messages."""
        def say(axis: int | None) -> str:
            return "per request (no batch axis)" if axis is None else f"batch on axis {axis}"
        lines = [f"input {n}: {say(a)}" for n, a in self.inputs.items()]
        lines += [f"output {n}: {say(a)}" for n, a in self.outputs.items()]
        lines.append("requests are batched together" if self.batchable
                     else f"one request per task (max_batch_size 0): {self.why_not}")
        return lines

    def to_json(self) -> dict[str, Any]:
        return {"batchable": self.batchable, "why_not": self.why_not, "symbol": self.symbol,
                "inputs": dict(self.inputs), "outputs": dict(self.outputs)}

    # -- batches ------------------------------------------------------------------------------
    def rows(self, feeds: Mapping[str, np.ndarray]) -> int:
        """The batch size of ``feeds`` (1 for a model that cannot batch, or one with no batched
        input in them)."""
        if self.why_not is None:
            for name, axis in self._batched:
                if name in feeds and (value := feeds[name]).ndim > axis:  # (no call: read per request)
                    return int(value.shape[axis])
        return 1

    def check_rows(self, feeds: Mapping[str, np.ndarray], what: str = "the request", *,
                   empty: bool = False) -> int:
        """The batch size of ``feeds``, refusing batched inputs that disagree on it, or an empty
        batch unless ``empty``."""
        if self.why_not is not None:
            return 1
        rows = {n: int(feeds[n].shape[a]) for n, a in self._batched if n in feeds and feeds[n].ndim > a}
        if len(set(rows.values())) > 1:
            raise InputError(f"{what}: the batched inputs disagree on the batch size: "
                             + ", ".join(f"{n} has {r} on axis {self.inputs[n]}" for n, r in rows.items()))
        n = next(iter(rows.values()), 1)
        if n < 1 and not empty:
            name = next(iter(rows))
            raise InputError(f"{what}: input {name!r} has an empty batch (axis {self.inputs[name]} is 0)")
        return n

    def signature(self, sample: Mapping[str, np.ndarray]) -> tuple[Any, ...]:
        """What requests must share to be batched together: every input's shape but its batch
        axis, and the value of every input without one (Triton's rule, plus per-request values)."""
        key: list[Any] = []
        for name, axis in self._batched:
            shape = sample[name].shape
            key.append(shape[:axis] + shape[axis + 1:])
        for name in self._unbatched:
            value = sample[name]
            key.append((value.dtype.str, value.shape, value.tobytes()))
        return tuple(key)

    def take(self, feeds: Mapping[str, np.ndarray], start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows ``start:stop`` of every batched input (views); per-request values whole."""
        return take_rows(self.inputs, feeds, start, stop)

    def concat(self, samples: Sequence[Mapping[str, np.ndarray]], rows: int,
               alloc: Callable[[tuple[int, ...], np.dtype], np.ndarray] = np.empty) -> dict[str, np.ndarray]:
        """One batch of ``rows`` from same-signature samples, the last repeated as padding."""
        feeds: dict[str, np.ndarray] = {}
        for name, axis in self.inputs.items():
            if axis is None:
                feeds[name] = samples[0][name]
                continue
            parts = [s[name] for s in samples]
            if rows > len(parts):
                parts += [parts[-1]] * (rows - len(parts))
            first = parts[0]
            shape = first.shape[:axis] + (sum(p.shape[axis] for p in parts),) + first.shape[axis + 1:]
            feeds[name] = np.concatenate(parts, axis=axis, out=alloc(shape, first.dtype))
        return feeds

    def split(self, outputs: Mapping[str, np.ndarray], counts: Sequence[int], rows: int | None = None
              ) -> list[dict[str, np.ndarray]]:
        """Each request's own rows of every output (``counts`` rows each, in order); rows past
        their sum are padding and dropped. Raises RuntimeError when an output does not have the
        rows the contract promises (never hands a request another's rows)."""
        total = sum(counts)
        rows = total if rows is None else rows
        results: list[dict[str, np.ndarray]] = [{} for _ in counts]
        for name, arr in outputs.items():
            axis = self.outputs.get(name)
            if len(counts) == 1 and rows == total:
                results[0][name] = arr
                continue
            if axis is None or np.ndim(arr) <= axis:
                raise RuntimeError(f"output {name!r} has no batch axis, so its rows cannot be split per request")
            if arr.shape[axis] != rows:
                raise RuntimeError(f"output {name!r} has {arr.shape[axis]} rows on its batch axis {axis} for a batch "
                                   f"of {rows} " + ("requests" if rows == total else f"rows ({total} requested, padded)"))
            lead = (slice(None),) * axis
            start = 0
            for r, n in zip(results, counts):
                r[name] = arr[lead + (slice(start, start + n),)]
                start += n
        return results
