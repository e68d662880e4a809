"""One copy of each part's weights per NUMA node, however many CPU sessions use them.

Each CPU group has its own session per part, and a plain session keeps a private copy of the
weights (40 MiB MatMul weight, PSS for 1 -> 4 sessions: 48 -> 180 MiB). Sharing one OrtValue
(``add_initializer``) does not help, as MatMul keeps its own prepacked copy (175 MiB);
``disable_prepacking`` does (55 MiB) but runs MatMul up to 3x slower, and
``PrepackedWeightsContainer`` is not in the Python API. So, once per (part, NUMA node), a
throw-away session saves the optimised part with its prepacked weights in a page-aligned
external data file (``save_external_prepacked_constant_initializers``) that every session then
memory-maps: one copy in the page cache (46 -> 47 MiB), at the same speed.

Measure with PSS or ``RssAnon`` (:func:`process_memory`): ``VmRSS`` counts a file page once per
mapping. The optimised model is specific to this CPU and ORT version, so the default cache is a
private folder deleted at exit. Pages land on the node of the thread that writes them, so the
worker thread writes its node's copy after pinning. When the save fails (an operator ORT cannot
serialise, a read-only disk) the worker says so and falls back to a plain session.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
import uuid
from pathlib import Path

import onnxruntime as ort

from staronnx.perfmodels.store import default_root

__all__ = ["SharedWeights", "default_shared_weights", "process_memory"]

_MODEL = "model.onnx"
_DATA = "model.onnx.data"


def process_memory() -> dict[str, int]:
    """This process's memory in bytes: ``rss`` (VmRSS), ``rss_anon``, ``rss_file``, ``pss``.

    ``pss`` is the one to compare when pages are shared (mapped weights): each shared page is
    divided among the mappings that use it.  psutil is not a dependency, so /proc is read
    directly (Linux only; missing keys are 0 elsewhere).
    """
    out = {"rss": 0, "rss_anon": 0, "rss_file": 0, "pss": 0}
    files = {"/proc/self/status": {"VmRSS:": "rss", "RssAnon:": "rss_anon", "RssFile:": "rss_file"},
             "/proc/self/smaps_rollup": {"Pss:": "pss"}}
    with contextlib.suppress(OSError):
        for path, keys in files.items():
            with open(path, encoding="ascii") as f:
                for parts in map(str.split, f):
                    if parts and parts[0] in keys:
                        out[keys[parts[0]]] = int(parts[1]) * 1024
    return out


class SharedWeights:
    """Cache of optimised parts whose weights live in a memory-mapped external data file.

    ``root=None`` makes a private folder under ``$STARONNX_HOME/weights`` (default
    ``~/.cache/staronnx/weights``; a disk, not a tmpfs, so the unused original weights in the
    data file cost no RAM) that is removed when the process exits; folders left by processes
    that died are removed the next time.  Thread-safe: two workers asking for the same part and
    NUMA node get the same file, built once.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *, min_bytes: int = 1024) -> None:
        self.min_bytes = min_bytes
        self._owned = root is None
        self._root_arg = Path(root) if root is not None else None
        self._root: Path | None = None
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}

    @property
    def root(self) -> Path:
        """The cache folder (created on first use)."""
        with self._lock:
            if self._root is None:
                self._root = self._make_root()
            return self._root

    def model_for(self, part: str | os.PathLike[str], numa: int | None) -> Path:
        """Path of the optimised copy of ``part`` for NUMA node ``numa``, built if needed.

        Call it from the thread that will use the weights (pinned, memory-bound), so that the
        data file's pages are allocated on its NUMA node.  Raises whatever ORT raises when the
        part cannot be optimised and saved; callers fall back to the original file.
        """
        src = Path(part).resolve()
        st = src.stat()
        ident = f"{src}|{st.st_size}|{st.st_mtime_ns}|{ort.__version__}"
        key = hashlib.sha256(ident.encode()).hexdigest()[:16]
        final = self.root / f"{src.stem}-{key}" / f"numa{'-' if numa is None else numa}"
        with self._lock:
            key_lock = self._key_locks.setdefault(str(final), threading.Lock())
        with key_lock:
            if (final / _MODEL).is_file():
                return final / _MODEL
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = final.parent / f".tmp-{uuid.uuid4().hex}"
            tmp.mkdir()
            try:
                self._optimise(src, tmp / _MODEL)
                try:
                    os.rename(tmp, final)  # atomic: another process may have won the race
                except OSError:
                    if not (final / _MODEL).is_file():
                        raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return final / _MODEL

    def _optimise(self, src: Path, dst: Path) -> None:
        so = ort.SessionOptions()
        so.log_severity_level = 3  # ORT warns that the saved model is hardware specific: we know.
        so.intra_op_num_threads = 1
        so.optimized_model_filepath = str(dst)
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", _DATA)
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", str(self.min_bytes)
        )
        so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
        sess = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
        del sess
        if not dst.is_file():
            raise RuntimeError(f"ONNX Runtime did not write the optimised model {dst}")

    def close(self) -> None:
        """Remove the cache folder if this object created it (open sessions keep their maps)."""
        with self._lock:
            if self._owned and self._root is not None:
                shutil.rmtree(self._root, ignore_errors=True)
                if self._root.parent.name == "staronnx-weights":  # the /tmp fallback: no trace
                    with contextlib.suppress(OSError):  # another process's folder is still there
                        self._root.parent.rmdir()
                self._root = None

    def _make_root(self) -> Path:
        if self._root_arg is not None:
            self._root_arg.mkdir(parents=True, exist_ok=True)
            return self._root_arg
        base = default_root() / "weights"
        try:
            base.mkdir(parents=True, exist_ok=True)
            root = Path(tempfile.mkdtemp(prefix=f"pid{os.getpid()}-", dir=base))
        except OSError:  # a read-only home (or weights/ left by another user): use /tmp
            base = Path(tempfile.gettempdir()) / "staronnx-weights"
            base.mkdir(parents=True, exist_ok=True)
            root = Path(tempfile.mkdtemp(prefix=f"pid{os.getpid()}-", dir=base))
        _remove_dead(base)
        atexit.register(self.close)
        return root


def _remove_dead(base: Path) -> None:
    """Remove cache folders of processes that no longer exist (crashed, killed)."""
    for d in base.glob("pid*-*"):
        pid = d.name[3:].split("-", 1)[0]
        if not pid.isdecimal() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass  # exists but not ours (EPERM): leave it


_default = SharedWeights()  # (its folder is made on first use)


def default_shared_weights() -> SharedWeights:
    """The process-wide cache every CPU worker uses unless given its own."""
    return _default
