#!/usr/bin/env python3
"""Choose the batch size for a rate (the same code as ``staronnx optimize-batch``).

    python scripts/optimize_batch.py PLANDIR --rate 300 [--slo-ms 50] [--batch-sizes 1,2,4,8,16]

Simulates every candidate from the calibrated perf models, measures the predicted best and
its neighbours live, prints predicted vs measured. From Python:
:func:`staronnx.bench.optimize.optimize_batch`.
"""

from __future__ import annotations

import sys

import typer

from staronnx.cli.sweep_cmds import optimize_batch_cmd
from staronnx.errors import StaronnxError


def main() -> None:
    try:
        typer.run(optimize_batch_cmd)
    except StaronnxError as exc:
        print(f"optimize-batch: error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


if __name__ == "__main__":
    main()
