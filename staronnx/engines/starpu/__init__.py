"""The starpu engine: run plans on the real StarPU C library (see :mod:`.engine`).

Importing this package does not touch StarPU; :class:`StarpuEngine` finds libstarpu and
compiles the cffi binding on first use (:mod:`._build`), raising :class:`StarpuUnavailable`
(a :class:`~staronnx.errors.StaronnxError`) that names the package to install when it is absent.
"""

from __future__ import annotations

from ._build import (
    INSTALL_HINT,
    StarpuInstall,
    StarpuUnavailable,
    find_starpu,
    load_binding,
)
from .engine import POLICY_ALIASES, StarpuEngine


def starpu_available() -> bool:
    """True when StarPU is installed and the binding compiles and loads."""
    try:
        load_binding()
    except StarpuUnavailable:
        return False
    return True


__all__ = [
    "INSTALL_HINT",
    "POLICY_ALIASES",
    "StarpuEngine",
    "StarpuInstall",
    "StarpuUnavailable",
    "find_starpu",
    "load_binding",
    "starpu_available",
]
