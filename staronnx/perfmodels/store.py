"""Where performance models live on disk, and how processes share them safely.

Layout under the root (``$STARONNX_HOME``, else ``~/.cache/staronnx``)::

    perfmodels/<host>/<plan_hash>/part<k>.<arch>.json   one history model
    bus/<host>.json                                       the host's bus model

Models are per host (``$STARONNX_HOSTNAME`` overrides the name, like ``STARPU_HOSTNAME``)
because times measured on one machine say nothing about another, and per plan hash because a
re-partitioned model has different parts. Every file is a JSON object carrying
``{"format": "staronnx-perfmodel", "version": 1, "kind": "history" | "bus", ...}``.

Safety rules, because a serving process, a calibration run and a benchmark may share a store:

* **Atomic writes**: a temp file in the same directory, fsync, ``os.replace``; a crash leaves
  either the old or the new file, never half of one.
* **No lost samples**: :meth:`PerfModelStore.update` takes a per-file lock (``filelock``),
  loads, applies the change, and writes. :meth:`PerfModelStore.commit` uses it to *replay* a
  model's unsaved samples into the on-disk state, so two processes recording concurrently add
  up instead of the last writer winning (StarPU overwrites here).
* **Never crash on a bad file**: a corrupt, truncated or foreign-version file is renamed aside
  to ``<name>.corrupt-<timestamp>`` with a :class:`PerfModelCorruptWarning` and treated as
  empty, i.e. recalibrated — the same outcome as StarPU's missing model, with the evidence
  kept for inspection.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import re
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from staronnx.fsutil import atomic_write_text
from staronnx.perfmodels.bus import BusModel
from staronnx.perfmodels.history import (
    CALIBRATE_MINIMUM,
    HISTORY_MAX_ERROR,
    HistoryModel,
    PerfModelFormatError,
    PerfRow,
)

FORMAT = "staronnx-perfmodel"
VERSION = 1
#: Seconds to wait for another process's lock before giving up with ``filelock.Timeout``.
LOCK_TIMEOUT = 60.0

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_MODEL_FILE_RE = re.compile(r"^part([0-9]+)\.([A-Za-z0-9_-]+)\.json$")


class PerfModelCorruptWarning(UserWarning):
    """A model file could not be used; it was moved aside and will be recalibrated."""


class _Unusable(Exception):
    """Internal: the file exists but cannot be used (the message says why)."""


def default_root() -> Path:
    """``$STARONNX_HOME`` if set, else ``~/.cache/staronnx``."""
    env = os.environ.get("STARONNX_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "staronnx"


def default_host() -> str:
    """``$STARONNX_HOSTNAME`` or the machine's host name, made safe as a file name."""
    raw = os.environ.get("STARONNX_HOSTNAME") or socket.gethostname() or "localhost"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", raw).strip(".") or "localhost"


def _check_name(what: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(f"{what} must match [A-Za-z0-9_-]+ (it names a file), got {value!r}")
    return value


@dataclass(frozen=True, order=True)
class ModelKey:
    """Which history model: a plan (by hash), one of its parts, one worker arch."""

    plan_hash: str
    part: int
    arch: str

    def __post_init__(self) -> None:
        _check_name("plan_hash", self.plan_hash)
        _check_name("arch", self.arch)
        if isinstance(self.part, bool) or not isinstance(self.part, int) or self.part < 0:
            raise ValueError(f"part must be a non-negative int, got {self.part!r}")

    @property
    def filename(self) -> str:
        """``part<k>.<arch>.json``."""
        return f"part{self.part}.{self.arch}.json"


def atomic_write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` so that readers see the old or the new file only."""
    atomic_write_text(path, json.dumps(data, indent=1, allow_nan=False, sort_keys=False) + "\n")


class PerfModelStore:
    """History and bus models of one host under one root directory.

    ``calibrate_minimum``, ``max_error`` and ``use_regression`` are applied to every model it
    loads (they are settings of this run, not data of the files).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        host: str | None = None,
        calibrate_minimum: int = CALIBRATE_MINIMUM,
        max_error: float = HISTORY_MAX_ERROR,
        use_regression: bool = True,
        lock_timeout: float = LOCK_TIMEOUT,
    ) -> None:
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.host = _check_host(host) if host is not None else default_host()
        self.lock_timeout = lock_timeout
        self._model_options: dict[str, Any] = {
            "calibrate_minimum": calibrate_minimum,
            "max_error": max_error,
            "use_regression": use_regression,
        }

    # -- paths -----------------------------------------------------------------------------

    def plan_dir(self, plan_hash: str) -> Path:
        """The folder of one plan's models on this host."""
        return self.root / "perfmodels" / self.host / _check_name("plan_hash", plan_hash)

    def path(self, key: ModelKey) -> Path:
        """The JSON file of one history model."""
        return self.plan_dir(key.plan_hash) / key.filename

    def bus_path(self) -> Path:
        """The JSON file of this host's bus model."""
        return self.root / "bus" / f"{self.host}.json"

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock", timeout=self.lock_timeout):
            yield

    # -- reading with recovery -------------------------------------------------------------

    def _read(self, path: Path, kind: str) -> dict[str, Any] | None:
        """The file's JSON object, ``None`` if absent; raises ``_Unusable`` if unusable."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise _Unusable(f"not valid JSON (truncated or corrupt: {exc})") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise _Unusable(f"not a {FORMAT} file")
        if data.get("version") != VERSION:
            raise _Unusable(f"of version {data.get('version')!r}; this staronnx reads {VERSION}")
        if data.get("kind") != kind:
            raise _Unusable(f"a {data.get('kind')!r} model where a {kind!r} model was expected")
        return data

    def _quarantine(self, path: Path, reason: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S") + f"-{time.time_ns() % 1_000_000_000:09d}"
        aside = path.with_name(f"{path.name}.corrupt-{stamp}")
        try:
            os.replace(path, aside)
            where = f"moved aside to {aside.name}"
        except FileNotFoundError:
            return
        except OSError as exc:
            where = f"could not be moved aside ({exc})"
        warnings.warn(
            f"performance model {path} is {reason}; {where}; it will be recalibrated",
            PerfModelCorruptWarning,
            stacklevel=4,
        )

    def _load_history_locked(self, key: ModelKey) -> HistoryModel:
        path = self.path(key)
        try:
            data = self._read(path, "history")
            if data is not None:
                model = HistoryModel.from_dict(data, **self._model_options)
                if (model.part, model.arch) != (key.part, key.arch):
                    raise _Unusable(f"the model of part {model.part} on {model.arch}")
                return model
        except (_Unusable, PerfModelFormatError) as exc:
            self._quarantine(path, str(exc))
        return HistoryModel(key.part, key.arch, **self._model_options)

    # -- history models --------------------------------------------------------------------

    def load(self, plan_hash: str, part: int, arch: str) -> HistoryModel:
        """The stored model, or an empty one (missing, or unusable and moved aside)."""
        key = ModelKey(plan_hash, part, arch)
        path = self.path(key)
        try:  # Lock-free fast path: writes are atomic, so a good file is read whole.
            data = self._read(path, "history")
            if data is None:
                return HistoryModel(part, arch, **self._model_options)
            model = HistoryModel.from_dict(data, **self._model_options)
            if (model.part, model.arch) == (part, arch):
                return model
        except (_Unusable, PerfModelFormatError):
            pass
        # Re-check under the lock before moving anything aside: a writer may just have fixed it.
        with self._locked(path):
            return self._load_history_locked(key)

    def save(self, plan_hash: str, model: HistoryModel) -> None:
        """Overwrite the stored model with ``model`` (discarding what was there).

        This is StarPU's ``STARPU_CALIBRATE=2``; to add samples use :meth:`commit`.
        """
        key = ModelKey(plan_hash, model.part, model.arch)
        path = self.path(key)
        with self._locked(path):
            self._write_history(path, key, model.checkpoint())

    def _write_history(self, path: Path, key: ModelKey, state: dict[str, Any]) -> None:
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "kind": "history",
            "host": self.host,
            "plan_hash": key.plan_hash,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **state,
        }
        atomic_write_json(path, payload)

    def update(
        self, key: ModelKey, fn: Callable[[HistoryModel], HistoryModel | None]
    ) -> HistoryModel:
        """Lock, load, let ``fn`` change the model (in place, or return a new one), write.

        Holding the lock across the read-modify-write is what lets concurrent processes merge
        their samples. Returns the model as written.
        """
        path = self.path(key)
        with self._locked(path):
            model = self._load_history_locked(key)
            replaced = fn(model)
            if replaced is not None:
                if (replaced.part, replaced.arch) != (key.part, key.arch):
                    raise ValueError(
                        f"update of {key.filename} returned the model of part {replaced.part} "
                        f"on {replaced.arch}"
                    )
                model = replaced
            self._write_history(path, key, model.to_dict())
            return model

    def commit(self, plan_hash: str, model: HistoryModel) -> HistoryModel:
        """Merge ``model``'s unsaved samples into the store and refresh ``model`` from it.

        The samples are replayed on the on-disk state with StarPU's rules, so samples other
        processes committed meanwhile are kept and counted in the statistics. Afterwards
        ``model`` predicts from everything known (its own samples and theirs). Returns the
        merged on-disk model.
        """
        pending = model.take_unsaved()
        key = ModelKey(plan_hash, model.part, model.arch)
        try:
            merged = self.update(key, lambda disk: disk.replay(pending))
        except BaseException:
            # Nothing was written: give the samples back so a later commit can retry.
            model.restore_unsaved(pending)
            raise
        model.sync_from(merged)
        return merged

    def plan_hashes(self) -> builtins.list[str]:
        """Plans with stored models on this host."""
        base = self.root / "perfmodels" / self.host
        if not base.is_dir():
            return []
        return sorted(p.name for p in base.iterdir() if p.is_dir() and _NAME_RE.match(p.name))

    def rows(self, plan_hash: str) -> builtins.list[PerfRow]:
        """Display rows for every model of a plan (see :meth:`HistoryModel.rows`)."""
        out: builtins.list[PerfRow] = []
        for key in self.list(plan_hash):
            out.extend(self.load(key.plan_hash, key.part, key.arch).rows())
        return out

    # -- bus model -------------------------------------------------------------------------

    def load_bus(self) -> BusModel:
        """This host's bus model, or an empty one (predicts 0) if none is usable."""
        path = self.bus_path()
        try:
            data = self._read(path, "bus")
            return BusModel() if data is None else BusModel.from_dict(data)
        except (_Unusable, ValueError):
            pass
        with self._locked(path):
            try:
                data = self._read(path, "bus")
                return BusModel() if data is None else BusModel.from_dict(data)
            except (_Unusable, ValueError) as exc:
                self._quarantine(path, str(exc))
                return BusModel()

    def save_bus(self, bus: BusModel) -> None:
        """Store this host's bus model (a calibration replaces the previous one)."""
        path = self.bus_path()
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "kind": "bus",
            "host": self.host,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **bus.to_dict(),
        }
        with self._locked(path):
            atomic_write_json(path, payload)

    # Defined last: inside the class body ``list`` is this method, hence ``builtins.list``.
    def list(self, plan_hash: str) -> builtins.list[ModelKey]:
        """The (part, arch) models stored for a plan on this host, sorted."""
        folder = self.plan_dir(plan_hash)
        if not folder.is_dir():
            return []
        keys = []
        for p in folder.iterdir():
            m = _MODEL_FILE_RE.match(p.name)
            if m and p.is_file():
                keys.append(ModelKey(plan_hash, int(m.group(1)), m.group(2)))
        return sorted(keys)


def _check_host(host: str) -> str:
    if not isinstance(host, str) or not re.match(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$", host):
        raise ValueError(f"host must be a file-name-safe string, got {host!r}")
    return host
