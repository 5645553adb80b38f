"""The GPT's C kernels (kernels/gpt_cpu.c) against the NumPy reference (models/gpt_numpy.py) and
float64 oracles, tails and odd lengths included; the fast path's buffers; the fallback.

Tolerances, found while writing these tests: the float64 build (libm's exp and tanh, the
reference's operations in its order) differs from the float64 reference by summation order
and by libm's tanh against NumPy's (GELU: 2.6e-15 seen), asserted at 1e-14 of the scale. In
float32, exp and tanh are the file's own polynomials: softmax and LayerNorm within a few ulp of
the NumPy float32 reference; GELU and its gradient no further from a float64 oracle than NumPy's
float32 GELU is, plus 2 ulp of the values' scale (both lose the same digits where tanh is near -1
or 1).
"""
import subprocess
import sys

import numpy as np
import pytest

from zerompi.optim import fused_cpu
from zerompi.train import model_kernels as MK
from zerompi.train.models import gpt as G
from zerompi.train.models.gpt_fast import FRESH, Workspace

from .mpirun import ROOT

F32, F64 = np.float32, np.float64
COLS = [1, 3, 15, 16, 17, 33, 64, 257]          # row lengths: below, at and past the 16 lanes
SEQ = [1, 2, 5, 16, 17, 33]                     # causal rows of every length up to T


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    """The library built in a fresh cache folder, as on a new machine."""
    if fused_cpu.find_compiler() is None:
        pytest.skip("no C compiler on PATH (set CC)")
    return MK.load(MK.build_library(tmp_path_factory.mktemp("cache")))


@pytest.fixture
def rng():
    return np.random.default_rng(22)


def kern(lib, dtype):
    return MK.Kernels(lib, dtype)


def close(got, want, rel, what):
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got.astype(F64) - want.astype(F64)).max())
    assert err <= rel * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


# ---- LayerNorm -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,rel", [(F64, 1e-14), (F32, 8e-7)])
@pytest.mark.parametrize("c", COLS)
def test_layernorm_forward_and_backward(lib, rng, dtype, rel, c):
    k = kern(lib, dtype)
    x = (rng.standard_normal((7, c)) * 3 + 1).astype(dtype)
    g, b = rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype)
    y, mean, rstd = np.empty_like(x), np.empty(7, dtype), np.empty(7, dtype)
    k.layernorm_fwd(x, g, b, y, mean, rstd, G.LN_EPS)
    want, cache = G.layernorm(np, x, g, b)
    close(y, want, rel * 4, "y")
    close(rstd, cache[1][:, 0], rel * 4, "rstd")
    dy, res = rng.standard_normal((7, c)).astype(dtype), rng.standard_normal((7, c)).astype(dtype)
    dx, dg, db = np.empty_like(x), np.full(c, np.nan, dtype), np.full(c, np.nan, dtype)
    k.layernorm_bwd(dy, x, mean, rstd, g, res, dx, dg, db)
    wdx, wdg, wdb = G.layernorm_backward(dy, cache, g)
    close(dx, wdx + res, rel * 16, "dx")
    close(dg, wdg, rel * 16, "dg")
    close(db, wdb, rel * 16, "db")
    k.layernorm_bwd(dy, x, mean, rstd, g, None, dx, None, None)          # no residual, no dg/db
    close(dx, wdx, rel * 16, "dx without residual")


# ---- GELU ------------------------------------------------------------------------------------------
def gelu64(x):
    """The float64 oracle: the tanh GELU and its derivative, written out independently."""
    c = np.sqrt(2 / np.pi)
    t = np.tanh(c * (x + 0.044715 * x ** 3))
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t ** 2) * c * (1 + 3 * 0.044715 * x ** 2)


@pytest.mark.parametrize("c", COLS)
def test_gelu_float64_is_the_reference(lib, rng, c):
    k = kern(lib, F64)
    f, b, d = (rng.standard_normal((5, c)) * 3, rng.standard_normal(c), rng.standard_normal((5, c)))
    ff, y = f.copy(), np.empty_like(f)
    k.gelu_fwd(ff, b, y)
    want, t = G.gelu(np, f + b)
    np.testing.assert_array_equal(ff, f + b)
    close(y, want, 1e-14, "gelu")
    dd, db = d.copy(), np.empty(c)
    k.gelu_bwd(dd, ff, db)
    dz = d * G.gelu_grad(f + b, t)
    close(dd, dz, 1e-14, "gelu'")
    close(db, dz.sum(axis=0), 1e-14, "bias gradient")


@pytest.mark.parametrize("c", COLS + [4096])
def test_gelu_float32_is_as_accurate_as_numpy(lib, rng, c):
    """Against the float64 oracle, on [-12, 12] (both tails of tanh): no worse than NumPy's float32."""
    k = kern(lib, F32)
    x = np.concatenate([np.linspace(-12, 12, 3001), rng.standard_normal(997) * 3])
    x = np.resize(x, (max(1, x.size // c), c)).astype(F32)
    d = rng.standard_normal(x.shape).astype(F32)
    y64, g64 = gelu64(x.astype(F64))
    y, f = np.empty_like(x), x.copy()
    k.gelu_fwd(f, None, y)
    np_y, t = G.gelu(np, x)
    err, np_err = np.abs(y - y64).max(), np.abs(np_y - y64).max()
    assert err <= np_err + 2 * 2.0 ** -24 * np.abs(y64).max(), (err, np_err)
    dd, db = d.copy(), np.empty(c, F32)
    k.gelu_bwd(dd, x, db)
    np_dz = d * G.gelu_grad(x, t)
    want = d.astype(F64) * g64
    err, np_err = np.abs(dd - want).max(), np.abs(np_dz - want).max()
    assert err <= np_err + 2 * 2.0 ** -24 * np.abs(want).max(), (err, np_err)
    close(db, want.sum(axis=0), 1e-6 * x.shape[0], "bias gradient")


# ---- causal softmax --------------------------------------------------------------------------------
def softmax_ref(s, scale):
    """The reference's causal softmax (models/gpt_numpy.attention) on given scores."""
    T = s.shape[-1]
    s = np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, s * s.dtype.type(scale))
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("dtype,rel", [(F64, 1e-15), (F32, 4e-7)])
@pytest.mark.parametrize("t", SEQ)
def test_softmax_causal_forward_and_backward(lib, rng, dtype, rel, t):
    k = kern(lib, dtype)
    s = (rng.standard_normal((2, 3, t, t)) * 4).astype(dtype)
    att = s.copy()
    k.softmax_causal_fwd(att, 0.35)
    want = softmax_ref(s, 0.35)
    close(att, want, rel * 4, "softmax")
    assert not np.triu(att[0, 0], 1).any()                      # exact zeros above the diagonal
    np.testing.assert_allclose(att.sum(axis=-1), 1.0, rtol=rel * 64)
    d = rng.standard_normal(s.shape).astype(dtype)
    ds = d.copy()
    k.softmax_causal_bwd(ds, att, 0.35)
    close(ds, att * (d - (d * att).sum(axis=-1, keepdims=True)) * dtype(0.35), rel * 16, "softmax backward")
    assert not np.triu(ds[1, 2], 1).any()


def test_softmax_float32_extremes(lib):
    """Scores far apart (exp underflows to 0), equal scores, and inf/NaN propagate as in the reference."""
    k = kern(lib, F32)
    s = np.array([[0, 0, 0], [-1e4, 50, 0], [3, 3, 3]], F32)[None]
    att = s.copy()
    k.softmax_causal_fwd(att, 1.0)
    np.testing.assert_allclose(att[0], softmax_ref(s, 1.0)[0], rtol=1e-6, atol=1e-30)
    bad = np.array([[1, 0], [np.nan, 0]], F32)[None]
    k.softmax_causal_fwd(bad, 1.0)
    assert bad[0, 0, 0] == 1 and np.isnan(bad[0, 1]).all()


# ---- bias + residual, alignment, checks ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, F64])
def test_bias_residual_is_bit_exact(lib, rng, dtype):
    k = kern(lib, dtype)
    out, res, b = (rng.standard_normal(s).astype(dtype) for s in ((9, 33), (9, 33), (33,)))
    want = res + (out + b)
    k.bias_residual(out, res, b)
    np.testing.assert_array_equal(out, want)


def test_results_do_not_depend_on_where_the_rows_lie(lib, rng):
    """The same values at another alignment give the same bits (lanes follow the index, not the address)."""
    k = kern(lib, F32)
    x = rng.standard_normal((5, 37)).astype(F32)
    g, b = rng.standard_normal(37).astype(F32), rng.standard_normal(37).astype(F32)

    def run(x):
        y, m, r = np.empty_like(x), np.empty(5, F32), np.empty(5, F32)
        k.layernorm_fwd(x, g, b, y, m, r, 1e-5)
        f, gy = x.copy(), np.empty_like(x)
        k.gelu_fwd(f, None, gy)
        s = np.ascontiguousarray(x[:, :5].reshape(1, 5, 5))
        k.softmax_causal_fwd(s, 0.5)
        return y, gy, s
    first = run(x)
    for shift in (1, 2, 3):
        buf = np.empty(x.size + shift, F32)[shift:].reshape(x.shape)   # 4-byte steps off the allocation
        buf[...] = x
        for a, b_ in zip(first, run(buf)):
            np.testing.assert_array_equal(a, b_)


def test_wrappers_refuse_what_the_c_code_cannot_take(lib):
    k = kern(lib, F32)
    x, y = np.zeros((4, 8), F32), np.zeros((4, 8), F32)
    with pytest.raises(ValueError, match="contiguous float32"):
        k.gelu_fwd(x.astype(F64), None, y)
    with pytest.raises(ValueError, match="strided"):
        k.gelu_fwd(np.zeros((4, 16), F32)[:, ::2], None, y)
    with pytest.raises(ValueError, match="shapes do not match"):
        k.bias_residual(x, np.zeros((4, 7), F32), np.zeros(8, F32))
    with pytest.raises(ValueError, match="not square"):
        k.softmax_causal_fwd(np.zeros((2, 3, 4), F32), 1.0)
    with pytest.raises(ValueError, match="float32 or float64"):
        MK.Kernels(lib, np.float16)


def test_library_is_named_and_cached_like_the_adamw_one(tmp_path):
    if fused_cpu.find_compiler() is None:
        pytest.skip("no C compiler on PATH (set CC)")
    first = MK.build_library(tmp_path)
    assert MK.build_library(tmp_path) == first
    assert first.name.startswith("zerompi_gpt_cpu-") and first.suffix == ".so"


# ---- the model's fast path -------------------------------------------------------------------------
def test_persistent_buffers_give_the_fresh_results(rng):
    """Buffers reused across calls (as in training): the same gradients as new arrays, for a
    second batch after a first one, and for another batch shape; the arrays are reused."""
    model = G.GPT(vocab=9, seq_len=6, n_layer=2, n_head=2, d_model=8, seed=1, dtype=F64)
    if model.layers.name != "c":
        pytest.skip("the GPT's C kernels do not build here")
    layers = [(n, {k: v.astype(F64) + 0.2 * rng.standard_normal(v.shape) for k, v in p.items()})
              for n, p in model.init_layers()]
    ws = Workspace(persistent=True)
    batches = [rng.integers(0, 9, (3, 7)) for _ in range(2)] + [rng.integers(0, 9, (2, 5))]
    ids = []
    for rows in batches:
        got = model.loss_and_grads(layers, rows[:, :-1], rows[:, 1:], ws=ws)
        want = model.loss_and_grads(layers, rows[:, :-1], rows[:, 1:], ws=FRESH)
        assert got[0] == want[0]
        for name in want[1]:
            np.testing.assert_array_equal(got[1][name], want[1][name], err_msg=name)
        ids.append({key: id(a) for key, a in ws._arrays.items()})
    assert ids[0] == ids[1] and ws.nbytes > 0          # same shapes: not one array allocated again


def test_float32_fast_path_matches_the_numpy_path(rng):
    """The two implementations in float32 on a 2-block model: the same loss and gradients to float32 rounding."""
    sizes = dict(vocab=11, seq_len=16, n_layer=2, n_head=4, d_model=32, seed=4)
    fast, plain = G.GPT(**sizes, kernels="auto"), G.GPT(**sizes, kernels="numpy")
    if fast.layers.name != "c":
        pytest.skip("the GPT's C kernels do not build here")
    layers = fast.init_layers()
    rows = rng.integers(0, 11, (5, 17))
    (l1, g1), (l2, g2) = (m.loss_and_grads(layers, rows[:, :-1], rows[:, 1:], ws=m.workspace) for m in (fast, plain))
    assert l1 == pytest.approx(l2, rel=1e-6)
    for name in g2:
        np.testing.assert_allclose(g1[name], g2[name], rtol=2e-4, atol=2e-6 * np.abs(g2[name]).max(), err_msg=name)


def test_without_a_compiler_auto_takes_numpy_and_c_says_why(tmp_path):
    code = ("from zerompi.train.models.gpt import GPT\n"
            "print(GPT(5, 4, 1, 1, 4).layers.name)\n"
            "try:\n    GPT(5, 4, 1, 1, 4, kernels='c')\nexcept RuntimeError as e:\n    print('RuntimeError', e)\n")
    env = {**__import__("os").environ, "CC": str(tmp_path / "no-such-cc"), "ZEROMPI_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                         cwd=str(ROOT))
    lines = out.stdout.splitlines()
    assert lines[0] == "numpy", out
    assert lines[1].startswith("RuntimeError the GPT's C kernels cannot be used") and "no-such-cc" in lines[1], out


def test_upcast_is_numpys_conversion(rng):
    h = (rng.standard_normal((33, 17)) * 100).astype(np.float16)
    h.flat[:4] = [np.inf, -np.inf, np.nan, 6e-8]                      # inf, NaN and a subnormal kept
    out = np.empty(h.shape, F32)
    got = MK.upcast(h, F32, out)
    assert got is out or MK.library() is None
    np.testing.assert_array_equal(got.view(np.uint32), h.astype(F32).view(np.uint32))
    np.testing.assert_array_equal(MK.upcast(h[:, ::2], F32), h[:, ::2].astype(F32))   # strided: NumPy's
    f = h.astype(F32)
    assert MK.upcast(f, F32) is f


def test_fp16_parameters_are_converted_again_for_each_block(rng):
    """Stored fp16 parameters (as the engine hands them) through the blocks' shared conversion buffers:
    the same bits as parameters converted up front, and as without a workspace."""
    model = G.GPT(vocab=9, seq_len=6, n_layer=3, n_head=2, d_model=8, seed=2)
    half = [(n, {k: (v + 0.2 * rng.standard_normal(v.shape)).astype(np.float16) for k, v in p.items()})
            for n, p in model.init_layers()]
    full = [(n, {k: v.astype(F32) for k, v in p.items()}) for n, p in half]
    rows = rng.integers(0, 9, (4, 7))
    want = model.loss_and_grads(full, rows[:, :-1], rows[:, 1:])
    for ws in (Workspace(persistent=True), FRESH):
        got = model.loss_and_grads(half, rows[:, :-1], rows[:, 1:], ws=ws)
        assert got[0] == want[0]
        for name in want[1]:
            np.testing.assert_array_equal(got[1][name], want[1][name], err_msg=name)
