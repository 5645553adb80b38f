"""The GPU path against the NumPy oracles: CUDA kernels, staged collectives, placement.

Skipped, with the reason, where CuPy or a GPU is missing (this is every CI machine); the
CUDA sources are still compiled with nvcc by tests/test_kernels.py wherever nvcc exists.
scripts/gpu_check.sh runs this file on a machine with a GPU.
"""
import json
import math

import numpy as np
import pytest

from zerompi.optim import cuda, reference

from .mpirun import ROOT, run_mpi
from .test_kernels import LENGTHS, SCALARS, adamw_float64, bits, random_state

REASON = cuda.unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(REASON), reason=f"no GPU for the CUDA kernels: {REASON}")]


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n", LENGTHS)
def test_adamw_gpu_matches_float64_and_reference_bits(cp, dtype, n):
    rng = np.random.default_rng(n)
    master, m, v, grad = random_state(n, dtype, rng)
    s = SCALARS[dtype]
    dev = [cp.asarray(a) for a in (master, m, v)]
    p_dev = cp.empty(n, dtype)
    cuda.adamw_fused_gpu(*dev, cp.asarray(grad), p_dev, s)
    got = [cp.asnumpy(a) for a in dev] + [cp.asnumpy(p_dev)]
    ref = [master.copy(), m.copy(), v.copy()]
    p_ref = np.empty(n, dtype)
    reference.adamw_reference(*ref, grad, p_ref, s)
    want, tol = adamw_float64(master, m, v, grad, s)
    for g, w, t, name in zip(got, want, tol, ("master", "m", "v")):
        bad = np.abs(g - w) > t
        assert not bad.any(), (name, np.flatnonzero(bad)[:5])
    for g, r in zip(got, ref + [p_ref]):
        assert np.array_equal(bits(g), bits(r))       # --fmad=false: 0 ulp from the NumPy reference


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_adamw_gpu_independent_of_slice_start(cp, dtype):
    """Unaligned slices take the scalar path: the same bits as the vector path."""
    n, rng = 1000, np.random.default_rng(1)
    master, m, v, grad = random_state(n + 8, dtype, rng)
    s = SCALARS[dtype]
    results = []
    for start in range(8):
        arrays = [cp.asarray(a) for a in (master, m, v)]
        p = cp.empty(n + 8, dtype)
        sl = slice(start, start + n)
        cuda.adamw_fused_gpu(*(a[sl] for a in arrays), cp.asarray(grad)[sl], p[sl], s)
        results.append([bits(cp.asnumpy(a[sl])) for a in arrays + [p]])
    for start in range(1, 8):
        for a, b in zip(results[0], results[start]):
            assert np.array_equal(a[start:], b[:n - start])


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n", [0] + LENGTHS)
def test_grad_stats_gpu_matches_float64(cp, dtype, n):
    rng = np.random.default_rng(n + 7)
    g = (rng.standard_normal(n) * (100 if dtype == np.float16 else 1e15)).astype(dtype)
    sumsq, bad = cuda.grad_stats_fused_gpu(cp.asarray(g))
    exact = math.fsum(float(x) * float(x) for x in g.astype(np.float64)) if n < 5000 else \
        float(np.sum(np.square(g.astype(np.float64))))
    assert not bad
    assert sumsq == pytest.approx(exact, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("bad_value", [np.inf, -np.inf, np.nan])
def test_grad_stats_gpu_flags_non_finite(cp, dtype, bad_value):
    g = np.ones(4099, dtype)
    g[4098] = bad_value
    sumsq, bad = cuda.grad_stats_fused_gpu(cp.asarray(g))
    assert bad and not math.isfinite(sumsq)


@pytest.mark.parametrize("n", [1, 2])
def test_staged_collectives_on_gpu_equal_the_host_ones(n):
    """tests/test_staging.py's driver with CuPy device arrays and CuPy's pinned transfers."""
    proc = run_mpi(n, [ROOT / "tests" / "test_staging.py", "--cupy"], timeout=180)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    cases = [r for r in lines if "case" in r]
    assert cases and not [r for r in cases if r["bits_differ"] or r["wrong"]], proc.stdout


# ---- block quantization (kernels/quantize.cu) -------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [8, 256, 1024])
def test_quantize_gpu_equals_the_reference_bits(cp, dtype, bits, block):
    from .test_quantize import LENGTHS as QLENGTHS, data
    rng = np.random.default_rng(bits + block)
    for n in QLENGTHS:
        for special in (False, True):
            x = data(n, dtype, rng, special)
            qr, sr = reference.quantize_reference(x, bits, block)
            qg, sg = cuda.quantize_fused_gpu(cp.asarray(x), bits, block)
            qg, sg = cp.asnumpy(qg), cp.asnumpy(sg)
            assert np.array_equal(qr, qg), (n, special)
            nan = np.isnan(sr)
            assert np.array_equal(nan, np.isnan(sg)) and np.array_equal(sr[~nan], sg[~nan]), (n, special)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("bits", [8, 4])
def test_dequant_sum_gpu_equals_the_reference_bits(cp, dtype, bits):
    from .test_quantize import LENGTHS as QLENGTHS, data
    rng = np.random.default_rng(bits)
    for n in QLENGTHS:
        rows = [reference.quantize_reference(data(n, dtype, rng), bits, 64) for _ in range(3)]
        for scale, acc in ((1.0, False), (0.25, True)):
            want = np.full(n, 0.5, dtype)
            got = cp.asarray(want)
            reference.dequant_sum_reference([q for q, _ in rows], [s for _, s in rows], n, bits, 64, want, scale, acc)
            cuda.dequant_sum_fused_gpu([cp.asarray(q) for q, _ in rows], [cp.asarray(s) for _, s in rows], n, bits, 64,
                                       got, scale, acc)
            assert np.array_equal(want.view(np.uint8), cp.asnumpy(got).view(np.uint8)), (n, scale, acc)


# ---- bfloat16 (CuPy 14 and later has bfloat16 arrays through ml_dtypes) ------------------------
def _cupy_bf16(cp):
    from zerompi.optim import dtypes
    bf = dtypes.bfloat16(required=False)
    if bf is None:
        pytest.skip("ml_dtypes is not installed")
    try:
        cp.zeros(1, bf)
    except Exception as e:
        pytest.skip(f"this CuPy has no bfloat16 arrays: {type(e).__name__}")
    return bf


@pytest.mark.parametrize("n", [1, 9, 4099, 100003])
def test_adamw_and_prepass_gpu_bf16_match_reference_bits(cp, n):
    bf = _cupy_bf16(cp)
    rng = np.random.default_rng(n)
    master = rng.standard_normal(n).astype(np.float32)
    m = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    v = (rng.random(n) * 1e-4).astype(np.float32)
    grad = (rng.standard_normal(n) * 3).astype(bf)
    s = reference.adamw_scalars(1e-3, 0.9, 0.95, 1e-8, 0.1, 7, 0.37)
    dev = [cp.asarray(a) for a in (master, m, v)]
    p_dev = cp.empty(n, bf)
    cuda.adamw_fused_gpu(*dev, cp.asarray(grad), p_dev, s)
    ref = [master.copy(), m.copy(), v.copy(), np.empty(n, bf)]
    reference.adamw_reference(*ref[:3], grad, ref[3], s)
    for g, r in zip([cp.asnumpy(a) for a in dev] + [cp.asnumpy(p_dev)], ref):
        assert np.array_equal(g.view(np.uint8), r.view(np.uint8))
    sumsq, bad = cuda.grad_stats_fused_gpu(cp.asarray(grad))
    assert not bad and sumsq == pytest.approx(float(np.sum(grad.astype(np.float64) ** 2)), rel=1e-12)
