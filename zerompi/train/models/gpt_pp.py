"""The GPT cut into pipeline chunks: one chunk's forward, backward and weight gradients, through its engine.

Chunk c of C holds engine layers (the whole model's numbering) ``embed`` (chunk 0 only), its
n_layer / C blocks, and ``ln_f`` (the last chunk, which also runs the tied head and the loss). Each
layer runs exactly as models/gpt.py's run_micro_batch runs it (the same kernels, the same visits of
the engine, the same gradients handed back in the same order), so every micro-batch computes the
same bits as without pipelining.

The tied embedding / head weight ``wte`` (pipeline/tied.py): chunk 0's engine trains it; the last chunk
reads a copy of its stored value, sent by chunk 0 at its first forward of each step, and sends the
head's gradient of each micro-batch back, which chunk 0 adds to the lookup's (``grads[wte] +=
head's``, as run_micro_batch does) before handing layer 0's gradients to its engine.

A split backward (ZB-H1): B runs each layer's input gradient (gpt.backward_layer_parts) and keeps its
weight part; W runs the weight parts, top layer first, and hands the gradients back.
"""
from typing import Optional

import numpy as np

from .activations import Keep, Recompute
from .chunks import ChunkState, WorkspacePool, chunk_layers
from .gpt import WTE
from .gpt_fast import FRESH


class GPTChunk:
    """Chunk ``index`` of ``chunks`` of ``model`` (a GPT, any --tp), fed from ``data`` (rows of data-parallel
    rank ``dp_rank`` of ``dp``; ``batch`` sequences per step, ``micro_batches``); ``tie`` a TiedWeight; ``shared``:
    the Workspace of one-layer buffers this rank's chunks share (models/chunks.py; default: the chunk's own)."""

    def __init__(self, model, index: int, chunks: int, data, batch: int, dp_rank: int, dp: int,
                 micro_batches: int, tie, shared=None):
        self.model, self.index, self.chunks, self.data = model, index, chunks, data
        self.batch, self.dp_rank, self.dp, self.m = batch, dp_rank, dp, micro_batches
        self.tie = tie
        self.first, self.last = index == 0, index == chunks - 1
        self.layers = chunk_layers(model.num_layers, [0], [model.n_layer + 1], model.n_layer, index, chunks)
        self.engine = self.sink = None
        self.pool = WorkspacePool(shared) if model.layers.name == "c" else None   # shared: the rank's one-layer set
        self.state = {}
        self.rows = None
        self.losses = {}
        self.per = batch // dp // micro_batches      # rows of one micro-batch

    # ---- what the engine holds ---------------------------------------------------------------
    def lazy_layers(self):
        """The chunk's layers of the whole model's lazy rules (engine/lazy.py: each knows its place in the
        model's draws, so the engine makes this chunk's shard of the same initial values)."""
        full = self.model.lazy_layers()
        return [full[g] for g in self.layers]

    def tp_split(self):
        names = {n for g in self.layers for n in self.model_names(g)}
        return {n: s for n, s in self.model.tp_split().items() if n in names}

    def model_names(self, g: int):
        if g == 0:
            return ["wte", "wpe"]
        if g <= self.model.n_layer:
            return list(self.model.block_names(g - 1).values())
        return ["ln_f.g", "ln_f.b"]

    def attach(self, engine, sink) -> None:
        self.engine, self.sink = engine, sink

    @property
    def activation_bytes(self) -> Optional[int]:
        return self.pool.peak_bytes if self.pool is not None else None

    # ---- the step ----------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        from ..data import rank_rows
        self.losses, self.sent_value = {}, False
        if self.first or self.last:
            self.rows = self.data.train_rows(step, rank_rows(self.batch, self.dp_rank, self.dp))
        if self.last:
            self.tie.expect_value()

    def end_step(self) -> None:
        self.rows = None

    def _tokens(self, mb: int):
        """(inputs, targets) of micro-batch ``mb``: this rank's chunk of each sequence (all of it without --sp)."""
        return self.model.local_sequence(self.model.xp.asarray(self.rows[mb * self.per:(mb + 1) * self.per]))

    def input_spec(self, mb: int):
        sp = self.model.sp.size if self.model.sp else 1
        return (self.per, self.model.seq_len // sp, self.model.d_model), self.model.dtype

    grad_spec = input_spec

    def forward(self, mb: int, x):
        e, m = self.engine, self.model
        ws = self.pool.take(mb) if self.pool is not None else FRESH
        st = self.state[mb] = ChunkState(ws)
        idx = targets = None
        if self.first or self.last:
            idx, targets = self._tokens(mb)
        e.begin_forward()
        h = x
        for li, g in enumerate(self.layers):
            with e.unsharded(li) as p:
                if g == 0:
                    if not self.sent_value:          # this step's value of the tied weight, to the head's stage
                        self.tie.send_value(p[WTE])
                        self.sent_value = True
                    self.tie.expect_grad(mb)
                    h, cache = m.forward_layer(0, p, idx, ws)
                else:
                    h, cache = self.run(ws).forward(g, p, h)   # checkpointing: a block keeps its input only
            st.caches.append(cache)
        if not self.last:
            return h
        loss, dh, dwte_head = m.head(self.tie.value(), h, targets, e.loss_scale, ws)
        self.losses[mb] = loss
        self.tie.send_grad(mb, dwte_head)
        st.extra = dh
        return None

    def evaluate(self, rows, x):
        """Forward only, as models/gpt.evaluate runs it: the next chunk's input, or (the last chunk) the sum of
        the token cross-entropies of ``rows`` (nats)."""
        e, m = self.engine, self.model
        inputs, targets = m.local_sequence(m.xp.asarray(rows))
        e.begin_forward()
        h = x
        for li, g in enumerate(self.layers):
            with e.unsharded(li) as p:
                if g == 0 and not self.sent_value:
                    self.tie.send_value(p[WTE])
                    self.sent_value = True
                if len(rows):             # no rows (a share of the held-out set that ran out): visited, not run
                    h, _ = m.forward_layer(g, p, inputs if g == 0 else h)
        if not len(rows):
            sp = m.sp.size if m.sp else 1
            return m.xp.empty((0, m.seq_len // sp, m.d_model), m.dtype) if not self.last else 0.0
        if not self.last:
            return h
        return float(m.token_losses(self.tie.value(), h, targets).astype(np.float64).sum())

    def backward(self, mb: int, dy, weights: bool):
        e, m = self.engine, self.model
        st = self.state[mb]
        dh = st.extra if self.last else dy
        e.begin_backward()
        parts = []
        for li in reversed(range(len(self.layers))):
            g = self.layers[li]
            if g == 0:      # the lookup reads no parameter; the visit keeps the engine's order (run_micro_batch)
                with e.unsharded(li):
                    pass
                parts.append((li, self._embed_weights(mb, st.caches[li], dh, st.ws)))
                continue
            with e.unsharded(li) as p:
                if weights:
                    dh, grads = self.run(st.ws).backward(g, p, st.caches[li], dh)
                    self.sink(li, grads)
                else:
                    dh, part = m.backward_layer_parts(g, p, st.caches[li], dh, st.ws)
                    parts.append((li, part))
            st.caches[li] = None
        if weights:
            for li, part in parts:          # the embedding (chunk 0): its gradient is all weight gradient
                self.sink(li, part())
            self._done(mb)
        else:
            st.weights = parts
        return None if self.first else dh

    def run(self, ws):
        """How a layer runs in workspace ``ws`` (models/activations.py): kept, or recomputed in the backward
        with --checkpoint-activations (not with a split backward: W would read recomputed buffers)."""
        return (Recompute if self.model.checkpoint_activations else Keep)(self.model, ws)

    def weights(self, mb: int) -> None:
        st = self.state[mb]
        for li, part in st.weights:          # the top layer first, as the unsplit backward hands them back
            self.sink(li, part())
        self._done(mb)

    def _embed_weights(self, mb, cache, dh, ws):
        def part():
            grads = self.model.backward_layer(0, None, cache, dh, ws)[1]
            grads[WTE] += self.tie.grad(mb)      # the lookup's plus the head's, as run_micro_batch adds them
            return grads
        return part

    def _done(self, mb: int) -> None:
        del self.state[mb]
        if self.pool is not None:
            self.pool.give(mb)
