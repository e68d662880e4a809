"""The HTTP door's inference lane (:mod:`staronnx.serve.fastpath`): plain inference requests are
answered beside aiohttp, everything else by aiohttp, and a client cannot tell which.

Each test talks to the real ``staronnx serve`` in a subprocess: Triton's HTTP client, and raw
sockets where the test needs to choose how the bytes arrive (one segment, a head and a late
body, requests pipelined behind one another). Nothing is timed.
"""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

pytest.importorskip("tritonclient", reason="needs Triton's clients (tritonclient: pip install -e '.[dev]')")
import tritonclient.http as thttp
from test_serve import _check, _http_infer, _m, _metrics, _x, serving, tiny_chain

from staronnx.serve.fastpath import WAIT_S, read_head

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return tiny_chain(tmp_path_factory.mktemp("lane"))


@pytest.fixture(scope="module")
def server(plan, tmp_path_factory):
    yield from serving([plan.root], tmp_path_factory.mktemp("server"), "--name", "tiny", "--policy", "eager",
                       "--batch-size", "4", "--max-delay", "2ms", "--queue-capacity", "64", "--drain-timeout", "10s")


def _infer_request(x: np.ndarray, *, model: str = "tiny", extra: str = "", version: str = "1.1") -> bytes:
    """An inference request in Triton's binary form, as tritonclient writes it."""
    head = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
    body = head + x.tobytes()
    return (f"POST /v2/models/{model}/infer HTTP/{version}\r\nHost: t\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {len(head)}\r\n{extra}\r\n").encode() + body


def _read_response(sock: socket.socket, buf: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One response from ``sock`` (``buf``: bytes already read past the previous one)."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection before answering"
        buf += chunk
    end = buf.index(b"\r\n\r\n")
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    total = end + 4 + int(headers.get("content-length", "0"))
    while len(buf) < total:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-answer"
        buf += chunk
    body = bytes(buf[end + 4:total])
    del buf[:total]
    return int(lines[0].split()[1]), headers, body


def _output(headers: dict[str, str], body: bytes) -> np.ndarray:
    length = int(headers["inference-header-content-length"])
    out = json.loads(body[:length])["outputs"][0]
    return np.frombuffer(body[length:], dtype=np.float32).reshape(out["shape"])


def _connect(addr: str) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def test_tritonclient_requests_of_every_form_on_one_connection_are_answered_and_counted(server, plan):
    """Binary and JSON inputs and outputs, then metadata and health on the same client (the
    connection leaves the lane for aiohttp at its first GET), then inference again."""
    before = _m(_metrics(server.metrics), "staronnx_requests_total", protocol="http", outcome="answered")
    client = thttp.InferenceServerClient(server.http, concurrency=1)
    for i, (binary_in, binary_out) in enumerate([(True, True), (False, False), (True, False), (False, True)]):
        x = _x(1 + i, seed=i)
        _check(plan, x, _http_infer(client, x, binary_in=binary_in, binary_out=binary_out).as_numpy("y"))
    assert client.is_model_ready("tiny") and client.get_model_metadata("tiny")["name"] == "tiny"
    x = _x(3, seed=9)
    _check(plan, x, _http_infer(client, x).as_numpy("y"))
    after = _m(_metrics(server.metrics), "staronnx_requests_total", protocol="http", outcome="answered")
    assert after - before == 5


def test_a_request_whose_body_comes_late_is_answered_whoever_receives_it(server, plan):
    """A head, then its body: soon after (the lane waits for it), and past the lane's wait
    (aiohttp receives it); the connection then serves a next request."""
    with _connect(server.http) as sock:
        buf = bytearray()
        for i, pause in enumerate((0.01, 2 * WAIT_S, 0.0)):
            x = _x(2, seed=20 + i)
            data = _infer_request(x)
            cut = data.index(b"\r\n\r\n") + 4
            sock.sendall(data[:cut])
            time.sleep(pause)
            sock.sendall(data[cut:])
            status, headers, body = _read_response(sock, buf)
            assert status == 200 and headers["server"] == "staronnx", body
            _check(plan, x, _output(headers, body))


def test_pipelined_requests_are_answered_in_order(server, plan):
    """Requests sent behind one another without waiting: each in its own segment (held by the
    lane while it answers the first), then several in one segment (aiohttp's), with a health
    check among them; the answers come in the order asked."""
    with _connect(server.http) as sock:
        buf = bytearray()
        xs = [_x(1, seed=30 + i) for i in range(3)]
        for x in xs:
            sock.sendall(_infer_request(x))
        for x in xs:
            status, headers, body = _read_response(sock, buf)
            assert status == 200, body
            _check(plan, x, _output(headers, body))
        ys = [_x(2, seed=40 + i) for i in range(2)]
        sock.sendall(_infer_request(ys[0]) + b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n"
                     + _infer_request(ys[1]))
        status, headers, body = _read_response(sock, buf)
        _check(plan, ys[0], _output(headers, body))
        assert _read_response(sock, buf)[0] == 200
        status, headers, body = _read_response(sock, buf)
        _check(plan, ys[1], _output(headers, body))


def test_the_lane_and_aiohttp_give_the_same_errors(server):
    """The same bad request, once plain (the lane) and once with a header the lane leaves to
    aiohttp (chunked), gets the same status and JSON error; the connection stays usable."""
    x = _x(1)
    bad = [_infer_request(x, model="nosuch"),
           _infer_request(x).replace(b"Inference-Header-Content-Length: ", b"Inference-Header-Content-Length: 9")]
    for data in bad:
        head, _, body = data.partition(b"\r\n\r\n")
        chunked = (head.replace(b"\r\nContent-Length", b"\r\nX-Was-Length") + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
                   + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        answers = []
        for raw in (data, chunked):
            with _connect(server.http) as sock:
                buf = bytearray()
                sock.sendall(raw)
                status, headers, text = _read_response(sock, buf)
                sock.sendall(_infer_request(x))
                assert _read_response(sock, buf)[0] == 200
            answers.append((status, headers["content-type"].split(";")[0], json.loads(text)))
        assert answers[0] == answers[1] and answers[0][0] >= 400 and "error" in answers[0][2], answers


@pytest.mark.parametrize("extra, version", [("Connection: close\r\n", "1.1"), ("", "1.0")])
def test_a_request_that_closes_its_connection_is_answered_then_closed(server, plan, extra, version):
    with _connect(server.http) as sock:
        x = _x(1, seed=5)
        sock.sendall(_infer_request(x, extra=extra, version=version))
        buf = bytearray()
        status, headers, body = _read_response(sock, buf)
        assert status == 200
        _check(plan, x, _output(headers, body))
        assert not buf and sock.recv(1) == b""


@pytest.mark.parametrize("head, taken", [
    (b"POST /v2/models/m/infer HTTP/1.1\r\nContent-Length: 3", True),
    (b"POST /v2/models/m/versions/2/infer HTTP/1.1\r\ncontent-length: 3\r\nConnection: Keep-Alive", True),
    (b"POST /v2/models/m/infer HTTP/1.0\r\nContent-Length: 3", False),
    (b"POST /v2/models/m/infer?x=1 HTTP/1.1\r\nContent-Length: 3", False),
    (b"POST /v2/models/m%20x/infer HTTP/1.1\r\nContent-Length: 3", False),
    (b"POST /v2/models/m/infer HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3", False),
    (b"POST /v2/models/m/infer HTTP/1.1\r\nContent-Length: +3", False),
    (b"POST /v2/models/m/infer HTTP/1.1\r\nTransfer-Encoding: chunked", False),
    (b"POST /v2/models/m/infer HTTP/1.1\r\nContent-Length: 3\r\nContent-Encoding: gzip", False),
    (b"POST /v2/models/m/infer HTTP/1.1\r\nContent-Length: 3\r\nExpect: 100-continue", False),
    (b"POST /v2/models/m/infer HTTP/1.1\r\nContent-Length: 3\nX: y", False),
    (b"POST /v2/models/m/infer HTTP/1.1\r\nContent Length: 3", False),
    (b"GET /v2/models/m/infer HTTP/1.1\r\nContent-Length: 3", False),
])
def test_the_lane_takes_only_heads_it_reads_in_full(head, taken):
    assert (read_head(head) is not None) == taken
