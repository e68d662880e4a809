"""``staronnx serve`` on the real exported models (issue 34): every client gets its own answer.

Each model of ``models/real/`` (and the issue's OCR model exported with a fixed batch
of 1, whose computed output carries the batch on axis 1 while it declares ``[1, time]``) is
cut in two, served by the real CLI in a subprocess with ``--batch-size 4 --max-delay 50ms``,
and sent 16 concurrent clients over HTTP, then 16 over gRPC, with Triton's own clients: each
client its own values, one of two shapes (so requests of different shapes share one queue),
some a batch of their own. Every answer must be ORT's answer to that client's inputs, and no
request may fail. The served config must state the model's batching contract the way Triton's
clients read it (``max_batch_size`` only where every tensor has the batch on axis 0), and a
request that fails inside the model must be counted failed in ``/metrics`` and in Triton's
statistics.
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
# a skip, not a collection error, where Triton's clients are absent (the GPU host)
pytest.importorskip("tritonclient", reason="needs Triton's clients (tritonclient: pip install -e '.[dev]')")
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

import realmodels
from _helpers import cli
from staronnx import partition
from staronnx.plan import Plan
from test_serve import _m, _metrics, start_server
from staronnx.partition import PartitionSpec

pytestmark = pytest.mark.timeout(180)

#: the issue's model: crnn_ocr with its batch fixed to 1 and its output declared [1, time]
FIXED_OCR = "ocr_fixed_b1"
MODELS = (*realmodels.NAMES, FIXED_OCR)
#: models whose every tensor has the batch on axis 0: Triton's max_batch_size > 0
LEADING = ("bert_tiny", "gpt2_tiny_kv", "unet_seg")
#: batched along each tensor's own axis (crnn's output on axis 1, gru's state on axis 1)
OWN_AXIS = ("crnn_ocr", "gru_stream")
#: one request per task
ALONE = (*realmodels.ONE_PER_TASK, FIXED_OCR)
CLIENTS = 16
BATCH = 4


def reference_name(name: str) -> str:
    """The real model whose ORT answers a model's requests must equal (the fixed-batch OCR
    computes what crnn_ocr does)."""
    return "crnn_ocr" if name == FIXED_OCR else name


def model_plan(name: str, real_plan, tmp_path_factory) -> Plan:
    if name != FIXED_OCR:
        return real_plan(name)
    root = tmp_path_factory.mktemp(FIXED_OCR)
    return partition(str(realmodels.fixed_batch_time_major(root)), None,
                     PartitionSpec(input_shapes=realmodels.input_shapes("crnn_ocr"), profile_runs=1),
                     output_dir=root / "plan", force=True)


def client_request(name: str, client: int) -> dict[str, np.ndarray]:
    """Client ``client``'s request: its own values, one of two shapes; every eighth client of a
    model that batches sends a batch of 2 of its own (split per sample, joined back along each
    output's batch axis)."""
    rows = 2 if client % 8 == 0 and name in (*LEADING, *OWN_AXIS) else 1
    return realmodels.request(reference_name(name), client, rows)


# -- the clients -------------------------------------------------------------------------------
def http_infer(addr: str, model: str, feeds: dict[str, np.ndarray], outputs: list[str]):
    client = thttp.InferenceServerClient(addr, connection_timeout=60, network_timeout=60)
    try:
        inputs = []
        for n, a in feeds.items():
            i = thttp.InferInput(n, list(a.shape), np_to_triton_dtype(a.dtype))
            i.set_data_from_numpy(a, binary_data=True)
            inputs.append(i)
        r = client.infer(model, inputs, outputs=[thttp.InferRequestedOutput(o, binary_data=True) for o in outputs])
        params = r.get_response().get("parameters") or {}
        return {o: r.as_numpy(o) for o in outputs}, int(params.get("staronnx_batch_size", 0))
    finally:
        client.close()


def grpc_infer(addr: str, model: str, feeds: dict[str, np.ndarray], outputs: list[str]):
    client = tgrpc.InferenceServerClient(addr)
    try:
        inputs = []
        for n, a in feeds.items():
            i = tgrpc.InferInput(n, list(a.shape), np_to_triton_dtype(a.dtype))
            i.set_data_from_numpy(a)
            inputs.append(i)
        r = client.infer(model, inputs, outputs=[tgrpc.InferRequestedOutput(o) for o in outputs], client_timeout=60)
        params = r.get_response(as_json=True).get("parameters") or {}
        size = (params.get("staronnx_batch_size") or {}).get("int64_param", 0)
        return {o: r.as_numpy(o) for o in outputs}, int(size)
    finally:
        client.close()


def concurrent_clients(infer, addr: str, model: str, name: str, first: int, make=None) -> list[int]:
    """``CLIENTS`` clients at once (released together), clients ``first..``, each sending
    ``make(client)`` (default :func:`client_request`); each answer is checked against ORT's
    answer (of model ``name``) to that client's own inputs. The batch each one-sample request
    ran in."""
    outputs = [o.name for o in realmodels._session(reference_name(name)).get_outputs()]
    start = threading.Barrier(CLIENTS)

    def one(client: int) -> tuple[int, dict[str, np.ndarray], dict[str, np.ndarray], int]:
        feeds = (make or functools.partial(client_request, name))(client)
        start.wait(30)
        got, size = infer(addr, model, feeds, outputs)
        return client, feeds, got, size

    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(one, range(first, first + CLIENTS)))
    for client, feeds, got, _ in answers:
        try:
            realmodels.assert_own_answer(reference_name(name), feeds, got)
        except AssertionError as exc:
            raise AssertionError(f"client {client} of {name!r} ({infer.__name__}): {exc}") from None
    return [size for client, feeds, _, size in answers if size]


# -- one server per model, both protocols --------------------------------------------------------
@pytest.fixture(scope="module", params=MODELS)
def served(request, real_plan, tmp_path_factory):
    """(model name, its plan, the server) with dynamic batching: batches of up to 4, 50 ms."""
    name = request.param
    plan = model_plan(name, real_plan, tmp_path_factory)
    server = start_server([plan.root], tmp_path_factory.mktemp(f"serve-{name}"), "--name", name,
                          "--policy", "eager", "--batch-size", str(BATCH), "--max-delay", "50ms")
    yield name, plan, server
    rc = server.stop()
    assert rc == 0, "\n".join(server.lines)


def test_each_of_16_concurrent_clients_gets_its_own_answer_over_http_and_grpc(served):
    """The issue's worst failure: a request answered with another's result. Clients of two
    shapes share the queue; every answer is ORT's to that client's inputs, none fails, and the
    statistics count every request as a success."""
    name, _, server = served
    before = _metrics(server.metrics)
    sizes = concurrent_clients(http_infer, server.http, name, name, first=0)
    sizes += concurrent_clients(grpc_infer, server.grpc, name, name, first=CLIENTS)
    after = _metrics(server.metrics)
    labels = {"model": name, "version": "1"}
    ok = _m(after, "nv_inference_request_success", **labels) - _m(before, "nv_inference_request_success", **labels)
    failed = {r: _m(after, "nv_inference_request_failure", reason=r, **labels) for r in
              ("REJECTED", "BACKEND", "OTHER", "CANCELED")}
    assert ok == 2 * CLIENTS and not any(failed.values()), (ok, failed, "\n".join(server.lines[-20:]))
    stats = thttp.InferenceServerClient(server.http).get_inference_statistics(name)["model_stats"][0]
    assert int(stats["inference_stats"]["fail"]["count"]) == 0
    assert int(stats["inference_stats"]["success"]["count"]) == 2 * CLIENTS
    print(f"{name}: batch sizes of the one-sample requests {sorted(sizes)}")
    if name in ALONE:  # one request per task: never batched with another
        assert set(sizes) == {1}, sizes
    else:  # requests of one shape did share batches (so their answers were split)
        assert max(sizes) > 1, f"{name}: no request shared a batch ({sizes}); the split went untested"
        assert max(sizes) <= BATCH


def test_the_config_states_the_batching_contract_as_tritons_clients_read_it(served):
    """``max_batch_size`` > 0 only where every tensor has the batch on axis 0 (then dims leave
    it out); otherwise 0 with full dims, the contract in ``parameters``. The metadata keeps
    full shapes, -1 for every dynamic dimension, over HTTP and gRPC alike."""
    name, plan, server = served
    config = thttp.InferenceServerClient(server.http).get_model_config(name)
    params = {k: v["string_value"] for k, v in config["parameters"].items()}
    grpc_config = tgrpc.InferenceServerClient(server.grpc).get_model_config(name, as_json=True)["config"]
    assert int(grpc_config.get("max_batch_size", 0)) == config["max_batch_size"]
    sess = realmodels._session(reference_name(name))
    declared = {i.name: [d if isinstance(d, int) else -1 for d in i.shape] for i in sess.get_inputs()}
    if name == FIXED_OCR:
        declared["image"][0] = 1
    dims = {t["name"]: [int(d) for d in t["dims"]] for t in config["input"]}
    if name in LEADING:
        assert config["max_batch_size"] == BATCH and params["batching"] == "true"
        assert dims == {n: s[1:] for n, s in declared.items()}
        assert "batching_reason" not in params
    else:
        assert config["max_batch_size"] == 0, config
        assert dims == declared
        assert params["batching"] == ("true" if name in OWN_AXIS else "false"), params
        assert params["batching_reason"]
    if name == "gru_stream":
        assert "state=1" in params["batch_axes"] and "sample_rate=none" in params["batch_axes"], params
    if name == "crnn_ocr":
        assert "log_probs=1" in params["batch_axes"], params
    if name in ALONE:
        assert "dynamic_batching" not in config and "one request per task" in params["batching_reason"]
    meta = thttp.InferenceServerClient(server.http).get_model_metadata(name)
    assert {t["name"]: t["shape"] for t in meta["inputs"]} == declared
    grpc_meta = tgrpc.InferenceServerClient(server.grpc).get_model_metadata(name, as_json=True)
    assert {t["name"]: [int(d) for d in t.get("shape", [])] for t in grpc_meta["inputs"]} == declared
    if name != FIXED_OCR:  # that one declares an output shape it does not compute
        outs = {o.name: [d if isinstance(d, int) else -1 for d in o.shape] for o in sess.get_outputs()}
        assert {t["name"]: t["shape"] for t in meta["outputs"]} == outs
    start = "\n".join(server.lines)
    assert ("one request per task" in start) == (name in ALONE), start


@pytest.mark.parametrize("served", ["bert_tiny"], indirect=True)
def test_a_request_that_fails_in_the_model_is_counted_failed(served):
    """A token id past BERT's vocabulary passes every check and fails inside ONNX Runtime: its
    client gets an error naming the model, and the failure is counted in ``/metrics`` and in
    Triton's statistics (it is no success); the next request is answered."""
    name, _, server = served
    feeds = client_request(name, 1)
    feeds["input_ids"][0, 0] = 10**7
    labels = {"model": name, "version": "1"}
    before = _metrics(server.metrics)
    stats0 = thttp.InferenceServerClient(server.http).get_inference_statistics(name)["model_stats"][0]
    with pytest.raises(InferenceServerException, match="bert_tiny"):
        http_infer(server.http, name, feeds, ["pooler_output"])
    with pytest.raises(InferenceServerException, match="bert_tiny"):
        grpc_infer(server.grpc, name, feeds, ["pooler_output"])
    good = client_request(name, 3)
    got, _ = http_infer(server.http, name, good, ["last_hidden_state", "pooler_output"])
    realmodels.assert_own_answer(name, good, got)
    after = _metrics(server.metrics)
    assert _m(after, "nv_inference_request_failure", reason="BACKEND", **labels) - \
        _m(before, "nv_inference_request_failure", reason="BACKEND", **labels) == 2
    assert _m(after, "nv_inference_request_success", **labels) - \
        _m(before, "nv_inference_request_success", **labels) == 1
    stats = thttp.InferenceServerClient(server.http).get_inference_statistics(name)["model_stats"][0]
    fails = int(stats["inference_stats"]["fail"]["count"]) - int(stats0["inference_stats"]["fail"]["count"])
    assert fails == 2


# -- the user's word: --no-batching, --batch-axis ------------------------------------------------
def test_no_batching_serves_each_request_alone_and_says_so(real_plan, tmp_path):
    """``--no-batching`` on a model that could batch: max_batch_size 0, full dims, each request
    its own task, and still every client's own answer."""
    plan = real_plan("bert_tiny")
    server = start_server([plan.root], tmp_path, "--name", "bert", "--policy", "eager", "--max-delay", "50ms",
                          "--no-batching")
    try:
        config = thttp.InferenceServerClient(server.http).get_model_config("bert")
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        assert config["max_batch_size"] == 0 and params["batching"] == "false"
        assert "--no-batching" in params["batching_reason"]
        assert [int(d) for d in config["input"][0]["dims"]] == [-1, -1]
        sizes = concurrent_clients(http_infer, server.http, "bert", "bert_tiny", first=0)
        assert set(sizes) == {1}, sizes
    finally:
        assert server.stop() == 0, "\n".join(server.lines)


@pytest.mark.parametrize("args, message", [
    (["--batch-axis", "nosuch=1"], "no served model has a tensor 'nosuch'"),
    (["--batch-axis", "state=7"], "model 'gru': batch axis 7 of 'state' is out of range"),
    (["--batch-axis", "gru:state=x"], "expected NAME=AXIS"),
    (["--batch-axis", "gru:frame=1"], "batch axis 1 of 'frame' is fixed to 256"),
])
def test_batch_axis_errors_are_one_line_naming_the_model(real_plan, capsys, args, message):
    plan = real_plan("gru_stream")
    code, out, err = cli(capsys, "serve", plan.root, "--name", "gru", "--http-port", "0", "--grpc-port", "0",
                         "--metrics-port", "0", *args)
    assert code != 0
    assert message in out + err, out + err
    assert "Traceback" not in out + err


def gru_state_unnamed(folder: Path) -> Path:
    """gru_stream exported as the graph cannot tell: its state's batch dimension has a name of
    its own (``[2, state_batch, 64]``), so the state reads as a per-request value."""
    model = onnx.load(str(realmodels.path("gru_stream")))
    state = next(i for i in model.graph.input if i.name == "state")
    state.type.tensor_type.shape.dim[1].dim_param = "state_batch"
    path = folder / "gru_state_unnamed.onnx"
    onnx.save(model, str(path))
    return path


def shared_state_request(client: int) -> dict[str, np.ndarray]:
    """A GRU client's request whose state equals every other client's (a stream's first step):
    only the batch axis the user names lets such requests share a batch."""
    feeds = client_request("gru_stream", client)
    common = realmodels.request("gru_stream", 999)["state"]
    feeds["state"] = np.repeat(common, feeds["frame"].shape[0], axis=1)
    return feeds


def test_batch_axis_names_one_model_of_several(real_plan, tmp_path):
    """``MODEL:NAME=AXIS`` overrides that model only: a GRU whose state's batch the graph does
    not name gets ``state=1`` from the user, and its requests (one state shared by all, client
    batches of 2 among them) batch along axis 1 and get their own answers; BERT beside it keeps
    its own contract."""
    gru = partition(str(gru_state_unnamed(tmp_path)), None,
                    PartitionSpec(costs="estimate", input_shapes=realmodels.input_shapes("gru_stream")),
                    output_dir=tmp_path / "gru")
    assert gru.contract.inputs["state"] is None  # what the graph says, before the user does
    server = start_server([real_plan("bert_tiny").root, gru.root], tmp_path, "--name", "bert", "--name", "gru",
                          "--policy", "eager", "--batch-size", str(BATCH), "--max-delay", "50ms",
                          "--batch-axis", "gru:state=1")
    try:
        client = thttp.InferenceServerClient(server.http)
        params = {k: v["string_value"] for k, v in client.get_model_config("gru")["parameters"].items()}
        assert "state=1" in params["batch_axes"] and params["batching"] == "true", params
        assert client.get_model_config("bert")["max_batch_size"] == BATCH
        sizes = concurrent_clients(http_infer, server.http, "gru", "gru_stream", first=0, make=shared_state_request)
        assert max(sizes) > 1, f"no request shared a batch ({sizes})"
    finally:
        assert server.stop() == 0, "\n".join(server.lines)
