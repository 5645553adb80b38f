"""The GPT's hand-written backward against central finite differences (float64), its engine
driver at N=1, and the offline data: the corpus entropy against independent estimates."""
import numpy as np
import pytest

from zerompi import ZeroConfig, ZeroEngine
from zerompi.train.data import FileData, GeneratedData, MarkovCorpus, check_file, rank_rows
from zerompi.errors import ConfigError
from zerompi.train.models import gpt as G
from zerompi.train.models.gpt_chunk import run_micro_batch

F64 = np.float64
EPS = 1e-6          # central differences in float64: error ~ EPS**2 * f''' + 1e-16 * |f| / EPS


def numeric_grad(f, x):
    """d f() / d x by central differences, perturbing x in place."""
    g = np.zeros_like(x)
    for i in range(x.size):
        old = x.flat[i]
        x.flat[i] = old + EPS
        up = f()
        x.flat[i] = old - EPS
        down = f()
        x.flat[i] = old
        g.flat[i] = (up - down) / (2 * EPS)
    return g


def assert_grad(analytic, numeric, what):
    scale = max(1.0, float(np.abs(numeric).max()))
    err = float(np.abs(analytic - numeric).max())
    assert err <= 1e-7 * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def tiny_model(**kw):
    sizes = dict(vocab=7, seq_len=5, n_layer=2, n_head=2, d_model=8, seed=3)
    sizes.update(kw)
    return G.GPT(**sizes, dtype=F64)


# Both implementations of the blocks: the plain array code and the C kernels (their float64
# build, libm's exp and tanh) with the fast path's buffers and views.
KERNELS = [pytest.param("numpy"), pytest.param("c", marks=pytest.mark.skipif(
    G.GPT(7, 5, 1, 1, 4, kernels="auto").layers.name != "c", reason="the GPT's C kernels do not build here"))]


def perturbed_layers(model, rng, spread=0.3):
    """init_layers in float64 plus noise, so LayerNorm gains, biases and attention are not trivial."""
    return [(name, {k: v.astype(F64) + spread * rng.standard_normal(v.shape) for k, v in p.items()})
            for name, p in model.init_layers()]


# ---- one piece at a time ----------------------------------------------------------------
def test_gelu_grad(rng):
    x = rng.standard_normal(40) * 2
    y, t = G.gelu(np, x)
    numeric = np.array([(G.gelu(np, np.array([a + EPS]))[0] - G.gelu(np, np.array([a - EPS]))[0])[0] / (2 * EPS)
                        for a in x])
    assert_grad(G.gelu_grad(x, t), numeric, "gelu")
    # and the forward is the tanh GELU, not something else with a matching derivative
    want = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(y, want, rtol=1e-12)


def test_layernorm_backward(rng):
    x, g, b = rng.standard_normal((2, 3, 6)), rng.standard_normal(6), rng.standard_normal(6)
    r = rng.standard_normal((2, 3, 6))
    f = lambda: float((G.layernorm(np, x, g, b)[0] * r).sum())
    _, cache = G.layernorm(np, x, g, b)
    dx, dg, db = G.layernorm_backward(r, cache, g)
    for name, arr, ana in (("x", x, dx), ("g", g, dg), ("b", b, db)):
        assert_grad(ana, numeric_grad(f, arr), f"layernorm d{name}")


def test_attention_backward_is_causal_and_exact(rng):
    B, T, H, hd = 2, 5, 2, 3
    qkv = rng.standard_normal((B, T, 3 * H * hd))
    r = rng.standard_normal((B, T, H * hd))
    f = lambda: float((G.attention(np, qkv, H)[0] * r).sum())
    y, cache = G.attention(np, qkv, H)
    assert_grad(G.attention_backward(np, r, cache), numeric_grad(f, qkv), "attention dqkv")
    # causal: changing the last position leaves every earlier output unchanged
    later = qkv.copy()
    later[:, -1] += 1.0
    np.testing.assert_array_equal(G.attention(np, later, H)[0][:, :-1], y[:, :-1])


@pytest.mark.parametrize("kernels", KERNELS)
def test_block_backward(rng, kernels):
    model = tiny_model(kernels=kernels)
    assert model.layers.name == kernels
    params = perturbed_layers(model, rng)[1][1]
    short = {k: params[v] for k, v in model.block_names(0).items()}
    x = rng.standard_normal((2, 5, 8))
    r = rng.standard_normal((2, 5, 8))
    f = lambda: float((model.layers.block_forward(short, x)[0] * r).sum())
    _, cache = model.layers.block_forward(short, x)
    dx, grads = model.layers.block_backward(short, cache, r)
    assert_grad(dx, numeric_grad(f, x), "block dx")
    assert sorted(grads) == sorted(short)
    for k in short:
        assert_grad(grads[k], numeric_grad(f, short[k]), f"block d{k}")


def test_embedding_backward(rng):
    model = tiny_model()
    params = perturbed_layers(model, rng)[0][1]
    idx = rng.integers(0, 7, (3, 4))            # T=4 < seq_len: positions past T get no gradient
    r = rng.standard_normal((3, 4, 8))
    f = lambda: float((model.embed_forward(params, idx)[0] * r).sum())
    _, grads = model.backward_layer(0, None, idx, r)
    for k in (G.WTE, G.WPE):
        assert_grad(grads[k], numeric_grad(f, params[k]), f"embedding d{k}")
    assert not grads[G.WPE][4:].any()


@pytest.mark.parametrize("kernels", KERNELS)
def test_final_layernorm_tied_head_and_cross_entropy(rng, kernels):
    model = tiny_model(kernels=kernels)
    layers = perturbed_layers(model, rng)
    lnf, wte = layers[-1][1], layers[0][1][G.WTE]
    last = model.num_layers - 1
    h = rng.standard_normal((2, 5, 8))
    targets = rng.integers(0, 7, (2, 5))

    def f():
        hf, _ = model.forward_layer(last, lnf, h)
        return model.head(wte, hf, targets)[0]

    hf, cache = model.forward_layer(last, lnf, h)
    loss, dhf, dwte = model.head(wte, hf, targets, scale=1.0)
    dh, grads = model.backward_layer(last, lnf, cache, dhf)
    assert_grad(dh, numeric_grad(f, h), "ln_f dh")
    assert_grad(dwte, numeric_grad(f, wte), "head dwte")
    for k in ("ln_f.g", "ln_f.b"):
        assert_grad(grads[k], numeric_grad(f, lnf[k]), f"d{k}")
    # the loss itself: mean cross-entropy of the softmax, computed independently
    logits = hf @ wte.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = -np.mean(np.log(np.take_along_axis(p, targets[..., None], -1)))
    assert loss == pytest.approx(want, rel=1e-12)
    # scale multiplies the gradients, not the loss
    loss2, dhf2, dwte2 = model.head(wte, hf, targets, scale=8.0)
    assert loss2 == loss
    np.testing.assert_allclose(dwte2, 8 * dwte, rtol=1e-12)


@pytest.mark.parametrize("kernels", KERNELS)
def test_whole_model_gradient(rng, kernels):
    model = tiny_model(kernels=kernels)
    layers = perturbed_layers(model, rng)
    idx, targets = rng.integers(0, 7, (3, 5)), rng.integers(0, 7, (3, 5))
    loss, grads = model.loss_and_grads(layers, idx, targets)
    names = [k for _, p in layers for k in p]
    assert sorted(grads) == sorted(names)
    f = lambda: model.loss_and_grads(layers, idx, targets)[0]
    for _, p in layers:
        for k, arr in p.items():
            assert_grad(grads[k], numeric_grad(f, arr), f"model d{k}")


# ---- the engine driver ------------------------------------------------------------------
class Recorder:
    """Forwards the public engine API to a real engine and records what the model does with it."""

    def __init__(self, engine):
        self.engine, self.visits, self.grads = engine, [], {}
        self.rank, self.world_size, self.comm = engine.rank, engine.world_size, engine.comm

    @property
    def loss_scale(self):
        return self.engine.loss_scale

    def begin_forward(self):
        self.visits.append("F")
        self.engine.begin_forward()

    def begin_backward(self):
        self.visits.append("B")
        self.engine.begin_backward()

    def unsharded(self, i):
        self.visits.append(i)
        return self.engine.unsharded(i)

    def grads_ready(self, i, grads):
        assert i not in self.grads, f"layer {i} handed back twice"
        self.grads[i] = {k: np.array(v, dtype=F64) for k, v in grads.items()}
        self.engine.grads_ready(i, grads)


@pytest.mark.parametrize("stage", [0, 3])
def test_engine_micro_batch_hands_back_the_float64_gradient(rng, stage):
    """N=1, fp32 storage: every layer once, in the schedule's order, equal to the float64 gradient."""
    model = G.GPT(vocab=11, seq_len=6, n_layer=2, n_head=2, d_model=8, seed=5)
    layers = model.init_layers()
    engine = ZeroEngine(layers, ZeroConfig(stage=stage, dtype="fp32", bucket_mb=1e-3))
    rec = Recorder(engine)
    idx, targets = rng.integers(0, 11, (4, 6)), rng.integers(0, 11, (4, 6))
    loss = run_micro_batch(rec, model, idx, targets)
    n = model.num_layers
    assert rec.visits == ["F"] + list(range(n)) + ["B"] + list(range(n - 1, -1, -1))
    assert sorted(rec.grads) == list(range(n))
    ref_model = G.GPT(vocab=11, seq_len=6, n_layer=2, n_head=2, d_model=8, seed=5, dtype=F64)
    want_loss, want = ref_model.loss_and_grads([(a, {k: v.astype(F64) for k, v in p.items()}) for a, p in layers],
                                               idx, targets)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for g in rec.grads.values():
        for k, v in g.items():
            np.testing.assert_allclose(v, want[k], rtol=1e-4, atol=1e-6 * np.abs(want[k]).max(), err_msg=k)
    engine.step()
    engine.close()


# ---- the corpus and its entropy ---------------------------------------------------------
def test_two_state_chain_entropy_is_the_closed_form():
    p, q = 0.3, 0.1                                    # P(0 -> 1), P(1 -> 0)
    c = MarkovCorpus(vocab=2, order=1, transitions=np.array([[1 - p, p], [q, 1 - q]]))
    h = lambda a: -(a * np.log(a) + (1 - a) * np.log(1 - a))
    pi0 = q / (p + q)
    assert c.stationary == pytest.approx([pi0, 1 - pi0], abs=1e-12)
    assert c.entropy_rate == pytest.approx(pi0 * h(p) + (1 - pi0) * h(q), abs=1e-12)
    assert c.floor(10) == pytest.approx(c.entropy_rate, abs=1e-12)


def test_stationary_distribution_is_stationary():
    c = MarkovCorpus(vocab=5, order=2, seed=4)
    v = c.vocab
    nxt = np.zeros((c.n_states, c.n_states))
    for s in range(c.n_states):                        # context (a, b) -> (b, x) with P[(a, b), x]
        for x in range(v):
            nxt[s, (s % v) * v + x] += c.transitions[s, x]
    np.testing.assert_allclose(c.stationary @ nxt, c.stationary, atol=1e-12)
    np.testing.assert_allclose(c.transitions.sum(1), 1.0, atol=1e-12)


def test_entropy_matches_a_plug_in_estimate_from_samples():
    """Counts of sampled n-grams, not the transition table: they check the sampler, the
    stationary start and the entropy formulas together."""
    c = MarkovCorpus(vocab=4, order=2, seed=7)
    rows = c.sample(np.random.default_rng(0).random((60000, 6)))
    v = c.vocab

    def cond_entropy(cols):
        """Empirical H(X_last | X_rest) of the given columns."""
        keys = np.ravel_multi_index(rows[:, cols].T, (v,) * len(cols))
        joint = np.bincount(keys, minlength=v ** len(cols)).reshape(-1, v).astype(F64)
        ctx = joint.sum(1, keepdims=True)
        nz = joint > 0
        return float(-(joint[nz] * np.log((joint / np.maximum(ctx, 1))[nz])).sum() / len(rows))

    assert cond_entropy([0, 1]) == pytest.approx(c.conditional_entropy(1), abs=0.01)
    assert cond_entropy([0, 1, 2]) == pytest.approx(c.conditional_entropy(2), abs=0.01)
    assert cond_entropy([3, 4, 5]) == pytest.approx(c.entropy_rate, abs=0.01)
    # an order-2 chain: a third token of context adds nothing (beyond estimation bias)
    assert cond_entropy([2, 3, 4, 5]) == pytest.approx(c.entropy_rate, abs=0.02)
    # and the older token matters: the floor is well below what the last token alone gives
    assert c.entropy_rate < cond_entropy([4, 5]) - 0.05
    # the stationary start: the first two columns are distributed like two later ones
    first = np.bincount(rows[:, 0] * v + rows[:, 1], minlength=v * v) / len(rows)
    later = np.bincount(rows[:, 4] * v + rows[:, 5], minlength=v * v) / len(rows)
    np.testing.assert_allclose(first, c.stationary, atol=0.01)
    np.testing.assert_allclose(later, c.stationary, atol=0.01)


def test_floor_is_the_mean_over_target_positions():
    d = GeneratedData(seq_len=3, seed=0, vocab=6)
    c = d.corpus
    want = (c.conditional_entropy(1) + 2 * c.entropy_rate) / 3
    assert d.entropy_floor == pytest.approx(want)
    assert c.entropy_rate < d.entropy_floor < np.log(6)


# ---- rows and splits ----------------------------------------------------------------------
def test_rows_do_not_depend_on_the_split():
    d = GeneratedData(seq_len=9, seed=2)
    whole = d.train_rows(5, range(12))
    for n in (1, 2, 3, 5):
        parts = [d.train_rows(5, rank_rows(12, r, n)) for r in range(n)]
        np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert not np.array_equal(d.train_rows(6, range(12)), whole)
    assert whole.shape == (12, 10) and whole.min() >= 0 and whole.max() < d.vocab
    assert not np.array_equal(d.val_rows(range(12)), whole)


def test_rank_rows_cover_each_row_once():
    for n_rows in (0, 1, 7, 12):
        for n in (1, 2, 3, 5):
            got = [j for r in range(n) for j in rank_rows(n_rows, r, n)]
            assert got == list(range(n_rows))


def test_file_data_windows_and_held_out_tail(tmp_path):
    raw = np.random.default_rng(0).integers(0, 256, 1000).astype(np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(raw.tobytes())
    d = FileData(str(path), seq_len=8, seed=1)
    assert (d.vocab, d.entropy_floor, d.n_val, d.n_train) == (256, None, 100, 900)
    for step in range(5):
        for row in d.train_rows(step, range(4)):
            starts = [s for s in range(d.n_train - 8) if np.array_equal(raw[s:s + 9], row)]
            assert starts, "a training row is not a window of the training part"
    val = d.val_rows(range(d.val_size))
    assert d.val_size == 92
    for j, row in enumerate(val):
        s = d.n_train + j
        np.testing.assert_array_equal(row, raw[s:s + 9])


def test_file_checks(tmp_path):
    with pytest.raises(ConfigError, match="is not a file"):
        check_file(str(tmp_path / "missing"), 8)
    short = tmp_path / "short.txt"
    short.write_bytes(b"x" * 17)
    with pytest.raises(ConfigError, match="has 17 bytes; seq_len=8 needs at least 18"):
        check_file(str(short), 8)
    short.write_bytes(b"x" * 18)
    check_file(str(short), 8)


def test_config_validation():
    from zerompi.train.config import parse_config
    cfg = parse_config([])
    assert (cfg.model, cfg.steps, cfg.batch) == ("gpt", 300, 48)
    assert parse_config(["--model", "mlp"]).steps == 30
    for flags, needle in ((["--d-model", "30", "--n-head", "4"], "d_model=30 is not divisible by n_head=4"),
                          (["--n-layer", "0"], "n_layer=0"), (["--seq-len", "0"], "seq_len=0"),
                          (["--eval-every", "-1"], "eval_every=-1"),
                          (["--model", "mlp", "--data", __file__], "applies to model gpt only")):
        with pytest.raises(ConfigError, match=needle):
            parse_config(flags)
