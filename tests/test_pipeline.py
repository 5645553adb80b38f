"""Pipeline parallelism (--pp): the same bits as without it, and every byte where its formula says.

The oracle is the unpipelined run (itself tested against float64 NumPy elsewhere) on the same global
batch and micro-batches at the same data-parallel (and TP) size: the final parameter hash, every loss
and every held-out loss must be equal, for every schedule and ZeRO stage, fp32 and fp16 (with
loss-scale skips and clipping), dp x pp and dp x tp x pp. Where a choice cannot give the same bits
(--pp-grad-reduce step), the measured difference is held to a stated tolerance.
Several runs share one mpiexec launch (tests/drivers/train_many.py).
"""
import json

import pytest

from tests.mpirun import ROOT, run_mpi

DRIVER = ROOT / "tests" / "drivers" / "train_many.py"
GPT = ["--model", "gpt", "--n-layer", "4", "--d-model", "32", "--n-head", "4", "--seq-len", "16", "--batch", "8",
       "--eval-every", "2", "--micro-batches", "4", "--bucket-mb", "0.01", "--log-every", "1000"]
MLP = ["--model", "mlp", "--width", "16", "--depth", "4", "--batch", "16", "--micro-batches", "4", "--bucket-mb",
       "0.002", "--log-every", "1000"]
FP32 = ["--dtype", "fp32", "--clip", "0.5", "--steps", "3"]
# fp16: loss scale 2^18 overflows in some steps (skipped on every rank), the norm ~1.5 is clipped to 0.5.
FP16 = ["--dtype", "fp16", "--loss-scale", "262144", "--loss-scale-window", "2", "--clip", "0.5", "--steps", "5"]
SCHEDULES = {"gpipe": ["--schedule", "gpipe"], "1f1b": ["--schedule", "1f1b"], "zb-h1": ["--schedule", "zb-h1"],
             "interleaved": ["--schedule", "interleaved", "--chunks", "2"]}
STAGES = ("0", "1", "2", "3")


def launch(n, configs, timeout=600):
    out = run_mpi(n, [DRIVER, json.dumps(configs)], timeout=timeout).stdout
    runs = [json.loads(line[8:]) for line in out.splitlines() if line.startswith("METRICS ")]
    assert len(runs) == len(configs)
    return runs


def key(flags):
    return tuple(flags)


@pytest.fixture(scope="module")
def reference():
    """Without --pp: 2 data-parallel ranks (GPT fp32 and fp16, every stage; the MLP)."""
    configs = [GPT + prec + ["--stage", s] for prec in (FP32, FP16) for s in STAGES] + [MLP + FP32 + ["--stage", "2"]]
    return {key(c): m for c, m in zip(configs, launch(2, configs))}


@pytest.fixture(scope="module")
def dp_pp():
    """--pp 2 on 4 ranks (2 data-parallel x 2 stages): every schedule x stage in fp32 and fp16; the MLP; and
    the references of the dp x tp x pp runs (2 data-parallel x 2 TP, no pipeline)."""
    configs = [GPT + prec + ["--stage", s, "--pp", "2"] + SCHEDULES[name] for prec in (FP32, FP16)
               for name in SCHEDULES for s in STAGES]
    configs += [MLP + FP32 + ["--stage", "2", "--pp", "2"] + SCHEDULES[name] for name in ("1f1b", "zb-h1")]
    configs += [GPT + FP32 + ["--stage", s, "--tp", "2"] for s in ("1", "3")]
    return {key(c): m for c, m in zip(configs, launch(4, configs))}


def same(a, b):
    return (a["final_params_sha256"], a["losses"], a.get("val_losses")) == \
           (b["final_params_sha256"], b["losses"], b.get("val_losses"))


@pytest.mark.parametrize("prec", ["fp32", "fp16"])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_and_stage_gives_the_unpipelined_bits(reference, dp_pp, prec, name):
    p = FP32 if prec == "fp32" else FP16
    for s in STAGES:
        ref = reference[key(GPT + p + ["--stage", s])]
        run = dp_pp[key(GPT + p + ["--stage", s, "--pp", "2"] + SCHEDULES[name])]
        assert same(run, ref), (name, prec, s, run["losses"], ref["losses"])
        if prec == "fp16":      # steps were skipped, the same ones
            assert run["steps_applied"] == ref["steps_applied"] < 5
        assert run["world_size"] == 4 and run["pipeline"]["pp"] == 2 and run["pipeline"]["dp"] == 2


def test_the_mlp_too(reference, dp_pp):
    ref = reference[key(MLP + FP32 + ["--stage", "2"])]
    for name in ("1f1b", "zb-h1"):
        assert same(dp_pp[key(MLP + FP32 + ["--stage", "2", "--pp", "2"] + SCHEDULES[name])], ref)


def test_bytes_and_memory_equal_their_formulas(dp_pp):
    """Point-to-point bytes per stage per step by kind, model states per rank, the GPT's activation bytes."""
    for flags, m in dp_pp.items():
        if "--pp" not in flags:
            continue
        assert m["pp_bytes_per_step"] == m["pp_theory_bytes_per_step"], flags
        # theory_bytes(_padded): the one schema's tables by key, as an unpipelined run's (once a total only)
        assert m["memory_bytes"]["total"] == m["theory_bytes_padded"]["total"] >= m["theory_bytes"]["total"] > 0, flags
        if m["model"] == "gpt":
            assert m["activation_bytes"] == m["activation_theory_bytes"] > 0, flags
            assert set(m["pp_bytes_per_step"]) == {"activations", "activation gradients", "tied weight"}
        assert 0 <= m["bubble_fraction"] <= 1 and 0 <= m["bubble_fraction_schedule"] <= 1
        if "fp32" in flags:     # ZeRO's traffic (fp16 here skips steps, and a skipped step publishes nothing)
            if "3" != flags[flags.index("--stage") + 1]:
                assert m["comm_bytes_per_step"] == m["comm_theory_bytes_per_step"], flags
            else:               # stage 3: between the unpipelined turns' savings and none kept at a turn
                assert m["comm_theory_bytes_per_step"] <= m["comm_bytes_per_step"] <= m["comm_most_bytes_per_step"]
    # rows 8 / dp 2 / m 4 = 1 sequence of 16 tokens x 32 channels x 4 bytes = 2 KiB per message, 4 per step;
    # the tied weight: 32 x 32 values, its fp32 value once from stage 0, the head's gradient per micro-batch back.
    m = dp_pp[key(GPT + FP32 + ["--stage", "1", "--pp", "2"] + SCHEDULES["1f1b"])]
    assert m["pp_bytes_per_step"] == {"activations": [8192, 0], "activation gradients": [0, 8192],
                                      "tied weight": [4096, 4 * 4096]}


@pytest.fixture(scope="module")
def dp_tp_pp():
    configs = [GPT + FP32 + ["--stage", s, "--tp", "2", "--pp", "2"] + SCHEDULES[name]
               for s, name in (("1", "1f1b"), ("3", "zb-h1"), ("3", "interleaved"))]
    return {key(c): m for c, m in zip(configs, launch(8, configs))}


def test_dp_x_tp_x_pp_gives_the_bits_of_dp_x_tp(dp_pp, dp_tp_pp):
    for flags, run in dp_tp_pp.items():
        s = flags[flags.index("--stage") + 1]
        ref = dp_pp[key(GPT + FP32 + ["--stage", s, "--tp", "2"])]
        assert same(run, ref), flags
        assert run["pipeline"] == run["pipeline"] | {"pp": 2, "dp": 2, "tp": 2}
        assert run["tensor_parallel"]["bytes_per_step"] > 0   # the one schema's TP entry
