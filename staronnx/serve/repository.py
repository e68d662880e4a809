"""A Triton model repository served by ``staronnx serve --model-repository DIR``.

Triton's layout: one folder per model, named as the model is served, holding an optional
``config.pbtxt`` (:mod:`staronnx.serve.model_config`) and numbered version folders, each with the
model file (``model.onnx``, or the config's ``default_model_filename``). Each model is loaded on
its own: one whose platform is not ONNX Runtime, whose config asks for what staronnx does not do,
or whose file does not load is left out with its reason (listed UNAVAILABLE in the repository
index), and the others serve.

Loading a model makes its plan (:func:`cached_plan`): cut once, kept under
``$STARONNX_HOME/repository-plans/`` keyed by the model file's SHA-256 and the settings that shape
the plan (parts, shares, method, the sizes given for its cost estimate), so the next start, or
the same file in another repository, reuses it. A model is served whole (one part) unless its
config's ``parameters`` ask for a split.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from staronnx.errors import StaronnxError
from staronnx.serve import model_config as mcfg
from staronnx.serve import sequences

#: where plans made from repository models are kept, under $STARONNX_HOME
CACHE_DIR = "repository-plans"


@dataclass
class RepositoryModel:
    """A repository model ready to serve: its plan, version, settings and effective config."""

    name: str
    version: str
    folder: Path
    model_file: Path
    plan: Any  # staronnx.plan.Plan (imported lazily: the CLI's start stays light)
    settings: mcfg.ModelSettings
    #: the config as served (completed from the model, checked), Triton's JSON form
    config: dict[str, Any]
    #: each output's labels, from its label_filename
    labels: dict[str, list[str]]
    #: its model_warmup samples: (what, count, feeds)
    warmup: list[tuple[str, int, dict[str, Any]]]
    #: the other versions its version_policy selects, latest first (this one is the latest)
    older: list["RepositoryModel"] = field(default_factory=list)


def scan(repositories: Sequence[Path]) -> list[tuple[str, Path]]:
    """(model name, folder) of every model in the repositories, in name order; a name found in
    two repositories is refused (a URL serves one model), as is a repository that is not a folder."""
    found: dict[str, Path] = {}
    for repo in repositories:
        if not repo.is_dir():
            raise StaronnxError(f"--model-repository {repo}: not a folder")
        for folder in sorted(repo.iterdir()):
            if not folder.is_dir() or folder.name.startswith("."):
                continue
            if folder.name in found:
                raise StaronnxError(f"model {folder.name!r} is in two repositories ({found[folder.name].parent} and "
                                    f"{repo}); a name serves one model")
            found[folder.name] = folder
    return sorted(found.items())


def load(name: str, folder: Path, batch_size: int, home: Path | None = None,
         override: str | None = None) -> RepositoryModel:
    """Model ``name`` of its ``folder``, ready to serve, or a :class:`StaronnxError` saying why
    not (its reason in the repository index). ``batch_size``: the server's ``--batch-size``, the
    ``max_batch_size`` a config that leaves it out gets where the model batches on axis 0.
    ``override``: a config in Triton's JSON form used instead of the folder's config.pbtxt (a
    load request's), completed from the model the same way."""
    if override is None:
        config, batch_written = mcfg.read_config(folder)
    else:
        config, batch_written = mcfg.parse_override(override)
    if config.platform not in mcfg.ONNX_PLATFORMS or config.backend not in mcfg.ONNX_BACKENDS:
        what = " and ".join(f"{k} {v!r}" for k, v in (("platform", config.platform), ("backend", config.backend)) if v)
        raise mcfg.ConfigError(f"{what} is not served by staronnx serve: it serves ONNX models through ONNX Runtime "
                               "(platform 'onnxruntime_onnx' or backend 'onnxruntime')")
    mcfg.check_honoured(config)
    filename = config.default_model_filename or mcfg.DEFAULT_MODEL_FILENAME
    versions = [int(d.name) for d in folder.iterdir() if d.is_dir() and d.name.isdigit() and (d / filename).is_file()]
    chosen = [_load_version(name, folder, v, filename, config, batch_written, batch_size, home)
              for v in mcfg.pick_versions(config, versions, name)]
    chosen[0].older = chosen[1:]
    return chosen[0]


def _load_version(name: str, folder: Path, version: int, filename: str, config: Any, batch_written: bool,
                  batch_size: int, home: Path | None) -> RepositoryModel:
    """One version of a model: its plan (cut or cached), its config completed from its file."""
    model_file = folder / str(version) / filename
    settings = mcfg.settings(config)
    inputs, outputs = mcfg.onnx_signature(model_file)
    plan = cached_plan(model_file, settings.plan, inputs, home)
    contract = plan.contract
    on_axis0 = contract.batchable and all(a == 0 for a in (*contract.inputs.values(), *contract.outputs.values()))
    try:
        effective = mcfg.complete(config, name, inputs, outputs, batch_size, on_axis0, batch_written)
    except mcfg.ConfigError as exc:
        raise mcfg.ConfigError(f"version {version}: {exc}") from None
    settings = mcfg.settings(effective)
    try:  # a stateful model: its sequence_batching checked against the graph
        settings.sequence = sequences.policy_of(effective, inputs, outputs, folder)
    except sequences.SequenceConfigError as exc:
        raise mcfg.ConfigError(f"version {version}: {exc}") from None
    if settings.max_batch_size == 0 and contract.batchable:
        plan.set_batching([], batching=False)  # Triton's non-batching model: each request alone
    labels = {}
    for output, file in settings.labels.items():
        path = folder / file
        try:
            labels[output] = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise mcfg.ConfigError(f"output {output!r}: label_filename {file!r} cannot be read: {exc}") from None
    warmup = mcfg.warmup_feeds(effective)
    return RepositoryModel(name, str(version), folder, model_file, plan, settings, mcfg.as_dict(effective), labels,
                           warmup)


def serve_spec(found: RepositoryModel, base: Any, delay: float) -> Any:
    """The batcher's :class:`~staronnx.serving.spec.ServeSpec` of a repository model: ``base``
    (the flags' spec with the model's queue capacity) changed where its config says otherwise;
    ``delay``: the server's --max-delay, for a config without a queue delay."""
    from dataclasses import replace

    s = found.settings
    return replace(base, batch_size=max(1, s.max_batch_size), max_delay=delay if s.max_delay is None else s.max_delay,
                   queue_capacity=s.queue_capacity or base.queue_capacity, pad_to=s.pad_to)


def workers_for(found: RepositoryModel, cuda_streams: int, separate_runtimes: bool,
                cuda_graphs: bool = False) -> str | None:
    """The workers a repository model's instance_group keeps it on in a shared runtime
    (``--model-workers`` ``cpu`` or ``cuda``), None for all; or why that cannot be done on this
    server (its instance kind, or CUDA graphs its config asks for, or refuses, against the
    server's ``--cuda-streams`` and ``--cuda-graphs``)."""
    graphs = bool(cuda_streams) and cuda_graphs
    if found.settings.cuda_graphs is not None and found.settings.cuda_graphs != graphs:
        raise StaronnxError(f"optimization.cuda.graphs is {str(found.settings.cuda_graphs).lower()}, but this server "
                            + ("captures CUDA graphs for every model (--no-cuda-graphs turns that off)" if graphs else
                               "has no CUDA graphs (they need --cuda-streams N and --cuda-graphs)"))
    wants = found.settings.workers
    if wants == "cuda" and not cuda_streams:
        raise StaronnxError("instance_group KIND_GPU: this server has no CUDA workers (start it with --cuda-streams N)")
    if wants is None or not cuda_streams:
        return None  # without CUDA workers every worker is a CPU group: KIND_CPU is what happens anyway
    if separate_runtimes:
        raise StaronnxError(f"instance_group {'KIND_GPU' if wants == 'cuda' else 'KIND_CPU'} keeps the model on some "
                            "workers of one shared runtime: not with --separate-runtimes")
    return wants


def declared(found: RepositoryModel) -> Any:
    """What the repository says of a loaded version, as the served model takes it
    (:class:`~staronnx.serve.models.Declared`)."""
    from staronnx.serve.models import Declared

    s = found.settings
    return Declared(found.version, found.config, found.labels, s.reshapes, s.preserve_ordering, s.queue_timeout,
                    s.sequence)


def warm(found: RepositoryModel, runtime: Any) -> int:
    """Run the model's ``model_warmup`` samples on ``runtime`` before it serves (a sample that
    fails fails the load, naming it); returns the runs made."""
    runs = 0
    for what, count, feeds in found.warmup:
        runs += count
        for _ in range(count):
            try:
                runtime.run(feeds)
            except Exception as exc:  # noqa: BLE001 - whatever ORT raised, the load fails with it
                raise StaronnxError(f"{what} failed: {exc}") from None
    return runs


def plan_key(model_file: Path, shaping: dict[str, Any]) -> str:
    """The cache key of a plan: the model file's SHA-256, the settings that shape the plan, and
    the staronnx version that cut it."""
    digest = hashlib.sha256()
    with open(model_file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    try:
        version = importlib.metadata.version("staronnx")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    settings = json.dumps({"staronnx": version, **shaping}, sort_keys=True)
    return f"{digest.hexdigest()[:32]}-{hashlib.sha256(settings.encode()).hexdigest()[:16]}"


def cached_plan(model_file: Path, shaping: dict[str, Any], inputs: Sequence[mcfg.TensorSpec],
                home: Path | None = None) -> Any:
    """The plan of ``model_file`` cut with ``shaping`` (parts, shares, method, input_shapes),
    from the cache or cut now and cached (written to a temporary folder, then renamed into
    place: a concurrent start or a crash never leaves half a plan)."""
    from staronnx.partition import PartitionSpec, partition
    from staronnx.perfmodels.store import default_root
    from staronnx.plan import Plan

    shaping = {"parts": 1, **shaping} if "shares" not in shaping else dict(shaping)
    root = (home or default_root()) / CACHE_DIR
    final = root / plan_key(model_file, shaping)
    if (final / "plan.json").is_file():
        return Plan.load(final)
    root.mkdir(parents=True, exist_ok=True)
    whole = shaping.get("parts") == 1
    shapes = shaping.get("input_shapes") or (_estimate_shapes(inputs) if whole else None)
    tmp = Path(tempfile.mkdtemp(prefix=".cutting-", dir=root))
    try:
        partition(model_file, shaping.get("shares"),
                  PartitionSpec(parts=shaping.get("parts"), method=shaping.get("method", "metis"), input_shapes=shapes,
                                costs="estimate" if whole else "profile"), output_dir=tmp / "plan")
        try:
            os.rename(tmp / "plan", final)
        except OSError:  # another start cached it meanwhile
            if not (final / "plan.json").is_file():
                raise
    except StaronnxError as exc:
        raise StaronnxError(f"cannot make its plan: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Plan.load(final)


def _estimate_shapes(inputs: Sequence[mcfg.TensorSpec]) -> list[str] | None:
    """Sizes for the dynamic dimensions past the first (which the partitioner takes as the
    batch), for the cost estimate of a one-part plan only (where the estimate decides nothing)."""
    shapes = [f"{t.name}={'x'.join(str(d if d > 0 else 1) for d in t.dims)}" for t in inputs
              if len(t.dims) > 1 and any(d < 0 for d in t.dims[1:])]
    return shapes or None


