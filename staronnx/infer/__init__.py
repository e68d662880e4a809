"""Offline batch inference: a dataset in, every row's outputs out (``staronnx infer``).

    from staronnx.infer import InferSpec, infer, read_outputs

    report = infer("model.onnx", "images/", "out/", InferSpec(batch_size=16, on_error="skip"))
    outputs = read_outputs("out/")          # {"row_id": [N], "logits": [N, 1000]}

The dataset is an ``.npz``, a folder of ``.npz``/``.npy`` shards, a Parquet/Arrow dataset, or any
iterable of feeds (:mod:`staronnx.infer.sources`); the output a folder of Parquet or ``.npz``
shards, or one file (:mod:`staronnx.infer.sinks`). The job streams with bounded memory, keeps the
dataset's order, reports bad rows by row id, and resumes after a stop
(:mod:`staronnx.infer.job`). :class:`staronnx.ray.data.StaronnxPredictor` runs the same
runtime inside Ray Data's ``map_batches`` beyond one machine.
"""

from staronnx.infer.batchsize import BatchChoice, choose_batch_size
from staronnx.infer.job import InferReport, InferSpec, RowError, infer
from staronnx.infer.plans import plan_for
from staronnx.infer.rows import RowLayout
from staronnx.infer.sinks import OutputError, read_outputs
from staronnx.infer.sources import open_source

__all__ = ["infer", "InferSpec", "InferReport", "RowError", "OutputError", "read_outputs", "RowLayout",
           "BatchChoice", "choose_batch_size", "open_source", "plan_for"]
