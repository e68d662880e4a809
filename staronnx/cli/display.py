"""How commands show things: results on stdout, progress on stderr for a person watching.

Results go to stdout; bars and spinners go to stderr, so ``staronnx run ... > out.txt`` keeps
a clean file and a pipeline never sees control codes. They show only when stderr is a
terminal and ``--quiet`` was not given; they vanish when done (``transient``), leaving the
results alone on screen.

Tables never cut a name: name columns fold (wrap inside the name) on a narrow terminal, and
output that goes to a file or a pipe, which has no width of its own, is laid out
:data:`PIPE_WIDTH` wide instead of rich's 80 columns (``COLUMNS`` still wins when set).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Container, Iterable, Iterator

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

#: the width of output to a file or a pipe (where no terminal gives one)
PIPE_WIDTH = 200

#: the help text of every command's ``--quiet``
QUIET_HELP = "No progress display (it is also off when stderr is not a terminal)."


def output_console() -> Console:
    """The console results are printed on (stdout)."""
    piped = not sys.stdout.isatty() and not os.environ.get("COLUMNS", "").isdigit()
    return Console(width=PIPE_WIDTH if piped else None)


def table_of(title: str, columns: Iterable[str], *, left: Container[str] | None = None, fold: bool = False) -> Table:
    """A table of ``columns`` under ``title``, left-justified, or with ``left`` only those in it
    (the others, figures, right-justified); ``fold``: a cell too wide wraps inside its column."""
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if left is None or col in left else "right",
                         overflow="fold" if fold else "ellipsis")
    return table


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


def above(progress: Progress, console: Console) -> Console:
    """The console to print a result on while ``progress`` may be drawn.

    A live bar redraws its lines in place: a line printed on another console (results go to
    stdout, the bar to stderr) lands after the bar's last line on a shared terminal and is
    then half erased by the next redraw. While the bar is live and stdout is that terminal too,
    results go through the bar's own console instead, which prints them above the bar and
    redraws it below, both whole. Otherwise (stdout a file or a pipe, no bar) ``console``.
    """
    if progress.live.is_started and progress.console.is_terminal and console.is_terminal:
        return progress.console
    return console


def warn(message: str) -> None:
    """One warning line on stderr, worded as staronnx's warnings are (``staronnx: warning: ...``)."""
    print(f"staronnx: warning: {message}", file=sys.stderr)


@contextlib.contextmanager
def partition_warnings() -> Iterator[None]:
    """Partition's warnings in the command line's words (``--parts 1``, not ``parts=1``), each
    printed once the block ends (after its spinner, never through it); other warnings as usual."""
    from staronnx.partition.checks import PartitionWarning

    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PartitionWarning)
            yield
    finally:
        for w in caught:
            if isinstance(w.message, PartitionWarning):
                warn(w.message.cli)
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
