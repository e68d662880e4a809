"""Copies per batch, counted and predicted (issue 37); CUDA workers on ``HostRuntime`` (runs anywhere).

A split model is cheap on a GPU only if its intermediates stay there: a 2-part plan on one GPU
must move exactly what the 1-part plan moves (the model's inputs up, its outputs down), a
GPU-to-CPU edge its tensor once, and the perf-model-driven policies must price exactly the
copies the engine issues. This sets, for 1-part and 2-part plans of googlenet and of a real
model from ``models/real/``:

- ``gpu``: one CUDA stream, every part on it (policy eager);
- ``gpu+cpu``: one CUDA stream and one CPU group; the 2-part plan pinned part 0 to the GPU and
  part 1 to the CPU (the GPU-to-CPU edge, policy static), the 1-part plan placed by dmda;

the host-to-device and device-to-host copies and bytes per batch that ``HostRuntime`` counted
(``copy_counts``: what the CUDA workers and the runtime's memory nodes issued) beside those
:func:`staronnx.runtime.datawizard.request_copies` predicts for the placement each request ran
at (the rule the core, the predictor, the simulator and the LP bound share), and the copies
within the GPU's memory (``d2d``: a tensor into a graph slot's fixed buffer; not a transfer).
Then a steady open loop (requests at ``--load`` of the closed-loop rate) on the 2-part plans,
GPU+CPU, under dmda and heft, which place a task when it is pushed: the share of tasks that
found their inputs on their node when they started (prefetch hits), and of those that needed
a copy, the share whose copies were done by then.

HostRuntime's copies are synchronous, so its prefetches are always done in time: there the
hit figure checks the mechanism (every task whose input moved had it prefetched), on a GPU
(``--device cuda``, where the counted columns are not available) the overlap.

Usage: python benchmarks/data_movement.py [--batches 6] [--batch 2] [--model googlenet.onnx]
       [--real bert_tiny] [--seconds 4] [--load 0.6] [--device host|cuda]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import GOOGLENET, REAL, cuda_worker_options, scratch_dir  # noqa: E402
from staronnx import partition  # noqa: E402
from staronnx.perfmodels import PerfModelStore  # noqa: E402
from staronnx.plan import Plan  # noqa: E402
from staronnx.runtime.runtime import Runtime  # noqa: E402
from staronnx.runtime.spec import RuntimeSpec
from staronnx.verify import random_plan_feeds  # noqa: E402
from staronnx.workers.cudart import HostRuntime  # noqa: E402
from staronnx.calibrate import start_workers  # noqa: E402
from staronnx.partition import PartitionSpec
from staronnx.workers.layout import MachineSpec


try:  # the one rule (absent before issue 37: the benchmark then counts only)
    from staronnx.runtime.datawizard import request_copies, tally
except ImportError:  # pragma: no cover - a checkout from before the data layer
    request_copies = tally = None  # type: ignore[assignment]


class CountingRuntime(HostRuntime):
    """HostRuntime that also tallies bytes per copy kind itself (so this benchmark counts the
    same way on a checkout whose HostRuntime does not: its "before" figures)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.moved: dict[str, list[int]] = {}
        self._lock2 = threading.Lock()

    def _add(self, kind: str, nbytes: int) -> None:
        if nbytes:
            with self._lock2:
                entry = self.moved.setdefault(kind, [0, 0])
                entry[0] += 1
                entry[1] += nbytes

    def copy_h2d(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        super().copy_h2d(dst, src, nbytes, stream)
        self._add("h2d", nbytes)

    def copy_d2h(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        super().copy_d2h(dst, src, nbytes, stream)
        self._add("d2h", nbytes)

    def copy_d2d(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        super().copy_d2d(dst, src, nbytes, stream)
        self._add("d2d", nbytes)

    def copy_peer(self, dst: int, dst_device: int, src: int, src_device: int, nbytes: int, stream: Any) -> None:
        super().copy_peer(dst, dst_device, src, src_device, nbytes, stream)
        self._add("peer", nbytes)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        with self._lock2:
            return {k: (n, b) for k, (n, b) in self.moved.items()}


def real_feeds(name: str, batch: int) -> dict[str, np.ndarray]:
    """A real model's reference inputs with their batch axis at ``batch`` (tiled)."""
    with np.load(REAL / f"{name}.npz") as z:
        ins = {k[3:]: z[k] for k in z.files if k.startswith("in:")}
    return {n: (np.concatenate([a] * batch, axis=0) if a.ndim else a) for n, a in ins.items()}


def real_shapes(name: str) -> list[str]:
    """``input_shapes`` to cut a real model at: its reference's sizes at batch 1."""
    with np.load(REAL / f"{name}.npz") as z:
        ins = {k[3:]: z[k] for k in z.files if k.startswith("in:")}
    return [f"{n}={'x'.join(map(str, [1, *a.shape[1:]]))}" for n, a in ins.items() if a.ndim]


def tensor_bytes(plan: Plan, feeds: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Bytes of every tensor of the plan on ``feeds`` (a reference run)."""
    return {n: int(np.asarray(v).nbytes) for n, v in plan.reference_values(dict(feeds)).items()}


def predicted(plan: Plan, runtime: Runtime, placements: list[dict[str, str]], nbytes: Mapping[str, int]) -> dict[str, tuple[int, int]] | None:
    """``kind -> (copies, bytes)`` the rule gives for each request's placement, summed."""
    if request_copies is None:
        return None
    node_of = {w.arch: w.memory_node for w in runtime.workers}
    parts = [(p.inputs, p.outputs) for p in plan.parts]
    total: dict[str, list[int]] = {}
    for placement in placements:
        nodes = [node_of[placement[f"part{k}"]] for k in range(plan.k)]
        for kind, (n, b) in tally(request_copies(parts, nodes, nbytes, set(plan.output_names))).items():
            entry = total.setdefault(kind, [0, 0])
            entry[0] += n
            entry[1] += b
    return {k: (n, b) for k, (n, b) in total.items()}


def delta(after: Mapping[str, tuple[int, int]], before: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    return {k: (n - before.get(k, (0, 0))[0], b - before.get(k, (0, 0))[1]) for k, (n, b) in after.items()
            if (n, b) != before.get(k, (0, 0))}


def open_runtime(plan: Plan, config: str, args: argparse.Namespace, home: Path, policy: str | None = None):
    """(Runtime, the stand-in or None, workers to close) for ``config``."""
    options, _ = cuda_worker_options(args.device)
    rt = CountingRuntime() if args.device == "host" else None
    if rt is not None:
        options = replace(options, runtime=rt)
    store = PerfModelStore(home)
    if config == "gpu":
        return Runtime(plan, MachineSpec("none", 1, cuda_graphs=False),
                       RuntimeSpec(policy or "eager", store=store, cuda=options)), rt, []
    if plan.k == 1 or policy is not None:
        return Runtime(plan, MachineSpec("1", 1, cuda_graphs=False),
                       RuntimeSpec(policy or "dmda", store=store, cuda=options)), rt, []
    # the options' own cuda_graphs would override the machine's (start_workers)
    workers = start_workers(plan, MachineSpec("1", 1, cuda_graphs=False), cuda_options=dataclasses.replace(options, cuda_graphs=False))
    names = {w.kind: w.name for w in workers}
    devices = {0: names["cuda"], **{p: names["cpu"] for p in range(1, plan.k)}}
    return Runtime(plan,
                   spec=RuntimeSpec(policy="static", policy_options={"devices": devices}, workers=workers,
                                    store=store)), rt, workers


def count_row(label: str, plan: Plan, config: str, feeds: dict[str, np.ndarray], args: argparse.Namespace,
              home: Path) -> dict[str, Any]:
    runtime, rt, workers = open_runtime(plan, config, args, home)
    try:
        with runtime:
            runtime.run(feeds)  # first run of each shape: sessions' own allocations
            before = rt.snapshot() if rt is not None else {}
            futs = [runtime.submit(feeds) for _ in range(args.batches)]
            for f in futs:
                f.result()
            counted = delta(rt.snapshot(), before) if rt is not None else None
            pred = predicted(plan, runtime, [dict(f.placement) for f in futs], tensor_bytes(plan, feeds))
    finally:
        for w in workers:
            w.close()
    return {"label": label, "config": config, "counted": counted, "predicted": pred}


def show(row: dict[str, Any], n: int, model_in: int, model_out: int) -> str:
    def cell(source: dict[str, tuple[int, int]] | None, kind: str) -> str:
        if source is None:
            return "-"
        c, b = source.get(kind, (0, 0))
        return f"{c / n:.3g}/{b / n / 1024:,.1f}"

    counted, pred = row["counted"], row["predicted"]
    same = "-" if counted is None or pred is None else (
        "yes" if {k: v for k, v in counted.items() if k != "d2d"} == pred else "NO")
    return (f"{row['label']:<22} {row['config']:<8} {cell(counted, 'h2d'):>14} {cell(pred, 'h2d'):>14} "
            f"{cell(counted, 'd2h'):>14} {cell(pred, 'd2h'):>14} {cell(counted, 'd2d'):>14} {same:>6}"
            f"   (inputs {model_in / 1024:,.1f} KiB, outputs {model_out / 1024:,.1f} KiB)")


def open_loop(plan: Plan, policy: str, feeds: dict[str, np.ndarray], args: argparse.Namespace, home: Path) -> str:
    runtime, _, workers = open_runtime(plan, "gpu+cpu", args, home, policy=policy)
    try:
        with runtime:
            for _ in range(3):
                runtime.run(feeds)
            start = time.perf_counter()  # the closed-loop rate, one request at a time
            for _ in range(4):
                runtime.run(feeds)
            period = (time.perf_counter() - start) / 4 / args.load
            futs, t0 = [], time.perf_counter()
            while time.perf_counter() - t0 < args.seconds:
                futs.append(runtime.submit(feeds))
                time.sleep(max(0.0, t0 + len(futs) * period - time.perf_counter()))
            for f in futs:
                f.result()
            stats = runtime.stats()
    finally:
        for w in workers:
            w.close()
    pre = stats.get("prefetch")
    if pre is None:
        return f"{policy:<6} {len(futs):>5} requests: no prefetch (this runtime does not prefetch)"
    moved, hits, tasks = pre["moved"], pre["hits"], pre["tasks"]
    return (f"{policy:<6} {len(futs):>5} requests, {tasks} tasks: inputs on their node at start "
            f"{pre['on_node']:.3f}; of the {moved} that needed a copy, prefetched in time {hits / max(moved, 1):.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=6, help="batches counted per row")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--model", type=Path, default=GOOGLENET)
    ap.add_argument("--real", default="bert_tiny", help="a model of models/real/")
    ap.add_argument("--seconds", type=float, default=4.0, help="open loop length per policy")
    ap.add_argument("--load", type=float, default=0.6, help="open loop rate / closed-loop rate")
    ap.add_argument("--device", choices=("host", "cuda"), default="host")
    ap.add_argument("--skip-open-loop", action="store_true")
    args = ap.parse_args(argv)
    tmp = scratch_dir("staronnx-movement-")
    models: list[tuple[str, Path, dict[str, np.ndarray] | None, Any, list[str]]] = [
        ("googlenet", args.model, None, [0.85, 0.15], [])]
    if args.real:
        models.append((args.real, REAL / f"{args.real}.onnx", real_feeds(args.real, args.batch), None,
                       real_shapes(args.real)))
    where = "HostRuntime (CPU stand-in)" if args.device == "host" else "the GPU (counted columns need HostRuntime)"
    print(f"copies per batch (count/KiB), batch {args.batch}, {args.batches} batches per row, CUDA workers on {where}")
    print(f"{'plan':<22} {'workers':<8} {'h2d counted':>14} {'h2d predicted':>14} {'d2h counted':>14} "
          f"{'d2h predicted':>14} {'d2d (in GPU)':>14} {'equal':>6}")
    two_part: list[tuple[str, Plan, dict[str, np.ndarray]]] = []
    for name, path, given, shares, shapes in models:
        cut = {"profile_runs": 1, "costs": "estimate", **({"input_shapes": shapes} if shapes else {})}
        one = partition(str(path), spec=PartitionSpec(parts=1, **cut), output_dir=tmp / name / "p1")
        two = partition(str(path), shares, PartitionSpec(**cut), output_dir=tmp / name / "p2")
        feeds = given if given is not None else random_plan_feeds(one, args.batch, seed=0)
        nbytes = tensor_bytes(one, feeds)
        model_in = sum(nbytes[n] for n in one.input_names)
        model_out = sum(nbytes[n] for n in one.output_names)
        for label, plan in ((f"{name} 1 part", one), (f"{name} 2 parts", two)):
            for config in ("gpu", "gpu+cpu"):
                row = count_row(label, plan, config, feeds, args, tmp / "home" / f"{label}-{config}")
                print(show(row, args.batches, model_in, model_out), flush=True)
        two_part.append((name, two, feeds))
    if not args.skip_open_loop:
        print(f"steady open loop at {args.load:g} of the closed-loop rate, {args.seconds:g} s, 2-part plans, GPU+CPU")
        for name, plan, feeds in two_part:
            for policy in ("dmda", "heft"):
                print(f"{name:<10} " + open_loop(plan, policy, feeds, args, tmp / "home" / f"{name}-{policy}"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
