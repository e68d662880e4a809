"""Drawing perf models: time versus batch size per part and architecture."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np

from staronnx.fsutil import save_figure
from staronnx.perfmodels.history import PerfRow


def plot_rows(rows: Sequence[PerfRow], out: Path, title: str = "") -> Path:
    """Measured means (with stddev bars) and the a*n^b+c fit, one line per (part, arch, shape family):
    a family's fit only describes its own footprints, so families are never joined into one line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[tuple[int, str, str], list[PerfRow]] = defaultdict(list)
    for r in rows:
        if r.n > 0:
            series[(r.part, r.arch, r.shape_hash)].append(r)
    families: dict[tuple[int, str], int] = defaultdict(int)
    for part, arch, _ in series:
        families[(part, arch)] += 1
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (part, arch, family), pts in sorted(series.items()):
        pts.sort(key=lambda r: r.batch)
        xs = np.array([r.batch for r in pts])
        ys = np.array([r.mean for r in pts]) * 1e3
        err = np.array([r.stddev for r in pts]) * 1e3
        line = ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3,
                           label=f"part {part} / {arch}" + (f" / shapes {family}" if families[(part, arch)] > 1 else ""))
        reg = pts[0].regression
        if reg is not None and len(xs) > 1:
            grid = np.linspace(xs.min(), xs.max(), 100)
            ax.plot(grid, [reg.predict(x) * 1e3 for x in grid], "--", color=line[0].get_color(),
                    alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("time per task (ms)")
    ax.set_title(title or "perf models: measured mean ± stddev, dashed: a·n^b + c fit")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, out, dpi=120)
