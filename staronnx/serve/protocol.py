"""The KServe v2 (Open Inference Protocol) tensor rules, shared by the HTTP and gRPC front ends.

Both transports describe a tensor the same way (name, datatype, shape, and either typed
values or raw little-endian bytes), so the checks live here once: a request is turned into
numpy arrays, or refused with a :class:`ProtocolError` whose ``kind`` each front end maps to
its own status (HTTP 400/404/503/500, gRPC INVALID_ARGUMENT/NOT_FOUND/UNAVAILABLE/INTERNAL).
Every message names the input at fault, because the person reading it is a client author who
cannot see the server's logs.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import numpy as np

from staronnx.errors import StaronnxError
from staronnx.partition.plan_cache import staronnx_version as staronnx_version  # noqa: F401 - the server metadata's

#: v2 datatype -> numpy dtype (little endian, as the protocol's raw bytes are)
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
_BY_NUMPY = {dt.name: name for name, dt in DATATYPES.items()}

#: Triton's classification extension: the output's top-k entries travel as BYTES strings
BYTES = "BYTES"

#: what a BYTES tensor is on the server's side: a numpy object array of ``str``, as ONNX Runtime's
#: Python binding takes and gives ``tensor(string)`` (it reads a ``bytes`` element as its
#: ``repr``, so elements are decoded from UTF-8 on the way in and encoded on the way out)
STRING_DTYPE = np.dtype(object)

#: every datatype this server speaks, in the order error messages list them
SPOKEN = (*DATATYPES, BYTES)

#: the InferTensorContents field that carries each datatype in gRPC (FP16 has none: raw only)
GRPC_CONTENTS: dict[str, str] = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

#: protocol errors and what they mean to each transport: an HTTP status, the name of a
#: ``grpc.StatusCode`` (a string, so that HTTP never imports grpc)
KINDS: dict[str, tuple[int, str]] = {
    "invalid": (400, "INVALID_ARGUMENT"),
    "not_found": (404, "NOT_FOUND"),
    "unavailable": (503, "UNAVAILABLE"),
    "internal": (500, "INTERNAL"),
    # a call this server understands and will not do (loading or unloading a model)
    "refused": (400, "FAILED_PRECONDITION"),
    # a request not answered within --request-timeout (Envoy's route timeout answers 504 too)
    "timeout": (504, "DEADLINE_EXCEEDED"),
    # a request whose body arrived too slowly (--body-timeout, --body-min-rate): nginx's 408
    "slow": (408, "DEADLINE_EXCEEDED"),
}

#: the most dimensions a tensor may have (numpy's limit): a longer shape is the client's error
MAX_RANK = 64

#: the most characters of a client's string (a model or input name) an error message repeats
ECHO_CHARS = 64

class ProtocolError(StaronnxError):
    """A request the protocol says to refuse; ``kind`` is a key of :data:`KINDS`."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.http_status, self.grpc_code = KINDS[kind]


def invalid(message: str) -> ProtocolError:
    return ProtocolError("invalid", message)


def shown(text: Any, limit: int = ECHO_CHARS) -> str:
    """``repr`` of a client's string for an error message, cut to ``limit`` characters: an error
    never echoes a 100 KB name back (a gRPC status that large breaks the metadata limit)."""
    text = str(text)
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def cut(value: Any, limit: int = 200) -> str:
    """``str(value)`` cut to ``limit`` characters (a shape or a parser's message in an error)."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def unknown_model(name: str, served: Sequence[str]) -> ProtocolError:
    """Triton's wording (its clients test the message's start), then what is served."""
    listed = ", ".join(shown(n) for n in sorted(served)[:16]) + (", ..." if len(served) > 16 else "")
    return ProtocolError("not_found", f"Request for unknown model: {shown(name)} is not found "
                                      f"(this server serves {listed})")


def datatype_of(dtype: str | np.dtype) -> str:
    """The v2 datatype of a plan's dtype name (``float32`` -> ``FP32``, an ONNX string tensor's
    ``object`` -> ``BYTES``)."""
    try:
        name = np.dtype(dtype).name
    except TypeError:  # ORT's names of sequences and maps ("seq(tensor(float))"): not a numpy dtype
        name = str(dtype)
    if name == STRING_DTYPE.name:
        return BYTES
    try:
        return _BY_NUMPY[name]
    except KeyError:
        raise StaronnxError(
            f"dtype {name} has no KServe v2 datatype this server speaks ({', '.join(SPOKEN)})"
        ) from None


def config_type(datatype: str) -> str:
    """Triton's model-config ``data_type`` of a v2 datatype (``FP32`` -> ``TYPE_FP32``; BYTES is
    ``TYPE_STRING`` there)."""
    return "TYPE_STRING" if datatype == BYTES else "TYPE_" + datatype


def dims_fit(declared: Sequence[int], model: Sequence[int]) -> bool:
    """Whether a config's dims agree with the model's (-1 on either side matches any size)."""
    return len(declared) == len(model) and all(a == b or a == -1 or b == -1 for a, b in zip(declared, model))


def config_datatype(type_name: str) -> str:
    """The v2 datatype of a model-config ``data_type`` name (:func:`config_type`'s inverse:
    ``TYPE_FP32`` -> ``FP32``, ``TYPE_STRING`` -> BYTES)."""
    return BYTES if type_name == "TYPE_STRING" else type_name[len("TYPE_"):]


def metadata_shape(shape: Sequence[int | str | None]) -> list[int]:
    """A plan's shape for model metadata: symbolic or unknown dims are ``-1``."""
    return [d if isinstance(d, int) else -1 for d in shape]


def check_shape(name: str, shape: Any) -> list[int]:
    """The request's shape as non-negative ints, or an INVALID_ARGUMENT naming the input."""
    if type(shape) is list and len(shape) <= MAX_RANK:  # what nearly every request sends: one pass
        for d in shape:
            if type(d) is not int or d < 0:
                break
        else:
            return shape
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise invalid(f"input {shown(name)}: 'shape' must be a list of integers, got {cut(shape)}")
    if len(shape) > MAX_RANK:
        raise invalid(f"input {shown(name)}: a shape of {len(shape)} dimensions; at most {MAX_RANK} are supported")
    if any(d < 0 for d in shape):
        raise invalid(f"input {shown(name)}: shape {list(shape)} has a negative dimension")
    return [int(d) for d in shape]


def _dtype_for(name: str, datatype: Any) -> np.dtype:
    if datatype == BYTES:
        return STRING_DTYPE
    if datatype not in DATATYPES:
        raise invalid(
            f"input {shown(name)}: datatype {shown(datatype)} is not one this server speaks ({', '.join(SPOKEN)})"
        )
    return DATATYPES[datatype]


def _text(name: str, index: int, value: bytes | bytearray | memoryview) -> str:
    """One BYTES element as the ``str`` ONNX Runtime takes, or the error naming its position."""
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"input {shown(name)}: element {index} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                      "ONNX Runtime's string tensors take text only") from None


def strings_from_raw(name: str, raw: bytes | bytearray | memoryview, count: int) -> np.ndarray:
    """``count`` BYTES elements from their serialized form (each a 4-byte little-endian length,
    then that many bytes: Triton's binary extension and gRPC's raw contents), as a flat object
    array of ``str``. Every byte must belong to an element: a length running past the end, or
    bytes left over, mean the client and server disagree about the tensor."""
    view = memoryview(raw).cast("B")
    offset, end = 0, len(view)
    if count > end // 4:  # before the array of ``count`` is made: a shape's claim is not memory to take
        raise invalid(f"input {shown(name)}: {end} bytes of data cannot hold the {count} BYTES elements its shape "
                      "holds (each is a 4-byte length, then its bytes)")
    out = np.empty(count, dtype=STRING_DTYPE)
    for i in range(count):
        if offset + 4 > end:
            raise invalid(f"input {shown(name)}: {end} bytes of data hold {i} BYTES elements, but its shape "
                          f"holds {count} (each is a 4-byte length, then its bytes)")
        size = int.from_bytes(view[offset:offset + 4], "little")
        offset += 4
        if offset + size > end:
            raise invalid(f"input {shown(name)}: element {i} claims {size} bytes, but only {end - offset} "
                          "are left in its data")
        out[i] = _text(name, i, view[offset:offset + size])
        offset += size
    if offset != end:
        raise invalid(f"input {shown(name)}: {end - offset} bytes follow its {count} BYTES elements")
    return out


def _strings_from_values(name: str, values: Any) -> np.ndarray:
    """BYTES elements given as values: JSON strings (HTTP) or ``bytes`` (gRPC ``bytes_contents``)."""
    flat = _leaves(values)
    out = np.empty(len(flat), dtype=STRING_DTYPE)
    for i, v in enumerate(flat):
        if type(v) is str:
            if not v.isascii():
                # JSON's "\ud800" escape (or those bytes, read with surrogatepass) is a lone
                # surrogate: no UTF-8 text, so ONNX Runtime's worker would fail the whole batch
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise invalid(f"input {shown(name)}: element {i} is not UTF-8 text (an unpaired surrogate "
                                  f"at character {exc.start}); ONNX Runtime's string tensors take text only") from None
            out[i] = v
        elif isinstance(v, (bytes, bytearray)):
            out[i] = _text(name, i, v)
        else:
            raise invalid(f"input {shown(name)}: data[{i}] = {cut(repr(v), 40)} is not a string "
                          "(BYTES takes JSON strings)")
    return out


def from_raw(name: str, datatype: Any, shape: Any, raw: bytes | bytearray | memoryview) -> np.ndarray:
    """A tensor from raw bytes (HTTP binary extension, gRPC raw_input_contents).

    The byte count must be exactly what the shape and datatype call for: a short or long
    buffer means the client and server disagree about the tensor, and guessing would hand the
    model garbage.
    """
    dims = check_shape(name, shape)
    dtype = _dtype_for(name, datatype)
    try:
        if dtype is STRING_DTYPE:
            return strings_from_raw(name, raw, math.prod(dims)).reshape(dims)
        expected = math.prod(dims) * dtype.itemsize
        if len(raw) != expected:
            raise invalid(
                f"input {shown(name)}: {len(raw)} bytes of data, but shape {dims} of {datatype} needs {expected}"
            )
        # frombuffer keeps a view on the request's bytes (no copy); the runtime only reads feeds
        return np.frombuffer(raw, dtype=dtype).reshape(dims)
    except ValueError as exc:  # a shape of no elements numpy cannot make ([0, 2**62, 8]): the client's
        raise _unmakeable(name, dims, exc) from None


def from_values(name: str, datatype: Any, shape: Any, values: Any) -> np.ndarray:
    """A tensor from typed values (HTTP JSON ``data``, flat or nested; gRPC ``contents``), strictly:
    numbers for the FP types (integers or not; ``NaN``/``Infinity`` as Python's json and
    tritonclient write them), integers for the INT and UINT types (a float only where it is
    integral: ``2.0``), ``true``/``false`` for BOOL, every value within its type's range. The
    first value that is not is refused (400 / INVALID_ARGUMENT) by its position in the flattened
    data: a string, a boolean, ``null`` or a truncated float must never become a number the
    client did not send.

    ``values`` may be a numpy array read straight from the JSON text
    (:mod:`staronnx.serve.jsontensors`), which only reads arrays already of the right kind.
    """
    dims = check_shape(name, shape)
    dtype = _dtype_for(name, datatype)
    if dtype is STRING_DTYPE:
        arr = _strings_from_values(name, values.tolist() if isinstance(values, np.ndarray) else values)
    elif isinstance(values, np.ndarray):
        arr = values if values.dtype == dtype else np.asarray(values, dtype=dtype)
    else:
        arr = _from_list(name, datatype, dtype, values)
    if arr.size != math.prod(dims):
        raise invalid(
            f"input {shown(name)}: {arr.size} values of data, but shape {dims} holds {math.prod(dims)}"
        )
    try:
        return arr.reshape(dims)
    except ValueError as exc:  # a shape of no elements numpy cannot make ([0, 10**30]): the client's
        raise _unmakeable(name, dims, exc) from None


def _unmakeable(name: str, dims: list[int], exc: ValueError) -> ProtocolError:
    return invalid(f"input {shown(name)}: shape {cut(dims)} cannot be made ({cut(exc)})")


class NumberOutOfRange(str):
    """A JSON number too large for a double (``1e309``), kept as its text by the parser so that
    it is refused by position rather than read as an infinity the client did not write."""


def parse_float(text: str) -> float | NumberOutOfRange:
    """``json.loads``'s ``parse_float``: the double, or :class:`NumberOutOfRange` past a double's range."""
    value = float(text)
    return NumberOutOfRange(text) if math.isinf(value) else value


def _leaves(values: Any) -> list[Any]:
    """The values of a (nested) list in row-major order; a scalar is one value."""
    if not isinstance(values, list):
        return [values]
    if not any(type(v) is list for v in values):
        return values
    out: list[Any] = []
    stack = [iter(values)]
    while stack:
        for v in stack[-1]:
            if type(v) is list:
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


#: what one value of a dtype's kind must be, and what its datatype takes, in JSON's words
_WANTS = {"b": ("true or false", "JSON booleans"), "i": ("an integer", "JSON integers"),
          "u": ("an integer", "JSON integers"), "f": ("a number", "JSON numbers")}


def _bad_value(name: str, datatype: str, dtype: np.dtype, index: int, value: Any) -> ProtocolError:
    """The error naming the input, the position of its first value ``datatype`` cannot take,
    the value as the client wrote it, and why."""
    try:
        text = str(value) if isinstance(value, NumberOutOfRange) else json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if dtype.kind in "iu" and number and not (isinstance(value, int) or float(value).is_integer()):
        why = f"is not an integer ({datatype} takes integers)"
    elif isinstance(value, NumberOutOfRange) or (number and dtype.kind != "b"):
        if dtype.kind == "f":
            why = f"is out of the range of {datatype} ({np.finfo(dtype).min:g} to {np.finfo(dtype).max:g})"
        else:
            why = f"is out of the range of {datatype} ({np.iinfo(dtype).min} to {np.iinfo(dtype).max})"
    else:
        wants, takes = _WANTS[dtype.kind]
        why = f"is not {wants} ({datatype} takes {takes})"
    return invalid(f"input {shown(name)}: data[{index}] = {cut(text, 40)} {why}")


def _fits(value: Any, dtype: np.dtype) -> bool:
    """Whether one JSON value is of ``dtype``'s kind and within its range."""
    t = type(value)
    if dtype.kind == "b":
        return t is bool
    if t is bool or t not in (int, float):
        return False
    if dtype.kind == "f":
        return t is float or abs(value) <= _FLOAT_MAX
    if t is float and not (math.isfinite(value) and value.is_integer()):
        return False
    info = np.iinfo(dtype)
    return bool(info.min <= value <= info.max)


#: the largest finite double: an integer past it has no float value at all
_FLOAT_MAX = float(np.finfo(np.float64).max)


def _from_list(name: str, datatype: str, dtype: np.dtype, values: Any) -> np.ndarray:
    flat = _leaves(values)
    kinds = set(map(type, flat))
    fast = (kinds <= {bool} if dtype.kind == "b" else kinds <= {int, float} if dtype.kind == "f" else kinds <= {int})
    if fast and dtype.kind in "iu" and flat:
        info = np.iinfo(dtype)
        fast = info.min <= min(flat) and max(flat) <= info.max
    if fast and dtype.kind == "f" and int in kinds:
        fast = all(abs(v) <= _FLOAT_MAX for v in flat if type(v) is int)
    if not fast:
        for i, v in enumerate(flat):
            if not _fits(v, dtype):
                raise _bad_value(name, datatype, dtype, i, v)
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            arr = np.asarray(values, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as exc:  # a ragged nest
        raise invalid(f"input {shown(name)}: data is not a (nested) list of {datatype} values: {cut(exc)}") from None
    if dtype.kind == "f" and dtype.itemsize < 8:
        # a finite double past the type's range would become an infinity the client never sent
        for at in np.flatnonzero(np.isinf(arr.reshape(-1))).tolist():
            v = flat[at]
            if not (type(v) is float and math.isinf(v)):
                raise _bad_value(name, datatype, dtype, at, v)
    return arr


def output_datatype(array: np.ndarray, declared: str) -> str:
    """An output's datatype on the wire: BYTES for a string tensor or a classification (object
    arrays of ``str`` or ``bytes``)."""
    return BYTES if array.dtype.kind in "OSU" else declared


def element_bytes(value: Any) -> bytes:
    """One BYTES element of an output: ``str`` (ONNX Runtime's strings) as UTF-8, bytes as they are."""
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


def to_raw(array: np.ndarray) -> bytes:
    """Row-major little-endian bytes of an output (BYTES: each element's 4-byte length, then it)."""
    raw = raw_view(array)
    return raw if isinstance(raw, bytes) else raw.tobytes()


def raw_view(array: np.ndarray) -> bytes | memoryview:
    """:func:`to_raw`'s bytes, as a view of the array's own memory where it already is row-major
    little-endian (most outputs: an answer's rows of its batch's output), so a body assembled
    from it copies each output once, where ``tobytes`` and then the body's join copied it twice."""
    if array.dtype.kind in "OSU":
        return b"".join(len(b).to_bytes(4, "little") + b for b in map(element_bytes, array.ravel()))
    arr = np.ascontiguousarray(array)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    try:
        return memoryview(arr).cast("B")
    except (TypeError, ValueError):  # a dtype without a buffer format (datetime64, ...)
        return arr.tobytes()


def classify(array: np.ndarray, k: int, axis: int | None, labels: Sequence[str] = ()) -> np.ndarray:
    """Triton's classification extension: the ``k`` largest values of each sample along the
    output's batch ``axis`` (of the whole tensor when it has none, None) as
    ``b"value:index[:label]"``, largest first; shape ``[batch, k]``, or ``[k]``."""
    batched = False
    if axis is not None and array.ndim > 1 and axis < array.ndim:
        array, batched = np.moveaxis(array, axis, 0), True
    rows = array.reshape(array.shape[0], -1) if batched else array.reshape(1, -1)
    k = min(k, rows.shape[1])
    out = np.empty((rows.shape[0], k), dtype=object)
    for r, row in enumerate(rows):
        top = np.argsort(-row.astype(np.float64), kind="stable")[:k]
        for j, i in enumerate(top):
            text = f"{float(row[i]):f}:{int(i)}" + (f":{labels[i]}" if i < len(labels) else "")
            out[r, j] = text.encode()
    return out if batched else out[0]


def select_outputs(available: Sequence[str], requested: Sequence[str] | None, model: str) -> list[str]:
    """The outputs to return: those named (each must exist), else all of the model's."""
    if not requested:
        return list(available)
    unknown = [n for n in requested if n not in available]
    if unknown:
        raise invalid(f"model {shown(model)} has no output(s) {', '.join(shown(n) for n in unknown[:8])}; "
                      f"its outputs are {list(available)}")
    return list(dict.fromkeys(requested))


def queue_parameters(parameters: Any) -> tuple[int, int | None]:
    """A request's ``priority`` (0: its model's default level) and ``timeout`` (microseconds it
    may wait in the queue; None: not given) from its parameters, as Triton's clients send them
    (``infer(..., priority=, timeout=)``: JSON numbers over HTTP, ``uint64_param`` and
    ``int64_param`` over gRPC); a value that is not a non-negative integer is refused by name."""
    values: list[int | None] = []
    for key in ("priority", "timeout"):
        value = parameters.get(key)
        if value is None:
            values.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise invalid(f"request parameter {key!r} must be a non-negative integer"
                          + (" (microseconds)" if key == "timeout" else "") + f", got {cut(value, 40)}")
        values.append(value)
    return values[0] or 0, values[1]


