"""The ``staronnx`` command line.

Each command group lives in its own module and registers itself on :data:`app`; this module
only assembles them and turns :class:`~staronnx.errors.StaronnxError` into one clear line and
exit code 2.
"""

from __future__ import annotations

import importlib
import sys

import typer

from staronnx.errors import StaronnxError
from staronnx.cli.help_format import PlainFlagsGroup

app = typer.Typer(
    name="staronnx",
    help="Run ONNX models on every processor of a server at once.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=PlainFlagsGroup,  # flags' help shows no "<bool>" type
)

# Modules under staronnx.cli that define commands; each exposes register(app).
_COMMAND_MODULES = [
    "partition_cmds",
    "demo_cmd",
    "topology_cmd",
    "perfmodel_cmds",
    "run_cmds",
    "simulate_cmd",
    "sweep_cmds",
]

for _name in _COMMAND_MODULES:
    importlib.import_module(f"staronnx.cli.{_name}").register(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, mapping user errors to exit code 2 with a one-line message."""
    try:
        app(args=argv, prog_name="staronnx")
    except StaronnxError as exc:
        print(f"staronnx: error: {exc.for_cli()}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    except KeyboardInterrupt:
        print("staronnx: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
