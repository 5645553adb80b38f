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
quantize = reference.quantize_reference
dequant_sum = reference.dequant_sum_reference
host_adamw_update = reference.adamw_reference   # AdamW on host arrays (offloaded optimizer state)


def use_impl(name: str, xp=None, verbose: bool = True) -> str:
    """Point adamw_update, grad_stats and sum_rows at the fused kernels or the NumPy reference.

    ``name``: "fused" (the C library on NumPy, the CUDA kernels on CuPy; ConfigError if they
    cannot be had), "numpy" (the reference), or "auto" (fused when available, else the
    reference and, when ``verbose``, a one-line note on stderr saying why).
    Process-wide. Returns what was chosen: "fused" or "numpy".
    """
    global adamw_update, grad_stats, sum_rows, quantize, dequant_sum, host_adamw_update
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
            host_sum = (fused_cpu.sum_rows_fused_cpu if not fused_cpu.unavailable_reason()
                        else reference.sum_rows_reference)
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
    # Quantization runs where the collectives run, on the host (comm/quantized.py): the C kernels.
    host = name != "numpy" and chosen[2] is not reference.sum_rows_reference
    if host:
        from . import fused_cpu
    quantize = fused_cpu.quantize_fused_cpu if host else reference.quantize_reference
    dequant_sum = fused_cpu.dequant_sum_fused_cpu if host else reference.dequant_sum_reference
    host_adamw_update = fused_cpu.adamw_fused_cpu if host else reference.adamw_reference
    return "numpy" if chosen[0] is reference.adamw_reference else "fused"


def is_device(arr) -> bool:
    """Whether ``arr`` is device memory (a CuPy array): what MPI and NumPy must not be handed, but a copy of."""
    return type(arr).__module__.split(".")[0] == "cupy"


def array_module(arr):
    """numpy, or cupy for a CuPy array."""
    if is_device(arr):
        import cupy
        return cupy
    import numpy
    return numpy


def to_host(arr):
    """A host (NumPy) array of ``arr``'s values: itself, or a copy from the device."""
    if is_device(arr):
        return arr.get()
    import numpy
    return numpy.asarray(arr)


def quantize_any(x, bits: int, block: int):
    """``quantize`` for a host array, the CUDA kernel for a CuPy one (the same bits either way)."""
    if is_device(x):
        from . import cuda
        return cuda.quantize_fused_gpu(x, bits, block)
    return quantize(x, bits, block)


def dequant_sum_any(q_rows, scale_rows, n: int, bits: int, block: int, out, scale: float, accumulate: bool) -> None:
    """``dequant_sum`` into a host array, the CUDA kernel into a CuPy one (the same bits either way)."""
    if is_device(out):
        from . import cuda
        return cuda.dequant_sum_fused_gpu(q_rows, scale_rows, n, bits, block, out, scale, accumulate)
    return dequant_sum(q_rows, scale_rows, n, bits, block, out, scale, accumulate)
