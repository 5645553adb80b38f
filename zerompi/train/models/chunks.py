"""A chunk of a model: a run of its layers, walked forward and backward through the chunk's engine.

The one layer walk of every built-in model (an unpipelined run: the one chunk of all layers), in the order
stage 3 schedules by, each layer's gradients handed back as its backward ends (a split backward: B, then W).
"""
from typing import Dict, List, Optional

import numpy as np

from .activations import MeteredWorkspace


def chunk_layers(num_layers: int, first: List[int], last: List[int], blocks: int, index: int, chunks: int) -> List[int]:
    """The engine layers (the whole model's numbering) of chunk ``index`` of ``chunks``: the ``first`` layers
    on chunk 0, the ``last`` on the last chunk, and an equal run of the ``blocks`` in between on each."""
    per = blocks // chunks
    lo = len(first) + index * per
    return (first if index == 0 else []) + list(range(lo, lo + per)) + (last if index == chunks - 1 else [])


class MicroBatch:
    """One micro-batch's state in one chunk, from its forward to its last backward."""

    __slots__ = ("caches", "ws", "weights", "extra", "head_grad")

    def __init__(self, ws=None):
        self.caches: List[object] = []
        self.ws = ws
        self.weights = None          # split backward: [(local layer, weights()) ...] for W
        self.extra = None            # the last chunk: the loss gradient
        self.head_grad = None        # the GPT's chunk with embedding and head: the head's gradient of wte


class Chunk:
    """Layers ``layers`` of ``model`` (forward_layer, backward_layer, backward_layer_parts, loss). ``feed(step)``:
    the step's micro-batches [(input, target)] (or set ``batches``); ``rows``: a micro-batch's."""

    def __init__(self, model, layers, num_layers: int, feed=None, rows: int = 0):
        self.model, self.layers, self.feed, self.rows = model, list(layers), feed, rows
        self.first, self.last = self.layers[0] == 0, self.layers[-1] == num_layers - 1
        self.engine = self.sink = None
        self.state: Dict[int, MicroBatch] = {}
        self.losses: Dict[int, float] = {}
        self.batches = None

    def lazy_layers(self):
        """The chunk's layers of the whole model's lazy rules (the same initial values as unpipelined)."""
        full = self.model.lazy_layers()
        return [full[g] for g in self.layers]

    def tp_split(self):
        names = {n for _, params in self.lazy_layers() for n in params}
        return {n: s for n, s in self.model.tp_split().items() if n in names}

    def attach(self, engine, sink=None) -> "Chunk":
        """Run through ``engine``; ``sink(layer, grads)`` takes the gradients (default: engine.grads_ready)."""
        self.engine, self.sink = engine, sink or engine.grads_ready
        return self

    def input_spec(self, mb: int):
        """(shape, dtype) of the activation the chunk receives (``rows`` per micro-batch)."""
        return self.model.activation_spec(self.layers[0] - 1, self.rows)

    def grad_spec(self, mb: int):
        """(shape, dtype) of the gradient of its output it receives."""
        return self.model.activation_spec(self.layers[-1], self.rows)

    def begin_step(self, step: int) -> None:
        self.losses = {}
        if self.first or self.last:
            self.batches = self.feed(step)

    def end_step(self) -> None:
        self.batches = None

    def run(self) -> List[float]:
        """Each micro-batch of ``batches`` forward, then backward, in turn (no pipeline); their losses."""
        for mb in range(len(self.batches)):
            self.forward(mb, None)
            self.backward(mb, None, True)
        return [self.losses[mb] for mb in range(len(self.batches))]

    def forward(self, mb: int, x):
        """Micro-batch ``mb`` through the chunk's layers: the next chunk's input (None from the last chunk)."""
        e, m = self.engine, self.model
        st = self.state[mb] = MicroBatch()
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
        """Micro-batch ``mb``'s backward (with ``weights``: whole; else B, W later): the previous chunk's dy."""
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
            self._done(mb)
        else:
            st.weights = parts
        return None if self.first else dh

    def weights(self, mb: int) -> None:
        """W of a split backward: the weight parts, the top layer first, as the whole backward hands them back."""
        for li, part in self.state[mb].weights:
            self.sink(li, part())
        self._done(mb)

    def _done(self, mb: int) -> None:
        del self.state[mb]


class WorkspacePool:
    """The GPT's workspaces for the micro-batches in flight: ``take(key)``, ``give(key)``; kept for reuse."""

    def __init__(self, shared: Optional[MeteredWorkspace] = None):
        self.free: List[MeteredWorkspace] = []
        self.used: Dict[object, MeteredWorkspace] = {}
        self.made: List[MeteredWorkspace] = []
        self.shared = shared if shared is not None else MeteredWorkspace()   # one-layer buffers: one set for all

    def take(self, key) -> MeteredWorkspace:
        ws = self.free.pop() if self.free else None
        if ws is None:
            ws = MeteredWorkspace(self.shared)
            self.made.append(ws)
        self.used[key] = ws
        return ws

    def give(self, key) -> None:
        self.free.append(self.used.pop(key))


def pools_peak_bytes(pools) -> int:
    """The activation bytes of a rank's chunks' pools: their workspaces', and each shared one-layer set once."""
    shared = {id(p.shared): p.shared for p in pools}
    return sum(ws.peak for p in pools for ws in p.made) + sum(getattr(s, "peak", 0) for s in shared.values())
