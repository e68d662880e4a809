"""``staronnx sweep --url``: the open-loop sweep driven over the network through a real
``staronnx serve`` subprocess (tritonclient.http.aio), its checks against the server's
settings, the batch each answer names, and the served model's bounded records.

The server runs in a subprocess (its KServe stubs and tritonclient's cannot share one
process's protobuf pool); the sweep runs through the CLI as a user runs it.
"""

from __future__ import annotations

from dataclasses import replace
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
# a skip, not a collection error, where Triton's clients are absent (the GPU host)
pytest.importorskip("tritonclient", reason="needs Triton's clients (tritonclient: pip install -e '.[dev]')")
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

from staronnx import partition
from staronnx.cli import main
from staronnx.errors import StaronnxError
from staronnx.plan import Plan
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.workers.layout import MachineSpec
from staronnx.serving import ServeSpec, Server
from staronnx.zoo import chain, fragile
from test_serve import _groups, start_server
from staronnx.partition import PartitionSpec

pytestmark = pytest.mark.timeout(180)

BATCH = 4


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Plan]:
    root = tmp_path_factory.mktemp("serve-sweep")
    onnx.save(chain(depth=4, width=8), str(root / "chain.onnx"))
    onnx.save(fragile(), str(root / "fragile.onnx"))
    return {
        "tiny": partition(root / "chain.onnx", spec=PartitionSpec(parts=2, method="linear", costs="estimate"),
                          output_dir=root / "tiny"),
        "other": partition(root / "fragile.onnx",
                           spec=PartitionSpec(parts=2, method="linear", input_shapes=["x=1x8"], costs="estimate"),
                           output_dir=root / "other"),
    }


@pytest.fixture(scope="module")
def server(plans, tmp_path_factory):
    """The tiny plan served as 'tiny': batches of up to 4, 2 ms max delay, eager."""
    s = start_server([plans["tiny"].root], tmp_path_factory.mktemp("server"), "--policy", "eager",
                     "--batch-size", str(BATCH), "--max-delay", "2ms", "--queue-capacity", "256")
    yield s
    rc = s.stop()
    assert rc == 0, "\n".join(s.lines)


def _staronnx(*args: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "staronnx", *args], capture_output=True, text=True, timeout=150,
                          env={**os.environ, "STARONNX_HOME": str(home)})


def test_sweep_over_the_network_writes_the_same_results(server, plans, tmp_path):
    wire = tmp_path / "wire"
    done = _staronnx("sweep", str(plans["tiny"].root), "--url", f"http://{server.http}", "--rates", "60,150",
                     "--duration", "1.5s", "--no-extend", "--no-plots", "--quiet", "-o", str(wire), home=tmp_path / "home")
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((wire / "results.json").read_text())
    rows = doc["rows"]
    assert [r["offered_rate"] for r in rows] == [60, 150]
    front = doc["settings"]["front_end"]
    assert front["kind"] == "network" and front["url"] == f"http://{server.http}" and front["model"] == "tiny"
    # the server's settings, read from its configuration, label every row
    assert doc["settings"]["batch_sizes"] == [BATCH] and doc["settings"]["max_delay_s"] == pytest.approx(0.002)
    for r in rows:
        assert r["batch_size"] == BATCH and r["max_delay_ms"] == pytest.approx(2.0)
        assert r["policy"] == "eager" and r["groups"] == _groups()
        assert r["requests"] > 0 and r["completed"] == r["requests"], r
        assert r["failed"] == 0 and r["rejected"] == 0
        # the open-loop generator kept the offered rate over the wire
        assert r["achieved_arrival_rate"] == pytest.approx(r["offered_rate"], rel=0.15), r["loadgen"]
        assert r["loadgen"]["submitted"] >= r["requests"]
        # batches rebuilt from the ids the server answered with: the papers' metric and CPU share
        assert 0 < r["batches"] <= r["completed"]
        assert r["paper_latency_mean_ms"] > 0 and r["latency_p99_ms"] >= r["latency_p50_ms"] > 0
        assert r["cpu_share"] == pytest.approx(1.0)
        assert any(k.startswith("share_part1_cpu") for k in r)
    header = (wire / "results.csv").read_text().splitlines()[0].split(",")
    assert {"achieved_arrival_rate", "paper_latency_mean_ms", "max_delay_ms"} <= set(header)

    # the in-process sweep of the same settings, overlaid with the over-the-wire one
    local = tmp_path / "local"
    done = _staronnx("sweep", str(plans["tiny"].root), "--rates", "60", "--batch-sizes", str(BATCH),
                     "--max-delay", "2ms", "--policy", "eager", "--groups", _groups(), "--duration", "1s",
                     "--no-extend", "--no-plots", "--quiet", "-o", str(local), home=tmp_path / "home")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((local / "results.json").read_text())["settings"]["front_end"] == {"kind": "in-process"}
    png = tmp_path / "compare.png"
    done = _staronnx("sweep-plot", str(local), "--compare", str(wire), "--labels", "in-process,HTTP",
                     "-o", str(png), home=tmp_path / "home")
    assert done.returncode == 0, done.stdout + done.stderr
    assert png.stat().st_size > 0


def test_sweep_over_grpc(server, plans, tmp_path):
    """``--url grpc://``: the same sweep through tritonclient.grpc.aio, the server's batching read
    from Triton's ModelConfig call, batches rebuilt from the ids in gRPC's typed parameters."""
    wire = tmp_path / "grpc"
    done = _staronnx("sweep", str(plans["tiny"].root), "--url", f"grpc://{server.grpc}", "--rates", "60,150",
                     "--duration", "1.5s", "--no-extend", "--no-plots", "--quiet", "-o", str(wire), home=tmp_path / "home")
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((wire / "results.json").read_text())
    front = doc["settings"]["front_end"]
    assert front == {"kind": "network", "url": f"grpc://{server.grpc}", "model": "tiny",
                     "protocol": "KServe v2 gRPC (Triton's service)", "client": "tritonclient.grpc.aio"}
    assert doc["settings"]["batch_sizes"] == [BATCH] and doc["settings"]["max_delay_s"] == pytest.approx(0.002)
    rows = doc["rows"]
    assert [r["offered_rate"] for r in rows] == [60, 150]
    for r in rows:
        assert r["policy"] == "eager" and r["groups"] == _groups()
        assert r["requests"] > 0 and r["completed"] == r["requests"] and r["failed"] == 0, r
        assert r["achieved_arrival_rate"] == pytest.approx(r["offered_rate"], rel=0.15), r["loadgen"]
        assert 0 < r["batches"] <= r["completed"], r
        # the placement came from gRPC's typed response parameters
        assert r["cpu_share"] == pytest.approx(1.0) and any(k.startswith("share_part1_cpu") for k in r)

    # through the library: samples sent together share the batch the server names
    from staronnx.bench.remote import RemoteRuntime, RemoteServer

    with RemoteRuntime(f"grpc://{server.grpc}", plans["tiny"]) as remote:
        assert remote.protocol == "grpc" and remote.served.batch_size == BATCH
        x = np.ones((2, 8), np.float32)
        assert remote.submit({"x": x}).result(30)["y"].shape[0] == 2  # a whole batch, as the warm-up sends
        front = RemoteServer(remote, ServeSpec(BATCH, max_delay=0.002))
        futures = [front.submit({"x": x[:1]}) for _ in range(BATCH)]
        for f in futures:
            f.result(30)
        rec = front.records()
        front.close()
    assert len(rec.requests) == BATCH and all(q.done is not None for q in rec.requests)
    assert all(b.id >= 0 for b in rec.batches) and len(rec.batches) < BATCH, rec.batches
    assert all(b.placement for b in rec.batches)


@pytest.mark.parametrize("args, says", [
    (["--batch-sizes", "8"], "forms batches of up to 4"),
    (["--max-delay", "5ms"], "max delay of 2 ms"),
    (["--policy", "heft"], "runs with --policy eager, not heft"),
    (["--model", "nope"], "serves no model 'nope'"),
    (["--simulate"], "--simulate needs the runtime in this process"),
])
def test_sweep_url_refuses_what_the_server_does_not_do(server, plans, tmp_path, capsys, args, says):
    with pytest.raises(SystemExit) as exc:
        main(["sweep", str(plans["tiny"].root), "--url", f"http://{server.http}", "--rates", "50",
              "--duration", "0.5s", "--no-plots", "--quiet", "-o", str(tmp_path / "out"), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("staronnx: error: ") and says in err and "Traceback" not in err, err


def test_sweep_url_checks_address_and_plan(server, plans, tmp_path, capsys):
    cases = [
        ([str(plans["other"].root), "--url", f"http://{server.http}", "--model", "tiny"], "sweep the plan the server serves"),
        ([str(plans["tiny"].root), "--url", f"ftp://{server.http}"], "expected http://HOST:PORT or grpc://HOST:PORT"),
        ([str(plans["tiny"].root), "--url", f"grpc://{server.grpc}", "--model", "nope"], "serves no model 'nope'"),
        ([str(plans["other"].root), "--url", f"grpc://{server.grpc}", "--model", "tiny"],
         "sweep the plan the server serves"),
        ([str(plans["tiny"].root), "--url", f"grpc://{server.grpc}", "--batch-sizes", "8"], "forms batches of up to 4"),
        ([str(plans["tiny"].root), "--url", "http://127.0.0.1:1"], "cannot reach http://127.0.0.1:1"),
        ([str(plans["tiny"].root), "--model", "tiny"], "give --url too"),
    ]
    for argv, says in cases:
        with pytest.raises(SystemExit) as exc:
            main(["sweep", *argv, "--rates", "50", "--duration", "0.5s", "--no-plots", "--quiet",
                  "-o", str(tmp_path / "out")])
        assert exc.value.code == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("staronnx: error: ") and says in err and "Traceback" not in err, err


def test_answers_name_their_batch_and_config_the_batching(server, plans):
    """What the remote sweep reads: Triton's model config, and each answer's batch (HTTP and gRPC)."""
    http = thttp.InferenceServerClient(server.http)
    config = http.get_model_config("tiny")
    assert config["max_batch_size"] == BATCH
    # where the instances run, as Triton's instance_group says it: the CPU workers here
    assert [(g["kind"], g["count"] > 0) for g in config["instance_group"]] == [("KIND_CPU", True)]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert config["parameters"]["plan_hash"]["string_value"] == plans["tiny"].hash
    assert config["parameters"]["policy"]["string_value"] == "eager"

    x = np.ones((1, 8), np.float32)
    inp = thttp.InferInput("x", [1, 8], "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    params = http.infer("tiny", [inp]).get_response()["parameters"]
    assert isinstance(params["staronnx_batch_id"], int) and 1 <= params["staronnx_batch_size"] <= BATCH
    placement = dict(item.split("=") for item in params["staronnx_placement"].split(","))
    assert set(placement) == {"part0", "part1"} and all(a.startswith("cpu") for a in placement.values())

    g = tgrpc.InferenceServerClient(server.grpc)
    ginp = tgrpc.InferInput("x", [1, 8], "FP32")
    ginp.set_data_from_numpy(x)
    gparams = g.infer("tiny", [ginp]).get_response(as_json=True)["parameters"]
    assert int(gparams["staronnx_batch_id"]["int64_param"]) > params["staronnx_batch_id"]
    # a client batch may run in several batches: no batch is named for it
    # a request of 3 rows takes 3 places in one batch (as in Triton) and names it; one larger
    # than a batch is cut into batches and names none
    rows3 = thttp.InferInput("x", [3, 8], "FP32")
    rows3.set_data_from_numpy(np.ones((3, 8), np.float32), binary_data=True)
    named = http.infer("tiny", [rows3]).get_response()["parameters"]
    assert isinstance(named["staronnx_batch_id"], int) and 3 <= named["staronnx_batch_size"] <= BATCH
    big = thttp.InferInput("x", [BATCH + 1, 8], "FP32")
    big.set_data_from_numpy(np.ones((BATCH + 1, 8), np.float32), binary_data=True)
    assert "parameters" not in http.infer("tiny", [big]).get_response()


# -- bounded records ---------------------------------------------------------------------------------
def test_server_keeps_only_the_latest_records_when_told(plans, tmp_path):
    plan = plans["tiny"]
    x = np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32)
    expect = plan.run_reference({"x": x})["y"]
    with Runtime(plan, MachineSpec(groups=_groups()), RuntimeSpec(policy="eager")) as rt:
        with Server(rt, ServeSpec(BATCH, max_delay=0.001, keep_records=32)) as bounded, Server(rt, ServeSpec(BATCH, max_delay=0.001)) as full:
            for server in (bounded, full):
                for _ in range(5):  # waves, so both full and partial batches form
                    futures = [server.submit({"x": x}) for _ in range(100)]
                    for f in futures:
                        np.testing.assert_allclose(f.result(30)["y"], expect, rtol=1e-5, atol=1e-5)
            kept = bounded.records()
            assert len(kept.requests) == 32 and len(kept.batches) <= 32 and len(kept.queue_samples) <= 32
            assert [r.id for r in kept.requests] == list(range(500 - 32, 500))  # the latest ones
            assert all(r.done is not None for r in kept.requests)
            assert len(bounded._requests) == 32 and len(bounded._batches) == 32 and len(bounded._queue_samples) == 32
            # without keep_records (what sweeps use) every request stays on record
            assert len(full.records().requests) == 500
        with pytest.raises(StaronnxError, match="keep_records"):
            Server(rt, ServeSpec(BATCH, keep_records=0))


def test_served_model_records_stay_bounded(plans):
    """staronnx serve's model endpoint: many requests through its infer path, records bounded."""
    from staronnx.serve.metrics import ServeMetrics
    from staronnx.serve.models import ENDPOINT_SPEC, RECORDS_KEPT, ModelEndpoint

    plan = plans["tiny"]
    x = np.random.default_rng(1).standard_normal((1, 8)).astype(np.float32)
    expect = plan.run_reference({"x": x})["y"]
    rt = Runtime(plan, MachineSpec(groups=_groups()), RuntimeSpec(policy="eager"))
    serving = replace(ENDPOINT_SPEC, batch_size=BATCH, max_delay=0.001, queue_capacity=64)
    default = ModelEndpoint("a", rt, serving, metrics=ServeMetrics())
    assert default.server.keep_records == RECORDS_KEPT  # what staronnx serve builds
    default.server.close()
    model = ModelEndpoint("tiny", rt, replace(serving, keep_records=50), metrics=ServeMetrics())

    async def drive() -> None:
        for _ in range(10):
            answers = await asyncio.gather(*(model.infer({"x": x}, {"x": "FP32"}, None) for _ in range(40)))
            for a in answers:
                np.testing.assert_allclose(a.outputs["y"], expect, rtol=1e-5, atol=1e-5)
                assert 1 <= a.parameters["staronnx_batch_size"] <= BATCH

    try:
        asyncio.run(drive())
        assert model.stats.success == 400
        assert len(model.server._requests) == 50
        assert len(model.server._batches) <= 50 and len(model.server._queue_samples) <= 50
    finally:
        model.close(10)
