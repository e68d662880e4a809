"""Plans kept under ``$STARONNX_HOME`` so that a model is cut once per settings (an
``InferenceSession``'s and ``staronnx infer``'s in ``plans/``, a model repository's and its
ensembles' in ``repository-plans/``), each folder named by the model's hash and a hash of what
shaped the cut, the plan format and the staronnx version (a new version cuts again). A maker
holds the folder's lock, so concurrent makers (sessions, server starts) cut once and the others
load the plan; ``partition`` and ``compose`` publish it atomically, so a killed run leaves no
half plan.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from filelock import FileLock

from staronnx.errors import PlanError
from staronnx.plan import PLAN_VERSION, Plan

log = logging.getLogger(__name__)

#: how long a maker waits for another process making the same plan (seconds)
PLAN_LOCK_TIMEOUT = 3600.0


def staronnx_version() -> str:
    """The installed staronnx's version ("unknown" from a source tree on PYTHONPATH): what kept
    plans are keyed by, and what the server metadata names."""
    try:
        return importlib.metadata.version("staronnx")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def plan_folder(root: Path, model: str, settings: Mapping[str, Any]) -> Path:
    """Where the plan of ``model`` (its file's SHA-256, or a name) cut with ``settings`` is
    kept under ``root``."""
    keyed = {"plan_version": PLAN_VERSION, "staronnx": staronnx_version(), **settings}
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return root / f"{model[:16]}-{key}"


def kept_plan(folder: Path, sha256: str | None = None, say: bool = False) -> Plan | None:
    """The plan in ``folder`` when it is intact and cut from the model ``sha256`` (None: any),
    else None (``say``: log why an existing one is not used, before it is made again)."""
    if not folder.exists():
        return None
    try:
        plan = Plan.load(folder)
    except PlanError as exc:
        why = f"is unusable ({exc})"
    else:
        if sha256 is None or plan.source.get("sha256") == sha256:
            return plan
        why = "is of another model"
    if say:
        log.warning("plan %s %s; making it again", folder, why)
    return None


def kept_or_made(folder: Path, make: Callable[[Path], Plan], sha256: str | None = None) -> Plan:
    """The plan kept in ``folder`` (see :func:`kept_plan`), else ``make(folder)``'s, made under
    the folder's lock (a hidden file beside it, so listings of the plans show plans only)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.with_name(f".{folder.name}.lock")), timeout=PLAN_LOCK_TIMEOUT):
        plan = kept_plan(folder, sha256, say=True)
        return plan if plan is not None else make(folder)
