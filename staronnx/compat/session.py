"""``staronnx.InferenceSession``: ONNX Runtime's call shape over a staronnx Runtime.

Existing code switches with one line::

    sess = staronnx.InferenceSession("model.onnx", providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    logits, = sess.run(None, {"input": x})

The constructor is ORT's, so that scripts written for ORT run unchanged; staronnx's own settings
(``shares``, CPU groups, CUDA streams, the runtime's policy and options) are one keyword-only value,
``spec=``:class:`SessionSpec`, so that none of them can be mistaken for an
ORT argument. Providers choose the
workers, as they choose ORT's devices; where CUDA cannot run, the session warns and serves on the
CPU, as ORT falls back. Misuse raises what ORT raises, each also a
:class:`~staronnx.errors.StaronnxError`.

A model (a file or bytes) is partitioned once and the plan kept under
``$STARONNX_HOME/plans/<model hash>-<settings hash>/``, as perf models are: the next session of
the same model and settings reuses it (and its calibrated perf models). A plan folder or
:class:`Plan` is used as it is.

A model with a dynamic size besides the batch (a sequence length, an image's height and width, a
KV cache's past) needs no option, as ORT needs none: partitioning must run the model at some
size to time it, and no size is safe to guess (a UNet wants multiples of its strides, a decoder's
mask must match its cache), so the session is cut at its first run's shapes, which are valid by
construction, and that one plan then serves every size the model accepts. That first run
therefore takes seconds; the plan is kept, and the next session of the model starts at once.

Whatever ONNX Runtime runs, the session runs: a model that cannot be cut is served whole
(:mod:`staronnx.partition.whole`, said in a PartitionWarning); one whose inputs or outputs
staronnx's workers cannot carry runs as one ORT session in this process. The split is the
session's own choice unless ``shares`` is given, so only then does it warn where the cut misses
the shares (or has a part that computes nothing): a drop-in user chose nothing to change.

ONNX Runtime's options, each honoured, said (``OptionNotApplied``, a warning naming it: settings
of ORT's own pools, allocators and logs, which each worker sets for its cores), or refused
(``NotImplementedError`` naming it):

==============================================  ==========================================================
option                                          here
==============================================  ==========================================================
``providers``, ``provider_options``             honoured: CUDA workers (``device_id``, CUDA's options) or CPU
``intra_op_num_threads``                        honoured: one CPU group of that many cores
``enable_profiling``, ``profile_file_prefix``   honoured: staronnx's trace, in ORT's format and file name
``optimized_model_filepath`` (+ its config      honoured: ORT writes the whole optimised model for these
entries for external initializers)              options (the parts are not it)
``add_initializer``                             honoured: the value replaces the model's before the cut
``add_external_initializers`` (and ``..._from_  honoured: the values stand for the external data
files_in_memory``)
``add_free_dimension_override_by_name`` /       honoured: the inputs' sizes are fixed before the cut
``..._by_denotation``
the model's ``ort_config`` (where ORT reads     honoured: read as ORT reads it (``get_session_options``)
it: ``ORT_LOAD_CONFIG_FROM_MODEL=1``)
``session.record_ep_graph_assignment_info``     honoured: ``get_provider_graph_assignment_info`` (CPU)
``inter_op_num_threads``, ``execution_mode``,   said, each with why (``_UNAPPLIED``, ``_CONFIG_ENTRIES``):
``execution_order``, ``graph_optimization...``  parts run in parallel on the workers, each part's
arena, pattern, reuse, determinism, log levels  operators in sequence, at ORT's full optimisation
< 2, pool/allocator config entries              level, with ORT's allocators, logging fatal errors
``session.load_model_format=ORT``, ``.ort``     refused: an ORT-format model cannot be cut
``add_provider``/``add_provider_for_devices``   refused: name the providers to InferenceSession
``register_custom_ops_library``                 not read back: a model needing it is refused at load
                                                (the checker and ORT both refuse it)
RunOptions: an active LoRA adapter;             honoured: a variant of the model with the adapter's
overridable initializers fed by name            parameters (cut once; the last 4 kept)
RunOptions ``terminate``                        honoured: the run does not start
RunOptions log levels, arena shrinkage,         said (once per session)
``gpu_graph_id``
==============================================  ==========================================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import sys
import threading
import time
import types
import warnings
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_inference_collection import InferenceSession as OrtSession

from staronnx.compat.errors import InvalidArgument, NotRecorded, Terminated, ort_task_error
from staronnx.compat.io import (CSession, Feeds, IOBinding, Names, RunOptionsArg, feed_array, host_array, host_memory,
                                owned_value)
from staronnx.compat.lora import Overrides, Variants, overridable_initializers
from staronnx.compat.model import ModelMetadata, NodeArg, declared_io, load_source, node_arg, unranked_inputs
from staronnx.compat.options import (RECORD_ASSIGNMENT, OptionNotApplied, config_entry, model_config, not_applied,
                                     reads_config, refuse_options, with_config)
from staronnx.compat.plan_cache import (AT_FIRST_RUN, first_run_shapes, partition_settings, plan_dir, session_plan,
                                        unsized_dims)
from staronnx.compat.providers import CPU_EP, CUDA_EP, asked_providers, cores_for_threads, cuda_device_id, cuda_workers
from staronnx.compat.runners import Held, OrtPart, Runner, why_not_on_workers
from staronnx.contract import parse_batch_axes
from staronnx.errors import InputError
from staronnx.modelio import load_model, model_sha256
from staronnx.ortutil import QUIET, write_optimized
from staronnx.partition.checks import targets_by_default
from staronnx.partition.plan_cache import kept_plan
from staronnx.partition.whole import too_small, value_spec
from staronnx.plan import Plan, check_tensor
from staronnx.runtime.engine import EngineClosed
from staronnx.runtime.policies import policy_options
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.runtime.task import RequestFuture, TaskError
from staronnx.workers.cuda import CudaWorker
from staronnx.workers.cudart import host_runtime_from_env
from staronnx.workers.layout import MachineSpec

log = logging.getLogger(__name__)
#: the package whose frames are the session's own, not a caller's
_PACKAGE = __name__.rpartition(".")[0] + "."

#: the split a session asks for when given none: the StarONNX papers' 85/15. A model with fewer
#: nodes than that is served whole instead (partition's default split), with a warning
DEFAULT_SHARES = (0.85, 0.15)


@dataclasses.dataclass(frozen=True)
class SessionSpec:
    """How a session cuts its model and which workers run it. What is None here ORT's arguments
    decide, as they choose ORT's devices: the CUDA streams from ``providers`` (two per GPU where
    CUDA is asked for), the GPU from the CUDA provider's ``device_id``, the CPU groups from
    ``intra_op_num_threads`` (one group of that many cores; else one per NUMA node)."""

    #: each part's share of the work (``"auto"``: from measured speeds); None: partition's default
    shares: Sequence[float] | str | None = DEFAULT_SHARES
    cpu_groups: str | None = None
    cuda_streams: int | None = None
    cuda_devices: Sequence[int] | None = None
    #: capture each (part, batch size) as a CUDA graph on the CUDA workers
    cuda_graphs: bool = True
    #: the size a model with dynamic sizes is cut at (``["image=1x3x256x256"]``) when the session
    #: opens, instead of at its first run's shapes
    input_shapes: Sequence[str] | Mapping[str, Sequence[int]] | None = None
    #: what goes to :func:`staronnx.partition` (``{"costs": "estimate"}``, ...)
    partition_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: how the runtime serves (policy, perf models, trace, CUDA options: :class:`RuntimeSpec`)
    runtime: RuntimeSpec = dataclasses.field(default_factory=RuntimeSpec)


#: ORT keyword arguments accepted for compatibility; staronnx has no use for them
_ORT_KWARGS = frozenset({"enable_fallback", "disabled_optimizers", "read_config_from_model"})

#: ORT methods refused, with what to do instead
_REFUSED: dict[str, str] = {
    "run_with_ortvaluevector": "use run_with_ort_values(output_names, {name: OrtValue})",
    "get_tuning_results": "kernel tuning is per worker session; staronnx tunes nothing across them",
    "set_tuning_results": "kernel tuning is per worker session; staronnx tunes nothing across them",
    "release_captured_graph": "CUDA graphs belong to the CUDA workers (off: spec=SessionSpec(cuda_graphs=False))",
    "create_ortvalue_from_shape_and_type": "use onnxruntime.OrtValue.ortvalue_from_shape_and_type (host memory)",
    "set_ep_dynamic_options": "providers are fixed when the workers start; create a new session",
}


# -- the session ------------------------------------------------------------------------------
def _called_from_staronnx(depth: int = 3) -> bool:
    """Whether the construction comes from staronnx's own code (a worker, a plan's reference
    session), within ``depth`` frames of the caller (a program's wrapper may stand between)."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        module = frame.f_globals.get("__name__", "")
        if module.startswith("staronnx.") and not module.startswith(_PACKAGE):
            return True
        frame = frame.f_back
    return False


class InferenceSession:
    """Drop-in for ``onnxruntime.InferenceSession`` backed by the staronnx runtime."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Where a program made this class ``onnxruntime.InferenceSession`` (the one-line switch),
        staronnx's own code asking that name for a part's session gets ORT's: a part cut again by
        staronnx would partition without end, each session waiting on its own plan's lock."""
        if ort.InferenceSession is not OrtSession and _called_from_staronnx():
            return OrtSession(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        path_or_bytes: str | os.PathLike[str] | bytes | Plan,
        sess_options: ort.SessionOptions | None = None,
        providers: Sequence[str | tuple[str, Mapping[str, Any]]] | None = None,
        provider_options: Sequence[Mapping[str, Any]] | None = None,
        *,
        spec: SessionSpec | None = None,
        **kwargs: Any,
    ) -> None:
        """``spec``: staronnx's settings (:class:`SessionSpec`); ``kwargs``: ORT's own keywords
        (``enable_fallback``, ``disabled_optimizers``, ``read_config_from_model``), any other
        refused. ORT's settings that choose hardware keep their meaning where ``spec`` leaves them
        open: the CUDA provider's ``device_id`` is the GPU the CUDA workers drive;
        ``sess_options.intra_op_num_threads = N`` gives the session one CPU group of N cores."""
        self._spec = spec = spec or SessionSpec()
        unknown = sorted(set(kwargs) - _ORT_KWARGS)
        if unknown:
            raise TypeError(f"InferenceSession() got an unexpected keyword argument {unknown[0]!r}; staronnx's "
                            "settings are one value, spec=staronnx.SessionSpec(...) (shares, cpu_groups, cuda_streams, "
                            "input_shapes, partition_options, runtime=RuntimeSpec(policy=..., store=...), ...)")
        #: what runs the plan: a Runtime over the workers, or for a plan they cannot run, an OrtPart
        self._runtime: Runtime | OrtPart | None = None
        self._plan: Plan | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        self._held = Held()
        self._finalizer = weakref.finalize(self, self._held.release)  # when collected, without close()
        if sess_options is not None and not isinstance(sess_options, ort.SessionOptions):
            hint = (" (staronnx's shares go in spec=SessionSpec(shares=[...]))"
                    if isinstance(sess_options, (list, tuple)) else "")
            raise TypeError(f"sess_options must be an onnxruntime.SessionOptions, got "
                            f"{type(sess_options).__name__}{hint}")
        refuse_options(sess_options, path_or_bytes)
        self._sess_options = sess_options
        self._assignments: tuple[list[OrtSession], list[Any]] | None = None
        #: the RunOptions settings not applied that this session has warned of
        self._said: set[str] = set()
        #: how this session cuts its model (None for a plan), and the runtimes of variants of the model
        #: with other initializers (a LoRA adapter's), by their values
        self._cut_model: Callable[..., Plan] | None = None
        self._variants = Variants(self._held)
        #: the model as loaded (source, model, hash; None for a plan), its metadata, its inputs and
        #: outputs as it declares them, and the initializers a run may override
        self._loaded = load_source(path_or_bytes, sess_options)
        model = self._loaded[1] if self._loaded is not None else None
        self._meta = ModelMetadata.of(model) if model is not None else None
        self._model = declared_io(model) if model is not None else None
        #: inputs the model gives no shape (any rank, as ORT takes them); the plan reads them as
        #: scalars, so the session checks such feeds itself, against the model as declared
        self._unranked = unranked_inputs(model) if model is not None else frozenset()
        self._overrides = Overrides(overridable_initializers(model) if model is not None else [])
        config = model_config(model) if model is not None and reads_config(kwargs) else {}
        #: the options this session runs with (the caller's, with the model's embedded config over them)
        self._options = effective = with_config(sess_options, config)
        unapplied = not_applied(effective, sess_options or effective) if effective is not None else []
        if unapplied:
            warnings.warn(OptionNotApplied("staronnx.InferenceSession does not apply sess_options."
                                           + "; ".join(unapplied)), stacklevel=2)
        self._threads = int(effective.intra_op_num_threads) if effective is not None else 0
        self._machine, self._runtime_spec = self._workers(providers, provider_options, spec.cuda_streams)

        if model is not None and effective is not None and effective.optimized_model_filepath:
            # the whole model, optimised as ORT writes it for these options (staronnx's parts are not it)
            model_arg = bytes(path_or_bytes) if isinstance(path_or_bytes, (bytes, bytearray, memoryview)) \
                else str(path_or_bytes)
            write_optimized(model_arg, sess_options or effective, list(self._provider_options),
                            config.get("graph_optimization_level"))
        options = partition_settings(spec.partition_options, spec.input_shapes)
        try:
            self._plan = self._plan_for(path_or_bytes, spec.shares, options, self._machine.groups, self._streams)
            self._profile_path, self._profile_start = self._profiling(effective)
            if self._plan is not None:
                self._runtime = self._start(self._plan)
            else:
                policy_options(spec.runtime.policy)  # an unknown policy fails here, not at the first run
        except BaseException:
            self._finalizer()  # what was started before the failure, and a private plan
            raise

    def _workers(self, providers: Any, provider_options: Any,
                 cuda_streams: int | None) -> tuple[MachineSpec, RuntimeSpec]:
        """The Runtime's machine and spec for ORT's provider arguments, with what the session was
        given (``self._spec``); ``self._provider_options`` records the providers in use."""
        spec, runtime = self._spec, self._spec.runtime
        # what the CUDA workers will drive instead of CUDA, if anything (as CudaWorker picks it)
        stand_in = runtime.cuda.runtime or host_runtime_from_env()
        asked = None if providers is None else asked_providers(providers, provider_options, stand_in is not None)
        self._streams = streams = cuda_workers(asked, cuda_streams, stand_in)
        self._provider_options = {CPU_EP: {}} if asked is None else dict(asked)
        self._provider_options.setdefault(CPU_EP, {})
        devices = spec.cuda_devices or ((cuda_device_id(asked),) if streams and asked is not None else (0,))
        drivers = len(devices) if streams else 0  # one per GPU
        cpu_groups = spec.cpu_groups or (cores_for_threads(self._threads, drivers) if self._threads > 0 else "numa")
        cuda_given = {k: str(v) for k, v in self._provider_options.get(CUDA_EP, {}).items()
                      if k not in ("device_id", "user_compute_stream", "has_user_compute_stream")}
        if streams and cuda_given:
            # ORT's CUDA options (gpu_mem_limit, arena settings, ...) go to every CUDA worker;
            # the device and the stream are each worker's own, so those are not passed
            runtime = dataclasses.replace(runtime, cuda=dataclasses.replace(
                runtime.cuda, provider_options={**cuda_given, **runtime.cuda.provider_options}))
        return MachineSpec(cpu_groups, streams, devices, spec.cuda_graphs), runtime

    def _start(self, plan: Plan) -> Runtime | OrtPart:
        """What runs the plan: a :class:`Runtime` over staronnx's workers, or for a plan they
        cannot run, one ORT session on the CPU (said, and warned of where CUDA was asked for)."""
        why = why_not_on_workers(plan)
        if why is None:
            runtime = self._held.add(Runtime(plan, self._machine, self._runtime_spec))
            if self._ort_profile and runtime.tracer is not None:
                runtime.tracer.event_list = True
            return runtime
        if self._streams:
            warnings.warn(f"{CUDA_EP} is not used for this model: it runs as one ONNX Runtime session on the "
                          f"CPU ({why})", UserWarning, stacklevel=4)
        log.info("running the model as one ONNX Runtime session in this process: %s", why)
        return self._held.add(OrtPart(plan, self._threads))

    def _plan_for(self, path_or_bytes: Any, shares: Any, options: dict[str, Any], groups: str,
                  streams: int) -> Plan | None:
        """The plan to run: the one given, the one kept for this model and settings, or a new
        cut. None when the model is cut at its first run (by :meth:`_runner`)."""
        if self._loaded is None:
            return path_or_bytes if isinstance(path_or_bytes, Plan) else Plan.load(path_or_bytes)
        source, model, sha256 = self._loaded
        # the user's own shares are warned of where the cut misses them; the session's are not
        by_default = shares is DEFAULT_SHARES
        if by_default and too_small(model, len(shares)):
            shares = None  # partition's default split, which serves a model too small to cut whole
        if shares is not None and not isinstance(shares, str):
            shares = [float(s) for s in shares]
        from staronnx.partition.api import partition
        from staronnx.partition.spec import PartitionSpec

        cut_fields = {f.name for f in dataclasses.fields(PartitionSpec)}

        unsized = [] if "input_shapes" in options else unsized_dims(model, parse_batch_axes(options.get("batch_axes")))
        stamp = _file_stamp(source)

        def cut_model(src: Any, sha: str, feeds: Mapping[str, Any] | None = None) -> Plan:
            """``src`` (this model, or a variant of it with other initializers) cut with this
            session's settings: at ``feeds``' shapes for a model with dynamic sizes."""
            if src is source and stamp is not None and _file_stamp(source) != stamp:
                # the file was rewritten or removed since the session loaded it (a first run cuts
                # later): ORT runs the model it loaded, so the session cuts the one it holds
                log.warning("%s changed since the session opened it; cutting the model the session loaded", source)
                src, sha = model, model_sha256(model)
            settings, asked = dict(options), dict(options)
            if unsized:
                assert feeds is not None
                # not an input the model gives no shape: a size given for it fixes its rank in
                # the parts, which then refuse the other ranks ORT takes (partition leaves it open)
                shapes = {k: v for k, v in first_run_shapes(feeds).items() if k not in self._unranked}
                log.info("cutting %s at a run's shapes %s (its dynamic sizes: %s); the plan serves every size",
                         self._meta.graph_name if self._meta else "the model", shapes, ", ".join(unsized))
                settings["input_shapes"], asked["input_shapes"] = shapes, AT_FIRST_RUN
            spec = PartitionSpec(groups=groups, cuda_streams=streams,
                                 **{k: v for k, v in settings.items() if k in cut_fields})
            make = functools.partial(partition, src, shares, spec,
                                     **{k: v for k, v in settings.items() if k not in cut_fields})
            with targets_by_default() if by_default else contextlib.nullcontext():
                return session_plan(sha, plan_dir(sha, shares, asked, groups, streams), make, self._held)

        self._cut_model = cut_model
        if not unsized:
            return cut_model(source, sha256)
        folder = plan_dir(sha256, shares, {**options, "input_shapes": AT_FIRST_RUN}, groups, streams)
        with contextlib.suppress(OSError):  # a home that cannot be read: cut at the first run
            return kept_plan(folder, sha256)
        return None

    @property
    def plan(self) -> Plan:
        """The plan this session runs. A model cut at its first run has none before that run."""
        if self._plan is None:
            raise RuntimeError("this session's model is cut at its first run's shapes and has not run yet; pass "
                               "spec=SessionSpec(input_shapes=[...]) to InferenceSession to cut it when the session opens")
        return self._plan

    def _profiling(self, so: ort.SessionOptions | None) -> tuple[Path | None, int]:
        """``enable_profiling`` records staronnx's trace (Chrome/Perfetto JSON, ORT's profile
        format) at ORT's file name, so a profiling script finds its file where it expects."""
        #: the trace is ORT's profile: written as ORT writes one, a JSON array of events
        self._ort_profile = self._runtime_spec.trace is None and so is not None and so.enable_profiling
        if self._ort_profile:
            assert so is not None
            # ORT's name: the time to the millisecond (to the second, sessions opened within one
            # second traced into one file, the second's replacing the first's)
            now = time.time()
            stamp = f"{time.strftime('%Y-%m-%d_%H-%M-%S', time.localtime(now))}_{int(now * 1000) % 1000:03d}"
            self._runtime_spec = dataclasses.replace(
                self._runtime_spec, trace=Path(f"{so.profile_file_prefix or 'onnxruntime_profile_'}_{stamp}.json"))
        trace = self._runtime_spec.trace
        return (Path(trace), time.time_ns()) if trace is not None else (None, 0)

    # -- getters ----------------------------------------------------------------------------
    @property
    def _io(self) -> Plan:
        """The inputs and outputs the getters report and feeds are checked against: the source
        model's, as it declares them (ORT's), or a plan's given as it is."""
        return self._model if self._model is not None else self.plan

    def get_inputs(self) -> list[NodeArg]:
        return [node_arg(t) for t in self._io.inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [node_arg(t) for t in self._io.outputs]

    def get_overridable_initializers(self) -> list[NodeArg]:
        """The initializers a run may replace (fed by name or set by a LoRA adapter: a variant of
        the model, see :meth:`run`), as the model declares them."""
        declared = {vi.name: vi for vi in self._loaded[1].graph.input} if self._loaded is not None else {}
        return [node_arg(value_spec(declared[t.name])) for t in self._overrides.overridable
                if t.name in declared]

    def get_providers(self) -> list[str]:
        # a session started at its first run has its CUDA workers decided already
        runtime = self._runtime
        cuda = bool(self._streams) if runtime is None else any(isinstance(w, CudaWorker) for w in runtime.workers)
        return ([CUDA_EP] if cuda else []) + [CPU_EP]

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        """The options of the providers in use: CUDA's as the first CUDA worker's part 0
        session reports them (ORT's full set), else as given."""
        out = {name: dict(self._provider_options.get(name, {})) for name in self.get_providers()}
        workers = self._runtime.workers if self._runtime is not None else []
        worker = next((w for w in workers if isinstance(w, CudaWorker)), None)
        if CUDA_EP in out and worker is not None:
            with contextlib.suppress(Exception):
                out[CUDA_EP] = dict(worker.provider_options(0).get(CUDA_EP, out[CUDA_EP]))
        return out

    def get_session_options(self) -> ort.SessionOptions:
        """The options this session runs with: those given, with the model's embedded ORT
        config over them where ORT would read it (see the module's table of what each does)."""
        return self._options if self._options is not None else ort.SessionOptions()

    def get_modelmeta(self) -> ModelMetadata:
        """The source model's metadata: from the model given, or for a plan from the model
        file it records (empty metadata when that file is gone)."""
        if self._meta is None:
            path = self.plan.source.get("path")
            self._meta = ModelMetadata()
            if path and Path(path).is_file():
                with contextlib.suppress(Exception):
                    self._meta = ModelMetadata.of(onnx.load(path, load_external_data=False))
        return self._meta

    def get_profiling_start_time_ns(self) -> int:
        return self._profile_start

    def end_profiling(self) -> str:
        """Write the trace so far and return its file name ('' when not profiling, or after
        the first call, as ORT)."""
        path, self._profile_path = self._profile_path, None
        tracer = self._runtime.tracer if self._runtime is not None else None
        if path is None or tracer is None:
            return ""
        saved = tracer.save()
        # profiling ends here, as ORT's does: the trace the runtime writes again when it stops
        # goes to a folder removed then, not over the file the caller now owns (or removed)
        tracer.path = self._held.temporary("staronnx-trace-") / saved.name
        return str(saved)

    def set_providers(self, providers: Any = None, provider_options: Any = None) -> None:
        """ORT's: the workers start again for these providers (all available ones for None),
        on the same plan; a provider ORT does not know is refused with ORT's RuntimeError.
        Requests in flight finish on the workers they started on."""
        stand_in = self._spec.runtime.cuda.runtime or host_runtime_from_env()
        known = set(ort.get_all_providers()) | ({CUDA_EP} if stand_in is not None else set())
        if providers is None:
            providers = ort.get_available_providers()
        names = [item[0] if isinstance(item, tuple) else item for item in providers]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise RuntimeError(f"Unknown Provider Type: {unknown[0]}")  # ORT's words and type
        started = self._workers(providers, provider_options, self._spec.cuda_streams if CUDA_EP in names else None)
        with self._start_lock:
            if self._closed:
                raise EngineClosed("the session is closed")
            old = [*self._variants.clear(), *([self._runtime] if self._runtime is not None else [])]
            self._machine, self._runtime_spec = started
            self._runtime = self._start(self._plan) if self._plan is not None else None
        for runner in old:
            self._held.stop(runner)

    def get_input_memory_infos(self) -> list[ort.OrtMemoryInfo]:
        """Where each input is taken from: host memory (the workers copy it to their device)."""
        return [host_memory() for _ in self._io.inputs]

    def get_output_memory_infos(self) -> list[ort.OrtMemoryInfo]:
        """Where each output is returned: host memory."""
        return [host_memory() for _ in self._io.outputs]

    def get_input_epdevices(self) -> list[Any]:
        """The device each input is taken on: the CPU execution provider's (host memory)."""
        cpu = next((d for d in ort.get_ep_devices() if d.ep_name == CPU_EP), None)
        return [cpu for _ in self._io.inputs]

    def get_provider_graph_assignment_info(self) -> list[Any]:
        """Which provider runs each node, as ORT answers it for each part's session on a CPU worker
        (the parts' nodes are the model's). Needs ORT's config entry (else ORT's Fail); refused with
        CUDA workers, where each part runs on the CPU or the GPU as the policy places its batch."""
        given = self._sess_options
        if given is None or config_entry(given, RECORD_ASSIGNMENT) != "1":
            raise NotRecorded(f"[ONNXRuntimeError] : 1 : FAIL : Session configuration entry '{RECORD_ASSIGNMENT}' "
                              'must be set to "1" to retrieve EP graph assignment information.')
        if self._streams:
            raise NotImplementedError("get_provider_graph_assignment_info: with CUDA workers each part runs where "
                                      "the policy places its batch (runtime.stats() counts where they ran)")
        if self._assignments is None:
            so = ort.SessionOptions()
            so.log_severity_level = QUIET
            so.add_session_config_entry(RECORD_ASSIGNMENT, "1")
            sessions = [OrtSession(str(self.plan.part_path(i)), so, providers=[CPU_EP]) for i in range(self.plan.k)]
            # the answers point into their sessions: the sessions live as long as this one
            self._assignments = (sessions, [s for session in sessions
                                            for s in session.get_provider_graph_assignment_info()])
        return list(self._assignments[1])

    @property
    def _sess(self) -> "CSession":
        """What scripts reach as ORT's C session (``session._sess.run_with_ort_values``)."""
        return CSession(self)

    def disable_fallback(self) -> None:
        """Nothing to turn off: fallback happens at construction only (CUDA missing -> CPU workers)."""

    def enable_fallback(self) -> None:
        """Nothing to turn on: fallback happens at construction only."""

    # -- running ----------------------------------------------------------------------------
    def _feeds(self, input_feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """ORT's feed checks: a missing input is a ValueError, anything else wrong with a feed an
        InvalidArgument."""
        names, io = list(input_feed.keys()), self._io  # a feed that is no mapping fails here, as in ORT
        missing = [n for n in io.input_names if n not in input_feed]
        if missing:
            raise InputError(f"Required inputs ({missing}) are missing from input feed ({names}).")
        specs = {t.name: t for t in io.inputs}
        feeds = {name: feed_array(value, name, specs.get(name)) for name, value in input_feed.items()}
        try:
            if self._unranked:
                io = self._ranked(io, feeds)
            io.check_feeds(feeds)
        except InputError as exc:
            raise InvalidArgument(str(exc)) from None
        return feeds

    def _ranked(self, io: Plan, feeds: Mapping[str, Any]) -> Plan:
        """``io`` with each input the model gives no shape at the rank it is fed (every size
        open): a value of any rank, as ORT takes it, where its ``[]`` alone took scalars."""
        shaped = {t.name: dataclasses.replace(t, shape=[None] * feeds[t.name].ndim) for t in io.inputs
                  if t.name in self._unranked and isinstance(feeds.get(t.name), np.ndarray)}
        if not shaped:
            return io
        return Plan(Path(), [], [shaped.get(t.name, t) for t in io.inputs], io.outputs, [], 0, {}, {})

    def _submit(self, runner: Runtime | OrtPart, feeds: Mapping[str, Any]) -> RequestFuture:
        """``feeds`` (checked: :meth:`_feeds`) queued on ``runner``. A model with an input of no
        shape was checked against the model here: the plan, which reads that input as a
        scalar, would refuse any other rank."""
        return runner.submit(feeds, checked=bool(self._unranked))

    def _outputs(self, output_names: Names) -> list[str]:
        if isinstance(output_names, str):
            raise TypeError("output_names must be a list of names (or None), not one string")
        names, known = list(output_names or self._io.output_names), self._io.output_names
        unknown = [n for n in names if n not in known]
        if unknown:
            raise InvalidArgument(f"Invalid output name:{unknown[0]}; the outputs are {known}")
        return names

    def _split(self, input_feed: Feeds, run_options: RunOptionsArg) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The feeds (checked: :meth:`_feeds`), and the overridable initializers this run
        replaces (ORT's two ways: fed by name, or set by ``run_options``' active LoRA adapters,
        read back from ORT)."""
        if run_options is not None:
            if run_options.terminate:
                raise Terminated("Exiting due to terminate flag being set to true.")  # ORT's words and class
            said = [s for s in not_applied(run_options, run_options) if s not in self._said]
            if said:
                self._said.update(said)  # once per session each
                said_text = "staronnx.InferenceSession does not apply run_options." + "; ".join(said)
                warnings.warn(OptionNotApplied(said_text), stacklevel=3)
        if not self._overrides.names:
            return self._feeds(input_feed), {}  # as given: a feed that is no mapping fails where ORT's does
        inputs, overrides = self._overrides.split(input_feed, run_options)
        feeds = self._feeds(inputs)
        fed = {name: overrides[name] for name in self._overrides.names & input_feed.keys()}
        if fed:
            # checked as ORT checks them, as inputs: else a wrong value is cut into a variant of the
            # model (kept in the home) and fails there, at ORT's load of a part, as a ModelError
            declared = {vi.name: value_spec(vi) for vi in self._loaded[1].graph.input if vi.name in fed} \
                if self._loaded is not None else {}
            try:  # initializers share no batch: each is checked against its own declared shape only
                for name in fed:
                    if name in declared:
                        check_tensor(declared[name], fed[name])
            except InputError as exc:
                raise InvalidArgument(str(exc)) from None
        return feeds, overrides

    def _runner(self, feeds: Mapping[str, Any], overrides: Mapping[str, np.ndarray]) -> Runtime | OrtPart:
        """What runs this request: the session's runtime (for a model cut at its first run, started
        now at ``feeds``' shapes: concurrent first runs wait for one cut, and a cut that fails
        leaves the session as it was, for the next run to try at its own shapes), or with
        initializers overridden, the runtime of that variant of the model (cut once, kept for the
        next runs that give the same values; the
        :data:`~staronnx.compat.lora.MAX_VARIANTS` last used are kept)."""
        if not overrides and self._runtime is not None:
            return self._runtime
        with self._start_lock:
            if self._closed:
                raise EngineClosed("the session is closed; no new requests are accepted")
            if not overrides:
                if self._runtime is None:
                    assert self._loaded is not None and self._cut_model is not None  # a model cut at its first run
                    try:
                        plan = self._cut_model(self._loaded[0], self._loaded[2], feeds)
                        self._runtime = self._start(plan)
                    except BaseException:
                        self._held.remove_scratch()  # a private plan (read-only home) made before the failure
                        raise
                    self._plan = plan
                return self._runtime
            loaded, cut_model = self._loaded, self._cut_model
            assert loaded is not None and cut_model is not None

            def start() -> Runner:
                variant = load_model(loaded[1], supplied=overrides)
                log.info("initializers %s overridden: running a variant of the model", sorted(overrides))
                return self._start(cut_model(variant.model, variant.sha256, feeds))

            return self._variants.runner(overrides, start)

    def run(self, output_names: Names, input_feed: Feeds, run_options: RunOptionsArg = None) -> list[np.ndarray]:
        """Outputs in the order asked (all, in the model's order, for None or []), as ORT
        returns them. Of ``run_options``, what changes the answer is honoured: an active LoRA
        adapter (a variant of the model with its parameters) and ``terminate``; its log and
        memory settings are ORT's own sessions' (the workers')."""
        names = self._outputs(output_names)
        feeds, overrides = self._split(input_feed, run_options)
        try:
            runner = self._runner(feeds, overrides)
            values = self._submit(runner, feeds).result() if self._unranked else runner.run(feeds)
        except TaskError as exc:
            raise ort_task_error(exc) from exc.__cause__
        return [values[n] for n in names]

    def run_async(self, output_names: Names, input_feed: Feeds | None = None,
                  callback: Callable[[list[np.ndarray], Any, str], None] | None = None, user_data: Any = None,
                  run_options: RunOptionsArg = None) -> None:
        """ORT's form: ``callback(results, user_data, err)`` from a worker thread once the
        outputs are ready (``err`` is '' on success; on failure results are [] and ``err`` the
        message). A missing input raises here, as in ORT; a first run's failed cut is reported
        through the callback. For a future, use :meth:`submit`."""
        if callback is None or input_feed is None:
            raise TypeError("run_async(output_names, input_feed, callback, user_data) is ONNX "
                            "Runtime's callback form; for a future of the outputs use submit(input_feed)")
        try:
            names = self._outputs(output_names)
            feeds, overrides = self._split(input_feed, run_options)
        except (InvalidArgument, Terminated) as exc:  # ORT reports these through the callback
            _call_back(callback, [], user_data, str(exc))
            return
        try:
            runtime = self._runner(feeds, overrides)
        except EngineClosed:
            raise
        except Exception as exc:  # noqa: BLE001 - a first run's cut failed: reported as its run's error
            _call_back(callback, [], user_data, str(exc))
            return
        future = self._submit(runtime, feeds)

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            results = [] if exc is not None else [f.result()[n] for n in names]
            _call_back(callback, results, user_data, "" if exc is None else str(exc))

        future.add_done_callback(done)

    def submit(self, input_feed: Mapping[str, Any]) -> RequestFuture:
        """A future (concurrent.futures, awaitable) of the outputs dict: staronnx's own
        asynchronous form, for pipelining many requests without callbacks."""
        feeds, overrides = self._split(input_feed, None)
        return self._submit(self._runner(feeds, overrides), feeds)

    def run_with_ort_values(self, output_names: Names, input_dict_ort_values: Mapping[str, ort.OrtValue],
                            run_options: RunOptionsArg = None) -> list[ort.OrtValue]:
        """Host OrtValues in (ORT's or its C ones: :meth:`_sess`), host OrtValues out."""
        feeds = {k: host_array(v, k) for k, v in input_dict_ort_values.items()}
        return [owned_value(a) for a in self.run(output_names, feeds, run_options)]

    def io_binding(self) -> IOBinding:
        return IOBinding(self)

    def run_with_iobinding(self, iobinding: IOBinding, run_options: RunOptionsArg = None) -> None:
        if not isinstance(iobinding, IOBinding):
            raise TypeError("run_with_iobinding takes the IOBinding this session's io_binding() made")
        iobinding._run(run_options)  # its terminate flag and LoRA adapters count here as in run()

    def __getattr__(self, name: str) -> Any:
        """ORT methods that have no meaning over staronnx's workers: one line saying so and
        what to use, instead of an AttributeError that reads like a typo."""
        why = _REFUSED.get(name)
        if why is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        def refused(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"staronnx.InferenceSession.{name}: {why}")

        return refused

    @property
    def runtime(self) -> Runtime | OrtPart:
        if self._runtime is None:
            if self._plan is None and not self._closed:
                raise RuntimeError("this session's workers start at its first run, which cuts the model at its shapes; "
                                   "pass spec=SessionSpec(input_shapes=[...]) to InferenceSession to start them when it "
                                   "opens")
            raise RuntimeError("this InferenceSession failed to start")
        return self._runtime

    def close(self) -> None:
        """Stop the workers. A plan kept under ``$STARONNX_HOME`` stays for the next session;
        one made in a temporary folder (read-only home) is removed."""
        with self._start_lock:  # a first run's cut in progress finishes first; none starts after
            self._closed = True
            self._variants.clear()
        self._finalizer()  # stops every runner, once

    def __enter__(self) -> "InferenceSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# the constructor's signature is __init__'s, ORT's (__new__ only hands staronnx's own calls to ORT)
InferenceSession.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    list(inspect.signature(InferenceSession.__init__).parameters.values())[1:])


def _file_stamp(source: Any) -> tuple[int, int] | None:
    """A model file's size and modification time (None for a model in memory; (-1, -1) for a
    file that is gone): what tells a file rewritten since the session loaded it."""
    if not isinstance(source, Path):
        return None
    try:
        st = source.stat()
    except OSError:
        return (-1, -1)
    return st.st_size, st.st_mtime_ns


def _call_back(callback: Callable[..., None], results: list[np.ndarray], user_data: Any, err: str) -> None:
    """A user's callback runs on a worker's thread: what it raises is logged, not allowed to
    take the worker down."""
    try:
        callback(results, user_data, err)
    except Exception:  # noqa: BLE001
        log.exception("run_async callback raised")
