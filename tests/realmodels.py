"""The real exported models of ``models/real/``, as tests use them (plain functions).

Each model stands for a kind users bring (see that folder's README). What tests need of each:
its path, the shapes to cut it at (``--input-shape``: one representative size for profiling),
and *one client's request* at a few shape variants, so concurrent clients send different
inputs and different shapes; ORT's answer to a request is the reference every door must match.

    feeds = request("crnn_ocr", client=3)          # a one-sample request, width varies by client
    want = ort_outputs("crnn_ocr", feeds)          # what onnxruntime answers to exactly these
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

#: the test models, tracked in the repository (a clone needs nothing beside it)
MODELS = Path(__file__).resolve().parents[1] / "models"
#: torchvision's GoogLeNet (random seeded weights, dynamic batch): the papers' main model
GOOGLENET = MODELS / "googlenet.onnx"
#: the seven real exported models with their reference inputs and outputs (see its README)
REAL = MODELS / "real"

NAMES = ("bert_tiny", "gpt2_tiny_kv", "crnn_ocr", "gru_stream", "unet_seg", "mobilenet_b1", "detector_nms")

#: models whose requests can share a task, and those that run one request per task
BATCHABLE = ("bert_tiny", "gpt2_tiny_kv", "crnn_ocr", "gru_stream", "unet_seg")
ONE_PER_TASK = ("mobilenet_b1", "detector_nms")


def path(name: str) -> Path:
    """The model file. The models are part of the repository, so one that is absent is a broken
    checkout (or a misspelt name) and fails the test rather than skipping it."""
    p = REAL / f"{name}.onnx"
    if not p.is_file():
        pytest.fail(f"{p} is absent: the real models are tracked in the repository under models/real/ "
                    f"(names: {', '.join(NAMES)})")
    return p


def reference(name: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The model's reference (inputs, outputs) from its ``.npz``."""
    with np.load(REAL / f"{name}.npz") as z:
        ins = {k[3:]: z[k] for k in z.files if k.startswith("in:")}
        outs = {k[4:]: z[k] for k in z.files if k.startswith("out:")}
    return ins, outs


def input_shapes(name: str) -> list[str]:
    """``--input-shape`` items to cut the model at (batch 1, the reference's other sizes)."""
    ins, _ = reference(name)
    items = []
    for n, a in ins.items():
        if a.ndim == 0:
            continue
        dims = list(a.shape)
        axis = 1 if (name == "gru_stream" and n == "state") else 0
        dims[axis] = 1
        items.append(f"{n}={'x'.join(map(str, dims))}")
    return items


def request(name: str, client: int, rows: int = 1) -> dict[str, np.ndarray]:
    """Client ``client``'s request of ``rows`` samples (1 for the fixed-batch models): its own
    values (seeded by the client), its shape one of two variants (client % 2)."""
    rng = np.random.default_rng(1000 + client)
    v = client % 2
    f32 = np.float32
    if name == "bert_tiny":
        seq = (5, 9)[v]
        ids = rng.integers(0, 1000, (rows, seq), dtype=np.int64)
        mask = np.ones((rows, seq), np.int64)
        mask[:, seq - 1 - client % 2:] = 0  # right-padded, by one or two tokens
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros((rows, seq), np.int64)}
    if name == "gpt2_tiny_kv":
        past, seq = (3, 5)[v], 1
        feeds = {"input_ids": rng.integers(0, 1000, (rows, seq), dtype=np.int64),
                 "attention_mask": np.ones((rows, past + seq), np.int64)}
        for i in (0, 1):
            for kind in ("key", "value"):
                feeds[f"past_{kind}_{i}"] = rng.standard_normal((rows, 2, past, 32)).astype(f32)
        return feeds
    if name == "crnn_ocr":
        return {"image": rng.standard_normal((rows, 1, 32, (148, 200)[v])).astype(f32)}
    if name == "gru_stream":
        return {"frame": rng.standard_normal((rows, 256)).astype(f32),
                "state": rng.standard_normal((2, rows, 64)).astype(f32),
                "sample_rate": np.array((16000, 8000)[v], dtype=np.int64)}
    if name == "unet_seg":
        h, w = ((32, 32), (48, 64))[v]
        return {"image": rng.standard_normal((rows, 3, h, w)).astype(f32)}
    if name == "mobilenet_b1":
        return {"input": rng.standard_normal((1, 3, 224, 224)).astype(f32)}
    if name == "detector_nms":
        h, w = ((64, 64), (96, 128))[v]
        return {"image": (rng.random((1, 3, h, w)) * 2).astype(f32)}
    raise KeyError(name)


@functools.lru_cache(maxsize=None)
def _session(name: str):  # an onnxruntime.InferenceSession
    """ORT's CPU session of a real model by name, or of any ``.onnx`` file by path."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    model = name if str(name).endswith(".onnx") else str(path(name))
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def ort_outputs(name: str | Path, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What plain onnxruntime answers to exactly ``feeds`` (the whole model, CPU); ``name`` is a
    real model's name or an ``.onnx`` path."""
    sess = _session(str(name))
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, dict(feeds))))


def assert_own_answer(name: str | Path, feeds: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray],
                      tol: float = 1e-4) -> None:
    """``got`` is ORT's answer to ``feeds`` (shapes equal, max abs diff <= tol x scale)."""
    want = ort_outputs(name, feeds)
    assert set(got) >= set(want), f"{name}: outputs {sorted(got)} lack {sorted(set(want) - set(got))}"
    for k, w in want.items():
        g = np.asarray(got[k])
        assert g.shape == w.shape, f"{name}.{k}: shape {g.shape}, ORT's {w.shape}"
        if w.size:
            scale = max(1.0, float(np.abs(w).max()))
            diff = float(np.abs(g.astype(np.float64) - w.astype(np.float64)).max())
            assert diff <= tol * scale, f"{name}.{k}: max abs diff {diff} to ORT's answer to these inputs"


def fixed_batch_time_major(folder: Path) -> Path:
    """The issue's OCR model: ``crnn_ocr`` exported with a fixed batch of 1 (input
    ``[1, 1, 32, width]``) whose output is declared ``[1, seqlen]`` but computed
    ``[time, 1, 37]`` (its batch on axis 1). Written to ``folder``; the path returned."""
    import onnx

    model = onnx.load(str(path("crnn_ocr")))
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    dim.Clear()
    dim.dim_value = 1
    shape = model.graph.output[0].type.tensor_type.shape
    del shape.dim[:]
    shape.dim.add().dim_value = 1
    shape.dim.add().dim_param = "seqlen"
    out = Path(folder) / "ocr_fixed_b1.onnx"
    onnx.save(model, str(out))
    return out


def fixed_request(client: int) -> dict[str, np.ndarray]:
    """A request to :func:`fixed_batch_time_major`'s model (one image, width by client % 2)."""
    return request("crnn_ocr", client)
