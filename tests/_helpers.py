"""Helpers shared by test modules (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations


def cli(capsys, *args: object) -> tuple[int, str, str]:
    """Run the staronnx CLI in-process, as ``staronnx ARGS`` would; return (exit code, stdout,
    stderr).  ``capsys`` is the calling test's fixture."""
    from staronnx.cli import main

    capsys.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err
