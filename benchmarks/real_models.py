"""Every door on real exported models: does each work, and is each answer the client's own?

For each model of ``models/real/`` (and of any folder given with ``--models DIR``):
the model's batching contract as staronnx reads it, then each door users use, run as a user
runs it (the ``staronnx`` command in a subprocess, ``staronnx.InferenceSession`` in process),
``OK`` or the one-line reason it failed:

* ``partition`` in 2 parts and at ``--shares 0.85,0.15`` (sizes from the model's reference
  ``.npz``: one representative size, for profiling only), ``plan verify`` (on the reference
  inputs when there are some, else random ones at batch 2), ``calibrate`` (batch 1 and 2),
  ``run``, a short ``sweep``, ``optimize-batch``, ``infer`` over the reference inputs (every
  row ORT's answer);
* ``serve`` over HTTP and gRPC (tritonclient): ``--clients`` concurrent clients (16), each
  sending its own requests of one of two shapes (mixed in one queue), every answer compared
  with plain onnxruntime's answer to that client's own inputs (max abs diff, relative to the
  output's scale, <= 1e-4); errors counted;
* ``InferenceSession``: every request of every client through ``run``, compared the same way.

Then, per shape: samples/s of ``staronnx serve`` (the clients in closed loop over HTTP) against
a plain onnxruntime session answering the same one-sample requests in a loop, side by side.

Requests are made from the model alone (nothing is model-specific here): the reference
``.npz`` gives one size per dynamic dimension and the values' ranges; the second shape halves
each dynamic size other than the batch (a dim whose name is an expression of others, as
``past_sequence + sequence``, is computed from them); a per-request value (an input with no batch
axis) keeps the reference's value in one shape and takes half of it in the other.

    .venv/bin/python benchmarks/real_models.py [--models DIR ...] [--only NAME ...] [--clients 16]
        [--requests 4] [--seconds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REAL, scratch_dir, start_serve  # noqa: E402

TOL = 1e-4


# ------------------------------------------------------------------------------ requests
@dataclass
class ModelCase:
    """One model: its file, reference arrays, contract and the requests clients send."""

    name: str
    path: Path
    ref_in: dict[str, np.ndarray]
    contract: object  # staronnx.contract.BatchContract
    shapes: list[dict[str, list[int]]] = field(default_factory=list)  # one-sample shape per variant

    def partition_shapes(self) -> list[str]:
        return [f"{n}={'x'.join(map(str, s))}" for n, s in self.shapes[0].items() if s]


def _eval_dim(expr: str, sizes: dict[str, int]) -> int | None:
    """A dim named by an expression of other dims' names (``past_sequence + sequence``)."""
    if not re.fullmatch(r"[\w\s+\-*()]+", expr):
        return None
    try:
        return int(eval(expr, {"__builtins__": {}}, dict(sizes)))  # noqa: S307 - names and + - * only
    except Exception:  # noqa: BLE001 - not an expression of known dims
        return None


def load_case(path: Path) -> ModelCase:
    """The model, its reference inputs (``NAME.npz``, keys ``in:<input>``; random if absent) and
    two shape variants of a one-sample request."""
    import onnx

    from staronnx.contract import BatchContract
    from staronnx.partition.graph import declared_outputs, model_inputs

    model = onnx.load(str(path), load_external_data=False)
    inputs = model_inputs(model)
    contract = BatchContract.read({i.name: i.shape for i in inputs}, declared_outputs(model))
    npz = path.with_suffix(".npz")
    ref: dict[str, np.ndarray] = {}
    if npz.is_file():
        with np.load(npz) as z:
            ref = {k[3:]: z[k] for k in z.files if k.startswith("in:")}
    sizes: dict[str, int] = {}
    for spec in inputs:  # the dynamic dims' sizes in the reference (8 where there is none)
        arr = ref.get(spec.name)
        for axis, d in enumerate(spec.shape):
            if isinstance(d, str) and axis != spec.batch_axis:
                sizes.setdefault(d, int(arr.shape[axis]) if arr is not None and arr.ndim > axis else 8)
    halved = {d: max(1, v // 2) for d, v in sizes.items() if d.isidentifier()}
    for d in sizes:  # expressions follow the dims they name
        if not d.isidentifier():
            value = _eval_dim(d, halved)
            halved[d] = value if value is not None else sizes[d]
    case = ModelCase(path.stem, path, ref, contract)
    for table in (sizes, halved):
        shape_of = {}
        for spec in inputs:
            dims = [1 if axis == spec.batch_axis else (table.get(d, 8) if isinstance(d, str) else int(d or 1))
                    for axis, d in enumerate(spec.shape)]
            shape_of[spec.name] = dims
        case.shapes.append(shape_of)
    case.inputs = inputs  # type: ignore[attr-defined]
    return case


def make_request(case: ModelCase, client: int) -> dict[str, np.ndarray]:
    """Client ``client``'s one-sample request: shape variant client % 2, values of its own."""
    from onnx import helper

    rng = np.random.default_rng(7919 * client + 1)
    variant = client % 2
    feeds = {}
    for spec in case.inputs:  # type: ignore[attr-defined]
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(spec.elem_type))
        shape = case.shapes[variant][spec.name]
        ref = case.ref_in.get(spec.name)
        if spec.batch_axis is None and ref is not None:  # a per-request value
            value = ref if variant == 0 else (ref // 2 if np.issubdtype(dtype, np.integer) else ref / 2)
            feeds[spec.name] = np.asarray(value, dtype=dtype).reshape(ref.shape)
        elif np.issubdtype(dtype, np.integer) or dtype == np.bool_:
            low, high = (int(ref.min()), int(ref.max()) + 1) if ref is not None and ref.size else (0, 2)
            feeds[spec.name] = rng.integers(low, max(high, low + 1), size=shape).astype(dtype)
        else:
            scale = float(ref.std()) if ref is not None and ref.size else 1.0
            mean = float(ref.mean()) if ref is not None and ref.size else 0.0
            feeds[spec.name] = (mean + scale * rng.standard_normal(shape)).astype(dtype)
    return feeds


class Reference:
    """Plain onnxruntime on the whole model: the answer each request must get."""

    def __init__(self, path: Path, threads: int = 1) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.session.get_outputs()]
        self.lock = threading.Lock()

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self.lock:
            return dict(zip(self.names, self.session.run(self.names, feeds)))


def diff(want: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> float:
    """Largest difference over outputs, relative to each output's scale (inf: a shape differs)."""
    worst = 0.0
    for k, w in want.items():
        g = np.asarray(got.get(k))
        if g.shape != w.shape:
            return float("inf")
        if w.size:
            worst = max(worst, float(np.abs(g.astype(np.float64) - w.astype(np.float64)).max())
                        / max(1.0, float(np.abs(w).max())))
    return worst


# ------------------------------------------------------------------------------ doors
def staronnx(*args: object, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    """``staronnx ARGS`` in a subprocess: "OK" or the one line that says why it failed."""
    proc = subprocess.run([sys.executable, "-m", "staronnx", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if proc.returncode == 0:
        return "OK"
    lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
    trace = any(ln.startswith("Traceback") for ln in lines)
    last = lines[-1] if lines else f"exit {proc.returncode}"
    return ("TRACEBACK: " if trace else "") + last[:160]


class Served:
    """``staronnx serve PLAN`` in a subprocess, on free loopback ports."""

    def __init__(self, plan: Path, name: str, env: dict[str, str], groups: str) -> None:
        cmd = [sys.executable, "-m", "staronnx", "serve", str(plan), "--name", name, "--http-port", "0",
               "--grpc-port", "0", "--metrics-port", "0", "--groups", groups, "--batch-size", "4",
               "--max-delay", "5ms", "--policy", "eager"]
        self.served = start_serve(cmd, env)
        self.lines, self.http, self.grpc = self.served.lines, self.served.http, self.served.grpc

    def close(self) -> None:
        self.served.stop(30)


def _client(protocol: str, url: str):  # a tritonclient client
    if protocol == "http":
        import tritonclient.http as t

        return t, t.InferenceServerClient(url, concurrency=1)
    import tritonclient.grpc as t

    return t, t.InferenceServerClient(url)


def infer(protocol: str, url: str, model: str, feeds: dict[str, np.ndarray], outputs: list[str]) -> dict[str, np.ndarray]:
    """One request through tritonclient, as any Triton user sends it."""
    t, client = _client(protocol, url)
    from tritonclient.utils import np_to_triton_dtype

    try:
        ins = []
        for name, value in feeds.items():
            x = t.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
            if protocol == "http":
                x.set_data_from_numpy(value, binary_data=True)
            else:
                x.set_data_from_numpy(value)
            ins.append(x)
        result = client.infer(model, ins, outputs=[t.InferRequestedOutput(o) for o in outputs])
        return {o: result.as_numpy(o) for o in outputs}
    finally:
        client.close()


def concurrent_check(ask, case: ModelCase, ref: Reference, clients: int, requests: int) -> tuple[int, int, float]:
    """``clients`` threads, each sending ``requests`` requests of its own at once through
    ``ask(feeds)``: (answers, errors, worst relative difference to ORT's answer)."""
    def one_client(c: int) -> tuple[int, int, float]:
        ok = errors = 0
        worst = 0.0
        for r in range(requests):
            feeds = make_request(case, c + clients * r)
            try:
                got = ask(feeds)
            except Exception:  # noqa: BLE001 - counted; the reason is the door's line
                errors += 1
                continue
            d = diff(ref(feeds), got)
            worst = max(worst, d)
            ok += 1
        return ok, errors, worst

    with ThreadPoolExecutor(clients) as pool:
        rows = list(pool.map(one_client, range(clients)))
    return sum(r[0] for r in rows), sum(r[1] for r in rows), max(r[2] for r in rows)


def closed_loop_rate(ask, feeds_of, clients: int, seconds: float) -> float:
    """Samples/s of ``clients`` threads each asking in turn for ``seconds``."""
    stop = time.perf_counter() + seconds
    counts = [0] * clients

    def loop(c: int) -> None:
        feeds = feeds_of(c)
        while time.perf_counter() < stop:
            ask(feeds)
            counts[c] += 1

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(loop, range(clients)))
    return sum(counts) / (time.perf_counter() - start)


def infer_door(case: ModelCase, ref: Reference, npz: Path, out: Path, groups: str, env: dict[str, str]) -> str:
    """``staronnx infer MODEL --inputs REF.npz`` at batch 2: every row of its output is ORT's
    answer to the reference inputs, that row (turned row-major as infer writes it)."""
    from staronnx.infer import RowLayout, plan_for, read_outputs

    said = staronnx("infer", case.path, "-i", npz, "-o", out, "--batch-size", 2, "--groups", groups, "-q",
                    "--overwrite", env=env)
    if said != "OK":
        return said
    layout = RowLayout.of(plan_for(case.path))
    rows = layout.count(case.ref_in) or 1
    want = layout.row_major(ref(case.ref_in), rows)
    got = read_outputs(out)
    if list(got["row_id"]) != list(range(rows)):
        return f"WRONG (row ids {list(got['row_id'])[:5]}..., {rows} rows asked)"
    worst = diff(want, {k: np.asarray(v) for k, v in got.items() if k != "row_id"})
    return ("OK" if worst <= TOL else "WRONG") + f" ({rows} rows, diff {worst:.1e})"


def check_model(case: ModelCase, args: argparse.Namespace, scratch: Path) -> dict:
    """Every door on one model; the row of the table."""
    from staronnx import InferenceSession

    row: dict = {"model": case.name, "contract": "batch" if case.contract.batchable else "1/task",
                 "doors": {}, "speed": []}
    env = {**os.environ, "STARONNX_HOME": str(scratch / "home")}
    doors = row["doors"]
    plan = scratch / f"{case.name}-2"
    shapes = sum((["--input-shape", s] for s in case.partition_shapes()), [])
    doors["partition 2"] = staronnx("partition", case.path, "-o", plan, "--parts", 2, "--profile-runs", 1,
                                    "-q", "--force", *shapes, env=env)
    doors["partition .85/.15"] = staronnx("partition", case.path, "-o", scratch / f"{case.name}-85", "--shares",
                                          "0.85,0.15", "--profile-runs", 1, "-q", "--force", *shapes, env=env)
    if doors["partition 2"] != "OK":
        return row
    npz = scratch / f"{case.name}-inputs.npz"
    if case.ref_in:
        np.savez(npz, **case.ref_in)
        doors["verify"] = staronnx("plan", "verify", plan, "--model", case.path, "--inputs", npz, env=env)
    else:
        doors["verify"] = staronnx("plan", "verify", plan, "--model", case.path, "--batch", 2, env=env)
    g = args.groups
    doors["calibrate"] = staronnx("calibrate", plan, "--batch-sizes", "1,2", "--groups", g, "--max-runs", 12,
                                  "--no-bus", env=env)
    doors["run"] = staronnx("run", plan, "--batch", 2, "--requests", 20, "--groups", g, "-q", env=env)
    doors["sweep"] = staronnx("sweep", plan, "--rates", 10, "--batch-sizes", "1,2", "--duration", "600ms",
                              "--groups", g, "-o", scratch / f"{case.name}-sweep", "--no-plots", "-q",
                              "--min-batches", 2, "--no-extend", "--simulate", env=env)
    doors["optimize-batch"] = staronnx("optimize-batch", plan, "--rate", 10, "--batch-sizes", "1,2", "--groups", g,
                                       "--sim-duration", "2s", "--verify-duration", "600ms", "--max-verify", 1,
                                       env=env)
    ref = Reference(case.path)
    outputs = ref.names
    if case.ref_in:
        doors["infer"] = infer_door(case, ref, npz, scratch / f"{case.name}-infer", g, env)
    try:
        served = Served(plan, case.name, env, g)
    except Exception as exc:  # noqa: BLE001 - the door's line
        doors["serve http"] = doors["serve grpc"] = str(exc).splitlines()[0][:160]
        served = None
    if served is not None:
        try:
            for protocol, url in (("http", served.http), ("grpc", served.grpc)):
                ok, errors, worst = concurrent_check(
                    lambda f, p=protocol, u=url: infer(p, u, case.name, f, outputs), case, ref,
                    args.clients, args.requests)
                good = errors == 0 and worst <= TOL
                doors[f"serve {protocol}"] = ("OK" if good else "WRONG") + f" ({ok} answers, {errors} errors, diff {worst:.1e})"
            for variant in (0, 1):  # samples/s, staronnx serve vs a plain ORT loop, per shape
                feeds_of = lambda c, v=variant: make_request(case, 2 * c + v)  # noqa: E731
                served_rate = closed_loop_rate(lambda f: infer("grpc", served.grpc, case.name, f, outputs),
                                               feeds_of, args.clients, args.seconds)
                plain = Reference(case.path, threads=0)
                ort_rate = closed_loop_rate(lambda f: plain.session.run(None, f), feeds_of, 1, args.seconds)
                shape = {n: s for n, s in case.shapes[variant].items()}
                row["speed"].append({"shape": shape, "serve": served_rate, "ort": ort_rate})
        finally:
            served.close()
    try:
        sess = InferenceSession(str(case.path))
        ok, errors, worst = concurrent_check(lambda f: dict(zip(outputs, sess.run(outputs, f))), case, ref,
                                             min(args.clients, 4), args.requests)
        doors["InferenceSession"] = ("OK" if errors == 0 and worst <= TOL else "WRONG") + \
            f" ({ok} answers, {errors} errors, diff {worst:.1e})"
    except Exception as exc:  # noqa: BLE001 - the door's line
        doors["InferenceSession"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:140] if str(exc) else ''}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", action="append", type=Path, default=[], help="another folder of .onnx models")
    ap.add_argument("--only", action="append", default=[], help="only these model names")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4, help="requests per client in the answer check")
    ap.add_argument("--seconds", type=float, default=2.0, help="per closed-loop rate measurement")
    ap.add_argument("--groups", default="cores=1", help="CPU groups of every command (default cores=1)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    folders = [REAL, *args.models]
    paths = sorted(p for f in folders for p in Path(f).glob("*.onnx"))
    if args.only:
        paths = [p for p in paths if p.stem in args.only]
    if not paths:
        raise SystemExit(f"no models found in {', '.join(map(str, folders))}")
    scratch = scratch_dir("staronnx-real-models-")
    rows = []
    for path in paths:
        t0 = time.perf_counter()
        case = load_case(path)
        row = check_model(case, args, scratch)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"\n== {case.name} ({row['contract']}; {row['seconds']} s)", flush=True)
        for door, verdict in row["doors"].items():
            print(f"  {door:<20} {verdict}", flush=True)
        for s in row["speed"]:
            shape = " ".join(f"{n}={'x'.join(map(str, d))}" for n, d in s["shape"].items() if d)
            print(f"  samples/s {shape}: serve {s['serve']:.0f}, plain ORT loop {s['ort']:.0f}, "
                  f"ratio {s['serve'] / s['ort']:.2f}" if s["ort"] else "", flush=True)
    doors = list(dict.fromkeys(d for r in rows for d in r["doors"]))
    print("\n| model | contract | " + " | ".join(doors) + " |")
    print("|" + "---|" * (len(doors) + 2))
    for r in rows:
        cells = [("OK" if r["doors"].get(d, "-").startswith("OK") else r["doors"].get(d, "-")) for d in doors]
        print(f"| {r['model']} | {r['contract']} | " + " | ".join(cells) + " |")
    failed = sum(1 for r in rows for v in r["doors"].values() if not v.startswith("OK"))
    print(f"\n{failed} door(s) failed of {sum(len(r['doors']) for r in rows)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
