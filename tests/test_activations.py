"""Activation checkpointing (the same bits as keeping every activation, at any stage and world
size) and the GPT's activation bytes (measured by the model's workspace, equal to the formula of
estimate/activations.py, and a real allocation: NumPy's heap through tracemalloc)."""
import json
import tracemalloc

import numpy as np
import pytest

from tests.mpirun import no_python_noise, run_mpi, zerompi_lines
from zerompi import ZeroConfig, ZeroEngine
from zerompi.errors import ConfigError
from zerompi.estimate.activations import gpt_activation_bytes, gpt_activation_elements
from zerompi.train.config import TrainConfig, parse_config
from zerompi.train.models import gpt as G
from zerompi.train.models.gpt_chunk import run_micro_batch

F64 = np.float64
C_KERNELS = G.GPT(7, 5, 1, 1, 4, kernels="auto").layers.name == "c"
needs_c = pytest.mark.skipif(not C_KERNELS, reason="the GPT's C kernels do not build here")


def engine_run(model, dtype, batches, stage=0, record=False):
    """Micro-batches (idx, targets) through an N=1 engine, a step after each; returns (losses, handed-back
    gradients of each step as float64 copies when ``record``, final parameters)."""
    eng = ZeroEngine(model.init_layers(), ZeroConfig(stage=stage, dtype=dtype, bucket_mb=2e-3))
    grads, losses = [], []

    class Recorder:                                   # the engine, with each handed-back gradient copied
        def __getattr__(self, name):
            return getattr(eng, name)

        def grads_ready(self, i, g):
            grads.append({k: np.array(v, dtype=F64) for k, v in g.items()})
            eng.grads_ready(i, g)

    for idx, targets in batches:
        losses.append(run_micro_batch(Recorder() if record else eng, model, idx, targets))
        eng.step()
    params = {}
    eng.begin_forward()
    for i in range(model.num_layers):
        with eng.unsharded(i) as p:
            params.update({k: np.array(v) for k, v in p.items()})
    eng.close()
    return losses, grads, params


def batches(vocab, B, T, count, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, (B, T)), rng.integers(0, vocab, (B, T))) for _ in range(count)]


SHAPE = dict(vocab=13, seq_len=6, n_layer=3, n_head=2, d_model=8, seed=5)


@pytest.mark.parametrize("kernels", [pytest.param("c", marks=needs_c), "numpy"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_checkpointing_gives_the_same_bits(kernels, dtype):
    """Three steps at N=1: losses, every handed-back gradient and the parameters equal to the bit."""
    data = batches(13, 4, 6, 3)
    plain = engine_run(G.GPT(**SHAPE, kernels=kernels), dtype, data, record=True)
    ckpt = engine_run(G.GPT(**SHAPE, kernels=kernels, checkpoint_activations=True), dtype, data, record=True)
    assert plain[0] == ckpt[0] and len(plain[1]) == len(ckpt[1]) == 3 * (SHAPE["n_layer"] + 2)
    for a, b in zip(plain[1], ckpt[1]):
        assert a.keys() == b.keys()
        for k in a:
            assert np.array_equal(a[k], b[k]), k
    for k in plain[2]:
        assert np.array_equal(plain[2][k], ckpt[2][k]), k
    assert plain[0][-1] != plain[0][0]                 # it trained: the comparison is not of constants


@pytest.mark.parametrize("kernels", [pytest.param("c", marks=needs_c), "numpy"])
def test_checkpointed_gradient_is_the_float64_gradient(kernels):
    """The recomputing driver against the whole model's float64 loss and gradient (no engine, no recompute)."""
    model = G.GPT(**SHAPE, kernels=kernels, checkpoint_activations=True)
    layers = model.init_layers()
    (idx, targets), = batches(13, 4, 6, 1, seed=3)
    losses, grads, _ = engine_run(model, "fp32", [(idx, targets)], record=True)
    ref = G.GPT(**SHAPE, dtype=F64, kernels="numpy")
    want_loss, want = ref.loss_and_grads([(a, {k: v.astype(F64) for k, v in p.items()}) for a, p in layers],
                                         idx, targets)
    assert losses[0] == pytest.approx(want_loss, rel=1e-5)
    got = {k: v for g in grads for k, v in g.items()}
    assert got.keys() == want.keys()
    for k, v in got.items():
        np.testing.assert_allclose(v, want[k], rtol=1e-4, atol=1e-6 * np.abs(want[k]).max(), err_msg=k)


SHAPES = [  # (B, T, C, L, H, V)
    (4, 6, 8, 1, 2, 13), (4, 6, 8, 3, 2, 13), (3, 17, 24, 2, 3, 40), (2, 9, 16, 5, 4, 7), (1, 1, 4, 2, 1, 3),
]


@needs_c
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_measured_activation_bytes_equal_the_formula(shape, checkpoint, dtype):
    B, T, C, L, H, V = shape
    model = G.GPT(vocab=V, seq_len=T, n_layer=L, n_head=H, d_model=C, checkpoint_activations=checkpoint)
    engine_run(model, dtype, batches(V, B, T, 2))
    assert model.activation_bytes == gpt_activation_bytes(B, T, C, L, H, V, checkpoint)["total"]
    # float64 compute: 8 bytes an element
    m64 = G.GPT(vocab=V, seq_len=T, n_layer=L, n_head=H, d_model=C, dtype=F64, checkpoint_activations=checkpoint)
    layers = [(a, {k: v.astype(F64) for k, v in p.items()}) for a, p in m64.init_layers()]
    h, caches = batches(V, B, T, 1)[0][0], []
    for i, p in enumerate(p for _, p in layers):        # the driver's schedule, no engine
        h, c = m64.activations.forward(i, p, h)
        caches.append(c)
    _, dh, _ = m64.head(layers[0][1]["wte"], h, batches(V, B, T, 1)[0][1], 1.0, m64.workspace)
    for i in reversed(range(len(layers))):
        dh, _ = m64.activations.backward(i, layers[i][1], caches[i], dh)
    assert m64.activation_bytes == 8 * gpt_activation_elements(B, T, C, L, H, V, checkpoint)["total"]


def test_formula_by_hand():
    """The default GPT's micro-batch at N=2 (B=24, T=64, C=64, L=2, H=4, V=32), counted by hand."""
    n, C, A, V = 24 * 64, 64, 24 * 4 * 64 * 64, 32
    block = 16 * n * C + 4 * n + A
    plain = 2 * block + 2 * 2 * n * C + 10 * n * C + A + 2 * n * C + 2 * n + n * C + 2 * n * V + n * C + n * V
    ckpt = block + 2 * n * C + 2 * 2 * n * C + 10 * n * C + A + 2 * n * C + 2 * n + n * C + 2 * n * V + n * C + n * V
    assert gpt_activation_bytes(24, 64, 64, 2, 4, 32)["total"] == 4 * plain == 25_030_656
    assert gpt_activation_bytes(24, 64, 64, 2, 4, 32, checkpoint=True)["total"] == 4 * ckpt
    # checkpointing saves (L - 1) blocks' buffers less one output per block, and two input gradients past 2 blocks
    big = [gpt_activation_bytes(4, 512, 256, 6, 8, 256, c)["total"] for c in (False, True)]
    assert big[1] < big[0] / 3


@needs_c
@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_counted_bytes_are_allocated(checkpoint):
    """NumPy's heap (tracemalloc): the bytes one micro-batch allocates grow with the batch as the counted
    activation bytes do, up to what is not counted (NumPy's temporaries inside a call: at most one n x C array
    and a few values per row). Doubling B doubles every batch-sized array and leaves the others."""
    def growth(B, T=32, C=48, L=3, H=4, V=29):
        model = G.GPT(vocab=V, seq_len=T, n_layer=L, n_head=H, d_model=C, seed=1, checkpoint_activations=checkpoint)
        eng = ZeroEngine(model.init_layers(), ZeroConfig(stage=0, dtype="fp32", bucket_mb=1e-2))
        (idx, targets), = batches(V, B, T, 1)
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            run_micro_batch(eng, model, idx, targets)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
            eng.close()
        return peak, model.activation_bytes

    (heap1, counted1), (heap2, counted2) = growth(6), growth(12)
    extra_rows = 6 * 32
    assert counted2 - counted1 > 0.9 * counted1          # nearly all of it is batch-sized
    uncounted = (heap2 - heap1) - (counted2 - counted1)
    assert 0 <= uncounted <= extra_rows * (2 * 4 * 48 + 64), uncounted


def test_numpy_path_is_not_measured():
    model = G.GPT(**SHAPE, kernels="numpy")
    engine_run(model, "fp32", batches(13, 2, 6, 1))
    assert model.activation_bytes is None


def test_mlp_refuses_checkpointing():
    with pytest.raises(ConfigError, match="^checkpoint_activations=True applies to model gpt only; "
                                          "drop --checkpoint-activations"):
        TrainConfig(model="mlp", checkpoint_activations=True)
    with pytest.raises(ConfigError, match="applies to model gpt only"):
        parse_config(["--model", "mlp", "--checkpoint-activations"])
    assert parse_config(["--checkpoint-activations"]).checkpoint_activations is True
    assert parse_config([]).checkpoint_activations is False


def test_mlp_with_the_flag_is_one_line_exit_2():
    proc = run_mpi(2, ["-m", "zerompi.train", "--model", "mlp", "--steps", "1", "--checkpoint-activations"],
                   timeout=60, check=False)
    lines = zerompi_lines(proc.stderr)     # zerompi's own lines: a launcher may add its banner
    no_python_noise(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("zerompi.train: error") and "--checkpoint-activations" in lines[0], lines[0]
    assert "gpt only" in lines[0] and "step " not in proc.stdout


# ---- the train job: stages 0-3 at N = 1, 2, 3 ---------------------------------------------
GPT_FLAGS = ["--model", "gpt", "--n-layer", "3", "--n-head", "2", "--d-model", "16", "--seq-len", "8",
             "--batch", "12", "--lr", "3e-3", "--bucket-mb", "0.004", "--log-every", "100", "--steps", "3",
             "--eval-every", "2"]
VARIANTS = [["--dtype", "fp32"], ["--dtype", "fp16", "--micro-batches", "2"]]


@pytest.fixture(scope="module", params=[1, 2, 3])
def runs(request):
    n = request.param
    configs = [GPT_FLAGS + v + ["--stage", str(s)] + c
               for v in VARIANTS for s in range(4) for c in ([], ["--checkpoint-activations"])]
    proc = run_mpi(n, ["tests/drivers/train_many.py", json.dumps(configs)], timeout=400)
    out = [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("METRICS ")]
    assert len(out) == len(configs)
    return n, out


def test_train_checkpointing_is_bit_identical_at_every_stage(runs):
    n, out = runs
    groups = {}
    for m in out:
        groups.setdefault(m["dtype"], []).append(m)
    for dtype, ms in groups.items():
        assert {(m["stage"], m["config"]["checkpoint_activations"]) for m in ms} == \
            {(s, c) for s in range(4) for c in (False, True)}
        for m in ms:
            for key in ("final_params_sha256", "losses", "val_losses"):
                assert m[key] == ms[0][key], (n, dtype, m["stage"], m["config"]["checkpoint_activations"], key)
    assert groups["fp32"][0]["final_params_sha256"] != groups["fp16"][0]["final_params_sha256"]


def test_train_activation_bytes_equal_the_formula(runs):
    n, out = runs
    for m in out:
        rows = 12 // (n * m["config"]["zero"]["micro_batches"])
        ckpt = m["config"]["checkpoint_activations"]
        want = gpt_activation_bytes(rows, 8, 16, 3, 2, 32, ckpt)["total"]
        assert m["activation_bytes"] == m["activation_theory_bytes"] == want, (n, m["flags"])
    by = {(m["stage"], m["dtype"], m["config"]["checkpoint_activations"]): m["activation_bytes"] for m in out}
    assert all(by[s, d, True] < by[s, d, False] for s, d, _ in by)
