"""What a batching server is asked to do (:class:`ServeSpec`), and the one rule that sizes its
in-flight window (:func:`inflight_window`): the server's, ``staronnx serve``'s, a sweep's, the
simulator's.

Only ``max_inflight`` batches are handed to the runtime at a time: without that bound a
saturated runtime would swallow every request into its task queues, and the server's queue
would never fill, be measured or refuse anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from staronnx.errors import StaronnxError
from staronnx.serving.priority import QueuePolicy

ON_FULL = ("reject", "block")
#: the window's floor (batches in the runtime), whatever the worker count. While the window is
#: full, every batch waits for the completion of an earlier one to wake the batcher, and a worker
#: finds its next task only if one was queued behind the running one before that hand-over (tens
#: of microseconds, much more when the GIL is contended) ends. With two, a single worker whose
#: task is shorter than that idled between batches: on the serving benchmark (one worker, a
#: trivial model, 34k requests/s offered) open loop congested in 5 of 6 quiet runs with two, 1 of
#: 4 with four, none of 5 with eight. Four, not eight: beyond two workers the floor is two per worker
MIN_INFLIGHT = 4


def inflight_window(worker_seconds: Sequence[float | None], cap: int = 256) -> int:
    """Batches to keep in the runtime so every worker can be chosen under load.

    ``worker_seconds``: the predicted time of one batch through the whole plan on each worker
    (None where unknown).  A worker w is chosen by dmda once the others' queues run past its
    own time, i.e. with about ``T_slowest / T_w`` batches queued on each faster worker; the
    window is the sum of those, plus one running batch per worker, and never below the
    unknown-machine default: two per worker, at least :data:`MIN_INFLIGHT`.
    """
    n = len(worker_seconds)
    floor = max(MIN_INFLIGHT, 2 * n)
    known = [t for t in worker_seconds if t is not None and math.isfinite(t) and t > 0]
    if len(known) < n or not known:
        return floor
    slowest = max(known)
    window = sum(math.ceil(slowest / t) for t in known) + n
    return int(min(max(floor, window), max(cap, floor)))


@dataclass(frozen=True)
class ServeSpec:
    """A batching server's settings, checked once (:class:`~staronnx.serving.server.Server`,
    ``staronnx serve``'s models, a Ray replica's).

    Args:
        batch_size: ``b``: the exact batch size, or the largest one with ``max_delay``.
        max_delay: seconds the oldest queued request may wait before a partial batch leaves;
            None (the papers' model) waits for a full batch.
        queue_capacity: requests waiting for a batch; beyond it ``submit`` rejects or blocks.
        on_full: ``"reject"`` raises :class:`~staronnx.serving.server.OverloadError`;
            ``"block"`` waits for room.
        max_inflight: batches handed to the runtime at once; None: :func:`inflight_window` of
            the runtime's workers with no times known (``staronnx serve`` gives the window of
            its perf models' times), enough to keep every worker fed and parts pipelined.
        pad_to: batch sizes a partial batch is padded up to (the last request's rows repeated,
            dropped again when the outputs are split), so the runtime only meets sizes it has
            captured CUDA graphs for; None: the runtime's ``preferred_batch_sizes`` (those
            above ``batch_size`` are ignored). A batch larger than all of them runs as it is.
            Records keep the real size (and ``padded_to``).
        keep_records: None keeps the record of every request, batch and queue sample (a sweep's
            figures need them all); a number keeps only the latest that many of each, so a
            long-running server (``staronnx serve``) does not grow without bound.
        colocate: run the batcher thread on the runtime's host core, beside its CUDA driver
            thread, or its first CPU worker's thread where it has no CUDA worker
            (:meth:`~staronnx.runtime.runtime.Runtime.colocate`): both hold the GIL in turn,
            and a hand-over between two cores costs more than one on the same core. A runtime
            without a worker of its own leaves it where it is. A thread that submits many
            requests gains more from the same block around its loop.
        queue_policy: priority levels (a batch takes the highest level's requests first) and
            each level's capacity and timeout (:mod:`staronnx.serving.priority`); None: one
            queue in arrival order, bounded by ``queue_capacity`` alone.
    """

    batch_size: int
    max_delay: float | None = None
    queue_capacity: int = 1024
    on_full: str = "reject"
    max_inflight: int | None = None
    pad_to: tuple[int, ...] | None = None
    keep_records: int | None = None
    colocate: bool = False
    queue_policy: QueuePolicy | None = None

    def __post_init__(self) -> None:
        policy = self.queue_policy
        if policy is not None and not policy.priority_levels and policy.levels[0].capacity is not None:
            # without levels the queue is the policy's one level, so its capacity bounds the
            # queue (the batcher only counts per level where there are levels): as
            # dynamic_batching.default_queue_policy.max_queue_size does for a served model
            object.__setattr__(self, "queue_capacity", min(self.queue_capacity, policy.levels[0].capacity))
        b, capacity = self.batch_size, self.queue_capacity
        if not isinstance(b, int) or b < 1:
            raise StaronnxError(f"batch_size must be an integer >= 1, got {b!r}")
        if self.max_delay is not None and not (self.max_delay >= 0):
            raise StaronnxError(f"max_delay must be >= 0 seconds or None, got {self.max_delay!r}")
        if capacity < 1:
            raise StaronnxError(f"queue_capacity must be >= 1, got {capacity}")
        if self.max_delay is None and capacity < b:
            # a full batch could never form: the queue would fill and stay full forever
            raise StaronnxError(f"queue_capacity ({capacity}) must be at least batch_size ({b}) "
                                "when batches leave only when full (no max_delay)")
        if self.on_full not in ON_FULL:
            raise StaronnxError(f"on_full must be one of {', '.join(ON_FULL)}, got {self.on_full!r}")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise StaronnxError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.keep_records is not None and (not isinstance(self.keep_records, int) or self.keep_records < 1):
            raise StaronnxError(f"keep_records must be None (keep all) or an integer >= 1, got {self.keep_records!r}")
        if self.pad_to is not None:
            if any(isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1 for m in self.pad_to):
                raise StaronnxError(f"pad_to must be batch sizes (integers >= 1), got {list(self.pad_to)!r}")
            object.__setattr__(self, "pad_to", tuple(sorted({int(m) for m in self.pad_to})))
