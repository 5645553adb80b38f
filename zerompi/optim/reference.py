"""The NumPy references: AdamW on a flat shard (and the scalars of one step), the gradient
pre-pass, the reduce-scatter's local sum, and block quantization (kernels/quant_math.h).

The reference does, element by element and in float32, exactly the operations the
fused kernels do (kernels/adamw_math.h), in the same order, so the fused kernels match
it to 0 ulp (tests/test_kernels.py). Every operation is elementwise: an element's result does
not depend on which rank updates it or where its slice starts, which is what makes
stages 0-3 bit-identical.
"""
import math
from typing import NamedTuple, Tuple

import numpy as np

F32 = np.float32


class AdamWScalars(NamedTuple):
    """The per-step constants, each rounded to float32 once on the host."""
    lr: np.float32
    beta1: np.float32
    one_minus_beta1: np.float32
    beta2: np.float32
    one_minus_beta2: np.float32
    inv_bias1: np.float32      # 1 / (1 - beta1**step)
    inv_bias2: np.float32      # 1 / (1 - beta2**step)
    eps: np.float32
    weight_decay: np.float32
    grad_scale: np.float32     # clip_coef / loss_scale: turns stored gradients into true ones


def adamw_scalars(lr, beta1, beta2, eps, weight_decay, step: int, grad_scale: float) -> AdamWScalars:
    """Constants for update number ``step`` (1-based), computed in float64 then rounded."""
    return AdamWScalars(
        F32(lr), F32(beta1), F32(1.0 - beta1), F32(beta2), F32(1.0 - beta2),
        F32(1.0 / (1.0 - beta1 ** step)), F32(1.0 / (1.0 - beta2 ** step)),
        F32(eps), F32(weight_decay), F32(grad_scale),
    )


def adamw_reference(master, m, v, grad, param_out, s: AdamWScalars) -> None:
    """One AdamW update in place, float32 math (NumPy; about ten passes over memory).

    master, m, v: float32 arrays (updated); grad: fp16/fp32 stored gradient (read);
    param_out: fp16/fp32 copy of the new master (written). All the same length.
    """
    g = grad.astype(F32) * s.grad_scale
    m *= s.beta1
    m += s.one_minus_beta1 * g
    v *= s.beta2
    v += s.one_minus_beta2 * (g * g)
    denom = np.sqrt(v * s.inv_bias2) + s.eps
    update = (m * s.inv_bias1) / denom + s.weight_decay * master
    master -= s.lr * update
    param_out[...] = master


def grad_stats_reference(grad) -> Tuple[float, bool]:
    """Sum of squares (float64) of a stored-gradient slice and whether any element is inf/NaN."""
    g = grad.astype(np.float64)
    # np.sum is pairwise in a fixed order (unlike BLAS dot, whose order can follow threads).
    sumsq = float(np.sum(g * g)) if g.size else 0.0
    return sumsq, not math.isfinite(sumsq)


def sum_rows_reference(rows, out, scale: float, accumulate: bool, addrs=None) -> None:
    """``out = cast([out +] scale * (rows[0] + rows[1] + ...))`` with fp32 accumulation in row order.

    ``rows``: a sequence of 1-D arrays of ``out``'s length (or a 2-D array), anywhere in
    memory; ``out`` may be one of them. ``addrs`` (the rows' addresses, for the C sum) is
    ignored here. The reference for the reduce-scatter's local sum; it is elementwise, so
    the result of an element does not depend on where the slice starts or how long it is.
    """
    with np.errstate(over="ignore", invalid="ignore"):   # overflow is detected by the step
        acc = rows[0].astype(F32)
        for r in range(1, len(rows)):
            np.add(acc, rows[r], out=acc)
        if scale != 1.0:
            np.multiply(acc, F32(scale), out=acc)
        if accumulate:
            np.add(acc, out, out=acc)
        out[...] = acc


# ---- block quantization (kernels/quant_math.h: the same float32 operations) -------------------
QMAX = {8: F32(127.0), 4: F32(7.0)}


def quantized_bytes(n: int, bits: int) -> int:
    """Bytes of the quantized values of n elements (int4: two per byte)."""
    return n if bits == 8 else (n + 1) // 2


def quantize_reference(x, bits: int, block: int):
    """(q, scales): ``x`` (float16/float32, 1-D) in blocks of ``block`` elements, symmetric, one
    float32 scale per block (max |x| / qmax), values rounded half to even; int8 one per byte,
    int4 two per byte (element 2j in the low nibble). A block whose scale is 0, inf or NaN is
    stored as zeros (its scale says which)."""
    xf = np.asarray(x).astype(F32).reshape(-1)
    n = xf.size
    nb = -(-n // block)
    pad = np.zeros(nb * block, F32)
    pad[:n] = xf
    blocks = pad.reshape(nb, block)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.max(np.abs(blocks), axis=1)                 # NaN propagates, as in the kernels
        scales = (amax / QMAX[bits]).astype(F32)
        zero = ~((scales > 0) & np.isfinite(scales))
        q = np.rint(blocks / np.where(zero, F32(1), scales)[:, None])
    q = np.clip(q, -QMAX[bits], QMAX[bits])
    q[zero] = 0
    q = q.reshape(-1)[:n].astype(np.int8)
    if bits == 8:
        return q.view(np.uint8), scales
    nib = (q.astype(np.int16) & 0xF).astype(np.uint8)
    if n % 2:
        nib = np.append(nib, np.uint8(0))
    return (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8), scales


def dequantize_reference(q, scales, n: int, bits: int, block: int) -> np.ndarray:
    """The float32 values of n quantized elements."""
    if bits == 8:
        v = q[:n].view(np.int8).astype(F32)
    else:
        lo = (q & 0xF).astype(np.int16)
        hi = (q >> 4).astype(np.int16)
        v = np.empty(2 * q.size, np.int16)
        v[0::2], v[1::2] = lo, hi
        v = np.where(v >= 8, v - 16, v)[:n].astype(F32)
    with np.errstate(invalid="ignore", over="ignore"):
        return v * np.repeat(scales, block)[:n]


def dequant_sum_reference(q_rows, scale_rows, n: int, bits: int, block: int, out, scale: float,
                          accumulate: bool) -> None:
    """``out = cast([out +] scale * sum_r dequantized(row r))``, float32 in row order (sum_rows over
    quantized rows)."""
    with np.errstate(over="ignore", invalid="ignore"):
        acc = dequantize_reference(q_rows[0], scale_rows[0], n, bits, block)
        for r in range(1, len(q_rows)):
            np.add(acc, dequantize_reference(q_rows[r], scale_rows[r], n, bits, block), out=acc)
        if scale != 1.0:
            np.multiply(acc, F32(scale), out=acc)
        if accumulate:
            np.add(acc, out, out=acc)
        out[...] = acc
