"""Placement methods (comm-sd, duet, overseer, optimal, ort-static) on graphs with known answers,
and their plans on real models: acyclic, one device per part, and equal to the source model."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import staronnx
from staronnx import zoo
from staronnx.errors import DeviceError, PartitionError
from staronnx.partition.api import METHODS, partition
from staronnx.partition.methods import (
    Device,
    Problem,
    comm_sd,
    comm_sd_pass,
    duet,
    duet_subgraphs,
    group_parts,
    makespan,
    overseer,
    TransferModel,
    place,
)
from staronnx.partition.methods.coarsen import chain_units, coarsen
from staronnx.partition.methods.model import is_monotone, part_devices
from staronnx.partition.methods.optimal import optimal
from staronnx.perfmodels import BusModel, LinkCost, PerfModelStore
from staronnx.plan import Plan
from staronnx.verify import verify_plan
from staronnx.partition.host import cpu_group_sizes, host_devices, host_transfer

from realmodels import GOOGLENET
from staronnx.partition import PartitionSpec

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


# -- an independent, vectorised evaluation of the model (every assignment at once) -----------


def all_assignments(n: int, d: int) -> np.ndarray:
    return np.array(list(itertools.product(range(d), repeat=n)), dtype=np.int64)


def linear_extensions(preds: list[list[int]], n: int) -> list[list[int]]:
    out: list[list[int]] = []

    def rec(done: set[int], order: list[int]) -> None:
        if len(order) == n:
            out.append(list(order))
            return
        for v in range(n):
            if v not in done and all(u in done for u in preds[v]):
                done.add(v)
                order.append(v)
                rec(done, order)
                order.pop()
                done.discard(v)

    rec(set(), [])
    return out


def list_schedule_all(p: Problem, assigns: np.ndarray, order: list[int]) -> np.ndarray:
    """Makespan of every row of ``assigns`` when nodes are appended to their device in ``order``."""
    m = len(assigns)
    rows = np.arange(m)
    finish = np.zeros((m, p.n))
    free = np.zeros((m, p.d))
    for v in order:
        dv = assigns[:, v]
        ready = np.zeros(m)
        for u, nbytes in p.in_edges[v]:
            du = assigns[:, u]
            comm = np.where(du == dv, 0.0, p.lat[du, dv] + nbytes * p.per_byte[du, dv])
            ready = np.maximum(ready, finish[:, u] + comm)
        start = np.maximum(ready, free[rows, dv])
        finish[:, v] = start + p.cost[v, dv]
        free[rows, dv] = finish[:, v]
    return finish.max(axis=1)


def brute_force(p: Problem) -> tuple[float, np.ndarray]:
    """The model's exact optimum: every assignment, every topological order."""
    assigns = all_assignments(p.n, p.d)
    best = np.full(len(assigns), np.inf)
    for order in linear_extensions(p.preds, p.n):
        best = np.minimum(best, list_schedule_all(p, assigns, order))
    return float(best.min()), best


def exact_makespan(p: Problem, assign: np.ndarray) -> float:
    return min(makespan(p, assign, o) for o in linear_extensions(p.preds, p.n))


def random_problem(rng: np.random.Generator, n: int, d: int, max_fanin: int = 2) -> Problem:
    edges = []
    for v in range(1, n):
        k = int(rng.integers(1, max_fanin + 1))
        for u in rng.choice(v, size=min(v, k), replace=False):
            edges.append((int(u), v, float(rng.integers(0, 4000))))
    cost = rng.uniform(5, 100, (n, d))
    lat = rng.uniform(0, 20, (d, d)) * (1 - np.eye(d))
    per_byte = rng.uniform(0, 0.01, (d, d)) * (1 - np.eye(d))
    return Problem.from_edges(cost, edges, lat, per_byte)


def diamonds(rng: np.random.Generator, k: int, d: int = 2) -> Problem:
    """src -> (a, b) -> join, k times: 3k + 1 nodes, 2^k topological orders."""
    edges = []
    join = 0
    for i in range(k):
        a, b, nxt = 3 * i + 1, 3 * i + 2, 3 * i + 3
        for x in (a, b):
            edges.append((join, x, float(rng.integers(100, 3000))))
            edges.append((x, nxt, float(rng.integers(100, 3000))))
        join = nxt
    n = 3 * k + 1
    cost = rng.uniform(10, 60, (n, d))
    return Problem.from_edges(cost, edges, lat=5.0, per_byte=0.01)


def fanout(branches: int, depth: int, cost: float = 100.0, nbytes: float = 1000.0, d: int = 2) -> Problem:
    """One source, ``branches`` chains of ``depth`` nodes, one sink; identical devices."""
    edges, v = [], 1
    ends = []
    for _ in range(branches):
        prev = 0
        for _ in range(depth):
            edges.append((prev, v, nbytes))
            prev, v = v, v + 1
        ends.append(prev)
    for e in ends:
        edges.append((e, v, nbytes))
    n = v + 1
    return Problem.from_edges(np.full((n, d), cost), edges, lat=10.0, per_byte=0.001)


# -- OverSeer -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_overseer_on_a_chain_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, d = 8, 3
    edges = [(v, v + 1, float(rng.integers(0, 5000))) for v in range(n - 1)]
    cost = rng.uniform(1, 100, (n, d))
    lat = rng.uniform(0, 30, (d, d)) * (1 - np.eye(d))  # asymmetric links
    per_byte = rng.uniform(0, 0.02, (d, d)) * (1 - np.eye(d))
    p = Problem.from_edges(cost, edges, lat, per_byte)
    assigns = all_assignments(n, d)
    # on a chain the makespan is the sum of node times and transfers along it
    totals = cost[np.arange(n), assigns].sum(axis=1)
    for u, v, b in edges:
        du, dv = assigns[:, u], assigns[:, v]
        totals += np.where(du == dv, 0.0, lat[du, dv] + b * per_byte[du, dv])
    best = float(totals.min())
    result = overseer(p)
    assert makespan(p, result.devices) == pytest.approx(best, rel=1e-9)
    assert result.info["tree_cost_us"] == pytest.approx(best, rel=1e-9)
    assert float(list_schedule_all(p, assigns, list(range(n))).min()) == pytest.approx(best)


def test_overseer_keeps_the_critical_path_in_its_tree() -> None:
    from staronnx.partition.methods.heuristics import overseer_tree

    # 0 -> 1 -> 3 costly, 0 -> 2 -> 3 cheap: node 3 must hang under 1
    p = Problem.from_edges([[1, 1], [50, 50], [2, 2], [1, 1]], [(0, 1, 0), (0, 2, 0), (1, 3, 0), (2, 3, 0)])
    assert overseer_tree(p) == [-1, 0, 0, 1]


# -- the MILP ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda rng: diamonds(rng, 3),  # 10 nodes, 2 devices
        lambda rng: diamonds(rng, 4),  # 13 -> trimmed below to 12
        lambda rng: random_problem(rng, 7, 2, max_fanin=2),
        lambda rng: random_problem(rng, 6, 3, max_fanin=3),
    ],
)
@pytest.mark.parametrize("seed", range(2))
def test_optimal_equals_brute_force(build, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    p = build(rng)
    if p.n > 12:  # keep the graph at 12 nodes: drop the last join
        keep = 12
        p = Problem.from_edges(p.cost[:keep], [(u, v, b) for u, v, b in p.edges if v < keep], p.lat, p.per_byte)
    best, _ = brute_force(p)
    result = optimal(p, time_limit=20)
    assert result.info["proven_optimal"], result.info
    assert result.info["objective_us"] == pytest.approx(best, rel=1e-5)
    assert exact_makespan(p, result.devices) == pytest.approx(best, rel=1e-6)
    # the solver's own start order, list-scheduled, reproduces the optimum
    assert makespan(p, result.devices, result.orders[0]) == pytest.approx(best, rel=1e-6)


def test_optimal_refuses_large_graphs_and_reports_the_gap_when_stopped() -> None:
    rng = np.random.default_rng(7)
    with pytest.raises(PartitionError, match="limited to 10 nodes"):
        optimal(random_problem(rng, 11, 2), max_nodes=10)
    # 28 independent jobs on 2 machines: hard to prove optimal in a fraction of a second
    n = 28
    p = Problem.from_edges(rng.uniform(10, 1000, (n, 2)), [])
    result = optimal(p, time_limit=0.3)
    info = result.info
    assert info["seconds"] < 10
    assert info["proven_optimal"] or (info["status"] == "Time limit reached" and info["gap"] > 0)
    assert info["bound_us"] <= info["objective_us"] + 1e-6
    assert makespan(p, result.devices, result.orders[0]) <= info["objective_us"] * (1 + 1e-6)


def test_chain_units_contract_series_chains_only() -> None:
    # 0 -> 1 -> 2 -> (3, 4); 3 -> 5; 4 -> 6 -> 7; (5, 7) -> 8 -> 9
    edges = [(0, 1, 1.0), (1, 2, 1.0), (2, 3, 1.0), (2, 4, 1.0), (3, 5, 1.0), (4, 6, 1.0), (6, 7, 1.0),
             (5, 8, 1.0), (7, 8, 1.0), (8, 9, 1.0)]
    p = Problem.from_edges(np.ones((10, 2)), edges)
    units = chain_units(p)
    groups = [sorted(np.flatnonzero(units == u).tolist()) for u in range(int(units.max()) + 1)]
    assert groups == [[0, 1, 2], [3, 5], [4, 6, 7], [8, 9]]
    assert is_monotone(p, units)
    c = coarsen(p, 4)
    assert c is not None and c.level == "chains" and c.k == 4
    assert c.problem.cost[:, 0].tolist() == [3.0, 2.0, 3.0, 2.0]
    assert c.expand(np.array([0, 1, 0, 1])).tolist() == [0, 0, 0, 1, 0, 1, 0, 0, 1, 1]
    order = c.expand_order([0, 2, 1, 3])
    assert sorted(order) == list(range(10))
    assert all(order.index(u) < order.index(v) for u, v, _ in p.edges)
    assert coarsen(p, 10).level == "nodes" and coarsen(p, 1) is None


@pytest.mark.parametrize("seed", range(3))
def test_coarsened_optimal_equals_brute_force_over_units(seed: int) -> None:
    # three 3-node chains in parallel between a source and a sink: 11 nodes, 5 units
    rng = np.random.default_rng(seed)
    edges = []
    v = 1
    for _ in range(3):
        prev = 0
        for _ in range(3):
            edges.append((prev, v, float(rng.integers(100, 3000))))
            prev, v = v, v + 1
        edges.append((prev, 10, float(rng.integers(100, 3000))))
    p = Problem.from_edges(rng.uniform(10, 100, (11, 2)), edges, lat=5.0, per_byte=0.01)
    c = coarsen(p, 6)
    assert c is not None and c.level == "chains" and c.k == 5
    result = optimal(c.problem)
    best, _ = brute_force(c.problem)
    assert result.info["proven_optimal"]
    assert result.info["objective_us"] == pytest.approx(best, rel=1e-6)
    # expanded to nodes, the unit-level schedule is reproduced by the node-level model
    nodes = c.expand(result.devices)
    assert makespan(p, nodes, c.expand_order(result.orders[0])) == pytest.approx(best, rel=1e-6)


def test_switch_cost_stops_splits_that_cost_more_than_they_buy() -> None:
    # a source, two 30 µs branches, a sink, on two identical devices with free transfers:
    # running the branches in parallel saves 30 µs, but a second part costs 100 µs more
    edges = [(0, 1, 10.0), (0, 2, 10.0), (1, 3, 10.0), (2, 3, 10.0)]
    p = Problem.from_edges(np.full((4, 2), 30.0), edges)
    split = optimal(p)
    assert split.info["objective_us"] == pytest.approx(90.0) and len(set(split.devices.tolist())) == 2
    charged = p.with_switch_cost(100.0)
    assert charged.comm(10.0, 0, 1) == pytest.approx(100.0) and charged.comm(10.0, 1, 1) == 0.0
    for method in (lambda q: optimal(q), comm_sd, duet, overseer):
        assert len(set(method(charged).devices.tolist())) == 1
    assert p.with_switch_cost(0.0) is p


def test_methods_decide_with_the_part_cost_unless_told_not_to(tmp_path: Path, two_groups) -> None:
    model = zoo.wide_and_deep()
    charged = place(model, PartitionSpec(method="optimal", costs="estimate"), output_dir=tmp_path / "a",
                    devices=host_devices(two_groups), options={"time_limit_s": 3.0})
    published = place(model, PartitionSpec(method="optimal", costs="estimate"), output_dir=tmp_path / "b",
                      devices=host_devices(two_groups), options={"time_limit_s": 3.0, "charge_parts": False})
    pa = charged.settings["placement"]["predicted_makespan_us"]["1"]
    pb = published.settings["placement"]["predicted_makespan_us"]["1"]
    assert charged.k <= published.k and pa <= pb * (1 + 1e-9)


# -- SIR+ Comm+SD ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_comm_sd_reaches_a_fixed_point(seed: int) -> None:
    rng = np.random.default_rng(seed)
    p = random_problem(rng, 25, 2, max_fanin=3)
    for alpha in (0.0, 10.0, 100.0):
        result = comm_sd(p, alpha=alpha)
        assert result.info["converged"]
        again, moves = comm_sd_pass(p, result.devices, alpha)
        assert moves == 0 and np.array_equal(again, result.devices)
        assert result.info["moves_per_sweep"][-1] == 0


def test_comm_sd_respects_alpha() -> None:
    p = fanout(branches=6, depth=3, cost=100.0)
    # identical devices: everything starts on device 0 (its fastest, ties to the lowest index)
    assert np.all(comm_sd(p, alpha=1e9).devices == 0)
    offloaded = comm_sd(p, alpha=0.0).devices
    assert 0 < int(offloaded.sum()) < p.n  # queueing on device 0 beats transfers: branches move
    assert makespan(p, offloaded) < makespan(p, np.zeros(p.n, dtype=np.int64))
    # a move must save more than alpha: a saving of one node's time (100 µs) is not enough
    # when alpha is larger than any saving the graph offers
    total = float(p.cost[:, 0].sum())
    assert np.all(comm_sd(p, alpha=total).devices == 0)
    with pytest.raises(ValueError):
        comm_sd(p, alpha=-1.0)


def test_comm_sd_keeps_nodes_on_a_much_faster_device() -> None:
    p = fanout(branches=4, depth=2)
    p = Problem.from_edges(np.column_stack([p.cost[:, 0], p.cost[:, 1] * 20]), p.edges, lat=10.0, per_byte=0.001)
    assert np.all(comm_sd(p).devices == 0)


# -- DUET -----------------------------------------------------------------------------------------


def test_duet_subgraphs_follow_the_phases() -> None:
    p = fanout(branches=3, depth=2)  # 0 | (1,2) (3,4) (5,6) | 7
    groups = duet_subgraphs(p)
    assert sorted(v for g in groups for v in g) == list(range(p.n))
    assert groups == [[0], [1, 2], [3, 4], [5, 6], [7]]
    chain = Problem.from_edges(np.ones((4, 2)), [(0, 1, 0), (1, 2, 0), (2, 3, 0)])
    assert duet_subgraphs(chain) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("seed", range(6))
def test_duet_correction_never_increases_predicted_latency(seed: int) -> None:
    rng = np.random.default_rng(seed)
    p = random_problem(rng, 30, 2 + seed % 2, max_fanin=2)
    result = duet(p)
    info = result.info
    assert info["latency_corrected_us"] <= info["latency_greedy_us"] + 1e-9
    assert makespan(p, result.devices) == pytest.approx(info["latency_corrected_us"])
    # every subgraph stays whole on one device
    for grp in duet_subgraphs(p):
        assert len({int(result.devices[v]) for v in grp}) == 1


def test_duet_balances_a_fan_out_on_identical_devices() -> None:
    p = fanout(branches=4, depth=3, cost=100.0)
    result = duet(p)
    assert makespan(p, result.devices) < makespan(p, np.zeros(p.n, dtype=np.int64))


# -- from devices to parts ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_parts_are_acyclic_and_single_device(seed: int) -> None:
    rng = np.random.default_rng(seed)
    p = random_problem(rng, 40, 3, max_fanin=3)
    assign = rng.integers(0, 3, p.n)
    ranks = group_parts(p, assign, overhead=20.0)
    assert is_monotone(p, ranks)
    assert sorted(set(ranks.tolist())) == list(range(int(ranks.max()) + 1))
    part_devices(ranks, assign)  # raises if a part mixes devices


def test_parts_merge_fan_out_branches() -> None:
    p = fanout(branches=8, depth=2, cost=100.0)
    assign = np.zeros(p.n, dtype=np.int64)
    assign[1:9] = 1  # first four branches on device 1
    ranks = group_parts(p, assign, overhead=50.0)
    assert int(ranks.max()) + 1 <= 4  # not a part per node or per branch
    assert is_monotone(p, ranks)
    assert np.all(ranks[np.flatnonzero(assign == 1)] == ranks[1])


# -- plans on real models -------------------------------------------------------------------------


ZOO_MODELS = {
    "multi_head_detector": zoo.multi_head_detector,
    "wide_and_deep": zoo.wide_and_deep,
    "wide_fanout": zoo.wide_fanout,
}
FAST_OPTIONS = {"optimal": {"time_limit_s": 3.0}}


def _check_plan(plan: Plan, model, method: str) -> None:
    assert plan.settings["method"] == method
    placed = plan.settings["placement"]
    assert set(placed["predicted_makespan_us"]) == {"1", "8"}
    assert all(v > 0 for v in placed["predicted_makespan_us"].values())
    assert [p.device for p in plan.parts] == placed["part_devices"]
    deps = plan.dependencies()
    assert all(all(d < i for d in deps[i]) for i in range(plan.k))  # parts in a DAG order
    report = verify_plan(plan, model)
    assert report.ok, [(o.name, o.max_rel) for o in report.outputs]


@pytest.mark.parametrize("name", sorted(ZOO_MODELS))
@pytest.mark.parametrize("method", ["comm-sd", "duet", "overseer", "optimal"])
def test_zoo_plans_verify(name: str, method: str, tmp_path: Path, two_groups) -> None:
    model = ZOO_MODELS[name]()
    options = dict(FAST_OPTIONS.get(method, {}))
    if method == "optimal" and name == "wide_fanout":
        with pytest.raises(PartitionError, match="limited to 60 nodes"):
            place(model, PartitionSpec(method=method, costs="estimate"), output_dir=tmp_path / "plan",
                  devices=host_devices(two_groups), options={"coarsen": "off"})
        options["time_limit_s"] = 2.0
    plan = place(model, PartitionSpec(method=method, costs="estimate"), output_dir=tmp_path / "plan",
                 devices=host_devices(two_groups), options=options)
    _check_plan(plan, model, method)


@pytest.mark.parametrize("method", ["comm-sd", "duet", "overseer"])
def test_googlenet_plans_verify(method: str, tmp_path: Path, two_groups) -> None:
    plan = place(GOOGLENET, PartitionSpec(method=method, costs="estimate"), output_dir=tmp_path / "plan",
                 devices=host_devices(two_groups))
    _check_plan(plan, GOOGLENET, method)


def test_googlenet_optimal_solves_over_chains_and_refuses_clearly_without(tmp_path: Path, two_groups) -> None:
    plan = place(GOOGLENET, PartitionSpec(method="optimal", costs="estimate"), output_dir=tmp_path / "plan",
                 devices=host_devices(two_groups))
    _check_plan(plan, GOOGLENET, "optimal")
    info = plan.settings["placement"]["info"]
    assert info["coarsened"] == "chains" and info["nodes"] == 139 and info["units"] <= 60
    assert "series chain" in info["optimal_among"]
    with pytest.raises(PartitionError, match="limited to 60 nodes and this graph has 139"):
        place(GOOGLENET, PartitionSpec(method="optimal", costs="estimate"), output_dir=tmp_path / "plan2",
              options={"coarsen": "off"}, devices=host_devices())
    with pytest.raises(PartitionError, match="coarsen must be"):
        place(GOOGLENET, PartitionSpec(method="optimal", costs="estimate"), output_dir=tmp_path / "plan3",
              options={"coarsen": "yes"}, devices=host_devices())


def test_partition_api_records_devices_and_predictions(tmp_path: Path) -> None:
    assert {"metis", "linear", "comm-sd", "duet", "overseer", "optimal", "ort-static"} <= set(METHODS)
    model = zoo.multi_head_detector()
    # through the public door: it places on this host's groups
    plan = staronnx.partition(model, spec=PartitionSpec(method="duet", costs="estimate"), output_dir=tmp_path / "plan")
    _check_plan(plan, model, "duet")
    data = json.loads((plan.root / "plan.json").read_text())
    assert all("device" in p for p in data["parts"])
    assert plan.settings["placement"]["devices"][0]["kind"] == "cpu"
    # shares-based methods are unchanged: no device, no placement record
    metis = partition(model, [0.85, 0.15], PartitionSpec(costs="estimate"), output_dir=tmp_path / "metis")
    assert metis.k == 2 and all(p.device is None for p in metis.parts)
    assert "placement" not in metis.settings


def test_placement_takes_the_machine_typed_and_prices_transfers_with_a_bus_model(tmp_path: Path) -> None:
    # a placement method places on the devices it is given and prices transfers with any bus
    # model (here perfmodels' own), whatever host runs the test (staronnx.partition() gives it
    # this host's, tested below)
    two_nodes = [Device("cpu:a", "cpu", "numa0", 1), Device("cpu:b", "cpu", "numa1", 1)]
    model = zoo.multi_head_detector()

    def bus(bandwidth: float) -> TransferModel:
        model = BusModel()
        for src, dst in (("numa0", "numa1"), ("numa1", "numa0")):
            model.set(src, dst, LinkCost(latency=1e-6, bandwidth=bandwidth))
        return TransferModel(bus=model)

    # transfers cost next to nothing: both groups work; 1 kB/s between the nodes: never worth crossing
    fast = place(model, PartitionSpec(method="duet", costs="estimate"), output_dir=tmp_path / "fast", devices=two_nodes,
                 transfer=bus(1e12))
    slow = place(model, PartitionSpec(method="duet", costs="estimate"), output_dir=tmp_path / "slow", devices=two_nodes,
                 transfer=bus(1e3))
    assert {p.device for p in fast.parts} == {"cpu:a", "cpu:b"}
    assert [d["name"] for d in fast.settings["placement"]["devices"]] == ["cpu:a", "cpu:b"]
    assert len({p.device for p in slow.parts}) == 1
    # a group policy names this machine's groups, which only the doors read
    with pytest.raises(PartitionError, match="host_devices"):
        place(model, PartitionSpec(method="duet", costs="estimate"), output_dir=tmp_path / "policy", devices="cores=1")


def test_the_host_door_reads_groups_and_the_stored_bus(tmp_path: Path, two_groups: str, monkeypatch) -> None:
    # what staronnx.partition() hands partition: CPU groups named like the workers the runtime
    # starts, their cores, and the bus model this host's store holds (none: default links)
    pus = two_groups.split(";")
    devices = host_devices(two_groups, cuda=True)
    assert [(d.name, d.kind, d.cores) for d in devices] == [
        (f"cpu:pus{pus[0]}", "cpu", 1), (f"cpu:pus{pus[1]}", "cpu", 1), ("cuda0", "cuda", 1)]
    assert all(d.memory.startswith("numa") for d in devices[:2]) and devices[2].memory == "cuda0"
    assert cpu_group_sizes(two_groups, 0) == [1, 1]
    monkeypatch.setenv("STARONNX_HOME", str(tmp_path / "home"))
    assert host_transfer().bus is None
    bus = BusModel()
    bus.set("numa0", "numa1", LinkCost(latency=1e-3, bandwidth=1e6))
    PerfModelStore().save_bus(bus)
    a, b = Device("cpu:a", "cpu", "numa0", 1), Device("cpu:b", "cpu", "numa1", 1)
    assert host_transfer().link(a, b) == pytest.approx((1e-3, 1e-6))


def test_plans_without_device_field_still_load(tmp_path: Path) -> None:
    model = zoo.chain()
    plan = partition(model, spec=PartitionSpec(parts=2, costs="estimate"), output_dir=tmp_path / "plan")
    meta = plan.root / "plan.json"
    data = json.loads(meta.read_text())
    for p in data["parts"]:
        p.pop("device", None)
    meta.write_text(json.dumps(data))
    assert [p.device for p in Plan.load(plan.root).parts] == [None, None]


def test_what_if_gpu_costs_move_work_to_the_gpu(tmp_path: Path) -> None:
    model = zoo.multi_head_detector()
    devices = [Device("cpu:g0", "cpu", "numa0", 1), Device("cuda0", "cuda", "cuda0", 1)]
    fast_gpu = place(model, PartitionSpec(method="overseer", costs="estimate"), output_dir=tmp_path / "a",
                     devices=devices, device_costs={"cuda0": 0.05})
    assert [p.device for p in fast_gpu.parts] == ["cuda0"]
    slow_gpu = place(model, PartitionSpec(method="overseer", costs="estimate"), output_dir=tmp_path / "b",
                     devices=devices, device_costs={"cuda0": {"*": 20.0}})
    assert [p.device for p in slow_gpu.parts] == ["cpu:g0"]
    # Comm+SD still overflows a few light nodes to a slow GPU when the CPU queue is long (SIR+'s
    # point), but keeps the bulk of the work on the CPU
    sd = place(model, PartitionSpec(method="comm-sd", costs="estimate"), output_dir=tmp_path / "sd", devices=devices,
               device_costs={"cuda0": {"*": 20.0}})
    per_device = sd.settings["placement"]["nodes_per_device"]
    assert per_device["cpu:g0"] > per_device["cuda0"]
    # per-op factors: only convolutions are fast on the "GPU"; the predictions use them
    mixed = place(model, PartitionSpec(method="optimal", costs="estimate"), output_dir=tmp_path / "c", devices=devices,
                  device_costs={"cuda0": {"Conv": 0.01, "*": 5.0}}, options={"time_limit_s": 5.0})
    assert "cuda0" in {p.device for p in mixed.parts}
    assert verify_plan(mixed, model).ok
    with pytest.raises(PartitionError, match="unknown device"):
        place(model, PartitionSpec(method="duet", costs="estimate"), devices=devices, device_costs={"tpu0": 1.0})


def test_placement_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(PartitionError, match="no option"):
        place(zoo.chain(), PartitionSpec(method="comm-sd", costs="estimate"), options={"alpha": 5},
              devices=host_devices())
    plan = place(zoo.chain(), PartitionSpec(method="comm-sd", costs="estimate"), output_dir=tmp_path / "p",
                 options={"alpha_us": 0.0}, devices=host_devices())
    assert plan.settings["placement"]["info"]["alpha_us"] == 0.0


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA: ort-static runs instead of failing")
def test_ort_static_names_the_missing_cuda_provider(tmp_path: Path) -> None:
    with pytest.raises(DeviceError, match="CUDAExecutionProvider"):
        place(zoo.chain(), PartitionSpec(method="ort-static", costs="estimate"), output_dir=tmp_path / "p",
              devices=host_devices())


@pytest.mark.skipif(not HAS_CUDA, reason="needs ONNX Runtime's CUDA provider")
def test_ort_static_on_a_gpu(tmp_path: Path, two_groups) -> None:
    model = zoo.multi_head_detector()
    plan = place(model, PartitionSpec(method="ort-static", costs="profile"), output_dir=tmp_path / "p",
                 devices=host_devices(two_groups, cuda=True))
    assert "cuda0" in {p.device for p in plan.parts}
    assert verify_plan(plan, model).ok


def test_cli_partition_with_a_placement_method(tmp_path: Path, capsys) -> None:
    import onnx

    from staronnx.cli import main

    def cli(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        out, err = capsys.readouterr()
        return code, out + err

    model = tmp_path / "detector.onnx"
    onnx.save(zoo.multi_head_detector(), str(model))
    code, out = cli("partition", model, "-o", tmp_path / "plan", "--method", "overseer", "--costs", "estimate")
    assert code == 0, out
    plan = Plan.load(tmp_path / "plan")
    assert plan.settings["method"] == "overseer" and all(p.device for p in plan.parts)
    code, out = cli("plan", "verify", tmp_path / "plan", "--model", model)
    assert code == 0 and "OK" in out
    if not HAS_CUDA:
        code, out = cli("partition", model, "-o", tmp_path / "p2", "--method", "ort-static", "--costs", "estimate")
        assert code == 2 and "CUDAExecutionProvider" in out
        assert not (tmp_path / "p2" / "plan.json").exists()
