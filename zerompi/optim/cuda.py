"""The CUDA kernels through CuPy: the fused AdamW and gradient pre-pass (kernels/fused_adamw.cu)
and block quantization (kernels/quantize.cu).

CuPy is imported on first use only, so this module imports on machines without it. Each
source is compiled once per process by NVRTC (``cupy.RawModule``; CuPy also keeps the
binary in its own disk cache) with ``--fmad=false``: no multiply-add contraction, so the
GPU rounds every operation as the NumPy references do. The local headers are pasted into
the source text rather than included, so CuPy's cache key (the text) changes with them.
"""
import re
from functools import lru_cache
from typing import Tuple

import numpy as np

from . import dtypes, reference
from .sources import read_source

SOURCE = "fused_adamw.cu"
QUANT_SOURCE = "quantize.cu"
OPTIONS = ("--std=c++14", "--fmad=false")
THREADS = 256          # ZMP_THREADS in the source: block_sum assumes it
VEC = 8                # ZMP_VEC: elements per vector step
MAX_PREPASS_BLOCKS = 1024


_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.M)


def full_source(name: str = SOURCE) -> str:
    """The .cu text with its local headers (``#include "x.h"``) pasted in, each once."""
    seen = set()

    def paste(text: str) -> str:
        def one(m):
            header = m.group(1)
            if header in seen:
                return ""
            seen.add(header)
            return paste(read_source(header))
        return _INCLUDE.sub(one, text)
    return paste(read_source(name))


@lru_cache(maxsize=None)
def _module(name: str = SOURCE):
    import cupy
    return cupy.RawModule(code=full_source(name), options=OPTIONS)


@lru_cache(maxsize=None)
def unavailable_reason() -> str:
    """"" when CuPy sees a GPU and the kernels compile, else why not (one line)."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no GPU"
        _module().get_function("zmp_adamw_f16")
    except Exception as e:  # ImportError, CUDA driver or NVRTC errors: all mean "not here"
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
    return ""


@lru_cache(maxsize=None)
def _grid_limit() -> int:
    import cupy
    return 8 * cupy.cuda.Device().attributes["MultiProcessorCount"]


def _suffix(dt) -> str:
    """The kernel variant for storage dtype ``dt``: "f16", "f32", "bf16", or "" (none: the reference)."""
    dt = np.dtype(dt)
    if dt == np.float16:
        return "f16"
    if dt == np.float32:
        return "f32"
    return "bf16" if dtypes.is_bf16(dt) else ""


def _aligned(*arrays) -> bool:
    return all(a.data.ptr % 16 == 0 for a in arrays)


def adamw_fused_gpu(master, m, v, grad, param_out, s: reference.AdamWScalars) -> None:
    """reference.adamw_reference in one kernel launch over CuPy arrays (fp16, bf16 or fp32 grad and
    param_out, the same dtype)."""
    import cupy
    n = master.size
    io = np.dtype(grad.dtype)
    if not (m.size == v.size == grad.size == param_out.size == n):
        raise ValueError(f"adamw: lengths differ: master {n}, m {m.size}, v {v.size}, "
                         f"grad {grad.size}, param_out {param_out.size}")
    arrays = (master, m, v, grad, param_out)
    if (not _suffix(io) or param_out.dtype != io or master.dtype != np.float32
            or not all(isinstance(a, cupy.ndarray) and a.flags.c_contiguous for a in arrays)):
        return reference.adamw_reference(master, m, v, grad, param_out, s)
    if n == 0:
        return
    vec = _aligned(*arrays)
    work = -(-n // VEC) if vec else n
    blocks = max(1, min(_grid_limit(), -(-work // THREADS)))
    kernel = _module().get_function("zmp_adamw_" + _suffix(io))
    kernel((blocks,), (THREADS,), (*arrays, np.int64(n), np.int32(vec), *[np.float32(x) for x in s]))


def grad_stats_fused_gpu(grad) -> Tuple[float, bool]:
    """reference.grad_stats_reference on the GPU: float64 sum of squares and non-finite flag.

    Deterministic: the summation order depends on the length only (the block count is a
    function of n), not on the slice's address. Synchronizes (returns host numbers).
    """
    import cupy
    io = np.dtype(grad.dtype)
    if not _suffix(io) or not grad.flags.c_contiguous:
        return reference.grad_stats_reference(grad)
    n = grad.size
    if n == 0:
        return 0.0, False
    blocks = max(1, min(MAX_PREPASS_BLOCKS, -(-n // (VEC * THREADS))))
    partials = cupy.empty(blocks, np.float64)
    out = cupy.empty(2, np.float64)
    mod = _module()
    kernel = mod.get_function("zmp_grad_sumsq_" + _suffix(io))
    kernel((blocks,), (THREADS,), (grad, np.int64(n), np.int32(_aligned(grad)), partials))
    mod.get_function("zmp_sum_partials")((1,), (THREADS,), (partials, np.int32(blocks), out))
    sumsq, bad = out.get()
    return float(sumsq), bool(bad)


# ---- block quantization ---------------------------------------------------------------------
def quantize_fused_gpu(x, bits: int, block: int):
    """reference.quantize_reference on CuPy arrays: (q, scales) as CuPy arrays, the same bits."""
    import cupy
    io = np.dtype(x.dtype)
    if not _suffix(io) or not x.flags.c_contiguous:
        q, scales = reference.quantize_reference(cupy.asnumpy(x), bits, block)
        return cupy.asarray(q), cupy.asarray(scales)
    n = x.size
    nb = -(-n // block)
    q = cupy.empty(reference.quantized_bytes(n, bits), np.uint8)
    scales = cupy.empty(nb, np.float32)
    if n:
        kernel = _module(QUANT_SOURCE).get_function("zmp_quantize_" + _suffix(io))
        kernel((nb,), (THREADS,), (x, np.int64(n), np.int32(bits), np.int64(block), q, scales))
    return q, scales


def dequant_sum_fused_gpu(q_rows, scale_rows, n: int, bits: int, block: int, out, scale: float,
                          accumulate: bool) -> None:
    """reference.dequant_sum_reference on CuPy arrays (the same bits), one kernel launch."""
    import cupy
    io = np.dtype(out.dtype)
    if n == 0:
        return
    qp = cupy.asarray(np.array([q.data.ptr for q in q_rows], np.uint64))
    sp = cupy.asarray(np.array([s.data.ptr for s in scale_rows], np.uint64))
    blocks = max(1, min(_grid_limit(), -(-n // THREADS)))
    kernel = _module(QUANT_SOURCE).get_function("zmp_dequant_sum_" + _suffix(io))
    kernel((blocks,), (THREADS,), (qp, sp, np.int32(len(q_rows)), np.int64(n), np.int32(bits), np.int64(block), out,
                                   np.float32(scale), np.int32(scale != 1.0), np.int32(bool(accumulate))))
