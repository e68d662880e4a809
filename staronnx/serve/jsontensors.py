"""JSON tensors without Python lists of numbers: request bodies parsed with simdjson, each input's
``data`` read straight into a numpy buffer; responses written by orjson from numpy arrays.

Why: ``json.loads`` of googlenet's input (150,528 FP32 values, 3.1 MB of text as tritonclient
writes it) builds 150,528 Python floats, then ``np.asarray`` walks them again: 47 ms of server
CPU per request, holding the GIL the whole time, where the model itself costs a few ms per
sample. simdjson parses the document in C and ``as_buffer`` copies a homogeneous array (nested
ones flattened) into a buffer of doubles or int64 with no Python object per value: 3.5 ms.
Writing is the mirror image: ``tolist()`` then ``json.dumps`` formats each float through Python
(0.6 ms per 1,000 values), orjson formats the numpy array itself (20 µs).

What a request means never changes with the parser; the values a datatype takes are as strict
as :func:`staronnx.serve.protocol.from_values` says:

* a document simdjson refuses (malformed JSON, ``NaN``/``Infinity`` tokens that Python's json
  and tritonclient write, nesting deeper than simdjson's 1024 levels, integers past 64 bits,
  a number past a double's range) is parsed again by :func:`json.loads`, whose result or error
  message is then the answer; a number too large for a double stays its text
  (:class:`~staronnx.serve.protocol.NumberOutOfRange`), refused by position, not an infinity;
* a ``data`` array takes the fast path only when it is a *rectangular* nest of numbers of the
  datatype's kind (JSON numbers for FP16/32/64 that stay finite in the type, integers in range
  for the INT and UINT types): the arrays it holds are counted level by level, and the ``[`` in
  the document must add up to exactly the arrays found, so a ragged nest or an array hidden
  where a number belongs cannot slip through flattened. Anything else (BOOL, strings, ``null``,
  floats in an INT tensor, a value out of the type's range, a ragged nest) is handed on as the
  Python list ``json.loads`` would have given, which ``from_values`` checks value by value;
* values are parsed to doubles and then cast, as ``np.asarray(list_of_floats, dtype)`` does, so
  a tensor is bit-equal to the one the list path makes.

Responses (:func:`dumps`) read back as the values ``tolist()`` + ``json.dumps`` give. Both run
on the JSON thread of :mod:`staronnx.serve.http_api` for large bodies, never on the event loop;
each thread keeps its own simdjson parser (one is not safe to share, and a parser reuses its
buffers from one document to the next).
"""

from __future__ import annotations

import contextlib
import json
import threading
from typing import Any

import numpy as np
import orjson
import simdjson

from staronnx.serve.protocol import parse_float

#: datatypes whose JSON values are numbers parsed as doubles, then cast
_FLOATS = {"FP16": np.float16, "FP32": np.float32, "FP64": np.float64}
#: datatypes whose JSON values are integers, parsed as int64, range-checked, then cast
_INTS: dict[str, type[np.integer[Any]]] = {"INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
                                          "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64}

#: deepest nest of ``data`` the fast path walks (numpy's own limit on dimensions)
_MAX_DEPTH = 64

#: a document shorter than this is parsed by json.loads (a binary request's header, a few values)
SMALL_BYTES = 4096

#: the byte "["
_OPEN = ord("[")

class _Local(threading.local):
    """Each thread's parser (made on the thread's first document)."""

    def __init__(self) -> None:
        self.parser = simdjson.Parser()


_local = _Local()


#: the decoder of :func:`strict_loads`, made once: ``json.loads`` with a keyword builds a new
#: decoder (and its scanner) on every call, ~a third of a small request header's parse
_decoder = json.JSONDecoder(parse_float=parse_float)


def strict_loads(data: bytes | bytearray | str) -> Any:
    """``json.loads``, with a number past a double's range kept as its text (refused later by
    position) instead of read as an infinity; the same errors (ValueError, UnicodeDecodeError)."""
    if not isinstance(data, str):  # an object in UTF-8, as nearly every request is, needs no detection
        utf8 = data[:1] == b"{" and data[1:2] != b"\x00"
        data = data.decode("utf-8" if utf8 else json.detect_encoding(data), "surrogatepass")
    return _decoder.decode(data)


def loads(data: bytes | bytearray) -> Any:
    """The JSON document ``data`` as Python objects, each ``inputs[i].data`` of a numeric datatype
    as a numpy array of that datatype where it can be read directly (see the module docstring);
    :func:`strict_loads` (raising json's errors) for a document simdjson refuses, and for a small
    one (a binary request's header): json.loads takes a few µs there, where simdjson's proxies
    cost more than they save."""
    if len(data) < SMALL_BYTES:
        return strict_loads(data)
    try:
        doc = _local.parser.parse(data)
    except RuntimeError:  # a parser still referenced by an earlier document (an error's traceback)
        _local.parser = simdjson.Parser()
        try:
            doc = _local.parser.parse(data)
        except (ValueError, RuntimeError, UnicodeDecodeError):
            return strict_loads(data)
    except (ValueError, UnicodeDecodeError):
        return strict_loads(data)
    try:
        return _convert(doc, data)
    finally:
        del doc


def _py(value: Any) -> Any:
    """A simdjson element as the Python object json.loads gives."""
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    if isinstance(value, simdjson.Array):
        return value.as_list()
    return value


def _fields(obj: Any) -> list[tuple[str, Any]] | None:
    """An Object's (key, element) pairs, containers left as simdjson proxies (``items()`` would
    convert them all); None where a key repeats (simdjson's lookup finds the first, json.loads
    keeps the last: such an object is converted whole, as json.loads reads it)."""
    keys = list(obj.keys())
    if len(set(keys)) != len(keys):
        return None
    return [(k, obj[k]) for k in keys]


def _convert(doc: Any, data: bytes | bytearray) -> Any:
    fields = _fields(doc) if isinstance(doc, simdjson.Object) else None
    if fields is None:
        return _py(doc)
    header: dict[str, Any] = {}
    fast: list[tuple[dict[str, Any], Any]] = []  # (input entry, its data Array): the rectangular nests
    expected = 0  # the arrays those nests are made of
    for key, value in fields:
        if key != "inputs" or not isinstance(value, simdjson.Array):
            header[key] = _py(value)
            continue
        header[key] = entries = []
        for spec in value:
            spec_fields = _fields(spec) if isinstance(spec, simdjson.Object) else None
            if spec_fields is None:
                entries.append(_py(spec))
                continue
            entry = {k: v if k == "data" and isinstance(v, simdjson.Array) else _py(v) for k, v in spec_fields}
            entries.append(entry)
            values = entry.get("data")
            if isinstance(values, simdjson.Array):  # read into a buffer where its nest is rectangular
                arrays = _rectangular(values)
                if arrays is None:
                    entry["data"] = values.as_list()
                else:
                    fast.append((entry, values))
                    expected += arrays
    if fast:
        # every "[" of the document is an array found outside data or inside a rectangular
        # nest: then no data array holds an array where a number belongs (a "[" inside a
        # string only makes the count disagree, which is safe)
        outside = _count_lists(header)
        # (counted by numpy: bytes.count of one byte is a plain loop, 1 ms over 3 MB; this is 0.25)
        brackets = int(np.count_nonzero(np.frombuffer(data, dtype=np.uint8) == _OPEN))
        rectangular = brackets == outside + expected
        for entry, values in fast:
            entry["data"] = _typed(values, entry.get("datatype")) if rectangular else values.as_list()
    return header


def _count_lists(value: Any) -> int:
    """Python lists in ``value`` (the arrays of the document outside the ``data`` read fast);
    iterative, as a document may nest 1024 deep (simdjson's limit), past Python's recursion's."""
    count, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            count += 1
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return count


def _rectangular(values: Any) -> int | None:
    """How many arrays the nest ``values`` is made of if it is rectangular down to its last level
    (each level's arrays of one length and holding arrays only), else None. Whether the last
    level holds numbers only is checked by the caller's count of ``[``."""
    level = [values]
    arrays = 1
    for _ in range(_MAX_DEPTH):
        n = len(level[0])
        if any(len(a) != n for a in level):
            return None
        if n == 0 or not isinstance(level[0][0], simdjson.Array):
            return arrays
        nxt = []
        for a in level:
            for child in a:
                if not isinstance(child, simdjson.Array):
                    return None
                nxt.append(child)
        arrays += len(nxt)
        level = nxt
    return None


def _typed(values: Any, datatype: Any) -> Any:
    """``values`` (a rectangular nest of arrays) as a flat numpy array of ``datatype``, or the
    Python list where its values are not all of the datatype's kind."""
    with contextlib.suppress(TypeError, ValueError, OverflowError):  # a bool, string, null, a float among ints
        if datatype in _FLOATS:
            flat = np.frombuffer(values.as_buffer(of_type="d"), dtype=np.float64)
            with np.errstate(over="ignore"):
                cast = flat.astype(_FLOATS[datatype])
            if datatype == "FP64" or np.isfinite(cast).all():  # else a number past the type's range
                return cast
        elif datatype in _INTS:
            flat = np.frombuffer(values.as_buffer(of_type="i"), dtype=np.int64)
            info = np.iinfo(_INTS[datatype])
            if not flat.size or info.min <= int(flat.min()) and int(flat.max()) <= info.max:
                return flat.astype(_INTS[datatype])
    return values.as_list()  # refused by position


def dumps(doc: dict[str, Any]) -> bytes:
    """``doc`` as JSON bytes; numpy arrays in it are written as flat lists of their values, the
    same values ``json.dumps`` of their ``tolist()`` would read back as (FP16/FP32 widened to
    float64). Arrays hold finite values only (:func:`json_array`); a float elsewhere that is not
    finite (a request ``id`` echoed back) is written as ``null``, so the document is valid JSON."""
    try:
        # with no ``default``, what orjson cannot write as json.dumps would (a subclass of str,
        # int, dict or list) raises, and json.dumps writes the document
        return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_PASSTHROUGH_SUBCLASS)
    except orjson.JSONEncodeError:
        return json.dumps(doc, default=_tolist, allow_nan=False).encode()


def _tolist(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def finite(array: np.ndarray) -> bool:
    """Whether every value of ``array`` can be written as a JSON number (no NaN, no infinity)."""
    return array.dtype.kind != "f" or bool(np.isfinite(array).all())


def json_array(array: np.ndarray) -> Any:
    """An output tensor's ``data`` for :func:`dumps`: a flat, C-contiguous, native-endian array
    orjson writes directly (BYTES elements as text). Its values must be :func:`finite` (the
    caller sends the others with the binary extension)."""
    if array.dtype.kind in "OSU":  # strings (ONNX Runtime gives str), classifications (bytes)
        return [v if isinstance(v, str) else bytes(v).decode("utf-8", "replace") for v in array.ravel()]
    flat = np.ascontiguousarray(array.reshape(-1))
    if flat.dtype.kind == "f":
        flat = flat.astype(np.float64)
    elif flat.dtype.byteorder == ">":
        flat = flat.astype(flat.dtype.newbyteorder("="))
    if flat.dtype.kind not in "biuf" or (flat.dtype.kind == "u" and flat.dtype.itemsize > 8):
        return flat.tolist()
    return flat
