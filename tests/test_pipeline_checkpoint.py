"""Activation checkpointing inside pipeline stages (--checkpoint-activations with --pp): the bits of the run without
--pp, the activations at their formula, and fewer of them.

The oracle is the same checkpointed run without --pp on 2 ranks (itself tested against the run without
checkpointing and float64, tests/test_activations.py): 2 data-parallel ranks, or 2 sequence-parallel ones with
--sp 2, the pipelined runs adding 2 stages. A recomputing block keeps its input only; the micro-batches in flight
share one recompute set per chunk (models/chunks.py). With sequence parallelism the recompute repeats the
forward's all-to-alls (3 passes). ZB-H1's split backward cannot recompute (its W reads what a recomputing block
drops): refused in one line.
"""
import pytest

from tests.mpirun import one_line, run_mpi
from tests.test_pipeline import FP16, FP32, GPT, SCHEDULES, key, launch, same

CKPT = ["--checkpoint-activations"]
RUNS = [("gpipe", "1", FP32, []), ("1f1b", "3", FP32, []), ("interleaved", "2", FP16, []),
        ("1f1b", "2", FP32, ["--sp", "2"])]
IDS = [f"{n}-stage{s}{'-sp2' if e else ''}" for n, s, _, e in RUNS]


def ref_flags(stage, p, extra):
    return GPT + p + CKPT + ["--stage", stage] + extra


def piped_flags(name, stage, p, extra, ckpt=True):
    return GPT + p + (CKPT if ckpt else []) + ["--stage", stage, "--pp", "2"] + SCHEDULES[name] + extra


@pytest.fixture(scope="module")
def runs():
    refs = [ref_flags(s, p, e) for _, s, p, e in RUNS]
    piped = [piped_flags(n, s, p, e, ckpt) for n, s, p, e in RUNS for ckpt in (True, False)]
    out = {key(c): m for c, m in zip(refs, launch(2, refs))}
    out.update({key(c): m for c, m in zip(piped, launch(4, piped))})
    return out


@pytest.mark.parametrize("name,stage,p,extra", RUNS, ids=IDS)
def test_checkpointed_stages_give_the_bits_of_the_checkpointed_run(runs, name, stage, p, extra):
    ref, run = runs[key(ref_flags(stage, p, extra))], runs[key(piped_flags(name, stage, p, extra))]
    kept = runs[key(piped_flags(name, stage, p, extra, ckpt=False))]
    assert same(run, ref), (name, stage, run["losses"], ref["losses"])
    assert same(kept, run)                         # recomputing changes no bit
    assert run["activation_bytes"] == run["activation_theory_bytes"] < kept["activation_bytes"]
    assert kept["activation_bytes"] == kept["activation_theory_bytes"]
    if extra:                                      # the recompute's all-to-alls: 3 passes of the 2
        sp, kept_sp = run["sequence_parallel"], kept["sequence_parallel"]   # the one schema's SP entry
        assert sp["bytes_per_step"] == sp["theory_bytes_per_step"] == kept_sp["bytes_per_step"] * 3 // 2


def test_a_split_backward_with_checkpointing_is_one_line_and_exit_2():
    proc = run_mpi(4, ["-m", "zerompi.train", "--pp", "2", "--schedule", "zb-h1", "--micro-batches", "2",
                       "--checkpoint-activations", "--steps", "1"], check=False, timeout=120)
    one_line(proc, 2, "checkpoint_activations=True is not available with the zb-h1 schedule")
