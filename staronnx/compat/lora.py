"""Variants of a session's model: other values of its overridable initializers, set by an
active LoRA adapter of ``run_options`` or fed by name, as ORT allows.

A variant is a model of its own to staronnx (its weights are cut into its parts), so each is
cut once and run by its own runtime; the runtimes of the :data:`MAX_VARIANTS` variants last used
are kept for the next runs that give the same values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from staronnx.compat.io import feed_array
from staronnx.compat.runners import Held, Runner
from staronnx.modelio import values_digest
from staronnx.ortutil import AdapterProbe

#: variants of a model (other initializers: LoRA adapters) whose runtimes a session keeps
MAX_VARIANTS = 4


def overridable_initializers(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The initializers a run may override (IR >= 4: those also listed as graph inputs), as ORT's
    ``get_overridable_initializers`` lists them; what a LoRA adapter sets."""
    if model.ir_version < 4:
        return []
    listed = {vi.name for vi in model.graph.input}
    return [t for t in model.graph.initializer if t.name in listed]


class Overrides:
    """The initializers a run replaces, ORT's two ways: fed by name, or set by ``run_options``'
    active LoRA adapters (read back from ORT, which keeps them out of Python's reach)."""

    def __init__(self, overridable: list[onnx.TensorProto]) -> None:
        self.overridable = overridable
        self.names = {t.name for t in overridable}
        self._adapters: AdapterProbe | None = None

    def split(self, input_feed: Mapping[str, Any],
              run_options: ort.RunOptions | None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(the feeds that are inputs, the initializers this run overrides)."""
        overrides: dict[str, np.ndarray] = {}
        if run_options is not None:
            if self._adapters is None:
                self._adapters = AdapterProbe(self.overridable)
            overrides.update(self._adapters.values(run_options))
        for name in self.names & input_feed.keys():
            overrides[name] = feed_array(input_feed[name], name)
        return {k: v for k, v in input_feed.items() if k not in self.names}, overrides


class Variants:
    """The runners of a session's variants, by their initializers' values, the most recently used
    last; the callers hold the session's start lock."""

    def __init__(self, held: Held) -> None:
        self._held = held
        self._runners: dict[str, Runner] = {}

    def runner(self, overrides: Mapping[str, np.ndarray], start: Callable[[], Runner]) -> Runner:
        """The runner of the variant with ``overrides``: kept, or started by ``start``; the
        least recently used beyond :data:`MAX_VARIANTS` are stopped."""
        key = values_digest(overrides)
        runner = self._runners.pop(key, None)
        if runner is None:
            runner = start()
        self._runners[key] = runner
        while len(self._runners) > MAX_VARIANTS:
            self._held.stop(self._runners.pop(next(iter(self._runners))))
        return runner

    def clear(self) -> list[Runner]:
        """Forget every variant; their runners, for the caller to stop."""
        runners, self._runners = list(self._runners.values()), {}
        return runners
