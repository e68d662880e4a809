"""How steady is this machine's speed? Plain ONNX Runtime, nothing of staronnx.

Why: the simulator's goals (issue 40) hold on a quiet machine, and a VM's speed moves with its
host's other tenants without the guest's /proc counting it (steal reads ~0). This runs one
process per core of this process's affinity, each pinned to its core with a one-thread
googlenet session at batch 1 back to back, and counts its runs in windows of ``--window``
seconds (a sweep point's length) for ``--seconds``: how far each window's speed strays from its
core's mean says how much of a prediction's error a machine this unsteady can explain, and what
share of windows a band of ``--band`` per cent covers (``sweep --sim-band``).

Usage: python benchmarks/steadiness.py [--seconds 60] [--window 3] [--band 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import GOOGLENET  # noqa: E402

#: what each core's process runs: its runs per second in each window, as one JSON list
_PROBE = """
import json, os, sys, time
import numpy as np, onnxruntime as ort
core, seconds, window, model = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
os.sched_setaffinity(0, {core})
so = ort.SessionOptions(); so.intra_op_num_threads = 1; so.inter_op_num_threads = 1
s = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
i = s.get_inputs()[0]
x = np.random.default_rng(0).random([d if isinstance(d, int) else 1 for d in i.shape], dtype=np.float32)
warm = time.perf_counter() + 2.0  # past the first runs' allocations and the core's wake-up
while time.perf_counter() < warm:
    s.run(None, {i.name: x})
speeds, end = [], time.perf_counter() + seconds
while time.perf_counter() < end:
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < window:
        s.run(None, {i.name: x}); n += 1
    speeds.append(n / (time.perf_counter() - t0))
print(json.dumps(speeds))
"""


@dataclass
class Steadiness:
    """Each core's speed (runs/s) per window, and what they say."""

    window: float
    speeds: dict[int, list[float]]

    def deviations(self) -> list[float]:
        """Every window's speed over its core's mean, minus 1."""
        return [v / statistics.fmean(vs) - 1 for vs in self.speeds.values() if vs for v in vs]

    def cv(self) -> float:
        devs = self.deviations()
        return statistics.pstdev(devs) if devs else 0.0

    def spread(self) -> float:
        """The slowest window's time over the fastest's, per core, the widest."""
        return max((max(vs) / min(vs) for vs in self.speeds.values() if vs), default=1.0)

    def covered(self, band: float) -> float:
        """The share of windows whose speed is within ``band`` of their core's mean."""
        devs = self.deviations()
        return sum(abs(d) <= band for d in devs) / len(devs) if devs else 1.0

    def band(self, coverage: float = 0.9, floor: float = 0.01) -> float:
        """The least deviation from the mean that holds ``coverage`` of the windows (at least
        ``floor``): the drift a prediction of this machine has to survive (``sweep --sim-band``)."""
        devs = sorted(abs(d) for d in self.deviations())
        if not devs:
            return floor
        return max(floor, devs[min(len(devs) - 1, math.ceil(coverage * len(devs)) - 1)])

    def describe(self, band: float) -> str:
        cores = ",".join(map(str, sorted(self.speeds)))
        n = sum(len(v) for v in self.speeds.values())
        return (f"machine steadiness: plain ONNX Runtime (googlenet, one thread, batch 1) on cores {cores}, "
                f"{n} windows of {self.window:g} s: speed {self.cv():.1%} (sd) around each core's mean, slowest "
                f"to fastest window x{self.spread():.2f}; {self.covered(band):.0%} of windows within {band:.1%} "
                "of the mean (a quiet machine: all of them within a few per cent)")


def measure(seconds: float = 60.0, window: float = 3.0, model: Path = GOOGLENET,
            cores: list[int] | None = None) -> Steadiness:
    """Every core of ``cores`` (default: this process's affinity) at once, for ``seconds``."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    procs = {c: subprocess.Popen([sys.executable, "-c", _PROBE, str(c), str(seconds), str(window), str(model)],
                                 stdout=subprocess.PIPE, text=True) for c in cores}
    speeds = {}
    for c, p in procs.items():
        out, _ = p.communicate(timeout=seconds + 120)
        if p.returncode != 0:
            raise RuntimeError(f"the steadiness probe on core {c} failed (exit {p.returncode})")
        speeds[c] = [float(v) for v in json.loads(out)]
    return Steadiness(window, speeds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--window", type=float, default=3.0)
    ap.add_argument("--band", type=float, default=5.0, metavar="PERCENT")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    result = measure(args.seconds, args.window)
    for c, vs in sorted(result.speeds.items()):
        print(f"core {c}: " + " ".join(f"{v:.1f}" for v in vs) + " runs/s")
    print(result.describe(args.band / 100))
    if args.json is not None:
        args.json.write_text(json.dumps({"window": result.window, "speeds": result.speeds, "cv": result.cv(),
                                         "spread": result.spread()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
