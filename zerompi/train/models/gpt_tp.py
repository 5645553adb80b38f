"""The GPT, tensor-parallel as Megatron-LM does it, on the plain array code (gpt_numpy.py).

Each TP rank holds 1/K of every block's matrices: QKV column-parallel (its n_head/K heads' q, k and
v columns), the attention projection row-parallel (the rows its heads' outputs multiply), fc
column-parallel, out row-parallel. One all-reduce in the forward after each row-parallel layer
(before its replicated bias is added), one in the backward on each column-parallel layer's input
gradient: 2 + 2 per block, of B·T·d_model values each. Embeddings (the tied head too), LayerNorms
and the row-parallel biases are replicated; their inputs and upstream gradients are the same on
every TP rank after those all-reduces (summed in rank order: the same bits), so are their gradients.

Parameter names are the full model's; shapes are the pieces' (tp_split() says how each is cut,
comm/tpsplit.py). lazy_layers() cuts the full model's rules into pieces (engine/lazy.Piece), so a run
at any TP size starts from the same model, and no rank makes more than its shard of its pieces.
"""
from typing import Dict, Tuple

import numpy as np

from ...comm.tpsplit import check_divides
from ...engine import lazy
from .gpt import GPT
from .gpt_sp import check_sp_model, sequence_parallel
from .gpt_numpy import gelu, layernorm, linear, NumpyLayers

# Short block name -> (axis, groups) of its split; the block's other parameters are replicated.
SPLIT = {"qkv.w": (1, 3), "qkv.b": (0, 3), "proj.w": (0, 1), "fc.w": (1, 1), "fc.b": (0, 1), "out.w": (0, 1)}


def _matmul(x, w):
    """x @ w on the last axis, without a bias (a row-parallel layer's partial sum), contiguous."""
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(x.shape[:-1] + (w.shape[1],))


class TPLayers(NumpyLayers):
    """A block of this TP rank's heads and fc columns; the final LayerNorm as NumpyLayers'."""

    name = "numpy-tp"

    def __init__(self, xp, n_head_local: int, tp):
        super().__init__(xp, n_head_local)
        self.tp = tp

    def _reduce(self, x):
        return self.tp.all_reduce(np.ascontiguousarray(x))

    def block_forward(self, p, x, ws=None, key=None):
        xp = self.xp
        a, ln1 = layernorm(xp, x, p["ln1.g"], p["ln1.b"])
        y, att = self.attention.forward(linear(a, p["qkv.w"], p["qkv.b"]))        # column-parallel
        x1 = x + (self._reduce(_matmul(y, p["proj.w"])) + p["proj.b"])            # row-parallel + all-reduce
        m, ln2 = layernorm(xp, x1, p["ln2.g"], p["ln2.b"])
        f = linear(m, p["fc.w"], p["fc.b"])                                       # column-parallel
        gf, t = gelu(xp, f)
        out = x1 + (self._reduce(_matmul(gf, p["out.w"])) + p["out.b"])          # row-parallel + all-reduce
        return out, (ln1, a, att, y, ln2, m, f, t, gf)

    def block_backward(self, p, cache, dout, ws=None, key=None):
        dx, weights = self.block_backward_parts(p, cache, dout)
        return dx, weights()

    def block_backward_parts(self, p, cache, dout, ws=None, key=None, keep=False, reduce=None):
        """NumpyLayers' with the all-reduce of fc's and QKV's input gradients (column-parallel)."""
        return super().block_backward_parts(p, cache, dout, reduce=self._reduce)


class TPGPT(GPT):
    """GPT whose blocks are split over the TP group ``tp`` (a TPComm: rank, size, all_reduce); with ``sp``
    (an SPComm) each TP rank's heads sequence-parallel too (gpt_sp.py)."""

    def __init__(self, vocab: int, seq_len: int, n_layer: int, n_head: int, d_model: int, seed: int = 0,
                 xp=np, dtype=np.float32, tp=None, sp=None):
        check_divides(tp.size, n_head=n_head, d_model=d_model)
        if sp is not None and sp.size > 1:           # the heads are split by TP first, then by SP
            check_sp_model(sp.size, n_head, seq_len, tp.size)
        super().__init__(vocab, seq_len, n_layer, n_head, d_model, seed, xp, dtype, kernels="numpy", sp=sp)
        self.tp = tp
        self.layers = sequence_parallel(TPLayers(xp, n_head // tp.size, tp), self.sp)

    def tp_split(self) -> Dict[str, Tuple[int, int]]:
        """{parameter name: (axis, groups)} of the split parameters (the engine's tp_split)."""
        return {f"block{i}.{k}": s for i in range(self.n_layer) for k, s in SPLIT.items()}

    def lazy_layers(self):
        """The full model's rules, each split parameter cut to this TP rank's piece (lazy.Piece)."""
        split, r, k = self.tp_split(), self.tp.rank, self.tp.size
        return [(lname, {n: lazy.Piece(a, *split[n], r, k) if n in split else a for n, a in params.items()})
                for lname, params in super().lazy_layers()]

    def init_layers(self):
        """lazy_layers() made whole: this TP rank's pieces as float32 arrays."""
        return lazy.materialize(self.lazy_layers())

    def tp_bytes_per_micro_batch(self, rows: int, itemsize: int = 4) -> int:
        """Bytes one rank sends in the TP all-reduces of one micro-batch of ``rows`` sequences:
        4 per block (2 forward, 2 backward) of rows·t·d_model values (t: the positions this rank holds,
        seq_len / sp), 2(K-1)/K of each."""
        k, t = self.tp.size, self.seq_len // (self.sp.size if self.sp else 1)
        return self.n_layer * 4 * 2 * (k - 1) * (rows * t * self.d_model // k) * itemsize
