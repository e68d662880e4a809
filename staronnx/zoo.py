"""A zoo of small ONNX models built in code, for tests and for ``staronnx demo``.

Every model here exists to exercise one structure a partitioner or a runtime must get right:
long chains, skip connections, wide fan-out, dynamic shapes, control flow with outer-scope
reads, several outputs, integer inputs. Building them with :mod:`onnx.helper` keeps the test
suite free of downloads and of torch, and makes every model deterministic in its ``seed``.

Conventions shared by all builders:

* opset 17, IR version 8 (runnable by any onnxruntime >= 1.14), float32 activations;
* the first dimension of every graph input and output is the symbolic dim ``"batch"``;
* weights come from ``numpy.random.default_rng(seed)``, He/Xavier-scaled so activations stay
  of order one and outputs stay finite for standard-normal feeds;
* every node has a unique, readable ``name`` and every node output is used.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "OPSET",
    "IR_VERSION",
    "ZOO",
    "chain",
    "residual",
    "inception",
    "inception_demo",
    "transformer_block",
    "wide_fanout",
    "if_model",
    "multi_head_detector",
    "wide_and_deep",
    "random_dag",
    "fragile",
]

OPSET = 17
IR_VERSION = 8
BATCH = "batch"

Dim = int | str


class _Namer:
    """Hands out unique names ``prefix_N``; shared by a graph and its subgraphs so that no
    tensor or node name is ever reused in any scope (ONNX forbids shadowing outer names)."""

    def __init__(self) -> None:
        self._counts: defaultdict[str, itertools.count[int]] = defaultdict(itertools.count)

    def __call__(self, prefix: str) -> str:
        return f"{prefix}_{next(self._counts[prefix])}"


class _GraphBuilder:
    """Tiny helper around :mod:`onnx.helper` that removes node/initializer boilerplate.

    Each :meth:`op` call adds one node whose name is also the name of its (single) output,
    unless ``out`` names the output explicitly (for graph outputs such as ``"y"``).
    """

    def __init__(self, name: str, seed: int = 0, *, rng: np.random.Generator | None = None,
                 namer: _Namer | None = None) -> None:
        self.name = name
        self.rng = rng if rng is not None else np.random.default_rng(seed)
        self.fresh = namer if namer is not None else _Namer()
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []

    # -- graph interface --------------------------------------------------------------------

    def input(self, name: str, shape: Sequence[Dim], dtype: int = TensorProto.FLOAT) -> str:
        """Declare a graph input and return its name."""
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def output(self, name: str, shape: Sequence[Dim], dtype: int = TensorProto.FLOAT) -> str:
        """Declare an existing tensor as a graph output."""
        self.outputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def subgraph(self, name: str) -> _GraphBuilder:
        """A builder for a control-flow body that shares this graph's rng and names."""
        return _GraphBuilder(name, rng=self.rng, namer=self.fresh)

    # -- initializers -----------------------------------------------------------------------

    def const(self, value: np.ndarray | np.generic | float | int | Sequence[int], hint: str = "const") -> str:
        """Add ``value`` as an initializer (int lists become int64, floats float32)."""
        arr = np.asarray(value)
        if arr.dtype.kind == "f":
            arr = arr.astype(np.float32)
        elif arr.dtype.kind in "iu":
            arr = arr.astype(np.int64)
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(arr, name))
        return name

    def weight(self, shape: Sequence[int], fan_in: int, gain: float = 2.0, hint: str = "w") -> str:
        """Random normal weight with variance ``gain / fan_in`` (He for gain 2, Xavier for 1)."""
        w = self.rng.standard_normal(tuple(shape)) * math.sqrt(gain / fan_in)
        return self.const(w.astype(np.float32), hint)

    def bias(self, n: int, hint: str = "b") -> str:
        """Small random bias, non-zero so that a bug dropping it changes the outputs."""
        return self.const((self.rng.standard_normal(n) * 0.01).astype(np.float32), hint)

    # -- nodes ------------------------------------------------------------------------------

    def op(self, op_type: str, *inputs: str, out: str | None = None, hint: str | None = None,
           **attrs: Any) -> str:
        """Add one single-output node and return its output name."""
        node_name = self.fresh(hint or op_type.lower())
        output = out if out is not None else node_name
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name=node_name, **attrs))
        return output

    def dense(self, x: str, n_in: int, n_out: int, act: str | None = "Relu", out: str | None = None) -> str:
        """``act(x @ W + b)``: the MatMul/Add pattern exporters emit for linear layers."""
        y = self.op("MatMul", x, self.weight([n_in, n_out], n_in, 2.0 if act == "Relu" else 1.0))
        if act is None:
            return self.op("Add", y, self.bias(n_out), out=out)
        y = self.op("Add", y, self.bias(n_out))
        return self.op(act, y, out=out)

    def conv(self, x: str, c_in: int, c_out: int, k: int = 3, stride: int = 1, act: bool = True, gain: float = 2.0,
             hint: str = "conv") -> str:
        """``Conv(x)`` with 'same' padding (``k`` odd), He-initialised, then Relu if ``act``."""
        w = self.weight([c_out, c_in, k, k], c_in * k * k, gain, hint=f"{hint}_w")
        p = k // 2
        y = self.op("Conv", x, w, self.bias(c_out, hint=f"{hint}_b"), hint=hint, kernel_shape=[k, k],
                    pads=[p, p, p, p], strides=[stride, stride])
        return self.op("Relu", y) if act else y

    # -- result -----------------------------------------------------------------------------

    def graph(self) -> onnx.GraphProto:
        """The graph built so far (also used for If bodies)."""
        return helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)

    def model(self, doc: str = "") -> onnx.ModelProto:
        """Wrap the graph in a model at the zoo's opset and IR version."""
        return helper.make_model(self.graph(), opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                                 producer_name="staronnx.zoo", doc_string=doc)


def _same_pad_out(n: int, stride: int) -> int:
    """Spatial size after a 'same'-padded conv/pool with odd kernel: ``ceil(n / stride)``."""
    return -(-n // stride)


# -------------------------------------------------------------------------------------------
# Builders
# -------------------------------------------------------------------------------------------


def chain(depth: int = 6, width: int = 32, seed: int = 0) -> onnx.ModelProto:
    """A straight MatMul/Add/Relu chain: input ``x`` [batch, width] -> ``y`` [batch, width].

    The simplest case for a partitioner: every cut is a single tensor, so any balanced split
    is a pipeline. ``3 * depth - 1`` nodes (the last layer has no Relu).
    """
    _check_positive(depth=depth, width=width)
    g = _GraphBuilder("chain", seed)
    h = g.input("x", [BATCH, width])
    for i in range(depth):
        last = i == depth - 1
        h = g.dense(h, width, width, act=None if last else "Relu", out="y" if last else None)
    g.output("y", [BATCH, width])
    return g.model(chain.__doc__ or "")


def residual(blocks: int = 3, channels: int = 8, size: int = 16, seed: int = 0) -> onnx.ModelProto:
    """ResNet basic blocks (Conv-BN-Relu-Conv + skip Add, Relu): ``x``/``y`` [batch, C, H, W].

    Skip connections make tensors live across several nodes, so a cut through a block must
    carry two tensors; BatchNormalization adds an op with five inputs, four of them weights.
    """
    _check_positive(blocks=blocks, channels=channels, size=size)
    g = _GraphBuilder("residual", seed)
    h = g.input("x", [BATCH, channels, size, size])
    for i in range(blocks):
        skip = h
        t = g.conv(h, channels, channels, act=False, hint=f"blk{i}_conv_a")
        scale = g.const(1.0 + 0.1 * g.rng.standard_normal(channels), f"blk{i}_bn_scale")
        shift = g.const(0.01 * g.rng.standard_normal(channels), f"blk{i}_bn_shift")
        mean = g.const(0.01 * g.rng.standard_normal(channels), f"blk{i}_bn_mean")
        var = g.const(1.0 + 0.1 * np.abs(g.rng.standard_normal(channels)), f"blk{i}_bn_var")
        t = g.op("BatchNormalization", t, scale, shift, mean, var, hint=f"blk{i}_bn", epsilon=1e-5)
        t = g.op("Relu", t)
        # Half gain on the second conv keeps the variance of skip + branch near that of x.
        t = g.conv(t, channels, channels, act=False, gain=1.0, hint=f"blk{i}_conv_b")
        t = g.op("Add", t, skip, hint=f"blk{i}_skip_add")
        # Scale by 1/sqrt(2) so the activations stay O(1) however many blocks are stacked.
        t = g.op("Mul", t, g.const(np.float32(1 / math.sqrt(2)), "inv_sqrt2"))
        h = g.op("Relu", t, out="y" if i == blocks - 1 else None)
    g.output("y", [BATCH, channels, size, size])
    return g.model(residual.__doc__ or "")


def inception(blocks: int = 3, channels: int = 16, size: int = 32, seed: int = 0, classes: int = 10) -> onnx.ModelProto:
    """Inception-style CNN: ``x`` [batch, 3, size, size] -> ``logits`` [batch, classes].

    A 3x3 stem conv, then ``blocks`` inception blocks, each with four parallel branches
    (1x1; 1x1->3x3; 1x1->3x3->3x3 standing for 5x5; 3x3 maxpool->1x1) of width
    ``channels * (2 + block)``, joined by a 4-input Concat; a stride-2 maxpool after every
    even block but the last; global average pool, Flatten, Gemm. Parallel branches of unequal
    cost are what lets a scheduler run parts concurrently, and the 4-way joins are what a
    partition must cut around. 16 nodes per block, 5 for stem and head, plus the pools
    (54 nodes, about 2 ms per sample on one CPU core at the defaults).
    """
    _check_positive(blocks=blocks, channels=channels, size=size, classes=classes)
    g = _GraphBuilder("inception", seed)
    h = g.input("x", [BATCH, 3, size, size])
    h = g.conv(h, 3, channels, k=3, hint="stem")
    c_in = channels
    for i in range(blocks):
        w = channels * (2 + i)  # branch width grows with depth, as in GoogLeNet
        r = max(w // 2, 4)  # 1x1 "reduce" width in front of the 3x3s
        p = f"blk{i}"
        b1 = g.conv(h, c_in, w, k=1, hint=f"{p}_1x1")
        b2 = g.conv(g.conv(h, c_in, r, k=1, hint=f"{p}_3x3_reduce"), r, w, k=3, hint=f"{p}_3x3")
        b3 = g.conv(h, c_in, r, k=1, hint=f"{p}_5x5_reduce")
        b3 = g.conv(g.conv(b3, r, w, k=3, hint=f"{p}_5x5_a"), w, w, k=3, hint=f"{p}_5x5_b")
        b4 = g.op("MaxPool", h, hint=f"{p}_pool", kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])
        b4 = g.conv(b4, c_in, w, k=1, hint=f"{p}_pool_proj")
        h = g.op("Concat", b1, b2, b3, b4, hint=f"{p}_concat", axis=1)
        c_in = 4 * w
        if i % 2 == 0 and i < blocks - 1:
            h = g.op("MaxPool", h, hint=f"{p}_downsample", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    h = g.op("GlobalAveragePool", h)
    h = g.op("Flatten", h, axis=1)
    wc = g.weight([classes, c_in], c_in, 1.0, hint="fc_w")
    g.op("Gemm", h, wc, g.bias(classes, hint="fc_b"), out="logits", hint="fc", transB=1)
    g.output("logits", [BATCH, classes])
    return g.model(inception.__doc__ or "")


#: Sizes of the model ``staronnx demo`` runs by default (see :func:`inception_demo`).
INCEPTION_DEMO_SIZES: dict[str, int] = {"blocks": 6, "channels": 16, "size": 48}


def inception_demo(seed: int = 0) -> onnx.ModelProto:
    """The ``staronnx demo`` default: :func:`inception` at :data:`INCEPTION_DEMO_SIZES`.

    Big enough (104 nodes, about 6 ms per sample on one CPU core) that splitting it across
    processors pays off visibly, small enough that the demo finishes in seconds.
    """
    return inception(seed=seed, **INCEPTION_DEMO_SIZES)


def transformer_block(d_model: int = 64, heads: int = 4, ff: int = 128, seed: int = 0) -> onnx.ModelProto:
    """One pre-LN transformer encoder block: ``x`` -> ``y``, both [batch, seq, d_model].

    Both ``batch`` and ``seq`` are symbolic, so every reshape is shape-computing: heads are
    split with ``Reshape(·, [0, 0, heads, d_head])`` and merged with a shape built by
    Shape/Gather/Concat. Exercises partitions whose cut tensors have two dynamic dims, plus
    LayerNormalization, Softmax, batched MatMuls and an Erf-form Gelu.
    """
    _check_positive(d_model=d_model, heads=heads, ff=ff)
    if d_model % heads:
        raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
    dh = d_model // heads
    g = _GraphBuilder("transformer_block", seed)
    x = g.input("x", [BATCH, "seq", d_model])

    def layer_norm(t: str, hint: str) -> str:
        gamma = g.const(1.0 + 0.1 * g.rng.standard_normal(d_model), f"{hint}_gamma")
        beta = g.const(0.01 * g.rng.standard_normal(d_model), f"{hint}_beta")
        return g.op("LayerNormalization", t, gamma, beta, hint=hint, axis=-1, epsilon=1e-5)

    def proj(t: str, n_in: int, n_out: int, hint: str) -> str:
        y = g.op("MatMul", t, g.weight([n_in, n_out], n_in, 1.0, hint=f"{hint}_w"), hint=f"{hint}_matmul")
        return g.op("Add", y, g.bias(n_out, hint=f"{hint}_b"), hint=f"{hint}_add")

    # --- self-attention ---
    ln1 = layer_norm(x, "ln1")
    split_shape = g.const([0, 0, heads, dh], "split_heads_shape")
    q, k, v = (g.op("Reshape", proj(ln1, d_model, d_model, n), split_shape, hint=f"{n}_split") for n in "qkv")
    q = g.op("Transpose", q, hint="q_heads", perm=[0, 2, 1, 3])  # [b, h, s, dh]
    k = g.op("Transpose", k, hint="k_heads_t", perm=[0, 2, 3, 1])  # [b, h, dh, s]
    v = g.op("Transpose", v, hint="v_heads", perm=[0, 2, 1, 3])  # [b, h, s, dh]
    scores = g.op("MatMul", q, k, hint="scores")
    scores = g.op("Mul", scores, g.const(np.float32(1 / math.sqrt(dh)), "attn_scale"), hint="scaled_scores")
    attn = g.op("Softmax", scores, axis=-1)
    ctx = g.op("MatMul", attn, v, hint="context")  # [b, h, s, dh]
    ctx = g.op("Transpose", ctx, hint="context_merge", perm=[0, 2, 1, 3])  # [b, s, h, dh]
    batch_seq = g.op("Gather", g.op("Shape", x), g.const([0, 1], "batch_seq_idx"), hint="batch_seq", axis=0)
    merged_shape = g.op("Concat", batch_seq, g.const([d_model], "d_model"), hint="merged_shape", axis=0)
    ctx = g.op("Reshape", ctx, merged_shape, hint="merge_heads")  # [b, s, d_model]
    h = g.op("Add", x, proj(ctx, d_model, d_model, "out_proj"), hint="attn_residual")

    # --- feed-forward with Gelu(u) = 0.5 * u * (1 + erf(u / sqrt 2)) ---
    ln2 = layer_norm(h, "ln2")
    u = proj(ln2, d_model, ff, "ff1")
    e = g.op("Erf", g.op("Mul", u, g.const(np.float32(1 / math.sqrt(2)), "gelu_inv_sqrt2"), hint="gelu_scale"))
    e = g.op("Add", e, g.const(np.float32(1.0), "one"), hint="gelu_one_plus")
    gelu = g.op("Mul", g.op("Mul", u, e, hint="gelu_u_times"), g.const(np.float32(0.5), "half"), hint="gelu")
    f = proj(gelu, ff, d_model, "ff2")
    g.op("Add", h, f, out="y", hint="ffn_residual")
    g.output("y", [BATCH, "seq", d_model])
    return g.model(transformer_block.__doc__ or "")


_ACTIVATIONS = ("Relu", "Tanh", "Sigmoid")


def wide_fanout(branches: int = 10, width: int = 32, seed: int = 0) -> onnx.ModelProto:
    """One input ``x`` [batch, width] feeding ``branches`` parallel MLPs -> ``y`` [batch, width].

    Branch ``i`` has depth ``1 + i % 4`` and hidden width ``width/2 * (1 + i % 3)``, so the
    branches differ in cost; a Concat joins them and a final MatMul mixes them. This is the
    shape that rewards many parallel workers and punishes a partitioner that ignores fan-out.
    """
    _check_positive(branches=branches, width=width)
    g = _GraphBuilder("wide_fanout", seed)
    x = g.input("x", [BATCH, width])
    ends: list[str] = []
    total = 0
    for i in range(branches):
        depth = 1 + i % 4
        hidden = max(width // 2, 1) * (1 + i % 3)
        act = _ACTIVATIONS[i % len(_ACTIVATIONS)]
        h, n_in = x, width
        for _ in range(depth):
            h = g.dense(h, n_in, hidden, act=act)
            n_in = hidden
        ends.append(h)
        total += hidden
    merged = g.op("Concat", *ends, hint="merge", axis=1)
    g.op("MatMul", merged, g.weight([total, width], total, 1.0, hint="w_final"), out="y", hint="final")
    g.output("y", [BATCH, width])
    return g.model(wide_fanout.__doc__ or "")


def if_model(seed: int = 0) -> onnx.ModelProto:
    """Control flow: ``x`` [batch, 16] -> ``y`` [batch, 8] through an ``If`` node.

    ``cond = ReduceSum(x) > 0`` is computed in-graph. Both branches read the outer tensor
    ``h`` (a node output, not an initializer); the then-branch also reads an outer-scope
    initializer, the else-branch the graph input ``x`` and its own local initializer. A
    partitioner must count these implicit subgraph inputs as edges into the If node, and
    an exporter must carry them into whatever part holds it.
    """
    width, out_width = 16, 8
    g = _GraphBuilder("if_model", seed)
    x = g.input("x", [BATCH, width])
    h = g.dense(x, width, width, act="Relu")
    total = g.op("ReduceSum", x, hint="sum_x", keepdims=0)
    cond = g.op("Greater", total, g.const(np.float32(0.0), "zero"), hint="cond")

    then_w = g.weight([width, width], width, 2.0, hint="then_w")  # outer-scope initializer
    tb = g.subgraph("then_branch")
    tb.op("Relu", tb.op("MatMul", h, then_w, hint="then_matmul"), out="then_out", hint="then_relu")
    tb.output("then_out", [BATCH, width])

    eb = g.subgraph("else_branch")
    else_w = eb.weight([width, width], width, 1.0, hint="else_w")  # initializer local to the branch
    t = eb.op("Add", eb.op("MatMul", h, else_w, hint="else_matmul"), x, hint="else_add_x")
    eb.op("Tanh", t, out="else_out", hint="else_tanh")
    eb.output("else_out", [BATCH, width])

    branch = g.op("If", cond, hint="if", then_branch=tb.graph(), else_branch=eb.graph())
    z = g.op("Add", branch, h, hint="after_if_add")
    g.dense(z, width, out_width, act=None, out="y")
    g.output("y", [BATCH, out_width])
    return g.model(if_model.__doc__ or "")


def multi_head_detector(seed: int = 0) -> onnx.ModelProto:
    """SSD-style detector: ``x`` [batch, 3, 64, 64] -> ``boxes`` [batch, N, 4], ``scores`` [batch, N, 5].

    A stride-2 conv backbone yields three feature scales (16x16, 8x8, 4x4); each has its own
    class head and box head (3x3 convs, 3 anchors), reshaped to [batch, -1, k] and
    concatenated over scales, so N = 3 * (256 + 64 + 16) = 1008. Two outputs fed by six heads
    branching off a chain: the partition must deliver several results from different parts.
    """
    size, anchors, classes = 64, 3, 5
    g = _GraphBuilder("multi_head_detector", seed)
    h = g.input("x", [BATCH, 3, size, size])
    h = g.conv(h, 3, 16, stride=2, hint="stem")
    s = _same_pad_out(size, 2)
    features: list[tuple[str, int, int]] = []  # (tensor, channels, spatial size)
    c_in = 16
    for i, c_out in enumerate((32, 64, 64)):
        h = g.conv(h, c_in, c_out, stride=2, hint=f"down{i}")
        h = g.conv(h, c_out, c_out, hint=f"feat{i}")
        s = _same_pad_out(s, 2)
        features.append((h, c_out, s))
        c_in = c_out
    score_parts: list[str] = []
    box_parts: list[str] = []
    n_anchors = 0
    for i, (f, c, s) in enumerate(features):
        for kind, k, parts in (("cls", classes, score_parts), ("box", 4, box_parts)):
            t = g.conv(f, c, anchors * k, act=False, gain=1.0, hint=f"{kind}_head{i}")
            t = g.op("Transpose", t, hint=f"{kind}_nhwc{i}", perm=[0, 2, 3, 1])
            parts.append(g.op("Reshape", t, g.const([0, -1, k], f"{kind}_shape"), hint=f"{kind}_flat{i}"))
        n_anchors += anchors * s * s
    logits = g.op("Concat", *score_parts, hint="cls_concat", axis=1)
    g.op("Sigmoid", logits, out="scores", hint="cls_sigmoid")
    g.op("Concat", *box_parts, out="boxes", hint="box_concat", axis=1)
    g.output("boxes", [BATCH, n_anchors, 4])
    g.output("scores", [BATCH, n_anchors, classes])
    return g.model(multi_head_detector.__doc__ or "")


#: Vocabulary size of each categorical field of :func:`wide_and_deep`.
WIDE_AND_DEEP_VOCABS: tuple[int, ...] = (1000, 500, 100, 50, 20, 10, 2000, 300)


def wide_and_deep(seed: int = 0) -> onnx.ModelProto:
    """Wide & Deep recommender: ``ids`` int64 [batch, 8], ``dense`` [batch, 13] -> ``logit`` [batch, 1].

    Deep tower: each id column is hashed into its table with ``Mod`` (so *any* int64 id,
    negative included, is a valid index), looked up with Gather in its own embedding table,
    concatenated with ``dense`` and sent through a 3-layer MLP. Wide part: a linear map of
    ``dense``. The two are summed. Exercises integer inputs, Gather on large initializers
    (memory-heavy parts) and a model with two inputs of different dtypes.
    """
    emb, n_dense = 16, 13
    fields = len(WIDE_AND_DEEP_VOCABS)
    g = _GraphBuilder("wide_and_deep", seed)
    ids = g.input("ids", [BATCH, fields], TensorProto.INT64)
    dense = g.input("dense", [BATCH, n_dense])
    embs = []
    for i, vocab in enumerate(WIDE_AND_DEEP_VOCABS):
        col = g.op("Gather", ids, g.const(np.int64(i), "field_idx"), hint=f"field{i}", axis=1)
        idx = g.op("Mod", col, g.const(np.int64(vocab), "vocab"), hint=f"hash{i}")
        table = g.const((g.rng.standard_normal((vocab, emb)) * 0.5).astype(np.float32), f"emb_table{i}")
        embs.append(g.op("Gather", table, idx, hint=f"embed{i}", axis=0))
    deep = g.op("Concat", *embs, dense, hint="deep_concat", axis=1)
    n = fields * emb + n_dense
    for width in (64, 32):
        deep = g.dense(deep, n, width, act="Relu")
        n = width
    deep = g.dense(deep, n, 1, act=None)
    wide = g.dense(dense, n_dense, 1, act=None)
    g.op("Add", deep, wide, out="logit", hint="wide_plus_deep")
    g.output("logit", [BATCH, 1])
    return g.model(wide_and_deep.__doc__ or "")


# Ops of random_dag by number of inputs. Bounds on |output| given bounds on |inputs| let the
# generator swap an op that could overflow for a bounded one, so outputs stay finite.
_UNARY = ("Relu", "Tanh", "Sigmoid", "MatMul", "MatMul")
_BINARY = ("Add", "Sub", "Mul", "Max", "Min")
_VARIADIC = ("Sum", "Mean", "Max", "Min")
_INPUT_BOUND = 6.0  # assumed |feed| bound (standard-normal feeds)
_BOUND_LIMIT = 1e3


def random_dag(n_nodes: int, seed: int, max_fanin: int = 3, width: int = 16) -> onnx.ModelProto:
    """A random DAG of exactly ``n_nodes`` nodes on [batch, width] float tensors.

    One or two inputs (``x0``, ``x1``). Each node reads 1..``max_fanin`` distinct earlier
    tensors (biased towards recent ones, so the DAG has depth as well as random fan-out):
    one input -> Relu/Tanh/Sigmoid/MatMul with a weight; two -> Add/Sub/Mul/Max/Min; more ->
    Sum/Mean/Max/Min. Every node output that nothing reads is a graph output (keeping its
    name ``t_K``), so there are no dead nodes. Ops that could overflow are replaced by bounded
    ones (Tanh, Mean), so outputs are finite for standard-normal feeds. Deterministic in
    ``seed``; used by property tests of the partitioner.
    """
    _check_positive(n_nodes=n_nodes, max_fanin=max_fanin, width=width)
    g = _GraphBuilder("random_dag", seed)
    rng = g.rng
    n_inputs = 1 if n_nodes < 2 else int(rng.integers(1, 3))
    pool = [g.input(f"x{i}", [BATCH, width]) for i in range(n_inputs)]
    bound = {name: _INPUT_BOUND for name in pool}
    consumed: set[str] = set()
    for k in range(n_nodes):
        args = [pool[k]] if k < n_inputs else []  # every input gets read
        fanin = min(max(int(rng.integers(1, max_fanin + 1)), len(args)), len(pool))
        others = [t for t in pool if t not in args]
        n_more = fanin - len(args)
        if n_more:
            p = np.arange(1, len(others) + 1, dtype=np.float64)  # recency bias
            picks = rng.choice(len(others), size=n_more, replace=False, p=p / p.sum())
            args += [others[j] for j in sorted(picks)]
        op, b, w = _dag_op(rng, [bound[a] for a in args], width)
        inputs = args + ([g.const(w, "w")] if w is not None else [])
        name = f"t_{k}"
        g.nodes.append(helper.make_node(op, inputs, [name], name=f"n{k}_{op}"))
        bound[name] = b
        pool.append(name)
        consumed.update(args)
    for t in pool[n_inputs:]:
        if t not in consumed:
            g.output(t, [BATCH, width])
    return g.model(random_dag.__doc__ or "")


def _dag_op(rng: np.random.Generator, bounds: list[float], width: int) -> tuple[str, float, np.ndarray | None]:
    """Pick the op of one random_dag node from its input bounds: (op, output bound, weight)."""
    if len(bounds) == 1:
        op = str(rng.choice(_UNARY))
        if op == "MatMul":
            w = (rng.standard_normal((width, width)) / math.sqrt(width)).astype(np.float32)
            b = bounds[0] * float(np.abs(w).sum(axis=0).max())
            if b <= _BOUND_LIMIT:
                return op, b, w
            op = "Tanh"
        return op, bounds[0] if op == "Relu" else 1.0, None
    op = str(rng.choice(_BINARY if len(bounds) == 2 else _VARIADIC))
    if op in ("Add", "Sub", "Sum"):
        b = sum(bounds)
    elif op == "Mul":
        b = math.prod(bounds)
    else:
        b = max(bounds)
    if b > _BOUND_LIMIT:
        op, b = "Mean", max(bounds)
    return op, b, None


def _check_positive(**sizes: int) -> None:
    for key, value in sizes.items():
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")


#: Default builder of every named zoo model (used by tests and by ``staronnx demo --model``).
ZOO: dict[str, Callable[[], onnx.ModelProto]] = {
    "chain": chain,
    "residual": residual,
    "inception": inception,
    "transformer": transformer_block,
    "wide_fanout": wide_fanout,
    "if": if_model,
    "detector": multi_head_detector,
    "wide_and_deep": wide_and_deep,
}


def fragile() -> onnx.ModelProto:
    """A chain whose last MatMul needs the dynamic dim ``d`` to be 8: feeds with another ``d``
    pass every signature check and then fail inside ONNX Runtime, which is how tests make
    one request's task fail while the others go on. Partition it with ``input_shapes=["x=1x8"]``."""
    g = _GraphBuilder("fragile")
    h = g.op("Tanh", g.op("Relu", g.input("x", [BATCH, "d"])))
    g.op("MatMul", h, g.const(np.random.default_rng(0).standard_normal((8, 4)), "w"), out="y", hint="mm")
    g.output("y", [BATCH, 4])
    return g.model()
