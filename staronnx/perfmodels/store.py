"""Where performance models live on disk, and how processes share them safely.

Under ``$STARONNX_HOME`` (else ``~/.cache/staronnx``)::

    perfmodels/<host>/<plan_hash>/part<k>.<arch>.json   one history model
    perfmodels/<host>/<plan_hash>/host.json             its host costs, per worker layout
    bus/<host>.json                                       the host's bus model

Per host (``$STARONNX_HOSTNAME`` overrides it) and per plan hash, because times say nothing
about another machine or another cut. A serving process, a calibration and a benchmark may
share a store, so: writes are atomic; :meth:`PerfModelStore.update` locks the file and
:meth:`PerfModelStore.commit` *replays* unsaved samples into what is on disk, so concurrent
writers add up (StarPU's last writer wins); a corrupt file reads as empty with one warning, and
only writers set it aside (``<name>.corrupt-<timestamp>``); a read-only home is read without
locks, and writing to it raises :class:`PerfModelStoreReadOnly` in one line.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
import os
import re
import shlex
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from filelock import FileLock

from staronnx.errors import StaronnxError
from staronnx.fsutil import atomic_write_text
from staronnx.perfmodels.bus import BusModel
from staronnx.perfmodels.helpcost import HelpCost
from staronnx.perfmodels.host import HostModel, layout_key
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
    """A model file could not be used: ignored by readers, moved aside by the next writer."""


class PerfModelStoreReadOnly(StaronnxError):
    """The store's folder cannot be written (read-only file system, no permission)."""


class PerfModelStoreReadOnlyWarning(UserWarning):
    """Serving could not save what it learnt (read-only home): kept in memory only."""


#: errnos that mean "this folder cannot be written", as opposed to a failing disk
_READ_ONLY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR})

_T = TypeVar("_T")
_warned: set[str] = set()
_warned_lock = threading.Lock()


def _read_or_warn(path: Path, read: Callable[[], _T | None], errors: tuple[type[Exception], ...],
                  message: Callable[[Exception], str]) -> _T | None:
    """``read()``'s model of ``path``, or None where it fails with ``errors``: then a warning
    ``message(error)``, once per process and damaged file (a serving process reads the same file
    again and again, and one line says it)."""
    try:
        return read()
    except errors as exc:
        key = _file_id(path)
        with _warned_lock:
            if key in _warned:
                return None
            _warned.add(key)
        warnings.warn(message(exc), PerfModelCorruptWarning, stacklevel=4)
        return None


def _parsed(data: dict[str, Any] | None, parse: Callable[[dict[str, Any]], _T]) -> _T | None:
    return None if data is None else parse(data)


def _file_id(path: Path) -> str:
    """A file's identity for warn-once: a file damaged again later is warned about again."""
    try:
        st = path.stat()
        return f"{path}|{st.st_size}|{st.st_mtime_ns}"
    except OSError:
        return str(path)


@contextlib.contextmanager
def _writing(root: Path) -> Iterator[None]:
    """Turn "cannot write here" OS errors into :class:`PerfModelStoreReadOnly`."""
    try:
        yield
    except PerfModelStoreReadOnly:
        raise
    except OSError as exc:
        if exc.errno not in _READ_ONLY_ERRNOS:
            raise
        raise PerfModelStoreReadOnly(
            f"cannot write performance models under {root} ({exc.strerror or exc}); "
            "set STARONNX_HOME to a writable folder",
        ) from None


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
        return self.plan_dir(key.plan_hash) / key.filename

    def bus_path(self) -> Path:
        """The JSON file of this host's bus model."""
        return self.root / "bus" / f"{self.host}.json"

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        """Hold ``path``'s lock for a read-modify-write (writers only: it creates files)."""
        with _writing(self.root):
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(path) + ".lock", timeout=self.lock_timeout)
            lock.acquire()
        try:
            with _writing(self.root):
                yield
        finally:
            lock.release()

    def check_writable(self) -> None:
        """Raise :class:`PerfModelStoreReadOnly` unless models can be written here.

        Calibration calls it before measuring: minutes of measurements that cannot be kept
        are worth one line up front. A probe file is created and removed (``os.access`` says
        yes to root on a read-only mount).
        """
        with _writing(self.root):
            self.root.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=self.root)
            os.close(fd)
            os.unlink(probe)

    # -- reading with recovery -------------------------------------------------------------

    def _read(self, path: Path, kind: str) -> dict[str, Any] | None:
        """The file's JSON object, ``None`` if absent; raises ``_Unusable`` if unusable."""
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
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

    def _read_history(self, key: ModelKey) -> HistoryModel | None:
        """The stored model, None if absent; raises ``_Unusable``/``PerfModelFormatError``."""
        data = self._read(self.path(key), "history")
        if data is None:
            return None
        model = HistoryModel.from_dict(data, **self._model_options)
        if (model.part, model.arch) != (key.part, key.arch):
            raise _Unusable(f"the model of part {model.part} on {model.arch}")
        return model

    def _load_history_locked(self, key: ModelKey) -> HistoryModel:
        """For writers, under the lock: an unusable file is set aside before it is replaced."""
        path = self.path(key)
        try:
            model = self._read_history(key)
            if model is not None:
                return model
        except (_Unusable, PerfModelFormatError) as exc:
            self._quarantine(path, str(exc))
        return HistoryModel(key.part, key.arch, **self._model_options)

    # -- history models --------------------------------------------------------------------

    def load(self, plan_hash: str, part: int, arch: str) -> HistoryModel:
        """The stored model, or an empty one (missing, or unusable: a warning says so).

        A read changes nothing on disk and takes no lock (writes are atomic, so a good file
        is read whole): it works from a read-only home, and a reader never moves a file a
        writer may be about to fix. The next writer sets an unusable file aside.
        """
        key = ModelKey(plan_hash, part, arch)
        path = self.path(key)
        model = _read_or_warn(path, lambda: self._read_history(key), (_Unusable, PerfModelFormatError),
                              lambda exc: f"performance model {path} is {exc}; ignored (it will be recalibrated, "
                              "and set aside by the next calibration)")
        return model if model is not None else HistoryModel(part, arch, **self._model_options)

    def save(self, plan_hash: str, model: HistoryModel) -> None:
        """Overwrite the stored model with ``model`` (discarding what was there).

        This is StarPU's ``STARPU_CALIBRATE=2``; to add samples use :meth:`commit`.
        """
        key = ModelKey(plan_hash, model.part, model.arch)
        path = self.path(key)
        with self._locked(path):
            self._load_history_locked(key)  # an unusable file is set aside, not overwritten
            atomic_write_json(path, self._payload("history", model.checkpoint(), key.plan_hash))

    def save_measured(self, plan_hash: str, model: HistoryModel) -> HistoryModel:
        """Overwrite, in the stored model, the footprints ``model`` has, keeping the stored
        entries of every other one (:meth:`HistoryModel.overwrite`); returns the model written.

        For a replacing calibration (``calibrate --replace``), whole or cut short: :meth:`save`
        would drop the batch sizes it was not asked about or had not reached yet, calibrated
        minutes of measurement that nothing replaced.
        """
        key = ModelKey(plan_hash, model.part, model.arch)
        return self.update(key, lambda disk: disk.overwrite(model))

    def _payload(self, kind: str, body: dict[str, Any], plan_hash: str | None = None) -> dict[str, Any]:
        """A file of this store: the header every kind shares, then ``body``."""
        head: dict[str, Any] = {"format": FORMAT, "version": VERSION, "kind": kind, "host": self.host}
        if plan_hash is not None:
            head["plan_hash"] = plan_hash
        return {**head, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **body}

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
            atomic_write_json(path, self._payload("history", model.to_dict(), key.plan_hash))
            return model

    def commit(self, plan_hash: str, model: HistoryModel) -> HistoryModel:
        """Merge ``model``'s unsaved samples into the store and refresh ``model`` from it.

        The samples are replayed on the on-disk state with StarPU's rules, so samples other
        processes committed meanwhile are kept and counted in the statistics. Afterwards
        ``model`` predicts from everything known (its own samples and theirs). Returns the
        merged on-disk model.
        """
        pending = model.take_unsaved()
        baseline = model.baseline()
        key = ModelKey(plan_hash, model.part, model.arch)
        try:
            merged = self.update(key, lambda disk: disk.replay(pending, baseline))
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
        """This host's bus model, or an empty one (predicts 0) if none is usable (a reader:
        an unusable file gets a warning and is left for the next :meth:`save_bus`)."""
        path = self.bus_path()
        bus = _read_or_warn(path, lambda: _parsed(self._read(path, "bus"), BusModel.from_dict), (_Unusable, ValueError),
                            lambda exc: f"bus model {path} is {exc}; ignored (it will be recalibrated)")
        return bus if bus is not None else BusModel()

    def save_bus(self, bus: BusModel) -> None:
        """Store this host's bus model (a calibration replaces the previous one)."""
        path = self.bus_path()
        payload = self._payload("bus", bus.to_dict())
        with self._locked(path):
            try:
                _parsed(self._read(path, "bus"), BusModel.from_dict)
            except (_Unusable, ValueError) as exc:
                self._quarantine(path, str(exc))  # keep the evidence the new model replaces
            atomic_write_json(path, payload)

    # -- what CPU help costs the GPU -----------------------------------------------------

    def help_cost_path(self) -> Path:
        """The JSON file of this host's :class:`~staronnx.perfmodels.helpcost.HelpCost`: a
        property of the host (its cores, its GIL-bound driver threads), not of a plan."""
        return self.root / "helpcost" / f"{self.host}.json"

    def load_help_cost(self) -> HelpCost | None:
        """This host's measured help cost, or None if none is stored or usable (the policies
        then charge the default, :class:`HelpCost`'s)."""
        path = self.help_cost_path()
        return _read_or_warn(path, lambda: _parsed(self._read(path, "helpcost"), HelpCost.from_dict),
                             (_Unusable, ValueError, TypeError),
                             lambda exc: f"help cost {path} is {exc}; ignored (the default is charged)")

    def save_help_cost(self, cost: HelpCost) -> None:
        """Store this host's measured help cost (a measurement replaces the previous one)."""
        path = self.help_cost_path()
        with self._locked(path):
            atomic_write_json(path, self._payload("helpcost", cost.as_dict()))

    # -- host costs ------------------------------------------------------------------------

    def host_path(self, plan_hash: str) -> Path:
        """The JSON file of a plan's host costs (:mod:`staronnx.perfmodels.host`)."""
        return self.plan_dir(plan_hash) / "host.json"

    def _read_hosts(self, path: Path) -> dict[str, HostModel]:
        """The host models of a file by layout; raises ``_Unusable`` on a bad file."""
        data = self._read(path, "host")
        if data is None:
            return {}
        try:
            return {k: HostModel.from_dict(v) for k, v in (data.get("layouts") or {}).items()}
        except (TypeError, ValueError, AttributeError) as exc:
            raise _Unusable(f"not a host-cost file ({exc})") from None

    def load_hosts(self, plan_hash: str) -> dict[str, HostModel]:
        """Every host model stored for a plan, by worker layout ({} when none or unusable:
        a warning says so once)."""
        path = self.host_path(plan_hash)
        hosts = _read_or_warn(path, lambda: self._read_hosts(path), (_Unusable,),
                              lambda exc: f"host costs {path} are {exc}; ignored (calibrate again to measure them)")
        return hosts if hosts is not None else {}

    def load_host(self, plan_hash: str, workers: Sequence[str]) -> HostModel | None:
        """The host costs measured on exactly these workers (names, the runtime's order), or
        None."""
        return self.load_hosts(plan_hash).get(layout_key(list(workers)))

    def save_host(self, plan_hash: str, model: HostModel) -> None:
        """Store ``model`` under its layout, keeping the other layouts' (locked, atomic)."""
        path = self.host_path(plan_hash)
        with self._locked(path):
            try:
                models = self._read_hosts(path)
            except _Unusable as exc:
                self._quarantine(path, str(exc))
                models = {}
            models[model.layout] = model
            atomic_write_json(path, self._payload(
                "host", {"layouts": {k: m.as_dict() for k, m in sorted(models.items())}}, plan_hash))

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


class CalibratedWorkers(Protocol):
    """What :func:`calibrate_line` reads of the workers a machine starts (a
    :class:`~staronnx.workers.layout.MachineSpec`, which this layer does not import: the workers
    import the perf models)."""

    @property
    def groups(self) -> str: ...
    @property
    def cuda_streams(self) -> int: ...
    @property
    def cuda_devices(self) -> Sequence[int]: ...
    @property
    def cuda_graphs(self) -> bool: ...
    @property
    def thread_per_stream(self) -> bool: ...


def calibrate_line(plandir: str | Path, machine: CalibratedWorkers, *, devices: Sequence[int] | None = None,
                   batch_sizes: Sequence[int] = (), replace: bool = False) -> str:
    """The ``staronnx calibrate`` line that measures the workers ``machine`` starts (what a
    warning or a stale-model note tells the user to run): its groups, CUDA streams and GPUs
    (``devices``: those of them calibrate can reach, default all), and the CUDA worker flags
    that change them: a driver thread per stream holds a core back per stream (the CPU groups'
    arch), and graphs change the times measured."""
    line = calibrate_command(plandir, machine.groups, machine.cuda_streams,
                             machine.cuda_devices if devices is None else devices, batch_sizes)
    if machine.cuda_streams:
        line += (" --no-cuda-graphs" if not machine.cuda_graphs else "") + (
            " --cuda-thread-per-stream" if machine.thread_per_stream else "")
    return line + (" --replace" if replace else "")


def calibrate_command(plandir: str | Path, groups: str, cuda_streams: int = 0, cuda_devices: Sequence[int] = (0,),
                      batch_sizes: Sequence[int] = (), replace: bool = False) -> str:
    """The ``staronnx calibrate`` line that fills the perf models of workers started with these
    settings (what a warning or a stale-model note tells the user to run): the GPUs named,
    since each GPU has perf models of its own."""
    cmd = f"staronnx calibrate {shlex.quote(str(plandir))} --groups {shlex.quote(groups)}"
    if batch_sizes:
        cmd += f" --batch-sizes {','.join(str(b) for b in sorted(batch_sizes))}"
    if cuda_streams:
        cmd += f" --cuda-streams {cuda_streams}"
        if tuple(cuda_devices) != (0,):
            cmd += f" --cuda-devices {','.join(map(str, cuda_devices))}"
    return cmd + (" --replace" if replace else "")
