"""The gRPC door's ``--request-timeout`` bookkeeping (:mod:`staronnx.serve.grpc_deadlines`), on a
real event loop: calls past their deadline are withdrawn, one by one as their own deadlines
pass, and calls that end in time are left alone; the door's own answer (DEADLINE_EXCEEDED) is
tested through tritonclient in ``test_serve_hostile.py``."""

from __future__ import annotations

import asyncio

from staronnx.serve.grpc_deadlines import Deadlines


async def _call(deadlines: Deadlines, work: asyncio.Future[None] | None) -> str:
    """What a handler does: enter, await its work, tell a withdrawal from a client's cancel."""
    call = deadlines.enter()
    try:
        try:
            if work is not None:
                await work
            return "answered"
        except asyncio.CancelledError:
            if deadlines.withdrawn(call):
                return "withdrawn"
            raise
    finally:
        deadlines.leave(call)


def test_late_calls_are_withdrawn_and_the_others_answered() -> None:
    async def scenario() -> tuple[list[str], int, int]:
        deadlines = Deadlines(1.0)  # long enough that a busy host does not withdraw the quick ones
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(_call(deadlines, loop.create_future()))  # never answered
        await asyncio.sleep(0.1)
        quick = asyncio.ensure_future(_call(deadlines, None))
        soon: asyncio.Future[None] = loop.create_future()
        answered_in_time = asyncio.ensure_future(_call(deadlines, soon))
        last = asyncio.ensure_future(_call(deadlines, loop.create_future()))
        await asyncio.sleep(0)
        soon.set_result(None)
        outcomes = list(await asyncio.gather(first, quick, answered_in_time, last))
        cancelled = asyncio.ensure_future(_call(deadlines, loop.create_future()))  # its client leaves: not a withdrawal
        await asyncio.sleep(0)
        cancelled.cancel()
        try:
            await cancelled
        except asyncio.CancelledError:
            outcomes.append("cancelled")
        return outcomes, len(deadlines._calls), len(deadlines._withdrawn)

    outcomes, in_flight, withdrawn = asyncio.run(scenario())
    assert outcomes == ["withdrawn", "answered", "answered", "withdrawn", "cancelled"]
    assert in_flight == 0 and withdrawn == 0  # nothing kept once the calls ended


def test_no_timeout_keeps_nothing() -> None:
    async def scenario() -> tuple[object, str]:
        deadlines = Deadlines(0.0)
        return deadlines.enter(), await _call(deadlines, None)

    assert asyncio.run(scenario()) == (None, "answered")
