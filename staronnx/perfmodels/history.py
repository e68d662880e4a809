"""History-based performance models: measured execution times per input footprint.

StarPU's ``HISTORY_BASED`` models (``perfmodel_history.c``), so that people who know StarPU can
predict what the scheduler will do: a **footprint** (batch size + CRC-32 of the input shapes)
keys the samples; the first sample of a footprint is dropped (lazy initialisation); a sample
outside ``[mean/1.5, 1.5*mean]`` only counts toward ``nerror``, and ``nerror >= n`` resets the
entry (StarPU's cure for poisoned models); until ``calibrate_minimum`` (10) samples are
accepted the prediction is NaN, which makes dmda explore (STARPU_MODEL.md §1).

Two deliberate differences: times are seconds, and a batch size without a calibrated entry
falls back, within the run, to a ``t(n) = a*n**b + c`` fit over the calibrated sizes of the
same shape family (the entry stays uncalibrated, so the runtime keeps measuring it).
Entries keep ``sum``, ``sum2`` and ``n``, so runs merge by addition; a merge applies a run's
resets only to what that run saw (:meth:`HistoryModel.replay`). Models are thread-safe.
"""

from __future__ import annotations

import functools
import math
import operator
import threading
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, NamedTuple

from staronnx.perfmodels.regression import MIN_SIZES, NLRegression, fit_nl_regression

#: Accepted samples an entry needs before its mean is trusted (STARPU_CALIBRATE_MINIMUM).
CALIBRATE_MINIMUM = 10
#: Relative band around the mean outside which a sample is an outlier (STARPU_HISTORY_MAX_ERROR
#: = 50 %, i.e. ``[mean/1.5, 1.5*mean]``).
HISTORY_MAX_ERROR = 0.5
#: How far (relative) a calibrated entry's mean may move before its family's batch-size
#: regression is fitted again: a run's times drift by more than this from one window to the next
REFIT_DRIFT = 0.01

ShapesLike = Sequence[Sequence[int]] | Mapping[str, Sequence[int]]


class PerfModelFormatError(ValueError):
    """A serialized performance model does not have the structure this version writes."""


@dataclass(frozen=True, order=True)
class Footprint:
    """What makes two runs of a part "the same work": batch size and input-shape family.

    ``shape_hash`` is a CRC-32 of every input's full shape in which a leading dimension equal
    to the batch size is written as ``*``. So ``(batch, shape_hash)`` still determines the full
    shapes, and all batch sizes of one input layout share a ``shape_hash`` — which is what the
    batch-size regression groups on. CRC-32 (not :func:`hash`) keeps footprints identical
    across processes and machines, so models saved by one run are found by the next.
    """

    batch: int
    shape_hash: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.batch, int) or self.batch < 0:
            raise ValueError(f"batch size must be a non-negative int, got {self.batch!r}")
        if not isinstance(self.shape_hash, int) or not 0 <= self.shape_hash < 2**32:
            raise ValueError(f"shape_hash must be a 32-bit unsigned int, got {self.shape_hash!r}")

    @classmethod
    def from_shapes(cls, shapes: ShapesLike, *, batch: int | None = None,
                    axes: Mapping[str, int] | None = None) -> Footprint:
        """Footprint of a run whose inputs have ``shapes``.

        ``shapes`` is a list of shapes (in input order) or a mapping input name -> shape (names
        are sorted, so feed order does not matter). The batch size is ``batch`` or, when
        omitted, the leading dimension of the first input. The batch dimension is left out of
        the hash, so every batch size of one set of other sizes is one family (the regression
        across batch sizes fits it): the axis ``axes`` names for an input (the plan's batching
        contract: a state ``[2, batch, 64]`` has it on axis 1; an input it leaves out has none),
        else, without ``axes``, axis 0 where it equals the batch.
        """
        by_name = isinstance(shapes, Mapping)
        items = shapes.items() if isinstance(shapes, Mapping) else (("", s) for s in shapes)
        named = [(str(k), tuple(operator.index(d) for d in v)) for k, v in items]
        first = named[0][1] if named else ()
        ordered = sorted(named) if by_name else named  # a list keeps its input order
        if batch is None:
            if not first:
                raise ValueError("cannot infer the batch size from these shapes; pass batch=")
            batch = first[0]
        batch = operator.index(batch)
        parts = []
        for name, dims in ordered:
            # an input the contract leaves out has no batch axis: a [1] or [4] shape tensor read
            # at batch 1 or 4 starred there alone put that batch size in a family of its own
            star = axes.get(name) if axes else 0
            text = ",".join("*" if i == star and d == batch else str(d) for i, d in enumerate(dims))
            parts.append(f"{name}[{text}]")
        return cls(batch=batch, shape_hash=zlib.crc32(";".join(parts).encode("utf-8")))

    @staticmethod
    def of_feeds(feeds: Mapping[str, Any], batch: int, axes: Mapping[str, int] | None = None) -> Footprint:
        """The footprint of a part's inputs, as the engine, calibration and the simulator key it
        (``axes``: each input's batch axis, :meth:`staronnx.plan.Plan.part_batch_axes`).

        Serving sees the same few shapes over and over, so footprints are cached by shape: the
        CRC over the shapes is then paid once per shape, not once per task.
        """
        return _cached_footprint(tuple((n, v.shape) for n, v in feeds.items()), batch,
                                 tuple(sorted(axes.items())) if axes else ())

    def __str__(self) -> str:
        return f"{self.batch}/{self.shape_hash:08x}"


@functools.lru_cache(maxsize=4096)
def _cached_footprint(shapes: tuple[tuple[str, tuple[int, ...]], ...], batch: int,
                      axes: tuple[tuple[str, int], ...] = ()) -> Footprint:
    return Footprint.from_shapes(dict(shapes), batch=batch, axes=dict(axes))


class SampleOutcome(Enum):
    """What :meth:`HistoryModel.record` did with a sample (for logs, tests and counters)."""

    DROPPED_FIRST = "dropped_first"  # created the entry; the sample itself is discarded
    ACCEPTED = "accepted"  # averaged into the entry
    OUTLIER = "outlier"  # outside the band; counted in nerror only
    RESET = "reset"  # outlier that made nerror >= n: the entry was emptied


@dataclass
class HistoryEntry:
    """Running statistics of one footprint. ``sum`` and ``sum2`` are in seconds, seconds²."""

    n: int = 0
    sum: float = 0.0
    sum2: float = 0.0
    nerror: int = 0

    @property
    def mean(self) -> float:
        """Mean of the accepted samples, NaN when there are none."""
        return self.sum / self.n if self.n else math.nan

    @property
    def stddev(self) -> float:
        """Population standard deviation (StarPU's ``deviation``), NaN without samples."""
        if not self.n:
            return math.nan
        return math.sqrt(abs(self.sum2 - self.sum * self.sum / self.n) / self.n)

    def add(self, seconds: float, max_error: float = HISTORY_MAX_ERROR) -> SampleOutcome:
        """Fold one sample in with StarPU's outlier and reset rules."""
        if self.n:
            bound = 1.0 + max_error
            mean = self.sum / self.n
            # Multiplications rather than StarPU's ratios: no division by a zero time.
            if seconds > bound * mean or mean > bound * seconds:
                self.nerror += 1
                if self.nerror >= self.n:
                    self.n, self.sum, self.sum2, self.nerror = 0, 0.0, 0.0, 0
                    return SampleOutcome.RESET
                return SampleOutcome.OUTLIER
        self.accept(seconds)
        return SampleOutcome.ACCEPTED

    def accept(self, seconds: float) -> None:
        """Average one sample in, unjudged (the judging is :meth:`add`'s, or a merged run's)."""
        self.n, self.sum, self.sum2 = self.n + 1, self.sum + seconds, self.sum2 + seconds * seconds

    def copy(self) -> HistoryEntry:
        """An independent copy (entries are mutable)."""
        return HistoryEntry(self.n, self.sum, self.sum2, self.nerror)


class PendingSample(NamedTuple):
    """A sample recorded in memory but not yet merged into the on-disk model.

    ``seconds is None`` records that the entry was created (and its first sample dropped), so
    that replaying on disk creates the entry without counting the warm-up sample. ``outcome``
    is the recording run's verdict on the sample; a merge applies it as it is (see
    :meth:`HistoryModel.replay`). ``None`` (a hand-built journal) lets the merge judge it.
    """

    footprint: Footprint
    seconds: float | None
    outcome: SampleOutcome | None = None


@dataclass(frozen=True)
class PerfRow:
    """One line of a ``perfmodel show`` table: a footprint's statistics and its family's fit."""

    part: int
    arch: str
    batch: int
    shape_hash: str
    n: int
    mean: float
    stddev: float
    nerror: int
    calibrated: bool
    prediction: float
    regression: NLRegression | None


def _check_seconds(seconds: float) -> float:
    value = float(seconds)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"a measured time must be finite seconds >= 0, got {seconds!r}")
    return value


class HistoryModel:
    """Measured times of one plan part on one arch (e.g. ``"cpu"``, ``"cuda0"``), per footprint.

    ``record`` folds a measurement in; ``predict`` answers the scheduler (NaN = uncalibrated);
    ``needs_samples`` tells the runtime whether timing this run is worth it. Samples recorded
    since the model was loaded are also kept in an *unsaved* journal, which
    :class:`~staronnx.perfmodels.store.PerfModelStore` replays into the on-disk model under a
    lock, so concurrent processes add up their samples instead of overwriting each other.
    """

    def __init__(self, part: int, arch: str, *, calibrate_minimum: int = CALIBRATE_MINIMUM,
                 max_error: float = HISTORY_MAX_ERROR, use_regression: bool = True,
                 min_regression_sizes: int = MIN_SIZES) -> None:
        if not isinstance(part, int) or part < 0:
            raise ValueError(f"part must be a non-negative int, got {part!r}")
        if not arch or not isinstance(arch, str):
            raise ValueError(f"arch must be a non-empty string, got {arch!r}")
        if calibrate_minimum < 1:
            raise ValueError("calibrate_minimum must be >= 1")
        if max_error <= 0:
            raise ValueError("max_error must be > 0")
        self.part = part
        self.arch = arch
        self.calibrate_minimum = int(calibrate_minimum)
        self.max_error = float(max_error)
        self.use_regression = use_regression
        self.min_regression_sizes = int(min_regression_sizes)
        self._entries: dict[Footprint, HistoryEntry] = {}
        #: the entries as last read from (or written to) the store: what this run "saw" of
        #: the stored history, which a reset in this run may discard there (see replay)
        self._baseline: dict[Footprint, HistoryEntry] = {}
        self._unsaved: list[PendingSample] = []
        self._fits: dict[int, NLRegression | None] = {}
        #: each fit's calibrated means (batch size -> seconds) as they were when it was made
        self._fitted_on: dict[int, dict[int, float]] = {}
        self._lock = threading.RLock()

    # -- recording -------------------------------------------------------------------------

    def record(self, footprint: Footprint, seconds: float) -> SampleOutcome:
        """Fold in one measured execution time, in seconds, and journal it for saving."""
        value = _check_seconds(seconds)
        with self._lock:
            entry = self._entries.get(footprint)
            if entry is None:  # the journal says "created", so a merge drops the warm-up sample too
                self._entries[footprint] = HistoryEntry()
                self._unsaved.append(PendingSample(footprint, None, SampleOutcome.DROPPED_FIRST))
                return SampleOutcome.DROPPED_FIRST
            outcome = entry.add(value, self.max_error)
            if outcome is SampleOutcome.RESET or (entry.n >= self.calibrate_minimum and self._moved(footprint, entry)):
                self._fits.pop(footprint.shape_hash, None)
            self._unsaved.append(PendingSample(footprint, value, outcome))
            return outcome

    def replay(self, samples: Iterable[PendingSample],
               baseline: Mapping[Footprint, HistoryEntry] | None = None) -> None:
        """Apply another model's journal to this one (the on-disk merge), without journaling.

        The recording run's verdicts stand: its accepted samples are added, its outliers
        counted, whatever this model's mean is. Judging them again here would let one
        process's samples reset another's: two calibrations at once on a loaded machine
        measure different times, and StarPU's reset (errors >= samples) would empty the
        entry of the first to merge. A reset in the recording run means its history had
        drifted: it removes what that run saw (``baseline``, the entries it loaded, plus its
        own earlier samples), not the samples other processes merged meanwhile.
        """
        with self._lock:
            _merge(self._entries, samples, baseline or {}, self.max_error)
            self._fits.clear()

    def baseline(self) -> dict[Footprint, HistoryEntry]:
        """Copies of the entries as last read from or written to the store (for replay)."""
        with self._lock:
            return {fp: e.copy() for fp, e in self._baseline.items()}

    def take_unsaved(self) -> list[PendingSample]:
        """Hand over the journal of samples not yet saved, and clear it."""
        with self._lock:
            pending, self._unsaved = self._unsaved, []
            return pending

    def restore_unsaved(self, samples: Iterable[PendingSample]) -> None:
        """Put a taken journal back in front (its save failed), so a later save retries it."""
        with self._lock:
            self._unsaved[:0] = list(samples)

    def checkpoint(self) -> dict[str, Any]:
        """:meth:`to_dict` and clear the journal in one step, for a full overwrite.

        Doing both under the lock means a sample recorded concurrently is either in the saved
        state or still in the journal, never both and never neither.
        """
        with self._lock:
            self._unsaved = []
            self._baseline = {fp: e.copy() for fp, e in self._entries.items()}
            return self.to_dict()

    @property
    def unsaved_count(self) -> int:
        return len(self._unsaved)

    def sync_from(self, other: HistoryModel) -> None:
        """Adopt ``other``'s entries (the merged on-disk state), keeping unsaved samples.

        Samples recorded here after the journal was taken are re-applied on top, so a worker
        recording while the store commits loses nothing.
        """
        with self._lock:
            stored = other.entries()
            entries = {fp: e.copy() for fp, e in stored.items()}
            _merge(entries, self._unsaved, stored, self.max_error)
            self._entries = entries
            self._baseline = stored
            self._fits.clear()

    def overwrite(self, other: HistoryModel) -> None:
        """Take ``other``'s entries for the footprints it has, keep this model's for the others
        (StarPU's ``STARPU_CALIBRATE=2`` footprint by footprint: what a replacing calibration
        measured replaces the stored entries, what it was not asked about or never reached
        stays)."""
        with self._lock:
            for fp, entry in other.entries().items():
                self._entries[fp] = entry.copy()
            self._fits.clear()

    # -- predicting ------------------------------------------------------------------------

    def predict(self, footprint: Footprint) -> float:
        """Expected seconds for a run with this footprint, NaN if uncalibrated.

        The entry's mean once it has ``calibrate_minimum`` samples; otherwise the batch-size
        regression of the footprint's shape family when one can be fitted; otherwise NaN.
        """
        with self._lock:
            entry = self._entries.get(footprint)
            if entry is not None and entry.n >= self.calibrate_minimum:
                return entry.mean
            fit = self.regression(footprint.shape_hash)
            return fit.predict(footprint.batch) if fit is not None else math.nan

    def needs_samples(self, footprint: Footprint) -> bool:
        """Whether the runtime should time runs of this footprint (entry not yet calibrated)."""
        with self._lock:
            entry = self._entries.get(footprint)
            return entry is None or entry.n < self.calibrate_minimum

    def _moved(self, footprint: Footprint, entry: HistoryEntry) -> bool:
        """Whether the family's fit no longer reflects this calibrated entry: a batch size it was
        made without, or a mean :data:`REFIT_DRIFT` away from the one it used. A fit is a
        non-linear least-squares solve (tens of microseconds): refitted on every sample of a
        serving model, it cost the server's event loop about 10 µs per request."""
        used = self._fitted_on.get(footprint.shape_hash, {}).get(footprint.batch)
        return used is None or abs(entry.mean - used) > REFIT_DRIFT * used

    def regression(self, shape_hash: int) -> NLRegression | None:
        """The ``a*n**b + c`` fit over this family's calibrated batch sizes, refitted lazily.

        ``None`` when regression is disabled or fewer than ``min_regression_sizes`` batch
        sizes are calibrated.
        """
        if not self.use_regression:
            return None
        with self._lock:
            if shape_hash not in self._fits:
                calibrated = {fp.batch: e.mean for fp, e in self._entries.items()
                              if fp.shape_hash == shape_hash and e.n >= self.calibrate_minimum}
                self._fits[shape_hash] = fit_nl_regression(list(calibrated), list(calibrated.values()),
                                                           min_sizes=self.min_regression_sizes)
                self._fitted_on[shape_hash] = calibrated
            return self._fits[shape_hash]

    # -- inspection ------------------------------------------------------------------------

    def entries(self) -> dict[Footprint, HistoryEntry]:
        with self._lock:
            return {fp: e.copy() for fp, e in self._entries.items()}

    def entry(self, footprint: Footprint) -> HistoryEntry | None:
        """A copy of one entry, or ``None`` if the footprint was never recorded."""
        with self._lock:
            entry = self._entries.get(footprint)
            return entry.copy() if entry is not None else None

    def __len__(self) -> int:
        return len(self._entries)

    def rows(self) -> list[PerfRow]:
        """Display rows, sorted by shape family then batch size."""
        with self._lock:
            return [PerfRow(part=self.part, arch=self.arch, batch=fp.batch, shape_hash=f"{fp.shape_hash:08x}", n=e.n,
                            mean=e.mean, stddev=e.stddev, nerror=e.nerror, calibrated=e.n >= self.calibrate_minimum,
                            prediction=self.predict(fp), regression=self.regression(fp.shape_hash))
                    for fp, e in self._by_family()]

    def _by_family(self) -> list[tuple[Footprint, HistoryEntry]]:
        """The entries sorted by shape family, then batch size: how tables and files list them."""
        return sorted(self._entries.items(), key=lambda kv: (kv[0].shape_hash, kv[0].batch))

    # -- serialization ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form. ``mean``/``stddev``/``regressions`` are for humans; loading uses
        only the sums, so a hand-edited mean cannot disagree with the statistics."""

        def num(x: float) -> float | None:
            return x if math.isfinite(x) else None

        with self._lock:
            entries = [
                {"batch": fp.batch, "shape_hash": f"{fp.shape_hash:08x}", **asdict(e), "mean": num(e.mean),
                 "stddev": num(e.stddev)}
                for fp, e in self._by_family()
            ]
            fits = {h: self.regression(h) for h in sorted({fp.shape_hash for fp in self._entries})}
            regressions = [{"shape_hash": f"{h:08x}", **fit.to_dict()} for h, fit in fits.items() if fit is not None]
            return {"part": self.part, "arch": self.arch, "unit": "seconds", "entries": entries,
                    "regressions": regressions}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **options: Any) -> HistoryModel:
        """Inverse of :meth:`to_dict`; raises :class:`PerfModelFormatError` on bad content.

        ``options`` are the constructor's keyword options (calibrate_minimum, ...), which are
        settings of the reader, not data of the file.
        """
        try:
            if data.get("unit", "seconds") != "seconds":
                raise PerfModelFormatError(f"unsupported time unit {data.get('unit')!r}")
            part, arch = data["part"], data["arch"]
            if isinstance(part, bool) or not isinstance(part, int) or not isinstance(arch, str):
                raise PerfModelFormatError("part must be an int and arch a string")
            model = cls(part, arch, **options)
            for raw in data["entries"]:
                fp = Footprint(_as_int(raw["batch"]), int(str(raw["shape_hash"]), 16))
                entry = HistoryEntry(_as_int(raw["n"]), _as_float(raw["sum"]), _as_float(raw["sum2"]),
                                     _as_int(raw["nerror"]))
                if entry.n < 0 or entry.nerror < 0 or entry.sum < 0 or entry.sum2 < 0:
                    raise PerfModelFormatError(f"negative statistics for footprint {fp}")
                if fp in model._entries:
                    raise PerfModelFormatError(f"footprint {fp} appears twice")
                model._entries[fp] = entry
            model._baseline = {fp: e.copy() for fp, e in model._entries.items()}
            return model
        except PerfModelFormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PerfModelFormatError(f"malformed history model: {exc!r}") from exc


def _merge(entries: dict[Footprint, HistoryEntry], samples: Iterable[PendingSample],
           baseline: Mapping[Footprint, HistoryEntry], max_error: float) -> None:
    """Fold a run's journal into ``entries`` with the run's own verdicts (see
    :meth:`HistoryModel.replay`); ``baseline`` is what the run had loaded."""
    seen = {fp: e.copy() for fp, e in baseline.items()}  # what the run saw, per footprint
    for sample in samples:
        fp = sample.footprint
        seconds = None if sample.seconds is None else _check_seconds(sample.seconds)
        entry = entries.setdefault(fp, HistoryEntry())
        if seconds is None:  # "entry created": the warm-up sample was dropped
            continue
        mine = seen.setdefault(fp, HistoryEntry())
        outcome = sample.outcome
        if outcome is None:  # no verdict recorded: judge it against this history
            outcome = entry.add(seconds, max_error)
            if outcome is SampleOutcome.ACCEPTED:
                mine.accept(seconds)
            continue
        if outcome is SampleOutcome.ACCEPTED:
            entry.accept(seconds)
            mine.accept(seconds)
        elif outcome is SampleOutcome.OUTLIER:
            entry.nerror += 1
            mine.nerror += 1
        elif outcome is SampleOutcome.RESET:
            # the run's history had drifted: drop what it saw, keep what others added since
            if entry.n >= mine.n and entry.sum >= mine.sum * (1 - 1e-9):
                entry.n -= mine.n
                entry.sum = max(entry.sum - mine.sum, 0.0) if entry.n else 0.0
                entry.sum2 = max(entry.sum2 - mine.sum2, 0.0) if entry.n else 0.0
                entry.nerror = max(entry.nerror - mine.nerror, 0)
            seen[fp] = HistoryEntry()


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PerfModelFormatError(f"expected an integer, got {value!r}")
    return value


def _as_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PerfModelFormatError(f"expected a finite number, got {value!r}")
    return float(value)
