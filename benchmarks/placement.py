"""Every placement method of the field on one runtime, side by side.

For each model and each method (metis and linear with 50/50 shares; comm-sd, duet, overseer,
and optimal, exact over the nodes or over series chains / DUET phases on larger graphs), one plan is cut from the *same* per-device node
costs (profiled once per model on this machine's CPU groups, the two "devices" here), then:

* predicted makespan at batch 1 and 8: the plan's parts as tasks on their device (metis and
  linear: on the device HEFT picks), with transfers and a per-part overhead (the cost model of
  ``staronnx.partition.methods.model``);
* measured latency at batch 1: one request at a time through
  ``Runtime(plan, MachineSpec(GROUPS), RuntimeSpec(policy=...))`` (median): heft for metis and linear (placed
  dynamically), ``static`` for the placement methods (each part on the device its method chose);
* maximum sustainable throughput at batch 8: ``--in-flight`` requests kept in flight through
  the same runtime (samples/s), and for the placement methods also with heft scheduling their
  parts (their cut, without their placement);
* part count and cut bytes per sample.

Plans are calibrated first (perf models at batch 1 and 8, in a private store). Measurements
alternate between methods round by round so machine noise hits them alike. A plain ORT session
on all cores is the reference row. One table, plus a PNG plot (``--plot``).

A placement method's per-part device (``PartSpec.device``) is enforced by the ``static``
policy, so its measured figures are the method's own placement, next to heft's dynamic one.

Usage: python benchmarks/placement.py [MODEL.onnx ...] [--groups cores=1] [--seconds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).parent))
from _common import GOOGLENET, scratch_dir

from staronnx import zoo
from staronnx.calibrate import calibrate, start_workers
from staronnx.errors import StaronnxError
from staronnx.modelio import load_model
from staronnx.partition.api import METHODS
from staronnx.partition.costs import NodeCosts
from staronnx.partition.cut import CutRequest, Parts
from staronnx.partition.export import write_plan
from staronnx.partition.graph import build_graph
from staronnx.partition.host import host_devices, host_transfer
from staronnx.partition.methods.model import predicted_makespan
from staronnx.partition.methods.pipeline import (
    PART_OVERHEAD_US,
    PLACEMENT_METHODS,
    make_context,
    place_context,
)
from staronnx.perfmodels import PerfModelStore
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.verify import random_plan_feeds, verify_plan
from staronnx.workers.topology import Topology
from staronnx.workers.layout import MachineSpec

SHARES_METHODS = ("metis", "linear")
PLACE_METHODS = ("comm-sd", "duet", "overseer", "optimal")


@dataclass
class Row:
    model: str
    method: str
    parts: int = 0
    cut_bytes: int = 0
    devices: str = ""
    pred_b1_ms: float = float("nan")
    pred_b8_ms: float = float("nan")
    lat_b1_ms: float = float("nan")
    thr_b8: float = float("nan")
    thr_b8_heft: float = float("nan")  # a placed plan's parts scheduled by heft instead
    place_s: float = float("nan")
    note: str = ""
    plan: Any = None
    lat_samples: list[float] = field(default_factory=list)
    thr_samples: list[float] = field(default_factory=list)
    heft_samples: list[float] = field(default_factory=list)


def default_models(tmp: Path) -> list[Path]:
    paths = [GOOGLENET] if GOOGLENET.exists() else []
    for name, build in (("multi_head_detector", zoo.multi_head_detector), ("wide_and_deep", zoo.wide_and_deep)):
        path = tmp / f"{name}.onnx"
        onnx.save(build(), str(path))
        paths.append(path)
    return paths


def make_plans(model: Path, args: argparse.Namespace, out: Path) -> list[Row]:
    graph = build_graph(load_model(model))
    name = model.stem
    print(f"\n== {name}: {len(graph)} nodes; profiling on {args.groups} ...", flush=True)
    t0 = time.perf_counter()
    ctx = make_context(graph, PLACEMENT_METHODS["comm-sd"], CutRequest([], devices=host_devices(args.groups),
                                                                         costs=args.costs, profile_runs=args.profile_runs,
                                                                         transfer=host_transfer()))
    print(f"   costs per device in {time.perf_counter() - t0:.1f} s; devices {[d.name for d in ctx.devices]}")
    rows = []
    base_costs = ctx.problem.cost[:, 0]
    for method in args.methods:
        row = Row(name, method)
        t0 = time.perf_counter()
        settings: dict[str, Any] = {"method": method, "benchmark": "placement", "costs": args.costs}
        try:
            if method in SHARES_METHODS:
                targets = np.array([0.5, 0.5])
                ranks = METHODS[method].rank(graph, base_costs, targets, 0, 0.02)
                node_costs = NodeCosts(base_costs, np.ones(len(graph), bool), ctx.devices[0].name, ctx.batch, 0)
                parts = Parts(ranks, node_costs, list(targets))
                pred = {b: predicted_makespan(ctx.problems[b], ranks, None, PART_OVERHEAD_US) for b in (1, 8)}
                placement = None
            else:
                m = PLACEMENT_METHODS[method]
                opts = {"time_limit_s": args.optimal_time} if method == "optimal" else {}
                m.check(ctx.devices, graph, opts)
                ctx.options = opts
                placement = place_context(m, ctx)
                parts = placement.parts(args.profile_runs, args.costs)
                pred = placement.predicted_us
                settings["placement"] = placement.settings()
        except StaronnxError as exc:
            row.note = f"skipped: {str(exc).split(':')[0]}"
            rows.append(row)
            print(f"   {method:9s} {row.note}")
            continue
        row.place_s = time.perf_counter() - t0
        plan = write_plan(graph, parts, settings, out / name / method)
        if placement is not None:
            row.devices = "/".join(sorted({p.device.split(".")[-1] for p in plan.parts if p.device}))
            info = placement.info
            if method == "optimal":
                row.note = f"{info['status']}, gap {info['gap']:.1%}"
                if info.get("coarsened"):
                    row.note += f", over {info['units']} {info['coarsened']}"
            elif method == "comm-sd":
                row.note = f"{info['iterations']} sweeps" + ("" if info["converged"] else " (cap)")
            elif method == "duet":
                row.note = f"{info['subgraphs']} subgraphs, {info['corrections']} corrections"
        else:
            row.devices = "heft"
        if not verify_plan(plan, model).ok:
            raise SystemExit(f"{name}/{method}: the plan does not verify")
        row.plan, row.parts, row.cut_bytes = plan, plan.k, plan.cut_bytes_per_sample
        row.pred_b1_ms, row.pred_b8_ms = pred[1] / 1e3, pred[8] / 1e3
        print(f"   {method:9s} {plan.k:3d} parts, predicted {row.pred_b1_ms:8.2f} / {row.pred_b8_ms:8.2f} ms "
              f"(b1/b8), placed in {row.place_s:.2f} s {row.note}", flush=True)
        rows.append(row)
    return rows


def measure(rows: list[Row], model: Path, args: argparse.Namespace, store: PerfModelStore) -> None:
    live = [r for r in rows if r.plan is not None]
    for r in live:
        workers = start_workers(r.plan, MachineSpec(groups=args.groups))
        try:
            calibrate(r.plan, [1, args.batch], workers=workers, store=store, max_runs=30)
        finally:
            for w in workers:
                w.close()
    def policy_for(plan) -> str:
        return "static" if all(getattr(p, "device", None) for p in plan.parts) else "heft"

    runtimes = {r.method: Runtime(r.plan,
                                  MachineSpec(groups=args.groups),
                                  RuntimeSpec(policy=policy_for(r.plan), store=store))
                for r in live}
    # the same placed plans with heft deciding each part's worker: the cut without the placement
    dynamic = {r.method: Runtime(r.plan, MachineSpec(groups=args.groups), RuntimeSpec(policy="heft", store=store))
               for r in live if policy_for(r.plan) == "static"}
    try:
        plan0 = live[0].plan
        f1 = random_plan_feeds(plan0, 1)
        fb = random_plan_feeds(plan0, args.batch)
        for rt in [*runtimes.values(), *dynamic.values()]:
            rt.run(f1)
            rt.run(fb)
        for _ in range(args.rounds):
            for r in live:
                rt = runtimes[r.method]
                r.lat_samples.append(_latency(rt, f1, args.seconds))
                r.thr_samples.append(_throughput(rt, fb, args.batch, args.in_flight, args.seconds))
                if r.method in dynamic:
                    r.heft_samples.append(_throughput(dynamic[r.method], fb, args.batch, args.in_flight,
                                                      args.seconds))
    finally:
        for rt in [*runtimes.values(), *dynamic.values()]:
            rt.close()
    for r in live:
        r.lat_b1_ms = statistics.median(r.lat_samples) * 1e3
        r.thr_b8 = statistics.median(r.thr_samples)
        if r.heft_samples:
            r.thr_b8_heft = statistics.median(r.heft_samples)


def _latency(rt: Runtime, feeds: dict, seconds: float) -> float:
    samples = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(samples) < 3:
        t = time.perf_counter()
        rt.run(feeds)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def _throughput(rt: Runtime, feeds: dict, batch: int, in_flight: int, seconds: float) -> float:
    window = [rt.submit(feeds) for _ in range(in_flight)]
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        window.pop(0).result()
        done += 1
        window.append(rt.submit(feeds))
    for f in window:
        f.result()
    done += len(window)
    return done * batch / (time.perf_counter() - start)


def ort_reference(model: Path, args: argparse.Namespace, plan: Any) -> Row:
    """One plain ORT session on all cores: latency at batch 1, throughput at batch 8."""
    ncores = len(Topology.from_system().allowed_cores())
    so = ort.SessionOptions()
    so.intra_op_num_threads = ncores
    sess = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
    f1, fb = random_plan_feeds(plan, 1), random_plan_feeds(plan, args.batch)
    sess.run(None, f1)
    sess.run(None, fb)
    row = Row(model.stem, f"ort ({ncores} cores)", parts=1, devices="-", note="reference")
    lat, thr = [], []
    for _ in range(args.rounds):
        samples = []
        end = time.perf_counter() + args.seconds
        while time.perf_counter() < end or len(samples) < 3:
            t = time.perf_counter()
            sess.run(None, f1)
            samples.append(time.perf_counter() - t)
        lat.append(statistics.median(samples))
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            sess.run(None, fb)
            n += args.batch
        thr.append(n / (time.perf_counter() - start))
    row.lat_b1_ms, row.thr_b8 = statistics.median(lat) * 1e3, statistics.median(thr)
    return row


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    head = (f"{'model':20s} {'method':13s} {'parts':>5s} {'cut B/sample':>12s} {'devices':>11s} "
            f"{'pred b1 ms':>10s} {'pred b8 ms':>10s} {'meas b1 ms':>10s} {'thr b8 /s':>9s} {'heft b8 /s':>10s}  note")
    print("\n" + head)
    print("-" * len(head))
    for r in rows:
        def f(x: float, w: int = 10, p: int = 2) -> str:
            return f"{x:{w}.{p}f}" if np.isfinite(x) else f"{'-':>{w}s}"

        print(f"{r.model[:20]:20s} {r.method:13s} {r.parts:5d} {r.cut_bytes:12,d} {r.devices[:11]:>11s} "
              f"{f(r.pred_b1_ms)} {f(r.pred_b8_ms)} {f(r.lat_b1_ms)} {f(r.thr_b8, 9, 1)} {f(r.thr_b8_heft, 10, 1)}  {r.note}")
    print(f"(devices: CPU groups '{args.groups}'; runtime: heft for metis/linear, static (as placed) for the placement methods, "
          f"and 'heft b8': the placement methods' parts scheduled by heft; on the same groups; in flight at "
          f"batch {args.batch}: {args.in_flight}; {args.rounds} alternating rounds of {args.seconds:g} s)")


def plot(rows: list[Row], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(5 * len(models), 7), squeeze=False)
    for j, model in enumerate(models):
        mine = [r for r in rows if r.model == model and (np.isfinite(r.lat_b1_ms) or np.isfinite(r.pred_b1_ms))]
        x = np.arange(len(mine))
        ax = axes[0][j]
        ax.bar(x - 0.2, [r.pred_b1_ms for r in mine], 0.4, label="predicted")
        ax.bar(x + 0.2, [r.lat_b1_ms for r in mine], 0.4, label="measured (as placed)")
        ax.set_title(f"{model}: latency at batch 1")
        ax.set_ylabel("ms")
        ax.set_xticks(x, [r.method for r in mine], rotation=30, ha="right")
        ax.legend(fontsize=8)
        ax = axes[1][j]
        ax.bar(x - 0.2, [r.thr_b8 for r in mine], 0.4, color="tab:green", label="as placed (metis/linear: heft)")
        ax.bar(x + 0.2, [r.thr_b8_heft for r in mine], 0.4, color="tab:olive", label="parts scheduled by heft")
        ax.legend(fontsize=8)
        ax.set_title(f"{model}: max throughput at batch 8")
        ax.set_ylabel("samples/s")
        ax.set_xticks(x, [r.method for r in mine], rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", type=Path, help="ONNX models (default: googlenet + two zoo models)")
    ap.add_argument("--groups", default="cores=1", help="CPU groups: the devices and the runtime's workers")
    ap.add_argument("--costs", default="profile", choices=("profile", "estimate"))
    ap.add_argument("--profile-runs", type=int, default=5)
    ap.add_argument("--methods", default=",".join(SHARES_METHODS + PLACE_METHODS))
    ap.add_argument("--optimal-time", type=float, default=20.0, help="MILP time limit (s)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--plot", type=Path, default=Path("placement.png"))
    args = ap.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    tmp = scratch_dir("staronnx-placement-")
    store = PerfModelStore(tmp / "home")
    models = args.models or default_models(tmp)
    table: list[Row] = []
    for model in models:
        rows = make_plans(model, args, tmp / "plans")
        print(f"   measuring {len([r for r in rows if r.plan])} plans through the runtime ...", flush=True)
        measure(rows, model, args, store)
        first = next(r.plan for r in rows if r.plan is not None)
        table.extend(rows)
        table.append(ort_reference(model, args, first))
    print_table(table, args)
    print(f"plot: {plot(table, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
