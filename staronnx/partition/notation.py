"""The two notations people type for a partition: shares ``0.85,0.15`` and shapes ``x=1x3x224x224``.

The CLI reads its options with these (naming its flags) and hands ``partition()`` typed values;
``partition()``/``place()`` still read the same strings from Python callers, who have written
them since the first release, naming the Python argument instead. One reader per notation, so
the two doors cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from staronnx.errors import PartitionError


def read_shares(text: str, name: str) -> list[float]:
    """Comma-separated numbers (empty items skipped); ``name`` is what the error calls them."""
    try:
        return [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise PartitionError(f"{name} must be comma-separated numbers, got {text!r}") from None


def read_input_shapes(items: Sequence[str], name: str) -> dict[str, list[int]]:
    """``NAME=D1xD2x...`` items into name -> dims; -1 means "as the model says" (a dynamic
    batch axis, as exporters write it), and 0 is an empty dimension (an empty KV-cache past at a
    decoder's first step), as the sessions accept."""
    shapes: dict[str, list[int]] = {}
    for item in items:
        tensor, sep, dims = item.rpartition("=")
        try:
            values = [int(d) for d in dims.lower().split("x")]
        except ValueError:
            values = []
        if not sep or not tensor or not values or any(d < -1 for d in values):
            raise PartitionError(f"{name} expects NAME=D1xD2x... (sizes >= 0, or -1 for the model's), "
                                 f"got {item!r}")
        shapes[tensor] = values
    return shapes


def read_input_shape_sets(items: Sequence[str], name: str) -> list[dict[str, list[int]]]:
    """Several sizes per input, for work measured at each (``calibrate``'s footprints):
    ``NAME=S1,S2`` or ``NAME=S1`` repeated, each ``S`` a ``D1xD2x...``. Set ``i`` takes each
    input's ``i``-th size (an input given once keeps it in every set), so inputs that share a
    dimension (``input_ids`` and ``attention_mask``) change together. One empty set when no
    item is given."""
    sizes: dict[str, list[list[int]]] = {}
    for item in items:
        tensor, _, text = item.rpartition("=")
        try:
            shapes = [read_input_shapes([f"{tensor}={one.strip()}"], name)[tensor] for one in text.split(",")]
        except PartitionError:
            raise PartitionError(f"{name} expects NAME=D1xD2x... or NAME=D1xD2x...,D1xD2x... (sizes >= 0, or -1 "
                                 f"for the model's), got {item!r}") from None
        sizes.setdefault(tensor, []).extend(shapes)
    counts = {n: len(v) for n, v in sizes.items()}
    many = {c for c in counts.values() if c > 1}
    if len(many) > 1:
        raise PartitionError(f"{name} gives inputs different numbers of sizes ({counts}): give each input "
                             "one size, or the same number of sizes as the others")
    n = max(many, default=1)
    return [{t: v[i if len(v) > 1 else 0] for t, v in sizes.items()} for i in range(n)]


def parse_input_shapes(value: Mapping[str, Sequence[int]] | Sequence[str] | None) -> dict[str, list[int]]:
    """The ``input_shapes`` argument of ``partition()``/``place()``: name -> dims, or the
    ``NAME=D1xD2x...`` strings of :func:`read_input_shapes`."""
    if not value:
        return {}
    if isinstance(value, Mapping):
        return {k: [int(d) for d in v] for k, v in value.items()}
    return read_input_shapes(value, "input_shapes")
