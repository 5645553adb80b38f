"""bfloat16 storage: the C kernels against the NumPy references bit for bit, the CUDA conversions
built for the host against ml_dtypes, the CUDA entry points compiled, and the one-line errors.

The engine's bf16 runs are checked by tests/test_parity.py (stages 0-3 bit-identical, memory and
traffic formulas) and tests/test_oracle.py (the float64 reference)."""
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.mpirun import ROOT, run_train
from zerompi.optim import cuda, dtypes, fused_cpu, reference

BF16 = dtypes.bfloat16(required=False)
pytestmark = pytest.mark.skipif(BF16 is None, reason="ml_dtypes is not installed")
LENGTHS = [1, 7, 8, 9, 511, 513, 4099, 100003]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    if fused_cpu.find_compiler() is None:
        pytest.skip("no C compiler on PATH (set CC)")
    return fused_cpu.load(fused_cpu.build(tmp_path_factory.mktemp("cache")))


def bits(a):
    return np.asarray(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def probes(rng, n):
    """float32 values of every range: random bit patterns, exact ties, overflow, NaN payloads, subnormals."""
    return np.concatenate([
        rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32),
        (rng.integers(0, 2 ** 16, n // 4).astype(np.uint32) << 16) | 0x8000,         # ties: to even
        np.array([0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF, 0x00008000, 0x00018000, 0x7FC00001,
                  0xFFC00000, 0x7F800001, 0x7F800000, 0x80000000], np.uint32),
    ]).view(np.float32)


# ---- conversions ------------------------------------------------------------------------------
def test_c_conversion_rounds_to_nearest_even_like_ml_dtypes(lib):
    """float32 -> bf16 through the AdamW kernel's parameter copy (lr 0: param_out = master)."""
    f = probes(np.random.default_rng(1), 300000)
    f = np.where(np.isinf(f), np.float32(1), f)            # inf - inf would turn into NaN in the update
    n = f.size
    out = np.empty(n, BF16)
    zero = reference.adamw_scalars(0.0, 0.9, 0.95, 1e-8, 0.0, 1, 0.0)
    master = f.copy()
    with np.errstate(invalid="ignore"):
        fused_cpu.adamw_fused_cpu(master, np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, BF16), out,
                                  zero, lib=lib)
        want = master.astype(BF16)
    assert np.array_equal(bits(out), bits(want))
    assert np.isinf(out.astype(np.float32)).any()               # values past bf16's max rounded to inf
    assert set(bits(out)[np.isnan(master)]) == {0x7FC0, 0xFFC0}    # NaN: the quiet NaN with its sign


def test_cuda_conversion_built_for_the_host(tmp_path):
    """kernels/cuda_half.h's bfloat16 conversions, compiled by the host C++ compiler (the device
    qualifiers defined away), against ml_dtypes over every bf16 value and float32 probes."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    harness = tmp_path / "h.cpp"
    harness.write_text(r'''
#include <cstring>
#include <cstdint>
#define __device__
#define __forceinline__ inline
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
#include "cuda_half.h"
extern "C" void to_bf16(const float *x, uint16_t *y, long n) { for (long i = 0; i < n; i++) y[i] = zmp_f2b(x[i]).bits; }
extern "C" void from_bf16(const uint16_t *x, float *y, long n) {
    for (long i = 0; i < n; i++) { zmp_bf16 h; h.bits = x[i]; y[i] = to_float(h); }
}
''')
    so = tmp_path / "h.so"
    proc = subprocess.run([cxx, "-O2", "-shared", "-fPIC", "-I", str(ROOT / "kernels"), str(harness), "-o", str(so)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import ctypes
    h = ctypes.CDLL(str(so))
    f = probes(np.random.default_rng(2), 300000)
    got = np.empty(f.size, np.uint16)
    h.to_bf16(ctypes.c_void_p(f.ctypes.data), ctypes.c_void_p(got.ctypes.data), ctypes.c_long(f.size))
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.array_equal(got, bits(f.astype(BF16)))
    every = np.arange(2 ** 16, dtype=np.uint16)
    back = np.empty(every.size, np.float32)
    h.from_bf16(ctypes.c_void_p(every.ctypes.data), ctypes.c_void_p(back.ctypes.data), ctypes.c_long(every.size))
    assert np.array_equal(bits(back), bits(every.view(BF16).astype(np.float32)))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: CUDA sources not compiled")
@pytest.mark.parametrize("name,entries", [
    (cuda.SOURCE, ["zmp_adamw_bf16", "zmp_grad_sumsq_bf16"]),
    (cuda.QUANT_SOURCE, ["zmp_quantize_bf16", "zmp_dequant_sum_bf16"]),
])
def test_cuda_bf16_entry_points_compile(tmp_path, name, entries):
    ptx = tmp_path / "k.ptx"
    proc = subprocess.run(["nvcc", "-arch=sm_90", *cuda.OPTIONS, "-I", str(ROOT / "kernels"), "--ptx",
                           str(ROOT / "kernels" / name), "-o", str(ptx)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = ptx.read_text()
    for entry in entries:
        assert f".entry {entry}(" in text, entry
    assert "fma.rn.f32" not in text


# ---- the C kernels against the references -----------------------------------------------------
@pytest.mark.parametrize("n", LENGTHS)
def test_adamw_bf16_matches_reference_bitwise(lib, n):
    rng = np.random.default_rng(n)
    master = rng.standard_normal(n).astype(np.float32)
    m = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    v = (rng.random(n) * 1e-4).astype(np.float32)
    grad = (rng.standard_normal(n) * 3).astype(BF16)
    s = reference.adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 7, 0.37)
    want = [a.copy() for a in (master, m, v)] + [np.empty(n, BF16)]
    got = [a.copy() for a in (master, m, v)] + [np.empty(n, BF16)]
    reference.adamw_reference(*want[:3], grad, want[3], s)
    fused_cpu.adamw_fused_cpu(*got[:3], grad, got[3], s, lib=lib)
    for w, g in zip(want, got):
        assert np.array_equal(bits(w), bits(g))


def test_grad_stats_bf16(lib):
    rng = np.random.default_rng(3)
    g = (rng.standard_normal(100003) * 10).astype(BF16)
    sumsq, bad = fused_cpu.grad_stats_fused_cpu(g, lib=lib)
    want = float(np.sum(g.astype(np.float64) ** 2))
    assert not bad and sumsq == pytest.approx(want, rel=1e-12)
    g[500] = np.float32(np.inf)
    assert fused_cpu.grad_stats_fused_cpu(g, lib=lib)[1]
    g[500] = np.float32(np.nan)
    assert fused_cpu.grad_stats_fused_cpu(g, lib=lib)[1]


@pytest.mark.parametrize("nrows,k", [(1, 7), (3, 513), (5, 4099)])
@pytest.mark.parametrize("scale,accumulate", [(1.0, False), (0.25, True)])
def test_sum_rows_bf16_matches_reference_bitwise(lib, nrows, k, scale, accumulate):
    rng = np.random.default_rng(nrows * k)
    rows = [(rng.standard_normal(k) * 100).astype(BF16) for _ in range(nrows)]
    rows[0][0] = np.float32(np.nan)
    start = rng.standard_normal(k).astype(BF16)
    want, got = start.copy(), start.copy()
    reference.sum_rows_reference(rows, want, scale, accumulate)
    fused_cpu.sum_rows_fused_cpu(rows, got, scale, accumulate, lib=lib)
    assert np.array_equal(bits(want), bits(got))
    # and against float64: each sum is the float32 sum rounded once to bf16 (within bf16's half ulp + fp32 sums)
    exact = sum(r.astype(np.float64) for r in rows) * scale + (start.astype(np.float64) if accumulate else 0)
    ok = np.isfinite(exact)
    assert np.all(np.abs(got.astype(np.float64)[ok] - exact[ok]) <= 2 ** -8 * np.abs(exact[ok]) + 1e-3)


@pytest.mark.parametrize("nbits", [8, 4])
def test_quantize_and_dequant_sum_bf16(lib, nbits):
    rng = np.random.default_rng(nbits)
    rows = [(rng.standard_normal(1001) * 5).astype(BF16) for _ in range(3)]
    qs = []
    for r in rows:
        qw, sw = reference.quantize_reference(r, nbits, 64)
        qg, sg = fused_cpu.quantize_fused_cpu(r, nbits, 64, lib=lib)
        assert np.array_equal(qw, qg) and np.array_equal(bits(sw), bits(sg))
        qs.append((qg, sg))
    want, got = np.ones(1001, BF16), np.ones(1001, BF16)
    reference.dequant_sum_reference([q for q, _ in qs], [s for _, s in qs], 1001, nbits, 64, want, 0.5, True)
    fused_cpu.dequant_sum_fused_cpu([q for q, _ in qs], [s for _, s in qs], 1001, nbits, 64, got, 0.5, True, lib=lib)
    assert np.array_equal(bits(want), bits(got))


# ---- the training job -------------------------------------------------------------------------
def test_bf16_has_no_loss_scaling_and_reports_its_dtype(tmp_path):
    m = run_train(2, tmp_path, "--model", "mlp", "--width", "32", "--depth", "2", "--steps", "3", "--dtype", "bf16")
    assert m["dtype"] == "bf16" and m["loss_scale"] == 1.0 and m["steps_applied"] == 3


def test_bf16_without_ml_dtypes_is_one_line(tmp_path):
    """Where ml_dtypes cannot be imported, --dtype bf16 says what to install, exit 2, on every launcher."""
    code = ("import sys; sys.modules['ml_dtypes'] = None; sys.argv = ['zerompi.train', '--dtype', 'bf16', "
            "'--model', 'mlp', '--steps', '1']; import runpy; runpy.run_module('zerompi.train', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install ml_dtypes" in lines[0] and "bf16" in lines[0], proc.stderr
