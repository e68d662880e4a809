"""A session's plans, kept under ``$STARONNX_HOME/plans/`` (:mod:`staronnx.partition.plan_cache`)
so the next session of the same model and settings reuses the plan and its perf models; where
the home cannot be written, a session's own plan in a temporary folder.
"""

from __future__ import annotations

import errno
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from staronnx.compat.runners import Held
from staronnx.modelio import is_fixed
from staronnx.partition import plan_cache
from staronnx.partition.graph import model_inputs
from staronnx.partition.whole import whole_reason
from staronnx.perfmodels.store import default_root
from staronnx.plan import Plan
#: what a session's settings record as its ``input_shapes`` when the model is cut at its first
#: run: one plan serves every size, so whichever first run made it, the next session reuses it
AT_FIRST_RUN = "at the first run's shapes"
#: errors of a home that cannot be written: the session's plan then lives in a temporary folder
_READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR})


def plan_dir(sha256: str, shares: Any, options: Mapping[str, Any], groups: str, cuda_streams: int) -> Path:
    """Where a session's plan of this model and these settings lives: keyed by what besides the
    model decides the cut (the workers only where the cut is timed on them: ``shares="auto"``, a
    placement method)."""
    settings: dict[str, Any] = {"shares": shares, "options": dict(options)}
    if shares == "auto" or "method" in options:
        settings.update(groups=groups, cuda_streams=cuda_streams)
    return plan_cache.plan_folder(default_root() / "plans", sha256, settings)


def partition_settings(partition_options: Mapping[str, Any] | None,
                       input_shapes: Sequence[str] | Mapping[str, Sequence[int]] | None) -> dict[str, Any]:
    """What goes to partition(): ``partition_options`` with ``input_shapes`` (a keyword of its
    own, as partition's errors name it) in it; given in both places it is refused, not merged."""
    options = dict(partition_options or {})
    if input_shapes is not None:
        if "input_shapes" in options:
            raise TypeError("input_shapes given twice: as input_shapes= and in partition_options; give it once")
        options["input_shapes"] = input_shapes
    placed = sorted({"output_dir", "force"} & options.keys())
    if placed:
        raise TypeError(f"partition_options cannot set {placed[0]}: a session's plan lives under "
                        "STARONNX_HOME; for a plan elsewhere, staronnx.partition(model, "
                        "output_dir=...) and pass that folder")
    return options


def unsized_dims(model: onnx.ModelProto, batch_axes: dict[str, int | None]) -> list[str]:
    """The model's dynamic sizes that partition cannot choose itself ("image: height"): every
    dynamic axis of an input but its batch axis (which partition sets to its profiling batch);
    none for a model served whole, which is not profiled (:mod:`staronnx.partition.whole`)."""
    if whole_reason(model) is not None:
        return []
    return [f"{spec.name}: {d or f'axis {axis}'}" for spec in model_inputs(model, batch_axes)
            for axis, d in enumerate(spec.shape) if not is_fixed(d) and axis != spec.batch_axis]


def first_run_shapes(feeds: Mapping[str, np.ndarray]) -> dict[str, list[int]]:
    """A first run's feed shapes as partition's ``input_shapes`` (scalars have none to give;
    a zero size, an empty KV cache at a decoder's prefill, is a size the model runs)."""
    return {name: [int(d) for d in value.shape] for name, value in feeds.items() if value.ndim}


def session_plan(sha256: str, folder: Path, make: Callable[..., Plan], held: Held) -> Plan:
    """The plan kept in ``folder`` when it is this model's and intact, else made there
    (:func:`~staronnx.partition.plan_cache.kept_or_made`); where the home cannot be written,
    this session's own in a temporary folder of ``held``."""
    try:
        return plan_cache.kept_or_made(folder, lambda out: make(output_dir=out, force=True), sha256)
    except OSError as exc:
        if exc.errno not in _READ_ONLY:
            raise
        why = exc.strerror or str(exc)
    # a home that cannot be written: this session's own plan, removed at close
    warnings.warn(f"cannot keep plans under {default_root()} ({why}); this "
                  "session's plan lives in a temporary folder until close(). Set "
                  "STARONNX_HOME to a writable folder to partition once.", UserWarning, stacklevel=4)
    return make(output_dir=held.temporary("staronnx-session-") / "plan")
