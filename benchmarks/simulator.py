"""Simulator vs measurement on the same points, and the LP throughput bound (issue 5).

Partitions a model (googlenet 85/15 by default), calibrates it on the chosen groups, then runs
a live sweep with ``simulate=True``: every measured (batch size, rate) point is replayed in the
discrete-event simulator from the perf models, same arrivals and window. Prints, per point, the
measured and simulated throughput and p50 latency with the relative error, the aggregate errors
(target within 15 %), the LP bound per batch size and achieved / bound at the saturating rate.

Usage: python benchmarks/simulator.py [--plan DIR] [--rates 10,30,50,70] [--batch-sizes 1,4]
       [--groups cores=1] [--duration 6] [-o results-sim/]
With ``--plan`` an existing plan is used and calibrated in ``$STARONNX_HOME`` unless already.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import GOOGLENET, scratch_dir  # noqa: E402

from staronnx import partition  # noqa: E402
from staronnx.bench.fidelity import TARGET, fidelity_summary  # noqa: E402
from staronnx.bench.results import load_results  # noqa: E402
from staronnx.bench.sweep import sweep  # noqa: E402
from staronnx.cli.sweep_cmds import parse_batch_sizes, parse_rates  # noqa: E402
from staronnx.calibrate import calibrate, start_workers  # noqa: E402
from staronnx.perfmodels import PerfModelStore  # noqa: E402
from staronnx.plan import Plan  # noqa: E402


def _pct(v: float | None) -> str:
    return "     -" if v is None else f"{v:+6.1%}"


def _num(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=GOOGLENET)
    ap.add_argument("--shares", default="0.85,0.15")
    ap.add_argument("--plan", type=Path, default=None, help="use this plan instead of partitioning --model")
    ap.add_argument("--rates", default="10,30,50,70")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--groups", default="cores=1")
    ap.add_argument("--policy", default="heft")
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--min-batches", type=int, default=6)
    ap.add_argument("-o", "--output", type=Path, default=None)
    args = ap.parse_args(argv)
    rates, sizes = parse_rates(args.rates), parse_batch_sizes(args.batch_sizes)
    tmp = scratch_dir("staronnx-bench-sim-")
    if args.plan is not None:
        plan, store = Plan.load(args.plan), PerfModelStore()
    else:
        plan = partition(args.model, [float(x) for x in args.shares.split(",")], output_dir=tmp / "plan")
        store = PerfModelStore(tmp / "home")
    print(f"plan {plan.root}: shares {[round(p.share, 3) for p in plan.parts]}, groups {args.groups}, {args.policy}")
    workers = start_workers(plan, groups=args.groups)
    try:
        calibrate(plan, sizes, workers=workers, store=store)
    finally:
        for w in workers:
            w.close()
    out = args.output or tmp / "sweep"
    rows = sweep(plan, rates, sizes, policy=args.policy, groups=args.groups, duration=args.duration,
                 min_batches=args.min_batches, out_dir=out, store=store, simulate=True,
                 stop_on_congestion=True)
    print(f"\n{'b':>2} {'rate':>5} | {'thr live':>8} {'thr sim':>8} {'err':>6} | {'p50 live':>9} {'p50 sim':>9} "
          f"{'err':>6} | {'paper live':>10} {'paper sim':>9} {'err':>6} | congested live/sim | /bound")
    for r in rows:
        if "sim_throughput" not in r:
            continue
        print(f"{r['batch_size']:>2} {r['offered_rate']:>5g} | {_num(r['throughput']):>8} {_num(r['sim_throughput']):>8} "
              f"{_pct(r['err_throughput'])} | {_num(r['latency_p50_ms']):>9} {_num(r['sim_latency_p50_ms']):>9} "
              f"{_pct(r['err_latency_p50'])} | {_num(r['paper_latency_mean_ms']):>10} "
              f"{_num(r['sim_paper_latency_mean_ms']):>9} {_pct(r['err_paper_latency'])} | "
              f"{'yes' if r['congested'] else 'no':>4}/{'yes' if r['sim_congested'] else 'no':<4}"
              f"{'':9}| {_num(None if r['achieved_over_bound'] is None else 100 * r['achieved_over_bound'], 0)} %")
    f = fidelity_summary(rows)
    print()
    for key, name in (("throughput", "throughput, every point"), ("latency_p50", "p50 latency, steady points"),
                      ("paper_latency", "papers' latency, steady points")):
        st = f[key]
        if st["points"]:
            print(f"{name}: median |error| {st['median_abs']:.1%}, max {st['max_abs']:.1%}, "
                  f"{st['within_target']:.0%} of {st['points']} within {TARGET:.0%}")
    if f["congestion_agreement"] is not None:
        print(f"congestion called alike on {f['congestion_agreement']:.0%} of {f['simulated_points']} points")
    doc = load_results(out)
    for b, bound in sorted(doc["bounds"].items(), key=lambda kv: int(kv[0])):
        mine = [r for r in rows if r["batch_size"] == int(b)]
        top = max(mine, key=lambda r: r["offered_rate"]) if mine else None
        if top is None:
            continue
        ratio = top.get("achieved_over_bound")
        print(f"LP bound b={b}: {bound['throughput']:.1f} samples/s; at {top['offered_rate']:g} req/s "
              f"({'congested' if top['congested'] else 'not congested'}) achieved {top['throughput']:.1f} "
              f"= {ratio:.1%} of the bound" if ratio is not None else "")
    for note in doc["notes"]:
        print(f"note: {note}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
