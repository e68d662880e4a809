"""Progress displays for long commands: on stderr, and only for a person watching.

Results go to stdout; bars and spinners go to stderr, so ``staronnx run ... > out.txt`` keeps
a clean file and a pipeline never sees control codes. They show only when stderr is a
terminal and ``--quiet`` was not given; they vanish when done (``transient``), leaving the
results alone on screen.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

#: the help text of every command's ``--quiet``
QUIET_HELP = "No progress display (it is also off when stderr is not a terminal)."


def shown(quiet: bool) -> bool:
    """Whether a progress display should be drawn at all."""
    return not quiet and sys.stderr.isatty()


def _progress(quiet: bool, *columns: ProgressColumn) -> Progress:
    return Progress(*columns, console=Console(stderr=True), transient=True, disable=not shown(quiet))


def bar(quiet: bool) -> Progress:
    """Counted work: description, bar, done/total, elapsed, remaining."""
    return _progress(quiet, TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                     TimeElapsedColumn(), TimeRemainingColumn())


def spinner(quiet: bool) -> Progress:
    """Steps of unknown length: a spinner, the current step, the time it has taken so far."""
    return _progress(quiet, SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
