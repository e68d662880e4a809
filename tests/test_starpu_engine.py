"""The starpu engine end to end: real StarPU (libstarpu) workers, schedulers and perf models.

Skipped, with the reason, where StarPU is not installed (``apt-get install libstarpu-dev``),
except the test that checks the error a user then gets.  StarPU's files go to a temporary
STARPU_HOME per test module, never to the user's ~/.starpu.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from staronnx import InputError, partition
from staronnx.errors import StaronnxError
from staronnx.runtime.engine import EngineClosed
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.workers.layout import MachineSpec
from staronnx.runtime.task import TaskError
from staronnx.verify import random_plan_feeds
from staronnx.zoo import inception
from staronnx.partition import PartitionSpec

GOOGLENET = Path(__file__).resolve().parents[1] / "models" / "googlenet.onnx"


@pytest.fixture(scope="session")
def starpu():
    """The compiled binding, or a skip naming what is missing."""
    from staronnx.engines.starpu import StarpuUnavailable, load_binding

    try:
        return load_binding()
    except StarpuUnavailable as exc:
        pytest.skip(f"StarPU is not usable here: {exc}")


@pytest.fixture(scope="module", autouse=True)
def starpu_home(tmp_path_factory):
    """StarPU's sampling files (bus, perf models) in a temporary folder for this module."""
    home = tmp_path_factory.mktemp("starpu_home")
    old = {k: os.environ.get(k) for k in ("STARPU_HOME", "STARPU_PERF_MODEL_DIR")}
    os.environ["STARPU_HOME"] = str(home)
    os.environ.pop("STARPU_PERF_MODEL_DIR", None)
    yield home
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def plan3(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp")
    model = root / "inception.onnx"
    onnx.save(inception(blocks=2, channels=8, size=16), str(model))
    return partition(model, [0.5, 0.3, 0.2], PartitionSpec(profile_runs=2), output_dir=root / "plan")


def _two_groups() -> str:
    """Two one-core groups (the first two allowed cores), or one on a 1-core machine.

    Debian's StarPU 1.3 caps CPU workers at STARPU_MAXCPUS = 4, so 'cores=1' would fail on a
    big machine; two workers are what the scheduling tests need.
    """
    from staronnx.workers.topology import Topology

    topo = Topology.from_system()
    cores = topo.allowed_cores()[:2]
    return ";".join(str(c.allowed_pus(topo.allowed_pus)[0]) for c in cores)


GROUPS = _two_groups()


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def _os_threads() -> int:
    """OS threads of this process (StarPU's workers and ORT's pools are not Python threads)."""
    gc.collect()  # sessions of earlier tests may still hold their ORT pools
    return len(os.listdir("/proc/self/task"))


# ----------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("policy", ["dmda", "dmdas", "eager", "lws", "ws", "prio", "random", "heft"])
def test_zoo_plan_matches_reference(starpu, plan3, policy):
    feeds = [random_plan_feeds(plan3, b, seed=i) for i, b in enumerate([1, 3, 2, 4] * 5)]
    refs = [plan3.run_reference(f)["logits"] for f in feeds]
    before, before_os = _threads(), _os_threads()
    with Runtime(plan3, MachineSpec(groups=GROUPS), RuntimeSpec(policy=policy, engine="starpu")) as rt:
        results = [f.result(timeout=60) for f in [rt.submit(f) for f in feeds]]
        stats = rt.stats()
        names = [w.name for w in rt.workers]
    assert names == list(stats["workers"]) and len(names) >= 1
    for r, ref in zip(results, refs):
        np.testing.assert_array_equal(r["logits"], ref)
    assert stats["engine"] == "starpu" and stats["policy"] == policy
    assert stats["starpu_policy"] == ("dmdas" if policy == "heft" else policy)
    assert stats["requests_done"] == len(feeds) and stats["requests_failed"] == 0
    assert sum(row["tasks"] for row in stats["tasks"].values()) == len(feeds) * plan3.k
    assert sum(w["tasks"] for w in stats["workers"].values()) == len(feeds) * plan3.k
    assert _threads() == before and _os_threads() <= before_os


def test_googlenet_two_parts_dmda_and_eager_identical_to_reference(starpu, tmp_path):
    plan = partition(GOOGLENET, [0.85, 0.15], PartitionSpec(profile_runs=2), output_dir=tmp_path / "plan")
    assert plan.k == 2 and plan.crossing
    feeds = [random_plan_feeds(plan, b, seed=i) for i, b in enumerate([1, 2, 1, 3])]
    refs = [plan.run_reference(f)["logits"] for f in feeds]
    for policy in ("dmda", "eager"):
        with Runtime(plan, MachineSpec(groups=GROUPS), RuntimeSpec(policy=policy, engine="starpu")) as rt:
            results = [f.result(timeout=120) for f in [rt.submit(f) for f in feeds]]
            assert rt.stats()["starpu_policy"] == policy
        for r, ref in zip(results, refs):
            np.testing.assert_array_equal(r["logits"], ref)


def test_500_concurrent_requests_all_correct(starpu, plan3):
    feeds = [random_plan_feeds(plan3, 1 + i % 3, seed=i) for i in range(16)]
    refs = [plan3.run_reference(f)["logits"] for f in feeds]
    with Runtime(plan3, MachineSpec(groups=GROUPS), RuntimeSpec(policy="dmda", engine="starpu")) as rt:

        def client(c: int) -> list[tuple[int, object]]:
            return [((c * 125 + i) % 16, rt.submit(feeds[(c * 125 + i) % 16])) for i in range(125)]

        with ThreadPoolExecutor(4) as pool:  # 500 requests in flight at once, from 4 threads
            submitted = [x for chunk in pool.map(client, range(4)) for x in chunk]
        ok = sum(bool(np.array_equal(f.result(timeout=120)["logits"], refs[j])) for j, f in submitted)
        stats = rt.stats()
    assert ok == 500
    assert stats["requests_done"] == 500 and stats["in_flight"] == 0


def test_parts_with_more_buffers_than_nmaxbufs_and_unknown_shapes(starpu, tmp_path):
    """More buffers than STARPU_NMAXBUFS (dyn_handles), and a crossing tensor of unknown shape
    (NonZero's output) that travels on the Python side while its handle orders the tasks."""
    _, lib, _ = starpu
    width = lib.STARPU_NMAXBUFS + 4
    consts = [numpy_helper.from_array(np.full((1,), i + 1, np.float32), f"c{i}") for i in range(width)]
    nodes = [helper.make_node("Mul", ["x", f"c{i}"], [f"y{i}"], name=f"mul{i}") for i in range(width)]
    nodes += [helper.make_node("Tanh", [f"y{i}"], [f"t{i}"], name=f"tanh{i}") for i in range(width)]
    nodes.append(helper.make_node("Sum", [f"t{i}" for i in range(width)], ["s"], name="sum"))
    g = helper.make_graph(nodes, "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                          [helper.make_tensor_value_info("s", TensorProto.FLOAT, ["batch", 64])], consts)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(tmp_path / "w.onnx"))
    wide = partition(tmp_path / "w.onnx", [0.5, 0.5], PartitionSpec(input_shapes=["x=1x64"], costs="estimate"),
                     output_dir=tmp_path / "wplan")
    assert max(len(p.inputs) + len(p.outputs) for p in wide.parts) > lib.STARPU_NMAXBUFS

    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("NonZero", ["r"], ["nz"], name="nonzero"),
             helper.make_node("Cast", ["nz"], ["c"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("ReduceSum", ["c"], ["s"], keepdims=0, name="sum")]
    g = helper.make_graph(nodes, "nz", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                          [helper.make_tensor_value_info("s", TensorProto.FLOAT, [])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(tmp_path / "nz.onnx"))
    nz = partition(tmp_path / "nz.onnx",
                   spec=PartitionSpec(parts=2, method="linear", input_shapes=["x=1x8"], costs="estimate"),
                   output_dir=tmp_path / "nzplan")
    assert any(not all(isinstance(d, int) for d in t.shape[1:]) for t in nz.crossing)

    for plan in (wide, nz):
        feeds = [{"x": np.random.default_rng(i).standard_normal((1 + i % 3, plan.inputs[0].shape[1]))
                  .astype(np.float32)} for i in range(24)]
        with Runtime(plan, MachineSpec(groups=GROUPS), RuntimeSpec(policy="dmda", engine="starpu")) as rt:
            results = [f.result(timeout=60) for f in [rt.submit(f) for f in feeds]]
        for f, r in zip(feeds, results):
            np.testing.assert_array_equal(r["s"], plan.run_reference(f)["s"])


# ----------------------------------------------------------------------------- failures
def test_failing_request_fails_only_itself(starpu, fragile_plan):
    plan = fragile_plan
    good = {"x": np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)}
    bad = {"x": np.ones((2, 5), np.float32)}
    want = plan.run_reference(good)["y"]
    with Runtime(plan, MachineSpec(groups=GROUPS), RuntimeSpec(policy="dmda", engine="starpu")) as rt:
        futures = [rt.submit(bad if i % 3 == 0 else good) for i in range(30)]
        for i, f in enumerate(futures):
            if i % 3 == 0:
                with pytest.raises(TaskError) as info:
                    f.result(timeout=30)
                assert info.value.__cause__ is not None  # ORT's own error
                assert info.value.part == 1
            else:
                np.testing.assert_array_equal(f.result(timeout=30)["y"], want)
        stats = rt.stats()
        assert stats["requests_failed"] == 10 and stats["requests_done"] == 20
        np.testing.assert_array_equal(rt.run(good)["y"], want)  # and it keeps serving


def test_bad_input_is_rejected_before_any_task(starpu, plan3):
    with Runtime(plan3, MachineSpec(groups=GROUPS), RuntimeSpec(policy="eager", engine="starpu")) as rt:
        good = random_plan_feeds(plan3, 2)
        with pytest.raises(ValueError, match="'x'.*float32.*float64"):
            rt.submit({"x": good["x"].astype(np.float64)})
        with pytest.raises(InputError, match="missing"):
            rt.submit({})
        assert rt.stats()["requests_done"] == 0
        rt.run(good)
    with pytest.raises(EngineClosed):
        rt.submit(good)


def test_close_with_zero_timeout_cancels_what_is_left(starpu, plan3):
    before, before_os = _threads(), _os_threads()
    rt = Runtime(plan3, MachineSpec(groups=GROUPS), RuntimeSpec(policy="dmdas", engine="starpu"))
    feeds = random_plan_feeds(plan3, 8)
    futures = [rt.submit(feeds) for _ in range(200)]
    rt.close(timeout=0)
    done = [f for f in futures if f.done() and not f.cancelled() and f.exception() is None]
    cancelled = [f for f in futures if f.cancelled()]
    assert all(f.done() for f in futures)
    assert cancelled, "200 queued batches cannot all finish in zero seconds"
    assert len(done) + len(cancelled) == 200
    assert _threads() == before and _os_threads() <= before_os
    rt.close()  # idempotent


def test_cancelled_requests_count_as_done_for_wait_and_as_completed(starpu, plan3):
    """A cancelled future counts for concurrent.futures.wait() once its executor says so
    (set_running_or_notify_cancel). The starpu engine never did, neither for a request its
    caller cancelled (its tasks skipped) nor for those close() cancelled: wait() and
    as_completed() over them waited their whole timeout (for good without one), as the
    native engine's once did."""
    from concurrent.futures import as_completed, wait

    one = GROUPS.split(";")[0]
    feeds = [random_plan_feeds(plan3, 2, seed=i) for i in range(12)]
    rt = Runtime(plan3, MachineSpec(groups=one), RuntimeSpec(policy="eager", engine="starpu"))
    try:
        futs = [rt.submit(f) for f in feeds]
        gone = futs[6]
        if gone.cancel():
            futs[-1].result(timeout=60)
            done, _ = wait([gone], timeout=30)
            assert done == {gone}, "a request its caller cancelled never counts as done for wait()"
            assert list(as_completed([gone], timeout=30)) == [gone]
        more = [rt.submit(f) for f in feeds * 4]
    finally:
        rt.close(timeout=0)
    assert any(f.cancelled() for f in more), "48 queued requests cannot all finish in zero seconds"
    done, not_done = wait(more, timeout=30)
    assert not not_done, f"{len(not_done)} requests close() cancelled never count as done for wait()"


def test_one_starpu_runtime_at_a_time(starpu, plan3):
    feeds = random_plan_feeds(plan3, 1)
    with Runtime(plan3, MachineSpec(groups=GROUPS), RuntimeSpec(policy="eager", engine="starpu")) as rt:
        with pytest.raises(StaronnxError, match="already running"):
            Runtime(plan3, MachineSpec(groups=GROUPS), RuntimeSpec(policy="eager", engine="starpu"))
        rt.run(feeds)
    one = GROUPS.split(";")[0]
    with Runtime(plan3,
                 MachineSpec(groups=one),
                 RuntimeSpec(policy="lws", engine="starpu")) as rt2:  # fine once closed
        np.testing.assert_array_equal(rt2.run(feeds)["logits"], plan3.run_reference(feeds)["logits"])


def test_unknown_policy_and_options_are_clear_errors(starpu, plan3):
    with pytest.raises(StaronnxError, match="unknown StarPU scheduling policy 'dmdaa'.*dmdas"):
        Runtime(plan3, spec=RuntimeSpec(policy="dmdaa", engine="starpu"))
    with pytest.raises(StaronnxError, match="policy option.*alpha"):
        Runtime(plan3, spec=RuntimeSpec(policy="dmda", engine="starpu", policy_options={"alhpa": 1}))
    with pytest.raises(StaronnxError, match="CPU codelets only"):
        Runtime(plan3, MachineSpec(cuda_streams=1), RuntimeSpec(engine="starpu"))
    with Runtime(plan3,
                 MachineSpec(groups=GROUPS),
                 RuntimeSpec(policy="dmda", engine="starpu", policy_options={"alpha": 1.0, "beta": 2.0})) as rt:
        rt.run(random_plan_feeds(plan3, 1))


def test_service_targets_are_refused_not_ignored(starpu, plan3):
    """StarPU orders tasks by its own priorities: a model's latency target, priority and
    capacity mean nothing to it. A Runtime on engine='starpu' given one served as if it had
    none (a capacity of 2 let every request in, with no ModelOverloaded): a setting staronnx
    does not honour is refused by name, never ignored."""
    name = plan3.root.name
    for target in ({"capacity": 2}, {"latency": 0.5}, {"priority": 1}):
        with pytest.raises(StaronnxError, match=f"starpu.*{next(iter(target))}"):
            Runtime(plan3, MachineSpec(groups=GROUPS), RuntimeSpec(policy="eager", engine="starpu",
                                                                     targets={name: target}))
    with Runtime(plan3, MachineSpec(groups=GROUPS),
                 RuntimeSpec(policy="eager", engine="starpu", targets={name: {}})) as rt:  # no target: fine
        rt.run(random_plan_feeds(plan3, 1))


# ----------------------------------------------------------------------------- API parity
def test_map_futures_trace_and_model_stats(starpu, plan3, tmp_path):
    """Also the Engine contract's model view (Runtime.model_stats, a model's handle): StarPU's
    one plan is the whole machine's work, with no target and so no deadline misses."""
    feeds = [random_plan_feeds(plan3, 1, seed=i) for i in range(12)]
    trace = tmp_path / "trace.json"
    with Runtime(plan3, MachineSpec(groups=GROUPS), RuntimeSpec(policy="dmda", engine="starpu", trace=trace)) as rt:
        out = list(rt.map(iter(feeds), max_in_flight=4))

        async def main():
            return await asyncio.gather(*(rt.submit(f) for f in feeds[:3]))

        awaited = asyncio.run(main())
        model, handle = rt.model_stats(), rt.model().stats()
        rt.save_perf_models()  # StarPU keeps its own perf models: nothing to merge, no error
        with pytest.raises(StaronnxError, match="one plan"):
            rt._engine.submit(feeds[0], model=1)
    assert model["requests_done"] == handle["requests_done"] == 15
    assert model["requests_failed"] == 0 and model["in_flight"] == 0 and model["deadline_misses"] == 0
    assert len(model["workers"]) == len(GROUPS.split(";")) and model["held_by"] == list(model["workers"])
    assert sum(row["tasks"] for row in model["tasks"].values()) == 15 * plan3.k
    assert handle["policy"] == "dmda"
    for f, r in zip(feeds, out):
        np.testing.assert_array_equal(r["logits"], plan3.run_reference(f)["logits"])
    assert len(awaited) == 3
    events = json.loads(trace.read_text())["traceEvents"]
    assert len([e for e in events if e["ph"] == "X"]) == 15 * plan3.k
    lanes = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert len(lanes) == len(GROUPS.split(";"))


# ----------------------------------------------------------------------------- perf models
def test_perfmodel_files_exist_and_starpu_lists_them(starpu, plan3, tmp_path, monkeypatch):
    home = tmp_path / "sp_home"
    monkeypatch.setenv("STARPU_HOME", str(home))
    feeds = {b: random_plan_feeds(plan3, b) for b in (1, 2)}
    with Runtime(plan3, MachineSpec(groups=GROUPS), RuntimeSpec(policy="dmda", engine="starpu")) as rt:
        for f in [rt.submit(feeds[1 + i % 2]) for i in range(60)]:
            f.result(timeout=60)
        symbols = rt._engine.perfmodel_symbols
        paths = rt._engine.perfmodel_paths()
        stats = rt.stats()
    assert len(symbols) == plan3.k
    for symbol, path in zip(symbols, paths):
        assert Path(path).exists(), path
        assert Path(path).is_relative_to(home / ".starpu" / "sampling" / "codelets")
        text = Path(path).read_text()
        assert "# number of entries" in text or "footprint" in text or text.strip()
    # (No assertion on predictions: StarPU predicts once 10 samples of a footprint fall within
    # +-50 % of their mean; sub-millisecond tasks on a noisy machine can keep resetting that.)
    assert set(stats["perfmodels"]) == set(symbols)
    tool = shutil.which("starpu_perfmodel_display")
    if tool is None:
        pytest.skip("starpu_perfmodel_display (starpu-tools) is not installed")
    env = dict(os.environ, STARPU_HOME=str(home))
    listed = subprocess.run([tool, "-l"], check=False, capture_output=True, text=True, env=env, timeout=60)
    assert listed.returncode == 0, listed.stderr
    for symbol in symbols:
        assert symbol in listed.stdout
    shown = subprocess.run([tool, "-s", symbols[0]], check=False, capture_output=True, text=True, env=env, timeout=60)
    assert shown.returncode == 0, shown.stderr
    rows = [line.split() for line in shown.stdout.splitlines() if line and line[0] in "0123456789abcdef"]
    assert {"1", "2"} <= {r[1] for r in rows if len(r) > 1}, shown.stdout  # size column = batch


# ----------------------------------------------------------------------------- without StarPU
def test_without_starpu_a_clear_error_and_import_staronnx_never_needs_it(plan3, tmp_path):
    code = (
        "import sys, staronnx\n"
        "assert 'staronnx.engines.starpu' not in sys.modules and 'staronnx.engines' not in sys.modules\n"
        "from staronnx.runtime.runtime import Runtime\n"
        "from staronnx.errors import StaronnxError\n"
        "try:\n"
        f"    Runtime({str(plan3.root)!r}, spec=staronnx.RuntimeSpec(engine='starpu'))\n"
        "except StaronnxError as exc:\n"
        "    print('ERROR', exc)\n"
    )
    env = dict(os.environ, STARPU_PREFIX=str(tmp_path / "no-starpu"), STARONNX_HOME=str(tmp_path / "home"))
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ERROR") and "apt-get install libstarpu-dev" in out.stdout
