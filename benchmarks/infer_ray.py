"""Ray Data's ``map_batches`` with staronnx's predictor against Ray Data with a plain-ONNX-Runtime
predictor, on the same local cluster, the same dataset and the same actors (issue 52).

Each setup runs the whole dataset through ``ds.map_batches(Predictor, batch_size=B,
compute=ActorPoolStrategy(size=A), num_cpus=C)`` and takes every row; the time is from the call
to the last row, the actors' start and model loading included (each call starts its own pool, as
a user's job does; give enough rows that it is small beside them). Rounds alternate the two
setups; median and range of samples/s; the outputs of both are compared row for row.

- ``staronnx``: :class:`staronnx.ray.data.StaronnxPredictor` (a runtime per actor over its
  machine's CPU groups, the Ray batch cut into tasks of ``--task-batch`` rows);
- ``ort``: a predictor a user writes: one ``onnxruntime.InferenceSession`` per actor (its
  defaults), ``sess.run`` on the whole Ray batch.

    python benchmarks/infer_ray.py --model googlenet --rows 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GOOGLENET, REAL, git_head, ratio, summary  # noqa: E402


class OrtPredictor:
    """The plain-ORT predictor: one session per actor, the Ray batch run as it comes, each output
    turned so its rows come first (``batch_axes``: a time-major CTC head has them on axis 1)."""

    def __init__(self, model: str, input_name: str, batch_axes: dict[str, int]) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        self.input_name = input_name
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.axes = batch_axes

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        x = np.ascontiguousarray(np.stack(list(batch[self.input_name])) if batch[self.input_name].dtype == object
                                 else batch[self.input_name])
        out = self.session.run(self.outputs, {self.input_name: x})
        result = {"id": batch["id"]}
        result.update((n, np.moveaxis(o, self.axes.get(n, 0), 0)) for n, o in zip(self.outputs, out))
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="googlenet", help="googlenet or a model of models/real/ with one input")
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16, help="Ray's batch_size")
    ap.add_argument("--task-batch", type=int, default=8, help="rows per staronnx task")
    ap.add_argument("--actors", type=int, default=1)
    ap.add_argument("--cpus", type=int, default=2, help="the cluster's CPUs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import onnxruntime
    import ray

    from staronnx.infer import RowLayout, plan_for
    from staronnx.ray.data import StaronnxPredictor

    model = GOOGLENET if args.model == "googlenet" else REAL / f"{args.model}.onnx"
    plan = plan_for(model)
    name = plan.input_names[0]
    shape = [d if isinstance(d, int) and d > 0 else 64 for d in plan.inputs[0].shape[1:]]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, *shape)).astype(np.float32)
    ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = ray.data.from_items([{"id": i, name: x[i]} for i in range(args.rows)]).materialize()
    cpus = max(1, args.cpus // args.actors)
    setups = {
        "staronnx": (StaronnxPredictor, {"model": str(plan.root), "batch_size": args.task_batch}),
        "ort": (OrtPredictor, {"model": str(model), "input_name": name,
                               "batch_axes": {n: a or 0 for n, a in RowLayout.of(plan).outputs.items()}}),
    }

    def once(key: str) -> tuple[float, dict[int, np.ndarray]]:
        cls, kwargs = setups[key]
        t0 = time.perf_counter()
        out = ds.map_batches(cls, fn_constructor_kwargs=kwargs, batch_size=args.batch,
                             compute=ray.data.ActorPoolStrategy(size=args.actors), num_cpus=cpus).take_all()
        elapsed = time.perf_counter() - t0
        first = [k for k in out[0] if k != "id"][0]
        return args.rows / elapsed, {int(r["id"]): np.asarray(r[first]) for r in out}

    samples: dict[str, list[float]] = {k: [] for k in setups}
    outputs: dict[str, dict[int, np.ndarray]] = {}
    for r in range(args.rounds):
        for key in (list(setups) if r % 2 == 0 else list(setups)[::-1]):
            rate, outputs[key] = once(key)
            samples[key].append(rate)
            print(f"round {r + 1} {key}: {rate:.1f} samples/s (actor start included)", flush=True)
    diff = max(float(np.abs(outputs["staronnx"][i] - outputs["ort"][i]).max()) for i in range(args.rows))
    stats = {k: summary(v) for k, v in samples.items()}
    over = ratio(samples["staronnx"], samples["ort"])
    apart = over["ranges_apart"]
    print(f"staronnx / plain-ORT predictor: {over['median']:.3f} (medians of {args.rounds}; ranges "
          f"{'apart' if apart else 'overlap'}); outputs' max abs difference {diff:.2e}")
    ray.shutdown()
    if args.out is not None:
        args.out.write_text(json.dumps({
            "provenance": {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
                           "onnxruntime": onnxruntime.__version__, "ray": ray.__version__, "commit": git_head(),
                           "command": shlex.join([sys.executable, *sys.argv]), "settings": vars(args)},
            "samples_per_s": samples, "summary": stats, "staronnx_over_ort": over["median"], "ranges_apart": apart,
            "max_abs_diff": diff}, indent=1, default=str))


if __name__ == "__main__":
    main()
