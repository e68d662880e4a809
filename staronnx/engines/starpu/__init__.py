"""The starpu engine: run plans on the real StarPU C library (see :mod:`.engine`).

Importing this package does not touch StarPU; :class:`StarpuEngine` finds libstarpu and
compiles the cffi binding on first use (:mod:`._build`), raising :class:`StarpuUnavailable`
(a :class:`~staronnx.errors.StaronnxError`) that names the package to install when it is absent.
"""

from __future__ import annotations

from ._build import INSTALL_HINT, StarpuInstall, StarpuUnavailable, find_starpu, load_binding
import dataclasses
import os

from staronnx.errors import StaronnxError
from staronnx.plan import Plan
from staronnx.runtime.models import ModelSet, ServiceTarget
from staronnx.runtime.predictor import calibrate_mode
from staronnx.runtime.registry import EngineSettings, register_engine

from .engine import POLICY_ALIASES, StarpuEngine

#: a model's target when it was given none
NO_TARGET = ServiceTarget()


def start_starpu(plan: Plan | ModelSet, settings: EngineSettings) -> StarpuEngine:
    """The ``starpu`` engine: StarPU's own workers, schedulers and perf models, for one plan."""
    models = ModelSet.of(plan)
    if not models.single:
        raise StaronnxError("the starpu engine serves one plan; several models share a runtime on the native engine")
    if settings.workers is not None:
        raise StaronnxError("engine='starpu' starts its own StarPU workers; workers= is for engine='native'")
    # StarPU orders tasks by its own priorities and admits every request: a target would be
    # ignored, and a setting staronnx does not honour is refused by name (DESIGN.md)
    hosted = models.models[0]
    asked = [f for f in ("latency", "priority", "capacity") if getattr(hosted.target, f) != getattr(NO_TARGET, f)]
    if asked:
        raise StaronnxError(f"engine='starpu' has no service targets: model {hosted.name!r} asks for "
                            f"{', '.join(asked)}; serve it on engine='native', or drop its target")
    options = dict(settings.policy_options)
    if "calibrate" not in options and (settings.calibrate is not None or "STARONNX_CALIBRATE" in os.environ):
        options["calibrate"] = calibrate_mode(settings.calibrate)
    return StarpuEngine(models.models[0].plan, dataclasses.replace(settings, policy_options=options))


register_engine("starpu", start_starpu)


def starpu_available() -> bool:
    """True when StarPU is installed and the binding compiles and loads."""
    try:
        load_binding()
    except StarpuUnavailable:
        return False
    return True


__all__ = ["INSTALL_HINT", "POLICY_ALIASES", "StarpuEngine", "StarpuInstall", "StarpuUnavailable", "find_starpu",
           "load_binding", "starpu_available"]
