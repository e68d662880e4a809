"""``staronnx serve --ray`` on the real exported models (issue 34): every client gets its own answer.

The Ray tests' local cluster (conftest's ``cluster``: 2 CPUs, skipped with its reason where
Ray cannot start) and one ``staronnx serve --ray`` in a subprocess joined to it, hosting
every real model, the issue's fixed-batch-1 time-major OCR model and a GRU whose state's batch
the graph does not name (``--batch-axis gru_unnamed:state=1``, which each replica must apply to
the plan it loads) on one shared runtime. 16 concurrent clients per model, over HTTP with
Triton's client, each with its own values and one of two shapes: every answer must be ORT's
answer to that client's own inputs, and none may fail.
"""

from __future__ import annotations

import pytest
# a skip, not a collection error, where Triton's clients are absent (the GPU host)
pytest.importorskip("tritonclient", reason="needs Triton's clients (tritonclient: pip install -e '.[dev]')")
import tritonclient.http as thttp

import realmodels
from staronnx import partition
from test_ray import RAY_TEST_S, _start_serve
from test_real_models_serve import (ALONE, BATCH, CLIENTS, LEADING, MODELS, OWN_AXIS, concurrent_clients,
                                    gru_state_unnamed, http_infer, model_plan, shared_state_request)
from staronnx.partition import PartitionSpec

pytestmark = [pytest.mark.ray, pytest.mark.timeout(RAY_TEST_S)]

#: the GRU served with the user's --batch-axis (its state's batch unnamed in the graph)
UNNAMED = "gru_unnamed"


def test_each_client_gets_its_own_answer_through_ray(cluster, real_plan, tmp_path_factory, tmp_path):
    plans = {name: model_plan(name, real_plan, tmp_path_factory) for name in MODELS}
    plans[UNNAMED] = partition(str(gru_state_unnamed(tmp_path)), None,
                               PartitionSpec(costs="estimate", input_shapes=realmodels.input_shapes("gru_stream")),
                               output_dir=tmp_path / "gru")
    args: list[str] = [str(p.root) for p in plans.values()]
    for name in plans:
        args += ["--name", name]
    s = _start_serve(cluster, tmp_path / "home", *args, "--groups", "cores=1", "--policy", "eager",
                     "--batch-size", str(BATCH), "--max-delay", "50ms", "--batch-axis", f"{UNNAMED}:state=1")
    addr = s.http
    try:
        client = thttp.InferenceServerClient(addr, network_timeout=120.0)
        sizes = {name: concurrent_clients(http_infer, addr, name, name, first=0) for name in MODELS}
        sizes[UNNAMED] = concurrent_clients(http_infer, addr, UNNAMED, "gru_stream", first=0,
                                            make=shared_state_request)
        for name in plans:
            stats = client.get_inference_statistics(name)["model_stats"][0]["inference_stats"]
            assert int(stats["fail"]["count"]) == 0 and int(stats["success"]["count"]) == CLIENTS, (name, stats)
            config = client.get_model_config(name)
            params = {k: v["string_value"] for k, v in config["parameters"].items()}
            assert config["max_batch_size"] == (BATCH if name in LEADING else 0), (name, config)
            assert params["batching"] == ("false" if name in ALONE else "true"), (name, params)
            if name in ALONE:
                assert set(sizes[name]) == {1}, (name, sizes[name])
        # the replica applied the user's axis to the plan it loaded (the graph does not name it)
        params = {k: v["string_value"] for k, v in client.get_model_config(UNNAMED)["parameters"].items()}
        assert "state=1" in params["batch_axes"], params
        print("batch sizes of the one-sample requests:", {n: sorted(s) for n, s in sizes.items()})
        batched = [n for n in (*LEADING, *OWN_AXIS, UNNAMED) if max(sizes[n]) > 1]
        assert batched, f"no request shared a batch on any model ({sizes}): the split went untested"
    finally:
        rc = s.stop()
    out = "\n".join(s.lines)
    assert rc == 0 and "Traceback" not in out, out
