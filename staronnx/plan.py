"""Plans: a partitioned model on disk (``plan.json`` plus one ONNX file per part).

A plan is what every later stage consumes (calibration, the runtime, the simulator), so it
carries everything they need without the source model: each part's inputs and outputs, the
tensors crossing between parts with their dtypes, symbolic shapes and bytes per sample, the
target and achieved cost shares, and provenance (source hash, settings) so cached performance
models can be matched to exactly this plan.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from staronnx.contract import UNNAMED, BatchContract, axis_of, parse_batch_axes
from staronnx.errors import InputError, PartFileError, PlanError
from staronnx.fsutil import atomic_write_text
from staronnx.modelio import is_fixed

PLAN_FORMAT = "staronnx-plan"
PLAN_VERSION = 1


@dataclass
class TensorSpec:
    """A tensor fed to a part: a model input or one crossing from another part."""

    name: str
    dtype: str
    shape: list[int | str | None]
    bytes_per_sample: int = 0
    batched: bool = True
    producer: int | None = None  # part index; None for a model input
    consumers: list[int] = field(default_factory=list)
    value_range: list[int] | None = None  # [low, high) for integer model inputs


@dataclass
class PartSpec:
    """One part: an ONNX file run as one task per batch."""

    index: int
    file: str
    inputs: list[str]
    outputs: list[str]
    nodes: int
    op_counts: dict[str, int]
    cost_us: float
    share: float
    target_share: float
    sha256: str = ""
    #: Where a placement method (comm-sd, duet, overseer, optimal, ort-static) put this part:
    #: a CPU worker's name (``cpu:numa0.core0``) or ``cudaD``; None when the runtime's policy
    #: decides (metis, linear). Plans written before this field load with None.
    device: str | None = None


@dataclass
class Plan:
    """A partitioned model; parts are listed in an order where producers come first."""

    root: Path
    parts: list[PartSpec]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    crossing: list[TensorSpec]
    cut_bytes_per_sample: int
    source: dict[str, Any]
    settings: dict[str, Any]
    cost_source: str = ""
    hash: str = ""
    _sessions: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)
    #: per input: (name, numpy dtype or None, shape), built once: check_feeds runs per request
    _input_checks: list[tuple[str, Any, list[Any]]] | None = field(default=None, repr=False, compare=False)
    _accepted: set[tuple[Any, ...]] = field(default_factory=set, repr=False, compare=False)
    _contract: BatchContract | None = field(default=None, repr=False, compare=False)
    #: batching overrides given at load time (a command's --batch-axis / --no-batching)
    _batching: tuple[dict[str, int | None], bool] | None = field(default=None, repr=False, compare=False)

    # -- persistence ------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "hash": self.hash,
            "source": self.source,
            "settings": self.settings,
            "cost_source": self.cost_source,
            "shares": {
                "target": [p.target_share for p in self.parts],
                "achieved": [p.share for p in self.parts],
            },
            "cut_bytes_per_sample": self.cut_bytes_per_sample,
            "inputs": [asdict(t) for t in self.inputs],
            "outputs": [asdict(t) for t in self.outputs],
            "crossing": [asdict(t) for t in self.crossing],
            "parts": [asdict(p) for p in self.parts],
        }

    def compute_hash(self) -> str:
        """Identity of what runs: source model, settings and the parts' bytes."""
        digest = hashlib.sha256()
        digest.update(str(self.source.get("sha256", "")).encode())
        digest.update(json.dumps(self.settings, sort_keys=True).encode())
        for p in self.parts:
            digest.update(p.sha256.encode())
        return digest.hexdigest()[:16]

    def write_json(self, directory: Path) -> None:
        atomic_write_text(directory / "plan.json", json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> "Plan":
        """Read a plan folder, failing with :class:`PlanError` when anything is missing."""
        root = Path(directory)
        meta = root / "plan.json"
        if not root.is_dir():
            raise PlanError(f"plan folder not found: {root}")
        if not meta.exists():
            raise PlanError(f"{root} is not a plan folder (no plan.json)")
        try:
            data = json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanError(f"{meta} is unreadable or not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise PlanError(f"{meta} is not a staronnx plan (a JSON {type(data).__name__}, not an object)")
        if data.get("format") != PLAN_FORMAT:
            raise PlanError(f"{meta} is not a staronnx plan (format {data.get('format')!r})")
        if data.get("version") != PLAN_VERSION:
            raise PlanError(f"{meta} has plan version {data.get('version')}, this staronnx reads "
                            f"version {PLAN_VERSION}; partition the model again")
        try:
            plan = cls(
                root=root,
                parts=[PartSpec(**p) for p in data["parts"]],
                inputs=[TensorSpec(**t) for t in data["inputs"]],
                outputs=[TensorSpec(**t) for t in data["outputs"]],
                crossing=[TensorSpec(**t) for t in data["crossing"]],
                cut_bytes_per_sample=int(data["cut_bytes_per_sample"]),
                source=data["source"],
                settings=data["settings"],
                cost_source=data.get("cost_source", ""),
                hash=data.get("hash", ""),
            )
            malformed = _malformed(plan)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise PlanError(f"{meta} is incomplete or malformed: {exc}") from None
        if malformed is not None:
            raise PlanError(f"{meta} is incomplete or malformed: {malformed}")
        for spec in (*plan.inputs, *plan.outputs, *plan.crossing):
            # plans written before negative dims were read as dynamic recorded them as -1
            spec.shape = [None if isinstance(d, int) and d < 0 else d for d in spec.shape]
        for part in plan.parts:
            check_part_file(root, part)
        _check_arch_files(root, plan)
        return plan

    # -- batching -------------------------------------------------------------------------
    @property
    def contract(self) -> BatchContract:
        """The model's batching contract (:mod:`staronnx.contract`): read off the plan's shapes,
        with the overrides given at partition time (its settings) and then at load time
        (:meth:`set_batching`). Every door batches through this one object."""
        if self._contract is None:
            axes = dict(self.settings.get("batch_axes") or {})
            batching = self.settings.get("batching", True) is not False
            if self._batching is not None:
                axes.update(self._batching[0])
                batching = batching and self._batching[1]
            self._contract = BatchContract.read({t.name: t.shape for t in self.inputs},
                                                {t.name: t.shape for t in self.outputs},
                                                batch_axes=axes, batching=batching)
        return self._contract

    def set_batching(self, batch_axes: Mapping[str, int | None] | Sequence[str] | None = None,
                     batching: bool = True) -> "Plan":
        """Override the contract for this loaded plan (the user knows what the graph cannot
        tell); raises :class:`~staronnx.contract.ContractError` for an override that does not fit."""
        self._batching = (parse_batch_axes(batch_axes), batching)
        self._contract = None
        self.contract  # noqa: B018 - checked now, where the user gave it
        return self

    def part_batch_axes(self, index: int) -> dict[str, int]:
        """The batch axis of each tensor part ``index`` reads (model inputs by the contract,
        crossing tensors where their shape names the batch), for its perf-model footprint."""
        contract = self.contract
        if not contract.batchable:
            return {}
        symbol = contract.symbol or UNNAMED
        axes: dict[str, int] = {}
        for name in self.parts[index].inputs:
            axis = contract.inputs[name] if name in contract.inputs else axis_of(self.tensor(name).shape, symbol)
            if axis is not None:
                axes[name] = axis
        return axes

    # -- structure --------------------------------------------------------------------------
    @property
    def k(self) -> int:
        return len(self.parts)

    def part_path(self, index: int) -> Path:
        return self.root / self.parts[index].file

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def tensor(self, name: str) -> TensorSpec:
        for t in (*self.inputs, *self.crossing, *self.outputs):
            if t.name == name:
                return t
        raise KeyError(name)

    def producers(self) -> dict[str, int]:
        """Which part produces each tensor a part or the caller reads."""
        return {o: p.index for p in self.parts for o in p.outputs}

    def dependencies(self) -> list[set[int]]:
        """Per part, the parts whose outputs it reads (the plan's DAG)."""
        prod = self.producers()
        return [{prod[t] for t in p.inputs if t in prod} for p in self.parts]

    # -- inputs -----------------------------------------------------------------------------
    def check_feeds(self, feeds: Mapping[str, Any]) -> None:
        """Reject feeds that cannot run, naming the input, what is expected and what was given.

        Checked before any work starts, so a bad request never half-runs.
        """
        checks = self._input_checks
        if checks is None:
            checks = self._input_checks = [(t.name, _numpy_dtype(t.dtype), t.shape) for t in self.inputs]
        # serving sends the same few signatures over and over: one accepted is not re-checked
        try:
            signature = tuple([(type(v), v.dtype, v.shape) for v in feeds.values()]) + tuple(feeds)
        except AttributeError:
            signature = None
        if signature is not None and signature in self._accepted:
            return
        self._check_feeds(feeds, checks)
        if signature is not None:
            if len(self._accepted) > 1024:
                self._accepted.clear()
            self._accepted.add(signature)

    def _check_feeds(self, feeds: Mapping[str, Any], checks: list[tuple[str, Any, list[Any]]]) -> None:
        if len(feeds) != len(checks) or any(name not in feeds for name, _, _ in checks):
            missing = [t.name for t in self.inputs if t.name not in feeds]
            if missing:
                raise InputError(f"missing input(s) {missing}; the plan's inputs are {self.input_names}")
            unknown = [n for n in feeds if n not in self.input_names]
            raise InputError(f"unknown input(s) {unknown}; the plan's inputs are {self.input_names}")
        for (name, dtype, _), spec in zip(checks, self.inputs):
            _check_tensor(spec, feeds[name], dtype)
        self.contract.check_rows(feeds, "the feeds", empty=True)  # one batch size on every batch axis

    # -- execution --------------------------------------------------------------------------
    def session(self, index: int) -> Any:
        """A cached CPU ORT session for a part (the reference path, not the runtime's)."""
        if index not in self._sessions:
            import onnxruntime as ort

            so = ort.SessionOptions()
            # parts run one after another, each with its own intra-op pool on the same cores:
            # a pool left spinning after its Run() would steal the cores from the next part
            so.add_session_config_entry("session.force_spinning_stop", "1")
            try:
                self._sessions[index] = ort.InferenceSession(str(self.part_path(index)), so,
                                                             providers=["CPUExecutionProvider"])
            except Exception as exc:  # ORT raises its own classes (InvalidProtobuf, Fail, ...)
                # the file was checked when the plan was loaded: it changed since
                raise part_file_error(self.root, self.parts[index],
                                      f"ONNX Runtime cannot load it: {_first_line(exc)}") from None
        return self._sessions[index]

    def run_reference(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the parts one after another on CPU ORT: the ground truth every engine must match."""
        values = self.reference_values(feeds)
        return {name: values[name] for name in self.output_names}

    def reference_values(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every tensor a part reads or writes, from a reference run.

        Calibration feeds each part the real values its predecessors produce: random values
        for a crossing tensor could be invalid (indices, masks) or take other code paths.
        """
        self.check_feeds(feeds)
        values: dict[str, np.ndarray] = dict(feeds)
        for part in self.parts:
            sess = self.session(part.index)
            outs = sess.run(part.outputs, {n: values[n] for n in part.inputs})
            values.update(zip(part.outputs, outs))
        return values

    def part_feeds(self, index: int, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: values[n] for n in self.parts[index].inputs}


def _malformed(plan: Plan) -> str | None:
    """What in a loaded plan.json does not have the structure staronnx writes (lists of names,
    shapes as lists, a settings object), or None: what every later step iterates over, checked
    once, so a damaged file is one :class:`PlanError` rather than a traceback wherever it is used."""
    if not isinstance(plan.settings, dict) or not isinstance(plan.source, dict):
        return "settings and source must be objects"
    for spec in (*plan.inputs, *plan.outputs, *plan.crossing):
        if not isinstance(spec.name, str) or not isinstance(spec.dtype, str) or not isinstance(spec.shape, list):
            return f"tensor {spec.name!r} needs a name, a dtype and a shape list"
    for part in plan.parts:
        names = (*part.inputs, *part.outputs) if isinstance(part.inputs, list) and isinstance(part.outputs, list) else None
        if names is None or not all(isinstance(n, str) for n in names) or not isinstance(part.file, str):
            return f"part {part.index!r} needs a file and lists of input and output names"
    for position, part in enumerate(plan.parts):
        if part.index != position:
            return f"part at position {position} has index {part.index!r}; parts must be listed in order 0..{len(plan.parts) - 1}"
    # a model input a part hands on as an output (an Identity, or the input itself among the
    # graph's outputs) is produced by no part: every part may read it
    given = {spec.name for spec in plan.inputs}
    producer: dict[str, int] = {}
    for part in plan.parts:
        for name in part.outputs:
            if name in given:
                continue
            if name in producer:
                return f"tensor {name!r} is produced by both part {producer[name]} and part {part.index}"
            producer[name] = part.index
    for part in plan.parts:
        for name in part.inputs:
            source = producer.get(name)
            if source is not None and source >= part.index:
                return (f"part {part.index} reads tensor {name!r} produced by part {source}, which does not run "
                        "before it (parts must run in order, each reading only earlier parts' outputs)")
    return None


def _check_arch_files(root: Path, plan: Plan) -> None:
    """The part files of an architecture of their own (the fp16 twins the CUDA workers load)
    pass the fp32 parts' checks too: one missing or truncated failed in a GPU worker only, after
    the plan had loaded and every command had said it was fine."""
    try:
        files = arch_files(plan)
        listed = {arch: list(names) for arch, names in files.items()}
    except (AttributeError, TypeError) as exc:
        raise PlanError(f"{root / 'plan.json'} is incomplete or malformed: settings.{PRECISION_SETTING}: {exc}") from None
    for arch, names in listed.items():
        if len(names) != len(plan.parts) or not all(isinstance(n, str) for n in names):
            raise PlanError(f"{root / 'plan.json'} is incomplete or malformed: settings.{PRECISION_SETTING} lists "
                            f"{len(names)} {arch} part file(s) for {len(plan.parts)} parts")
        for part, name in zip(plan.parts, names):
            check_part_file(root, replace(part, file=name))


def part_file_error(root: Path, part: PartSpec, why: str) -> PartFileError:
    """The one error for an unusable part file: which file, why, and what to do."""
    return PartFileError(f"plan {root}: part file {part.file} is {why}; partition the model again to re-create "
                         "the plan")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_part_file(root: Path, part: PartSpec) -> None:
    """Fail with :class:`PartFileError` unless ``part``'s file is an ONNX model with the inputs
    and outputs ``plan.json`` lists.

    Every command reads a plan through :meth:`Plan.load`, so checking here gives a damaged plan
    one answer everywhere, before any worker starts (a worker would fail later, in a thread, and
    after unrelated warnings). Parsing without the external weights is cheap (a 26 MB part takes
    tens of milliseconds); a cut inside the protobuf fails to parse, a cut between two fields
    parses but loses the graph's inputs, outputs or opsets, which the name check catches.
    """
    import onnx

    path = root / part.file
    if not path.is_file():
        raise part_file_error(root, part, "missing")
    if path.stat().st_size == 0:
        raise part_file_error(root, part, "empty")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends: any parse failure
        why = f"not a readable ONNX model (truncated or overwritten: {_first_line(exc)})"
        raise part_file_error(root, part, why) from None
    graph_inputs = {i.name for i in model.graph.input}
    graph_outputs = {o.name for o in model.graph.output}
    lost = [n for n in part.inputs if n not in graph_inputs]
    lost += [n for n in part.outputs if n not in graph_outputs]
    if lost or not model.opset_import or not model.graph.node:
        what = f"tensor(s) {lost}" if lost else "its opsets or nodes"
        raise part_file_error(root, part, f"damaged (it lacks {what} that plan.json lists)")
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location" and not (path.parent / entry.value).is_file():
                    raise part_file_error(root, part, f"missing its weights file {entry.value}")


def output_dir_for(output_dir: str | os.PathLike[str] | None, force: bool) -> Path:
    """Where a new plan goes: ``output_dir``, refused before any work is done when it holds
    something and ``force`` is not given, or a fresh name in the temporary folder when none is
    given. Nothing is created there until the plan is written (atomically, as every plan is),
    so a partition that fails leaves nothing."""
    if output_dir is None:
        return Path(tempfile.gettempdir()) / f"staronnx-plan-{uuid.uuid4().hex[:12]}"
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise PlanError(f"output path exists and is not a folder: {out}")
    if out.exists() and any(out.iterdir()) and not force:
        why = f"output folder {out} exists and is not empty"
        raise PlanError(f"{why}; use force=True to replace it", cli=f"{why}; use --force to replace it")
    return out


#: a string tensor's dtype in a plan (numpy's for ONNX strings), and the numpy kinds ORT takes for one
_STRINGS = np.dtype(object)
_STRING_KINDS = frozenset("OUSV")


def check_tensor(spec: TensorSpec, value: Any) -> None:
    """Reject a value that cannot stand for ``spec`` (its dtype, rank or a fixed size), naming it:
    one tensor's part of :meth:`Plan.check_feeds`, for a value checked alone (an initializer
    fed in place of its own value shares no batch with the inputs)."""
    _check_tensor(spec, value, _numpy_dtype(spec.dtype))


def _check_tensor(spec: TensorSpec, value: Any, dtype: np.dtype | None) -> None:
    """:func:`check_tensor` with ``spec``'s numpy dtype already made (``check_feeds`` keeps them)."""
    if "(" in spec.dtype:  # a sequence, optional or map (ORT's type string): ORT checks its own
        return
    if not isinstance(value, np.ndarray):
        raise InputError(f"input {spec.name!r}: expected a numpy array, got {type(value).__name__}")
    # comparing dtype objects is a C call; dtype.name runs Python code in numpy
    mismatch = (value.dtype != dtype) if dtype is not None else (value.dtype.name != spec.dtype)
    # a string tensor: ORT takes numpy's str_, bytes_ and void arrays as it takes objects
    if mismatch and not (dtype == _STRINGS and value.dtype.kind in _STRING_KINDS):
        raise InputError(f"input {spec.name!r}: expected dtype {spec.dtype}, got {value.dtype.name}")
    if len(spec.shape) != value.ndim:
        raise InputError(f"input {spec.name!r}: expected rank {len(spec.shape)} {spec.shape}, "
                         f"got shape {list(value.shape)}")
    for axis, (want, got) in enumerate(zip(spec.shape, value.shape)):
        if is_fixed(want) and want != got:
            raise InputError(f"input {spec.name!r}: axis {axis} must be {want} (shape {spec.shape}), "
                             f"got shape {list(value.shape)}")


def _numpy_dtype(name: str) -> np.dtype | None:
    """The numpy dtype a plan's dtype name means, or None for names numpy does not know."""
    try:
        return np.dtype(name)
    except TypeError:
        return None


#: the plan setting that lists, per architecture, part files of its own (fp16 for the CUDA
#: workers: :mod:`staronnx.partition.precision` writes it)
PRECISION_SETTING = "precision"


def arch_files(plan: Plan) -> dict[str, list[str]]:
    """Per architecture with its own part files, their names (empty: every arch runs the fp32 files)."""
    files: dict[str, list[str]] = plan.settings.get(PRECISION_SETTING, {}).get("files", {})
    return files


@functools.lru_cache(maxsize=64)
def _files_beside(plan_json: Path, mtime_ns: int) -> dict[str, dict[str, str]]:
    """Per arch, the fp32 part file name -> that arch's file name, read from a plan.json."""
    data = json.loads(plan_json.read_text())
    files = data.get("settings", {}).get(PRECISION_SETTING, {}).get("files", {})
    parts = [p["file"] for p in data.get("parts", [])]
    return {arch: dict(zip(parts, names, strict=True)) for arch, names in files.items()}


def arch_part_path(path: Path, arch: str) -> Path:
    """The file ``arch``'s workers load in place of the part file ``path``, by the settings of
    the plan folder it is in (the launcher sees part paths only, of one plan or of several)."""
    plan_json = path.parent / "plan.json"
    try:
        mapping = _files_beside(plan_json, plan_json.stat().st_mtime_ns)
    except (OSError, ValueError, KeyError):
        return path
    other = mapping.get(arch, {}).get(path.name)
    return path.parent / other if other else path
