"""The GPU table's models, exported on the GPU host (issue 48, item 2).

The host has torch and torchvision but the models are too large to carry (a BERT-base-sized
encoder is ~440 MB), so they are made where they run, all with random weights (seed 0), fp32,
opset 17, the batch axis dynamic:

- ``googlenet``, ``resnet50``: torchvision's, input ``input`` [batch, 3, 224, 224];
- ``encoder``: a BERT-base-sized ``torch.nn.TransformerEncoder`` (12 layers, hidden 768, 12
  heads, feed-forward 3072, GELU) behind a token embedding (vocabulary 30,522) and learned
  positions, input ``input_ids`` int64 [batch, sequence], both axes dynamic: transformers is
  not needed, and the graph is the same shape of work (attention, LayerNorm, GEMMs).

Usage (GPU host): python benchmarks/gpu_models.py --out DIR [--models googlenet,resnet50,encoder]
prints one line per model with its path and size; a model already in DIR is kept.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

#: what each model needs beyond torch
NEEDS = {"googlenet": "torchvision", "resnet50": "torchvision", "encoder": None}
#: the encoder's sizes (BERT-base's)
VOCAB, HIDDEN, LAYERS, HEADS, FFN, MAX_POSITIONS = 30522, 768, 12, 12, 3072, 512
#: the sequence length the table runs the encoder at (batch x 128)
SEQUENCE = 128


def export_torchvision(name: str, path: Path) -> None:
    import torch
    import torchvision

    torch.manual_seed(0)
    kwargs = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
    net = getattr(torchvision.models, name)(weights=None, **kwargs).eval()
    x = torch.randn(1, 3, 224, 224)
    torch.onnx.export(net, x, str(path), input_names=["input"], output_names=["logits"], opset_version=17,
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False)


def encoder_module(layers: int = LAYERS, hidden: int = HIDDEN, heads: int = HEADS, ffn: int = FFN,
                   vocab: int = VOCAB) -> object:
    """The encoder as a torch module (``layers`` etc. smaller in the test that exports one)."""
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(vocab, hidden)
            self.positions = nn.Embedding(MAX_POSITIONS, hidden)
            self.norm = nn.LayerNorm(hidden)
            layer = nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.0, activation="gelu", batch_first=True)
            # no nested tensors: the exporter traces the plain path, every op a standard ONNX one
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            return self.encoder(self.norm(self.tokens(input_ids) + self.positions(pos)))

    torch.manual_seed(0)
    return Encoder().eval()


def export_encoder(path: Path, **sizes: int) -> None:
    import torch

    net = encoder_module(**sizes)
    ids = torch.randint(0, sizes.get("vocab", VOCAB), (2, 16))
    # the fused "fast path" of TransformerEncoderLayer (one native op) has no ONNX form
    torch.backends.mha.set_fastpath_enabled(False)
    with torch.no_grad():
        torch.onnx.export(net, (ids,), str(path), input_names=["input_ids"], output_names=["hidden"],
                          opset_version=17, dynamo=False,
                          dynamic_axes={"input_ids": {0: "batch", 1: "sequence"},
                                        "hidden": {0: "batch", 1: "sequence"}})


def export(name: str, out: Path) -> Path:
    """``name``'s ONNX file under ``out`` (made once); SystemExit naming what is missing."""
    if name not in NEEDS:
        raise SystemExit(f"unknown model {name!r} (have {', '.join(NEEDS)})")
    path = out / f"{name}.onnx"
    if path.exists():
        return path
    for module in ("torch", NEEDS[name]):
        if module is None:
            continue
        try:
            __import__(module)
        except ImportError:
            raise SystemExit(f"{name}: {module} is not installed here, so it cannot be exported "
                             "(the GPU host's image has torch and torchvision)") from None
    out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".onnx.part")
    if name == "encoder":
        export_encoder(tmp)
    else:
        export_torchvision(name, tmp)
    tmp.replace(path)  # a run cut short leaves no half-written model behind
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="googlenet,resnet50,encoder")
    args = ap.parse_args(argv)
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        t0 = time.perf_counter()
        path = export(name, args.out)
        print(f"{name}: {path} ({path.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
