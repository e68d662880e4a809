"""Helpers shared by test modules (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

from staronnx.serving.server import StandInRuntime


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


class Gated(StandInRuntime):
    """A runtime behind a gate: no batch it is given completes before ``gate`` is set, so a
    test can place callbacks or cancel requests first. ``submit`` returns at once (a server
    may launch a batch on the thread that submits its last request); the batch is submitted
    to the real runtime, and its future handed on, from a thread of its own once the gate
    opens."""

    def __init__(self, runtime) -> None:  # a Runtime
        import threading

        self.plan = runtime.plan
        self.runtime = runtime
        self.gate = threading.Event()

    def submit(self, feeds):
        import threading
        from concurrent.futures import Future

        held: Future = Future()

        def run() -> None:
            self.gate.wait(30)
            try:
                result = self.runtime.submit(feeds).result()
            except BaseException as exc:  # noqa: BLE001 - handed on as the batch's error
                held.set_exception(exc)
            else:
                held.set_result(result)

        threading.Thread(target=run, name="gated-runtime", daemon=True).start()
        return held


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


def warm_worker(worker, batch_sizes, make_feeds, parallel: int = 2) -> list[tuple[int, int, float]]:
    """Warm a CUDA worker used without an engine, as :func:`staronnx.runtime.engine.warm_up`
    warms an engine's (tests/test_cuda_hot_path.py holds that one): on the worker's own thread,
    every part at every batch size in rounds of ``parallel`` tasks launched together (both
    buffer sets a pipelined worker uses), twice, or three times with graphs (discovery, the
    capture, a replay). ``make_feeds(part, batch)``; returns ``(part, batch, compute seconds)``
    of each shape's last task."""
    rounds = 3 if worker.cuda_graphs else 2

    def here():
        timings = []
        for part, path in enumerate(worker.part_paths):
            if path is None:
                continue
            for b in batch_sizes:
                feeds = make_feeds(part, b)
                for _ in range(rounds):
                    for launch in [worker.launch_here(part, feeds, True, None) for _ in range(parallel)]:
                        worker.finish_here(launch)
                timings.append((part, b, worker.last_compute_seconds or 0.0))
        return timings

    return worker.call(here)
