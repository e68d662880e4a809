"""ONNX Runtime's own static placement, read off a CUDA session, as a baseline.

ORT assigns each node to the first provider in the list that supports it (CUDA first, CPU for
the rest). With ``memory_limit_kb`` it stops giving nodes to CUDA once their estimated memory
exceeds the budget (``session.resource_cuda_partitioning_settings``, "limit_kb,stats_file";
we pass no stats file, so ORT estimates). Graph optimisations are off so ORT's nodes are the
model's nodes; the provider that ran each node's kernel comes from ORT's profile.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from staronnx.errors import DeviceError, PartitionError
from staronnx.feeds import random_feeds_for_shapes
from staronnx.ortutil import make_session, providers_for
from staronnx.partition.costs import kernel_events, profiling_options
from staronnx.partition.graph import ModelGraph, resolve_input_shapes
from staronnx.partition.methods.heuristics import Assignment
from staronnx.partition.methods.model import Device


def ort_static_devices(
    graph: ModelGraph,
    devices: Sequence[Device],
    *,
    batch: int = 1,
    input_shapes: dict[str, list[int]] | None = None,
    seed: int = 0,
    memory_limit_kb: int | None = None,
) -> Assignment:
    try:
        providers = providers_for("cuda")
    except DeviceError as exc:
        raise DeviceError(f"ort-static: {exc}") from None
    gpu = next((i for i, d in enumerate(devices) if d.kind == "cuda"), None)
    cpu = next((i for i, d in enumerate(devices) if d.kind == "cpu"), None)
    if gpu is None or cpu is None:
        why = f"ort-static places between a CPU and a GPU; the devices are {[d.name for d in devices]}"
        raise PartitionError(f"{why} (add a 'cuda' Device, e.g. host_devices(cuda=True), or use device='cuda')",
                             cli=f"{why} (use --device cuda)")
    shapes = resolve_input_shapes(graph.inputs, batch, input_shapes)
    feeds = random_feeds_for_shapes(graph.inputs, shapes, model=graph.model, seed=seed)
    with tempfile.TemporaryDirectory(prefix="staronnx-ort-static-") as tmp:
        so = profiling_options(tmp)
        if memory_limit_kb is not None:
            so.add_session_config_entry("session.resource_cuda_partitioning_settings", f"{int(memory_limit_kb)},")
        sess = make_session(graph.model, optimize=False, providers=providers, options=so)
        sess.run(None, feeds)
        # the provider whose kernel ran each node
        placed = {name: provider for name, _, provider in kernel_events(Path(sess.end_profiling())) if provider}
    a = np.full(len(graph), cpu, dtype=np.int64)
    on_gpu = 0
    for v, node in enumerate(graph.nodes):
        if placed.get(node.name) == "CUDAExecutionProvider":
            a[v] = gpu
            on_gpu += 1
    return Assignment(a, {"nodes_on_cuda": on_gpu, "nodes_reported": len(placed), "memory_limit_kb": memory_limit_kb})
