"""Several models on one runtime (issue 23): one set of workers, one policy, per-model targets.

Real plans (METIS cuts of zoo models), real ORT sessions, real worker threads. The two models
both name their input ``x``, so anything keyed by tensor name alone would mix them up.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from dataclasses import replace

import numpy as np
import onnx
import pytest

from staronnx import partition
from staronnx.errors import StaronnxError
from staronnx.perfmodels import PerfModelStore
from staronnx.runtime.models import ModelOverloaded, ServiceTarget
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.workers.layout import MachineSpec
from staronnx.serving.server import OverloadError, Server, StandInRuntime
from staronnx.serving.spec import ServeSpec
from staronnx.zoo import inception, residual
from staronnx.partition import PartitionSpec


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """(heavy, light): a 3-part METIS cut of an Inception model and a 2-part cut of a small
    residual CNN, both with an input named ``x``."""
    root = tmp_path_factory.mktemp("multi")
    onnx.save(inception(blocks=3, channels=16, size=32), str(root / "heavy.onnx"))
    onnx.save(residual(blocks=2, channels=4, size=8), str(root / "light.onnx"))
    heavy = partition(root / "heavy.onnx", [0.5, 0.3, 0.2], PartitionSpec(costs="estimate"), output_dir=root / "heavy")
    light = partition(root / "light.onnx", [0.6, 0.4], PartitionSpec(costs="estimate"), output_dir=root / "light")
    return heavy, light


def one_group() -> str:
    """One one-PU CPU group, whatever the host: a single worker serves everything in order."""
    return str(min(os.sched_getaffinity(0)))


def heavy_feeds(batch: int, seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, 3, 32, 32), dtype=np.float32)}


def light_feeds(batch: int, seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, 4, 8, 8), dtype=np.float32)}


def assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, ref in want.items():
        scale = max(float(np.abs(ref).max()), 1.0)
        np.testing.assert_allclose(got[name], ref, atol=1e-4 * scale, rtol=0)


@pytest.mark.parametrize("policy", ["heft", "eager", "ws"])
def test_two_models_share_one_set_of_workers_and_match_their_references(plans, two_groups, tmp_path, policy):
    heavy, light = plans
    with Runtime({"heavy": heavy, "light": light},
                 MachineSpec(groups=two_groups),
                 RuntimeSpec(policy=policy, store=PerfModelStore(tmp_path))) as rt:
        # one set of workers, each with a session of every model's parts
        assert len(rt.workers) == 2
        assert all(w.n_parts == heavy.k + light.k for w in rt.workers)
        jobs = []
        for i in range(6):  # interleaved, so both models' tasks are in the queues together
            fh, fl = heavy_feeds(2, i), light_feeds(3, 100 + i)
            jobs.append((rt.submit(fh, "heavy"), heavy, fh))
            jobs.append((rt.model("light").submit(fl), light, fl))
        for future, plan, feeds in jobs:
            assert_close(future.result(timeout=60), plan.run_reference(feeds))
        stats = rt.stats()
    assert {m: stats["models"][m]["requests_done"] for m in ("heavy", "light")} == {"heavy": 6, "light": 6}
    # every part of both models ran, under labels that keep the models apart
    ran = {key.rsplit("/", 1)[0] for key in stats["tasks"]}
    assert ran == {f"heavy/part{p}" for p in range(heavy.k)} | {f"light/part{p}" for p in range(light.k)}


def test_a_request_names_its_model(plans, two_groups, tmp_path):
    heavy, light = plans
    with Runtime({"heavy": heavy, "light": light},
                 MachineSpec(groups=two_groups),
                 RuntimeSpec(store=PerfModelStore(tmp_path))) as rt:
        with pytest.raises(StaronnxError, match="several models"):
            rt.submit(light_feeds(1, 0))
        with pytest.raises(StaronnxError, match="no model 'nope'"):
            rt.submit(light_feeds(1, 0), "nope")
        with pytest.raises(ValueError):  # checked against the light model's own signature
            rt.submit(heavy_feeds(1, 0), "light")
        with pytest.raises(StaronnxError, match="use runtime.model"):
            rt.plan  # noqa: B018 - a shared runtime has no single plan
        assert rt.model("light").plan is light
        # and it still serves after the refusals
        feeds = light_feeds(1, 1)
        assert_close(rt.model("light").run(feeds), light.run_reference(feeds))


def test_targets_must_name_hosted_models(plans, two_groups):
    heavy, light = plans
    with pytest.raises(StaronnxError, match="unknown model"):
        Runtime({"heavy": heavy, "light": light},
                MachineSpec(groups=two_groups),
                RuntimeSpec(targets={"ligth": {"latency_ms": 5}}))
    with pytest.raises(StaronnxError, match="positive"):
        ServiceTarget(latency=0)


def heavy_tasks_while_light_waits(rt: Runtime) -> int:
    """Ten heavy requests, then one light one, on a single worker: how many heavy tasks ran
    to their end between the light request's submission and its answer."""
    def heavy_tasks() -> int:
        return sum(row["tasks"] for row in rt.model_stats("heavy")["tasks"].values())

    futures = [rt.submit(heavy_feeds(8, i), "heavy") for i in range(10)]
    seen: list[int] = []
    before = heavy_tasks()
    light = rt.submit(light_feeds(1, 0), "light")
    light.add_done_callback(lambda _: seen.append(heavy_tasks()))
    for f in [*futures, light]:
        f.result(timeout=120)
    return seen[0] - before


@pytest.mark.parametrize("policy", ["heft", "dmda", "eager", "ws"])
def test_a_latency_target_lets_a_light_model_pass_a_heavy_backlog(plans, tmp_path, policy):
    heavy, light = plans
    machine, common = MachineSpec(one_group()), RuntimeSpec(policy=policy, store=PerfModelStore(tmp_path))
    with Runtime({"heavy": heavy, "light": light}, machine, common) as rt:
        blind = heavy_tasks_while_light_waits(rt)
    with Runtime({"heavy": heavy, "light": light}, machine,
                 replace(common, targets={"light": ServiceTarget(latency=0.05)})) as rt:
        served = heavy_tasks_while_light_waits(rt)
    # without a target the light request waits behind the backlog queued before it (heft's
    # ranks put every heavy part 0 first; FIFO queues all of it)...
    assert blind >= 8, blind
    # ...with one it waits at most for the heavy task already running (non-preemptive)
    assert served <= 2, served


def test_deadline_misses_are_counted_per_model(plans, two_groups, tmp_path):
    heavy, light = plans
    targets = {"heavy": ServiceTarget(latency=1e-6), "light": ServiceTarget(latency=600.0)}
    with Runtime({"heavy": heavy, "light": light},
                 MachineSpec(groups=two_groups),
                 RuntimeSpec(targets=targets, store=PerfModelStore(tmp_path))) as rt:
        for f in [rt.submit(heavy_feeds(1, i), "heavy") for i in range(3)] + \
                 [rt.submit(light_feeds(1, i), "light") for i in range(4)]:
            f.result(timeout=60)
        heavy_stats, light_stats = rt.model_stats("heavy"), rt.model_stats("light")
    assert (heavy_stats["requests_done"], heavy_stats["deadline_misses"]) == (3, 3)
    assert (light_stats["requests_done"], light_stats["deadline_misses"]) == (4, 0)
    assert heavy_stats["target"]["latency_ms"] == pytest.approx(1e-3)
    # each worker's busy share is split by model, and only heavy's tasks count for heavy
    assert sum(w["busy"] for w in heavy_stats["workers"].values()) > 0
    assert set(heavy_stats["tasks"]) <= {f"part{p}/cpu1" for p in range(heavy.k)}


def test_one_models_capacity_refuses_it_only(plans, two_groups, tmp_path):
    heavy, light = plans
    with Runtime({"heavy": heavy, "light": light},
                 MachineSpec(groups=two_groups),
                 RuntimeSpec(store=PerfModelStore(tmp_path), targets={"heavy": ServiceTarget(capacity=2)})) as rt:
        big = heavy_feeds(64, 0)  # tens of ms per request on one core: none ends within the submits
        held = [rt.submit(big, "heavy"), rt.submit(big, "heavy")]
        with pytest.raises(ModelOverloaded, match="'heavy'"):
            rt.submit(big, "heavy")
        feeds = [light_feeds(2, i) for i in range(5)]
        lights = [rt.submit(f, "light") for f in feeds]  # the other model is not refused
        for f, fd in zip(lights, feeds):
            assert_close(f.result(timeout=60), light.run_reference(fd))
        for f in held:
            f.result(timeout=120)
        rt.submit(heavy_feeds(1, 1), "heavy").result(timeout=60)  # room again once they ended


def test_servers_over_one_runtime_overload_one_model_only(plans, two_groups, tmp_path):
    """Two batching servers (one per model) over one shared runtime: the heavy model's full
    queue refuses its requests (the 503 of ``staronnx serve``); the light model's requests
    are served, with their outputs, meanwhile."""
    heavy, light = plans
    with Runtime({"heavy": heavy, "light": light},
                 MachineSpec(groups=two_groups),
                 RuntimeSpec(store=PerfModelStore(tmp_path))) as rt:
        gate = threading.Event()

        class Held(StandInRuntime):  # the heavy model's batches wait at the gate: its queue fills for sure
            plan = heavy
            workers = rt.workers

            def submit(self, feeds, **kw):
                # returns at once: the server may launch a batch on the thread that submits its
                # last request (this test's own), which must not block at the gate (it did, for
                # the gate's whole timeout, and then the heavy batch ran while light was checked)
                held: Future = Future()

                def run() -> None:
                    gate.wait(300)
                    try:
                        held.set_result(rt.model("heavy").submit(feeds, **kw).result())
                    except BaseException as exc:  # noqa: BLE001 - handed on as the batch's error
                        held.set_exception(exc)

                threading.Thread(target=run, name="held-heavy", daemon=True).start()
                return held

        with Server(Held(), ServeSpec(2, max_inflight=1, queue_capacity=4)) as hs, \
                Server(rt.model("light"), ServeSpec(2, max_delay=0.001)) as ls:
            accepted, refused = [], 0
            try:
                for i in range(20):
                    try:
                        accepted.append(hs.submit(heavy_feeds(1, i)))
                    except OverloadError:
                        refused += 1
                assert refused >= 20 - 4 - 2 * 2  # queue capacity plus what the batcher holds
                samples = [light_feeds(1, i) for i in range(6)]
                answers = [ls.submit(s) for s in samples]
                for a, s in zip(answers, samples):
                    assert_close(a.result(timeout=60), light.run_reference(s))
                assert not any(f.done() for f in accepted)  # heavy still held: light did not wait
            finally:
                gate.set()  # a failed check must not leave the server's close waiting on the gate
            for f in accepted:
                f.result(timeout=120)


def test_perf_models_stay_per_plan_and_part(plans, two_groups, tmp_path):
    """A shared runtime records each model's times under its own plan hash and part index,
    so a model keeps its calibration when it joins or leaves a shared runtime."""
    heavy, light = plans
    store = PerfModelStore(tmp_path)
    with Runtime({"heavy": heavy, "light": light},
                 MachineSpec(groups=two_groups),
                 RuntimeSpec(store=store, calibrate=1)) as rt:
        for i in range(8):
            rt.submit(heavy_feeds(1, i), "heavy").result(timeout=60)
            rt.submit(light_feeds(1, i), "light").result(timeout=60)
    for plan in (heavy, light):
        for part in range(plan.k):
            model = store.load(plan.hash, part, "cpu1")
            assert model.part == part
            assert sum(e.n for e in model.entries().values()) >= 1, (plan.root, part)
    # nothing stored under a global part number past a plan's own parts
    assert not store.load(light.hash, heavy.k, "cpu1").entries()


def test_a_single_plan_keeps_its_face(plans, two_groups, tmp_path):
    heavy, _ = plans
    with Runtime(heavy,
                 MachineSpec(groups=two_groups),
                 RuntimeSpec(store=PerfModelStore(tmp_path), targets={"heavy": ServiceTarget(latency=600.0)})) as rt:
        assert rt.plan is heavy and rt.model_names == ["heavy"]
        feeds = heavy_feeds(2, 0)
        assert_close(rt.run(feeds), heavy.run_reference(feeds))
        stats = rt.stats()
    assert set(stats["tasks"]) <= {f"part{p}/cpu1" for p in range(heavy.k)}
    assert stats["models"]["heavy"]["deadline_misses"] == 0


def test_a_servers_records_name_the_policy_of_its_shared_runtime(plans, two_groups, tmp_path):
    # a server over one model of a shared runtime recorded policy None in its settings (it
    # looked for a Runtime only), so its sweep points could not say how they were scheduled
    heavy, light = plans
    with Runtime({"heavy": heavy, "light": light}, MachineSpec(groups=two_groups),
                 RuntimeSpec(policy="eager", store=PerfModelStore(tmp_path))) as rt:
        with Server(rt.model("light"), ServeSpec(1)) as server:
            server.submit(light_feeds(1, 0)).result(timeout=60)
            assert server.settings()["policy"] == "eager"
            assert server.records().settings["policy"] == "eager"
