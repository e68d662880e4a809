"""The inference lane of the HTTP door: a plain inference request answered without aiohttp's
per-request machinery.

Why: on a small model the server's CPU per request was mostly HTTP machinery, not the model.
aiohttp builds, for every request, a request object, a payload stream, a router match, a chain
of middlewares, a response object with its header multidict and a stream writer: sampled on the
CPU (perf), aiohttp's code was ~30 % of the server's CPU on a trivial model. An echo of a small
binary body cost ~86-100 µs of server CPU on an aiohttp app, ~25 µs on a bare
``asyncio.Protocol``, ~66 µs on uvicorn's ASGI server (no better than aiohttp's low-level
server, ~68 µs). With this lane the served trivial model took 0.67-0.74x the CPU per HTTP
request of the same server without it (both at once, same load). Nearly every request a busy
server sees is the same request: ``POST /v2/models/<m>[/versions/<v>]/infer`` with a
Content-Length, in one or two TCP
segments, on a keep-alive connection. Such a request is recognised here, on the bytes aiohttp
would have parsed, and answered by the front end directly; anything else about it, or about
the connection, goes to aiohttp as it arrived.

The rule is to recognise conservatively and hand over otherwise. A connection starts in the
lane (:class:`Lane`); its bytes are kept until a whole head and body are there. A head this
module does not read in full confidence (another method or route, HTTP/1.0, a header twice,
chunked or compressed bodies, ``Expect``, ``Connection: close``, a body over
:data:`MAX_BODY`, bytes of a next request already behind it, anything unusual in the syntax)
hands the connection over: every byte it kept is fed to aiohttp, which from then on serves the
connection alone, with every limit and answer of the door (:mod:`staronnx.serve.http_api`).
So the lane never answers what aiohttp would have refused, and no request is ever seen by both.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus

#: the largest body answered in the lane; a larger one is received by aiohttp, under the body
#: limits of :mod:`staronnx.serve.limits` (its arrival takes long enough for them to matter)
MAX_BODY = 64 * 1024

#: the longest request head looked at; a longer one goes to aiohttp's parser and its limits
MAX_HEAD = 8 * 1024

#: bytes of a connection's next requests held while the lane answers one; past them the
#: connection stops reading until the answer is sent (a client pipelining far ahead waits)
MAX_HELD = MAX_HEAD + MAX_BODY

#: how long the lane waits for the rest of a body whose head arrived; then the connection goes
#: to aiohttp, whose body timeouts apply (a client split a small request in two segments)
WAIT_S = 0.25

#: a head the lane reads: the request line of an inference route, then header lines of a token,
#: a colon and visible characters, spaces or tabs (no bare CR or LF, no control characters);
#: matched whole in one call, so a head that is not plain in every byte is aiohttp's
_HEAD = re.compile(rb"POST /v2/models/([A-Za-z0-9_.\-]+)(?:/versions/([A-Za-z0-9_.\-]+))?/infer HTTP/1\.1"
                   rb"((?:\r\n[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*)*)")
_FIELD = re.compile(rb"\r\n([^:]+):[ \t]*([^\r]*?)[ \t]*(?=\r\n|$)")

#: headers that hand a request to aiohttp whatever their value
_ABSENT = frozenset((b"transfer-encoding", b"expect", b"upgrade"))


@dataclass(frozen=True, slots=True)
class InferHead:
    """What the lane read of a request head: the model and version of the route, the binary
    extension's header length (as sent; :func:`~staronnx.serve.http_api.decode_body` checks it)
    and the body's length."""

    model: str
    version: str | None
    header_length: str | None
    body_bytes: int


def read_head(head: bytes) -> InferHead | None:
    """The inference request ``head`` (its bytes before the blank line), or None where the lane
    does not take it (aiohttp will)."""
    match = _HEAD.fullmatch(head)
    if match is None:
        return None
    pairs = _FIELD.findall(match.group(3))
    fields = {name.lower(): value for name, value in pairs}
    if len(fields) != len(pairs):  # a header given twice: aiohttp's rules and answers
        return None
    length = fields.get(b"content-length")
    if length is None or not length.isdigit() or not _ABSENT.isdisjoint(fields):
        return None
    if fields.get(b"content-encoding", b"identity").lower() != b"identity":
        return None
    if fields.get(b"connection", b"keep-alive").lower() != b"keep-alive":
        return None
    hl = fields.get(b"inference-header-content-length")
    version = match.group(2)
    return InferHead(match.group(1).decode(), version.decode() if version is not None else None,
                     hl.decode("latin-1") if hl is not None else None, int(length))


class Lane:
    """One connection's bytes while it is in the lane: a request still arriving, and what
    arrives while the lane's request is being answered (kept, in order, for after it)."""

    __slots__ = ("_raw", "busy", "held")

    def __init__(self) -> None:
        self._raw = b""
        #: a request of the lane is being answered
        self.busy = False
        #: bytes that came while ``busy``: the connection's next requests
        self.held = bytearray()

    @property
    def pending(self) -> bool:
        """Whether part of a request is kept, or a request is being answered."""
        return self.busy or bool(self._raw) or bool(self.held)

    def feed(self, data: bytes, max_body: int) -> tuple[InferHead, bytes] | bool:
        """Take ``data``: (head, body) once a whole request the lane answers is there (the lane
        is busy then); True while more is needed (or the lane is busy: ``data`` is held); False
        where the connection goes to aiohttp (:meth:`handover` gives the bytes kept)."""
        if self.busy:
            self.held += data
            return True
        raw = self._raw + data if self._raw else data
        self._raw = raw
        end = raw.find(b"\r\n\r\n", 0, MAX_HEAD + 4)
        if end < 0:
            return len(raw) <= MAX_HEAD
        head = read_head(raw[:end])
        if head is None or head.body_bytes > min(MAX_BODY, max_body):
            return False
        total = end + 4 + head.body_bytes
        if len(raw) < total:
            return True
        if len(raw) > total:  # the next request is behind it already: pipelining is aiohttp's
            return False
        self._raw = b""
        self.busy = True
        return head, raw[end + 4:]

    def keep(self, data: bytes) -> None:
        """Keep ``data`` unread, for :meth:`handover`."""
        self._raw += data

    def waiting_for_body(self) -> bool:
        """Whether a whole head is kept and its body is still arriving."""
        return not self.busy and b"\r\n\r\n" in self._raw

    def handover(self) -> bytes:
        """Every byte kept (the request that was arriving), for aiohttp; the lane is done."""
        raw, self._raw = self._raw, b""
        return raw


_date = ["", -1.0]


def http_date() -> str:
    """The Date header's value, formatted once a second."""
    now = int(time.time())
    if now != _date[1]:
        _date[:] = [formatdate(now, usegmt=True), now]
    return str(_date[0])


_REASONS = {s.value: s.phrase for s in HTTPStatus}


def response_bytes(status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None,
                   close: bool = False) -> bytes:
    """A whole HTTP/1.1 response, as aiohttp would have written it (Server names staronnx only)."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}", f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}", f"Date: {http_date()}", "Server: staronnx"]
    if extra:
        lines += [f"{k}: {v}" for k, v in extra.items()]
    if close:
        lines.append("Connection: close")
    lines += ["", ""]
    return "\r\n".join(lines).encode("latin-1") + body
