"""What a :class:`~staronnx.runtime.runtime.Runtime` is asked to do besides which workers to start
(those are its :class:`~staronnx.workers.layout.MachineSpec`): :class:`RuntimeSpec`, and what its
CUDA workers get beyond their place on the machine, :class:`CudaOptions`. Values, so every door
(the CLI, a Serve config, a sweep, an ``InferenceSession``) hands the runtime one thing it checked;
the runtime hands its engine both as one :class:`EngineSettings`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from staronnx.errors import StaronnxError
from staronnx.perfmodels import PerfModelStore
from staronnx.runtime.models import ServiceTarget
from staronnx.workers.cudart import GpuRuntime
from staronnx.workers.layout import MachineSpec


@dataclass(frozen=True)
class CudaOptions:
    """Every CUDA worker's session settings: its device, stream and core come from the machine's
    layout, and whether it captures CUDA graphs or drives itself is the machine's too
    (:class:`~staronnx.workers.layout.MachineSpec`), so neither is here to be given twice."""

    #: cuDNN's convolution algorithm search (``EXHAUSTIVE``, ``HEURISTIC``, ``DEFAULT``)
    cudnn_conv_algo_search: str = "EXHAUSTIVE"
    #: ORT's CUDA provider options (``gpu_mem_limit``, ``use_tf32``, ...) but device and stream
    provider_options: Mapping[str, str] = field(default_factory=dict)
    #: what stands in for CUDA (``HostRuntime()``: the same pipeline on the CPU provider); None:
    #: CUDA itself, or ``STARONNX_CUDA_RUNTIME=host``'s stand-in
    runtime: GpuRuntime | None = None

    def worker_options(self) -> dict[str, Any]:
        """The keywords each :class:`~staronnx.workers.cuda.CudaWorker` is made with."""
        return dict(vars(self))


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
        if self.save_every < 0:
            raise StaronnxError(f"save_every must be >= 0 seconds (0 = at close only), got {self.save_every}")


@dataclass(frozen=True)
class EngineSettings(RuntimeSpec):
    """What ``Runtime`` was asked for, handed whole to the engine's factory: its spec, and the
    workers to start unless ``workers`` are given."""

    machine: MachineSpec = field(default_factory=MachineSpec)

    @property
    def cuda_options(self) -> dict[str, Any]:
        """Every CUDA worker's keywords (:meth:`CudaOptions.worker_options`)."""
        return self.cuda.worker_options()
