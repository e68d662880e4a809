"""The benchmark results page, generated from the files under ``benchmarks/results/``.

Nothing on the page is typed by hand: each committed result file gets a section with its
path, its own metadata (date, device, command, versions: whatever top-level scalars it records)
and its rows as a table (a ``benchmarks/gpu.py`` result as ``benchmarks/gpu_table.py`` renders
it: medians, ranges, the ratios claimed). Figures quoted elsewhere in these pages without such a file are marked
"not reproducible: no artifact" where they appear. ``docs/hooks.py`` calls :func:`render` on
every build; ``python docs/gen_results.py`` prints the page.
"""

from __future__ import annotations

import csv
import html
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_table  # noqa: E402  (the GPU table's one renderer, also the guide's)
PAGE = "benchmarks.md"
#: rows shown per table (the file holds them all)
MAX_ROWS = 40


def _cell(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:,.4g}"
    elif isinstance(value, (dict, list)):
        text = json.dumps(value, separators=(",", ":"))
        text = text if len(text) <= 60 else text[:57] + "..."
    else:
        text = str(value)
    return html.escape(" ".join(text.split()), quote=False).replace("|", "\\|")


def _table(rows: list[dict[str, Any]]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    columns = columns[:14]
    out = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows[:MAX_ROWS]]
    if len(rows) > MAX_ROWS:
        out.append(f"\n{len(rows) - MAX_ROWS} more rows in the file.")
    return out


def _json_section(doc: Any) -> list[str]:
    lines: list[str] = []
    if isinstance(doc, dict):
        meta = {k: v for k, v in doc.items() if not isinstance(v, (dict, list))}
        if meta:
            lines += ["| field | value |", "|---|---|"] + [f"| {_cell(k)} | {_cell(v)} |" for k, v in meta.items()]
            lines.append("")
        for key, value in doc.items():
            if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                lines += [f"**{_cell(key)}**", ""] + _table(value) + [""]
            elif isinstance(value, dict) and value and all(not isinstance(v, (dict, list)) for v in value.values()):
                lines += [f"**{_cell(key)}**", ""] + _table([value]) + [""]
    elif isinstance(doc, list) and doc and all(isinstance(v, dict) for v in doc):
        lines += _table(doc) + [""]
    return lines


def _shown(path: Path) -> str:
    """The path as a reader finds it in the repository (``benchmarks/results/...``)."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()


def section(path: Path) -> list[str]:
    """One result file as Markdown."""
    rel = _shown(path)
    lines = [f"## `{rel}`", ""]
    try:
        if path.suffix == ".json":
            doc = json.loads(path.read_text())
            if isinstance(doc, dict) and doc.get("schema") == gpu_table.SCHEMA:  # benchmarks/gpu.py's table
                lines += [gpu_table.render(doc, rel)]
            else:
                lines += _json_section(doc)
        elif path.suffix == ".csv":
            with path.open(newline="") as f:
                lines += _table(list(csv.DictReader(f))) + [""]
        elif path.suffix in (".md", ".txt"):
            lines += ["```text", path.read_text().rstrip(), "```", ""]
        else:
            lines += [f"A {path.suffix or 'plain'} file of {path.stat().st_size:,} bytes.", ""]
    except (OSError, ValueError) as exc:
        lines += [f"Could not be read: {_cell(exc)}", ""]
    return lines


def result_files(root: Path = RESULTS) -> list[Path]:
    """The committed result files, newest name last (README files left out)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name.lower() != "readme.md"
                  and not p.name.startswith("."))


def render(root: Path = RESULTS) -> str:
    files = result_files(root)
    lines = ["# Benchmark results", "",
             "This page is generated from the files committed under `benchmarks/results/` "
             "(`docs/gen_results.py`, on every documentation build): each file's own metadata and rows, "
             "nothing typed by hand. A benchmark writes such a file when it runs (see "
             "[Development](development.md) for the benchmarks and how to run them).", ""]
    if not files:
        lines += ["!!! note \"No committed results yet\"",
                  "    `benchmarks/results/` holds no result file in this version. Figures quoted in these pages "
                  "without a file here are marked *not reproducible: no artifact*; in particular the "
                  "GPU table of 2026-11-28 (NVIDIA H200) awaits a committed run.", ""]
    else:
        lines += [f"{len(files)} file(s):", ""] + [f"- `{_shown(p)}`" for p in files] + [""]
        for path in files:
            lines += section(path)
    return "\n".join(lines)


if __name__ == "__main__":
    print(render())
