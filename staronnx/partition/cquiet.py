"""Silencing what C libraries (METIS, HiGHS) print straight to the process's stdout.

METIS writes ``***Cannot bisect a graph with 0 vertices!`` (and the like) with ``printf`` when a
part comes out empty, and HiGHS prints its banner when a solver is made: text on file
descriptor 1, below Python's ``sys.stdout``, which ended up in the middle of ``staronnx
partition``'s output (and would corrupt any machine-readable output). :func:`c_stdout_captured`
points descriptor 1 at a temporary file around the library call only, flushing C's own stdio
buffer before putting it back, and hands back what was written so a failure can be reported in
our own words with the library's reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()


class Captured:
    """What the library printed while captured (read after the ``with`` block)."""

    text: str = ""


def _flush_c_stdio() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def c_stdout_captured() -> Iterator[Captured]:
    """Descriptor 1 goes to a temporary file for the block; the text it got is ``.text`` after.

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
                captured.text = sink.read().decode("utf-8", "replace")
        finally:
            os.close(saved)
            sink.close()


def library_lines(text: str) -> str:
    """The library's printed lines, stripped of its ``***`` markers, joined into one line."""
    lines = [line.strip().lstrip("*").strip() for line in text.splitlines()]
    return "; ".join(line for line in lines if line)
