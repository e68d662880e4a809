"""``staronnx.InferenceSession``: ONNX Runtime's call shape over a staronnx Runtime.

Existing code switches with one line::

    sess = staronnx.InferenceSession("model.onnx")          # was onnxruntime.InferenceSession
    logits, = sess.run(None, {"input": x})

A model file is partitioned on first use (85/15 by default, into a temporary plan); a plan
folder is used as it is.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from staronnx.ortutil import ort_type_name
from staronnx.plan import Plan, TensorSpec
from staronnx.runtime.runtime import Runtime



@dataclass(frozen=True)
class NodeArg:
    """Like onnxruntime.NodeArg: name, type string, shape with symbolic dims as strings."""

    name: str
    type: str
    shape: list[int | str | None]


def _arg(t: TensorSpec) -> NodeArg:
    return NodeArg(t.name, ort_type_name(t.dtype), list(t.shape))


class InferenceSession:
    """Drop-in for ``onnxruntime.InferenceSession.run`` backed by the staronnx runtime."""

    def __init__(
        self,
        model_or_plan: str | os.PathLike[str] | Plan,
        shares: Sequence[float] = (0.85, 0.15),
        policy: str = "heft",
        cpu_groups: str = "numa",
        cuda_streams: int = 0,
        **runtime_options: Any,
    ) -> None:
        if isinstance(model_or_plan, Plan):
            plan = model_or_plan
        elif Path(model_or_plan).is_dir():
            plan = Plan.load(model_or_plan)
        else:
            from staronnx.partition.api import partition

            out = Path(tempfile.mkdtemp(prefix="staronnx-session-")) / "plan"
            plan = partition(model_or_plan, list(shares), output_dir=out)
        self.plan = plan
        self._runtime = Runtime(plan, policy=policy, cpu_groups=cpu_groups,
                                cuda_streams=cuda_streams, **runtime_options)

    def get_inputs(self) -> list[NodeArg]:
        return [_arg(t) for t in self.plan.inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [_arg(t) for t in self.plan.outputs]

    def get_providers(self) -> list[str]:
        kinds = {getattr(w, "device_id", None) is not None for w in self._runtime.workers}
        return (["CUDAExecutionProvider"] if True in kinds else []) + ["CPUExecutionProvider"]

    def run(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, np.ndarray],
        run_options: Any = None,
    ) -> list[np.ndarray]:
        """Outputs in the order asked (all, in the model's order, for None), as ORT returns them."""
        names = list(output_names) if output_names else self.plan.output_names
        unknown = [n for n in names if n not in self.plan.output_names]
        if unknown:
            raise ValueError(f"unknown output name(s) {unknown}; outputs are {self.plan.output_names}")
        values = self._runtime.run(input_feed)
        return [values[n] for n in names]

    def run_async(self, input_feed: Mapping[str, np.ndarray]):
        """A future of the outputs dict (staronnx extension)."""
        return self._runtime.submit(input_feed)

    @property
    def runtime(self) -> Runtime:
        return self._runtime

    def close(self) -> None:
        self._runtime.close()

    def __enter__(self) -> "InferenceSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
