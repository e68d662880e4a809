"""The plan a job runs: a plan folder as it is, or an ONNX file as one part.

Batch inference from a model file needs no cut: the whole model as one part runs on every
worker the machine has, one batch per worker at a time, which is what keeps a server busy
offline (a cut pays where a GPU and CPU groups share a batch; give a plan folder for that). The
one-part plan is made once per model file and kept under ``STARONNX_HOME/plans``, keyed by the
file's hash, in the cache :class:`staronnx.InferenceSession` keeps its plans in
(:mod:`staronnx.partition.plan_cache`).
"""

from __future__ import annotations

import os
from pathlib import Path

from staronnx.errors import InputError
from staronnx.modelio import file_sha256, load_model
from staronnx.partition.cut import CutRequest, plan_settings
from staronnx.partition.plan_cache import kept_or_made, plan_folder
from staronnx.partition.whole import WHOLE, write_whole_plan
from staronnx.perfmodels.store import default_root
from staronnx.plan import Plan

#: bumped when the kept one-part plans must be made again
PLAN_KEY = "infer-whole-1"


def plan_for(model: str | os.PathLike[str] | Plan) -> Plan:
    """The plan for ``model``: a :class:`Plan`, a plan folder, or an ONNX file (made into a
    one-part plan, kept for the next job)."""
    if isinstance(model, Plan):
        return model
    path = Path(model)
    if path.is_dir():
        return Plan.load(path)
    if not path.exists():
        raise InputError(f"{path}: no such model file or plan folder")
    sha = file_sha256(path)
    # no cut, so nothing is profiled and no size has to be given for a dynamic dimension
    settings = plan_settings(WHOLE, [1.0], CutRequest([1.0], costs="estimate"), device="cpu", tolerance=None,
                             whole="the whole model on every worker (staronnx infer)")
    return kept_or_made(plan_folder(default_root() / "plans", sha, {"infer": PLAN_KEY}),
                        lambda folder: write_whole_plan(load_model(path), settings, folder), sha)
