"""Real inputs from an ``.npz`` file (``--inputs``) instead of random ones.

Random feeds exercise the arithmetic but not the data: a model whose cost depends on its
inputs (early exits, NMS, sparse masks, token ids) must be measured on real ones. The file
is what ``numpy.savez(path, **{input_name: array})`` writes: one array per model input,
keyed by the input's name, each with a leading batch axis of the same length N (N samples).
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


def _batched(plan: Plan, name: str) -> bool:
    """Whether an input has a batch axis to slice (a dynamic leading dimension)."""
    spec = plan.tensor(name)
    return bool(spec.shape) and not isinstance(spec.shape[0], int)


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
    counts = {n: a.shape[0] for n, a in arrays.items() if _batched(plan, n) and a.ndim}
    if len(set(counts.values())) > 1:
        raise InputError(f"{where}: the inputs hold different numbers of samples along axis 0: {counts}")
    if any(c == 0 for c in counts.values()):
        raise InputError(f"{where}: input {next(n for n, c in counts.items() if c == 0)!r} holds no sample")
    try:
        plan.check_feeds(arrays)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    return arrays


def samples(inputs: Mapping[str, np.ndarray], plan: Plan) -> int:
    """How many samples the inputs hold (1 when no input has a batch axis)."""
    counts = [a.shape[0] for n, a in inputs.items() if _batched(plan, n)]
    return counts[0] if counts else 1


def batch_of(inputs: Mapping[str, np.ndarray], plan: Plan, batch: int, index: int) -> dict[str, np.ndarray]:
    """Batch number ``index`` of ``batch`` samples, cycling through the samples; inputs
    without a batch axis are passed whole."""
    n = samples(inputs, plan)
    rows = np.arange(index * batch, (index + 1) * batch) % n
    return {
        name: np.ascontiguousarray(a[rows]) if _batched(plan, name) else a
        for name, a in inputs.items()
    }


def batches(inputs: Mapping[str, np.ndarray], plan: Plan, batch: int, count: int) -> list[dict[str, np.ndarray]]:
    """``count`` successive batches of ``batch`` samples (:func:`batch_of`)."""
    return [batch_of(inputs, plan, batch, i) for i in range(count)]
