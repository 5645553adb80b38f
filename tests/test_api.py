"""The public API on one rank (in-process): misuse raises clear errors, never a hang or a wrong answer."""
import pydoc

import numpy as np
import pytest

import zerompi
from zerompi import ConfigError, UsageError, ZeroConfig, ZeroEngine


def layers():
    rng = np.random.default_rng(0)
    return [("l0", {"w0": rng.standard_normal((3, 4)).astype(np.float32), "b0": np.zeros(4, np.float32)}),
            ("l1", {"w1": rng.standard_normal((4, 2)).astype(np.float32)})]


def grads_like(lay, scale=1.0):
    return {k: np.full(v.shape, scale, np.float32) for k, v in lay[1].items()}


@pytest.fixture(params=[0, 1, 2, 3])
def engine(request):
    eng = ZeroEngine(layers(), ZeroConfig(stage=request.param, dtype="fp32", bucket_mb=1e-4))
    yield eng
    if not eng.closed:
        eng.close()


def test_full_parameters_start_at_init(engine):
    got = engine.full_parameters()
    for _, params in layers():
        for k, v in params.items():
            np.testing.assert_array_equal(got[k], v)


def test_one_step_matches_adamw(engine):
    ls = layers()
    for i in reversed(range(2)):
        engine.grads_ready(i, grads_like(ls[i], 0.5))
    res = engine.step()
    assert not res.skipped and res.step == 1 and res.clip_coef == 1.0
    n_params = sum(v.size for _, p in ls for v in p.values())
    assert res.grad_norm == pytest.approx(0.5 * np.sqrt(n_params))
    got = engine.full_parameters()
    lr = engine.config.lr
    # First AdamW step with a constant gradient moves every element by lr * g/|g| (up to eps).
    for _, params in ls:
        for k, v in params.items():
            np.testing.assert_allclose(got[k], v - lr, rtol=0, atol=1e-6)


def test_step_before_all_gradients(engine):
    engine.grads_ready(1, grads_like(layers()[1]))
    with pytest.raises(UsageError, match=r"step\(\) after 0 of 1 micro-batches \(1 of 2 layers"):
        engine.step()


def test_wrong_gradients(engine):
    with pytest.raises(UsageError, match=r"gradient 'w1' has shape \(2, 4\); the parameter's shape is \(4, 2\)"):
        engine.grads_ready(1, {"w1": np.zeros((2, 4), np.float32)})
    with pytest.raises(UsageError, match="dtype int64"):
        engine.grads_ready(1, {"w1": np.zeros((4, 2), np.int64)})
    with pytest.raises(UsageError, match=r"missing for \['b0'\]"):
        engine.grads_ready(0, {"w0": np.zeros((3, 4), np.float32)})
    with pytest.raises(UsageError, match="not a layer index"):
        engine.grads_ready(2, {})
    engine.grads_ready(1, grads_like(layers()[1]))
    with pytest.raises(UsageError, match="handed back twice"):
        engine.grads_ready(1, grads_like(layers()[1]))


def test_closed_engine(engine):
    engine.close()
    for call in (lambda: engine.step(), lambda: engine.unshard(0), lambda: engine.full_parameters()):
        with pytest.raises(UsageError, match="closed"):
            call()


def test_bad_lr_override(engine):
    for i in reversed(range(2)):
        engine.grads_ready(i, grads_like(layers()[i]))
    with pytest.raises(ConfigError, match="lr=0"):
        engine.step(lr=0)


def test_stage3_parameters_only_inside_gather():
    eng = ZeroEngine(layers(), ZeroConfig(stage=3, dtype="fp32", bucket_mb=1e-4))
    with pytest.raises(UsageError, match="stage 3: layer 0 .* is sharded"):
        eng.params(0)
    with eng.unsharded(0) as p:
        np.testing.assert_array_equal(p["w0"], layers()[0][1]["w0"])
        assert eng.params(0)["b0"].shape == (4,)
    with pytest.raises(UsageError, match="sharded"):
        eng.params(0)
    with pytest.raises(UsageError, match="without a matching unshard"):
        eng.reshard(1)
    eng.close()


def test_config_errors_name_value_and_range():
    with pytest.raises(ConfigError, match=r"stage=4 is not allowed; use one of 0, 1, 2, 3"):
        ZeroConfig(stage=4)
    with pytest.raises(ConfigError, match=r"beta2=1.0 must be in \[0, 1\)"):
        ZeroConfig(beta2=1.0)


def test_help_reads_as_a_manual():
    text = pydoc.render_doc(zerompi, renderer=pydoc.plaintext)
    for word in ("ZeroEngine", "unsharded", "grads_ready", "full_parameters", "ZeroConfig"):
        assert word in text
