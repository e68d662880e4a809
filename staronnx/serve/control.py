"""Model control (Triton's ``--model-control-mode``): which repository models are served, changed
while the server runs, and the repository index that says so.

* ``none``: every model of the repositories is loaded at start and stays; load and unload
  requests are refused.
* ``explicit``: the models named by ``--load-model`` (``*``: all) are loaded at start; clients
  load (with an optional config override, Triton's JSON form of the config), reload and unload
  models through the repository API, over HTTP and gRPC. As in Triton, loading an ensemble loads
  its members not served yet, and (re)loading a member reloads the served ensembles built on it.
* ``poll``: every model is loaded at start, and the repositories are read again every
  ``--repository-poll-secs``: a new model is loaded, one whose folder changed (its config, a
  version; for an ensemble, a member's folder too) is reloaded, one whose folder is gone is unloaded; load and unload requests are
  refused, as Triton does in this mode.

Loading never disturbs the other models' requests: the model is made (its plan cut or read from
the cache, its sessions created) on a worker thread, then swapped in; the version it replaces
keeps answering until then and drains what it accepted afterwards. An unload takes the model out
of service at once (new requests are refused, naming it unloaded) and drains its accepted
requests. A load that fails leaves the model as it was (a served version stays served) and
answers with the reason, in Triton's words (``failed to load 'NAME': ...``).

Models served from plan folders given on the command line are outside model control: listed in
the index, never loaded or unloaded by a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from staronnx.errors import StaronnxError
from staronnx.serve.models import ModelEndpoint
from staronnx.serve.protocol import ProtocolError, shown

log = logging.getLogger("staronnx.serve")

MODES = ("none", "poll", "explicit")

#: why a repository model that is not served is not: never loaded, or unloaded
NOT_LOADED = "not loaded (explicit model control: load it through the repository API)"
UNLOADED = "unloaded"

#: one file of a model folder as poll mode compares it: (path in the folder, size, mtime in ns)
FileStamp = tuple[str, int, int]
#: a model's folders (its own, and an ensemble's members'): (folder name, its files' stamps) each
ModelStamp = tuple[tuple[str, tuple[FileStamp, ...]], ...]

#: builds a served model from its repository folder (blocking: cuts or reads its plan, creates
#: its sessions) with an optional config override; raises StaronnxError with the reason
Opener = Callable[[str, Path, "str | None"], ModelEndpoint]


class ModelControl:
    """The served models (``models``, read by both front ends), the repository models that are
    not served and why (``unavailable``), and the loads and unloads that change them."""

    def __init__(self, mode: str, repositories: Sequence[Path], opener: Opener | None,
                 models: dict[str, ModelEndpoint], unavailable: dict[str, str], fixed: Sequence[str] = (),
                 drain_timeout: float = 30.0) -> None:
        if mode not in MODES:
            raise StaronnxError(f"--model-control-mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.repositories = list(repositories)
        self.opener = opener
        self.models = models
        self.unavailable = unavailable
        #: models served from plan folders: listed, never loaded or unloaded by a request
        self.fixed = set(fixed)
        self.drain_timeout = drain_timeout
        #: one load or unload at a time (a reload must not race another of the same model)
        self._lock = asyncio.Lock()
        #: each repository model's folder state when it was loaded (what poll mode compares)
        self.stamps: dict[str, ModelStamp] = {}
        #: the config override a model was loaded with (what reloading it for a member keeps)
        self.overrides: dict[str, str | None] = {}

    # -- the repository ----------------------------------------------------------------------
    def read_folders(self) -> dict[str, Path]:
        """Every model folder of the repositories now; StaronnxError where they cannot be read (a
        model name in two of them, a repository gone): each caller says what that means to it."""
        from staronnx.serve.repository import scan

        return dict(scan(self.repositories))

    def folders(self) -> dict[str, Path]:
        """Every model folder of the repositories now (a repository that cannot be read: none)."""
        try:
            return self.read_folders()
        except StaronnxError as exc:
            log.warning("cannot read the model repository: %s", exc)
            return {}

    def index(self, ready: Callable[[ModelEndpoint], bool]) -> list[dict[str, str]]:
        """Triton's repository index: every model served or in a repository, its version, state
        and reason (READY, or UNAVAILABLE and why)."""
        listed = [{"name": n, "version": "", "state": "UNAVAILABLE", "reason": self.unavailable.get(n, NOT_LOADED)}
                  for n in sorted({*self.folders(), *self.unavailable}) if n not in self.models]
        for name, model in self.models.items():
            ok = ready(model)
            listed += [{"name": name, "version": v, "state": "READY" if ok else "UNAVAILABLE",
                        "reason": "" if ok else "the server is shutting down"} for v in model.versions]
        return sorted(listed, key=lambda e: (e["name"], -int(e["version"]) if e["version"].isdigit() else 0))

    # -- requests --------------------------------------------------------------------------
    def _check_allowed(self, name: str, action: str) -> None:
        if self.mode != "explicit" or self.opener is None:
            how = ("the repository is polled (--model-control-mode poll): change its folders instead"
                   if self.mode == "poll" else
                   "model control is off (--model-control-mode none): start the server with "
                   "--model-control-mode explicit to load and unload models")
            raise ProtocolError("refused", f"cannot {action} model {shown(name)}: {how}")
        if name in self.fixed:
            raise ProtocolError("refused", f"cannot {action} model {shown(name)}: it is served from a plan folder "
                                           "given on the command line, outside model control")

    async def load(self, name: str, config: str | None = None, files: Mapping[str, Any] | None = None) -> None:
        """Load (or reload) model ``name`` from the repository, ``config`` (JSON) over its
        config.pbtxt; refused in Triton's words where it cannot be."""
        self._check_allowed(name, "load")
        if files:
            raise ProtocolError("internal", f"failed to load {shown(name)}: failed to poll from model repository: "
                                            "model files sent with a load request are not supported by staronnx "
                                            "serve; put the model in the repository and load it by name")
        async with self._lock:
            await self._load(name, config)

    async def _load(self, name: str, config: str | None, dependents: bool = True) -> None:
        """Open ``name`` and swap it in. In explicit mode, as Triton's does: an ensemble's members
        not served yet are loaded first (a step-by-step ensemble sends its steps to them, and
        Triton serves an ensemble's composing models with it), and the served ensembles built on
        ``name`` are reloaded after it (one composed as a task graph holds its members' plans as
        they were when it was loaded) unless ``dependents`` is False (they are being reloaded)."""
        try:
            folders = self.read_folders()
        except StaronnxError as exc:  # why, rather than "no model of that name" (folders() reads none)
            raise ProtocolError("invalid", f"failed to load {shown(name)}: {exc}") from None
        folder = folders.get(name)
        if folder is None:
            raise ProtocolError("invalid", f"failed to load {shown(name)}: no model of that name in the repository "
                                           f"({', '.join(map(str, self.repositories))})")
        assert self.opener is not None
        loop = asyncio.get_running_loop()
        if self.mode == "explicit":
            for member in members_of(folder, folders):
                if member not in self.models and member != name:
                    try:
                        await self._load(member, None, dependents=False)
                    except ProtocolError as exc:
                        raise ProtocolError(exc.kind, f"failed to load {shown(name)}: its step {shown(member)} cannot "
                                                      f"be served: {exc}") from None
        stamp = model_stamp(folder, folders)
        try:
            endpoint = await loop.run_in_executor(None, self.opener, name, folder, config)
        except StaronnxError as exc:
            if name not in self.models:
                self.unavailable[name] = str(exc)
            raise ProtocolError("invalid", f"failed to load {shown(name)}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a bug or an unforeseen error fails this load only
            # not a reason the loader gave: logged with its traceback, and the load fails with it
            # (in poll mode an error escaping here ended the whole poll, every time, silently)
            log.exception("loading model %s failed unexpectedly", shown(name))
            why = f"{type(exc).__name__}: {exc}"
            if name not in self.models:
                self.unavailable[name] = why
            raise ProtocolError("internal", f"failed to load {shown(name)}: {why}") from None
        old = self.models.get(name)
        self.models[name] = endpoint  # from now on its requests go to the new one
        self.unavailable.pop(name, None)
        self.stamps[name] = stamp
        self.overrides[name] = config
        if old is not None:  # the old one answers what it accepted, then frees its runtime
            old.retire("reloaded (its sequences do not carry over to the new one)")
            await loop.run_in_executor(None, old.close, self.drain_timeout)
        if dependents and self.mode == "explicit":
            # every served ensemble whose folders (its own, its members', nested) include this one
            for ensemble_name in [n for n, st in self.stamps.items()
                                  if n != name and n in self.models and any(f == folder.name for f, _ in st)]:
                try:
                    await self._load(ensemble_name, self.overrides.get(ensemble_name), dependents=False)
                except ProtocolError as exc:  # it keeps serving as it was loaded; said, as a failed load is
                    log.warning("reloading ensemble %s for its member %s: %s", shown(ensemble_name), shown(name), exc)

    async def unload(self, name: str) -> None:
        """Take model ``name`` out of service and drain its accepted requests."""
        self._check_allowed(name, "unload")
        async with self._lock:
            await self._unload(name)

    async def _unload(self, name: str) -> None:
        model = self.models.pop(name, None)
        if model is None and name not in self.folders() and name not in self.unavailable:
            raise ProtocolError("invalid", f"failed to unload {shown(name)}: no model of that name is served or "
                                           "in the repository")
        self.unavailable[name] = UNLOADED
        if model is None:
            return  # already not served: Triton answers an unload of an unloaded model with success
        self.stamps.pop(name, None)
        self.overrides.pop(name, None)
        model.retire(UNLOADED)
        await asyncio.get_running_loop().run_in_executor(None, model.close, self.drain_timeout)

    # -- poll mode ---------------------------------------------------------------------------
    async def poll_forever(self, every: float) -> None:
        """Poll mode: read the repositories again every ``every`` seconds (:meth:`poll`)."""
        while True:
            await asyncio.sleep(every)
            try:
                await self.poll()
            except Exception:  # noqa: BLE001 - a bad poll must not end polling, nor pass unseen
                log.exception("reading the model repository failed; the next poll tries again")

    async def poll(self) -> None:
        """Load new models, reload changed ones, unload the ones whose folder is gone."""
        async with self._lock:
            try:
                folders = self.read_folders()
            except StaronnxError as exc:  # not "no models": that would unload every model it serves
                log.warning("cannot read the model repository: %s", exc)
                return
            for name, folder in folders.items():
                if name in self.fixed:
                    continue
                try:
                    stamp = model_stamp(folder, folders)
                except Exception:  # noqa: BLE001 - one folder that cannot be read leaves the others polled
                    log.exception("cannot read the folder of model %s", shown(name))
                    continue
                if self.stamps.get(name) == stamp:
                    continue  # loaded, or failed before, and nothing changed since
                try:
                    await self._load(name, None)
                except ProtocolError as exc:
                    self.stamps[name] = stamp  # not tried again until the folder changes
                    log.warning("%s", exc)
            for name in [n for n in self.models if n not in folders and n not in self.fixed]:
                await self._unload(name)
                self.unavailable.pop(name, None)
            for name in [n for n in self.unavailable if n not in folders and n not in self.fixed]:
                del self.unavailable[name]  # one that failed to load: its folder is gone, so is its entry
                self.stamps.pop(name, None)


def folder_stamp(folder: Path) -> tuple[FileStamp, ...]:
    """What poll mode compares to tell a model's folder changed: each file's path, size and
    modification time, down to the version folders' contents."""
    stamp = []
    for path in sorted(folder.rglob("*")):
        with contextlib.suppress(OSError):
            info = path.stat()
            stamp.append((str(path.relative_to(folder)), info.st_size, info.st_mtime_ns))
    return tuple(stamp)


def members_of(folder: Path, folders: Mapping[str, Path]) -> list[str]:
    """The models an ensemble's steps name that the repository holds, in step order, each once
    (none for a model that is no ensemble, or whose config cannot be read: its load says why)."""
    from staronnx.serve import ensemble
    from staronnx.serve.model_config import ConfigError, read_config

    try:
        config = read_config(folder)[0]
    except ConfigError:
        return []
    if not ensemble.is_ensemble(config):
        return []
    return list(dict.fromkeys(s.model_name for s in config.ensemble_scheduling.step if s.model_name in folders))


def model_stamp(folder: Path, folders: Mapping[str, Path]) -> ModelStamp:
    """:func:`folder_stamp`, and for an ensemble its members' folders' too (through nested
    ensembles, each folder once): an ensemble's plan is composed from its members' files, so a
    member's new version or config reloads the ensemble as well as the member."""
    stamp: list[tuple[str, tuple[FileStamp, ...]]] = []
    seen: set[Path] = set()
    todo = [folder]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        stamp.append((current.name, folder_stamp(current)))
        todo += [folders[m] for m in members_of(current, folders)]
    return tuple(stamp)
