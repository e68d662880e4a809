"""Placement-method plans run as placed: the static policy pins each part to its device."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from staronnx.errors import StaronnxError
from staronnx.partition.methods import place
from staronnx.perfmodels import PerfModelStore
from staronnx.runtime.policies import PolicyError, make_policy
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.workers.layout import MachineSpec
from staronnx.runtime.sched import TaskView, WorkerInfo
from staronnx.verify import random_plan_feeds
from staronnx.partition.host import host_devices
from staronnx.zoo import wide_fanout
from staronnx import partition
from staronnx.partition import PartitionSpec


class _Clock:
    def now(self) -> float:
        return 0.0


def _workers() -> list[WorkerInfo]:
    return [WorkerInfo(0, "a", "cpu1", "cpu", "numa0"), WorkerInfo(1, "b", "cpu1", "cpu", "numa0")]


def test_static_policy_places_by_name_and_rejects_unknown_workers():
    pol = make_policy("static", devices={0: "b", 1: "a"})
    pol.attach(_workers(), predictor=None, clock=_Clock(), dag=[[1], []])  # type: ignore[arg-type]
    assert pol.push(TaskView(id=1, part=0, batch=1, request=0)) == 1
    assert pol.push(TaskView(id=2, part=1, batch=1, request=0)) == 0
    assert pol.pop(0).id == 2 and pol.pop(1).id == 1 and pol.pop(0) is None
    bad = make_policy("static", devices={0: "gpu9"})
    with pytest.raises(PolicyError, match="gpu9"):
        bad.attach(_workers(), predictor=None, clock=_Clock())  # type: ignore[arg-type]


def test_static_queues_let_a_task_with_a_target_pass_the_ones_without():
    """A shared runtime's latency targets order the static policy's queues too (EDF, then model
    priority first): the placement stays the plan's."""
    pol = make_policy("static", devices={0: "a", 1: "a"})
    pol.attach(_workers(), predictor=None, clock=_Clock(), dag=[[], []])  # type: ignore[arg-type]
    plain = [TaskView(id=i, part=0, batch=1, request=i) for i in range(3)]
    for t in plain:
        assert pol.push(t) == 0
    late = TaskView(id=10, part=1, batch=1, request=10, deadline=2.0)
    soon = TaskView(id=11, part=1, batch=1, request=11, deadline=1.0)
    urgent = TaskView(id=12, part=1, batch=1, request=12, level=1)
    for t in (late, soon, urgent):
        assert pol.push(t) == 0
    assert [pol.pop(0).id for _ in range(6)] == [12, 11, 10, 0, 1, 2]


def test_a_duet_plan_runs_where_duet_placed_it(tmp_path, two_groups):
    model = tmp_path / "fan.onnx"
    onnx.save(wide_fanout(branches=8), str(model))
    second = two_groups.split(";")[1]  # explicit one-PU groups are named pus<PU>
    plan = place(model, PartitionSpec(method="duet", costs="estimate"), output_dir=tmp_path / "plan",
                 devices=host_devices(two_groups), device_costs={f"cpu:pus{second}": 0.5})
    devices = {p.index: p.device for p in plan.parts}
    store = PerfModelStore(tmp_path / "home")
    feeds = [random_plan_feeds(plan, 2, seed=i) for i in range(10)]
    with Runtime(plan, MachineSpec(groups=two_groups), RuntimeSpec(policy="static", store=store)) as rt:
        names = {i: w.name for i, w in enumerate(rt.workers)}
        results = [f.result(timeout=60) for f in [rt.submit(x) for x in feeds]]
        stats = rt.stats()
    for f, r in zip(feeds, results):
        for name, value in plan.run_reference(f).items():
            np.testing.assert_array_equal(r[name], value)
    used = {n for n, row in stats["workers"].items() if row["tasks"]}
    assert used == set(devices.values()) & set(names.values())


def test_static_policy_needs_a_placed_plan(tmp_path, two_groups):
    model = tmp_path / "fan.onnx"
    onnx.save(wide_fanout(branches=8), str(model))
    plan = partition(model, spec=PartitionSpec(parts=2, costs="estimate"), output_dir=tmp_path / "plan")
    with pytest.raises(StaronnxError, match="--method"):
        Runtime(plan,
                MachineSpec(groups=two_groups),
                RuntimeSpec(policy="static", store=PerfModelStore(tmp_path / "h")))
