"""How a tensor-parallel parameter is cut into pieces and put back (NumPy only, no MPI).

A split is ``(axis, groups)``: the axis is cut into ``groups`` equal parts (3 for the GPT's fused
QKV: q, k and v), each part into ``size`` equal runs, and TP rank ``r`` holds run ``r`` of every
part, concatenated along the axis (so its q, k and v columns are its own heads'). A parameter
without a split is replicated: every TP rank holds all of it.
"""
from typing import Sequence

import numpy as np


def piece(full: np.ndarray, axis: int, groups: int, rank: int, size: int) -> np.ndarray:
    """TP rank ``rank``'s piece of ``full`` (a new contiguous array)."""
    parts = np.split(full, groups, axis=axis)
    return np.ascontiguousarray(np.concatenate([np.split(p, size, axis=axis)[rank] for p in parts], axis=axis))


def merge(pieces: Sequence[np.ndarray], axis: int, groups: int) -> np.ndarray:
    """The full parameter from every TP rank's piece, in rank order (the inverse of :func:`piece`)."""
    cut = [np.split(p, groups, axis=axis) for p in pieces]
    return np.concatenate([cut[r][g] for g in range(groups) for r in range(len(pieces))], axis=axis)


def check_divides(size: int, **dims: int) -> None:
    """ValueError naming the first dimension ``size`` does not divide."""
    for name, v in dims.items():
        if v % size:
            raise ValueError(f"tp={size} does not divide {name}={v}")
