"""Scheduling policies, driven by hand or by a tiny discrete-event simulator: no threads, no ORT.

The clock is a FakeClock the test moves; predictions come from a dict {(part, arch): seconds}
and transfers from bytes / bandwidth of the inputs not valid on the worker's memory node.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staronnx.errors import StaronnxError
from staronnx.perfmodels.helpcost import HelpCost
from staronnx.runtime.policies import (
    POLICIES,
    DmdaPolicy,
    HeftPolicy,
    PolicyError,
    make_policy,
    upward_ranks,
)
from staronnx.runtime.policies.dmda import Decision
from staronnx.runtime.sched import DataView, Policy, TaskView, WorkerInfo

NAN = math.nan
MS = 1e-3


# -- fakes ------------------------------------------------------------------------------------
class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


class FakePredictor:
    """exec: {(part, arch) or (part, arch, batch): seconds}; missing entries give ``default``."""

    def __init__(self, exec_times: dict, bandwidth: float = 1e9, latency: float = 0.0,
                 default: float = NAN) -> None:
        self.times = dict(exec_times)
        self.bandwidth = bandwidth
        self.latency = latency
        self.default = default

    def exec_time(self, task: TaskView, worker: WorkerInfo) -> float:
        key = (task.part, worker.arch, task.batch)
        if key in self.times:
            return self.times[key]
        return self.times.get((task.part, worker.arch), self.default)

    def transfer_time(self, task: TaskView, worker: WorkerInfo) -> float:
        return sum(self.latency + d.nbytes / self.bandwidth for d in task.inputs
                   if d.nbytes and worker.memory_node not in d.valid_on)


GPU = WorkerInfo(0, "cuda0", "cuda0", "cuda", "cuda0")
CPU = WorkerInfo(1, "cpu0", "cpu4", "cpu", "numa0", ncores=4)
CPU_B = WorkerInfo(2, "cpu1", "cpu4", "cpu", "numa1", ncores=4)

_ids = itertools.count()
_handles = itertools.count()


def data(nbytes: int, *nodes: str) -> DataView:
    n = next(_handles)
    return DataView(n, f"t{n}", nbytes, frozenset(nodes))


def task(part: int = 0, batch: int = 1, inputs: Sequence[DataView] = (), priority: float = 0.0,
         **fields) -> TaskView:
    return TaskView(id=next(_ids), part=part, batch=batch, request=0, inputs=list(inputs),
                    priority=priority, **fields)


def attached(policy: Policy | str, workers: Sequence[WorkerInfo], times: dict | None = None,
             dag: Sequence[Sequence[int]] = (), clock: FakeClock | None = None, **kw) -> Policy:
    p = make_policy(policy) if isinstance(policy, str) else policy
    p.attach(workers, FakePredictor(times or {}, **kw), clock or FakeClock(), dag)
    return p


def cand(decision: Decision, worker: int):
    return next(c for c in decision.candidates if c.worker == worker)


# -- a tiny discrete-event simulator ---------------------------------------------------------
@dataclass
class Sim:
    placements: dict[tuple[int, int], int] = field(default_factory=dict)  # (req, part) -> worker
    decisions: dict[tuple[int, int], Decision] = field(default_factory=dict)
    done_at: dict[tuple[int, int], float] = field(default_factory=dict)


def simulate(policy: Policy, workers: Sequence[WorkerInfo], times: dict, dag: Sequence[Sequence[int]],
             arrivals: Sequence[float], input_bytes: int = 0, crossing_bytes: int = 100_000,
             bandwidth: float = 1e9) -> Sim:
    """Run requests through ``policy``: each worker runs one task at a time for its predicted
    time plus the transfer of inputs not on its node; outputs stay on the worker's node."""
    clock = FakeClock()
    predictor = FakePredictor(times, bandwidth=bandwidth)
    policy.attach(workers, predictor, clock, dag)
    preds = [[p for p in range(len(dag)) if s in dag[p]] for s in range(len(dag))]
    sim = Sim()
    outputs: dict[tuple[int, int], DataView] = {}
    events: list = []
    seq = itertools.count()
    for r, at in enumerate(arrivals):
        heapq.heappush(events, (at, next(seq), "arrive", r))
    busy = {w.id: False for w in workers}
    by_id = {w.id: w for w in workers}

    def push(r: int, part: int, releasing: int | None) -> None:
        if part in [p for p in range(len(dag)) if not preds[p]]:
            inputs = [data(input_bytes, "numa0")]
        else:
            inputs = [outputs[(r, p)] for p in preds[part]]
        t = TaskView(id=next(_ids), part=part, batch=1, request=r, inputs=inputs)
        t.releasing_worker = releasing
        placed = policy.push(t)
        if placed is not None:
            sim.placements[(r, part)] = placed
        if isinstance(policy, DmdaPolicy):
            assert policy.last_decision is not None
            sim.decisions[(r, part)] = policy.last_decision

    while events:
        now, _, kind, payload = heapq.heappop(events)
        clock.t = now
        if kind == "arrive":
            for part in range(len(dag)):
                if not preds[part]:
                    push(payload, part, None)
        else:
            wid, t = payload
            busy[wid] = False
            policy.on_done(wid, t, times[(t.part, by_id[wid].arch)], now)
            sim.done_at[(t.request, t.part)] = now
            outputs[(t.request, t.part)] = data(crossing_bytes, by_id[wid].memory_node)
            for s in dag[t.part]:
                if all((t.request, p) in sim.done_at for p in preds[s]):
                    push(t.request, s, wid)
        for w in workers:
            if busy[w.id]:
                continue
            t = policy.pop(w.id)
            if t is None:
                continue
            sim.placements[(t.request, t.part)] = w.id
            policy.on_start(w.id, t, now)
            busy[w.id] = True
            duration = predictor.transfer_time(t, w) + times[(t.part, w.arch)]
            heapq.heappush(events, (now + duration, next(seq), "done", (w.id, t)))
    assert policy.pending() == 0
    return sim


# -- make_policy ------------------------------------------------------------------------------
def test_every_name_builds_a_policy_with_that_name():
    assert set(POLICIES) == {"eager", "random", "ws", "lws", "dm", "dmda", "dmdar", "dmdas", "heft"}
    for name in POLICIES:
        p = make_policy(name)
        assert isinstance(p, Policy) and p.name == name


def test_unknown_policy_lists_the_valid_names():
    with pytest.raises(PolicyError) as info:
        make_policy("fifo")
    assert isinstance(info.value, StaronnxError) and isinstance(info.value, ValueError)
    for name in POLICIES:
        assert name in str(info.value)


def test_bad_options_are_refused():
    with pytest.raises(PolicyError, match="eager.*no options"):
        make_policy("eager", alpha=1.0)
    with pytest.raises(PolicyError, match="alpha, beta"):
        make_policy("dmda", alfa=1.0)
    with pytest.raises(PolicyError, match="beta"):
        make_policy("dmdas", beta=-1)
    with pytest.raises(PolicyError, match="alpha"):
        make_policy("heft", alpha="fast")
    assert make_policy("DMDA", alpha=2, beta=0.5).alpha == 2.0  # names are case-insensitive


def test_places_at_push_flags():
    assert [n for n in POLICIES if make_policy(n).places_at_push] == \
        ["random", "dm", "dmda", "dmdar", "dmdas", "heft"]


# -- the acceptance scenario: a 2-part chain, part 0 10x and part 1 3x faster on the GPU --------
CHAIN = [[1], []]
CHAIN_TIMES = {(0, "cuda0"): 1 * MS, (0, "cpu4"): 10 * MS, (1, "cuda0"): 1 * MS, (1, "cpu4"): 3 * MS}


@pytest.mark.parametrize("name", ["heft", "dmda", "dmdas", "dmdar"])
def test_low_load_runs_both_parts_on_the_gpu(name):
    sim = simulate(make_policy(name), [GPU, CPU], CHAIN_TIMES, CHAIN, [i * 10 * MS for i in range(20)])
    assert set(sim.placements.values()) == {GPU.id}


@pytest.mark.parametrize("name", ["heft", "dmda", "dmdas"])
def test_under_load_part1_overflows_to_the_cpu_but_part0_does_not(name):
    # 2 ms of GPU work per request arriving every 1.6 ms: the GPU alone cannot keep up
    sim = simulate(make_policy(name), [GPU, CPU], CHAIN_TIMES, CHAIN, [i * 1.6 * MS for i in range(300)])
    on_cpu = Counter(part for (r, part), w in sim.placements.items() if w == CPU.id)
    assert on_cpu[0] == 0
    assert on_cpu[1] >= 20
    # and it keeps up: latency stays bounded instead of growing with the queue
    latency = max(sim.done_at[(r, 1)] - r * 1.6 * MS for r in range(300))
    assert latency < 15 * MS


def test_model_based_policies_beat_blind_ones_under_load():
    arrivals = [i * 1.6 * MS for i in range(300)]

    def worst_latency(name: str) -> float:
        sim = simulate(make_policy(name), [GPU, CPU], CHAIN_TIMES, CHAIN, arrivals)
        return max(sim.done_at[(r, 1)] - at for r, at in enumerate(arrivals))

    blind = min(worst_latency(n) for n in ("eager", "ws", "random"))
    for name in ("dmda", "dmdas", "heft"):
        assert worst_latency(name) < blind / 3


@pytest.mark.parametrize("name", ["heft", "dmda"])
def test_part0_goes_to_the_cpu_only_when_the_cpu_finishes_it_sooner(name):
    # a burst of 40 requests: the GPU queue soon exceeds the 10 ms part 0 takes on the CPU. On
    # a host where a CPU task costs the GPU nothing (StarPU's decision): with the default
    # cost (the H200's, test_cpu_help_costs.py) a CPU 10x slower than the GPU takes nothing
    sim = simulate(make_policy(name, help_cost=HelpCost.free()), [GPU, CPU], CHAIN_TIMES, CHAIN, [0.0] * 40)
    part0_cpu = [r for (r, part), w in sim.placements.items() if part == 0 and w == CPU.id]
    assert part0_cpu, "a long enough GPU queue must send some part 0 to the CPU"
    for (r, part), d in sim.decisions.items():
        if part != 0:
            continue
        cpu_end, gpu_end = cand(d, CPU.id).end, cand(d, GPU.id).end
        if d.worker == CPU.id:
            assert cpu_end < gpu_end
        else:
            assert gpu_end <= cpu_end


# -- dmda decision details --------------------------------------------------------------------
def test_transfer_decides_between_equal_compute_times():
    times = {(0, "cuda0"): 1.0, (0, "cpu4"): 1.0}
    p = attached("dmda", [GPU, CPU], times)
    assert p.push(task(inputs=[data(10**8, "cuda0")])) == GPU.id  # data on the GPU
    p = attached("dmda", [GPU, CPU], times)
    # the data is on the host: a tie on compute, but the GPU would pay a transfer
    assert p.push(task(inputs=[data(10**8, "numa0")])) == CPU.id
    d = p.last_decision
    assert cand(d, GPU.id).transfer == pytest.approx(0.1)
    assert cand(d, GPU.id).end == pytest.approx(1.1)  # max(0 + 0, 0 + T) + L
    assert cand(d, GPU.id).fitness == pytest.approx(0.1 + 0.1)  # alpha*(end-best) + beta*T
    # dm ignores data: the tie goes to the first worker
    p = attached("dm", [GPU, CPU], times)
    assert p.push(task(inputs=[data(10**8, "numa0")])) == GPU.id


@pytest.mark.parametrize(
    "alpha, beta, expected",
    [(1.0, 1.0, CPU.id), (1.0, 0.0, GPU.id), (1.0, 0.5, GPU.id), (2.0, 1.0, GPU.id), (1.0, 2.0, CPU.id)],
)
def test_alpha_and_beta_weigh_completion_against_transfer(alpha, beta, expected):
    # GPU: L=1, T=0.5 -> end 1.5, fitness 0.5*beta; CPU: L=1.8, T=0 -> fitness 0.3*alpha
    times = {(0, "cuda0"): 1.0, (0, "cpu4"): 1.8}
    p = attached(DmdaPolicy(alpha=alpha, beta=beta), [GPU, CPU], times)
    assert p.push(task(inputs=[data(5 * 10**8, "numa0")])) == expected


def test_strict_less_than_tie_goes_to_the_first_worker_in_order():
    times = {(0, "cpu4"): 1.0}
    p = attached("dmda", [CPU, CPU_B], times)
    assert p.push(task()) == CPU.id
    p = attached("dmda", [CPU_B, CPU], times)
    assert p.push(task()) == CPU_B.id
    # then alternates: the second task sees the first one queued
    assert p.push(task()) == CPU.id


def test_uncalibrated_arch_is_explored_greedily():
    cpu_a = WorkerInfo(1, "cpu_a", "cpu1", "cpu", "numa0", 1)
    cpu_b = WorkerInfo(2, "cpu_b", "cpu1", "cpu", "numa0", 1)
    # the GPU is calibrated and fast; cpu1 is not calibrated (NaN)
    p = attached("dmda", [GPU, cpu_a, cpu_b], {(0, "cuda0"): 1e-3})
    placed = []
    for _ in range(4):
        t = task()
        placed.append(p.push(t))
        assert t.predicted == 0.0 and t.transfer == 0.0 and t.extra["forced"]
        assert p.last_decision.forced
    # the first NaN candidate beats the calibrated GPU; then NaN candidates share by
    # (ntasks + pipeline_ntasks) / speedup, ties to the first
    assert placed == [cpu_a.id, cpu_b.id, cpu_a.id, cpu_b.id]
    assert p.queue(GPU.id).ntasks == 0


def test_no_model_is_greedy_by_queue_length_over_speedup():
    cpu1 = WorkerInfo(1, "cpu", "cpu1", "cpu", "numa0", 1)
    p = attached("dmda", [GPU, cpu1], {}, default=0.0)  # 0.0: no model at all
    placed = [p.push(task()) for _ in range(4)]
    # push 1: both empty -> GPU (first); push 2: GPU 2/13.33 > CPU 0 -> CPU;
    # push 3: GPU 0.15 < CPU 2/0.5 -> GPU; push 4: GPU 4/13.33 = 0.3 < 4 -> GPU
    assert placed == [GPU.id, cpu1.id, GPU.id, GPU.id]
    assert math.isnan(p.last_decision.best_end)


def test_one_uncalibrated_candidate_forces_greedy_even_if_another_is_calibrated():
    p = attached("dmda", [GPU, CPU], {(0, "cuda0"): 1e-3, (0, "cpu4"): NAN})
    first = task()
    assert p.push(first) == CPU.id and p.last_decision.forced
    assert math.isnan(first.extra["expected_end"])


def test_queue_bookkeeping_matches_hand_computation():
    clock = FakeClock(0.0)
    p = attached("dmda", [GPU], {(0, "cuda0"): 2.0}, clock=clock)
    q = p.queue(GPU.id)
    inp = data(5 * 10**8, "numa0")  # 0.5 s to bring to cuda0
    a, b, c = task(inputs=[inp]), task(inputs=[inp]), task(inputs=[inp])

    p.push(a)  # end = max(0 + 0, 0 + 0.5) + 2; T' = 0.5 (nothing queued to hide it)
    assert (a.predicted, a.transfer, a.extra["expected_end"]) == pytest.approx((2.0, 0.5, 2.5))
    assert a.placed_on == GPU.id and not a.extra["forced"]
    assert (q.exp_start, q.exp_len, q.exp_end, q.ntasks, q.pipeline_ntasks) == pytest.approx((0, 2.5, 2.5, 1, 1))
    p.push(b)  # end = max(2.5, 0.5) + 2; T' = 0 (hidden behind a)
    assert (b.transfer, b.extra["expected_end"]) == pytest.approx((0.0, 4.5))
    assert (q.exp_len, q.exp_end, q.ntasks, q.pipeline_ntasks) == pytest.approx((4.5, 4.5, 2, 2))

    clock.t = 0.1
    assert p.pop(GPU.id) is a  # T' moves to the pipeline, exp_start = now + pipeline_len
    assert (q.exp_start, q.exp_len, q.pipeline_len, q.exp_end, q.ntasks) == pytest.approx((0.6, 4.0, 0.5, 4.6, 1))
    p.on_start(GPU.id, a, 0.6)  # T' leaves, L moves from exp_len to the pipeline
    assert (q.exp_start, q.exp_len, q.pipeline_len, q.exp_end) == pytest.approx((2.6, 2.0, 2.0, 4.6))
    p.on_done(GPU.id, a, 1.4, 2.0)  # early: exp_start keeps its later value
    assert (q.exp_start, q.exp_len, q.pipeline_len, q.pipeline_ntasks) == pytest.approx((2.6, 2.0, 0.0, 1))

    clock.t = 2.0
    assert p.pop(GPU.id) is b
    assert (q.exp_start, q.exp_len, q.exp_end, q.ntasks) == pytest.approx((2.0, 2.0, 4.0, 0))
    p.on_start(GPU.id, b, 2.0)
    assert (q.exp_start, q.exp_len, q.pipeline_len) == pytest.approx((4.0, 0.0, 2.0))

    clock.t = 3.0
    p.push(c)  # end = max(max(4, 3) + 0, 3 + 0.5) + 2 = 6; now + T = 3.5 < exp_end 4: hidden
    assert (c.transfer, c.extra["expected_end"]) == pytest.approx((0.0, 6.0))
    assert (q.exp_start, q.exp_len, q.exp_end) == pytest.approx((4.0, 2.0, 6.0))
    p.on_done(GPU.id, b, 2.5, 4.5)  # late: exp_start moves to now
    assert (q.exp_start, q.exp_len, q.exp_end, q.pipeline_len, q.pipeline_ntasks) == pytest.approx((4.5, 2.0, 6.5, 0.0, 1))


def test_late_worker_pushes_start_from_now():
    clock = FakeClock(0.0)
    p = attached("dmda", [GPU], {(0, "cuda0"): 1.0}, clock=clock)
    clock.t = 10.0  # nothing happened for 10 s: exp_start (0) is stale
    t = task()
    p.push(t)
    assert t.extra["expected_end"] == pytest.approx(11.0)
    assert p.queue(GPU.id).exp_start == pytest.approx(10.0)


_OPS = st.lists(st.sampled_from(["push", "pop", "tick"]), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS, name=st.sampled_from(["dm", "dmda", "dmdar", "dmdas", "heft"]))
def test_accounting_returns_to_zero_when_everything_ran(ops, name):
    clock = FakeClock(0.0)
    times = {(0, "cuda0"): 0.01, (0, "cpu4"): 0.05, (1, "cuda0"): 0.02, (1, "cpu4"): 0.03}
    p = attached(name, [GPU, CPU], times, dag=[[1], []], clock=clock)
    pushed, ran = [], []
    for i, op in enumerate(ops):
        if op == "push":
            t = task(part=i % 2, inputs=[data(10**6 * (i % 3), "numa0" if i % 2 else "cuda0")])
            p.push(t)
            pushed.append(t)
        elif op == "tick":
            clock.t += 0.007
        else:
            for w in (GPU, CPU):
                t = p.pop(w.id)
                if t is not None:
                    assert t.placed_on == w.id
                    p.on_start(w.id, t, clock.now())
                    p.on_done(w.id, t, 0.01, clock.now())
                    ran.append(t)
    for w in (GPU, CPU):
        while (t := p.pop(w.id)) is not None:
            p.on_start(w.id, t, clock.now())
            p.on_done(w.id, t, 0.01, clock.now())
            ran.append(t)
    assert sorted(t.id for t in ran) == sorted(t.id for t in pushed)
    assert p.pending() == 0
    for w in (GPU, CPU):
        q = p.queue(w.id)
        assert q.exp_len == pytest.approx(0.0, abs=1e-9)
        assert q.pipeline_len == pytest.approx(0.0, abs=1e-9)
        assert q.pipeline_ntasks == 0 and q.ntasks == 0


# -- queues: dmdas priorities, ready-first pops ----------------------------------------------
def test_dmdas_pops_by_priority_and_fifo_among_equals():
    p = attached("dmdas", [CPU], {(0, "cpu4"): 1.0})
    ts = [task(priority=pr) for pr in (0, 5, 5, 1, 5)]
    for t in ts:
        p.push(t)
    order = [p.pop(CPU.id) for _ in ts]
    assert [ts.index(t) for t in order] == [1, 2, 4, 3, 0]
    assert p.pop(CPU.id) is None


def test_dmda_queue_ignores_priorities():
    p = attached("dmda", [CPU], {(0, "cpu4"): 1.0})
    ts = [task(priority=pr) for pr in (0, 5, 1)]
    for t in ts:
        p.push(t)
    assert [p.pop(CPU.id) for _ in ts] == ts


@pytest.mark.parametrize("name", ["dmdar", "dmdas"])
def test_ready_first_pop_prefers_inputs_already_on_the_node(name):
    p = attached(name, [CPU], {(0, "cpu4"): 1.0})
    far = task(inputs=[data(10**6, "cuda0")])
    near = task(inputs=[data(10**6, "numa0", "cuda0")])
    p.push(far)
    p.push(near)
    assert p.pop(CPU.id) is near
    assert p.pop(CPU.id) is far
    # plain dmda takes the head whatever its data
    p = attached("dmda", [CPU], {(0, "cpu4"): 1.0})
    p.push(far)
    p.push(near)
    assert p.pop(CPU.id) is far


def test_ready_first_fewest_missing_bytes_and_head_priority_floor():
    # dmdar's FIFO queue: a ready task of lower priority than the head is not considered
    p = attached("dmdar", [CPU], {(0, "cpu4"): 1.0})
    head = task(priority=1, inputs=[data(10**6, "cuda0")])
    low_ready = task(priority=0)
    p.push(head)
    p.push(low_ready)
    assert p.pop(CPU.id) is head
    # fewest non-ready bytes wins, not just ready/not ready
    p = attached("dmdar", [CPU], {(0, "cpu4"): 1.0})
    big, small = task(inputs=[data(10**7, "cuda0")]), task(inputs=[data(10**3, "cuda0")])
    p.push(big)
    p.push(small)
    assert p.pop(CPU.id) is small
    # dmdas: same-priority tasks compete, lower ones wait even if ready
    p = attached("dmdas", [CPU], {(0, "cpu4"): 1.0})
    a = task(priority=1, inputs=[data(10**6, "cuda0")])
    b = task(priority=1)
    c = task(priority=0)
    for t in (c, a, b):
        p.push(t)
    assert [p.pop(CPU.id) for _ in range(3)] == [b, a, c]


# -- eager, random, ws ------------------------------------------------------------------------
def test_eager_is_one_fifo_for_everyone():
    p = attached("eager", [GPU, CPU])
    ts = [task() for _ in range(4)]
    assert all(p.push(t) is None for t in ts)
    assert p.pending() == 4
    assert [p.pop(CPU.id), p.pop(GPU.id), p.pop(GPU.id), p.pop(CPU.id)] == ts
    assert p.pop(GPU.id) is None and p.pending() == 0


def test_random_draws_in_proportion_to_speedup():
    cpu1 = WorkerInfo(2, "cpu1", "cpu1", "cpu", "numa0", 1)
    workers = [GPU, CPU, cpu1]  # speedups 13.33, 2.0, 0.5
    p = attached(make_policy("random", seed=7), workers)
    n = 30_000
    counts = Counter(p.push(task()) for _ in range(n))
    total = sum(w.speedup for w in workers)
    for w in workers:
        assert counts[w.id] / n == pytest.approx(w.speedup / total, abs=0.01)
    # per-worker FIFO
    firsts = [t for t in (p.pop(CPU.id) for _ in range(3))]
    assert [t.id for t in firsts] == sorted(t.id for t in firsts)


def test_random_is_reproducible_with_a_seed():
    def draws(seed: int) -> list[int | None]:
        p = attached(make_policy("random", seed=seed), [GPU, CPU])
        return [p.push(task()) for _ in range(200)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


def test_ws_pushes_to_the_releasing_worker_else_round_robin():
    p = attached("ws", [GPU, CPU, CPU_B])
    rr = [task() for _ in range(4)]
    for t in rr:
        assert p.push(t) is None
    released = task(releasing_worker=CPU_B.id)
    p.push(released)
    # round-robin from the first worker: GPU, CPU, CPU_B, GPU; the released one on CPU_B
    assert p.pop(GPU.id) is rr[0] and p.pop(GPU.id) is rr[3]
    assert p.pop(CPU_B.id) is rr[2] and p.pop(CPU_B.id) is released


def test_ws_owner_pops_oldest_highest_thief_steals_from_the_back():
    p = attached("ws", [GPU, CPU])
    t1, t2, t3, t4 = (task(priority=pr, releasing_worker=GPU.id) for pr in (0, 1, 1, 0))
    for t in (t1, t2, t3, t4):
        p.push(t)
    assert p.pop(GPU.id) is t2  # owner: highest priority, oldest
    assert p.pop(CPU.id) is t3  # thief: back of the highest-priority bucket
    assert t3.extra["stolen_from"] == GPU.id
    assert p.pop(CPU.id) is t4  # then back of the next bucket
    assert p.pop(GPU.id) is t1
    assert p.pop(CPU.id) is None and p.pending() == 0


def test_ws_victims_round_robin_and_lws_by_proximity():
    cpu_c = WorkerInfo(3, "cpu2", "cpu4", "cpu", "numa0", 4)
    workers = [GPU, CPU, CPU_B, cpu_c]
    ws = attached("ws", workers)
    for w in (GPU, CPU_B, cpu_c):
        for _ in range(2):
            ws.push(task(releasing_worker=w.id))
    # CPU (id 1) is idle: victims in turn, resuming after the last one robbed
    stolen_from = [ws.pop(CPU.id).extra["stolen_from"] for _ in range(4)]
    assert stolen_from == [GPU.id, CPU_B.id, cpu_c.id, GPU.id]

    lws = attached("lws", workers)
    assert lws.victims(CPU.id) == [cpu_c.id, CPU_B.id, GPU.id]  # same node, same kind, rest
    for w in (GPU, CPU_B, cpu_c):
        lws.push(task(releasing_worker=w.id))
    assert [lws.pop(CPU.id).extra["stolen_from"] for _ in range(3)] == [cpu_c.id, CPU_B.id, GPU.id]


def test_ws_runs_a_chain_where_its_predecessor_ran():
    sim = simulate(make_policy("ws"), [GPU, CPU], CHAIN_TIMES, CHAIN, [i * 20 * MS for i in range(6)])
    for r in range(6):
        assert sim.placements[(r, 0)] == sim.placements[(r, 1)]


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_completes_a_simulated_run(name):
    sim = simulate(make_policy(name), [GPU, CPU, CPU_B], CHAIN_TIMES, CHAIN, [i * MS for i in range(50)])
    assert len(sim.done_at) == 100


# -- remove_worker ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", POLICIES)
def test_remove_worker_returns_its_queued_tasks_and_stops_using_it(name):
    times = {(0, "cuda0"): 1.0, (0, "cpu4"): 1.0}
    p = attached(make_policy(name, **({"seed": 2} if name == "random" else {})), [GPU, CPU], times)
    pushed = [task() for _ in range(16)]
    for t in pushed:
        p.push(t)
    returned = p.remove_worker(CPU.id)
    assert p.pending() == len(pushed) - len(returned)
    if name != "eager":
        assert returned, "the dead worker had tasks queued"
    assert p.pop(CPU.id) is None
    later = [task() for _ in range(6)]
    for t in later:
        assert p.push(t) in (None, GPU.id)
    drained = []
    while (t := p.pop(GPU.id)) is not None:
        p.on_start(GPU.id, t, 0.0)
        p.on_done(GPU.id, t, 1.0, 0.0)
        drained.append(t)
    ids = sorted(t.id for t in returned + drained)
    assert ids == sorted(t.id for t in pushed + later)
    assert p.pending() == 0


# -- heft -------------------------------------------------------------------------------------
DIAMOND = [[1, 2], [3], [3], []]
DIAMOND_TIMES = {
    (0, "cuda0"): 2.0, (0, "cpu4"): 4.0,  # mean 3
    (1, "cuda0"): 1.0, (1, "cpu4"): 5.0,  # mean 3
    (2, "cuda0"): 2.0, (2, "cpu4"): 2.0,  # mean 2
    (3, "cuda0"): 1.0, (3, "cpu4"): 3.0,  # mean 2
}


def test_upward_ranks_on_a_diamond():
    # r3 = 2; r1 = 3 + 2; r2 = 2 + 2; r0 = 3 + max(5, 4)
    assert upward_ranks(DIAMOND, [3.0, 3.0, 2.0, 2.0]) == [8.0, 5.0, 4.0, 2.0]
    assert upward_ranks(DIAMOND, [1.0] * 4) == [3.0, 2.0, 2.0, 1.0]
    assert upward_ranks([], [1.5, 2.5]) == [1.5, 2.5]  # no DAG: no successors


def test_heft_sets_upward_rank_priorities():
    p = attached("heft", [GPU, CPU], DIAMOND_TIMES, dag=DIAMOND)
    assert isinstance(p, HeftPolicy)
    ts = [task(part=k) for k in range(4)]
    for t in ts:
        p.push(t)
    assert [t.priority for t in ts] == pytest.approx([8.0, 5.0, 4.0, 2.0])


def test_heft_uses_path_lengths_until_calibrated_and_caches_per_batch():
    times = {k: v for k, v in DIAMOND_TIMES.items() if k[0] != 2}  # part 2 unknown: NaN
    p = attached("heft", [GPU, CPU], times, dag=DIAMOND)
    t = task(part=0)
    p.push(t)
    assert t.priority == 3.0  # longest path, in parts
    p.predictor.times[(2, "cuda0")] = p.predictor.times[(2, "cpu4")] = 2.0  # calibrated now
    t = task(part=0)
    p.push(t)
    assert t.priority == pytest.approx(8.0)
    # per batch size: batch 4 takes twice as long everywhere
    for (part, arch), s in DIAMOND_TIMES.items():
        p.predictor.times[(part, arch, 4)] = 2 * s
    t = task(part=0, batch=4)
    p.push(t)
    assert t.priority == pytest.approx(16.0)
    assert p.ranks(1) == pytest.approx([8.0, 5.0, 4.0, 2.0])  # cached, unchanged


def test_heft_learns_footprints_of_other_parts():
    class FootprintPredictor(FakePredictor):
        """Like the engine's: no footprint, no model (0.0)."""

        def exec_time(self, task, worker):
            return super().exec_time(task, worker) if task.footprint is not None else 0.0

    p = make_policy("heft")
    p.attach([GPU, CPU], FootprintPredictor(DIAMOND_TIMES), FakeClock(), DIAMOND)
    first = task(part=0, footprint="fp0")
    p.push(first)
    assert first.priority == 3.0  # parts 1-3 never seen at this batch: unit weights
    for k in (1, 2, 3):
        p.push(task(part=k, footprint=f"fp{k}"))
    again = task(part=0, footprint="fp0")
    p.push(again)
    assert again.priority == pytest.approx(8.0)


def test_heft_orders_a_workers_queue_by_rank():
    p = attached("heft", [GPU], DIAMOND_TIMES, dag=DIAMOND)
    late = task(part=3)
    early = task(part=0)
    p.push(late)
    p.push(early)
    assert p.pop(GPU.id) is early


@pytest.mark.parametrize("name", ["dmda", "dmdas", "heft", "dm"])
def test_a_decision_asks_once_per_arch_and_per_memory_node(name):
    """A GPU's streams are alike workers (one arch, one memory node): a decision asks the perf
    model once per arch and the bus model once per node, not once per stream (with 8 streams
    the per-worker asks made dmda cost 6x eager's host calls per task), and still places as the
    rule says: the queued streams are passed over for the idle one, the CPU's slower end loses."""

    class Counting(FakePredictor):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.exec_asks: Counter = Counter()
            self.transfer_asks: Counter = Counter()

        def exec_time(self, task, worker):
            self.exec_asks[worker.arch] += 1
            return super().exec_time(task, worker)

        def transfer_time(self, task, worker):
            self.transfer_asks[worker.memory_node] += 1
            return super().transfer_time(task, worker)

    streams = [WorkerInfo(i, f"cuda0.s{i}", "cuda0", "cuda", "cuda0") for i in range(8)]
    cpu = WorkerInfo(8, "cpu0", "cpu4", "cpu", "numa0", ncores=4)
    predictor = Counting({(0, "cuda0"): 1e-3, (0, "cpu4"): 5e-3})
    p = make_policy(name)
    p.attach([*streams, cpu], predictor, FakeClock(), [[]])
    x = DataView(1, "x", 4096, frozenset({"numa0"}))
    placed = []
    for _ in range(8):
        placed.append(p.push(task(inputs=[x])))
        # as many asks for the 8 streams' arch as for the one CPU group's (heft also asks per arch
        # for its ranks)
        assert set(predictor.exec_asks) == {"cuda0", "cpu4"}
        assert predictor.exec_asks["cuda0"] == predictor.exec_asks["cpu4"] <= 2
        # dm is blind to data: it never asks for a transfer
        assert predictor.transfer_asks == (Counter() if name == "dm" else Counter({"cuda0": 1, "numa0": 1}))
        predictor.exec_asks.clear()
        predictor.transfer_asks.clear()
    assert sorted(placed) == list(range(8))  # each stream once: the idle one wins, never the CPU
    # every stream busy for 1 ms: a stream's 2 ms (+ the copy) still beats the CPU's 5 ms
    assert p.push(task(inputs=[x])) == 0
    assert p.push(task(inputs=[x])) == 1
