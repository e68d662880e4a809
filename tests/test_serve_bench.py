"""``benchmarks/serve.py --suite tail`` (issue 21's tail-latency rows) runs end to end on a real
server and client processes and reports every row and goal line. No timing is asserted: the
figures are the benchmark's business; this checks the rows exist and hold real requests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "serve.py"


@pytest.mark.slow
def test_tail_suite_reports_closed_and_open_loop_rows_for_both_protocols(tmp_path):
    out = tmp_path / "tail.json"
    done = subprocess.run([sys.executable, str(BENCH), "--suite", "tail", "--rounds", "1", "--tail-seconds", "1",
                           "--warmup", "0.3", "--clients", "4", "--tail-clients", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["tail"]
    for path in ("HTTP binary", "gRPC"):
        for row in ("closed 4", "closed 8", "open 25%", "open 50%", "open 75%"):
            r = rows[f"{path} / {row}"]
            assert r["throughput"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"], (path, row, r)
            assert r["p99_over_p50"] >= 1.0
        assert f"goal ({path}): p99 at 8 clients" in done.stdout
    # an open-loop point offers its share of the capacity measured in the same round
    cap = rows["HTTP binary / closed 4"]["throughput"]
    assert rows["HTTP binary / open 75%"]["throughput"] == pytest.approx(0.75 * cap, rel=0.5)


def test_an_open_loop_counts_refused_requests_instead_of_ending_the_row():
    """An overloaded server refuses some requests (gRPC's core cancels calls past its backlog):
    the row goes on and reports how many, where one refusal used to end the run."""
    import asyncio
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    sent = 0

    async def call() -> None:
        nonlocal sent
        sent += 1
        await asyncio.sleep(0.001)
        if sent % 3 == 0:
            raise RuntimeError("[StatusCode.CANCELLED] CANCELLED")

    r = asyncio.run(bench.open_loop(call, rate=400.0, seconds=0.5, warmup=0.05))
    assert r["failed"] > 0 and len(r["latencies"]) > 0
    assert r["failed"] + len(r["latencies"]) <= sent
