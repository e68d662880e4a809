"""String tensors (KServe v2 ``BYTES``) served from ONNX ``tensor(string)`` (issue 49, item 4),
through Triton's own clients against ``staronnx serve`` on loopback.

The models are built with onnx.helper at test time: Triton's ``simple_string`` (INPUT0, INPUT1:
BYTES [-1, 16] holding decimal numbers; OUTPUT0 their sum and OUTPUT1 their difference, as
strings; in ONNX: Cast string -> int32, Add/Sub, Cast back), ``simple_identity`` (a BYTES tensor
returned as it came: embedded NUL characters, control bytes, non-ASCII text) and a model with a
bfloat16 input, which KServe v2 has no datatype for here: it must fail alone, its reason in the
repository index, while the string models serve.

Each block makes the calls Triton's examples ``simple_{http,grpc}_string_infer_client.py`` and
``grpc_explicit_byte_content_client.py`` make: binary and JSON tensors over HTTP, raw and
``bytes_contents`` over gRPC.
"""

from __future__ import annotations

import json
import urllib.request

import grpc
import numpy as np
import onnx
import pytest

pytest.importorskip("tritonclient", reason="needs Triton's clients (tritonclient: pip install -e '.[dev]')")
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from test_serve import start_server
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

from staronnx import partition
from staronnx.partition import PartitionSpec

pytestmark = pytest.mark.timeout(180)


def _model(name: str, nodes: list, ins: list, outs: list) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, ins, outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def simple_string_model() -> onnx.ModelProto:
    """Triton's ``simple_string``: decimal numbers in, their sum and difference out, as text."""
    ins = [helper.make_tensor_value_info(n, TensorProto.STRING, ["batch", 16]) for n in ("INPUT0", "INPUT1")]
    outs = [helper.make_tensor_value_info(n, TensorProto.STRING, ["batch", 16]) for n in ("OUTPUT0", "OUTPUT1")]
    nodes = [helper.make_node("Cast", ["INPUT0"], ["a"], to=TensorProto.INT32),
             helper.make_node("Cast", ["INPUT1"], ["b"], to=TensorProto.INT32),
             helper.make_node("Add", ["a", "b"], ["sum"]),
             helper.make_node("Sub", ["a", "b"], ["diff"]),
             helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=TensorProto.STRING),
             helper.make_node("Cast", ["diff"], ["OUTPUT1"], to=TensorProto.STRING)]
    return _model("simple_string", nodes, ins, outs)


def identity_model() -> onnx.ModelProto:
    """Triton's ``simple_identity`` in ONNX: a BYTES [batch, n] tensor back as it came."""
    return _model("simple_identity", [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
                  [helper.make_tensor_value_info("INPUT0", TensorProto.STRING, ["batch", "n"])],
                  [helper.make_tensor_value_info("OUTPUT0", TensorProto.STRING, ["batch", "n"])])


def bfloat16_model() -> onnx.ModelProto:
    return _model("bf16", [helper.make_node("Identity", ["x"], ["y"])],
                  [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["batch", 4])],
                  [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, ["batch", 4])])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("strings")
    onnx.save(simple_string_model(), str(root / "simple_string.onnx"))
    onnx.save(identity_model(), str(root / "simple_identity.onnx"))
    onnx.save(bfloat16_model(), str(root / "bf16.onnx"))
    plans = [partition(root / "simple_string.onnx", spec=PartitionSpec(parts=1, costs="estimate"),
                       output_dir=root / "simple_string"),
             partition(root / "simple_identity.onnx",
                       spec=PartitionSpec(parts=1, costs="estimate", input_shapes=["INPUT0=1x4"]),
                       output_dir=root / "simple_identity"),
             partition(root / "bf16.onnx", spec=PartitionSpec(parts=1, costs="estimate"), output_dir=root / "bf16")]
    s = start_server([p.root for p in plans], root, "--policy", "eager", "--batch-size", "8", "--max-delay", "1ms",
                     "--drain-timeout", "10s")
    yield s
    assert s.stop() == 0, "\n".join(s.lines)


def _numbers() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The examples' data: 0..15 and 1 (as numbers, and as the strings sent)."""
    in0 = np.arange(16, dtype=np.int32).reshape(1, 16)
    in1 = np.ones((1, 16), dtype=np.int32)
    as_text = np.vectorize(lambda v: str(v).encode("utf-8"), otypes=[object])
    return in0, in1, as_text(in0), as_text(in1)


def _check_sum_difference(results, in0: np.ndarray, in1: np.ndarray) -> None:
    out0, out1 = results.as_numpy("OUTPUT0"), results.as_numpy("OUTPUT1")
    assert out0.dtype == object and out0.shape == (1, 16)
    assert [int(v) for v in out0.ravel()] == list((in0 + in1).ravel())
    assert [int(v) for v in out1.ravel()] == list((in0 - in1).ravel())


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_http_simple_string(served, binary):
    """simple_http_string_infer_client.py: BYTES in and out, binary and JSON."""
    client = httpclient.InferenceServerClient(served.http)
    in0, in1, text0, text1 = _numbers()
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "BYTES"), httpclient.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_data_from_numpy(text0, binary_data=binary)
    inputs[1].set_data_from_numpy(text1, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")]
    results = client.infer("simple_string", inputs, outputs=outputs)
    assert results.get_output("OUTPUT0")["datatype"] == "BYTES"
    _check_sum_difference(results, in0, in1)


def test_grpc_simple_string(served):
    """simple_grpc_string_infer_client.py: BYTES as raw_input_contents, back as raw_output_contents."""
    client = grpcclient.InferenceServerClient(served.grpc)
    in0, in1, text0, text1 = _numbers()
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "BYTES"), grpcclient.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_data_from_numpy(text0)
    inputs[1].set_data_from_numpy(text1)
    results = client.infer("simple_string", inputs)
    _check_sum_difference(results, in0, in1)


def test_grpc_bytes_contents(served):
    """grpc_explicit_byte_content_client.py: BYTES in the typed ``bytes_contents`` field."""
    import grpc

    in0, in1, text0, text1 = _numbers()
    request = service_pb2.ModelInferRequest(model_name="simple_string")
    for name, values in (("INPUT0", text0), ("INPUT1", text1)):
        tensor = request.inputs.add(name=name, datatype="BYTES", shape=[1, 16])
        tensor.contents.bytes_contents.extend(values.ravel().tolist())
    with grpc.insecure_channel(served.grpc) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    by_name = {o.name: (o, raw) for o, raw in zip(response.outputs, response.raw_output_contents)}
    out, raw = by_name["OUTPUT0"]
    assert out.datatype == "BYTES" and list(out.shape) == [1, 16]
    assert raw == serialize_byte_tensor(np.array([str(v).encode() for v in (in0 + in1).ravel()], dtype=object)).item()


SAMPLES = [np.array([["he\x00llo".encode()] * 16], dtype=object),  # an embedded NUL
           np.array([[b"\x00\x01\x02\x03"] * 16], dtype=np.bytes_),  # control bytes
           np.array([["grüße, 世界".encode()] * 3 + [b""]], dtype=object)]  # non-ASCII text, an empty element


@pytest.mark.parametrize("sample", range(len(SAMPLES)))
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_http_identity_keeps_every_byte(served, sample, binary):
    """simple_http_string_infer_client.py's identity calls: the elements come back unchanged."""
    data = SAMPLES[sample]
    client = httpclient.InferenceServerClient(served.http)
    tensor = httpclient.InferInput("INPUT0", list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data, binary_data=binary)
    results = client.infer("simple_identity", [tensor],
                           outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)])
    got = results.as_numpy("OUTPUT0")
    back = [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in got.ravel()]
    assert back == [bytes(v) for v in data.ravel()]


def test_grpc_identity_keeps_every_byte(served):
    data = SAMPLES[0]
    client = grpcclient.InferenceServerClient(served.grpc)
    tensor = grpcclient.InferInput("INPUT0", list(data.shape), "BYTES")
    tensor.set_data_from_numpy(data)
    got = client.infer("simple_identity", [tensor]).as_numpy("OUTPUT0")
    assert got.tolist() == data.tolist()


def test_malformed_bytes_are_refused_by_name(served):
    """A length prefix running past the data, bytes left over, text that is not UTF-8: 400 naming
    the input (never a server error), and the server keeps answering."""
    client = httpclient.InferenceServerClient(served.http)
    good = serialize_byte_tensor(np.array([b"1"] * 16, dtype=object)).item()
    for raw, words in ((good[:-1], "are left in its data"), (good + b"x", "bytes follow"),
                       (b"".join(len(b).to_bytes(4, "little") + b for b in [b"\xff\xfe"] * 16), "not UTF-8")):
        header = json.dumps({"inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "BYTES", "parameters": {"binary_data_size": len(raw)}},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "BYTES", "data": ["1"] * 16}]}).encode()
        req = urllib.request.Request(f"http://{served.http}/v2/models/simple_string/infer", data=header + raw,
                                     headers={"Inference-Header-Content-Length": str(len(header))})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        assert info.value.code == 400
        message = json.loads(info.value.read())["error"]
        assert "'INPUT0'" in message and words in message, message
    with pytest.raises(InferenceServerException, match="is not a string"):
        tensor = httpclient.InferInput("INPUT0", [1, 16], "BYTES")
        tensor._data = list(range(16))  # JSON numbers where BYTES takes strings
        other = httpclient.InferInput("INPUT1", [1, 16], "BYTES")
        other.set_data_from_numpy(np.array([[b"1"] * 16], dtype=object), binary_data=False)
        client.infer("simple_string", [tensor, other])
    in0, in1, text0, text1 = _numbers()
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "BYTES"), httpclient.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_data_from_numpy(text0)
    inputs[1].set_data_from_numpy(text1)
    _check_sum_difference(client.infer("simple_string", inputs), in0, in1)


def test_a_json_string_that_is_not_text_is_refused_by_name(served):
    """A JSON BYTES element with an unpaired surrogate (the escape ``"\\ud800"``, or its UTF-8-style
    bytes ED A0 80 in the body) is no text ONNX Runtime can take: 400 naming the input and the
    element, as a binary element that is not UTF-8 is, never a 500 from the model's worker (which
    would fail every request batched with it); the server keeps answering."""
    for element in (b'"\\ud800"', b'"\xed\xa0\x80"'):
        body = (b'{"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "BYTES", "data": ["ok", '
                + element + b']}]}')
        req = urllib.request.Request(f"http://{served.http}/v2/models/simple_identity/infer", data=body)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        message = json.loads(info.value.read())["error"]
        assert info.value.code == 400, message
        assert "'INPUT0'" in message and "element 1" in message, message
    client = httpclient.InferenceServerClient(served.http)
    tensor = httpclient.InferInput("INPUT0", [1, 2], "BYTES")
    tensor.set_data_from_numpy(np.array([["a", "\u00e9"]], dtype=object), binary_data=False)
    assert client.infer("simple_identity", [tensor]).as_numpy("OUTPUT0").tolist() == [[b"a", "\u00e9".encode()]]


def test_a_bytes_shape_its_data_cannot_hold_is_refused_before_anything_is_allocated(served):
    """A binary BYTES input whose shape claims more elements than its bytes can hold (each takes
    at least its 4-byte length) is 400 / INVALID_ARGUMENT naming the input, as a short buffer of
    a numeric input is: never a 500 from an array of the claimed size (2**40 elements asked
    room for 8 TiB, and a few GiB would have been taken, from a 5-byte tensor)."""
    raw = (1).to_bytes(4, "little") + b"a"
    for shape in ([1, 10**30], [1, 2**40]):
        header = json.dumps({"inputs": [{"name": "INPUT0", "shape": shape, "datatype": "BYTES",
                                         "parameters": {"binary_data_size": len(raw)}}]}).encode()
        req = urllib.request.Request(f"http://{served.http}/v2/models/simple_identity/infer", data=header + raw,
                                     headers={"Inference-Header-Content-Length": str(len(header))})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        message = json.loads(info.value.read())["error"]
        assert info.value.code == 400 and "'INPUT0'" in message and "BYTES elements" in message, message
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(served.grpc))
    request = service_pb2.ModelInferRequest(model_name="simple_identity")
    request.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, 2**40])
    request.raw_input_contents.append(raw)
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "BYTES elements" in err.value.details()
    client = httpclient.InferenceServerClient(served.http)
    tensor = httpclient.InferInput("INPUT0", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"a"]], dtype=object))
    assert client.infer("simple_identity", [tensor]).as_numpy("OUTPUT0").tolist() == [[b"a"]]


def test_metadata_and_config_say_bytes(served):
    """Metadata speaks the protocol's BYTES, the model config Triton's TYPE_STRING."""
    client = httpclient.InferenceServerClient(served.http)
    meta = client.get_model_metadata("simple_string")
    assert {t["datatype"] for t in meta["inputs"] + meta["outputs"]} == {"BYTES"}
    config = client.get_model_config("simple_string")
    assert {t["data_type"] for t in config["input"] + config["output"]} == {"TYPE_STRING"}
    grpc_config = grpcclient.InferenceServerClient(served.grpc).get_model_config("simple_string").config
    assert {t.data_type for t in grpc_config.input} == {grpcclient.model_config_pb2.TYPE_STRING}


def test_a_model_that_cannot_be_served_fails_alone(served):
    """bf16 has no v2 datatype here: the start line and the repository index say why, the model is
    not ready and its requests are refused with the reason, while the string models serve."""
    assert any("model 'bf16' is not served" in line and "bfloat16" in line for line in served.lines)
    client = httpclient.InferenceServerClient(served.http)
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["bf16"]["state"] == "UNAVAILABLE" and "bfloat16" in index["bf16"]["reason"]
    assert index["simple_string"]["state"] == "READY"
    assert not client.is_model_ready("bf16") and client.is_model_ready("simple_string")
    with pytest.raises(InferenceServerException, match="bfloat16"):
        client.get_model_metadata("bf16")
    grpc_index = grpcclient.InferenceServerClient(served.grpc).get_model_repository_index()
    assert {m.name: m.state for m in grpc_index.models}["bf16"] == "UNAVAILABLE"
