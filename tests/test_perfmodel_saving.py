"""Perf models learnt while serving reach the store while the runtime still serves
(``Runtime(save_every=)``, ``staronnx serve --save-every``): a server that is killed, not
closed, loses at most one period of what it learnt."""

from __future__ import annotations

import os
import time

import numpy as np
import onnx
import pytest

from staronnx import partition
from staronnx.errors import StaronnxError
from staronnx.perfmodels import PerfModelStore
from staronnx.runtime.runtime import Runtime
from staronnx.runtime.spec import RuntimeSpec
from staronnx.workers.layout import MachineSpec
from staronnx.zoo import chain
from staronnx.partition import PartitionSpec


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("saving")
    onnx.save(chain(depth=3, width=8), str(root / "m.onnx"))
    return partition(root / "m.onnx", spec=PartitionSpec(parts=1, costs="estimate"), output_dir=root / "plan")


def stored_samples(store: PerfModelStore, plan) -> int:
    return sum(row.n for row in store.rows(plan.hash)) if plan.hash in store.plan_hashes() else 0


def test_perf_models_are_merged_every_period_while_serving(plan, tmp_path):
    store = PerfModelStore(tmp_path / "home")
    rt = Runtime(plan,
                 MachineSpec(groups=str(min(os.sched_getaffinity(0)))),
                 RuntimeSpec(policy="eager", store=store, save_every=0.2))
    try:
        for i in range(12):
            rt.run({"x": np.full((2, 8), float(i), np.float32)})
        deadline = time.monotonic() + 10
        while stored_samples(PerfModelStore(tmp_path / "home"), plan) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stored_samples(PerfModelStore(tmp_path / "home"), plan) > 0, "nothing merged before close"
    finally:
        rt.close()
    assert rt._saver is not None and not rt._saver.is_alive()


def test_without_a_period_nothing_is_merged_before_close(plan, tmp_path):
    store = PerfModelStore(tmp_path / "home")
    with Runtime(plan,
                 MachineSpec(groups=str(min(os.sched_getaffinity(0)))),
                 RuntimeSpec(policy="eager", store=store)) as rt:
        for i in range(12):
            rt.run({"x": np.full((2, 8), float(i), np.float32)})
        time.sleep(0.3)
        assert stored_samples(PerfModelStore(tmp_path / "home"), plan) == 0
    assert stored_samples(PerfModelStore(tmp_path / "home"), plan) > 0


def test_a_negative_period_is_refused(plan, tmp_path):
    with pytest.raises(StaronnxError, match="save_every"):
        Runtime(plan,
                MachineSpec(groups=str(min(os.sched_getaffinity(0)))),
                RuntimeSpec(store=PerfModelStore(tmp_path), save_every=-1))


def test_serve_refuses_a_bad_save_every(plan, tmp_path):
    from typer.testing import CliRunner

    from staronnx.cli import app

    out = CliRunner().invoke(app, ["serve", str(plan.root), "--http-port", "0", "--grpc-port", "0",
                                   "--save-every", "soon"])
    assert out.exit_code != 0 and "--save-every" in out.output + str(out.exception)
