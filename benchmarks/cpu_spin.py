"""A CPU worker's pool spinning after its run, or not: this tree against a tree before the
change, and both against a plain ONNX Runtime loop, side by side in one run.

ONNX Runtime's intra-op pool threads spin while they wait for work (``allow_spinning``), and by
default go on spinning for a while after a ``Run()`` returns. A plain loop has nothing else to
do between two runs; a staronnx process does: the engine books the finished task and takes the
next, the caller is woken and submits the next batch, a server's event loop answers, a batch
job reads and writes. With the worker's group holding every core, a pool that spins on after
its run takes a core from those threads exactly when they have work. This tree's CPU workers
stop spinning as each run ends (``session.force_spinning_stop``); the tree given as
``--before`` kept ORT's default for a worker of one part.

For each model (batch 8, one CPU group of every core, a 1-part plan, 2 batches in flight),
four setups, each in a fresh process, taken in turn for ``--rounds`` rounds with the order
rotated each round (this VM's speed drifts: see the README's measurements section):

- ``before`` / ``after``: ``Runtime.map`` over in-memory batches for ``--seconds`` s, the same
  code run from the ``--before`` tree and from this one (``python -P`` with ``PYTHONPATH`` set,
  so neither imports the other);
- ``ort`` / ``ort-stop``: one ``onnxruntime.InferenceSession`` in a loop, with its defaults and
  with ``force_spinning_stop`` (the peer at its best is the better of the two by median).

``--load`` repeats the whole set while another process keeps one core busy (a busy host: the
suite's own rule). The JSON keeps every repeat, the machine, the versions, both commits and the
command; ratios are medians, with ``ranges_apart`` saying whether the ranges overlap.

    git worktree add /tmp/before-spin <commit before the change>
    python benchmarks/cpu_spin.py --before /tmp/before-spin --rounds 5 --load --out benchmarks/results/cpu-spin.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GOOGLENET, REAL, REPO, git_dirty, git_head, ratio, summary  # noqa: E402

SHAPES = {"googlenet": (3, 224, 224), "crnn_ocr": (1, 32, 128), "unet_seg": (3, 64, 64)}

#: one setup's measurement, run in a fresh process: argv model, batch, seconds, setup
MEASURE = r"""
import sys, time, json
import numpy as np
model, batch, seconds, setup, shape = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
import onnxruntime as ort
name = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).get_inputs()[0].name
rng = np.random.default_rng(0)
feeds = [{name: rng.standard_normal((batch, *shape)).astype(np.float32)} for _ in range(16)]
def timed(step):
    for f in feeds[:4]:
        step([f])
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        done += step(feeds) * batch
    return done / (time.perf_counter() - start)
if setup.startswith("ort"):
    so = ort.SessionOptions()
    if setup == "ort-stop":
        so.add_session_config_entry("session.force_spinning_stop", "1")
    s = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    def step(fs):
        for f in fs:
            s.run(None, f)
        return len(fs)
    print(json.dumps({"samples_per_s": timed(step)}))
else:
    from staronnx.infer import plan_for
    from staronnx.runtime.runtime import Runtime
    from staronnx.runtime.spec import RuntimeSpec
    from staronnx.workers.layout import MachineSpec
    with Runtime(plan_for(model), MachineSpec(groups="numa"), RuntimeSpec("heft")) as rt:
        def step(fs):
            return sum(1 for _ in rt.map(fs * 8, max_in_flight=2))  # a window drained every 128 batches
        print(json.dumps({"samples_per_s": timed(step)}))
"""

SETUPS = ("before", "after", "ort", "ort-stop")


def model_path(name: str) -> Path:
    return GOOGLENET if name == "googlenet" else REAL / f"{name}.onnx"


def measure(setup: str, model: str, batch: int, seconds: float, before: Path) -> float:
    tree = before if setup == "before" else REPO
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-P", "-c", MEASURE, str(model_path(model)), str(batch), str(seconds), setup,
                          json.dumps(SHAPES[model])], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{setup} on {model} failed:\n{out.stderr[-2000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["samples_per_s"])


def _busy() -> None:
    while True:
        pass


def run_set(models: list[str], args: argparse.Namespace, label: str) -> list[dict[str, Any]]:
    rows = []
    for model in models:
        samples: dict[str, list[float]] = {s: [] for s in SETUPS}
        for r in range(args.rounds):
            order = SETUPS[r % len(SETUPS):] + SETUPS[:r % len(SETUPS)]
            for setup in order:
                samples[setup].append(measure(setup, model, args.batch, args.seconds, args.before))
            print(f"[{label}] {model} round {r + 1}: " + ", ".join(f"{s} {samples[s][-1]:,.0f}" for s in SETUPS),
                  flush=True)
        best_ort = max(("ort", "ort-stop"), key=lambda s: statistics.median(samples[s]))
        row = {"model": model, "batch": args.batch, "load": label, "samples_per_s": samples,
               "summary": {s: summary(v) for s, v in samples.items()}, "best_ort": best_ort,
               "after_over_before": ratio(samples["after"], samples["before"]),
               "after_over_best_ort": ratio(samples["after"], samples[best_ort]),
               "before_over_best_ort": ratio(samples["before"], samples[best_ort])}
        print(f"[{label}] {model}: after/before {row['after_over_before']['median']:.3f} "
              f"[{row['after_over_before']['low']:.3f}-{row['after_over_before']['high']:.3f}], after/{best_ort} "
              f"{row['after_over_best_ort']['median']:.3f}, before/{best_ort} "
              f"{row['before_over_best_ort']['median']:.3f}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the code before the change")
    ap.add_argument("--models", default="crnn_ocr,unet_seg,googlenet")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--load", action="store_true", help="also measure while another process keeps a core busy")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    models = args.models.split(",")
    import onnxruntime
    import numpy

    result: dict[str, Any] = {"provenance": {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "onnxruntime": onnxruntime.__version__, "numpy": numpy.__version__,
        "commit": git_head(), "dirty": git_dirty(),
        "before": {"path": str(args.before), "commit": git_head(args.before)},
        "command": shlex.join([sys.executable, *sys.argv]), "settings": {k: str(v) for k, v in vars(args).items()}},
        "rows": []}

    def save() -> None:
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1) + "\n")

    result["rows"] += run_set(models, args, "quiet")
    save()
    if args.load:
        busy = multiprocessing.Process(target=_busy, daemon=True)
        busy.start()
        try:
            result["rows"] += run_set(models, args, "one core busy")
        finally:
            busy.terminate()
        save()


if __name__ == "__main__":
    main()
