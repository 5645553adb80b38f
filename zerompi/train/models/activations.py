"""The GPT's activations: the workspace that measures them, and activation checkpointing.

``MeteredWorkspace`` counts a Workspace's activation bytes (not its parameter-sized buffers), now and at
peak; ``Keep`` runs each layer in its own buffers and keeps its cache; ``Recompute`` (--checkpoint-activations)
keeps a block's input only and runs its forward again inside its backward: the same bits. Only the C kernels'
path is measured (the plain array path makes new arrays). docs/activations.md.
"""
import numpy as np

from .gpt_fast import Workspace
from .gpt_sp import SHARED

RECOMPUTE = "recompute"     # the workspace key of the shared buffers a checkpointed block runs in


def parameter_buffer(key) -> bool:
    """True for the parameter-sized buffers (("param", name) copies, (layer or "block", "g.<name>") gradients);
    every other buffer is an activation."""
    return isinstance(key, tuple) and len(key) == 2 and (key[0] == "param" or str(key[1]).startswith("g."))


def one_layer_buffer(key) -> bool:
    """True for the buffers that live through one layer's call only, which the workspaces of several micro-batches
    may share: the ("param", name) fp32 copies; everything of ("block", name) -- the parameter gradients and the
    backward's scratch (d fc, d m, d y, d a, d qkv, d att), read before the next layer's call (a split backward
    keeps what its W reads under the layer's own key); the SP attention's (SHARED, name) exchange buffers; and a
    recomputing block's (RECOMPUTE, name) forward set (its output is copied to the layer's own)."""
    return isinstance(key, tuple) and len(key) == 2 and key[0] in ("param", "block", SHARED, RECOMPUTE)


class MeteredWorkspace(Workspace):
    """A persistent Workspace that counts its activation bytes, ``current`` and ``peak``; ``shared``: where its
    one-layer buffers live (one set for the micro-batches in flight, not m)."""

    def __init__(self, shared: Workspace = None):
        super().__init__(persistent=True)
        self.current = self.peak = 0
        self.shared = shared

    def get(self, key, shape, dtype):
        if self.shared is not None and one_layer_buffer(key):
            return self.shared.get(key, shape, dtype)
        old = self._arrays.get(key)
        a = super().get(key, shape, dtype)
        if a is not old and not parameter_buffer(key):
            self.current += a.nbytes - (old.nbytes if old is not None else 0)
            self.peak = max(self.peak, self.current)
        return a

    def clear(self) -> None:
        super().clear()
        self.current = 0


def scratch(ws, xp, key, shape, dtype):
    """ws's buffer ``key`` where the workspace keeps NumPy arrays, else a new ``xp`` array."""
    if ws.persistent and xp is np:
        return ws.get(key, shape, dtype)
    return xp.empty(shape, dtype)


class _Renamed:
    """A view of a workspace that files layer ``layer``'s buffers under ``name`` instead."""

    def __init__(self, ws, layer, name):
        self.ws, self.layer, self.name, self.persistent = ws, layer, name, ws.persistent

    def get(self, key, shape, dtype):
        if isinstance(key, tuple) and key and key[0] == self.layer:
            key = (self.name,) + key[1:]
        return self.ws.get(key, shape, dtype)


class Keep:
    """Each layer's forward in its own buffers, its cache kept for its backward. ``ws``: the workspace
    (default: the model's; a pipeline chunk gives each micro-batch in flight its own)."""

    def __init__(self, model, ws=None):
        self.model, self._ws = model, ws

    @property
    def ws(self):
        return self._ws if self._ws is not None else self.model.workspace

    def forward(self, i, params, x):
        return self.model.forward_layer(i, params, x, self.ws)

    def backward(self, i, params, cache, dy):
        return self.model.backward_layer(i, params, cache, dy, self.ws)


class Recompute(Keep):
    """Activation checkpointing: a block (engine layers 1..n_layer) keeps only its input."""

    def _block(self, i) -> bool:
        return 1 <= i <= self.model.n_layer

    def forward(self, i, params, x):
        if not self._block(i):
            return super().forward(i, params, x)
        m = self.model
        out, _ = m.forward_layer(i, params, x, _Renamed(self.ws, i, RECOMPUTE))
        kept = scratch(self.ws, m.xp, (i, "output"), out.shape, out.dtype)
        kept[...] = out               # the shared buffers are the next block's; the output is its input
        return kept, x

    def backward(self, i, params, x, dy):
        if not self._block(i):
            return super().backward(i, params, x, dy)
        m = self.model
        with m.replaying():
            _, cache = m.forward_layer(i, params, x, _Renamed(self.ws, i, RECOMPUTE))
        # dx of block i is block i-1's dy: two alternating sets of input-gradient buffers.
        return m.backward_layer(i, params, cache, dy, _Renamed(self.ws, i, (RECOMPUTE, i % 2)))
