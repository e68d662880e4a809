"""Batch inference beyond one machine: staronnx inside Ray Data's ``map_batches``.

Ray Data's answer for offline inference is a stateful callable class per actor: the actor builds
its model once and is called with batches of rows. :class:`StaronnxPredictor` is that class, with
a staronnx :class:`~staronnx.Runtime` per actor, so each actor runs its batches on every worker
its share of the machine has (CPU groups; CUDA streams on the GPUs Ray gives it)::

    import ray
    from staronnx.infer import plan_for
    from staronnx.ray.data import StaronnxPredictor

    plan = str(plan_for("model.onnx").root)          # made once, on the driver
    ds = ray.data.read_parquet("images/")
    out = ds.map_batches(StaronnxPredictor, fn_constructor_kwargs={"model": plan},
                         batch_size=64, concurrency=2, num_cpus=1)
    out.write_parquet("outputs/")

The plan travels as a path, as a Serve replica's does: on one machine or a shared filesystem the
actors load the very folder the driver made. Rows come row-major, as Ray holds them (a
``[rows, *sample]`` array per column, or an object array of per-row arrays where sizes differ);
the predictor puts them on each input's batch axis (:mod:`staronnx.infer.rows`), submits the
batch in pieces of ``batch_size`` rows so every worker of the actor is busy, and returns each
output row-major beside the columns that are not the model's inputs (a row id, a file name).
GPUs: Ray sets ``CUDA_VISIBLE_DEVICES`` to the actor's (``num_gpus=1``), and the predictor
starts ``cuda_streams`` workers on each (2 by default where it has one, none otherwise).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from staronnx.errors import InputError
from staronnx.infer.plans import plan_for
from staronnx.infer.rows import RowLayout
from staronnx.infer.sources import chunks_from_columns
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.workers.layout import MachineSpec

#: CUDA streams per GPU an actor starts when it has GPUs and none were asked for
DEFAULT_STREAMS = 2


def _actor_gpus() -> int:
    """How many GPUs Ray gave this actor (0 outside Ray)."""
    try:
        import ray

        return len(ray.get_gpu_ids()) if ray.is_initialized() else 0
    except Exception:  # noqa: BLE001 - no Ray, or not in a worker: no GPU of Ray's
        return 0


class StaronnxPredictor:
    """A Ray Data predictor: one staronnx runtime per actor (see the module docstring).

    ``model``: a plan folder (or an ONNX file: each actor then keeps its own one-part plan under
    ``STARONNX_HOME``). ``batch_size``: rows per task (None: each Ray batch's rows in one task,
    where the model batches). ``groups``, ``policy``, ``cuda_streams`` (None: 2 per GPU of the
    actor), ``cuda_graphs``: the runtime's, as ``staronnx infer`` takes them. ``home``: the
    ``STARONNX_HOME`` whose perf models the actor reads (a shared folder is safe)."""

    def __init__(self, model: str, *, batch_size: int | None = None, groups: str = "numa", policy: str = "heft",
                 cuda_streams: int | None = None, cuda_graphs: bool = True, home: str | None = None) -> None:
        if home is not None:
            os.environ["STARONNX_HOME"] = home
        if batch_size is not None and batch_size < 1:
            raise InputError(f"batch_size must be at least 1, got {batch_size}")
        gpus = _actor_gpus()
        streams = cuda_streams if cuda_streams is not None else (DEFAULT_STREAMS if gpus else 0)
        self.plan = plan_for(model)
        self.layout = RowLayout.of(self.plan)
        self.batch_size = batch_size
        self.runtime = Runtime(self.plan, MachineSpec(groups, streams, tuple(range(max(gpus, 1))), cuda_graphs),
                               RuntimeSpec(policy))

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """One Ray batch (``batch_format="numpy"``): its rows' outputs, row-major, with the
        columns that are not the model's inputs passed through."""
        missing = [n for n in self.layout.inputs if n not in batch]
        if missing:
            raise InputError(f"the batch has no column for input(s) {missing}; its columns are {list(batch)} and "
                             f"the model's inputs {list(self.layout.inputs)}")
        columns = {n: _rows(batch[n]) for n in self.layout.inputs}
        pending = []
        for chunk in chunks_from_columns(self.layout, columns, 0):
            if chunk.problem is not None:
                raise InputError(f"row {chunk.start} of the batch cannot run: {chunk.problem}")
            step = (self.batch_size or chunk.rows) if self.layout.batched else 1
            for lo in range(0, chunk.rows, step):
                hi = min(lo + step, chunk.rows)
                feeds = {n: np.require(v, requirements="C") for n, v in self.layout.take(chunk.arrays, lo, hi).items()}
                pending.append((hi - lo, self.runtime.submit(feeds)))
        results = [self.layout.row_major(future.result(), rows) for rows, future in pending]
        out: dict[str, Any] = {k: v for k, v in batch.items() if k not in self.layout.inputs}
        for name in self.plan.output_names:
            parts = [r[name] for r in results]
            if len({p.shape[1:] for p in parts}) <= 1:
                out[name] = np.concatenate(parts) if parts else np.zeros(0)
            else:  # rows of different shapes: one array per row, as Ray holds variable-shaped tensors
                rows_list = [row for p in parts for row in p]
                holder = np.empty(len(rows_list), dtype=object)
                holder[:] = rows_list
                out[name] = holder
        return out

    def __del__(self) -> None:
        runtime = getattr(self, "runtime", None)
        if runtime is not None:
            runtime.close()


def _rows(column: Any) -> np.ndarray | list[np.ndarray | None]:
    """A Ray column as a ``[rows, *sample]`` array, or per-row arrays where their shapes differ
    (Ray's variable-shaped tensors arrive as an object array of arrays)."""
    array = np.asarray(column) if not isinstance(column, np.ndarray) else column
    if array.dtype == object and array.ndim == 1 and len(array) and isinstance(array[0], np.ndarray):
        shapes = {a.shape for a in array}
        if len(shapes) == 1:
            return np.stack(list(array))
        return [np.asarray(a) for a in array]
    return array
