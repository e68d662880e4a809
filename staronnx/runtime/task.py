"""What a caller of either engine holds: a request's future and a failed task's error.

(The requests, tasks and data handles themselves are the core's: :mod:`staronnx.runtime.core`.)
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any, Generator

import numpy as np


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
