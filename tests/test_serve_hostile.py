"""``staronnx serve`` against a hostile client (issue 21, defects D1-D9 and the leak): each test
sends the exact request of the issue and checks the protocol's answer, that the server logged
no traceback, and that it still serves.

The server is the real CLI in a subprocess (tests/test_serve.py's ``start_server``), listening
on 127.0.0.1 only; every request loop is bounded, and nothing is timed.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import time
import urllib.request
import zlib

import grpc
import numpy as np
import onnx
import pytest
# a skip, not a collection error, where Triton's clients are absent (the GPU host)
pytest.importorskip("tritonclient", reason="needs Triton's clients (tritonclient: pip install -e '.[dev]')")
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from test_serve import _check, _m, _metrics, _post, _x, start_server
from tritonclient.grpc import service_pb2, service_pb2_grpc

from staronnx import partition
from staronnx.zoo import chain

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    onnx.save(chain(depth=2, width=8), str(root / "chain.onnx"))
    return partition(root / "chain.onnx", parts=1, method="linear", output_dir=root / "chain", costs="estimate")


@pytest.fixture(scope="module")
def server(plan, tmp_path_factory):
    s = start_server([plan.root], tmp_path_factory.mktemp("server"), "--name", "tiny", "--policy", "eager",
                     "--batch-size", "4", "--max-delay", "2ms", "--queue-capacity", "64", "--max-body", "1MiB",
                     "--drain-timeout", "10s")
    yield s
    assert s.stop() == 0, "\n".join(s.lines)
    assert "Traceback" not in "\n".join(s.lines), "\n".join(s.lines)


def _raw(addr: str, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes as they are; the status, headers and body of the answer."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
    return int(lines[0].split()[1]), headers, body


def _still_serves(server, plan) -> None:
    x = _x(2, seed=11)
    inp = thttp.InferInput("x", [2, 8], "FP32")
    inp.set_data_from_numpy(x)
    _check(plan, x, thttp.InferenceServerClient(server.http).infer("tiny", [inp]).as_numpy("y"))
    g = tgrpc.InferenceServerClient(server.grpc)
    ginp = tgrpc.InferInput("x", [2, 8], "FP32")
    ginp.set_data_from_numpy(x)
    _check(plan, x, g.infer("tiny", [ginp]).as_numpy("y"))


def _no_traceback(server) -> None:
    out = "\n".join(server.lines)
    assert "Traceback" not in out and "RecursionError" not in out, out[-3000:]


# -- D1: JSON nested too deeply ----------------------------------------------------------------
def test_d1_json_nested_too_deeply_is_400(server, plan):
    status, doc = _post(server.http, "/v2/models/tiny/infer", b"[" * 100000)
    assert status == 400 and "nested too deeply" in doc["error"], doc
    deep = b'{"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": ' + b"[" * 5000 + b"]" * 5000 + b"}]}"
    status, doc = _post(server.http, "/v2/models/tiny/infer", deep)
    assert status == 400 and "nested too deeply" in doc["error"], doc
    _no_traceback(server)
    _still_serves(server, plan)


# -- D2: shapes of more than 64 dimensions -----------------------------------------------------
def test_d2_rank_over_64_is_400_and_invalid_argument(server, plan):
    shape = [1] * 65
    body = json.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": "FP32", "data": [0.0]}]}).encode()
    status, doc = _post(server.http, "/v2/models/tiny/infer", body)
    assert status == 400 and "at most 64" in doc["error"], doc
    head = json.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": "FP32",
                                   "parameters": {"binary_data_size": 4}}]}).encode()
    status, doc = _post(server.http, "/v2/models/tiny/infer", head + b"\0" * 4,
                        {"Inference-Header-Content-Length": str(len(head))})
    assert status == 400 and "at most 64" in doc["error"], doc
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.grpc))
    req = service_pb2.ModelInferRequest(model_name="tiny")
    req.inputs.add(name="x", datatype="FP32", shape=[1] * 10000)
    req.raw_input_contents.append(b"\0" * 4)
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 64" in e.value.details()
    _no_traceback(server)
    _still_serves(server, plan)


# -- D3: what aiohttp's parser refuses ---------------------------------------------------------
@pytest.mark.parametrize("request_bytes", [
    b"GET /v2/models/" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n",
    b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}",
], ids=["url-9000", "header-9000", "content-length--1"])
def test_d3_unparsable_requests_get_the_json_error_and_one_log_line(server, plan, request_bytes):
    before = len(server.lines)
    status, headers, body = _raw(server.http, request_bytes)
    assert status == 400 and headers.get("content-type", "").startswith("application/json"), (status, headers, body)
    assert "malformed HTTP request" in json.loads(body)["error"]
    assert headers.get("server") == "staronnx"
    deadline = time.monotonic() + 10  # the log line arrives through the server's pipe
    while len(server.lines) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    new = server.lines[before:]
    assert len(new) == 1 and "malformed HTTP request" in new[0], new
    _no_traceback(server)
    _still_serves(server, plan)


# -- D4: a compressed body that inflates past --max-body ---------------------------------------
def test_d4_gzip_bomb_is_refused_at_max_body(server, plan):
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = b"\0" * 2**20
    bomb = b"".join([c.compress(zeros) for _ in range(64)] + [c.flush()])  # 64 MiB of zeros in ~64 KB
    assert len(bomb) < 2**20
    status, doc = _post(server.http, "/v2/models/tiny/infer", bomb, {"Content-Encoding": "gzip"})
    assert status == 400 and "decompresses to more than --max-body" in doc["error"], doc
    status, doc = _post(server.http, "/v2/models/tiny/infer", b"\x1f\x8b not gzip", {"Content-Encoding": "gzip"})
    assert status == 400 and "not valid compressed data" in doc["error"], doc
    status, doc = _post(server.http, "/v2/models/tiny/infer", b"{}", {"Content-Encoding": "br"})
    assert status == 400 and "not supported" in doc["error"], doc
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [0.5] * 8}]}).encode()
    status, doc = _post(server.http, "/v2/models/tiny/infer", gzip.compress(body), {"Content-Encoding": "gzip"})
    assert status == 200, doc
    _check(plan, np.full((1, 8), 0.5, np.float32), np.asarray(doc["outputs"][0]["data"], np.float32).reshape(1, 8))
    _no_traceback(server)


def test_d4_inflate_stops_at_the_limit():
    """The decompression itself: never more than max_body + 1 bytes come out of zlib."""
    from staronnx.serve.http_api import _inflate
    from staronnx.serve.protocol import ProtocolError

    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    bomb = b"".join([c.compress(b"\0" * 2**20) for _ in range(16)] + [c.flush()])
    with pytest.raises(ProtocolError, match="more than --max-body"):
        _inflate(bomb, 16 + zlib.MAX_WBITS, 1000)
    assert _inflate(gzip.compress(b"abc"), 16 + zlib.MAX_WBITS, 3) == b"abc"
    with pytest.raises(ProtocolError, match="truncated"):
        _inflate(gzip.compress(b"abc" * 100)[:-12], 16 + zlib.MAX_WBITS, 1000)


# -- D6: more samples than the queue holds -----------------------------------------------------
def test_d6_batch_100_over_queue_64_is_400(server):
    body = json.dumps({"inputs": [{"name": "x", "shape": [100, 8], "datatype": "FP32", "data": [0.0] * 800}]}).encode()
    status, doc = _post(server.http, "/v2/models/tiny/infer", body)
    assert status == 400 and "100 samples" in doc["error"] and "at most 64" in doc["error"], doc


# -- D7: an HTTP client that disconnects has its request withdrawn -----------------------------
def test_d7_http_client_that_disconnects_is_canceled(plan, tmp_path):
    """A sample waits for a batch of 4 for up to 3 s; its client hangs up; the sample is withdrawn
    and counted CANCELED, never run (the delay passes and nothing runs)."""
    s = start_server([plan.root], tmp_path, "--name", "tiny", "--policy", "eager", "--batch-size", "4",
                     "--max-delay", "3s")
    try:
        labels = {"model": "tiny", "version": "1"}
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [0.0] * 8}]}).encode()
        host, port = s.http.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            deadline = time.monotonic() + 20
            while _m(_metrics(s.metrics), "staronnx_queue_length", model="tiny") != 1:
                assert time.monotonic() < deadline, "the request never reached the queue"
                time.sleep(0.01)
        deadline = time.monotonic() + 20
        while _m(_metrics(s.metrics), "nv_inference_request_failure", reason="CANCELED", **labels) != 1:
            assert time.monotonic() < deadline, "the disconnect was never noticed"
            time.sleep(0.01)
        m = _metrics(s.metrics)
        assert _m(m, "staronnx_queue_length", model="tiny") == 0
        assert _m(m, "nv_inference_request_success", **labels) == 0
        assert _m(m, "nv_inference_pending_request_count", **labels) == 0
        # a full batch runs at once; the withdrawn sample is not in it
        clients = [thttp.InferenceServerClient(s.http) for _ in range(4)]
        pending = []
        for i, c in enumerate(clients):
            inp = thttp.InferInput("x", [1, 8], "FP32")
            inp.set_data_from_numpy(_x(1, seed=i))
            pending.append(c.async_infer("tiny", [inp]))
        for i, p in enumerate(pending):
            _check(plan, _x(1, seed=i), p.get_result().as_numpy("y"))
        m = _metrics(s.metrics)
        assert _m(m, "nv_inference_count", **labels) == 4 and _m(m, "nv_inference_request_success", **labels) == 4
    finally:
        if s.proc.poll() is None:
            assert s.stop() == 0, "\n".join(s.lines)


# -- D8: what is echoed is bounded -------------------------------------------------------------
def test_d8_long_model_names_are_not_echoed_whole(server):
    g = tgrpc.InferenceServerClient(server.grpc)
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as e:
        g.get_model_metadata("m" * 100_000)
    assert e.value.status() == "StatusCode.NOT_FOUND", e.value
    assert "Request for unknown model" in e.value.message() and len(e.value.message()) < 500
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.grpc))
    req = service_pb2.ModelInferRequest(model_name="n" * 100_000)
    req.inputs.add(name="x", datatype="FP32", shape=[1, 8])
    req.raw_input_contents.append(b"\0" * 32)
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and len(err.value.details()) < 500
    status, doc = _post(server.http, "/v2/models/" + "a" * 4000 + "/infer", b"{}")
    assert status == 404 and "Request for unknown model" in doc["error"] and len(doc["error"]) < 500, doc
    body = json.dumps({"inputs": [{"name": "z" * 4000, "shape": [1, 8], "datatype": "FP32", "data": [0.0] * 8}]})
    status, doc = _post(server.http, "/v2/models/tiny/infer", body.encode())
    assert status == 400 and len(doc["error"]) < 500, doc


# -- D9: a message that is not protobuf --------------------------------------------------------
def test_d9_undecodable_protobuf_is_invalid_argument(server, plan):
    channel = grpc.insecure_channel(server.grpc)
    for method in ("ModelInfer", "ModelMetadata", "ModelStatistics"):
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
        with pytest.raises(grpc.RpcError) as e:
            call(b"\xff\xff\xff\xff", timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value)
        assert "not a valid" in e.value.details()
    _no_traceback(server)
    _still_serves(server, plan)


# -- the leak: paths, exception text, software versions ----------------------------------------
def test_leak_server_header_names_staronnx_only(server):
    for url in (f"http://{server.http}/v2", f"http://{server.http}/v2/models/tiny/config", server.metrics):
        with urllib.request.urlopen(url, timeout=30) as resp:
            assert resp.headers["Server"] == "staronnx", (url, resp.headers["Server"])
    status, headers, _ = _raw(server.http, b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 404 and headers["server"] == "staronnx"
    with urllib.request.urlopen(f"http://{server.http}/v2/models/tiny/config", timeout=30) as resp:
        text = resp.read().decode()
    assert "/" not in json.dumps(json.loads(text)["parameters"]), text


def test_leak_a_500_says_only_that_the_log_has_the_details(caplog):
    """A server bug (here a model whose metadata raises) answers 500 without the exception's
    class or message; the log has them."""
    from aiohttp.test_utils import TestClient, TestServer

    from staronnx.serve.http_api import HttpFrontend

    class Broken:
        ready = True

        def check_version(self, version):
            pass

        def metadata(self):
            raise RuntimeError("secret /home/someone/plans/x")

    async def go() -> tuple[int, dict, str]:
        app = HttpFrontend({"b": Broken()}, {"name": "staronnx"}, 2**20, lambda: True).app()
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            resp = await client.get("/v2/models/b")
            return resp.status, await resp.json(), resp.headers.get("Server", "")

    status, doc, server_header = asyncio.run(go())
    assert status == 500 and "secret" not in doc["error"] and "RuntimeError" not in doc["error"], doc
    assert "log" in doc["error"] and server_header == "staronnx"
    assert "secret /home/someone/plans/x" in caplog.text


# -- D5: SIGTERM answers the requests in transit -----------------------------------------------
def test_d5_sigterm_answers_requests_in_transit_with_503_and_drains_the_accepted(plan, tmp_path):
    """A connection mid-body at SIGTERM gets 503 (not a reset, not held for --drain-timeout);
    the accepted requests (waiting up to 3 s for a batch) are answered; a request sent during
    the drain gets UNAVAILABLE; the process exits 0."""
    import signal
    import threading

    s = start_server([plan.root], tmp_path, "--name", "tiny", "--policy", "eager", "--batch-size", "4",
                     "--max-delay", "3s", "--drain-timeout", "60s")
    try:
        host, port = s.http.rsplit(":", 1)
        in_transit = socket.create_connection((host, int(port)), timeout=30)  # read timeout < drain timeout
        in_transit.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 1000\r\n\r\n{\"inputs\": [")
        results: dict[str, object] = {}

        def accepted(kind: str) -> None:
            try:
                x = _x(1, seed=3)
                if kind == "http":
                    inp = thttp.InferInput("x", [1, 8], "FP32")
                    inp.set_data_from_numpy(x)
                    results[kind] = thttp.InferenceServerClient(s.http).infer("tiny", [inp]).as_numpy("y")
                else:
                    inp = tgrpc.InferInput("x", [1, 8], "FP32")
                    inp.set_data_from_numpy(x)
                    results[kind] = tgrpc.InferenceServerClient(s.grpc).infer("tiny", [inp]).as_numpy("y")
            except BaseException as exc:  # noqa: BLE001
                results[kind] = exc

        threads = [threading.Thread(target=accepted, args=(k,)) for k in ("http", "grpc")]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while _m(_metrics(s.metrics), "staronnx_queue_length", model="tiny") != 2:
            assert time.monotonic() < deadline, "the two requests never waited together"
            time.sleep(0.01)
        g = tgrpc.InferenceServerClient(s.grpc)
        s.proc.send_signal(signal.SIGTERM)
        status, headers, body = _raw_reply(in_transit)
        assert status == 503 and "shutting down" in json.loads(body)["error"], (status, body)
        late = None
        try:
            deadline = time.monotonic() + 20
            while g.is_server_ready() and time.monotonic() < deadline:
                time.sleep(0.01)
            inp = tgrpc.InferInput("x", [1, 8], "FP32")
            inp.set_data_from_numpy(_x(1))
            g.infer("tiny", [inp])
        except Exception as exc:  # noqa: BLE001 - the drain may have ended and the listener closed
            late = exc
        assert late is not None and "UNAVAILABLE" in str(late.status() if hasattr(late, "status") else late), late
        for t in threads:
            t.join(30)
        for kind in ("http", "grpc"):
            assert isinstance(results.get(kind), np.ndarray), results
            _check(plan, _x(1, seed=3), results[kind])
        assert s.proc.wait(30) == 0
        assert "Traceback" not in "\n".join(s.lines)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def _raw_reply(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The answer on ``sock``, as soon as it is whole (a reset or a close first fails the test)."""
    with sock:
        buf = b""
        while True:
            head, sep, body = buf.partition(b"\r\n\r\n")
            if sep:
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
                if len(body) >= int(headers.get("content-length", "0")):
                    return int(lines[0].split()[1]), headers, body
            chunk = sock.recv(65536)
            assert chunk, "the connection was closed without an answer"
            buf += chunk
