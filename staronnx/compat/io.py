"""Data in and out of a session as ORT scripts hand it over: arrays, lists, host OrtValues,
IOBinding, and the C session's ``run_with_ort_values``.

Staronnx's workers move data between devices themselves (pinned buffers, prefetch), so only
host memory is taken and given back (arrays, CPU OrtValues, or IOBinding's host pointers); a
device pointer or OrtValue is refused, naming what to pass instead.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_state

from staronnx.compat.model import NodeArg
from staronnx.plan import TensorSpec, _numpy_dtype

#: what ORT's run methods take: the outputs asked (None or [] for all), the feeds, the run's options
type Names = Sequence[str] | None
type Feeds = Mapping[str, Any]
type RunOptionsArg = ort.RunOptions | None


class Session(Protocol):
    """What IOBinding and the C session stand-in call back: the session's own run methods (the
    session is not imported here, since it imports these)."""

    def run(self, output_names: Names, input_feed: Feeds, run_options: RunOptionsArg = None) -> list[np.ndarray]: ...

    def run_with_ort_values(self, output_names: Names, input_dict_ort_values: Mapping[str, ort.OrtValue],
                            run_options: RunOptionsArg = None) -> list[ort.OrtValue]: ...

    def get_inputs(self) -> list[NodeArg]: ...

    def get_outputs(self) -> list[NodeArg]: ...


class IOBinding:
    """ORT's IOBinding for host memory: inputs bound as arrays, CPU OrtValues or host pointers
    (``bind_input(name, "cpu", 0, np.float32, shape, array.ctypes.data)``), outputs returned as
    OrtValues or written into bound ones (an OrtValue, or a host pointer). Staronnx moves data
    between devices itself (pinned buffers, prefetch), so device pointers are refused: bind host
    memory."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self._inputs: dict[str, np.ndarray] = {}
        self._outputs: dict[str, ort.OrtValue | None] = {}
        self._results: list[ort.OrtValue] = []

    def _known_input(self, name: str, words: str) -> None:
        """An input name the model does not have is refused when it is bound, as ORT refuses it
        (a plain RuntimeError, in ORT's words), not at the run that reads the binding."""
        if name not in {i.name for i in self._session.get_inputs()}:
            raise RuntimeError(words.format(name=name))

    def bind_cpu_input(self, name: str, arr_on_cpu: np.ndarray) -> None:
        self._known_input(name, "Failed to find NodeArg with name: {name} in the def list")
        self._inputs[name] = arr_on_cpu

    def bind_input(self, name: str, device_type: str, device_id: int, element_type: Any,
                   shape: Sequence[int], buffer_ptr: int) -> None:
        """ORT's form for memory at a pointer; host memory (``"cpu"``) is taken, read when the
        binding runs (as ORT reads it), so what is written there until then is what runs."""
        if device_type != "cpu":
            raise NotImplementedError(f"staronnx binds host memory only (not {device_type!r}): use bind_input(name, "
                                      "'cpu', 0, dtype, shape, host_pointer), bind_cpu_input(name, array) or "
                                      "bind_ortvalue_input(name, cpu_ortvalue)")
        self._known_input(name, "Error when binding input: Failed to find input name in the mapping: {name}")
        self._inputs[name] = host_buffer(element_type, shape, buffer_ptr)

    def bind_ortvalue_input(self, name: str, ortvalue: ort.OrtValue) -> None:
        self._known_input(name, "Error when binding input: Failed to find input name in the mapping: {name}")
        self._inputs[name] = host_array(ortvalue, name)

    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0,
                    element_type: Any = None, shape: Sequence[int] | None = None,
                    buffer_ptr: int | None = None) -> None:
        """ORT's form: the output returned in memory the run allocates, or written into host
        memory at ``buffer_ptr`` (``element_type`` and ``shape`` given, as ORT requires)."""
        if device_type != "cpu":
            raise NotImplementedError(f"staronnx returns outputs in host memory only (not {device_type!r}): use "
                                      "bind_output(name), a host pointer, or bind_ortvalue_output(name, cpu_ortvalue)")
        if buffer_ptr is None:
            self._outputs[name] = None
            return
        if element_type is None or shape is None:  # ORT's words and type
            raise ValueError("`element_type` and `shape` are to be provided if pre-allocated memory is provided")
        # an OrtValue over the caller's memory: the run writes the output there, as ORT's does
        self._outputs[name] = ort.OrtValue.ortvalue_from_numpy(host_buffer(element_type, shape, buffer_ptr))

    def bind_ortvalue_output(self, name: str, ortvalue: ort.OrtValue) -> None:
        host_array(ortvalue, name)  # refuses device memory now, not at run
        self._outputs[name] = ortvalue

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()

    def synchronize_inputs(self) -> None:
        """Nothing to wait for: bound inputs are host arrays."""

    def synchronize_outputs(self) -> None:
        """Nothing to wait for: run_with_iobinding returns once outputs are on the host."""

    def get_outputs(self) -> list[ort.OrtValue]:
        return list(self._results)

    def get_outputs_as_ortvaluevector(self) -> Any:
        """The outputs of the last run as ORT's OrtValueVector (what ORT's own method returns)."""
        vector = _ort_state.OrtValueVector()
        for value in self._results:
            vector.push_back(value._ortvalue)
        return vector

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        """Copies, as ORT's are: an output bound into an OrtValue (or host memory) is written
        again in place by the next run, and a view of it changed under a script that kept it."""
        return [np.array(v.numpy(), copy=True) for v in self._results]

    def _run(self, run_options: RunOptionsArg = None) -> None:
        if not self._outputs:  # ORT refuses it: a script that ran here would fail on ORT
            raise RuntimeError("Error in execution: At least one output should be requested.")
        names = list(self._outputs)
        try:
            arrays = self._session.run(names, self._inputs, run_options)
        except ValueError as exc:
            raise RuntimeError(f"Error in execution: {exc}") from exc  # ORT's type here
        results = []
        declared = {o.name: o.type for o in self._session.get_outputs()}
        for name, array in zip(names, arrays):
            value = self._outputs.get(name)
            if value is None:
                value = ort.OrtValue.ortvalue_from_numpy(array)
            else:
                # update_inplace copies bytes whatever the OrtValue's type: a float64 value given
                # float32 output would hold meaningless numbers; ORT refuses the run (its words)
                if value.data_type() != declared.get(name, value.data_type()):
                    raise RuntimeError(f"Error in execution: Unexpected output data type. Actual: "
                                       f"({value.data_type()}) , expected: ({declared[name]})")
                # nor does it look at the shape: a [3, 2] value given a [2, 3] output held its
                # bytes under the wrong shape, and ORT refuses the run (its words)
                _check_bound_shape(name, list(value.shape()), list(np.shape(array)))
                value.update_inplace(np.ascontiguousarray(array))
            results.append(value)
        self._results = results


def _check_bound_shape(name: str, bound: list[int], computed: list[int]) -> None:
    """Refuse an output bound at a shape other than the one the run computed, as ORT does."""
    if len(bound) != len(computed):
        raise RuntimeError(f"Error in execution: Invalid rank for output: {name} Got: {len(bound)} Expected: "
                           f"{len(computed)} Please fix either the inputs/outputs or the model.")
    wrong = [f" index: {i} Got: {b} Expected: {c}\n" for i, (b, c) in enumerate(zip(bound, computed)) if b != c]
    if wrong:
        raise RuntimeError(f"Error in execution: Got invalid dimensions for output: {name} for the following indices\n"
                           f"{''.join(wrong)} Please fix either the inputs/outputs or the model.")


def host_buffer(element_type: Any, shape: Sequence[int], buffer_ptr: int) -> np.ndarray:
    """The host memory at ``buffer_ptr`` as an array of ``shape`` and ``element_type`` (numpy's
    type, as ORT takes it): a view, not a copy, so the memory is read and written when a run
    reads or writes it, as ORT does."""
    dtype = np.dtype(element_type)
    dims = tuple(int(d) for d in shape)
    count = int(np.prod(dims, dtype=np.int64))
    if count == 0:
        return np.empty(dims, dtype)
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(int(buffer_ptr))
    return np.frombuffer(raw, dtype=dtype, count=count).reshape(dims)


def host_memory() -> ort.OrtMemoryInfo:
    """Host memory as ORT's CPU provider describes it."""
    return ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)


class CSession:
    """The part of ORT's C session (``InferenceSession._sess``) that scripts call directly:
    ``run_with_ort_values`` on C OrtValues, answered with ORT's OrtValueVector, and ``run``."""

    def __init__(self, session: Session) -> None:
        self._session = session

    def run(self, output_names: Names, input_feed: Feeds, run_options: RunOptionsArg = None) -> list[np.ndarray]:
        return self._session.run(output_names, input_feed, run_options)

    def run_with_ort_values(self, feeds: Feeds, output_names: Names, run_options: RunOptionsArg = None) -> Any:
        vector = _ort_state.OrtValueVector()
        for value in self._session.run_with_ort_values(output_names, feeds, run_options):
            vector.push_back(value._ortvalue)
        return vector

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"staronnx.InferenceSession._sess has no {name!r}: it stands for ORT's C session only in "
                             "run and run_with_ort_values; use the session's own methods")


def owned_value(array: np.ndarray) -> ort.OrtValue:
    """An OrtValue holding its own copy of ``array`` (one that points into a numpy array
    would outlive it inside an OrtValueVector)."""
    if array.dtype == object:
        return ort.OrtValue.ortvalue_from_numpy(array)  # ORT copies strings into its own tensor
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), array.dtype)
    value.update_inplace(np.ascontiguousarray(array))
    return value


def feed_array(value: Any, name: str, spec: TensorSpec | None = None) -> Any:
    """A feed as the workers take it: lists and host OrtValues as arrays, as ORT accepts them (a
    sequence, optional or map input's value goes as given)."""
    if isinstance(value, ort.OrtValue):
        return host_array(value, name)
    if isinstance(value, np.ndarray) or spec is not None and "(" in spec.dtype:
        return value
    return np.asarray(value, dtype=_numpy_dtype(spec.dtype) if spec else None)


def host_array(value: Any, name: str) -> np.ndarray:
    """An OrtValue's data as a host array; device OrtValues are refused, since staronnx's
    workers copy to their own device themselves."""
    if value.device_name().lower() != "cpu":
        raise NotImplementedError(f"{name!r}: staronnx takes host OrtValues only (this one is on "
                                  f"{value.device_name()}); pass OrtValue.ortvalue_from_numpy(array)")
    return np.asarray(value.numpy())
