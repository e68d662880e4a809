"""Atomic file writes: readers see the old file or the new one, never half of one.

Plans, perf models, sweep results and traces are all written this way, so an interrupted
command (Ctrl-C, a crash, a full disk) leaves what was there intact. ``mkstemp`` creates its
temporary file with mode 0600; the file that replaces the target gets the target's mode when
it exists, else the mode a plain ``open()`` would give (0666 less the umask), so a plan or a
perf model written by one user stays readable by the group that serves it.

Nothing survives SIGKILL, so every temporary is named after its owner,
``.NAME.tmp-<pid>-<random>`` (a file gets ``.tmp`` at the end too), and the next writer of
``NAME`` removes the temporaries whose owner is gone (:func:`remove_stale_temporaries`). A
temporary whose pid is alive is never touched: it may be a concurrent run's. The pid is
checked on this host, so two hosts writing into one shared folder each leave the other's
temporaries alone only while their pids differ; a pid the kernel has since given to a
younger process is recognised by that process's start time.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

#: a staging folder holds this file from its first moment, so a sweep of a folder only ever
#: removes staging folders staronnx made (or empty ones)
STAGING_MARKER = ".staronnx-staging"

_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>[0-9]+)-[A-Za-z0-9_]+(?:\.tmp)?$")
_PLAN_FILE = re.compile(r"^(?:part[0-9]+\.onnx(?:\.data)?|plan\.json)$")
_BACKUP = re.compile(r"^\.(?P<name>.+)\.old-(?P<pid>[0-9]+)$")


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask() sets it)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _mode_for(path: Path) -> int:
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        return 0o666 & ~_umask()


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same folder, then rename."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder, then rename."""
    with atomic_writer(path) as fh:
        fh.write(data)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A file to write ``path``'s new content into (readable too, as a zip writer needs): a
    temporary file in the same folder, given ``path``'s mode, synced and renamed into place when
    the block ends, removed if it raises; the rename itself persisted where the folder can be
    opened. What a reader of ``path`` sees is the old file or the whole new one, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = _mode_for(path)
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w+b") as fh:
            yield fh
            fh.flush()
            os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # persist the rename itself; not every platform can open a directory
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def save_figure(fig: Any, path: str | os.PathLike[str], dpi: int = 120) -> Path:
    """A matplotlib figure as a PNG, written atomically (a viewer never opens half a plot), then
    closed (pyplot keeps every open figure alive)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, dpi=dpi, format="png")
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())
    return Path(path)


def check_writable(path: str | os.PathLike[str], option: str, *, folder: bool = False) -> None:
    """Raise :class:`~staronnx.errors.StaronnxError` (one line naming ``option`` and the path)
    unless ``path`` can be written: a file written atomically beside itself, or with ``folder``
    a folder filled in place or staged beside itself. Commands call this before their work
    starts, so an output that cannot be written costs a second, not a profiling or a sweep.

    The test is a real one (a file created and removed in the nearest existing folder), not
    ``os.access``: root passes every permission check but not a read-only mount, an immutable
    folder (``chattr +i``) or a path whose parent is a regular file.
    """
    from staronnx.errors import StaronnxError

    path = Path(path)
    target = path.absolute()
    if folder and target.exists() and not target.is_dir():
        raise StaronnxError(f"cannot write {option} {path}: it is a file, not a folder")
    if not folder and target.is_dir():
        raise StaronnxError(f"cannot write {option} {path}: it is a folder, not a file")
    probes = [path] if folder and target.is_dir() else []
    existing = path.parent  # as the user wrote it, for the message
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise StaronnxError(f"cannot write {option} {path}: {existing} is a file, not a folder")
    probes.append(existing)
    for where in probes:
        try:
            # not named like a temporary or a staging folder: those are other runs' business
            fd, probe = tempfile.mkstemp(prefix=f".{target.name}.probe-{os.getpid()}-", dir=where)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise StaronnxError(
                f"cannot write {option} {path}: {exc.strerror or exc} in {where}"
            ) from None


def written_path(filename: str | os.PathLike[str]) -> Path:
    """The file a user asked for behind one of our temporaries (``.NAME.tmp-<pid>-XXXX`` ->
    ``NAME``), so an error names what the user wrote, not our staging name."""
    path = Path(filename)
    m = _TEMP.match(path.name)
    return path.with_name(m["name"]) if m else path


def temp_prefix(target: str | os.PathLike[str]) -> str:
    """``.NAME.tmp-<pid>-``: the name of this process's temporaries for ``target``."""
    return f".{Path(target).name}.tmp-{os.getpid()}-"


def make_staging_dir(target: str | os.PathLike[str]) -> Path:
    """A new, marked staging folder beside ``target`` (to be renamed onto it when complete),
    after removing the staging folders that dead runs left there."""
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target)
    staging = Path(tempfile.mkdtemp(prefix=temp_prefix(target), dir=target.parent))
    (staging / STAGING_MARKER).touch()
    return staging


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike[str]) -> Iterator[Path]:
    """A staging folder to fill; when the block ends without error its files are fsynced and
    it replaces ``target`` whole (an old ``target`` is moved aside only at the very end), and
    when the block raises it is removed: readers see the old folder or the new one."""
    target = Path(target).absolute()
    staging = make_staging_dir(target)
    try:
        yield staging
        (staging / STAGING_MARKER).unlink()
        for child in staging.iterdir():
            with open(child, "rb") as fh:
                os.fsync(fh.fileno())
        publish_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def publish_dir(staging: Path, directory: Path) -> None:
    """Move a finished staging folder into place; an old folder is replaced only at the end,
    through a ``.NAME.old-<pid>`` backup that :func:`remove_stale_temporaries` restores if the
    run dies between the two renames."""
    directory = directory.absolute()
    if directory.exists():
        backup = directory.with_name(f".{directory.name}.old-{os.getpid()}")
        os.rename(directory, backup)
        try:
            os.rename(staging, directory)
        except BaseException:
            os.rename(backup, directory)
            raise
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.rename(staging, directory)


def remove_stale_temporaries(target: str | os.PathLike[str]) -> list[Path]:
    """Clean up after writers of ``target``'s folder that died; return what was removed.

    - temporary files of ``target`` itself (an atomic write cut short);
    - staging folders of any name in that folder that carry :data:`STAGING_MARKER` or are
      empty (a plan export cut short: up to the model's size);
    - ``.NAME.old-<pid>`` backups of a replaced plan: removed when ``NAME`` exists, renamed
      back onto ``NAME`` when the run died between its two renames (the old plan survives).

    Only entries whose owning pid is gone are touched; errors (a folder that vanished, no
    permission) are skipped, since cleaning is a courtesy and must not stop the write.
    """
    target = Path(target).absolute()
    removed: list[Path] = []
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP.match(entry.name)
        b = _BACKUP.match(entry.name) if m is None else None
        match = m or b
        if match is None or _owner_alive(int(match["pid"]), entry):
            continue
        path = Path(entry.path)
        with contextlib.suppress(OSError):
            if b is not None:
                if b["name"] == target.name and not target.exists() and entry.is_dir(follow_symlinks=False):
                    os.rename(path, target)
                    continue
                if not (path.parent / b["name"]).exists() or not (path / "plan.json").exists():
                    continue
                shutil.rmtree(path)
            elif entry.is_dir(follow_symlinks=False):
                if not _is_staging(path):
                    continue
                shutil.rmtree(path)
            elif m is not None and m["name"] == target.name:
                path.unlink()
            else:
                continue
            removed.append(path)
    return removed


def _is_staging(path: Path) -> bool:
    """A folder staronnx staged: marked, empty, or holding only a plan's files (the marker is
    taken out just before the folder is published)."""
    names = [p.name for p in path.iterdir()]
    return STAGING_MARKER in names or all(_PLAN_FILE.match(n) for n in names)


def _owner_alive(pid: int, entry: os.DirEntry[str]) -> bool:
    """Whether the process that named ``entry`` may still be running (when in doubt: yes)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # another user's process: alive
    try:
        modified = entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return True
    started = _process_start(pid)
    # a process started after the temporary last changed cannot be the one that wrote it
    return started is None or started <= modified + 1.0


def _process_start(pid: int) -> float | None:
    """A process's start time (epoch seconds) from /proc, or None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
