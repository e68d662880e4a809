"""A damaged part file inside a plan (issue 12, defect 3).

Every command that reads a plan must answer a truncated ``partN.onnx`` the same way: exit code
2 and one line ``staronnx: error: ...`` naming the file and saying to partition again, with no
traceback and no unrelated warning first. The plan is a copy of the shared calibrated plan, so
the commands that need perf models (sweep, simulate, optimize-batch) get far enough to load the
parts.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from staronnx import PlanError, load_plan
from staronnx.errors import PartFileError
from _helpers import cli


@pytest.fixture
def damaged(calibrated_inception, tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A copy of the calibrated plan whose part 1 lost its second half, and the source model."""
    plan, home = calibrated_inception
    monkeypatch.setenv("STARONNX_HOME", str(home))
    copy = tmp_path / "plan"
    shutil.copytree(plan.root, copy)
    part = copy / "part1.onnx"
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    return copy, plan.root.parent / "inception.onnx"


#: (plan folder, model, explicit CPU groups) -> the command's arguments
COMMANDS = {
    "plan verify": lambda p, m, g: ["plan", "verify", p, "--model", m],
    "plan show": lambda p, m, g: ["plan", "show", p],
    "run": lambda p, m, g: ["run", p, "--groups", g, "--requests", "4"],
    "calibrate": lambda p, m, g: ["calibrate", p, "--groups", g, "--batch-sizes", "1", "--no-bus"],
    "sweep": lambda p, m, g: ["sweep", p, "--groups", g, "--batch-sizes", "1", "--rates", "50",
                              "--duration", "1s", "-o", p.parent / "results"],
    "simulate": lambda p, m, g: ["simulate", p, "--groups", g, "--rate", "50", "--batch", "1"],
    "optimize-batch": lambda p, m, g: ["optimize-batch", p, "--groups", g, "--rate", "50",
                                       "--slo-ms", "50", "--batch-sizes", "1,2"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_truncated_part_is_one_clear_error_in_every_command(damaged, capsys, command, two_groups):
    plan_dir, model = damaged
    code, out, err = cli(capsys, *COMMANDS[command](plan_dir, model, two_groups))
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err  # no warning before it, no traceback
    assert lines[0].startswith("staronnx: error: ")
    assert "part1.onnx" in lines[0] and "partition" in lines[0], lines[0]


def test_the_library_raises_one_error_class_naming_the_file(damaged):
    plan_dir, _ = damaged
    with pytest.raises(PartFileError, match="part1.onnx") as info:
        load_plan(str(plan_dir))
    assert isinstance(info.value, PlanError)


def test_a_part_cut_at_a_field_boundary_is_caught_too(calibrated_inception, tmp_path):
    """A cut between two protobuf fields parses; the part then lacks what plan.json lists."""
    plan, _ = calibrated_inception
    copy = tmp_path / "plan"
    shutil.copytree(plan.root, copy)
    import onnx

    part = onnx.load(str(copy / "part0.onnx"))
    del part.graph.output[:]
    onnx.save(part, str(copy / "part0.onnx"))
    with pytest.raises(PartFileError, match="part0.onnx"):
        load_plan(str(copy))


@pytest.fixture(scope="module")
def googlenet_three(tmp_path_factory) -> Path:
    """A 3-part linear plan of the real GoogLeNet (a chain: part 1 reads part 0, part 2 reads part 1)."""
    import staronnx
    from staronnx.partition import PartitionSpec
    from realmodels import GOOGLENET

    root = tmp_path_factory.mktemp("order")
    plan = staronnx.partition(GOOGLENET, [0.4, 0.3, 0.3], PartitionSpec(method="linear", profile_runs=1),
                              output_dir=root / "plan")
    return plan.root


def _edited(source: Path, tmp_path: Path, edit) -> Path:
    import json

    copy = tmp_path / "plan"
    shutil.copytree(source, copy)
    data = json.loads((copy / "plan.json").read_text())
    edit(data["parts"])
    (copy / "plan.json").write_text(json.dumps(data))
    return copy


def _reorder(parts: list) -> None:
    """Parts listed out of order, renumbered: new part 0 reads a tensor of a later part."""
    parts.reverse()
    for i, p in enumerate(parts):
        p["index"] = i


def _cycle(parts: list) -> None:
    """Part 0 also reads a tensor part 1 produces (a cycle 0 -> 1 -> 0)."""
    produced = [t for t in parts[1]["outputs"] if t not in parts[0]["inputs"]]
    parts[0]["inputs"].append(produced[0])


@pytest.mark.parametrize("edit", [_reorder, _cycle], ids=["out-of-order", "cyclic"])
def test_a_plan_whose_parts_read_later_parts_is_refused_naming_part_and_tensor(googlenet_three, tmp_path,
                                                                                capsys, edit):
    plan_dir = _edited(googlenet_three, tmp_path, edit)
    with pytest.raises(PlanError, match=r"part \d+ reads tensor '[^']+' produced by part \d+"):
        load_plan(str(plan_dir))
    code, out, err = cli(capsys, "plan", "show", plan_dir)
    lines = err.strip().splitlines()
    assert code == 2, (out, err)
    assert len(lines) == 1 and lines[0].startswith("staronnx: error: ") and "reads tensor" in lines[0], err


def test_a_plan_with_parts_listed_out_of_order_is_refused(googlenet_three, tmp_path):
    def swap(parts: list) -> None:
        parts[0], parts[1] = parts[1], parts[0]

    plan_dir = _edited(googlenet_three, tmp_path, swap)
    with pytest.raises(PlanError, match="position 0 has index 1"):
        load_plan(str(plan_dir))
