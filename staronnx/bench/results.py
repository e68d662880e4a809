"""A sweep's rows and files: one row per measured point, ``results.csv`` and ``results.json``.

The CSV holds the fixed :data:`COLUMNS` (latencies in ms; a mixed sweep's rows, one per point
and model, start with :data:`MIX_COLUMNS`), then the simulator's columns where a row has them,
then one ``share_part<p>_<arch>`` column per part and arch; the JSON holds the same rows with per-window, generator and per-worker detail, the settings, the bounds, the
skipped points and the notes. Both are strict (no NaN) and written atomically, so a sweep can
rewrite them after every point and an interrupted one keeps what it measured.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from staronnx.bench.fidelity import COLUMNS as SIM_COLUMNS
from staronnx.errors import StaronnxError
from staronnx.fsutil import atomic_write_text
from staronnx.serving.metrics import point_state

FORMAT = "staronnx-sweep"
VERSION = 1
RESULTS_CSV = "results.csv"
RESULTS_JSON = "results.json"

#: summarize() keys in seconds, written in milliseconds under ``<key>_ms``
_MS_KEYS = (
    "paper_latency_mean", "paper_latency_std", "paper_latency_p95", "paper_latency_max",
    "latency_mean", "latency_p50", "latency_p90", "latency_p95", "latency_p99", "latency_p999",
    "latency_max",
)
#: the fixed CSV columns, in order; ``share_part<p>_<arch>`` columns follow
COLUMNS = (
    "batch_size", "offered_rate", "achieved_arrival_rate", "throughput",
    *(f"{k}_ms" for k in _MS_KEYS),
    "cpu_share", "state", "congested", "stable", "extended",
    "requests", "completed", "rejected", "failed", "pending", "batches",
    "queue_mean", "queue_max", "backlog_growth",
    "bound_throughput", "achieved_over_bound",
    "duration_s", "warmup_s", "measured_s",
    "policy", "groups", "cuda_streams", "cuda_devices", "distribution", "max_delay_ms", "notes",
    "machine_busy", "others_cpu_share", "steal_share", "own_cpu_cores", "task_time_ratio", "machine_slowed",
)


#: the columns of a mixed sweep (several models on one runtime), written first when present
MIX_COLUMNS = ("model", "mix", "point", "latency_target_ms", "deadline_misses", "deadline_miss_rate",
               "bound_scale", "bound_feasible", "solo_bound_throughput")


class SweepError(StaronnxError, ValueError):
    """A sweep that cannot run as asked (bad rates, batch sizes, durations), or results that
    cannot be read."""


def clean(value: Any) -> Any:
    """JSON-safe: NaN/inf -> None, numpy scalars -> Python, tuples -> lists, recursively."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def clean_dict(value: dict[Any, Any]) -> dict[str, Any]:
    """:func:`clean` of a dict (a row, a result), typed as the dict it returns."""
    return {str(k): clean(v) for k, v in value.items()}


def make_row(summary: Mapping[str, Any], settings: Mapping[str, Any], *, duration: float,
             extended: bool = False, bound: float | None = None) -> dict[str, Any]:
    """One sweep row from a :func:`~staronnx.serving.summarize` result (latencies in ms)."""
    row: dict[str, Any] = {
        "batch_size": int(summary["batch_size"]),
        "offered_rate": float(summary["offered_rate"]),
        "achieved_arrival_rate": summary.get("achieved_arrival_rate"),
        "throughput": summary.get("throughput"),
    }
    for key in _MS_KEYS:
        v = summary.get(key)
        row[f"{key}_ms"] = v * 1e3 if isinstance(v, (int, float)) and math.isfinite(v) else None
    row["cpu_share"] = summary.get("cpu_share")
    row["state"], row["notes"] = summary.get("state"), summary.get("notes") or ""
    if row["state"] is None:  # figures summarized before points had a state
        row["state"], row["notes"] = point_state(dict(summary))  # it reads the figures only
    row.update(congested=bool(summary.get("congested")), stable=bool(summary.get("stable")), extended=bool(extended))
    for key in ("requests", "completed", "rejected", "failed", "pending", "batches", "queue_mean", "queue_max",
                "backlog_growth"):
        row[key] = summary.get(key)
    thr = summary.get("throughput")
    row["bound_throughput"] = bound
    row["achieved_over_bound"] = (
        thr / bound if bound and isinstance(thr, (int, float)) and math.isfinite(thr) and bound > 0 else None)
    row.update(duration_s=duration, warmup_s=summary.get("warmup_s"), measured_s=summary.get("measured_s"))
    row.update({key: settings.get(key) for key in ("policy", "groups", "cuda_streams", "distribution")})
    devices = settings.get("cuda_devices")  # one CSV cell: "0,1"
    row["cuda_devices"] = ",".join(map(str, devices)) if devices and settings.get("cuda_streams") else None
    delay = settings.get("max_delay_s")
    row["max_delay_ms"] = None if delay is None else delay * 1e3
    for part, archs in sorted((summary.get("placement") or {}).items()):
        for arch, frac in sorted(archs.items()):
            row[f"share_{part}_{arch}"] = frac
    return clean_dict(row)


def share_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ``share_part<p>_<arch>`` columns present in any row, sorted by part then arch."""
    cols = {k for r in rows for k in r if k.startswith("share_")}

    def key(c: str) -> tuple[int, str]:
        m = re.match(r"share_part([0-9]+)_(.*)", c)
        return (int(m.group(1)), m.group(2)) if m else (1 << 30, c)

    return sorted(cols, key=key)


def rows_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """CSV text: the fixed :data:`COLUMNS`, the simulator's columns where a row has them, then
    the share columns; empty cells for None."""
    simulated = [c for c in (*SIM_COLUMNS, "sim_deadline_misses") if any(c in r for r in rows)]
    # a mixed sweep's rows are one per (point, model): which model and mix come first
    mixed = list(MIX_COLUMNS) if any("model" in r for r in rows) else []
    columns = [*mixed, *COLUMNS, *simulated, *share_columns(rows)]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({c: _csv_cell(r.get(c)) for c in columns})
    return buf.getvalue()


def _csv_cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def write_results(out_dir: str | os.PathLike[str], rows: Sequence[Mapping[str, Any]], *,
                  settings: Mapping[str, Any] | None = None, bounds: Mapping[Any, Any] | None = None,
                  skipped: Sequence[Mapping[str, Any]] = (), notes: Sequence[str] = (),
                  fidelity: Mapping[str, Any] | None = None) -> tuple[Path, Path]:
    """Write ``results.csv`` and ``results.json`` into ``out_dir``, each atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / RESULTS_CSV, out / RESULTS_JSON
    atomic_write_text(csv_path, rows_csv(rows))
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "settings": clean(dict(settings or {})),
        "bounds": clean({str(k): v for k, v in (bounds or {}).items()}),
        "rows": clean(list(rows)),
        "skipped": clean(list(skipped)),
        "notes": list(notes),
    }
    if fidelity is not None:
        doc["fidelity"] = clean(dict(fidelity))
    atomic_write_text(json_path, json.dumps(doc, indent=1, allow_nan=False) + "\n")
    return csv_path, json_path


def load_results(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A sweep's ``results.json`` (give the folder or the file), checked for its format."""
    p = Path(path)
    if p.is_dir():
        p = p / RESULTS_JSON
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise SweepError(f"no sweep results at {p} (run `staronnx sweep ... -o {p.parent}` first)") from None
    except json.JSONDecodeError as exc:
        raise SweepError(f"{p} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SweepError(f"{p} is not a staronnx sweep result (format {FORMAT!r})")
    return doc


def load_rows(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The measured rows of a sweep folder (or its ``results.json``)."""
    return list(load_results(path)["rows"])


def row_state(row: Mapping[str, Any]) -> str:
    """A row's state (:data:`~staronnx.serving.metrics.STATES`), also for results written before
    rows had one (read off ``failed``, ``congested`` and ``stable``)."""
    state = row.get("state")
    return str(state) if state else point_state(dict(row))[0]


def best_per_rate(rows: Sequence[Mapping[str, Any]], metric: str = "paper_latency_mean_ms",
                  *, include_congested: bool = False) -> dict[float, dict[str, Any]]:
    """Per offered rate, the row with the lowest ``metric`` among uncongested points (a point
    whose requests failed is never the best: its latency is that of the few that got through)."""
    best: dict[float, dict[str, Any]] = {}
    for r in rows:
        v = r.get(metric)
        if v is None or row_state(r) == "failed" or (r.get("congested") and not include_congested):
            continue
        rate = float(r["offered_rate"])
        if rate not in best or v < best[rate][metric]:
            best[rate] = dict(r)
    return dict(sorted(best.items()))
