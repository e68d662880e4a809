"""Fixtures shared by the serving tests: one tiny calibrated plan, built once per session."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import pytest

from staronnx import partition
from staronnx.calibrate import calibrate, start_workers
from staronnx.perfmodels import PerfModelStore
from staronnx.plan import Plan
from staronnx.zoo import fragile, inception

#: batch sizes the shared plan is calibrated at (arch cpu1: one-PU groups)
CALIBRATED_SIZES = [1, 2, 4]


@pytest.fixture(scope="session")
def calibrated_inception(tmp_path_factory) -> tuple[Plan, Path]:
    """A 70/30 plan of a 2-block Inception model and a store with its models of one-PU groups
    (arch cpu1, as :func:`two_groups` makes) at batch 1, 2 and 4 (what sweeps, the simulator,
    the bound and the optimizer need)."""
    root = tmp_path_factory.mktemp("calibrated")
    onnx.save(inception(blocks=2, channels=8, size=16), str(root / "inception.onnx"))
    plan = partition(root / "inception.onnx", [0.7, 0.3], output_dir=root / "plan", profile_runs=2)
    home = root / "home"
    # one explicit one-PU group: one worker measures arch cpu1 on any host (cores=1 would
    # start one per core)
    workers = start_workers(plan, groups=str(min(os.sched_getaffinity(0))))
    try:
        # this plan's parts take tens of microseconds: on a loaded machine StarPU's outlier
        # rule can keep an entry from reaching 10 accepted samples within one calibration's
        # cap, so calibrate again (the store keeps what was accepted) until every entry has
        report = calibrate(plan, CALIBRATED_SIZES, workers=workers, store=PerfModelStore(home))
        for _ in range(4):
            if not report.uncalibrated:
                break
            report = calibrate(plan, CALIBRATED_SIZES, workers=workers, store=PerfModelStore(home), max_runs=200)
        assert not report.uncalibrated, f"could not calibrate {report.uncalibrated} (machine too noisy?)"
    finally:
        for w in workers:
            w.close()
    return plan, home


@pytest.fixture
def fragile_plan(tmp_path) -> Plan:
    """:func:`staronnx.zoo.fragile` cut in two: a request whose ``x`` is not ``(n, 8)`` passes
    every signature check and fails in part 1, inside ONNX Runtime."""
    model = tmp_path / "fragile.onnx"
    onnx.save(fragile(), str(model))
    return partition(model, parts=2, method="linear", output_dir=tmp_path / "fragile-plan",
                     input_shapes=["x=1x8"], costs="estimate")


@pytest.fixture(scope="session")
def two_groups() -> str:
    """Two one-PU CPU groups as an explicit policy ('3;5'), whatever the host's core count,
    so tests that count workers or lanes hold on 2 cores or 128."""
    import os

    pus = sorted(os.sched_getaffinity(0))
    if len(pus) < 2:
        pytest.skip("needs 2 allowed PUs for two CPU groups")
    return f"{pus[0]};{pus[1]}"
