"""The GPU guide's table, generated from the newest committed GPU result file.

``docs/hooks.py`` puts :func:`render`'s Markdown where :data:`MARKER` stands in
``docs/guides/gpu.md`` on every build: the table is ``benchmarks/gpu_table.py``'s output over
the newest ``benchmarks/results/gpu-*.json`` that ``benchmarks/gpu.py`` wrote, so no GPU figure
on the site is typed by hand. Without such a file it says that none is committed yet.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = "<!-- gpu-table: generated from benchmarks/results/gpu-*.json -->"

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_table  # noqa: E402


def gpu_results(root: Path = RESULTS) -> list[Path]:
    """The committed results of ``benchmarks/gpu.py``, oldest name first (names carry the date)."""
    found = []
    for path in sorted(root.glob("gpu-*.json")) if root.is_dir() else []:
        try:
            if json.loads(path.read_text()).get("schema") == gpu_table.SCHEMA:
                found.append(path)
        except (OSError, ValueError):
            continue
    return found


def render(root: Path = RESULTS) -> str:
    files = gpu_results(root)
    if not files:
        return ("!!! note \"No GPU run committed yet\"\n"
                "    `benchmarks/results/` holds no `gpu-*.json` from `benchmarks/gpu.py` in this version: the table "
                "of record appears here once a run on a lent GPU is committed.\n")
    newest = files[-1]
    shown = newest.relative_to(ROOT).as_posix() if newest.is_relative_to(ROOT) else newest.as_posix()
    return gpu_table.render(json.loads(newest.read_text()), shown)


if __name__ == "__main__":
    print(render())
