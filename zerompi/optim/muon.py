"""Muon's arithmetic on NumPy or CuPy arrays: the Nesterov momentum (elementwise, on any slice) and
the Newton-Schulz orthogonalisation of one whole matrix, with its shape scale.

Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025) updates a 2-D weight ``W`` from its gradient
``G``, in float32 here::

    B <- mu B + G                      momentum (the row ``momentum``)
    U <- G + mu B                      Nesterov
    O <- NS5(U)                        5 Newton-Schulz iterations, quintic (a, b, c) = (3.4445, -4.7750, 2.0315)
    W <- W - lr (0.2 sqrt(max(A, B)) O + wd W)     Moonlight's scale: O's RMS matched to AdamW's update,
                                                   so Muon shares AdamW's lr and decoupled weight decay

The momentum is elementwise, so a rank updates its own slices of a matrix (the same bits whatever
the slicing); only NS needs the whole matrix, and one rank runs it (engine/matrix_owners.py).
NS is the reference's: X = U / (|U|_F + 1e-7) (transposed when it has more rows than columns),
then X <- a X + (b A + c A A) X with A = X X^T; the norm is summed in float64 (a fixed order).
"""
import math

import numpy as np

F32 = np.float32
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


def momentum_update(buf, grad, grad_scale, mu, out) -> None:
    """``buf = mu buf + g`` and ``out = g + mu buf`` (Nesterov), g = grad as float32 times ``grad_scale``
    (clip / loss scale), all float32, elementwise. ``buf``, ``out``: float32; ``grad``: the stored dtype."""
    g = grad.astype(F32) * F32(grad_scale)
    buf *= F32(mu)
    buf += g
    out[...] = g + F32(mu) * buf


def shape_scale(shape) -> np.float32:
    """Moonlight's update scale of a (rows, cols) matrix: 0.2 sqrt(max(rows, cols))."""
    return F32(0.2 * math.sqrt(max(shape)))


def newton_schulz(u, steps: int = NS_STEPS):
    """The orthogonalised float32 matrix of the 2-D float32 ``u`` (NumPy or CuPy), ``steps`` iterations."""
    from .impl import array_module
    xp = array_module(u)
    a, b, c = (F32(k) for k in NS_COEFFICIENTS)
    tall = u.shape[0] > u.shape[1]
    x = u.T if tall else u
    norm = F32(math.sqrt(float(xp.sum(x.astype(np.float64) ** 2))))
    x = xp.ascontiguousarray(x / (norm + F32(NS_EPS)), dtype=F32)
    for _ in range(steps):
        A = x @ x.T
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x.T if tall else x


def apply_update(master, o, lr, scale, weight_decay, param_out) -> None:
    """``master -= lr (scale o + wd master)`` in float32 (decoupled decay, as AdamW's); ``param_out`` the new
    master in the stored dtype. All 1-D, the same length (a rank's piece of one matrix)."""
    master -= F32(lr) * (F32(scale) * o + F32(weight_decay) * master)
    param_out[...] = master
