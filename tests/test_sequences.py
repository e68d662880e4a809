"""Triton's sequence batcher in ``staronnx serve --model-repository`` (issue 50, item 1): stateful
models served through Triton's clients on loopback, over HTTP, gRPC and gRPC's bidirectional
stream (``start_stream``/``async_stream_infer``, what Triton's sequence clients use).

The repository is written at test time: Triton's two example sequence models as ONNX graphs
built with onnx.helper and their example configs (``simple_sequence``: START and READY, the
``direct`` strategy; ``simple_dyna_sequence``: START, END, READY and a UINT64 CORRID, the
``oldest`` strategy), ``gru_stream`` from ``models/real`` with its recurrent state kept by the
server (implicit state), a short-lived copy of ``simple_sequence`` whose sequences are released
after 0.2 s idle, an accumulator whose running sum the server keeps (batched across sequences,
its initial state read from a file), an ordinary model, and configs that must be refused by name.
Every answer is compared with ONNX Runtime run on the same graph with the control inputs Triton
would fill (and, for ``gru_stream``, the state carried step by step).
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

pytest.importorskip("tritonclient", reason="needs Triton's clients (tritonclient: pip install -e '.[dev]')")
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from test_serve import start_server
from test_triton_compat import simple_model
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(300)

GRU = Path(__file__).resolve().parent.parent / "models" / "real" / "gru_stream.onnx"

CONTROL = '{{ name: "{name}" control [ {{ kind: CONTROL_SEQUENCE_{kind} int32_false_true: [ 0, 1 ] }} ] }}'
CORRID = '{{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: {type} }} ] }}'
TENSORS = """
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

#: Triton's example config of simple_sequence (direct by default, 1 s idle by default)
SIMPLE_SEQUENCE = f"""
name: "simple_sequence"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {{
  control_input [ {CONTROL.format(name="START", kind="START")}, {CONTROL.format(name="READY", kind="READY")} ]
}}
{TENSORS}
instance_group [ {{ kind: KIND_CPU }} ]
"""

#: Triton's example config of simple_dyna_sequence (less its custom backend's execute_delay_ms
#: parameter and its instance count, which staronnx refuses: its policy places the tasks)
SIMPLE_DYNA_SEQUENCE = f"""
name: "simple_dyna_sequence"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {{
  max_sequence_idle_microseconds: 10000000
  oldest {{ max_candidate_sequences: 1024 max_queue_delay_microseconds: 10000 }}
  control_input [ {CONTROL.format(name="START", kind="START")}, {CONTROL.format(name="END", kind="END")},
                  {CONTROL.format(name="READY", kind="READY")}, {CORRID.format(type="TYPE_UINT64")} ]
}}
{TENSORS}
instance_group [ {{ kind: KIND_CPU }} ]
"""

SIMPLE_STRING_DYNA_SEQUENCE = SIMPLE_DYNA_SEQUENCE.replace("simple_dyna_sequence", "simple_string_dyna_sequence").replace(
    "TYPE_UINT64", "TYPE_STRING")

SHORT_LIVED = f"""
max_batch_size: 8
sequence_batching {{
  max_sequence_idle_microseconds: 200000
  control_input [ {CONTROL.format(name="START", kind="START")}, {CONTROL.format(name="READY", kind="READY")} ]
}}
"""

#: gru_stream's recurrent state [2, batch, 64] kept by the server; its batch is on axis 1 of the
#: state, which Triton's max_batch_size cannot say: each request is one row, whole (max_batch_size 0)
GRU_CONFIG = """
max_batch_size: 0
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  oldest { max_candidate_sequences: 16 }
  state [ { input_name: "state" output_name: "state_out" data_type: TYPE_FP32 dims: [ 2, 1, 64 ]
            initial_state { data_type: TYPE_FP32 dims: [ 2, 1, 64 ] zero_data: true name: "silence" } } ]
}
"""

#: an accumulator with its running sum kept by the server, batched across sequences (its state
#: on axis 0, as every tensor of it), starting from 100 read from a file (Triton's data_file)
ACCUMULATE_CONFIG = """
max_batch_size: 8
sequence_batching {
  oldest { max_candidate_sequences: 32 max_queue_delay_microseconds: 5000 }
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "INPUT_STATE" output_name: "OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 1 ]
            initial_state { data_type: TYPE_INT32 dims: [ 1 ] data_file: "hundred" name: "a hundred" } } ]
}
"""

#: model_warmup of a stateful model: the sample gives the client's inputs only (the server fills
#: the control inputs and the state, as it does for a client's request)
WARMUP = """
model_warmup [ { name: "ones" batch_size: 2 count: 2
                 inputs { key: "INPUT" value: { data_type: TYPE_INT32 dims: [ 1 ] random_data: true } } } ]
"""

#: model -> (config, words its reason in the repository index must hold)
REFUSED = {
    "float_corrid": (f"max_batch_size: 8 sequence_batching {{ control_input [ {CORRID.format(type='TYPE_FP32')} ] }}",
                     "CONTROL_SEQUENCE_CORRID data_type TYPE_FP32 is not one Triton allows (TYPE_UINT64, TYPE_INT64, "
                     "TYPE_UINT32, TYPE_INT32, TYPE_STRING)"),
    "int_corrid": (f"max_batch_size: 8 sequence_batching {{ control_input [ {CORRID.format(type='TYPE_INT64')} ] }}",
                   "CONTROL_SEQUENCE_CORRID data_type TYPE_INT64, but the model's input is TYPE_UINT64"),
    "fp32_start": ('max_batch_size: 8 sequence_batching { control_input [ { name: "START" control [ { kind: '
                   'CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] } ] }',
                   "fp32_false_true needs a TYPE_FP32 input, but the model's is TYPE_INT32"),
    "iterative": ("max_batch_size: 8 sequence_batching { iterative_sequence: true }",
                  "sequence_batching.iterative_sequence is not honoured"),
    "listed_control": ('max_batch_size: 8 sequence_batching { control_input [ ' + CONTROL.format(name="START", kind="START")
                       + ' ] } input [ { name: "START" data_type: TYPE_INT32 dims: [ 1 ] } ]',
                       "'START' is filled by the server: remove it from the config's input"),
    "warmup_gives_start": ('max_batch_size: 8 sequence_batching { control_input [ ' + CONTROL.format(name="START",
                           kind="START") + ' ] } model_warmup [ { batch_size: 1 inputs { key: "INPUT" value: { '
                           'data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } inputs { key: "START" value: { '
                           'data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } } ]',
                           "model_warmup[0]: input(s) 'START' are filled by the server from the sequence"),
    # a state too large to make crashed the server's start with numpy's traceback
    "huge_state": ('max_batch_size: 8 sequence_batching { state [ { input_name: "INPUT_STATE" output_name: '
                   '"OUTPUT_STATE" data_type: TYPE_INT32 dims: [ 4611686018427387904 ] } ] }',
                   "sequence_batching.state[0]: dims [1, 4611686018427387904] cannot be made"),
    "no_such_input": ('max_batch_size: 8 sequence_batching { control_input [ ' + CONTROL.format(name="GO", kind="START")
                      + ' ] }', "control_input[0] 'GO' is not one of the model's inputs"),
}


def simple_sequence_model() -> onnx.ModelProto:
    """Triton's simple_sequence as an ONNX graph: OUTPUT = READY * (INPUT + START), INT32 [batch, 1]."""
    ins = [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", 1]) for n in ("INPUT", "START", "READY")]
    out = helper.make_tensor_value_info("OUTPUT", TensorProto.INT32, ["batch", 1])
    nodes = [helper.make_node("Add", ["INPUT", "START"], ["sum"], name="add"),
             helper.make_node("Mul", ["READY", "sum"], ["OUTPUT"], name="ready")]
    return helper.make_model(helper.make_graph(nodes, "simple_sequence", ins, [out]),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def simple_dyna_sequence_model(corrid: int = TensorProto.UINT64) -> onnx.ModelProto:
    """Triton's simple_dyna_sequence: OUTPUT = READY * (INPUT + START + END * int32(CORRID));
    ``corrid`` STRING: its simple_string_dyna_sequence (the id's digits read as a number)."""
    ins = [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", 1]) for n in ("INPUT", "START", "END", "READY")]
    ins.append(helper.make_tensor_value_info("CORRID", corrid, ["batch", 1]))
    out = helper.make_tensor_value_info("OUTPUT", TensorProto.INT32, ["batch", 1])
    nodes = [helper.make_node("Cast", ["CORRID"], ["corrid32"], name="cast", to=TensorProto.INT32),
             helper.make_node("Mul", ["END", "corrid32"], ["tail"], name="tail"),
             helper.make_node("Add", ["INPUT", "START"], ["head"], name="head"),
             helper.make_node("Add", ["head", "tail"], ["sum"], name="sum"),
             helper.make_node("Mul", ["READY", "sum"], ["OUTPUT"], name="ready")]
    return helper.make_model(helper.make_graph(nodes, "simple_dyna_sequence", ins, [out]),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def accumulate_model(state_width: int | str = 1) -> onnx.ModelProto:
    """OUTPUT = OUTPUT_STATE = INPUT_STATE + INPUT * (1 + START): a running sum (START counts
    the first value twice, so that a test sees the control and the state together);
    ``state_width``: the state's size past the batch (a name: any size)."""
    ins = [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", 1]) for n in ("INPUT", "START")]
    ins.append(helper.make_tensor_value_info("INPUT_STATE", TensorProto.INT32, ["batch", state_width]))
    outs = [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", state_width])
            for n in ("OUTPUT", "OUTPUT_STATE")]
    one = helper.make_tensor("one", TensorProto.INT32, [], [1])
    nodes = [helper.make_node("Add", ["START", "one"], ["times"], name="times"),
             helper.make_node("Mul", ["INPUT", "times"], ["step"], name="step"),
             helper.make_node("Add", ["INPUT_STATE", "step"], ["OUTPUT_STATE"], name="sum"),
             helper.make_node("Identity", ["OUTPUT_STATE"], ["OUTPUT"], name="out")]
    return helper.make_model(helper.make_graph(nodes, "accumulate", ins, outs, initializer=[one]),
                             opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _write(root: Path, name: str, config: str, model: onnx.ModelProto | Path) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)
    target = root / name / "1" / "model.onnx"
    if isinstance(model, Path):
        target.write_bytes(model.read_bytes())
    else:
        onnx.save(model, str(target))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequences") / "models"
    _write(root, "simple_sequence", SIMPLE_SEQUENCE, simple_sequence_model())
    _write(root, "simple_dyna_sequence", SIMPLE_DYNA_SEQUENCE, simple_dyna_sequence_model())
    _write(root, "simple_string_dyna_sequence", SIMPLE_STRING_DYNA_SEQUENCE,
           simple_dyna_sequence_model(TensorProto.STRING))
    _write(root, "short_lived", SHORT_LIVED, simple_sequence_model())
    _write(root, "gru_stream", GRU_CONFIG, GRU)
    _write(root, "simple", "max_batch_size: 8", simple_model())
    one_slot = (SIMPLE_SEQUENCE.replace('name: "simple_sequence"', "").replace("max_batch_size: 8", "max_batch_size: 1")
                .replace("sequence_batching {", "sequence_batching { max_sequence_idle_microseconds: 60000000"))
    _write(root, "one_slot", one_slot, simple_sequence_model())
    _write(root, "one_slot_timeouts", one_slot, simple_sequence_model())  # its slot held by no other test
    _write(root, "accumulate", ACCUMULATE_CONFIG, accumulate_model())
    (root / "accumulate" / "initial_state").mkdir()
    (root / "accumulate" / "initial_state" / "hundred").write_bytes(np.array([100], np.int32).tobytes())
    _write(root, "warmed_accumulate", ACCUMULATE_CONFIG + WARMUP, accumulate_model())
    (root / "warmed_accumulate" / "initial_state").mkdir()
    (root / "warmed_accumulate" / "initial_state" / "hundred").write_bytes(np.array([100], np.int32).tobytes())
    _write(root, "warmed_dyna_sequence", SIMPLE_DYNA_SEQUENCE.replace('name: "simple_dyna_sequence"', "") + WARMUP,
           simple_dyna_sequence_model())
    for name, (config, _) in REFUSED.items():
        _write(root, name, config, accumulate_model("width") if name == "huge_state" else simple_dyna_sequence_model())
    s = start_server([], tmp_path_factory.mktemp("home"), "--model-repository", str(root), "--policy", "eager",
                     "--batch-size", "8", "--max-delay", "1ms", "--drain-timeout", "10s")
    yield s
    assert s.stop() == 0, "\n".join(s.lines)


def _client(served, protocol: str):
    return (httpclient.InferenceServerClient(served.http) if protocol == "http"
            else grpcclient.InferenceServerClient(served.grpc))


def _int_input(module, name: str, value: int):
    t = module.InferInput(name, [1, 1], "INT32")
    t.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return t


def _ort_answer(session: ort.InferenceSession, value: int, start: bool, end: bool = False,
                corrid: int | str | None = None) -> int:
    """ONNX Runtime's answer with the control inputs Triton fills for one request."""
    feeds = {"INPUT": np.array([[value]], np.int32), "START": np.array([[int(start)]], np.int32),
             "READY": np.array([[1]], np.int32)}
    names = {i.name for i in session.get_inputs()}
    if "END" in names:
        feeds["END"] = np.array([[int(end)]], np.int32)
    if "CORRID" in names:
        feeds["CORRID"] = (np.array([[corrid]], dtype=object) if isinstance(corrid, str) else
                           np.array([[corrid]], np.uint64))
    return int(session.run(None, feeds)[0][0, 0])


def _plan(lengths: dict[int | str, int]) -> list[tuple[int | str, int, bool, bool, int]]:
    """Requests of several sequences, interleaved round-robin: (id, step, start, end, value)."""
    steps = []
    for step in range(max(lengths.values())):
        for sid, n in lengths.items():
            if step < n:
                steps.append((sid, step, step == 0, step == n - 1, 10 * step + len(steps)))
    return steps


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_interleaved_sequences_answer_as_ort_with_the_controls_filled(served, protocol):
    module = httpclient if protocol == "http" else grpcclient
    client = _client(served, protocol)
    for model, build, ids in (("simple_sequence", simple_sequence_model, {11: 4, "seq-b": 2, 13: 5}),
                              ("simple_dyna_sequence", simple_dyna_sequence_model, {1001: 3, 1002: 5, 1003: 1}),
                              ("simple_string_dyna_sequence", lambda: simple_dyna_sequence_model(TensorProto.STRING),
                               {"1004": 2, "1005": 4})):
        session = ort.InferenceSession(build().SerializeToString(), providers=["CPUExecutionProvider"])
        for sid, step, start, end, value in _plan(ids):
            result = client.infer(model, [_int_input(module, "INPUT", value)], sequence_id=sid,
                                  sequence_start=start, sequence_end=end)
            want = _ort_answer(session, value, start, end, None if model == "simple_sequence" else sid)
            assert int(result.as_numpy("OUTPUT")[0, 0]) == want, (model, sid, step)


def test_different_sequences_share_batches(served):
    """8 sequences at once through simple_dyna_sequence (oldest, 10 ms queue delay): every answer
    as ORT's, and their rows share batches (one row per sequence), seen in the answers' batch size
    (a busy host may serve a round one by one: up to five rounds)."""
    session = ort.InferenceSession(simple_dyna_sequence_model().SerializeToString(), providers=["CPUExecutionProvider"])
    sizes: list[int] = []
    failures: list[str] = []

    def run(sid: int) -> None:
        client = httpclient.InferenceServerClient(served.http)
        try:
            for step in range(6):
                value = sid % 100 + step
                result = client.infer("simple_dyna_sequence", [_int_input(httpclient, "INPUT", value)],
                                      sequence_id=sid, sequence_start=step == 0, sequence_end=step == 5)
                if int(result.as_numpy("OUTPUT")[0, 0]) != _ort_answer(session, value, step == 0, step == 5, sid):
                    failures.append(f"sequence {sid} step {step}")
                sizes.append(int(result.get_response()["parameters"]["staronnx_batch_size"]))
        except Exception as exc:  # noqa: BLE001 - said by the test, not lost in the thread
            failures.append(f"sequence {sid}: {exc}")

    for round_ in range(5):
        threads = [threading.Thread(target=run, args=(3000 + 10 * round_ + i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures[:5]
        if max(sizes) > 1:
            break
    assert max(sizes) > 1, sizes


def test_the_stream_answers_interleaved_sequences_and_ordinary_models(served):
    """tritonclient's stream: interleaved sequences of simple_dyna_sequence and simple_sequence,
    and requests to an ordinary model between them; a refused request answers its error on the
    stream, which stays open."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(served.grpc)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    want: dict[str, int] = {}
    try:
        dyna = ort.InferenceSession(simple_dyna_sequence_model().SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        simple = ort.InferenceSession(simple_sequence_model().SerializeToString(), providers=["CPUExecutionProvider"])
        for i, (sid, step, start, end, value) in enumerate(_plan({2001: 4, 2002: 2, 2003: 6})):
            rid = f"d{i}"
            client.async_stream_infer("simple_dyna_sequence", [_int_input(grpcclient, "INPUT", value)], request_id=rid,
                                      sequence_id=sid, sequence_start=start, sequence_end=end)
            want[rid] = _ort_answer(dyna, value, start, end, sid)
            rid = f"s{i}"
            client.async_stream_infer("simple_sequence", [_int_input(grpcclient, "INPUT", value)], request_id=rid,
                                      sequence_id=f"text-{sid}", sequence_start=start, sequence_end=end)
            want[rid] = _ort_answer(simple, value, start)
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        plain = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        for t in plain:
            t.set_data_from_numpy(a)
        client.async_stream_infer("simple", plain, request_id="plain")
        client.async_stream_infer("simple_sequence", [_int_input(grpcclient, "INPUT", 1)], request_id="no-id")
        client.async_stream_infer("simple", plain, request_id="plain-after")
        got, errors = {}, []
        for _ in range(len(want) + 3):
            result, error = answers.get(timeout=60)
            if error is not None:
                errors.append(str(error))
            else:
                got[result.get_response().id] = result
    finally:
        client.stop_stream()
        client.close()  # not left to the channel's finalizer, which can hang at interpreter exit
    for rid, value in want.items():
        assert int(got[rid].as_numpy("OUTPUT")[0, 0]) == value, rid
    np.testing.assert_array_equal(got["plain"].as_numpy("OUTPUT0"), 2 * a)
    np.testing.assert_array_equal(got["plain-after"].as_numpy("OUTPUT0"), 2 * a)
    assert len(errors) == 1 and "must specify a non-zero or non-empty sequence_id" in errors[0], errors


def _gru_reference(frames: np.ndarray, rate: int) -> list[np.ndarray]:
    """gru_stream run step by step through ORT, its state carried from one step to the next."""
    session = ort.InferenceSession(str(GRU), providers=["CPUExecutionProvider"])
    state = np.zeros((2, 1, 64), np.float32)
    probs = []
    for frame in frames:
        prob, state = session.run(None, {"frame": frame[None], "state": state, "sample_rate": np.array(rate, np.int64)})
        probs.append(prob)
    return probs


def test_gru_stream_keeps_its_state_across_16_concurrent_sequences(served):
    """16 sequences of different lengths at once, half over HTTP, half over gRPC, each step sent
    without the state: each answer equals ORT's step with the state carried by hand."""
    rng = np.random.default_rng(50)
    lengths = [3 + (i * 5) % 14 for i in range(16)]
    failures: list[str] = []

    def one(i: int) -> None:
        try:
            steps(i)
        except Exception as exc:  # noqa: BLE001 - said by the test, not lost in the thread
            failures.append(f"sequence {500 + i}: {exc}")

    def steps(i: int) -> None:
        protocol = "http" if i % 2 else "grpc"
        module = httpclient if protocol == "http" else grpcclient
        client = _client(served, protocol)
        rate = 16000 if i % 3 else 8000
        frames = np.asarray(rng.standard_normal((lengths[i], 256)), dtype=np.float32)
        reference = _gru_reference(frames, rate)
        for step, frame in enumerate(frames):
            frame_in = module.InferInput("frame", [1, 256], "FP32")
            frame_in.set_data_from_numpy(frame[None])
            rate_in = module.InferInput("sample_rate", [], "INT64")
            rate_in.set_data_from_numpy(np.array(rate, np.int64))
            result = client.infer("gru_stream", [frame_in, rate_in], sequence_id=500 + i, sequence_start=step == 0,
                                  sequence_end=step == len(frames) - 1)
            if result.as_numpy("state_out") is not None:
                failures.append(f"sequence {500 + i}: the state output reached the client")
            if not np.allclose(result.as_numpy("prob"), reference[step], atol=1e-5):
                failures.append(f"sequence {500 + i} step {step}: {result.as_numpy('prob')} != {reference[step]}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads), "a sequence did not finish"
    assert not failures, failures[:5]
    stats = httpclient.InferenceServerClient(served.http).get_inference_statistics("gru_stream")
    assert int(stats["model_stats"][0]["inference_stats"]["success"]["count"]) >= sum(lengths)


def test_implicit_state_batched_across_sequences_starts_from_its_file_and_resets_at_start(served):
    """8 sequences at once through the accumulator (state on axis 0, batched together): each
    answer is 100 (the initial state's file) plus its sequence's running sum; a START on a
    sequence still open, and one after its END, start again from 100."""
    failures: list[str] = []

    def run(sid: int) -> None:
        client = grpcclient.InferenceServerClient(served.grpc) if sid % 2 else httpclient.InferenceServerClient(served.http)
        module = grpcclient if sid % 2 else httpclient
        try:
            for attempt, n in enumerate((5, 3, 4)):
                total = 100
                for step in range(n):
                    value = sid % 7 + step + 1
                    total += value * (2 if step == 0 else 1)
                    end = attempt != 0 and step == n - 1  # the first run is cut short by the next START
                    result = client.infer("accumulate", [_int_input(module, "INPUT", value)], sequence_id=sid,
                                          sequence_start=step == 0, sequence_end=end)
                    got = int(result.as_numpy("OUTPUT")[0, 0])
                    if got != total:
                        failures.append(f"sequence {sid} run {attempt} step {step}: {got} != {total}")
                    if result.as_numpy("OUTPUT_STATE") is not None:
                        failures.append(f"sequence {sid}: the state output reached the client")
        except Exception as exc:  # noqa: BLE001 - said by the test, not lost in the thread
            failures.append(f"sequence {sid}: {exc}")

    threads = [threading.Thread(target=run, args=(6000 + i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a sequence did not finish"
    assert not failures, failures[:5]


def test_a_sequence_past_the_slots_waits_in_the_backlog_until_one_ends(served):
    """``direct`` with max_batch_size 1: one sequence at a time. A second sequence's first
    request waits (the statistics show it in the backlog) until the first sequence ends."""
    client = httpclient.InferenceServerClient(served.http)
    client.infer("one_slot", [_int_input(httpclient, "INPUT", 1)], sequence_id=1, sequence_start=True)
    second: list = []
    waiting = threading.Thread(target=lambda: second.append(client_b.infer(
        "one_slot", [_int_input(httpclient, "INPUT", 40)], sequence_id=2, sequence_start=True)))
    client_b = httpclient.InferenceServerClient(served.http)
    waiting.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        sequences = client.get_inference_statistics("one_slot")["model_stats"][0]["staronnx"]["sequences"]
        if sequences["backlog"] == 1:
            break
        time.sleep(0.05)
    assert sequences == {"strategy": "direct", "slots": 1, "active": 2, "backlog": 1}, sequences
    assert not second  # still waiting for the slot
    result = client.infer("one_slot", [_int_input(httpclient, "INPUT", 2)], sequence_id=1, sequence_end=True)
    assert int(result.as_numpy("OUTPUT")[0, 0]) == 2
    waiting.join(60)
    assert int(second[0].as_numpy("OUTPUT")[0, 0]) == 41


def test_a_sequence_past_its_requests_timeout_in_the_backlog_is_refused_as_triton_does(served):
    """A request's ``timeout`` bounds how long its sequence waits in the backlog for a slot, as
    Triton's sequence batcher reads it: past it the request is refused UNAVAILABLE with Triton's
    words, and the sequence is over (its next request without START is refused, saying why). The
    timeout used to be ignored: the request waited until a slot was freed."""
    client = httpclient.InferenceServerClient(served.http)
    client.infer("one_slot_timeouts", [_int_input(httpclient, "INPUT", 1)], sequence_id=31, sequence_start=True)
    outcome: queue.Queue = queue.Queue()

    def second() -> None:
        waiting = httpclient.InferenceServerClient(served.http, network_timeout=600.0)
        try:
            outcome.put(waiting.infer("one_slot_timeouts", [_int_input(httpclient, "INPUT", 40)], sequence_id=32,
                                      sequence_start=True, timeout=100_000))
        except InferenceServerException as exc:
            outcome.put(exc)

    thread = threading.Thread(target=second, daemon=True)
    thread.start()
    thread.join(120)  # the 0.1 s timeout ends it; the slot stays held for a minute
    try:
        assert not thread.is_alive(), "the request still waits for a slot past its timeout"
        refused = outcome.get_nowait()
        assert isinstance(refused, InferenceServerException), refused
        assert refused.status() == "503" and "timeout of the corresponding sequence has been expired" in str(refused)
        with pytest.raises(InferenceServerException, match="timed out waiting for a sequence slot"):
            client.infer("one_slot_timeouts", [_int_input(httpclient, "INPUT", 2)], sequence_id=32)
    finally:
        result = client.infer("one_slot_timeouts", [_int_input(httpclient, "INPUT", 2)], sequence_id=31,
                              sequence_end=True)
        thread.join(120)
    assert int(result.as_numpy("OUTPUT")[0, 0]) == 2
    # the slot is free again: a new sequence gets it at once
    again = client.infer("one_slot_timeouts", [_int_input(httpclient, "INPUT", 5)], sequence_id=32, sequence_start=True,
                         sequence_end=True, timeout=100_000)
    assert int(again.as_numpy("OUTPUT")[0, 0]) == 6


def test_an_idle_sequence_is_released_and_its_next_request_refused(served):
    client = httpclient.InferenceServerClient(served.http)
    client.infer("short_lived", [_int_input(httpclient, "INPUT", 1)], sequence_id=77, sequence_start=True)
    deadline = time.monotonic() + 60
    message = ""
    while time.monotonic() < deadline:
        time.sleep(0.5)  # past its 0.2 s idle time (a busy host may answer before the release: then again)
        try:
            client.infer("short_lived", [_int_input(httpclient, "INPUT", 2)], sequence_id=77)
        except InferenceServerException as exc:
            message = str(exc)
            break
    assert "sequence 77" in message and "was released after" in message and "µs idle" in message, message
    assert "must specify the START flag" in message
    # a new START opens it again
    result = client.infer("short_lived", [_int_input(httpclient, "INPUT", 5)], sequence_id=77, sequence_start=True)
    assert int(result.as_numpy("OUTPUT")[0, 0]) == 6


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_requests_a_sequence_model_cannot_take_are_refused_by_name(served, protocol):
    module = httpclient if protocol == "http" else grpcclient
    client = _client(served, protocol)
    one = [_int_input(module, "INPUT", 1)]
    with pytest.raises(InferenceServerException, match="must specify a non-zero or non-empty sequence_id"):
        client.infer("simple_sequence", one)
    with pytest.raises(InferenceServerException, match="sequence 9999.*was never started"):
        client.infer("simple_sequence", one, sequence_id=9999)
    with pytest.raises(InferenceServerException, match="'START' are filled by the server"):
        client.infer("simple_sequence", [*one, _int_input(module, "START", 1)], sequence_id=3, sequence_start=True)
    with pytest.raises(InferenceServerException, match="sequence_id 'abc' is a string, but its CORRID control input "
                                                       "'CORRID' is TYPE_UINT64"):
        client.infer("simple_dyna_sequence", one, sequence_id="abc", sequence_start=True)
    client.infer("simple_dyna_sequence", one, sequence_id=4242, sequence_start=True, sequence_end=True)
    with pytest.raises(InferenceServerException, match="sequence 4242.*ended"):
        client.infer("simple_dyna_sequence", one, sequence_id=4242)
    two = module.InferInput("INPUT", [2, 1], "INT32")
    two.set_data_from_numpy(np.array([[1], [2]], np.int32))
    with pytest.raises(InferenceServerException, match="has a batch of 2; a request of a sequence carries one row"):
        client.infer("simple_sequence", [two], sequence_id=5, sequence_start=True)
    # a refused request leaves its sequence as it was: an END with a wrong datatype does not end it
    client.infer("simple_sequence", one, sequence_id=6, sequence_start=True)
    wrong = module.InferInput("INPUT", [1, 1], "INT64")
    wrong.set_data_from_numpy(np.array([[1]], np.int64))
    with pytest.raises(InferenceServerException, match="datatype 'INT64', but model 'simple_sequence' expects INT32"):
        client.infer("simple_sequence", [wrong], sequence_id=6, sequence_end=True)
    result = client.infer("simple_sequence", [_int_input(module, "INPUT", 7)], sequence_id=6, sequence_end=True)
    assert int(result.as_numpy("OUTPUT")[0, 0]) == 7
    # the refusals count in the model's statistics, as Triton's failures
    stats = httpclient.InferenceServerClient(served.http).get_inference_statistics("simple_sequence")
    assert int(stats["model_stats"][0]["inference_stats"]["fail"]["count"]) >= 4


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_bad_classification_leaves_its_sequence_as_it_was(served, protocol):
    """A request refused for its ``classification`` (k < 0) is refused before it joins its
    sequence, as one with a wrong datatype is: an END asking it does not end the sequence."""
    module = httpclient if protocol == "http" else grpcclient
    client = _client(served, protocol)
    sid = 8 if protocol == "http" else 9
    client.infer("simple_sequence", [_int_input(module, "INPUT", 1)], sequence_id=sid, sequence_start=True)
    with pytest.raises(InferenceServerException, match="classification must be a non-negative integer"):
        client.infer("simple_sequence", [_int_input(module, "INPUT", 1)], sequence_id=sid, sequence_end=True,
                     outputs=[module.InferRequestedOutput("OUTPUT", class_count=-1)])
    result = client.infer("simple_sequence", [_int_input(module, "INPUT", 7)], sequence_id=sid, sequence_end=True)
    assert int(result.as_numpy("OUTPUT")[0, 0]) == 7


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_stateful_model_warms_up_from_its_config_and_starts_its_sequences_afresh(served, protocol):
    """model_warmup on a stateful model: each sample runs with the control inputs and the initial
    state filled by the server (a sequence of one request per row), as a client's request would
    be, so the model loads warmed up instead of failing its load on inputs the sample cannot give
    (a sample may not name them: they are the server's). The warm-up leaves no state behind."""
    for model in ("warmed_accumulate", "warmed_dyna_sequence"):
        line = next((x for x in served.lines if x.startswith(f"model {model!r}:")), "")
        assert "warmed up (2 runs)" in line, "\n".join(served.lines)
    client = _client(served, protocol)
    module = httpclient if protocol == "http" else grpcclient
    sid = 9100 if protocol == "http" else 9200
    first = client.infer("warmed_accumulate", [_int_input(module, "INPUT", 5)], sequence_id=sid, sequence_start=True)
    assert int(first.as_numpy("OUTPUT")[0, 0]) == 110  # 100 (its file) + 2 * 5: START counts it twice
    last = client.infer("warmed_accumulate", [_int_input(module, "INPUT", 3)], sequence_id=sid, sequence_end=True)
    assert int(last.as_numpy("OUTPUT")[0, 0]) == 113
    answer = client.infer("warmed_dyna_sequence", [_int_input(module, "INPUT", 4)], sequence_id=sid,
                          sequence_start=True, sequence_end=True)
    assert int(answer.as_numpy("OUTPUT")[0, 0]) == 4 + 1 + sid


def test_the_server_says_it_serves_sequences(served):
    assert "sequence" in httpclient.InferenceServerClient(served.http).get_server_metadata()["extensions"]
    assert "sequence" in grpcclient.InferenceServerClient(served.grpc).get_server_metadata().extensions


def test_refused_configs_are_listed_with_their_reason(served):
    entries = {e["name"]: e for e in httpclient.InferenceServerClient(served.http).get_model_repository_index()}
    for name in ("simple_sequence", "simple_dyna_sequence", "simple_string_dyna_sequence", "short_lived", "gru_stream",
                 "simple", "accumulate", "one_slot", "one_slot_timeouts", "warmed_accumulate", "warmed_dyna_sequence"):
        assert entries[name]["state"] == "READY", entries[name]
    for name, (_, words) in REFUSED.items():
        assert entries[name]["state"] == "UNAVAILABLE" and words in entries[name]["reason"], entries[name]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_metadata_and_config_answer_the_sequence_batching(served, protocol):
    client = _client(served, protocol)
    if protocol == "http":
        meta = client.get_model_metadata("simple_dyna_sequence")
        config = client.get_model_config("simple_dyna_sequence")
        inputs = [t["name"] for t in meta["inputs"]]
        outputs = [t["name"] for t in client.get_model_metadata("gru_stream")["outputs"]]
    else:
        from google.protobuf import json_format

        meta = client.get_model_metadata("simple_dyna_sequence")
        config = json_format.MessageToDict(client.get_model_config("simple_dyna_sequence").config,
                                           preserving_proto_field_name=True)
        inputs = [t.name for t in meta.inputs]
        outputs = [t.name for t in client.get_model_metadata("gru_stream").outputs]
    assert inputs == ["INPUT"]  # the control inputs are the server's
    assert outputs == ["prob"]  # the state is the server's
    sb = config["sequence_batching"]
    assert "dynamic_batching" not in config
    assert int(sb["max_sequence_idle_microseconds"]) == 10_000_000
    assert int(sb["oldest"]["max_candidate_sequences"]) == 1024
    assert [c["name"] for c in sb["control_input"]] == ["START", "END", "READY", "CORRID"]
    assert [i["name"] for i in config["input"]] == ["INPUT"]
    simple = (client.get_model_config("simple_sequence") if protocol == "http" else
              json_format.MessageToDict(client.get_model_config("simple_sequence").config,
                                        preserving_proto_field_name=True))
    assert int(simple["sequence_batching"]["max_sequence_idle_microseconds"]) == 1_000_000  # Triton's default
    assert "direct" in simple["sequence_batching"]
    gru = (client.get_model_config("gru_stream") if protocol == "http" else
           json_format.MessageToDict(client.get_model_config("gru_stream").config, preserving_proto_field_name=True))
    state = gru["sequence_batching"]["state"][0]
    assert (state["input_name"], state["output_name"], [int(d) for d in state["dims"]]) == ("state", "state_out",
                                                                                          [2, 1, 64])
    assert [i["name"] for i in gru["input"]] == ["frame", "sample_rate"]


def test_unloading_a_stateful_model_refuses_its_backlog_at_once(tmp_path):
    """A sequence waiting in the backlog for a slot (one slot, held by another sequence that
    stays idle for a minute) is refused UNAVAILABLE, naming the unload, as soon as the model is
    unloaded: no slot will ever be freed for it. It used to wait until the active sequence's idle
    timeout, and failed then."""
    root = tmp_path / "models"
    one_slot = (SIMPLE_SEQUENCE.replace('name: "simple_sequence"', "").replace("max_batch_size: 8", "max_batch_size: 1")
                .replace("sequence_batching {", "sequence_batching { max_sequence_idle_microseconds: 600000000"))
    _write(root, "one_slot", one_slot, simple_sequence_model())
    s = start_server([], tmp_path, "--model-repository", str(root), "--model-control-mode", "explicit",
                     "--load-model", "one_slot", "--policy", "eager", "--drain-timeout", "10s")
    try:
        client = httpclient.InferenceServerClient(s.http)
        client.infer("one_slot", [_int_input(httpclient, "INPUT", 1)], sequence_id=1, sequence_start=True)
        outcome: queue.Queue = queue.Queue()

        def second() -> None:
            waiting = httpclient.InferenceServerClient(s.http, network_timeout=600.0)
            try:
                outcome.put(waiting.infer("one_slot", [_int_input(httpclient, "INPUT", 40)], sequence_id=2,
                                          sequence_start=True))
            except InferenceServerException as exc:
                outcome.put(exc)

        thread = threading.Thread(target=second, daemon=True)
        thread.start()
        for _ in range(600):  # a generous bound on a busy host; no timing is asserted
            stats = client.get_inference_statistics("one_slot")["model_stats"][0]["staronnx"]["sequences"]
            if stats["backlog"] == 1:
                break
            time.sleep(0.1)
        assert stats["backlog"] == 1, stats
        client.unload_model("one_slot")
        thread.join(120)  # far less than the 600 s idle timeout that used to free its slot
        assert not thread.is_alive(), "the backlog request still waits after the unload"
        refused = outcome.get_nowait()
        assert isinstance(refused, InferenceServerException), refused
        assert "unloaded" in str(refused) and refused.status() == "503", refused
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_a_shutdown_answers_the_backlog_of_a_stateful_model(tmp_path):
    """SIGTERM while a sequence waits in the backlog for a slot: the drain frees no slot (no new
    request can end the sequence that holds it), so the waiting request is answered 503 at once,
    saying the server is shutting down, and the server exits 0. It used to be left waiting until
    the drain's end and then cut: its client saw the connection reset, no answer."""
    root = tmp_path / "models"
    one_slot = (SIMPLE_SEQUENCE.replace('name: "simple_sequence"', "").replace("max_batch_size: 8", "max_batch_size: 1")
                .replace("sequence_batching {", "sequence_batching { max_sequence_idle_microseconds: 600000000"))
    _write(root, "one_slot", one_slot, simple_sequence_model())
    s = start_server([], tmp_path, "--model-repository", str(root), "--policy", "eager", "--drain-timeout", "10s")
    try:
        client = httpclient.InferenceServerClient(s.http)
        client.infer("one_slot", [_int_input(httpclient, "INPUT", 1)], sequence_id=1, sequence_start=True)
        outcome: queue.Queue = queue.Queue()

        def second() -> None:
            waiting = httpclient.InferenceServerClient(s.http, network_timeout=600.0)
            try:
                outcome.put(waiting.infer("one_slot", [_int_input(httpclient, "INPUT", 40)], sequence_id=2,
                                          sequence_start=True))
            except Exception as exc:  # noqa: BLE001 - an answer, or the connection's fate
                outcome.put(exc)

        thread = threading.Thread(target=second, daemon=True)
        thread.start()
        for _ in range(600):  # a generous bound on a busy host; no timing is asserted
            stats = client.get_inference_statistics("one_slot")["model_stats"][0]["staronnx"]["sequences"]
            if stats["backlog"] == 1:
                break
            time.sleep(0.1)
        assert stats["backlog"] == 1, stats
        s.sigterm()
        thread.join(120)
        assert not thread.is_alive()
        refused = outcome.get_nowait()
        assert isinstance(refused, InferenceServerException), repr(refused)
        assert refused.status() == "503" and "shutting down" in str(refused), refused
    finally:
        assert s.stop() == 0, "\n".join(s.lines)
