"""Topology (real hwloc through pyhwloc) and CPU group policies, on synthetic and XML machines."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from staronnx.errors import StaronnxError
from staronnx.workers.groups import CpuGroups, GroupError, make_groups
from staronnx.workers.topology import Topology, TopologyError, format_pus

BIG = "pack:2 numa:2 core:8 pu:2"  # 2 packages x 2 NUMA x 8 cores x 2 PUs = 32 cores, 64 PUs


@pytest.fixture(scope="module")
def big() -> Topology:
    return Topology.from_synthetic(BIG)


# ------------------------------------------------------------------------- topology
def test_synthetic_structure(big: Topology) -> None:
    assert len(big.packages) == 2
    assert [n.os_index for n in big.numa_nodes] == [0, 1, 2, 3]
    assert big.n_cores == 32 and big.n_pus == 64
    assert big.allowed_pus == frozenset(range(64))
    assert big.cores[9].pus == (18, 19)
    assert big.cores[9].numa == 1 and big.cores[9].package == 0
    assert big.cores[31].numa == 3 and big.cores[31].package == 1
    assert big.packages[1].numa_nodes == (2, 3)
    assert big.numa_nodes[2].pus == tuple(range(32, 48))
    assert not big.is_this_system


def test_os_indexes_differ_from_logical() -> None:
    # Hyperthread siblings numbered far apart, as on many Intel servers.
    t = Topology.from_synthetic("pack:2 core:2 pu:2(indexes=0,4,1,5,2,6,3,7)")
    assert [c.pus for c in t.cores] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert t.core_of_pu(5).index == 1
    g = make_groups(t, "package")
    assert g[0].pus == (0, 4, 1, 5) and g[0].first_pu == 0
    # ORT wants 1-based ids, one ';' entry per extra thread: core 1 = PUs 1 and 5.
    assert g[0].ort_thread_affinities() == "2,6"


def test_topology_without_packages() -> None:
    t = Topology.from_synthetic("numa:2 core:2 pu:1")
    assert t.packages == () and {c.package for c in t.cores} == {None}
    assert [g.pus for g in make_groups(t, "package")] == [(0, 1, 2, 3)]
    assert [g.pus for g in make_groups(t, "numa")] == [(0, 1), (2, 3)]
    assert "NUMA node 1" in t.render()
    # PUs under no core still get one (pseudo-)core each, so every PU is in exactly one core.
    bare = Topology.from_synthetic("numa:2 pu:2")
    assert [c.pus for c in bare.cores] == [(0,), (1,), (2,), (3,)]
    assert [g.n_cores for g in make_groups(bare, "numa")] == [2, 2]


def test_system_topology_matches_affinity(tmp_path: Path) -> None:
    t = Topology.from_system()
    assert t.is_this_system
    assert t.allowed_pus == frozenset(os.sched_getaffinity(os.getpid()))
    assert t.n_cores >= 1 and len(t.numa_nodes) >= 1
    assert all(c.numa is not None for c in t.cores)
    assert Topology.from_xml(t.export_xml(tmp_path / "system.xml")) == t


def test_render_shows_the_tree_and_disallowed_pus(big: Topology) -> None:
    text = big.render()
    assert "Package 1" in text and "NUMA node 3" in text and "Core 31: PU 62 PU 63" in text
    restricted = big.with_allowed(range(4, 20)).render()
    assert "PU 3 (not allowed)" in restricted and "PU 4 " in restricted


def test_xml_round_trip_same_topology_and_groups(big: Topology, tmp_path) -> None:
    path = big.export_xml(tmp_path / "machine.xml")
    back = Topology.from_xml(path)
    assert back == big
    assert back.source.startswith("xml:")
    for policy in ("numa", "package", "cores=3", "0-3;4-7", "numa,reserve=2", "cores=5,reserve=3"):
        assert make_groups(back, policy) == make_groups(big, policy), policy


def test_xml_round_trip_keeps_allowed_restriction(big: Topology, tmp_path) -> None:
    restricted = big.with_allowed([*range(4, 20), 33])
    back = Topology.from_xml(restricted.export_xml(tmp_path / "r.xml"))
    assert back.allowed_pus == frozenset([*range(4, 20), 33])
    assert back == restricted and back != big
    assert make_groups(back, "numa") == make_groups(restricted, "numa")


def test_bad_sources_raise_topology_errors(tmp_path) -> None:
    with pytest.raises(TopologyError, match="synthetic topology 'bogus:3'"):
        Topology.from_synthetic("bogus:3")
    with pytest.raises(TopologyError, match="empty"):
        Topology.from_synthetic("  ")
    with pytest.raises(TopologyError, match="does not exist"):
        Topology.from_xml(tmp_path / "missing.xml")
    bad = tmp_path / "bad.xml"
    bad.write_text("<not a topology/>")
    with pytest.raises(TopologyError, match="cannot load the topology XML"):
        Topology.from_xml(bad)
    with pytest.raises(TopologyError, match="PU\\(s\\) 64-65 do not exist"):
        Topology.from_synthetic(BIG).with_allowed([0, 64, 65])
    assert issubclass(TopologyError, StaronnxError) and issubclass(TopologyError, ValueError)


def test_format_pus() -> None:
    assert format_pus([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert format_pus([]) == "none"
    assert format_pus([5]) == "5"


# ------------------------------------------------------------------------- groups
def test_numa_policy_is_the_default(big: Topology) -> None:
    groups = make_groups(big)
    assert groups == make_groups(big, "numa")
    assert len(groups) == 4
    for i, g in enumerate(groups):
        assert g.id == i and g.name == f"numa{i}"
        assert g.n_cores == 8 and len(g.pus) == 16
        assert g.numa_nodes == (i,) and g.numa == i
        assert g.package == i // 2
        assert g.first_pu == 16 * i
    assert groups.reserved == ()


def test_package_policy(big: Topology) -> None:
    groups = make_groups(big, "package")
    assert len(groups) == 2
    assert [g.numa_nodes for g in groups] == [(0, 1), (2, 3)]
    assert [g.n_cores for g in groups] == [16, 16]
    assert groups[1].pus == tuple(range(32, 64)) and groups[1].numa is None
    assert make_groups(big, "socket") == CpuGroups("socket", groups.groups)


def test_cores_policy_never_crosses_numa(big: Topology) -> None:
    groups = make_groups(big, "cores=3")
    # 8 cores per node: 3 + 3 + 2, the remainder as a smaller last group.
    assert [g.n_cores for g in groups] == [3, 3, 2] * 4
    assert all(len(g.numa_nodes) == 1 for g in groups)
    assert groups[2].name == "numa0.cores6-7"
    assert make_groups(big, "cores=1")[5].name == "numa0.core5"
    assert len(make_groups(big, "cores=100")) == 4  # as large as a node, never larger


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 10),
    allowed=st.sets(st.integers(0, 63), min_size=1),
    reserve=st.integers(0, 3),
)
def test_cores_policy_properties(size: int, allowed: set[int], reserve: int) -> None:
    topo = Topology.from_synthetic(BIG).with_allowed(allowed)
    usable = topo.allowed_cores()
    if reserve >= len(usable):
        with pytest.raises(GroupError, match="leaves no core"):
            make_groups(topo, f"cores={size},reserve={reserve}")
        return
    groups = make_groups(topo, f"cores={size},reserve={reserve}")
    seen = Counter(c for g in groups for c in g.cores)
    assert set(seen.values()) == {1}, "a core is in two groups"
    assert set(seen) | set(groups.reserved_cores) == {c.index for c in usable}
    assert not set(seen) & set(groups.reserved_cores)
    assert all(set(g.pus) <= allowed for g in groups)
    assert set(groups.reserved_pus) <= allowed
    per_node: Counter[int] = Counter()
    for g in groups:
        assert 1 <= g.n_cores <= size
        assert len(g.numa_nodes) == 1, "a group crosses a NUMA node"
        per_node[g.numa_nodes[0]] += g.n_cores < size
    assert all(n <= 1 for n in per_node.values()), "more than one short group in a node"


def test_explicit_lists(big: Topology) -> None:
    groups = make_groups(big, "0-3;4-7")
    assert [g.pus for g in groups] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [g.n_cores for g in groups] == [2, 2]
    assert groups[1].cores == (2, 3) and groups[1].ort_thread_affinities() == "7,8"
    # Order is the user's: the first PU written is the one the worker thread runs on.
    odd = make_groups(big, "9, 2-3 ; 40")
    assert odd[0].pus == (9, 2, 3) and odd[0].first_pu == 9 and odd[0].cores == (4, 1)
    assert odd[1].numa_nodes == (2,) and odd[1].package == 1
    # Hyperthreads of one core may go to different groups (a core counted in both).
    split = make_groups(big, "0;1")
    assert split[0].cores == split[1].cores == (0,)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("0-3;3-4", "PU 3 is in groups 0 and 1"),
        ("0-99", "PU 64 does not exist"),
        ("0,1,0", "PU 0 is listed twice"),
        ("7-4", "backwards"),
        ("0-3;;4", "group 1 .* is empty"),
        ("0-3;4-x", "unknown CPU group policy"),
        ("bogus", "unknown CPU group policy 'bogus'"),
        ("numa,package", "several base terms"),
        ("cores=0", "cores must be >= 1"),
        ("cores=two", "cores needs an integer"),
        ("numa,reserve=-1", "reserve needs an integer|reserve must be"),
        ("numa,reserve=1,reserve=2", "reserve= is given 2 times"),
        ("numa,reserve:1", "reserve=N"),
        ("numa,reserve=32", "reserve=32 leaves no core"),
        ("60-63,reserve=1", "PU 62 is reserved"),
    ],
)
def test_bad_policies_name_the_cause(big: Topology, policy: str, message: str) -> None:
    with pytest.raises(GroupError, match=message):
        make_groups(big, policy)


def test_group_error_is_a_staronnx_error() -> None:
    assert issubclass(GroupError, StaronnxError) and issubclass(GroupError, ValueError)


def test_explicit_pu_must_be_allowed(big: Topology) -> None:
    restricted = big.with_allowed(range(8))
    with pytest.raises(GroupError, match="PU 8 is not allowed"):
        make_groups(restricted, "0-3;4-8")


def test_reserve_takes_the_end_of_the_last_numa_node(big: Topology) -> None:
    groups = make_groups(big, "numa,reserve=1")
    assert [g.n_cores for g in groups] == [8, 8, 8, 7]
    assert groups.reserved == ((62, 63),) and groups.reserved_cores == (31,)
    assert groups.reserved_pus == (62, 63)
    spill = make_groups(big, "numa,reserve=9")  # the last node is too small: spill into node 2
    assert [g.n_cores for g in spill] == [8, 8, 7]
    assert spill.reserved_cores == tuple(range(23, 32))
    # reserve alone means the default policy plus the reserve.
    assert make_groups(big, "reserve=1") == CpuGroups("reserve=1", groups.groups, groups.reserved, (31,))
    with_list = make_groups(big, "0-3;4-7,reserve=2")
    assert len(with_list) == 2 and with_list.reserved_cores == (30, 31)
    pkg = make_groups(big, "package,reserve=2")
    assert [g.n_cores for g in pkg] == [16, 14]


def test_only_allowed_cores_are_used(big: Topology) -> None:
    restricted = big.with_allowed([*range(4, 20), 33])
    groups = make_groups(restricted, "numa")
    assert [g.pus for g in groups] == [tuple(range(4, 16)), (16, 17, 18, 19), (33,)]
    assert [g.n_cores for g in groups] == [6, 2, 1]
    # Core 16 keeps its allowed hyperthread only.
    assert groups[2].cores == (16,)
    assert make_groups(restricted, "numa,reserve=1").reserved == ((33,),)


# ------------------------------------------------------------------------- CLI
def _cli() -> typer.Typer:
    from staronnx.cli import topology_cmd

    app = typer.Typer()
    topology_cmd.register(app)

    @app.command("noop")  # a second command keeps typer from flattening 'topology' away
    def _noop() -> None: ...

    return app


def test_cli_topology_synthetic_with_groups() -> None:
    result = CliRunner().invoke(
        _cli(), ["topology", "--synthetic", BIG, "--groups", "cores=4,reserve=1"],
        env={"COLUMNS": "160"},
    )
    assert result.exit_code == 0, result.output
    assert "NUMA node 3" in result.output and "Core 31" in result.output
    assert "numa0.cores0-3" in result.output and "reserved" in result.output


def test_cli_topology_xml_and_export(big: Topology, tmp_path) -> None:
    xml = big.export_xml(tmp_path / "m.xml")
    out = tmp_path / "again.xml"
    result = CliRunner().invoke(
        _cli(), ["topology", "--xml", str(xml), "--groups", "package", "--export-xml", str(out)],
        env={"COLUMNS": "160"},
    )
    assert result.exit_code == 0, result.output
    assert "package1" in result.output
    assert Topology.from_xml(out) == big


@pytest.mark.parametrize("columns", [None, "80"])
def test_cli_topology_never_cuts_a_worker_name(columns) -> None:
    """The group and worker names are what --lane and --model-workers take: piped to a file (no
    terminal width) or on a narrow terminal they were cut to 'numa0.cor…'; they are laid out as
    every other command's tables are (200 wide on a pipe, folded rather than cut)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | ({"COLUMNS": columns} if columns else {})
    done = subprocess.run([sys.executable, "-m", "staronnx", "topology", "--synthetic", "pack:2 numa:2 core:16 pu:2",
                           "--groups", "cores=7", "--cuda-streams", "2", "--cuda-devices", "0,1"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    tables = done.stdout[done.stdout.index("CPU groups"):]
    assert "…" not in tables, tables
    if columns is None:
        assert "numa0.cores7-13" in tables and "cpu:numa1.cores30-31" in tables, tables


def test_cli_topology_exports_this_system(tmp_path) -> None:
    """--export-xml writes this machine's topology whether or not it has GPUs (a machine without
    one returned after saying so, and the file was never written)."""
    out = tmp_path / "here.xml"
    result = CliRunner().invoke(_cli(), ["topology", "--export-xml", str(out)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert f"topology written to {out}" in result.output.replace("\n", "")
    assert Topology.from_xml(out) == Topology.from_system()


def test_cli_topology_this_system() -> None:
    result = CliRunner().invoke(_cli(), ["topology"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "Machine (system)" in result.output and "numa" in result.output


def test_cli_errors_are_staronnx_errors(tmp_path) -> None:
    result = CliRunner().invoke(_cli(), ["topology", "--synthetic", BIG, "--groups", "bogus"])
    assert isinstance(result.exception, GroupError)
    result = CliRunner().invoke(
        _cli(), ["topology", "--synthetic", BIG, "--xml", str(tmp_path / "x.xml")]
    )
    assert isinstance(result.exception, StaronnxError)
    assert "not both" in str(result.exception)


def test_cli_registers_topology_command() -> None:
    import staronnx.cli as cli

    assert "topology_cmd" in cli._COMMAND_MODULES


def test_cli_topology_shows_the_workers_a_run_would_start_with_gpus() -> None:
    """``topology --cuda-streams 1 --cuda-devices 0-3`` on another machine's topology: the groups
    as the runtime makes them (a core held back per GPU driver thread) and every worker, each
    CUDA stream with its GPU's arch and memory node and the PU its driver runs on."""
    result = CliRunner().invoke(_cli(), ["topology", "--synthetic", BIG, "--cuda-streams", "1", "--cuda-devices",
                                         "0-3"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, (result.output, result.exception)
    assert "policy 'numa,reserve=4'" in result.output
    rows = {m.group(1): m.group(2) for m in re.finditer(r"│ (cuda\d\.s0) +│ cuda +│ cuda\d +│ cuda\d +│ ([^│]+)│",
                                                          result.output)}
    assert sorted(rows) == ["cuda0.s0", "cuda1.s0", "cuda2.s0", "cuda3.s0"], result.output
    pus = [int(re.search(r"PU (\d+)", v).group(1)) for v in rows.values()]
    assert len(set(pus)) == 4  # one core of its own per GPU's driver thread
    assert "cpu:numa0" in result.output
    # on this machine, the GPUs named must exist (here stood in for by HostRuntime)
    here = CliRunner().invoke(_cli(), ["topology", "--cuda-streams", "1", "--cuda-devices", "0,1"],
                              env={"COLUMNS": "200", "STARONNX_CUDA_RUNTIME": "host:2"})
    assert here.exit_code == 0 and "GPUs CUDA workers can use here: 2" in here.output, here.output
    assert here.output.count("HostRuntime (CPU stand-in") == 2  # a stand-in never reads as a GPU
    missing = CliRunner().invoke(_cli(), ["topology", "--cuda-streams", "1", "--cuda-devices", "0-2"],
                                 env={"STARONNX_CUDA_RUNTIME": "host:2"})
    assert "no GPU 2 here" in str(missing.exception)


def test_cli_topology_says_why_no_gpu_is_usable() -> None:
    from staronnx.workers.cuda import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is None:
        pytest.skip("CUDA is here")
    result = CliRunner().invoke(_cli(), ["topology"], env={"COLUMNS": "400", "STARONNX_CUDA_RUNTIME": ""})
    assert result.exit_code == 0 and "no GPU for CUDA workers here: " in result.output
    assert "staronnx[gpu]" in result.output  # printed as text, not read as rich markup
