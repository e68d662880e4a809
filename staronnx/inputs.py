"""Real inputs from an ``.npz`` file (``--inputs``) instead of random ones.

Random feeds exercise the arithmetic but not the data: a model whose cost depends on its
inputs (early exits, NMS, sparse masks, token ids) must be measured on real ones. The file
is what ``numpy.savez(path, **{input_name: array})`` writes: one array per model input,
keyed by the input's name, each holding N samples along its batch axis (the plan's batching
contract: axis 0 mostly, axis 1 of a ``[layers, batch, hidden]`` state; an input without one,
a scalar sample rate, is passed whole).
Commands slice it into the batches they need, cycling through the N samples.

Everything is checked against the plan before any work starts, and every mismatch names the
input: an unknown or missing name, a dtype, a rank or a fixed dimension.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from staronnx.errors import InputError
from staronnx.plan import Plan


def _axis(plan: Plan, name: str) -> int | None:
    """The axis of input ``name`` that holds the samples (None: no batch axis to slice)."""
    contract = plan.contract
    return contract.inputs.get(name) if contract.batchable else None


def load_inputs(path: str | os.PathLike[str], plan: Plan) -> dict[str, np.ndarray]:
    """Read an npz of real inputs and check it against the plan's inputs (names, dtypes,
    ranks, fixed dimensions, one common number of samples)."""
    path = Path(path)
    where = f"--inputs {path}"
    try:
        if path.is_dir():
            raise IsADirectoryError(path)
        if not path.exists():
            raise FileNotFoundError(path)
        if not zipfile.is_zipfile(path):  # a .npy, a pickle, anything else: numpy's words mislead
            raise InputError(f"{where}: not an .npz file (write one with numpy.savez(path, NAME=array, ...))")
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except InputError:
        raise
    except FileNotFoundError:
        raise InputError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{where}: is a folder, not an .npz file") from None
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise InputError(f"{where}: not a readable .npz file ({exc})") from None
    unknown = [n for n in arrays if n not in plan.input_names]
    missing = [n for n in plan.input_names if n not in arrays]
    if unknown or missing:
        bits = ([f"unknown input(s) {unknown}"] if unknown else []) + ([f"missing {missing}"] if missing else [])
        raise InputError(f"{where}: {'; '.join(bits)}; the plan's inputs are {plan.input_names}")
    counts = {n: a.shape[ax] for n, a in arrays.items() if (ax := _axis(plan, n)) is not None and a.ndim > ax}
    if len(set(counts.values())) > 1:
        raise InputError(f"{where}: the inputs hold different numbers of samples along their batch axes: "
                         + ", ".join(f"{n} has {c} on axis {_axis(plan, n)}" for n, c in counts.items()))
    if any(c == 0 for c in counts.values()):
        raise InputError(f"{where}: input {next(n for n, c in counts.items() if c == 0)!r} holds no sample")
    try:
        plan.check_feeds(arrays)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    return arrays


def samples(inputs: Mapping[str, np.ndarray], plan: Plan) -> int:
    """How many samples the inputs hold (1 when no input has a batch axis)."""
    counts = [a.shape[ax] for n, a in inputs.items() if (ax := _axis(plan, n)) is not None]
    return counts[0] if counts else 1


def batch_of(inputs: Mapping[str, np.ndarray], plan: Plan, batch: int, index: int) -> dict[str, np.ndarray]:
    """Batch number ``index`` of ``batch`` samples, cycling through the samples; inputs
    without a batch axis are passed whole."""
    n = samples(inputs, plan)
    rows = np.arange(index * batch, (index + 1) * batch) % n
    out = {}
    for name, a in inputs.items():
        axis = _axis(plan, name)
        out[name] = a if axis is None else np.ascontiguousarray(np.take(a, rows, axis=axis))
    return out


def batches(inputs: Mapping[str, np.ndarray], plan: Plan, batch: int, count: int) -> list[dict[str, np.ndarray]]:
    """``count`` successive batches of ``batch`` samples (:func:`batch_of`)."""
    return [batch_of(inputs, plan, batch, i) for i in range(count)]
