"""The cycle collector while serving: young collections only, older ones when the caller says.

CPython's collector stops every thread (event loop, batchers, workers) while it walks a
generation. Serving keeps each request's objects alive for a while (in flight, then in the
records a server keeps for its statistics), so they survive the young collections and fill the
older generations, and walking those became the tail:

- the load generator's process (``benchmarks/serving_path.py``, 2-core VM): middle-generation
  collections over the run's requests, 0.4-1 ms each, p99 4 ms and up to 17 ms when the OS
  preempted the collecting thread, every 25-65 ms at 40k requests/s; at 75 % of capacity one
  1 ms stop queues 40 requests that take 3 ms to drain (open-loop p99 13-60x p50; 1.5-4.7x
  without them);
- ``staronnx serve`` under the tail benchmark (``benchmarks/serve.py --suite tail``, ~50 s of
  load): 205 middle-generation collections (50 over 5 ms, up to 14 ms) and 19 full ones (13 over
  5 ms, up to 37 ms), against p99 goals of 30-40 ms.

Young collections stay (cycles that die young are freed there, 0.1-0.4 ms each); reference
counting frees everything else as usual. What waits is cyclic garbage that outlived a young
collection: until the caller's own full collection (``staronnx serve`` runs one every
``--gc-interval``, a pause of one full walk that often instead of ten times a second) or until
the last user leaves.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

from staronnx.process_settings import SharedSetting

#: the older generations' thresholds while :func:`young_only` holds: never reached
OUT_OF_REACH = 1 << 30


def _young_thresholds() -> tuple[int, ...]:
    found = gc.get_threshold()
    gc.set_threshold(found[0], OUT_OF_REACH, OUT_OF_REACH)
    return found


#: only young (generation 0) collections run automatically while held; nests, and the last
#: user to leave restores the thresholds the first found (an explicit ``gc.collect()`` still
#: collects everything)
young_only = SharedSetting(_young_thresholds, lambda found: gc.set_threshold(*found)).held


@contextlib.contextmanager
def full_collections_every(interval: float) -> Iterator[None]:
    """:func:`young_only` while inside, and the full collection it leaves to the server, on a
    thread of its own every ``interval`` s: one walk of everything that often instead of the
    older generations' walks several times a second under load (each stops every thread,
    wherever it runs). What ``staronnx serve --gc-interval`` holds, in its process or in each
    Ray replica's."""
    stop = threading.Event()

    def collect() -> None:
        while not stop.wait(interval):
            gc.collect()

    with young_only():
        collector = threading.Thread(target=collect, name="staronnx-gc", daemon=True)
        collector.start()
        try:
            yield
        finally:
            stop.set()
