"""The GPT's blocks on the CPU at the speed of their matrix multiplies: gpt_numpy.NumpyLayers' mathematics with
one matrix multiply per linear layer into its buffer, the elementwise passes in the C kernels (model_kernels.py),
attention on views of qkv, every buffer from a Workspace; float32/float64 NumPy only. docs/gpt.md ("Speed").
"""
from typing import Dict, Optional, Tuple

import numpy as np

from .gpt_numpy import LN_EPS

# The block gradients computed with the input gradient (the rest are the weight multiplies' and their bias sums).
KEPT_GRADS = ("fc.b", "ln2.g", "ln2.b", "ln1.g", "ln1.b")


class Workspace:
    """Arrays by key: ``persistent`` hands the same one back while shape and dtype match, else a new one each time."""

    def __init__(self, persistent: bool = True):
        self.persistent = persistent
        self._arrays: Dict[Tuple, np.ndarray] = {}

    def get(self, key, shape, dtype) -> np.ndarray:
        if not self.persistent:
            return np.empty(shape, dtype)
        a = self._arrays.get(key)
        if a is None or a.shape != tuple(shape) or a.dtype != dtype:
            a = self._arrays[key] = np.empty(shape, dtype)
        return a

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays.values())

    def clear(self) -> None:
        self._arrays.clear()


FRESH = Workspace(persistent=False)


def _heads(qkv, B: int, T: int, H: int):
    """q, k, v as (B, H, T, hd) views of a (B*T, 3C) array (no copies)."""
    hd = qkv.shape[-1] // (3 * H)
    v = qkv.reshape(B, T, 3, H, hd)
    return tuple(v[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


class FusedAttention:
    """The causal attention core of one block on this rank's ``n_head`` heads with the C kernels, reading q, k, v
    where the qkv projection wrote them (gpt_sp.py's SPFusedAttention: over a sequence-parallel rank's chunk)."""

    def __init__(self, kernels, n_head: int):
        self.k, self.n_head, self.dtype = kernels, n_head, kernels.dtype

    def qkv_buffer(self, ws: Workspace, key, n: int, c: int) -> np.ndarray:
        """Where the qkv projection writes (n, 3C): the layer's own, kept for the backward."""
        return ws.get((key, "qkv"), (n, 3 * c), self.dtype)

    def forward(self, qkv, B: int, T: int, ws: Workspace = FRESH, key=None):
        """(y (B*T, C), cache) of qkv (B*T, 3C)."""
        H, C = self.n_head, qkv.shape[1] // 3
        att, y = ws.get((key, "att"), (B, H, T, T), self.dtype), ws.get((key, "y"), (B * T, C), self.dtype)
        scale = self.core(qkv, B, T, H, att, y)
        return y, (qkv, att, scale)

    def backward(self, cache, dy, ws: Workspace = FRESH, out=None):
        """d qkv (B*T, 3C) of upstream dy (B*T, C): into ``out``, else a buffer every block shares."""
        qkv, att, scale = cache
        dqkv = ws.get(("block", "dqkv"), qkv.shape, self.dtype) if out is None else out
        self.core_backward(qkv, att, scale, dy, dqkv, ws.get(("block", "datt"), att.shape, self.dtype))
        return dqkv

    def core(self, qkv, B: int, T: int, H: int, att, y) -> float:
        """softmax(q k^T * scale, causal) v of qkv (B*T, 3 H hd) into y, probabilities into att; returns the scale."""
        q, kk, v = _heads(qkv, B, T, H)
        scale = 1.0 / float(np.sqrt(qkv.shape[1] // (3 * H)))
        np.matmul(q, kk.transpose(0, 1, 3, 2), out=att)
        self.k.softmax_causal_fwd(att, scale)
        np.matmul(att, v, out=y.reshape(B, T, H, -1).transpose(0, 2, 1, 3))
        return scale

    def core_backward(self, qkv, att, scale: float, dy, dqkv, datt) -> None:
        """d qkv (B*T, 3 H hd) of :meth:`core` for upstream dy (B*T, H hd); datt: (B, H, T, T) scratch."""
        B, H, T, _ = att.shape
        q, kk, v = _heads(qkv, B, T, H)
        dq, dk, dv = _heads(dqkv, B, T, H)
        dy4 = dy.reshape(B, T, H, -1).transpose(0, 2, 1, 3)
        np.matmul(att.transpose(0, 1, 3, 2), dy4, out=dv)
        np.matmul(dy4, v.transpose(0, 1, 3, 2), out=datt)
        self.k.softmax_causal_bwd(datt, att, scale)          # the scale is folded in here
        np.matmul(datt, kk, out=dq)
        np.matmul(datt.transpose(0, 1, 3, 2), q, out=dk)


class FusedLayers:
    """A transformer block and the final LayerNorm with the C kernels on NumPy, buffers from ``ws`` under the layer's
    ``key``: its cache, output and input gradient its own; a backward's scratch and gradients shared by all blocks.
    """

    name = "c"

    def __init__(self, kernels, n_head: int, tp=None):
        self.k, self.n_head, self.dtype, self.tp = kernels, n_head, kernels.dtype, tp
        self.attention = FusedAttention(kernels, n_head)

    def reduce(self, x) -> None:
        """The TP all-reduce, in place, of a row-parallel layer's partial sums or a column-parallel layer's dx."""
        if self.tp is not None:
            self.tp.all_reduce(x)

    @staticmethod
    def _flat(x):
        return np.ascontiguousarray(x).reshape(-1, x.shape[-1])

    def _p(self, p, name):
        return np.ascontiguousarray(p[name], dtype=self.dtype)

    # ---- the final LayerNorm ---------------------------------------------------------------
    def ln_forward(self, x, g, b, ws: Workspace = FRESH, key=None):
        x2 = self._flat(x)
        rows, c = x2.shape
        y = ws.get((key, "y"), x2.shape, self.dtype)
        mean, rstd = ws.get((key, "mean"), (rows,), self.dtype), ws.get((key, "rstd"), (rows,), self.dtype)
        self.k.layernorm_fwd(x2, np.ascontiguousarray(g), np.ascontiguousarray(b), y, mean, rstd, LN_EPS)
        return y.reshape(x.shape), (x2, mean, rstd)

    def ln_backward(self, dy, cache, g, ws: Workspace = FRESH, key=None):
        x2, mean, rstd = cache
        c = x2.shape[1]
        dx = ws.get((key, "dx"), x2.shape, self.dtype)
        dg, db = np.empty(c, self.dtype), np.empty(c, self.dtype)
        self.k.layernorm_bwd(self._flat(dy), x2, mean, rstd, np.ascontiguousarray(g), None, dx, dg, db)
        return dx.reshape(dy.shape), dg, db

    # ---- a transformer block ----------------------------------------------------------------
    def _buffers(self, ws: Workspace, key, keep: bool):
        """(shared, kept): ``f(name, shape)`` of a buffer every block shares, and of one the layer keeps for its
        later W (its own with ``keep``, else a shared one too)."""
        shared = lambda name, shape: ws.get(("block", name), shape, self.dtype)   # noqa: E731
        return shared, (lambda name, shape: ws.get((key, name), shape, self.dtype)) if keep else shared

    def _grads(self, p, names, ws: Workspace, key, keep: bool) -> Dict[str, np.ndarray]:
        """The gradient buffers of ``names``: those computed with the input gradient (KEPT_GRADS) in the layer's
        own when ``keep``, the rest (and all without ``keep``) in buffers every block shares."""
        shared, kept = self._buffers(ws, key, keep)
        return {name: (kept if name in KEPT_GRADS else shared)("g." + name, self._p(p, name).shape) for name in names}

    def attention_half_forward(self, p, x, ws: Workspace = FRESH, key=None):
        """(x1, m, cache) of a block's attention half: x1 = x + proj(attention(ln1(x))) and m = ln2(x1), both
        (B*T, C) in the layer's own buffers; what the MLP half reads (the dense MLP, or moe/block.py's MoE)."""
        k, dt = self.k, self.dtype
        B, T, C = x.shape
        n, c = B * T, p["qkv.w"].shape[1] // 3                 # c: this TP rank's
        own = lambda name, shape: ws.get((key, name), shape, dt)
        x2 = self._flat(x)
        a, mu1, rs1 = own("a", (n, C)), own("mu1", (n,)), own("rs1", (n,))
        k.layernorm_fwd(x2, self._p(p, "ln1.g"), self._p(p, "ln1.b"), a, mu1, rs1, LN_EPS)
        qkv = self.attention.qkv_buffer(ws, key, n, c)
        np.matmul(a, self._p(p, "qkv.w"), out=qkv)
        qkv += self._p(p, "qkv.b")
        y, attn = self.attention.forward(qkv, B, T, ws, key)
        x1 = own("x1", (n, C))
        np.matmul(y, self._p(p, "proj.w"), out=x1)
        self.reduce(x1)                                       # row-parallel under TP
        k.bias_residual(x1, x2, self._p(p, "proj.b"))
        m, mu2, rs2 = own("m", (n, C)), own("mu2", (n,)), own("rs2", (n,))
        k.layernorm_fwd(x1, self._p(p, "ln2.g"), self._p(p, "ln2.b"), m, mu2, rs2, LN_EPS)
        return x1, m, (x2, mu1, rs1, a, attn, y, x1, mu2, rs2, m)

    def attention_half_backward(self, p, cache, dm, dout2, g, ws: Workspace = FRESH, key=None, keep: bool = False):
        """(dx (B*T, C), weights) of :meth:`attention_half_forward`'s ``cache`` for dm, the gradient of m, and
        dout2, of x1 by the residual (both (B*T, C)); the LayerNorms' gradients into ``g`` now, ``weights()``
        the projections' (proj, qkv) into ``g`` later, from the layer's own buffers when ``keep``."""
        k, dt = self.k, self.dtype
        x2, mu1, rs1, a, attn, y, x1, mu2, rs2, m = cache
        n, C = x2.shape
        c = y.shape[1]                                        # this TP rank's channels of its heads
        shared, kept = self._buffers(ws, key, keep)
        dx1 = ws.get((key, "dx1"), (n, C), dt)
        k.layernorm_bwd(dm, x1, mu2, rs2, self._p(p, "ln2.g"), dout2, dx1, g["ln2.g"], g["ln2.b"])
        dy = shared("dy", (n, c))
        np.matmul(dx1, self._p(p, "proj.w").T, out=dy)
        dqkv = self.attention.backward(attn, dy, ws, out=kept("dqkv", (n, 3 * c)))
        da = shared("da", (n, C))
        np.matmul(dqkv, self._p(p, "qkv.w").T, out=da)
        self.reduce(da)
        dx = ws.get((key, "dx"), (n, C), dt)
        k.layernorm_bwd(da, x2, mu1, rs1, self._p(p, "ln1.g"), dx1, dx, g["ln1.g"], g["ln1.b"])

        def weights():
            np.matmul(y.T, dx1, out=g["proj.w"])
            dx1.sum(axis=0, out=g["proj.b"])
            np.matmul(a.T, dqkv, out=g["qkv.w"])
            dqkv.sum(axis=0, out=g["qkv.b"])
        return dx, weights

    def block_forward(self, p, x, ws: Workspace = FRESH, key=None):
        k, dt = self.k, self.dtype
        B, T, C = x.shape
        n, hidden = B * T, p["fc.w"].shape[1]                 # hidden: this TP rank's
        own = lambda name, shape: ws.get((key, name), shape, dt)
        x1, m, half = self.attention_half_forward(p, x, ws, key)
        f, gf = own("f", (n, hidden)), own("gf", (n, hidden))
        np.matmul(m, self._p(p, "fc.w"), out=f)
        k.gelu_fwd(f, self._p(p, "fc.b"), gf)
        out = own("out", (n, C))
        np.matmul(gf, self._p(p, "out.w"), out=out)
        self.reduce(out)
        k.bias_residual(out, x1, self._p(p, "out.b"))
        return out.reshape(B, T, C), half + (f, gf)

    def block_backward(self, p, cache, dout, ws: Workspace = FRESH, key=None):
        """(dx, {short name: grad}) of one block."""
        dx, weights = self.block_backward_parts(p, cache, dout, ws, key)
        return dx, weights()

    def block_backward_parts(self, p, cache, dout, ws: Workspace = FRESH, key=None, keep: bool = False):
        """(dx, weights) of one block: ``weights()`` -> {short name: grad} runs the four weight-gradient matrix
        multiplies and their bias sums (a zero-bubble schedule's W). What it reads lives in buffers every block
        shares, unless ``keep``: then in the layer's own, valid until its next backward. The same bits."""
        k = self.k
        half, (f, gf) = cache[:-2], cache[-2:]
        m = half[-1]
        n, hidden = f.shape                          # this TP rank's hidden
        shared, kept = self._buffers(ws, key, keep)
        g = self._grads(p, p, ws, key, keep)
        dout2 = self._flat(dout)
        dz = kept("dz", (n, hidden))
        np.matmul(dout2, self._p(p, "out.w").T, out=dz)
        k.gelu_bwd(dz, f, g["fc.b"])
        dm = shared("dm", (n, m.shape[1]))
        np.matmul(dz, self._p(p, "fc.w").T, out=dm)
        self.reduce(dm)                                       # column-parallel under TP
        dx, attention_weights = self.attention_half_backward(p, half, dm, dout2, g, ws, key, keep)

        def weights():
            np.matmul(gf.T, dout2, out=g["out.w"])
            dout2.sum(axis=0, out=g["out.b"])
            np.matmul(m.T, dz, out=g["fc.w"])
            attention_weights()
            return g
        return dx.reshape(dout.shape), weights


def fused_layers(xp, dtype, n_head: int, kernels: str, tp=None) -> Optional[FusedLayers]:
    """FusedLayers of ``n_head`` heads when ``kernels`` allows them and they run here (NumPy, float32/64, the C
    library loads), else None; RuntimeError when ``kernels="c"`` and they cannot."""
    if kernels == "numpy":
        return None
    from ..model_kernels import kernels_for, unavailable_reason
    k = kernels_for(dtype) if xp is np else None
    if k is None and kernels == "c":
        why = "they run on NumPy only" if xp is not np else (unavailable_reason() or f"dtype {np.dtype(dtype)}")
        raise RuntimeError(f"the GPT's C kernels cannot be used: {why}")
    return FusedLayers(k, n_head, tp) if k is not None else None
