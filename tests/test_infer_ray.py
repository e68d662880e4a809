"""Ray Data: ``Dataset.map_batches`` with :class:`staronnx.ray.data.StaronnxPredictor` on a local
Ray cluster gives ONNX Runtime's outputs, row for row, beside the columns passed through."""

from __future__ import annotations

import numpy as np
import pytest

import realmodels

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def ray_cluster(cluster):
    """The Ray tests' local cluster (conftest's ``cluster``), with Ray Data and no progress bars."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.data", reason="ray[data] is not installed (pip install 'staronnx[ray]')")
    ray.data.DataContext.get_current().enable_progress_bars = False
    return ray


def test_map_batches_gives_ort_outputs(ray_cluster):
    """crnn_ocr (its output's batch on axis 1) through two actors, Ray batches of 16 cut into
    tasks of 4: every row's log-probs are ORT's, its id passed through."""
    import ray.data

    from staronnx.infer import plan_for
    from staronnx.ray.data import StaronnxPredictor

    plan = str(plan_for(realmodels.path("crnn_ocr")).root)
    x = np.random.default_rng(0).standard_normal((64, 1, 32, 64)).astype(np.float32)
    ds = ray.data.from_items([{"id": i, "image": x[i]} for i in range(len(x))])
    out = ds.map_batches(StaronnxPredictor, fn_constructor_kwargs={"model": plan, "batch_size": 4, "groups": "0"},
                         batch_size=16, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1).take_all()
    assert sorted(r["id"] for r in out) == list(range(64))
    want = realmodels.ort_outputs("crnn_ocr", {"image": x})["log_probs"]
    for row in out:
        got = np.asarray(row["log_probs"])
        assert got.shape == want[:, row["id"]].shape
        assert np.abs(got - want[:, row["id"]]).max() <= 1e-4 * max(1.0, float(np.abs(want).max()))
    assert set(out[0]) == {"id", "log_probs"}


def test_a_missing_column_is_named(ray_cluster):
    from staronnx.errors import InputError
    from staronnx.infer import plan_for
    from staronnx.ray.data import StaronnxPredictor

    predictor = StaronnxPredictor(str(plan_for(realmodels.path("crnn_ocr")).root), groups="0")
    with pytest.raises(InputError, match=r"no column for input\(s\) \['image'\]"):
        predictor({"pixels": np.zeros((2, 1, 32, 64), np.float32)})
