"""Triton ensembles (issue 50, item 2): ``platform: "ensemble"`` served by ``staronnx serve
--model-repository`` as one task graph, through Triton's own clients on loopback.

The repository (``benchmarks/_ensemble_repo.py``) holds two pipelines over the real models of
``models/real/``: ``text_reader`` (``unet_seg`` -> ``text_mask`` -> ``crnn_ocr`` ->
``ctc_greedy``: two real models and two onnx.helper members; every request its own task graph,
batch and width free) and ``seg_pipeline`` (``preprocess`` -> ``unet_seg`` -> ``text_mask``,
batched across requests), ``text_reader_steps`` (the same steps served one request per step, as
Triton does), and ensembles that must fail alone, each for its reason, named in the repository
index. Every answer is compared with the members run in turn through ONNX Runtime.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("tritonclient", reason="needs Triton's clients (tritonclient: pip install -e '.[dev]')")
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from test_serve import start_server
from tritonclient.utils import InferenceServerException

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _ensemble_repo as er  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = "".join(f' input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    maps += "".join(f' output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}"{maps} }}'


def _ensemble(name: str, steps: list[str], *, mbs: int = 0, inputs: str = "", outputs: str = "",
              extra: str = "") -> str:
    inputs = inputs or 'input [ { name: "IMAGE" data_type: TYPE_FP32 dims: [ -1, 3, 32, -1 ] } ]'
    outputs = outputs or 'output [ { name: "PROB" data_type: TYPE_FP32 dims: [ -1, 1, 32, -1 ] } ]'
    return (f'name: "{name}" platform: "ensemble" max_batch_size: {mbs} {inputs} {outputs} {extra} '
            f"ensemble_scheduling {{ step [ {', '.join(steps)} ] }}")


SEG = _step("unet_seg", {"image": "IMAGE"}, {"logits": "LOGITS"})
MASK = _step("text_mask", {"logits": "LOGITS"}, {"prob": "PROB"})

#: ensemble -> (config, words its reason in the repository index must hold)
REFUSED = {
    "looping": (_ensemble("looping", [_step("unet_seg", {"image": "B"}, {"logits": "A"}),
                                      _step("text_mask", {"logits": "A"}, {"prob": "B"}),
                                      _step("crnn_ocr", {"image": "IMAGE"}, {"log_probs": "PROB"})]),
                "form a cycle"),
    "nested_a": (_ensemble("nested_a", [_step("nested_b", {"IMAGE": "IMAGE"}, {"PROB": "PROB"})]),
                 "leads back to ensemble"),
    "nested_b": (_ensemble("nested_b", [_step("nested_a", {"IMAGE": "IMAGE"}, {"PROB": "PROB"})]),
                 "leads back to ensemble"),
    "absent_member": (_ensemble("absent_member", [_step("no_such_model", {"image": "IMAGE"}, {"prob": "PROB"})]),
                      "step 'no_such_model' is not a model of the repository"),
    "unmapped": (_ensemble("unmapped", [SEG, _step("text_mask", {"logits": "NOWHERE"}, {"prob": "PROB"})]),
                 "reads ensemble tensor 'NOWHERE' (its input 'logits'), which is neither an ensemble input nor"),
    "unknown_output": (_ensemble("unknown_output", [SEG, _step("text_mask", {"logits": "LOGITS"}, {"mask": "PROB"})]),
                       "output_map names 'mask', which is not an output of the member"),
    "unproduced": (_ensemble("unproduced", [SEG, MASK], outputs='output [ { name: "PROB" data_type: TYPE_FP32 '
                             'dims: [ -1, 1, 32, -1 ] }, { name: "EXTRA" data_type: TYPE_FP32 dims: [ -1 ] } ]'),
                   "ensemble output(s) ['EXTRA'] are produced by no step"),
    "stateful_step": (_ensemble("stateful_step", [_step("stateful", {"frame": "IMAGE"}, {"prob": "PROB"})]),
                      "step 'stateful' is a sequence model (sequence_batching)"),
    "too_big": (_ensemble("too_big", [SEG, MASK], mbs=16,
                          inputs='input [ { name: "IMAGE" data_type: TYPE_FP32 dims: [ 3, 32, -1 ] } ]',
                          outputs='output [ { name: "PROB" data_type: TYPE_FP32 dims: [ 1, 32, -1 ] } ]'),
                "allows batches of 16, but its step 'unet_seg' allows at most 8"),
    "batched_ocr": (er.TEXT_READER.replace('"text_reader"', '"batched_ocr"').replace("max_batch_size: 0",
                    "max_batch_size: 4").replace("dims: [ -1, 3, 32, -1 ]", "dims: [ 3, 32, -1 ]")
                    .replace("dims: [ -1, -1 ]", "dims: [ -1 ]")
                    .replace("dims: [ -1, 1, 32, -1 ]", "dims: [ 1, 32, -1 ]"),
                    "its step 'crnn_ocr' does not batch (max_batch_size 0)"),
    "batched_detector": (er.DETECT_SEGMENT.replace('"detect_segment"', '"batched_detector"')
                         .replace("max_batch_size: 0", "max_batch_size: 2")
                         .replace("dims: [ 1, 3, -1, -1 ]", "dims: [ 3, -1, -1 ]"),
                         "its step 'detector_nms' does not batch (max_batch_size 0)"),
    "wrong_type": (_ensemble("wrong_type", [SEG, MASK], inputs='input [ { name: "IMAGE" data_type: TYPE_INT32 '
                                                                'dims: [ -1, 3, 32, -1 ] } ]'),
                   "ensemble tensor 'IMAGE' is TYPE_INT32, but input 'image' of step 'unet_seg' is TYPE_FP32"),
    "wrong_dims": (_ensemble("wrong_dims", [SEG, MASK], inputs='input [ { name: "IMAGE" data_type: TYPE_FP32 '
                                                                'dims: [ -1, 4, 32, -1 ] } ]'),
                   "ensemble tensor 'IMAGE' has dims [-1, 4, 32, -1] (batch included), which do not fit"),
    "no_tensors": ('name: "no_tensors" platform: "ensemble" ensemble_scheduling { step [ ' + SEG + " ] }",
                   "an ensemble's config must declare its inputs and outputs"),
    "with_instances": (_ensemble("with_instances", [SEG, MASK], extra="instance_group [ { kind: KIND_CPU } ]"),
                       "config field instance_group is not honoured for an ensemble"),
}

#: unet_seg cut in two by its own config: inside an ensemble it keeps its two parts
SPLIT = """
max_batch_size: 8
parameters { key: "parts" value: { string_value: "2" } }
parameters { key: "partition_method" value: { string_value: "linear" } }
parameters { key: "input_shapes" value: { string_value: "image=1x3x32x32" } }
"""

STATEFUL = """
max_batch_size: 8
sequence_batching { max_sequence_idle_microseconds: 1000000 }
"""


def _pair_sum() -> onnx.ModelProto:
    """x + y, both ``[batch, 2, H, W]``: a member whose two inputs an ensemble may feed one tensor."""
    h = onnx.helper
    dims = ["batch", 2, "height", "width"]
    graph = h.make_graph([h.make_node("Add", ["x", "y"], ["sum"])], "pair_sum",
                         [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, dims) for n in ("x", "y")],
                         [h.make_tensor_value_info("sum", onnx.TensorProto.FLOAT, dims)])
    return h.make_model(graph, opset_imports=er.OPSET, ir_version=8)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = er.write_repository(tmp_path_factory.mktemp("repository") / "models")
    steps = er.TEXT_READER.replace('"text_reader"', '"text_reader_steps"').replace(
        "ensemble_scheduling", 'parameters { key: "ensemble_mode" value: { string_value: "steps" } }\n'
                               "ensemble_scheduling")
    er.write_model_folder_only(root, "text_reader_steps", steps)
    for name, (config, _) in REFUSED.items():
        er.write_model_folder_only(root, name, config)
    er.write_model(root, "stateful", STATEFUL, er.REAL / "gru_stream.onnx")
    er.write_model(root, "unet_split", SPLIT, er.REAL / "unet_seg.onnx")
    er.write_model(root, "pair_sum", "max_batch_size: 8", _pair_sum())
    er.write_model_folder_only(root, "doubled", _ensemble(
        "doubled", [SEG, _step("pair_sum", {"x": "LOGITS", "y": "LOGITS"}, {"sum": "TWICE"})],
        outputs='output [ { name: "TWICE" data_type: TYPE_FP32 dims: [ -1, 2, 32, -1 ] } ]'))
    er.write_model_folder_only(root, "split_pipeline", er.SEG_PIPELINE.replace('"seg_pipeline"', '"split_pipeline"')
                               .replace('model_name: "unet_seg"', 'model_name: "unet_split"'))
    return root


@pytest.fixture(scope="module")
def served(repo, tmp_path_factory):
    s = start_server([], tmp_path_factory.mktemp("home"), "--model-repository", str(repo), "--policy", "dmda",
                     "--batch-size", "8", "--max-delay", "2ms", "--drain-timeout", "20s")
    yield s
    assert s.stop() == 0, "\n".join(s.lines)


@pytest.fixture(scope="module")
def reference() -> er.Reference:
    return er.Reference()


def _client(served, protocol: str):
    module = httpclient if protocol == "http" else grpcclient
    return module, module.InferenceServerClient(served.http if protocol == "http" else served.grpc)


def _infer(served, protocol: str, model: str, name: str, value: np.ndarray, datatype: str):
    module, client = _client(served, protocol)
    tensor = module.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return client.infer(model, [tensor])


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, float(np.abs(want).max(initial=0))))
    else:
        np.testing.assert_array_equal(got, want)


def _many_clients(served, reference, model: str, clients: int = 16, requests: int = 3) -> list[str]:
    """``clients`` threads, half over HTTP and half over gRPC, each sending ``requests`` requests
    of its own shapes to ``model``; every answer checked against the members run in turn
    through ORT. Returns the failures (empty: every answer equal)."""
    failures: list[str] = []

    def client(i: int) -> None:
        rng = np.random.default_rng(100 + i)
        protocol = "http" if i % 2 else "grpc"
        try:
            for r in range(requests):
                if model.startswith("text_reader"):
                    image = er.text_image(rng, batch=1 + (i + r) % 3, width=(8 + 8 * ((i + r) % 4)) * 4)
                    want = reference.text_reader(image)
                    result = _infer(served, protocol, model, "IMAGE", image, "FP32")
                else:
                    height, width = [(32, 32), (32, 64), (64, 32)][(i + r) % 3]
                    raw = er.raw_image(rng, batch=1 + (i % 2), height=height, width=width)
                    want = reference.seg_pipeline(raw)
                    result = _infer(served, protocol, model, "RAW", raw, "UINT8")
                for name, value in want.items():
                    _close(result.as_numpy(name), value)
        except Exception as exc:  # noqa: BLE001 - collected, so every client's failure is reported
            failures.append(f"client {i} ({protocol}): {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    return failures


def test_index_lists_the_ensembles_and_refuses_each_bad_one_by_name(served):
    entries = {e["name"]: e for e in httpclient.InferenceServerClient(served.http).get_model_repository_index()}
    for name in ("text_reader", "text_reader_steps", "seg_pipeline", "detect_segment", "split_pipeline", "unet_split",
                 "doubled", "pair_sum", *er.MEMBERS):
        assert entries[name]["state"] == "READY", entries[name]
    for name, (_, words) in REFUSED.items():
        assert entries[name]["state"] == "UNAVAILABLE" and words in entries[name]["reason"], (name, entries[name])


def test_two_real_models_as_one_task_graph_answer_as_ort_in_turn_under_16_clients(served, reference):
    """unet_seg -> text_mask -> crnn_ocr -> ctc_greedy, mixed batches (1-3) and widths (32-128)."""
    assert _many_clients(served, reference, "text_reader") == []


def test_a_batched_ensemble_answers_as_ort_in_turn_under_16_clients(served, reference):
    """preprocess -> unet_seg -> text_mask, batched across requests (per image size)."""
    before = _stats(served, "seg_pipeline")
    assert _many_clients(served, reference, "seg_pipeline") == []
    after = _stats(served, "seg_pipeline")
    samples = sum((1 + (i % 2)) * 3 for i in range(16))
    assert after["inference_count"] - before["inference_count"] == samples
    assert 0 < after["execution_count"] - before["execution_count"] <= samples


def test_a_step_whose_output_count_varies_per_request_flows_through_as_a_shape(served, reference):
    """detector_nms -> crop -> unet_seg: each request its own task graph, its detections (19 to
    60-odd, or none) the crops' batch; answers equal to the members run in turn through ORT."""
    sizes = [(192, 256), (160, 224), (320, 320), (96, 128)]
    failures: list[str] = []

    def client(i: int) -> None:
        try:
            image = er.scene(*sizes[i % len(sizes)]) if i % 5 else np.ones((1, 3, 32, 32), np.float32)
            want = er.detect_segment_reference(reference, image)
            result = _infer(served, "http" if i % 2 else "grpc", "detect_segment", "IMAGE", image, "FP32")
            for name, value in want.items():
                _close(result.as_numpy(name), value)
        except Exception as exc:  # noqa: BLE001 - collected, so every client's failure is reported
            failures.append(f"client {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert failures == []


def test_a_member_cut_in_parts_keeps_its_parts_inside_the_ensemble(served, reference):
    line = next(x for x in served.lines if x.startswith("model 'split_pipeline'"))
    assert "(4 parts" in line, line  # preprocess, unet_split's two parts, text_mask
    rng = np.random.default_rng(5)
    for height, width in [(32, 32), (64, 32)]:
        raw = er.raw_image(rng, 2, height, width)
        result = _infer(served, "grpc", "split_pipeline", "RAW", raw, "UINT8")
        _close(result.as_numpy("PROB"), reference.seg_pipeline(raw)["PROB"])


def test_one_tensor_fed_to_two_inputs_of_a_member(served, reference):
    image = er.text_image(np.random.default_rng(4), batch=2, width=64)
    result = _infer(served, "http", "doubled", "IMAGE", image, "FP32")
    _close(result.as_numpy("TWICE"), 2 * reference.run("unet_seg", {"image": image})["logits"])


def test_steps_served_as_triton_does_answer_the_same(served, reference):
    assert _many_clients(served, reference, "text_reader_steps", clients=4, requests=2) == []


def test_a_bad_classification_of_a_steps_ensemble_is_refused_as_a_models_is(served):
    """An ensemble served step by step checks an output's ``classification: k`` as a model does:
    k that is not a non-negative integer (a string over HTTP, a negative int64 over gRPC) is 400 /
    INVALID_ARGUMENT naming the output, not a server error after its steps ran."""
    image = er.text_image(np.random.default_rng(5), batch=1, width=32)
    body = {"inputs": [{"name": "IMAGE", "datatype": "FP32", "shape": list(image.shape),
                        "data": image.ravel().tolist()}],
            "outputs": [{"name": "TEXT_PROB", "parameters": {"classification": "2"}}]}
    req = urllib.request.Request(f"http://{served.http}/v2/models/text_reader_steps/infer",
                                 data=json.dumps(body).encode())
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=60)
    message = json.loads(info.value.read())["error"]
    assert info.value.code == 400 and "'TEXT_PROB'" in message and "classification" in message, message
    module, client = _client(served, "grpc")
    tensor = module.InferInput("IMAGE", list(image.shape), "FP32")
    tensor.set_data_from_numpy(image)
    with pytest.raises(InferenceServerException) as err:
        client.infer("text_reader_steps", [tensor], outputs=[module.InferRequestedOutput("TEXT_PROB", class_count=-1)])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and "classification" in err.value.message(), err.value


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_steps_ensemble_passes_its_requests_priority_on_to_its_steps(served, protocol):
    """Triton's ensemble scheduler gives every step's request the ensemble request's priority and
    timeout; served step by step, a priority reaches the members, none of which has priority
    levels here, so it is refused by name (INVALID_ARGUMENT), as the same ensemble served as one
    task graph refuses it. The priority used to be dropped: the request was answered as if the
    client had not asked for one."""
    image = er.text_image(np.random.default_rng(6), batch=1, width=32)
    module, client = _client(served, protocol)
    tensor = module.InferInput("IMAGE", list(image.shape), "FP32")
    tensor.set_data_from_numpy(image)
    for model in ("text_reader", "text_reader_steps"):
        with pytest.raises(InferenceServerException) as err:
            client.infer(model, [tensor], priority=1)
        assert "no priority levels" in err.value.message(), (model, err.value)
        assert err.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), (model, err.value)
    assert client.infer("text_reader_steps", [tensor]).as_numpy("TEXT_PROB") is not None  # no priority: answered


def _stats(served, model: str, protocol: str = "http") -> dict:
    if protocol == "http":
        return httpclient.InferenceServerClient(served.http).get_inference_statistics(model)["model_stats"][0]
    doc = grpcclient.InferenceServerClient(served.grpc).get_inference_statistics(model, as_json=True)
    stats = doc["model_stats"][0]
    return {**stats, "inference_count": int(stats.get("inference_count", 0)),
            "execution_count": int(stats.get("execution_count", 0))}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_statistics_count_the_ensemble_and_each_member(served, protocol):
    """As Triton reports them: the ensemble's requests, and each composing model's runs, those
    inside the ensemble's task graph included (with the time of its own tasks)."""
    members_before = {m: _stats(served, m, protocol)["inference_count"] for m in ("unet_seg", "crnn_ocr")}
    ensemble_before = _stats(served, "text_reader", protocol)
    image = er.text_image(np.random.default_rng(7), batch=2, width=64)
    _infer(served, protocol, "text_reader", "IMAGE", image, "FP32")
    ensemble = _stats(served, "text_reader", protocol)
    assert ensemble["inference_count"] == ensemble_before["inference_count"] + 1  # a whole request: one task graph
    for member, before in members_before.items():
        stats = _stats(served, member, protocol)
        assert stats["inference_count"] == before + 1, (member, stats)
        infer = stats["inference_stats"]["compute_infer"]
        assert int(infer["count"]) >= 1 and int(infer["ns"]) > 0, (member, stats)


def test_members_stay_servable_on_their_own(served, reference):
    image = er.text_image(np.random.default_rng(3), batch=2, width=48)
    result = _infer(served, "http", "unet_seg", "image", image, "FP32")
    _close(result.as_numpy("logits"), reference.run("unet_seg", {"image": image})["logits"])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_config_and_metadata_say_ensemble(served, protocol):
    _, client = _client(served, protocol)
    if protocol == "http":
        config = client.get_model_config("text_reader")
        metadata = client.get_model_metadata("text_reader")
    else:
        config = client.get_model_config("text_reader", as_json=True)["config"]
        metadata = client.get_model_metadata("text_reader", as_json=True)
    assert config["platform"] == "ensemble"
    assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == [
        "unet_seg", "text_mask", "crnn_ocr", "ctc_greedy"]
    assert metadata["platform"] == "ensemble"
    assert [t["name"] for t in metadata["inputs"]] == ["IMAGE"]
    assert sorted(t["name"] for t in metadata["outputs"]) == ["IDS", "TEXT_PROB"]


def test_a_request_that_does_not_fit_the_ensemble_is_refused_naming_the_input(served):
    bad = np.zeros((1, 3, 16, 64), np.float32)  # the ensemble says height 32
    with pytest.raises(InferenceServerException, match=r"input 'IMAGE': axis 2 must be 32"):
        _infer(served, "http", "text_reader", "IMAGE", bad, "FP32")
    image = er.text_image(np.random.default_rng(1), batch=1, width=32)  # and the server still answers
    assert _infer(served, "grpc", "text_reader", "IMAGE", image, "FP32").as_numpy("IDS").shape == (1, 8)


def test_the_composed_plan_calibrates_and_simulates_as_a_model(served, tmp_path):
    """The ensemble's plan is a plan folder: ``staronnx calibrate`` and ``staronnx simulate``
    (with the LP bound) take it as they take a model's."""
    line = next(x for x in served.lines if x.startswith("model 'seg_pipeline'"))
    root = re.search(r"plan (\S+) \(3 parts", line).group(1)
    env = {**os.environ, "STARONNX_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "staronnx"]
    cal = subprocess.run([*cli, "calibrate", root, "--batch-sizes", "1,2", "--no-bus", "--groups", "cores=1"],
                         capture_output=True, text=True, env=env, timeout=240)
    assert cal.returncode == 0, cal.stdout + cal.stderr
    sim = subprocess.run([*cli, "simulate", root, "--rate", "20", "--batch", "2", "--groups", "cores=1",
                          "--duration", "2s"], capture_output=True, text=True, env=env, timeout=240)
    assert sim.returncode == 0, sim.stdout + sim.stderr
    assert "LP bound" in sim.stdout, sim.stdout


def test_the_benchmark_runs_its_three_columns_end_to_end(tmp_path):
    """``benchmarks/ensemble.py`` (short: no timing asserted, speed is its to print): every
    column's throughput and p99, the ratio line, the placement per worker, and its JSON with the
    trace and the Gantt chart beside it."""
    out = tmp_path / "ensemble.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ensemble.py"), "--seconds", "0.5",
                           "--rounds", "1", "--warmup", "0.2", "--trace-seconds", "0.3", "--groups", _two_groups(),
                           "--out", str(out), "--note", "test"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "STARONNX_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"graph / steps throughput: [\d.]+x \(goal >= 1.2x\), graph / chain: [\d.]+x", done.stdout)
    result = json.loads(out.read_text())
    assert set(result["summary"]) == {"graph", "steps", "chain"}
    assert all(len(result["throughput_per_s"][c]) == 1 and result["throughput_per_s"][c][0] > 0
               for c in result["summary"])
    placement = result["placement"]["tasks_per_worker"]
    assert {m for counts in placement.values() for m in counts} == {"unet_seg", "text_mask", "crnn_ocr", "ctc_greedy"}
    assert Path(result["placement"]["trace"]).is_file()
    assert result["provenance"]["commit"] and result["note"] == "test"


def _two_groups() -> str:
    pus = sorted(os.sched_getaffinity(0))[:2]
    return ";".join(str(p) for p in pus)


def test_poll_mode_recomposes_an_ensemble_whose_member_changed(tmp_path):
    """--model-control-mode poll: a new version of a member reloads the member and the ensemble
    that composes it (its plan is composed from the members' files)."""
    root = tmp_path / "models"
    er.write_model(root, "unet_seg", "max_batch_size: 8", er.REAL / "unet_seg.onnx")
    er.write_model(root, "text_mask", "max_batch_size: 8", er.text_mask())
    er.write_model_folder_only(root, "mini", _ensemble("mini", [SEG, MASK]))
    s = start_server([], tmp_path / "home", "--model-repository", str(root), "--model-control-mode", "poll",
                     "--repository-poll-secs", "0.5", "--policy", "eager")
    try:
        image = er.text_image(np.random.default_rng(2), batch=1, width=32)
        first = _infer(s, "http", "mini", "IMAGE", image, "FP32").as_numpy("PROB")
        background = er.text_mask()  # version 2 keeps the background class instead of the text class
        background.graph.initializer[0].CopyFrom(onnx.helper.make_tensor("one", onnx.TensorProto.INT64, [1], [0]))
        background.graph.initializer[1].CopyFrom(onnx.helper.make_tensor("two", onnx.TensorProto.INT64, [1], [1]))
        er.write_model(root, "text_mask", None, background, versions=(2,))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            now = _infer(s, "http", "mini", "IMAGE", image, "FP32").as_numpy("PROB")
            if not np.allclose(now, first):
                break
            time.sleep(0.5)
        np.testing.assert_allclose(now, 1 - first, atol=1e-5)  # two classes: the other one's probability
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_explicit_mode_loads_an_ensembles_members_and_recomposes_it_when_one_is_reloaded(tmp_path):
    """--model-control-mode explicit, as Triton's: loading an ensemble loads its members not
    served yet (a step-by-step ensemble failed every request, 'its step is not served now'), and
    reloading a member reloads the ensembles built on it (one composed as a task graph kept
    answering with the member's old version until it was reloaded itself)."""
    root = tmp_path / "models"
    er.write_model(root, "unet_seg", "max_batch_size: 8", er.REAL / "unet_seg.onnx")
    er.write_model(root, "text_mask", "max_batch_size: 8", er.text_mask())
    er.write_model_folder_only(root, "mini", _ensemble("mini", [SEG, MASK]))
    er.write_model_folder_only(root, "mini_steps", _ensemble(
        "mini_steps", [SEG, MASK], extra='parameters { key: "ensemble_mode" value: { string_value: "steps" } }'))
    s = start_server([], tmp_path / "home", "--model-repository", str(root), "--model-control-mode", "explicit",
                     "--policy", "eager")
    try:
        client = httpclient.InferenceServerClient(s.http)
        client.load_model("mini_steps")
        assert client.is_model_ready("unet_seg") and client.is_model_ready("text_mask")
        image = er.text_image(np.random.default_rng(2), batch=1, width=32)
        first = _infer(s, "http", "mini_steps", "IMAGE", image, "FP32").as_numpy("PROB")
        client.load_model("mini")
        np.testing.assert_allclose(_infer(s, "http", "mini", "IMAGE", image, "FP32").as_numpy("PROB"), first, atol=1e-5)
        background = er.text_mask()  # version 2 keeps the background class instead of the text class
        background.graph.initializer[0].CopyFrom(onnx.helper.make_tensor("one", onnx.TensorProto.INT64, [1], [0]))
        background.graph.initializer[1].CopyFrom(onnx.helper.make_tensor("two", onnx.TensorProto.INT64, [1], [1]))
        er.write_model(root, "text_mask", None, background, versions=(2,))
        client.load_model("text_mask")  # answers once the member and its ensembles are reloaded
        for name in ("mini", "mini_steps"):
            got = _infer(s, "http", name, "IMAGE", image, "FP32").as_numpy("PROB")
            np.testing.assert_allclose(got, 1 - first, atol=1e-5, err_msg=name)
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_prometheus_counts_of_a_member_include_its_runs_inside_ensembles(served):
    import urllib.request

    def scraped(model: str) -> float:
        text = urllib.request.urlopen(served.metrics, timeout=30).read().decode()
        return float(re.search(rf'^nv_inference_count{{model="{model}",version="1"}} (\S+)$', text, re.M).group(1))

    before = scraped("crnn_ocr")
    _infer(served, "grpc", "text_reader", "IMAGE", er.text_image(np.random.default_rng(9), 1, 32), "FP32")
    assert scraped("crnn_ocr") == before + 1
    assert scraped("crnn_ocr") == _stats(served, "crnn_ocr")["inference_count"]
