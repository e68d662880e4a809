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


class Gated:
    """A runtime behind a gate: the server's batcher is held in ``submit`` until ``gate`` is
    set, so a test can place callbacks or cancel requests before any batch completes."""

    def __init__(self, runtime) -> None:  # a Runtime
        import threading

        self.plan = runtime.plan
        self.runtime = runtime
        self.gate = threading.Event()

    def submit(self, feeds):
        self.gate.wait(30)
        return self.runtime.submit(feeds)


def read_pty(master: int, proc, seconds: float = 300.0, on_output=None) -> bytes:
    """Everything a subprocess writes to the pseudo-terminal ``master`` until it closes it or
    exits (at most ``seconds``); ``on_output(bytes so far)`` is called after each read, so a
    test can act on what appeared (send a signal, say)."""
    import os
    import select
    import time

    raw = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the other end is closed
                break
            if not data:
                break
            raw += data
        elif proc.poll() is not None:
            break
        if on_output is not None:
            on_output(raw)
    return raw
