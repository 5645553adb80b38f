"""Where a chunk's gradients go: to its engine at once, or accumulated and handed over once per step.

``"micro-batch"`` (the default): each layer's gradients go to the engine as they come, and the
engine reduce-scatters them per micro-batch and sums the reduced micro-batches in micro-batch order,
as without pipelining: the same bits. ``"step"`` (Megatron's): each layer's gradients are summed in
float32 on this rank over the step's micro-batches (in micro-batch order) and handed to the engine
once, after the last, divided by the micro-batch count; the engine (configured with one micro-batch)
then reduces once per step: m times less data-parallel traffic, 4 bytes per parameter more memory,
and the sums run in another order (float32 before the reduction instead of after), so not the same
bits: docs/pipeline.md has the measured difference.
"""
from typing import Dict

import numpy as np

F32 = np.float32


class GradSink:
    """``sink(layer, grads)``: hand a micro-batch's gradients of one of ``engine``'s layers on."""

    def __init__(self, engine, mode: str, micro_batches: int):
        self.engine, self.mode, self.m = engine, mode, micro_batches
        self.acc: Dict[int, Dict[str, np.ndarray]] = {}     # layer -> {param: float32 sum so far}
        self.count: Dict[int, int] = {}
        self.bytes = self.peak_bytes = 0                    # the accumulator's bytes now, and at most

    def __call__(self, layer: int, grads) -> None:
        if self.mode == "micro-batch":
            self.engine.grads_ready(layer, grads)
            return
        acc = self.acc.setdefault(layer, {})
        for name, g in grads.items():
            if name in acc:
                acc[name] += g
            else:
                acc[name] = g.astype(F32, copy=True)      # NumPy, or CuPy on a GPU
                self.bytes += acc[name].nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.count[layer] = self.count.get(layer, 0) + 1
        if self.count[layer] == self.m:
            inv = F32(1.0 / self.m)
            self.engine.grads_ready(layer, {name: a * inv for name, a in acc.items()})
            self.bytes -= sum(a.nbytes for a in acc.values())
            del self.acc[layer], self.count[layer]
