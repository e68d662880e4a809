"""``staronnx infer`` side by side with ``staronnx run`` and a plain-ONNX-Runtime loop over the
same files (issue 52).

For each model (googlenet and real models of ``models/real/``), a dataset of ``--rows`` samples
is written as ``.npz`` shards of ``--shard`` rows (seeded random inputs of one shape). Then:

1. **Check** (``--rows`` rows): ``staronnx infer`` over every shard, and the plain-ORT loop over
   the same shards; the outputs are compared row for row (row ids 0..N-1, each once, max abs
   difference to ORT's); the peak RSS of the infer process (``wait4``) against that of the same
   command over one batch, the growth set beside the bytes of one window of batches in flight.
2. **Speed** (``--timing-rows`` rows, the first shards): three setups, each in a fresh process,
   taken in turn for ``--rounds`` rounds (the order rotated each round, so the VM's drift hits
   them alike), median and range of samples/s:

   - ``infer``: ``staronnx infer MODEL -i SHARDS -o OUT --batch-size B --max-in-flight W``
     (its own figure: the rows it wrote over the time from its first read to its last write);
   - ``run``: ``staronnx run PLAN --batch B --requests N/B --max-in-flight W --inputs SHARD``
     on the same one-part plan and workers (compute only: no reading, outputs thrown away);
   - ``ort``: one ``onnxruntime.InferenceSession`` (its defaults), a loop a user writes: load
     each shard, ``sess.run`` batch by batch, ``numpy.savez`` the shard's outputs.

The goals: infer >= 0.95x run, >= 1.0x the ORT loop; peak RSS growth <= 2x one window (said
against the batches in flight and against every buffer the job holds by design: the bundles read
ahead and submitted, the row groups gathered, queued and encoded). The JSON
(``--out``) keeps every repeat, the machine, the versions, the commit and the command.

    python benchmarks/infer.py --models crnn_ocr,unet_seg,googlenet --rows 20000 --timing-rows 2000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GOOGLENET, REAL, git_dirty, git_head, ratio, scratch_dir, summary  # noqa: E402

#: one sample's shape per model (the dataset's rows; axis 0 carries them for every model here)
SHAPES = {"googlenet": (3, 224, 224), "crnn_ocr": (1, 32, 128), "unet_seg": (3, 64, 64),
          "bert_tiny": None, "gru_stream": None}
STARONNX = [sys.executable, "-m", "staronnx"]


def model_path(name: str) -> Path:
    return GOOGLENET if name == "googlenet" else REAL / f"{name}.onnx"


def make_dataset(name: str, rows: int, shard: int, folder: Path) -> Path:
    """``rows`` seeded samples of the model's shape in .npz shards of ``shard`` rows (kept
    between runs in ``folder``: a googlenet dataset of 20,000 rows is 12 GB)."""
    shape = SHAPES.get(name)
    if shape is None:
        raise SystemExit(f"{name}: no dataset shape defined here (choose from "
                         f"{', '.join(k for k, v in SHAPES.items() if v)})")
    out = folder / f"{name}-{rows}x{shard}"
    done = out / "_complete"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i, lo in enumerate(range(0, rows, shard)):
        n = min(shard, rows - lo)
        np.savez(out / f"shard-{i:04d}.npz", **{input_name(name): rng.standard_normal((n, *shape)).astype(np.float32)})
    done.touch()
    return out


def input_name(name: str) -> str:
    return "input" if name == "googlenet" else "image"


def subset(src: Path, rows: int, shard: int, folder: Path) -> Path:
    """The first shards of ``src`` holding ``rows`` rows, as a folder of links."""
    out = folder / f"{src.name}-first{rows}"
    out.mkdir(parents=True, exist_ok=True)
    shards = sorted(src.glob("shard-*.npz"))[: max(1, -(-rows // shard))]
    for p in shards:
        link = out / p.name
        if not link.exists():
            link.symlink_to(p)
    return out


def _hwm(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM, bytes; 0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_measured(cmd: list[str]) -> tuple[str, int]:
    """Run ``cmd``; its stdout and its peak RSS in bytes. The peak is VmHWM read while it runs
    (every 20 ms, and at its end before it is reaped): ``getrusage``'s maximum would include
    the RSS this parent had when it forked the child, before the exec."""
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _hwm(proc.pid))
            done.wait(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # wait for the exit without reaping it (WNOWAIT), so its /proc entry still holds the peak
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    done.set()
    watcher.join()
    peak = max(peak, _hwm(proc.pid))
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return out.decode(), peak


# -- the three setups ---------------------------------------------------------------------------------
def infer_once(model: Path, src: Path, out: Path, batch: int, window: int, groups: str) -> dict[str, Any]:
    cmd = [*STARONNX, "infer", str(model), "-i", str(src), "-o", str(out), "--batch-size", str(batch),
           "--max-in-flight", str(window), "--groups", groups, "--overwrite", "-q"]
    _, rss = run_measured(cmd)
    summary = json.loads((out / "_SUCCESS.json").read_text())
    return {"samples_per_s": summary["samples_per_s"], "rows": summary["written"], "peak_rss": rss,
            "elapsed_s": summary["elapsed_s"]}


def run_once(plan: Path, shard: Path, rows: int, batch: int, window: int, groups: str) -> dict[str, Any]:
    cmd = [*STARONNX, "run", str(plan), "--batch", str(batch), "--requests", str(max(1, rows // batch)),
           "--max-in-flight", str(window), "--groups", groups, "--inputs", str(shard), "-q", "--policy", "heft"]
    out, _ = run_measured(cmd)
    line = next(l for l in out.splitlines() if "samples/s" in l)
    rate = float(line.split(" samples/s")[0].split()[-1].replace(",", ""))
    return {"samples_per_s": rate}


def batch_axes(model: Path) -> dict[str, int]:
    """Each output's batch axis (what a user reads off the model to join its batches)."""
    from staronnx.infer import RowLayout, plan_for

    return {n: a or 0 for n, a in RowLayout.of(plan_for(model)).outputs.items()}


def ort_once(model: Path, src: Path, out: Path, batch: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--ort-loop", str(model), str(src), str(out), str(batch),
           json.dumps(batch_axes(model))]
    text, rss = run_measured(cmd)
    result = json.loads(text.strip().splitlines()[-1])
    result["peak_rss"] = rss
    return result


def ort_loop(model: str, src: str, out: str, batch: int, axes: dict[str, int]) -> None:
    """The plain-ORT loop a user writes (run in its own process by :func:`ort_once`): batches
    joined along each output's batch axis (axis 1 of a time-major CTC head)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    Path(out).mkdir(parents=True, exist_ok=True)
    rows = 0
    start = time.perf_counter()
    for shard in sorted(Path(src).glob("shard-*.npz")):
        data = dict(np.load(shard))
        n = len(next(iter(data.values())))
        results: list[list[np.ndarray]] = []
        for lo in range(0, n, batch):
            results.append(sess.run(names, {k: v[lo:lo + batch] for k, v in data.items()}))
        np.savez(Path(out) / shard.name, **{name: np.concatenate([r[i] for r in results], axis=axes.get(name, 0))
                                            for i, name in enumerate(names)})
        rows += n
    elapsed = time.perf_counter() - start
    print(json.dumps({"samples_per_s": rows / elapsed, "rows": rows, "elapsed_s": elapsed}))


# -- the check ------------------------------------------------------------------------------------------
def compare(infer_out: Path, ort_out: Path, model: Path) -> dict[str, Any]:
    """Row for row: every row id once, in order, and the largest difference to ORT's outputs
    (ORT's layout turned row-major as infer writes it)."""
    from staronnx.infer import RowLayout, plan_for, read_outputs

    layout = RowLayout.of(plan_for(model))
    got = read_outputs(infer_out)
    ids = np.asarray(got["row_id"])
    want: dict[str, list[np.ndarray]] = {}
    for shard in sorted(ort_out.glob("shard-*.npz")):
        with np.load(shard) as z:
            for name in z.files:
                axis = layout.outputs.get(name) or 0
                want.setdefault(name, []).append(np.moveaxis(z[name], axis, 0))
    diffs = {}
    for name, parts in want.items():
        ref = np.concatenate(parts)
        have = np.asarray(got[name])
        scale = max(1.0, float(np.abs(ref).max()))
        diffs[name] = float(np.abs(have - ref).max()) / scale if have.shape == ref.shape else float("inf")
    return {"rows": int(len(ids)), "in_order_once": bool(np.array_equal(ids, np.arange(len(ids)))),
            "max_rel_diff": diffs, "equal": bool(all(d <= 1e-4 for d in diffs.values()))}


def row_bytes(src: Path, out: Path) -> tuple[int, int]:
    """One row's input bytes (a row of the dataset) and output bytes (a row infer wrote)."""
    from staronnx.infer import read_outputs

    with np.load(sorted(src.glob("shard-*.npz"))[0]) as z:
        row_in = sum(z[k][0].nbytes for k in z.files)
    got = read_outputs(out)
    return row_in, sum(np.asarray(v[0]).nbytes for k, v in got.items() if k != "row_id")


def window_bytes(src: Path, out: Path, batch: int, window: int) -> int:
    """One window of batches in flight: ``window`` batches of ``batch`` rows, inputs and outputs."""
    row_in, row_out = row_bytes(src, out)
    return int(window * batch * (row_in + row_out))


def job_window_bytes(src: Path, out: Path, batch: int, window: int) -> int:
    """Every buffer the job holds by design (staronnx/infer/job.py's docstring), beside the
    batches in flight: the bundle being submitted and the one read ahead (inputs of
    ``BUNDLE_BYTES``, or one batch where a batch is larger), and the outputs' row groups
    (``ROW_GROUP_BYTES``) being gathered, queued for the writer (``max(2, window)``) and encoded."""
    from staronnx.infer.job import BUNDLE_BYTES
    from staronnx.infer.sinks import ROW_GROUP_BYTES

    row_in, _ = row_bytes(src, out)
    bundle = max(BUNDLE_BYTES, batch * row_in)
    return window_bytes(src, out, batch, window) + 2 * bundle + (max(2, window) + 2) * ROW_GROUP_BYTES


def timing_rows(text: str, name: str) -> int:
    """``--timing-rows``: one count for every model, or ``name=rows`` items (others: 2000)."""
    if "=" not in text:
        return int(text)
    items = dict(item.split("=", 1) for item in text.split(","))
    return int(items.get(name, 2000))


def provenance(args: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime

    commit, dirty = git_head(), git_dirty()
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "cpus": os.cpu_count(),
            "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__, "numpy": np.__version__, "commit": commit, "dirty": dirty,
            "command": shlex.join([sys.executable, *sys.argv]), "settings": vars(args)}


def job_workers(plan: Any, groups: str, window: int | None) -> tuple[str, int]:
    """The CPU groups and the window a job with these settings runs on (``auto`` resolved as
    ``staronnx infer`` resolves it; the window two per worker unless given), so that every setup
    of a row runs on the same workers."""
    from staronnx.infer.workers import default_window, job_machine
    from staronnx.workers.groups import make_groups
    from staronnx.workers.layout import MachineSpec
    from staronnx.workers.topology import Topology

    resolved = job_machine(MachineSpec(groups), plan).groups
    return resolved, window or default_window(len(make_groups(Topology.from_system(), resolved)))


def bench_model(name: str, args: argparse.Namespace, data: Path, work: Path) -> dict[str, Any]:
    from staronnx.infer import plan_for

    model = model_path(name)
    loaded = plan_for(model)
    plan = loaded.root
    groups, window = job_workers(loaded, args.groups, args.window)
    args = argparse.Namespace(**{**vars(args), "groups": groups, "window": window})
    src = make_dataset(name, args.rows, args.shard, data)
    result: dict[str, Any] = {"model": name, "rows": args.rows, "batch": args.batch, "max_in_flight": args.window,
                              "groups": args.groups}
    if not args.skip_check:
        print(f"[{name}] check: infer and the ORT loop over {args.rows} rows", flush=True)
        big = infer_once(model, src, work / f"{name}-infer", args.batch, args.window, args.groups)
        ort = ort_once(model, src, work / f"{name}-ort", args.batch)
        result["check"] = compare(work / f"{name}-infer", work / f"{name}-ort", model)
        one = subset(src, args.batch, args.shard, work)
        tiny_src = work / f"{name}-one-batch"
        tiny_src.mkdir(exist_ok=True)
        with np.load(sorted(one.glob("shard-*.npz"))[0]) as z:
            np.savez(tiny_src / "shard-0000.npz", **{k: z[k][: args.batch] for k in z.files})
        tiny = infer_once(model, tiny_src, work / f"{name}-tiny", args.batch, args.window, args.groups)
        growth = big["peak_rss"] - tiny["peak_rss"]
        win = window_bytes(src, work / f"{name}-tiny", args.batch, args.window)
        job_window = job_window_bytes(src, work / f"{name}-tiny", args.batch, args.window)
        result["memory"] = {"peak_rss": big["peak_rss"], "peak_rss_one_batch": tiny["peak_rss"], "growth": growth,
                            "window_bytes": win, "growth_over_window": growth / win,
                            "job_window_bytes": job_window, "growth_over_job_window": growth / job_window,
                            "ort_loop_peak_rss": ort["peak_rss"]}
        result["check_rates"] = {"infer": big["samples_per_s"], "ort": ort["samples_per_s"]}
        print(f"[{name}] outputs {'equal' if result['check']['equal'] else 'DIFFER'} row for row "
              f"({result['check']['rows']} rows, in order once: {result['check']['in_order_once']}, "
              f"max rel diff {max(result['check']['max_rel_diff'].values()):.2e}); peak RSS growth "
              f"{growth / 2**20:.1f} MiB = {growth / win:.2f}x the {args.window} batches in flight "
              f"({win / 2**20:.1f} MiB), {growth / job_window:.2f}x every buffer the job holds by design "
              f"({job_window / 2**20:.1f} MiB); the ORT loop's peak {ort['peak_rss'] / 2**20:.0f} MiB "
              f"against infer's {big['peak_rss'] / 2**20:.0f} MiB", flush=True)
    if args.rounds:
        rows = min(timing_rows(args.timing_rows, name), args.rows)
        part = subset(src, rows, args.shard, work)
        rows = min(rows, args.shard * len(list(part.glob("shard-*.npz"))))
        first = sorted(part.glob("shard-*.npz"))[0]
        setups = {
            "infer": lambda: infer_once(model, part, work / f"{name}-t-infer", args.batch, args.window, args.groups),
            "run": lambda: run_once(plan, first, rows, args.batch, args.window, args.groups),
            "ort": lambda: ort_once(model, part, work / f"{name}-t-ort", args.batch),
        }
        if args.before:  # the job on other workers (the default before --groups auto: numa:2)
            before_groups, _, before_window = args.before.partition(":")
            b_groups, b_window = job_workers(loaded, before_groups, int(before_window) if before_window else None)
            result["before"] = {"groups": b_groups, "max_in_flight": b_window}
            setups["infer_before"] = lambda: infer_once(model, part, work / f"{name}-t-before", args.batch, b_window,
                                                        b_groups)
        order = list(setups)
        samples: dict[str, list[float]] = {k: [] for k in setups}
        peaks: list[int] = []
        for r in range(args.rounds):
            for key in order[r % len(order):] + order[: r % len(order)]:
                measured = setups[key]()
                rate = measured["samples_per_s"]
                samples[key].append(rate)
                if key == "infer":
                    peaks.append(measured["peak_rss"])
                print(f"[{name}] round {r + 1} {key}: {rate:.1f} samples/s", flush=True)
        stats = {k: summary(v) for k, v in samples.items()}
        # the same job over fewer rows: its peak RSS does not depend on the dataset's size
        result["timing"] = {"rows": rows, "samples_per_s": samples, "summary": stats, "infer_peak_rss": peaks}
        for peer in ("run", "ort", "infer_before")[: 3 if args.before else 2]:
            result["timing"][f"infer_over_{peer}"] = ratio(samples["infer"], samples[peer])
        before = (f", infer / infer on {result['before']['groups']} with {result['before']['max_in_flight']} in flight "
                  f"{result['timing']['infer_over_infer_before']['median']:.3f}") if args.before else ""
        print(f"[{name}] on {args.groups} with {args.window} in flight: infer / run "
              f"{result['timing']['infer_over_run']['median']:.3f}, infer / ORT loop "
              f"{result['timing']['infer_over_ort']['median']:.3f}{before} (medians of {args.rounds})", flush=True)
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--ort-loop":
        ort_loop(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), json.loads(sys.argv[6]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="crnn_ocr,unet_seg,googlenet")
    ap.add_argument("--rows", type=int, default=20000, help="rows of each dataset (the check runs over all)")
    ap.add_argument("--timing-rows", default="2000",
                    help="rows each timed repeat runs: a count, or name=rows items (e.g. crnn_ocr=20000,googlenet=2000)")
    ap.add_argument("--shard", type=int, default=1000, help="rows per input shard")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--window", type=int, default=None,
                    help="batches in flight (infer and run alike; default two per worker, as infer's)")
    ap.add_argument("--groups", default="auto", help="CPU groups (default infer's own: auto, resolved here)")
    ap.add_argument("--before", default=None,
                    help="GROUPS[:WINDOW]: also time infer on these workers (numa:2, the default before auto)")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds of the speed part (0: none)")
    ap.add_argument("--skip-check", action="store_true", help="the speed part only")
    ap.add_argument("--data", type=Path, default=None, help="where the datasets are kept between runs")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    data = args.data or scratch_dir("staronnx-infer-data-")
    work = scratch_dir("staronnx-infer-bench-")
    results = {"provenance": provenance(args), "models": []}
    for name in args.models.split(","):
        results["models"].append(bench_model(name.strip(), args, data, work))
        if args.out is not None:  # written as measured: a run cut short keeps what it did
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps({m["model"]: {k: m.get(k) for k in ("check", "memory")} for m in results["models"]}, indent=1))


if __name__ == "__main__":
    main()
