"""Serving: single-sample requests batched for a Runtime, under an open-loop load.

    from staronnx.serving import Server, ServeSpec, make_arrivals, run_open_loop, summarize

    with Runtime(plan) as rt, Server(rt, ServeSpec(batch_size=8)) as server:
        records = run_open_loop(server, make_arrivals("poisson", 200.0, seed=1),
                                lambda i: samples[i % len(samples)], duration=10.0)
    print(summarize(records, warmup=1.0))   # throughput, the papers' latency, p99, congested, ...

:mod:`~staronnx.serving.records` is the format a run produces, live or simulated;
:mod:`~staronnx.serving.metrics` reads it without caring which.
"""

from staronnx.serving.arrivals import (
    DISTRIBUTIONS,
    ArrivalError,
    ArrivalProcess,
    Constant,
    Poisson,
    Replay,
    make_arrivals,
)
from staronnx.serving.loadgen import generator_report, run_open_loop, sleep_until
from staronnx.serving.metrics import (
    backlog,
    cpu_share,
    is_stable,
    measurement_window,
    stability_windows,
    summarize,
)
from staronnx.serving.records import BatchRecord, RequestRecord, RunRecords
from staronnx.serving.priority import LevelPolicy, QueuePolicy
from staronnx.serving.server import BatchRuntime, LevelFullError, OverloadError, Server, ServerClosed, StandInRuntime
from staronnx.serving.spec import ServeSpec

__all__ = [
    "DISTRIBUTIONS",
    "ArrivalError",
    "ArrivalProcess",
    "BatchRecord",
    "BatchRuntime",
    "Constant",
    "LevelFullError",
    "LevelPolicy",
    "OverloadError",
    "Poisson",
    "QueuePolicy",
    "Replay",
    "RequestRecord",
    "RunRecords",
    "ServeSpec",
    "Server",
    "ServerClosed",
    "StandInRuntime",
    "backlog",
    "cpu_share",
    "generator_report",
    "is_stable",
    "make_arrivals",
    "measurement_window",
    "run_open_loop",
    "sleep_until",
    "stability_windows",
    "summarize",
]
