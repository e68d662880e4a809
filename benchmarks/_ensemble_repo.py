"""A Triton model repository of real-model pipelines, served as ensembles (tests and benchmark).

Two pipelines over the real models of ``models/real/`` (see its README), with small pre- and
post-processing members written here with onnx.helper:

* ``text_reader``: an OCR pipeline of two real models. ``unet_seg`` segments a text line
  (image ``[batch, 3, 32, width]``), ``text_mask`` turns its logits into the text class's
  probability ``[batch, 1, 32, width]`` (Softmax over the classes, the text channel kept), the
  recogniser ``crnn_ocr`` reads it (``[time, batch, 37]``, time-major) and ``ctc_greedy``
  decodes it (best class per step, batch first: ``[batch, time]``). ``crnn_ocr`` carries its
  batch on axis 1, which Triton's ``max_batch_size`` cannot say: it is a ``max_batch_size: 0``
  member, so the ensemble is too (each request its own task graph, of any batch and width).
* ``seg_pipeline``: ``preprocess`` (uint8 HWC images to normalised float CHW) -> ``unet_seg``
  -> ``text_mask``: every member batches, so the ensemble does (``max_batch_size: 4``), its
  requests batched together (per image size) and each batch run through all three members.
* ``detect_segment``: ``detector_nms`` (its detections' count depends on the image, zero
  included) -> ``crop`` (RoiAlign: one 32x32 crop per box) -> ``unet_seg`` (the crops as its
  batch): a step whose output count varies per request. With ``max_batch_size: 0`` each request
  is its own task graph and the count flows through as a shape.

:func:`reference` answers a request by running the members in turn through ONNX Runtime:
what every served answer must equal.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

REAL = Path(__file__).resolve().parents[1] / "models" / "real"
OPSET = [helper.make_opsetid("", 17)]

#: member -> (its config, or None: completed from the model)
MEMBERS = {
    "unet_seg": "max_batch_size: 8",
    "crnn_ocr": "max_batch_size: 0",
    "text_mask": "max_batch_size: 8",
    "ctc_greedy": "max_batch_size: 0",
    "preprocess": "max_batch_size: 8",
}

TEXT_READER = """
name: "text_reader"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IMAGE" data_type: TYPE_FP32 dims: [ -1, 3, 32, -1 ] } ]
output [ { name: "IDS" data_type: TYPE_INT64 dims: [ -1, -1 ] },
         { name: "TEXT_PROB" data_type: TYPE_FP32 dims: [ -1, 1, 32, -1 ] } ]
ensemble_scheduling { step [
  { model_name: "unet_seg" model_version: -1
    input_map { key: "image" value: "IMAGE" } output_map { key: "logits" value: "SEG_LOGITS" } },
  { model_name: "text_mask" model_version: -1
    input_map { key: "logits" value: "SEG_LOGITS" } output_map { key: "prob" value: "TEXT_PROB" } },
  { model_name: "crnn_ocr" model_version: -1
    input_map { key: "image" value: "TEXT_PROB" } output_map { key: "log_probs" value: "LOG_PROBS" } },
  { model_name: "ctc_greedy" model_version: -1
    input_map { key: "log_probs" value: "LOG_PROBS" } output_map { key: "ids" value: "IDS" } }
] }
"""

SEG_PIPELINE = """
name: "seg_pipeline"
platform: "ensemble"
max_batch_size: 4
input [ { name: "RAW" data_type: TYPE_UINT8 dims: [ -1, -1, 3 ] } ]
output [ { name: "PROB" data_type: TYPE_FP32 dims: [ 1, -1, -1 ] } ]
ensemble_scheduling { step [
  { model_name: "preprocess" input_map { key: "raw" value: "RAW" } output_map { key: "image" value: "IMAGE" } },
  { model_name: "unet_seg" input_map { key: "image" value: "IMAGE" } output_map { key: "logits" value: "LOGITS" } },
  { model_name: "text_mask" input_map { key: "logits" value: "LOGITS" } output_map { key: "prob" value: "PROB" } }
] }
parameters { key: "input_shapes" value: { string_value: "RAW=1x32x32x3" } }
"""

#: ensemble -> config
ENSEMBLES = {"text_reader": TEXT_READER, "seg_pipeline": SEG_PIPELINE}


def text_mask() -> onnx.ModelProto:
    """Segmentation logits ``[batch, 2, H, W]`` -> the text class's probability ``[batch, 1, H, W]``."""
    nodes = [
        helper.make_node("Softmax", ["logits"], ["soft"], axis=1),
        helper.make_node("Slice", ["soft", "one", "two", "axis1"], ["prob"]),
    ]
    inits = [helper.make_tensor(n, TensorProto.INT64, [1], [v]) for n, v in (("one", 1), ("two", 2), ("axis1", 1))]
    graph = helper.make_graph(
        nodes, "text_mask",
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2, "height", "width"])],
        [helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["batch", 1, "height", "width"])], inits)
    return helper.make_model(graph, opset_imports=OPSET, ir_version=8)


def ctc_greedy() -> onnx.ModelProto:
    """CTC log-probabilities ``[time, batch, classes]`` -> the best class per step, ``[batch, time]``."""
    nodes = [
        helper.make_node("ArgMax", ["log_probs"], ["best"], axis=2, keepdims=0),
        helper.make_node("Transpose", ["best"], ["ids"], perm=[1, 0]),
    ]
    graph = helper.make_graph(
        nodes, "ctc_greedy",
        [helper.make_tensor_value_info("log_probs", TensorProto.FLOAT, ["time", "batch", 37])],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "time"])])
    return helper.make_model(graph, opset_imports=OPSET, ir_version=8)


def preprocess() -> onnx.ModelProto:
    """uint8 images ``[batch, H, W, 3]`` -> float ``[batch, 3, H, W]``, scaled to [0, 1] and
    normalised per channel (ImageNet's means and deviations)."""
    mean = np.array([0.485, 0.456, 0.406], np.float32).reshape(1, 3, 1, 1)
    std = np.array([0.229, 0.224, 0.225], np.float32).reshape(1, 3, 1, 1)
    nodes = [
        helper.make_node("Cast", ["raw"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Transpose", ["f"], ["chw"], perm=[0, 3, 1, 2]),
        helper.make_node("Mul", ["chw", "scale"], ["unit"]),
        helper.make_node("Sub", ["unit", "mean"], ["centred"]),
        helper.make_node("Div", ["centred", "std"], ["image"]),
    ]
    inits = [helper.make_tensor("scale", TensorProto.FLOAT, [], [1 / 255]),
             onnx.numpy_helper.from_array(mean, "mean"), onnx.numpy_helper.from_array(std, "std")]
    graph = helper.make_graph(
        nodes, "preprocess",
        [helper.make_tensor_value_info("raw", TensorProto.UINT8, ["batch", "height", "width", 3])],
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 3, "height", "width"])], inits)
    return helper.make_model(graph, opset_imports=OPSET, ir_version=8)


BUILT = {"text_mask": text_mask, "ctc_greedy": ctc_greedy, "preprocess": preprocess}


def member_file(name: str) -> onnx.ModelProto | Path:
    return BUILT[name]() if name in BUILT else REAL / f"{name}.onnx"


def write_model(root: Path, name: str, config: str | None, model: onnx.ModelProto | Path,
                versions: tuple[int, ...] = (1,)) -> Path:
    """``root/name`` with its config and version folders holding ``model``."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.pbtxt").write_text(config)
    for v in versions:
        (folder / str(v)).mkdir(exist_ok=True)
        if isinstance(model, Path):
            shutil.copyfile(model, folder / str(v) / "model.onnx")
        else:
            onnx.save(model, str(folder / str(v) / "model.onnx"))
    return folder


def write_repository(root: Path, ensembles: Mapping[str, str] = ENSEMBLES) -> Path:
    """The members and ``ensembles`` (name -> config) as a Triton model repository in ``root``."""
    for name, config in MEMBERS.items():
        write_model(root, name, config, member_file(name))
    for name, config in ensembles.items():
        write_model_folder_only(root, name, config)
    return root


def write_model_folder_only(root: Path, name: str, config: str) -> Path:
    """An ensemble folder: its config and an empty version folder (Triton's layout)."""
    folder = root / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(config)
    return folder


class Reference:
    """The members run in turn through ONNX Runtime (one CPU session each): the answer every
    door must equal."""

    def __init__(self) -> None:
        import onnxruntime as ort

        self.sessions = {}
        for name in MEMBERS:
            model = member_file(name)
            data = model.read_bytes() if isinstance(model, Path) else model.SerializeToString()
            self.sessions[name] = ort.InferenceSession(data, providers=["CPUExecutionProvider"])

    def run(self, name: str, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        sess = self.sessions[name]
        outs = sess.run(None, dict(feeds))
        return {o.name: v for o, v in zip(sess.get_outputs(), outs)}

    def text_reader(self, image: np.ndarray) -> dict[str, np.ndarray]:
        logits = self.run("unet_seg", {"image": image})["logits"]
        prob = self.run("text_mask", {"logits": logits})["prob"]
        log_probs = self.run("crnn_ocr", {"image": prob})["log_probs"]
        return {"IDS": self.run("ctc_greedy", {"log_probs": log_probs})["ids"], "TEXT_PROB": prob}

    def seg_pipeline(self, raw: np.ndarray) -> dict[str, np.ndarray]:
        image = self.run("preprocess", {"raw": raw})["image"]
        logits = self.run("unet_seg", {"image": image})["logits"]
        return {"PROB": self.run("text_mask", {"logits": logits})["prob"]}


def text_image(rng: np.random.Generator, batch: int, width: int) -> np.ndarray:
    """A text-line request for ``text_reader``: ``[batch, 3, 32, width]`` (width a multiple of 4)."""
    return rng.standard_normal((batch, 3, 32, width)).astype(np.float32)


def raw_image(rng: np.random.Generator, batch: int, height: int, width: int) -> np.ndarray:
    """A request for ``seg_pipeline``: uint8 ``[batch, height, width, 3]`` (sizes multiples of 4)."""
    return rng.integers(0, 256, size=(batch, height, width, 3), dtype=np.uint8)


def crop() -> onnx.ModelProto:
    """An image ``[1, 3, H, W]`` and boxes ``[num_det, 4]`` (x1, y1, x2, y2 in pixels) -> each
    box's crop resampled to ``[num_det, 3, 32, 32]`` (RoiAlign): a variable count per request."""
    nodes = [
        helper.make_node("Shape", ["boxes"], ["boxes_shape"]),
        helper.make_node("Slice", ["boxes_shape", "zero", "one"], ["count"]),
        helper.make_node("ConstantOfShape", ["count"], ["batch_indices"],
                         value=helper.make_tensor("v", TensorProto.INT64, [1], [0])),
        helper.make_node("RoiAlign", ["image", "boxes", "batch_indices"], ["crops"], output_height=32,
                         output_width=32, sampling_ratio=2, spatial_scale=1.0),
    ]
    inits = [helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
             helper.make_tensor("one", TensorProto.INT64, [1], [1])]
    graph = helper.make_graph(
        nodes, "crop",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, "height", "width"]),
         helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["num_det", 4])],
        [helper.make_tensor_value_info("crops", TensorProto.FLOAT, ["num_det", 3, 32, 32])], inits)
    return helper.make_model(graph, opset_imports=OPSET, ir_version=8)


BUILT["crop"] = crop
MEMBERS.update({"detector_nms": "max_batch_size: 0", "crop": "max_batch_size: 0"})

#: detector -> crops -> segmenter: a step whose output count varies per request (each request
#: its own task graph: max_batch_size 0, the count flowing through as a shape)
DETECT_SEGMENT = """
name: "detect_segment"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IMAGE" data_type: TYPE_FP32 dims: [ 1, 3, -1, -1 ] } ]
output [ { name: "BOXES" data_type: TYPE_FP32 dims: [ -1, 4 ] },
         { name: "MASKS" data_type: TYPE_FP32 dims: [ -1, 2, 32, 32 ] } ]
ensemble_scheduling { step [
  { model_name: "detector_nms" input_map { key: "image" value: "IMAGE" } output_map { key: "boxes" value: "BOXES" } },
  { model_name: "crop" input_map { key: "image" value: "IMAGE" } input_map { key: "boxes" value: "BOXES" }
    output_map { key: "crops" value: "CROPS" } },
  { model_name: "unet_seg" input_map { key: "image" value: "CROPS" } output_map { key: "logits" value: "MASKS" } }
] }
"""
ENSEMBLES["detect_segment"] = DETECT_SEGMENT


def detect_segment_reference(ref: "Reference", image: np.ndarray) -> dict[str, np.ndarray]:
    """detect_segment's members in turn through ORT."""
    boxes = ref.run("detector_nms", {"image": image})["boxes"]
    crops = ref.run("crop", {"image": image, "boxes": boxes})["crops"]
    return {"BOXES": boxes, "MASKS": ref.run("unet_seg", {"image": crops})["logits"]}


def scene(height: int = 192, width: int = 256) -> np.ndarray:
    """The detector's reference scene (``models/real/detector_nms.npz``) or, at another size,
    coloured rectangles on a dark noisy background (about as many detections per area)."""
    data = np.load(REAL / "detector_nms.npz")
    image = data["in:image"].astype(np.float32)
    if image.shape[2:] == (height, width):
        return image
    rng = np.random.default_rng(height * 1000 + width)
    out = (rng.standard_normal((1, 3, height, width)) * 0.05).astype(np.float32)
    for _ in range(max(1, height * width // 4000)):
        h, w = int(rng.integers(40, 80)), int(rng.integers(40, 80))
        y, x = int(rng.integers(0, max(1, height - h))), int(rng.integers(0, max(1, width - w)))
        out[0, :, y:y + h, x:x + w] = rng.uniform(0.5, 1.0, size=(3, 1, 1))
    return out
