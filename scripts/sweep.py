#!/usr/bin/env python3
"""Sweep rates x batch sizes on the live runtime (the same code as ``staronnx sweep``).

    python scripts/sweep.py PLANDIR --rates 50:800:50 --batch-sizes 1,2,4,8,16 -o results/

Options, defaults and output are those of ``staronnx sweep --help``; from Python, call
:func:`staronnx.bench.sweep.sweep` and :func:`staronnx.bench.plots.plot_results` directly.
"""

from __future__ import annotations

import sys

import typer

from staronnx.cli.sweep_cmds import sweep_cmd
from staronnx.errors import StaronnxError


def main() -> None:
    try:
        typer.run(sweep_cmd)
    except StaronnxError as exc:
        print(f"sweep: error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


if __name__ == "__main__":
    main()
