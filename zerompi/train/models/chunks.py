"""What the built-in models' pipeline chunks share (gpt_pp.py, mlp_pp.py): which engine layers a chunk
holds, its micro-batches' state between their forward and their last backward, and the GPT's buffers.

A chunk holds a run of consecutive engine layers of the whole model (numbered as the model numbers
them); its engine numbers them 0, 1, ... A micro-batch's state (the layers' caches, and for a split
backward the weight-gradient parts) lives from its F to its B (its W when the backward is split).
The GPT's C kernels write every activation into a Workspace: each micro-batch in flight gets one of
its own from a pool (a micro-batch's buffers must outlive the next one's forward), returned after its
last backward; ``activation_bytes`` is what the pool's workspaces hold at most (models/activations.py).
The buffers that live through one layer's call only (a block's fp32 copy of its parameters, its
gradients before the engine takes them, its backward's scratch, the SP all-to-all's buffers, a
recomputing block's forward set) are one set for the whole pool, not one per micro-batch -- and one
for all the chunks of a rank (the interleaved schedule's), which never run at the same time.
"""
from typing import Dict, List, Optional

from .activations import MeteredWorkspace
from .gpt_fast import Workspace


class WorkspacePool:
    """Workspaces for the micro-batches in flight: ``take(key)``, ``give(key)``; kept for reuse."""

    def __init__(self, shared: Optional[Workspace] = None):
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

    @property
    def peak_bytes(self) -> int:
        """The activation bytes the pool's workspaces hold at most (each keeps its buffers for reuse), the shared
        one-layer set's included."""
        return sum(ws.peak for ws in self.made) + getattr(self.shared, "peak", 0)


def pools_peak_bytes(pools) -> int:
    """The activation bytes of several chunks' pools on one rank: their workspaces', and each shared one-layer set
    once (the chunks of a rank share one: they never run at the same time)."""
    shared = {id(p.shared): p.shared for p in pools}
    return sum(ws.peak for p in pools for ws in p.made) + sum(getattr(s, "peak", 0) for s in shared.values())


def chunk_layers(num_layers: int, first: List[int], last: List[int], blocks: int, index: int, chunks: int) -> List[int]:
    """The engine layers (the whole model's numbering) of chunk ``index`` of ``chunks``: the ``first`` layers
    on chunk 0, the ``last`` on the last chunk, and an equal run of the ``blocks`` in between on each."""
    per = blocks // chunks
    lo = len(first) + index * per
    return (first if index == 0 else []) + list(range(lo, lo + per)) + (last if index == chunks - 1 else [])


class ChunkState:
    """One micro-batch's state in one chunk, from its F to its last backward."""

    __slots__ = ("caches", "ws", "weights", "extra")

    def __init__(self, ws: Optional[MeteredWorkspace]):
        self.caches: List[object] = []
        self.ws = ws
        self.weights = None          # split backward: [(local layer, weights()) ...] for W
        self.extra = None            # the model's (the GPT's last chunk: the head's input gradient)
