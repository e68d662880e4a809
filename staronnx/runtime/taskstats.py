"""What both engines report about tasks: measured vs predicted time per (part, arch).

Why one function: ``Runtime.stats()`` must read the same whichever engine runs the plan
(native or starpu), and the comparison of measured with predicted times is how users see
whether the perf models still describe the machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def per_part_arch(measured: Mapping[tuple[int, str], Sequence[float]],
                  predicted: Mapping[tuple[int, str], Sequence[float]]) -> dict[str, dict[str, Any]]:
    """``"part<p>/<arch>"`` -> tasks, mean measured ms, mean predicted ms (None: never predicted)."""
    out: dict[str, dict[str, Any]] = {}
    for (part, arch), times in sorted(measured.items()):
        pred = predicted.get((part, arch), [])
        out[f"part{part}/{arch}"] = {
            "tasks": len(times),
            "measured_ms": float(np.mean(times) * 1e3),
            "predicted_ms": float(np.mean(pred) * 1e3) if pred else None,
        }
    return out
