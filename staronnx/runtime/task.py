"""Requests, tasks and data handles: the native engine's bookkeeping for one batch.

A request is one ``submit(feeds)``: one task per part, one data handle per tensor a part reads
or writes. A handle knows which memory nodes hold a valid copy (StarPU's MSI states reduced to
what a read-mostly inference DAG needs: written once by its producer on one node, then shared
by every node that reads it), so policies can price transfers and prefer workers where the
data already is.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generator

import numpy as np

from staronnx.runtime.sched import DataView, TaskView

_handle_ids = itertools.count()


class RequestFuture(Future):  # type: ignore[type-arg]
    """A concurrent.futures.Future of a request's outputs, also awaitable from asyncio."""

    def __init__(self, request_id: int) -> None:
        super().__init__()
        self.request_id = request_id
        #: "part<k>" -> arch of the worker that ran it (serving reports CPU share from this)
        self.placement: dict[str, str] = {}
        #: the serving batch that carried this request (a BatchRecord: formed/done times, size),
        #: set by the Server before the result, so network front ends can split queue from compute
        self.batch: Any = None

    def __await__(self) -> Generator[Any, None, dict[str, np.ndarray]]:
        return asyncio.wrap_future(self).__await__()


class TaskError(RuntimeError):
    """A part failed while running; ``__cause__`` is ONNX Runtime's own error."""

    def __init__(self, part: int, worker: str, cause: BaseException) -> None:
        super().__init__(f"part {part} failed on worker {worker}: {type(cause).__name__}: {cause}")
        self.part = part
        self.worker = worker


@dataclass
class DataHandle:
    """A tensor of one request, with the memory nodes holding a valid copy."""

    name: str
    nbytes: int
    valid_on: set[str] = field(default_factory=set)
    id: int = field(default_factory=lambda: next(_handle_ids))
    readers_left: int = 0

    def view(self) -> DataView:
        return DataView(self.id, self.name, self.nbytes, frozenset(self.valid_on))


@dataclass
class Task:
    """One part applied to one request's batch."""

    request: "Request"
    part: int
    waiting_on: set[int]  # parts whose outputs this task still needs
    view: TaskView | None = None
    ready_at: float = 0.0
    started_at: float = 0.0
    ended_at: float = 0.0
    worker: int | None = None


@dataclass
class Request:
    """One submitted batch travelling through the plan."""

    id: int
    batch: int
    future: RequestFuture
    values: dict[str, np.ndarray]
    handles: dict[str, DataHandle]
    tasks: list[Task]
    submitted_at: float
    parts_left: int
    failed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
