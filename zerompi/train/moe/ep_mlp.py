"""The MoE MLP under expert parallelism (--ep K): this rank holds E/K experts; tokens go to theirs and back.

The router runs where the tokens are (moe.py, unchanged). Each expert's rows are sent to the EP rank holding
it (comm/ep_alltoall.py: counts, then rows), run there one source rank at a time -- the same rows in the same
order, the same matrix multiplies as that source would run without EP -- and sent back; the backward sends
the rows' gradients there and their input gradients back. The expert weight gradient is kept per source
(K partials, each what the source itself would have computed), and the expert engine sums the N partials in
rank order (comm/sources_reduce.py): the bits of --ep 1. ``ExpertStore`` is where the experts' parameters and
gradients live: the expert engine, one layer per MoE block. docs/moe.md.
"""
from contextlib import contextmanager

import numpy as np

from ..model_kernels import upcast
from .mlp import EXPERT_KEYS, MoEMLP, Routing, expert_backward, expert_forward


class ExpertStore:
    """Where each MoE block's experts live: ``where`` {block: (engine, layer)} (or (engine, layer, sink), ``sink(layer,
    grads)`` taking the gradients instead of engine.grads_ready: a pipeline's GradSink), each engine a ZeroEngine
    of sources = K; one engine of all blocks (unpipelined), or one per model chunk (pipelined)."""

    def __init__(self, where, dtype):
        self.dtype = dtype
        self.where = {b: (w + (w[0].grads_ready,))[:3] for b, w in where.items()}

    @contextmanager
    def params(self, block: int):
        """{short name: this rank's experts' parameter (E/K, ...) in the compute dtype} (stage 3: gathered)."""
        engine, layer, _ = self.where[block]
        with engine.unsharded(layer) as p:
            yield {k: upcast(p[f"block{block}.{k}"], self.dtype) for k in EXPERT_KEYS}

    def grads(self, block: int, grads) -> None:
        """Hand back the block's experts' per-source gradients {short name: (K, E/K, ...)}."""
        _, layer, sink = self.where[block]
        sink(layer, {f"block{block}.{k}": v for k, v in grads.items()})


class EPMoEMLP(MoEMLP):
    """The MoE MLP whose experts are spread over ``ep`` (an EPComm of K ranks) and kept in ``store``."""

    def __init__(self, spec, xp, dtype, ep, store: ExpertStore):
        super().__init__(spec, xp, dtype)
        self.ep, self.store = ep, store
        self.local = spec.experts // ep.size           # experts per EP rank

    def _send_order(self, r: Routing):
        """The assignment positions of every expert, in expert order (= by EP rank, then its experts)."""
        return [r.kept[e] for e in range(self.spec.experts)]

    def experts_forward(self, p, m, r: Routing, block: int):
        K, El, n = self.ep.size, self.local, m.shape[0]
        kept = self._send_order(r)
        counts = np.array([len(q) for q in kept], np.int64).reshape(K, El)
        got = self.ep.counts(counts)                     # (source, my expert): rows each source sends
        xp = self.xp
        order = xp.concatenate(kept)
        send = m[order % n] if n else m
        x = self.ep.rows(send, counts.sum(axis=1), got.sum(axis=1), xp=xp)
        ys, acts = xp.empty_like(x), []
        with self.store.params(block) as P:
            lo = 0
            for s in range(K):                           # one source at a time: its own rows, as it would
                for i in range(El):
                    hi = lo + int(got[s, i])
                    h, t, g, ys[lo:hi] = expert_forward(self.xp, P, i, x[lo:hi])
                    acts.append((h, t, g))
                    lo = hi
        back = self.ep.rows(ys, got.sum(axis=1), counts.sum(axis=1), xp=xp)
        Y = xp.zeros((self.spec.top_k * n, m.shape[1]), self.dtype)
        if n:
            Y[order] = back
        return Y, (kept, counts, got, x, acts)

    def experts_backward(self, p, m, r: Routing, acts, dY, block: int):
        K, El, n = self.ep.size, self.local, m.shape[0]
        kept, counts, got, x, act = acts
        xp = self.xp
        order = xp.concatenate(kept)
        dy = self.ep.rows(dY[order], counts.sum(axis=1), got.sum(axis=1), xp=xp)
        dx = xp.empty_like(dy)
        with self.store.params(block) as P:
            g = {name: self.xp.zeros((K,) + P[name].shape, self.dtype) for name in EXPERT_KEYS}
            lo = 0
            for s in range(K):
                part = {name: v[s] for name, v in g.items()}     # source s's partial
                for i in range(El):
                    hi = lo + int(got[s, i])
                    dx[lo:hi] = expert_backward(P, i, x[lo:hi], act[s * El + i], dy[lo:hi], part, i)
                    lo = hi
        self.store.grads(block, g)
        back = self.ep.rows(dx, got.sum(axis=1), counts.sum(axis=1), xp=xp)
        dm = self.xp.zeros(m.shape, self.dtype)
        lo = 0
        for q in kept:                                   # the input gradients summed in expert order, as at --ep 1
            hi = lo + len(q)
            dm[q % n] += back[lo:hi]
            lo = hi
        return dm, {}

    def idle(self, block: int, width: int) -> None:
        """A forward with no rows (a held-out share that ran out): the exchanges and the gather still run."""
        empty = self.xp.zeros((0, width), self.dtype)
        self.experts_forward(None, empty, Routing(self.xp, self.spec, self.xp.zeros((0, self.spec.experts))), block)
