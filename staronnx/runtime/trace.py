"""Chrome/Perfetto traces of what the engine did: one lane per worker, tasks, flows.

Open the JSON in https://ui.perfetto.dev or chrome://tracing. Each task is a complete event
("X") on its worker's lane; each dependency is a flow arrow from the producing task's end to
the consuming task's start. A :class:`~staronnx.serving.Server` on a traced runtime adds its own
lanes (each batch's fill, from its oldest request's arrival to its formation, then the batch
from formation to result) and a queue-length counter; a traced sweep marks its points. Events
are kept in memory and written atomically at close.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from staronnx.fsutil import atomic_write_text


class Tracer:
    """Collects trace events; thread-safe; times are seconds from the engine's clock."""

    def __init__(self, path: str | os.PathLike[str], origin: float) -> None:
        self.path = Path(path)
        self.origin = origin
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._flow_ids = 0
        self._pid = os.getpid()
        #: written as a bare JSON array of events (the Trace Event Format's array form, which ONNX
        #: Runtime's profiler writes and scripts that read its profiles iterate); Perfetto and
        #: chrome://tracing read both forms. False: the object form, with its display unit
        self.event_list = False

    def _us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 3)

    def lane(self, tid: int, name: str) -> None:
        with self._lock:
            self._events.append({"ph": "M", "name": "thread_name", "pid": self._pid, "tid": tid,
                                 "args": {"name": name}})
            self._events.append({"ph": "M", "name": "thread_sort_index", "pid": self._pid,
                                 "tid": tid, "args": {"sort_index": tid}})

    def task(self, tid: int, name: str, start: float, end: float, args: dict[str, Any]) -> None:
        self.span(tid, name, start, end, "task", args)

    def flow(self, src_tid: int, src_time: float, dst_tid: int, dst_time: float, name: str) -> None:
        """A dependency arrow from the end of one task to the start of another."""
        with self._lock:
            self._flow_ids += 1
            fid = self._flow_ids
            self._events.append({"ph": "s", "id": fid, "name": name, "cat": "dependency",
                                 "pid": self._pid, "tid": src_tid, "ts": self._us(src_time)})
            self._events.append({"ph": "f", "bp": "e", "id": fid, "name": name, "cat": "dependency",
                                 "pid": self._pid, "tid": dst_tid, "ts": self._us(dst_time)})

    def span(self, tid: int, name: str, start: float, end: float, cat: str, args: dict[str, Any] | None = None) -> None:
        """A complete event: a task, or the server's batch fills and batches, sweep points."""
        with self._lock:
            self._events.append({"ph": "X", "name": name, "cat": cat, "pid": self._pid, "tid": tid,
                                 "ts": self._us(start), "dur": self._us(end) - self._us(start), "args": args or {}})

    def async_span(self, name: str, cat: str, span_id: int | str, start: float, end: float,
                   args: dict[str, Any] | None = None) -> None:
        """A span that may overlap others of its ``cat`` (Perfetto draws each category as an
        async track with as many rows as needed): batches in flight, batch fills."""
        with self._lock:
            base = {"name": name, "cat": cat, "id": f"{cat}:{span_id}", "pid": self._pid, "tid": 0}
            self._events.append({**base, "ph": "b", "ts": self._us(start), "args": args or {}})
            self._events.append({**base, "ph": "e", "ts": self._us(end)})

    def counter(self, name: str, t: float, value: float) -> None:
        """A value over time (a counter track in Perfetto), e.g. the server's queue length."""
        with self._lock:
            self._events.append({"ph": "C", "name": name, "pid": self._pid, "ts": self._us(t),
                                 "args": {name: value}})

    def save(self) -> Path:
        with self._lock:
            events = list(self._events)
            data: Any = events if self.event_list else {"traceEvents": events, "displayTimeUnit": "ms"}
        atomic_write_text(self.path, json.dumps(data))
        return self.path
