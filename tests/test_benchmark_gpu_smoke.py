"""benchmarks/gpu.py runs end to end (its CPU smoke mode: same harness, CPU provider, tiny
model), so the GPU host's benchmark cannot rot between the sessions that have a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_smoke_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--device", "cpu", "--models", "tiny", "--batches", "1,2",
         "--seconds", "0.2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "STARONNX_HOME": str(tmp_path / "home")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| tiny | 1 |" in done.stdout and "| tiny | 2 |" in done.stdout
    data = json.loads(out.read_text())
    assert [r["batch"] for r in data["rows"]] == [1, 2]
    for row in data["rows"]:
        assert all(row[c] > 0 for c in ("ort1", "ort2", "ort4", "gpu", "gpu+cpu", "split", "auto", "cpu"))
        assert max(row["errors"].values()) < 1e-3
    assert any("max relative error" in text for text, _ in data["checks"])
