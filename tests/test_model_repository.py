"""``staronnx serve --model-repository DIR`` (issue 49, item 1, and what item 2 asks of the fields
it honours): Triton's layout served as it is, through Triton's clients on loopback.

The repository is written at test time with onnx.helper models: ``simple`` with Triton's own
config, ``simple_string`` with no config at all (completed from the model), ``versioned`` with
versions 1 and 2 (the latest served), ``unbatched`` whose config says ``max_batch_size: 0``,
``tuned`` with a queue delay, a queue size and staronnx parameters; and models that must fail
alone, each for its reason, named in the repository index: a TensorFlow platform, a field
staronnx does not honour, an unknown staronnx parameter, a config whose dims contradict the model,
a folder with no version.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

pytest.importorskip("tritonclient", reason="needs Triton's clients (tritonclient: pip install -e '.[dev]')")
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from test_serve import start_server
from test_triton_compat import simple_model
from test_triton_strings import simple_string_model
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(240)

SIMPLE_CONFIG = """
name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
        { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
         { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""

TUNED_CONFIG = """
max_batch_size: 4
dynamic_batching { max_queue_delay_microseconds: 2000 preferred_batch_size: [ 2, 4 ]
                   default_queue_policy { max_queue_size: 64 } }
instance_group [ { kind: KIND_CPU } ]
parameters { key: "slo_ms" value: { string_value: "250" } }
"""

WARMED_CONFIG = """
max_batch_size: 8
optimization { cuda { graphs: false } }
model_warmup [ { name: "zeros" batch_size: 2 count: 3
                 inputs { key: "INPUT0" value: { data_type: TYPE_INT32 dims: [ 16 ] zero_data: true } }
                 inputs { key: "INPUT1" value: { data_type: TYPE_INT32 dims: [ 16 ] random_data: true } } } ]
"""

RESHAPED_CONFIG = """
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 4, 4 ] reshape { shape: [ 16 ] } },
        { name: "INPUT1" data_type: TYPE_INT32 dims: [ 4, 4 ] reshape { shape: [ 16 ] } } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 2, 8 ] reshape { shape: [ 16 ] } } ]
"""

#: model -> (config text or None, versions): the ones that serve
SERVED = {
    "simple": (SIMPLE_CONFIG, [1]),
    "simple_string": (None, [1]),
    "versioned": ('platform: "onnxruntime_onnx"', [1, 2]),
    "unbatched": ("max_batch_size: 0", [1]),
    "tuned": (TUNED_CONFIG, [3]),
    "warmed": (WARMED_CONFIG, [1]),
    "reshaped": (RESHAPED_CONFIG, [1]),
    "ordered": ("max_batch_size: 8 dynamic_batching { preserve_ordering: true }", [1]),
    "impatient": ("max_batch_size: 8 dynamic_batching { max_queue_delay_microseconds: 5000000 "
                  "default_queue_policy { default_timeout_microseconds: 500000 } }", [1]),
    "multi": ("max_batch_size: 8 version_policy: { all { } }", [1, 2]),
    "split": ('parameters { key: "parts" value: { string_value: "2" } } '
              'parameters { key: "partition_method" value: { string_value: "linear" } }', [1]),
}

#: a model_warmup sample too large to make (numpy refuses to make it)
HUGE_WARMUP = ('max_batch_size: 8 model_warmup [ { batch_size: 1 '
               'inputs { key: "INPUT0" value: { data_type: TYPE_INT32 dims: [ 4611686018427387904 ] '
               'zero_data: true } } '
               'inputs { key: "INPUT1" value: { data_type: TYPE_INT32 dims: [ 16 ] zero_data: true } } } ]')

#: model -> (config text, versions, words its reason must hold): the ones that fail alone
REFUSED = {
    "tf_model": ('platform: "tensorflow_savedmodel"', [1], "platform 'tensorflow_savedmodel' is not served"),
    "cached": ("response_cache { enable: true }", [1], "config field response_cache is not honoured"),
    "misranked": ("max_batch_size: 8 dynamic_batching { priority_levels: 2 default_priority_level: 3 }", [1],
                  "dynamic_batching.default_priority_level 3 must lie between 1 and priority_levels (2)"),
    "on_gpu": ("instance_group [ { kind: KIND_GPU } ]", [1],
               "instance_group[0] KIND_GPU: this server has no CUDA workers"),
    "counted": ("instance_group [ { kind: KIND_CPU count: 2 }, { kind: KIND_CPU count: 1 } ]", [1],
                "instance_group: 3 KIND_CPU instance(s), but this server has"),
    "profiled": ('instance_group [ { kind: KIND_CPU profile: "fast" } ]', [1],
                 "config field instance_group[0].profile is not honoured"),
    "stranger": ('parameters { key: "colour" value: { string_value: "red" } }', [1],
                 "config parameters 'colour' are not staronnx settings"),
    "wrong_dims": ('max_batch_size: 8 input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 15 ] } ]', [1],
                   "the config's dims [15] do not fit the model's [16]"),
    "no_version": ("", [], "has no version folder"),
    "bad_reshape": ('max_batch_size: 8 input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 5 ] '
                    'reshape { shape: [ 16 ] } } ]', [1], "dims [5] and reshape [16] must hold as many values"),
    "graphs": ("optimization { cuda { graphs: true } }", [1],
               "optimization.cuda.graphs is true, but this server has no CUDA graphs"),
    "half_warm": ('max_batch_size: 8 model_warmup [ { batch_size: 1 inputs { key: "INPUT0" value: '
                  '{ data_type: TYPE_INT32 dims: [ 16 ] zero_data: true } } } ]', [1],
                  "model_warmup[0]: its inputs must be the model's (INPUT0, INPUT1); missing INPUT1"),
    "from_file": ('max_batch_size: 8 model_warmup [ { batch_size: 1 inputs { key: "INPUT0" value: '
                  '{ data_type: TYPE_INT32 dims: [ 16 ] input_data_file: "x" } } } ]', [1],
                  "config field model_warmup[0].inputs['INPUT0'].input_data_file is not honoured"),
    # it crashed the server's start with numpy's traceback instead of leaving this model out
    "huge_warmup": (HUGE_WARMUP, [1], "model_warmup[0]: input 'INPUT0' of dims [4611686018427387904] cannot be made"),
}


def _write(root: Path, name: str, config: str | None, versions: list[int], model: onnx.ModelProto) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    if config is not None:
        (folder / "config.pbtxt").write_text(config)
    for v in versions:
        (folder / str(v)).mkdir()
        onnx.save(model, str(folder / str(v) / "model.onnx"))


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("repository") / "models"
    for name, (config, versions) in SERVED.items():
        _write(root, name, config, versions, simple_string_model() if name == "simple_string" else simple_model())
    for name, (config, versions, _) in REFUSED.items():
        _write(root, name, config, versions, simple_model())
    # version 2 of "versioned" answers the difference first: which version runs can be told apart
    model = simple_model()
    model.graph.node[0].op_type, model.graph.node[1].op_type = "Sub", "Add"
    onnx.save(model, str(root / "versioned" / "2" / "model.onnx"))
    onnx.save(model, str(root / "multi" / "2" / "model.onnx"))
    return root


@pytest.fixture(scope="module")
def served(repo, tmp_path_factory):
    s = start_server([], tmp_path_factory.mktemp("home"), "--model-repository", str(repo), "--policy", "eager",
                     "--batch-size", "8", "--max-delay", "1ms", "--drain-timeout", "10s",
                     "--queue-capacity", "simple=32")
    yield s
    assert s.stop() == 0, "\n".join(s.lines)


def _simple_inputs(module, n: int = 1) -> tuple[list, np.ndarray, np.ndarray]:
    a = np.arange(16 * n, dtype=np.int32).reshape(n, 16)
    b = np.full((n, 16), 3, dtype=np.int32)
    inputs = [module.InferInput("INPUT0", [n, 16], "INT32"), module.InferInput("INPUT1", [n, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, a, b


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_index_lists_every_model_with_its_state_and_reason(served, protocol):
    if protocol == "http":
        entries = httpclient.InferenceServerClient(served.http).get_model_repository_index()
    else:
        index = grpcclient.InferenceServerClient(served.grpc).get_model_repository_index()
        entries = [{"name": m.name, "version": m.version, "state": m.state, "reason": m.reason} for m in index.models]
    by_name = {e["name"]: e for e in entries}
    assert set(by_name) == set(SERVED) | set(REFUSED)
    for name in SERVED:
        assert by_name[name]["state"] == "READY", by_name[name]
    assert [(e["version"], e["state"]) for e in entries if e["name"] == "multi"] == [("2", "READY"), ("1", "READY")]
    for name, (_, _, words) in REFUSED.items():
        assert by_name[name]["state"] == "UNAVAILABLE" and words in by_name[name]["reason"], by_name[name]
    assert by_name["versioned"]["version"] == "2" and by_name["tuned"]["version"] == "3"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_models_answer_through_both_protocols(served, protocol):
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(served.http if protocol == "http" else served.grpc)
    for model in ("simple", "unbatched", "tuned", "warmed"):
        inputs, a, b = _simple_inputs(module, 2)
        result = client.infer(model, inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    inputs, a, b = _simple_inputs(module)
    result = client.infer("versioned", inputs)  # version 2: the difference first
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a - b)
    with pytest.raises(InferenceServerException, match="has no version '1'.*serves version 2"):
        client.infer("versioned", inputs, model_version="1")
    text = [np.array([str(i).encode() for i in range(16)], dtype=object).reshape(1, 16)] * 2
    strings = [module.InferInput(n, [1, 16], "BYTES") for n in ("INPUT0", "INPUT1")]
    for t, v in zip(strings, text):
        t.set_data_from_numpy(v)
    out = client.infer("simple_string", strings).as_numpy("OUTPUT0")
    assert [int(v) for v in out.ravel()] == [2 * i for i in range(16)]
    with pytest.raises(InferenceServerException, match="model 'tf_model' is not available: platform"):
        client.infer("tf_model", _simple_inputs(module)[0])


def test_config_is_the_effective_one(served):
    """get_model_config: Triton's config completed from the model (no config at all, or one
    without tensors), with what the server honoured (delay, queue, target) as served."""
    http = httpclient.InferenceServerClient(served.http)
    simple = http.get_model_config("simple")
    assert simple["platform"] == "onnxruntime_onnx" and simple["max_batch_size"] == 8
    assert simple["parameters"]["queue_capacity"]["string_value"] == "32"  # --queue-capacity simple=32
    assert [(t["name"], t["data_type"], t["dims"]) for t in simple["input"]] == [
        ("INPUT0", "TYPE_INT32", [16]), ("INPUT1", "TYPE_INT32", [16])]
    completed = http.get_model_config("simple_string")  # no config.pbtxt: all from the model
    assert completed["max_batch_size"] == 8
    assert {(t["name"], t["data_type"]) for t in completed["output"]} == {("OUTPUT0", "TYPE_STRING"),
                                                                        ("OUTPUT1", "TYPE_STRING")}
    assert all(t["dims"] == [16] for t in completed["input"] + completed["output"])
    unbatched = http.get_model_config("unbatched")
    assert unbatched["max_batch_size"] == 0 and unbatched["input"][0]["dims"] == [-1, 16]
    assert unbatched["parameters"]["batching"]["string_value"] == "false"
    tuned = http.get_model_config("tuned")
    assert tuned["max_batch_size"] == 4
    assert tuned["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert tuned["dynamic_batching"]["preferred_batch_size"] == [2, 4]
    assert tuned["parameters"]["queue_capacity"]["string_value"] == "64"
    assert tuned["parameters"]["slo_ms"]["string_value"] == "250"
    assert tuned["parameters"]["latency_ms"]["string_value"] == "250.0"
    grpc_config = grpcclient.InferenceServerClient(served.grpc).get_model_config("tuned").config
    assert grpc_config.max_batch_size == 4 and list(grpc_config.input[0].dims) == [16]
    assert grpcclient.InferenceServerClient(served.grpc).get_model_metadata("versioned").versions == ["2"]


def test_config_json_writes_64_bit_integers_as_numbers(served):
    """The HTTP config is Triton's JSON: its 64-bit integers (a queue policy's timeout, priority
    levels, ...) are numbers, as Triton writes them, not the strings of protobuf's JSON form."""
    config = httpclient.InferenceServerClient(served.http).get_model_config("impatient")
    policy = config["dynamic_batching"]["default_queue_policy"]
    assert policy["default_timeout_microseconds"] == 500000, config["dynamic_batching"]


def test_a_request_larger_than_the_configs_queue_names_max_queue_size(served):
    """A request of more samples than a repository model's queue holds is refused naming what
    sized that queue: its config's max_queue_size, not the --queue-capacity flag it was not given."""
    client = httpclient.InferenceServerClient(served.http)
    with pytest.raises(InferenceServerException) as info:
        client.infer("tuned", _simple_inputs(httpclient, 65)[0])
    assert "max_queue_size" in str(info.value) and "--queue-capacity" not in str(info.value), str(info.value)
    with pytest.raises(InferenceServerException, match="--queue-capacity") as info:  # the flag's, named as ever
        client.infer("simple", _simple_inputs(httpclient, 33)[0])


def test_plans_are_cached_by_model_hash_and_settings(served, repo, tmp_path):
    """The plans made at the first start are reused by the next (same file, same settings), one
    per distinct (file, settings): simple, unbatched and versioned v1 share one file."""
    home = Path(re.search(r"plan (\S+/repository-plans)/", "\n".join(served.lines)).group(1))
    made = sorted(p.name for p in home.iterdir() if not p.name.startswith("."))
    plans = {m: re.search(rf"model '{m}': .*plan (\S+) \(", "\n".join(served.lines)).group(1) for m in SERVED}
    assert plans["simple"] == plans["unbatched"] == plans["tuned"] == plans["warmed"]
    # simple's file whole, and cut in two (other settings, another plan); simple_string's; versioned v2's
    assert plans["split"] != plans["simple"]
    assert plans["multi"] == plans["versioned"]  # the same file, the same settings: one plan
    assert len(set(plans.values())) == len(made) == 4
    stamps = {p: os.stat(p).st_mtime_ns for p in plans.values()}
    again = start_server([], home.parent.parent, "--model-repository", str(repo), "--policy", "eager")
    try:
        assert sorted(p.name for p in home.iterdir() if not p.name.startswith(".")) == made
        assert all(os.stat(p).st_mtime_ns == t for p, t in stamps.items())
    finally:
        assert again.stop() == 0


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_reshape_serves_the_clients_dims(served, protocol):
    """A config's reshape: the client sends and receives its dims, the model runs on its own shape."""
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(served.http if protocol == "http" else served.grpc)
    a = np.arange(3 * 16, dtype=np.int32).reshape(3, 4, 4)
    b = np.ones((3, 4, 4), dtype=np.int32)
    inputs = [module.InferInput("INPUT0", [3, 4, 4], "INT32"), module.InferInput("INPUT1", [3, 4, 4], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("reshaped", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), (a + b).reshape(3, 2, 8))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), (a - b).reshape(3, 16))  # not reshaped
    meta = client.get_model_metadata("reshaped")
    shapes = {t["name"]: t["shape"] for t in meta["inputs"] + meta["outputs"]} if protocol == "http" else \
        {t.name: list(t.shape) for t in [*meta.inputs, *meta.outputs]}
    assert shapes == {"INPUT0": [-1, 4, 4], "INPUT1": [-1, 4, 4], "OUTPUT0": [-1, 2, 8], "OUTPUT1": [-1, 16]}
    if protocol == "http":
        config = client.get_model_config("reshaped")
        assert config["input"][0]["dims"] == [4, 4] and config["input"][0]["reshape"] == {"shape": [16]}
    inputs[0] = module.InferInput("INPUT0", [3, 5], "INT32")
    inputs[0].set_data_from_numpy(np.zeros((3, 5), dtype=np.int32))
    with pytest.raises(InferenceServerException, match="input 'INPUT0': shape \\[3, 5\\] cannot be reshaped"):
        client.infer("reshaped", inputs)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_every_version_the_policy_selects_is_served(served, protocol):
    """version_policy all: versions 2 (the latest, answering when no version is named) and 1."""
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(served.http if protocol == "http" else served.grpc)
    inputs, a, b = _simple_inputs(module)
    np.testing.assert_array_equal(client.infer("multi", inputs).as_numpy("OUTPUT0"), a - b)  # version 2
    np.testing.assert_array_equal(client.infer("multi", inputs, model_version="2").as_numpy("OUTPUT0"), a - b)
    np.testing.assert_array_equal(client.infer("multi", inputs, model_version="1").as_numpy("OUTPUT0"), a + b)
    with pytest.raises(InferenceServerException, match="has no version '3'.*serves versions 2, 1"):
        client.infer("multi", inputs, model_version="3")
    meta = client.get_model_metadata("multi")
    assert list(meta["versions"] if protocol == "http" else meta.versions) == ["2", "1"]
    assert client.is_model_ready("multi", "1") and client.is_model_ready("multi", "2")
    if protocol == "http":
        stats = client.get_inference_statistics("multi")["model_stats"]
        assert sorted(s["version"] for s in stats) == ["1", "2"]


def test_preserve_ordering_answers_every_request(served):
    """preserve_ordering: the config says it; concurrent requests are each answered with their own."""
    import asyncio

    import tritonclient.http.aio as aio

    client = httpclient.InferenceServerClient(served.http)
    assert client.get_model_config("ordered")["dynamic_batching"]["preserve_ordering"] is True

    async def many() -> None:
        c = aio.InferenceServerClient(served.http)
        try:
            sent = [_simple_inputs(aio, n) for n in range(1, 9)]
            results = await asyncio.gather(*(c.infer("ordered", inputs) for inputs, _, _ in sent))
            for (_, a, b), result in zip(sent, results):
                np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        finally:
            await c.close()

    asyncio.run(many())


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_queue_timeout_rejects_a_request_still_waiting_for_its_batch(served, protocol):
    """default_queue_policy's timeout (REJECT): a lone sample waits for a batch of 8 (up to 5 s of
    queue delay) and is refused at 0.5 s; eight samples fill a batch at once and are answered."""
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(served.http if protocol == "http" else served.grpc)
    with pytest.raises(InferenceServerException, match="waited for its batch longer than the queue timeout"):
        client.infer("impatient", _simple_inputs(module, 1)[0])
    inputs, a, b = _simple_inputs(module, 8)
    np.testing.assert_array_equal(client.infer("impatient", inputs).as_numpy("OUTPUT0"), a + b)
    assert client.is_model_ready("impatient")
    if protocol == "http":
        policy = client.get_model_config("impatient")["dynamic_batching"]["default_queue_policy"]
        assert int(policy["default_timeout_microseconds"]) == 500000


def test_parameters_cut_the_plan(served):
    """parameters parts/partition_method: the model is served as a plan of two parts."""
    line = next(x for x in served.lines if x.startswith("model 'split':"))
    assert "(2 parts" in line, line
    client = httpclient.InferenceServerClient(served.http)
    inputs, a, b = _simple_inputs(httpclient, 2)
    np.testing.assert_array_equal(client.infer("split", inputs).as_numpy("OUTPUT1"), a - b)


def test_warmup_runs_before_the_model_serves(served):
    line = next(x for x in served.lines if x.startswith("model 'warmed':"))
    assert "warmed up (3 runs)" in line


def test_serve_needs_something_to_serve(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "staronnx", "serve", "--http-port", "0"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "STARONNX_HOME": str(tmp_path)})
    assert proc.returncode != 0
    assert "give plan folders to serve, --model-repository DIR, or both" in proc.stdout + proc.stderr


def test_an_empty_repository_is_said_so(tmp_path):
    """A repository with no model folder: the line says so, not 'no model can be served: ' and nothing."""
    (tmp_path / "models").mkdir()
    proc = subprocess.run([sys.executable, "-m", "staronnx", "serve", "--model-repository", str(tmp_path / "models"),
                           "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "STARONNX_HOME": str(tmp_path)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (f"staronnx: error: no model to serve: --model-repository {tmp_path / 'models'} holds no "
                           "model folder (<model>/<version>/model.onnx)\n"), proc.stderr


# -- model control (issue 49, item 3) ----------------------------------------------------------
@pytest.fixture(scope="module")
def explicit(repo, tmp_path_factory):
    """Explicit model control: simple and simple_string loaded at start, the rest on request."""
    s = start_server([], tmp_path_factory.mktemp("explicit"), "--model-repository", str(repo),
                     "--model-control-mode", "explicit", "--load-model", "simple", "--load-model", "simple_string",
                     "--policy", "eager", "--batch-size", "8", "--max-delay", "1ms", "--drain-timeout", "10s",
                     "--queue-capacity", "simple=32")
    yield s
    assert s.stop() == 0, "\n".join(s.lines)


def _state(client, name: str) -> tuple[str, str]:
    entry = {e["name"]: e for e in client.get_model_repository_index()}[name]
    return entry["state"], entry["reason"]


def test_explicit_mode_loads_what_it_is_told(explicit):
    http = httpclient.InferenceServerClient(explicit.http)
    assert http.is_model_ready("simple") and http.is_model_ready("simple_string")
    assert _state(http, "tuned") == ("UNAVAILABLE", "not loaded (explicit model control: load it through the "
                                                    "repository API)")
    http.load_model("tuned")
    assert http.is_model_ready("tuned") and _state(http, "tuned") == ("READY", "")
    inputs, a, b = _simple_inputs(httpclient, 3)
    np.testing.assert_array_equal(http.infer("tuned", inputs).as_numpy("OUTPUT0"), a + b)
    grpc = grpcclient.InferenceServerClient(explicit.grpc)
    grpc.unload_model("tuned")
    assert not grpc.is_model_ready("tuned")
    assert _state(http, "tuned") == ("UNAVAILABLE", "unloaded")
    with pytest.raises(InferenceServerException, match="model 'tuned' is not available: unloaded"):
        http.infer("tuned", inputs)
    http.load_model("multi")  # every version its policy selects
    inputs, a, b = _simple_inputs(httpclient)
    np.testing.assert_array_equal(http.infer("multi", inputs, model_version="1").as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(http.infer("multi", inputs).as_numpy("OUTPUT0"), a - b)
    assert [e["version"] for e in http.get_model_repository_index() if e["name"] == "multi"] == ["2", "1"]
    grpc.load_model("tuned")
    np.testing.assert_array_equal(grpc.infer("tuned", _simple_inputs(grpcclient)[0]).as_numpy("OUTPUT1"),
                                  _simple_inputs(grpcclient)[1] - _simple_inputs(grpcclient)[2])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_config_override_takes_effect_and_a_bad_one_changes_nothing(explicit, protocol):
    """simple_{http,grpc}_model_control.py: a load with a JSON config overrides config.pbtxt; a load
    whose config does not parse fails, naming the model, and the served version stays served."""
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(explicit.http if protocol == "http" else explicit.grpc)
    with pytest.raises(InferenceServerException, match="failed to load 'simple'"):
        client.load_model("simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}')
    assert client.is_model_ready("simple")
    client.load_model("simple", config='{"max_batch_size":"16"}')
    config = client.get_model_config("simple")
    assert (config["max_batch_size"] if protocol == "http" else config.config.max_batch_size) == 16
    inputs, a, b = _simple_inputs(module, 2)
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), a + b)
    client.load_model("simple")  # back to its config.pbtxt
    config = client.get_model_config("simple")
    assert (config["max_batch_size"] if protocol == "http" else config.config.max_batch_size) == 8


def test_an_override_in_camel_case_sets_max_batch_size_0(explicit):
    """A load's JSON config may name fields as protobuf's JSON does, in camelCase (which protobuf's
    parser, Triton's too, takes): its maxBatchSize 0 makes a model that does not batch."""
    client = httpclient.InferenceServerClient(explicit.http)
    client.load_model("ordered", config='{"maxBatchSize": 0}')
    try:
        assert client.get_model_config("ordered").get("max_batch_size", 0) == 0
    finally:
        client.unload_model("ordered")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_loads_that_cannot_be_done_are_refused_by_name(explicit, protocol):
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(explicit.http if protocol == "http" else explicit.grpc)
    with pytest.raises(InferenceServerException, match="failed to load 'wrong_model_name': no model of that name"):
        client.load_model("wrong_model_name")
    with pytest.raises(InferenceServerException, match="failed to load 'tf_model': platform 'tensorflow_savedmodel'"):
        client.load_model("tf_model")
    assert _state(httpclient.InferenceServerClient(explicit.http), "tf_model")[0] == "UNAVAILABLE"
    with pytest.raises(InferenceServerException, match="failed to poll from model repository") as info:
        client.load_model("simple", config="{}", files={"file:1/model.onnx": b"a"})
    if protocol == "grpc":
        assert info.value.status() == "StatusCode.INTERNAL"
    assert client.is_server_live() and client.is_model_ready("simple")


def test_a_reload_does_not_disturb_the_other_models(explicit):
    """While simple is reloaded over and over, every request to simple_string is answered."""
    import threading

    client = httpclient.InferenceServerClient(explicit.http)
    text = np.array([[str(i).encode() for i in range(16)]], dtype=object)
    stop, failures, answered = threading.Event(), [], [0]

    def ask() -> None:
        c = httpclient.InferenceServerClient(explicit.http)
        while not stop.is_set():
            inputs = [httpclient.InferInput(n, [1, 16], "BYTES") for n in ("INPUT0", "INPUT1")]
            for t in inputs:
                t.set_data_from_numpy(text)
            try:
                out = c.infer("simple_string", inputs).as_numpy("OUTPUT0")
                assert [int(v) for v in out.ravel()] == [2 * i for i in range(16)]
                answered[0] += 1
            except Exception as exc:  # noqa: BLE001 - collected, asserted below
                failures.append(exc)

    thread = threading.Thread(target=ask)
    thread.start()
    try:
        for _ in range(3):
            client.load_model("simple")
    finally:
        stop.set()
        thread.join(60)
    assert not failures and answered[0] > 0, failures[:3]


def test_model_control_is_refused_where_it_is_off(served):
    client = httpclient.InferenceServerClient(served.http)
    with pytest.raises(InferenceServerException, match="model control is off"):
        client.load_model("simple")
    with pytest.raises(InferenceServerException, match="model control is off"):
        grpcclient.InferenceServerClient(served.grpc).unload_model("simple")
    assert client.is_model_ready("simple")


def test_poll_mode_follows_the_repository(tmp_path):
    """A model folder added is loaded, one removed is unloaded, at the next read of the repository."""
    import shutil
    import time

    root = tmp_path / "models"
    _write(root, "first", None, [1], simple_model())
    s = start_server([], tmp_path, "--model-repository", str(root), "--model-control-mode", "poll",
                     "--repository-poll-secs", "0.2", "--policy", "eager", "--queue-capacity", "16")
    try:
        client = httpclient.InferenceServerClient(s.http)
        assert client.is_model_ready("first")
        _write(root, "second", None, [1], simple_model())

        def wait_for(check) -> bool:
            for _ in range(600):  # a generous bound on a busy host; no timing is asserted
                if check():
                    return True
                time.sleep(0.1)
            return False

        assert wait_for(lambda: client.is_model_ready("second"))
        # --queue-capacity N is every model's, those added to the repository while serving too
        for model in ("first", "second"):
            assert client.get_model_config(model)["parameters"]["queue_capacity"]["string_value"] == "16", model
        shutil.rmtree(root / "first")
        assert wait_for(lambda: not client.is_model_ready("first"))
        np.testing.assert_array_equal(client.infer("second", _simple_inputs(httpclient)[0]).as_numpy("OUTPUT0"),
                                      _simple_inputs(httpclient)[1] + _simple_inputs(httpclient)[2])
        with pytest.raises(InferenceServerException, match="the repository is polled"):
            client.load_model("second")
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_poll_mode_starts_on_an_empty_repository(tmp_path):
    """Poll mode on a repository with no model yet starts (as explicit mode does) and loads the
    first model folder written there; it refused with 'no model can be served: ' and no reason."""
    import time

    root = tmp_path / "models"
    root.mkdir()
    s = start_server([], tmp_path, "--model-repository", str(root), "--model-control-mode", "poll",
                     "--repository-poll-secs", "0.2", "--policy", "eager")
    try:
        client = httpclient.InferenceServerClient(s.http)
        assert client.get_model_repository_index() == []
        _write(root, "first", None, [1], simple_model())
        for _ in range(600):  # a generous bound on a busy host; no timing is asserted
            if client.is_model_ready("first"):
                break
            time.sleep(0.1)
        inputs, a, b = _simple_inputs(httpclient)
        np.testing.assert_array_equal(client.infer("first", inputs).as_numpy("OUTPUT0"), a + b)
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


@pytest.mark.parametrize("flag", ["--model-workers", "--lane"])
def test_workers_for_a_model_loaded_later_name_the_way_out(repo, tmp_path, flag):
    """--model-workers or --lane for a repository model that explicit mode does not load at start:
    refused (the shared runtime cannot take it later) in words that say so, where the line called
    a model of the repository unknown ('names unknown model(s) 'versioned'; this runtime serves ...')."""
    value = "versioned=cpu" if flag == "--model-workers" else "versioned"
    proc = subprocess.run([sys.executable, "-m", "staronnx", "serve", "--model-repository", str(repo),
                           "--model-control-mode", "explicit", "--load-model", "simple", "--load-model", "unbatched",
                           flag, value, "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "STARONNX_HOME": str(tmp_path)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (f"staronnx: error: {flag} versioned: the model is not loaded at start, and the shared "
                           "runtime cannot take a model while it runs: list it in --load-model\n"), proc.stderr


def test_a_target_for_a_model_loaded_later_does_not_stop_the_start(tmp_path):
    """--slo-ms NAME=MS for a repository model that explicit mode loads later: the models loaded at
    start share a runtime, which refused to start for a target of a model it does not hold; the
    model gets its target when it is loaded."""
    root = tmp_path / "models"
    for name in ("first", "second", "later"):
        _write(root, name, None, [1], simple_model())
    s = start_server([], tmp_path, "--model-repository", str(root), "--model-control-mode", "explicit",
                     "--load-model", "first", "--load-model", "second", "--slo-ms", "later=250",
                     "--policy", "eager")
    try:
        client = httpclient.InferenceServerClient(s.http)
        assert client.is_model_ready("first") and not client.is_model_ready("later")
        client.load_model("later")
        assert client.get_model_config("later")["parameters"]["latency_ms"]["string_value"] == "250.0"
        assert "latency_ms" not in client.get_model_config("first")["parameters"]
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def _unknown_op_model() -> onnx.ModelProto:
    """A model ONNX Runtime cannot load: its one node is an op of a domain no library registers."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph([helper.make_node("Foo", ["INPUT0"], ["OUTPUT0"], domain="com.example")], "alien", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])


@pytest.mark.parametrize("layout", [[], ["--separate-runtimes"]], ids=["shared", "separate"])
def test_a_model_onnx_runtime_cannot_load_fails_alone(tmp_path, layout):
    """A repository model whose part ONNX Runtime refuses (an op of an unknown domain) is left out,
    UNAVAILABLE with ONNX Runtime's reason, and the others serve; it used to stop the start
    ('staronnx: error: ONNX Runtime cannot load part 0 ...') on the shared runtime and on
    separate ones alike. With --exit-on-error the server refuses to start, naming it."""
    root = tmp_path / "models"
    _write(root, "good", None, [1], simple_model())
    _write(root, "alien", None, [1], _unknown_op_model())
    s = start_server([], tmp_path, "--model-repository", str(root), "--policy", "eager", *layout)
    try:
        client = httpclient.InferenceServerClient(s.http)
        assert client.is_model_ready("good") and not client.is_model_ready("alien")
        alien = next(m for m in client.get_model_repository_index() if m["name"] == "alien")
        assert alien["state"] == "UNAVAILABLE" and "com.example:Foo" in alien["reason"], alien
        inputs, a, b = _simple_inputs(httpclient)
        assert (client.infer("good", inputs).as_numpy("OUTPUT0") == a + b).all()
    finally:
        assert s.stop() == 0, "\n".join(s.lines)
    proc = subprocess.run([sys.executable, "-m", "staronnx", "serve", "--model-repository", str(root), "--exit-on-error",
                           "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--policy", "eager", *layout],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "STARONNX_HOME": str(tmp_path)})
    assert proc.returncode == 2 and "ready" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.startswith("staronnx: error: --exit-on-error: ") and "alien" in proc.stderr, proc.stderr


def test_exit_on_error_refuses_a_model_whose_warmup_fails(tmp_path):
    """--exit-on-error: a model whose model_warmup fails cannot be served, so the server does not
    start (it started and served the others, as without the flag)."""
    from onnx import TensorProto, helper

    root = tmp_path / "models"
    _write(root, "good", None, [1], simple_model())
    # a Gather from an empty tensor: loads, and fails every run, the warm-up's first
    graph = helper.make_graph([helper.make_node("Gather", ["data", "INDEX"], ["OUT"], axis=0)], "cold",
                              [helper.make_tensor_value_info("INDEX", TensorProto.INT64, ["batch", 1])],
                              [helper.make_tensor_value_info("OUT", TensorProto.FLOAT, ["batch", 1])],
                              initializer=[helper.make_tensor("data", TensorProto.FLOAT, [0], [])])
    _write(root, "cold", 'max_batch_size: 8 model_warmup [ { name: "zeros" batch_size: 1 inputs { key: "INDEX" '
                         'value: { data_type: TYPE_INT64 dims: [ 1 ] zero_data: true } } } ]', [1],
           helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    proc = subprocess.run([sys.executable, "-m", "staronnx", "serve", "--model-repository", str(root), "--exit-on-error",
                           "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--policy", "eager"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "STARONNX_HOME": str(tmp_path)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "ready" not in proc.stdout
    assert proc.stderr.startswith("staronnx: error: --exit-on-error: ") and "cold" in proc.stderr, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--exit-on-error"], "--exit-on-error: "),
    (["--load-model", "simple"], "--load-model goes with --model-control-mode explicit"),
    (["--model-control-mode", "sometimes"], "--model-control-mode must be one of none, poll, explicit"),
    (["--model-control-mode", "explicit", "--load-model", "nothing"], "--load-model nothing: no such model"),
])
def test_model_control_flags_are_checked(repo, args, message, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "staronnx", "serve", "--model-repository", str(repo), *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "STARONNX_HOME": str(tmp_path)})
    assert proc.returncode != 0 and message in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def _two_repositories(tmp_path: Path, *args: str) -> tuple[Path, Path, Any]:
    """A server of two repositories, ``models`` holding model ``first`` and ``more`` empty (a test
    copies ``first`` there to make the repositories unreadable: a name in two of them)."""
    first, other = tmp_path / "models", tmp_path / "more"
    _write(first, "first", None, [1], simple_model())
    other.mkdir()
    return first, other, start_server([], tmp_path, "--model-repository", str(first), "--model-repository",
                                      str(other), *args, "--policy", "eager")


def test_poll_mode_keeps_serving_while_the_repository_cannot_be_read(tmp_path):
    """A poll that cannot read the repositories (here a model copied into the second one: a name
    in two repositories) changes nothing: the served models stay served until it reads again."""
    import shutil
    import time

    first, other, s = _two_repositories(tmp_path, "--model-control-mode", "poll", "--repository-poll-secs", "0.2")
    try:
        client = httpclient.InferenceServerClient(s.http)
        assert client.is_model_ready("first")
        shutil.copytree(first / "first", other / "first")
        for _ in range(600):  # until a poll met the duplicate (no timing is asserted)
            if any("cannot read the model repository" in line for line in s.lines):
                break
            time.sleep(0.1)
        seen = sum("cannot read the model repository" in line for line in s.lines)
        for _ in range(600):  # two more polls: one that unloaded would have done so by now
            if sum("cannot read the model repository" in line for line in s.lines) >= seen + 2:
                break
            time.sleep(0.1)
        assert client.is_model_ready("first"), "\n".join(s.lines[-20:])
        np.testing.assert_array_equal(client.infer("first", _simple_inputs(httpclient)[0]).as_numpy("OUTPUT0"),
                                      _simple_inputs(httpclient)[1] + _simple_inputs(httpclient)[2])
        shutil.rmtree(other / "first")
        _write(other, "second", None, [1], simple_model())
        for _ in range(600):  # the repository reads again: polling goes on
            if client.is_model_ready("second"):
                break
            time.sleep(0.1)
        assert client.is_model_ready("second") and client.is_model_ready("first")
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_poll_mode_forgets_a_failed_model_whose_folder_is_gone(tmp_path):
    """A model that failed to load is listed UNAVAILABLE with its reason while its folder is
    there; once the folder is removed it leaves the index, as a served model's does."""
    import shutil
    import time

    root = tmp_path / "models"
    _write(root, "first", None, [1], simple_model())
    _write(root, "broken", 'platform: "tensorflow_savedmodel"', [1], simple_model())
    s = start_server([], tmp_path, "--model-repository", str(root), "--model-control-mode", "poll",
                     "--repository-poll-secs", "0.2", "--policy", "eager")
    try:
        client = httpclient.InferenceServerClient(s.http)
        assert {e["name"]: e["state"] for e in client.get_model_repository_index()}["broken"] == "UNAVAILABLE"
        shutil.rmtree(root / "broken")
        _write(root, "second", None, [1], simple_model())
        for _ in range(600):  # the poll that loads "second" sees "broken" gone (no timing is asserted)
            if client.is_model_ready("second"):
                break
            time.sleep(0.1)
        assert client.is_model_ready("second")
        names = {e["name"] for e in client.get_model_repository_index()}
        assert names == {"first", "second"}, client.get_model_repository_index()
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_warmup_samples_of_a_reshaped_input_are_given_in_its_dims(tmp_path):
    """A model_warmup sample's dims are the input's as the config declares them (Triton's warm-up
    request goes through the same reshape as a client's): a model with a reshape warms up and
    serves."""
    config = RESHAPED_CONFIG + """
model_warmup [ { name: "square" batch_size: 2
                 inputs { key: "INPUT0" value: { data_type: TYPE_INT32 dims: [ 4, 4 ] zero_data: true } }
                 inputs { key: "INPUT1" value: { data_type: TYPE_INT32 dims: [ 4, 4 ] random_data: true } } } ]
"""
    root = tmp_path / "models"
    _write(root, "reshaped", config, [1], simple_model())
    s = start_server([], tmp_path, "--model-repository", str(root), "--policy", "eager", "--batch-size", "8")
    try:
        client = httpclient.InferenceServerClient(s.http)
        assert client.is_model_ready("reshaped"), "\n".join(s.lines)
        a = np.arange(16, dtype=np.int32).reshape(1, 4, 4)
        inputs = [httpclient.InferInput(n, [1, 4, 4], "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(a)
        assert client.infer("reshaped", inputs).as_numpy("OUTPUT0").shape == (1, 2, 8)
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_a_version_folder_of_non_ascii_digits_is_not_a_version(tmp_path):
    """Version folders are numbers (ASCII digits, as Triton parses them); another folder, even one
    whose name Python calls digits ('²', '١'), is ignored as Triton ignores it: the model serves its
    versions, the server starts."""
    import shutil

    root = tmp_path / "models"
    _write(root, "odd", None, [1], simple_model())
    for name in ("²", "١"):
        shutil.copytree(root / "odd" / "1", root / "odd" / name)
    s = start_server([], tmp_path, "--model-repository", str(root), "--policy", "eager")
    try:
        client = httpclient.InferenceServerClient(s.http)
        assert client.is_model_ready("odd") and client.get_model_metadata("odd")["versions"] == ["1"]
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_a_model_file_that_is_not_onnx_fails_that_model_alone(tmp_path):
    """A version's model.onnx that does not parse (a truncated copy, another format) leaves that
    model out, UNAVAILABLE with its reason naming the file; the other models serve."""
    root = tmp_path / "models"
    _write(root, "first", None, [1], simple_model())
    (root / "corrupt" / "1").mkdir(parents=True)
    (root / "corrupt" / "1" / "model.onnx").write_bytes(bytes(range(256)) * 3)
    s = start_server([], tmp_path, "--model-repository", str(root), "--policy", "eager")
    try:
        client = httpclient.InferenceServerClient(s.http)
        assert client.is_model_ready("first")
        entry = next(e for e in client.get_model_repository_index() if e["name"] == "corrupt")
        assert entry["state"] == "UNAVAILABLE" and "model.onnx" in entry["reason"], entry
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_a_latency_target_below_zero_fails_its_model_alone(tmp_path):
    """A config's slo_ms parameter that is not a positive number of milliseconds leaves that model
    out, its reason naming the parameter as written; the server starts and the others serve."""
    root = tmp_path / "models"
    _write(root, "first", None, [1], simple_model())
    _write(root, "hasty", 'parameters { key: "slo_ms" value: { string_value: "-5" } }', [1], simple_model())
    s = start_server([], tmp_path, "--model-repository", str(root), "--policy", "eager")
    try:
        client = httpclient.InferenceServerClient(s.http)
        assert client.is_model_ready("first")
        entry = next(e for e in client.get_model_repository_index() if e["name"] == "hasty")
        assert entry["state"] == "UNAVAILABLE" and "slo_ms" in entry["reason"] and "-5" in entry["reason"], entry
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_max_batch_size_0_is_read_wherever_the_config_writes_it(tmp_path):
    """'max_batch_size: 0' (a model that does not batch) counts wherever the config writes it, on
    one line after another field as much as on a line of its own; a commented-out one does not."""
    root = tmp_path / "models"
    _write(root, "one_line", 'platform: "onnxruntime_onnx" max_batch_size: 0', [1], simple_model())
    _write(root, "commented", '# max_batch_size: 0\nplatform: "onnxruntime_onnx"', [1], simple_model())
    s = start_server([], tmp_path, "--model-repository", str(root), "--policy", "eager", "--batch-size", "8")
    try:
        client = httpclient.InferenceServerClient(s.http)
        assert client.get_model_config("one_line").get("max_batch_size", 0) == 0
        assert client.get_model_config("commented")["max_batch_size"] == 8
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_a_repository_given_twice_is_read_once(tmp_path):
    """--model-repository DIR given twice (a script that adds the default repository again, or the
    same folder by another path) serves each model once, as Triton reads a set of repositories;
    it is not a model found in two repositories."""
    root = tmp_path / "models"
    _write(root, "first", None, [1], simple_model())
    s = start_server([], tmp_path, "--model-repository", str(root), "--model-repository", str(tmp_path / "." / "models"),
                     "--policy", "eager")
    try:
        assert httpclient.InferenceServerClient(s.http).is_model_ready("first")
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_a_load_says_why_the_repository_cannot_be_read(tmp_path):
    """Explicit mode: a load while the repositories cannot be read (a model name in two of them)
    is refused with that reason, not as a model missing from the repository."""
    import shutil

    first, other, s = _two_repositories(tmp_path, "--model-control-mode", "explicit", "--load-model", "first")
    try:
        client = httpclient.InferenceServerClient(s.http)
        shutil.copytree(first / "first", other / "first")
        with pytest.raises(InferenceServerException, match="failed to load 'first': model 'first' is in two "
                                                           "repositories"):
            client.load_model("first")
        assert client.is_model_ready("first")  # the served version stays served
    finally:
        assert s.stop() == 0, "\n".join(s.lines)



def test_poll_mode_goes_on_past_a_model_whose_load_raises_an_unforeseen_error(tmp_path):
    """A model whose load fails with an error the loader did not turn into a reason (here numpy's
    ValueError making a warm-up sample) is listed UNAVAILABLE with that error, and the poll goes
    on: a model added after it (in name order) is loaded, one removed is unloaded. The error used
    to end every poll at that model, unlogged: nothing after it was ever loaded or unloaded."""
    import shutil
    import time

    root = tmp_path / "models"
    _write(root, "first", None, [1], simple_model())
    s = start_server([], tmp_path, "--model-repository", str(root), "--model-control-mode", "poll",
                     "--repository-poll-secs", "0.2", "--policy", "eager")
    try:
        client = httpclient.InferenceServerClient(s.http)
        assert client.is_model_ready("first")
        _write(root, "aaa_huge_warmup", HUGE_WARMUP, [1], simple_model())
        _write(root, "zzz_second", None, [1], simple_model())
        shutil.rmtree(root / "first")

        def wait_for(check) -> bool:
            for _ in range(600):  # a generous bound on a busy host; no timing is asserted
                if check():
                    return True
                time.sleep(0.1)
            return False

        assert wait_for(lambda: client.is_model_ready("zzz_second")), "\n".join(s.lines)
        assert wait_for(lambda: not client.is_model_ready("first")), "\n".join(s.lines)
        entry = {e["name"]: e for e in client.get_model_repository_index()}["aaa_huge_warmup"]
        assert entry["state"] == "UNAVAILABLE" and "not loaded" not in entry["reason"], entry
    finally:
        assert s.stop() == 0, "\n".join(s.lines)
