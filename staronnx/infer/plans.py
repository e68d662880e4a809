"""The plan a job runs: a plan folder as it is, or an ONNX file as one part.

Batch inference from a model file needs no cut: the whole model as one part runs on every
worker the machine has, one batch per worker at a time, which is what keeps a server busy
offline (a cut pays where a GPU and CPU groups share a batch; give a plan folder for that). The
one-part plan is made once per model file and kept under ``STARONNX_HOME/plans``, keyed by the
file's hash, in the cache :class:`staronnx.InferenceSession` keeps its plans in
(:mod:`staronnx.partition.plan_cache`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from staronnx.errors import InputError
from staronnx.modelio import _external_locations, file_sha256, load_model
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
    folder = plan_folder(default_root() / "plans", sha, {"infer": PLAN_KEY})
    if _recorded_sha256(folder) not in (None, sha):
        # the kept plan records its model's hash with its external data files': the file's
        # alone never matched it, so every job made the plan again (copying the weights),
        # saying the kept one 'is of another model'. Hashed with them only here, where a kept
        # plan says there are some: reading a model's list of them parses the whole file
        sha = _model_sha256(path)
    return kept_or_made(folder, lambda out: write_whole_plan(load_model(path), settings, out), sha)


def _recorded_sha256(folder: Path) -> str | None:
    """The source hash the plan kept in ``folder`` records (None: no readable plan there)."""
    try:
        value = json.loads((folder / "plan.json").read_text())["source"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) else None


def _model_sha256(path: Path) -> str:
    """The model file's hash with its external data files', as the plan records its source's
    (:func:`staronnx.modelio.load_model`). A file that cannot be read hashes alone (load_model
    says why)."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - not a model: load_model words it when the plan is made
        return file_sha256(path)
    externals = [path.parent / name for name in sorted(set(_external_locations(model).values()) - {""})]
    return file_sha256(path, [p for p in externals if p.exists()])
