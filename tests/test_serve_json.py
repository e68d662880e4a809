"""JSON tensors over HTTP (issue 21, "JSON tensors"): what a request's ``data`` means, and what a
response's ``data`` reads back as, are exactly what ``json.loads`` + ``np.asarray`` and
``tolist()`` + ``json.dumps`` made of them, now that the server reads ``data`` straight into numpy
buffers (simdjson) and writes outputs from them (orjson), on worker threads for large bodies.

The server is the real CLI on loopback serving an *echo* model (one Identity per datatype), so
each answer shows the tensor the server decoded, bit for bit. Every expectation is computed in
this process from the request's own text with the standard library and numpy: the old path's
meaning, which the fast path must not change, for every value its datatype takes. Values it
does not take (issue 36: a string, a boolean or ``null`` among numbers, a float in an integer
tensor, a value out of range) are refused 400, naming the input and the first such value, where
numpy used to convert them.
"""

from __future__ import annotations

import json
import math
import os
import platform
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest
# a skip, not a collection error, where Triton's clients are absent (the GPU host)
pytest.importorskip("tritonclient", reason="needs Triton's clients (tritonclient: pip install -e '.[dev]')")
import tritonclient.http as thttp
from onnx import TensorProto, helper
from test_serve import _post, serving

from staronnx import partition
from staronnx.partition import PartitionSpec

pytestmark = pytest.mark.timeout(180)

#: input name -> (v2 datatype, ONNX type, numpy dtype); each echoed as "o_<name>"
TYPES = {
    "f32": ("FP32", TensorProto.FLOAT, np.float32),
    "f16": ("FP16", TensorProto.FLOAT16, np.float16),
    "f64": ("FP64", TensorProto.DOUBLE, np.float64),
    "i32": ("INT32", TensorProto.INT32, np.int32),
    "i64": ("INT64", TensorProto.INT64, np.int64),
    "u8": ("UINT8", TensorProto.UINT8, np.uint8),
    "u64": ("UINT64", TensorProto.UINT64, np.uint64),
    "b": ("BOOL", TensorProto.BOOL, np.bool_),
}
WIDTH = 4
#: the wide input: a batch of 4 is 32,768 values (~700 KB of JSON), decoded and encoded on a worker thread
BIG = 8192


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("json")
    ins = [helper.make_tensor_value_info(n, t, ["batch", WIDTH]) for n, (_, t, _) in TYPES.items()]
    ins.append(helper.make_tensor_value_info("big", TensorProto.FLOAT, ["batch", BIG]))
    outs = [helper.make_tensor_value_info("o_" + n, t, ["batch", WIDTH]) for n, (_, t, _) in TYPES.items()]
    outs.append(helper.make_tensor_value_info("o_big", TensorProto.FLOAT, ["batch", BIG]))
    nodes = [helper.make_node("Identity", [n], ["o_" + n]) for n in [*TYPES, "big"]]
    model = helper.make_model(helper.make_graph(nodes, "echo", ins, outs),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(root / "echo.onnx"))
    return partition(root / "echo.onnx", spec=PartitionSpec(parts=1, method="linear", costs="estimate"),
                     output_dir=root / "echo")


@pytest.fixture(scope="module")
def server(plan, tmp_path_factory):
    yield from serving([plan.root], tmp_path_factory.mktemp("server"), "--name", "echo", "--policy", "eager",
                       "--batch-size", "4", "--max-delay", "2ms", "--max-body", "16MiB", "--drain-timeout", "10s")


def _default(name: str, rows: int = 1) -> list:
    if name == "big":
        return [0.5] * (rows * BIG)
    if name == "b":
        return [True, False, True, False] * rows
    return [1, 2, 3, 4] * rows


def _request(overrides: dict[str, str], rows: int = 1, extra: str = "") -> bytes:
    """A JSON inference request as text, so that each test says byte for byte what ``data`` is:
    every input at its default unless ``overrides`` gives its ``data`` text."""
    specs = []
    for name in [*TYPES, "big"]:
        datatype = TYPES[name][0] if name in TYPES else "FP32"
        data = overrides.get(name, json.dumps(_default(name, rows)))
        width = BIG if name == "big" else WIDTH
        specs.append(f'{{"name": "{name}", "shape": [{rows}, {width}], "datatype": "{datatype}", "data": {data}}}')
    return ('{"inputs": [' + ", ".join(specs) + "]" + extra + "}").encode()


def _expected(data_text: str, name: str, rows: int = 1) -> np.ndarray:
    """What the old path made of ``data``: json.loads, then np.asarray to the input's dtype."""
    dtype = TYPES[name][2] if name in TYPES else np.float32
    with np.errstate(over="ignore"):  # 1e10 as f16 is inf, which numpy warns about: the case tested
        return np.asarray(json.loads(data_text), dtype=dtype).reshape(rows, -1)


def _answer(doc: dict, name: str) -> dict:
    return next(o for o in doc["outputs"] if o["name"] == "o_" + name)


def _echoed(doc: dict, name: str) -> np.ndarray:
    out = _answer(doc, name)
    dtype = TYPES[name][2] if name in TYPES else np.float32
    return np.asarray(out["data"], dtype=dtype).reshape(out["shape"])


def _same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes(), (a, b)


def test_flat_data_of_every_numeric_datatype_decodes_as_before(server):
    """The values tritonclient writes (floats widened to 17 digits), edge values of each type."""
    f32 = np.random.default_rng(3).standard_normal(WIDTH).astype(np.float32)
    texts = {
        "f32": json.dumps([v.item() for v in f32]),
        "f16": "[0.1, 65504, -0.00006103515625, 1e-8]",
        "f64": "[0.1, 1e308, -2.5e-308, 3]",
        "i32": "[-2147483648, 2147483647, 0, -1]",
        "i64": "[-9223372036854775808, 9223372036854775807, 7, -7]",
        "u8": "[0, 255, 128, 1]",
        "u64": "[0, 9223372036854775807, 18446744073709551615, 1]",  # past int64: the list path
    }
    status, doc = _post(server.http, "/v2/models/echo/infer", _request(texts))
    assert status == 200, doc
    for name, text in texts.items():
        _same_bits(_echoed(doc, name), _expected(text, name))
    _same_bits(_echoed(doc, "b"), _expected(json.dumps(_default("b")), "b"))


@pytest.mark.parametrize(("name", "data", "words"), [
    ("f32", "[1, 2.5, true, -3]", "data[2] = true is not a number"),
    ("i32", "[1.9, -1.9, 2, 3]", "data[0] = 1.9 is not an integer"),
    ("i64", "[true, false, 5, 6]", "data[0] = true is not an integer"),
    ("b", "[1, 0, 1, 0]", "data[0] = 1 is not true or false"),
])
def test_values_of_another_kind_are_refused_by_position(server, name, data, words):
    """A boolean among numbers, a fraction in an integer tensor, numbers in a BOOL one: numpy
    converted them (True became 1.0, 1.9 became 1); now 400, naming the input and the value."""
    status, doc = _post(server.http, "/v2/models/echo/infer", _request({name: data}))
    assert status == 400 and f"input {name!r}: {words}" in doc["error"], doc


def test_integers_in_float_tensors_and_integral_floats_in_integer_ones_convert(server):
    """What a datatype does take converts as numpy converts it: integers are numbers, 2.0 an integer."""
    texts = {"f32": "[1, 2.5, 3, -4]", "f16": "[1, 2, 3, 4]", "i32": "[2.0, -3.0, 4, 5]", "u8": "[0.0, 255, 1, 2]"}
    status, doc = _post(server.http, "/v2/models/echo/infer", _request(texts))
    assert status == 200, doc
    for name, text in texts.items():
        _same_bits(_echoed(doc, name), _expected(text, name))


def test_nested_rectangular_data_equals_flat(server):
    rows = 2
    nested = json.dumps([[1.25, 2.5, 3.75, 5.0], [6.25, 7.5, 8.75, 10.0]])
    status, doc = _post(server.http, "/v2/models/echo/infer",
                        _request({"f32": nested, "i32": "[[1, 2], [3, 4], [5, 6], [7, 8]]",
                                  "f64": "[[[1, 2, 3, 4]], [[5, 6, 7, 8]]]"}, rows=rows))
    assert status == 200, doc
    _same_bits(_echoed(doc, "f32"), _expected(nested, "f32", rows))
    _same_bits(_echoed(doc, "i32"), np.arange(1, 9, dtype=np.int32).reshape(rows, WIDTH))
    _same_bits(_echoed(doc, "f64"), np.arange(1, 9, dtype=np.float64).reshape(rows, WIDTH))


@pytest.mark.parametrize("data", [
    "[[1, 2, 3, 4], []]",  # ragged: as many numbers as the shape holds once flattened
    "[[1, 2], [3, 4, 5], [6]]",
    "[1, 2, 3, [4]]",  # an array where a number belongs
    "[[1, 2], 3, 4]",
    "[[1, 2], [3, [4]]]",
    "[[[1, 2]], [[3], [4]]]",
])
def test_ragged_nests_are_refused_as_before(server, data):
    """A nest np.asarray refuses is 400 with the old message, though its values flattened would
    fill the shape (the fast path must not flatten it through)."""
    with pytest.raises(ValueError):
        np.asarray(json.loads(data), dtype=np.float32)
    status, doc = _post(server.http, "/v2/models/echo/infer", _request({"f32": data}))
    assert status == 400 and "input 'f32': data is not a (nested) list of FP32 values" in doc["error"], doc


@pytest.mark.parametrize(("name", "data", "words"), [
    ("u8", "[256, 0, 0, 0]", "data[0] = 256 is out of the range of UINT8"),
    ("u8", "[-1, 0, 0, 0]", "data[0] = -1 is out of the range of UINT8"),
    ("i32", "[2147483648, 0, 0, 0]", "data[0] = 2147483648 is out of the range of INT32"),
    ("i64", "[9223372036854775808, 0, 0, 0]", "data[0] = 9223372036854775808 is out of the range of INT64"),
    ("u64", "[-1, 0, 0, 0]", "data[0] = -1 is out of the range of UINT64"),
    ("f32", '[1, 2, "3", 4]', 'data[2] = "3" is not a number'),
    ("f32", "[1, 2, null, 4]", "data[2] = null is not a number"),
    ("f32", '[1, 2, "x", 4]', 'data[2] = "x" is not a number'),
    ("f32", "[1, 2, {}, 4]", "data[2] = {} is not a number"),
    ("f16", "[1e10, 0, 0, 0]", "data[0] = 10000000000.0 is out of the range of FP16"),
    ("f32", "[3.5e38, 0, 0, 0]", "data[0] = 3.5e+38 is out of the range of FP32"),
    ("i32", "[[1, 2], [3, 4.5]]", "data[3] = 4.5 is not an integer"),
])
def test_values_out_of_range_or_of_another_kind_are_400_naming_input_and_element(server, name, data, words):
    """Out of the type's range (numpy raised for integers and made an infinity of a float) or
    not of its kind (a string, null, an object; a fraction in a nested integer tensor): 400
    naming the input and the position of the first such value in the flattened data."""
    status, doc = _post(server.http, "/v2/models/echo/infer", _request({name: data}))
    assert status == 400 and f"input {name!r}: {words}" in doc["error"], doc


def test_wrong_count_and_shape_messages_are_unchanged(server):
    status, doc = _post(server.http, "/v2/models/echo/infer", _request({"f32": "[1, 2, 3]"}))
    assert status == 400 and "input 'f32': 3 values of data, but shape [1, 4] holds 4" in doc["error"], doc
    status, doc = _post(server.http, "/v2/models/echo/infer", _request({"f32": "[[1, 2, 3, 4, 5]]"}))
    assert status == 400 and "5 values of data, but shape [1, 4] holds 4" in doc["error"], doc


def test_non_finite_values_are_read_and_sent_back_with_the_binary_extension(server):
    """NaN and Infinity (not JSON, but Python's json and tritonclient write them) are read as
    before; an output holding them goes back with the binary extension, exact, and the JSON part
    of the response stays valid JSON (the other outputs as JSON data)."""
    req = urllib.request.Request(f"http://{server.http}/v2/models/echo/infer", method="POST",
                                 data=_request({"f32": "[NaN, Infinity, -Infinity, 1.5]"}))
    with urllib.request.urlopen(req, timeout=60) as resp:
        raw, length = resp.read(), int(resp.headers["Inference-Header-Content-Length"])

    def refuse(token: str) -> None:
        raise ValueError(f"{token} is not JSON")

    doc = json.loads(raw[:length], parse_constant=refuse)
    entry = _answer(doc, "f32")
    assert entry["parameters"] == {"binary_data_size": 16} and "data" not in entry
    got = np.frombuffer(raw[length:], np.float32)
    assert math.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf and got[3] == 1.5
    _same_bits(_echoed(doc, "i32"), _expected(json.dumps(_default("i32")), "i32"))


def test_a_bracket_inside_a_string_does_not_change_the_values(server):
    """'[' in the request id: the count of arrays disagrees, and the data is read the slow way."""
    status, doc = _post(server.http, "/v2/models/echo/infer",
                        _request({"f32": "[[0.5, 1.5, 2.5, 3.5]]"}, extra=', "id": "a[b[c"'))
    assert status == 200 and doc["id"] == "a[b[c", doc
    _same_bits(_echoed(doc, "f32"), np.array([[0.5, 1.5, 2.5, 3.5]], dtype=np.float32))


def test_outputs_read_back_as_the_doubles_json_dumps_wrote(server):
    """Each FP32 output value, read as a double, is the float32 widened (what tolist() and
    json.dumps gave): a float64 reader sees the same number as before, a float32 reader the same bits."""
    x = np.random.default_rng(7).standard_normal((4, BIG)).astype(np.float32)
    x[0, :8] = [0.1, 1e-45, 3.4028235e38, -0.0, 1e-5, 123456.789, 2.0**-126, 1.0]
    text = json.dumps([v.item() for v in x.ravel()])
    status, doc = _post(server.http, "/v2/models/echo/infer", _request({"big": text}, rows=4))
    assert status == 200, doc
    data = _answer(doc, "big")["data"]
    assert data == x.astype(np.float64).ravel().tolist()
    assert math.copysign(1.0, data[3]) == -1.0  # -0.0 stays negative
    _same_bits(_echoed(doc, "big"), x)


def test_large_json_requests_from_tritonclient_in_parallel_are_all_exact(server):
    """Large bodies decode and encode on worker threads: 24 concurrent requests, each its own
    values, each answered with its own values (no parser shared across threads)."""
    def one(seed: int) -> bool:
        client = thttp.InferenceServerClient(server.http)
        rng = np.random.default_rng(seed)
        inputs, want = [], {}
        for name in [*TYPES, "big"]:
            datatype = TYPES[name][0] if name in TYPES else "FP32"
            width = BIG if name == "big" else WIDTH
            dtype = TYPES[name][2] if name in TYPES else np.float32
            arr = (rng.standard_normal((2, width)) * 50).astype(dtype)
            inp = thttp.InferInput(name, [2, width], datatype)
            inp.set_data_from_numpy(arr, binary_data=False)
            inputs.append(inp)
            want[name] = arr
        outs = [thttp.InferRequestedOutput("o_" + n, binary_data=False) for n in want]
        res = client.infer("echo", inputs, outputs=outs)
        for name, arr in want.items():
            _same_bits(res.as_numpy("o_" + name), arr)
        return True

    with ThreadPoolExecutor(6) as pool:
        assert all(pool.map(one, range(24)))


def test_metadata_and_binary_requests_are_unaffected(server):
    with urllib.request.urlopen(f"http://{server.http}/v2/models/echo", timeout=30) as resp:
        meta = json.loads(resp.read())
    assert [t["name"] for t in meta["inputs"]] == [*TYPES, "big"]
    client = thttp.InferenceServerClient(server.http)
    inputs = []
    want = {}
    for name in [*TYPES, "big"]:
        datatype = TYPES[name][0] if name in TYPES else "FP32"
        width = BIG if name == "big" else WIDTH
        arr = np.ones((1, width), dtype=TYPES[name][2] if name in TYPES else np.float32)
        inp = thttp.InferInput(name, [1, width], datatype)
        inp.set_data_from_numpy(arr, binary_data=True)
        inputs.append(inp)
        want[name] = arr
    res = client.infer("echo", inputs, outputs=[thttp.InferRequestedOutput("o_" + n, binary_data=True) for n in want])
    for name, arr in want.items():
        _same_bits(res.as_numpy("o_" + name), arr)


def _minor_faults(pid: int) -> int:
    """Minor page faults of process ``pid`` so far (``/proc/<pid>/stat``, field 10)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


@pytest.mark.skipif(not os.path.exists("/proc/self/stat") or platform.libc_ver()[0] != "glibc",
                    reason="reads page faults from /proc; the tuning is glibc's (keep_freed_memory)")
def test_a_warm_server_reuses_its_memory_for_large_bodies(server):
    """Eight clients sending 2.6 MB JSON bodies: once warm, a request costs the server a few page
    faults (2-11 measured), not one (and a page zeroed by the kernel) for most of the 4 KiB pages
    its buffers span: 330-520 of 661 with glibc's defaults, which hand freed buffers back to
    the kernel (see staronnx.serve.app.keep_freed_memory)."""
    rows = 16  # 131,072 values in "big", as tritonclient writes them: a 2.6 MB body; only o_f32 comes back
    big = np.random.default_rng(5).standard_normal(rows * BIG).astype(np.float32)
    body = _request({"big": json.dumps([v.item() for v in big])}, rows=rows, extra=', "outputs": [{"name": "o_f32"}]')
    assert len(body) > 2_000_000

    def post(_: int) -> int:
        status, doc = _post(server.http, "/v2/models/echo/infer", body)
        assert status == 200, doc
        return len(doc["outputs"])

    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(post, range(48))) == {1}  # warm-up: the buffers reach their peak
        before = _minor_faults(server.proc.pid)
        assert set(pool.map(post, range(96))) == {1}
        per_request = (_minor_faults(server.proc.pid) - before) / 96
    pages = len(body) / 4096
    assert per_request < 0.1 * pages, f"{per_request:.0f} page faults per request of {pages:.0f} pages"
