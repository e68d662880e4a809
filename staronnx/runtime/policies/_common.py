"""Pieces shared by several policies: the error type, queue helpers and the data-readiness
measure that dmdar/dmdas pop by.

Kept free of any policy logic so each policy module reads on its own.
"""

from __future__ import annotations

from collections import deque
from typing import SupportsFloat

from staronnx.errors import StaronnxError
from staronnx.runtime.sched import TaskView, runs_before


class PolicyError(StaronnxError, ValueError):
    """An unknown policy name or a bad policy option (user input, hence a StaronnxError)."""


def check_weight(name: str, value: SupportsFloat | str) -> float:
    """A finite, non-negative float, or a PolicyError naming the option.

    StarPU asserts its alpha/beta/gamma knobs are normal floats; a negative weight would
    *reward* late ends or transfers, which no user means, so we refuse it at construction.
    """
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise PolicyError(f"policy option {name} must be a number, got {value!r}") from None
    if not (x >= 0.0 and x != float("inf")):
        raise PolicyError(f"policy option {name} must be finite and >= 0, got {value!r}")
    return x


def insert_sorted(queue: deque[TaskView], task: TaskView) -> None:
    """Insert ``task`` after every queued task that runs before it or ties with it.

    This is ``starpu_st_fifo_taskq_push_sorted_task``: descending priority, FIFO among equals,
    with the service targets of a shared runtime first (model priority, then deadline:
    :func:`~staronnx.runtime.sched.runs_before`). We scan from the back because new tasks
    usually land at (or near) the tail.
    """
    i = len(queue)
    while i > 0 and runs_before(task, queue[i - 1]):
        i -= 1
    queue.insert(i, task)


def non_ready_bytes(task: TaskView, node: str) -> int:
    """Bytes of ``task``'s inputs with no valid copy on memory node ``node``.

    StarPU's ``starpu_st_non_ready_buffers_size`` also separates "loading" and "not allocated"
    bytes; a :class:`DataView` only says where copies are valid, so those tie-breakers reduce
    to queue order here.
    """
    return sum(d.nbytes for d in task.inputs if d.nbytes and node not in d.valid_on)


def pop_first_ready(queue: deque[TaskView], node: str) -> TaskView | None:
    """Remove and return the task dmdar/dmdas run next on a worker of memory node ``node``.

    Following ``starpu_st_fifo_taskq_pop_first_ready_task``: among queued tasks whose priority
    is >= the head's (that the head does not run before: service targets count first), the one
    with the fewest non-ready input bytes; the first one in queue
    order wins ties (strict ``<``), and a fully ready task stops the scan. In a priority-sorted
    queue this only looks at the head's priority class; in dmdar's FIFO queue it also lets a
    later, higher-priority task through.
    """
    if not queue:
        return None
    head = queue[0]
    best_index = 0
    best_bytes: int | None = None
    for i, task in enumerate(queue):
        if runs_before(head, task):
            continue
        nbytes = non_ready_bytes(task, node)
        if best_bytes is None or nbytes < best_bytes:
            best_index, best_bytes = i, nbytes
            if nbytes == 0:
                break
    task = queue[best_index]
    del queue[best_index]
    return task
