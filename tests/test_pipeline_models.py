"""The pieces a pipeline chunk is made of, in one process: the backward split into B (input gradient) and W
(weight gradient) gives the bits of the whole backward (the GPT on its C kernels and on plain NumPy, the
MLP); the chunks cover the model's layers; the per-step gradient accumulator sums and scales as documented."""
import numpy as np
import pytest

from zerompi.pipeline.grads import GradSink
from zerompi.train.models.chunks import chunk_layers
from zerompi.train.models.gpt import GPT
from zerompi.train.models.gpt_fast import Workspace
from zerompi.train.models.mlp import MLP


def gpt_case(kernels):
    model = GPT(vocab=32, seq_len=8, n_layer=3, n_head=2, d_model=16, seed=3, kernels=kernels)
    params = [p for _, p in model.init_layers()]
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 32, (2, 8))
    return model, params, idx, rng.integers(0, 32, (2, 8))


@pytest.mark.parametrize("kernels", ["c", "numpy"])
def test_split_backward_gives_the_whole_backwards_bits(kernels):
    """B for every layer (top first, as a split schedule runs them), then every W: the same input gradients and
    the same weight gradients, bit for bit, as backward_layer; each W reads only its own layer's buffers."""
    model, params, idx, targets = gpt_case(kernels)
    if kernels == "c" and model.layers.name != "c":
        pytest.skip("the GPT's C kernels cannot be built here")
    n = model.num_layers
    results = []
    for split in (False, True):
        ws = Workspace(persistent=True)
        h, caches = idx, []
        for i in range(n):
            h, c = model.forward_layer(i, params[i], h, ws)
            caches.append(c)
        _, dh, _ = model.head(params[0]["wte"], h, targets, 1.0, ws)
        grads, dxs, parts = {}, [], []
        for i in reversed(range(1, n)):
            if split:
                dh, part = model.backward_layer_parts(i, params[i], caches[i], dh, ws)
                parts.append(part)
            else:
                dh, g = model.backward_layer(i, params[i], caches[i], dh, ws)
                grads.update({k: v.copy() for k, v in g.items()})
            dxs.append(dh.copy())
        for part in parts:            # every W after every B: another block's B ran in between
            grads.update({k: v.copy() for k, v in part().items()})
        results.append((grads, dxs))
    (g0, d0), (g1, d1) = results
    assert sorted(g0) == sorted(g1) and len(g0) == 3 * 12 + 2
    for k in g0:
        assert np.array_equal(g0[k], g1[k]), k
    for a, b in zip(d0, d1):
        assert np.array_equal(a, b)


def test_mlp_split_backward():
    model = MLP(12, 3, seed=1)
    params = [p for _, p in model.init_layers()]
    x = np.random.default_rng(2).standard_normal((5, 12)).astype(np.float32)
    caches, h = [], x
    for i in range(3):
        h, c = model.forward_layer(i, params[i], h)
        caches.append(c)
    dy = np.ones_like(h)
    for i in reversed(range(3)):
        dx0, g0 = model.backward_layer(i, params[i], caches[i], dy)
        dx1, part = model.backward_layer_parts(i, params[i], caches[i], dy)
        g1 = part()
        assert (dx0 is None and dx1 is None) or np.array_equal(dx0, dx1)
        assert all(np.array_equal(g0[k], g1[k]) for k in g0)
        dy = dx0 if dx0 is not None else dy


def test_chunks_cover_the_model_in_order():
    # the GPT: embed (0), blocks 1..8, ln_f (9) in 4 chunks
    got = [chunk_layers(10, [0], [9], 8, c, 4) for c in range(4)]
    assert got == [[0, 1, 2], [3, 4], [5, 6], [7, 8, 9]]
    assert sum(got, []) == list(range(10))
    assert [chunk_layers(6, [], [], 6, c, 3) for c in range(3)] == [[0, 1], [2, 3], [4, 5]]


class FakeEngine:
    def __init__(self):
        self.got = []

    def grads_ready(self, layer, grads):
        self.got.append((layer, {k: v.copy() for k, v in grads.items()}))


def test_the_per_step_accumulator():
    """Megatron's pattern: the micro-batches summed in float32 in order, handed over once, divided by m."""
    e = FakeEngine()
    sink = GradSink(e, "step", 4)
    rng = np.random.default_rng(5)
    gs = [rng.standard_normal(6).astype(np.float32) for _ in range(4)]
    for g in gs:
        sink(0, {"w": g})
    assert len(e.got) == 1 and e.got[0][0] == 0
    want = ((gs[0] + gs[1]) + gs[2]) + gs[3]
    assert np.array_equal(e.got[0][1]["w"], want * np.float32(0.25))
    assert sink.peak_bytes == 24 and sink.bytes == 0
    e2 = FakeEngine()
    GradSink(e2, "micro-batch", 4)(1, {"w": gs[0]})
    assert len(e2.got) == 1 and np.array_equal(e2.got[0][1]["w"], gs[0])
