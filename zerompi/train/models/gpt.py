"""GPT: a decoder-only transformer with hand-written forward and backward, one engine layer at a time.

Engine layers: 0 = ``embed`` (``wte``, ``wpe``), 1..L = ``block{i}`` (pre-LayerNorm causal attention, then a
GELU MLP), L+1 = ``ln_f``; the output head is tied to ``wte``. The blocks run on the C kernels (gpt_fast.py)
or plain array code (gpt_numpy.py), kept or recomputed (activations.py), split over TP (``TP_SPLIT``: Megatron-LM's
cut) or SP (gpt_sp.py); gpt_chunk.py walks them through the engine (pipelined or not). docs/gpt.md has the design.
"""
from contextlib import contextmanager
from typing import Dict, List, Tuple

import numpy as np

from ...comm.tp_pieces import check_divides
from ...engine import lazy
from ..model_kernels import upcast
from .activations import Keep, MeteredWorkspace, Recompute, scratch
from .gpt_fast import FRESH, Workspace, fused_layers
from .gpt_sp import check_sp_model, sequence_parallel
from .gpt_numpy import (LN_EPS, NumpyLayers, attention, attention_backward, gelu, gelu_grad, layernorm,
                        layernorm_backward, linear, linear_backward)

__all__ = ["GPT", "LN_EPS", "WPE", "WTE", "attention", "attention_backward", "gelu", "gelu_grad",
           "layernorm", "layernorm_backward", "linear", "linear_backward"]
WTE, WPE = "wte", "wpe"
KERNELS = ("auto", "c", "numpy")
# Short block name -> (axis, groups) of its tensor-parallel split; the block's other parameters are replicated.
TP_SPLIT = {"qkv.w": (1, 3), "qkv.b": (0, 3), "proj.w": (0, 1), "fc.w": (1, 1), "fc.b": (0, 1), "out.w": (0, 1)}


# ---- the model ------------------------------------------------------------------------
class GPT:
    """Sizes, initial parameters, and per-layer forward/backward in ``dtype`` on ``xp``."""

    def __init__(self, vocab: int, seq_len: int, n_layer: int, n_head: int, d_model: int, seed: int = 0,
                 xp=np, dtype=np.float32, kernels: str = "auto", checkpoint_activations: bool = False, sp=None,
                 tp=None, moe=None, initial=None):
        if d_model % n_head:
            raise ValueError(f"d_model={d_model} must be divisible by n_head={n_head}")
        if kernels not in KERNELS:
            raise ValueError(f"kernels={kernels!r} is not allowed; use one of {', '.join(KERNELS)}")
        self.vocab, self.seq_len, self.n_layer = vocab, seq_len, n_layer
        self.n_head, self.d_model, self.seed = n_head, d_model, seed
        self.xp, self.dtype = xp, dtype
        self.initial = initial     # None, or (name, fresh rule) -> the rule to use instead (train/hf_init.py)
        self.sp = sp if sp is not None and sp.size > 1 else None   # SPComm: this rank's chunk of each sequence
        self.tp = tp if tp is not None and tp.size > 1 else None   # TPComm: this rank's heads and MLP columns
        k = self.tp.size if self.tp else 1
        if self.tp:
            check_divides(k, n_head=n_head, d_model=d_model)
        if self.sp:                             # the heads are split by TP first, then by SP
            check_sp_model(sp.size, n_head, seq_len, k)
        heads = n_head // k
        self.layers = sequence_parallel(fused_layers(xp, dtype, heads, kernels, self.tp)
                                        or NumpyLayers(xp, heads, self.tp), self.sp)
        self.workspace = MeteredWorkspace()    # the engine driver's buffers, kept across steps
        self.checkpoint_activations = bool(checkpoint_activations)
        self.activations = (Recompute if checkpoint_activations else Keep)(self)   # how the driver runs layers
        self.moe = moe                         # moe/mlp.py's MoESpec: the MoE blocks (None: all dense)
        self.experts_apart = False             # --ep > 1: the experts live in an engine of their own (moe/ep_mlp.py)
        if moe is not None:
            from ..moe.block import MoEBlocks
            self.moe_blocks = MoEBlocks(moe, xp, dtype, heads, self.tp, self.sp, self.layers)

    @property
    def activation_bytes(self):
        """The most bytes of activations held at once so far (None on the plain array path and with MoE blocks:
        not all in the workspace)."""
        return self.workspace.peak if self.layers.name == "c" and self.moe is None else None

    def chunk(self, tokens: int) -> int:
        """The first position of this rank's chunk of ``tokens`` positions (0 without sequence parallelism)."""
        return self.sp.rank * tokens if self.sp else 0

    def local_sequence(self, rows):
        """(inputs, targets) of this rank's chunk of ``rows`` (sequences of seq_len + 1 tokens; with SP, its part)."""
        t = self.seq_len // (self.sp.size if self.sp else 1)
        lo = self.chunk(t)
        return rows[:, lo:lo + t], rows[:, lo + 1:lo + t + 1]

    def data_share(self, engine) -> Tuple[int, int]:
        """(this rank's share, shares) of the global batch's rows: the engine's ranks, SP ranks sharing one."""
        k = self.sp.size if self.sp else 1
        return engine.rank // k, engine.world_size // k

    def activation_spec(self, i: int, rows: int):
        """(shape, dtype) of engine layer i's output for ``rows`` sequences (this rank's positions of each)."""
        return (rows, self.seq_len // (self.sp.size if self.sp else 1), self.d_model), self.dtype

    @property
    def num_layers(self) -> int:
        """Engine layers: embeddings, n_layer blocks, final LayerNorm."""
        return self.n_layer + 2

    def is_moe(self, i: int) -> bool:
        """Whether block i (0-based) has the MoE MLP (moe/block.py)."""
        return self.moe is not None and self.moe.is_moe(i)

    @contextmanager
    def replaying(self):
        """A block's forward run again (activation checkpointing): the same bits, its MoE routing not counted
        again (the MoE MLP routes the same rows the same way: moe/mlp.py)."""
        stats = self.moe_blocks.mlp.stats if self.moe is not None else None
        if stats is not None:
            stats.paused = True
        try:
            yield
        finally:
            if stats is not None:
                stats.paused = False

    def use_expert_parallel(self, ep, store) -> None:
        """--ep > 1: the MoE blocks' experts spread over ``ep`` (an EPComm), kept in ``store`` (an ExpertStore);
        the blocks' own layers then hold the rest (block_names without the experts)."""
        from ..moe.ep_mlp import EPMoEMLP
        self.experts_apart = True
        mlp = EPMoEMLP(self.moe, self.xp, self.dtype, ep, store)
        mlp.sp = self.moe_blocks.mlp.sp       # with --sp: the aux loss and the capacity over the whole sequences
        self.moe_blocks.mlp = mlp

    def idle_layer(self, i: int, x):
        """Layer i visited with no rows to run (held-out evaluation): ``x``; an expert-parallel MoE block still
        joins its exchanges (every rank makes every collective)."""
        if self.experts_apart and 1 <= i <= self.n_layer and self.is_moe(i - 1):
            self.moe_blocks.mlp.idle(i - 1, self.d_model)
        return x

    def block_names(self, i: int) -> Dict[str, str]:
        """Short name -> parameter name of block i (0-based)."""
        if self.is_moe(i):
            from ..moe.block import moe_keys
            return {k: f"block{i}.{k}" for k in moe_keys(self.experts_apart, self.moe.shared)}
        keys = ["ln1.g", "ln1.b", "qkv.w", "qkv.b", "proj.w", "proj.b",
                "ln2.g", "ln2.b", "fc.w", "fc.b", "out.w", "out.b"]
        return {k: f"block{i}.{k}" for k in keys}

    def lazy_layers(self) -> List[Tuple[str, Dict[str, lazy.Lazy]]]:
        """[(layer name, {param name: lazy rule})] (engine/lazy.py), GPT-2 style: N(0, 0.02), residual projections
        N(0, 0.02 / sqrt(2 L)), LayerNorm gain 1, biases 0; the normals drawn in turn from one generator."""
        stream = lazy.Stream([self.seed, 0x6E7])
        C, L = self.d_model, self.n_layer
        normal = lambda shape, std=0.02: stream.normal(shape, scale=std)
        zeros, ones = (lambda n: lazy.Constant(n, 0.0)), (lambda n: lazy.Constant(n, 1.0))
        layers = [("embed", {WTE: normal((self.vocab, C)), WPE: normal((self.seq_len, C))})]
        resid = 0.02 / np.sqrt(2 * L)
        for i in range(L):
            n = self.block_names(i)
            if self.is_moe(i):
                from ..moe.block import moe_keys, moe_params
                n = {k: f"block{i}.{k}" for k in moe_keys(shared=self.moe.shared)}   # every parameter, the experts too
                layers.append((f"block{i}", moe_params(n, self.moe, C, normal, zeros, ones, resid)))
                continue
            layers.append((f"block{i}", {
                n["ln1.g"]: ones(C), n["ln1.b"]: zeros(C),
                n["qkv.w"]: normal((C, 3 * C)), n["qkv.b"]: zeros(3 * C),
                n["proj.w"]: normal((C, C), resid), n["proj.b"]: zeros(C),
                n["ln2.g"]: ones(C), n["ln2.b"]: zeros(C),
                n["fc.w"]: normal((C, 4 * C)), n["fc.b"]: zeros(4 * C),
                n["out.w"]: normal((4 * C, C), resid), n["out.b"]: zeros(C),
            }))
        layers.append(("ln_f", {"ln_f.g": ones(C), "ln_f.b": zeros(C)}))
        if self.initial is not None:   # --init-from: values read from a file instead of drawn
            layers = [(name, {n: self.initial(n, a) for n, a in params.items()}) for name, params in layers]
        if self.tp:                    # each split parameter cut to this TP rank's piece (the same draws)
            split, r, k = self.tp_split(), self.tp.rank, self.tp.size
            layers = [(name, {n: lazy.Piece(a, *split[n], r, k) if n in split else a for n, a in params.items()})
                      for name, params in layers]
        return layers

    def tp_split(self) -> Dict[str, Tuple[int, int]]:
        """{parameter name: (axis, groups)} of the tensor-parallel split parameters (the engine's tp_split)."""
        return {f"block{i}.{k}": s for i in range(self.n_layer) for k, s in TP_SPLIT.items()
                if k in self.block_names(i)}       # an MoE block: its attention's (moe/block.py)

    def tp_bytes_per_micro_batch(self, rows: int, itemsize: int = 4) -> int:
        """Bytes one rank sends in the TP all-reduces of a micro-batch of ``rows`` sequences: per block 2 forward (again
        when recomputed) and 2 backward, of rows·t·d_model values (t = seq_len / sp), 2(K-1)/K of each; an MoE
        block half of them (its attention's: the experts are whole)."""
        k, t = (self.tp.size if self.tp else 1), self.seq_len // (self.sp.size if self.sp else 1)
        calls = 6 if self.checkpoint_activations else 4
        per = sum(calls // 2 if self.is_moe(i) else calls for i in range(self.n_layer))
        return per * 2 * (k - 1) * (rows * t * self.d_model // k) * itemsize

    def init_layers(self) -> List[Tuple[str, Dict[str, np.ndarray]]]:
        """lazy_layers() made whole: [(layer name, {param name: float32 array})] (references, tests)."""
        return lazy.materialize(self.lazy_layers())

    def _cast(self, params, names, ws: Workspace = FRESH) -> Dict[str, object]:
        """{short name: parameter in the compute dtype}: stored fp16 ones converted (model_kernels.upcast), with a
        persistent workspace into one set of buffers every block shares (no fp32 copy of the model kept)."""
        out = {}
        for k, v in names.items():
            a = params[v]
            reuse = ws.persistent and self.xp is np and a.dtype != self.dtype
            out[k] = upcast(a, self.dtype, ws.get(("param", k), a.shape, self.dtype) if reuse else None)
        return out

    # -- per engine layer -----------------------------------------------------------------
    def forward_layer(self, i: int, params, x, ws: Workspace = FRESH):
        """(out, cache) of layer i: token ids (B, T) -> h for i = 0, h -> h after. With a persistent ``ws``, out and
        cache are this layer's buffers, valid until its next forward (default: new arrays)."""
        if i == 0:
            return self.embed_forward(params, x, ws)
        if i <= self.n_layer and self.is_moe(i - 1):
            return self.moe_blocks.block_forward(self._cast(params, self.block_names(i - 1)), x, i - 1, ws, i)
        if i <= self.n_layer:
            return self.layers.block_forward(self._cast(params, self.block_names(i - 1), ws), x, ws, i)
        p = self._cast(params, {"g": "ln_f.g", "b": "ln_f.b"})
        return self.layers.ln_forward(x, p["g"], p["b"], ws, i)

    def backward_layer(self, i: int, params, cache, dy, ws: Workspace = FRESH):
        """(dx, {param name: grad}) of layer i (layer 0 reads no parameters). With a persistent ``ws``, a block's
        gradients are buffers every block shares: read them before the next call."""
        if i == 0:
            return None, self.embed_backward(cache, dy, ws)
        if i <= self.n_layer:
            names = self.block_names(i - 1)
            if self.is_moe(i - 1):
                dx, g = self.moe_blocks.block_backward(self._cast(params, names), cache, dy, ws, i)
            else:
                dx, g = self.layers.block_backward(self._cast(params, names, ws), cache, dy, ws, i)
            return dx, {names[k]: v for k, v in g.items()}
        p = self._cast(params, {"g": "ln_f.g"})
        dx, dg, db = self.layers.ln_backward(dy, cache, p["g"], ws, i)
        return dx, {"ln_f.g": dg, "ln_f.b": db}

    def backward_layer_parts(self, i: int, params, cache, dy, ws: Workspace = FRESH):
        """(dx, weights) of block or final LayerNorm i >= 1: ``weights()`` -> {param name: grad} later, from the
        layer's own buffers (a zero-bubble schedule's B, then W; the same bits as backward_layer)."""
        if i <= self.n_layer:
            names = self.block_names(i - 1)
            if self.is_moe(i - 1):       # the MoE MLP's gradients with B (its exchanges), the attention's in W
                dx, weights = self.moe_blocks.block_backward_parts(self._cast(params, names), cache, dy, ws, i, True)
            else:
                dx, weights = self.layers.block_backward_parts(self._cast(params, names, ws), cache, dy, ws, i,
                                                               keep=True)
            return dx, lambda: {names[k]: v for k, v in weights().items()}
        dx, grads = self.backward_layer(i, params, cache, dy, ws)
        return dx, lambda: grads

    # -- embeddings and the tied head ------------------------------------------------------
    def embed_forward(self, params, idx, ws: Workspace = FRESH):
        B, T = idx.shape
        wte, wpe = upcast(params[WTE], self.dtype), upcast(params[WPE], self.dtype)
        h = scratch(ws, self.xp, ("embed", "h"), (B, T, wte.shape[1]), self.dtype)
        # NumPy's take buffers ``out`` in its default mode; token ids are in range, so "clip" is the same copy.
        self.xp.take(wte, idx, axis=0, out=h, **({"mode": "clip"} if self.xp is np else {}))
        lo = self.chunk(T)             # positions by where the chunk is in the whole sequence
        h += wpe[lo:lo + T]
        return h, idx

    def embed_backward(self, idx, dh, ws: Workspace = FRESH):
        """{wte: scatter-add of dh by token, wpe: dh summed over rows}."""
        xp = self.xp
        B, T, C = dh.shape
        flat = idx.reshape(-1)
        # A one-hot matmul instead of a scatter-add: the same code on NumPy and CuPy, in a fixed order.
        onehot = xp.equal(flat[:, None], xp.arange(self.vocab)[None, :],
                          out=scratch(ws, xp, ("embed", "onehot"), (B * T, self.vocab), self.dtype))
        dwte = onehot.T @ dh.reshape(-1, C)
        dwpe = xp.zeros((self.seq_len, C), self.dtype)
        lo = self.chunk(T)
        dwpe[lo:lo + T] = dh.sum(axis=0)
        return {WTE: dwte, WPE: dwpe}

    def head(self, wte_stored, hf, targets, scale: float = 1.0, ws: Workspace = FRESH):
        """Tied output head and mean cross-entropy: (loss in nats, d hf, d wte), the gradients of ``scale * loss``."""
        xp = self.xp
        if self.moe is not None:
            self.moe_blocks.mlp.scale = scale     # the aux loss's gradient is of scale times it too
        wte = upcast(wte_stored, self.dtype)
        B, T, C = hf.shape
        h2 = hf.reshape(-1, C)
        buf = lambda name, shape: scratch(ws, xp, ("head", name), shape, self.dtype)
        logits = xp.matmul(h2, wte.T, out=buf("logits", (B * T, wte.shape[0])))   # (B T, V)
        logits -= logits.max(axis=1, keepdims=True)
        e = xp.exp(logits, out=buf("e", logits.shape))
        z = e.sum(axis=1, keepdims=True)
        rows = xp.arange(B * T)
        t = targets.reshape(-1)
        loss = float((xp.log(z[:, 0]) - logits[rows, t]).astype(np.float64).mean())
        dlogits = xp.divide(e, z, out=e)
        dlogits[rows, t] -= 1.0
        dlogits *= self.dtype(scale / (B * T))
        dh = xp.matmul(dlogits, wte, out=buf("dh", (B * T, C)))
        return loss, dh.reshape(B, T, C), dlogits.T @ h2

    def token_losses(self, wte_stored, hf, targets):
        """Cross-entropy of every target (B, T), nats; no gradient (evaluation)."""
        xp = self.xp
        wte = upcast(wte_stored, self.dtype)
        logits = hf @ wte.T
        logits = logits - logits.max(axis=-1, keepdims=True)
        lse = xp.log(xp.exp(logits).sum(axis=-1))
        return lse - xp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]

    # -- the whole model in one process (tests, references) --------------------------------
    def loss_and_grads(self, layers, idx, targets, scale: float = 1.0, ws: Workspace = FRESH):
        """(loss, {param name: grad of scale * loss}) without an engine; ``layers`` as init_layers()."""
        params = [p for _, p in layers]
        h, caches = idx, []
        for i, p in enumerate(params):
            h, c = self.forward_layer(i, p, h, ws)
            caches.append(c)
        loss, dh, dwte = self.head(params[0][WTE], h, targets, scale, ws)
        grads = {}
        for i in reversed(range(len(params))):
            dh, g = self.backward_layer(i, params[i], caches[i], dh, ws)
            grads.update({k: v.copy() for k, v in g.items()} if ws.persistent else g)
        grads[WTE] = grads[WTE] + dwte
        return loss, grads
