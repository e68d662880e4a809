"""Latency lanes (issue 23): a light model's worker of its own on the heavy model's cores, that the
OS lets preempt the heavy model's running task.

Real plans on real worker threads (ORT's CPU provider), real OS priorities read back from the
threads; the preemption test checks an *order* (the light answer comes while the heavy task in
front of it still runs, and after it without a lane), not a speed.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import onnx
import pytest

from staronnx import partition
from staronnx.perfmodels import PerfModelStore
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.workers.lanes import LANE_NICE, LANE_SWITCH_INTERVAL, parse_lanes, plan_lanes, short_switch_interval
from staronnx.workers.layout import MachineSpec, layout
from staronnx.workers.residency import ResidencyError, WorkerSlot
from staronnx.workers.topology import Topology
from staronnx.zoo import chain, inception
from staronnx.partition import PartitionSpec

pytestmark = pytest.mark.timeout(180)


def one_pu() -> str:
    return str(min(os.sched_getaffinity(0)))


def nice_of(worker) -> int:
    return os.getpriority(os.PRIO_PROCESS, worker.native_id)


def policy_of(worker) -> int:
    return os.sched_getscheduler(worker.native_id)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """(heavy, light): an Inception in one part (a task of tens of ms per sample on one core),
    an MLP chain cut in two."""
    root = tmp_path_factory.mktemp("lanes")
    onnx.save(inception(blocks=3, channels=32, size=64), str(root / "heavy.onnx"))
    onnx.save(chain(depth=4, width=16), str(root / "light.onnx"))
    heavy = partition(root / "heavy.onnx", spec=PartitionSpec(parts=1, costs="estimate"), output_dir=root / "heavy")
    light = partition(root / "light.onnx", [0.5, 0.5], PartitionSpec(costs="estimate"), output_dir=root / "light")
    return heavy, light


def heavy_feeds(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, 3, 64, 64), dtype=np.float32)}


def light_feeds(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((2, 16), dtype=np.float32)}


# -- options --------------------------------------------------------------------------------
def test_lane_options_parse_and_refuse_what_cannot_be_a_lane():
    assert parse_lanes(["a", " b = cpu:pus1 "]) == {"a": "cpu", "b": "cpu:pus1"}
    for bad in (["a", "a=cpu"], [""], ["=cpu"], ["a="]):
        with pytest.raises(ResidencyError):
            parse_lanes(bad)
    cpu = [WorkerSlot("cpu:pus0", "cpu"), WorkerSlot("cpu:pus1", "cpu")]
    plan = plan_lanes({"a": "cpu", "b": "cpu:pus1"}, ["a", "b", "c"], cpu)
    assert plan.lanes == ((0, ("a",)), (1, ("a", "b")))
    laid = layout(MachineSpec("0;1", lanes={"a": "cpu", "b": "cpu:pus1"}),
                  Topology.from_synthetic("pack:1 core:2 pu:1"), ["a", "b", "c"])
    assert [(w.name, w.kind, w.models) for w in laid.workers] == [
        ("cpu:pus0", "cpu", ()), ("cpu:pus1", "cpu", ()), ("lane:pus0", "lane", ("a",)), ("lane:pus1", "lane", ("a", "b"))]
    assert plan_lanes({}, ["a"], cpu).lanes == ()
    for lanes, names, slots, message in (
            ({"z": "cpu"}, ["a", "b"], cpu, "unknown model.*'z'"),
            ({"a": "cpu"}, ["a"], cpu, "several models"),
            ({"a": "cpu", "b": "cpu"}, ["a", "b"], cpu, "names every model"),
            ({"a": "cpu"}, ["a", "b"], [], "needs CPU groups"),
            ({"a": "cuda0"}, ["a", "b"], cpu, "'cuda0' names no CPU group")):
        with pytest.raises(ResidencyError, match=message):
            plan_lanes(lanes, names, slots)


# -- real runtimes --------------------------------------------------------------------------
@pytest.mark.parametrize("preempt", ["idle", "nice"])
def test_a_lane_holds_its_model_only_at_full_priority_and_the_group_worker_runs_lowered(plans, tmp_path, preempt):
    heavy, light = plans
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    interval = sys.getswitchinterval()
    with Runtime({"heavy": heavy, "light": light},
                 MachineSpec(groups=one_pu(), lanes={"light": "cpu"}, lane_preempt=preempt),
                 RuntimeSpec(policy="heft", store=PerfModelStore(tmp_path))) as rt:
        assert sys.getswitchinterval() == interval  # a runtime leaves process-wide settings alone:
        with short_switch_interval():  # the caller holds it while serving (serve --lane does)
            assert sys.getswitchinterval() == pytest.approx(min(interval, LANE_SWITCH_INTERVAL))
        assert sys.getswitchinterval() == interval  # given back when the block ends
        group, lane = rt.workers
        assert lane.name == "lane:" + group.name.removeprefix("cpu:")
        assert lane.group.pus == group.group.pus  # the same cores
        assert group.holds == frozenset(range(heavy.k)) and lane.holds == frozenset(range(heavy.k, heavy.k + light.k))
        if preempt == "idle":
            assert policy_of(group) == os.SCHED_IDLE and group.priority == "SCHED_IDLE"
        else:
            assert nice_of(group) == min(mine + LANE_NICE, 19) and group.priority == f"nice {nice_of(group)}"
        assert nice_of(lane) == mine and policy_of(lane) == os.SCHED_OTHER
        models = rt.stats()["models"]
        assert models["light"]["held_by"] == [lane.name]
        assert models["heavy"]["held_by"] == [group.name]
        for i in range(4):
            f = light_feeds(i)
            got = rt.submit(f, "light").result(timeout=60)
            np.testing.assert_allclose(got["y"], light.run_reference(f)["y"], rtol=1e-4, atol=1e-4)
        f = heavy_feeds(1)
        got = rt.submit(f, "heavy").result(timeout=60)
        ref = heavy.run_reference(f)
        for name, want in ref.items():
            np.testing.assert_allclose(got[name], want, rtol=1e-3, atol=1e-3)
    assert sys.getswitchinterval() == interval  # and closing leaves it alone too


def thread_policies() -> dict[int, int]:
    """The scheduling policy of every thread of this process by thread id, ONNX Runtime's own
    pool threads included (``/proc/<pid>/task/<tid>/stat``'s 41st field)."""
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                out[int(task)] = int(f.read().rsplit(")", 1)[1].split()[38])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            pass
    return out


def test_the_lowered_groups_onnx_runtime_pool_threads_run_lowered_too(plans, tmp_path):
    """A group of two cores runs a session with a pool thread ONNX Runtime creates: it must
    inherit the worker thread's priority, or the heavy model's second core would not yield."""
    pus = sorted(os.sched_getaffinity(0))
    if len(pus) < 2 or not os.path.isdir("/proc/self/task"):
        pytest.skip("needs two allowed PUs and /proc")
    heavy, light = plans
    # Threads by id, not a count: a lowered thread of an earlier test that ends meanwhile would
    # lower the difference of two counts (CI saw +1 for +2).
    before = set(thread_policies())
    with Runtime({"heavy": heavy, "light": light},
                 MachineSpec(groups=f"{pus[0]},{pus[1]}", lanes={"light": "cpu"}),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path))) as rt:
        group, lane = rt.workers
        assert group.group.n_cores == 2
        rt.submit(heavy_feeds(1), "heavy").result(timeout=60)
        lowered = [tid for tid, policy in thread_policies().items() if policy == os.SCHED_IDLE and tid not in before]
        assert group.native_id in lowered and len(lowered) >= 2, lowered  # the worker thread and its pool's
        assert policy_of(lane) == os.SCHED_OTHER


@pytest.mark.parametrize("policy", ["eager", "heft", "ws"])
def test_a_laned_model_runs_on_its_lanes_only_unless_residency_adds_the_shared_workers(plans, tmp_path, policy):
    heavy, light = plans
    with Runtime({"heavy": heavy, "light": light},
                 MachineSpec(groups=one_pu(), lanes={"light": "cpu"}),
                 RuntimeSpec(policy=policy, store=PerfModelStore(tmp_path))) as rt:
        group, lane = rt.workers
        assert policy_of(group) == os.SCHED_IDLE
        jobs = [rt.submit(heavy_feeds(1, i), "heavy") for i in range(3)]
        jobs += [rt.submit(light_feeds(i), "light") for i in range(12)]
        for job in jobs:
            job.result(timeout=60)
        busy = {name: row["busy"] for name, row in rt.stats()["models"]["light"]["workers"].items()}
        assert busy[lane.name] > 0 and busy[group.name] == 0, busy
    with Runtime({"heavy": heavy, "light": light},
                 MachineSpec(groups=one_pu(), lanes={"light": "cpu"}, residency={"light": "lane,cpu"}),
                 RuntimeSpec(policy=policy, store=PerfModelStore(tmp_path))) as rt:
        assert rt.stats()["models"]["light"]["held_by"] == [w.name for w in rt.workers]


def test_lanes_hold_only_the_models_given_lanes(plans, tmp_path):
    heavy, light = plans
    with pytest.raises(ResidencyError, match="would be held by no worker"):
        Runtime({"heavy": heavy, "light": light},
                MachineSpec(groups=one_pu(), lanes={"light": "cpu"}, residency={"heavy": "lane"}),
                RuntimeSpec(store=PerfModelStore(tmp_path)))


@pytest.mark.parametrize("lane", [True, False])
def test_a_light_request_is_answered_while_the_heavy_task_in_front_of_it_still_runs_only_with_a_lane(
        plans, tmp_path, lane):
    """One core, one heavy task of hundreds of ms already running: with a lane the light
    request (a few ms of work) is answered before that task ends; without one it waits for it
    (a worker does not preempt its task), which is what makes the lane's order meaningful.

    The shared worker yields by ``nice`` (the mode for a machine shared with other work): under
    ``idle`` (SCHED_IDLE) any busy process of the host comes first, and beside a 2-core CPU load
    the heavy task got almost no CPU and did not end within the test's timeout."""
    heavy, light = plans
    with Runtime({"heavy": heavy, "light": light},
                 MachineSpec(groups=one_pu(), lanes={"light": "cpu"} if lane else {}, lane_preempt="nice"),
                 RuntimeSpec(policy="heft", store=PerfModelStore(tmp_path),
                             targets={"light": {"latency": 0.05}})) as rt:
        rt.submit(light_feeds(0), "light").result(timeout=60)  # sessions warm
        rt.submit(heavy_feeds(1), "heavy").result(timeout=60)
        started = time.perf_counter()
        big = rt.submit(heavy_feeds(16), "heavy")
        while rt.stats()["workers"][rt.workers[0].name]["tasks"] == 0 and time.perf_counter() - started < 5:
            time.sleep(0.005)  # the heavy task is on the core (its worker took it)
        time.sleep(0.02)
        small = rt.submit(light_feeds(1), "light")
        small.result(timeout=60)
        heavy_running = not big.done()
        big.result(timeout=120)
    if lane:
        assert heavy_running, "the light request waited for the heavy task although it had a lane"
    else:
        assert not heavy_running, "without a lane the light request cannot overtake the running heavy task"


def test_lanes_refused_with_workers_given_or_the_starpu_engine(plans, tmp_path):
    heavy, light = plans
    with pytest.raises(Exception, match="lanes are workers the native engine starts"):
        Runtime({"heavy": heavy, "light": light}, MachineSpec(lanes={"light": "cpu"}), RuntimeSpec(workers=[]))


# -- the command line -----------------------------------------------------------------------
def test_serve_lane_gives_the_light_model_lanes_and_both_models_answer_their_references(plans, tmp_path):
    from test_serve import _post, start_server
    from test_serve_models import body, get_json, output

    heavy, light = plans
    s = start_server([heavy.root, light.root], tmp_path, "--policy", "heft", "--batch-size", "2",
                     "--max-delay", "1ms", "--lane", "light", "--slo-ms", "light=50", "--lane-preempt", "nice")
    try:
        text = "\n".join(s.lines)
        assert "light has lanes lane:" in text, text
        assert "yield to the lanes (nice " in text, text
        nices = []
        for task in os.listdir(f"/proc/{s.proc.pid}/task"):
            with open(f"/proc/{s.proc.pid}/task/{task}/stat") as f:
                nices.append(int(f.read().rsplit(")", 1)[1].split()[16]))
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert min(mine + LANE_NICE, 19) in nices, nices  # the shared worker, lowered by nice
        for i in range(3):
            x = light_feeds(i)["x"][:1]
            st, reply = _post(s.http, "/v2/models/light/infer", body(x))
            assert st == 200, reply
            np.testing.assert_allclose(output(reply, "y"), light.run_reference({"x": x})["y"], rtol=1e-4, atol=1e-4)
        x = heavy_feeds(1)["x"]
        st, reply = _post(s.http, "/v2/models/heavy/infer", body(x))
        assert st == 200, reply
        stats = {m["name"]: m["staronnx"] for m in get_json(f"http://{s.http}/v2/models/stats")["model_stats"]}
        assert any(w.startswith("lane:") for w in stats["light"]["held_by"])
        assert not any(w.startswith("lane:") for w in stats["heavy"]["held_by"])
    finally:
        assert s.stop() == 0, "\n".join(s.lines)


def test_serve_lane_refuses_unknown_models_separate_runtimes_and_cuda(plans, tmp_path):
    from typer.testing import CliRunner

    from staronnx.cli import app

    heavy, light = plans
    runner = CliRunner()
    args = ["serve", str(heavy.root), str(light.root), "--http-port", "0", "--grpc-port", "0", "--groups", one_pu()]
    for extra, message in ((["--lane", "nope"], "'nope' that are not served"),
                           (["--lane", "light", "--separate-runtimes"], "does not go with --separate-runtimes"),
                           (["--lane", "light=cuda0"], "'cuda0' names no CPU group"),
                           (["--lane", "light=cpu", "--lane", "light"], "twice"),
                           (["--lane", "light", "--lane-preempt", "rt"], "idle or nice")):
        out = runner.invoke(app, [*args, *extra])
        assert out.exit_code != 0, out.output
        assert message in out.output + str(out.exception), (extra, out.output, out.exception)
    out = runner.invoke(app, ["serve", str(light.root), "--http-port", "0", "--lane", "light"])
    assert out.exit_code != 0 and "needs several models" in out.output + str(out.exception)


def test_a_ray_replica_opens_its_shared_runtime_with_the_lanes_of_its_models(plans, tmp_path):
    """What a ``serve --ray --lane`` replica builds (the runtime, without a cluster)."""
    from staronnx.ray.cli import model_specs
    from staronnx.ray.replica import open_runtime
    from staronnx.ray.spec import ReplicaSpec

    heavy, light = plans
    specs = model_specs([heavy.root, light.root], ["heavy", "light"],
                        {"groups": one_pu(), "home": str(tmp_path), "lane_preempt": "nice"},
                        capacities={"heavy": 8, "light": 8}, targets={}, lanes={"light": "cpu"})
    assert [s.lane for s in specs] == [None, "cpu"]
    rt = open_runtime(ReplicaSpec(tuple(specs)))
    try:
        assert [w.name.split(":")[0] for w in rt.workers] == ["cpu", "lane"]
        assert rt.stats()["models"]["heavy"]["held_by"] == [rt.workers[0].name]
        assert rt.workers[0].priority == f"nice {nice_of(rt.workers[0])}"
    finally:
        rt.close()
