"""The one duration syntax of every edge that reads durations as text: ``10s``, ``500ms``,
``2m`` or a bare number of seconds.

The library takes seconds as floats; the command line (sweep, simulate, optimize-batch,
serve) and configuration files (the Ray Serve config) parse their text here, at the edge.
"""

from __future__ import annotations

import math
import re

from staronnx.errors import StaronnxError

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(ms|s|m|min)?\s*$", re.IGNORECASE)
_UNIT = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0}


class DurationError(StaronnxError, ValueError):
    """A duration that is not one, or is out of range."""


def parse_duration(text: str | float, *, allow_zero: bool = False, option: str | None = None) -> float:
    """Seconds from ``"10s"``, ``"500ms"``, ``"2m"`` or a bare number of seconds (> 0, or
    >= 0 with ``allow_zero``: a warm-up or a batching delay may be none at all).

    ``option`` (``"--duration"``) starts the error message, so the user knows which value to fix.
    """
    where = f"{option}: " if option else ""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _DURATION.match(str(text))
        if not m:
            raise DurationError(f"{where}durations look like 10s, 500ms, 2m or 1.5 (seconds); got {text!r}")
        value = float(m.group(1)) * _UNIT[(m.group(2) or "s").lower()]
    if not (math.isfinite(value) and (value >= 0 if allow_zero else value > 0)):
        raise DurationError(f"{where}a duration must be {'>=' if allow_zero else '>'} 0 seconds, got {text!r}")
    return value
