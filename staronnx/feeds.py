"""Random inputs of the right dtypes and shapes, for profiling, calibration and verification.

Integer inputs are the trap: token ids or categorical ids must be valid indices for the tables
they are gathered from, and masks must be 0/1, or the model fails or takes another path.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import onnx
from onnx import helper


class _Spec(Protocol):
    name: str
    elem_type: int


def integer_ranges(model: onnx.ModelProto) -> dict[str, tuple[int, int]]:
    """Valid [low, high) ranges for integer inputs, read off how the graph uses them.

    An input used as Gather indices into an initializer gets [0, table rows); one whose name
    says mask, or that feeds a Where/Not/Cast-to-bool, gets [0, 2); others get [0, 2) too,
    the least surprising range for flags and small ids.
    """
    init = {t.name: t for t in model.graph.initializer}
    const = {n.output[0]: n.attribute[0].t for n in model.graph.node if n.op_type == "Constant"
             and n.attribute and n.attribute[0].type == onnx.AttributeProto.TENSOR}
    ranges: dict[str, tuple[int, int]] = {}
    t = onnx.TensorProto
    int_types = {t.INT64, t.INT32, t.INT16, t.INT8, t.UINT8, t.UINT16, t.UINT32, t.UINT64}
    for vi in model.graph.input:
        if vi.name in init or vi.type.tensor_type.elem_type not in int_types:
            continue
        high = 2
        for node in model.graph.node:
            if node.op_type in ("Gather", "GatherElements") and len(node.input) > 1 and node.input[1] == vi.name:
                table = init.get(node.input[0]) or const.get(node.input[0])
                if table is not None and len(table.dims):
                    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                    rows = int(table.dims[axis])
                    high = rows if high == 2 else min(high, rows)
        ranges[vi.name] = (0, max(high, 1))
    return ranges


def random_array(elem_type: int, shape: Sequence[int], rng: np.random.Generator,
                 value_range: tuple[int, int] | None = None) -> np.ndarray:
    """One random tensor: normal floats, ints in the valid range, fair booleans.

    Always an array, a rank-0 one for a scalar input (numpy's generators return a numpy scalar
    there, and ORT refuses a ``numpy.bool`` scalar as a feed)."""
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    shape = tuple(int(d) for d in shape)
    if dtype == np.bool_:
        return np.asarray(rng.random(shape) < 0.5)
    if np.issubdtype(dtype, np.integer):
        low, high = value_range or (0, 2)
        return np.asarray(rng.integers(low, high, size=shape), dtype=dtype)
    if np.issubdtype(dtype, np.floating):
        return np.asarray(rng.standard_normal(shape), dtype=dtype)
    if dtype.kind in ("U", "S", "O"):
        return np.array(rng.choice(["a", "b", "c"], size=shape), dtype=object)
    raise ValueError(f"cannot make random values of dtype {dtype}")


def random_feeds_for_shapes(inputs: Sequence[_Spec], shapes: dict[str, list[int]], *,
                            model: onnx.ModelProto | None = None, ranges: dict[str, tuple[int, int]] | None = None,
                            seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds for every input at the given concrete shapes."""
    rng = np.random.default_rng(seed)
    if ranges is None:
        ranges = integer_ranges(model) if model is not None else {}
    return {spec.name: random_array(spec.elem_type, shapes[spec.name], rng, ranges.get(spec.name)) for spec in inputs}
