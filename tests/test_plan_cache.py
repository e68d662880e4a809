"""The one plan cache (:mod:`staronnx.partition.plan_cache`) as ``staronnx infer`` reaches it
(sessions' plans: ``test_session_plans.py``; a repository's: ``test_model_repository.py``): jobs
started at once share one plan, made once; a damaged kept plan is made again, not loaded."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import realmodels as rm
from staronnx.infer.plans import plan_for


def kept(root: Path) -> list[str]:
    """The plan folders under ``root`` (locks and staging folders are hidden)."""
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


def test_infer_jobs_at_once_share_one_whole_model_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path / "home"))
    with ThreadPoolExecutor(3) as pool:
        plans = list(pool.map(lambda _: plan_for(rm.path("bert_tiny")), range(3)))
    assert len({p.root for p in plans}) == 1 and plans[0].k == 1
    assert kept(tmp_path / "home" / "plans") == [plans[0].root.name]


def test_a_damaged_kept_plan_is_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path / "home"))
    first = plan_for(rm.path("crnn_ocr"))
    (first.root / first.parts[0].file).write_bytes(b"not a model")
    again = plan_for(rm.path("crnn_ocr"))
    assert again.root == first.root and (again.root / again.parts[0].file).read_bytes() != b"not a model"
