"""``staronnx serve`` as a drop-in for Triton (issue 21, items 1-5): Triton's example client
programs, run against the models they expect, with nothing changed but the model name and the
address.

The programs live in Triton's client repository (``src/python/examples/``); a test cannot
download them, so each block below repeats, call for call and check for check, what one of them
does (its name is given), with ``sys.exit(1)`` turned into a failing assertion. The one
deliberate difference: the health examples check the server's name is ``"triton"``; staronnx
keeps its own name (issue 21, item 4), so those blocks check ``"staronnx"``.

The models are built to the examples' spec with onnx.helper: ``simple`` (INPUT0, INPUT1: INT32
[-1, 16] -> OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, served with batches of up
to 8 as Triton's is) and an image classifier (FP32 [-1, 3, 32, 32] -> FP32 [-1, 10] scores,
with a ``labels.txt`` in its plan folder as Triton's model repository has), each partitioned
into one part and served by the real CLI in a subprocess. tritonclient's gRPC stubs live in
this process, the server's own in the server's (they share protobuf's descriptor names).
"""

from __future__ import annotations

import asyncio
import queue
import struct
import sys
from functools import partial
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
# a skip, not a collection error, where Triton's clients are absent (the GPU host)
pytest.importorskip("tritonclient", reason="needs Triton's clients (tritonclient: pip install -e '.[dev]')")
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.grpc.model_config_pb2 as mc
import tritonclient.http as httpclient
import tritonclient.http.aio as httpclient_aio
from onnx import TensorProto, helper
from test_serve import start_server
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from staronnx import partition
from staronnx.partition import PartitionSpec

pytestmark = pytest.mark.timeout(180)

LABELS = [f"class_{i}" for i in range(10)]


# -- the models the examples expect ------------------------------------------------------------
def simple_model() -> onnx.ModelProto:
    """Triton's ``simple``: two INT32 [batch, 16] inputs, their sum and difference."""
    ins = [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", 16]) for n in ("INPUT0", "INPUT1")]
    outs = [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", 16]) for n in ("OUTPUT0", "OUTPUT1")]
    nodes = [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"], name="add"),
             helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"], name="sub")]
    graph = helper.make_graph(nodes, "simple", ins, outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def image_model() -> onnx.ModelProto:
    """An image classifier's shape: FP32 [batch, 3, 32, 32] -> 10 softmax scores."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 10], rng.standard_normal((3, 10)).astype(np.float32).ravel())
    nodes = [helper.make_node("GlobalAveragePool", ["data"], ["pooled"], name="pool"),
             helper.make_node("Flatten", ["pooled"], ["flat"], name="flatten"),
             helper.make_node("MatMul", ["flat", "w"], ["logits"], name="fc"),
             helper.make_node("Softmax", ["logits"], ["prob"], name="softmax", axis=1)]
    graph = helper.make_graph(nodes, "classifier",
                              [helper.make_tensor_value_info("data", TensorProto.FLOAT, ["batch", 3, 32, 32])],
                              [helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["batch", 10])],
                              initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton")
    onnx.save(simple_model(), str(root / "simple.onnx"))
    onnx.save(image_model(), str(root / "image.onnx"))
    simple = partition(root / "simple.onnx", spec=PartitionSpec(parts=1, costs="estimate"), output_dir=root / "simple")
    image = partition(root / "image.onnx", spec=PartitionSpec(parts=1, costs="estimate"), output_dir=root / "image")
    (Path(image.root) / "labels.txt").write_text("\n".join(LABELS) + "\n")
    s = start_server([simple.root, image.root], root, "--name", "simple", "--name", "image_classifier",
                     "--policy", "eager", "--batch-size", "8", "--max-delay", "1ms", "--drain-timeout", "10s")
    s.image_root = Path(image.root)
    s.simple_root = Path(simple.root)
    yield s
    assert s.stop() == 0, "\n".join(s.lines)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """Two small RGB pictures (image_client takes a file or a folder)."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(1)
    for i in range(2):
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
    return folder


def _data() -> tuple[np.ndarray, np.ndarray]:
    input0_data = np.expand_dims(np.arange(start=0, stop=16, dtype=np.int32), axis=0)
    return input0_data, np.full(shape=(1, 16), fill_value=-1, dtype=np.int32)


def _validate(results, input0_data, input1_data) -> None:
    """The examples' own check: every sum and every difference."""
    output0_data = results.as_numpy("OUTPUT0")
    output1_data = results.as_numpy("OUTPUT1")
    for i in range(16):
        assert input0_data[0][i] + input1_data[0][i] == output0_data[0][i], "sync infer error: incorrect sum"
        assert input0_data[0][i] - input1_data[0][i] == output1_data[0][i], "sync infer error: incorrect difference"


# -- simple_http_infer_client.py ---------------------------------------------------------------
def _http_test_infer(triton_client, model_name, input0_data, input1_data, headers=None, outputs_too=True):
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(input0_data, binary_data=False)
    inputs[1].set_data_from_numpy(input1_data, binary_data=True)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)] if outputs_too else None
    return triton_client.infer(model_name, inputs, outputs=outputs, query_params={"test_1": 1, "test_2": 2},
                               headers=headers, request_compression_algorithm=None,
                               response_compression_algorithm=None)


def test_simple_http_infer_client(served):
    triton_client = httpclient.InferenceServerClient(url=served.http, verbose=False)
    model_name = "simple"
    input0_data, input1_data = _data()
    results = _http_test_infer(triton_client, model_name, input0_data, input1_data)
    statistics = triton_client.get_inference_statistics(model_name=model_name, headers=None)
    assert len(statistics["model_stats"]) == 1, "FAILED: Inference Statistics"
    _validate(results, input0_data, input1_data)
    results = _http_test_infer(triton_client, model_name, input0_data, input1_data, outputs_too=False)
    _validate(results, input0_data, input1_data)
    with pytest.raises(InferenceServerException) as ex:
        _http_test_infer(triton_client, "wrong_model_name", input0_data, input1_data).get_response()
    assert ex.value.message().startswith("Request for unknown model"), "improper error message for wrong model name"
    # the same with gzip and deflate request bodies (the example's --request-compression-algorithm)
    for algorithm in ("gzip", "deflate"):
        inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(input0_data, binary_data=False)
        inputs[1].set_data_from_numpy(input1_data, binary_data=True)
        _validate(triton_client.infer(model_name, inputs, request_compression_algorithm=algorithm),
                  input0_data, input1_data)


# -- simple_http_async_infer_client.py ---------------------------------------------------------
def test_simple_http_async_infer_client(served):
    triton_client = httpclient.InferenceServerClient(url=served.http, verbose=False, concurrency=4)
    model_name = "simple"
    input0_data, input1_data = _data()
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(input0_data, binary_data=False)
    inputs[1].set_data_from_numpy(input1_data, binary_data=True)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    async_requests = [triton_client.async_infer(model_name=model_name, inputs=inputs, outputs=outputs)
                      for _ in range(4)]
    for async_request in async_requests:
        _validate(async_request.get_result(), input0_data, input1_data)
    statistics = triton_client.get_inference_statistics(model_name=model_name)
    assert len(statistics["model_stats"]) == 1, "FAILED: Inference Statistics"


# -- simple_http_aio_infer_client.py -----------------------------------------------------------
def test_simple_http_aio_infer_client(served):
    async def test_infer(triton_client, model_name, input0_data, input1_data, outputs_too=True):
        inputs = [httpclient_aio.InferInput("INPUT0", [1, 16], "INT32"),
                  httpclient_aio.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(input0_data, binary_data=False)
        inputs[1].set_data_from_numpy(input1_data, binary_data=True)
        outputs = [httpclient_aio.InferRequestedOutput("OUTPUT0", binary_data=True),
                   httpclient_aio.InferRequestedOutput("OUTPUT1", binary_data=False)] if outputs_too else None
        return await triton_client.infer(model_name, inputs, outputs=outputs, query_params={"test_1": 1, "test_2": 2},
                                         headers=None)

    async def main() -> None:
        triton_client = httpclient_aio.InferenceServerClient(url=served.http, verbose=False)
        model_name = "simple"
        input0_data, input1_data = _data()
        results = await test_infer(triton_client, model_name, input0_data, input1_data)
        statistics = await triton_client.get_inference_statistics(model_name=model_name, headers=None)
        assert len(statistics["model_stats"]) == 1, "FAILED: Inference Statistics"
        _validate(results, input0_data, input1_data)
        _validate(await test_infer(triton_client, model_name, input0_data, input1_data, outputs_too=False),
                  input0_data, input1_data)
        try:
            (await test_infer(triton_client, "wrong_model_name", input0_data, input1_data)).get_response()
            raise AssertionError("expected error message for wrong model name")
        except InferenceServerException as ex:
            assert ex.message().startswith("Request for unknown model"), "improper error message for wrong model name"
        result_1, result_2 = await asyncio.gather(
            test_infer(triton_client, model_name, input0_data, input1_data),
            test_infer(triton_client, model_name, input0_data, input1_data, outputs_too=False))
        _validate(result_1, input0_data, input1_data)
        _validate(result_2, input0_data, input1_data)
        await triton_client.close()

    asyncio.run(main())


# -- simple_grpc_infer_client.py ---------------------------------------------------------------
def _grpc_inputs(client_module):
    inputs = [client_module.InferInput("INPUT0", [1, 16], "INT32"), client_module.InferInput("INPUT1", [1, 16], "INT32")]
    input0_data = np.expand_dims(np.arange(start=0, stop=16, dtype=np.int32), axis=0)
    input1_data = np.ones(shape=(1, 16), dtype=np.int32)
    inputs[0].set_data_from_numpy(input0_data)
    inputs[1].set_data_from_numpy(input1_data)
    outputs = [client_module.InferRequestedOutput("OUTPUT0"), client_module.InferRequestedOutput("OUTPUT1")]
    return inputs, outputs, input0_data, input1_data


def test_simple_grpc_infer_client(served):
    triton_client = grpcclient.InferenceServerClient(url=served.grpc, verbose=False)
    model_name = "simple"
    inputs, outputs, input0_data, input1_data = _grpc_inputs(grpcclient)
    results = triton_client.infer(model_name=model_name, inputs=inputs, outputs=outputs, client_timeout=None,
                                  headers={"test": "1"}, compression_algorithm=None)
    statistics = triton_client.get_inference_statistics(model_name=model_name)
    assert len(statistics.model_stats) == 1, "FAILED: Inference Statistics"
    _validate(results, input0_data, input1_data)
    results = triton_client.infer(model_name=model_name, inputs=inputs, outputs=None, compression_algorithm=None)
    _validate(results, input0_data, input1_data)
    # the example's -C gzip / deflate
    for algorithm in ("gzip", "deflate"):
        _validate(triton_client.infer(model_name=model_name, inputs=inputs, compression_algorithm=algorithm),
                  input0_data, input1_data)


# -- simple_grpc_async_infer_client.py ---------------------------------------------------------
def test_simple_grpc_async_infer_client(served):
    triton_client = grpcclient.InferenceServerClient(url=served.grpc, verbose=False)
    model_name = "simple"
    inputs, outputs, input0_data, input1_data = _grpc_inputs(grpcclient)
    user_data: queue.Queue = queue.Queue()

    def callback(user_data, result, error):
        user_data.put(error if error else result)

    triton_client.async_infer(model_name=model_name, inputs=inputs, callback=partial(callback, user_data),
                              outputs=outputs)
    data_item = user_data.get(timeout=60)  # the example polls until the callback has run
    assert not isinstance(data_item, InferenceServerException), data_item
    _validate(data_item, input0_data, input1_data)


# -- simple_grpc_aio_infer_client.py -----------------------------------------------------------
def test_simple_grpc_aio_infer_client(served):
    async def main() -> None:
        triton_client = grpcclient_aio.InferenceServerClient(url=served.grpc, verbose=False)
        model_name = "simple"
        inputs, outputs, input0_data, input1_data = _grpc_inputs(grpcclient_aio)
        results = await triton_client.infer(model_name=model_name, inputs=inputs, outputs=outputs, client_timeout=None,
                                            headers={"test": "1"}, compression_algorithm=None)
        statistics = await triton_client.get_inference_statistics(model_name=model_name)
        assert len(statistics.model_stats) == 1, "FAILED: Inference Statistics"
        _validate(results, input0_data, input1_data)
        result_1, result_2 = await asyncio.gather(
            triton_client.infer(model_name=model_name, inputs=inputs, outputs=None, compression_algorithm=None),
            triton_client.infer(model_name=model_name, inputs=inputs, outputs=None, compression_algorithm=None))
        _validate(result_1, input0_data, input1_data)
        _validate(result_2, input0_data, input1_data)
        await triton_client.close()

    asyncio.run(main())


# -- simple_http_health_metadata.py ------------------------------------------------------------
def test_simple_http_health_metadata(served):
    triton_client = httpclient.InferenceServerClient(url=served.http, verbose=False)
    model_name = "simple"
    assert triton_client.is_server_live(query_params={"test_1": 1, "test_2": 2}), "FAILED : is_server_live"
    assert triton_client.is_server_ready(), "FAILED : is_server_ready"
    assert triton_client.is_model_ready(model_name), "FAILED : is_model_ready"
    metadata = triton_client.get_server_metadata()
    assert metadata["name"] == "staronnx", "FAILED : get_server_metadata"  # the example: "triton"
    metadata = triton_client.get_model_metadata(model_name, query_params={"test_1": 1, "test_2": 2})
    assert metadata["name"] == model_name, "FAILED : get_model_metadata"
    with pytest.raises(InferenceServerException) as ex:
        triton_client.get_model_metadata("wrong_model_name")
    assert "Request for unknown model" in ex.value.message(), "FAILED : get_model_metadata wrong_model_name"


# -- simple_grpc_health_metadata.py ------------------------------------------------------------
def test_simple_grpc_health_metadata(served):
    triton_client = grpcclient.InferenceServerClient(url=served.grpc, verbose=False)
    model_name = "simple"
    assert triton_client.is_server_live(headers={"test": "1", "dummy": "2"}), "FAILED : is_server_live"
    assert triton_client.is_server_ready(), "FAILED : is_server_ready"
    assert triton_client.is_model_ready(model_name), "FAILED : is_model_ready"
    metadata = triton_client.get_server_metadata()
    assert metadata.name == "staronnx", "FAILED : get_server_metadata"  # the example: "triton"
    metadata = triton_client.get_model_metadata(model_name, headers={"test": "1", "dummy": "2"})
    assert metadata.name == model_name, "FAILED : get_model_metadata"
    with pytest.raises(InferenceServerException) as ex:
        triton_client.get_model_metadata("wrong_model_name")
    assert "Request for unknown model" in ex.value.message(), f"Got: {ex.value.message()}"
    config = triton_client.get_model_config(model_name)
    assert config.config.name == model_name, "FAILED: get_model_config"


# -- image_client.py (-i HTTP and -i gRPC; sync, -a async; -b 2 -c 3) ------------------------
class AttrDict(dict):
    """What image_client.py wraps HTTP's JSON metadata and config in (attrdict's AttrDict,
    unmaintained and not installed here): keys as attributes, recursively."""

    def __getattr__(self, key):
        try:
            return _attr(self[key])
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key, value):
        self[key] = value


def _attr(value):
    if isinstance(value, dict) and not isinstance(value, AttrDict):
        return AttrDict(value)
    if isinstance(value, list):
        return tuple(_attr(v) for v in value)
    return value


def _image_parse_model(model_metadata, model_config):
    """image_client.py's parse_model, check for check."""
    if len(model_metadata.inputs) != 1:
        raise Exception(f"expecting 1 input, got {len(model_metadata.inputs)}")
    if len(model_metadata.outputs) != 1:
        raise Exception(f"expecting 1 output, got {len(model_metadata.outputs)}")
    if len(model_config.input) != 1:
        raise Exception(f"expecting 1 input in model configuration, got {len(model_config.input)}")
    input_metadata = model_metadata.inputs[0]
    input_config = model_config.input[0]
    output_metadata = model_metadata.outputs[0]
    if output_metadata.datatype != "FP32":
        raise Exception("expecting output datatype to be FP32")
    output_batch_dim = model_config.max_batch_size > 0
    non_one_cnt = 0
    for dim in output_metadata.shape:
        if output_batch_dim:
            output_batch_dim = False
        elif dim > 1:
            non_one_cnt += 1
            if non_one_cnt > 1:
                raise Exception("expecting model output to be a vector")
    input_batch_dim = model_config.max_batch_size > 0
    expected_input_dims = 3 + (1 if input_batch_dim else 0)
    if len(input_metadata.shape) != expected_input_dims:
        raise Exception(f"expecting input to have {expected_input_dims} dimensions, "
                        f"model '{model_metadata.name}' input has {len(input_metadata.shape)}")
    if type(input_config.format) == str:  # noqa: E721 - the example's own test
        FORMAT_ENUM_TO_INT = dict(mc.ModelInput.Format.items())
        input_config.format = FORMAT_ENUM_TO_INT[input_config.format]
    if input_config.format not in (mc.ModelInput.FORMAT_NCHW, mc.ModelInput.FORMAT_NHWC):
        raise Exception("unexpected input format " + mc.ModelInput.Format.Name(input_config.format))
    if input_config.format == mc.ModelInput.FORMAT_NHWC:
        h = input_metadata.shape[1 if input_batch_dim else 0]
        w = input_metadata.shape[2 if input_batch_dim else 1]
        c = input_metadata.shape[3 if input_batch_dim else 2]
    else:
        c = input_metadata.shape[1 if input_batch_dim else 0]
        h = input_metadata.shape[2 if input_batch_dim else 1]
        w = input_metadata.shape[3 if input_batch_dim else 2]
    return (model_config.max_batch_size, input_metadata.name, output_metadata.name, c, h, w, input_config.format,
            input_metadata.datatype)


def _image_preprocess(img, format, dtype, c, h, w, scaling):
    from PIL import Image

    sample_img = img.convert("L") if c == 1 else img.convert("RGB")
    resized = np.array(sample_img.resize((w, h), Image.BILINEAR))
    if resized.ndim == 2:
        resized = resized[:, :, np.newaxis]
    npdtype = triton_to_np_dtype(dtype)
    typed = resized.astype(npdtype)
    scaled = (typed / 127.5) - 1 if scaling == "INCEPTION" else typed
    return np.transpose(scaled, (2, 0, 1)) if format == mc.ModelInput.FORMAT_NCHW else scaled


def _image_postprocess(results, output_name, batch_size, supports_batching) -> list[list[str]]:
    output_array = results.as_numpy(output_name)
    if supports_batching and len(output_array) != batch_size:
        raise Exception(f"expected {batch_size} results, got {len(output_array)}")
    printed = []
    for results in output_array:
        if not supports_batching:
            results = [results]
        row = []
        for result in results:
            if output_array.dtype.type == np.object_:
                cls = "".join(chr(x) for x in result).split(":")
            else:
                cls = result.split(":")
            row.append("    {} ({}) = {}".format(cls[0], cls[1], cls[2]))
        printed.append(row)
    return printed


@pytest.mark.parametrize("protocol, async_set", [("HTTP", False), ("HTTP", True), ("gRPC", False), ("gRPC", True)])
def test_image_client(served, images, protocol, async_set):
    from PIL import Image

    model_name, model_version, batch_size, classes, scaling = "image_classifier", "", 2, 3, "INCEPTION"
    grpc_protocol = protocol.lower() == "grpc"
    if grpc_protocol:
        triton_client = grpcclient.InferenceServerClient(url=served.grpc, verbose=False)
    else:
        triton_client = httpclient.InferenceServerClient(url=served.http, verbose=False,
                                                         concurrency=20 if async_set else 1)
    try:
        model_metadata = triton_client.get_model_metadata(model_name=model_name, model_version=model_version)
    except InferenceServerException as e:
        raise AssertionError("failed to retrieve the metadata: " + str(e)) from None
    try:
        model_config = triton_client.get_model_config(model_name=model_name, model_version=model_version)
    except InferenceServerException as e:
        raise AssertionError("failed to retrieve the config: " + str(e)) from None
    if grpc_protocol:
        model_config = model_config.config
    else:
        model_metadata, model_config = AttrDict(model_metadata), AttrDict(model_config)
    max_batch_size, input_name, output_name, c, h, w, format, dtype = _image_parse_model(model_metadata, model_config)
    supports_batching = max_batch_size > 0
    assert supports_batching and (c, h, w) == (3, 32, 32) and format == mc.ModelInput.FORMAT_NCHW

    filenames = sorted(str(p) for p in images.iterdir())
    image_data = [_image_preprocess(Image.open(f), format, dtype, c, h, w, scaling) for f in filenames]
    client = grpcclient if grpc_protocol else httpclient
    responses, async_requests, completed = [], [], queue.Queue()
    image_idx, last_request, sent_count = 0, False, 0
    while not last_request:
        repeated_image_data = []
        for _ in range(batch_size):
            repeated_image_data.append(image_data[image_idx])
            image_idx = (image_idx + 1) % len(image_data)
            if image_idx == 0:
                last_request = True
        batched_image_data = np.stack(repeated_image_data, axis=0)
        inputs = [client.InferInput(input_name, batched_image_data.shape, dtype)]
        inputs[0].set_data_from_numpy(batched_image_data)
        outputs = [client.InferRequestedOutput(output_name, class_count=classes)]
        sent_count += 1
        if async_set and grpc_protocol:
            triton_client.async_infer(model_name, inputs, lambda result, error: completed.put((result, error)),
                                      request_id=str(sent_count), model_version=model_version, outputs=outputs)
        elif async_set:
            async_requests.append(triton_client.async_infer(model_name, inputs, request_id=str(sent_count),
                                                            model_version=model_version, outputs=outputs))
        else:
            responses.append(triton_client.infer(model_name, inputs, request_id=str(sent_count),
                                                 model_version=model_version, outputs=outputs))
    if async_set and grpc_protocol:
        for _ in range(sent_count):
            result, error = completed.get(timeout=60)
            assert error is None, "inference failed: " + str(error)
            responses.append(result)
    elif async_set:
        responses.extend(r.get_result() for r in async_requests)
    for response in responses:
        this_id = response.get_response().id if grpc_protocol else response.get_response()["id"]
        assert this_id in {str(i + 1) for i in range(sent_count)}
        printed = _image_postprocess(response, output_name, batch_size, supports_batching)
        # beyond the example: the classes are the model's top 3, largest first, with their labels
        scores = _reference_scores(served, np.stack(image_data[:batch_size]).astype(np.float32))
        for row, sample in zip(printed, scores):
            top = np.argsort(-sample, kind="stable")[:classes]
            assert [line.split("(")[1].split(")")[0] for line in row] == [str(i) for i in top]
            assert [line.rsplit("= ", 1)[1] for line in row] == [LABELS[i] for i in top]


def _reference_scores(served, x: np.ndarray) -> np.ndarray:
    from staronnx.plan import Plan

    return Plan.load(served.image_root).run_reference({"data": x})["prob"]


# -- grpc_image_client.py (the raw gRPC stubs: ModelMetadata, ModelConfig, ModelInfer) ---------
def _deserialize_bytes_tensor(encoded_tensor):
    strs = []
    offset = 0
    while offset < len(encoded_tensor):
        length = struct.unpack_from("<I", encoded_tensor, offset)[0]
        offset += 4
        strs.append(struct.unpack_from(f"<{length}s", encoded_tensor, offset)[0])
        offset += length
    return np.array(strs, dtype=np.object_)


def test_grpc_image_client(served, images):
    from PIL import Image

    model_name, model_version, batch_size, classes = "image_classifier", "", 2, 2
    grpc_stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(served.grpc))
    metadata_response = grpc_stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=model_name, version=model_version))
    config_response = grpc_stub.ModelConfig(service_pb2.ModelConfigRequest(name=model_name, version=model_version))
    max_batch_size, input_name, output_name, c, h, w, format, dtype = _image_parse_model(
        metadata_response, config_response.config)
    supports_batching = max_batch_size > 0
    request = service_pb2.ModelInferRequest()
    request.model_name = model_name
    request.model_version = model_version
    output = service_pb2.ModelInferRequest().InferRequestedOutputTensor()
    output.name = output_name
    output.parameters["classification"].int64_param = classes
    request.outputs.extend([output])
    tensor = service_pb2.ModelInferRequest().InferInputTensor()
    tensor.name = input_name
    tensor.datatype = dtype
    tensor.shape.extend([batch_size, c, h, w] if supports_batching else [c, h, w])
    filenames = sorted(str(p) for p in images.iterdir())
    image_data = [_image_preprocess(Image.open(f), format, dtype, c, h, w, "NONE") for f in filenames]
    request.inputs.extend([tensor])
    request.raw_input_contents.extend([b"".join(d.tobytes() for d in image_data[:batch_size])])
    for response in (grpc_stub.ModelInfer(request), grpc_stub.ModelInfer.future(request).result()):
        assert len(response.outputs) == 1 and len(response.raw_output_contents) == 1
        contents = np.reshape(_deserialize_bytes_tensor(response.raw_output_contents[0]), response.outputs[0].shape)
        assert len(contents) == batch_size
        for results in contents:
            for result in results:
                cls = "".join(chr(x) for x in result).split(":")
                assert 0 <= float(cls[0]) <= 1 and LABELS[int(cls[1])] == cls[2]


def test_grpc_classification_of_a_type_other_than_an_integer_is_refused_not_ignored(served):
    """Triton takes ``classification`` as an int64_param and refuses another type; a value this
    server reads as no integer (a string, a boolean) is INVALID_ARGUMENT naming the output, as
    HTTP's ``"classification": "2"`` is, never the whole output silently sent unclassified."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(served.grpc))
    for field, value in (("string_param", "2"), ("bool_param", True)):
        request = service_pb2.ModelInferRequest(model_name="simple")
        for name in ("INPUT0", "INPUT1"):
            request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
            request.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
        output = request.outputs.add(name="OUTPUT0")
        setattr(output.parameters["classification"], field, value)
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value)
        assert "'OUTPUT0'" in err.value.details() and "classification" in err.value.details(), err.value.details()


# -- what the examples do not check ------------------------------------------------------------
def test_config_follows_tritons_conventions(served):
    """Item 3: dims without the batch axis when max_batch_size > 0, image formats, labels, the
    extensions listed; no path of the server's in the configuration (the leak item)."""
    h = httpclient.InferenceServerClient(served.http)
    g = grpcclient.InferenceServerClient(served.grpc)
    cfg = h.get_model_config("image_classifier")
    assert cfg["max_batch_size"] == 8
    assert cfg["input"] == [{"name": "data", "data_type": "TYPE_FP32", "format": "FORMAT_NCHW", "dims": [3, 32, 32]}]
    assert cfg["output"] == [{"name": "prob", "data_type": "TYPE_FP32", "dims": [10], "label_filename": "labels.txt"}]
    assert h.get_model_metadata("image_classifier")["inputs"][0]["shape"] == [-1, 3, 32, 32]
    simple = g.get_model_config("simple").config
    assert simple.max_batch_size == 8 and [list(i.dims) for i in simple.input] == [[16], [16]]
    assert [i.format for i in simple.input] == [mc.ModelInput.FORMAT_NONE] * 2
    assert [i.data_type for i in simple.input] == [mc.TYPE_INT32] * 2
    assert simple.dynamic_batching.max_queue_delay_microseconds == 1000
    params = {k: v.string_value for k, v in simple.parameters.items()}
    assert params["plan"] == "simple" and len(params["plan_hash"]) >= 8
    assert all("/" not in v for v in params.values()), params
    for ext in ("binary_tensor_data", "classification", "model_configuration", "model_repository", "statistics"):
        assert ext in h.get_server_metadata()["extensions"] and ext in g.get_server_metadata().extensions


def test_statistics_count_what_was_sent(served):
    """Item 1: counts per Triton's definitions, over both protocols, for one model and for all."""
    h = httpclient.InferenceServerClient(served.http)
    g = grpcclient.InferenceServerClient(served.grpc)

    def stats():
        (s,) = h.get_inference_statistics("simple")["model_stats"]
        return s

    before = stats()
    input0_data, input1_data = _data()
    for _ in range(3):
        _validate(_http_test_infer(h, "simple", input0_data, input1_data), input0_data, input1_data)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "FP32")]
    inputs[0].set_data_from_numpy(input0_data)
    inputs[1].set_data_from_numpy(input1_data.astype(np.float32))
    with pytest.raises(InferenceServerException):
        h.infer("simple", inputs)  # a datatype the model does not take: one failure
    after = stats()
    check_statistics(before, after, "simple", answered=3, failed=1)
    assert {s["name"] for s in h.get_inference_statistics()["model_stats"]} == {"simple", "image_classifier"}
    grpc_stats = g.get_inference_statistics("simple", as_json=True)["model_stats"][0]
    assert int(grpc_stats["inference_stats"]["success"]["count"]) == after["inference_stats"]["success"]["count"]
    assert len(g.get_inference_statistics().model_stats) == 2
    with pytest.raises(InferenceServerException) as e:
        g.get_inference_statistics("nope")
    assert e.value.status() == "StatusCode.NOT_FOUND" and "Request for unknown model" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        h.get_inference_statistics("simple", model_version="2")
    assert e.value.status() == "404"


def check_statistics(before, after, name: str, *, answered: int, failed: int) -> None:
    """Triton's definitions, between two statistics documents of one model: ``answered``
    one-sample requests (their queue, compute and batch counts), ``failed`` failures."""
    def d(*keys):
        return _dig(after, keys) - _dig(before, keys)

    assert after["name"] == name and after["version"] == "1"
    assert d("inference_stats", "success", "count") == answered
    assert d("inference_stats", "fail", "count") == failed
    assert d("inference_count") == answered and 1 <= d("execution_count") <= answered
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert d("inference_stats", key, "count") == answered
    assert d("inference_stats", "success", "ns") >= d("inference_stats", "compute_infer", "ns") > 0
    assert sum(b["compute_infer"]["count"] for b in after["batch_stats"]) == after["execution_count"]
    assert after["last_inference"] > 0


def _dig(doc, keys):
    for k in keys:
        doc = doc[k]
    return int(doc)


def test_repository_index_is_read_only(served):
    """Item 5: the index lists the served models, READY; load and unload are refused, saying why."""
    h = httpclient.InferenceServerClient(served.http)
    g = grpcclient.InferenceServerClient(served.grpc)
    index = h.get_model_repository_index()
    assert index == [{"name": "image_classifier", "version": "1", "state": "READY", "reason": ""},
                     {"name": "simple", "version": "1", "state": "READY", "reason": ""}]
    gindex = g.get_model_repository_index()
    assert [(m.name, m.version, m.state) for m in gindex.models] == [
        ("image_classifier", "1", "READY"), ("simple", "1", "READY")]
    for client in (h, g):
        for call in (client.load_model, client.unload_model):
            with pytest.raises(InferenceServerException) as e:
                call("simple")
            assert "for the life of the process" in e.value.message(), e.value.message()
    assert h.is_model_ready("simple") and g.is_model_ready("simple")


def test_server_stubs_match_tritonclients():
    """The server's proto (run in a subprocess: both register ``inference.*``) has every message,
    enum and method of tritonclient's with the same fields and numbers."""
    import json
    import subprocess

    code = """
import json, sys
from google.protobuf import descriptor_pb2 as d
if sys.argv[1] == "server":
    from staronnx.serve.proto import grpc_predict_v2_pb2 as a, model_config_pb2 as b
else:
    from tritonclient.grpc import service_pb2 as a, model_config_pb2 as b
out = {}
for mod in (a, b):
    fd = d.FileDescriptorProto(); mod.DESCRIPTOR.CopyToProto(fd)
    for group in (fd.message_type, fd.enum_type, fd.service):
        for item in group:
            out[item.name] = item.SerializeToString(deterministic=True).hex()
print(json.dumps(out))
"""
    dumps = {}
    for side in ("server", "client"):
        proc = subprocess.run([sys.executable, "-c", code, side], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        dumps[side] = json.loads(proc.stdout)
    assert dumps["server"] == dumps["client"]
    assert len(dumps["server"]) > 60


def test_unknown_grpc_calls_are_unimplemented_not_a_crash(served):
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(served.grpc))
    with pytest.raises(grpc.RpcError) as e:
        stub.TraceSetting(service_pb2.TraceSettingRequest(), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=30).live


# -- TLS (issue 49, item 6): Triton's clients with ssl=True --------------------------------------
def _certificates(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate it signed (PEM files)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def make(name: str, issuer=None, issuer_key=None, ca: bool = False, server: bool = False):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject)
                   .issuer_name(issuer.subject if issuer is not None else subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        cert = builder.sign(issuer_key if issuer_key is not None else key, hashes.SHA256())
        return cert, key

    ca, ca_key = make("staronnx test CA", ca=True)
    files = {}
    for name, (cert, key) in {"ca": (ca, ca_key), "server": make("127.0.0.1", ca, ca_key, server=True),
                              "client": make("client", ca, ca_key)}.items():
        files[name] = folder / f"{name}.pem"
        files[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[name + "_key"] = folder / f"{name}.key"
        files[name + "_key"].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return files


@pytest.fixture(scope="module")
def tls_served(served, tmp_path_factory):
    """``simple`` over mutual TLS on every listener, on an address other machines reach (0.0.0.0:
    TLS stands for --insecure there); its addresses are read off the https lines as loopback."""
    root = tmp_path_factory.mktemp("tls")
    files = _certificates(root)
    s = start_server([served.simple_root], root, "--name", "simple", "--policy", "eager", "--host", "0.0.0.0",
                     "--tls-cert", str(files["server"]), "--tls-key", str(files["server_key"]),
                     "--tls-client-ca", str(files["ca"]), "--drain-timeout", "10s")
    s.files = files
    yield s
    assert s.stop() == 0, "\n".join(s.lines)


def _https_client(url: str, files: dict[str, Path], cert: bool = True) -> httpclient.InferenceServerClient:
    """tritonclient.http over TLS, trusting the test CA, presenting the client certificate or not."""
    import ssl

    def context(*args, **kwargs) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(files["ca"]))
        if cert:
            ctx.load_cert_chain(str(files["client"]), str(files["client_key"]))
        return ctx

    return httpclient.InferenceServerClient(url, ssl=True, ssl_context_factory=context)


def test_tls_serves_trusted_clients_on_both_protocols(tls_served):
    files = tls_served.files
    assert any("mutual TLS" in line for line in tls_served.lines)
    input0_data, input1_data = _data()
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(input0_data)
    inputs[1].set_data_from_numpy(input1_data)
    _validate(_https_client(tls_served.http, files).infer("simple", inputs), input0_data, input1_data)
    g = grpcclient.InferenceServerClient(tls_served.grpc, ssl=True, root_certificates=str(files["ca"]),
                                         private_key=str(files["client_key"]), certificate_chain=str(files["client"]))
    inputs, outputs, input0_data, input1_data = _grpc_inputs(grpcclient)
    results = g.infer("simple", inputs, outputs=outputs)
    np.testing.assert_array_equal(results.as_numpy("OUTPUT0"), input0_data + input1_data)


def test_tls_refuses_clients_without_a_certificate(tls_served):
    with pytest.raises(Exception):  # the handshake fails: no answer at all
        _https_client(tls_served.http, tls_served.files, cert=False).is_server_live()
    g = grpcclient.InferenceServerClient(tls_served.grpc, ssl=True, root_certificates=str(tls_served.files["ca"]))
    with pytest.raises(InferenceServerException):
        g.is_server_live(client_timeout=30)


def test_tls_flags_are_checked(served, tmp_path):
    """A key without its certificate, files that are not PEM: one line naming the flags."""
    import subprocess

    (tmp_path / "x.pem").write_text("not a certificate")
    for args, words in ((["--tls-key", str(tmp_path / "x.pem")], "--tls-cert and --tls-key go together"),
                        (["--tls-cert", str(tmp_path / "x.pem"), "--tls-key", str(tmp_path / "x.pem")],
                         "cannot be loaded as PEM certificates and key")):
        proc = subprocess.run([sys.executable, "-m", "staronnx", "serve", str(served.simple_root), *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and words in proc.stdout + proc.stderr, proc.stdout + proc.stderr
