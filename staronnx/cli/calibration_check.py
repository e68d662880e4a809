"""One warning line when a command's workers have no calibrated perf model for a part.

Why: perf models are kept per (part, arch), and the arch names a worker's kind and width
(``cpu1``, ``cpu2``, ``cuda0``). A plan calibrated with ``--groups numa`` on a 2-core machine
has ``cpu2`` models, which a run with ``--groups cores=1`` (``cpu1`` workers) never reads: the
dm policies then explore, the simulator borrows another width's times, and a sweep's bound
column shows ``-``, with the reason only inside ``results.json``. The user reads the terminal,
so the commands that lean on the models (``run``, ``sweep``, ``simulate``, ``optimize-batch``)
say it there, once per command and not per task, with the command that fixes it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from staronnx.workers.layout import MachineSpec

#: policies that never ask for a prediction: their runs need no model, so no warning
MODEL_FREE_POLICIES = frozenset({"eager", "ws", "lws", "static"})


def uncalibrated(plan: Any, archs: Iterable[str], store: Any) -> dict[str, list[int]]:
    """Per arch, the parts whose model has no calibrated entry at any batch size.

    A model calibrated at some batch sizes but not at the one served still predicts (from
    its batch-size regression) or explores a little; a part with nothing calibrated on an arch
    is what leaves a whole run uninformed, so that is what is reported.
    """
    calibrated = {(row.part, row.arch) for row in store.rows(plan.hash) if row.calibrated}
    missing = {arch: [p for p in range(plan.k) if (p, arch) not in calibrated] for arch in archs}
    return {arch: parts for arch, parts in missing.items() if parts}


def warn_uncalibrated(plandir: str | Path, plan: Any, machine: MachineSpec, *, skip_archs: Sequence[str] = (),
                      store: Any = None) -> str | None:
    """Print one ``staronnx: warning: no calibrated model for ...`` line on stderr when the
    workers ``machine`` starts lack models for some parts; return it (None when all is
    calibrated). ``skip_archs``: archs whose times come from elsewhere on purpose (a what-if
    GPU scaled from the CPU's models)."""
    from staronnx.bench.machine import sim_workers
    from staronnx.perfmodels.store import calibrate_line
    from staronnx.perfmodels.store import PerfModelStore

    store = store if store is not None else PerfModelStore()
    # the archs of the workers these settings start here (an arch per GPU), without starting any
    # (a lane is a worker on its CPU group's cores, of the group's arch: the groups say it all)
    archs = dict.fromkeys(w.arch for w in sim_workers(replace(machine, lanes={})))
    missing = uncalibrated(plan, [a for a in archs if a not in set(skip_archs)], store)
    if not missing:
        return None
    where = ", ".join(f"{'part' if len(parts) == 1 else 'parts'} {', '.join(map(str, parts))} on {arch}"
                      for arch, parts in missing.items())  # part 1 on cpu1, parts 0, 1 on cuda0
    # the GPUs calibrate can measure: a skipped one (a what-if) would make the command fail
    reachable = [d for d in machine.cuda_devices if f"cuda{d}" not in set(skip_archs)] or [0]
    line = (f"staronnx: warning: no calibrated model for {where}: "
            f"run {calibrate_line(plandir, machine, devices=reachable)}")
    print(line, file=sys.stderr, flush=True)
    return line
