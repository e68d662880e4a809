"""Plans a session makes live under STARONNX_HOME, are reused, and nothing is left in the
temporary folder, even by a construction that fails (issue 22, defect 3)."""

from __future__ import annotations

import glob
import importlib
import os
import tempfile
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest

import staronnx
from staronnx import RuntimeSpec, SessionSpec
from staronnx.errors import ModelError, PartitionError
from staronnx.zoo import chain

PATTERN = os.path.join(tempfile.gettempdir(), "staronnx-session-*")
#: where a session's partition() lives (``staronnx.partition`` is the function itself)
api = importlib.import_module("staronnx.partition.api")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "home"
    monkeypatch.setenv("STARONNX_HOME", str(root))
    before = set(glob.glob(PATTERN))
    yield root
    assert set(glob.glob(PATTERN)) <= before, "a session left a folder in the temporary directory"


@pytest.fixture
def model_path(tmp_path) -> Path:
    path = tmp_path / "chain.onnx"
    onnx.save(chain(depth=4, width=8), str(path))
    return path


@pytest.fixture
def partitions(monkeypatch) -> list[Path]:
    """Counts the partitions sessions make (their output folders)."""
    made: list[Path] = []
    real = api.partition

    def counting(*args, **kwargs):
        made.append(Path(kwargs["output_dir"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "partition", counting)
    return made


def _leftovers(home: Path) -> list[str]:
    """What a failed construction left in the home, beyond lock files."""
    if not home.exists():
        return []
    return sorted(str(p.relative_to(home)) for p in home.rglob("*")
                  if not p.name.endswith(".lock") and p.name != "plans")


def test_a_session_of_a_model_file_leaves_nothing_in_tmp_and_keeps_its_plan_in_the_home(
        home, model_path, two_groups, partitions):
    x = np.ones((2, 8), np.float32)
    with staronnx.InferenceSession(model_path, spec=SessionSpec(cpu_groups=two_groups)) as sess:
        sess.run(None, {"x": x})
        root = sess.plan.root
    assert root.parent == home / "plans" and (root / "plan.json").is_file()
    assert root.name.startswith(sess.plan.source["sha256"][:16])
    assert not glob.glob(os.path.join(tempfile.gettempdir(), "staronnx-session-*", "plan"))


def test_the_next_session_of_the_same_model_and_settings_reuses_the_plan(home, model_path, two_groups,
                                                                          partitions):
    with staronnx.InferenceSession(model_path, spec=SessionSpec(cpu_groups=two_groups)) as first:
        plan_hash, root = first.plan.hash, first.plan.root
    with staronnx.InferenceSession(model_path.read_bytes(), spec=SessionSpec(cpu_groups=two_groups)) as again:
        assert (again.plan.root, again.plan.hash) == (root, plan_hash)
    assert len(partitions) == 1
    with staronnx.InferenceSession(model_path, spec=SessionSpec(cpu_groups=two_groups, shares=[0.6, 0.4])) as other:
        assert other.plan.root != root and other.plan.root.parent == root.parent
    assert len(partitions) == 2


@pytest.mark.parametrize("option", ["free dimension", "initializer"])
def test_the_next_session_with_options_that_change_the_model_reuses_the_plan(home, model_path, two_groups,
                                                                             partitions, option):
    """Session options that change the model (a free dimension fixed, an initializer given) key
    its plan as their own model: the next session with the same options reuses it. It was cut
    again by every session ('plan ... is of another model; making it again'): the plan records
    the changed model's hash, the session looked for a hash of the file and the options."""
    import onnxruntime as ort

    weights = onnx.load(str(model_path)).graph.initializer[0]
    value = ort.OrtValue.ortvalue_from_numpy(
        np.full(tuple(weights.dims), 0.5, dtype=onnx.helper.tensor_dtype_to_np_dtype(weights.data_type)))

    def options() -> ort.SessionOptions:
        so = ort.SessionOptions()
        if option == "free dimension":
            so.add_free_dimension_override_by_name("batch", 2)
        else:
            so.add_initializer(weights.name, value)
        return so

    x = np.ones((2, 8), np.float32)
    with staronnx.InferenceSession(model_path, options(), spec=SessionSpec(cpu_groups=two_groups)) as first:
        want, root = first.run(None, {"x": x})[0], first.plan.root
    with staronnx.InferenceSession(model_path, options(), spec=SessionSpec(cpu_groups=two_groups)) as again:
        assert again.plan.root == root
        np.testing.assert_array_equal(again.run(None, {"x": x})[0], want)
    assert len(partitions) == 1


def _sequence_chain(seed: int) -> onnx.ModelProto:
    """chain() over [batch, seq, 8]: a dynamic size besides the batch, so a session cuts it at its
    first run's shapes."""
    model = chain(depth=4, width=8, seed=seed)
    for vi in (model.graph.input[0], model.graph.output[0]):
        dims = vi.type.tensor_type.shape.dim
        dims.insert(1, onnx.TensorShapeProto.Dimension(dim_param="seq"))
    return model


def test_a_model_file_rewritten_before_the_first_run_still_runs_the_model_the_session_opened(home, tmp_path,
                                                                                            two_groups):
    """ORT runs the model it loaded when the session opened. A session that cuts at its first
    run read the file again then: a file rewritten meanwhile (an export loop writing the next
    model to the same path) ran the new model's weights under the session opened on the old."""
    import onnxruntime as ort

    path = tmp_path / "seq.onnx"
    onnx.save(_sequence_chain(seed=0), str(path))
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    reference = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with staronnx.InferenceSession(path, spec=SessionSpec(cpu_groups=two_groups)) as sess:
        onnx.save(_sequence_chain(seed=1), str(path))  # the next export, same inputs and outputs
        got = sess.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, reference.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_concurrent_sessions_of_one_model_partition_it_once(home, model_path, two_groups, partitions):
    barrier = threading.Barrier(3)
    sessions: list[staronnx.InferenceSession] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            barrier.wait()
            sessions.append(staronnx.InferenceSession(model_path, spec=SessionSpec(cpu_groups=two_groups)))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert not errors, errors
        assert len({s.plan.root for s in sessions}) == 1 and len(partitions) == 1
        x = np.ones((1, 8), np.float32)
        outs = [s.run(None, {"x": x})[0] for s in sessions]
        for out in outs[1:]:
            np.testing.assert_array_equal(out, outs[0])
    finally:
        for s in sessions:
            s.close()


def test_a_damaged_cached_plan_is_made_again(home, model_path, two_groups, partitions):
    with staronnx.InferenceSession(model_path, spec=SessionSpec(cpu_groups=two_groups)) as sess:
        root = sess.plan.root
    (root / "part1.onnx").write_bytes(b"truncated")
    with staronnx.InferenceSession(model_path, spec=SessionSpec(cpu_groups=two_groups)) as sess:
        assert sess.plan.root == root
        sess.run(None, {"x": np.ones((1, 8), np.float32)})
    assert len(partitions) == 2


def test_failed_constructions_leave_nothing_behind(home, model_path, tmp_path, two_groups):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not onnx at all")
    with pytest.raises(ModelError):
        staronnx.InferenceSession(garbage, spec=SessionSpec(cpu_groups=two_groups))
    with pytest.raises(ModelError):
        staronnx.InferenceSession(tmp_path / "missing.onnx", spec=SessionSpec(cpu_groups=two_groups))
    assert not home.exists()  # refused before anything was written
    with pytest.raises(PartitionError):
        staronnx.InferenceSession(model_path, spec=SessionSpec(cpu_groups=two_groups, shares=[0.05] * 20))
    assert _leftovers(home) == []
    with pytest.raises(ValueError):
        staronnx.InferenceSession(model_path,
                                  spec=SessionSpec(cpu_groups=two_groups, runtime=RuntimeSpec(policy="no-such-policy")))


def test_a_read_only_home_keeps_no_private_plan_of_a_variant_it_no_longer_runs(tmp_path, monkeypatch, two_groups):
    """Where plans cannot be kept, each variant of the model (an overridable initializer fed
    by name, a LoRA adapter) is cut into a temporary folder. The session runs the last
    MAX_VARIANTS of them; the folders of those it stopped were kept until close(), so a
    service switching among many adapters filled the temporary folder, one plan per value."""
    from onnx import TensorProto, helper

    from staronnx.compat.lora import MAX_VARIANTS

    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.eye(4, dtype=np.float32).ravel())
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                              "variants", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4]),
                                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])], [w])
    path = tmp_path / "variants.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("STARONNX_HOME", str(not_a_folder / "home"))
    before = set(glob.glob(PATTERN))
    x = np.ones((2, 4), np.float32)
    with pytest.warns(UserWarning, match="STARONNX_HOME"):
        sess = staronnx.InferenceSession(path, spec=SessionSpec(cpu_groups=two_groups))
    try:
        for k in range(MAX_VARIANTS + 3):
            got = sess.run(None, {"x": x, "w": np.full((4, 4), float(k), np.float32)})[0]
            np.testing.assert_array_equal(got, np.full((2, 4), 4.0 * k, np.float32))
        kept = set(glob.glob(PATTERN)) - before
        assert len(kept) <= MAX_VARIANTS + 1, f"{len(kept)} private plans kept for {MAX_VARIANTS} variants and the model"
    finally:
        sess.close()
    assert set(glob.glob(PATTERN)) <= before


def test_a_read_only_home_gets_a_private_plan_removed_at_close(tmp_path, monkeypatch, model_path, two_groups):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("STARONNX_HOME", str(not_a_folder / "home"))
    with pytest.warns(UserWarning, match="STARONNX_HOME"):
        store = staronnx.perfmodels.PerfModelStore(tmp_path / "store")
        sess = staronnx.InferenceSession(model_path, spec=SessionSpec(cpu_groups=two_groups,
                                                                      runtime=RuntimeSpec(store=store)))
    try:
        root = sess.plan.root
        assert root.is_dir()
        sess.run(None, {"x": np.ones((1, 8), np.float32)})
    finally:
        sess.close()
    assert not root.exists() and not root.parent.exists()
