"""The MLP's teacher data: each rank's rows are the global batch's rows, bit for bit, at any split and
batch size; the inputs are one generator's draws per step; the targets are a float64 teacher's to
float32 rounding; a rank computes only the blocks that hold its rows."""
import numpy as np
import pytest

from zerompi.train.data import rank_rows
from zerompi.train.models.mlp import TEACHER_BLOCK, MLP, TeacherData, init_mlp

W, D, SEED = 24, 3, 5


@pytest.fixture(scope="module")
def data():
    return TeacherData(W, D, SEED)


@pytest.mark.parametrize("batch", [1, 12, 16, 37, 64])
def test_rows_of_any_split_are_the_global_rows(data, batch):
    x, y = data.global_batch(4, batch)
    assert x.shape == y.shape == (batch, W) and x.dtype == y.dtype == np.float32
    for n in (1, 2, 3, 4, 5):
        parts = [data.rows(4, rank_rows(batch, r, n)) for r in range(n)]
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)
    wider = data.global_batch(4, batch + 21)                  # a larger batch starts with the same rows
    np.testing.assert_array_equal(wider[0][:batch], x)
    np.testing.assert_array_equal(wider[1][:batch], y)
    assert not np.array_equal(data.global_batch(5, batch)[0], x)


def test_inputs_and_targets_against_an_independent_float64_teacher(data):
    batch = 40
    x, y = data.global_batch(7, batch)
    want_x = np.random.default_rng([SEED, 7]).standard_normal((batch, W))   # one generator per step, row after row
    np.testing.assert_array_equal(x, want_x.astype(np.float32))
    rng = np.random.default_rng(SEED + 7)
    h = x.astype(np.float64)
    for i, (_, p) in enumerate(init_mlp(W, D, SEED + 1_000_003)):
        h = h @ p[f"block{i}.weight"].astype(np.float64) + rng.standard_normal(W) * 0.1
        if i < D - 1:
            h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
    err = np.abs(y - h).max() / np.abs(h).max()
    assert 0 < err < 1e-5, err                  # float32, not float64, and no further than its rounding


def test_a_rank_computes_only_the_blocks_of_its_rows(data, monkeypatch):
    seen = []
    real = data._targets
    monkeypatch.setattr(data, "_targets", lambda x: seen.append(len(x)) or real(x))
    data.rows(0, range(3 * TEACHER_BLOCK + 2, 4 * TEACHER_BLOCK + 1))       # in blocks 3 and 4
    data.rows(0, range(2 * TEACHER_BLOCK, 3 * TEACHER_BLOCK))                # exactly block 2
    assert seen == [2 * TEACHER_BLOCK, TEACHER_BLOCK]
    x, y = data.rows(0, range(0))
    assert x.shape == y.shape == (0, W)


def test_first_layer_makes_no_input_gradient():
    model = MLP(8, 2, seed=1)
    params = [p for _, p in model.init_layers()]
    x = np.ones((3, 8), np.float32)
    h, c0 = model.forward_layer(0, params[0], x)
    _, c1 = model.forward_layer(1, params[1], h)
    dh, _ = model.backward_layer(1, params[1], c1, np.ones((3, 8), np.float32))
    assert dh.shape == (3, 8)
    dx, grads = model.backward_layer(0, params[0], c0, dh)
    assert dx is None and sorted(grads) == ["block0.bias", "block0.weight"]
