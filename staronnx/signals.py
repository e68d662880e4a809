"""SIGINT and SIGTERM as one exception, so a stopped command cleans up the same way for both.

Python turns SIGINT into :class:`KeyboardInterrupt` but lets SIGTERM (what ``kill``, systemd,
Kubernetes and CI runners send) end the process at once: no ``finally`` runs, so staging
folders, worker threads and half-measured sweeps were left as they were. Inside
:func:`handle_signals` both signals raise :class:`Interrupted` in the main thread instead,
which unwinds every ``finally`` and ``except BaseException`` on its way out. It is not a
:class:`KeyboardInterrupt` on purpose: typer turns those into a silent exit 130, and the
CLI wants to say which signal stopped it and exit ``128 + signum`` (130, 143) as shells do.

A second signal while the first is being handled gets the default behaviour (SIGTERM kills,
SIGINT raises KeyboardInterrupt), so a stuck cleanup can still be stopped.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

#: the signals :func:`handle_signals` turns into :class:`Interrupted`
HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The process was asked to stop by ``signum``; raised in the main thread."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        self.name = signal.Signals(signum).name
        super().__init__(f"interrupted ({self.name})")

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process this signal ended: 128 + the signal number."""
        return 128 + self.signum


def signal_name(exc: BaseException) -> str:
    """The signal behind an interruption: :class:`Interrupted`'s, SIGINT for a plain
    KeyboardInterrupt, else the exception's type (a SystemExit, say)."""
    if isinstance(exc, Interrupted):
        return exc.name
    if isinstance(exc, KeyboardInterrupt):
        return "SIGINT"
    return type(exc).__name__


def _raise(signum: int, _frame: FrameType | None) -> None:
    # the first signal unwinds; the next one of either kind acts as it would without us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    raise Interrupted(signum)


@contextlib.contextmanager
def handle_signals() -> Iterator[None]:
    """Raise :class:`Interrupted` on SIGINT and SIGTERM for the duration of the block (a no-op
    outside the main thread, where handlers cannot be set); the old handlers come back after.
    An ignored signal stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # a signal the parent set to be ignored (``cmd &`` in a script ignores SIGINT) stays ignored
    old = {s: signal.getsignal(s) for s in HANDLED if signal.getsignal(s) is not signal.SIG_IGN}
    for s in old:
        signal.signal(s, _raise)
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
