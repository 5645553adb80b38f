"""The GPT's MoE block: pre-LayerNorm causal attention as the dense block's, then the MoE MLP (moe.py).

``MoEBlocks`` runs the blocks that ``MoESpec.is_moe`` picks: the attention half the dense block's own
(gpt_fast.py's FusedLayers on the C kernels, wherever the dense blocks run them; else gpt_numpy.py's pieces),
then moe.py's router and experts in array code, in the model's dtype; ``moe_params`` gives the engine their lazy
rules in the GPT's one stream of draws. Under tensor parallelism (``tp``) the
attention half is split as the dense block's (qkv column-, proj row-parallel: one all-reduce each way); the
router and the experts are whole on every TP rank, which route and run the same rows to the same bits. Under
sequence parallelism (``sp``) the attention core is gpt_sp.py's, and each SP rank routes its chunk's tokens,
the aux loss taken over the whole sequences (moe.py's ``Routing.share``).
"""
import numpy as np

from ..models.gpt_fast import FRESH
from ..models.gpt_numpy import Attention, layernorm, layernorm_backward, linear, linear_backward, matmul
from ..models.gpt_sp import SPAttention
from .mlp import EXPERT_KEYS, ROUTER, SHARED_KEYS, MoEMLP, MoESpec

ATTENTION_KEYS = ("ln1.g", "ln1.b", "qkv.w", "qkv.b", "proj.w", "proj.b", "ln2.g", "ln2.b")


def moe_keys(experts_apart: bool = False, shared: int = 0):
    """The short names of an MoE block's parameters, in the engine's order (``experts_apart``: without the
    routed experts', which then live in an engine of their own: moe/ep_mlp.py; ``shared``: the shared experts,
    dense parameters after the router, when there are any). The routed experts are last, so that the dense
    part of a block is its first parameters at every --ep (checkpoint consolidation keeps that order)."""
    return ATTENTION_KEYS + (ROUTER,) + (SHARED_KEYS if shared else ()) + (() if experts_apart else EXPERT_KEYS)


def moe_params(names, spec: MoESpec, C: int, normal, zeros, ones, resid: float) -> dict:
    """{param name: lazy rule} of one MoE block (``names``: short -> full), drawn in the order of moe_keys()."""
    E, H, S = spec.experts, spec.hidden, spec.shared
    out = {
        names["ln1.g"]: ones(C), names["ln1.b"]: zeros(C),
        names["qkv.w"]: normal((C, 3 * C)), names["qkv.b"]: zeros(3 * C),
        names["proj.w"]: normal((C, C), resid), names["proj.b"]: zeros(C),
        names["ln2.g"]: ones(C), names["ln2.b"]: zeros(C),
        names[ROUTER]: normal((C, E)),
    }
    if S:
        out.update({names["shared.fc.w"]: normal((S, C, H)), names["shared.fc.b"]: zeros((S, H)),
                    names["shared.out.w"]: normal((S, H, C), resid), names["shared.out.b"]: zeros((S, C))})
    out.update({names["experts.fc.w"]: normal((E, C, H)), names["experts.fc.b"]: zeros((E, H)),
                names["experts.out.w"]: normal((E, H, C), resid), names["experts.out.b"]: zeros((E, C))})
    return out


class MoEBlocks:
    """A transformer block whose MLP is the MoE, on ``xp`` in ``dtype`` with ``n_head`` heads (this TP rank's);
    ``tp``: the TP group (a TPComm) or None. ``layers``: the dense blocks' (models/gpt_fast.py's FusedLayers),
    whose attention half (LayerNorms, qkv, attention core, projection, residual; split under TP, SP's core) the
    MoE block then runs on the C kernels, in the workspace as a dense block; None: the plain array code here."""

    def __init__(self, spec: MoESpec, xp, dtype, n_head: int, tp=None, sp=None, layers=None):
        self.xp, self.n_head, self.tp = xp, n_head, tp
        self.fused = layers if getattr(layers, "name", None) == "c" else None
        self.attention = Attention(xp, n_head) if sp is None else SPAttention(xp, n_head, sp)
        self.mlp = MoEMLP(spec, xp, dtype)
        self.mlp.sp = sp

    def reduce(self, x):
        """The TP all-reduce of the projection's partial sums or the qkv layer's dx (else x)."""
        return x if self.tp is None else self.tp.all_reduce(self.xp.ascontiguousarray(x))

    def block_forward(self, p, x, block: int, ws=None, key=None):
        """(out, cache) of MoE block ``block`` (0-based) on x (B, T, C); ``ws``, ``key``: the workspace and the
        layer's key of the C kernels' path (default: new arrays)."""
        B, T, C = x.shape
        if self.fused is not None:
            ws = FRESH if ws is None else ws
            x1, m, half = self.fused.attention_half_forward(p, x, ws, key)
            mo, moe = self.mlp.forward(p, m, block, B)
            out = ws.get((key, "out"), (B * T, C), x1.dtype)
            np.add(x1, mo, out=out)
            return out.reshape(B, T, C), (half, moe)
        xp = self.xp
        a, ln1 = layernorm(xp, x, p["ln1.g"], p["ln1.b"])
        y, att = self.attention.forward(linear(a, p["qkv.w"], p["qkv.b"]))
        x1 = x + (self.reduce(matmul(y, p["proj.w"])) + p["proj.b"])      # row-parallel under TP
        m, ln2 = layernorm(xp, x1, p["ln2.g"], p["ln2.b"])
        mo, moe = self.mlp.forward(p, m.reshape(B * T, C), block, B)
        return x1 + mo.reshape(B, T, C), (ln1, a, att, y, ln2, moe)

    def block_backward(self, p, cache, dout, ws=None, key=None):
        """(dx, {short name: grad}) of one MoE block."""
        dx, weights = self.block_backward_parts(p, cache, dout, ws, key)
        return dx, weights()

    def block_backward_parts(self, p, cache, dout, ws=None, key=None, keep: bool = False):
        """(dx, weights) of one MoE block: the MoE MLP's gradients now (its exchanges are in the input gradient's
        pass), ``weights()`` -> {short name: grad} with the attention half's projections then, as a dense block's
        (on the C kernels' path; ``keep``: what they read in the layer's own buffers). The same bits."""
        B, T, C = dout.shape
        if self.fused is not None:
            ws = FRESH if ws is None else ws
            half, moe = cache
            dout2 = np.ascontiguousarray(dout).reshape(B * T, C)
            dm, g = self.mlp.backward(p, moe, dout2)
            g.update(self.fused._grads(p, ATTENTION_KEYS, ws, key, keep))
            dx, attention_weights = self.fused.attention_half_backward(p, half, dm, dout2, g, ws, key, keep)

            def weights():
                attention_weights()
                return g
            return dx.reshape(B, T, C), weights
        ln1, a, att, y, ln2, moe = cache
        dm, g = self.mlp.backward(p, moe, dout.reshape(B * T, C))
        dx1, g["ln2.g"], g["ln2.b"] = layernorm_backward(dm.reshape(B, T, C), ln2, p["ln2.g"])
        dx1 = dx1 + dout
        dy, g["proj.w"], g["proj.b"] = linear_backward(dx1, y, p["proj.w"])
        da, g["qkv.w"], g["qkv.b"] = linear_backward(self.attention.backward(dy, att), a, p["qkv.w"])
        dx, g["ln1.g"], g["ln1.b"] = layernorm_backward(self.reduce(da), ln1, p["ln1.g"])
        return dx + dx1, lambda: g
