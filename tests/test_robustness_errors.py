"""Library errors speak Python, the CLI speaks flags (issue 12, defect 10).

``staronnx.partition(..., force=False)`` used to answer "use --force"; a Python caller has no
``--force``. The error names the argument (``force=True``) and carries the CLI's wording,
which ``staronnx`` prints.
"""

from __future__ import annotations

import onnx
import pytest

import staronnx
from staronnx import PartitionError, PlanError, zoo
from _helpers import cli
from staronnx.partition import PartitionSpec


CASES = [
    # (python kwargs, python says, CLI args, CLI says)
    ({"parts": 2}, "force=True", ["--parts", "2"], "--force"),
    ({"shares": [0.5, 0.5], "parts": 3}, "parts=3", ["--shares", "0.5,0.5", "--parts", "3"], "--parts is 3"),
    ({"parts": 2, "input_shapes": ["x=1x-2"]}, "input_shapes expects", ["--parts", "2", "--input-shape", "x=1x-2"],
     "--input-shape expects"),
    ({"parts": 2, "profile_batch": 0}, "profile_batch", ["--parts", "2", "--profile-batch", "0"], "--profile-batch"),
]


@pytest.mark.parametrize(("kwargs", "py_says", "args", "cli_says"), CASES)
def test_python_errors_name_arguments_and_the_cli_names_flags(tmp_path, capsys, kwargs, py_says, args, cli_says):
    model = tmp_path / "chain.onnx"
    onnx.save(zoo.chain(), str(model))
    out = tmp_path / "plan"
    (out).mkdir()
    (out / "something").write_text("an earlier plan")
    with pytest.raises((PartitionError, PlanError)) as info:
        settings = dict(kwargs)
        staronnx.partition(model, settings.pop("shares", None), PartitionSpec(costs="estimate", **settings),
                           output_dir=out)
    message = str(info.value)
    assert py_says in message and " --" not in f" {message}", message
    code, _, err = cli(capsys, "partition", model, "-o", out, "--costs", "estimate", *args)
    assert code == 2 and cli_says in err, err
    assert len(err.strip().splitlines()) == 1
