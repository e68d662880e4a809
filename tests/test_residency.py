"""Workers that do not hold every model (issue 23): ``residency`` loads a model on some workers
only, and every policy places its tasks there and nowhere else.

The policy tests drive each policy by hand (no threads, no ORT); the runtime tests run real
plans on real worker threads: CPU groups and CUDA workers on ``HostRuntime`` (the CUDA
pipeline over ORT's CPU provider), so they hold on any host.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import onnx
import pytest

from staronnx import partition
from staronnx.perfmodels import PerfModelStore
from staronnx.runtime.engine import EngineClosed
from staronnx.runtime.policies import POLICIES, make_policy
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import CudaOptions, RuntimeSpec
from staronnx.workers.layout import MachineSpec
from staronnx.runtime.sched import TaskView, WorkerInfo
from staronnx.workers.cudart import HostRuntime
from staronnx.workers.residency import ResidencyError, WorkerSlot, model_holders, parse_model_workers
from staronnx.zoo import chain, residual
from staronnx.partition import PartitionSpec

GPU = WorkerInfo(0, "cuda0.s0", "cuda0", "cuda", "cuda0")
CPU = WorkerInfo(1, "cpu:pus0", "cpu1", "cpu", "numa0", ncores=1)
CPU_B = WorkerInfo(2, "cpu:pus1", "cpu1", "cpu", "numa0", ncores=1)
_ids = itertools.count()


class Clock:
    def now(self) -> float:
        return 0.0


class Predictor:
    """Every part 1 ms on every worker, no transfer cost: placement is free to go anywhere,
    so only ``where`` keeps a task off a worker."""

    def exec_time(self, task: TaskView, worker: WorkerInfo) -> float:
        return 1e-3

    def transfer_time(self, task: TaskView, worker: WorkerInfo) -> float:
        return 0.0


#: part 0 on every worker, part 1 on the GPU only, part 2 on the second CPU group only
WHERE = [{0, 1, 2}, {0}, {2}]


@pytest.mark.parametrize("name", sorted(set(POLICIES) - {"static"}))
def test_every_policy_hands_a_task_only_to_a_worker_that_holds_its_part(name):
    policy = make_policy(name)
    policy.attach([GPU, CPU, CPU_B], Predictor(), Clock(), [[], [], []], WHERE)
    tasks = [TaskView(id=next(_ids), part=p, batch=1, request=i) for i in range(30) for p in (0, 1, 2)]
    for t in tasks:
        placed = policy.push(t)
        assert placed is None or placed in WHERE[t.part], (name, t.part, placed)
    popped: list[tuple[int, TaskView]] = []
    for _ in range(len(tasks) + 5):  # each worker in turn, as idle workers ask
        for w in (GPU, CPU, CPU_B):
            got = policy.pop(w.id)
            if got is not None:
                popped.append((w.id, got))
                policy.on_start(w.id, got, 0.0)
                policy.on_done(w.id, got, 1e-3, 0.0)
    assert sorted(t.id for _, t in popped) == sorted(t.id for t in tasks), f"{name} left tasks queued"
    assert all(wid in WHERE[t.part] for wid, t in popped), f"{name} gave a worker a part it does not hold"


@pytest.mark.parametrize("name", ["dmda", "heft", "random", "ws", "eager"])
def test_a_lost_holder_sends_its_tasks_to_the_other_holders_only(name):
    policy = make_policy(name)
    policy.attach([GPU, CPU, CPU_B], Predictor(), Clock(), [[], [], []], [{0, 1, 2}, {0, 2}, {2}])
    tasks = [TaskView(id=next(_ids), part=1, batch=1, request=i) for i in range(6)]
    for t in tasks:
        policy.push(t)
    orphans = policy.remove_worker(0)
    for t in orphans:  # what the core does with them: push again
        assert policy.push(t) in (None, 2)
    got = [policy.pop(1) for _ in range(8)]
    assert got == [None] * 8  # CPU (worker 1) never holds part 1
    assert len([t for _ in range(8) if (t := policy.pop(2)) is not None]) == 6


def test_static_placement_on_a_worker_without_the_part_is_refused():
    policy = make_policy("static", devices={0: "cuda0.s0", 1: "cpu:pus0", 2: "cpu:pus1"})
    with pytest.raises(ValueError, match="part 1 -> cpu:pus0"):
        policy.attach([GPU, CPU, CPU_B], Predictor(), Clock(), [[], [], []], WHERE)


def test_selectors_name_kinds_devices_and_workers_and_refuse_what_matches_nothing():
    slots = [WorkerSlot("cuda0.s0", "cuda", 0), WorkerSlot("cuda1.s0", "cuda", 1), WorkerSlot("cpu:numa0", "cpu")]
    assert model_holders({"a": "cpu", "b": "cuda1", "c": "cuda0.s0,cpu:numa0", "d": "cuda"},
                         ["a", "b", "c", "d", "e"], slots) == {"a": [2], "b": [1], "c": [0, 2], "d": [0, 1]}
    with pytest.raises(ResidencyError, match="'gpu' matches no worker.*cuda0.s0, cuda1.s0, cpu:numa0"):
        model_holders({"a": "gpu"}, ["a"], slots)
    with pytest.raises(ResidencyError, match="unknown model.*'z'.*serves a, b"):
        model_holders({"z": "cpu"}, ["a", "b"], slots)
    assert parse_model_workers(["a=cpu", " b = cuda0,cpu "]) == {"a": "cpu", "b": "cuda0,cpu"}
    for bad in (["a"], ["=cpu"], ["a="], ["a=cpu", "a=cuda"]):
        with pytest.raises(ResidencyError):
            parse_model_workers(bad)


# -- real runtimes --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """(big, small): 2-part cuts of a residual CNN and of an MLP chain, both reading ``x``."""
    root = tmp_path_factory.mktemp("residency")
    onnx.save(residual(blocks=2, channels=4, size=8), str(root / "big.onnx"))
    onnx.save(chain(depth=4, width=16), str(root / "small.onnx"))
    big = partition(root / "big.onnx", [0.6, 0.4], PartitionSpec(costs="estimate"), output_dir=root / "big")
    small = partition(root / "small.onnx", [0.5, 0.5], PartitionSpec(costs="estimate"), output_dir=root / "small")
    return big, small


def big_feeds(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((2, 4, 8, 8), dtype=np.float32)}


def small_feeds(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((2, 16), dtype=np.float32)}


def one_pu() -> str:
    return str(min(os.sched_getaffinity(0)))


def assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, ref in want.items():
        np.testing.assert_allclose(got[name], ref, atol=1e-4 * max(float(np.abs(ref).max()), 1.0), rtol=0)


@pytest.mark.parametrize("policy", ["heft", "eager", "ws"])
def test_a_model_kept_off_the_gpu_runs_only_on_the_cpu_and_both_match_their_references(plans, tmp_path, policy):
    big, small = plans
    with Runtime({"big": big, "small": small},
                 MachineSpec(groups=one_pu(), cuda_streams=1, cuda_graphs=False, residency={"big": "cpu"}),
                 RuntimeSpec(policy=policy, store=PerfModelStore(tmp_path),
                             cuda=CudaOptions(runtime=HostRuntime()))) as rt:
        cuda = next(w for w in rt.workers if w.kind == "cuda")
        cpu = next(w for w in rt.workers if w.kind == "cpu")
        assert cuda.holds == frozenset(range(big.k, big.k + small.k))  # no session of big's parts
        assert cpu.holds is None
        jobs = []
        for i in range(8):
            fb, fs = big_feeds(i), small_feeds(50 + i)
            jobs += [(rt.submit(fb, "big"), big, fb), (rt.submit(fs, "small"), small, fs)]
        for future, plan, feeds in jobs:
            assert_close(future.result(timeout=60), plan.run_reference(feeds))
        stats = rt.stats()
    models = stats["models"]
    assert models["big"]["held_by"] == [cpu.name]
    assert models["small"]["held_by"] == [cuda.name, cpu.name]
    ran_big = {key.rsplit("/", 1)[1] for key in models["big"]["tasks"]}
    assert ran_big == {cpu.arch}, f"big's tasks ran on {ran_big}"
    assert models["big"]["requests_done"] == 8 and models["small"]["requests_done"] == 8


def test_losing_a_models_only_holder_fails_that_model_and_keeps_the_other_running(plans, tmp_path):
    big, small = plans
    host = HostRuntime()
    with Runtime({"big": big, "small": small},
                 MachineSpec(groups=one_pu(), cuda_streams=1, cuda_graphs=False, residency={"small": "cuda"}),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path), cuda=CudaOptions(runtime=host))) as rt:
        rt.submit(small_feeds(0), "small").result(timeout=60)
        host.inject("copy_h2d", 700)  # an illegal address: the CUDA context, small's only home, is lost
        with pytest.raises(Exception):
            rt.submit(small_feeds(1), "small").result(timeout=60)
        with pytest.raises(EngineClosed, match="'small' can no longer run"):
            rt.submit(small_feeds(2), "small")
        fb = big_feeds(3)  # the other model goes on, on the CPU group
        assert_close(rt.submit(fb, "big").result(timeout=60), big.run_reference(fb))
        assert rt.stats()["models"]["small"]["held_by"] == []


def test_residency_refuses_a_selector_that_matches_no_worker_before_any_worker_starts(plans, tmp_path):
    big, small = plans
    with pytest.raises(ResidencyError, match="'cuda' matches no worker"):
        Runtime({"big": big, "small": small},
                MachineSpec(groups=one_pu(), residency={"small": "cuda"}),
                RuntimeSpec(store=PerfModelStore(tmp_path)))


# -- a model that does not fit in a GPU's memory --------------------------------------------
def test_a_model_that_does_not_fit_on_the_gpu_is_left_off_it_and_runs_on_the_cpu(plans, tmp_path, caplog):
    """The first session the CUDA worker loads (the big model's part 0) fails as an out-of-memory
    would: the runtime starts anyway, the CUDA worker holding the small model only, says so,
    and both models answer their references."""
    big, small = plans
    host = HostRuntime()
    host.inject("session_load", 2)  # cudaErrorMemoryAllocation
    with caplog.at_level("WARNING", logger="staronnx.workers.launch"):
        rt = Runtime({"big": big, "small": small},
                     MachineSpec(groups=one_pu(), cuda_streams=1, cuda_graphs=False),
                     RuntimeSpec(policy="heft", store=PerfModelStore(tmp_path), cuda=CudaOptions(runtime=host)))
    with rt:
        cuda = next(w for w in rt.workers if w.kind == "cuda")
        assert cuda.holds == frozenset(range(big.k, big.k + small.k))
        assert "model 'big' is left off this worker" in caplog.text and "does not fit" in caplog.text
        for i in range(4):
            fb, fs = big_feeds(i), small_feeds(i)
            assert_close(rt.submit(fb, "big").result(timeout=60), big.run_reference(fb))
            assert_close(rt.submit(fs, "small").result(timeout=60), small.run_reference(fs))
        assert rt.model("big").stats()["held_by"] == [w.name for w in rt.workers if w.kind == "cpu"]


def test_a_model_that_fits_nowhere_or_a_single_model_that_does_not_fit_is_an_error(plans, tmp_path):
    from staronnx.workers.cuda import PartDoesNotFit
    from staronnx.workers.groups import GroupError

    big, small = plans
    host = HostRuntime()
    host.inject("session_load", 2)
    with pytest.raises(GroupError, match="no worker holds model 'big'"):  # no CPU group to take it
        Runtime({"big": big, "small": small},
                MachineSpec(groups="none", cuda_streams=1, cuda_graphs=False),
                RuntimeSpec(store=PerfModelStore(tmp_path), cuda=CudaOptions(runtime=host)))
    host = HostRuntime()
    host.inject("session_load", 2)
    with pytest.raises(PartDoesNotFit, match="part 0 .* does not fit in the GPU's memory"):
        Runtime(big,
                MachineSpec(groups=one_pu(), cuda_streams=1, cuda_graphs=False),
                RuntimeSpec(store=PerfModelStore(tmp_path), cuda=CudaOptions(runtime=host)))


def test_ort_texts_of_a_lack_of_gpu_memory_are_recognised():
    from staronnx.workers.cuda import _out_of_memory

    assert _out_of_memory("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : ... CUDA failure 2: out of memory ; "
                          "GPU=0 ; hostname=h ; file=cuda_allocator.cc")
    assert _out_of_memory("BFCArena::AllocateRawInternal Failed to allocate memory for requested buffer of size 4096")
    assert _out_of_memory("cudaMalloc returned cudaErrorMemoryAllocation")
    assert not _out_of_memory("CUDA failure 700: an illegal memory access was encountered")
    assert not _out_of_memory("[ONNXRuntimeError] : 10 : INVALID_GRAPH : Load model failed")
