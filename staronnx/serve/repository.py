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

An ensemble (``platform: "ensemble"``) is loaded from its members: each step's model is loaded
as above (from its own folder, with its own config), checked against the ensemble, and the
members' plans are composed into the ensemble's plan, cached beside theirs
(:mod:`staronnx.serve.ensemble`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from staronnx.errors import StaronnxError
from staronnx.modelio import file_sha256
from staronnx.serve import ensemble as ens
from staronnx.serve import model_config as mcfg
from staronnx.serve import sequences
from staronnx.serve.proto import model_config_pb2 as mc

if TYPE_CHECKING:  # imported where used: the CLI's start stays light
    from staronnx.plan import Plan
    from staronnx.serve.models import Declared
    from staronnx.serving.spec import ServeSpec
    from staronnx.workers.residency import WorkerSlot

#: where plans made from repository models are kept, under $STARONNX_HOME
CACHE_DIR = "repository-plans"


class Runs(Protocol):
    """What a warm-up runs its samples on: a model's :class:`~staronnx.runtime.runtime.Runtime`,
    or its :class:`~staronnx.runtime.runtime.ModelHandle` in a runtime shared by several models."""

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...


@dataclass
class RepositoryModel:
    """A repository model ready to serve: its plan, version, settings and effective config."""

    name: str
    version: str
    folder: Path
    model_file: Path
    plan: Plan
    settings: mcfg.ModelSettings
    #: the config as served (completed from the model, checked), Triton's JSON form
    config: dict[str, Any]
    #: each output's labels, from its label_filename
    labels: dict[str, list[str]]
    #: its model_warmup samples
    warmup: list[mcfg.WarmupSample]
    #: the other versions its version_policy selects, latest first (this one is the latest)
    older: list["RepositoryModel"] = field(default_factory=list)
    #: an ensemble's steps (None: a model of its own)
    ensemble: ens.EnsembleSpec | None = None


def scan(repositories: Sequence[Path]) -> list[tuple[str, Path]]:
    """(model name, folder) of every model in the repositories, in name order; a name found in
    two repositories is refused (a URL serves one model), as is a repository that is not a folder."""
    found: dict[str, Path] = {}
    read: set[Path] = set()
    for repo in repositories:
        if not repo.is_dir():
            raise StaronnxError(f"--model-repository {repo}: not a folder")
        if repo.resolve() in read:
            continue  # the same folder given twice (as Triton's set of repositories): its models once
        read.add(repo.resolve())
        for folder in sorted(repo.iterdir()):
            if not folder.is_dir() or folder.name.startswith("."):
                continue
            if folder.name in found:
                raise StaronnxError(f"model {folder.name!r} is in two repositories ({found[folder.name].parent} and "
                                    f"{repo}); a name serves one model")
            found[folder.name] = folder
    return sorted(found.items())


def load(name: str, folder: Path, batch_size: int, home: Path | None = None,
         override: str | None = None, folders: dict[str, Path] | None = None,
         within: tuple[str, ...] = ()) -> RepositoryModel:
    """Model ``name`` of its ``folder``, ready to serve, or a :class:`StaronnxError` saying why
    not (its reason in the repository index). ``batch_size``: the server's ``--batch-size``, the
    ``max_batch_size`` a config that leaves it out gets where the model batches on axis 0.
    ``override``: a config in Triton's JSON form used instead of the folder's config.pbtxt (a
    load request's), completed from the model the same way. ``folders``: every model folder of
    the repositories by name, where an ensemble finds its members (default: the models beside
    ``folder``); ``within``: the ensembles being loaded that lead here (a cycle is refused)."""
    config, batch_written = mcfg.read_config(folder) if override is None else mcfg.parse_override(override)
    if ens.is_ensemble(config):
        return _load_ensemble(name, folder, config, batch_size, home,
                              folders if folders is not None else dict(scan([folder.parent])), within)
    if config.platform not in mcfg.ONNX_PLATFORMS or config.backend not in mcfg.ONNX_BACKENDS:
        what = " and ".join(f"{k} {v!r}" for k, v in (("platform", config.platform), ("backend", config.backend)) if v)
        raise mcfg.ConfigError(f"{what} is not served by staronnx serve: it serves ONNX models through ONNX Runtime "
                               "(platform 'onnxruntime_onnx' or backend 'onnxruntime')")
    mcfg.check_honoured(config)
    filename = config.default_model_filename or mcfg.DEFAULT_MODEL_FILENAME
    # ASCII digits: str.isdigit() also takes '²' or '١', which int() refuses or reads as another folder's number
    versions = [int(d.name) for d in folder.iterdir()
                if d.is_dir() and d.name.isascii() and d.name.isdigit() and (d / filename).is_file()]
    chosen = [_load_version(name, folder, v, filename, config, batch_written, batch_size, home)
              for v in mcfg.pick_versions(config, versions, name)]
    chosen[0].older = chosen[1:]
    return chosen[0]


def _load_ensemble(name: str, folder: Path, config: mc.ModelConfig, batch_size: int, home: Path | None,
                   folders: dict[str, Path], within: tuple[str, ...]) -> RepositoryModel:
    """An ensemble: its steps read, each member loaded from its own folder and checked against
    it, their plans composed into one (cached). Members load as they would on their own (a
    member that cannot be served fails the ensemble, with its reason)."""
    spec = ens.read(config, name)
    loaded: dict[str, RepositoryModel] = {}
    members = []
    for step in spec.steps:
        if step.model_name in (*within, name):
            raise mcfg.ConfigError(f"step {step.model_name!r} leads back to ensemble {name!r}: ensembles cannot "
                                   f"form a cycle ({' -> '.join((*within, name, step.model_name))})")
        member_folder = folders.get(step.model_name)
        if member_folder is None:
            raise mcfg.ConfigError(f"step {step.model_name!r} is not a model of the repository "
                                   f"({', '.join(sorted(n for n in folders if n != name)) or 'no other model'})")
        if step.model_name not in loaded:
            ens.refuse_sequence_member(step, mcfg.read_config(member_folder)[0])
            try:
                loaded[step.model_name] = load(step.model_name, member_folder, batch_size, home, folders=folders,
                                               within=(*within, name))
            except StaronnxError as exc:
                raise mcfg.ConfigError(f"step {step.model_name!r} cannot be loaded: {exc}") from None
        found = loaded[step.model_name]
        versions = {int(v.version): v for v in (found, *found.older)}
        version = found if step.model_version < 0 else versions.get(step.model_version)
        if version is None:
            raise mcfg.ConfigError(f"step {step.model_name!r} asks for version {step.model_version}, which its "
                                   f"version_policy does not serve (it serves {sorted(versions)})")
        members.append(ens.MemberView(step.model_name, version.version, version.config, version.plan))
    ens.check_members(spec, config, members)
    from staronnx.perfmodels.store import default_root

    plan = ens.composed_plan(spec, config, members, (home or default_root()) / CACHE_DIR)
    spec = replace(spec, member_parts=ens.member_parts(plan))
    effective = mc.ModelConfig()
    effective.CopyFrom(config)
    effective.name = name
    versions_here = [int(d.name) for d in folder.iterdir() if d.is_dir() and d.name.isascii() and d.name.isdigit()]
    return RepositoryModel(name, str(max(versions_here, default=1)), folder, folder / "config.pbtxt", plan,
                           mcfg.settings(effective), mcfg.as_dict(effective), {}, [], ensemble=spec)


def _load_version(name: str, folder: Path, version: int, filename: str, config: mc.ModelConfig, batch_written: bool,
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
    warmup = mcfg.warmup_feeds(effective, filled=settings.sequence.filled if settings.sequence else frozenset())
    if settings.sequence is not None:  # each sample a sequence of one request per row
        warmup = [w._replace(feeds=settings.sequence.warmup_feeds(w.feeds)) for w in warmup]
    return RepositoryModel(name, str(version), folder, model_file, plan, settings, mcfg.as_dict(effective), labels,
                           warmup)


def serve_spec(found: RepositoryModel, base: ServeSpec, delay: float) -> ServeSpec:
    """The batcher's :class:`~staronnx.serving.spec.ServeSpec` of a repository model: ``base``
    (the flags' spec with the model's queue capacity) changed where its config says otherwise;
    ``delay``: the server's --max-delay, for a config without a queue delay."""
    s = found.settings
    return replace(base, batch_size=max(1, s.max_batch_size), max_delay=delay if s.max_delay is None else s.max_delay,
                   queue_capacity=s.queue_capacity or base.queue_capacity, pad_to=s.pad_to,
                   queue_policy=s.queue_policy)


def workers_for(found: RepositoryModel, workers: Sequence[WorkerSlot], separate_runtimes: bool,
                cuda_graphs: bool = False) -> str | None:
    """The workers a repository model's instance_group keeps it on in a shared runtime (a
    ``--model-workers`` selector, :func:`staronnx.serve.instances.holders`), None for all; or why
    that cannot be done on this server (its instance groups against ``workers``, the server's CUDA
    streams and CPU groups as :class:`~staronnx.workers.residency.WorkerSlot`, or CUDA graphs its
    config asks for, or refuses, against the server's ``--cuda-graphs``)."""
    from staronnx.serve.instances import holders

    cuda_streams = any(w.kind == "cuda" for w in workers)
    graphs = cuda_streams and cuda_graphs
    if found.settings.cuda_graphs is not None and found.settings.cuda_graphs != graphs:
        raise StaronnxError(f"optimization.cuda.graphs is {str(found.settings.cuda_graphs).lower()}, but this server "
                            + ("captures CUDA graphs for every model (--no-cuda-graphs turns that off)" if graphs else
                               "has no CUDA graphs (they need --cuda-streams N and --cuda-graphs)"))
    wants = holders(found.settings.instances, workers)
    if wants is not None and separate_runtimes:
        raise StaronnxError(f"instance_group keeps the model on some workers ({wants}) of one shared runtime: not "
                            "with --separate-runtimes")
    return wants


def machine_workers(groups: str, cuda_streams: int, cuda_devices: Sequence[int],
                    thread_per_stream: bool = False) -> list[WorkerSlot]:
    """The CUDA streams and CPU groups a server of these settings starts on this machine, as
    :class:`~staronnx.workers.residency.WorkerSlot` (their names and kinds, before any starts):
    what a config's instance_group is mapped onto."""
    from staronnx.workers.layout import MachineSpec, layout
    from staronnx.workers.topology import Topology

    spec = MachineSpec(groups, cuda_streams, tuple(cuda_devices), thread_per_stream=thread_per_stream)
    return [w.slot for w in layout(spec, Topology.from_system()).workers if w.kind in ("cpu", "cuda")]


def declared(found: RepositoryModel) -> Declared:
    """What the repository says of a loaded version, as the served model takes it
    (:class:`~staronnx.serve.models.Declared`)."""
    from staronnx.serve.models import Declared

    s = found.settings
    return Declared(found.version, found.config, found.labels, s.reshapes, s.preserve_ordering,
                    sequence=s.sequence, ensemble=found.ensemble, queue_sized=s.queue_capacity is not None)


def warm(found: RepositoryModel, runtime: Runs) -> int:
    """Run the model's ``model_warmup`` samples on ``runtime`` before it serves (a sample that
    fails fails the load, naming it); returns the runs made."""
    runs = 0
    for sample in found.warmup:
        runs += sample.runs
        for _ in range(sample.runs):
            try:
                runtime.run(sample.feeds)
            except Exception as exc:  # noqa: BLE001 - whatever ORT raised, the load fails with it
                raise StaronnxError(f"{sample.what} failed: {exc}") from None
    return runs


def cached_plan(model_file: Path, shaping: dict[str, Any], inputs: Sequence[mcfg.TensorSpec],
                home: Path | None = None) -> Plan:
    """The plan of ``model_file`` cut with ``shaping`` (parts, shares, method, input_shapes),
    kept by the model file's hash and ``shaping`` (:mod:`staronnx.partition.plan_cache`)."""
    from staronnx.partition import PartitionSpec, partition
    from staronnx.partition.plan_cache import kept_or_made, plan_folder
    from staronnx.perfmodels.store import default_root

    shaping = {"parts": 1, **shaping} if "shares" not in shaping else dict(shaping)
    whole = shaping.get("parts") == 1
    shapes = shaping.get("input_shapes") or (_estimate_shapes(inputs) if whole else None)
    spec = PartitionSpec(parts=shaping.get("parts"), method=shaping.get("method", "metis"), input_shapes=shapes,
                         costs="estimate" if whole else "profile")
    sha = file_sha256(model_file)
    try:
        return kept_or_made(plan_folder((home or default_root()) / CACHE_DIR, sha, shaping),
                            lambda folder: partition(model_file, shaping.get("shares"), spec, output_dir=folder,
                                                     force=True), sha)
    except StaronnxError as exc:
        raise StaronnxError(f"cannot make its plan: {exc}") from None


def _estimate_shapes(inputs: Sequence[mcfg.TensorSpec]) -> list[str] | None:
    """Sizes for the dynamic dimensions past the first (which the partitioner takes as the
    batch), for the cost estimate of a one-part plan only (where the estimate decides nothing)."""
    shapes = [f"{t.name}={'x'.join(str(d if d > 0 else 1) for d in t.dims)}" for t in inputs
              if len(t.dims) > 1 and any(d < 0 for d in t.dims[1:])]
    return shapes or None


