"""Where a dataset's rows sit in a model's tensors, for batch inference.

A dataset is a sequence of samples, one row each. A model takes them along each input's batch
axis (the plan's batching contract, :mod:`staronnx.contract`: axis 0 mostly, axis 1 of a
``[layers, batch, hidden]`` state) and gives each sample's answer along each output's batch axis
(axis 1 of a CTC head's ``[time, batch, classes]``). A model exported at a fixed batch of 1
(``[1, 3, 224, 224]``) cannot batch, but its rows are still slices of axis 0, kept at size 1.
An input with no such axis (a scalar sample rate) is one value for every row.

:class:`RowLayout` is that reading, made once per plan: sources cut their arrays into rows with
it, the job joins rows into batches with it, and the sinks turn each batch's outputs into
row-major arrays (``[rows, *sample shape]``) with it, so a Parquet row or an ``.npz`` entry holds
one sample whatever axis the model put the batch on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from staronnx.contract import _BATCH_NAME, take_rows
from staronnx.plan import Plan, TensorSpec


@dataclass(frozen=True)
class RowLayout:
    """Per input and output, the axis its rows lie on (None: one value for all rows), and
    whether rows are batched together or run one per task."""

    #: input name -> the axis holding its rows (None: a value shared by every row)
    inputs: Mapping[str, int | None]
    #: output name -> the axis holding its rows (None: the output of a one-row task, whole)
    outputs: Mapping[str, int | None]
    #: whether several rows share a task (False: the model runs one row per task)
    batched: bool
    #: inputs whose row axis is kept at size 1 in a row's feeds (a model exported at batch 1)
    kept: frozenset[str] = frozenset()
    #: the rank the model gives each kept input (its batch-1 axis counted): what tells a row
    #: written with that axis from one without it, whatever its next size
    ranks: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: Plan) -> RowLayout:
        """The layout the plan's contract gives; a model that cannot batch runs a row per task,
        its rows along the batch axis the contract still finds in its inputs, where it is named
        as a batch or set by the user (a dynamic batch whose outputs do not keep it apart: a
        detector's boxes of every image in one list; a plan cut with batching off), else axis 0
        of every input the model fixes to 1 there (a batch-1 export). Such a model's dataset was
        refused ('no input holds rows') unless its inputs were fixed to 1."""
        contract = plan.contract
        if contract.batchable:
            return cls(dict(contract.inputs), dict(contract.outputs), True)

        # the contract's axes where they surely are the batch: named so, or set by the user (a
        # dynamic first size named otherwise, a 1-D input's 'sequence', is no row axis to trust)
        trusted = bool(contract.overridden) or bool(contract.symbol and _BATCH_NAME.match(contract.symbol))

        def axis(spec: TensorSpec, found: int | None) -> int | None:
            if found is not None and trusted:
                return found
            return 0 if spec.shape and spec.shape[0] == 1 else None

        inputs = {spec.name: axis(spec, contract.inputs.get(spec.name)) for spec in plan.inputs}
        outputs = {spec.name: axis(spec, contract.outputs.get(spec.name)) for spec in plan.outputs}
        kept = frozenset(n for n, a in inputs.items() if a is not None)
        return cls(inputs, outputs, False, kept, {s.name: len(s.shape) for s in plan.inputs if s.name in kept})

    @property
    def row_inputs(self) -> list[str]:
        """The inputs that carry rows (at least one for a dataset to have rows)."""
        return [n for n, a in self.inputs.items() if a is not None]

    def count(self, arrays: Mapping[str, np.ndarray]) -> int | None:
        """How many rows ``arrays`` hold (None: no input carries rows)."""
        for name in self.row_inputs:
            value = arrays.get(name)
            if value is not None:
                return int(value.shape[self.inputs[name] or 0])
        return None

    def take(self, arrays: Mapping[str, np.ndarray], start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows ``start:stop`` of every input (views where numpy allows); shared values whole."""
        return take_rows(self.inputs, arrays, start, stop)

    def join(self, pieces: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Consecutive pieces of rows as one (a batch that spans two chunks of a source)."""
        if len(pieces) == 1:
            return dict(pieces[0])
        out: dict[str, np.ndarray] = {}
        for name, first in pieces[0].items():
            axis = self.inputs.get(name)
            out[name] = first if axis is None else np.concatenate([p[name] for p in pieces], axis=axis)
        return out

    def sample_shape(self, name: str, value: np.ndarray) -> tuple[int, ...]:
        """An input's per-row shape: its shape without the row axis (the shape itself for a
        shared value): what rows must agree on to share a batch."""
        axis = self.inputs.get(name)
        return tuple(value.shape) if axis is None else tuple(value.shape[:axis] + value.shape[axis + 1:])

    def signature(self, arrays: Mapping[str, np.ndarray]) -> tuple[object, ...]:
        """What consecutive rows must share to run in one batch: every input's per-row shape and
        dtype, and the bytes of every shared value (Triton's rule)."""
        key: list[object] = []
        for name, value in arrays.items():
            key.append((name, value.dtype.str, self.sample_shape(name, value)))
            if self.inputs.get(name) is None:
                key.append(value.tobytes())
        return tuple(key)

    def row_major(self, outputs: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
        """A batch's outputs as ``[rows, *sample shape]`` arrays (C-contiguous, so a sink writes
        them without another copy); an output with no row axis (a one-row task's) gains one."""
        out: dict[str, np.ndarray] = {}
        for name, value in outputs.items():
            value = np.asarray(value)
            axis = self.outputs.get(name)
            if not self.batched:
                # one row per task: the task's whole output is that row's, a batch-1 axis dropped
                if axis is not None and value.ndim > axis and value.shape[axis] == 1:
                    value = np.take(value, 0, axis=axis)
                out[name] = np.ascontiguousarray(value[np.newaxis])
                continue
            if axis is None or value.ndim <= axis or value.shape[axis] != rows:
                raise RuntimeError(f"output {name!r} {list(value.shape)} does not hold the batch's {rows} rows "
                                   f"on axis {axis}")
            out[name] = np.ascontiguousarray(np.moveaxis(value, axis, 0)) if axis else value
        return out
