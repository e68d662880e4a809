"""staronnx's own settings of an :class:`~staronnx.compat.session.InferenceSession`, as one value:
the constructor keeps ONNX Runtime's call shape (its own keywords included), so that nothing of
staronnx's can be mistaken for an ORT argument, and an ORT script runs unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from staronnx.runtime.spec import RuntimeSpec

#: the split a session asks for when given none: the StarONNX papers' 85/15. A model with fewer
#: nodes than that is served whole instead (partition's default split), with a warning
DEFAULT_SHARES = (0.85, 0.15)


@dataclass(frozen=True)
class SessionSpec:
    """How a session cuts its model and which workers run it. What is None here ORT's arguments
    decide, as they choose ORT's devices: the CUDA streams from ``providers`` (two per GPU where
    CUDA is asked for), the GPU from the CUDA provider's ``device_id``, the CPU groups from
    ``intra_op_num_threads`` (one group of that many cores; else one per NUMA node)."""

    #: each part's share of the work (``"auto"``: from measured speeds); None: partition's default
    shares: Sequence[float] | str | None = DEFAULT_SHARES
    cpu_groups: str | None = None
    cuda_streams: int | None = None
    cuda_devices: Sequence[int] | None = None
    #: capture each (part, batch size) as a CUDA graph on the CUDA workers
    cuda_graphs: bool = True
    #: the size a model with dynamic sizes is cut at (``["image=1x3x256x256"]``) when the session
    #: opens, instead of at its first run's shapes
    input_shapes: Sequence[str] | Mapping[str, Sequence[int]] | None = None
    #: what goes to :func:`staronnx.partition` (``{"costs": "estimate"}``, ...)
    partition_options: Mapping[str, Any] = field(default_factory=dict)
    #: how the runtime serves (policy, perf models, trace, CUDA options: :class:`RuntimeSpec`)
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
