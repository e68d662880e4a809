"""What a cut is asked for, as one value: :class:`PartitionSpec`.

``staronnx.partition(model, shares, spec)`` and ``staronnx partition`` take the same settings;
the command parses its flags into one spec, and scripts keep a spec to cut several models the
same way (``dataclasses.replace(spec, seed=1)`` for a variant).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["PartitionSpec"]


@dataclass(frozen=True)
class PartitionSpec:
    """How a model is cut (the shares themselves are :func:`~staronnx.partition` 's own argument).

    Args:
        parts: k equal shares, when no shares are given (k must match the shares when both are).
        method: the cut (``metis``, ``linear``) or placement method (``comm-sd``, ``duet``, ...).
        device: where node costs are measured: ``cpu`` or ``cuda``.
        input_shapes: fixed sizes for dynamic input dimensions (``["x:1x3x224x224"]`` or a dict).
        seed: the random feeds' and METIS's seed.
        costs: ``profile`` (ORT's profiler) or ``estimate`` (FLOP/byte estimates only).
        profile_batch: the batch size costs (and ``shares="auto"``'s speeds) are measured at.
        profile_runs: profiled runs per measurement.
        tolerance: how far an achieved share may miss its target before a warning says so.
        groups: the CPU group policy the plan will be served with (``shares="auto"`` times the
            model on those workers; a placement method places on those groups); None: one per
            NUMA node, or two halves of the cores.
        cuda_streams: CUDA workers per GPU the plan will be served with (``shares="auto"``).
        cuda_devices: the GPUs, by CUDA ordinal (``shares="auto"`` with ``cuda_streams`` or ``device="cuda"``:
            each is timed).
        batch_axes: input or output name -> batch axis (None: not batched), where the graph
            cannot tell (:mod:`staronnx.contract`); kept in the plan's settings.
        batching: False serves one request per task, whatever the graph says.
    """

    parts: int | None = None
    method: str = "metis"
    device: str = "cpu"
    input_shapes: Sequence[str] | Mapping[str, Sequence[int]] | None = None
    seed: int = 0
    costs: str = "profile"
    profile_batch: int = 8
    profile_runs: int = 5
    tolerance: float = 0.02
    groups: str | None = None
    cuda_streams: int = 0
    cuda_devices: Sequence[int] = (0,)
    batch_axes: Sequence[str] | Mapping[str, int | None] | None = None
    batching: bool = True
