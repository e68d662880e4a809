"""The GPU table (Markdown) from a results JSON that ``benchmarks/gpu.py`` wrote (issue 48, item 5).

Nothing in the table is typed by hand: the README's and the documentation's GPU figures are this
script's output over a committed ``benchmarks/results/gpu-*.json`` (the documentation build
calls :func:`render` on the newest one). Per row: staronnx's better setup and plain ONNX
Runtime's better setup at the same number of requests in flight K, each as median [min-max]
samples/s over its repeats, their ratio, which is *claimed* only where the two ranges do not
overlap (else it is shown as "~", not claimed); the CPU-help setups against the GPU alone;
batch-1 latency against ``ort-tuned1``.

This module imports nothing heavy (the documentation build runs it), and the verdict rules
:func:`verdict` and :func:`headline` are the ones ``gpu.py`` prints and checks with.

Usage: python benchmarks/gpu_table.py benchmarks/results/gpu-h100-2026-12-08.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SCHEMA = "staronnx-gpu-table/1"
#: staronnx's GPU-alone setups (4 and 8 streams, CUDA graphs)
STARONNX_GPU = ("staronnx-s4", "staronnx-s8")
#: what the CPU-help setups are weighed against: the GPU alone with their 4 streams
GPU_ALONE = "staronnx-s4"


def best(row: dict[str, Any], prefix: tuple[str, ...]) -> tuple[str, dict[str, Any]] | None:
    """The setup whose label starts with one of ``prefix`` with the highest median."""
    found = [(label, f) for label, f in row["figures"].items() if label.startswith(prefix)]
    return max(found, key=lambda lf: lf[1]["median"]) if found else None


def verdict(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[float, str]:
    """The ratio of the medians, and what may be said of it: "faster" or "slower" only where the
    min-max ranges do not overlap, else "overlap" (not claimed)."""
    ratio = ours["median"] / theirs["median"]
    if ours["min"] > theirs["max"]:
        return ratio, "faster"
    if ours["max"] < theirs["min"]:
        return ratio, "slower"
    return ratio, "overlap"


def headline(row: dict[str, Any]) -> dict[str, Any] | None:
    """staronnx at K over the best plain ORT at K (``ortN`` and ``ort-tunedN``): the better
    median on each side, the same selection on both."""
    ours, theirs = best(row, STARONNX_GPU), best(row, ("ort",))
    if ours is None or theirs is None:
        return None
    ratio, claim = verdict(ours[1], theirs[1])
    return {"staronnx": ours[0], "ort": theirs[0], "ratio": ratio, "claim": claim}


def _figure(f: dict[str, Any]) -> str:
    return f"{f['median']:,.0f} [{f['min']:,.0f}-{f['max']:,.0f}]"


def _ratio(ratio: float, claim: str) -> str:
    return f"~{ratio:.2f}x (overlap)" if claim == "overlap" else f"**{ratio:.2f}x**"


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | precision | batch | K | staronnx | best plain ORT | staronnx / ORT | gpu+cpu / GPU alone "
             "| auto / GPU alone | batch-1 latency ms (staronnx / ort-tuned1) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        h = headline(r)
        ours = f"{_figure(r['figures'][h['staronnx']])} ({h['staronnx']})" if h else "-"
        theirs = f"{_figure(r['figures'][h['ort']])} ({h['ort']})" if h else "-"
        ratio = _ratio(h["ratio"], h["claim"]) if h else "-"
        alone = r["figures"].get(GPU_ALONE)
        mixed = [_ratio(*verdict(r["figures"][m], alone)) if alone and m in r["figures"] else "-"
                 for m in ("gpu+cpu", "auto")]
        lat = r.get("latency_ms", {})
        latency = (f"{lat[GPU_ALONE]:.2f} / {lat['ort-tuned1']:.2f}" if GPU_ALONE in lat and "ort-tuned1" in lat
                   else "-")
        lines.append(f"| {r['model']} | {r['precision']} | {r['batch']} | {r['k']} | {ours} | {theirs} | {ratio} "
                     f"| {mixed[0]} | {mixed[1]} | {latency} |")
    return lines


def describe(doc: dict[str, Any]) -> str:
    """One sentence: the device, its driver and CUDA, ORT, the commits and dates of the runs."""
    runs = doc.get("runs", [])
    if not runs:
        return "No run recorded."
    last = runs[-1]
    dev = last.get("device", {})
    cuda = dev.get("cuda_runtime")
    cuda_text = f"CUDA runtime {cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else "CUDA runtime ?"
    settings = last.get("settings", {})
    commits = ", ".join(dict.fromkeys(str(r.get("commit", "?"))[:7] for r in runs))
    dates = ", ".join(dict.fromkeys(str(r.get("date", "?"))[:10] for r in runs))
    where = f" (driver {dev.get('driver', '?')}, {cuda_text})" if dev.get("kind") == "cuda" else ""
    return (f"{dev.get('name', '?')}{where}, onnxruntime "
            f"{last.get('onnxruntime', '?')}, {last.get('cpus', '?')} host cores; {len(runs)} run(s) on {dates}, "
            f"commit(s) {commits}; each figure the median of {settings.get('repeats', '?')} alternated repeats of "
            f"{settings.get('seconds', '?')} s, samples/s [min-max].")


def render(doc: dict[str, Any], source: str) -> str:
    """The table of ``doc`` (read from ``source``, named in the text) as Markdown."""
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{source}: not a benchmarks/gpu.py result (schema {doc.get('schema')!r}, want {SCHEMA!r})")
    rows = doc.get("rows", [])
    lines = [f"From `{source}`: {describe(doc)} A ratio in bold is claimed (the two ranges do not overlap); "
             "\"~\" marks one that is not.", ""]
    lines += table(rows) if rows else ["No row measured yet."]
    failed = [text for text, held in doc.get("checks", []) if not held]
    if failed:
        lines += ["", f"Goals missed ({len(failed)}):", ""] + [f"- {text}" for text in failed]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("-o", "--out", type=Path, default=None, help="write the Markdown there (default: print it)")
    args = ap.parse_args(argv)
    try:
        doc = json.loads(args.results.read_text())
        text = render(doc, args.results.as_posix())
        if args.out is None:
            print(text, end="")
        else:
            args.out.write_text(text)
    except (OSError, ValueError) as exc:
        print(f"gpu_table.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
