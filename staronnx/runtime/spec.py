"""What a :class:`~staronnx.runtime.runtime.Runtime` is asked to do besides which workers to start
(those are its :class:`~staronnx.workers.layout.MachineSpec`): :class:`RuntimeSpec`, with what its
CUDA workers get beyond their place on the machine, the workers' own
:class:`~staronnx.workers.cuda.CudaOptions` (whether they capture CUDA graphs and drive
themselves is the machine's to say, and set from it). Values, so every door
(the CLI, a Serve config, a sweep, an ``InferenceSession``) hands the runtime one thing it checked;
the runtime hands its engine both as one :class:`EngineSettings`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from staronnx.errors import StaronnxError
from staronnx.perfmodels import PerfModelStore
from staronnx.runtime.models import ServiceTarget
from staronnx.workers.cuda import CudaOptions
from staronnx.workers.layout import MachineSpec


@dataclass(frozen=True)
class RuntimeSpec:
    """How a runtime serves: its policy, its engine, what it records and learns, and per model
    its service target (``targets``: a :class:`ServiceTarget`, or a mapping of its fields, by
    model name; a single plan is named after its folder)."""

    policy: str = "heft"
    #: the policy's own settings (``static``'s ``devices``, StarPU's variables, ...)
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    #: ``native`` (staronnx's workers) or ``starpu`` (StarPU's, through its binding)
    engine: str = "native"
    #: a Chrome/Perfetto trace file written at close
    trace: str | os.PathLike[str] | None = None
    #: the perf models (None: the default store under ``$STARONNX_HOME``)
    store: PerfModelStore | None = None
    #: workers already started, instead of the machine's (the runtime leaves them open)
    workers: Sequence[Any] | None = None
    #: StarPU's ``STARPU_CALIBRATE``: 0 freezes the models, 1 keeps recording, 2 replaces them
    #: (None: ``$STARONNX_CALIBRATE``, else 0)
    calibrate: int | None = None
    cuda: CudaOptions = field(default_factory=CudaOptions)
    #: batch sizes every CUDA worker runs (capturing their CUDA graphs) before serving
    warmup: Sequence[int] = ()
    targets: Mapping[str, ServiceTarget | Mapping[str, Any]] = field(default_factory=dict)
    #: seconds between merges of the perf models learnt while serving into the store (0: at
    #: close only), so a server that is killed loses at most that much of what it learnt
    save_every: float = 0.0

    def __post_init__(self) -> None:
        if not self.cuda.cuda_graphs or self.cuda.thread_per_stream:
            raise StaronnxError("cuda_graphs and thread_per_stream are the machine's: set them in MachineSpec, "
                                "not in the runtime's CudaOptions")
        if self.save_every < 0:
            raise StaronnxError(f"save_every must be >= 0 seconds (0 = at close only), got {self.save_every}")


@dataclass(frozen=True)
class EngineSettings(RuntimeSpec):
    """What ``Runtime`` was asked for, handed whole to the engine's factory: its spec, and the
    workers to start unless ``workers`` are given."""

    machine: MachineSpec = field(default_factory=MachineSpec)

    @property
    def cuda_options(self) -> CudaOptions:
        """Every CUDA worker's options: the spec's, with the machine's graphs and threads."""
        return replace(self.cuda, cuda_graphs=self.machine.cuda_graphs, thread_per_stream=self.machine.thread_per_stream)
