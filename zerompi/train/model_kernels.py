"""The GPT's fused elementwise kernels (kernels/gpt_cpu.c), compiled on first use, called through ctypes.

Built as the AdamW kernels are (optim/fused_cpu.py); each has a float32 and a float64 version, so the
float64 gradient checks test the loops that train. The wrappers raise ValueError on what the C code does
not take, never falling back silently; models.gpt picks the path once (``kernels="auto"``).
"""
import ctypes
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np

from ..optim.fused_cpu import build, lazy_library, open_checked

SOURCE = "gpt_cpu.c"
HEADERS = ("gpt_cpu_body.h",)
PREFIX = "zerompi_gpt_cpu"
ABI_VERSION = 1                      # must match ZGPT_ABI_VERSION in the C source
SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}
_SIGNATURES = {                      # name: argument kinds (p = pointer, i = int64, r = a REAL scalar)
    "layernorm_fwd": "ppppppiir",
    "layernorm_bwd": "pppppppppii",
    "gelu_fwd": "pppii",
    "gelu_bwd": "pppii",
    "softmax_causal_fwd": "piir",
    "softmax_causal_bwd": "ppiir",
    "bias_residual": "pppii",
}


def build_library(directory: Optional[Path] = None, compiler: Optional[list] = None) -> Path:
    """Compile kernels/gpt_cpu.c (unless built already); returns the library's path (BuildError)."""
    return build(directory, compiler=compiler, source=SOURCE, headers=HEADERS, prefix=PREFIX)


def load(path: Path) -> ctypes.CDLL:
    """Open a built library and declare its functions' signatures."""
    lib = open_checked(path, "zgpt_abi_version", ABI_VERSION)
    for sfx, real in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
        kinds = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "r": real}
        for name, sig in _SIGNATURES.items():
            fn = getattr(lib, f"zgpt_{name}_{sfx}")
            fn.argtypes = [kinds[k] for k in sig]
            fn.restype = None
    return lib


_library = lazy_library(lambda: load(build_library()))


def library() -> Optional[ctypes.CDLL]:
    """The process's library (built and loaded on the first call), or None if it cannot be had."""
    return _library()[0]


def unavailable_reason() -> str:
    """Why library() is None ("" when it loaded)."""
    return _library()[1]


def _ptr(a) -> Optional[int]:
    return None if a is None else a.ctypes.data


class Kernels:
    """The kernels on NumPy arrays of one dtype (float32 or float64), with their checks."""

    def __init__(self, lib: ctypes.CDLL, dtype):
        self.dtype = np.dtype(dtype)
        if self.dtype not in SUFFIX:
            raise ValueError(f"model kernels run in float32 or float64, not {self.dtype}")
        sfx = SUFFIX[self.dtype]
        self._fn = {name: getattr(lib, f"zgpt_{name}_{sfx}") for name in _SIGNATURES}

    def _check(self, *arrays) -> None:
        for a in arrays:
            if a is not None and not (isinstance(a, np.ndarray) and a.dtype == self.dtype and a.flags.c_contiguous):
                got = f"{type(a).__name__} {getattr(a, 'dtype', '')}"
                raise ValueError(f"model kernels need C-contiguous {self.dtype} NumPy arrays, got {got}"
                                 f"{'' if getattr(a, 'flags', None) is None or a.flags.c_contiguous else ' (strided)'}")

    @staticmethod
    def _rows(x, c: int, *same) -> int:
        if x.ndim < 1 or x.shape[-1] != c or any(a is not None and a.shape != x.shape for a in same):
            shapes = [getattr(a, "shape", None) for a in same]
            raise ValueError(f"shapes do not match: {x.shape} with rows of {c} and {shapes}")
        return x.size // max(c, 1)

    def layernorm_fwd(self, x, g, b, y, mean, rstd, eps: float) -> None:
        """Rows of x (last axis g.size) -> y; mean and rstd get one value per row."""
        self._check(x, g, b, y, mean, rstd)
        c = g.size
        rows = self._rows(x, c, y)
        if b.size != c or mean.size != rows or rstd.size != rows:
            raise ValueError("layernorm_fwd: g, b, mean or rstd has the wrong length")
        self._fn["layernorm_fwd"](_ptr(x), _ptr(g), _ptr(b), _ptr(y), _ptr(mean), _ptr(rstd), rows, c, eps)

    def layernorm_bwd(self, dy, x, mean, rstd, g, res, dx, dg, db) -> None:
        """dx (+ res when given) and dg, db (overwritten; None to skip) of LayerNorm for upstream dy."""
        self._check(dy, x, mean, rstd, g, res, dx, dg, db)
        c = g.size
        rows = self._rows(dy, c, x, res, dx)
        if mean.size != rows or rstd.size != rows or any(a is not None and a.size != c for a in (dg, db)):
            raise ValueError("layernorm_bwd: mean, rstd, dg or db has the wrong length")
        self._fn["layernorm_bwd"](_ptr(dy), _ptr(x), _ptr(mean), _ptr(rstd), _ptr(g), _ptr(res), _ptr(dx),
                                  _ptr(dg), _ptr(db), rows, c)

    def gelu_fwd(self, f, b, y) -> None:
        """f += b (b None: no bias), y = gelu(f); rows of f's last axis."""
        self._check(f, b, y)
        c = f.shape[-1]
        rows = self._rows(f, c, y)
        if b is not None and b.size != c:
            raise ValueError("gelu_fwd: the bias has the wrong length")
        self._fn["gelu_fwd"](_ptr(f), _ptr(b), _ptr(y), rows, c)

    def gelu_bwd(self, d, f, db) -> None:
        """d *= gelu'(f) in place; db = column sums of the result (None to skip)."""
        self._check(d, f, db)
        c = f.shape[-1]
        rows = self._rows(f, c, d)
        if db is not None and db.size != c:
            raise ValueError("gelu_bwd: db has the wrong length")
        self._fn["gelu_bwd"](_ptr(d), _ptr(f), _ptr(db), rows, c)

    def softmax_causal_fwd(self, s, scale: float) -> None:
        """(..., T, T) scores -> causal softmax(scale * scores), in place (zeros above the diagonal)."""
        self._check(s)
        if s.ndim < 2 or s.shape[-1] != s.shape[-2]:
            raise ValueError(f"softmax_causal_fwd: scores of shape {s.shape} are not square")
        t = s.shape[-1]
        self._fn["softmax_causal_fwd"](_ptr(s), s.size // max(t * t, 1), t, scale)

    def softmax_causal_bwd(self, d, att, scale: float) -> None:
        """d (d att) -> scale * att * (d - rowsum(att * d)) in place (zeros above the diagonal)."""
        self._check(d, att)
        if d.shape != att.shape or d.ndim < 2 or d.shape[-1] != d.shape[-2]:
            raise ValueError(f"softmax_causal_bwd: shapes {d.shape} and {att.shape}")
        t = d.shape[-1]
        self._fn["softmax_causal_bwd"](_ptr(d), _ptr(att), d.size // max(t * t, 1), t, scale)

    def bias_residual(self, out, res, b) -> None:
        """out = res + (out + b), b along the last axis."""
        self._check(out, res, b)
        c = b.size
        rows = self._rows(out, c, res)
        self._fn["bias_residual"](_ptr(out), _ptr(res), _ptr(b), rows, c)


def upcast(a, dtype, out=None):
    """``a`` in ``dtype`` (no copy when it is already): a stored fp16 parameter as float32 goes through
    the AdamW library's F16C conversion (exact, as NumPy's, and faster), into
    ``out`` when given (an array of a's shape and that dtype); anything else is ``a.astype``."""
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a
    if not (isinstance(a, np.ndarray) and a.dtype == np.float16 and dtype == np.float32 and a.flags.c_contiguous):
        return a.astype(dtype)
    from ..optim import fused_cpu
    lib = fused_cpu.library()
    if lib is None:
        return a.astype(dtype)
    if out is None or out.shape != a.shape or out.dtype != dtype or not out.flags.c_contiguous:
        out = np.empty(a.shape, dtype)
    lib.zmp_halves_to_floats(out.ctypes.data, a.ctypes.data, a.size)
    return out


@lru_cache(maxsize=None)
def kernels_for(dtype) -> Optional[Kernels]:
    """Kernels for this dtype (float32, float64) when the library loads, else None."""
    lib = library()
    if lib is None or np.dtype(dtype) not in SUFFIX:
        return None
    return Kernels(lib, dtype)
