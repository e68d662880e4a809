"""What a repository config's queue and instance settings mean (issue 49, item 2): priority levels,
per-level queue policies, the DELAY timeout action, per-request timeouts, instance counts and
GPU lists.

The batcher's order is checked first on :class:`~staronnx.serving.Server` itself, with a runtime
behind a gate (no batch completes until the test opens it, so what is queued is known, not
timed). Then through the door users take: ``staronnx serve --model-repository`` on loopback and
Triton's own clients over HTTP and gRPC, with ``bert_tiny`` from ``models/real/``. Its sequence
length is dynamic and requests of different lengths never share a batch, so with a long
``max_queue_delay_microseconds`` each waits alone in the queue until the oldest one's delay runs
out; the batcher then forms one batch per length, in the queue's order. Which request left first
is read from the answers (``staronnx_batch_id``), never from a clock; the only timing is that the
requests are queued, which the test sees in the server's statistics, well within the 5 s delay.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
from _helpers import Gated

from staronnx import PartitionSpec, partition
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.workers.layout import MachineSpec
from staronnx.serve.instances import InstanceError, InstanceGroup, holders
from staronnx.serving import ServeSpec, Server
from staronnx.serving.priority import LevelPolicy, QueuePolicy
from staronnx.serving.server import LevelFullError
from staronnx.workers.residency import WorkerSlot
from staronnx.zoo import chain

pytest.importorskip("tritonclient", reason="needs Triton's clients (tritonclient: pip install -e '.[dev]')")
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from test_serve import start_server
from test_triton_compat import simple_model
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(300)

BERT = Path(__file__).resolve().parents[1] / "models" / "real" / "bert_tiny.onnx"
#: how long a partial batch of the bert models waits: far longer than queueing a few requests takes
DELAY_US = 5_000_000


# -- the batcher's order, behind a gate ---------------------------------------------------------
@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    root = tmp_path_factory.mktemp("queues")
    onnx.save(chain(depth=2, width=8), str(root / "chain.onnx"))
    plan = partition(root / "chain.onnx", spec=PartitionSpec(parts=1, costs="estimate"), output_dir=root / "plan")
    with Runtime(plan, MachineSpec(groups=str(min(os.sched_getaffinity(0)))), RuntimeSpec(policy="eager")) as rt:
        yield rt


def _sample(i: int) -> dict[str, np.ndarray]:
    return {"x": np.full((1, 8), float(i), np.float32)}


def _held(server: Server) -> object:
    """A first request, taken into a batch that waits at the gate: what follows stays queued."""
    first = server.submit(_sample(0))
    deadline = time.monotonic() + 10
    while server.queue_length and time.monotonic() < deadline:
        time.sleep(0.001)
    assert server.in_flight == 1
    return first


TWO_LEVELS = QueuePolicy((LevelPolicy(), LevelPolicy(capacity=3)), default_level=2, priority_levels=2)


def test_each_batch_takes_the_highest_level_first(runtime):
    gated = Gated(runtime)
    server = Server(gated, ServeSpec(2, max_inflight=1, max_delay=0.0, queue_policy=TWO_LEVELS))
    try:
        first = _held(server)
        low = [server.submit(_sample(i)) for i in (1, 2, 3)]  # the default level, 2
        high = [server.submit(_sample(i), level=1) for i in (4, 5)]
        gated.gate.set()
        for f in [first, *low, *high]:
            f.result(timeout=30)
    finally:
        gated.gate.set()
        server.close()
    batch = {f: f.batch.id for f in [*low, *high]}
    # the two level-1 requests came last and leave first, together; the level-2 ones in arrival order
    assert batch[high[0]] == batch[high[1]] < batch[low[0]] == batch[low[1]] < batch[low[2]]


def test_a_full_level_is_refused_while_the_others_have_room(runtime):
    gated = Gated(runtime)
    server = Server(gated, ServeSpec(2, max_inflight=1, max_delay=0.0, queue_policy=TWO_LEVELS))
    try:
        _held(server)
        for i in range(3):
            server.submit(_sample(i))
        with pytest.raises(LevelFullError, match=r"the queue of priority level 2 is full \(3 requests waiting"):
            server.submit(_sample(9))
        server.submit(_sample(10), level=1)  # level 1 has room of its own
        assert server.queue_length == 4
    finally:
        gated.gate.set()
        server.close()


def test_delay_moves_a_request_behind_the_others_of_its_level(runtime):
    gated = Gated(runtime)
    policy = QueuePolicy((LevelPolicy(timeout=60.0, delay=True),))
    server = Server(gated, ServeSpec(1, max_inflight=1, max_delay=0.0, queue_policy=policy))
    try:
        first = _held(server)
        late, b, c = (server.submit(_sample(i)) for i in (1, 2, 3))
        assert server.delay([late]) == 1 and server.delay([late]) == 0  # moved once
        d = server.submit(_sample(4))  # a newer request within its timeout goes ahead of the delayed one too
        gated.gate.set()
        for f in (first, late, b, c, d):
            f.result(timeout=30)
    finally:
        gated.gate.set()
        server.close()
    assert b.batch.id < c.batch.id < d.batch.id < late.batch.id


def test_a_level_out_of_range_is_refused_and_a_plain_queue_delays_nothing(runtime):
    from staronnx import InputError

    with Server(runtime, ServeSpec(2, max_delay=0.0, queue_policy=TWO_LEVELS)) as server:
        with pytest.raises(InputError, match="priority level 3 is out of range: this server's levels are 1 to 2"):
            server.submit(_sample(1), level=3)
    with Server(runtime, ServeSpec(2, max_delay=0.0)) as server:
        assert server.delay([server.submit(_sample(1))]) == 0


# -- instance groups on the server's workers ---------------------------------------------------
WORKERS = [WorkerSlot("cuda0.s0", "cuda", 0), WorkerSlot("cuda0.s1", "cuda", 0), WorkerSlot("cuda1.s0", "cuda", 1),
           WorkerSlot("cuda1.s1", "cuda", 1), WorkerSlot("cpu:numa0", "cpu"), WorkerSlot("cpu:numa1", "cpu")]


@pytest.mark.parametrize("groups, selector", [
    ([], None),
    ([InstanceGroup("g", "auto")], None),
    ([InstanceGroup("g", "gpu")], "cuda"),
    ([InstanceGroup("g", "cpu")], "cpu"),
    ([InstanceGroup("g", "gpu", 1, (1,))], "cuda1.s0"),
    ([InstanceGroup("g", "gpu", 1)], "cuda0.s0,cuda1.s0"),
    ([InstanceGroup("g", "gpu", 1, (0,)), InstanceGroup("h", "gpu", 1, (0,))], "cuda0.s0,cuda0.s1"),
    ([InstanceGroup("g", "cpu", 1)], "cpu:numa0"),
    ([InstanceGroup("g", "gpu", 2, (1,)), InstanceGroup("h", "cpu", 1)], "cuda1.s0,cuda1.s1,cpu:numa0"),
    ([InstanceGroup("g", "auto", 1)], "cuda0.s0,cuda1.s0"),  # KIND_AUTO with a count: the GPUs, where there are
])
def test_instance_groups_pick_the_workers_that_hold_the_model(groups, selector):
    assert holders(groups, WORKERS) == selector


def test_kind_auto_with_a_count_is_cpu_groups_without_gpus():
    assert holders([InstanceGroup("g", "auto", 1)], [w for w in WORKERS if w.kind == "cpu"]) == "cpu:numa0"


@pytest.mark.parametrize("groups, words", [
    ([InstanceGroup("instance_group[0]", "gpu", 3, (0,))],
     "3 instance(s) on GPU 0, but this server has 2 CUDA stream(s) per GPU (--cuda-streams 2): start it with "
     "--cuda-streams 3"),
    ([InstanceGroup("instance_group[0]", "gpu", 1, (2,))], "GPU 2 is not one this server drives (GPUs 0, 1"),
    ([InstanceGroup("instance_group[0]", "cpu", 3)], "3 KIND_CPU instance(s), but this server has 2 CPU group(s) "
                                                     "(cpu:numa0, cpu:numa1; --groups)"),
    ([InstanceGroup("instance_group[0]", "cpu", 1, (0,))], "instance_group[0]: gpus [0] go with KIND_GPU"),
])
def test_instances_the_server_cannot_give_are_refused_naming_the_flag(groups, words):
    with pytest.raises(InstanceError) as info:
        holders(groups, WORKERS)
    assert words in str(info.value)


# -- through Triton's clients ------------------------------------------------------------------
BERT_MODELS = {
    # two levels, requests without a priority at level 2, whose queue holds 3
    "ranked": f"""max_batch_size: 4
dynamic_batching {{ max_queue_delay_microseconds: {DELAY_US} priority_levels: 2 default_priority_level: 2
  priority_queue_policy {{ key: 2 value: {{ max_queue_size: 3 }} }} }}""",
    # past its timeout (60 s, or shorter where the request says) a request is moved behind the others
    "patient": f"""max_batch_size: 4
dynamic_batching {{ max_queue_delay_microseconds: {DELAY_US} default_queue_policy {{ timeout_action: DELAY
  default_timeout_microseconds: 60000000 allow_timeout_override: true }} }}""",
    # a request may give its own timeout
    "hurried": f"""max_batch_size: 4
dynamic_batching {{ max_queue_delay_microseconds: {DELAY_US} default_queue_policy {{ allow_timeout_override: true }} }}""",
}

SIMPLE_MODELS = {
    "one_group": "max_batch_size: 8 instance_group [ { kind: KIND_CPU count: 1 } ]",
    "too_many": "max_batch_size: 8 instance_group [ { kind: KIND_CPU count: 5 } ]",
    "on_gpu_0": "max_batch_size: 8 instance_group [ { kind: KIND_GPU count: 1 gpus: [ 0 ] } ]",
    "bad_level": "max_batch_size: 8 dynamic_batching { priority_levels: 2 default_priority_level: 1 priority_queue_policy "
                 "{ key: 3 value: { max_queue_size: 1 } } }",
}


def _repository(root: Path, bert: dict[str, str], simple: dict[str, str]) -> Path:
    for name, config in [*bert.items(), *simple.items()]:
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
        if name in bert:
            (root / name / "1" / "model.onnx").symlink_to(BERT)
        else:
            onnx.save(simple_model(), str(root / name / "1" / "model.onnx"))
    return root


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = _repository(tmp_path_factory.mktemp("repository") / "models", BERT_MODELS, SIMPLE_MODELS)
    s = start_server([], tmp_path_factory.mktemp("home"), "--model-repository", str(repo), "--policy", "eager",
                     "--batch-size", "8", "--max-delay", "1ms", "--drain-timeout", "20s")
    yield s
    assert s.stop() == 0, "\n".join(s.lines)


def _module(protocol: str):
    return httpclient if protocol == "http" else grpcclient


def _client(served, protocol: str):
    return _module(protocol).InferenceServerClient(served.http if protocol == "http" else served.grpc)


def _tokens(module, length: int) -> list:
    """One bert_tiny request of ``length`` tokens (its own signature: it batches only with its length)."""
    ids = (np.arange(length, dtype=np.int64) % 1000).reshape(1, length)
    inputs = []
    for name, value in (("input_ids", ids), ("attention_mask", np.ones_like(ids)), ("token_type_ids", 0 * ids)):
        tensor = module.InferInput(name, [1, length], "INT64")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def _batch_id(result, protocol: str) -> int:
    if protocol == "http":
        return int(result.get_response()["parameters"]["staronnx_batch_id"])
    return int(result.get_response().parameters["staronnx_batch_id"].int64_param)


def _queued(served, name: str) -> int:
    stats = httpclient.InferenceServerClient(served.http).get_inference_statistics(name)["model_stats"][0]
    return int(stats["staronnx"]["queue_length"])


def _wait_queued(served, name: str, count: int) -> None:
    """Until ``count`` requests of ``name`` wait in its queue (well within its 5 s batch delay)."""
    deadline = time.monotonic() + DELAY_US / 1e6 * 0.8
    while _queued(served, name) < count:
        assert time.monotonic() < deadline, f"{count} requests never waited together in {name}'s queue"
        time.sleep(0.02)


def _send(pool: ThreadPoolExecutor, served, protocol: str, name: str, length: int, **kwargs):
    """A request sent from a thread of its own (its answer comes once its batch has run)."""
    return pool.submit(lambda: _client(served, protocol).infer(name, _tokens(_module(protocol), length), **kwargs))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_high_priority_request_leaves_before_the_low_ones_queued_before_it(served, protocol):
    """Three requests at the default level (2) wait; a fourth is refused (level 2's queue holds 3);
    one at priority 1 comes last and is answered from the first batch that leaves."""
    with ThreadPoolExecutor(4) as pool:
        low = []
        for n in (1, 2, 3):  # one after the other: their order in the queue is known
            low.append(_send(pool, served, protocol, "ranked", n))
            _wait_queued(served, "ranked", n)
        with pytest.raises(InferenceServerException, match="the queue of priority level 2 is full"):
            _client(served, protocol).infer("ranked", _tokens(_module(protocol), 4))
        high = _send(pool, served, protocol, "ranked", 5, priority=1)
        _wait_queued(served, "ranked", 4)
        answers = [f.result(timeout=60) for f in (*low, high)]
    ids = [_batch_id(a, protocol) for a in answers]
    assert ids[3] < min(ids[:3]) and ids[:3] == sorted(ids[:3]), ids
    assert answers[3].as_numpy("last_hidden_state").shape == (1, 5, 128)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_priorities_out_of_range_and_timeouts_not_allowed_are_refused(served, protocol):
    client, module = _client(served, protocol), _module(protocol)
    with pytest.raises(InferenceServerException, match=r"priority 3 is out of range: its levels are 1 \(the "
                                                        r"highest\) to 2"):
        client.infer("ranked", _tokens(module, 2), priority=3)
    with pytest.raises(InferenceServerException, match="model 'hurried' has no priority levels"):
        client.infer("hurried", _tokens(module, 2), priority=1)
    with pytest.raises(InferenceServerException, match="model 'ranked' does not let a request set its own queue "
                                                        "timeout"):
        client.infer("ranked", _tokens(module, 2), timeout=1000)
    assert client.is_model_ready("ranked") and client.is_model_ready("hurried")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_requests_own_timeout_is_honoured_where_the_policy_allows_it(served, protocol):
    """allow_timeout_override: a lone request would wait 5 s for its batch; with timeout=200000
    (µs) it is refused once that has passed, saying so."""
    client, module = _client(served, protocol), _module(protocol)
    with pytest.raises(InferenceServerException, match="waited for its batch longer than the queue timeout "
                                                        r"\(200000 µs"):
        client.infer("hurried", _tokens(module, 3), timeout=200_000)
    assert _queued(served, "hurried") == 0  # withdrawn from the queue


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_delay_runs_a_request_past_its_timeout_after_the_others(served, protocol):
    """DELAY: the first request gives a timeout of 0.3 s (shorter than its level's 60 s), waits past
    it and is moved behind the two that came after it (within theirs); all three are answered, it
    last."""
    with ThreadPoolExecutor(3) as pool:
        late = _send(pool, served, protocol, "patient", 1, timeout=300_000)
        _wait_queued(served, "patient", 1)
        time.sleep(0.6)  # its timeout passes (had it not yet been moved, it would be moved behind these all the same)
        others = []
        for n in (2, 3):
            others.append(_send(pool, served, protocol, "patient", n))
            _wait_queued(served, "patient", n)
        answers = [f.result(timeout=60) for f in (late, *others)]
    ids = [_batch_id(a, protocol) for a in answers]
    assert ids[1] < ids[2] < ids[0], ids


def test_the_config_says_the_queue_policy_and_the_instances_as_served(served):
    client = httpclient.InferenceServerClient(served.http)
    batching = client.get_model_config("ranked")["dynamic_batching"]
    assert int(batching["priority_levels"]) == 2 and int(batching["default_priority_level"]) == 2
    assert batching["priority_queue_policy"]["2"]["max_queue_size"] == 3
    over_grpc = grpcclient.InferenceServerClient(served.grpc).get_model_config("ranked").config.dynamic_batching
    assert over_grpc.priority_levels == 2 and over_grpc.priority_queue_policy[2].max_queue_size == 3
    groups = client.get_model_config("one_group")["instance_group"]
    assert [(g["kind"], g["count"]) for g in groups] == [("KIND_CPU", 1)]
    assert len(client.get_inference_statistics("one_group")["model_stats"][0]["staronnx"]["held_by"]) == 1
    inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.ones((1, 16), np.int32))
    np.testing.assert_array_equal(client.infer("one_group", inputs).as_numpy("OUTPUT0"), np.full((1, 16), 2))


def test_configs_the_server_cannot_serve_fail_alone_with_their_reason(served):
    index = {e["name"]: e for e in httpclient.InferenceServerClient(served.http).get_model_repository_index()}
    reasons = {
        "too_many": "instance_group: 5 KIND_CPU instance(s), but this server has",
        "on_gpu_0": "instance_group[0] KIND_GPU: this server has no CUDA workers (start it with --cuda-streams N)",
        "bad_level": "dynamic_batching.priority_queue_policy names level(s) [3] outside 1 to priority_levels (2)",
    }
    for name, words in reasons.items():
        assert index[name]["state"] == "UNAVAILABLE" and words in index[name]["reason"], index[name]


# -- on a GPU ----------------------------------------------------------------------------------
def _cuda_reason() -> str | None:
    from staronnx.workers.cuda import cuda_unavailable_reason

    return cuda_unavailable_reason(0)


@pytest.mark.gpu
def test_kind_gpu_count_and_gpus_keep_the_model_on_those_streams(tmp_path):
    """KIND_GPU count 1 on GPU 0 of a server with two streams per GPU: the model is held by one
    CUDA stream of GPU 0 (its config says so) and answers; three instances there are refused,
    naming --cuda-streams."""
    reason = _cuda_reason()
    if reason is not None:
        pytest.skip(f"needs a GPU with ONNX Runtime's CUDAExecutionProvider: {reason}")
    repo = _repository(tmp_path / "models", {}, {
        "one_stream": "max_batch_size: 8 instance_group [ { kind: KIND_GPU count: 1 gpus: [ 0 ] } ]",
        "three_streams": "max_batch_size: 8 instance_group [ { kind: KIND_GPU count: 3 gpus: [ 0 ] } ]",
        "anywhere": "max_batch_size: 8",
    })
    s = start_server([], tmp_path / "home", "--model-repository", str(repo), "--policy", "eager", "--batch-size", "8",
                     "--max-delay", "1ms", "--cuda-streams", "2", "--cuda-devices", "0", "--drain-timeout", "20s")
    try:
        client = httpclient.InferenceServerClient(s.http)
        groups = client.get_model_config("one_stream")["instance_group"]
        assert [(g["kind"], g["count"], g["gpus"]) for g in groups] == [("KIND_GPU", 1, [0])], groups
        held = client.get_inference_statistics("one_stream")["model_stats"][0]["staronnx"]["held_by"]
        assert held == ["cuda0.s0"], held
        inputs = [httpclient.InferInput(n, [2, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(np.ones((2, 16), np.int32))
        np.testing.assert_array_equal(client.infer("one_stream", inputs).as_numpy("OUTPUT0"), np.full((2, 16), 2))
        index = {e["name"]: e for e in client.get_model_repository_index()}
        assert "3 instance(s) on GPU 0, but this server has 2 CUDA stream(s) per GPU (--cuda-streams 2)" in \
            index["three_streams"]["reason"], index["three_streams"]
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_a_reload_with_another_instance_count_takes_effect(tmp_path, two_groups):
    """Explicit model control: loaded at start on one CPU group of two, reloaded with a config
    that asks for two, the model is then held by both (its first runtime's workers could not
    change while serving: the reload gets a runtime of its own)."""
    repo = _repository(tmp_path / "models", {}, {"one_group": SIMPLE_MODELS["one_group"]})
    s = start_server([], tmp_path / "home", "--model-repository", str(repo), "--model-control-mode", "explicit",
                     "--load-model", "*", "--policy", "eager", "--batch-size", "8", "--max-delay", "1ms",
                     "--drain-timeout", "20s")
    try:
        client = httpclient.InferenceServerClient(s.http)

        def held() -> list[str]:
            return client.get_inference_statistics("one_group")["model_stats"][0]["staronnx"]["held_by"]

        assert len(held()) == 1
        client.load_model("one_group", config='{"max_batch_size": 8, "instance_group": [{"kind": "KIND_CPU", '
                                              '"count": 2}]}')
        assert len(held()) == 2
        assert [g["count"] for g in client.get_model_config("one_group")["instance_group"]] == [2]
        with pytest.raises(InferenceServerException, match="instance_group: 3 KIND_CPU instance"):
            client.load_model("one_group", config='{"max_batch_size": 8, "instance_group": [{"kind": "KIND_CPU", '
                                                  '"count": 3}]}')
        assert client.is_model_ready("one_group") and len(held()) == 2  # a failed load changes nothing
    finally:
        assert s.stop() == 0, "\n".join(s.lines)
