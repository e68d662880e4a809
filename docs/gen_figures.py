"""The documentation's figures, made from a small real run (``make docs`` runs this first).

What it runs, in a scratch folder with a private ``$STARONNX_HOME`` (nothing of the user's is
read or written), through the same ``staronnx`` commands the guides show:

1. ``staronnx partition`` googlenet 85/15 (``models/googlenet.onnx`` of the repository, else the
   demo's Inception-style model built in code);
2. ``staronnx calibrate`` at batch 1, 2, 4 and 8 on two one-core CPU groups;
3. ``staronnx perfmodel show --plot`` -> ``perfmodel.png``;
4. ``staronnx run --trace`` then ``staronnx trace plot`` -> ``gantt.png``;
5. ``staronnx sweep`` at a few rates, batch 1 and 4 -> ``sweep.png`` (the sweep's own figure,
   redrawn from its ``results.json`` by :func:`staronnx.bench.plots.figure_latency_throughput`
   with the legend moved beside the axes, off the data);
6. the plan itself drawn from ``plan.json`` -> ``plan.png`` (parts sized by cost share, the
   tensors that cross between them).

It takes about a minute on a 2-core machine. ``--if-missing`` does nothing when every figure is
there already (the documentation build's hook calls it that way, so a fresh clone builds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).resolve().parent / "figures"
FIGURES = ("plan.png", "perfmodel.png", "gantt.png", "sweep.png")


def find_model() -> Path | None:
    """googlenet from the repository's ``models/``; None where a checkout lacks it (the caller
    then builds the demo's model). Nothing outside the repository is read."""
    model = ROOT / "models" / "googlenet.onnx"
    return model if model.is_file() else None


def staronnx(*args: str, cwd: Path, env: dict[str, str]) -> None:
    """Run one ``staronnx`` command as a user would; its output goes to this script's stderr."""
    cmd = [str(Path(sys.executable).parent / "staronnx"), *args]
    print("+ staronnx " + " ".join(args), file=sys.stderr, flush=True)
    subprocess.run(cmd, cwd=cwd, env=env, check=True, stdout=sys.stderr)


def two_groups() -> str:
    """Two one-PU CPU groups (two workers even on a 2-core machine)."""
    pus = sorted(os.sched_getaffinity(0))
    return f"{pus[0]};{pus[-1]}" if len(pus) > 1 else str(pus[0])


def legend_outside(fig: Any) -> None:
    """Move every axes' legend beside the axes, on the right, so that it hides no point."""
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        handles = legend.legend_handles
        labels = [t.get_text() for t in legend.get_texts()]
        title = legend.get_title().get_text()
        legend.remove()
        ax.legend(handles, labels, title=title, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                  borderaxespad=0.0, fontsize=9, title_fontsize=9)


def draw_sweep(results: Path, out: Path) -> None:
    """The sweep's latency-throughput figure, legend outside the data."""
    from staronnx.bench.plots import figure_latency_throughput
    from staronnx.bench.results import load_rows

    fig, _ = figure_latency_throughput(load_rows(results.parent))
    fig.set_size_inches(9, 5)
    legend_outside(fig)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def draw_plan(plan_dir: Path, out: Path) -> None:
    """A plan as boxes (one per part, its width its cost share) and the tensors between them."""
    plan = json.loads((plan_dir / "plan.json").read_text())
    parts = plan["parts"]
    fig, ax = plt.subplots(figsize=(10, 3.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    x, gap, lefts = 0.12, 0.1, []
    span = 1.0 - 2 * 0.12 - gap * (len(parts) - 1)
    for part in parts:
        width = max(span * part["share"], 0.17)
        lefts.append((x, width))
        x += width + gap
    scale = (1.0 - 0.12) / x if x > 1.0 - 0.12 else 1.0
    lefts = [(0.12 + (lx - 0.12) * scale, w * scale) for lx, w in lefts]
    for (left, width), part, color in zip(lefts, parts, colors, strict=False):
        ax.add_patch(Rectangle((left, 0.3), width, 0.4, color=color, alpha=0.85))
        top_ops = ", ".join(f"{op} {n}" for op, n in sorted(part["op_counts"].items(), key=lambda kv: -kv[1])[:3])
        ax.text(left + width / 2, 0.5, f"part {part['index']}\n{part['share']:.0%}",
                ha="center", va="center", fontsize=10, color="white", weight="bold")
        ax.text(left + width / 2, 0.24, f"{part['nodes']} nodes: {top_ops}", ha="center", va="top", fontsize=8)
    first_left = lefts[0][0]
    ax.annotate("", xy=(first_left, 0.5), xytext=(0.01, 0.5), arrowprops={"arrowstyle": "->"})
    ax.text(0.0, 0.56, "inputs:\n" + "\n".join(i["name"] for i in plan["inputs"]), fontsize=8, va="bottom")
    last_left, last_width = lefts[-1]
    ax.annotate("", xy=(min(last_left + last_width + 0.1, 0.995), 0.5), xytext=(last_left + last_width, 0.5),
                arrowprops={"arrowstyle": "->"})
    ax.text(min(last_left + last_width + 0.02, 0.9), 0.56,
            "outputs:\n" + "\n".join(o["name"] for o in plan["outputs"]), fontsize=8, va="bottom")
    crossing: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for tensor in plan["crossing"]:
        for consumer in tensor["consumers"]:
            crossing.setdefault((tensor["producer"], consumer), []).append(tensor)
    for (src, dst), tensors in sorted(crossing.items()):
        (sl, sw), (dl, _) = lefts[src], lefts[dst]
        ax.annotate("", xy=(dl, 0.62), xytext=(sl + sw, 0.62),
                    arrowprops={"arrowstyle": "->", "lw": 1.5,
                                "connectionstyle": "arc3,rad=-0.3" if dst - src > 1 else "arc3"})
        kib = sum(t["bytes_per_sample"] for t in tensors) / 1024
        ax.text((sl + sw + dl) / 2, 0.74 if dst - src == 1 else 0.9,
                f"{len(tensors)} tensor{'s' * (len(tensors) > 1)}\n{kib:,.0f} KiB a sample",
                ha="center", va="bottom", fontsize=8)
    model = Path(plan["source"].get("path", "model")).name if isinstance(plan.get("source"), dict) else "model"
    ax.set_title(f"plan of {model}: {len(parts)} parts, {plan['cut_bytes_per_sample'] / 1024:,.0f} KiB "
                 f"cross the cut per sample\n(box width: the part's share of the profiled cost; plan.json, hash {plan['hash']})",
                 fontsize=10)
    ax.set_xlim(0, 1)
    ax.set_ylim(0.05, 1.05)
    ax.axis("off")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def make_all(out: Path) -> None:
    """Run everything in a scratch folder and write the figures into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="staronnx-docs-figures-"))
    try:
        env = {**os.environ, "STARONNX_HOME": str(work / "home"), "MPLBACKEND": "Agg", "COLUMNS": "120"}
        model = find_model()
        if model is None:
            from staronnx.zoo import inception
            import onnx

            model = work / "inception.onnx"
            onnx.save(inception(blocks=3, channels=16, size=56), str(model))
        shutil.copy(model, work / "googlenet.onnx") if model.parent != work else None
        groups = two_groups()
        staronnx("partition", "googlenet.onnx", "--shares", "0.85,0.15", "-o", "plan/", cwd=work, env=env)
        draw_plan(work / "plan", out / "plan.png")
        staronnx("calibrate", "plan/", "--batch-sizes", "1,2,4,8", "--groups", groups, cwd=work, env=env)
        staronnx("perfmodel", "show", "plan/", "--groups", groups, "--plot", str(out / "perfmodel.png"),
                 cwd=work, env=env)
        staronnx("run", "plan/", "--batch", "4", "--requests", "24", "--policy", "heft", "--groups", groups,
                 "--trace", "trace.json", cwd=work, env=env)
        staronnx("trace", "plot", "trace.json", "-o", str(out / "gantt.png"), cwd=work, env=env)
        staronnx("sweep", "plan/", "--rates", "20,40,60,80,100,120", "--batch-sizes", "1,4", "--duration", "1s",
                 "--no-extend", "--groups", groups, "-o", "sweep/", cwd=work, env=env)
        draw_sweep(work / "sweep" / "results.json", out / "sweep.png")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder to write the figures into")
    parser.add_argument("--if-missing", action="store_true", help="do nothing when every figure exists")
    args = parser.parse_args()
    if args.if_missing and all((args.out / name).exists() for name in FIGURES):
        return
    make_all(args.out)
    print(f"figures written to {args.out}: {', '.join(FIGURES)}", file=sys.stderr)


if __name__ == "__main__":
    main()
