"""A model over protobuf's 2 GB limit, with its weights in an external data file.

Four float32 [12000, 12000] MatMul weights (576 MB each, 2.3 GB in all) in a chain: the model
must load, be cut into 2 parts (estimated costs: profiling would only add a 2.3 GB ORT run),
be exported, and the chained parts must compute what the whole model computes.

The whole test takes well over a minute and about 6 GB of memory (see the module fixture's
report), so it only runs when STARONNX_LARGE_MODEL=1 is set, e.g.

    STARONNX_LARGE_MODEL=1 .venv/bin/pytest -q -s tests/test_large_model.py
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import staronnx
from staronnx.modelio import file_sha256, load_model
from staronnx.plan import Plan
from staronnx.verify import verify_plan
from staronnx.partition import PartitionSpec

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("STARONNX_LARGE_MODEL") != "1",
                       reason="2.3 GB model, ~2 min: set STARONNX_LARGE_MODEL=1 to run"),
]

N = 12000
LAYERS = 4
DATA_FILE = "big.onnx.data"


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB


def _weight(i: int) -> np.ndarray:
    """Layer i's weight, N(0, 1/N) so activations stay of order one through the chain."""
    w = np.random.default_rng(i).standard_normal((N, N), dtype=np.float32)
    w *= np.float32(1 / np.sqrt(N))
    return w


def _write_big_model(folder: Path) -> Path:
    """Write the weights straight into one external data file (never 2.3 GB in memory at
    once), in the layout onnx.save(save_as_external_data=True, all_tensors_to_one_file=True)
    produces, then the small model file that points into it."""
    initializers = []
    offset = 0
    with open(folder / DATA_FILE, "wb") as fh:
        for i in range(LAYERS):
            w = _weight(i)
            fh.write(memoryview(w).cast("B"))
            t = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=[N, N],
                            data_location=TensorProto.EXTERNAL)
            for key, value in (("location", DATA_FILE), ("offset", str(offset)), ("length", str(w.nbytes))):
                t.external_data.add(key=key, value=value)
            initializers.append(t)
            offset += w.nbytes
            del w
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i - 1}", f"w{i}"],
                              ["y" if i == LAYERS - 1 else f"h{i}"], name=f"matmul{i}")
             for i in range(LAYERS)]
    graph = helper.make_graph(
        nodes, "big_chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", N])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", N])], initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = folder / "big.onnx"
    onnx.save(model, str(path))
    onnx.checker.check_model(str(path))
    return path


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    folder = tmp_path_factory.mktemp("large-model")
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    path = _write_big_model(folder)
    timings["write model"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = staronnx.partition(path, spec=PartitionSpec(parts=2, costs="estimate"), output_dir=folder / "plan")
    timings["partition"] = time.perf_counter() - t0
    try:
        yield {"path": path, "plan": plan, "folder": folder, "timings": timings}
    finally:
        print("\nlarge model:", ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()),
              f"peak RSS {_peak_rss_gb():.1f} GiB")
        shutil.rmtree(folder, ignore_errors=True)  # 4.6 GB of model and plan


def test_the_model_is_over_the_protobuf_limit_and_loads(big):
    path = big["path"]
    total = path.stat().st_size + (path.parent / DATA_FILE).stat().st_size
    assert total > 2**31 and path.stat().st_size < 10_000
    loaded = load_model(path)
    assert loaded.sha256 == file_sha256(path, [path.parent / DATA_FILE])
    assert [t.name for t in loaded.graph.initializer] == [f"w{i}" for i in range(LAYERS)]


def test_it_partitions_into_two_parts(big):
    plan = big["plan"]
    assert plan.k == 2
    assert [p.nodes for p in plan.parts] == [2, 2]
    assert plan.parts[0].inputs == ["x"] and plan.parts[1].outputs == ["y"]
    assert [(t.name, t.shape, t.bytes_per_sample) for t in plan.crossing] == [("h1", ["batch", N], 4 * N)]
    assert plan.cut_bytes_per_sample == 4 * N
    assert plan.source["sha256"] == file_sha256(big["path"], [big["path"].parent / DATA_FILE])
    for p in plan.parts:
        assert abs(p.share - 0.5) < 0.01
        files = sorted(plan.root.glob(f"{p.file}*"))
        digest = hashlib.sha256()
        for f in files:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    digest.update(chunk)
        assert p.sha256 == digest.hexdigest()
        onnx.checker.check_model(str(plan.part_path(p.index)))
        weights = onnx.load(str(plan.part_path(p.index)), load_external_data=False).graph.initializer
        assert [t.name for t in weights] == [f"w{2 * p.index}", f"w{2 * p.index + 1}"]
    assert Plan.load(plan.root).hash == plan.hash


def test_chained_parts_equal_the_whole_model(big):
    plan = big["plan"]
    t0 = time.perf_counter()
    report = verify_plan(plan, big["path"], batch=1, seed=0)
    big["timings"]["verify (whole model vs parts on ORT)"] = time.perf_counter() - t0
    assert report.ok, report.outputs
    assert report.outputs[0].shape == (1, N)


def test_chained_parts_equal_numpy(big):
    plan = big["plan"]
    x = np.random.default_rng(123).standard_normal((1, N), dtype=np.float32)
    t0 = time.perf_counter()
    got = plan.run_reference({"x": x})["y"]
    big["timings"]["run_reference"] = time.perf_counter() - t0
    want = x.astype(np.float64)
    for i in range(LAYERS):
        want = want @ _weight(i)
    scale = float(np.abs(want).max())
    assert got.shape == (1, N) and np.isfinite(got).all()
    assert float(np.abs(got - want).max()) <= 1e-4 * scale


def test_parts_are_saved_with_external_data(big):
    plan = big["plan"]
    assert sorted(f.name for f in plan.root.iterdir()) == [
        "part0.onnx", "part0.onnx.data", "part1.onnx", "part1.onnx.data", "plan.json"]
    for p in plan.parts:
        path = plan.part_path(p.index)
        assert path.stat().st_size < 1_000_000
        assert (plan.root / f"{p.file}.data").stat().st_size == 2 * 4 * N * N
        weights = onnx.load(str(path), load_external_data=False).graph.initializer
        for t in weights:
            assert t.data_location == TensorProto.EXTERNAL, (p.file, t.name)
            assert {e.key: e.value for e in t.external_data}["location"] == f"{p.file}.data"
