"""The fused CPU kernels (kernels/fused_adamw_cpu.c), compiled on first use, called through ctypes.

Built once per machine by the system C compiler (``$CC``, else cc, gcc or clang) into a
cache folder (``$ZEROMPI_CACHE_DIR``, else ``$XDG_CACHE_HOME/zerompi``, else
``~/.cache/zerompi``), named by a hash of the sources, the flags, the compiler and the CPU,
so a changed source or another machine never picks up a stale library. Ranks that start
together may all compile; each writes a private file and renames it into place, so the
library is always whole. Why on first use rather than at install: docs/kernels.md.

Flags: ``-O3 -ffp-contract=off`` (never -ffast-math): vectorized, yet every element is
rounded exactly as reference.adamw_reference and reference.sum_rows_reference round it.
"""
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence, Tuple

import numpy as np

from . import dtypes, reference
from .sources import kernels_dir

SOURCE = "fused_adamw_cpu.c"
HEADERS = ("adamw_math.h", "quant_math.h", "bf16_cpu.h", "quantize_cpu.h")
ABI_VERSION = 4                      # must match ZMP_ABI_VERSION in the C source
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11", "-fPIC", "-shared")
NATIVE_FLAGS = ("-march=native",)    # tried first; dropped if the compiler rejects it
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
SUFFIXES = ("f16", "f32", "bf16")    # each kernel's variants: fp16, fp32 and bfloat16 storage


class BuildError(RuntimeError):
    """The C library could not be compiled or loaded (no compiler, compiler error, bad library)."""


class _Scalars(ctypes.Structure):
    """zmp_adamw_scalars: reference.AdamWScalars as float32 fields, same order."""
    _fields_ = [(name, ctypes.c_float) for name in reference.AdamWScalars._fields]


# ---- build ------------------------------------------------------------------------------
def find_compiler() -> Optional[list]:
    """The C compiler command: ``$CC`` split like a shell would, else cc, gcc or clang on PATH."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    return None


def cache_dir() -> Path:
    """Where compiled libraries are kept (created if missing; a temp folder if that fails)."""
    base = os.environ.get("ZEROMPI_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "zerompi")
    try:
        os.makedirs(base, exist_ok=True)
        if os.access(base, os.W_OK):
            return Path(base)
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"zerompi-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def _cpu_identity() -> str:
    """What -march=native depends on: the machine and, on Linux, the CPU feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + "|" + flags


def _compiler_identity(cc: list) -> str:
    try:
        out = subprocess.run(cc + ["--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"C compiler {' '.join(cc)!r} cannot run ({e})")
    return " ".join(cc) + "|" + (out.stdout.splitlines() or [""])[0]


def build(directory: Optional[Path] = None, extra_flags: Sequence[str] = (), compiler: Optional[list] = None,
          source: str = SOURCE, headers: Sequence[str] = HEADERS, prefix: str = "zerompi_fused_cpu") -> Path:
    """Compile the C kernels unless a library for these sources, flags, compiler and CPU exists.

    Returns the library's path; raises BuildError when no compiler works.
    ``extra_flags`` (e.g. ``-DZMP_FP16_SOFT``) lets tests build the other code paths.
    ``source``, ``headers`` and ``prefix`` (the library's file name) build another kernel
    file of kernels/ the same way (the model's kernels: train/model_kernels.py).
    """
    cc = compiler or find_compiler()
    if not cc:
        raise BuildError("no C compiler found (looked for $CC, cc, gcc, clang)")
    src = kernels_dir()
    text = b"".join((src / name).read_bytes() for name in (source,) + tuple(headers))
    ident = _compiler_identity(cc)
    directory = Path(directory) if directory is not None else cache_dir()
    errors = []
    for flags in (BASE_FLAGS + NATIVE_FLAGS + tuple(extra_flags), BASE_FLAGS + tuple(extra_flags)):
        cpu = _cpu_identity() if NATIVE_FLAGS[0] in flags else platform.machine()
        key = hashlib.sha256(b"\0".join([text, " ".join(flags).encode(), ident.encode(), cpu.encode()])).hexdigest()
        path = directory / f"{prefix}-{key[:20]}.so"
        if path.exists():
            return path
        fd, tmp = tempfile.mkstemp(suffix=".so", prefix=path.stem + ".", dir=directory)
        os.close(fd)
        cmd = cc + list(flags) + ["-I", str(src), str(src / source), "-o", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            os.unlink(tmp)
            raise BuildError(f"C compiler {' '.join(cc)!r} cannot run ({e})")
        if proc.returncode == 0:
            os.replace(tmp, path)            # atomic: concurrent ranks never see half a file
            return path
        os.unlink(tmp)
        errors.append((proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1])
    raise BuildError(f"{' '.join(cc)} failed to compile {source}: {errors[-1]}")


def open_checked(path: Path, abi: str, version: int) -> ctypes.CDLL:
    """Open a built library whose C function ``abi`` returns its ABI version, which must be ``version``
    (BuildError otherwise: every kernel library's loader)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise BuildError(f"cannot load {path}: {e}")
    got = getattr(lib, abi)()
    if got != version:
        raise BuildError(f"{path} has ABI {got}, expected {version}")
    return lib


def load(path: Path) -> ctypes.CDLL:
    """Open a built library and declare its functions' signatures."""
    lib = open_checked(path, "zmp_abi_version", ABI_VERSION)
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    for name in (f"zmp_adamw_{x}" for x in SUFFIXES):
        getattr(lib, name).argtypes = [p, p, p, p, p, i64, ctypes.POINTER(_Scalars)]
        getattr(lib, name).restype = None
    for name in (f"zmp_grad_stats_{x}" for x in SUFFIXES):
        getattr(lib, name).argtypes = [p, i64, ctypes.POINTER(ctypes.c_double)]
        getattr(lib, name).restype = i32
    for name in (f"zmp_sum_rows_{x}" for x in SUFFIXES):
        getattr(lib, name).argtypes = [p, i64, i64, p, f32, i32, i32]
        getattr(lib, name).restype = None
    for name in (f"zmp_quantize_{x}" for x in SUFFIXES):
        getattr(lib, name).argtypes = [p, i64, i32, i64, p, p]
        getattr(lib, name).restype = None
    for name in (f"zmp_dequant_sum_{x}" for x in SUFFIXES):
        getattr(lib, name).argtypes = [p, p, i64, i64, i32, i64, p, f32, i32, i32]
        getattr(lib, name).restype = None
    for name in ("zmp_halves_to_floats", "zmp_floats_to_halves"):
        getattr(lib, name).argtypes = [p, p, i64]
        getattr(lib, name).restype = None
    lib.zmp_fp16_path.restype = ctypes.c_char_p
    return lib


def lazy_library(make):
    """A function returning (the library ``make()`` builds and loads, "") on its first call and ever
    after, or (None, why) when it cannot be had; for every kernel library (this one, the GPT's)."""
    @lru_cache(maxsize=None)
    def attempt() -> Tuple[Optional[ctypes.CDLL], str]:
        try:
            return make(), ""
        except (BuildError, FileNotFoundError, OSError) as e:
            return None, str(e)
    return attempt


_library = lazy_library(lambda: load(build()))


def library() -> Optional[ctypes.CDLL]:
    """The process's library (built and loaded on the first call), or None if it cannot be had."""
    return _library()[0]


def unavailable_reason() -> str:
    """Why library() is None ("" when it loaded)."""
    return _library()[1]


# ---- the kernels, with optim's and comm's calling conventions -------------------------
def _ptr(a) -> int:
    return a.ctypes.data


def _flat_ok(a, dtype) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == dtype and a.flags.c_contiguous


def _suffix(dt) -> str:
    """The kernel variant for storage dtype ``dt``: "f16", "f32", "bf16", or "" (none: the reference)."""
    if dt == F16:
        return "f16"
    if dt == F32:
        return "f32"
    return "bf16" if dt is not None and dtypes.is_bf16(dt) else ""


def adamw_fused_cpu(master, m, v, grad, param_out, s: reference.AdamWScalars, lib=None) -> None:
    """reference.adamw_reference in one pass (C): same arguments, same float32 results.

    fp16, bf16 or fp32 grad and param_out (the same dtype) on contiguous arrays; other
    combinations go to the reference.
    """
    lib = lib or library()
    n = master.size
    if not (m.size == v.size == grad.size == param_out.size == n):
        raise ValueError(f"adamw: lengths differ: master {n}, m {m.size}, v {v.size}, "
                         f"grad {grad.size}, param_out {param_out.size}")
    io = grad.dtype if grad.dtype == param_out.dtype else None
    sfx = _suffix(io)
    if not sfx or not all(_flat_ok(a, F32) for a in (master, m, v)) or not all(
            _flat_ok(a, io) for a in (grad, param_out)):
        return reference.adamw_reference(master, m, v, grad, param_out, s)
    fn = getattr(lib, "zmp_adamw_" + sfx)
    fn(_ptr(master), _ptr(m), _ptr(v), _ptr(grad), _ptr(param_out), n, ctypes.byref(_Scalars(*s)))


def grad_stats_fused_cpu(grad, lib=None) -> Tuple[float, bool]:
    """reference.grad_stats_reference in one pass (C): float64 sum of squares, non-finite flag.

    The summation order (32 interleaved partial sums, fixed tree) differs from NumPy's
    pairwise sum, so the sum may differ from the reference in the last bits; it depends
    only on the values and their order, never on where the slice lies in memory.
    """
    lib = lib or library()
    sfx = _suffix(getattr(grad, "dtype", None))
    if not sfx or not _flat_ok(grad, grad.dtype):
        return reference.grad_stats_reference(grad)
    out = ctypes.c_double()
    fn = getattr(lib, "zmp_grad_stats_" + sfx)
    bad = fn(_ptr(grad), grad.size, ctypes.byref(out))
    return out.value, bool(bad)


def sum_rows_fused_cpu(rows, out, scale: float, accumulate: bool, addrs=None, lib=None) -> None:
    """reference.sum_rows_reference in one pass (C); bit-identical results.

    ``rows``: a sequence of 1-D arrays (or a 2-D array); ``addrs``: their addresses as a
    ctypes array, when the caller has them (the Communicator keeps them per receive
    buffer), which skips the per-row checks: the caller vouches for contiguous rows of
    ``out``'s dtype and length. Anything the C code cannot take goes to the reference.
    """
    lib = lib or library()
    dt = out.dtype
    sfx = _suffix(dt)
    if not (sfx and _flat_ok(out, dt)):
        addrs = None
        ok = False
    elif addrs is None:
        ok = all(_flat_ok(r, dt) and r.size == out.size for r in rows)
        if ok:
            addrs = (ctypes.c_void_p * len(rows))(*[_ptr(r) for r in rows])
    else:
        ok = len(addrs) == len(rows)
    if not ok or not len(rows):
        return reference.sum_rows_reference(rows, out, scale, accumulate)
    fn = getattr(lib, "zmp_sum_rows_" + sfx)
    fn(addrs, len(rows), out.size, _ptr(out), float(np.float32(scale)), int(scale != 1.0), int(bool(accumulate)))


def quantize_fused_cpu(x, bits: int, block: int, lib=None):
    """reference.quantize_reference in C: the same (q, scales), bit for bit."""
    lib = lib or library()
    dt = getattr(x, "dtype", None)
    sfx = _suffix(dt)
    if not sfx or not _flat_ok(x, dt):
        return reference.quantize_reference(x, bits, block)
    n = x.size
    q = np.empty(reference.quantized_bytes(n, bits), np.uint8)
    scales = np.empty(-(-n // block), F32)
    fn = getattr(lib, "zmp_quantize_" + sfx)
    fn(_ptr(x), n, bits, block, _ptr(q), _ptr(scales))
    return q, scales


def dequant_sum_fused_cpu(q_rows, scale_rows, n: int, bits: int, block: int, out, scale: float,
                          accumulate: bool, lib=None) -> None:
    """reference.dequant_sum_reference in C (the same bits); anything else goes to the reference."""
    lib = lib or library()
    dt = out.dtype
    sfx = _suffix(dt)
    ok = (sfx and _flat_ok(out, dt) and out.size == n and len(q_rows) == len(scale_rows) > 0
          and all(_flat_ok(q, np.dtype(np.uint8)) for q in q_rows) and all(_flat_ok(s, F32) for s in scale_rows))
    if not ok:
        return reference.dequant_sum_reference(q_rows, scale_rows, n, bits, block, out, scale, accumulate)
    qs = (ctypes.c_void_p * len(q_rows))(*[_ptr(q) for q in q_rows])
    ss = (ctypes.c_void_p * len(scale_rows))(*[_ptr(s) for s in scale_rows])
    fn = getattr(lib, "zmp_dequant_sum_" + sfx)
    fn(qs, ss, len(q_rows), n, bits, block, _ptr(out), float(np.float32(scale)), int(scale != 1.0),
       int(bool(accumulate)))
