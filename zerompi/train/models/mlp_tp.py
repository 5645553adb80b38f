"""The MLP, tensor-parallel: blocks alternate column-parallel (even: W's columns and b split, GELU on the split
output) and row-parallel (odd: W's rows split, partial products all-reduced, then the replicated bias); one
all-reduce per odd block forward, one per even block but block 0 backward. The depth is even, so the output is
whole on every TP rank. Names as the MLP's, shapes the pieces'.
"""
from typing import Dict, Tuple

import numpy as np

from ...comm.tp_pieces import check_divides
from ...engine import lazy
from .mlp import MLP, gelu


def contiguous(a):
    """``a`` C-contiguous on the host (NumPy's ascontiguousarray would pull a CuPy array down: the TP
    all-reduce stages device arrays itself)."""
    return np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a


class TPMLP(MLP):
    def __init__(self, width: int, depth: int, seed: int = 0, tp=None):
        super().__init__(width, depth, seed)
        check_divides(tp.size, width=width)
        if depth % 2:
            raise ValueError(f"depth={depth} is odd; the tensor-parallel MLP pairs column- and row-parallel "
                             "blocks, so use an even depth")
        self.tp = tp

    def tp_split(self) -> Dict[str, Tuple[int, int]]:
        out = {}
        for i in range(self.depth):
            if i % 2 == 0:
                out[f"block{i}.weight"], out[f"block{i}.bias"] = (1, 1), (0, 1)
            else:
                out[f"block{i}.weight"] = (0, 1)
        return out

    def lazy_layers(self):
        """The full model's rules, each split parameter cut to this TP rank's piece (lazy.Piece)."""
        split, r, k = self.tp_split(), self.tp.rank, self.tp.size
        return [(lname, {n: lazy.Piece(a, *split[n], r, k) if n in split else a for n, a in params.items()})
                for lname, params in super().lazy_layers()]

    def init_layers(self):
        """lazy_layers() made whole: this TP rank's pieces as float32 arrays."""
        return lazy.materialize(self.lazy_layers())

    def forward_layer(self, i, params, x):
        w = self._weight(params, i)
        b = params[f"block{i}.bias"].astype(np.float32, copy=False)
        if i % 2:
            z = self.tp.all_reduce(contiguous(x @ w)) + b
        else:
            z = x @ w + b
        if i == self.depth - 1:
            return z, (x, None)
        return gelu(z), (x, z)

    def backward_layer_parts(self, i, params, cache, dy):
        dx, weights = super().backward_layer_parts(i, params, cache, dy)
        if i % 2 == 0 and dx is not None:
            dx = self.tp.all_reduce(contiguous(dx))
        return dx, weights

    def activation_spec(self, i: int, rows: int):
        """A column-parallel block's output stays split: this rank's columns."""
        split = i % 2 == 0 and i != self.depth - 1
        return (rows, self.width // self.tp.size if split else self.width), np.float32

    def tp_bytes_per_micro_batch(self, rows: int, itemsize: int = 4) -> int:
        k = self.tp.size
        return (self.depth - 1) * 2 * (k - 1) * (rows * self.width // k) * itemsize
