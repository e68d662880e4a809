"""staronnx against ONNX Runtime at its best, at equal concurrency, on a GPU server (issue 48).

One *row* per (model, precision, batch size, K), K the number of requests in flight. Every
setup of a row keeps at most K requests in flight:

- ``ortN`` (N in 1, 2, 4, 8, 16, N <= K): N plain ``InferenceSession``s with the CUDA provider,
  one thread each calling ``run()`` with numpy in and out (Triton's ``instance_group`` count);
- ``ort-tunedN`` (2N <= K: each thread keeps two requests in flight): N sessions as a careful
  user tunes ORT for a GPU, one thread each, each session on its own stream
  (``user_compute_stream``) with ``enable_cuda_graph``; two IO bindings per thread (two CUDA
  graphs, ``gpu_graph_id`` 0 and 1) over fixed device buffers, the host inputs and outputs in
  pinned memory, each request an async copy in, a graph replay with
  ``disable_synchronize_execution_providers``, an async copy out and an event; the thread
  launches one binding's request while the other's runs, and waits only for the older one
  (what staronnx's CUDA worker itself does);
- ``staronnx-sN`` (N streams, N <= K, 4 and 8): the 1-part plan on N CUDA workers, CUDA graphs
  captured at warm-up, K requests in flight (completion-order closed loop);
- on the K = 16 fp32 rows also ``gpu+cpu`` (the same plan on the CUDA workers and the CPU
  groups, dmda) and ``auto`` (``--shares auto``, heft), each weighed against ``staronnx-s4``,
  the GPU alone with the same streams.

Each figure is the median of ``--repeats`` (>= 3 on a GPU) measurements of ``--seconds`` (>= 2)
taken in turn (setup after setup, the order rotated each repeat, so drifting clocks and a
noisy neighbour hit every setup alike), with min and max; every repeat is in the JSON. A row's
headline is the better of staronnx's medians over the better of plain ORT's medians (the same
selection on both sides), and a ratio is claimed only where the two min-max ranges do not
overlap (``benchmarks/gpu_table.py`` prints the table from the JSON).

Precisions: ``fp32`` (TF32 off on both sides), ``tf32`` (on for both), ``fp16`` (the model
converted by onnxconverter-common, I/O kept fp32, both sides run that model). The matrix is
ordered so that what matters most is measured first: googlenet and resnet50 fp32 at K = 16,
then K = 4, then the encoder, then the TF32 and fp16 rows. ``--resume FILE`` keeps FILE's rows
measured on the same GPU model and measures only the others; ``--budget SECONDS`` stops before
a row that would not finish in time (a call's limit then never cuts a row in half). Each row is
written to the JSON as soon as it is measured.

Models (``benchmarks/gpu_models.py``, exported on the host, random weights): googlenet,
resnet50 and a BERT-base-sized encoder at sequence 128. ``--device cpu`` runs the same harness
with the CPU provider, staronnx's CUDA workers and ort-tuned's streams on the CUDA stand-in
(``STARONNX_CUDA_RUNTIME=host``), on tiny models (CI's smoke test; its figures mean nothing).

Usage (GPU host): python benchmarks/gpu.py --models-dir DIR [--resume benchmarks/results/gpu-....json]
                  [--budget 360] [--json gpu.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).parent))
from _common import REPO, scratch_dir  # noqa: E402
from gpu_table import GPU_ALONE, SCHEMA, headline, verdict  # noqa: E402,F401
from staronnx.partition import PartitionSpec
from staronnx.workers.layout import MachineSpec

CUDA = "CUDAExecutionProvider"
#: the matrix's dimensions, in the order they are measured
MODELS = ("googlenet", "resnet50", "encoder")
PRECISIONS = ("fp32", "tf32", "fp16")
KS = (16, 4)
BATCHES = (1, 8, 32)
SESSIONS = (1, 2, 4, 8, 16)
STREAMS = (4, 8)
#: the floor of a figure of record on a GPU (issue 48): >= 3 repeats of >= 2 s
MIN_REPEATS, MIN_SECONDS = 3, 2.0


# ---------------------------------------------------------------------- the matrix
@dataclass(frozen=True)
class Key:
    """One row of the table."""

    model: str
    precision: str
    batch: int
    k: int

    @property
    def id(self) -> str:
        return f"{self.model}/{self.precision}/b{self.batch}/k{self.k}"


def matrix(models: list[str], precisions: list[str], ks: list[int], batches: list[int]) -> list[Key]:
    """The rows in the order they are measured: per precision (fp32 first), the CNNs before the
    encoder, the larger K first, then each model and batch size."""
    keys = []
    for precision in precisions:
        for group in ([m for m in models if m != "encoder"], [m for m in models if m == "encoder"]):
            for k in sorted(ks, reverse=True):
                keys += [Key(m, precision, b, k) for m in group for b in batches]
    return keys


# ---------------------------------------------------------------------- models and inputs
def cpu_stand_in(name: str, out: Path, sequence: int) -> Path:
    """The tiny model ``--device cpu`` runs for ``name``: a small inception net for the CNNs, one
    transformer block (dynamic sequence) for the encoder."""
    from staronnx.zoo import inception, transformer_block

    path = out / f"tiny-{'encoder' if name == 'encoder' else 'cnn'}.onnx"
    if not path.exists():
        model = transformer_block(d_model=32, heads=2, ff=64) if name == "encoder" else inception(blocks=2, channels=8,
                                                                                                   size=16)
        onnx.save(model, str(path))
    return path


def to_fp16(path: Path) -> Path:
    """``path`` converted to fp16 with onnxconverter-common, inputs and outputs kept fp32."""
    out = path.with_name(path.stem + "-fp16.onnx")
    if out.exists():
        return out
    try:
        from onnxconverter_common import float16
    except ImportError:
        raise Skip("fp16 rows need onnxconverter-common (not installed here)") from None
    model = float16.convert_float_to_float16(onnx.load(str(path)), keep_io_types=True)
    onnx.save(model, str(out))
    return out


class Skip(Exception):
    """A row that cannot run here (what it lacks is its message): reported, not recorded, so
    a later run measures it."""


def model_file(key: Key, args: argparse.Namespace) -> Path:
    if args.device == "cpu":
        path = cpu_stand_in(key.model, args.models_dir, args.sequence)
    else:
        from gpu_models import export

        path = export(key.model, args.models_dir)
    return to_fp16(path) if key.precision == "fp16" else path


def input_shapes(path: Path, batch: int, sequence: int) -> dict[str, list[int]]:
    """Each input's shape: the batch on axis 0, ``sequence`` for any other dynamic dim."""
    model = onnx.load(str(path), load_external_data=False)
    shapes = {}
    for i in model.graph.input:
        dims = i.type.tensor_type.shape.dim
        shapes[i.name] = [batch if k == 0 else (d.dim_value if d.dim_value > 0 else sequence)
                          for k, d in enumerate(dims)]
    return shapes


def inputs_for(path: Path, batch: int, sequence: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs: standard normal floats, token ids in [0, 1000) for integer inputs."""
    model = onnx.load(str(path), load_external_data=False)
    rng = np.random.default_rng(seed)
    shapes = input_shapes(path, batch, sequence)
    feeds = {}
    for i in model.graph.input:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        shape = shapes[i.name]
        feeds[i.name] = (rng.integers(0, 1000, shape).astype(dtype) if np.issubdtype(dtype, np.integer)
                         else rng.standard_normal(shape).astype(dtype))
    return feeds


# ---------------------------------------------------------------------- plain ORT
def providers(device: str, tf32: bool, **extra: str) -> list[Any]:
    if device != "cuda":
        return ["CPUExecutionProvider"]
    return [(CUDA, {"use_tf32": "1" if tf32 else "0", **extra}), "CPUExecutionProvider"]


def check_on_cuda(session: ort.InferenceSession) -> None:
    """Exit (one line) when ``session`` did not get ORT's CUDA provider (a CUDA or cuDNN library
    it cannot load makes ORT fall back to the CPU with a log line only: the ORT columns would
    then be CPU figures in a GPU table)."""
    got = session.get_providers()
    if not got or got[0] != CUDA:
        raise SystemExit(f"benchmarks/gpu.py: a plain ONNX Runtime session asked for {CUDA} runs on {got}: "
                         "ORT fell back to the CPU (a CUDA or cuDNN library it could not load; see its "
                         "warning above), so the ORT baselines would not be GPU figures")


def ort_sessions(path: Path, n: int, device: str, tf32: bool = False) -> list[ort.InferenceSession]:
    """N plain sessions; on ``cuda``, refused unless ORT really runs them on its CUDA provider."""
    from staronnx.workers.cudart import capture_safe

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if device != "cuda":
        so.intra_op_num_threads = 1  # N sessions in N threads on a small CPU
    with capture_safe():  # never breaks (nor is broken by) a graph staronnx captures meanwhile
        sessions = [ort.InferenceSession(str(path), so, providers=providers(device, tf32)) for _ in range(n)]
    if device == "cuda":
        check_on_cuda(sessions[0])
    return sessions


class Setup:
    """One column of a row: kept open across the row's repeats."""

    label: str
    in_flight: int

    def measure(self, seconds: float) -> float:
        """Samples per second over ``seconds``."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class PlainOrt(Setup):
    """``ortN``: N sessions, one thread each calling ``run()`` in a loop."""

    def __init__(self, sessions: list[ort.InferenceSession], feeds: dict[str, np.ndarray], batch: int) -> None:
        self.sessions, self.feeds, self.batch = sessions, feeds, batch
        self.label, self.in_flight = f"ort{len(sessions)}", len(sessions)

    def measure(self, seconds: float) -> float:
        from staronnx.workers.cudart import capture_safe

        counts = [0] * len(self.sessions)
        stop = threading.Event()

        def loop(i: int) -> None:
            with capture_safe():
                while not stop.is_set():
                    self.sessions[i].run(None, self.feeds)
                    counts[i] += 1

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(self.sessions))]
        start = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        return self.batch * sum(counts) / (time.perf_counter() - start)


class _Slot:
    """One binding of a tuned lane: pinned host buffers, device buffers, the binding, its
    graph id, its event."""

    def __init__(self, lane: _TunedLane, graph_id: int, feeds: dict[str, np.ndarray],
                 outputs: dict[str, np.ndarray]) -> None:
        rt = lane.rt
        self.buffers: list[Any] = []
        self.inputs: list[tuple[int, int, int]] = []  # (device ptr, pinned ptr, bytes)
        self.outputs: list[tuple[int, int, int]] = []
        self.host_out: dict[str, np.ndarray] = {}
        self.binding = lane.session.io_binding()
        for name, a in feeds.items():
            pinned, dev = rt.pinned(a.nbytes), rt.device_buffer(a.nbytes)
            self.buffers += [pinned, dev]
            pinned.view(a.dtype, a.shape)[...] = a
            self.inputs.append((dev.ptr, pinned.ptr, a.nbytes))
            self.binding.bind_input(name, rt.ort_device_type, 0, a.dtype.type, list(a.shape), dev.ptr)
        for name, o in outputs.items():
            pinned, dev = rt.pinned(o.nbytes), rt.device_buffer(o.nbytes)
            self.buffers += [pinned, dev]
            self.host_out[name] = pinned.view(o.dtype, o.shape)
            self.outputs.append((pinned.ptr, dev.ptr, o.nbytes))
            self.binding.bind_output(name, rt.ort_device_type, 0, o.dtype.type, list(o.shape), dev.ptr)
        self.options = ort.RunOptions()
        self.options.log_severity_level = 4
        self.options.add_run_config_entry("gpu_graph_id", str(graph_id))
        self.options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        session = lane.session
        run = lambda b, o: session.run_with_iobinding(b, o)  # noqa: E731
        self.run = rt.graph_run(session, run, graph_id) if graph_id >= 0 else run
        self.event = rt.event(timing=False)


class _TunedLane:
    """One ort-tuned thread's session, stream and two slots (made on that thread: ORT keeps
    CUDA graphs per thread)."""

    def __init__(self, rt: Any, path: Path, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray],
                 device: str, tf32: bool, graphs: bool = True) -> None:
        self.rt = rt
        rt.set_device(0)
        self.stream = rt.stream()
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if device != "cuda":
            so.intra_op_num_threads = 1
        extra = {"device_id": "0", "user_compute_stream": str(self.stream.handle), "do_copy_in_default_stream": "0",
                 **({"enable_cuda_graph": "1"} if graphs else {})}
        self.session = ort.InferenceSession(str(path), so, providers=providers(device, tf32, **extra))
        if device == "cuda":
            check_on_cuda(self.session)
        self.slots = [_Slot(self, g if graphs else -1, feeds, outputs) for g in (0, 1)]

    def launch(self, slot: _Slot) -> None:
        for dst, src, n in slot.inputs:
            self.rt.copy_h2d(dst, src, n, self.stream)
        slot.run(slot.binding, slot.options)
        for dst, src, n in slot.outputs:
            self.rt.copy_d2h(dst, src, n, self.stream)
        slot.event.record(self.stream)

    def warm(self) -> dict[str, np.ndarray]:
        """Discovery, capture and a replay of each slot's graph; the first slot's outputs."""
        for _ in range(3):
            for slot in self.slots:
                self.launch(slot)
                slot.event.synchronize()
        return {k: v.copy() for k, v in self.slots[0].host_out.items()}

    def run_until(self, deadline: float) -> tuple[int, float]:
        """Requests completed (two in flight, the older waited for first) until ``deadline``,
        and when the last one completed."""
        a, b = self.slots
        self.launch(a)
        self.launch(b)
        done = 0
        while time.perf_counter() < deadline:
            a.event.synchronize()
            done += 1
            self.launch(a)
            a, b = b, a
        for slot in (a, b):
            slot.event.synchronize()
        return done + 2, time.perf_counter()

    def latency_ms(self, n: int = 30) -> float:
        slot = self.slots[0]
        times = []
        for _ in range(n + 3):
            t0 = time.perf_counter()
            self.launch(slot)
            slot.event.synchronize()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times[3:])

    def close(self) -> None:
        for slot in self.slots:
            for buf in slot.buffers:
                buf.free()
            slot.event.destroy()
        self.stream.destroy()


class TunedOrt(Setup):
    """``ort-tunedN``: N lanes, each on a thread of its own kept for the whole row (made one at
    a time: a capture in CUDA's global mode breaks on another thread's allocation)."""

    def __init__(self, n: int, rt: Any, path: Path, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray],
                 device: str, tf32: bool, batch: int, graphs: bool = True) -> None:
        self.label, self.in_flight, self.batch, self.graphs = f"ort-tuned{n}", 2 * n, batch, graphs
        self._commands: list[queue.SimpleQueue[tuple[str, Any]]] = [queue.SimpleQueue() for _ in range(n)]
        self._answers: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self.output: dict[str, np.ndarray] = {}
        try:
            for i in range(n):
                t = threading.Thread(target=self._serve, args=(i, rt, path, feeds, outputs, device, tf32, graphs),
                                     daemon=True)
                t.start()
                self._threads.append(t)
                _, warmed = self._answers.get()
                if isinstance(warmed, BaseException):
                    raise warmed
                self.output = self.output or warmed
        except BaseException:
            self.close()
            raise

    def _serve(self, i: int, rt: Any, path: Path, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray],
               device: str, tf32: bool, graphs: bool) -> None:
        from staronnx.workers.cudart import capture_safe

        with capture_safe():
            try:
                lane = _TunedLane(rt, path, feeds, outputs, device, tf32, graphs=graphs)
                self._answers.put((i, lane.warm()))
            except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
                self._answers.put((i, exc))
                return
            while True:
                command, arg = self._commands[i].get()
                if command == "stop":
                    lane.close()
                    return
                try:
                    self._answers.put((i, getattr(lane, command)(arg)))
                except BaseException as exc:  # noqa: BLE001
                    self._answers.put((i, exc))

    def _ask(self, command: str, arg: Any, lanes: int | None = None) -> list[Any]:
        n = len(self._threads) if lanes is None else lanes
        for i in range(n):
            self._commands[i].put((command, arg))
        answers = [self._answers.get()[1] for _ in range(n)]
        for a in answers:
            if isinstance(a, BaseException):
                raise a
        return answers

    def measure(self, seconds: float) -> float:
        start = time.perf_counter()
        answers = self._ask("run_until", start + seconds)
        return float(self.batch * sum(n for n, _ in answers) / (max(end for _, end in answers) - start))

    def latency_ms(self) -> float:
        return float(self._ask("latency_ms", 30, lanes=1)[0])

    def close(self) -> None:
        for i, t in enumerate(self._threads):
            self._commands[i].put(("stop", None))
            t.join(timeout=60)
        self._threads = []


# ---------------------------------------------------------------------- staronnx
def closed_loop(submit: Callable[[], Future[Any]], wait: Callable[[Future[Any]], Any], in_flight: int,
                seconds: float) -> float:
    """Requests per second with ``in_flight`` outstanding for ``seconds`` (after a warm-up),
    each replaced as soon as it completes, in completion order (perf_analyzer's concurrency
    mode): waiting in submission order lets one slow request (a batch a CPU group took) hold
    back the window while the GPU idles. ``wait`` reads a completed future (raises its error)."""
    finished: queue.SimpleQueue[Future[Any]] = queue.SimpleQueue()

    def launch() -> None:
        submit().add_done_callback(finished.put)

    for _ in range(in_flight):  # warm-up
        launch()
    for _ in range(in_flight):
        wait(finished.get())
    done, start = 0, time.perf_counter()
    for _ in range(in_flight):
        launch()
    while time.perf_counter() - start < seconds:
        wait(finished.get())
        done += 1
        launch()
    for _ in range(in_flight):
        wait(finished.get())
        done += 1
    return done / (time.perf_counter() - start)


def open_runtime(plan: Any, key: Key, batches: list[int], *, policy: str, groups: str, streams: int, store: Any,
                 trace: Path | None) -> Any:
    """A staronnx runtime with CUDA graphs, every batch size of the matrix captured at warm-up
    (it serves the rows of one model, precision and K in turn)."""
    from staronnx import CudaOptions, Runtime, RuntimeSpec

    cuda = CudaOptions(provider_options={"use_tf32": "1" if key.precision == "tf32" else "0"})
    return Runtime(plan, MachineSpec(groups, streams),
                   RuntimeSpec(policy, store=store, cuda=cuda, warmup=tuple(sorted(set(batches))), trace=trace))


class Staronnx(Setup):
    """An open staronnx runtime (:class:`Plans` owns it) at K requests in flight."""

    def __init__(self, label: str, rt: Any, feeds: dict[str, np.ndarray], key: Key) -> None:
        self.label, self.in_flight, self.batch, self.feeds, self.rt = label, key.k, key.batch, feeds, rt
        self.output = self.rt.run(feeds)

    def measure(self, seconds: float) -> float:
        return self.batch * closed_loop(lambda: self.rt.submit(self.feeds), lambda f: f.result(), self.in_flight,
                                        seconds)

    def latency_ms(self) -> float:
        from staronnx.partition.autoshares import median_seconds

        return 1e3 * float(median_seconds(lambda: self.rt.run(self.feeds), 30, warmup=3))

    def graph_stats(self) -> dict[str, int]:
        """CUDA graphs captured and replayed by the runtime so far (its rows together)."""
        graphs = [w.get("graphs") for w in self.rt.stats()["workers"].values() if w.get("graphs")]
        return {k: sum(g[k] for g in graphs) for k in graphs[0]} if graphs else {}


@dataclass
class Plans:
    """Each model file's plans (1 part; ``--shares auto``), made and calibrated once; and what
    the rows of one (model, precision, K) share, opened once for them: the plain sessions and
    the staronnx runtimes (a session's creation costs about a second on a GPU, and a runtime
    warms every batch size up at once). Tuned lanes are made per row: their bindings are."""

    tmp: Path
    args: argparse.Namespace
    store: Any
    made: dict[tuple[str, str], Any] = field(default_factory=dict)
    calibrated: set[tuple[str, str]] = field(default_factory=set)
    group: tuple[str, str, int] | None = None
    sessions: list[ort.InferenceSession] = field(default_factory=list)
    runtimes: dict[str, Any] = field(default_factory=dict)

    def get(self, path: Path, kind: str, sequence: int) -> Any:
        from staronnx import partition

        key = (str(path), kind)
        if key not in self.made:
            shapes: dict[str, Sequence[int]] = dict(input_shapes(path, 1, sequence))
            out = self.tmp / f"{path.stem}-{kind}"
            device = "cuda" if self.args.device == "cuda" else "cpu"
            if kind == "one":
                self.made[key] = partition(path,
                                           spec=PartitionSpec(parts=1, costs="estimate", device=device,
                                                              input_shapes=shapes), output_dir=out)
            else:
                self.made[key] = partition(path, "auto",
                                           PartitionSpec(device=device, profile_runs=3, groups=self.args.groups,
                                                         input_shapes=shapes, cuda_streams=4 if device == "cuda" else 0,
                                                         profile_batch=8), output_dir=out)
        return self.made[key]

    def calibrate(self, plan: Any, groups: str, streams: int) -> None:
        """Perf models at every batch size of the matrix, for the dmda/heft setups (the eager
        ones need none)."""
        from staronnx.calibrate import calibrate, start_workers

        key = (plan.hash, groups)
        if key in self.calibrated:
            return
        self.calibrated.add(key)
        workers = start_workers(plan, MachineSpec(groups=groups, cuda_streams=streams))
        try:
            calibrate(plan, sorted(set(self.args.batches)), workers=workers, store=self.store, max_runs=30)
        finally:
            for w in workers:
                w.close()

    def enter(self, key: Key) -> None:
        """``key``'s row comes next: what another (model, precision, K) opened is closed."""
        group = (key.model, key.precision, key.k)
        if group != self.group:
            self.close()
            self.group = group

    def plain(self, path: Path, n: int, tf32: bool) -> list[ort.InferenceSession]:
        if len(self.sessions) < n:
            self.sessions += ort_sessions(path, n - len(self.sessions), self.args.device, tf32)
        return self.sessions[:n]

    def runtime(self, label: str, make: Callable[[], Any]) -> Any:
        if label not in self.runtimes:
            self.runtimes[label] = make()
        return self.runtimes[label]

    def close(self) -> None:
        for rt in self.runtimes.values():
            rt.close()
        self.runtimes, self.sessions, self.group = {}, [], None


# ---------------------------------------------------------------------- one row
def rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - ref).max() / max(float(np.abs(ref).max()), 1e-12))


def summary(values: list[float]) -> dict[str, Any]:
    return {"repeats": values, "median": statistics.median(values), "min": min(values), "max": max(values)}


def build_setups(key: Key, path: Path, feeds: dict[str, np.ndarray], outputs: dict[str, np.ndarray],
                 args: argparse.Namespace, plans: Plans, say: Callable[[str], None],
                 notes: list[str]) -> list[Setup]:
    """The row's setups, opened. Plain ORT must open; any other setup that cannot is a note of
    the row (one line: what failed), and ort-tuned is tried again without CUDA graphs where ORT
    refuses them (a model whose shape nodes stay on the CPU): ORT at its best where ORT allows."""
    from staronnx.workers.cudart import CudaRuntime, HostRuntime

    tf32 = key.precision == "tf32"
    setups: list[Setup] = []

    def attempt(label: str, make: Callable[[], Setup]) -> Setup | None:
        say(f"{key.id}: {label}")
        try:
            setup = make()
        except Exception as exc:  # noqa: BLE001 - a setup that cannot run is a note, not the end of the run
            notes.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            say(f"{key.id}: {notes[-1]}")
            return None
        setups.append(setup)
        return setup

    try:
        ns = [n for n in SESSIONS if n <= key.k]
        say(f"{key.id}: {max(ns)} plain sessions (each run once: cuDNN's search before any timing)")
        sessions = plans.plain(path, max(ns), tf32)
        for session in sessions:
            session.run(None, feeds)
        setups += [PlainOrt(sessions[:n], feeds, key.batch) for n in ns]
        rt = CudaRuntime() if args.device == "cuda" else HostRuntime()
        def tuned(n: int, graphs: bool) -> Callable[[], Setup]:
            return lambda: TunedOrt(n, rt, path, feeds, outputs, args.device, tf32, key.batch, graphs=graphs)

        for n in (n for n in SESSIONS if 2 * n <= key.k):
            if attempt(f"ort-tuned{n}", tuned(n, True)) is None:
                if attempt(f"ort-tuned{n} without CUDA graphs", tuned(n, False)) is not None:
                    notes.append(f"ort-tuned{n} ran without CUDA graphs")
        one = plans.get(path, "one", args.sequence)

        def alone(label: str, streams: int) -> Callable[[], Setup]:
            return lambda: Staronnx(label, plans.runtime(label, lambda: open_runtime(
                one, key, args.batches, policy="eager", groups="none", streams=streams, store=plans.store,
                trace=trace_path(args, key, label))), feeds, key)

        for streams in (n for n in STREAMS if n <= key.k):
            attempt(f"staronnx-s{streams}", alone(f"staronnx-s{streams}", streams))
        if key.k == max(args.ks) and key.precision == "fp32" and not args.no_cpu_help:
            def mixed() -> Setup:
                plans.calibrate(one, args.groups, 4)
                return Staronnx("gpu+cpu", plans.runtime("gpu+cpu", lambda: open_runtime(
                    one, key, args.batches, policy="dmda", groups=args.groups, streams=4, store=plans.store,
                    trace=trace_path(args, key, "gpu+cpu"))), feeds, key)

            def auto() -> Setup:
                plan = plans.get(path, "auto", args.sequence)
                notes.append(f"auto: {plan.settings['auto_shares']['reason']}")
                plans.calibrate(plan, args.groups, 4)
                return Staronnx("auto", plans.runtime("auto", lambda: open_runtime(
                    plan, key, args.batches, policy="heft", groups=args.groups, streams=4, store=plans.store,
                    trace=trace_path(args, key, "auto"))), feeds, key)

            attempt("gpu+cpu", mixed)
            attempt("auto", auto)
    except BaseException:
        for s in setups:
            s.close()
        raise
    return setups


def trace_path(args: argparse.Namespace, key: Key, label: str) -> Path | None:
    if args.trace is None or label not in args.trace_setups:
        return None
    folder: Path = args.trace
    # one runtime serves the rows of a (model, precision, K): its trace holds them all
    return folder / f"trace-{key.model}-{key.precision}-k{key.k}-{label.replace('+', '_')}.json"


def measure_row(key: Key, args: argparse.Namespace, plans: Plans, say: Callable[[str], None]) -> dict[str, Any]:
    """Every setup of ``key``'s row, ``--repeats`` times in turn."""
    t0 = time.perf_counter()
    plans.enter(key)
    path = model_file(key, args)
    feeds = inputs_for(path, key.batch, args.sequence)
    ref_session = ort_sessions(path, 1, args.device, key.precision == "tf32")[0]
    names = [o.name for o in ref_session.get_outputs()]
    outputs = dict(zip(names, ref_session.run(None, feeds), strict=True))
    ref = outputs[names[0]]
    notes: list[str] = []
    setups = build_setups(key, path, feeds, outputs, args, plans, say, notes)
    if plans.runtimes:
        notes.append("staronnx's runtimes are shared by the rows of this model, precision and K: their graph counts "
                     "and traces are those rows' together")
    row: dict[str, Any] = {"id": key.id, "model": key.model, "precision": key.precision, "batch": key.batch,
                           "k": key.k, "sequence": args.sequence if key.model == "encoder" else None,
                           "figures": {}, "errors": {}, "notes": notes}
    try:
        samples: dict[str, list[float]] = {s.label: [] for s in setups}
        for r in range(args.repeats):
            order = setups[r % len(setups):] + setups[:r % len(setups)]
            for s in order:
                samples[s.label].append(s.measure(args.seconds))
            say(f"{key.id}: repeat {r + 1}/{args.repeats} done")
        for s in setups:
            row["figures"][s.label] = {"in_flight": s.in_flight, **summary(samples[s.label])}
            out = getattr(s, "output", None)
            if out:
                row["errors"][s.label] = rel_error(out[names[0]], ref)
            if isinstance(s, Staronnx):
                stats = s.graph_stats()
                if stats:
                    row.setdefault("graph_stats", {})[s.label] = stats
        if key.batch == 1:  # latency of one request at a time (median of 30)
            lat = {"ort1": 1e3 * _median_run(lambda: ref_session.run(None, feeds))}
            for s in setups:
                if s.label in ("ort-tuned1", GPU_ALONE) and hasattr(s, "latency_ms"):
                    lat[s.label] = s.latency_ms()
            row["latency_ms"] = lat
    finally:
        for s in setups:
            s.close()
    if args.trace is not None:
        row["traced"] = sorted(set(args.trace_setups) & set(row["figures"]))
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _median_run(run: Callable[[], Any], n: int = 30) -> float:
    from staronnx.partition.autoshares import median_seconds

    return median_seconds(run, n, warmup=3)


# ---------------------------------------------------------------------- verdicts
# best, verdict and headline live in gpu_table.py (the table's script): one rule for both
def checks(rows: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """Issue 48's goals, as (statement, held)."""
    out = []
    for r in rows:
        h = headline(r)
        if h is not None and r["precision"] == "fp32":
            goal = 1.15 if r["batch"] <= 8 and r["k"] == 16 else 1.0
            out.append((f"{r['id']}: {h['staronnx']} {h['ratio']:.2f}x {h['ort']} ({h['claim']}; goal >= {goal})",
                        h["ratio"] >= goal))
        alone = r["figures"].get(GPU_ALONE)
        for mixed in ("gpu+cpu", "auto"):
            if alone and mixed in r["figures"]:
                ratio, claim = verdict(r["figures"][mixed], alone)
                out.append((f"{r['id']}: {mixed} {ratio:.2f}x the GPU alone ({claim}; goal >= 0.98)", ratio >= 0.98))
        for label, g in r.get("graph_stats", {}).items():
            out.append((f"{r['id']}: {label} replayed {g.get('replays', 0)} CUDA graphs "
                        f"({g.get('captured', 0)} captured, {g.get('failed', 0)} failed)",
                        g.get("replays", 0) > 0 and not g.get("failed")))
        if r["errors"]:
            tol = 1e-2 if r["precision"] != "fp32" else 1e-3
            err = max(r["errors"].values())
            out.append((f"{r['id']}: max relative error {err:.1e} against plain ORT (< {tol:g})", err < tol))
        lat = r.get("latency_ms", {})
        if GPU_ALONE in lat and "ort-tuned1" in lat:
            out.append((f"{r['id']}: batch-1 latency {lat[GPU_ALONE]:.2f} ms vs ort-tuned1 {lat['ort-tuned1']:.2f} ms",
                        lat[GPU_ALONE] <= lat["ort-tuned1"]))
    return out


def format_row(row: dict[str, Any]) -> str:
    h = headline(row)
    cells = ", ".join(f"{label} {f['median']:,.0f} [{f['min']:,.0f}-{f['max']:,.0f}]"
                      for label, f in row["figures"].items())
    verdict_text = f"{h['staronnx']} / {h['ort']} {h['ratio']:.2f}x ({h['claim']})" if h else "-"
    return f"{row['id']}: {verdict_text} in {row['seconds']:.0f} s; {cells}"


# ---------------------------------------------------------------------- provenance
def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit() -> dict[str, Any]:
    """The commit the figures are of: git's, or ``$STARONNX_COMMIT`` where the tree is a copy
    without its history (a device call's copy of the working tree: the caller writes the hash
    into the command), with whether the tree differed from it (None: unknown)."""
    found = _git("rev-parse", "HEAD")
    if found:
        return {"commit": found, "dirty": bool(_git("status", "--porcelain", "--", "staronnx", "benchmarks")),
                "commit_from": "git"}
    return {"commit": os.environ.get("STARONNX_COMMIT", ""), "dirty": None, "commit_from": "STARONNX_COMMIT"}


def describe_device(device: str) -> dict[str, Any]:
    """What the figures are of: the GPU (name, memory, capability, UUID), the driver and CUDA
    versions; on ``--device cpu`` the CPU."""
    if device != "cuda":
        return {"name": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", "kind": "cpu"}
    from staronnx.workers.cuda_env import describe_gpus
    from staronnx.workers.cudart import runtime_module

    info: dict[str, Any] = {"kind": "cuda", **(describe_gpus([0]) or [{}])[0]}
    with contextlib.suppress(Exception):
        rt = runtime_module()
        info["cuda_runtime"] = int(rt.cudaRuntimeGetVersion()[1])
        info["cuda_driver_api"] = int(rt.cudaDriverGetVersion()[1])
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        info["driver"] = smi or None
    return info


def provenance(args: argparse.Namespace, device: dict[str, Any]) -> dict[str, Any]:
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "onnxruntime": ort.__version__,
            "numpy": np.__version__, **commit(),
            "command": shlex.join([sys.executable, *sys.argv]), "device": device,
            "settings": {k: (sorted(v) if isinstance(v, set) else v if isinstance(v, (int, float, bool, list)) or v is None
                             else str(v)) for k, v in vars(args).items()}}


def resumed_rows(path: Path | None, device: dict[str, Any],
                 say: Callable[[str], None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows and runs of an earlier result to keep: ``path`` itself, or in a folder the newest
    ``gpu-*.json`` of this GPU model; only rows measured on the same GPU model are kept (an
    H100's rows and an H200's are not one table)."""
    if path is None or not path.exists():
        return [], []
    candidates = sorted(path.glob("gpu-*.json"), reverse=True) if path.is_dir() else [path]
    for candidate in candidates:
        try:
            doc = json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
        if doc.get("schema") != SCHEMA:
            continue
        theirs = (doc.get("runs") or [{}])[-1].get("device", {}).get("name")
        if theirs == device.get("name"):
            rows: list[dict[str, Any]] = doc.get("rows", [])
            say(f"--resume {candidate}: {len(rows)} row(s) kept")
            return rows, doc.get("runs", [])
        say(f"--resume {candidate}: measured on {theirs!r}, this is {device.get('name')!r}: not continued")
    say(f"--resume {path}: nothing of this device to continue: starting a new table")
    return [], []


def write_results(path: Path, runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """The rows measured so far (earlier runs' first), with their checks: written after each row,
    so a run cut short keeps every row it finished."""
    from staronnx.fsutil import atomic_write_text

    atomic_write_text(path, json.dumps({"schema": SCHEMA, "runs": runs, "rows": rows,
                                        "checks": checks(rows)}, indent=1))


# ---------------------------------------------------------------------- main
def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--in-flight", default=",".join(map(str, KS)), help="the values of K, comma-separated")
    ap.add_argument("--seconds", type=float, default=MIN_SECONDS, help="one measurement's length")
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS, help="measurements per figure, taken in turn")
    ap.add_argument("--sequence", type=int, default=128, help="the encoder's sequence length")
    ap.add_argument("--models-dir", type=Path, default=None, help="where the exported models are (made if absent)")
    ap.add_argument("--resume", type=Path, default=None, help="a results JSON, or a folder of them (its newest gpu-*.json of this GPU model), whose "
                         "rows are kept: only the others are measured")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds: no row is started that the slowest row so far says would not end in time")
    ap.add_argument("--rows", type=int, default=0, help="at most this many new rows (0: all)")
    ap.add_argument("--trace", type=Path, default=None, help="a folder for Perfetto traces of --trace-setups")
    ap.add_argument("--trace-setups", default="gpu+cpu,auto")
    ap.add_argument("--no-cpu-help", action="store_true", help="leave out gpu+cpu and auto")
    ap.add_argument("--groups", default="numa", help="CPU groups beside the GPU for gpu+cpu and auto")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json", type=Path, default=Path("gpu-benchmark.json"))
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.ks = [int(k) for k in args.in_flight.split(",")]
    args.trace_setups = {x for x in args.trace_setups.split(",") if x}
    unknown = sorted(set(args.models) - set(MODELS)) + sorted(set(args.precisions) - set(PRECISIONS))
    if unknown:
        ap.error(f"unknown model or precision: {', '.join(unknown)} (models {', '.join(MODELS)}; "
                 f"precisions {', '.join(PRECISIONS)})")
    if args.device == "cuda" and (args.repeats < MIN_REPEATS or args.seconds < MIN_SECONDS):
        ap.error(f"a GPU figure is the median of >= {MIN_REPEATS} repeats of >= {MIN_SECONDS:g} s "
                 f"(--repeats {args.repeats}, --seconds {args.seconds:g}); --device cpu takes less")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device == "cuda" and CUDA not in ort.get_available_providers():
        print(f"benchmarks/gpu.py needs onnxruntime-gpu's {CUDA} (this onnxruntime has "
              f"{', '.join(ort.get_available_providers())}); use --device cpu for a smoke run", file=sys.stderr)
        return 2
    say = lambda msg: print(f"  .. {msg}", file=sys.stderr, flush=True)  # noqa: E731
    tmp = scratch_dir("staronnx-gpu-bench-")
    if args.device == "cpu":  # staronnx's CUDA workers on the stand-in: the same code path as on a GPU
        os.environ["STARONNX_CUDA_RUNTIME"] = "host"
    os.environ.setdefault("STARONNX_HOME", str(tmp / "home"))
    args.models_dir = args.models_dir or tmp / "models"
    args.models_dir.mkdir(parents=True, exist_ok=True)
    if args.trace is not None:
        args.trace.mkdir(parents=True, exist_ok=True)
    device = describe_device(args.device)
    rows, runs = resumed_rows(args.resume, device, say)
    runs = [*runs, provenance(args, device)]
    done = {r["id"] for r in rows}
    from staronnx.perfmodels import PerfModelStore

    plans = Plans(tmp, args, PerfModelStore(tmp / "home"))
    print(f"{device.get('name')}: {args.repeats} repeats of {args.seconds:g} s per figure, K in {args.ks}, "
          f"{'budget %.0f s' % args.budget if args.budget else 'no budget'}; samples/s, median [min-max]", flush=True)
    start, slowest, new, failures = time.perf_counter(), 0.0, 0, 0
    for key in matrix(args.models, args.precisions, args.ks, args.batches):
        if key.id in done:
            continue
        left = args.budget - (time.perf_counter() - start)
        if args.budget and left < slowest * 1.2:
            print(f"stopped before {key.id}: {left:.0f} s of the budget left, the slowest row took {slowest:.0f} s",
                  flush=True)
            break
        if args.rows and new >= args.rows:
            break
        try:
            row = measure_row(key, args, plans, say)
        except Skip as exc:
            print(f"{key.id}: skipped: {exc}", flush=True)
            continue
        except Exception as exc:  # noqa: BLE001 - one row's failure is reported; the next rows still run
            import traceback

            traceback.print_exc()
            print(f"{key.id}: failed: {type(exc).__name__}: {exc}", flush=True)
            with contextlib.suppress(Exception):
                plans.close()  # the next row opens its own
            failures += 1
            if failures >= 3:
                print("stopped: three rows failed (see the tracebacks above)", flush=True)
                break
            continue
        rows.append(row)
        new += 1
        slowest = max(slowest, row["seconds"])
        write_results(args.json, runs, rows)  # first: a run cut short keeps every row it measured
        print(format_row(row), flush=True)
    plans.close()  # the runtimes write their traces as they close
    write_results(args.json, runs, rows)
    print()
    for text, held in checks(rows):
        print(f"{'PASS' if held else 'FAIL'}  {text}")
    print(f"wrote {args.json} ({len(rows)} rows, {new} new)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
