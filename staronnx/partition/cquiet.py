"""Silencing what C libraries (METIS, HiGHS) print straight to the process's stdout.

METIS writes ``***Cannot bisect a graph with 0 vertices!`` (and the like) with ``printf`` when a
part comes out empty, and HiGHS prints its banner when a solver is made: text on file
descriptor 1, below Python's ``sys.stdout``, which ended up in the middle of ``staronnx
partition``'s output (and would corrupt any machine-readable output). :func:`c_stdout_captured`
points descriptor 1 at a temporary file around the library call only, flushing C's own stdio
buffer before putting it back, and hands back what was written so a failure can be reported in
our own words with the library's reason. Descriptor 1 is the whole process's: what other threads
wrote meanwhile (a server's log lines while a repository model is cut) is written out again
after the block, only the lines the caller names as the library's kept back.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator

_LOCK = threading.Lock()


class Captured:
    """What the library printed while captured (read after the ``with`` block)."""

    text: str = ""


def _flush_c_stdio() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def c_stdout_captured(library: Callable[[str], bool]) -> Iterator[Captured]:
    """Descriptor 1 goes to a temporary file for the block; the lines ``library`` says are the
    library's are ``.text`` after, the others written to descriptor 1 again.

    One block at a time in the process (descriptor 1 is process-wide): concurrent callers wait."""
    captured = Captured()
    with _LOCK:
        try:
            sys.stdout.flush()
        except (AttributeError, ValueError, OSError):
            pass
        try:
            saved = os.dup(1)
        except OSError:  # no descriptor 1 at all: nothing to protect
            yield captured
            return
        sink = tempfile.TemporaryFile()
        try:
            os.dup2(sink.fileno(), 1)
            try:
                yield captured
            finally:
                _flush_c_stdio()
                os.dup2(saved, 1)
                sink.seek(0)
                ours: list[bytes] = []
                others: list[bytes] = []
                for line in sink.read().splitlines(keepends=True):
                    (ours if library(line.decode("utf-8", "replace")) else others).append(line)
                captured.text = b"".join(ours).decode("utf-8", "replace")
                if others:
                    with contextlib.suppress(OSError):
                        os.write(1, b"".join(others))
        finally:
            os.close(saved)
            sink.close()


def library_lines(text: str) -> str:
    """The library's printed lines, stripped of its ``***`` markers, joined into one line."""
    lines = [line.strip().lstrip("*").strip() for line in text.splitlines()]
    return "; ".join(line for line in lines if line)


def metis_line(line: str) -> bool:
    """A line METIS printed: its complaints start with ``***``."""
    return line.lstrip().startswith("***")


def highs_line(line: str) -> bool:
    """A line of HiGHS's banner (``Running HiGHS 1.x ... Copyright ...``, ``Includes third-party
    software components, see THIRD_PARTY_NOTICES.md ...``) or of its log, which ``output_flag``
    turns off once the solver exists."""
    return "HiGHS" in line or "THIRD_PARTY_NOTICES" in line or line.startswith(("Running ", "Copyright (c)"))
