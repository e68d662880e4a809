"""A batch-inference job: a dataset in, every row's outputs out, in order, resumable.

Three threads share the work so that neither reading nor writing stalls the workers::

    reader:  source chunks -> batches (cut at shard edges, checked against the model) -> queue
    caller:  queue -> Runtime.submit -> a window of futures, settled in order -> shards
    writer:  row groups of outputs -> the open shard's file, renamed into place when it ends

Memory is bounded: the reader reads one bundle of batches ahead of the one the caller submits
from (about :data:`BUNDLE_BYTES` of inputs each, or one batch where a batch is larger), the
runtime holds at most ``max_in_flight`` batches, the caller gathers one row group of outputs
(:data:`~staronnx.infer.sinks.ROW_GROUP_BYTES`) and the writer's queue holds at most
``max_in_flight`` of them (an ``.npz`` shard holds its rows until it ends). Hand-overs between
the threads go by bundle and by row group, not by batch: each costs the GIL. The caller settles
the oldest future first, so rows come out in the dataset's order.

A row that cannot run is never lost silently. A row the source cannot read (a null) or the
model refuses before running (a dtype, a rank, a fixed size: :meth:`Plan.check_feeds`) is
reported by row id; a batch that fails while running is run again a row at a time, so only the
rows that fail alone are reported. ``on_error="skip"`` writes the others and lists the skipped
rows beside their shard; ``"fail"`` stops the job at the first one, naming it (the finished
shards stay, and ``resume`` carries on after a fix, or with ``skip``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from staronnx.errors import InputError, StaronnxError
from staronnx.infer.batchsize import MAX_BATCH_BYTES, BatchChoice, choose_batch_size
from staronnx.infer.rows import RowLayout
from staronnx.infer.sinks import ROW_GROUP_BYTES, ShardSink, ShardWriter, output_format, output_specs
from staronnx.infer.sources import CHUNK_BYTES, Chunk, Source, open_source
from staronnx.infer.workers import AUTO, default_window, job_machine
from staronnx.plan import Plan
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.workers.layout import MachineSpec

ON_ERROR = ("fail", "skip")
#: inputs the reader hands to the caller at once (at least one batch): a hand-over between
#: threads costs the GIL twice, which small batches of a small model felt per batch. A file
#: source's chunk, so that a bundle keeps no more of the reader's buffers alive than it uses
BUNDLE_BYTES = CHUNK_BYTES
#: what a batch weighs in a bundle at least: a batch refused before it runs (a null, a wrong
#: dtype) holds no inputs, and a bundle of them reached the caller only when the dataset ended (a
#: dataset of the wrong dtype was read to its end before the job failed at row 0); a bundle now
#: holds at most 1024 batches
MIN_BATCH_BYTES = BUNDLE_BYTES // 1024
#: rows the batch-size probe and the warm-up look through for rows the model takes (the first
#: rows may be refused: a null, a wrong dtype) before they give up and leave them to the job
SAMPLE_LOOK_ROWS = 1024
#: manifest version: a resumed job refuses an output another version of the layout wrote
MANIFEST_VERSION = 1
#: seconds between two progress calls
PROGRESS_EVERY_S = 0.1


class RowError(InputError):
    """A row of the dataset cannot run (``on_error="fail"``): the message names its row id."""


@dataclass(frozen=True)
class InferSpec:
    """How a batch-inference job runs, as one value (``staronnx infer`` fills it from its flags).

    ``batch_size`` None: chosen for throughput on this machine (:mod:`staronnx.infer.batchsize`).
    ``max_in_flight`` None: two batches per worker, so each worker has the next one queued.
    ``shard_rows``: rows per output shard, the unit a resumed job skips. ``on_error``: ``fail``
    stops at the first bad row, ``skip`` reports it and goes on. ``resume`` continues the job
    that wrote the output; ``overwrite`` replaces it. ``output_format``: ``parquet`` or ``npz``
    (None: from the output's suffix, Parquet for a folder). ``policy``: the scheduling policy."""

    batch_size: int | None = None
    max_in_flight: int | None = None
    shard_rows: int = 4096
    on_error: str = "fail"
    resume: bool = False
    overwrite: bool = False
    output_format: str | None = None
    policy: str = "heft"

    def __post_init__(self) -> None:
        if self.batch_size is not None and self.batch_size < 1:
            raise StaronnxError(f"batch size must be at least 1, got {self.batch_size}")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise StaronnxError(f"max_in_flight must be at least 1, got {self.max_in_flight}")
        if self.shard_rows < 1:
            raise StaronnxError(f"shard_rows must be at least 1, got {self.shard_rows}")
        if self.on_error not in ON_ERROR:
            raise StaronnxError(f"on_error {self.on_error!r}: choose one of {', '.join(ON_ERROR)}")
        if self.resume and self.overwrite:
            raise StaronnxError("resume and overwrite exclude each other: resume keeps the finished shards, "
                                "overwrite removes them")


@dataclass
class InferReport:
    """What a job did: rows written and skipped (this run and before it), the batch size and
    how it was chosen, and the time taken."""

    output: Path
    total_rows: int | None
    written: int = 0
    skipped: list[dict[str, Any]] = field(default_factory=list)
    resumed_rows: int = 0
    batch_size: int = 0
    max_in_flight: int = 0
    #: the CPU groups the job ran on (``auto`` resolved: :mod:`staronnx.infer.workers`) and its workers
    groups: str = ""
    workers: int = 0
    choice: BatchChoice | None = None
    elapsed_s: float = 0.0
    #: where the skipped rows are listed (written only when a row was skipped)
    errors_file: Path | None = None

    @property
    def samples_per_s(self) -> float:
        """Rows computed per second of this run (rows skipped or resumed not counted)."""
        return self.written / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"output": str(self.output), "total_rows": self.total_rows, "written": self.written,
                "skipped": len(self.skipped), "resumed_rows": self.resumed_rows, "batch_size": self.batch_size,
                "max_in_flight": self.max_in_flight, "groups": self.groups, "workers": self.workers,
                "elapsed_s": round(self.elapsed_s, 3),
                "samples_per_s": round(self.samples_per_s, 2),
                "batch_choice": None if self.choice is None else self.choice.to_json()}


@dataclass
class Batch:
    """Rows ``start .. start + rows - 1`` of one shard, as the model takes them (or why not)."""

    start: int
    rows: int
    shard: int
    feeds: dict[str, np.ndarray]
    problem: str | None = None

    @property
    def row_ids(self) -> np.ndarray:
        return np.arange(self.start, self.start + self.rows, dtype=np.int64)


Progress = Callable[[int, "int | None"], None]


def infer(model: str | Path | Plan, inputs: str | Path | Iterable[Mapping[str, np.ndarray]] | Any,
          output: str | Path, spec: InferSpec = InferSpec(), machine: MachineSpec = MachineSpec(AUTO), *,
          progress: Progress | None = None) -> InferReport:
    """Run every row of ``inputs`` through ``model`` (an ONNX file, a plan folder or a
    :class:`Plan`) on this machine's workers and write the outputs to ``output`` (a folder of
    shards, or a ``.parquet``/``.npz`` file), in order, resumable (see the module docstring).
    ``inputs``: an ``.npz``, a folder of ``.npz``/``.npy`` shards, a Parquet/Arrow file or
    folder, or any iterable of feeds (:mod:`staronnx.infer.sources`). ``machine``'s ``auto``
    groups (the default) are a worker per core where memory allows
    (:mod:`staronnx.infer.workers`). ``progress(done, total)`` is called as rows finish
    (``total`` None when the source cannot tell)."""
    from staronnx.infer.plans import plan_for

    plan = plan_for(model)
    machine = job_machine(machine, plan)
    layout = RowLayout.of(plan)
    source = open_source(inputs, layout)
    out = Path(output)
    fmt = output_format(out, spec.output_format)
    manifest = {"version": MANIFEST_VERSION, "plan": plan.hash, "model_sha256": plan.source.get("sha256"),
                "source": source.describe(), "shard_rows": spec.shard_rows, "format": fmt,
                "outputs": output_specs(plan, layout)}
    sink = ShardSink(out, fmt, manifest, resume=spec.resume, overwrite=spec.overwrite)
    try:
        return _run_job(plan, machine, layout, source, sink, spec, out, progress)
    finally:
        sink.release()  # the output, for the next job (an error's traceback would hold the sink)


def _run_job(plan: Plan, machine: MachineSpec, layout: RowLayout, source: Source, sink: ShardSink, spec: InferSpec,
             out: Path, progress: Progress | None) -> InferReport:
    """The job on its prepared output (:func:`infer`)."""
    total = source.total_rows()
    report = InferReport(out, total)
    if sink.done:  # a resumed single-file output this job finished: every row was written before
        report.groups = machine.groups
        report.skipped = sink.errors()
        report.errors_file = sink.errors_file() if report.skipped else None
        report.resumed_rows = sink.rows_done()
        return report
    start = _first_unfinished(sink.finished, spec.shard_rows, total)
    report.resumed_rows = _finished_rows(sink, spec.shard_rows, total)
    # CUDA graphs of the batch size are captured before the first read, where the model's sizes
    # allow random warm-up feeds (no dynamic size but the batch); otherwise at the size's first run
    warm = (spec.batch_size,) if machine.cuda_streams and spec.batch_size and _fixed_sizes(plan, layout) else ()
    with Runtime(plan, machine, RuntimeSpec(spec.policy, warmup=warm)) as runtime:
        window = spec.max_in_flight or default_window(len(runtime.workers))
        report.groups, report.workers = machine.groups, len(runtime.workers)
        if spec.batch_size is not None:
            batch = spec.batch_size if layout.batched else 1
        elif not layout.batched:
            batch = 1
        else:
            sample = _sample_rows(source, layout, start, plan=plan, max_bytes=MAX_BATCH_BYTES)
            try:
                report.choice = choose_batch_size(runtime, layout, sample, max_in_flight=window) if sample else None
            except Exception:  # noqa: BLE001 - the sample's first row fails in the model: the job reports it by row id
                report.choice = None
            batch = report.choice.batch_size if report.choice is not None else 1
        report.batch_size, report.max_in_flight = batch, window
        if report.choice is None:  # the probe already ran the model on the job's first rows
            _warm_up(runtime, source, layout, start, batch)
        t0 = time.perf_counter()
        _Pipeline(runtime, plan, layout, source, sink, spec, batch, window, report, progress).run(start)
        report.elapsed_s = time.perf_counter() - t0
    report.skipped = sink.errors()
    report.errors_file = sink.errors_file() if report.skipped else None
    sink.finish({**report.to_json(), "skipped_rows": [e["row_id"] for e in report.skipped[:1000]]})
    return report


def _warm_up(runtime: Runtime, source: Source, layout: RowLayout, start: int, batch: int) -> None:
    """A batch of the job's first rows run on every worker before the clock starts, as ``staronnx
    run`` does: ONNX Runtime's first run of a size allocates its arenas and plans its memory, a
    one-off cost a job pays once whatever its length and that would otherwise weigh on a short
    job's samples/s. Two per worker at once, so the policy spreads them (a task cannot be sent to
    a given worker): with one, the other workers of a worker-per-core job allocated theirs
    inside the job's clock. A first batch that fails is left to the job, which reports it by row id."""
    sample = _sample_rows(source, layout, start, want=batch, plan=runtime.plan)
    if sample is None:
        return
    with contextlib.suppress(Exception):
        for future in [runtime.submit(sample) for _ in range(2 * max(1, len(runtime.workers)))]:
            future.result()


def _fixed_sizes(plan: Plan, layout: RowLayout) -> bool:
    """Whether every input size but the row axis is fixed (random warm-up feeds can be made)."""
    for spec in plan.inputs:
        axis = layout.inputs.get(spec.name)
        if any(not isinstance(d, int) or d < 0 for i, d in enumerate(spec.shape) if i != axis):
            return False
    return True


def _first_unfinished(finished: set[int], shard_rows: int, total: int | None) -> int:
    """The first row of the first shard not yet written (shards are written in order)."""
    k = 0
    while k in finished:
        k += 1
    return k * shard_rows if total is None else min(k * shard_rows, total)


def _finished_rows(sink: ShardSink, shard_rows: int, total: int | None) -> int:
    rows = 0
    last = max(sink.finished, default=None)
    for k in sink.finished:
        if total is None and k == last:
            # a dataset of unknown length may end inside its last shard: the file says how many
            rows += sink.rows_in(k)
            continue
        hi = (k + 1) * shard_rows if total is None else min((k + 1) * shard_rows, total)
        rows += max(hi - k * shard_rows, 0)
    return rows


def _sample_rows(source: Source, layout: RowLayout, start: int, want: int = 64,
                 plan: Plan | None = None, max_bytes: int | None = None) -> dict[str, np.ndarray] | None:
    """Up to ``want`` consecutive readable rows of one shape from ``start`` (the batch-size
    probe's inputs: the job's own data, not random values), leaving out rows ``plan`` refuses
    (a dtype, a rank, a fixed size): the probe would fail on them, where the job reports them by
    row id. No more rows than ``max_bytes`` hold (at least one): the probe's largest batch,
    where 64 large rows held the job's memory many times over before its first batch ran. No
    more than :data:`SAMPLE_LOOK_ROWS` rows (or twice ``want``) are looked at: where every row
    is refused (a dataset of the wrong dtype), the probe and the warm-up each read the whole
    dataset before the job reported its row 0."""
    if max_bytes is not None:
        first = _first_readable(source, start)
        if first is None:
            return None
        row_bytes = sum(int(v.nbytes) // first.rows for n, v in first.arrays.items()
                        if layout.inputs.get(n) is not None)
        want = max(1, min(want, max_bytes // max(row_bytes, 1)))
        del first  # its buffers, before the rows are read again
    pieces: list[dict[str, np.ndarray]] = []
    rows = 0
    key: object = None
    looked = 0
    for chunk in source.peek(start, rows=want):
        if looked >= max(SAMPLE_LOOK_ROWS, 2 * want):  # a warm-up's batch larger than the bound: whole
            break
        looked += chunk.rows
        if chunk.problem is not None:
            continue
        if plan is not None:
            try:  # a chunk's rows share a dtype and shape
                plan.check_feeds(layout.take(chunk.arrays, 0, 1))
            except InputError:
                continue
        sig = layout.signature(layout.take(chunk.arrays, 0, 1))
        if pieces and sig != key:
            break
        key = sig
        take = min(chunk.rows, want - rows)
        pieces.append(layout.take(chunk.arrays, 0, take))
        rows += take
        if rows >= want:
            break
    return layout.join(pieces) if pieces else None


def _first_readable(source: Source, start: int) -> Chunk | None:
    """The first chunk from ``start`` the source could read (not a null), within
    :data:`SAMPLE_LOOK_ROWS` rows."""
    looked = 0
    for chunk in source.peek(start, rows=1):
        if chunk.problem is None and chunk.rows:
            return chunk
        looked += chunk.rows
        if looked >= SAMPLE_LOOK_ROWS:
            break
    return None


class _Pipeline:
    """One run of a job's reader, caller and writer (see the module docstring)."""

    def __init__(self, runtime: Runtime, plan: Plan, layout: RowLayout, source: Source, sink: ShardSink,
                 spec: InferSpec, batch: int, window: int, report: InferReport, progress: Progress | None) -> None:
        self.runtime, self.plan, self.layout, self.source, self.sink = runtime, plan, layout, source, sink
        self.spec, self.batch, self.window, self.report, self.progress = spec, batch, window, report, progress
        self.stop = threading.Event()
        # bundles of batches (:data:`BUNDLE_BYTES`): one hand-over per bundle, not per batch
        self.ready: queue.Queue[list[Batch] | BaseException | None] = queue.Queue(maxsize=1)
        # the caller's rows not yet handed to the writer (one hand-over per row group)
        self.held_ids: list[np.ndarray] = []
        self.held_outputs: list[dict[str, np.ndarray]] = []
        self.held_bytes = 0
        # (kind, shard, payload): "rows" (row ids, outputs), "errors" (skipped rows), "end" (None)
        self.to_write: queue.Queue[tuple[str, int, Any] | None] = queue.Queue(maxsize=max(2, window))
        self.write_error: BaseException | None = None
        self.done_rows = report.resumed_rows
        self.next_progress = 0.0
        self.shard: int | None = None  # the shard the caller is filling

    # -- threads ------------------------------------------------------------------------------
    def run(self, start: int) -> None:
        reader = threading.Thread(target=self._read, args=(start,), name="staronnx-infer-reader", daemon=True)
        writer = threading.Thread(target=self._write, name="staronnx-infer-writer", daemon=True)
        reader.start()
        writer.start()
        try:
            self._call()
        finally:
            self.stop.set()
            with contextlib.suppress(queue.Empty):  # unblock a reader waiting to put
                while True:
                    self.ready.get_nowait()
            reader.join()
            self.to_write.put(None)  # shards already ended are written; a shard cut short is dropped
            writer.join()
        if self.write_error is not None:
            raise self.write_error

    def _put(self, item: list[Batch] | BaseException | None) -> bool:
        """Hand ``item`` to the caller and wait until it took it, so the reader reads one bundle
        ahead of the caller's, no more (False: the job stopped meanwhile)."""
        while not self.stop.is_set():
            try:
                self.ready.put(item, timeout=0.1)
                break
            except queue.Full:
                continue
        taken = self.ready.all_tasks_done
        with taken:
            while self.ready.unfinished_tasks and not self.stop.is_set():
                taken.wait(0.1)
        return not self.stop.is_set()

    def _read(self, start: int) -> None:
        try:
            bundle: list[Batch] = []
            held = 0
            for batch in self._batches(start):
                bundle.append(batch)
                held += max(sum(int(v.nbytes) for v in batch.feeds.values()), MIN_BATCH_BYTES)
                if held >= BUNDLE_BYTES:
                    if not self._put(bundle):
                        return
                    bundle, held = [], 0
            if bundle and not self._put(bundle):
                return
            self._put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
            self._put(exc)

    def _write(self) -> None:
        writer: ShardWriter | None = None
        while True:
            item = self.to_write.get()
            if item is None:
                if writer is not None:
                    writer.abort()
                return
            if self.write_error is not None:
                continue
            kind, index, payload = item
            try:
                if writer is None:
                    writer = self.sink.open(index)
                if kind == "rows":
                    writer.add(*payload)
                elif kind == "errors":
                    writer.errors.extend(payload)
                else:
                    writer.close()
                    writer = None
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                self.write_error = exc
                if writer is not None:
                    writer.abort()
                    writer = None

    # -- reading: chunks into batches -------------------------------------------------------------
    def _batches(self, start: int) -> Iterator[Batch]:
        """Batches of at most ``batch`` rows, none spanning two shards or two shapes; the rows of
        shards already written are skipped."""
        pending: list[Chunk] = []
        held = 0
        for chunk in self.source.chunks(start, rows=self.batch):
            if self.stop.is_set():
                return
            for piece in self._by_shard(chunk):
                shard = piece.start // self.spec.shard_rows
                if shard in self.sink.finished:
                    continue
                if piece.problem is not None:
                    yield from self._emit(pending, held)
                    pending, held = [], 0
                    yield Batch(piece.start, piece.rows, shard, {}, piece.problem)
                    continue
                if pending and (pending[-1].start // self.spec.shard_rows != shard
                                or self._key(pending[-1]) != self._key(piece)):
                    yield from self._emit(pending, held)
                    pending, held = [], 0
                if not pending and self.layout.batched and piece.rows >= self.batch:
                    # the common case, cut without the bookkeeping below: whole batches as views
                    # of the piece (its rows share a shape), the Python per batch is what the
                    # workers wait for, on the GIL, between their tasks
                    whole = piece.rows - piece.rows % self.batch
                    for lo in range(0, whole, self.batch):
                        yield self._batch(piece.start + lo, self.batch, shard,
                                          self.layout.take(piece.arrays, lo, lo + self.batch))
                    if whole == piece.rows:
                        continue
                    piece = Chunk(piece.start + whole, piece.rows - whole,
                                  self.layout.take(piece.arrays, whole, piece.rows))
                pending.append(piece)
                held += piece.rows
                while held >= self.batch:
                    first, rest = self._split(pending, self.batch)
                    yield from self._emit(first, self.batch)
                    pending, held = rest, held - self.batch
        yield from self._emit(pending, held)

    def _by_shard(self, chunk: Chunk) -> Iterator[Chunk]:
        rows = self.spec.shard_rows
        lo = chunk.start
        end = chunk.start + chunk.rows
        while lo < end:
            hi = min(end, (lo // rows + 1) * rows)
            if lo == chunk.start and hi == end:
                yield chunk
            else:
                arrays = {} if chunk.problem else self.layout.take(chunk.arrays, lo - chunk.start, hi - chunk.start)
                yield Chunk(lo, hi - lo, arrays, chunk.problem)
            lo = hi

    def _key(self, chunk: Chunk) -> object:
        return self.layout.signature(self.layout.take(chunk.arrays, 0, 1))

    def _split(self, pending: list[Chunk], rows: int) -> tuple[list[Chunk], list[Chunk]]:
        first: list[Chunk] = []
        need = rows
        for i, piece in enumerate(pending):
            if piece.rows <= need:
                first.append(piece)
                need -= piece.rows
                if need == 0:
                    return first, pending[i + 1:]
                continue
            take = self.layout.take(piece.arrays, 0, need)
            rest = self.layout.take(piece.arrays, need, piece.rows)
            first.append(Chunk(piece.start, need, take))
            return first, [Chunk(piece.start + need, piece.rows - need, rest), *pending[i + 1:]]
        return first, []

    def _emit(self, pieces: list[Chunk], rows: int) -> Iterator[Batch]:
        if not pieces or rows == 0:
            return
        start = pieces[0].start
        shard = start // self.spec.shard_rows
        if not self.layout.batched:  # one row per task
            for piece in pieces:
                for i in range(piece.rows):
                    yield self._checked(Batch(piece.start + i, 1, shard, self.layout.take(piece.arrays, i, i + 1)))
            return
        yield self._batch(start, rows, shard, self.layout.join([p.arrays for p in pieces]))

    def _batch(self, start: int, rows: int, shard: int, feeds: Mapping[str, np.ndarray]) -> Batch:
        """A batch of ``rows`` rows from ``start``, its feeds C-contiguous (views where they
        already are), checked against the model."""
        return self._checked(Batch(start, rows, shard, {n: np.require(v, requirements="C") for n, v in feeds.items()}))

    def _checked(self, batch: Batch) -> Batch:
        try:
            self.plan.check_feeds(batch.feeds)
        except InputError as exc:
            batch.problem = str(exc)
            batch.feeds = {}
        return batch

    # -- calling: a window of futures, settled in order ---------------------------------------------
    def _call(self) -> None:
        window: deque[tuple[Batch, Any]] = deque()
        while True:
            # room in the window before the next bundle is taken: taking it lets the reader read
            # the one after, so the inputs held are the window, the bundle being submitted and
            # the one being read, never a bundle more waiting in the queue
            while len(window) >= self.window:
                self._settle(*window.popleft())
            bundle = self.ready.get()
            self.ready.task_done()  # the reader may read the next bundle now
            if isinstance(bundle, BaseException):
                raise bundle
            if bundle is None:
                break
            for item in bundle:
                # a batch goes in only when one of the window's has come out: at most
                # max_in_flight batches on the workers
                while len(window) >= self.window or (window and (window[0][1] is None or window[0][1].done())):
                    self._settle(*window.popleft())
                future = None
                if item.problem is None:
                    try:  # the reader checked the batch against the plan (:meth:`_checked`)
                        future = self.runtime.submit(item.feeds, checked=True)
                    except InputError as exc:
                        item.problem = str(exc)
                window.append((item, future))
            # the window holds the batches now: a bundle kept until the next one arrives would
            # keep their input buffers from the reader's pool after they are settled
            bundle.clear()
        while window:
            self._settle(*window.popleft())
        if self.shard is not None:
            self._end(self.shard)
        self.final_progress()

    def _settle(self, batch: Batch, future: Any) -> None:
        if self.shard != batch.shard:
            if self.shard is not None:
                self._end(self.shard)
            self.shard = batch.shard
        if batch.problem is not None:
            self._bad(batch.row_ids, batch.problem)
            return
        try:
            outputs = future.result()
        except Exception as exc:  # noqa: BLE001 - the batch's rows are tried alone below
            self._rows_alone(batch, exc)
        else:
            self._rows(batch.row_ids, self.layout.row_major(outputs, batch.rows))

    def _rows_alone(self, batch: Batch, exc: BaseException) -> None:
        """A failed batch run again a row at a time: the rows that fail alone are the bad ones."""
        from staronnx.verify import model_failure

        if batch.rows == 1:
            self._bad(batch.row_ids, str(model_failure(self.plan, batch.feeds, exc)))
            return
        for i in range(batch.rows):
            feeds = self.layout.take(batch.feeds, i, i + 1)
            row = np.array([batch.start + i], dtype=np.int64)
            try:
                outputs = self.runtime.run(feeds)
            except Exception as alone:  # noqa: BLE001 - reported by row id
                self._bad(row, str(model_failure(self.plan, feeds, alone)))
            else:
                self._rows(row, self.layout.row_major(outputs, 1))

    def _rows(self, row_ids: np.ndarray, outputs: dict[str, np.ndarray]) -> None:
        self.held_ids.append(row_ids)
        self.held_outputs.append(outputs)
        self.held_bytes += sum(int(v.nbytes) for v in outputs.values())
        if self.held_bytes >= ROW_GROUP_BYTES:
            self._hand_rows()
        self.report.written += len(row_ids)
        self._advance(len(row_ids))

    def _hand_rows(self) -> None:
        if self.held_ids:
            assert self.shard is not None
            self._send("rows", self.shard, (self.held_ids, self.held_outputs))
            self.held_ids, self.held_outputs, self.held_bytes = [], [], 0

    def _end(self, shard: int) -> None:
        self._hand_rows()
        self._send("end", shard, None)

    def _bad(self, row_ids: np.ndarray, reason: str) -> None:
        if self.spec.on_error == "fail":
            ids = f"row {row_ids[0]}" if len(row_ids) == 1 else f"rows {row_ids[0]}..{row_ids[-1]}"
            raise RowError(f"{ids} of the dataset cannot run: {reason} (--on-error skip reports such rows and "
                           "goes on; the shards written so far are kept for --resume)")
        assert self.shard is not None
        self._send("errors", self.shard, [{"row_id": int(r), "error": reason} for r in row_ids])
        self._advance(len(row_ids))

    def _advance(self, rows: int) -> None:
        self.done_rows += rows
        if self.progress is not None:
            now = time.monotonic()
            # a progress bar redraws a few times a second: a call per batch is GIL time the
            # workers wait for between tasks (the last call, at the end, is always made)
            if now >= self.next_progress or self.done_rows == self.report.total_rows:
                self.next_progress = now + PROGRESS_EVERY_S
                self.progress(self.done_rows, self.report.total_rows)

    def final_progress(self) -> None:
        """The count as it ends (a throttled call may have left the bar behind)."""
        if self.progress is not None:
            self.progress(self.done_rows, self.report.total_rows)

    def _send(self, kind: str, shard: int, payload: Any) -> None:
        if self.write_error is not None:
            raise self.write_error
        self.to_write.put((kind, shard, payload))
