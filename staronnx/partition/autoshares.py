"""``--shares auto``: the split that fits this machine, or one part where a split cannot pay.

85/15 is the StarONNX papers' setting for a P100 beside its CPUs. On an H100 the CPU is worth
3-6 % of the GPU, and a second task per batch costs a fixed ~100 µs (benchmarks/engines.py) plus
its transfers, so the right split is a property of the machine, not of the model.

The rule, from the whole model's time per batch on each worker (measured by
:func:`measure_speeds`, or given with ``--speeds-from PLAN``): alike workers (all within
``latency_ratio`` of the fastest) get one part, as whole batches spread over them do as well as
a split without its extra tasks and transfers. Beside a fast device, slow workers would idle (a
whole batch there takes ``latency_ratio`` times longer), so a split hands them the tail of every
batch, sized to balance the two stages, each paying the fixed per-task cost.

Beside a GPU, the CPU stage is also charged what it costs the GPU stage: while a CPU task runs,
the GPU side loses ``help.host_share`` of its throughput (the host core and the GIL its driver
thread needs: 13 % on the H200, where a 7 % CPU tail predicted +4.9 % at batch 8 and lost 26 %),
the same estimate the dmda family uses to place tasks
(:class:`~staronnx.perfmodels.helpcost.HelpCost`), so a split is cut only where the policy would
run it. It is kept when its predicted throughput beats the fast device alone by more than
``min_gain`` and more than the fast device's own run-to-run spread (:attr:`WorkerSpeed.spread`,
measured by timing it three times): a gain the GPU's own noise can hide is not one to pay a
second task per batch for.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Callable

import onnxruntime as ort

from staronnx.errors import PartitionError
from staronnx.perfmodels.helpcost import HelpCost

__all__ = ["WorkerSpeed", "SharesChoice", "choose_shares", "concurrent_seconds", "measure_speeds", "median_seconds",
           "is_auto"]

#: a task's fixed cost in the native engine (benchmarks/engines.py, dmda, pipelined)
FIXED_TASK_SECONDS = 100e-6


@dataclass(frozen=True)
class WorkerSpeed:
    """The whole model's time for one batch on one worker (or on each of ``count`` alike ones:
    CPU groups of one size, GPUs of one model; a GPU's streams share it, so a GPU counts once)."""

    name: str  # "cuda0", "cpu4", ...
    kind: str  # "cuda" | "cpu"
    seconds: float
    count: int = 1
    #: batches a GPU had in flight while timed (its streams): ``seconds`` is then the time per
    #: batch at that concurrency, not one batch's latency
    streams: int = 1
    #: run-to-run spread of the timing ((max - min) / median of repeated timings; 0: timed once)
    spread: float = 0.0

    @property
    def label(self) -> str:
        """How the reason names it: ``cpu14x2``, ``cuda0 (4 streams)``."""
        label = f"{self.name}x{self.count}" if self.count > 1 else self.name
        return f"{label} ({self.streams} streams)" if self.streams > 1 else label

    @property
    def rate(self) -> float:
        """Batches per second these workers finish together."""
        return self.count / self.seconds


@dataclass
class SharesChoice:
    """What ``--shares auto`` chose, and why; stored in the plan's settings."""

    shares: list[float]
    batch: int
    reason: str
    speeds: list[WorkerSpeed]
    #: predicted samples/s: one part on the fastest device alone, and the split (if any)
    predicted: dict[str, float] = field(default_factory=dict)

    @property
    def parts(self) -> int:
        return len(self.shares)

    def to_json(self) -> dict[str, Any]:
        return {
            "shares": self.shares, "batch": self.batch, "reason": self.reason,
            "speeds": [asdict(s) for s in self.speeds], "predicted_samples_per_s": self.predicted,
        }


def is_auto(shares: object) -> bool:
    """True for ``"auto"`` (any case, surrounding spaces ignored)."""
    return isinstance(shares, str) and shares.strip().lower() == "auto"


def choose_shares(
    speeds: Sequence[WorkerSpeed],
    batch: int,
    *,
    fixed_cost: float = FIXED_TASK_SECONDS,
    min_gain: float = 0.03,
    latency_ratio: float = 2.0,
    transfer_seconds: float = 0.0,
    help: HelpCost = HelpCost(),
) -> SharesChoice:
    """Shares for a fast device beside slow workers (see the module's rule); pure arithmetic.

    ``transfer_seconds`` is the crossing tensors' copy per batch, charged to the slow stage;
    ``help``: what a CPU task costs a GPU stage (the host's measured one where it has one).
    """
    speeds = [s for s in speeds if s.count > 0]
    if not speeds:
        raise PartitionError("shares='auto' needs at least one worker speed",
                             cli="--shares auto needs at least one worker speed")
    for s in speeds:
        if not (math.isfinite(s.seconds) and s.seconds > 0):
            raise PartitionError(f"worker {s.name}: time per batch must be > 0 s, got {s.seconds}")
    fast = min(speeds, key=lambda s: s.seconds)
    slow = [s for s in speeds if s.seconds > latency_ratio * fast.seconds]
    # the fast class: every worker within latency_ratio of the fastest (several GPUs, alike CPU
    # groups), their rates added; a GPU's streams share one device, so a GPU counts once
    fast_class = [s for s in speeds if s not in slow]
    fast_rate = sum(s.rate for s in fast_class)  # batches/s, no fixed cost
    alone = {"one part": batch / (1 / fast_rate + fixed_cost)}
    if not slow:
        where = "a single worker" if len(speeds) == 1 and speeds[0].count == 1 else "workers within " \
            f"{latency_ratio:g}x of each other"
        return SharesChoice([1.0], batch, f"one part: {where}, so whole batches spread over the workers "
                            "do as well as a split, without its extra tasks", list(speeds), alone)
    slow_rate = sum(s.rate for s in slow)  # batches/s of the slow workers together
    # CPU seconds a batch's tail keeps a slow worker busy, per unit of tail (their mean time)
    slow_seconds = sum(s.count for s in slow) / slow_rate
    # the GPU side's loss while they run (a CPU stage beside CPU workers costs them nothing)
    share_lost = help.host_share if any(s.kind == "cuda" for s in fast_class) else 0.0

    def period(tail: float) -> float:  # seconds per batch of the two-stage pipeline
        fast_stage = (1 - tail) / fast_rate + fixed_cost + share_lost * tail * slow_seconds
        return max(fast_stage, tail / slow_rate + fixed_cost + transfer_seconds)

    share = min((i / 100 for i in range(1, 51)), key=period)
    split = batch / period(share)
    predicted = {**alone, "split": split}
    gain = split / alone["one part"] - 1
    slow_names = ", ".join(s.label for s in slow)
    fast_names = " + ".join(s.label for s in fast_class)
    spread = max(s.spread for s in fast_class)
    charged = f", charged {share_lost:.0%} of the GPU while they run" if share_lost else ""
    if gain < max(min_gain, spread):
        bar = (f"{fast_names} alone's own run-to-run spread ({spread:.1%})" if spread > min_gain else
               f"the {min_gain:.0%} a second task per batch must pay for")
        return SharesChoice(
            [1.0], batch,
            f"one part: {slow_names} would add {gain:+.1%} to {fast_names} alone{charged}, less than {bar}",
            list(speeds), predicted)
    return SharesChoice(
        [round(1 - share, 2), share], batch,
        f"{1 - share:.2f}/{share:.2f}: {slow_names} take the last {share:.0%} of each batch, "
        f"predicted {gain:+.1%} over {fast_names} alone{charged}"
        + (f" (beyond its run-to-run spread, {spread:.1%})" if spread else ""), list(speeds), predicted)


# ---------------------------------------------------------------------- measuring
def median_seconds(run: Callable[[], object], runs: int, warmup: int = 2) -> float:
    """Median wall time of ``runs`` calls of ``run`` after ``warmup`` untimed ones (first runs
    pay allocations and kernel selection; the median shrugs off a preempted run)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def concurrent_seconds(calls: Sequence[Callable[[], object]], rounds: int, warmup: int = 2,
                       enter: Callable[[], AbstractContextManager[object]] = nullcontext) -> float:
    """Wall time per call with every call of ``calls`` looping on its own thread at once
    (``rounds`` each, after ``warmup`` untimed ones per thread, all threads started together):
    a GPU's time per batch when that many batches are in flight, which is what its streams
    serve at and what one batch's latency overstates (an H200 ran googlenet at batch 8 2.0x
    faster with 4 sessions in flight than with one).  ``enter`` is each thread's context (the
    CUDA capture mode is per thread)."""
    if not calls or rounds < 1:
        raise ValueError("concurrent_seconds needs at least one call and one round")
    start = threading.Barrier(len(calls) + 1)
    errors: list[BaseException] = []

    def loop(call: Callable[[], object]) -> None:
        def repeat(times: int) -> None:
            try:
                for _ in range(times):
                    call()
            except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
                errors.append(exc)

        with enter():
            repeat(warmup)
            start.wait()
            if not errors:
                repeat(rounds)

    threads = [threading.Thread(target=loop, args=(c,), name=f"speed-{i}") for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall / (len(calls) * rounds)


def measure_speeds(
    model: Any,
    feeds: dict[str, Any],
    *,
    group_sizes: Sequence[int],
    cuda: bool,
    runs: int = 5,
    progress: Callable[[str], None] | None = None,
    cuda_devices: Sequence[int] = (0,),
    cuda_streams: int = 1,
) -> list[WorkerSpeed]:
    """Time the whole model on each GPU of ``cuda_devices`` (``cuda``) and on a CPU group of
    each size (each GPU is timed: one may be another model, or share its PCIe switch).

    ``group_sizes`` are the cores of each CPU worker (``[14]`` for one 14-core NUMA group);
    groups of one size are timed once and counted.  The GPU is timed through plain
    ``session.run`` with numpy in and out, so its copies are included, as a one-part plan pays them,
    with ``cuda_streams`` sessions running at once, one thread each, as the plan's streams will
    (:func:`concurrent_seconds`): timed one batch at a time, an H200 looked half as fast as its
    4 streams served, and the CPU's tail share won on paper and lost 25-55 % measured.
    """
    from staronnx.ortutil import QUIET, cuda_capture_safe, make_session, providers_for

    say = progress or (lambda _m: None)
    speeds: list[WorkerSpeed] = []
    if cuda:
        from staronnx.workers.cudart import host_runtime_from_env

        # STARONNX_CUDA_RUNTIME=host: the CPU provider stands in for CUDA, as it does for the CUDA
        # workers, so that the command a GPU user runs can be tried (and tested) without one
        stand_in = host_runtime_from_env() is not None
        if not stand_in:
            providers_for("cuda")  # fails in one line where CUDA is absent
        streams = max(int(cuda_streams), 1)
        for device in cuda_devices:
            say(f"timing the whole model on cuda{device}")
            with cuda_capture_safe():  # a runtime in this process may be capturing a CUDA graph
                on: list[str | tuple[str, dict[str, str]]] = ["CPUExecutionProvider"] if stand_in else [
                    ("CUDAExecutionProvider", {"device_id": str(device)}), "CPUExecutionProvider"]
                gpus = [make_session(model, providers=on) for _ in range(streams)]
            # timed three times: the spread is the bar a split's predicted gain must clear
            times = [concurrent_seconds([partial(g.run, None, feeds) for g in gpus], max(runs, 10),
                                        enter=cuda_capture_safe) for _ in range(3)]
            seconds = statistics.median(times)
            speeds.append(WorkerSpeed(f"cuda{device}", "cuda", seconds, streams=streams,
                                      spread=(max(times) - min(times)) / seconds))
            del gpus  # their device memory goes back before the next GPU's sessions
    for cores, count in sorted(Counter(group_sizes).items(), reverse=True):
        say(f"timing the whole model on a {cores}-core CPU group")
        so = ort.SessionOptions()
        so.intra_op_num_threads = max(int(cores), 1)
        so.inter_op_num_threads = 1
        so.log_severity_level = QUIET
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sess = make_session(model, providers=["CPUExecutionProvider"], options=so)
        speeds.append(WorkerSpeed(f"cpu{cores}", "cpu", median_seconds(lambda: sess.run(None, feeds), runs), count))
        del sess
    if not speeds:
        why = "found no worker to time (no CPU group, no GPU)"
        raise PartitionError(f"shares='auto' {why}", cli=f"--shares auto {why}")
    return speeds
