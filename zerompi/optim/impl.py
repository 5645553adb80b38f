"""Which implementation the engine calls: the fused kernels or the NumPy references.

``adamw_update``, ``grad_stats`` and ``sum_rows`` below are what the engine's step and the
reduce-scatter's local sum call; :func:`use_impl` points them at the fused kernels (the C
library on NumPy, the CUDA kernels on CuPy) or at the NumPy references. Every fused
kernel rounds exactly as its reference does, so the choice changes speed, never bits.
"""
from . import reference

OPTIMIZER_IMPLS = ("auto", "fused", "numpy")

# What the engine calls; use_impl() rebinds them (process-wide).
adamw_update = reference.adamw_reference
grad_stats = reference.grad_stats_reference
sum_rows = reference.sum_rows_reference


def use_impl(name: str, xp=None, verbose: bool = True) -> str:
    """Point adamw_update, grad_stats and sum_rows at the fused kernels or the NumPy reference.

    ``name``: "fused" (the C library on NumPy, the CUDA kernels on CuPy; ConfigError if they
    cannot be had), "numpy" (the reference), or "auto" (fused when available, else the
    reference and, when ``verbose``, a one-line note on stderr saying why).
    Process-wide. Returns what was chosen: "fused" or "numpy".
    """
    global adamw_update, grad_stats, sum_rows
    from ..errors import ConfigError
    if name not in OPTIMIZER_IMPLS:
        raise ConfigError(f"optimizer_impl={name!r} is not allowed; use one of {', '.join(OPTIMIZER_IMPLS)}")
    on_gpu = getattr(xp, "__name__", "") == "cupy"
    chosen = (reference.adamw_reference, reference.grad_stats_reference, reference.sum_rows_reference)
    if name != "numpy":
        from . import fused_cpu
        if on_gpu:
            # The reduce-scatter's sum runs on the host (comm/staging.py stages device buffers through
            # pinned host memory): the C sum when it builds, else the reference; same bits either way.
            from . import cuda as kernels
            host_sum = fused_cpu.sum_rows_fused_cpu if not fused_cpu.unavailable_reason() else reference.sum_rows_reference
            fused = (kernels.adamw_fused_gpu, kernels.grad_stats_fused_gpu, host_sum)
        else:
            kernels = fused_cpu
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
    adamw_update, grad_stats, sum_rows = chosen
    return "numpy" if chosen[0] is reference.adamw_reference else "fused"
