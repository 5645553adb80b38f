"""Block quantization (kernels/quant_math.h): the C kernels against the NumPy reference bit for
bit, the reference against the float64 error bound, the wire format, and the CUDA sources
compiled with nvcc (the kernels themselves run in tests/test_gpu.py where a GPU is).
"""
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from zerompi.comm.quantized import Quantization
from zerompi.optim import cuda, fused_cpu
from zerompi.optim import reference as R

@pytest.mark.parametrize("bits", [8, 4])
def test_blocks_of_tiny_values_obey_the_bound_the_docs_state(lib, bits):
    """A block whose amax is below qmax x 2^-126 has a subnormal (or zero) scale, itself rounded to a
    multiple of 2^-149: there the error reaches many times scale / 2, and is at most
    scale / 2 + qmax x 2^-150 (+ the product's rounding), which docs/quantized.md states. The C kernel
    quantizes those blocks as the reference does, bit for bit."""
    rng, qmax, block = np.random.default_rng(bits), float(R.QMAX[bits]), 64
    x = np.concatenate([(rng.uniform(-1, 1, block) * 2.0 ** e).astype(np.float32)
                        for e in np.linspace(-149, -110, 300)])           # amax from 2^-149 to normal scales
    q, s = R.quantize_reference(x, bits, block)
    qc, sc = fused_cpu.quantize_fused_cpu(x, bits, block, lib=lib)
    assert np.array_equal(q, qc) and np.array_equal(s.view(np.uint32), sc.view(np.uint32))
    got = R.dequantize_reference(q, s, x.size, bits, block)
    step = np.repeat(s, block).astype(np.float64)
    err = np.abs(got.astype(np.float64) - x.astype(np.float64))
    assert (err <= step / 2 + qmax * 2.0 ** -150 + np.spacing(np.abs(got))).all()
    subnormal = step < 2.0 ** -126                 # the scale is a subnormal float32, or 0
    assert (err[subnormal] > step[subnormal] / 2 + np.spacing(np.abs(got[subnormal]))).any()   # scale / 2 alone fails
    assert not (err[~subnormal] > step[~subnormal] / 2 + np.spacing(np.abs(x[~subnormal]))).any()
    doc = " ".join((Path(__file__).parents[1] / "docs" / "quantized.md").read_text().split())
    assert "scale / 2 + qmax × 2^-150" in doc


LENGTHS = [1, 2, 7, 8, 9, 255, 256, 257, 1000, 4099]


def data(n, dtype, rng, special=False):
    x = (rng.standard_normal(n) * rng.choice([1e-4, 1.0, 300.0], n)).astype(dtype)
    if n >= 24:
        x[8:16] = 0                          # an all-zero block (with block 8)
        x[17] = np.float32(-0.0)
        x[-1] = np.finfo(dtype).max / 2      # a large value: one block's scale is big
        if special:
            x[3], x[20] = np.nan, np.inf
    return x


@pytest.fixture(scope="module", params=["native", "no-avx2"])
def lib(request, tmp_path_factory):
    """The library as the engine builds it, and built without AVX2: its vector paths
    (kernels/quantize_cpu.h) and the portable loops must give the reference's bits alike."""
    if fused_cpu.unavailable_reason():
        pytest.skip(fused_cpu.unavailable_reason())
    if request.param == "native":
        return fused_cpu.library()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("-mno-avx2 is an x86 flag")
    return fused_cpu.load(fused_cpu.build(tmp_path_factory.mktemp("cache"), extra_flags=["-mno-avx2"]))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [8, 64, 256])
def test_c_quantize_equals_the_reference_bit_for_bit(lib, dtype, bits, block):
    rng = np.random.default_rng(bits * block)
    for n in LENGTHS:
        for special in (False, True):
            x = data(n, dtype, rng, special)
            qr, sr = R.quantize_reference(x, bits, block)
            qc, sc = fused_cpu.quantize_fused_cpu(x, bits, block, lib=lib)
            assert np.array_equal(qr, qc), (n, special)
            assert np.array_equal(np.isnan(sr), np.isnan(sc)) and np.array_equal(sr[~np.isnan(sr)], sc[~np.isnan(sc)])
            assert qc.size == (n if bits == 8 else (n + 1) // 2) and sc.size == -(-n // block)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("bits", [8, 4])
def test_c_dequant_sum_equals_the_reference_bit_for_bit(lib, dtype, bits):
    rng = np.random.default_rng(bits)
    for n in LENGTHS:
        for nrows in (1, 2, 5):
            rows = [R.quantize_reference(data(n, dtype, rng), bits, 64) for _ in range(nrows)]
            for scale, acc in ((1.0, False), (0.25, True), (1 / 3, False)):
                want = np.full(n, 0.5, dtype)
                got = want.copy()
                R.dequant_sum_reference([q for q, _ in rows], [s for _, s in rows], n, bits, 64, want, scale, acc)
                fused_cpu.dequant_sum_fused_cpu([q for q, _ in rows], [s for _, s in rows], n, bits, 64, got, scale,
                                                acc, lib=lib)
                assert np.array_equal(want.view(np.uint8), got.view(np.uint8)), (n, nrows, scale, acc)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("bits", [8, 4])
def test_error_is_at_most_half_a_step(dtype, bits):
    """|x - deq(q(x))| <= scale / 2, up to the float32 rounding of q * scale (half an ulp of the value)."""
    rng = np.random.default_rng(7)
    for block in (8, 256):
        x = data(5000, dtype, rng)
        q, s = R.quantize_reference(x, bits, block)
        x32 = x.astype(np.float32)
        got = R.dequantize_reference(q, s, x.size, bits, block)
        step = np.repeat(s, block)[:x.size]
        err = np.abs(got.astype(np.float64) - x32.astype(np.float64))
        assert (err <= step / 2 + np.spacing(np.abs(x32))).all(), (err - step / 2).max()
        assert (np.abs(np.where(step > 0, got / np.where(step > 0, step, 1), 0)) <= R.QMAX[bits] + 1e-3).all()


def test_non_finite_blocks_dequantize_to_nan_and_zero_blocks_to_zero():
    x = np.array([1.0, np.nan, 2.0, 3.0] + [0.0] * 4 + [np.inf, 1.0] + [5.0] * 6, np.float32)
    q, s = R.quantize_reference(x, 8, 8)
    assert np.isnan(s[0]) and s[1] == np.inf and not q[:16].any()
    got = R.dequantize_reference(q, s, x.size, 8, 8)
    assert np.isnan(got).all()      # 0 * NaN and 0 * inf: the step's non-finite check still sees it
    z = R.dequantize_reference(*R.quantize_reference(np.zeros(20, np.float32), 4, 8), 20, 4, 8)
    assert (z == 0).all()


def test_rounding_is_half_to_even_and_int4_packs_low_nibble_first():
    # amax 127 -> scale 1.0: the values are exact halves
    x = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.49, -127.0], np.float32)
    q, s = R.quantize_reference(x, 8, 8)
    assert s[0] == 1.0 and q.view(np.int8).tolist() == [127, 0, 2, 2, 0, -2, 3, -127]
    q4, s4 = R.quantize_reference(np.array([7.0, -7.0, 1.0], np.float32), 4, 8)
    assert s4[0] == 1.0 and q4.tolist() == [0x7 | (0x9 << 4), 0x1]


def test_deterministic():
    x = data(4099, np.float16, np.random.default_rng(3))
    a, b = fused_cpu.quantize_fused_cpu(x, 4, 64), fused_cpu.quantize_fused_cpu(x, 4, 64)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("bits,k,block,wire", [(8, 16, 256, 16 + 4), (8, 257, 256, 260 + 8), (4, 16, 8, 8 + 8),
                                               (4, 7, 8, 4 + 4), (8, 1000, 8, 1000 + 4 * 125)])
def test_wire_format(bits, k, block, wire):
    q = Quantization(bits, block)
    assert q.wire_bytes(k) == wire
    x = data(k, np.float32, np.random.default_rng(k))
    buf = np.zeros(wire, np.uint8)
    q.pack(x, buf)
    values, scales = q.rows(buf, k)
    want_q, want_s = R.quantize_reference(x, bits, block)
    assert np.array_equal(values[:want_q.size], want_q) and np.array_equal(scales, want_s)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: CUDA sources not compiled")
@pytest.mark.parametrize("name", [cuda.SOURCE, cuda.QUANT_SOURCE])
def test_cuda_text_given_to_nvrtc_is_self_contained(tmp_path, name):
    """optim.cuda pastes every local header in: the text compiles with no include path, and the
    quantization kernels divide with IEEE division and round with rint (as the C and NumPy ones)."""
    src = tmp_path / "whole.cu"
    src.write_text(cuda.full_source(name))
    ptx = tmp_path / "whole.ptx"
    proc = subprocess.run(["nvcc", "-arch=sm_90", *cuda.OPTIONS, "--ptx", str(src), "-o", str(ptx)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = ptx.read_text()
    assert "fma.rn.f32" not in text
    assert '#include "' not in cuda.full_source(name)
    if name == cuda.QUANT_SOURCE:
        for op in ("div.rn.f32", "cvt.rni.f32.f32", "cvt.rn.f16.f32"):
            assert op in text, op
