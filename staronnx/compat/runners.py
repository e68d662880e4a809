"""What runs a session's plan, and what a session must stop.

A :class:`~staronnx.runtime.runtime.Runtime` over staronnx's workers runs it, or for a plan they
cannot run, one ORT session in this process (:class:`OrtPart`). A session holds its runners and
temporary folders in a :class:`Held`, released when the session closes, is collected, or the
interpreter exits (ORT's users never call close()).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnxruntime as ort
from onnxruntime.capi.onnxruntime_inference_collection import InferenceSession as OrtSession

from staronnx.compat.providers import CPU_EP
from staronnx.ortutil import QUIET
from staronnx.plan import Plan
from staronnx.runtime.engine import EngineClosed
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.task import RequestFuture

log = logging.getLogger(__name__)

#: what runs a session's plan
type Runner = Runtime | OrtPart


def why_not_on_workers(plan: Plan) -> str | None:
    """Why staronnx's workers cannot run the plan, or None when they can: they hand on tensors
    priced by their bytes (a sequence has none), and the engine tracks each tensor from the one
    part that writes it (an input returned as an output is written by none)."""
    odd = next((t for t in (*plan.inputs, *plan.outputs) if "(" in t.dtype), None)
    if odd is not None:
        return f"{odd.name!r} is a {odd.dtype}, and staronnx's workers hand on tensors only"
    fed = set(plan.input_names)
    passed = next((n for n in plan.output_names if n in fed), None)
    if passed is not None:
        return f"output {passed!r} is an input returned as it is, which staronnx's engine does not track"
    return None


class OrtPart:
    """The one part of a plan that staronnx's workers cannot run (:func:`why_not_on_workers`), run
    by one ONNX Runtime session in this process, on the CPU, answering what a session asks of its
    Runtime."""

    def __init__(self, plan: Plan, threads: int = 0) -> None:
        so = ort.SessionOptions()
        so.log_severity_level = QUIET  # its errors reach the caller as exceptions
        so.intra_op_num_threads = max(threads, 0)  # 0: ORT's default
        self._session: OrtSession | None = OrtSession(str(plan.part_path(0)), so, providers=[CPU_EP])
        self.plan = plan
        self._outputs = plan.output_names
        self.workers: list[Any] = []
        self.tracer = None

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        if self._session is None:
            raise EngineClosed("the session is closed; no new requests are accepted")
        return dict(zip(self._outputs, self._session.run(self._outputs, dict(feeds))))

    def submit(self, feeds: Mapping[str, Any], *, checked: bool = False) -> RequestFuture:
        """The outputs, computed in this call, as a settled future (``checked``, as a Runtime's:
        ORT checks the feeds here whatever it says)."""
        future = RequestFuture(-1)
        try:
            future.set_result(self.run(feeds))
        except Exception as exc:  # noqa: BLE001 - the future carries it, as a worker's would
            future.set_exception(exc)
        return future

    def close(self) -> None:
        self._session = None


class Held:
    """What a session started and must stop: its runners and temporary folders. Kept apart from
    the session, so that they are released when the session is collected or the interpreter
    exits without ``close()`` (ORT's users never call it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runners: list[Runner] = []
        #: a private plan's folder (read-only home), and where a trace ended goes at close
        self.scratch: list[Path] = []
        _LIVE.add(self)  # released at exit, closed or not

    def add(self, runner: Runner) -> Runner:
        with self._lock:
            self._runners.append(runner)
        return runner

    def stop(self, runner: Runner) -> None:
        with self._lock:
            if runner in self._runners:
                self._runners.remove(runner)
        runner.close()
        # a private plan (read-only home) of a runner stopped before close (a variant of the model
        # no longer kept) goes with it, unless a runner still running uses it (set_providers)
        root = runner.plan.root
        with self._lock:
            if any(r.plan.root == root for r in self._runners):
                return
            gone = [folder for folder in self.scratch if folder in root.parents]
            for folder in gone:
                self.scratch.remove(folder)
        for folder in gone:
            shutil.rmtree(folder, ignore_errors=True)

    def temporary(self, prefix: str) -> Path:
        """A new temporary folder, removed with the rest."""
        folder = Path(tempfile.mkdtemp(prefix=prefix))
        self.scratch.append(folder)
        return folder

    def remove_scratch(self) -> None:
        while self.scratch:
            shutil.rmtree(self.scratch.pop(), ignore_errors=True)

    def release(self) -> None:
        """Stop every runner (one that fails to stop is logged, the others still stop), then
        remove the temporary plan folder."""
        with self._lock:
            runners, self._runners = self._runners, []
        try:
            for runner in runners:
                try:
                    runner.close()
                except Exception:  # noqa: BLE001 - the next runner must stop too
                    log.exception("stopping a session's workers failed")
        finally:
            self.remove_scratch()


#: what the sessions alive hold, released at exit before the interpreter joins its threads (as a
#: plain ORT session's process, this one's exits at once): threading's own exit hook, as
#: concurrent.futures uses, since atexit runs only after every non-daemon thread is joined
_LIVE: weakref.WeakSet[Held] = weakref.WeakSet()


def _release_all() -> None:
    for held in list(_LIVE):
        held.release()


threading._register_atexit(_release_all)  # type: ignore[attr-defined]
