"""The train CLI's pre-launch memory check (train/preflight.py) under --tp: its per-rank layers against
the TP models' own pieces, its model states against what TP runs measure, and a job that fits only
thanks to the split is let through (where the estimate without TP would refuse it)."""
import json
from types import SimpleNamespace

import numpy as np
import pytest

from tests.mpirun import run_mpi
from zerompi.estimate import machine
from zerompi.estimate.tensor import gpt_tp
from zerompi.train import preflight
from zerompi.train.config import parse_config
from zerompi.train.models.gpt_tp import TPGPT
from zerompi.train.models.mlp_tp import TPMLP

GPT = ["--model", "gpt", "--n-layer", "2", "--d-model", "32", "--n-head", "4", "--seq-len", "16", "--batch", "8",
       "--eval-every", "0"]
MLP = ["--model", "mlp", "--width", "32", "--depth", "4", "--batch", "16"]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_layer_sizes_are_the_tp_models_pieces(model, k):
    """Oracle: the arrays each TP rank's model starts from (init_layers cuts the full model's)."""
    cfg = parse_config((GPT if model == "gpt" else MLP) + ["--tp", str(k)])
    for rank in range(k):
        tp = SimpleNamespace(rank=rank, size=k)
        net = TPGPT(32, 16, 2, 4, 32, tp=tp) if model == "gpt" else TPMLP(32, 4, tp=tp)
        got = [sum(a.size for a in params.values()) for _, params in net.init_layers()]
        assert preflight.layer_sizes(cfg, k) == got, (model, k, rank)
    if model == "gpt":     # the estimator's split of the same dimensions (vocab 32: the generated corpus)
        assert sum(preflight.layer_sizes(cfg, k)) == gpt_tp(k, 4, 2, 32, 32, 16, 8)["params_local"]


RUNS = [GPT + ["--stage", s, "--tp", t, "--dtype", d, "--bucket-mb", b, "--micro-batches", m]
        for s, t, d, b, m in [("0", "2", "fp32", "0.02", "1"), ("1", "2", "fp16", "0.01", "2"),
                              ("2", "4", "fp32", "0.02", "1"), ("3", "2", "bf16", "0.005", "1"),
                              ("3", "1", "fp16", "0.02", "1")]]
RUNS += [MLP + ["--stage", s, "--tp", t, "--dtype", d, "--bucket-mb", "0.004"]
         for s, t, d in [("1", "2", "fp32"), ("2", "4", "fp16"), ("3", "2", "fp32"), ("0", "1", "fp32")]]


def test_preflight_model_states_equal_the_tp_runs_measured():
    configs = [flags + ["--steps", "2", "--log-every", "1000"] for flags in RUNS]
    proc = run_mpi(4, ["tests/drivers/train_many.py", json.dumps(configs)], timeout=600)
    results = [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("METRICS ")]
    assert len(results) == len(RUNS)
    for flags, m in zip(configs, results):
        row = preflight.stage_estimate(parse_config(flags), 4)
        got = {"params": row["params_bytes"], "grads": row["grads_bytes"], "optimizer": row["optimizer_bytes"],
               "total": row["model_state_bytes"]}
        assert got == m["memory_bytes"], (flags, got, m["memory_bytes"])
        tp = m.get("tensor_parallel")
        assert (tp["tp"] if tp else 1) == int(flags[flags.index("--tp") + 1])


def test_a_job_that_fits_only_with_the_split_is_let_through(monkeypatch):
    big = GPT[:4] + ["--d-model", "256", "--n-head", "4", "--seq-len", "16", "--batch", "8", "--eval-every", "0",
                     "--stage", "0", "--dtype", "fp32"]
    with_tp, without = parse_config(big + ["--tp", "4"]), parse_config(big)
    need_tp, need = (sum(preflight.memory_needed(c, 4).values()) for c in (with_tp, without))
    assert need_tp < need
    have = (need_tp + need) // 2
    monkeypatch.setattr(machine, "available_per_rank", lambda placement: (have, "a test's share"))
    assert preflight.memory_error(with_tp, 4, None) is None
    line = preflight.memory_error(without, 4, None)
    assert line and "\n" not in line and "the job needs at least" in line and "a test's share" in line
    monkeypatch.setattr(machine, "available_per_rank", lambda placement: (need_tp - 1, "a test's share"))
    line = preflight.memory_error(with_tp, 4, None)
    assert line and "1 data-parallel x 4 tensor-parallel" in line


def test_tp_attention_and_init_parts():
    """The GPT's attention probabilities: n_head/K heads of batch/(N/K) sequences per TP rank; no initial
    parameters (the models are lazy: no rank makes them whole); the MLP's teacher, whole."""
    flags = ["--model", "gpt", "--n-layer", "2", "--d-model", "32", "--n-head", "4", "--seq-len", "512",
             "--batch", "8", "--eval-every", "0"]
    for k in (1, 2, 4):
        parts = preflight.memory_needed(parse_config(flags + ["--tp", str(k)]), 4)
        dp = 4 // k
        assert parts["attention probabilities"] == 4 * 2 * (8 // dp) * (4 // k) * 512 ** 2
    small = parse_config(GPT + ["--tp", "2"])
    assert list(preflight.memory_needed(small, 4)) == ["model states and buffers", "attention probabilities"]
    full = sum(preflight.layer_sizes(small))
    assert full == sum(np.prod(a.shape) for _, p in TPGPT(32, 16, 2, 4, 32, tp=SimpleNamespace(rank=0, size=1))
                       .init_layers() for a in p.values())
    mlp = parse_config(["--model", "mlp", "--width", "64", "--depth", "2"])
    assert preflight.memory_needed(mlp, 4)["teacher network (float32)"] == 4 * 2 * (64 * 64 + 64)
