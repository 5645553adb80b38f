"""The MoE GPT on the engine: stages 0-3 bit-identical at N=2 and N=3 (fp32 and fp16, dropless and with a
capacity, micro-batches and clipping), and N=2 and N=3 fp32 against a float64 training of the same shares
(the model's float64 gradients, tests/test_moe_model.py's finite differences vouch for them)."""
import json

import numpy as np
import pytest

from tests.mpirun import run_mpi, run_train
from zerompi.train.data import GeneratedData, rank_rows
from zerompi.train.models.gpt import GPT
from zerompi.train.moe.mlp import MoESpec

SIZES = dict(n_layer=2, n_head=2, d_model=16, seq_len=8)
MOE = dict(experts=4, top_k=2, hidden=24)


def float64_mean_grads(shares: int, shared: int = 0) -> dict:
    """The first step's gradient of the MoE GPT of SIZES and MOE in float64, one process: the mean over the
    ``shares`` data-parallel shares of batch 12, each routed on its own (the gradient-norm tests' reference;
    ``shared``: with that many shared experts)."""
    data = GeneratedData(SIZES["seq_len"], 0)
    spec = MoESpec(MOE["experts"], MOE["top_k"], MOE["hidden"], 1, None, 0.01, shared=shared)
    model = GPT(data.vocab, seed=0, dtype=np.float64, moe=spec, **SIZES)
    layers = [(a, {k: v.astype(np.float64) for k, v in p.items()}) for a, p in model.init_layers()]
    total = {}
    for share in range(shares):
        rows = data.train_rows(0, rank_rows(12, share, shares))
        _, g = model.loss_and_grads(layers, rows[:, :-1], rows[:, 1:])
        for k, v in g.items():
            total[k] = total.get(k, 0) + v / shares
    return total
FLAGS = ["--model", "gpt", "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--seq-len", "8",
         "--batch", "12", "--lr", "3e-3", "--bucket-mb", "0.004", "--log-every", "100",
         "--experts", "4", "--top-k", "2", "--expert-hidden", "24"]
BASE = FLAGS + ["--steps", "3", "--eval-every", "3"]
OPTIONS = {"dropless": ["--clip", "0.5", "--micro-batches", "2"], "capacity": ["--capacity-factor", "0.8"]}


def run_all(n):
    configs = [BASE + ["--dtype", dtype, "--stage", str(stage)] + opt
               for dtype in ("fp32", "fp16") for opt in OPTIONS.values() for stage in range(4)]
    proc = run_mpi(n, ["tests/drivers/train_many.py", json.dumps(configs)], timeout=300)
    return [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("METRICS ")]


@pytest.fixture(scope="module")
def runs():
    out = {}
    for n in (2, 3):
        out[n] = run_all(n)
        assert len(out[n]) == 16
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_stages_bit_identical(runs, n):
    groups = {}
    for m in runs[n]:
        key = (m["dtype"], m["moe"]["capacity_factor"])
        groups.setdefault(key, {})[m["stage"]] = m
    assert len(groups) == 4
    for key, by_stage in groups.items():
        assert sorted(by_stage) == [0, 1, 2, 3]
        first = by_stage[0]
        for stage, m in by_stage.items():
            assert m["final_params_sha256"] == first["final_params_sha256"], (n, key, stage)
            assert m["losses"] == first["losses"] and m["val_losses"] == first["val_losses"], (n, key, stage)
            assert m["moe"] == first["moe"], (n, key, stage)
        moe = first["moe"]
        assert len(moe["aux_loss"]) == 3 and all(a >= 1.0 - 1e-9 for a in moe["aux_loss"])   # E·Σf·p >= 1 ... ~1
        assert all(d > 0 for d in moe["dropped"]) == (key[1] is not None)
        if key[1] is None:     # dropless: every assignment kept, 12 x 8 tokens x top-2 per block per step
            assert [round(t * 4) for t in moe["tokens_mean"]] == [12 * 8 * 2] * 3
    assert len({next(iter(g.values()))["final_params_sha256"] for g in groups.values()}) == 4


def reference_training(n, steps, batch, lr, micro=1, capacity=None, seed=0, beta1=0.9, beta2=0.999, eps=1e-8):
    """The same training in one process, float64: each of the n shares' micro-batches routed on its own (the
    capacity and the aux loss are per micro-batch), their gradients averaged, AdamW."""
    data = GeneratedData(SIZES["seq_len"], seed)
    spec = MoESpec(MOE["experts"], MOE["top_k"], MOE["hidden"], 1, capacity, 0.01)
    model = GPT(data.vocab, seed=seed, dtype=np.float64, moe=spec, **SIZES)
    layers = [(a, {k: v.astype(np.float64) for k, v in p.items()}) for a, p in model.init_layers()]
    flat = {k: v for _, p in layers for k, v in p.items()}
    m = {k: np.zeros_like(v) for k, v in flat.items()}
    v2 = {k: np.zeros_like(v) for k, v in flat.items()}
    losses = []
    for t in range(1, steps + 1):
        grads = {k: np.zeros_like(v) for k, v in flat.items()}
        total = 0.0
        for share in range(n):
            rows = data.train_rows(t - 1, rank_rows(batch, share, n))
            per = len(rows) // micro
            for k in range(micro):
                r = rows[k * per:(k + 1) * per]
                loss, g = model.loss_and_grads(layers, r[:, :-1], r[:, 1:])
                total += loss / (n * micro)
                for name in grads:
                    grads[name] += g[name] / (n * micro)
        losses.append(total)
        for k, p in flat.items():
            m[k] = beta1 * m[k] + (1 - beta1) * grads[k]
            v2[k] = beta2 * v2[k] + (1 - beta2) * grads[k] ** 2
            p -= lr * (m[k] / (1 - beta1 ** t)) / (np.sqrt(v2[k] / (1 - beta2 ** t)) + eps)
    return losses


@pytest.mark.parametrize("n,extra", [(2, []), (3, ["--micro-batches", "2", "--capacity-factor", "1.0"])])
def test_matches_float64_reference(tmp_path, n, extra):
    """fp32 storage, stage 3, against float64: the losses of 4 steps (relative differences measured ~1e-8)."""
    got = run_train(n, tmp_path, *FLAGS, "--steps", "4", "--eval-every", "0", "--stage", "3", "--dtype", "fp32",
                    *extra, timeout=180)
    micro = 2 if extra else 1
    want = reference_training(n, 4, 12, 3e-3, micro=micro, capacity=1.0 if extra else None)
    np.testing.assert_allclose(got["losses"], want, rtol=1e-6)
    assert got["losses"][-1] < got["losses"][0] - 0.05


def test_resume_at_ep_1_is_the_straight_run(tmp_path):
    """--ep 1: the experts are parameters of the one engine: saved at step 2 (stage 1), resumed at stage 3 to step 4,
    the straight run's bits."""
    flags = FLAGS + ["--steps", "4", "--eval-every", "0", "--dtype", "fp32", "--capacity-factor", "1.0"]
    straight = run_train(2, tmp_path, *flags, "--stage", "1", "--save-dir", tmp_path / "ck", "--save-every", "2",
                         tag="a")
    resumed = run_train(2, tmp_path, *flags, "--stage", "3", "--resume", tmp_path / "ck" / "step_000002", tag="b")
    assert resumed["final_params_sha256"] == straight["final_params_sha256"]
    assert resumed["losses"] == straight["losses"][2:]
