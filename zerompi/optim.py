"""AdamW on a flat shard: the scalars of one step and the NumPy reference update.

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


# The implementation the engine calls; use_impl() points them at the fused kernels.
adamw_update = adamw_reference
grad_stats = grad_stats_reference


def use_impl(name: str, xp=np, verbose: bool = True) -> str:
    """Point adamw_update, grad_stats and comm.sum_rows at the fused kernels or the NumPy reference.

    ``name``: "fused" (the C library on NumPy, the CUDA kernels on CuPy; ConfigError if they
    cannot be had), "numpy" (the reference), or "auto" (fused when available, else the
    reference and, when ``verbose``, a one-line note on stderr saying why).
    Process-wide. Returns what was chosen: "fused" or "numpy".
    """
    global adamw_update, grad_stats
    from . import comm
    from .config import OPTIMIZER_IMPLS
    from .errors import ConfigError
    if name not in OPTIMIZER_IMPLS:
        raise ConfigError(f"optimizer_impl={name!r} is not allowed; use one of {', '.join(OPTIMIZER_IMPLS)}")
    on_gpu = getattr(xp, "__name__", "") == "cupy"
    chosen = (adamw_reference, grad_stats_reference, comm.sum_rows_reference)
    if name != "numpy":
        if on_gpu:
            # The reduce-scatter's sum runs on the host (staging.py stages device buffers through
            # pinned host memory): the C sum when it builds, else the reference; same bits either way.
            from . import fused_cpu
            from . import kernels_gpu as kernels
            host_sum = fused_cpu.sum_rows_fused_cpu if not fused_cpu.unavailable_reason() else comm.sum_rows_reference
            fused = (kernels.adamw_fused_gpu, kernels.grad_stats_fused_gpu, host_sum)
        else:
            from . import fused_cpu as kernels
            fused = (kernels.adamw_fused_cpu, kernels.grad_stats_fused_cpu, kernels.sum_rows_fused_cpu)
        reason = kernels.unavailable_reason()
        if not reason:
            chosen = fused
        elif name == "fused":
            raise ConfigError(f"optimizer_impl='fused' is not available: {reason}; use auto or numpy")
        elif verbose:
            import sys
            print(f"zerompi: fused optimizer kernels unavailable ({reason}); using the NumPy reference",
                  file=sys.stderr, flush=True)
    adamw_update, grad_stats, comm.sum_rows = chosen
    return "numpy" if chosen[0] is adamw_reference else "fused"
