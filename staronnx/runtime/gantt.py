"""Drawing a runtime trace as a Gantt chart (one row per worker, one bar per task)."""

from __future__ import annotations

import json
from pathlib import Path

from staronnx.errors import StaronnxError
from staronnx.fsutil import save_figure


def plot_trace(trace: Path, out: Path, title: str = "") -> Path:
    """Read a Chrome/Perfetto trace written by the runtime and draw its tasks per worker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        data = json.loads(Path(trace).read_text())
        events = data["traceEvents"] if isinstance(data, dict) else data
    except (OSError, ValueError, KeyError) as exc:
        raise StaronnxError(f"{trace} is not a readable trace: {exc}") from None
    lanes = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    tasks = [e for e in events if e.get("ph") == "X"]
    if not tasks:
        raise StaronnxError(f"{trace} holds no task events")
    parts = sorted({e["name"] for e in tasks})
    cmap = plt.get_cmap("tab10")
    colour = {p: cmap(i % 10) for i, p in enumerate(parts)}
    rows = sorted(lanes) or sorted({e["tid"] for e in tasks})
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.6 * len(rows)))
    for e in tasks:
        y = rows.index(e["tid"]) if e["tid"] in rows else len(rows)
        ax.broken_barh([(e["ts"] / 1e3, max(e["dur"], 1) / 1e3)], (y - 0.4, 0.8),
                       facecolors=colour[e["name"]],
                       edgecolors="red" if e.get("args", {}).get("failed") else "none")
    ax.set_yticks(range(len(rows)), [lanes.get(r, str(r)) for r in rows])
    ax.set_xlabel("time (ms)")
    ax.set_title(title or f"{Path(trace).name}: {len(tasks)} tasks")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[p]) for p in parts]
    ax.legend(handles, parts, loc="upper right", fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, out, dpi=110)
