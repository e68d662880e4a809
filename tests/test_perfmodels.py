"""History models (StarPU's rules), batch-size regression and the bus model."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staronnx.perfmodels import (
    BusModel,
    Footprint,
    HistoryModel,
    Link,
    LinkCost,
    PerfModelFormatError,
    SampleOutcome,
    calibrate_host_numa,
    calibrate_link,
    fit_nl_regression,
    fit_power_law,
    host_numa_nodes,
)

FP = Footprint.from_shapes({"input": (8, 3, 224, 224)})


def calibrated(model: HistoryModel, fp: Footprint, seconds: float, n: int = 10) -> None:
    """Record the dropped first sample plus ``n`` identical ones."""
    for _ in range(n + 1):
        model.record(fp, seconds)


# -- footprints ---------------------------------------------------------------------------------


def test_footprint_puts_batch_first_and_groups_batch_sizes_by_shape_family() -> None:
    a = Footprint.from_shapes({"input": (8, 3, 224, 224)})
    b = Footprint.from_shapes({"input": (16, 3, 224, 224)})
    other = Footprint.from_shapes({"input": (8, 3, 112, 112)})
    assert (a.batch, b.batch) == (8, 16)
    assert a.shape_hash == b.shape_hash != other.shape_hash
    assert a != b and a != other


def test_footprint_ignores_feed_order_of_a_mapping_but_not_fixed_dims() -> None:
    one = Footprint.from_shapes({"x": (4, 10), "mask": (4, 10)})
    two = Footprint.from_shapes({"mask": (4, 10), "x": (4, 10)})
    assert one == two
    # A second input whose leading dim is not the batch keeps that dim in the hash.
    assert Footprint.from_shapes([(4, 10), (7, 2)]) != Footprint.from_shapes([(4, 10), (8, 2)])
    assert Footprint.from_shapes([(5, 2)], batch=5).batch == 5
    with pytest.raises(ValueError):
        Footprint.from_shapes([()])


def test_footprint_is_identical_across_processes_with_different_hash_seeds() -> None:
    code = (
        "from staronnx.perfmodels import Footprint;"
        "print(Footprint.from_shapes({'input': (8, 3, 224, 224), 'b': (8, 5)}).shape_hash)"
    )
    seen = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        seen.add(int(out.stdout))
    assert seen == {Footprint.from_shapes({"input": (8, 3, 224, 224), "b": (8, 5)}).shape_hash}


# -- StarPU's history rules ---------------------------------------------------------------------


def test_first_sample_of_each_footprint_is_dropped() -> None:
    model = HistoryModel(0, "cpu")
    assert model.record(FP, 100.0) is SampleOutcome.DROPPED_FIRST
    entry = model.entry(FP)
    assert entry is not None and entry.n == 0
    assert model.record(FP, 1.0) is SampleOutcome.ACCEPTED  # 100.0 never counted as mean
    assert model.entry(FP).mean == 1.0  # type: ignore[union-attr]


def test_prediction_is_nan_until_ten_accepted_samples() -> None:
    model = HistoryModel(0, "cuda0")
    assert math.isnan(model.predict(FP)) and model.needs_samples(FP)
    model.record(FP, 2.0)  # dropped
    for i in range(9):
        model.record(FP, 2.0)
        assert math.isnan(model.predict(FP)), i
        assert model.needs_samples(FP)
    model.record(FP, 2.0)
    assert model.predict(FP) == 2.0
    assert not model.needs_samples(FP)


def test_calibrate_minimum_is_configurable() -> None:
    model = HistoryModel(0, "cpu", calibrate_minimum=3)
    calibrated(model, FP, 0.5, n=3)
    assert model.predict(FP) == 0.5


def test_outlier_is_not_averaged_and_only_counts_in_nerror() -> None:
    model = HistoryModel(0, "cpu")
    calibrated(model, FP, 1.0)
    assert model.record(FP, 1.51) is SampleOutcome.OUTLIER
    assert model.record(FP, 0.66) is SampleOutcome.OUTLIER  # below mean/1.5
    entry = model.entry(FP)
    assert entry is not None
    assert (entry.n, entry.nerror, entry.mean) == (10, 2, 1.0)
    # The band's edges are inside it, as in StarPU (strict comparisons).
    assert model.record(FP, 1.5) is SampleOutcome.ACCEPTED


def test_entry_resets_when_errors_reach_samples() -> None:
    model = HistoryModel(0, "cpu")
    model.record(FP, 1.0)  # dropped
    model.record(FP, 1.0)
    model.record(FP, 1.0)
    assert model.record(FP, 5.0) is SampleOutcome.OUTLIER  # nerror 1 < n 2
    assert model.record(FP, 5.0) is SampleOutcome.RESET  # nerror 2 >= n 2
    entry = model.entry(FP)
    assert entry is not None and (entry.n, entry.nerror, entry.sum) == (0, 0, 0.0)
    # The entry survives, so the next sample is not "first" again: the new regime is learnt.
    assert model.record(FP, 5.0) is SampleOutcome.ACCEPTED
    assert model.entry(FP).mean == 5.0  # type: ignore[union-attr]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=0.9, max_value=1.1), min_size=2, max_size=60))
def test_mean_and_stddev_match_numpy(values: list[float]) -> None:
    model = HistoryModel(0, "cpu")
    outcomes = [model.record(FP, v) for v in values]
    assert outcomes[0] is SampleOutcome.DROPPED_FIRST
    assert all(o is SampleOutcome.ACCEPTED for o in outcomes[1:])
    entry = model.entry(FP)
    assert entry is not None and entry.n == len(values) - 1
    assert entry.mean == pytest.approx(np.mean(values[1:]), rel=1e-12)
    assert entry.stddev == pytest.approx(np.std(values[1:]), abs=1e-6)


def test_invalid_times_are_rejected() -> None:
    model = HistoryModel(0, "cpu")
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError):
            model.record(FP, bad)


def test_json_round_trip_keeps_statistics_and_predictions() -> None:
    model = HistoryModel(2, "cuda1")
    calibrated(model, FP, 0.25)
    model.record(FP, 10.0)  # an outlier, so nerror is round-tripped too
    other = Footprint(4, FP.shape_hash)
    model.record(other, 0.1)
    model.record(other, 0.1)
    text = json.dumps(model.to_dict(), allow_nan=False)
    back = HistoryModel.from_dict(json.loads(text))
    assert (back.part, back.arch) == (2, "cuda1")
    assert back.entries() == model.entries()
    assert back.predict(FP) == model.predict(FP)
    assert math.isnan(back.predict(other))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("entries"),
        lambda d: d["entries"][0].update(n="ten"),
        lambda d: d["entries"][0].update(sum=-1.0),
        lambda d: d["entries"].append(dict(d["entries"][0])),
        lambda d: d.update(unit="microseconds"),
        lambda d: d.update(part="0"),
    ],
)
def test_from_dict_rejects_malformed_content(mutate) -> None:  # type: ignore[no-untyped-def]
    model = HistoryModel(0, "cpu")
    calibrated(model, FP, 1.0)
    data = json.loads(json.dumps(model.to_dict()))
    mutate(data)
    with pytest.raises(PerfModelFormatError):
        HistoryModel.from_dict(data)


def test_journal_replay_reproduces_the_model_and_sync_keeps_late_samples() -> None:
    model = HistoryModel(0, "cpu")
    calibrated(model, FP, 1.0, n=4)
    disk = HistoryModel(0, "cpu")
    disk.replay(model.take_unsaved())
    assert disk.entries() == model.entries()
    assert model.unsaved_count == 0
    model.record(FP, 1.0)  # recorded while "the store" was busy
    model.sync_from(disk)
    assert model.entry(FP).n == 5  # type: ignore[union-attr]
    assert model.unsaved_count == 1


# -- regression ---------------------------------------------------------------------------------

A, B, C = 2e-3, 0.8, 5e-3
SIZES = np.array([1, 2, 4, 8, 16, 32, 64, 128], dtype=float)


def truth(n: np.ndarray | float) -> np.ndarray | float:
    return A * np.asarray(n, dtype=float) ** B + C


def test_nl_regression_recovers_parameters_from_noisy_data() -> None:
    rng = np.random.default_rng(7)
    y = truth(SIZES) * (1 + 0.01 * rng.standard_normal(len(SIZES)))
    fit = fit_nl_regression(SIZES, y)
    assert fit is not None
    assert fit.b == pytest.approx(B, abs=0.03)
    assert fit.a == pytest.approx(A, rel=0.1)
    assert fit.c == pytest.approx(C, rel=0.1)
    assert fit.r2 > 0.999 and fit.rel_rmse < 0.02
    assert (fit.npoints, fit.min_batch, fit.max_batch) == (8, 1, 128)
    assert fit.predict(48) == pytest.approx(truth(48), rel=0.02)  # a size never measured


def test_nl_regression_needs_three_distinct_sizes() -> None:
    assert fit_nl_regression([1, 2], [1.0, 2.0]) is None
    assert fit_nl_regression([4, 4, 4, 8], [1.0, 1.1, 0.9, 2.0]) is None
    assert fit_nl_regression([1, 2, 4], [1.0, 2.0, 4.0]) is not None


def test_nl_regression_keeps_constant_non_negative() -> None:
    x = np.array([1, 2, 4, 8, 16], dtype=float)
    fit = fit_nl_regression(x, 1e-3 * x - 2e-4)  # least squares would want c < 0
    assert fit is not None and fit.c >= 0 and fit.a >= 0
    exact = fit_nl_regression(x, 3e-3 * x**1.5)
    assert exact is not None
    assert exact.b == pytest.approx(1.5, abs=1e-4) and exact.c == pytest.approx(0, abs=1e-9)


def test_power_law_follows_starpu_validity_rules() -> None:
    x = np.repeat([2.0, 4.0, 8.0, 16.0, 32.0], 2)
    law = fit_power_law(x, 1e-3 * x**0.9)
    assert law is not None
    assert law.beta == pytest.approx(0.9) and law.alpha == pytest.approx(1e-3)
    assert law.predict(10) == pytest.approx(1e-3 * 10**0.9)
    assert math.isnan(law.predict(1.0)) and math.isnan(law.predict(40.0))
    assert fit_power_law(x[:9], x[:9]) is None  # fewer than 10 samples
    assert fit_power_law([8.0] * 12, [1.0] * 12) is None  # no spread in size


def family_model(sizes: list[int]) -> HistoryModel:
    model = HistoryModel(1, "cuda0")
    for n in sizes:
        calibrated(model, Footprint(n, FP.shape_hash), float(truth(n)))
    return model


def test_history_predict_falls_back_to_regression_for_unseen_batch_sizes() -> None:
    model = family_model([1, 2, 4, 8, 16, 32])
    unseen = Footprint(12, FP.shape_hash)
    assert model.predict(unseen) == pytest.approx(truth(12), rel=1e-3)
    assert model.needs_samples(unseen)  # the fallback does not stop calibration
    assert math.isnan(model.predict(Footprint(12, FP.shape_hash ^ 1)))  # other shapes
    # A calibrated entry wins over the curve.
    assert model.predict(Footprint(8, FP.shape_hash)) == pytest.approx(truth(8))
    assert math.isnan(HistoryModel(1, "cuda0", use_regression=False).predict(unseen))


def test_regression_needs_three_calibrated_sizes_and_refits_when_history_changes() -> None:
    model = family_model([1, 2])
    probe = Footprint(64, FP.shape_hash)
    assert math.isnan(model.predict(probe))
    # Uncalibrated entries (fewer than 10 samples) do not count as points.
    for _ in range(5):
        model.record(Footprint(4, FP.shape_hash), float(truth(4)))
    assert math.isnan(model.predict(probe))
    for _ in range(6):
        model.record(Footprint(4, FP.shape_hash), float(truth(4)))
    first = model.regression(FP.shape_hash)
    assert first is not None and first.npoints == 3
    calibrated(model, Footprint(32, FP.shape_hash), float(truth(32)))
    second = model.regression(FP.shape_hash)
    assert second is not None and second.npoints == 4
    assert model.predict(probe) == pytest.approx(truth(64), rel=1e-3)


def test_regression_is_fitted_again_only_when_a_calibrated_mean_moves() -> None:
    """A serving model records a sample per task: each one must not cost a fresh non-linear
    fit (a solve on the server's event loop), only a sample that moves its entry's mean by more
    than REFIT_DRIFT, or a newly calibrated batch size, does."""
    model = family_model([1, 2, 4])
    four = Footprint(4, FP.shape_hash)
    first = model.regression(FP.shape_hash)
    model.record(four, float(truth(4)))  # the mean stays where it was
    assert model.regression(FP.shape_hash) is first
    for _ in range(10):  # about 10 % slower now: the curve must follow
        model.record(four, float(truth(4)) * 1.25)
    moved = model.regression(FP.shape_hash)
    assert moved is not first and moved is not None
    assert moved.predict(4) > first.predict(4)


def test_rows_carry_statistics_and_regression_parameters() -> None:
    model = family_model([1, 2, 4])
    model.record(Footprint(8, FP.shape_hash), 0.5)  # created, not calibrated
    rows = model.rows()
    assert [r.batch for r in rows] == [1, 2, 4, 8]
    assert all(r.part == 1 and r.arch == "cuda0" for r in rows)
    assert [r.calibrated for r in rows] == [True, True, True, False]
    assert rows[0].n == 10 and rows[0].mean == pytest.approx(truth(1))
    assert rows[0].stddev == pytest.approx(0.0, abs=1e-9)
    assert rows[3].regression is not None and rows[3].regression.b > 0
    assert rows[3].prediction == pytest.approx(rows[3].regression.predict(8))


# -- bus ----------------------------------------------------------------------------------------


def bus() -> BusModel:
    model = BusModel()
    model.set("numa0", "cuda0", LinkCost(latency=1e-5, bandwidth=12e9))
    model.set("cuda0", "numa0", LinkCost(latency=2e-5, bandwidth=10e9))
    model.set("numa1", "numa0", LinkCost(latency=3e-6, bandwidth=20e9))
    return model


def test_bus_predict_is_latency_plus_size_over_bandwidth() -> None:
    model = bus()
    mib = 1 << 20
    assert model.predict("numa0", "cuda0", mib) == pytest.approx(1e-5 + mib / 12e9)
    assert model.predict("numa0", "cuda0", mib, shared_by=4) == pytest.approx(1e-5 + 4 * mib / 12e9)
    assert model.predict("cuda0", "cuda0", mib) == 0.0
    assert model.predict("numa0", "cuda0", 0) == 0.0
    # Unknown route: 0 like StarPU's NaN, and has_route tells it apart.
    assert model.predict("numa0", "cuda1", mib) == 0.0
    assert not model.has_route("numa0", "cuda1") and model.has_route("numa0", "cuda0")
    with pytest.raises(ValueError):
        model.predict("numa0", "cuda0", -1)


def test_bus_routes_through_measured_links() -> None:
    model = bus()
    n = 8 << 20
    two_hops = 3e-6 + 1e-5 + n * (1 / 20e9 + 1 / 12e9)
    assert model.predict("numa1", "cuda0", n) == pytest.approx(two_hops)
    # A direct link, once measured, is used when it is cheaper.
    model.set("numa1", "cuda0", LinkCost(latency=1e-5, bandwidth=11e9))
    assert model.predict("numa1", "cuda0", n) == pytest.approx(1e-5 + n / 11e9)


def test_bus_json_round_trip() -> None:
    model = bus()
    back = BusModel.from_dict(json.loads(json.dumps(model.to_dict(), allow_nan=False)))
    assert back.links == model.links
    assert back.nodes() == ["cuda0", "numa0", "numa1"]
    with pytest.raises(ValueError):
        BusModel.from_dict({"links": [{"src": "numa0", "dst": "cuda0", "latency": 0.0}]})


def test_links_and_costs_are_validated() -> None:
    for src, dst in (("numa0", "numa0"), ("NUMA0", "cuda0"), ("gpu", "cuda0")):
        with pytest.raises(ValueError):
            Link(src, dst)
    with pytest.raises(ValueError):
        LinkCost(latency=-1.0, bandwidth=1.0)
    with pytest.raises(ValueError):
        LinkCost(latency=0.0, bandwidth=0.0)


def test_calibrate_link_recovers_latency_and_bandwidth_from_the_copy_times() -> None:
    now = [0.0]
    sizes: list[int] = []

    def clock() -> float:
        return now[0]

    def copy(nbytes: int) -> None:  # a simulated link: 5 us + nbytes / 8 GB/s
        sizes.append(nbytes)
        now[0] += 5e-6 + nbytes / 8e9

    cost = calibrate_link(copy, clock=clock)
    assert cost.latency == pytest.approx(5e-6 + 1 / 8e9)
    assert cost.bandwidth == pytest.approx(8e9, rel=1e-6)
    assert sizes.count(1) == 33 and sizes.count(32 << 20) == 33  # StarPU's 32 + a warm-up


def test_calibrate_host_numa_measures_real_copies() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    fake_two_nodes = {0: cpus[:1], 1: cpus[-1:]}
    model = calibrate_host_numa(fake_two_nodes, bandwidth_bytes=1 << 20, repeats=3)
    assert set(model.links) == {Link("numa0", "numa1"), Link("numa1", "numa0")}
    for cost in model.links.values():
        assert math.isfinite(cost.bandwidth) and cost.bandwidth > 0 and cost.latency >= 0
    assert model.predict("numa0", "numa1", 1 << 20) > 0
    assert calibrate_host_numa({0: cpus}, bandwidth_bytes=1 << 16, repeats=1).links == {}


def test_host_numa_nodes_reads_sysfs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    allowed = sorted(os.sched_getaffinity(0))
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "cpulist").write_text(f"{allowed[0]}\n")
    (tmp_path / "node1").mkdir()
    (tmp_path / "node1" / "cpulist").write_text("\n")  # memory-only node
    assert host_numa_nodes(tmp_path) == {0: [allowed[0]]}
    assert host_numa_nodes(tmp_path / "missing") == {0: allowed}
    assert 0 in host_numa_nodes()


@pytest.mark.parametrize("name, k", [("bert_tiny", 3), ("gpt2_tiny_kv", 2)])
def test_every_batch_size_of_a_part_is_one_shape_family(tmp_path, name, k) -> None:
    """A part may read an unbatched crossing tensor whose leading size happens to equal a batch
    size (bert_tiny's and gpt2_tiny_kv's [1]-shaped Unsqueeze outputs; [3] and [4] shape vectors
    in finer cuts). The footprint starred that axis as the batch at that batch size only, so
    batch 1 (or 3, 4) formed a family of its own: the batch-size regression lost its most
    telling point, or fell below the three sizes it needs. The contract's axes alone are starred
    now, and every batch size of a part shares one family."""
    import staronnx
    import realmodels
    from staronnx.partition import PartitionSpec
    from staronnx.verify import random_plan_feeds

    plan = staronnx.partition(realmodels.path(name), spec=PartitionSpec(
        parts=k, costs="estimate", input_shapes=realmodels.input_shapes(name)), output_dir=tmp_path / "plan")
    unbatched = [n for p in plan.parts for n in p.inputs
                 if n not in plan.part_batch_axes(p.index) and plan.tensor(n).shape]
    assert unbatched, "the cut reads no unbatched tensor: the case this test is for is gone"
    values = {b: plan.reference_values(random_plan_feeds(plan, b, seed=b)) for b in (1, 2, 3, 4, 8)}
    for part in plan.parts:
        axes = plan.part_batch_axes(part.index)
        families = {b: Footprint.of_feeds(plan.part_feeds(part.index, v), b, axes).shape_hash
                    for b, v in values.items()}
        assert len(set(families.values())) == 1, (part.index, families)


def test_plot_draws_one_line_and_one_fit_per_shape_family(tmp_path, monkeypatch) -> None:
    """Two shape families of one part and arch are two lines, each with its own family's fit
    (they were one line zig-zagging between families, drawn with the first family's fit)."""
    import staronnx.perfmodels.plot as plot_mod
    from staronnx.perfmodels.history import PerfRow
    from staronnx.perfmodels.regression import NLRegression

    small = NLRegression(a=1e-3, b=1.0, c=0.0, r2=1.0, rel_rmse=0.0, npoints=3, min_batch=1, max_batch=4)
    large = NLRegression(a=1e-1, b=1.0, c=0.0, r2=1.0, rel_rmse=0.0, npoints=3, min_batch=1, max_batch=4)
    rows = [PerfRow(part=0, arch="cpu", batch=b, shape_hash=family, n=10, mean=reg.predict(b), stddev=0.0,
                    nerror=0, calibrated=True, prediction=reg.predict(b), regression=reg)
            for family, reg in (("0000000a", small), ("0000000b", large)) for b in (1, 2, 4)]
    figures = []
    real_save = plot_mod.save_figure

    def keep(fig, path, dpi=120):
        figures.append(fig)
        return real_save(fig, path, dpi=dpi)

    monkeypatch.setattr(plot_mod, "save_figure", keep)
    out = plot_mod.plot_rows(rows, tmp_path / "perf.png")
    assert out.exists() and out.stat().st_size > 0
    ax = figures[0].axes[0]
    assert len(ax.containers) == 2, "one errorbar line per shape family"
    labels = [c.get_label() for c in ax.containers]
    assert any("0000000a" in label for label in labels) and any("0000000b" in label for label in labels)
    fits = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(fits) == 2
    ends = sorted(float(line.get_ydata()[-1]) for line in fits)
    # each fit at batch 4 is its own family's time (ms): 4 ms and 400 ms
    assert ends == pytest.approx([4.0, 400.0])
    for container in ax.containers:
        xs = list(container.lines[0].get_xdata())
        assert xs == sorted(xs) == [1, 2, 4]
