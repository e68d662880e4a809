"""The on-disk store: layout, atomic writes, recovery from bad files, concurrent processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
from _pytest.monkeypatch import MonkeyPatch

from staronnx.perfmodels import (
    BusModel,
    Footprint,
    HistoryModel,
    LinkCost,
    ModelKey,
    PendingSample,
    PerfModelCorruptWarning,
    PerfModelStore,
    SampleOutcome,
)

PLAN = "plan0123abcd"
FP = Footprint.from_shapes({"input": (8, 3, 224, 224)})


def filled(part: int = 0, arch: str = "cpu", n: int = 12, seconds: float = 0.02) -> HistoryModel:
    model = HistoryModel(part, arch)
    for _ in range(n):
        model.record(FP, seconds)
    return model


def stray_files(root: Path) -> list[Path]:
    """Anything a write may leave behind besides the models and their lock files."""
    return [p for p in root.rglob("*") if p.name.startswith(".") or p.name.endswith(".tmp")]


def test_save_load_round_trip_and_layout(tmp_path: Path) -> None:
    store = PerfModelStore(tmp_path, host="node1")
    model = filled(part=1, arch="cuda0")
    store.save(PLAN, model)
    path = tmp_path / "perfmodels" / "node1" / PLAN / "part1.cuda0.json"
    assert store.path(ModelKey(PLAN, 1, "cuda0")) == path and path.is_file()
    data = json.loads(path.read_text())
    assert (data["format"], data["version"], data["kind"]) == ("staronnx-perfmodel", 1, "history")
    back = store.load(PLAN, 1, "cuda0")
    assert back.entries() == model.entries()
    assert back.predict(FP) == pytest.approx(0.02)
    assert model.unsaved_count == 0
    # Nothing stored yet for another arch: an empty, uncalibrated model.
    assert len(store.load(PLAN, 1, "cpu")) == 0


def test_root_and_host_come_from_the_environment(tmp_path: Path, monkeypatch: MonkeyPatch) -> None:
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("STARONNX_HOSTNAME", "bench box/1")
    store = PerfModelStore()
    assert store.root == tmp_path / "home" and store.host == "bench_box_1"
    monkeypatch.delenv("STARONNX_HOME")
    assert PerfModelStore().root == Path.home() / ".cache" / "staronnx"


@pytest.mark.parametrize("bad", ["../x", "a/b", "", "a.b"])
def test_names_that_could_escape_the_store_are_rejected(tmp_path: Path, bad: str) -> None:
    store = PerfModelStore(tmp_path, host="h")
    with pytest.raises(ValueError):
        store.load(bad, 0, "cpu")
    with pytest.raises(ValueError):
        store.load(PLAN, 0, bad)


def test_commit_merges_samples_instead_of_overwriting(tmp_path: Path) -> None:
    store = PerfModelStore(tmp_path, host="h")
    first = store.load(PLAN, 0, "cpu")
    second = store.load(PLAN, 0, "cpu")
    for _ in range(6):
        first.record(FP, 1.0)
    for _ in range(7):
        second.record(FP, 1.0)
    store.commit(PLAN, first)
    merged = store.commit(PLAN, second)
    # Each process dropped its own first sample: 5 + 6 samples survive, none overwritten.
    assert merged.entry(FP).n == 11  # type: ignore[union-attr]
    assert second.entry(FP).n == 11  # type: ignore[union-attr]  # refreshed from the store
    assert store.load(PLAN, 0, "cpu").predict(FP) == 1.0


def test_update_applies_a_change_under_the_lock(tmp_path: Path) -> None:
    store = PerfModelStore(tmp_path, host="h")
    key = ModelKey(PLAN, 2, "cpu")

    def add_sample(model: HistoryModel) -> None:
        model.record(FP, 0.5)

    for _ in range(3):
        store.update(key, add_sample)
    assert store.load(PLAN, 2, "cpu").entry(FP).n == 2  # type: ignore[union-attr]
    replaced = store.update(key, lambda m: HistoryModel(2, "cpu"))
    assert len(replaced) == 0 and len(store.load(PLAN, 2, "cpu")) == 0
    with pytest.raises(ValueError, match="part 3"):
        store.update(key, lambda m: HistoryModel(3, "cpu"))


def test_list_rows_and_plan_hashes(tmp_path: Path) -> None:
    store = PerfModelStore(tmp_path, host="h")
    store.save(PLAN, filled(0, "cuda0"))
    store.save(PLAN, filled(1, "cpu"))
    store.save("otherplan", filled(0, "cpu"))
    assert store.plan_hashes() == ["otherplan", PLAN]
    assert store.list(PLAN) == [ModelKey(PLAN, 0, "cuda0"), ModelKey(PLAN, 1, "cpu")]
    rows = store.rows(PLAN)
    assert [(r.part, r.arch, r.batch, r.n) for r in rows] == [
        (0, "cuda0", 8, 11),
        (1, "cpu", 8, 11),
    ]
    assert store.list("nothing") == [] and store.rows("nothing") == []


HEADER = {"format": "staronnx-perfmodel", "version": 1}
BAD_CONTENTS = {
    "garbage": b"\x00\xffnot json at all",
    "truncated": None,  # filled in from a valid file below
    "foreign version": json.dumps({"format": "staronnx-perfmodel", "version": 2}).encode(),
    "foreign format": json.dumps({"format": "something-else", "version": 1}).encode(),
    "wrong kind": json.dumps({**HEADER, "kind": "bus", "links": []}).encode(),
    "bad entries": json.dumps(
        {**HEADER, "kind": "history", "part": 0, "arch": "cpu", "entries": [{"batch": 1}]}
    ).encode(),
    "other part": None,  # a valid file of another part, copied here
}


@pytest.mark.parametrize("case", sorted(BAD_CONTENTS))
def test_unusable_file_is_moved_aside_with_a_warning_and_recalibrated(
    tmp_path: Path, case: str
) -> None:
    store = PerfModelStore(tmp_path, host="h")
    path = store.path(ModelKey(PLAN, 0, "cpu"))
    store.save(PLAN, filled(0, "cpu"))
    content = BAD_CONTENTS[case]
    if case == "truncated":
        content = path.read_bytes()[: len(path.read_bytes()) // 2]
    elif case == "other part":
        store.save(PLAN, filled(5, "cpu"))
        content = store.path(ModelKey(PLAN, 5, "cpu")).read_bytes()
    path.write_bytes(content)  # type: ignore[arg-type]

    with pytest.warns(PerfModelCorruptWarning, match="recalibrated"):
        model = store.load(PLAN, 0, "cpu")
    assert len(model) == 0 and (model.part, model.arch) == (0, "cpu")
    # a reader leaves the file alone (issue 12: only writers set files aside)
    assert path.read_bytes() == content
    assert not list(path.parent.glob("part0.cpu.json.corrupt-*"))
    # The store keeps working: the writer sets the file aside and saves to a fresh one.
    for _ in range(3):
        model.record(FP, 1.0)
    with pytest.warns(PerfModelCorruptWarning, match="moved aside"):
        store.commit(PLAN, model)
    aside = list(path.parent.glob("part0.cpu.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == content
    assert store.load(PLAN, 0, "cpu").entry(FP).n == 2  # type: ignore[union-attr]


def test_update_over_a_corrupt_file_warns_and_starts_fresh(tmp_path: Path) -> None:
    store = PerfModelStore(tmp_path, host="h")
    key = ModelKey(PLAN, 0, "cpu")
    store.path(key).parent.mkdir(parents=True)
    store.path(key).write_text('{"format": "staronnx-perfmodel", "vers')  # truncated
    with pytest.warns(PerfModelCorruptWarning):
        model = store.update(key, lambda m: m.replay([PendingSample(FP, None)]))
    assert model.entry(FP).n == 0  # type: ignore[union-attr]
    assert json.loads(store.path(key).read_text())["version"] == 1


def test_bus_model_round_trip_and_recovery(tmp_path: Path) -> None:
    store = PerfModelStore(tmp_path, host="h")
    assert store.load_bus().links == {}
    bus = BusModel()
    bus.set("numa0", "cuda0", LinkCost(1e-5, 12e9))
    store.save_bus(bus)
    assert store.bus_path() == tmp_path / "bus" / "h.json"
    assert store.load_bus().links == bus.links
    store.bus_path().write_text(json.dumps({**HEADER, "kind": "bus", "links": [{"src": "numa0"}]}))
    with pytest.warns(PerfModelCorruptWarning):
        assert store.load_bus().links == {}
    assert not list(store.bus_path().parent.glob("h.json.corrupt-*"))  # a reader only warns
    with pytest.warns(PerfModelCorruptWarning):
        store.save_bus(bus)
    assert list(store.bus_path().parent.glob("h.json.corrupt-*"))
    assert store.load_bus().links == bus.links


def test_atomic_writes_leave_no_temp_files(tmp_path: Path, monkeypatch: MonkeyPatch) -> None:
    store = PerfModelStore(tmp_path, host="h")
    model = store.load(PLAN, 0, "cpu")
    for i in range(20):
        model.record(FP, 1.0)
        store.commit(PLAN, model)
    store.save_bus(BusModel())
    assert stray_files(tmp_path) == []
    good = store.path(ModelKey(PLAN, 0, "cpu")).read_bytes()

    # A write that fails at the last step keeps the old file and cleans its temp file up.
    def failing_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    model.record(FP, 1.0)
    with pytest.raises(OSError, match="disk full"):
        store.commit(PLAN, model)
    monkeypatch.undo()
    assert stray_files(tmp_path) == []
    assert store.path(ModelKey(PLAN, 0, "cpu")).read_bytes() == good
    assert model.unsaved_count == 1  # kept for the next commit
    assert store.commit(PLAN, model).entry(FP).n == 20  # type: ignore[union-attr]


# -- two processes recording into the same model ------------------------------------------------

SAMPLES_PER_PROCESS = 200


def _record_concurrently(root: str, barrier, results) -> None:  # type: ignore[no-untyped-def]
    """Child process: record samples one by one, committing each into the shared store."""
    store = PerfModelStore(root, host="h")
    model = store.load(PLAN, 0, "cuda0")
    barrier.wait()
    dropped = 0
    accepted_sum = 0.0
    for i in range(SAMPLES_PER_PROCESS):
        seconds = 0.01 + 0.0001 * (i % 7)  # always inside the ±50 % band
        outcome = model.record(FP, seconds)
        if outcome is SampleOutcome.DROPPED_FIRST:
            dropped += 1
        else:
            accepted_sum += seconds
        store.commit(PLAN, model)
    results.put((dropped, accepted_sum))


def test_two_processes_recording_concurrently_lose_no_sample(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_record_concurrently, args=(str(tmp_path), barrier, results))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    dropped = sum(d for d, _ in outcomes)
    # Each process drops its first sample, unless the other one had already created the entry.
    assert 1 <= dropped <= 2
    entry = PerfModelStore(tmp_path, host="h").load(PLAN, 0, "cuda0").entry(FP)
    assert entry is not None
    assert entry.n == 2 * SAMPLES_PER_PROCESS - dropped
    assert entry.nerror == 0
    assert entry.sum == pytest.approx(sum(s for _, s in outcomes), rel=1e-12)
    assert stray_files(tmp_path) == []


def test_atomic_writes_get_the_mode_open_would_give_or_keep_the_targets(tmp_path):
    import os
    import stat

    from staronnx.fsutil import atomic_write_text

    old = os.umask(0o022)
    try:
        new = tmp_path / "sub" / "new.json"
        atomic_write_text(new, "{}\n")
        assert stat.S_IMODE(new.stat().st_mode) == 0o644  # not mkstemp's 0600
        assert new.read_text() == "{}\n"
        kept = tmp_path / "kept.json"
        kept.write_text("old")
        kept.chmod(0o640)
        atomic_write_text(kept, "new")
        assert stat.S_IMODE(kept.stat().st_mode) == 0o640 and kept.read_text() == "new"
        assert not list(tmp_path.rglob(".*.tmp"))
    finally:
        os.umask(old)


def test_a_help_cost_file_without_its_figure_warns_and_charges_the_default(tmp_path: Path,
                                                                          monkeypatch: MonkeyPatch) -> None:
    """A help-cost file with the store's header but no host_share (cut short by hand, written by
    another version) raised KeyError out of the store's reader, which promises a warning and the
    default for an unusable file: partition --shares auto ended in a traceback."""
    import warnings

    import realmodels
    import staronnx
    from staronnx.partition import PartitionSpec
    from staronnx.partition.autoshares import WorkerSpeed
    from staronnx.perfmodels.helpcost import HelpCost
    from staronnx.perfmodels.store import PerfModelCorruptWarning

    monkeypatch.setenv("STARONNX_HOME", str(tmp_path / "home"))
    store = PerfModelStore()
    store.save_help_cost(HelpCost(host_share=0.2))
    path = store.help_cost_path()
    data = json.loads(path.read_text())
    del data["host_share"]
    path.write_text(json.dumps(data))
    speeds = [WorkerSpeed("cuda0", "cuda", 0.001), WorkerSpeed("cpu1", "cpu", 0.01)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = staronnx.partition(realmodels.path("crnn_ocr"), "auto", PartitionSpec(
            costs="estimate", input_shapes=realmodels.input_shapes("crnn_ocr")), output_dir=tmp_path / "plan",
            speeds=speeds)
    assert plan.settings["auto_shares"]["reason"]
    assert any(issubclass(w.category, PerfModelCorruptWarning) and "host_share" in str(w.message) for w in caught)
