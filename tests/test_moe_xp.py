"""The MoE GPT on the array path that CuPy takes, with tests/fake_cupy.py's strict NumPy standing in for CuPy.

The stand-in refuses what CuPy refuses: a NumPy function or ufunc on a device array, a host array mixed into
device arithmetic, an implicit transfer. So the MoE modules that run on it here (moe/mlp.py: the router, top-k,
the aux loss, capacity drops, the selection bias; moe/block.py; moe/ep_mlp.py and comm/ep_alltoall.py: the
expert-parallel all-to-all, staged through host buffers) make no hidden NumPy call on a device array, and move
their counts to the host explicitly. Their results: the bits of the plain NumPy array path (the same code on
NumPy), and the C-kernel CPU path within docs/kernels.md's float32 bound (2e-4 relative; the losses within
1e-5, the routing counts equal), in one process and in training runs at --ep 1, 2 and 4, stages 0 and 3, N = 4.
"""
import json

import numpy as np
import pytest

from tests.fake_cupy import DeviceArray, xp
from tests.mpirun import run_mpi
from zerompi.train.models.gpt import GPT
from zerompi.train.moe.mlp import MoESpec

V, T, L, H, C = 11, 6, 2, 2, 8


def test_the_stand_in_refuses_what_cupy_refuses():
    """Without this the equalities below would prove nothing about NumPy calls on device arrays."""
    a = xp.asarray(np.arange(4.0))
    host = np.ones(4)
    refused = [lambda: np.exp(a), lambda: np.asarray(a), lambda: np.concatenate([a, a]), lambda: np.cumsum(a),
               lambda: a + host, lambda: host * a, lambda: xp.add(a, host), lambda: a[np.array([0, 1])],
               lambda: np.add(a, 1.0, out=a), lambda: np.concatenate([[0], np.cumsum(np.asarray(a))])]
    for f in refused:
        with pytest.raises(TypeError):
            f()
    b = (a * 2.0 + np.float32(1)).sum()                # scalars, NumPy's too, and reductions: as on CuPy
    assert isinstance(b, DeviceArray) and float(b) == 16.0 and int(a.max()) == 3 and len(a) == 4
    np.testing.assert_array_equal(xp.asnumpy(xp.argsort(-a, kind="stable")), [3, 2, 1, 0])


CASES = {"dropless": {}, "capacity": {"capacity": 0.75}, "every-2": {"every": 2}, "top-1": {"top_k": 1},
         "shared-capacity": {"shared": 2, "capacity": 0.75, "top_k": 1}, "bias": {"bias": True}}


def setup(dtype, experts=4, top_k=2, every=1, capacity=None, shared=0, bias=False):
    spec = MoESpec(experts, top_k, 12, every, capacity, 0.01, 0.01 if bias else 0.0, shared)
    rng = np.random.default_rng(5)
    layers = GPT(V, T, L, H, C, seed=3, moe=spec, dtype=dtype).init_layers()
    for _, p in layers:               # biases and gains off their constants, so every path carries a gradient
        for k, v in p.items():
            if k.endswith(".b") or k.endswith(".g"):
                v += rng.normal(0, 0.1, v.shape).astype(v.dtype)
    idx, tgt = rng.integers(0, V, (3, T)), rng.integers(0, V, (3, T))
    return spec, [(a, {k: v.astype(dtype) for k, v in p.items()}) for a, p in layers], idx, tgt


def run(spec, layers, idx, tgt, dtype, on, kernels="numpy", bias=False):
    """(loss, grads on the host, MoEStats.take(), routed) of one pass on ``on`` (numpy or the stand-in)."""
    model = GPT(V, T, L, H, C, seed=3, moe=spec, dtype=dtype, xp=on, kernels=kernels)
    mlp = model.moe_blocks.mlp
    if bias:                          # a selection bias that changes the choice (host float64, as the job keeps it)
        for b in range(L):
            mlp.update_bias(b, [40, 1, 30, 2])
            mlp.update_bias(b, [40, 1, 1, 50])
    if on is xp:
        layers = [(a, {k: xp.asarray(v) for k, v in p.items()}) for a, p in layers]
        idx, tgt = xp.asarray(idx), xp.asarray(tgt)
    loss, grads = model.loss_and_grads(layers, idx, tgt, scale=4.0)
    routed = {b: r.copy() for b, r in mlp.stats.routed.items()}
    return loss, {k: xp.asnumpy(v) for k, v in grads.items()}, mlp.stats.take(), routed


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_moe_model_on_xp_has_the_bits_of_the_array_path(case, dtype):
    spec, layers, idx, tgt = setup(dtype, **CASES[case])
    bias = CASES[case].get("bias", False)
    loss, grads, stats, routed = run(spec, layers, idx, tgt, dtype, xp, bias=bias)
    want_loss, want_grads, want_stats, want_routed = run(spec, layers, idx, tgt, dtype, np, bias=bias)
    assert loss == want_loss
    assert grads.keys() == want_grads.keys()
    for k, v in want_grads.items():
        assert grads[k].dtype == v.dtype and np.array_equal(grads[k], v), k
    (tokens, dropped, aux, passes), (wt, wd, wa, wp) = stats, want_stats
    assert (dropped, aux, passes) == (wd, wa, wp) and (dropped > 0) == (spec.capacity_factor is not None)
    assert tokens.keys() == wt.keys() and all(np.array_equal(tokens[b], wt[b]) for b in wt)
    assert all(np.array_equal(routed[b], want_routed[b]) for b in want_routed)


@pytest.mark.parametrize("case", ["capacity", "shared-capacity", "bias"])
def test_moe_model_on_xp_near_the_c_kernels(case):
    """Against the CPU path's C kernels (the attention half): float32's bound, the same routing."""
    from zerompi.train.model_kernels import kernels_for
    if kernels_for(np.float32) is None:
        pytest.skip("the GPT's C kernels do not load here")
    dtype = np.float32
    spec, layers, idx, tgt = setup(dtype, **CASES[case])
    bias = CASES[case].get("bias", False)
    loss, grads, (tokens, dropped, aux, _), _ = run(spec, layers, idx, tgt, dtype, xp, bias=bias)
    lc, gc, (tc, dc, ac, _), _ = run(spec, layers, idx, tgt, dtype, np, kernels="c", bias=bias)
    assert loss == pytest.approx(lc, abs=1e-5)
    assert dropped == dc and all(np.array_equal(tokens[b], tc[b]) for b in tc)
    assert aux == pytest.approx(ac, rel=1e-5)
    for k, v in gc.items():
        np.testing.assert_allclose(grads[k], v, rtol=2e-4, atol=2e-4 * np.abs(v).max(), err_msg=k)


FLAGS = ["--model", "gpt", "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--seq-len", "8",
         "--batch", "12", "--lr", "3e-3", "--bucket-mb", "0.004", "--log-every", "100",
         "--experts", "4", "--top-k", "2", "--expert-hidden", "24", "--steps", "3", "--eval-every", "3",
         "--dtype", "fp32"]
RUNS = [["--stage", "0", "--ep", "1"], ["--stage", "3", "--ep", "1", "--capacity-factor", "1.0"],
        ["--stage", "0", "--ep", "2", "--bias-update", "0.01"],
        ["--stage", "3", "--ep", "2", "--capacity-factor", "1.0"],
        ["--stage", "3", "--ep", "4", "--micro-batches", "2", "--batch", "16"]]


@pytest.mark.slow
def test_moe_training_on_xp_equals_the_cpu_path():
    """N = 4: each run with its model on the stand-in (the all-to-all staged through host buffers) beside the same
    run on the C-kernel CPU path: losses and held-out losses within 1e-5, routing (tokens per expert, drops, the
    all-to-all's bytes, the selection bias) equal, the aux loss and the gradient norms within float32's bound."""
    proc = run_mpi(4, ["tests/drivers/moe_xp.py", json.dumps([FLAGS + r for r in RUNS])], timeout=400)
    runs = [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("METRICS ")]
    assert [r["path"] for r in runs] == ["xp"] * len(RUNS) + ["cpu"] * len(RUNS)
    for got, want in zip(runs[:len(RUNS)], runs[len(RUNS):]):
        assert got["flags"] == want["flags"]
        what = " ".join(got["flags"][len(FLAGS):])
        np.testing.assert_allclose(got["losses"], want["losses"], rtol=0, atol=1e-5, err_msg=what)
        assert [s for s, _ in got["val_losses"]] == [s for s, _ in want["val_losses"]]
        np.testing.assert_allclose([v for _, v in got["val_losses"]], [v for _, v in want["val_losses"]], atol=1e-5)
        g, w = got["moe"], want["moe"]
        for key in ("tokens_min", "tokens_mean", "tokens_max", "dropped", "all_to_all_bytes", "bias"):
            assert g[key] == w[key], (what, key)
        np.testing.assert_allclose(g["aux_loss"], w["aux_loss"], rtol=1e-5, err_msg=what)
        np.testing.assert_allclose(g["grad_norms"], w["grad_norms"], rtol=2e-4, err_msg=what)
    drops = [r["moe"]["dropped"] for r in runs[:len(RUNS)]]
    assert sum(drops[1]) > 0 and sum(drops[3]) > 0 and runs[2]["moe"]["bias"]     # capacity and bias exercised


def test_device_gpu_takes_the_moe_at_every_ep():
    """--ep > 1 runs on the GPU's path too (tests/test_gpu_path.py): the config takes it."""
    from zerompi.train.config import parse_config
    for ep in ("1", "2"):
        cfg = parse_config(["--experts", "4", "--ep", ep, "--device", "gpu"], environ={})
        assert cfg.device == "gpu" and cfg.moe.ep == int(ep)
