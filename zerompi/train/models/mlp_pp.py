"""The MLP cut into pipeline chunks: depth / C consecutive blocks each, the loss on the last.

Each block runs as loop.run_micro_batch runs it (the same calls, the same gradients handed back in the
same order), so every micro-batch computes the same bits as without pipelining. The last chunk's
loss gradient is scaled by the loss scale as there (``dy * float32(loss_scale)``). A split backward
(ZB-H1): B runs mlp.backward_layer_parts' input gradient, W the weight parts.
"""
import numpy as np

from .. import loop
from .chunks import ChunkState, chunk_layers


class MLPChunk:
    """Chunk ``index`` of ``chunks`` of ``model`` (an MLP or TPMLP) on the teacher ``data``."""

    def __init__(self, model, index: int, chunks: int, data, batch: int, dp_rank: int, dp: int, micro_batches: int):
        self.model, self.index, self.chunks, self.data = model, index, chunks, data
        self.batch, self.dp_rank, self.dp, self.m = batch, dp_rank, dp, micro_batches
        self.first, self.last = index == 0, index == chunks - 1
        self.layers = chunk_layers(model.depth, [], [], model.depth, index, chunks)
        self.engine = self.sink = None
        self.state, self.losses, self.batches = {}, {}, None
        self.activation_bytes = None

    def lazy_layers(self):
        """The chunk's layers of the whole model's lazy rules (engine/lazy.py: each knows its place in the
        model's draws, so the engine makes this chunk's shard of the same initial values)."""
        full = self.model.lazy_layers()
        return [full[g] for g in self.layers]

    def tp_split(self):
        names = {f"block{g}.{k}" for g in self.layers for k in ("weight", "bias")}
        return {n: s for n, s in self.model.tp_split().items() if n in names}

    def attach(self, engine, sink) -> None:
        self.engine, self.sink = engine, sink

    def begin_step(self, step: int) -> None:
        self.losses = {}
        if self.first or self.last:
            rows = loop.local_rows(self.batch, self.dp_rank, self.dp)
            x, y = self.data.rows(step, range(rows.start, rows.stop))
            self.batches = loop.micro_batches(x, y, self.m)

    def end_step(self) -> None:
        self.batches = None

    def _width(self, g: int) -> int:
        """The width of block g's output on this rank (a column-parallel block's output stays split)."""
        tp = getattr(self.model, "tp", None)
        split = tp is not None and g % 2 == 0 and g != self.model.depth - 1
        return self.model.width // tp.size if split else self.model.width

    def input_spec(self, mb: int):
        return (self.batch // self.dp // self.m, self._width(self.layers[0] - 1)), np.float32

    def grad_spec(self, mb: int):
        return (self.batch // self.dp // self.m, self._width(self.layers[-1])), np.float32

    def forward(self, mb: int, x):
        e, m = self.engine, self.model
        st = self.state[mb] = ChunkState(None)
        h = self.batches[mb][0] if self.first else x
        e.begin_forward()
        for li, g in enumerate(self.layers):
            with e.unsharded(li) as p:
                h, cache = m.forward_layer(g, p, h)
            st.caches.append(cache)
        if not self.last:
            return h
        loss, dy = m.loss(h, self.batches[mb][1])
        self.losses[mb] = loss
        st.extra = dy * np.float32(e.loss_scale)
        return None

    def backward(self, mb: int, dy, weights: bool):
        e, m = self.engine, self.model
        st = self.state[mb]
        dh = st.extra if self.last else dy
        e.begin_backward()
        parts = []
        for li in reversed(range(len(self.layers))):
            with e.unsharded(li) as p:
                if weights:
                    dh, grads = m.backward_layer(self.layers[li], p, st.caches[li], dh)
                else:
                    dh, part = m.backward_layer_parts(self.layers[li], p, st.caches[li], dh)
                    parts.append((li, part))
            st.caches[li] = None
            if weights:
                self.sink(li, grads)
        if weights:
            del self.state[mb]
        else:
            st.weights = parts
        return None if self.first else dh

    def weights(self, mb: int) -> None:
        for li, part in self.state.pop(mb).weights:
            self.sink(li, part())
