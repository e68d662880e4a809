"""Drawing a runtime trace as a Gantt chart (one row per worker, one bar per task).

What a person must be able to read off it, on a sweep's trace of 17 points as on one run's:

- **which point a task belongs to**: a sweep's trace marks its points on a "sweep points" lane
  (``b=1 @ 20 req/s``); each task takes its point's colour, the points in numeric order (batch
  size, then rate, then a repeated attempt), each its own colour. A trace without points colours
  tasks by part. Parts are told apart by hatching (part 0 plain, part 1 hatched, ...);
- **the legend** beside the plot, never over the tasks;
- **the workers**: each lane's whole name (``cpu:numa0.core1``), the margin sized to the longest;
- **live against simulated**: a sweep run with ``--simulate`` writes its simulated schedule
  beside its trace (``T.json`` and ``T.sim.json``, on one clock); given one, the other is drawn
  too (``compare``), each worker's live row above its simulated one, on one time axis, so a
  person sees where they part.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from staronnx.errors import StaronnxError
from staronnx.fsutil import save_figure

#: a sweep point's label: ``b=4 @ 120 req/s``, maybe `` (again)`` or `` (simulated)``
_POINT = re.compile(r"^b=(\d+) @ ([0-9.eE+-]+) req/s")
#: hatches of parts 0, 1, 2, ... (part 0 plain)
HATCHES = ("", "////", "xxx", "...", "\\\\\\\\", "++", "oo")
#: how far apart (us) a simulated point's start and its live attempt's may be
TWIN_US = 100_000
#: the colour of a task that falls in no point (warm-up, between points)
OUTSIDE = "#b0b0b0"


@dataclass
class Lane:
    """One row of the chart."""

    label: str
    tasks: list[dict[str, Any]] = field(default_factory=list)
    points: list[dict[str, Any]] = field(default_factory=list)  # sweep point spans on this row


@dataclass
class GanttInfo:
    """What a chart shows (for tests and callers): rows top to bottom, point labels in legend
    order with their colours, part names, task count."""

    rows: list[str]
    points: list[str]
    colours: dict[str, Any]
    parts: list[str]
    tasks: int


def _read(trace: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(Path(trace).read_text())
        events = data["traceEvents"] if isinstance(data, dict) else data
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StaronnxError(f"{trace} is not a readable trace: {exc}") from None
    if not isinstance(events, list):
        raise StaronnxError(f"{trace} is not a readable trace: no event list")
    return [e for e in events if isinstance(e, dict)]


def point_key(label: str) -> tuple[float, float, int, str]:
    """Numeric order of a point's label: batch size, rate, then attempts (``(again)`` after),
    then the text (anything that is not a sweep point last)."""
    m = _POINT.match(label)
    if not m:
        return (math.inf, math.inf, 0, label)
    return (float(m.group(1)), float(m.group(2)), 1 if "(again)" in label else 0, label)


def _point_name(label: str) -> str:
    """A point's label without `` (simulated)``: a live point and its twin share a colour."""
    return label.replace(" (simulated)", "")


def _lanes(events: list[dict[str, Any]], suffix: str) -> tuple[dict[int, Lane], list[dict[str, Any]]]:
    """Worker lanes by thread id (named from the metadata), and the sweep points' spans."""
    names = {e["tid"]: str(e["args"]["name"]) for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and "tid" in e}
    lanes: dict[int, Lane] = {}
    points = []
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        if e.get("cat") == "sweep point":
            points.append(e)
            continue
        tid = e.get("tid", 0)
        lane = lanes.get(tid)
        if lane is None:
            lane = lanes[tid] = Lane(names.get(tid, str(tid)) + suffix)
        lane.tasks.append(e)
    for tid in names:  # a named worker with no task still gets its row
        if tid not in lanes and not any(p.get("tid") == tid for p in points):
            lanes[tid] = Lane(names[tid] + suffix)
    return dict(sorted(lanes.items())), points


def _palette(n: int) -> list[Any]:
    """``n`` colours as far apart as matplotlib's qualitative maps allow (tab10, tab20, then
    a sampled rainbow), none grey (grey is for tasks outside every point)."""
    import matplotlib

    if n <= 9:  # tab10 without its grey
        cmap = matplotlib.colormaps["tab10"]
        return [cmap(i) for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)][:n]
    if n <= 18:  # tab20's nine strong hues first, then their light twins (no grey)
        cmap = matplotlib.colormaps["tab20"]
        order = [i for i in range(0, 20, 2) if i != 14] + [i for i in range(1, 20, 2) if i != 15]
        return [cmap(i) for i in order][:n]
    cmap = matplotlib.colormaps["turbo"]
    return [cmap(0.05 + 0.9 * i / (n - 1)) for i in range(n)]


def gantt_figure(trace: str | Path, title: str = "", compare: str | Path | None = None) -> tuple[Any, GanttInfo]:
    """The chart of ``trace`` (and of ``compare``, its simulated or live twin, row by row) as a
    matplotlib figure, with what it shows (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = _read(Path(trace))
    twin = _read(Path(compare)) if compare is not None else None
    live_tag, twin_tag = (" (live)", " (sim)") if twin is not None else ("", "")
    if twin is not None and _is_simulated(Path(trace)):
        live_tag, twin_tag = " (sim)", " (live)"
    lanes, points = _lanes(events, live_tag)
    twin_lanes, twin_points = _lanes(twin, twin_tag) if twin is not None else ({}, [])
    if not any(lane.tasks for lane in [*lanes.values(), *twin_lanes.values()]):
        raise StaronnxError(f"{trace} holds no task events")
    # rows, top to bottom: the points' lane, then each worker (live above its simulated twin)
    rows: list[Lane] = []
    if points or twin_points:
        rows.append(Lane("sweep points", points=[*points, *twin_points]))
    for tid in sorted(set(lanes) | set(twin_lanes)):
        rows.extend(lane for lane in (lanes.get(tid), twin_lanes.get(tid)) if lane is not None)
    # a simulated point is the twin of the live attempt that began with it (its arrivals start
    # a few ms after the span's): same name, same colour
    live = [p for p in [*points, *twin_points] if "(simulated)" not in p["name"]]
    for p in [*points, *twin_points]:
        if "(simulated)" in p["name"] and live:
            near = min(live, key=lambda q: abs(q["ts"] - p["ts"]))
            if abs(near["ts"] - p["ts"]) <= TWIN_US:
                p["name"] = near["name"] + " (simulated)"
    spans = sorted({_point_name(p["name"]) for p in [*points, *twin_points]}, key=point_key)
    colour = dict(zip(spans, _palette(len(spans))))
    tasks = [t for lane in rows for t in lane.tasks]
    parts = sorted({t["name"] for t in tasks if t.get("cat", "task") == "task"}, key=_part_key)
    by_part = dict(zip(parts, _palette(len(parts)))) if not spans else {}
    hatch = {p: HATCHES[i % len(HATCHES)] for i, p in enumerate(parts)} if spans else {}
    windows = sorted(((p["ts"], p["ts"] + p["dur"], _point_name(p["name"])) for p in [*points, *twin_points]),
                     key=lambda w: w[0])

    def task_colour(t: dict[str, Any]) -> Any:
        if not spans:
            return by_part.get(t["name"], OUTSIDE)  # (a transfer: grey)
        for start, end, name in windows:
            if start <= t["ts"] <= end:
                return colour[name]
        return OUTSIDE

    longest = max(len(lane.label) for lane in rows)
    entries = len(spans) + len(hatch) if spans else len(parts)
    label_w = 0.3 + 0.075 * longest  # inches for the row labels at 9 pt
    legend_title = "points (colour), parts (hatching)" if spans else "parts"
    legend_w = 0.5 + 0.072 * max([len(s) + 5 for s in spans] + [len(p) + 5 for p in parts] + [len(legend_title)])
    legend_cols = 1 if entries <= 24 else 2
    plot_w = 10.0
    width = label_w + plot_w + legend_w * legend_cols
    height = max(1.6 + 0.45 * len(rows), 0.9 + 0.19 * min(entries, 48) / legend_cols)
    fig, ax = plt.subplots(figsize=(width, height))
    fig.subplots_adjust(left=label_w / width, right=(label_w + plot_w) / width, top=1 - 0.55 / height,
                        bottom=0.6 / height)
    scale, unit = _time_unit([*tasks, *points, *twin_points])
    for y, lane in enumerate(reversed(rows)):
        for t in lane.tasks:
            failed = bool((t.get("args") or {}).get("failed"))
            face = task_colour(t)
            hatched = hatch.get(t["name"], "")
            ax.broken_barh([(t["ts"] / scale, max(t.get("dur", 0), 1) / scale)], (y - 0.38, 0.76),
                           facecolors=face, hatch=hatched,  # the hatch is drawn in the edge colour
                           edgecolors="red" if failed else (_darker(face) if hatched else "none"),
                           linewidth=0.8 if failed else 0.0)
        for p in lane.points:
            simulated = "(simulated)" in p["name"]
            ax.broken_barh([(p["ts"] / scale, p["dur"] / scale)], (y - 0.38 if simulated else y, 0.38),
                           facecolors=colour[_point_name(p["name"])], edgecolors="white", linewidth=0.5)
    ax.set_yticks(range(len(rows)), [lane.label for lane in reversed(rows)], fontsize=9)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(True, axis="x", alpha=0.3)
    n_tasks = len(tasks)
    ax.set_title(title or (f"{Path(trace).name}: {n_tasks} tasks"
                           + (f", with {Path(compare).name}" if compare is not None else "")), fontsize=10)
    if spans:
        handles = [Patch(facecolor=colour[s], label=s) for s in spans]
        handles += [Patch(facecolor="white", edgecolor="dimgrey", hatch=hatch[p], label=p) for p in parts]
        if any(task_colour(t) == OUTSIDE for t in tasks):
            handles.append(Patch(facecolor=OUTSIDE, label="outside the points"))
    else:
        handles = [Patch(facecolor=by_part[p], label=p) for p in parts]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8,
              title=legend_title, title_fontsize=8, ncol=legend_cols, frameon=False)
    info = GanttInfo([lane.label for lane in rows], spans, colour if spans else by_part, parts, n_tasks)
    return fig, info


def _darker(colour: Any, by: float = 0.55) -> tuple[float, float, float]:
    """``colour`` darkened (a hatch in it reads on its own face)."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(colour)
    return (r * by, g * by, b * by)


def _part_key(name: str) -> tuple[str, int, str]:
    """``part2`` before ``part10``; ``model/part1`` by model then number."""
    m = re.match(r"^(.*?)(\d+)$", name)
    return (m.group(1), int(m.group(2)), name) if m else (name, -1, name)


def _time_unit(events: list[dict[str, Any]]) -> tuple[float, str]:
    """(microseconds per unit, unit name): seconds past 10 s of trace, else ms."""
    end = max((e["ts"] + e.get("dur", 0) for e in events), default=0.0)
    return (1e6, "s") if end > 10e6 else (1e3, "ms")


def _is_simulated(path: Path) -> bool:
    return path.name.endswith(".sim.json") or path.stem.endswith(".sim")


def twin_of(trace: str | Path) -> Path | None:
    """The other half of a sweep's pair beside ``trace`` (``T.json`` <-> ``T.sim.json``), when
    it exists."""
    path = Path(trace)
    if _is_simulated(path):
        other = path.with_name(path.name[: -len(".sim.json")] + ".json") if path.name.endswith(".sim.json") else None
    else:
        other = path.with_name(f"{path.stem}.sim{path.suffix or '.json'}")
    return other if other is not None and other.is_file() else None


def plot_trace(trace: Path, out: Path, title: str = "", compare: Path | None = None, twin: bool = True) -> Path:
    """Read a Chrome/Perfetto trace written by the runtime and draw its tasks per worker
    (:func:`gantt_figure`); with ``twin``, a sweep's simulated (or live) twin beside it
    (:func:`twin_of`) is drawn too unless ``compare`` names another trace."""
    if compare is None and twin:
        compare = twin_of(trace)
    fig, _ = gantt_figure(trace, title, compare)
    return save_figure(fig, out, dpi=110)
