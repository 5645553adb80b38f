"""The fused optimizer kernels against NumPy: float64 oracles, and the float32 references bit for bit.

Found (and asserted): the C kernels equal reference.adamw_reference and reference.sum_rows_reference
to 0 ulp, since adamw_math.h does the reference's float32 operations in the same order and
-ffp-contract=off keeps the compiler from fusing any of them; grad_stats differs from
NumPy's pairwise float64 sum only by summation order (relative 1e-12 is asserted).
The CUDA sources are compiled with nvcc where it exists (they cannot run here).
"""
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest

from zerompi.optim import cuda, fused_cpu, reference
from zerompi.optim.reference import sum_rows_reference
from zerompi.optim.sources import kernels_dir

from .mpirun import ROOT

U = 2.0 ** -24          # float32 unit roundoff
TINY = 2.0 ** -149      # smallest float32 subnormal
LENGTHS = [1, 7, 8, 9, 31, 33, 511, 513, 4099, 1000003]
needs_cc = pytest.mark.skipif(fused_cpu.find_compiler() is None, reason="no C compiler on PATH (set CC)")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh cache folder: the first fixture to build compiles, as on a new machine."""
    if fused_cpu.find_compiler() is None:
        pytest.skip("no C compiler on PATH (set CC)")
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def lib(cache):
    """The C library as the engine builds it."""
    return fused_cpu.load(fused_cpu.build(cache))


@pytest.fixture(scope="module", params=["", "-DZMP_FP16_NO_F16C", "-DZMP_FP16_SOFT"],
                ids=["native", "no-f16c", "soft"])
def any_lib(request, cache):
    """The library with each of its binary16 conversion paths (F16C, _Float16, portable)."""
    return fused_cpu.load(fused_cpu.build(cache, extra_flags=[request.param] if request.param else []))


# ---- CUDA: compile with nvcc ---------------------------------------------------------------

CU_FILES = sorted(p.name for p in (ROOT / "kernels").glob("*.cu"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: CUDA sources not compiled")
@pytest.mark.parametrize("name", CU_FILES)
def test_cuda_source_compiles_for_sm90_without_fma(name, tmp_path):
    ptx = tmp_path / "k.ptx"
    cmd = ["nvcc", "-arch=sm_90", *cuda.OPTIONS, "-I", str(ROOT / "kernels"), "--ptx",
           str(ROOT / "kernels" / name), "-o", str(ptx)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = ptx.read_text()
    # --fmad=false: every multiply and add rounded alone, as in NumPy; IEEE sqrt and divide.
    assert "fma.rn.f32" not in text
    if name == cuda.SOURCE:
        for op in ("sqrt.rn.f32", "div.rn.f32", "cvt.rn.f16.f32", "ld.global.v4.f32", "st.global.v4.u32"):
            assert op in text, op


def test_gpu_module_imports_without_cupy():
    """Importing optim.cuda must not import CuPy (it is only needed when the GPU path runs)."""
    code = "import sys, zerompi.optim.cuda; assert 'cupy' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert out.stdout.strip() == "ok", out.stderr


# ---- AdamW: host build of adamw_math.h ------------------------------------------------------

def adamw_float64(master, m, v, grad, s):
    """The AdamW step in float64 from the same float32 inputs: the independent oracle."""
    f = np.float64
    g = grad.astype(f) * f(s.grad_scale)
    m2 = f(s.beta1) * m + f(s.one_minus_beta1) * g
    v2 = f(s.beta2) * v + f(s.one_minus_beta2) * (g * g)
    denom = np.sqrt(v2 * f(s.inv_bias2)) + f(s.eps)
    mhat = m2 * f(s.inv_bias1)
    master2 = master - f(s.lr) * (mhat / denom + f(s.weight_decay) * master)
    # Error bounds of the float32 computation: a few roundings of each term's magnitude.
    bound_m = np.abs(f(s.beta1) * m) + np.abs(f(s.one_minus_beta1) * g)
    bound_v = np.abs(f(s.beta2) * v) + np.abs(f(s.one_minus_beta2) * g * g)
    upd_err = (f(s.inv_bias1) * 5 * U * bound_m + 12 * U * np.abs(mhat)) / denom \
        + 3 * U * f(s.weight_decay) * np.abs(master)
    tol_master = 3 * U * (np.abs(master) + np.abs(master2)) + f(s.lr) * upd_err * 2 + TINY
    # m: 4 roundings (g, both products, the sum), v: 5 (g, g*g, product, product, sum); +1 margin.
    return (master2, m2, v2), (tol_master, 5 * U * bound_m + TINY, 6 * U * bound_v + 2 * TINY)


def random_state(n, dtype, rng):
    """master, m, v, grad with zeros in v and a mix of ordinary, huge, tiny and zero gradients."""
    master = rng.standard_normal(n).astype(np.float32)
    m = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    v = (rng.standard_normal(n) ** 2 * 1e-4).astype(np.float32)
    v[::3] = 0.0
    if dtype == np.float16:
        kinds = [rng.standard_normal(n) * 1e3, np.full(n, 65504.0), rng.standard_normal(n) * 1e-7, np.zeros(n)]
    else:   # huge: g*g still finite in float32 (|g| < 1.8e19); tiny: g*g subnormal or zero
        kinds = [rng.standard_normal(n), rng.standard_normal(n) * 1e18, rng.standard_normal(n) * 1e-21, np.zeros(n)]
    pick = rng.integers(0, 4, n)
    grad = np.choose(pick, kinds) * rng.choice([-1.0, 1.0], n)
    return master, m, v, grad.astype(dtype)


SCALARS = {np.float16: reference.adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, step=1, grad_scale=1 / 65536),
           np.float32: reference.adamw_scalars(3e-4, 0.8, 0.95, 1e-6, 0.1, step=1000, grad_scale=0.7)}


def bits(a):
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint16)


@needs_cc
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n", LENGTHS)
def test_adamw_matches_float64_and_reference_bits(lib, dtype, n):
    rng = np.random.default_rng(n)
    master, m, v, grad = random_state(n, dtype, rng)
    s = SCALARS[dtype]
    fused = [master.copy(), m.copy(), v.copy()]
    ref = [master.copy(), m.copy(), v.copy()]
    p_fused, p_ref = np.empty(n, dtype), np.empty(n, dtype)
    fused_cpu.adamw_fused_cpu(*fused, grad, p_fused, s, lib=lib)
    reference.adamw_reference(*ref, grad, p_ref, s)
    want, tol = adamw_float64(master, m, v, grad, s)
    for got, w, t, name in zip(fused, want, tol, ("master", "m", "v")):
        bad = np.abs(got - w) > t
        assert not bad.any(), (name, np.flatnonzero(bad)[:5], got[bad][:5], w[bad][:5])
    for got, r in zip(fused + [p_fused], ref + [p_ref]):
        assert np.array_equal(bits(got), bits(r))       # 0 ulp from the NumPy float32 reference
    assert np.array_equal(p_fused, fused[0].astype(dtype))


@needs_cc
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_adamw_result_independent_of_slice_start(lib, dtype):
    """Element i's result must not depend on where its slice starts (stage parity needs it)."""
    n, rng = 1000, np.random.default_rng(1)
    master, m, v, grad = random_state(n + 8, dtype, rng)
    s = SCALARS[dtype]
    results = []
    for start in range(8):      # every alignment of the 32-byte vectors
        arrays = [a.copy() for a in (master, m, v)]
        p = np.empty(n + 8, dtype)
        sl = slice(start, start + n)
        fused_cpu.adamw_fused_cpu(*(a[sl] for a in arrays), grad[sl], p[sl], s, lib=lib)
        results.append([bits(a[sl]).copy() for a in arrays + [p]])
    for start in range(1, 8):      # the elements both windows hold
        for a, b in zip(results[0], results[start]):
            assert np.array_equal(a[start:], b[:n - start])


@needs_cc
def test_adamw_unsupported_layouts_fall_back_to_reference(lib):
    n, rng = 100, np.random.default_rng(2)
    master, m, v, grad = random_state(2 * n, np.float32, rng)
    s = SCALARS[np.float32]
    a = [x[::2].copy() for x in (master, m, v)]       # contiguous copies for the reference
    b = [x.copy() for x in (master, m, v)]
    pa, pb = np.empty(n, np.float16), np.empty(2 * n, np.float16)
    reference.adamw_reference(*a, grad[::2], pa, s)
    fused_cpu.adamw_fused_cpu(*(x[::2] for x in b), grad[::2], pb[::2], s, lib=lib)   # strided, mixed dtypes
    for x, y in zip(a + [pa], [x[::2] for x in b] + [pb[::2]]):
        assert np.array_equal(x, y)
    with pytest.raises(ValueError, match="lengths differ"):
        fused_cpu.adamw_fused_cpu(b[0], b[1], b[2][:-1], grad, pb, s, lib=lib)


# ---- the pre-pass -----------------------------------------------------------------------

@needs_cc
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n", [0] + LENGTHS)
def test_grad_stats_matches_float64(lib, dtype, n):
    rng = np.random.default_rng(n + 7)
    g = (rng.standard_normal(n) * (100 if dtype == np.float16 else 1e15)).astype(dtype)
    sumsq, bad = fused_cpu.grad_stats_fused_cpu(g, lib=lib)
    exact = math.fsum(float(x) * float(x) for x in g.astype(np.float64)) if n < 5000 else \
        float(np.sum(np.square(g.astype(np.float64))))
    assert not bad
    assert sumsq == pytest.approx(exact, rel=1e-12, abs=0.0)
    ref_sumsq, ref_bad = reference.grad_stats_reference(g)
    assert ref_bad == bad and sumsq == pytest.approx(ref_sumsq, rel=1e-12, abs=0.0)


@needs_cc
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_grad_stats_independent_of_alignment(lib, dtype):
    """Same values at another address: the same bits (stage 0-1 and stage 2-3 slices differ in address)."""
    n, rng = 4099, np.random.default_rng(3)
    values = rng.standard_normal(n).astype(dtype)
    sums = set()
    for start in range(8):
        buf = np.zeros(n + 8, dtype)
        buf[start:start + n] = values
        sums.add(fused_cpu.grad_stats_fused_cpu(buf[start:start + n], lib=lib)[0])
    assert len(sums) == 1


@needs_cc
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("bad_value", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", [0, 511, 512, 4098])
def test_grad_stats_flags_non_finite(lib, dtype, bad_value, where):
    g = np.ones(4099, dtype)
    g[where] = bad_value
    sumsq, bad = fused_cpu.grad_stats_fused_cpu(g, lib=lib)
    assert bad and not math.isfinite(sumsq)
    assert reference.grad_stats_reference(g)[1]


@needs_cc
def test_grad_stats_flags_fp16_overflow_of_a_cast(lib):
    """A gradient too large for fp16 arrives as inf in the stored copy: it must be flagged."""
    with np.errstate(over="ignore"):
        g = np.array([1.0, 7e4, 2.0], np.float32).astype(np.float16)   # 7e4 > 65504 -> inf
    assert fused_cpu.grad_stats_fused_cpu(g, lib=lib)[1]


# ---- the reduce-scatter's local sum -----------------------------------------------------------

@needs_cc
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("nrows", [1, 2, 3, 5])
@pytest.mark.parametrize("k", [1, 7, 17, 513, 10007])
@pytest.mark.parametrize("scale,accumulate", [(1.0, False), (1 / 3, False), (0.25, True), (1 / 6, True)])
def test_sum_rows_bit_identical_to_reference(any_lib, dtype, nrows, k, scale, accumulate):
    """Every build (native: summed in SIMD registers; no-f16c and soft: the portable
    block loop) against the reference, tails of every length mod 16 included."""
    lib = any_lib
    rng = np.random.default_rng(nrows * 100003 + k)
    rows = np.clip(rng.standard_normal((nrows, k)) * 3e4, -65504, 65504).astype(dtype)  # fp16: some sums overflow
    start = (rng.standard_normal(k) * 10).astype(dtype)
    ref, fused = start.copy(), start.copy()
    sum_rows_reference(rows, ref, scale, accumulate)
    fused_cpu.sum_rows_fused_cpu(rows, fused, scale, accumulate, lib=lib)
    assert np.array_equal(bits(fused), bits(ref))
    # The float64 oracle, where the float32 sum is finite: n additions, a multiply, a cast.
    exact = rows.astype(np.float64).sum(axis=0) * scale + (start.astype(np.float64) if accumulate else 0.0)
    bound = np.abs(rows.astype(np.float64)).sum(axis=0) * scale + np.abs(start.astype(np.float64)) * accumulate
    finite = np.isfinite(fused)
    out_ulp = 2.0 ** -11 if dtype == np.float16 else U
    tol = (nrows + 2) * U * bound + out_ulp * np.abs(exact) + 2.0 ** -24
    assert np.all(np.abs(fused[finite].astype(np.float64) - exact[finite]) <= tol[finite])
    if dtype == np.float32:
        assert finite.all()


@needs_cc
def test_sum_rows_rows_anywhere_and_fallback(any_lib):
    rng = np.random.default_rng(5)
    big = rng.standard_normal((3, 40)).astype(np.float16)
    rows = big[:, 3:30]                                  # row stride 40, start 3: the C path
    ref, fused = np.zeros(27, np.float16), np.zeros(27, np.float16)
    sum_rows_reference(rows, ref, 0.5, False)
    fused_cpu.sum_rows_fused_cpu(rows, fused, 0.5, False, lib=any_lib)
    assert np.array_equal(bits(ref), bits(fused))
    cols = big[:, ::2]                                    # element stride 2: the reference path
    ref, fused = np.zeros(20, np.float16), np.zeros(20, np.float16)
    sum_rows_reference(cols, ref, 1.0, False)
    fused_cpu.sum_rows_fused_cpu(cols, fused, 1.0, False, lib=any_lib)
    assert np.array_equal(bits(ref), bits(fused))


@needs_cc
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("own", [0, 1, 3])
def test_sum_rows_separate_rows_and_out_in_place(any_lib, dtype, own):
    """How the reduce-scatter calls it: rows in separate buffers (the own slice inside the
    send buffer, the peers' in the receive buffer), addresses given, and for an in-place
    all-reduce ``out`` is the own row itself."""
    import ctypes
    rng = np.random.default_rng(own)
    k = 1037
    send = (rng.standard_normal(4 * k) * 100).astype(dtype)
    recv = (rng.standard_normal((3, k)) * 100).astype(dtype)
    rows = list(recv[:own]) + [send[own * k:(own + 1) * k]] + list(recv[own:])
    start = rows[own].copy()
    want = start.copy()
    sum_rows_reference([r.copy() for r in rows], want, 0.25, True)
    addrs = (ctypes.c_void_p * 4)(*[r.ctypes.data for r in rows])
    out = rows[own]                                     # in place: the own slice is also the output
    fused_cpu.sum_rows_fused_cpu(rows, out, 0.25, True, addrs=addrs, lib=any_lib)
    assert np.array_equal(bits(send[own * k:(own + 1) * k]), bits(want))
    # and without addresses: the wrapper finds them
    again = start.copy()
    fused_cpu.sum_rows_fused_cpu([r.copy() for r in rows[:own]] + [start.copy()] + [r.copy() for r in rows[own + 1:]],
                                 again, 0.25, True, lib=any_lib)
    assert np.array_equal(bits(again), bits(want))


# ---- binary16 conversions, every path ------------------------------------------------------------

def convert(lib, values, to_half):
    values = np.ascontiguousarray(values)
    out = np.empty(values.size, np.uint16 if to_half else np.float32)
    fn = lib.zmp_floats_to_halves if to_half else lib.zmp_halves_to_floats
    fn(out.ctypes.data, values.ctypes.data, values.size)
    return out


def test_half_to_float_every_value(any_lib):
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    got = convert(any_lib, halves, to_half=False)
    want = halves.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))   # -0.0 included


def test_float_to_half_rounds_to_nearest_even(any_lib):
    rng = np.random.default_rng(6)
    finite = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = finite[np.isfinite(finite)].astype(np.float64)
    ordered = np.unique(finite)
    mids = (ordered[:-1] + ordered[1:]) / 2                       # ties: exact in float32
    around = mids.astype(np.float32)
    probes = np.concatenate([
        finite.astype(np.float32), around, np.nextafter(around, np.float32(np.inf)),
        np.nextafter(around, np.float32(-np.inf)),
        rng.integers(0, 2 ** 32, 200000, dtype=np.uint64).astype(np.uint32).view(np.float32),   # every range
        np.array([65504, 65519.996, 65520, 1e5, np.inf, -np.inf, 2.0 ** -25, 2.0 ** -24 * 1.5, 5.9e-8],
                 np.float32),
    ])
    got = convert(any_lib, probes, to_half=True)
    with np.errstate(over="ignore"):
        want = probes.astype(np.float16).view(np.uint16)
    nan = np.isnan(probes)
    assert np.array_equal(np.isnan(got.view(np.float16)), nan)
    assert np.array_equal(got[~nan], want[~nan]), probes[~nan][got[~nan] != want[~nan]][:5]


def test_conversion_path_names(any_lib):
    assert any_lib.zmp_fp16_path().decode() in ("f16c", "_Float16", "soft")


# ---- build and load -----------------------------------------------------------------------------

def test_kernel_sources_found_from_checkout():
    assert kernels_dir() == ROOT / "kernels"
    assert sorted(p.name for p in kernels_dir().iterdir() if p.suffix in (".h", ".c", ".cu")) == \
        ["adamw_math.h", "bf16_cpu.h", "checksum_cpu.c", "cuda_half.h", "fused_adamw.cu", "fused_adamw_cpu.c",
         "gpt_cpu.c", "gpt_cpu_body.h", "quant_math.h", "quantize.cu", "quantize_cpu.h"]


def test_build_is_cached_and_keyed_by_flags(cache, lib):
    first = fused_cpu.build(cache)
    assert fused_cpu.build(cache) == first                          # found, not compiled again
    assert fused_cpu.build(cache, extra_flags=["-DZMP_FP16_SOFT"]) != first
    names = [p.name for p in cache.iterdir()]
    assert all(n.startswith("zerompi_fused_cpu-") and n.endswith(".so") and n.count(".") == 1 for n in names), names


def test_missing_compiler_falls_back_with_one_line_note(tmp_path):
    code = ("from zerompi.optim import impl, reference; print(impl.use_impl('auto'), impl.adamw_update.__name__)\n"
            "from zerompi.errors import ConfigError\n"
            "try:\n    impl.use_impl('fused')\nexcept ConfigError as e:\n    print('ConfigError', e)\n")
    env = {**__import__("os").environ, "CC": str(tmp_path / "no-such-cc"), "ZEROMPI_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                         cwd=str(ROOT))
    lines = out.stdout.splitlines()
    assert lines[0] == "numpy adamw_reference", out
    assert lines[1].startswith("ConfigError optimizer_impl='fused' is not available") and "no-such-cc" in lines[1]
    note = out.stderr.strip().splitlines()
    assert len(note) == 1 and "using the NumPy reference" in note[0], out.stderr
