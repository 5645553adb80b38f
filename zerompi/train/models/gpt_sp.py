"""The GPT's attention, sequence-parallel as DeepSpeed-Ulysses does it.

K ranks hold K chunks of every sequence; around the attention core two all-to-alls trade (the chunk, all of
this rank's heads) for (the whole sequence, 1/K of them) and back, the other way round in the backward.
SPAttention wraps the plain array code, SPFusedAttention the C kernels, whose all-to-all buffers come from
the workspace (measured activations). docs/sequence-parallel.md has the design and the bytes.
"""
import numpy as np

from .gpt_fast import FRESH, FusedAttention, FusedLayers, Workspace
from .gpt_numpy import Attention, attention, attention_backward

SHARED = "sp"      # the workspace key of the buffers every SP block shares: (SHARED, name), flat


def check_sp_model(sp_size: int, n_head: int, seq_len: int, tp: int = 1) -> None:
    """ValueError naming the value unless ``sp_size`` divides this rank's heads (n_head / tp) and seq_len."""
    if n_head % (tp * sp_size):
        heads = f"n_head={n_head}" if tp == 1 else f"the {n_head // tp} heads per TP rank (n_head={n_head}, tp={tp})"
        raise ValueError(f"sp={sp_size} does not divide {heads}; each sequence-parallel rank attends to 1/sp of them")
    if seq_len % sp_size:
        raise ValueError(f"sp={sp_size} does not divide seq_len={seq_len}; each rank holds seq_len/sp positions")


def sequence_parallel(layers, sp):
    """``layers`` with its attention sequence-parallel over ``sp`` (None or a group of one: unchanged)."""
    if sp is None or sp.size == 1:
        return layers
    if isinstance(layers, FusedLayers):
        layers.attention = SPFusedAttention(layers.k, layers.n_head, sp)
    else:
        layers.attention = SPAttention(layers.xp, layers.n_head, sp)
    return layers


class SPAttention(Attention):
    """The attention core over the whole sequence for 1/K of this rank's heads, on the plain array code."""

    def __init__(self, xp, n_head: int, sp):
        super().__init__(xp, n_head)
        self.sp = sp

    def forward(self, qkv):
        B, t, c3 = qkv.shape
        k, H = self.sp.size, self.n_head
        hd = c3 // (3 * H)
        full = self.sp.all_to_all(self.xp.ascontiguousarray(qkv).reshape(B, t, 3, H, hd), 3, 1)   # (B, T, 3, H/K, hd)
        y, cache = attention(self.xp, full.reshape(B, k * t, -1), H // k)
        out = self.sp.all_to_all(y.reshape(B, k * t, H // k, hd), 1, 2)                      # (B, t, H, hd)
        return out.reshape(B, t, H * hd), cache

    def backward(self, dy, cache):
        B, t, c = dy.shape
        k, H = self.sp.size, self.n_head
        hd = c // H
        dfull = self.sp.all_to_all(self.xp.ascontiguousarray(dy).reshape(B, t, H, hd), 2, 1)     # (B, T, H/K, hd)
        dqkv = attention_backward(self.xp, dfull.reshape(B, k * t, -1), cache)                # (B, T, 3C/K)
        return self.sp.all_to_all(dqkv.reshape(B, k * t, 3, H // k, hd), 1, 3).reshape(B, t, 3 * c)


class SPFusedAttention(FusedAttention):
    """The same with the C kernels, every array from the workspace (module docstring: which are kept)."""

    def __init__(self, kernels, n_head: int, sp):
        super().__init__(kernels, n_head)
        self.sp = sp

    def _shared(self, ws: Workspace, name: str, size: int) -> np.ndarray:
        return ws.get((SHARED, name), (size,), self.dtype)

    def qkv_buffer(self, ws: Workspace, key, n: int, c: int) -> np.ndarray:
        """The chunk's qkv: shared, its all-to-all has moved it before the next block writes it."""
        return self._shared(ws, "qkv", 3 * n * c).reshape(n, 3 * c)

    def _exchange(self, x, scatter: int, gather: int, out, ws: Workspace, size: int) -> None:
        """The all-to-all through the shared send and receive blocks of ``size`` elements each (3 n C:
        the largest exchange, q, k and v)."""
        self.sp.all_to_all(x, scatter, gather, out, self._shared(ws, "send", size), self._shared(ws, "recv", size))

    def forward(self, qkv, B: int, t: int, ws: Workspace = FRESH, key=None):
        k, H = self.sp.size, self.n_head
        n, c = qkv.shape[0], qkv.shape[1] // 3
        hd, T, h = c // H, k * t, H // k
        full = ws.get((key, "qkv_full"), (B * T, 3 * c // k), self.dtype)      # kept: the backward reads q, k, v
        self._exchange(qkv.reshape(B, t, 3, H, hd), 3, 1, full.reshape(B, T, 3, h, hd), ws, 3 * n * c)
        att = ws.get((key, "att"), (B, h, T, T), self.dtype)
        heads = self._shared(ws, "heads", n * c).reshape(B * T, c // k)
        scale = self.core(full, B, T, h, att, heads)
        y = ws.get((key, "y"), (n, c), self.dtype)
        self._exchange(heads.reshape(B, T, h, hd), 1, 2, y.reshape(B, t, H, hd), ws, 3 * n * c)
        return y, (full, att, scale)

    def backward(self, cache, dy, ws: Workspace = FRESH, out=None):
        full, att, scale = cache
        B, h, T, _ = att.shape
        k, H = self.sp.size, self.n_head
        n, c = dy.shape
        hd, t = c // H, T // k
        dheads = self._shared(ws, "heads", n * c).reshape(B * T, c // k)
        self._exchange(dy.reshape(B, t, H, hd), 2, 1, dheads.reshape(B, T, h, hd), ws, 3 * n * c)
        dfull = self._shared(ws, "qkv", 3 * n * c).reshape(B * T, 3 * c // k)
        self.core_backward(full, att, scale, dheads, dfull, ws.get(("block", "datt"), att.shape, self.dtype))
        dqkv = ws.get(("block", "dqkv"), (n, 3 * c), self.dtype) if out is None else out
        self._exchange(dfull.reshape(B, T, 3, h, hd), 1, 3, dqkv.reshape(B, t, 3, H, hd), ws, 3 * n * c)
        return dqkv
