"""Datasets read for batch inference: an ``.npz``, a folder of ``.npy``/``.npz`` shards, a
Parquet or Arrow dataset, or any Python iterable of feeds.

Every source yields :class:`Chunk` s: consecutive rows with their first row's id (the row's
position in the whole dataset, counted from 0 across shards in name order), from any row on
(:meth:`Source.chunks`), so a resumed job reads only what it has not written. Reading is bounded:
an uncompressed ``.npy``/``.npz`` member (what ``numpy.save``/``numpy.savez`` write) is read a
chunk at a time from its file offset, never loaded or mapped whole (a mapped file's pages count in
the process's resident memory as it is read); a compressed member (``numpy.savez_compressed``) is
loaded whole, one shard at a time; Parquet/Arrow are read in record batches.

The ``.npz`` convention is ``staronnx run --inputs``'s: one array per model input, keyed by its
name, samples along the input's batch axis (:mod:`staronnx.infer.rows`); an input without one is
stored once and shared by every row. A Parquet/Arrow dataset has one row per sample and a column
per input: a tensor column (Arrow's ``fixed_shape_tensor``), nested lists, or scalars; rows of
different shapes (images of several sizes) are fine, and run in batches of equal shapes.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import zipfile
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import numpy as np

from staronnx.errors import InputError
from staronnx.infer.rows import RowLayout

#: rows a chunk holds by default
CHUNK_ROWS = 1024
#: bytes of inputs a ``.npy``/``.npz`` chunk reads at once (one read per input, whatever the
#: batch), unless the rows asked for hold more. The job hands batches over in bundles of this
#: size (:data:`staronnx.infer.job.BUNDLE_BYTES`): a chunk's buffer lives while any batch cut from
#: it does, so a chunk twice a bundle kept a bundle's worth more alive (crnn_ocr: -2.5 MiB of peak RSS)
CHUNK_BYTES = 1 << 20

#: a block of an array's rows (all of them, at one index of the axes before the rows' axis) this
#: small is read whole with its neighbours rather than a read per run of the rows asked: a read
#: call costs about what copying a few kilobytes does
SMALL_BLOCK_BYTES = 8 << 10

#: the file every output folder of staronnx infer holds (:data:`staronnx.infer.sinks.MANIFEST`):
#: such a folder inside an input folder is an output, not input
MANIFEST = "_manifest.json"
#: where a single-file output (``out.parquet``, ``out.npz``) keeps its job's manifest: the key of
#: a Parquet file's schema metadata (an ``.npz``'s is its zip comment). Such a file inside an
#: input folder is an output, not input
MANIFEST_KEY = b"staronnx.infer.manifest"

ARROW_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".arrow": "ipc", ".feather": "ipc", ".ipc": "ipc"}


@dataclass
class Chunk:
    """Consecutive rows of a dataset: ``rows`` rows from row id ``start``, as arrays along each
    input's row axis; ``problem`` says why none of them can run (a row the source cannot read),
    and they are reported rather than run."""

    start: int
    rows: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    problem: str | None = None


class Source(Protocol):
    """A dataset a job reads rows from."""

    def total_rows(self) -> int | None:
        """How many rows the dataset holds (None: unknown until read, an iterable's)."""

    def describe(self) -> dict[str, Any]:
        """What identifies the dataset's content (paths, sizes, modification times): a resumed
        job refuses a dataset that changed since its first run."""

    def chunks(self, start: int = 0, rows: int = CHUNK_ROWS) -> Iterator[Chunk]:
        """The rows from row id ``start`` on, in order, at least ``rows`` at a time where the data
        allows (a job asks for its batch size; a file source reads more small rows at once)."""

    def peek(self, start: int = 0, rows: int = CHUNK_ROWS) -> Iterator[Chunk]:
        """Chunks from row id ``start`` holding about ``rows`` rows, which :meth:`chunks` reads
        again (a job's batch-size probe and warm-up look at its first rows before its pass)."""


def embedded_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of the staronnx infer job that wrote ``path``, a single-file output (a
    Parquet file's schema metadata, an ``.npz``'s zip comment); None for any other file."""
    suffix = path.suffix.lower()
    try:
        if ARROW_SUFFIXES.get(suffix) == "parquet":
            import pyarrow.parquet as pq

            raw = (pq.read_schema(path).metadata or {}).get(MANIFEST_KEY)
        elif suffix == ".npz":
            with zipfile.ZipFile(path) as npz:
                raw = npz.comment
        else:
            return None
        value = json.loads(raw) if raw else None
    except (OSError, ValueError, zipfile.BadZipFile):  # pyarrow's ArrowInvalid is a ValueError
        return None
    return value if isinstance(value, dict) else None


# -- .npy/.npz arrays read a slice at a time -------------------------------------------------------
class BufferPool:
    """The reader's input buffers, used again once no batch refers to them.

    Why: a job reads the same sizes over and over, and a fresh array per read leaves the
    allocator to place each one anew; freed from other threads (the caller, the workers), the
    large ones land in other threads' arenas and the process keeps pages it no longer uses (a
    googlenet job held about twice its window more than it read). A pool keeps the reads in a
    few buffers whose count is the job's real window. A buffer is free when nothing but the pool
    refers to it: every batch is a view of the buffer it was read into, and a view holds a
    reference to its base until the batch is settled and dropped. Only the reader thread calls
    :meth:`empty`, so the pool needs no lock."""

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self._buffers: list[np.ndarray] = []

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised C-ordered array of ``shape`` and ``dtype``: a view of a free pooled
        buffer at least that large (the smallest such), or of a new one while the pool has room,
        or a plain new array."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        best: np.ndarray | None = None
        for buf in self._buffers:
            # the list, this loop's name and getrefcount's argument: nobody else holds it
            if buf.nbytes >= nbytes and sys.getrefcount(buf) <= 3 and (best is None or buf.nbytes < best.nbytes):
                best = buf
        if best is None:
            if len(self._buffers) >= self.keep:
                return np.empty(shape, dtype)
            best = np.empty(max(nbytes, 1), np.uint8)
            self._buffers.append(best)
        return best[:nbytes].view(dtype).reshape(shape)


@dataclass(frozen=True)
class _StoredArray:
    """An array stored uncompressed in a file at ``offset`` (a ``.npy``, or an ``.npz`` member)."""

    path: Path
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran: bool

    def rows(self, start: int, stop: int, axis: int = 0, pool: BufferPool | None = None) -> np.ndarray:
        """Rows ``start:stop`` of ``axis`` (0; 1 for a state's batch), read from the file into a
        fresh C-ordered array (or one of ``pool``'s): one read per index of the axes before it,
        each a run of whole rows (a single read for axis 0). A Fortran-ordered array is the
        C-ordered array of the reversed shape, read the same way and turned back (it was loaded
        whole for every chunk: the whole dataset in memory, and read once per chunk)."""
        if self.fortran:
            reversed_c = _StoredArray(self.path, self.offset, self.dtype, self.shape[::-1], False)
            return np.ascontiguousarray(reversed_c.rows(start, stop, len(self.shape) - 1 - axis).T)
        outer = int(np.prod(self.shape[:axis], dtype=np.int64))
        count = self.shape[axis]
        row = int(np.prod(self.shape[axis + 1:], dtype=np.int64)) * self.dtype.itemsize
        shape = (*self.shape[:axis], stop - start, *self.shape[axis + 1:])
        out = np.empty(shape, self.dtype) if pool is None else pool.empty(shape, self.dtype)
        run = (stop - start) * row
        flat = memoryview(out.reshape(-1).view(np.uint8))
        block = count * row  # the bytes of one index of the axes before: every row of it
        with open(self.path, "rb") as fh:
            if outer > 1 and block <= SMALL_BLOCK_BYTES:
                # many small runs (a Fortran-ordered feature matrix: one per column): whole
                # blocks read a group at a time, each group's runs picked out, where a read
                # per run cost a call per few bytes
                group = max(1, CHUNK_BYTES // block)
                runs = np.frombuffer(flat, np.uint8).reshape(outer, run)
                for lo in range(0, outer, group):
                    hi = min(lo + group, outer)
                    fh.seek(self.offset + lo * block)
                    data = fh.read((hi - lo) * block)
                    if len(data) != (hi - lo) * block:
                        raise InputError(f"{self.path}: the file ends before row {stop} (truncated?)")
                    runs[lo:hi] = np.frombuffer(data, np.uint8).reshape(hi - lo, block)[:, start * row:stop * row]
                return out
            for i in range(outer):
                fh.seek(self.offset + (i * count + start) * row)
                if fh.readinto(flat[i * run:(i + 1) * run]) != run:
                    raise InputError(f"{self.path}: the file ends before row {stop} (truncated?)")
        return out

    def whole(self) -> np.ndarray:
        """The whole array (a shared value, a compressed or Fortran-ordered one)."""
        count = int(np.prod(self.shape, dtype=np.int64))
        flat = np.fromfile(self.path, self.dtype, count, offset=self.offset)
        if flat.size != count:
            raise InputError(f"{self.path}: the file ends before the array does (truncated?)")
        return flat.reshape(self.shape, order="F" if self.fortran else "C")


@dataclass(frozen=True)
class _CompressedArray:
    """An ``.npz`` member that ``numpy.savez_compressed`` compressed: loaded whole, when the job
    reaches its shard (not when the dataset is opened: every shard at once)."""

    path: Path
    member: str
    dtype: np.dtype
    shape: tuple[int, ...]

    def whole(self) -> np.ndarray:
        with zipfile.ZipFile(self.path) as zf, zf.open(self.member) as fh:
            return np.lib.format.read_array(fh, allow_pickle=False)


def _npy_header(fh: IO[bytes], where: str) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """dtype, shape, Fortran order and the data's offset of the ``.npy`` stream at ``fh``'s position."""
    try:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
    except ValueError as exc:
        raise InputError(f"{where}: not a readable .npy array ({exc})") from None
    if dtype.hasobject:
        raise InputError(f"{where}: holds Python objects (a pickle), which staronnx does not load; "
                         "save strings as a Parquet column")
    return np.dtype(dtype), tuple(int(d) for d in shape), bool(fortran), fh.tell()


def _npy_file(path: Path) -> _StoredArray:
    with open(path, "rb") as fh:
        dtype, shape, fortran, offset = _npy_header(fh, str(path))
    return _StoredArray(path, offset, dtype, shape, fortran)


def _npz_members(path: Path) -> dict[str, _StoredArray | _CompressedArray | np.ndarray]:
    """Each member of an ``.npz``: stored ones as slices to read later, compressed ones loaded."""
    where = str(path)
    if not zipfile.is_zipfile(path):
        raise InputError(f"{where}: not an .npz file (write one with numpy.savez(path, NAME=array, ...))")
    out: dict[str, _StoredArray | _CompressedArray | np.ndarray] = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as fh:
        for info in zf.infolist():
            name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            if info.compress_type != zipfile.ZIP_STORED:
                with zf.open(info) as member:
                    # its header checked as a stored member's is: a pickle refused by name, not
                    # by numpy's ValueError from read_array
                    dtype, shape, _, _ = _npy_header(member, f"{where}[{name}]")
                out[name] = _CompressedArray(path, info.filename, dtype, shape)
                continue
            fh.seek(info.header_offset)
            local = fh.read(30)
            if local[:4] != b"PK\x03\x04":
                raise InputError(f"{where}: member {info.filename} has no local header (a damaged .npz)")
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            fh.seek(info.header_offset + 30 + name_len + extra_len)
            dtype, shape, fortran, offset = _npy_header(fh, f"{where}[{name}]")
            out[name] = _StoredArray(path, offset, dtype, shape, fortran)
    return out


def _natural(path: Path) -> list[object]:
    """Sort key: ``shard-2`` before ``shard-10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


class NumpySource:
    """An ``.npz``, or a folder of ``.npz`` shards (or ``.npy`` shards for a model with one input
    that carries rows), read in name order."""

    def __init__(self, path: Path, layout: RowLayout) -> None:
        self.path = path
        self.layout = layout
        if path.is_dir():
            # hidden and underscore names left out, as in a Parquet folder (macOS's ._shard.npz, _SUCCESS)
            # a job's single-file output kept in its input folder (-o data/out.npz) is not input
            files = sorted((p for p in path.iterdir() if p.suffix.lower() in (".npz", ".npy") and p.is_file()
                            and not p.name.startswith((".", "_")) and embedded_manifest(p) is None), key=_natural)
            if not files:
                raise InputError(f"--inputs {path}: the folder holds no .npz or .npy shard")
            kinds = {p.suffix.lower() for p in files}
            if len(kinds) > 1:
                raise InputError(f"--inputs {path}: mixes .npz and .npy shards; use one kind")
        else:
            files = [path]
        self.files = files
        self._pool = BufferPool()
        self._shards = [self._open(p) for p in files]
        self._counts = [self._count(p, s) for p, s in zip(files, self._shards)]

    def _open(self, path: Path) -> dict[str, _StoredArray | _CompressedArray | np.ndarray]:
        if path.suffix.lower() == ".npy":
            names = self.layout.row_inputs
            if len(self.layout.inputs) != 1 or len(names) != 1:
                raise InputError(f"--inputs {self.path}: .npy shards hold one array each, but the model takes "
                                 f"{list(self.layout.inputs)}; write .npz shards keyed by input name")
            return {names[0]: _npy_file(path)}
        members = _npz_members(path)
        unknown = [n for n in members if n not in self.layout.inputs]
        missing = [n for n in self.layout.inputs if n not in members]
        if unknown or missing:
            bits = ([f"unknown input(s) {unknown}"] if unknown else []) + ([f"missing {missing}"] if missing else [])
            raise InputError(f"--inputs {path}: {'; '.join(bits)}; the model's inputs are {list(self.layout.inputs)}")
        return members

    def _count(self, path: Path, shard: Mapping[str, _StoredArray | _CompressedArray | np.ndarray]) -> int:
        counts = {n: a.shape[ax] for n, a in shard.items()
                  if (ax := self.layout.inputs.get(n)) is not None and len(a.shape) > ax}
        if not counts:
            raise InputError(f"--inputs {path}: no input holds rows (the model's rows lie along "
                             f"{ {n: a for n, a in self.layout.inputs.items() if a is not None} })")
        if len(set(counts.values())) > 1:
            raise InputError(f"--inputs {path}: the inputs hold different numbers of rows: "
                             + ", ".join(f"{n} has {c} on axis {self.layout.inputs[n]}" for n, c in counts.items()))
        return next(iter(counts.values()))

    def total_rows(self) -> int | None:
        return sum(self._counts)

    def describe(self) -> dict[str, Any]:
        return {"kind": "numpy", "path": str(self.path.resolve()),
                "files": [[p.name, (st := p.stat()).st_size, st.st_mtime_ns] for p in self.files]}

    def peek(self, start: int = 0, rows: int = CHUNK_ROWS) -> Iterator[Chunk]:
        return self.chunks(start, rows)  # a file is read again

    def chunks(self, start: int = 0, rows: int = CHUNK_ROWS) -> Iterator[Chunk]:
        first = 0
        for shard, count in zip(self._shards, self._counts):
            if first + count <= start:
                first += count
                continue
            # a compressed member is loaded once its shard is reached, and kept for its chunks
            shard = {n: (a.whole() if isinstance(a, _CompressedArray) else a) for n, a in shard.items()}
            per_row = sum(self._row_bytes(n, a) for n, a in shard.items())
            step = max(1, rows, CHUNK_BYTES // max(per_row, 1))
            shared = {n: (a if isinstance(a, np.ndarray) else a.whole())
                      for n, a in shard.items() if self.layout.inputs.get(n) is None}
            for lo in range(max(start - first, 0), count, step):
                hi = min(lo + step, count)
                arrays = dict(shared)
                for name, stored in shard.items():
                    if name not in shared:
                        arrays[name] = self._rows(name, stored, lo, hi)
                yield Chunk(first + lo, hi - lo, arrays)
            first += count

    def _row_bytes(self, name: str, stored: _StoredArray | _CompressedArray | np.ndarray) -> int:
        axis = self.layout.inputs.get(name)
        if axis is None or not stored.shape:
            return 0
        return int(np.prod(stored.shape, dtype=np.int64)) // max(stored.shape[axis], 1) * stored.dtype.itemsize

    def _rows(self, name: str, stored: _StoredArray | _CompressedArray | np.ndarray, lo: int, hi: int) -> np.ndarray:
        axis = self.layout.inputs[name] or 0
        if isinstance(stored, _StoredArray):  # a chunk read, never the whole file: the module's promise
            return stored.rows(lo, hi, axis, self._pool if axis == 0 else None)
        whole = stored if isinstance(stored, np.ndarray) else stored.whole()
        return np.ascontiguousarray(whole[(slice(None),) * axis + (slice(lo, hi),)])


# -- Parquet / Arrow -------------------------------------------------------------------------------
def _column_rows(column: Any, name: str) -> list[np.ndarray | None]:
    """One numpy array per row of an Arrow column (None for a null row): the slow path, for rows
    of different shapes."""
    import pyarrow as pa

    out: list[np.ndarray | None] = []
    nested = _holds_null(column)  # once per column: the rows are looked at one by one only if so
    for i in range(len(column)):
        item = column[i]
        if not item.is_valid or (nested and _holds_null(column.slice(i, 1))):
            # a null inside the row's values too: numpy would make it a NaN, or fail on an integer
            out.append(None)
            continue
        if isinstance(column.type, pa.FixedShapeTensorType):
            out.append(np.asarray(column.slice(i, 1).to_numpy_ndarray()[0]))
            continue
        if _is_shaped(column.type):
            value = item.as_py()
            out.append(np.asarray(value["data"], dtype=_value_dtype(column.type.field("data").type)).reshape(value["shape"]))
            continue
        out.append(np.asarray(item.as_py(), dtype=_value_dtype(column.type)))
    return out


def _holds_null(array: Any) -> bool:
    """Whether a row's (nested) values hold a null at any level."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(array, pa.ExtensionArray):
        array = array.storage
    if _is_shaped(array.type):
        array = array.field("data")
    while pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or pa.types.is_fixed_size_list(array.type):
        if array.null_count:
            return True
        array = pc.list_flatten(array)
    return bool(array.null_count)


def _innermost(dtype: Any) -> Any:
    import pyarrow as pa

    while pa.types.is_list(dtype) or pa.types.is_large_list(dtype) or pa.types.is_fixed_size_list(dtype):
        dtype = dtype.value_type
    return dtype


def _is_text(dtype: Any) -> bool:
    import pyarrow as pa

    inner = _innermost(dtype)
    return bool(pa.types.is_string(inner) or pa.types.is_large_string(inner) or pa.types.is_binary(inner))


def _value_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype of a (nested) list column's values: a row read through Python keeps the
    column's type (float32 stays float32, not Python's float64)."""
    if _is_text(dtype):
        return np.dtype(object)
    dt: np.dtype = np.dtype(_innermost(dtype).to_pandas_dtype())
    return dt


def _is_shaped(dtype: Any) -> bool:
    """A ``struct<data: list, shape: list>`` column: a variable-shape tensor's storage."""
    import pyarrow as pa

    return bool(pa.types.is_struct(dtype) and dtype.num_fields == 2
                and [dtype.field(i).name for i in range(2)] == ["data", "shape"])


def _uniform(column: Any) -> np.ndarray | None:
    """The column as one ``[rows, *sample shape]`` array when every row has one shape and none is
    null (the fast path: no Python per row), else None."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if column.null_count:
        return None
    if isinstance(column.type, pa.FixedShapeTensorType):
        return np.asarray(column.to_numpy_ndarray())
    if _is_shaped(column.type):
        shapes = _uniform(column.field("shape"))
        if shapes is None or (len(shapes) and (shapes != shapes[0]).any()):
            return None
        data = column.field("data")
        if data.null_count:
            return None
        inner = pc.list_flatten(data)
        items: np.ndarray = (np.asarray(inner.to_pylist(), dtype=object) if _is_text(inner.type)
                             else np.asarray(inner.to_numpy(zero_copy_only=False)))
        return items.reshape((len(column), *(int(d) for d in (shapes[0] if len(shapes) else ()))))
    shape = [len(column)]
    values = column
    while pa.types.is_list(values.type) or pa.types.is_large_list(values.type) or pa.types.is_fixed_size_list(values.type):
        if values.null_count:
            return None
        lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != lengths[0]).any():
            return None
        shape.append(int(lengths[0]) if len(lengths) else 0)
        values = pc.list_flatten(values)
    if values.null_count:
        return None
    if _is_text(values.type):
        flat = np.asarray(values.to_pylist(), dtype=object)
    else:
        flat = values.to_numpy(zero_copy_only=False)
    return flat.reshape(shape)


class ArrowSource:
    """A Parquet or Arrow IPC/Feather file, or a folder of them (pyarrow.dataset), one row per
    sample and a column per input."""

    def __init__(self, path: Path | None, layout: RowLayout, fmt: str, dataset: Any = None) -> None:
        import pyarrow.dataset as ds

        self.path = path
        self.layout = layout
        self.format = fmt
        if dataset is not None:  # a pyarrow Dataset, Table or RecordBatch of the caller's (path None)
            self.dataset = dataset if isinstance(dataset, ds.Dataset) else ds.dataset(dataset)
        else:
            assert path is not None
            try:  # a folder's files listed here: their order and which of them are the dataset's
                self.dataset = ds.dataset([str(p) for p in _arrow_files(path)] if path.is_dir() else str(path),
                                          format=fmt)
            except Exception as exc:  # noqa: BLE001 - pyarrow's many error types; one message names the file
                raise InputError(f"--inputs {path}: not a readable {fmt} dataset ({exc})") from None
        names = set(self.dataset.schema.names)
        missing = [n for n in layout.inputs if n not in names]
        if missing:
            where = f"--inputs {path}" if path is not None else f"the {type(dataset).__name__}"
            raise InputError(f"{where}: no column for input(s) {missing}; the dataset's columns are "
                             f"{self.dataset.schema.names} and the model's inputs {list(layout.inputs)}")
        self._fragments = list(self.dataset.get_fragments())
        self._counts: list[int] = [int(f.count_rows()) for f in self._fragments]

    def total_rows(self) -> int | None:
        return sum(self._counts)

    def describe(self) -> dict[str, Any]:
        if self.path is None or not all(hasattr(f, "path") for f in self._fragments):
            # in memory: no file to date; its rows are what a resumed job can compare
            return {"kind": self.format, "type": type(self.dataset).__name__, "rows": self._counts}
        # resolved as the path is: pyarrow names a fragment as the path was given, relative or not
        files = [Path(f.path).resolve() for f in self._fragments]
        return {"kind": self.format, "path": str(self.path.resolve()),
                "files": [[str(p), (st := p.stat()).st_size, st.st_mtime_ns] for p in files]}

    def peek(self, start: int = 0, rows: int = CHUNK_ROWS) -> Iterator[Chunk]:
        return self.chunks(start, rows)  # a file is read again

    def chunks(self, start: int = 0, rows: int = CHUNK_ROWS) -> Iterator[Chunk]:
        first = 0
        columns = list(self.layout.inputs)
        for fragment, count in zip(self._fragments, self._counts):
            if first + count <= start:
                first += count
                continue
            row = first
            skip = max(start - first, 0)
            for piece in self._pieces(fragment, skip):
                if skip:
                    # a Parquet row group wholly before ``start`` is passed by its metadata, not
                    # read: a resumed job decoded every row it had written before (a crash at 90%
                    # of one large file read 90% of it again, and a damaged part there failed it)
                    # (a row group's fragment counts its file's rows: its metadata says its own)
                    held = sum(g.num_rows for g in piece.row_groups) if piece is not fragment else count
                    if skip >= held:
                        skip -= held
                        row += held
                        continue
                for batch in piece.to_batches(columns=columns, batch_size=max(1, rows)):
                    if skip >= batch.num_rows:
                        skip -= batch.num_rows
                        row += batch.num_rows
                        continue
                    if skip:
                        batch = batch.slice(skip)
                        row += skip
                        skip = 0
                    yield from self._convert(batch, row)
                    row += batch.num_rows
            first += count

    @staticmethod
    def _pieces(fragment: Any, skip: int) -> list[Any]:
        """The fragment's row groups, in order, where rows are to be skipped and it has them
        (a Parquet file); else the fragment whole."""
        if skip and hasattr(fragment, "split_by_row_group"):
            groups = list(fragment.split_by_row_group())
            if groups:
                return groups
        return [fragment]

    def _convert(self, batch: Any, start: int) -> Iterator[Chunk]:
        cols = {name: batch.column(name) for name in self.layout.inputs}
        columns = {name: (a if (a := _uniform(col)) is not None else _column_rows(col, name)) for name, col in cols.items()}
        yield from chunks_from_columns(self.layout, columns, start)


def chunks_from_columns(layout: RowLayout, columns: Mapping[str, np.ndarray | list[np.ndarray | None]],
                        start: int) -> Iterator[Chunk]:
    """Row-major columns (one row per sample: a ``[rows, *sample]`` array, or a list of per-row
    arrays, None for a null) as chunks along the model's axes: one chunk when every column is an
    array, else runs of rows that share every per-row shape and shared value, a null row alone
    with its problem. What an Arrow dataset and a Ray Data batch both hold."""
    if all(isinstance(c, np.ndarray) and c.dtype != object for c in columns.values()) and all(
            layout.inputs[n] is not None for n in columns):
        arrays = {n: to_model_axes(layout, n, c) for n, c in columns.items() if isinstance(c, np.ndarray)}
        yield Chunk(start, layout.count(arrays) or 0, arrays)
        return
    rows = len(next(iter(columns.values())))
    per_row = {n: list(c) for n, c in columns.items()}
    run: list[int] = []
    key: object = None
    for i in range(rows):
        values = {n: per_row[n][i] for n in columns}
        null = next((n for n, v in values.items() if v is None), None)
        if null is not None:
            yield from _flush(layout, run, per_row, start)
            run, key = [], None
            yield Chunk(start + i, 1, problem=f"input {null!r} is null in this row (or holds a null)")
            continue
        arrays = {n: np.asarray(v) for n, v in values.items()}
        this = tuple((n, v.dtype.str, v.shape, v.tobytes() if layout.inputs[n] is None else b"")
                     for n, v in arrays.items())
        if run and this != key:
            yield from _flush(layout, run, per_row, start)
            run = []
        run.append(i)
        key = this
    yield from _flush(layout, run, per_row, start)


def _flush(layout: RowLayout, run: list[int], per_row: Mapping[str, list[Any]], start: int) -> Iterator[Chunk]:
    if not run:
        return
    arrays: dict[str, np.ndarray] = {}
    for name, rows in per_row.items():
        picked = [np.asarray(rows[i]) for i in run]
        arrays[name] = picked[0] if layout.inputs[name] is None else to_model_axes(layout, name, np.stack(picked))
    yield Chunk(start + run[0], len(run), arrays)


def to_model_axes(layout: RowLayout, name: str, rows_first: np.ndarray) -> np.ndarray:
    """``[rows, *sample]`` as the model takes it: rows along the input's row axis; for a batch-1
    export the sample keeps its leading 1 (``[rows, 3, 224, 224]``: rows of ``[1, 3, 224, 224]``
    stacked on axis 0; a sample written with its batch-1 axis, ``[rows, 1, 3, 224, 224]``, too).
    Which of the two a sample is, its rank says, not its first size: a grayscale export's
    ``[1, 28, 28]`` sample (``[1, 1, 28, 28]`` in the model) has no batch axis to drop."""
    axis = layout.inputs[name] or 0
    rank = layout.ranks.get(name)
    if name in layout.kept and rows_first.ndim >= 2 and rows_first.shape[1] == 1 and \
            (rank is None or rows_first.ndim == rank + 1):
        rows_first = rows_first[:, 0]
    return np.ascontiguousarray(np.moveaxis(rows_first, 0, axis)) if axis else rows_first


# -- Python ------------------------------------------------------------------------------------------
class FeedsSource:
    """Any iterable of feeds (mappings of input name -> array, rows along each input's batch axis,
    as :meth:`staronnx.Runtime.submit` takes them), each item one or more rows.

    A one-shot iterable (a generator) is read once: the items a :meth:`peek` takes are kept and
    handed again, first, to the job's pass; those wholly before the row it starts from (a resumed
    job's rows written before) are dropped as they are read, not kept: a resumed job would hold
    every row written before in memory until its pass read past them."""

    def __init__(self, items: Iterable[Mapping[str, np.ndarray]], layout: RowLayout) -> None:
        self.items = items
        self.layout = layout
        self._once: Iterator[Mapping[str, np.ndarray]] | None = items if isinstance(items, Iterator) else None
        self._peeked: deque[Mapping[str, np.ndarray]] = deque()
        #: rows of a one-shot iterable that :meth:`peek` read and dropped (before the row asked)
        self._dropped = 0

    def total_rows(self) -> int | None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"kind": "python", "type": type(self.items).__name__}

    def chunks(self, start: int = 0, rows: int = CHUNK_ROWS) -> Iterator[Chunk]:
        self._check_start(start)
        return self._chunks(self._items(), start, self._dropped)

    def peek(self, start: int = 0, rows: int = CHUNK_ROWS) -> Iterator[Chunk]:
        if self._once is None:
            return self.chunks(start, rows)
        self._check_start(start)
        seen = self._dropped + sum(self.layout.count(dict(item)) or 0 for item in self._peeked)
        for item in self._once:
            count = self.layout.count(dict(item))
            if not self._peeked and count is not None and seen + count <= start:
                self._dropped += count  # every row of it before the start: never run, not kept
                seen += count
                continue
            self._peeked.append(item)
            seen += count or 0
            if seen >= start + rows:
                break
        return self._chunks(iter(list(self._peeked)), start, self._dropped)

    def _check_start(self, start: int) -> None:
        if start < self._dropped:
            raise InputError(f"a one-shot iterable of feeds cannot be read again from row {start}: its rows before "
                             f"{self._dropped} were read and dropped")

    def _items(self) -> Iterator[Mapping[str, np.ndarray]]:
        if self._once is None:
            yield from self.items
            return
        while self._peeked:
            yield self._peeked.popleft()
        yield from self._once

    def _chunks(self, items: Iterator[Mapping[str, np.ndarray]], start: int, first: int = 0) -> Iterator[Chunk]:
        """The rows from ``start`` of ``items``, whose first row is row ``first`` of the dataset."""
        row = first
        for item in items:
            arrays = {n: np.asarray(v) for n, v in item.items()}
            count = self.layout.count(arrays)
            if count is None:
                raise InputError(f"feeds {sorted(arrays)} carry no rows: the model's rows lie along "
                                 f"{ {n: a for n, a in self.layout.inputs.items() if a is not None} }")
            if row + count > start:
                skip = max(start - row, 0)
                yield Chunk(row + skip, count - skip, self.layout.take(arrays, skip, count) if skip else arrays)
            row += count


def open_source(src: str | os.PathLike[str] | Iterable[Mapping[str, np.ndarray]] | Any, layout: RowLayout) -> Source:
    """The source for ``src``: a path (an ``.npz``; a folder of ``.npz``/``.npy`` shards; a Parquet or
    Arrow file or folder), a pyarrow Dataset or Table, one feeds mapping, or an iterable of feeds."""
    if isinstance(src, (str, os.PathLike)):
        path = Path(src)
        if not path.exists():
            raise InputError(f"--inputs {path}: no such file or folder")
        fmt = _arrow_format(path)
        if fmt is not None:
            return ArrowSource(path, layout, fmt)
        if path.is_dir() or path.suffix.lower() in (".npz", ".npy"):
            return NumpySource(path, layout)
        raise InputError(f"--inputs {path}: not a dataset staronnx reads (.npz, a folder of .npz/.npy shards, "
                         f"or Parquet/Arrow: {', '.join(sorted(ARROW_SUFFIXES))})")
    if "pyarrow" in sys.modules:  # a pyarrow object can only come from a process that loaded it
        import pyarrow as pa
        import pyarrow.dataset as ds

        if isinstance(src, (pa.Table, pa.RecordBatch, ds.Dataset)):
            return ArrowSource(None, layout, "arrow", dataset=src)
    if isinstance(src, Mapping):  # one feeds (a dict, a loaded .npz), not an iterable of its names
        return FeedsSource([src], layout)
    return FeedsSource(src, layout)


def _arrow_files(folder: Path) -> list[Path]:
    """A folder's Parquet/Arrow files in name order (``shard-2`` before ``shard-10``, as a folder of
    ``.npz`` shards is read), its subfolders' too (a partitioned dataset). Left out, as pyarrow
    leaves them out of a folder it reads: names that start with ``.`` or ``_`` (``_SUCCESS``,
    ``.crc`` files); and every folder or single file staronnx infer wrote (it holds a manifest):
    an output kept inside its input folder is not read back as input by the next job or a
    ``--resume``. Other
    files (a README, a job's ``.errors.json``) are not the dataset's."""
    files: list[Path] = []
    for path in sorted(folder.iterdir(), key=_natural):
        if path.name.startswith((".", "_")):
            continue
        if path.is_dir():
            if not (path / MANIFEST).exists():
                files += _arrow_files(path)
        elif path.suffix.lower() in ARROW_SUFFIXES and embedded_manifest(path) is None:
            files.append(path)
    return files


def _arrow_format(path: Path) -> str | None:
    """``parquet`` or ``ipc`` for a Parquet/Arrow file or a folder of them, else None."""
    if path.is_file():
        return ARROW_SUFFIXES.get(path.suffix.lower())
    kinds = {ARROW_SUFFIXES[p.suffix.lower()] for p in _arrow_files(path)}
    if len(kinds) > 1:
        raise InputError(f"--inputs {path}: mixes Parquet and Arrow files; use one kind")
    return next(iter(kinds), None)
