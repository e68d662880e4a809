"""Per-node costs: measured with ONNX Runtime's profiler, estimated from FLOPs and bytes otherwise.

METIS balances vertex weights, so the weights must be what the target device really spends.
One profiled ORT run reports every node's kernel time; we average several runs after a warm-up.
Graph optimisations are switched off while profiling so that ORT's nodes are the model's nodes
one to one (fusion would rename and merge them). Nodes the profiler does not report get a
FLOP/byte estimate scaled by the median measured/estimated ratio of the nodes it did report,
so both kinds of cost share one unit (microseconds per profiled batch).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from staronnx.feeds import random_feeds_for_shapes
from staronnx.ortutil import QUIET, make_session, ort_failure, providers_for
from staronnx.partition.checks import say
from staronnx.partition.graph import ModelGraph, TensorInfo, resolve_input_shapes

#: Throughput assumed by the pure estimate when nothing was measured (flop/s, bytes/s).
_ASSUMED_FLOPS = 20e9
_ASSUMED_BANDWIDTH = 10e9


@dataclass
class NodeCosts:
    """Cost of each vertex in microseconds, and where each figure came from."""

    micros: np.ndarray
    measured: np.ndarray  # bool per vertex: True when the profiler reported it
    device: str
    batch: int
    runs: int

    @property
    def source(self) -> str:
        n = int(self.measured.sum())
        if n == len(self.measured):
            return f"profiled on {self.device} ({self.runs} runs, batch {self.batch})"
        if n == 0:
            return "estimated from FLOPs and bytes"
        return f"profiled on {self.device} ({n}/{len(self.measured)} nodes), rest estimated"


def estimate_node(graph: ModelGraph, v: int, batch: int) -> float:
    """Rough seconds of one vertex at a batch size: max of FLOP time and memory time."""
    node = graph.nodes[v]
    flops = _flops(graph, node) * batch
    touched = 0
    for t in list(node.input) + list(node.output):
        info = graph.tensors.get(t)
        if info is not None:
            touched += info.bytes_per_sample * (batch if info.batched else 1)
        elif t in graph.initializers:
            touched += int(np.prod(graph.initializers[t].dims)) * 4
    return max(flops / _ASSUMED_FLOPS, touched / _ASSUMED_BANDWIDTH, 1e-7)


def _shape(graph: ModelGraph, name: str) -> tuple[int, ...] | None:
    info: TensorInfo | None = graph.tensors.get(name)
    if info is not None and info.shape1 is not None:
        return info.shape1
    if name in graph.initializers:
        return tuple(int(d) for d in graph.initializers[name].dims)
    return None


def _flops(graph: ModelGraph, node: onnx.NodeProto) -> float:
    """Multiply-adds x2 per sample for the heavy ops; element count for the rest."""
    out = _shape(graph, node.output[0]) if node.output else None
    out_elems = float(np.prod(out)) if out else 0.0
    op = node.op_type
    if op in ("Conv", "ConvTranspose") and len(node.input) > 1:
        w = _shape(graph, node.input[1])
        if w and out:
            group = next((a.i for a in node.attribute if a.name == "group"), 1)
            per_out = float(np.prod(w[1:])) if op == "Conv" else float(np.prod(w[2:])) * w[0] / group
            return 2.0 * out_elems * per_out
    if op in ("MatMul", "Gemm", "MatMulInteger", "FusedMatMul") and len(node.input) > 1:
        a = _shape(graph, node.input[0])
        if a and out:
            trans_a = next((x.i for x in node.attribute if x.name == "transA"), 0)
            k = a[-2] if (op == "Gemm" and trans_a) else a[-1]
            return 2.0 * out_elems * k
    return out_elems


def profile_costs(
    graph: ModelGraph,
    *,
    device: str = "cpu",
    batch: int = 8,
    runs: int = 5,
    input_shapes: dict[str, list[int]] | None = None,
    seed: int = 0,
    threads: int | None = None,
) -> NodeCosts:
    """Measure every vertex's time with ORT's profiler on the target device.

    ``threads`` pins the intra-op pool size (a CPU group's cores, for per-device placement
    costs); None lets ORT use the machine. Two warm-up runs are dropped and the median of the
    rest kept, which resists a preempted run on a busy machine. Falls back to estimates (for
    the nodes it cannot time, or all of them if ORT cannot run the model on this device),
    never to an exception: costs only steer the cut. A run that fails is said in one
    :class:`~staronnx.partition.checks.PartitionWarning` (ORT's own log stays quiet).
    """
    providers = providers_for(device)
    shapes = resolve_input_shapes(graph.inputs, batch, input_shapes)
    feeds = random_feeds_for_shapes(graph.inputs, shapes, model=graph.model, seed=seed)
    estimates = estimated_costs(graph, batch).micros
    measured = np.zeros(len(graph), dtype=bool)
    micros = estimates.copy()
    warmup = 2
    with tempfile.TemporaryDirectory(prefix="staronnx-profile-") as tmp:
        so = profiling_options(tmp)
        if threads is not None:
            so.intra_op_num_threads = max(int(threads), 1)
            so.inter_op_num_threads = 1
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            sess = make_session(graph.model, optimize=False, providers=providers, options=so)
            for _ in range(runs + warmup):
                sess.run(None, feeds)
            times: dict[str, list[float]] = {}
            for name, us, _provider in kernel_events(Path(sess.end_profiling())):
                times.setdefault(name, []).append(us)
        except Exception as exc:  # noqa: BLE001 - costs only steer the cut: fall back to estimates
            times = {}
            _warn_unprofiled(exc, shapes, device)
    index = {node.name: v for v, node in enumerate(graph.nodes)}
    for name, durations in times.items():
        v = index.get(name)
        if v is None or len(durations) <= warmup:
            continue
        micros[v] = float(np.median(durations[warmup:]))
        measured[v] = True
    if measured.any() and not measured.all():
        ratio = np.median(micros[measured] / np.maximum(estimates[measured], 1e-9))
        micros[~measured] = estimates[~measured] * ratio
    micros = np.maximum(micros, 1e-3)
    return NodeCosts(micros=micros, measured=measured, device=device, batch=batch, runs=runs)


def _warn_unprofiled(exc: Exception, shapes: dict[str, list[int]], device: str) -> None:
    """One line for a profiling run ONNX Runtime refused: where, ORT's reason, what it means."""
    op, node, message = ort_failure(exc)
    where = f"{op} node {node!r}: " if node is not None else ""
    at = ", ".join(f"{n}={'x'.join(map(str, d)) or 'scalar'}" for n, d in shapes.items())
    why = (f"the model failed to run on {device} at {at} while profiling ({where}{message}): the node costs "
           "are estimated from FLOPs and bytes")
    say(f"{why}; give sizes the model accepts with input_shapes (and batch_axes where an input carries the "
        "batch elsewhere)",
        f"{why}; give sizes the model accepts with --input-shape (and --batch-axis where an input carries the "
        "batch elsewhere)")


def estimated_costs(graph: ModelGraph, batch: int = 8) -> NodeCosts:
    """Costs from FLOPs and bytes alone (no run), for a quick or deterministic partition."""
    micros = np.array([estimate_node(graph, v, batch) for v in range(len(graph))]) * 1e6
    return NodeCosts(micros=micros, measured=np.zeros(len(graph), dtype=bool), device="none",
                     batch=batch, runs=0)


def profiling_options(folder: str) -> ort.SessionOptions:
    """Session options that write ORT's profile (one event per node kernel) into ``folder``."""
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(folder, "profile")
    so.log_severity_level = QUIET  # a failed run is summarised in one line, not logged raw
    return so


def kernel_events(trace: Path) -> list[tuple[str, float, str]]:
    """(node name, µs, execution provider) of every node kernel in an ORT profile, in run order."""
    return [(str(e["name"])[: -len("_kernel_time")], float(e.get("dur", 0)),
             str((e.get("args") or {}).get("provider", "")))
            for e in json.loads(trace.read_text())
            if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")]
