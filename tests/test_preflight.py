"""The train CLI's pre-launch memory check (train/preflight.py) under --tp: its per-rank layers against
the TP models' own pieces, its model states against what TP runs measure, and a job that fits only
thanks to the split is let through (where the estimate without TP would refuse it). With --pp, each rank's
own stage: against what a simulated rank of that stage measures, and a stage too big refused in one line."""
import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from tests.mpirun import ROOT, mpi_env, one_line, run_mpi
from zerompi.estimate import machine
from zerompi.estimate.activations import gpt_activation_bytes
from zerompi.estimate.tp_bytes import gpt_tp
from zerompi.train import preflight
from zerompi.train.config import parse_config
from zerompi.train.models.gpt import GPT as GPTModel
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
        net = GPTModel(32, 16, 2, 4, 32, tp=tp) if model == "gpt" else TPMLP(32, 4, tp=tp)
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


def test_tp_activations_and_init_parts():
    """The GPT's activations on the CPU, by their formula: with --tp K a TP rank's (n_head/K heads, 1/K of the
    split layers' arrays, of batch/(N/K) sequences), less than without TP; no initial parameters (the models
    are lazy: no rank makes them whole); the MLP's teacher, whole."""
    flags = ["--model", "gpt", "--n-layer", "2", "--d-model", "32", "--n-head", "4", "--seq-len", "512",
             "--batch", "8", "--eval-every", "0"]
    for k in (2, 4):
        parts = preflight.memory_needed(parse_config(flags + ["--tp", str(k)]), 4)
        dp = 4 // k
        assert parts["activations"] == gpt_activation_bytes(8 // dp, 512, 32, 2, 4, 32, tp=k)["total"]
        assert parts["activations"] < gpt_activation_bytes(8 // dp, 512, 32, 2, 4, 32)["total"]
    whole = preflight.memory_needed(parse_config(flags), 4)["activations"]
    assert whole == gpt_activation_bytes(2, 512, 32, 2, 4, 32)["total"] > 4 * 2 * 2 * 4 * 512 ** 2
    small = parse_config(GPT + ["--tp", "2"])
    assert list(preflight.memory_needed(small, 4)) == ["model states and buffers", "activations"]
    full = sum(preflight.layer_sizes(small))
    assert full == sum(np.prod(a.shape) for _, p in GPTModel(32, 16, 2, 4, 32, tp=SimpleNamespace(rank=0, size=1))
                       .init_layers() for a in p.values())
    mlp = parse_config(["--model", "mlp", "--width", "64", "--depth", "2"])
    assert preflight.memory_needed(mlp, 4)["teacher network (float32)"] == 4 * 2 * (64 * 64 + 64)


# ---- pipeline stages: each rank checks its own stage's chunks ------------------------------------------
PIPELINED = [  # (world, rank, flags): the simulated rank's ledger, buffers and activations are the oracle
    (8, 1, ["--pp", "2", "--stage", "1"]),
    (8, 6, ["--pp", "2", "--stage", "3", "--schedule", "zb-h1", "--dtype", "bf16"]),
    (8, 5, ["--pp", "4", "--chunks", "2", "--schedule", "interleaved", "--stage", "2", "--micro-batches", "4",
            "--n-layer", "8"]),
    (8, 3, ["--pp", "2", "--tp", "2", "--stage", "0", "--dtype", "fp32"]),
    (8, 5, ["--pp", "2", "--sp", "2", "--stage", "2", "--schedule", "zb-h1"]),
]


@pytest.mark.parametrize("world,rank,flags", PIPELINED)
def test_pipeline_preflight_is_the_ranks_own_stage(tmp_path, world, rank, flags):
    argv = GPT + ["--n-layer", "4", "--micro-batches", "2", "--batch", "16", "--steps", "2", *flags]
    out = tmp_path / "m.json"
    run_sim = ["--simulate-world", str(world), "--simulate-rank", str(rank), "--metrics-json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "zerompi.train", *argv, *run_sim], capture_output=True, text=True,
                          timeout=240, env=mpi_env(), cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    m = json.loads(out.read_text())
    cfg = parse_config(argv)
    row = preflight.pipeline_estimate(cfg, world, rank)
    assert row["model_state_bytes"] == m["memory_bytes"]["total"]
    # The preflight's "at least": the best case's buffers; the rank (its stand-ins arrive when it waits, as a real
    # rank's pending reductions do) holds that or more, up to the cap's row.
    assert row["buffer_bytes_best_case"] <= m["peak_buffer_bytes"] <= row["buffer_bytes"]
    parts = preflight.memory_needed(cfg, world, rank)
    assert parts["model states and buffers"] == m["memory_bytes"]["total"] + row["buffer_bytes_best_case"]
    assert parts["activations"] == m["activation_bytes"]     # with --tp too: its C kernels, measured


def test_a_pipeline_stage_that_cannot_fit_is_one_line_naming_the_rank(monkeypatch):
    cfg = parse_config(GPT + ["--n-layer", "4", "--pp", "2", "--micro-batches", "2", "--stage", "0"])
    need = [sum(preflight.memory_needed(cfg, 4, r).values()) for r in range(4)]
    assert need[0] == need[1] != need[2] == need[3]           # the two stages hold other layers
    have = min(need)
    monkeypatch.setattr(machine, "available_per_rank", lambda placement: (have, "a test's share"))
    big = max(range(4), key=lambda r: need[r])
    assert preflight.memory_error(cfg, 4, None, min(range(4), key=lambda r: need[r])) is None
    line = preflight.memory_error(cfg, 4, None, big)
    assert line and "\n" not in line and f"rank {big}'s stage {big // 2}" in line and "2 pipeline stages" in line
    assert "more --pp stages" in line


def test_the_cli_refuses_a_pipeline_stage_too_big_for_here():
    proc = subprocess.run([sys.executable, "-m", "zerompi.train", "--simulate-world", "2", "--simulate-rank", "1",
                           "--pp", "2", "--n-layer", "2", "--d-model", "16384", "--n-head", "8", "--micro-batches", "2",
                           "--stage", "0", "--steps", "1"], capture_output=True, text=True, timeout=120, env=mpi_env(),
                          cwd=str(ROOT))
    one_line(proc, 2, "the job needs at least", "rank 1's stage 1", "2 pipeline stages")
