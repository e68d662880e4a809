"""SIR+'s MILP: the placement and schedule of minimum makespan, solved with HiGHS.

Variables: ``x[v,d]`` (node v on device d, binary), ``s[v]`` (start, µs), ``C`` (makespan),
``z[e,d1,d2]`` (edge e goes from d1 to d2, d1 != d2, continuous in [0, 1], forced up by
``z >= x[u,d1] + x[v,d2] - 1``) and ``o[u,v]`` (u before v, binary) for every pair of nodes
that no path orders. Constraints:

* placement: sum_d x[v,d] = 1;
* precedence with transfer times: s[v] >= s[u] + sum_d f(u,d) x[u,d] + sum g(e,d1,d2) z[e,d1,d2];
* no overlap per device (big-M disjunction on o, active only when both sit on d):
  s[v] >= s[u] + f(u,d) - M (1 - o[u,v]) - M (2 - x[u,d] - x[v,d]), and the converse;
* C >= s[v] + sum_d f(v,d) x[v,d]; minimise C.

This is exactly the model :func:`~staronnx.partition.methods.model.schedule` evaluates (so the
optimum equals brute force over assignments and list-schedule orders). The best heuristic
schedule seeds the solver and bounds M. The number of ordering binaries grows with the square
of the node count, so graphs above ``max_nodes`` are refused; a time limit stops the search
early, and the report says how far from proven optimal it stopped (the MIP gap).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import numpy as np

from staronnx.errors import PartitionError
from staronnx.partition.methods.heuristics import Assignment
from staronnx.partition.graph import priority_topological
from staronnx.partition.methods.model import Problem, reachable, schedule

#: Largest graph the MILP accepts by default (nodes), and its default time limit (s).
MAX_NODES = 60
TIME_LIMIT = 30.0


def optimal(
    problem: Problem,
    *,
    time_limit: float = TIME_LIMIT,
    max_nodes: int = MAX_NODES,
    warm_starts: Sequence[np.ndarray] = (),
    mip_gap: float = 1e-6,
    threads: int | None = None,
) -> Assignment:
    """Solve the MILP; ``warm_starts`` are assignments whose list schedules seed the search."""
    import highspy

    from staronnx.partition.cquiet import c_stdout_captured, highs_line

    n, d = problem.n, problem.d
    if n > max_nodes:
        raise PartitionError(
            f"the optimal (MILP) placement is limited to {max_nodes} nodes and this graph has {n}: "
            "its ordering variables grow as n^2; use comm-sd, duet or overseer, or raise max_nodes"
        )
    cost = problem.cost
    reach = reachable(problem.succs, range(n))
    independent = [
        (u, v) for u in range(n) for v in range(u + 1, n) if not (reach[u] >> v) & 1 and not (reach[v] >> u) & 1
    ]
    # an upper bound: the best warm start, or everything on its fastest device in series
    starts = [np.asarray(a, dtype=np.int64) for a in warm_starts] + [problem.fastest(), np.zeros(n, dtype=np.int64)]
    scheds = [(schedule(problem, a), a) for a in starts]
    incumbent, inc_assign = min(scheds, key=lambda t: t[0].makespan)
    ub = float(incumbent.makespan)
    big_m = ub + float(cost.max()) + 1.0

    # -- columns ----------------------------------------------------------------------------
    col_lo: list[float] = []
    col_hi: list[float] = []
    col_cost: list[float] = []
    integer: list[int] = []

    def new_col(lo: float, hi: float, c: float = 0.0, is_int: bool = False) -> int:
        col_lo.append(lo)
        col_hi.append(hi)
        col_cost.append(c)
        integer.append(1 if is_int else 0)
        return len(col_lo) - 1

    x = [[new_col(0, 1, is_int=True) for _ in range(d)] for _ in range(n)]
    s = [new_col(0, ub) for _ in range(n)]
    c_max = new_col(0, ub, 1.0)
    z: dict[tuple[int, int, int], int] = {}
    edge_comm: dict[tuple[int, int], np.ndarray] = {}
    for u, v, nbytes in problem.edges:
        table = np.array(problem.comm_table(nbytes))
        edge_comm[(u, v)] = table
        for d1 in range(d):
            for d2 in range(d):
                if d1 != d2 and table[d1, d2] > 0:
                    z[(u * n + v, d1, d2)] = new_col(0, 1)
    o = {pair: new_col(0, 1, is_int=True) for pair in independent}

    # -- rows -------------------------------------------------------------------------------
    starts_idx: list[int] = [0]
    index: list[int] = []
    value: list[float] = []
    row_lo: list[float] = []
    row_hi: list[float] = []
    inf = highspy.kHighsInf

    def row(terms: dict[int, float], lo: float, hi: float) -> None:
        for col, coef in terms.items():
            if coef != 0.0:
                index.append(col)
                value.append(coef)
        starts_idx.append(len(index))
        row_lo.append(lo)
        row_hi.append(hi)

    for v in range(n):
        row({x[v][dd]: 1.0 for dd in range(d)}, 1.0, 1.0)
        terms = {c_max: 1.0, s[v]: -1.0}
        for dd in range(d):
            terms[x[v][dd]] = -float(cost[v, dd])
        row(terms, 0.0, inf)
    for u, v, _ in problem.edges:
        terms = {s[v]: 1.0, s[u]: -1.0}
        for dd in range(d):
            terms[x[u][dd]] = -float(cost[u, dd])
        table = edge_comm[(u, v)]
        for d1 in range(d):
            for d2 in range(d):
                col = z.get((u * n + v, d1, d2))
                if col is not None:
                    terms[col] = -float(table[d1, d2])
                    row({col: 1.0, x[u][d1]: -1.0, x[v][d2]: -1.0}, -1.0, inf)
        row(terms, 0.0, inf)
    for (u, v), ouv in o.items():
        for dd in range(d):
            # v after u when o = 1 and both on dd
            row({s[v]: 1.0, s[u]: -1.0, ouv: -big_m, x[u][dd]: -big_m, x[v][dd]: -big_m},
                float(cost[u, dd]) - 3 * big_m, inf)
            # u after v when o = 0 and both on dd
            row({s[u]: 1.0, s[v]: -1.0, ouv: big_m, x[u][dd]: -big_m, x[v][dd]: -big_m},
                float(cost[v, dd]) - 2 * big_m, inf)

    lp = highspy.HighsLp()
    lp.num_col_ = len(col_lo)
    lp.num_row_ = len(row_lo)
    lp.col_cost_ = np.array(col_cost)
    lp.col_lower_ = np.array(col_lo)
    lp.col_upper_ = np.array(col_hi)
    lp.row_lower_ = np.array(row_lo)
    lp.row_upper_ = np.array(row_hi)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.array(starts_idx, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(value)
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in integer]

    # HiGHS prints its banner to descriptor 1 when a solver is made, before output_flag can be
    # cleared: kept out of the command's output
    with c_stdout_captured(highs_line):
        h = highspy.Highs()  # type: ignore[no-untyped-call]  # highspy's Highs() has no annotations
        h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    h.setOptionValue("random_seed", 0)
    if threads is not None:
        h.setOptionValue("threads", int(threads))
    h.passModel(lp)

    # warm start from the incumbent's list schedule
    sol = np.zeros(len(col_lo))
    for v in range(n):
        sol[x[v][int(inc_assign[v])]] = 1.0
        sol[s[v]] = float(incumbent.start[v])
    sol[c_max] = ub
    for (key, col) in z.items():
        e, d1, d2 = key
        u, v = divmod(e, n)
        sol[col] = 1.0 if (inc_assign[u] == d1 and inc_assign[v] == d2) else 0.0
    for (u, v), col in o.items():
        sol[col] = 1.0 if incumbent.start[u] <= incumbent.start[v] else 0.0
    hsol = highspy.HighsSolution()
    hsol.col_value = sol.tolist()
    with contextlib.suppress(Exception):  # a warm start is only a hint
        h.setSolution(hsol)

    began = time.perf_counter()
    with c_stdout_captured(highs_line):
        h.run()
    elapsed = time.perf_counter() - began
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    values = np.asarray(h.getSolution().col_value)
    if values.size != len(col_lo) or not np.isfinite(info.objective_function_value):
        assign, starts_v, objective = inc_assign, incumbent.start, ub
    else:
        assign = np.array([int(np.argmax([values[x[v][dd]] for dd in range(d)])) for v in range(n)])
        starts_v = values[s]
        objective = float(info.objective_function_value)
    bound = float(info.mip_dual_bound)
    gap = float(info.mip_gap) if np.isfinite(info.mip_gap) else float("nan")
    proven = status == "Optimal"
    order = sorted(range(n), key=lambda v: (starts_v[v], v))
    # the start order is topological up to float ties: repair with a stable topological sort
    pos = {v: i for i, v in enumerate(order)}
    order = priority_topological(problem.preds, problem.succs, [pos[v] for v in range(n)])
    return Assignment(
        np.asarray(assign, dtype=np.int64),
        {
            "status": status,
            "proven_optimal": proven,
            "objective_us": objective,
            "bound_us": bound,
            "gap": gap if not proven else 0.0,
            "seconds": round(elapsed, 3),
            "time_limit_s": time_limit,
            "columns": len(col_lo),
            "rows": len(row_lo),
            "ordering_pairs": len(independent),
        },
        orders=[order],
    )
