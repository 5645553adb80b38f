"""The GPT's chunk (models/chunks.py): a run of its engine layers, the embedding and the tied head among them.

Chunk c of C holds ``embed`` (chunk 0), its n_layer / C blocks and ``ln_f`` (the last, with the tied head and
the loss); an unpipelined run is the one chunk of all. A chunk holding embedding and head keeps ``embed``
unsharded until the head has read ``wte`` and adds the head's gradient to the lookup's; cut apart, the value
and the gradient travel between the two chunks (pipeline/tied.py): the same sum, the same bits.
"""
from contextlib import ExitStack
from typing import List

import numpy as np

from .activations import Keep, Recompute
from .chunks import Chunk, MicroBatch
from .gpt import WTE


class GPTChunk(Chunk):
    """Layers ``layers`` of ``model`` (a GPT, any --tp or --sp); ``tie``: a TiedWeight where the embedding and
    the head are on two chunks; ``pool``: a WorkspacePool, else every micro-batch runs in ``ws`` (default: the
    model's workspace)."""

    def __init__(self, model, layers, feed=None, rows: int = 0, tie=None, pool=None, ws=None):
        super().__init__(model, layers, model.num_layers, feed, rows)
        self.tie, self.pool = tie, pool
        self.ws = model.workspace if ws is None else ws
        self.sent_value = False

    def begin_step(self, step: int) -> None:
        super().begin_step(step)
        self.sent_value = False
        if self.last and not self.first:
            self.tie.expect_value()

    def run_layers(self, ws):
        """How a layer runs in workspace ``ws`` (models/activations.py): kept, or recomputed in the backward
        with --checkpoint-activations (not with a split backward: W would read recomputed buffers)."""
        return (Recompute if self.model.checkpoint_activations else Keep)(self.model, ws)

    def _embed(self, mb, p, held: bool):
        """The stored wte the head reads: the held layer's, or this step's value sent to the head's chunk."""
        if held:
            return p[WTE]
        if not self.sent_value:
            self.tie.send_value(p[WTE])
            self.sent_value = True
        if mb is not None:
            self.tie.expect_grad(mb)
        return None

    def _walk(self, mb, h, layer, head):
        """The chunk's layers forward from ``h``, ``layer(g, params, x) -> y`` on each; the last chunk returns
        ``head(wte, y)`` while layer 0 is still held (wte: a callable, the value the head reads)."""
        e = self.engine
        e.begin_forward()
        wte = None
        with ExitStack() as held:          # the embedding and the head in this chunk: layer 0 held until the head
            for li, g in enumerate(self.layers):
                with ExitStack() as visit:
                    p = (held if g == 0 and self.last else visit).enter_context(e.unsharded(li))
                    if g == 0:
                        wte = self._embed(mb, p, self.last)
                    h = layer(g, p, h)
            return head(lambda: self.tie.value() if wte is None else wte, h) if self.last else h

    def forward(self, mb: int, x):
        e, m = self.engine, self.model
        ws = self.pool.take(mb) if self.pool is not None else self.ws
        st = self.state[mb] = MicroBatch(ws)
        idx, targets = self.batches[mb] if self.first or self.last else (None, None)
        run = self.run_layers(ws)

        def layer(g, p, h):
            h, cache = run.forward(g, p, h)
            st.caches.append(cache)
            return h
        out = self._walk(mb, idx if self.first else x, layer,
                         lambda wte, h: m.head(wte(), h, targets, e.loss_scale, ws))
        if not self.last:
            return out
        self.losses[mb], st.extra, dwte_head = out
        if self.first:
            st.head_grad = dwte_head
        else:
            self.tie.send_grad(mb, dwte_head)
        return None

    def evaluate(self, rows, x):
        """Forward only: the next chunk's input, or (the last chunk) the sum of the token cross-entropies of
        ``rows`` (nats). No rows (a share of the held-out set that ran out): the layers visited, nothing run."""
        m, n = self.model, len(rows)
        inputs, targets = m.local_sequence(m.xp.asarray(rows))
        out = self._walk(None, inputs if self.first else x,
                         lambda g, p, h: m.forward_layer(g, p, h)[0] if n else m.idle_layer(g, h),
                         lambda wte, h: float(m.token_losses(wte(), h, targets).astype(np.float64).sum()) if n else 0.0)
        if n or self.last:
            return out
        return m.xp.empty((0, m.seq_len // (m.sp.size if m.sp else 1), m.d_model), m.dtype)

    def backward(self, mb: int, dy, weights: bool):
        e, m = self.engine, self.model
        if m.moe is not None:         # the aux loss's gradient is of the loss scale times it (any stage's blocks)
            m.moe_blocks.mlp.scale = e.loss_scale
        st = self.state[mb]
        dh = st.extra if self.last else dy
        run = self.run_layers(st.ws)
        e.begin_backward()
        parts = []
        for li in reversed(range(len(self.layers))):
            g = self.layers[li]
            if g == 0:      # the lookup reads no parameter; the visit keeps the engine's order
                with e.unsharded(li):
                    pass
                parts.append((li, self._embed_weights(mb, st, dh)))
                continue
            with e.unsharded(li) as p:
                if weights:
                    dh, grads = run.backward(g, p, st.caches[li], dh)
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

    def _embed_weights(self, mb, st, dh):
        def part():
            grads = self.model.backward_layer(0, None, st.caches[0], dh, st.ws)[1]
            grads[WTE] += st.head_grad if self.last else self.tie.grad(mb)    # the lookup's plus the head's
            return grads
        return part

    def _done(self, mb: int) -> None:
        super()._done(mb)
        if self.pool is not None:
            self.pool.give(mb)


# ---- an unpipelined run: the one chunk of all layers ------------------------------------
def whole(engine, model):
    """The model's one chunk of all its layers through ``engine``, its micro-batches in the model's workspace."""
    return GPTChunk(model, range(model.num_layers)).attach(engine)


def run_micro_batch(engine, model, idx, targets) -> float:
    """Forward, loss and backward of one micro-batch through the engine (gradients of the loss times
    ``engine.loss_scale``, layer 0's last); returns the loss."""
    chunk = whole(engine, model)
    chunk.batches = [(idx, targets)]
    return chunk.run()[0]


def evaluate(engine, model, rows) -> float:
    """Sum of the token cross-entropies (nats) of ``rows`` (sequences of seq_len + 1 tokens); forward only."""
    return whole(engine, model).evaluate(rows, None)


# ---- one training step's data, and the held-out loss ------------------------------------
def step_batches(model, data, step: int, batch: int, share: int, shares: int, micro_batches: int):
    """[(inputs, targets)] of the micro-batches of share ``share`` of ``shares`` of step ``step``'s global batch
    of ``batch`` sequences (data.train_rows: the same rows at any world size)."""
    from ..data import rank_rows
    rows = data.train_rows(step, rank_rows(batch, share, shares))
    per = rows.shape[0] // micro_batches
    return [model.local_sequence(model.xp.asarray(rows[m * per:(m + 1) * per])) for m in range(micro_batches)]


def train_losses(engine, model, data, step: int, batch: int, micro_batches: int) -> List[float]:
    """This rank's micro-batch losses of training step ``step`` (``batch`` sequences over all ranks)."""
    chunk = whole(engine, model)
    chunk.batches = step_batches(model, data, step, batch, *model.data_share(engine), micro_batches)
    return chunk.run()


def held_out_loss(engine, model, data, chunk: int = 32):
    """data.HeldOut: the mean token loss (nats) over the held-out set and its rows; a collective over each rank's
    share of the rows in passes (data.held_out_passes)."""
    from ...comm.simulated_world import simulated
    from ..data import HeldOut, held_out_passes
    total, tokens = 0.0, 0
    for rows in held_out_passes(data.val_size, *model.data_share(engine), chunk):
        r = model.xp.asarray(data.val_rows(rows))
        total += evaluate(engine, model, r)
        tokens += model.local_sequence(r)[1].size
    summed = engine.comm.sum_scalars([total, tokens])
    if simulated(engine.comm):    # N copies of this rank's sums: its own rows' mean instead
        return HeldOut.of(total, tokens, data.seq_len // (model.sp.size if model.sp else 1))
    return HeldOut.of(float(summed[0]), float(summed[1]), data.seq_len)
