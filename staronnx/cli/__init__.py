"""The ``staronnx`` command line.

Each command group lives in its own module and registers itself on :data:`app`; this module
only assembles them and turns :class:`~staronnx.errors.StaronnxError` into one clear line and
exit code 2, and SIGINT/SIGTERM into a clean stop: ``finally`` blocks run (staging folders and
workers are cleaned up), one line names the signal, and the exit code is 130 or 143.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import sys
import warnings
from typing import TextIO

import typer

from staronnx.errors import StaronnxError
from staronnx.cli.display import warn
from staronnx.cli.help_format import PlainFlagsGroup
from staronnx.signals import Interrupted, handle_signals

app = typer.Typer(
    name="staronnx",
    help="Run ONNX models on every processor of a server at once.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=PlainFlagsGroup,  # flags' help shows no "<bool>" type
)

# Modules under staronnx.cli that define commands; each exposes register(app).
_COMMAND_MODULES = ["partition_cmds", "demo_cmd", "topology_cmd", "perfmodel_cmds", "run_cmds", "simulate_cmd",
                    "sweep_cmds", "serve_cmd", "infer_cmd"]

#: OS errors that mean "this path cannot be used here", which the user can act on
_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR,
                errno.EISDIR}


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        from staronnx import __version__

        ort = "not installed"
        for dist in ("onnxruntime", "onnxruntime-gpu"):  # the GPU build's name wins when both are
            with contextlib.suppress(PackageNotFoundError):
                ort = version(dist)
        print(f"staronnx {__version__} (onnxruntime {ort}, Python {sys.version.split()[0]})")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print staronnx's version (and ONNX Runtime's) and exit."),
) -> None:
    """Run ONNX models on every processor of a server at once."""


for _name in _COMMAND_MODULES:
    importlib.import_module(f"staronnx.cli.{_name}").register(app)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, mapping user errors to exit code 2 with a one-line message and
    SIGINT/SIGTERM to exit code 128 + signum once everything has been cleaned up."""
    shown = warnings.showwarning

    def one_line(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: TextIO | None = None, line: str | None = None) -> None:
        """staronnx's own warnings read like its errors, one line to act on; other libraries'
        keep Python's form, which says where they come from."""
        if category.__module__.split(".")[0] == "staronnx":
            warn(str(message))
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = one_line
    try:
        with handle_signals():
            app(args=argv, prog_name="staronnx")
    except StaronnxError as exc:
        print(f"staronnx: error: {exc.for_cli()}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    except Interrupted as exc:
        print(f"staronnx: interrupted ({exc.name})", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    except OSError as exc:
        # a path that cannot be written (or read) late in a command, past its own checks: one
        # line naming the path the user gave, not our temporary's name
        if exc.errno not in _PATH_ERRNOS or exc.filename is None:
            raise
        from staronnx.fsutil import written_path

        print(f"staronnx: error: {written_path(exc.filename)}: {exc.strerror or exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # a second Ctrl-C during the first one's cleanup
        print("staronnx: interrupted (SIGINT)", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        warnings.showwarning = shown
