"""What a cut is asked for, as one value: :class:`PartitionSpec`.

``staronnx.partition(model, shares, spec)`` and ``staronnx partition`` take the same settings;
the command parses its flags into one spec, and scripts keep a spec to cut several models the
same way (``dataclasses.replace(spec, seed=1)`` for a variant).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real

from staronnx.errors import PartitionError

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

    def __post_init__(self) -> None:
        """Refuses values of the wrong kind, naming the field: a Python caller's ``parts=2.5`` or
        ``profile_runs="2"`` ended in a TypeError deep in the cut, and ``profile_batch=1.5`` was taken
        as given. Ranges are ``partition()``'s to check."""
        whole = {"profile_batch": self.profile_batch, "profile_runs": self.profile_runs, "seed": self.seed,
                 "cuda_streams": self.cuda_streams}
        if self.parts is not None:
            whole["parts"] = self.parts
        for name, value in whole.items():
            if isinstance(value, bool) or not isinstance(value, Integral):
                raise PartitionError(f"{name} must be a whole number, got {value!r}")
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, Real):
            raise PartitionError(f"tolerance must be a number, got {self.tolerance!r}")
        if not isinstance(self.batching, bool):
            raise PartitionError(f"batching is True or False, got {self.batching!r}")
        if isinstance(self.input_shapes, Mapping):
            for name, dims in self.input_shapes.items():
                sizes = list(dims) if isinstance(dims, Sequence) and not isinstance(dims, str) else None
                if sizes is None or any(
                        isinstance(d, bool) or not isinstance(d, Integral) or d < -1 for d in sizes):
                    # (0 stays: an empty past is a real first run's size, which sessions cut at)
                    raise PartitionError(f"input_shapes[{name!r}] must list sizes >= 0 (or -1 for the model's), "
                                         f"got {dims!r}")
