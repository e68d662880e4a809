"""The batch size for throughput, measured on this machine with the job's own rows.

Offline inference has no latency target: the batch that computes the most samples per second
wins. How much batching pays depends on the model, the workers and the runtime's own cost per
task, which a perf model calibrated elsewhere (or not at all) does not know, so the choice is
measured: batch sizes 1, 2, 4, ... run through the job's runtime with its window of requests
in flight, on the dataset's first rows, each for a short while after one warm-up run; the climb
stops when doubling gains less than :data:`GAIN` twice in a row, or the batch's inputs pass
:data:`MAX_BATCH_BYTES`. The answer is the smallest size within :data:`GAIN` of the best (a
bigger batch holds more memory and gives coarser progress for nothing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from staronnx.infer.rows import RowLayout

#: a doubling must gain this much to count as better
GAIN = 0.05
#: the largest batch tried, and the most input bytes one batch may hold
MAX_BATCH = 256
MAX_BATCH_BYTES = 64 << 20
#: how long each size is measured (after its warm-up run), and at least how many batches
PROBE_SECONDS = 0.4
PROBE_BATCHES = 3


@dataclass
class BatchChoice:
    """The chosen size and what each size tried measured (samples/s)."""

    batch_size: int
    measured: dict[int, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "samples_per_s": {str(b): round(v, 2) for b, v in self.measured.items()}}

    def describe(self) -> str:
        tried = ", ".join(f"{b}: {v:.1f}" for b, v in self.measured.items())
        return f"batch size {self.batch_size} chosen for throughput (samples/s by batch size: {tried})"


def _rows_of(layout: RowLayout, sample: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """``rows`` rows cycled from ``sample``'s."""
    have = layout.count(sample) or 1
    if rows <= have:
        return {n: np.require(v, requirements="C") for n, v in layout.take(sample, 0, rows).items()}
    reps = [sample] * (rows // have) + ([layout.take(sample, 0, rows % have)] if rows % have else [])
    return layout.join(reps)


def _throughput(runtime: Any, feeds: dict[str, np.ndarray], rows: int, max_in_flight: int) -> float:
    runtime.run(feeds)  # warm-up: the size's first run allocates
    count = 0
    t0 = time.perf_counter()
    window = []
    while True:
        window.append(runtime.submit(feeds))
        if len(window) >= max_in_flight:
            window.pop(0).result()
            count += 1
        if count >= PROBE_BATCHES and time.perf_counter() - t0 >= PROBE_SECONDS:
            break
    for future in window:
        future.result()
        count += 1
    return count * rows / (time.perf_counter() - t0)


def choose_batch_size(runtime: Any, layout: RowLayout, sample: dict[str, np.ndarray], *,
                      max_in_flight: int = 4, max_batch: int = MAX_BATCH) -> BatchChoice:
    """Measure batch sizes 1, 2, 4, ... on ``runtime`` with rows from ``sample`` (see the module
    docstring) and return the choice."""
    per_row = sum(int(v.nbytes) // max(layout.count(sample) or 1, 1)
                  for n, v in sample.items() if layout.inputs.get(n) is not None)
    measured: dict[int, float] = {}
    best = 0.0
    flat = 0
    size = 1
    # size 1 whatever its bytes: a row larger than the limit runs alone (none measured: no choice)
    while size <= max_batch and (size == 1 or size * per_row <= MAX_BATCH_BYTES):
        try:
            rate = _throughput(runtime, _rows_of(layout, sample, size), size, max_in_flight)
        except Exception:
            # a row of the sample that the model fails on (the job reports it by row id): the
            # sizes measured before it decide
            if not measured:
                raise
            break
        measured[size] = rate
        if rate > best * (1 + GAIN):
            flat = 0
        else:
            flat += 1
            if flat >= 2:
                break
        best = max(best, rate)
        size *= 2
    top = max(measured.values())
    chosen = min(b for b, v in measured.items() if v >= top / (1 + GAIN))
    return BatchChoice(chosen, measured)
