"""One partition pipeline (issue 15, part 3): every method is a Cut, every plan is finished by
one export, the partition package has no import cycle, and strings are read at the edge."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import onnx
import pytest

import staronnx
from staronnx import zoo
from staronnx.errors import PartitionError
from staronnx.modelio import load_model
from staronnx.partition.api import METHODS
from staronnx.partition.autoshares import choose_shares
from staronnx.partition.costs import estimated_costs
from staronnx.partition.cut import CutRequest, Parts
from staronnx.partition.export import write_plan
from staronnx.partition.graph import build_graph
from staronnx.partition.methods import place
from staronnx.plan import Plan
from staronnx.partition.host import host_devices
from _helpers import cli
from staronnx.partition import PartitionSpec

PACKAGE = Path(staronnx.__file__).parent / "partition"


# ---------------------------------------------------------------------------- import graph
def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def partition_imports() -> dict[str, set[str]]:
    """staronnx.partition module -> the staronnx.partition modules it imports, anywhere in the
    file (inside functions too). ``from PKG import name`` counts as importing ``PKG.name`` when
    that is a module, else ``PKG``; a submodule import is not counted as importing its parents."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                           for a in node.names]
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_partition_package_has_no_import_cycle():
    graph = partition_imports()
    # the graph is real: the modules the pipeline joins are in it, with their edges
    assert "staronnx.partition.export" in graph["staronnx.partition.methods.pipeline"]
    assert "staronnx.partition.methods.pipeline" in graph["staronnx.partition.api"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


# ---------------------------------------------------------------------------- one pipeline
def test_every_method_is_a_cut_named_as_it_is_asked_for():
    assert set(METHODS) == {"metis", "linear", "comm-sd", "duet", "overseer", "optimal", "ort-static"}
    for name, cut in METHODS.items():
        assert cut.name == name and callable(cut)


def test_a_share_cut_answers_parts_that_the_export_writes(tmp_path):
    graph = build_graph(load_model(zoo.chain()))
    parts = METHODS["linear"](graph, CutRequest([0.5, 0.5], costs="estimate"))
    assert isinstance(parts, Parts) and parts.k == 2 and parts.devices is None
    plan = write_plan(graph, parts, {"method": "linear"}, tmp_path / "p")
    assert [p.target_share for p in plan.parts] == [0.5, 0.5]
    assert [p.device for p in plan.parts] == [None, None]


def test_placed_plans_are_written_once_with_their_devices(tmp_path, two_groups, monkeypatch):
    writes: list[Path] = []
    real = Plan.write_json
    monkeypatch.setattr(Plan, "write_json", lambda self, d: (writes.append(Path(d)), real(self, d))[1])
    plan = place(zoo.inception(blocks=2, channels=8, size=16), PartitionSpec(method="duet", costs="estimate"),
                 output_dir=tmp_path / "plan", devices=host_devices(two_groups))
    assert len(writes) == 1, writes  # staged once, renamed into place: never rewritten
    data = json.loads((tmp_path / "plan" / "plan.json").read_text())
    devices = [p["device"] for p in data["parts"]]
    assert devices == data["settings"]["placement"]["part_devices"] == [p.device for p in plan.parts]
    assert all(d.startswith("cpu:") for d in devices)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging or backup left


def test_partition_and_place_cut_and_export_alike(tmp_path, two_groups):
    model = zoo.inception(blocks=2, channels=8, size=16)
    a = staronnx.partition(model, spec=PartitionSpec(method="duet", groups=two_groups, costs="estimate"),
                           output_dir=tmp_path / "a")
    b = place(model, PartitionSpec(method="duet", costs="estimate"), output_dir=tmp_path / "b",
              devices=host_devices(two_groups))
    assert [p.sha256 for p in a.parts] == [p.sha256 for p in b.parts]
    assert [p.device for p in a.parts] == [p.device for p in b.parts]
    assert a.settings["placement"] == b.settings["placement"]
    # each entry point keeps its own record of how it was asked
    assert (a.settings["device"], a.settings["tolerance"]) == ("cpu", 0.02)
    assert (b.settings["device"], b.settings["tolerance"], b.settings["options"]) == ("placed", None, {})


@pytest.mark.parametrize("bad", ["backwards", "gap", "devices"])
def test_the_export_refuses_an_invalid_cut_and_writes_nothing(tmp_path, bad):
    graph = build_graph(load_model(zoo.chain()))
    n = len(graph)
    ranks = np.array([0] * (n // 2) + [1] * (n - n // 2))
    devices = None
    if bad == "backwards":
        ranks = ranks[::-1].copy()  # the first nodes feed later ones from a later part
    elif bad == "gap":
        ranks = ranks * 2  # parts 0 and 2, no part 1
    else:
        devices = ["cpu:a"]  # one device for two parts
    parts = Parts(ranks, estimated_costs(graph), [0.5, 0.5] + ([0.0] if bad == "gap" else []), devices)
    with pytest.raises(PartitionError, match="invalid cut"):
        write_plan(graph, parts, {"method": "mine"}, tmp_path / "p")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- strings at the edge
def test_the_cli_reads_its_strings_and_names_its_flags(tmp_path, capsys):
    model = tmp_path / "chain.onnx"
    onnx.save(zoo.chain(), str(model))
    code, _, err = cli(capsys, "partition", model, "-o", tmp_path / "p", "--costs", "estimate",
                       "--shares", "0.6,0.4", "--input-shape", "x=-1x32")
    assert code == 0, err
    plan = Plan.load(tmp_path / "p")
    assert [p.target_share for p in plan.parts] == [0.6, 0.4]
    assert plan.settings["input_shapes"] == {"x": [-1, 32]}
    code, _, err = cli(capsys, "plan", "verify", tmp_path / "p", "--model", model, "--input-shape", "x=1xq")
    assert code == 2 and "--input-shape expects" in err and len(err.strip().splitlines()) == 1, err


def test_the_library_names_its_arguments_for_the_same_strings(tmp_path):
    with pytest.raises(PartitionError) as info:
        staronnx.partition(zoo.chain(), "0.6,x", PartitionSpec(costs="estimate"), output_dir=tmp_path / "p")
    assert str(info.value).startswith("shares must be comma-separated") and "--" not in str(info.value)
    with pytest.raises(PartitionError) as info:
        choose_shares([], batch=8)
    assert str(info.value).startswith("shares='auto'") and info.value.for_cli().startswith("--shares auto")


def test_one_profile_reader_gives_each_node_its_time_and_provider(tmp_path):
    """costs.kernel_events serves both the node costs and ort-static's provider per node."""
    from staronnx.feeds import random_feeds_for_shapes
    from staronnx.ortutil import make_session
    from staronnx.partition.costs import kernel_events, profiling_options
    from staronnx.partition.graph import resolve_input_shapes

    graph = build_graph(load_model(zoo.chain()))
    feeds = random_feeds_for_shapes(graph.inputs, resolve_input_shapes(graph.inputs, 2, None), model=graph.model)
    sess = make_session(graph.model, optimize=False, providers=["CPUExecutionProvider"],
                        options=profiling_options(str(tmp_path)))
    sess.run(None, feeds)
    events = kernel_events(Path(sess.end_profiling()))
    assert {name for name, _, _ in events} == {node.name for node in graph.nodes}
    assert all(us >= 0 and provider == "CPUExecutionProvider" for _, us, provider in events)


def test_place_keeps_the_specs_batching_contract(tmp_path, two_groups):
    """place() read the method and the cost settings of its PartitionSpec and dropped
    ``batch_axes`` and ``batching`` without a word: gru_stream placed with batching=False came
    back batching its requests, and a batch axis that does not fit the model was accepted. The
    plan keeps them as partition()'s plans do, and a misfit is refused before any work."""
    import realmodels
    from staronnx.contract import ContractError
    from staronnx.partition import PartitionSpec

    shapes = realmodels.input_shapes("gru_stream")
    off = place(realmodels.path("gru_stream"), PartitionSpec(method="comm-sd", costs="estimate", input_shapes=shapes,
                                                            batching=False), output_dir=tmp_path / "off",
                devices=host_devices(two_groups))
    assert not off.contract.batchable and "batching is off" in (off.contract.why_not or "")
    own = place(realmodels.path("gru_stream"), PartitionSpec(method="comm-sd", costs="estimate", input_shapes=shapes,
                                                            batch_axes={"sample_rate": None, "state": 1}),
                output_dir=tmp_path / "own", devices=host_devices(two_groups))
    assert own.contract.batchable and set(own.contract.overridden) == {"sample_rate", "state"}
    with pytest.raises(ContractError, match="fixed to 2"):
        place(realmodels.path("gru_stream"), PartitionSpec(method="comm-sd", costs="estimate", input_shapes=shapes,
                                                          batch_axes={"state": 0}), output_dir=tmp_path / "bad",
              devices=host_devices(two_groups))
    assert not (tmp_path / "bad").exists()
