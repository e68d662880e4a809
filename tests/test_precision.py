"""Per-device precision (issue 48, item 3): ``partition --precision gpu=fp16`` writes an fp16
twin of every part for the CUDA workers, with the fp32 inputs and outputs of the part it
stands for (the casts at the cuts); the CPU workers keep the fp32 files; ``plan verify`` checks
the fp16 chain against the fp32 model within the tolerance it states; the CUDA workers (on the
stand-in here) load the fp16 files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from staronnx import zoo
from staronnx.plan import Plan
from _helpers import cli
import realmodels

pytest.importorskip("onnxconverter_common", reason="the fp16 conversion needs onnxconverter-common")


@pytest.fixture
def model_file(tmp_path) -> Path:
    path = tmp_path / "model.onnx"
    onnx.save(zoo.inception(blocks=2, channels=8, size=16), str(path))
    return path


def _fp16_plan(capsys, model_file: Path, out: Path) -> Plan:
    code, stdout, stderr = cli(capsys, "partition", model_file, "--shares", "0.6,0.4", "--costs", "estimate",
                               "--precision", "gpu=fp16", "-o", out, "-q")
    assert code == 0, stdout + stderr
    assert "precision: cuda parts fp16, cpu parts fp32" in stdout, stdout
    return Plan.load(out)


def test_the_gpu_parts_are_fp16_with_the_fp32_parts_inputs_and_outputs(capsys, model_file, tmp_path):
    plan = _fp16_plan(capsys, model_file, tmp_path / "plan")
    setting = plan.settings["precision"]
    assert setting["cuda"] == "fp16" and setting["cpu"] == "fp32" and "onnxconverter-common" in setting["converter"]
    assert len(setting["files"]["cuda"]) == plan.k == 2
    for part, name in zip(plan.parts, setting["files"]["cuda"], strict=True):
        fp32 = onnx.load(str(plan.part_path(part.index)))
        fp16 = onnx.load(str(plan.root / name))
        io = lambda m: [(v.name, v.type.tensor_type.elem_type) for v in [*m.graph.input, *m.graph.output]]  # noqa: E731
        assert io(fp16) == io(fp32)  # the cut's tensors keep their types: the casts are inside
        assert {i.data_type for i in fp16.graph.initializer if i.data_type in (1, 10)} == {onnx.TensorProto.FLOAT16}
        assert any(n.op_type == "Cast" for n in fp16.graph.node)
    # the plan's identity changed with it (perf models of the fp32 plan do not apply)
    code, stdout, _ = cli(capsys, "partition", model_file, "--shares", "0.6,0.4", "--costs", "estimate", "-o",
                          tmp_path / "fp32", "-q")
    assert code == 0 and Plan.load(tmp_path / "fp32").hash != plan.hash
    code, stdout, _ = cli(capsys, "plan", "show", plan.root)
    assert code == 0 and "precision: cuda parts fp16, cpu parts fp32" in stdout


def test_the_fp16_plan_verifies_on_the_cpu_within_its_stated_tolerance(capsys, model_file, tmp_path):
    plan = _fp16_plan(capsys, model_file, tmp_path / "plan")
    code, stdout, stderr = cli(capsys, "plan", "verify", plan.root, "--model", model_file, "--batch", "4")
    assert code == 0, stdout + stderr
    assert "OK (tolerance 0.0001 relative to each output's scale)" in stdout  # the fp32 parts
    assert "OK for the cuda parts (fp16) (tolerance 0.01 relative to each output's scale)" in stdout, stdout
    assert "cuda workers' fp16 parts" in stdout


def test_a_fp16_part_that_drifts_beyond_the_tolerance_fails_verify(capsys, model_file, tmp_path):
    """verify really compares the fp16 files: one whose weights were changed is a mismatch."""
    plan = _fp16_plan(capsys, model_file, tmp_path / "plan")
    path = plan.root / plan.settings["precision"]["files"]["cuda"][0]
    bad = onnx.load(str(path))
    init = next(i for i in bad.graph.initializer if i.data_type == onnx.TensorProto.FLOAT16 and len(i.dims) == 4)
    arr = onnx.numpy_helper.to_array(init)
    init.CopyFrom(onnx.numpy_helper.from_array((arr * 3).astype(np.float16), init.name))
    onnx.save(bad, str(path))
    code, stdout, _ = cli(capsys, "plan", "verify", plan.root, "--model", model_file)
    assert code == 1 and "MISMATCH for the cuda parts (fp16)" in stdout, stdout


def test_the_cuda_workers_run_the_fp16_parts(capsys, model_file, tmp_path, monkeypatch):
    """On the CUDA stand-in the CUDA workers load the fp16 twins (their outputs carry fp16's
    rounding), the CPU workers the fp32 files (theirs equal the fp32 chain's)."""
    from staronnx import MachineSpec, Runtime, RuntimeSpec
    from staronnx.verify import random_plan_feeds

    monkeypatch.setenv("STARONNX_CUDA_RUNTIME", "host")
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path / "home"))
    plan = _fp16_plan(capsys, model_file, tmp_path / "plan")
    feeds = random_plan_feeds(plan, 2, seed=1)
    ref = plan.run_reference(feeds)
    name = plan.output_names[0]
    with Runtime(plan.root,
                 MachineSpec(groups="none", cuda_streams=1),
                 RuntimeSpec(policy="eager", calibrate=0)) as rt:
        on_gpu = rt.run(feeds)[name]
    with Runtime(plan.root,
                 MachineSpec(groups="numa", cuda_streams=0),
                 RuntimeSpec(policy="eager", calibrate=0)) as rt:
        on_cpu = rt.run(feeds)[name]
    scale = float(np.abs(ref[name]).max())
    assert np.array_equal(on_cpu, ref[name])
    gpu_error = float(np.abs(on_gpu - ref[name]).max()) / scale
    assert 0 < gpu_error < 1e-2, gpu_error


def _real_fp16_verify(capsys, tmp_path: Path, name: str) -> tuple[int, str]:
    """``partition --precision gpu=fp16`` of a real model, then ``plan verify --inputs`` on its
    reference inputs: (exit code, output)."""
    ins, _ = realmodels.reference(name)
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, **ins)
    code, stdout, stderr = cli(capsys, "partition", realmodels.path(name), "--costs", "estimate", "--precision",
                               "gpu=fp16", "-o", tmp_path / "plan", "-q",
                               *[f"--input-shape={s}" for s in realmodels.input_shapes(name)])
    assert code == 0, stdout + stderr
    code, stdout, stderr = cli(capsys, "plan", "verify", tmp_path / "plan", "--model", realmodels.path(name),
                               "--inputs", inputs)
    return code, stdout + stderr


@pytest.mark.parametrize("name", ["bert_tiny", "gpt2_tiny_kv", "unet_seg", "mobilenet_b1"])
def test_the_fp16_twins_of_real_models_load_and_verify(capsys, tmp_path, name):
    """A part output that the part reads too (bert_tiny's last_hidden_state, read by its pooler;
    unet_seg's and mobilenet_b1's crossing tensors) and a Cast to float (gpt2_tiny_kv's mask)
    made fp16 twins ONNX Runtime refused to load ("Type (tensor(float16)) ... does not match
    expected type (tensor(float))"): a GPU user's CUDA workers could not start, and verify
    blamed the inputs. Every twin loads now, and agrees with the fp32 model within fp16's
    tolerance."""
    code, out = _real_fp16_verify(capsys, tmp_path, name)
    assert "does not match expected type" not in out and "fails" not in out, out
    assert code == 0, out
    assert "OK for the cuda parts (fp16) (tolerance 0.01 relative to each output's scale)" in out, out


def test_the_fp16_twins_keep_constants_fp16_can_hold(capsys, tmp_path):
    """gru_stream scales its frame by 16000 / sample_rate. The converter's default clamp of
    every constant to 1e4 made that 10000 / sample_rate in the fp16 twin: its state drifted
    ~6 % from the fp32 model's and verify said MISMATCH. fp16 holds 16000 exactly, and the
    twin now agrees within fp16's tolerance."""
    code, out = _real_fp16_verify(capsys, tmp_path, "gru_stream")
    assert code == 0, out
    assert "OK for the cuda parts (fp16) (tolerance 0.01 relative to each output's scale)" in out, out
    half = onnx.load(str(tmp_path / "plan" / Plan.load(tmp_path / "plan").settings["precision"]["files"]["cuda"][0]))
    values = [onnx.numpy_helper.to_array(t) for t in half.graph.initializer]
    values += [onnx.numpy_helper.to_array(a.t) for n in half.graph.node if n.op_type == "Constant"
               for a in n.attribute if a.name == "value"]
    assert any(v.size == 1 and float(v.reshape(-1)[0]) == 16000.0 for v in values)


def test_the_fp16_twins_of_a_model_with_an_if_load(capsys, tmp_path):
    """detector_nms (If, NonMaxSuppression, Casts to float): its twins load and run. Its outputs
    are data-dependent (two near-equal scores may swap in fp16), so only the run is asserted."""
    code, out = _real_fp16_verify(capsys, tmp_path, "detector_nms")
    assert "does not match expected type" not in out and "fails" not in out, out
    assert "for the cuda parts (fp16)" in out, out


def _fp16_unet(tmp_path: Path) -> Path:
    """unet_seg as a user's fp16 export: onnxconverter-common's conversion with fp32 inputs and
    outputs (keep_io_types), the usual way an fp16 model for a GPU is made."""
    from onnxconverter_common import float16

    path = tmp_path / "unet_fp16.onnx"
    onnx.save(float16.convert_float_to_float16(onnx.load(str(realmodels.path("unet_seg"))), keep_io_types=True),
              str(path))
    return path


def test_an_fp16_model_asked_for_fp16_gpu_parts(capsys, tmp_path):
    """partition --precision gpu=fp16 of a model that is fp16 already ended in the converter's
    ValueError ("The model is already converted to float16") and a traceback, after the plan
    was written. Its parts are what a GPU runs: each twin is the part as it is."""
    model = _fp16_unet(tmp_path)
    code, stdout, stderr = cli(capsys, "partition", model, "--costs", "estimate", "--precision", "gpu=fp16",
                               "-o", tmp_path / "plan", "-q", "--input-shape", "image=1x3x64x96")
    assert code == 0 and "Traceback" not in stdout + stderr, stdout + stderr
    plan = Plan.load(tmp_path / "plan")
    for part, name in zip(plan.parts, plan.settings["precision"]["files"]["cuda"], strict=True):
        assert (plan.root / name).read_bytes() == plan.part_path(part.index).read_bytes()
    ins, _ = realmodels.reference("unet_seg")
    np.savez(tmp_path / "inputs.npz", **ins)
    code, stdout, stderr = cli(capsys, "plan", "verify", tmp_path / "plan", "--model", model, "--inputs",
                               tmp_path / "inputs.npz")
    assert "OK for the cuda parts (fp16)" in stdout, stdout + stderr


def test_the_plan_of_an_fp16_model_verifies_at_fp16s_tolerance(capsys, tmp_path):
    """The plan of an fp16 export computes what the model computes, but ONNX Runtime fuses and
    orders fp16 arithmetic differently in the whole model and in its parts (unet_seg: 5e-4 of
    the output's scale, fp16's own rounding): plan verify held it to fp32's 1e-4 and said
    MISMATCH for every such plan. It is held to fp16's tolerance, and says so."""
    model = _fp16_unet(tmp_path)
    code, stdout, stderr = cli(capsys, "partition", model, "--costs", "estimate", "-o", tmp_path / "plan", "-q",
                               "--input-shape", "image=1x3x64x96")
    assert code == 0, stdout + stderr
    ins, _ = realmodels.reference("unet_seg")
    np.savez(tmp_path / "inputs.npz", **ins)
    code, stdout, stderr = cli(capsys, "plan", "verify", tmp_path / "plan", "--model", model, "--inputs",
                               tmp_path / "inputs.npz")
    assert code == 0 and "OK (tolerance 0.01 relative to each output's scale)" in stdout, stdout + stderr


@pytest.mark.parametrize("value, message", [
    ("cpu=fp16", "the CPU parts stay fp32"),
    ("gpu=int8", "write DEVICE=PRECISION with DEVICE gpu or cpu and PRECISION fp32 or fp16"),
    ("fp16", "write DEVICE=PRECISION"),
])
def test_a_precision_staronnx_cannot_apply_is_refused_in_one_line(capsys, model_file, tmp_path, value, message):
    code, stdout, stderr = cli(capsys, "partition", model_file, "--parts", "2", "--costs", "estimate",
                               "--precision", value, "-o", tmp_path / "plan")
    assert code != 0 and message in stdout + stderr, stdout + stderr
    assert not (tmp_path / "plan").exists()


def test_a_gpu_that_fits_no_model_names_the_fp16_file_its_worker_loaded(capsys, model_file, tmp_path):
    """The error of a CUDA worker that fits none of a runtime's models names the file it tried
    to load: with ``--precision gpu=fp16`` the part's fp16 twin, not the fp32 file of the CPU
    workers."""
    from staronnx import CudaOptions, MachineSpec, Runtime, RuntimeSpec
    from staronnx.perfmodels import PerfModelStore
    from staronnx.plan import arch_part_path
    from staronnx.workers.cuda import PartDoesNotFit
    from staronnx.workers.cudart import HostRuntime

    plans = {name: _fp16_plan(capsys, model_file, tmp_path / name) for name in ("a", "b")}
    host = HostRuntime()
    host.inject("session_load", 2, times=100)  # every session load runs out of GPU memory
    with pytest.raises(PartDoesNotFit, match="no model fits in its memory") as caught:
        Runtime(plans, MachineSpec(groups="none", cuda_streams=1, cuda_graphs=False),
                RuntimeSpec(store=PerfModelStore(tmp_path / "home"), cuda=CudaOptions(runtime=host)))
    fp32 = [plan.part_path(p) for plan in plans.values() for p in range(plan.k)]
    fp16 = [arch_part_path(path, "cuda") for path in fp32]
    assert set(fp16).isdisjoint(fp32)
    message = str(caught.value)
    assert any(f"({path})" in message for path in fp16), message
    assert not any(f"({path})" in message for path in fp32), message


def test_fp16_parts_are_written_by_rename_and_plan_json_last(capsys, tmp_path, monkeypatch):
    """``partition --precision gpu=fp16`` on a real model: every fp16 part arrives by a rename of a
    complete temporary (a reader or a crash never sees half a part) and plan.json, which names
    them, is replaced after them; a conversion that fails on a later part writes no fp16 file."""
    import importlib
    import os

    import staronnx.fsutil as fsutil

    from staronnx.errors import PartitionError

    precision = importlib.import_module("staronnx.partition.precision")

    renamed: list[str] = []
    real_replace = os.replace

    def replace(src, dst):
        renamed.append(Path(dst).name)
        return real_replace(src, dst)

    monkeypatch.setattr(fsutil.os, "replace", replace)
    model = realmodels.path("mobilenet_b1")
    code, stdout, stderr = cli(capsys, "partition", model, "--shares", "0.5,0.5", "--costs", "estimate",
                               "--precision", "gpu=fp16", "-o", tmp_path / "plan", "-q")
    assert code == 0, stdout + stderr
    plan = Plan.load(tmp_path / "plan")
    halves = plan.settings["precision"]["files"]["cuda"]
    after = renamed[max(i for i, n in enumerate(renamed) if n in halves) + 1:]
    assert set(halves) <= set(renamed), renamed
    assert after and after[-1] == "plan.json", renamed  # published after the parts it names
    assert not [p.name for p in (tmp_path / "plan").iterdir() if p.suffix == ".tmp"]

    calls = {"n": 0}
    real_cast = precision.cast_as_typed

    def fail_second(graph):
        calls["n"] += 1
        if calls["n"] == 2:
            raise PartitionError("converter failed on part 1")
        real_cast(graph)

    monkeypatch.setattr(precision, "cast_as_typed", fail_second)
    code, stdout, stderr = cli(capsys, "partition", model, "--shares", "0.5,0.5", "--costs", "estimate",
                               "--precision", "gpu=fp16", "-o", tmp_path / "again", "-q")
    assert code != 0
    left = sorted(p.name for p in (tmp_path / "again").iterdir())
    assert not [n for n in left if "fp16" in n], left  # no half-converted plan beside a fp32 plan.json
    assert "precision" not in Plan.load(tmp_path / "again").settings


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_fp16_part_is_one_clear_error_when_the_plan_loads(capsys, tmp_path, damage):
    """The fp16 twin the CUDA workers load passes the fp32 part's checks: a truncated or
    missing one was only found by a GPU worker, after `plan show` had loaded the plan fine."""
    model = realmodels.path("mobilenet_b1")
    code, stdout, stderr = cli(capsys, "partition", model, "--shares", "0.5,0.5", "--costs", "estimate",
                               "--precision", "gpu=fp16", "-o", tmp_path / "plan", "-q")
    assert code == 0, stdout + stderr
    half = tmp_path / "plan" / Plan.load(tmp_path / "plan").settings["precision"]["files"]["cuda"][1]
    if damage == "missing":
        half.unlink()
    else:
        half.write_bytes(half.read_bytes()[: half.stat().st_size // 2])
    code, stdout, stderr = cli(capsys, "plan", "show", tmp_path / "plan")
    lines = stderr.strip().splitlines()
    assert code == 2, stdout + stderr
    assert len(lines) == 1 and lines[0].startswith("staronnx: error: ") and half.name in lines[0], stderr
