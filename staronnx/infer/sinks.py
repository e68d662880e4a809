"""Where batch inference writes: shards of rows, each written whole or not at all, so a job that
is stopped (Ctrl-C, SIGTERM, a crash, a power cut) resumes from the first shard it did not finish.

An output is a folder::

    DST/_manifest.json          what the job is: model and plan hash, dataset, shard size, format
    DST/part-00000.parquet      rows 0 .. shard_rows-1 (those that ran), with their row ids
    DST/part-00000.errors.json  the rows of that shard that were skipped, and why (only if any)
    DST/part-00001.parquet      ...
    DST/_SUCCESS.json           written last: rows written, rows skipped, time taken

Shard ``k`` holds the rows whose ids lie in ``[k * shard_rows, (k + 1) * shard_rows)``, whatever the
batch size or the dataset's own shards, so a resumed job cuts the same shards as the first. A
shard's error list is written before the shard, and both through a temporary file and a rename:
a shard that exists is complete, with its errors. A single-file output (``out.parquet``,
``out.npz``) is built in ``out.parquet.parts/`` and joined into the file when every shard is done;
the file keeps the job's manifest (Parquet: the schema's metadata; ``.npz``: the zip comment), so a
``--resume`` of the finished job can tell it is done, its parts folder being gone.

Each shard has one row per sample (row-major: an output with the batch on axis 1 is turned so
each row holds its own sample) and a ``row_id`` column, the row's position in the dataset:

- Parquet: a tensor column per output (Arrow's ``fixed_shape_tensor``) where the model fixes the
  sample's shape, a ``struct<data: list, shape: fixed_size_list<int32>>`` where it does not (a
  detector's boxes per image: the storage of Arrow's ``variable_shape_tensor``); streamed in row
  groups as the batches finish, so a shard of any size holds little memory;
- ``.npz``: ``row_id`` and one ``[rows, *sample shape]`` array per output (every row of a shard
  must then have one shape).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from staronnx.errors import InputError, StaronnxError
from staronnx.fsutil import (_mode_for, atomic_write_bytes, atomic_write_text, atomic_writer, remove_stale_temporaries,
                             temp_prefix)
from staronnx.infer.sources import MANIFEST, MANIFEST_KEY, embedded_manifest

try:
    import fcntl
except ImportError:  # not POSIX: jobs on one output are not kept apart
    fcntl = None  # type: ignore[assignment]

SUCCESS = "_SUCCESS.json"
#: the file a job holds locked (flock) in its output folder while it writes, so that a second
#: job on the same output is refused instead of writing beside it (removed when the job ends)
LOCK = ".staronnx-infer.lock"
FORMATS = ("parquet", "npz")
#: the suffixes of a single-file output, and the format each names
SINGLE_FILES = {".parquet": "parquet", ".pq": "parquet", ".npz": "npz"}
ROW_ID = "row_id"
#: outputs the job gathers before it hands them to the writer as a Parquet row group: small, because
#: Arrow's writer holds several times a group's bytes while it encodes it (crnn_ocr over 3,000
#: rows: peak RSS +46 MB with 1 MiB groups, +20 MB with 512 KiB, the same with 256 KiB)
ROW_GROUP_BYTES = 512 << 10
#: the most a zip comment holds (an ``.npz`` output's manifest; a longer one is kept as its digest)
ZIP_COMMENT_BYTES = 0xFFFF


class OutputError(StaronnxError):
    """The output cannot be written as asked (it exists, it belongs to another job, a format
    that cannot hold the rows)."""


def output_format(output: Path, asked: str | None) -> str:
    """``parquet`` or ``npz``: as asked, else from the output's suffix, else Parquet."""
    if asked is not None:
        if asked not in FORMATS:
            raise OutputError(f"--format {asked!r}: choose one of {', '.join(FORMATS)}")
        # a single file is written in its suffix's format: the other under its name opens nowhere
        named = SINGLE_FILES.get(output.suffix.lower())
        if named is not None and named != asked:
            raise OutputError(f"--format {asked} but --output {output} names a {named} file; name the file "
                              f"{output.stem}.{asked}, or leave --format out")
        return asked
    return SINGLE_FILES.get(output.suffix.lower(), "parquet")


def _written_by_a_job(name: str) -> bool:
    """Whether a file of an output folder is one a job writes (or its temporary, ``.NAME.tmp-...``)."""
    if name.startswith(".") and ".tmp-" in name:
        name = name[1:name.index(".tmp-")]
    return name in (MANIFEST, SUCCESS, "_errors.json") or name.startswith("part-")


class ShardSink:
    """A job's output folder: the manifest, the shards already finished, and atomic writes."""

    def __init__(self, output: Path, fmt: str, manifest: Mapping[str, Any], *, resume: bool, overwrite: bool) -> None:
        self.output = output
        self.format = fmt
        self.single = output.suffix.lower() in (".parquet", ".npz", ".pq")
        self.folder = output.with_name(output.name + ".parts") if self.single else output
        self.manifest = dict(manifest)
        self.finished: set[int] = set()
        #: a single-file output this same job already finished (``resume``): nothing is left to run
        self.done = False
        self._lock_fd: int | None = None
        try:
            self._prepare(resume, overwrite)
        except BaseException:
            self.release()
            raise
        if fmt == "parquet":
            # loaded now, not by the first row group: it takes ~0.15 s, which a small model's
            # job would otherwise spend with its workers idle behind the writer
            import pyarrow.parquet  # noqa: F401

    # -- the folder ---------------------------------------------------------------------------
    def _prepare(self, resume: bool, overwrite: bool) -> None:
        # an unfinished job's parts beside the file (an --overwrite of an earlier job's file that
        # stopped, which keeps that file until it is done): the resume carries on with them
        parts = resume and self.single and (self.folder / MANIFEST).is_file()
        if self.single and self.output.is_file() and resume and not overwrite and not parts:
            # the job finished and joined its shards (the parts folder is gone): a resume of it
            # has nothing left to run, as a finished folder's has not, where the file is this job's
            self._check_finished_file()
            self.done = True
            return
        if self.single and self.output.exists() and not overwrite and not parts:
            raise OutputError(f"--output {self.output} exists; --overwrite replaces it")
        if self.single and self.output.is_dir():
            raise OutputError(f"--output {self.output} is a folder; name a file, or a folder without a suffix")
        folder = self.folder
        if folder.exists() and not folder.is_dir():
            raise OutputError(f"--output {folder} is a file; name a folder (or a .parquet/.npz file)")
        folder.mkdir(parents=True, exist_ok=True)
        self._lock()
        # a manifest alone: a job that stopped before its first shard (refused as it started),
        # which left nothing to keep or resume
        existing = any(p.name not in (MANIFEST, LOCK) for p in folder.iterdir())
        if existing and overwrite:
            self._clear()
        elif existing and not resume:
            raise OutputError(f"--output {folder} is not empty; --resume continues the job that wrote it, "
                              "--overwrite starts again")
        elif existing:
            self._check_manifest()
        folder.mkdir(parents=True, exist_ok=True)
        self.finished = set(self._done())
        atomic_write_text(folder / MANIFEST, json.dumps(self.manifest, indent=1, sort_keys=True))
        with contextlib.suppress(FileNotFoundError):
            (folder / SUCCESS).unlink()

    def _lock(self) -> None:
        """Hold the output for this job: a second job on it (another --resume or --overwrite
        while this one runs) wrote its shards beside this one's, or removed them under it, with
        no word; it is refused now, naming why. The lock goes with the process (flock)."""
        if fcntl is None:  # no flock on this platform: nothing to hold
            return
        fd = os.open(self.folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(f"--output {self.output}: another staronnx infer job is writing it now; let it end "
                              "(or stop it), then --resume carries on from its shards") from None
        except OSError:  # a filesystem without locks (some network mounts): the job goes on unguarded
            os.close(fd)
            with contextlib.suppress(OSError):
                (self.folder / LOCK).unlink()
            return
        self._lock_fd = fd

    def release(self) -> None:
        """Let the next job write the output (called as the job ends, finished or not)."""
        if self._lock_fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            (self.folder / LOCK).unlink()
        os.close(self._lock_fd)
        self._lock_fd = None

    def _clear(self) -> None:
        """Remove what an earlier job wrote (only its own files: a folder of other things is refused)."""
        folder = self.folder
        if not (folder / MANIFEST).exists():
            raise OutputError(f"--output {folder} holds files that no staronnx infer wrote; --overwrite replaces "
                              "only an earlier job's output (choose an empty or new folder)")
        for path in folder.iterdir():  # not the folder whole: a file of the user's beside the job's stays
            if _written_by_a_job(path.name) and not path.is_dir():
                path.unlink()
        if self.single and self.output.exists():
            self.output.unlink()

    def _check_manifest(self) -> None:
        path = self.folder / MANIFEST
        try:
            old = json.loads(path.read_text())
        except FileNotFoundError:
            raise OutputError(f"--resume: {self.folder} has no {MANIFEST}; it is not an output of staronnx infer") from None
        except (OSError, ValueError) as exc:
            raise OutputError(f"--resume: {path} is unreadable ({exc})") from None
        self._refuse_another_job(self.folder, old)

    def _refuse_another_job(self, where: Path, old: Mapping[str, Any]) -> None:
        """Raise unless ``old``, the manifest ``where`` keeps, is this job's."""
        new = json.loads(json.dumps(self.manifest))
        if "manifest_sha256" in old:  # a manifest too long for an .npz's comment
            new = {"manifest_sha256": _manifest_digest(self.manifest)}
        changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        if changed:
            raise OutputError(f"--resume: {where} was written by another job (its {', '.join(changed)} differ: "
                              f"e.g. {changed[0]} was {old.get(changed[0])!r}, now {new.get(changed[0])!r}); "
                              "--overwrite starts again")

    def _check_finished_file(self) -> None:
        """Refuse to call the single-file output done unless this job wrote it."""
        old = embedded_manifest(self.output)
        if old is None:
            raise OutputError(f"--resume: {self.output} exists but keeps no manifest of the staronnx infer job that "
                              "wrote it, so it cannot be told finished by this job; --overwrite starts again")
        self._refuse_another_job(self.output, old)

    def _done(self) -> list[int]:
        """The shards already written (a file exists only once it is whole)."""
        suffix = f".{self.format}"
        out = []
        for p in self.folder.iterdir():
            if p.name.startswith("part-") and p.name.endswith(suffix):
                with contextlib.suppress(ValueError):
                    out.append(int(p.name[5:-len(suffix)]))
        return out

    def shard_path(self, index: int) -> Path:
        return self.folder / f"part-{index:05d}.{self.format}"

    def rows_in(self, index: int) -> int:
        """The rows of finished shard ``index``: those it holds and those skipped."""
        path = self.shard_path(index)
        if self.format == "parquet":
            import pyarrow.parquet as pq

            rows = int(pq.read_metadata(path).num_rows)
        else:
            with np.load(path, allow_pickle=False) as npz:
                rows = len(npz[ROW_ID])
        errors = path.with_name(path.name[:-len(path.suffix)] + ".errors.json")
        return rows + (len(json.loads(errors.read_text())) if errors.exists() else 0)

    # -- writing ------------------------------------------------------------------------------
    def open(self, index: int) -> ShardWriter:
        """A writer of shard ``index``, streaming into a temporary file renamed when it closes."""
        writer = ParquetShardWriter if self.format == "parquet" else NpzShardWriter
        return writer(self.shard_path(index), self.manifest.get("outputs", {}))

    def errors(self) -> list[dict[str, Any]]:
        """Every skipped row of every finished shard, in row order."""
        if self.done:  # the shards are joined: their errors are listed beside the file
            path = self.errors_file()
            return list(json.loads(path.read_text())) if path.exists() else []
        out: list[dict[str, Any]] = []
        for path in sorted(self.folder.glob("part-*.errors.json")):
            out.extend(json.loads(path.read_text()))
        return sorted(out, key=lambda e: int(e["row_id"]))

    def rows_done(self) -> int:
        """The rows of a :attr:`done` output: those its file holds and those skipped."""
        if self.format == "parquet":
            import pyarrow.parquet as pq

            rows = int(pq.read_metadata(self.output).num_rows)
        else:
            with np.load(self.output, allow_pickle=False) as npz:
                rows = len(npz[ROW_ID])
        return rows + len(self.errors())

    def errors_file(self) -> Path:
        """Where :meth:`finish` lists every skipped row: ``DST/_errors.json``, or ``out.parquet.errors.json``."""
        return self.output.with_name(self.output.name + ".errors.json") if self.single else self.folder / "_errors.json"

    def finish(self, summary: Mapping[str, Any]) -> Path:
        """Mark the job done, listing every skipped row in :meth:`errors_file`; a single-file
        output is joined from its shards now."""
        errors = self.errors()
        if errors:
            atomic_write_text(self.errors_file(), json.dumps(errors, indent=1))
        else:  # an earlier job's list (out.parquet.errors.json outlives --overwrite) would name rows this one wrote
            with contextlib.suppress(FileNotFoundError):
                self.errors_file().unlink()
        if not self.single:
            atomic_write_text(self.folder / SUCCESS, json.dumps(dict(summary), indent=1))
            return self.output
        shards = sorted(self.folder.glob(f"part-*.{self.format}"), key=shard_order)
        if self.format == "parquet":
            self._join_parquet(shards)
        else:
            self._join_npz(shards)
        shutil.rmtree(self.folder)
        return self.output

    def _join_npz(self, shards: Sequence[Path]) -> None:
        """The ``.npz`` shards into one ``.npz``, streamed: each output's ``.npy`` member is
        written into the zip (stored, zip64) as its header (the joined shape) and then each
        shard's rows in order, so about one shard's member is held at once (joined in memory, the
        whole output was held about three times). Written through a temporary file and renamed;
        the manifest is the zip comment."""
        # pass 1: each member's dtype and shape per shard, from the .npy headers (nothing loaded)
        headers: dict[str, list[tuple[np.dtype[Any], tuple[int, ...]]]] = {}
        for path in shards:
            with zipfile.ZipFile(path) as zf:
                for info in zf.infolist():
                    if not info.filename.endswith(".npy"):
                        continue
                    with zf.open(info) as fh:
                        version = np.lib.format.read_magic(fh)
                        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                            np.lib.format.read_array_header_2_0
                        shape, _, dtype = read(fh)
                    headers.setdefault(info.filename[:-4], []).append((dtype, tuple(shape)))
        plan: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {}
        for name, parts in headers.items():
            filled = [p for p in parts if p[1] and p[1][0]] or parts
            if len({shape[1:] for _, shape in filled}) > 1:
                raise OutputError(f"output {name!r} has rows of different shapes in different shards; an .npz holds "
                                  f"one array per output: write Parquet (an --output named .parquet), which holds "
                                  f"any (the shards are kept in {self.folder})")
            if not filled:
                plan[name] = (np.dtype(np.float64), (0,))
                continue
            dtype = np.result_type(*(d for d, _ in filled))
            rows = sum(shape[0] if shape else 1 for _, shape in filled)
            plan[name] = (dtype, (rows, *filled[0][1][1:]))
        with atomic_writer(self.output) as raw:
            with zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED, allowZip64=True) as out:
                for name, (dtype, shape) in plan.items():
                    with out.open(name + ".npy", "w", force_zip64=True) as member:
                        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                  "shape": shape}
                        head = io.BytesIO()
                        try:
                            np.lib.format.write_array_header_1_0(head, header)
                        except ValueError:  # a header over 64 KiB: format 2.0, as numpy.save picks
                            head = io.BytesIO()
                            np.lib.format.write_array_header_2_0(head, header)
                        member.write(head.getvalue())
                        for shard in shards:
                            with np.load(shard, allow_pickle=False) as npz:
                                if name not in npz.files:
                                    continue
                                value = npz[name]
                            if (len(value) if value.ndim else 1) == 0:
                                continue
                            value = np.ascontiguousarray(value, dtype=dtype)
                            member.write(memoryview(value).cast("B"))
                            del value
                out.comment = _npz_comment(self.manifest)  # numpy ignores the comment; resume reads it

    def _join_parquet(self, shards: Sequence[Path]) -> None:
        """The shards into one Parquet file, a row group at a time, by a shard's own writer on the
        output's path (its temporary file, mode, fsync and rename; a file of the job's columns
        where no row was written): joined in memory, the whole output was held (twice) at the end
        of a job whose memory is otherwise bounded."""
        import pyarrow.parquet as pq

        joined = ParquetShardWriter(self.output, self.manifest.get("outputs", {}),
                                    {MANIFEST_KEY: json.dumps(self.manifest, sort_keys=True).encode()})
        try:
            for path in shards:
                shard = pq.ParquetFile(path)
                for group in range(shard.num_row_groups):
                    joined.add_table(shard.read_row_group(group))
            joined.close()
        except BaseException:
            joined.abort()
            raise


def _manifest_digest(manifest: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def _npz_comment(manifest: Mapping[str, Any]) -> bytes:
    """The manifest as an ``.npz`` output's zip comment (its digest where it is too long)."""
    text = json.dumps(manifest, sort_keys=True).encode()
    if len(text) > ZIP_COMMENT_BYTES:
        text = json.dumps({"manifest_sha256": _manifest_digest(manifest)}).encode()
    return text


# -- encodings --------------------------------------------------------------------------------------
def _npz_bytes(row_ids: np.ndarray, outputs: Mapping[str, Sequence[np.ndarray]], _specs: Mapping[str, Any]) -> bytes:
    arrays: dict[str, np.ndarray] = {ROW_ID: row_ids}
    for name, parts in outputs.items():
        shapes = {p.shape[1:] for p in parts}
        if len(shapes) > 1:
            raise OutputError(f"output {name!r} has rows of different shapes {sorted(shapes)[:3]} in one shard; an "
                              ".npz holds one array per output: write Parquet (--format parquet), which holds any")
        arrays[name] = np.concatenate(parts) if len(parts) > 1 else parts[0]
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def _flat_array(values: np.ndarray, value_type: Any) -> Any:
    """A 1-D numpy array as an Arrow array over the same memory where the type allows (fixed
    width numbers): ``pa.array`` asks pandas whether the value is one of its own, which imports
    pandas on first use (half a second inside a job's clock) and costs a check per call."""
    import pyarrow as pa

    if values.dtype.kind in "iuf" and pa.from_numpy_dtype(values.dtype) == value_type:
        values = np.ascontiguousarray(values)
        return pa.Array.from_buffers(value_type, len(values), [None, pa.py_buffer(values)])
    return pa.array(values.tolist() if values.dtype == object else values, type=value_type)


def _shaped(parts: Sequence[np.ndarray], value_type: Any, rank: int) -> Any:
    """Rows whose shape the model leaves open (a detector's boxes, a CTC head's time steps) as
    one struct column: ``data``, each row's values flattened, and ``shape``, its sizes. This is
    the storage of Arrow's canonical ``variable_shape_tensor`` (without its annotation, which
    pyarrow cannot write yet), and a tenth of the cost of one list level per dimension (crnn_ocr:
    23 against 150 ms per 4,000 rows). ``parts`` are ``[rows, *sample]`` arrays (a batch's
    rows share a shape)."""
    import pyarrow as pa

    counts = np.array([len(p) for p in parts], dtype=np.int64)
    sizes = np.repeat([int(np.prod(p.shape[1:], dtype=np.int64)) for p in parts], counts) if parts else \
        np.zeros(0, np.int64)
    flat = np.concatenate([p.reshape(-1) for p in parts]) if parts else np.zeros(0)
    values = _flat_array(flat, value_type)
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int32)
    data = pa.ListArray.from_arrays(_flat_array(offsets, pa.int32()), values)
    dims = (np.repeat(np.array([p.shape[1:] for p in parts], dtype=np.int32).reshape(len(parts), rank), counts, axis=0)
            if parts else np.zeros((0, rank), np.int32))
    shape = pa.FixedSizeListArray.from_arrays(_flat_array(dims.reshape(-1), pa.int32()), rank)
    return pa.StructArray.from_arrays([data, shape], names=["data", "shape"])


def _table(row_ids: np.ndarray, outputs: Mapping[str, Sequence[np.ndarray]], specs: Mapping[str, Any]) -> Any:
    """Rows as an Arrow table whose schema depends on ``specs`` alone (every row group and
    shard of a job alike)."""
    import pyarrow as pa

    columns: dict[str, Any] = {ROW_ID: _flat_array(row_ids.astype(np.int64, copy=False), pa.int64())}
    for name in [*specs, *(n for n in outputs if n not in specs)]:
        spec = specs.get(name, {})
        parts = outputs.get(name, [])
        text = spec.get("dtype") == "object" or any(p.dtype == object for p in parts)
        value_type = pa.string() if text else pa.from_numpy_dtype(np.dtype(spec.get("dtype") or parts[0].dtype))
        fixed = spec.get("sample_shape")
        if fixed is not None and not text:
            size = int(np.prod(fixed, dtype=np.int64))
            joined = np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else np.zeros((0, *fixed))
            if joined.shape[1:] != tuple(fixed):
                raise OutputError(f"output {name!r} gave rows of shape {list(joined.shape[1:])}, not the model's {fixed}")
            storage = pa.FixedSizeListArray.from_arrays(_flat_array(joined.reshape(-1), value_type), size)
            columns[name] = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(value_type, fixed), storage)
        else:
            rank = spec.get("rank", parts[0].ndim - 1 if parts else 0)
            columns[name] = _shaped(parts, value_type, rank)
    # Table.from_arrays, not pa.table(dict): the latter asks whether the dict is a pandas frame,
    # which imports pandas (half a second, once per process, inside the timed job)
    return pa.Table.from_arrays(list(columns.values()), names=list(columns))


class ShardWriter:
    """One shard being written: groups of rows added as the caller gathers them (about
    :data:`ROW_GROUP_BYTES` of outputs each), the rows skipped, then :meth:`close` (its errors,
    then its rows, each renamed into place) or :meth:`abort` (nothing left)."""

    def __init__(self, path: Path, specs: Mapping[str, Any]) -> None:
        self.path = path
        self.specs = specs
        self.errors: list[dict[str, Any]] = []

    def add(self, row_ids: Sequence[np.ndarray], outputs: Sequence[Mapping[str, np.ndarray]]) -> None:
        """One group: each batch's row ids and row-major outputs, in order."""
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Drop what was written of the shard (a job stopped before its last row)."""

    def close(self) -> None:
        errors = self.path.with_name(self.path.name[:-len(self.path.suffix)] + ".errors.json")
        if self.errors:
            atomic_write_text(errors, json.dumps(self.errors, indent=1))
        else:
            # a list an earlier run of the shard wrote before it stopped short of the shard (the
            # list goes first): trusted, it named rows this run wrote as skipped
            with contextlib.suppress(FileNotFoundError):
                errors.unlink()
        self._finish()


def _by_output(outputs: Sequence[Mapping[str, np.ndarray]]) -> dict[str, list[np.ndarray]]:
    """Batches' outputs as each output's list of arrays, in order."""
    joined: dict[str, list[np.ndarray]] = {}
    for batch in outputs:
        for name, value in batch.items():
            joined.setdefault(name, []).append(value)
    return joined


class ParquetShardWriter(ShardWriter):
    """A Parquet shard written as its rows come, a row group per group added, so a shard of any
    size holds no more than one group in memory."""

    def __init__(self, path: Path, specs: Mapping[str, Any], metadata: Mapping[bytes, bytes] | None = None) -> None:
        super().__init__(path, specs)
        #: the file's schema metadata (a single-file output's manifest)
        self.metadata = dict(metadata or {})
        self._writer: Any = None
        self._tmp: Path | None = None

    def add(self, row_ids: Sequence[np.ndarray], outputs: Sequence[Mapping[str, np.ndarray]]) -> None:
        ids = np.concatenate(row_ids) if row_ids else np.zeros(0, np.int64)
        self.add_table(_table(ids, _by_output(outputs), self.specs))

    def add_table(self, table: Any) -> None:
        """One row group, as an Arrow table of the job's columns."""
        import pyarrow.parquet as pq

        if self._writer is None:
            remove_stale_temporaries(self.path)
            fd, tmp = tempfile.mkstemp(prefix=temp_prefix(self.path), suffix=".tmp", dir=self.path.parent)
            os.close(fd)
            self._tmp = Path(tmp)
            # no dictionary pages (a tensor's values rarely repeat: trying cost 3x the write) and
            # statistics for the row ids only (what a reader filters on)
            schema = table.schema.with_metadata({**(table.schema.metadata or {}), **self.metadata}) \
                if self.metadata else table.schema
            self._writer = pq.ParquetWriter(tmp, schema, use_dictionary=False, write_statistics=[ROW_ID])
        self._writer.write_table(table)

    def _finish(self) -> None:
        if self._writer is None:  # every row of the shard skipped: an empty file of the job's schema
            self.add([], [])
        self._writer.close()
        assert self._tmp is not None
        os.chmod(self._tmp, _mode_for(self.path))  # as atomic_write_bytes leaves a file: mkstemp's is 0600
        with open(self._tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(self._tmp, self.path)
        self._writer = self._tmp = None

    def abort(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.unlink()
        self._writer = self._tmp = None


class NpzShardWriter(ShardWriter):
    """An ``.npz`` shard: its rows are held until it closes (one array per output; a shard of
    many large rows is better written as Parquet, which streams)."""

    def __init__(self, path: Path, specs: Mapping[str, Any]) -> None:
        super().__init__(path, specs)
        self._ids: list[np.ndarray] = []
        self._outputs: list[Mapping[str, np.ndarray]] = []

    def add(self, row_ids: Sequence[np.ndarray], outputs: Sequence[Mapping[str, np.ndarray]]) -> None:
        self._ids.extend(row_ids)
        self._outputs.extend(outputs)

    def _finish(self) -> None:
        ids = np.concatenate(self._ids) if self._ids else np.zeros(0, np.int64)
        atomic_write_bytes(self.path, _npz_bytes(ids, _by_output(self._outputs), self.specs))


def output_specs(plan: Any, layout: Any) -> dict[str, dict[str, Any]]:
    """Per output, its dtype and, where the model fixes it, a row's shape (the manifest keeps
    them, so every shard of a job has one schema)."""
    out: dict[str, dict[str, Any]] = {}
    for spec in plan.outputs:
        if spec.name == ROW_ID:  # its column would take the row ids' place in every shard
            raise OutputError(f"the model has an output named {ROW_ID!r}, the name of the column that holds each "
                              "row's id in staronnx infer's output; rename that output (onnx.compose.add_prefix, "
                              "or an Identity node to a new name)")
        axis = layout.outputs.get(spec.name)
        shape = list(spec.shape)
        if layout.batched and axis is not None:
            sample = shape[:axis] + shape[axis + 1:]
        elif not layout.batched and axis is not None and len(shape) > axis:
            # a row per task: its batch axis holds the one row (:meth:`RowLayout.row_major` drops it)
            sample = shape[:axis] + shape[axis + 1:]
        else:
            sample = shape
        fixed = all(isinstance(d, int) and d >= 0 for d in sample)
        text = spec.dtype in ("object", "str") or "string" in spec.dtype
        out[spec.name] = {"dtype": "object" if text else spec.dtype, "rank": len(sample),
                          "sample_shape": [int(d) for d in sample if isinstance(d, int)] if fixed else None}
    return out


# -- reading back --------------------------------------------------------------------------------
def shard_order(path: Path) -> tuple[int, str]:
    """A shard file's place among its job's: by its index, not its name (``part-{k:05d}`` has
    six digits from shard 100000 on, whose name sorts before ``part-10001``'s)."""
    index = path.name[len("part-"):].split(".", 1)[0]
    return (int(index), path.name) if index.isdigit() else (-1, path.name)


def read_outputs(path: str | os.PathLike[str]) -> dict[str, Any]:
    """An output written by :func:`staronnx.infer.infer` (a folder of shards or one file) as
    ``{"row_id": [N], output: [N, *sample shape]}``, rows in order; an output whose rows differ
    in shape comes back as a list of arrays, one per row."""
    path = Path(path)
    if path.is_dir():
        files = sorted((p for p in path.iterdir() if p.name.startswith("part-") and p.suffix in (".parquet", ".npz")),
                       key=shard_order)
    elif path.exists():
        files = [path]
    else:
        raise InputError(f"{path}: no such output")
    pieces: dict[str, list[Any]] = {}
    for f in files:
        for name, value in _read_file(f).items():
            pieces.setdefault(name, []).append(value)
    out: dict[str, Any] = {}
    for name, parts in pieces.items():
        # a shard of no rows (every one skipped) says nothing of a row's shape: an empty Parquet
        # column of a variable-shape output reads back as shape (0,)
        parts = [p for p in parts if len(p)] or parts
        if all(isinstance(p, np.ndarray) for p in parts) and len({p.shape[1:] for p in parts}) <= 1:
            out[name] = np.concatenate(parts) if parts else np.zeros(0)
        else:
            out[name] = [row for p in parts for row in p]
    return out


def _read_file(path: Path) -> dict[str, Any]:
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as npz:
            return {n: npz[n] for n in npz.files}
    import pyarrow.parquet as pq

    from staronnx.infer.sources import _column_rows, _uniform

    table = pq.read_table(path)
    out: dict[str, Any] = {}
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        uniform = _uniform(column)
        out[name] = uniform if uniform is not None else _column_rows(column, name)
    return out
