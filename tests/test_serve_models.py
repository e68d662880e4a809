"""``staronnx serve a/ b/``: several models on one shared runtime, through the real CLI and HTTP.

What a user of a shared server relies on: one set of workers serves every model, each answer
equals its model's reference, one model's overload is refused (503) for that model only, and
/metrics and the statistics say each model's latency target, deadline misses and busy shares.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest

from staronnx import partition
from staronnx.zoo import chain, inception
from staronnx.serve.models import inflight_from_models
from staronnx.serving.spec import inflight_window
from test_serve import _groups, _m, _metrics, _post, start_server
from test_simulator import plan  # noqa: F401 - a fixture
from staronnx.partition import PartitionSpec
from staronnx.workers.layout import MachineSpec

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """A heavy Inception (tens of ms a sample on one core) cut by METIS, a light MLP."""
    root = tmp_path_factory.mktemp("serve-models")
    onnx.save(inception(blocks=3, channels=32, size=64), str(root / "heavy.onnx"))
    onnx.save(chain(depth=4, width=8), str(root / "light.onnx"))
    return {
        "heavy": partition(root / "heavy.onnx", [0.6, 0.4], PartitionSpec(costs="estimate"), output_dir=root / "heavy"),
        "light": partition(root / "light.onnx", [0.5, 0.5], PartitionSpec(costs="estimate"), output_dir=root / "light"),
    }


def body(x: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()


def output(reply: dict, name: str) -> np.ndarray:
    (out,) = [o for o in reply["outputs"] if o["name"] == name]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


def heavy_x(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 3, 64, 64)).astype(np.float32)


def light_x(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 8)).astype(np.float32)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def test_two_models_on_one_runtime_answer_their_references_and_report_their_targets(plans, tmp_path):
    heavy, light = plans["heavy"], plans["light"]
    s = start_server([heavy.root, light.root], tmp_path, "--policy", "heft", "--batch-size", "2",
                     "--max-delay", "1ms", "--slo-ms", "light=60000", "--slo-ms", "heavy=0.001",
                     "--queue-capacity", "light=64")
    try:
        text = "\n".join(s.lines)
        assert re.search(r"one runtime for 2 models: 2 workers", text), text
        # each model batches by the one spec the flags were parsed into (its own queue capacity),
        # in flight the window of the one rule (no perf models here: its unknown-machine window)
        window = inflight_window([None] * 2)
        assert inflight_from_models(light, 2, groups=_groups(), cuda_streams=0) is None
        for model, capacity in (("heavy", 1024), ("light", 64)):
            config = get_json(f"http://{s.http}/v2/models/{model}/config")
            assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 1000
            assert {k: config["parameters"][k]["string_value"] for k in ("batch_size", "queue_capacity",
                                                                          "max_inflight")} == {
                "batch_size": "2", "queue_capacity": str(capacity), "max_inflight": str(window)}
            assert re.search(rf"model {model!r}: .*batches of up to 2, max delay 1 ms, {window} batches in flight",
                             text), text
        # the event loop the serve extra brings (uvloop) runs the front ends
        assert re.search(r"event loop: uvloop \d", text), text
        for i in range(3):
            st, reply = _post(s.http, "/v2/models/heavy/infer", body(heavy_x(i)))
            assert st == 200, reply
            np.testing.assert_allclose(output(reply, "logits"), heavy.run_reference({"x": heavy_x(i)})["logits"],
                                       rtol=1e-4, atol=1e-4)
            st, reply = _post(s.http, "/v2/models/light/infer", body(light_x(i)))
            assert st == 200, reply
            np.testing.assert_allclose(output(reply, "y"), light.run_reference({"x": light_x(i)})["y"],
                                       rtol=1e-4, atol=1e-4)
        stats = {m["name"]: m["staronnx"] for m in get_json(f"http://{s.http}/v2/models/stats")["model_stats"]}
        assert stats["light"]["latency_target_ms"] == 60000 and stats["light"]["deadline_misses"] == 0
        assert stats["heavy"]["deadline_misses"] == 3  # a 1 us target: every answer is late
        # the same workers serve both, each model with its own busy share of them
        assert set(stats["heavy"]["busy"]) == set(stats["light"]["busy"]) and len(stats["heavy"]["busy"]) == 2
        assert sum(stats["heavy"]["busy"].values()) > sum(stats["light"]["busy"].values()) > 0
        metrics = _metrics(s.metrics)
        assert _m(metrics, "staronnx_deadline_misses_total", model="heavy") == 3
        assert _m(metrics, "staronnx_deadline_misses_total", model="light") == 0
        assert _m(metrics, "staronnx_latency_target_seconds", model="light") == 60.0
        config = get_json(f"http://{s.http}/v2/models/light/config")["parameters"]
        assert config["shared_runtime"]["string_value"] == "True"
        assert config["latency_ms"]["string_value"] == "60000.0"
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_one_models_overload_is_503_for_it_only(plans, tmp_path):
    """The heavy model is flooded past its own queue (2 samples): some of its requests get
    503; every request of the light model (no target: it waits behind the heavy backlog, in
    its own queue of 64), sent meanwhile, gets its answer."""
    heavy, light = plans["heavy"], plans["light"]
    s = start_server([heavy.root, light.root], tmp_path, "--policy", "heft", "--batch-size", "1",
                     "--max-delay", "0ms", "--queue-capacity", "64", "--queue-capacity", "heavy=2")
    try:
        # bodies built first: built one by one between submissions (a busy machine makes each
        # take ms), the flood trickled in slower than the server drained it and nothing overflowed
        heavy_bodies = [body(heavy_x(i)) for i in range(40)]
        light_bodies = [body(light_x(i)) for i in range(10)]
        with ThreadPoolExecutor(16) as pool:
            flood = [pool.submit(_post, s.http, "/v2/models/heavy/infer", b) for b in heavy_bodies]
            calm = [(i, pool.submit(_post, s.http, "/v2/models/light/infer", b)) for i, b in enumerate(light_bodies)]
            heavy_status = [f.result()[0] for f in flood]
            for i, f in calm:
                st, reply = f.result()
                assert st == 200, reply
                np.testing.assert_allclose(output(reply, "y"), light.run_reference({"x": light_x(i)})["y"],
                                           rtol=1e-4, atol=1e-4)
        assert set(heavy_status) <= {200, 503} and heavy_status.count(503) > 0, heavy_status
        assert heavy_status.count(200) > 0
        metrics = _metrics(s.metrics)
        assert _m(metrics, "nv_inference_request_failure", model="heavy", version="1", reason="REJECTED") > 0
        assert _m(metrics, "nv_inference_request_failure", model="light", version="1", reason="REJECTED") == 0
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_targets_must_name_served_models(plans, tmp_path, capsys):
    from _helpers import cli

    code, out, err = cli(capsys, "serve", plans["heavy"].root, plans["light"].root, "--slo-ms", "ligth=5")
    assert code != 0 and "'ligth'" in out + err
    code, out, err = cli(capsys, "serve", plans["heavy"].root, plans["light"].root, "--slo-ms", "light=5",
                         "--separate-runtimes")
    assert code != 0 and "--separate-runtimes" in out + err
    code, out, err = cli(capsys, "serve", plans["heavy"].root, plans["light"].root, "--priority", "light=1.5")
    assert code != 0 and "whole number" in out + err and "'1.5'" in out + err  # not silently 1


def test_model_workers_keep_a_model_on_the_workers_named(plans, tmp_path):
    """``--model-workers light=<one group>``: the light model is loaded on that CPU group only
    (the server says so at start and in its statistics), its tasks run there and nowhere else,
    and both models still answer their references."""
    import os

    heavy, light = plans["heavy"], plans["light"]
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 allowed PUs for two CPU groups")
    only = f"cpu:pus{sorted(os.sched_getaffinity(0))[1]}"
    s = start_server([heavy.root, light.root], tmp_path, "--policy", "heft", "--batch-size", "2",
                     "--max-delay", "1ms", "--model-workers", f"light={only}")
    try:
        assert f"light on {only} only" in "\n".join(s.lines), s.lines
        for i in range(4):
            st, reply = _post(s.http, "/v2/models/light/infer", body(light_x(i)))
            assert st == 200, reply
            np.testing.assert_allclose(output(reply, "y"), light.run_reference({"x": light_x(i)})["y"],
                                       rtol=1e-4, atol=1e-4)
        st, reply = _post(s.http, "/v2/models/heavy/infer", body(heavy_x(0)))
        assert st == 200, reply
        stats = {m["name"]: m["staronnx"] for m in get_json(f"http://{s.http}/v2/models/stats")["model_stats"]}
        assert stats["light"]["held_by"] == [only]
        assert len(stats["heavy"]["held_by"]) == 2
        assert stats["light"]["busy"][only] > 0
        assert all(busy == 0 for worker, busy in stats["light"]["busy"].items() if worker != only)
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_model_workers_refuses_unknown_models_and_separate_runtimes(plans, tmp_path):
    """Refused before anything starts, with the cause named (the CLI prints the error's text)."""
    from typer.testing import CliRunner

    from staronnx.cli import app

    heavy, light = plans["heavy"], plans["light"]
    runner = CliRunner()
    args = ["serve", str(heavy.root), str(light.root), "--http-port", "0", "--grpc-port", "0"]
    for extra, message in ((["--model-workers", "nope=cpu"], "'nope' that are not served"),
                           (["--model-workers", "light=cpu", "--separate-runtimes"], "does not go with --separate-runtimes"),
                           (["--model-workers", "light=gpu"], "'gpu' matches no worker"),
                           (["--model-workers", "light"], "NAME=WORKERS")):
        out = runner.invoke(app, [*args, *extra])
        assert out.exit_code != 0, out.output
        assert message in out.output + str(out.exception), (extra, out.output, out.exception)


def test_a_served_models_window_is_the_simulators_from_the_same_perf_models(plan, tmp_path, monkeypatch, two_groups):
    """One rule sizes the in-flight window: a served model's (``staronnx serve``, a Ray replica),
    a sweep's or a simulation's machine and the rule over each worker's whole-plan time from the
    perf models give one number. A what-if GPU 20x faster than each one-PU CPU group: dmda takes a
    CPU once ~20 batches queue on the GPU, so the window holds them."""
    from test_simulator import MS, write_models

    from staronnx.bench.machine import build_machine, machine_inflight
    from staronnx.perfmodels import PerfModelStore
    from staronnx.runtime.runtime import Runtime
    from staronnx.serve.metrics import ServeMetrics
    from staronnx.serve.models import ModelEndpoint
    from staronnx.serve.protocol import ProtocolError
    from staronnx.serving.spec import ServeSpec

    monkeypatch.setenv("STARONNX_HOME", str(tmp_path))
    write_models(PerfModelStore(), plan, {(0, "cuda0"): 1 * MS, (1, "cuda0"): 1 * MS,
                                          (0, "cpu1"): 20 * MS, (1, "cpu1"): 20 * MS})
    rule = inflight_window([2 * MS, 40 * MS, 40 * MS])  # a batch through both parts, per worker
    machine = build_machine(plan, MachineSpec(groups=two_groups, cuda_streams=1))
    assert machine_inflight(machine, 1) == inflight_from_models(plan, 1, groups=two_groups, cuda_streams=1) == rule
    assert rule == 20 + 1 + 1 + 3
    settings = {"groups": two_groups, "cuda_streams": 1}  # the GPU is the what-if's: the runtime has CPUs only
    with Runtime(plan, MachineSpec(groups=two_groups)) as rt:
        for spec, window in ((ServeSpec(1, max_delay=0.0, queue_capacity=16), rule),
                             (ServeSpec(1, max_delay=0.0, queue_capacity=16, max_inflight=3), 3)):  # given: kept
            endpoint = ModelEndpoint("chain", rt, spec, metrics=ServeMetrics(), settings=settings)
            try:
                assert endpoint.server.max_inflight == endpoint.server.spec.max_inflight == window
                assert endpoint.config()["parameters"]["max_inflight"] == {"string_value": str(window)}
                # the spec's queue capacity bounds a client's batch too: refused whole, as invalid
                with pytest.raises(ProtocolError, match="holds at most 16 samples") as refused:
                    asyncio.run(endpoint.infer({"x": np.zeros((17, 32), np.float32)}, {"x": "FP32"}, None))
                assert refused.value.kind == "invalid" and endpoint.server.queue_length == 0
            finally:
                endpoint.server.close()
