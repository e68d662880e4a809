"""The papers' pictures from sweep results (PNG, matplotlib's Agg backend: no display needed).

Latency vs throughput per batch size and the best batch size per rate (their Fig. 2a and 2b),
the CPU share, the simulator against the measurement, each model of a mixed sweep, and several
sweep folders overlaid. Congested points are drawn hollow, points measured beside other work
(``machine_busy``) ringed in black. Each ``figure_*`` function returns ``(figure, series)``
with the labels of the curves drawn, so callers (and tests) can tell what went in;
:func:`plot_results` and :func:`compare` write the PNGs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from staronnx.bench.results import best_per_rate, load_results, load_rows
from staronnx.fsutil import save_figure
from staronnx.errors import StaronnxError

Rows = Sequence[Mapping[str, Any]]
LATENCY = "paper_latency_mean_ms"
SPREAD = "paper_latency_std_ms"
RATE = "offered rate (requests/s)"  # the x axis of most figures


class PlotError(StaronnxError, ValueError):
    """Nothing to draw (no rows, no rows with a latency), or inconsistent inputs."""


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else math.nan


def _by_batch(rows: Rows) -> dict[int, list[Mapping[str, Any]]]:
    out: dict[int, list[Mapping[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: (int(r["batch_size"]), float(r["offered_rate"]))):
        out.setdefault(int(r["batch_size"]), []).append(r)
    return out


def _colors(rows: Rows) -> dict[int, str]:
    """One colour per batch size, from every batch size of the sweep: ``b = 4`` is the same
    colour in every figure, whichever batch sizes a figure leaves out (no latency, no share)."""
    sizes = sorted({int(r["batch_size"]) for r in rows})
    return {b: f"C{i % 10}" for i, b in enumerate(sizes)}


def _title(rows: Rows, what: str) -> str:
    first = rows[0] if rows else {}
    gpus = first.get("cuda_devices")
    bits = [f"{first.get('policy')}" if first.get("policy") else "", f"groups {first.get('groups')}"
            if first.get("groups") else "", f"{first.get('cuda_streams')} CUDA stream(s)"
            + (f" on GPUs {gpus}" if gpus and str(gpus) != "0" else "")
            if first.get("cuda_streams") else "", first.get("distribution") or ""]
    extra = ", ".join(b for b in bits if b)
    return f"{what}" + (f"\n({extra})" if extra else "")


#: how a point measured beside other work is marked (``machine_busy``: :mod:`staronnx.bench.cpuload`)
BUSY_MARK: dict[str, Any] = {"marker": "o", "ms": 12, "mfc": "none", "mec": "black", "mew": 1.2, "ls": "none"}
BUSY_LABEL = "measured beside other work"


def _mark_busy(ax: Any, xs: Sequence[float], ys: Sequence[float], pts: Rows) -> bool:
    """Ring the points of ``pts`` measured beside other work; whether any was."""
    busy = [(x, y) for x, y, r in zip(xs, ys, pts, strict=True) if r.get("machine_busy") and math.isfinite(y)]
    if busy:
        ax.plot(*zip(*busy, strict=True), zorder=4, **BUSY_MARK)
    return bool(busy)


def _legend(ax: Any, busy: bool, **kwargs: Any) -> None:
    """The axes' legend, with one entry for the busy ring where a point was ringed."""
    from matplotlib.lines import Line2D

    handles, labels = ax.get_legend_handles_labels()
    if busy:
        handles.append(Line2D([], [], **BUSY_MARK))
        labels.append(BUSY_LABEL)
    ax.legend(handles, labels, **kwargs)


def _need(rows: Rows) -> None:
    if not rows:
        raise PlotError("no sweep rows to plot")


def _some(fig: Figure, series: list[str], nothing: str) -> None:
    """PlotError(``nothing``) when no curve was drawn (``fig`` closed), before any legend."""
    if not series:
        plt.close(fig)
        raise PlotError(nothing)


# ---------------------------------------------------------------------------- figures
def figure_latency_throughput(rows: Rows, *, latency: str = LATENCY, spread: str | None = SPREAD,
                              log_y: bool = True) -> tuple[Figure, list[str]]:
    """Papers' Fig. 2a: latency vs achieved throughput, one curve per batch size."""
    _need(rows)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    series: list[str] = []
    colors = _colors(rows)
    busy = False
    for b, pts in _by_batch(rows).items():
        xs = [_num(r.get("throughput")) for r in pts]
        ys = [_num(r.get(latency)) for r in pts]
        es = [_num(r.get(spread)) if spread else math.nan for r in pts]
        if not any(math.isfinite(y) for y in ys):
            continue
        label = f"b = {b}"
        # asymmetric bars: on a log axis a std larger than the value would dive below zero
        low = [0.0 if not (math.isfinite(e) and math.isfinite(y)) else min(e, 0.9 * y) for e, y in zip(es, ys, strict=True)]
        high = [0.0 if not math.isfinite(e) else e for e in es]
        line = ax.errorbar(xs, ys, yerr=None if spread is None else [low, high],
                           marker="o", ms=4, capsize=2, label=label, color=colors[b])
        color = line[0].get_color()
        hot = [(x, y) for x, y, r in zip(xs, ys, pts, strict=True) if r.get("congested")]
        if hot:
            ax.plot(*zip(*hot, strict=True), "o", ms=8, mfc="white", mec=color, zorder=3)
        busy = _mark_busy(ax, xs, ys, pts) or busy
        series.append(label)
    _some(fig, series, f"no row has a {latency!r} value to plot")
    ax.set(xlabel="achieved throughput (samples/s)", yscale="log" if log_y else "linear",
           ylabel="latency of the first request of a batch (ms)" if latency == LATENCY else latency,
           title=_title(rows, "latency vs throughput per batch size"))
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax, busy, title="batch size (hollow: congested)", fontsize=8)
    fig.tight_layout()
    return fig, series


def figure_best_batch(rows: Rows, *, latency: str = LATENCY) -> tuple[Figure, list[str]]:
    """Papers' Fig. 2b: per offered rate, the best batch size (uncongested) and its latency."""
    _need(rows)
    best = best_per_rate(rows, latency)
    if not best:
        raise PlotError("every point is congested or has no latency: no best batch size to plot")
    rates = list(best)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ax.plot(rates, [best[r][latency] for r in rates], "o-", color="C0", label="latency of the best b")
    for r in rates:
        ax.annotate(f"b={best[r]['batch_size']}", (r, best[r][latency]), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=7)
    ax.set(xlabel=RATE, yscale="log", title=_title(rows, "best batch size per rate"))
    ax.set_ylabel("latency of the first request of a batch (ms)", color="C0")
    ax.grid(True, which="both", alpha=0.3)
    ax2 = ax.twinx()
    ax2.step(rates, [best[r]["batch_size"] for r in rates], where="mid", color="C1", label="best batch size")
    ax2.set_ylabel("best batch size", color="C1")
    sizes = sorted({int(r["batch_size"]) for r in rows})
    ax2.set_yscale("log", base=2)
    ax2.set_yticks(sizes, [str(s) for s in sizes])
    ax2.set_ylim(min(sizes) / 1.5, max(sizes) * 1.5)
    lines = ax.get_lines()[:1] + ax2.get_lines()[:1]
    ax.legend(lines, [str(ln.get_label()) for ln in lines], fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig, ["latency of the best b", "best batch size"]


def figure_cpu_share(rows: Rows) -> tuple[Figure, list[str]]:
    """Share of part-tasks run on CPU workers vs offered rate, one curve per batch size."""
    _need(rows)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    series = []
    colors = _colors(rows)
    for b, pts in _by_batch(rows).items():
        xs = [float(r["offered_rate"]) for r in pts]
        ys = [_num(r.get("cpu_share")) for r in pts]
        if not any(math.isfinite(y) for y in ys):
            continue
        label = f"b = {b}"
        ax.plot(xs, [100 * y for y in ys], "o-", ms=4, label=label, color=colors[b])
        series.append(label)
    _some(fig, series, "no row records a CPU share (placement)")
    # rates from 0: one measured rate (the others congested) is a dot at its rate, not the
    # middle of a 48-52 axis
    ax.set(xlabel=RATE, ylabel="part-tasks run on a CPU (%)", ylim=(-3, 103), title=_title(rows, "CPU share vs rate"),
           xlim=(0, 1.05 * max(float(r["offered_rate"]) for r in rows)))
    shares = [_num(r.get("cpu_share")) for r in rows if math.isfinite(_num(r.get("cpu_share")))]
    if all(v >= 1.0 - 1e-9 for v in shares) and not any(r.get("cuda_streams") for r in rows):
        ax.text(0.5, 0.5, "no CUDA worker: every part-task runs on a CPU", transform=ax.transAxes,
                ha="center", va="center", fontsize=9, color="grey")
    ax.grid(True, alpha=0.3)
    ax.legend(title="batch size", fontsize=8)
    fig.tight_layout()
    return fig, series


def figure_simulator(rows: Rows) -> tuple[Figure, list[str]]:
    """Simulated vs measured throughput and p50 latency per offered rate, one colour per batch size;
    where the sweep simulated a band (:func:`~staronnx.bench.fidelity.band_columns`), the p50
    between its fast and slow ends shaded: how far the machine's drift moves each point."""
    _need(rows)
    simulated = [r for r in rows if "sim_throughput" in r]
    if not simulated:
        raise PlotError("no simulated points (sweep with simulate=True / --simulate)")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    series: list[str] = []
    colors = _colors(rows)
    busy = False
    for b, pts in _by_batch(simulated).items():
        xs = [_num(r.get("offered_rate")) for r in pts]
        color = colors[b]
        measured = [_num(r.get("throughput")) for r in pts]
        left.plot(xs, measured, "o-", ms=4, color=color, label=f"b = {b} measured")
        left.plot(xs, [_num(r.get("sim_throughput")) for r in pts], "x--", color=color, label=f"b = {b} simulated")
        p50 = [_num(r.get("latency_p50_ms")) for r in pts]
        right.plot(xs, p50, "o-", ms=4, color=color)
        right.plot(xs, [_num(r.get("sim_latency_p50_ms")) for r in pts], "x--", color=color)
        if any("sim_fragile" in r for r in pts):  # the band: the tasks that much faster .. slower
            right.fill_between(xs, [_num(r.get("sim_latency_p50_fast_ms")) for r in pts],
                               [_num(r.get("sim_latency_p50_slow_ms")) for r in pts], color=color, alpha=0.15, lw=0)
        busy = _mark_busy(left, xs, measured, pts) | _mark_busy(right, xs, p50, pts) or busy
        series.append(f"b = {b}")
    left.set(xlabel=RATE, ylabel="throughput (samples/s)")
    right.set(xlabel=RATE, ylabel="per-request p50 latency (ms)", yscale="log")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
    banded = [_num(r.get("sim_band")) for r in simulated if "sim_fragile" in r]
    _legend(left, busy, fontsize=7, title_fontsize=7, title="solid: measured, dashed: simulated" + (
        f"\nshaded (right): simulated with the tasks {max(banded):.0%} faster .. slower" if banded else ""))
    fig.suptitle(_title(rows, "simulator vs measurement"))
    fig.tight_layout()
    return fig, series


def figure_compare(results: Sequence[Rows], labels: Sequence[str], *,
                   latency: str = LATENCY) -> tuple[Figure, list[str]]:
    """Several sweeps overlaid: best latency per rate (left), throughput reached per rate (right)."""
    if len(results) != len(labels):
        raise PlotError(f"{len(results)} result sets but {len(labels)} labels")
    if not results:
        raise PlotError("nothing to compare")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    series = []
    for i, (rows, label) in enumerate(zip(results, labels, strict=True)):
        best = best_per_rate(rows, latency)
        color = f"C{i % 10}"  # one colour per sweep on both axes, whether or not it has a best point
        if best:
            ax.plot(list(best), [v[latency] for v in best.values()], "o-", ms=4, label=label, color=color)
        top: dict[float, float] = {}
        for r in rows:
            rate, thr = float(r["offered_rate"]), _num(r.get("throughput"))
            if math.isfinite(thr):
                top[rate] = max(top.get(rate, 0.0), thr)
        if top:
            rates = sorted(top)
            ax2.plot(rates, [top[x] for x in rates], "o-", ms=4, label=label, color=color)
        if best or top:
            series.append(label)
    _some(fig, series, "no result set has anything to plot")
    # the offered = achieved diagonal, up to a little above the best throughput reached
    top_thr = max((_num(r.get("throughput")) for rows in results for r in rows
                   if math.isfinite(_num(r.get("throughput")))), default=1.0)
    lim = min(max((float(r["offered_rate"]) for rows in results for r in rows), default=1.0), 1.5 * top_thr)
    ax2.plot([0, lim], [0, lim], ":", color="grey", lw=1, label="offered")
    ax.set(xlabel=RATE, ylabel="best latency of the first request of a batch (ms)", yscale="log",
           title="best batch size's latency per rate")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax2.set(xlabel=RATE, ylabel="highest throughput over batch sizes (samples/s)", title="throughput reached per rate")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig, series


# ---------------------------------------------------------------------------- files
def _rows_of(source: str | os.PathLike[str] | Rows) -> list[Mapping[str, Any]]:
    if isinstance(source, (str, os.PathLike)):
        return [*load_rows(source)]
    return list(source)


def plot_results(source: str | os.PathLike[str] | Rows, out_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Draw the sweep figures of a result folder (or rows) into ``out_dir`` (default: that
    folder); a figure with nothing to show (every point congested, no placement recorded) is
    left out rather than failing the others. A mixed sweep draws ``models.png``, then the
    figures over each model's own rows (``latency_throughput_<model>.png``, ...; no best batch:
    one row per mix)."""
    rows = _rows_of(source)
    if out_dir is None:
        if not isinstance(source, (str, os.PathLike)):
            raise PlotError("give out_dir when plotting rows")
        out_dir = source
    out = Path(out_dir)
    # one model is a set of one: a mixed sweep draws models.png, then the same figures per model
    mixed = any("model" in r for r in rows)
    written = [save_figure(figure_models(rows)[0], out / "models.png")] if mixed else []
    per_model = ({n: [r for r in rows if r["model"] == n] for n in dict.fromkeys(str(r["model"]) for r in rows)}
                 if mixed else {"": rows})
    for name, mine in per_model.items():
        for stem, build in (("latency_throughput", figure_latency_throughput), ("best_batch", figure_best_batch),
                            ("cpu_share", figure_cpu_share), ("simulator", figure_simulator)):
            if mixed and stem == "best_batch":  # one row per mix: no best batch per rate to tell
                continue
            try:
                fig, _ = build(mine)
            except PlotError:
                if stem == "latency_throughput" and not mixed:
                    raise
                continue
            written.append(save_figure(fig, out / (f"{stem}_{name}.png" if mixed else f"{stem}.png")))
    return written


def figure_models(rows: Rows) -> tuple[Figure, list[str]]:
    """A mixed sweep (several models on one runtime): per mix (x, in sweep order), each
    model's p50 and p99 latency (log scale; its latency target dotted) and its throughput over
    its offered rate (1: served in full); congested points hollow."""
    _need(rows)
    points = sorted({int(r["point"]) for r in rows})
    labels = {int(r["point"]): str(r.get("mix")) for r in rows}
    models = list(dict.fromkeys(str(r["model"]) for r in rows))
    fig, (lat, thr) = plt.subplots(2, 1, figsize=(max(7.0, 1.1 * len(points) + 3), 8), sharex=True)
    series = []
    for i, name in enumerate(models):
        mine = sorted((r for r in rows if r["model"] == name), key=lambda r: int(r["point"]))
        xs = [points.index(int(r["point"])) for r in mine]
        color = f"C{i % 10}"
        for key, style in (("latency_p99_ms", "-"), ("latency_p50_ms", "--")):
            lat.plot(xs, [_num(r.get(key)) for r in mine], style, color=color,
                     label=f"{name} {key.split('_')[1]}")
        for x, r in zip(xs, mine):
            hollow = bool(r.get("congested"))
            lat.plot([x], [_num(r.get("latency_p99_ms"))], "o", color=color,
                     markerfacecolor="none" if hollow else color)
        target = next((r.get("latency_target_ms") for r in mine if r.get("latency_target_ms") is not None), None)
        if target is not None:
            lat.axhline(float(target), color=color, linestyle=":", label=f"{name} target")
        thr.plot(xs, [_num(r.get("throughput")) / _num(r.get("offered_rate")) if _num(r.get("offered_rate")) else math.nan
                      for r in mine], "o-", color=color, label=name)
        series.append(name)
    lat.set(yscale="log", ylabel="latency per request (ms)",
            title=_title(rows, "several models on one runtime: latency per mix"))
    lat.legend(fontsize="small")
    thr.axhline(1.0, color="grey", linewidth=0.8)
    thr.set(ylabel="throughput / offered rate", xlabel="mix (requests/s per model)")
    thr.set_xticks(range(len(points)), [labels[p] for p in points], rotation=30, ha="right", fontsize="small")
    thr.legend(fontsize="small")
    fig.tight_layout()
    return fig, series


def compare(result_dirs: Sequence[str | os.PathLike[str]], labels: Sequence[str] | None = None,
            out: str | os.PathLike[str] = "compare.png") -> Path:
    """Overlay several sweep folders in one PNG (labels default to each sweep's label or folder)."""
    if not result_dirs:
        raise PlotError("give at least one result folder to compare")
    docs = [load_results(d) for d in result_dirs]
    if labels is None:
        labels = [doc.get("settings", {}).get("label") or Path(d).name for doc, d in zip(docs, result_dirs, strict=True)]
    fig, _ = figure_compare([doc["rows"] for doc in docs], list(labels))
    return save_figure(fig, out)
