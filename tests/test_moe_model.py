"""The GPT's MoE blocks against tests/moe_oracle.py, an independent float64 MoE GPT: the loss and the aux loss to
float64 rounding, and every kind of parameter's gradient (router, experts, aux loss, the dense parts around them)
against central finite differences of the oracle's loss."""
import numpy as np
import pytest

from tests import moe_oracle
from zerompi.train.models.gpt import GPT
from zerompi.train.moe.mlp import MoESpec

V, T, L, H, C = 11, 6, 2, 2, 8


def setup(experts=4, top_k=2, every=1, capacity=None, coef=0.01, hidden=12, dtype=np.float64, seed=3, shared=0):
    spec = MoESpec(experts, top_k, hidden, every, capacity, coef, shared=shared)
    model = GPT(V, T, L, H, C, seed=seed, moe=spec, dtype=dtype)
    layers = [(a, {k: v.astype(dtype) for k, v in p.items()}) for a, p in model.init_layers()]
    rng = np.random.default_rng(seed)
    for _, p in layers:               # biases and gains off their constants, so every path carries a gradient
        for k, v in p.items():
            if k.endswith(".b") or k.endswith(".g"):
                v += rng.normal(0, 0.1, v.shape)
    idx, tgt = rng.integers(0, V, (3, T)), rng.integers(0, V, (3, T))
    return spec, model, layers, idx, tgt


def oracle(spec, layers, idx, tgt, flat=None, bias=None):
    flat = flat or {k: v for _, p in layers for k, v in p.items()}
    blocks = [i for i in range(L) if spec.is_moe(i)]
    return moe_oracle.loss(flat, idx, tgt, L, H, blocks, spec.experts, spec.top_k, spec.capacity_factor,
                           spec.aux_coef, bias, spec.shared)


CASES = {"dropless": {}, "capacity": {"capacity": 0.75}, "every-2": {"every": 2}, "top-1": {"top_k": 1},
         "top-3": {"top_k": 3, "experts": 5}, "shared-1": {"shared": 1}, "shared-2": {"shared": 2, "every": 2},
         "shared-capacity": {"shared": 2, "capacity": 0.75, "top_k": 1}}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_aux_equal_the_oracle(case):
    spec, model, layers, idx, tgt = setup(**CASES[case])
    model.moe_blocks.mlp.stats.take()
    ce, _ = model.loss_and_grads(layers, idx, tgt)
    tokens, dropped, aux, passes = model.moe_blocks.mlp.stats.take()
    want_ce, want_aux, _ = oracle(spec, layers, idx, tgt)
    assert ce == pytest.approx(want_ce, rel=1e-12)
    assert aux == pytest.approx(want_aux, rel=1e-12)
    assert passes == sum(spec.is_moe(i) for i in range(L))
    n = idx.size * spec.top_k
    assert sum(int(t.sum()) for t in tokens.values()) + dropped == n * passes
    assert (dropped > 0) == (spec.capacity_factor is not None)


def check_fd(spec, model, layers, idx, tgt, names, per=4, eps=1e-6, rtol=2e-6):
    """The model's gradient of CE + aux_coef · aux equals the oracle's central differences."""
    _, grads = model.loss_and_grads(layers, idx, tgt)
    flat = {k: v for _, p in layers for k, v in p.items()}
    rng = np.random.default_rng(7)
    checked = 0
    for name in names:
        p = flat[name]
        for pos in rng.choice(p.size, size=min(per, p.size), replace=False):
            at = np.unravel_index(pos, p.shape)
            old = p[at]
            p[at] = old + eps
            up = oracle(spec, layers, idx, tgt, flat)[2]
            p[at] = old - eps
            down = oracle(spec, layers, idx, tgt, flat)[2]
            p[at] = old
            fd = (up - down) / (2 * eps)
            assert grads[name][at] == pytest.approx(fd, rel=rtol, abs=1e-9), (name, at)
            checked += 1
    return checked


MOE_NAMES = ["block{}.router.w", "block{}.experts.fc.w", "block{}.experts.fc.b", "block{}.experts.out.w",
             "block{}.experts.out.b", "block{}.ln2.g", "block{}.qkv.w"]


SHARED_NAMES = ["block{}.shared.fc.w", "block{}.shared.fc.b", "block{}.shared.out.w", "block{}.shared.out.b"]


@pytest.mark.parametrize("case", ["dropless", "capacity", "every-2", "shared-1", "shared-2", "shared-capacity"])
def test_gradients_equal_finite_differences(case):
    spec, model, layers, idx, tgt = setup(**CASES[case])
    block = next(i for i in range(L) if spec.is_moe(i))
    names = [n.format(block) for n in MOE_NAMES + (SHARED_NAMES if spec.shared else [])] \
        + ["wte", "wpe", "block0.ln1.g"]
    assert check_fd(spec, model, layers, idx, tgt, names) == 4 * len(names)


def test_shared_experts_change_the_output():
    """The shared experts are in the model (every MoE block's parameters, shaped (S, ...)) and move the loss; with
    S = 0 the model has none of them (the names, the draws and the bits of a model without)."""
    spec, model, layers, idx, tgt = setup(shared=2)
    flat = {k: v for _, p in layers for k, v in p.items()}
    assert flat["block0.shared.fc.w"].shape == (2, C, 12) and flat["block1.shared.out.b"].shape == (2, C)
    with_shared = model.loss_and_grads(layers, idx, tgt)[0]
    plain_layers = setup()[2]
    assert not any(".shared." in k for _, p in plain_layers for k in p)
    for _, p in layers:                      # the shared experts' output zeroed: the model without them
        for k in [k for k in p if ".shared.out." in k]:
            p[k][...] = 0
    assert model.loss_and_grads(layers, idx, tgt)[0] != with_shared


def test_aux_loss_gradient_alone():
    """top-1: the renormalised weight is 1, so the router learns from the aux loss only; its gradient (a strong
    coefficient) equals the differences, and it is 0 without the aux loss."""
    spec, model, layers, idx, tgt = setup(top_k=1, coef=0.5)
    assert check_fd(spec, model, layers, idx, tgt, ["block0.router.w", "block1.router.w"], per=8) == 16
    spec, model, layers, idx, tgt = setup(top_k=1, coef=0.0)
    _, grads = model.loss_and_grads(layers, idx, tgt)
    assert not grads["block0.router.w"].any()


def test_fp32_with_kernels_near_float64():
    """The dense blocks on the C kernels (when they load), the MoE blocks in float32: the float64 loss and
    gradients within float32 rounding."""
    spec, m64, layers, idx, tgt = setup(every=2)
    m32 = GPT(V, T, L, H, C, seed=3, moe=spec, dtype=np.float32)
    l32 = [(a, {k: v.astype(np.float32) for k, v in p.items()}) for a, p in layers]
    loss64, g64 = m64.loss_and_grads(layers, idx, tgt)
    loss32, g32 = m32.loss_and_grads(l32, idx, tgt)
    assert loss32 == pytest.approx(loss64, rel=1e-6)
    for k, v in g64.items():
        np.testing.assert_allclose(g32[k], v, rtol=1e-3, atol=1e-6 * np.abs(v).max())


def test_selection_bias_equals_the_oracle():
    """Aux-loss-free balancing: a bias that changes the choices (not the weights): loss and aux equal the
    oracle's; the gradients still its differences (the bias is a constant of the step)."""
    spec, model, layers, idx, tgt = setup()
    bias = {0: np.array([0.3, -0.2, 0.0, 0.1]), 1: np.array([-0.1, 0.0, 0.25, 0.0])}
    plain = model.loss_and_grads(layers, idx, tgt)[0]
    model.moe_blocks.mlp.bias = {b: v.copy() for b, v in bias.items()}
    model.moe_blocks.mlp.stats.take()
    ce, _ = model.loss_and_grads(layers, idx, tgt)
    aux = model.moe_blocks.mlp.stats.take()[2]
    want_ce, want_aux, _ = oracle(spec, layers, idx, tgt, bias=bias)
    assert ce != plain and ce == pytest.approx(want_ce, rel=1e-12) and aux == pytest.approx(want_aux, rel=1e-12)
    _, grads = model.loss_and_grads(layers, idx, tgt)
    flat = {k: v for _, p in layers for k, v in p.items()}
    for name, at in (("block0.router.w", (1, 2)), ("block1.experts.fc.w", (2, 3, 4)), ("block0.qkv.w", (0, 5))):
        p, eps = flat[name], 1e-6
        old = p[at]
        p[at] = old + eps
        up = oracle(spec, layers, idx, tgt, flat, bias)[2]
        p[at] = old - eps
        down = oracle(spec, layers, idx, tgt, flat, bias)[2]
        p[at] = old
        assert grads[name][at] == pytest.approx((up - down) / (2 * eps), rel=2e-6, abs=1e-9), name


def test_bias_update_rule():
    """bias_e += γ · sign(mean load - load_e): the underloaded experts up, the overloaded down, the mean kept."""
    from zerompi.train.moe.mlp import MoEMLP
    mlp = MoEMLP(MoESpec(4, 2, 8, bias_rate=0.01))
    mlp.update_bias(3, [10, 20, 30, 40])
    mlp.update_bias(3, [25, 25, 10, 40])
    np.testing.assert_array_equal(mlp.bias[3], [0.01, 0.01, 0.0, -0.02])


def _model(spec, kernels, dtype, checkpoint=False):
    return GPT(V, T, L, H, C, seed=3, moe=spec, dtype=dtype, kernels=kernels, checkpoint_activations=checkpoint)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_moe_attention_on_the_c_kernels_equals_the_array_path(dtype):
    """The MoE blocks' attention half runs the dense block's C kernels (when they load): the model's loss and
    every gradient as the plain array path's within the kernels' tolerance (docs/kernels.md: float64 to its
    rounding, float32 as the dense GPT's 2e-4)."""
    pytest.importorskip("zerompi.train.model_kernels")
    from zerompi.train.model_kernels import kernels_for
    if kernels_for(dtype) is None:
        pytest.skip("the GPT's C kernels do not load here")
    spec, _, layers, idx, tgt = setup(shared=1, capacity=1.5)
    layers = [(a, {k: v.astype(dtype) for k, v in p.items()}) for a, p in layers]
    fast, plain = _model(spec, "c", dtype), _model(spec, "numpy", dtype)
    assert fast.moe_blocks.fused is fast.layers and plain.moe_blocks.fused is None
    lf, gf = fast.loss_and_grads(layers, idx, tgt)
    lp, gp = plain.loss_and_grads(layers, idx, tgt)
    rel = 1e-12 if dtype == np.float64 else 2e-4
    assert lf == pytest.approx(lp, rel=rel)
    assert gf.keys() == gp.keys()
    for k, v in gp.items():
        np.testing.assert_allclose(gf[k], v, rtol=rel, atol=rel * np.abs(v).max(), err_msg=k)


def test_moe_block_split_backward_and_recompute_keep_the_bits():
    """On the C kernels, an MoE block's split backward (B now, the attention's W later, after another block's
    backward has reused the shared buffers) and activation checkpointing give the bits of the plain backward,
    in a persistent workspace as the engine runs it."""
    from zerompi.train.model_kernels import kernels_for
    if kernels_for(np.float32) is None:
        pytest.skip("the GPT's C kernels do not load here")
    from zerompi.train.models.gpt_fast import Workspace
    spec, _, layers, idx, tgt = setup(every=1)
    layers = [(a, {k: v.astype(np.float32) for k, v in p.items()}) for a, p in layers]
    params = [p for _, p in layers]

    def run(checkpoint, split):
        m = _model(spec, "c", np.float32, checkpoint)
        ws, run = Workspace(), m.activations
        run._ws = ws
        h, caches = idx, []
        for i, p in enumerate(params):
            h, c = run.forward(i, p, h)
            caches.append(c)
        _, dh, dwte = m.head(params[0]["wte"], h, tgt, 1.0, ws)
        grads, later = {}, []
        for i in reversed(range(len(params))):
            if split and 1 <= i <= L and not checkpoint:
                dh, w = m.backward_layer_parts(i, params[i], caches[i], dh, ws)
                later.append(w)
                continue
            dh, g = run.backward(i, params[i], caches[i], dh)
            grads.update({k: v.copy() for k, v in g.items()})
        for w in later:                   # every block's W after all the B's
            grads.update({k: v.copy() for k, v in w().items()})
        return grads

    base = run(False, False)
    for checkpoint, split in ((False, True), (True, False)):
        got = run(checkpoint, split)
        for k, v in base.items():
            np.testing.assert_array_equal(got[k], v, err_msg=f"{k} checkpoint={checkpoint} split={split}")
