"""The live engine and the simulator share one core: the same arrivals give the same schedule.

The live side is the real thing - ``Server`` (its batcher thread, queue and in-flight limit),
``NativeEngine`` (its worker threads and lock), real ONNX Runtime sessions computing real
outputs - with two substitutions that make it deterministic: a virtual clock (the simulator's
``SimClock``) and workers whose run time is the perf model's mean, spent on that clock. A
conductor advances the clock one event at a time, only once every thread has settled, with
the simulator's rule (completions before arrivals at the same instant). The simulator replays
the same arrivals with ``spread=0``. Both must start the same tasks on the same workers at
the same instants, and fill the same serving records.

Times are multiples of 2**-14 s, so every sum and difference is exact and the policy's
bookkeeping cannot differ by a rounding; the test fails loudly if two tasks end at the same
instant (their order would then be a thread race, not a decision). Policies that place at
push with FIFO queues (dm, dmda) are compared; with shared queues (eager, ws) which idle thread
pops first, and with heft's priority queues whether a worker pops before or after the batcher
thread pushes a new batch, are races the live side cannot fix, so those are left out.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from staronnx.bench.simclock import SimClock
from staronnx.bench.machine import PerfTable, SimMachine, profile_plan
from staronnx.bench.simulator import simulate
from staronnx.partition import partition
from staronnx.perfmodels import HistoryModel, PerfModelStore
from staronnx.plan import Plan
from staronnx.runtime.engine import NativeEngine
from staronnx.runtime.policies import make_policy
from staronnx.runtime.predictor import PerfPredictor
from staronnx.runtime.sched import Policy, TaskView, WorkerInfo
from staronnx.serving import ServeSpec, Server
from staronnx.serving.server import StandInRuntime
from staronnx.workers.base import Worker
from staronnx.zoo import chain
from staronnx.partition import PartitionSpec
from staronnx.bench.spec import SimSpec

U = 2.0**-14  # the time quantum: every time below is a whole number of U
BATCH = 2
#: (arch, cores) of the two workers: a slow one and a fast one, both on the host node
WORKERS = [("cpu1", 1), ("cpu2", 2)]
#: units of U per (part, arch)
UNITS = {"cpu1": (301, 187, 143), "cpu2": (163, 97, 71)}


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Plan:
    root = tmp_path_factory.mktemp("replay")
    onnx.save(chain(depth=6, width=16), str(root / "chain.onnx"))
    return partition(root / "chain.onnx", [0.4, 0.3, 0.3], PartitionSpec(profile_runs=2), output_dir=root / "plan")


@pytest.fixture(scope="module")
def store(plan, tmp_path_factory) -> PerfModelStore:
    """Calibrated models whose every sample is the part's time: the mean is exact."""
    store = PerfModelStore(tmp_path_factory.mktemp("models"))
    fps = profile_plan(plan, BATCH).footprints
    for arch, units in UNITS.items():
        for part in range(plan.k):
            model = HistoryModel(part, arch)
            for _ in range(11):
                model.record(fps[part], units[part] * U)
            store.save(plan.hash, model)
    return store


def recording(name: str) -> Policy:
    """A policy of that name that logs (time, worker, request, part) of every task it hands out."""
    base = type(make_policy(name))

    class Recording(base):  # type: ignore[misc, valid-type]
        log: list[tuple[float, int, int, int]]

        def setup(self) -> None:
            super().setup()
            self.log = []

        def pop(self, worker_id: int) -> TaskView | None:
            view = super().pop(worker_id)
            if view is not None:
                self.log.append((self.clock.now(), worker_id, view.request, view.part))
            return view

    return Recording()


# -- the live side -------------------------------------------------------------------------------
class Conductor:
    """Holds each running task until the virtual clock reaches its end."""

    def __init__(self, clock: SimClock) -> None:
        self.clock = clock
        self.cond = threading.Condition()
        self.running: dict[int, tuple[float, threading.Event]] = {}  # worker -> (end, release)

    def spend(self, worker: int, seconds: float) -> None:
        """Called in a worker thread: block until the conductor moves the clock to the end."""
        release = threading.Event()
        with self.cond:
            self.running[worker] = (self.clock.now() + seconds, release)
        assert release.wait(60), "the conductor never released this task"

    def next_end(self) -> tuple[float, int] | None:
        with self.cond:
            ends = sorted((end, w) for w, (end, _) in self.running.items())
        if len(ends) > 1 and ends[0][0] == ends[1][0]:
            pytest.fail(f"two tasks end at {ends[0][0]}: their order would be a thread race; change UNITS")
        return ends[0] if ends else None

    def release(self, worker: int) -> None:
        with self.cond:
            end, event = self.running.pop(worker)
        self.clock.advance(end)
        event.set()


class ClockedWorker(Worker):
    """A worker (the engine's Worker protocol, whose defaults it takes) with real ORT sessions
    whose time is virtual."""

    kind = "cpu"
    memory_node = "numa0"
    last_compute_seconds = None

    def __init__(self, index: int, arch: str, n_cores: int, plan: Plan, conductor: Conductor) -> None:
        self.index, self.arch, self.n_cores = index, arch, n_cores
        self.name = f"clocked{index}:{arch}"
        self.conductor = conductor
        self.sessions = [ort.InferenceSession(str(plan.part_path(p.index)), providers=["CPUExecutionProvider"])
                         for p in plan.parts]
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=self.name)

    def spawn(self, fn: Callable[[], Any]) -> Future[Any]:
        return self.pool.submit(fn)

    def run_here(self, part: int, feeds: dict[str, np.ndarray], timed: bool = True) -> dict[str, np.ndarray]:
        session = self.sessions[part]
        values = session.run(None, dict(feeds))
        self.conductor.spend(self.index, UNITS[self.arch][part] * U)
        return {o.name: v for o, v in zip(session.get_outputs(), values)}

    def close(self) -> None:
        self.pool.shutdown()


class CountingRuntime(StandInRuntime):
    """What the server sees: the engine, counting the batches it has taken (once pushed)."""

    def __init__(self, engine: NativeEngine) -> None:
        self.engine, self.plan, self.submitted = engine, engine.plan, 0
        self.workers = engine.workers

    def submit(self, feeds):
        future = self.engine.submit(feeds)  # tasks pushed and workers woken before it returns
        self.submitted += 1
        return future


def settled(engine: NativeEngine, rt: CountingRuntime, server: Server, conductor: Conductor) -> None:
    """Wait until no thread can act before the clock moves: the batcher with nothing to do and
    every batch it formed pushed, every worker idle or held by the conductor. Read downstream
    (server, runtime, workers) and twice: the counters only grow, so an unchanged reading means
    nothing moved in between."""

    def state() -> tuple[Any, ...] | None:
        recs = server.records()  # one consistent copy, under the server's lock
        with server._cond:  # finished batches the batcher has not handed out yet: it will, at
            # the current instant, so the clock must wait for it (a batcher descheduled for
            # longer than the 2 ms below looked settled under load, and stamped a later time)
            handing_out = len(server._completions) + server._resolving
        if handing_out:
            return None
        queued = sum(r.batch_id < 0 and not r.rejected for r in recs.requests)
        running = sum(b.done is None for b in recs.batches)
        submitted = rt.submitted
        with conductor.cond:
            held = len(conductor.running)
        idle = engine.idle
        if (running < server.max_inflight and queued >= server.batch_size) or submitted != len(recs.batches) \
                or idle + held != len(engine.workers):
            return None
        tasks = sum(st.tasks for st in engine.core.workers)
        return (len(recs.requests), len(recs.batches), running, submitted, held, idle, tasks)

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        first = state()
        if first is not None:
            time.sleep(0.002)
            if state() == first:
                return
        time.sleep(0.0005)
    pytest.fail("the live engine never settled")


def run_live(plan: Plan, store: PerfModelStore, arrivals: list[float], policy: str, max_inflight: int):
    clock = SimClock(arrivals[0])
    conductor = Conductor(clock)
    workers = [ClockedWorker(i, arch, n, plan, conductor) for i, (arch, n) in enumerate(WORKERS)]
    pol = recording(policy)
    engine = NativeEngine(plan, workers, pol, PerfPredictor(plan.hash, store), clock=clock, own_workers=True)
    rt = CountingRuntime(engine)
    server = Server(rt, ServeSpec(BATCH, queue_capacity=64, max_inflight=max_inflight), clock=clock.now)
    rng = np.random.default_rng(0)
    samples = [{"x": rng.standard_normal((1, 16)).astype(np.float32)} for _ in arrivals]
    futures = []
    try:
        i = 0
        while True:
            settled(engine, rt, server, conductor)
            nxt = conductor.next_end()
            if nxt is not None and (i == len(arrivals) or nxt[0] <= arrivals[i]):
                conductor.release(nxt[1])
            elif i < len(arrivals):
                clock.advance(arrivals[i])
                futures.append(server.submit(samples[i], arrival=arrivals[i]))
                i += 1
                if i == len(arrivals):
                    server.flush()  # as the load generator does after its last submission
            else:
                break
        outputs = [f.result(timeout=10) for f in futures]
        records = server.records()
    finally:
        server.close(timeout=10)
        engine.close(timeout=10)
    for sample, out in zip(samples, outputs):  # the virtual time did not fake the results
        np.testing.assert_allclose(out["y"], plan.run_reference(sample)["y"], rtol=1e-5, atol=1e-6)
    return pol.log, records


def run_sim(plan: Plan, store: PerfModelStore, arrivals: list[float], policy: str, max_inflight: int):
    infos = [WorkerInfo(i, f"clocked{i}:{arch}", arch, "cpu", "numa0", n) for i, (arch, n) in enumerate(WORKERS)]
    machine = SimMachine(plan, infos, PerfTable(PerfPredictor(plan.hash, store)))
    pol = recording(policy)
    res = simulate(machine, 1.0, BATCH, SimSpec(policy=pol, spread=0.0, queue_capacity=64), arrivals=arrivals,
                   max_inflight=max_inflight)
    return pol.log, res.records


@pytest.mark.parametrize("policy,max_inflight", [("dmda", 2), ("dmda", 8), ("dm", 3)])
def test_live_engine_and_simulator_take_the_same_decisions(plan, store, policy, max_inflight):
    assert [o.name for o in plan.outputs] == ["y"] and [i.name for i in plan.inputs] == ["x"]
    gaps = np.random.default_rng(1).integers(20, 260, size=31)
    arrivals = [float(t) * U for t in np.concatenate([[0], np.cumsum(gaps)])]  # 32 requests
    live_log, live = run_live(plan, store, arrivals, policy, max_inflight)
    sim_log, sim = run_sim(plan, store, arrivals, policy, max_inflight)

    # the same tasks, started on the same workers at the same instants
    assert len(sim_log) == len(arrivals) // BATCH * plan.k
    assert sorted(live_log) == sorted(sim_log)
    assert {w for _, w, _, _ in sim_log} == {0, 1}  # both workers got work: the choice was real
    # the same serving records: batches formed and done at the same times, parts placed alike
    assert [(b.id, b.size, b.formed, b.done, b.placement) for b in live.batches] == \
        [(b.id, b.size, b.formed, b.done, b.placement) for b in sim.batches]
    assert [(r.id, r.arrival, r.batch_id, r.first_in_batch, r.done) for r in live.requests] == \
        [(r.id, r.arrival, r.batch_id, r.first_in_batch, r.done) for r in sim.requests]
