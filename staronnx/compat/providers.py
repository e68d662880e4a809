"""ORT's providers as staronnx's workers: CUDA streams where the CUDA provider is asked for and
can run (else ORT's fallback to the CPU, said), CPU groups sized by ``intra_op_num_threads``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import onnxruntime as ort
from onnxruntime.capi.onnxruntime_inference_collection import check_and_normalize_provider_args

from staronnx.workers.cuda_env import cuda_unavailable_reason, missing_device
from staronnx.workers.topology import Topology

CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"
#: CUDA workers a session starts when CUDA is asked for and ``cuda_streams`` is not given: two
#: streams overlap one batch's copies with another's compute (the StarONNX papers' best small N)
DEFAULT_CUDA_STREAMS = 2


def asked_providers(providers: Sequence[str | tuple[str, Mapping[str, Any]]] | None,
               provider_options: Sequence[Mapping[str, Any]] | None,
               cuda_stand_in: bool = False) -> dict[str, dict[str, str]]:
    """ORT's two provider spellings as one ordered {name: options}, checked by ORT's own code;
    providers this ORT lacks are dropped after ORT's warning, as ORT drops them (not CUDA's where
    a stand-in CUDA runtime is given)."""
    available = ort.get_available_providers() + ([CUDA_EP] if cuda_stand_in else [])
    names, options = check_and_normalize_provider_args(providers, provider_options, available)
    return {name: opts for name, opts in zip(names, options) if name in available}


def cuda_workers(asked: dict[str, dict[str, str]] | None, cuda_streams: int | None, stand_in: Any = None) -> int:
    """How many CUDA workers to start: with ``providers=None``, ``cuda_streams``; with providers
    naming CUDA, where CUDA can run (``stand_in``: the CUDA runtime the workers use instead of
    this machine's, asked in its place), and otherwise none, with ORT's warning of a fallback."""
    if asked is None:
        return int(cuda_streams or 0)
    if CUDA_EP not in asked:
        if cuda_streams:
            raise ValueError(f"cuda_streams={cuda_streams} needs {CUDA_EP} in providers "
                             f"(providers here: {', '.join(asked) or 'none'})")
        return 0
    device = cuda_device_id(asked)
    reason = cuda_unavailable_reason(device) if stand_in is None else missing_device(device, stand_in.device_count())
    if reason is not None:
        warnings.warn(f"{CUDA_EP} cannot run here, falling back to {CPU_EP}: {reason}", UserWarning, stacklevel=3)
        return 0
    return DEFAULT_CUDA_STREAMS if cuda_streams is None else int(cuda_streams)


def cuda_device_id(asked: Mapping[str, Mapping[str, Any]]) -> int:
    """The GPU the CUDA provider's options name (ORT's ``device_id``, 0 by default)."""
    value = (asked.get(CUDA_EP) or {}).get("device_id", 0)
    try:
        device = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{CUDA_EP} option device_id must be a CUDA device ordinal (0, 1, ...), "
                         f"got {value!r}") from None
    if device < 0:
        raise ValueError(f"{CUDA_EP} option device_id must be >= 0, got {device}")
    return device


def cores_for_threads(threads: int, cuda_drivers: int = 0) -> str:
    """ORT's ``intra_op_num_threads`` as CPU groups: one group of the first ``threads`` cores
    this process may use (one PU each), so the session computes on that many threads as ORT's
    would. ``cuda_drivers`` more cores are reserved for the GPU driver threads where the machine
    has them, as the default groups do (an explicit list alone reserves none)."""
    topology = Topology.from_system()
    allowed = topology.allowed_cores()
    cores = allowed[:threads]
    pus = ",".join(str(core.allowed_pus(topology.allowed_pus)[0]) for core in cores)
    spare = len(allowed) - len(cores)
    return pus + (f",reserve={min(cuda_drivers, spare)}" if cuda_drivers and spare else "")
