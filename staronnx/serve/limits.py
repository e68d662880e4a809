"""What ``staronnx serve`` holds against hostile and careless clients, as nginx and Envoy do.

Every connection and every request is bounded in time and memory, each bound a flag of
``staronnx serve`` with a default taken from those servers:

* **memory follows the data**: a body is read into buffers that grow with what has arrived
  (one buffer of the announced length is taken only once half of it is there), and the bytes
  held by bodies still arriving, over every connection, stay under ``--receive-budget``
  (:class:`ReceiveBudget`); past it a body is refused 503 at once. A client announcing 64 MiB
  and sending nothing costs the server what it sent, not 64 MiB;
* **time**: a connection has ``--header-timeout`` to send a whole request head (from its
  accept, or from the first byte after a keep-alive pause: nginx's ``client_header_timeout``,
  Envoy's ``request_headers_timeout``), ``--idle-timeout`` between requests (nginx's
  ``keepalive_timeout``), and a body must keep arriving (no pause longer than
  ``--body-timeout``, nginx's ``client_body_timeout``) at ``--body-min-rate`` on average once
  ``--body-timeout`` has passed (Apache's ``RequestReadTimeout ... MinRate``: a slowloris
  sending a byte a second is closed however regular it is). ``--request-timeout`` is the
  deadline of a whole request, body, queue and inference included (Envoy's route timeout);
* **connections**: the open-file soft limit is raised to the hard limit at start
  (:func:`raise_open_files`), and each protocol takes at most half of what is left once a
  reserve for the process's own files is set aside (:func:`connection_cap`), so that a flood
  of idle connections is refused (HTTP: 503 and ``Connection: close``; gRPC: gRPC's core
  closes the connection) instead of exhausting descriptors and failing every other client.

What was refused, and why, is counted (:class:`Refusals`, ``staronnx_refused_total{protocol,
reason}`` on ``/metrics``) and logged at most a few lines per window with a count of the rest
(:class:`LogLimiter`), so a flood of bad requests cannot flood the log.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

#: descriptors kept for the process itself (plans, perf models, threads' pipes, the metrics port)
FD_RESERVE_MIN = 64


@dataclass(frozen=True)
class Limits:
    """The bounds of one server (``staronnx serve``'s flags); times in seconds, sizes in bytes.

    0 for ``request_timeout`` means no deadline; 0 for ``max_connections`` and
    ``receive_budget`` means "derive it" (:meth:`resolved`)."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    body_min_rate: float = 1024.0
    idle_timeout: float = 75.0
    request_timeout: float = 120.0
    max_connections: int = 0
    receive_budget: int = 0
    grpc_max_streams: int = 4096

    def resolved(self, max_body: int, open_files: int) -> Limits:
        """These limits with the derived ones filled in: the connection cap from the open-file
        limit, the receive budget 16 bodies of ``max_body`` (at least one)."""
        return replace(self, max_connections=self.max_connections or connection_cap(open_files),
                       receive_budget=max(self.receive_budget or 16 * max_body, max_body))


def raise_open_files() -> int:
    """Raise the open-file soft limit to the hard limit (a server holds one descriptor per
    connection; the common default soft limit of 1,024 let 1,100 idle connections fail every
    other client); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    if target > soft:
        with contextlib.suppress(ValueError, OSError):  # macOS refuses past OPEN_MAX; keep what there is
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return int(soft)


def connection_cap(open_files: int) -> int:
    """Connections each protocol may hold with ``open_files`` descriptors: half of what is left
    after the process's own reserve (an eighth of the limit, at least :data:`FD_RESERVE_MIN`),
    so HTTP and gRPC together never exhaust the descriptors and a refusal can still be answered."""
    reserve = max(FD_RESERVE_MIN, open_files // 8)
    return max(1, (open_files - reserve) // 2)


@dataclass
class ReceiveBudget:
    """Bytes held by request bodies still arriving, over every connection, under a limit.

    Used on the event loop only (no lock). A body takes its bytes as its buffers grow and gives
    them back once whole (decoding and inference are bounded by the batcher's queue instead)."""

    limit: int
    held: int = 0

    def take(self, n: int) -> bool:
        """Hold ``n`` more bytes; False (nothing held) where that would pass the limit."""
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


@dataclass
class Refusals:
    """Counts of what the front ends refused or cut short, by protocol and reason, and of how
    inference requests ended (answered, refused, failed, cancelled by their client, dropped),
    read by ``/metrics`` and by the summary line at exit."""

    refused: Counter[tuple[str, str]] = field(default_factory=Counter)
    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: open connections per protocol (HTTP's, counted by its connection handler)
    connections: Counter[str] = field(default_factory=Counter)

    def refuse(self, protocol: str, reason: str) -> None:
        self.refused[(protocol, reason)] += 1

    def outcome(self, protocol: str, outcome: str) -> None:
        self.outcomes[(protocol, outcome)] += 1

    def total(self, outcome: str) -> int:
        return sum(n for (_, o), n in self.outcomes.items() if o == outcome)


class RefusalCollector:
    """``staronnx_refused_total{protocol, reason}``, ``staronnx_requests_total{protocol,
    outcome}``, the open HTTP connections and the bytes of bodies being received."""

    def __init__(self, refusals: Refusals, budget: ReceiveBudget) -> None:
        self.refusals = refusals
        self.budget = budget

    def collect(self) -> Iterator[Any]:
        for name, text, label, counts in (
                ("staronnx_refused", "Connections and requests refused or cut short by the server's limits, by "
                 "protocol and reason", "reason", self.refusals.refused),
                ("staronnx_requests", "Inference requests by how they ended: answered, refused (503 / UNAVAILABLE), "
                 "failed (another error), cancelled (by the client), dropped (closed unanswered by the server)",
                 "outcome", self.refusals.outcomes)):
            family = CounterMetricFamily(name, text, labels=["protocol", label])
            for key, n in sorted(counts.items()):
                family.add_metric(list(key), n)
            yield family
        conns = GaugeMetricFamily("staronnx_open_connections", "Open HTTP connections", labels=["protocol"])
        conns.add_metric(["http"], self.refusals.connections["http"])
        yield conns
        yield GaugeMetricFamily("staronnx_receiving_bytes", "Bytes held by request bodies still arriving "
                                "(--receive-budget bounds them)", value=self.budget.held)


class LogLimiter:
    """Log lines of one kind (a refused request, a malformed one) at most ``burst`` per
    ``window`` seconds; the rest are counted and summed up in one line when the window ends
    (:meth:`flush`, which the server calls every window and at exit), so that a flood of bad
    requests costs the log a few lines a window, never one per request."""

    def __init__(self, logger: logging.Logger, burst: int = 10, window: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.burst = burst
        self.window = window
        self.clock = clock
        self._start = clock()
        self._logged: Counter[str] = Counter()
        self._held: Counter[str] = Counter()

    def warning(self, kind: str, message: str, *args: Any) -> None:
        """``message % args`` as a warning, unless ``burst`` lines of ``kind`` were logged this window."""
        if self.clock() - self._start >= self.window:
            self.flush()
        if self._logged[kind] < self.burst:
            self._logged[kind] += 1
            self.logger.warning(message, *args)
        else:
            self._held[kind] += 1

    def flush(self) -> None:
        """One line per kind whose lines were held back this window, with their count; a new window."""
        for kind, n in sorted(self._held.items()):
            self.logger.warning("... and %d more %s in the last %.0f s (at most %d logged per %.0f s)",
                                n, kind, self.clock() - self._start, self.burst, self.window)
        self._held.clear()
        self._logged.clear()
        self._start = self.clock()


@dataclass
class Guard:
    """What both front ends share: the limits, the receive budget, the counts and the log."""

    limits: Limits
    budget: ReceiveBudget
    refusals: Refusals
    log: LogLimiter

    @classmethod
    def make(cls, limits: Limits, logger: logging.Logger) -> Guard:
        return cls(limits, ReceiveBudget(limits.receive_budget or 1 << 62), Refusals(), LogLimiter(logger))
