"""Pipeline stages of sequence-parallel ranks (--pp with --sp): the same bits as --sp alone, every byte at its formula.

The oracle is the run without --pp at the same sequence- and data-parallel sizes (itself tested against
the full GPT in float64, tests/test_sequence_parallel.py): the final parameter hash, every loss and every
held-out loss must be equal, for every schedule and ZeRO stage (fp32, and fp16 with loss-scale skips and
clipping), sp x pp and dp x sp x pp. The activations each rank holds, the SP all-to-all bytes and the
pipeline's messages per stage must equal their formulas; a checkpoint resumes to the same bits.
"""
import json

import pytest

from tests.mpirun import run_mpi
from tests.test_pipeline import FP16, FP32, SCHEDULES, key, launch, same

GPT = ["--model", "gpt", "--n-layer", "4", "--d-model", "32", "--n-head", "4", "--seq-len", "16", "--batch", "8",
       "--eval-every", "2", "--micro-batches", "4", "--bucket-mb", "0.01", "--log-every", "1000", "--sp", "2"]
RUNS = [("gpipe", "0", FP32), ("1f1b", "1", FP32), ("zb-h1", "3", FP32), ("interleaved", "2", FP32),
        ("1f1b", "3", FP16), ("zb-h1", "2", FP16), ("interleaved", "3", FP16)]


def prec(p):
    return "fp32" if p is FP32 else "fp16"


@pytest.fixture(scope="module")
def runs():
    """Without --pp on 2 ranks (sp 2), with --pp 2 on 4 (sp 2 x 2 stages)."""
    refs = sorted({(s, prec(p)) for _, s, p in RUNS})
    ref_configs = [GPT + (FP32 if pr == "fp32" else FP16) + ["--stage", s] for s, pr in refs]
    pp_configs = [GPT + p + ["--stage", s, "--pp", "2"] + SCHEDULES[name] for name, s, p in RUNS]
    out = {key(c): m for c, m in zip(ref_configs, launch(2, ref_configs))}
    out.update({key(c): m for c, m in zip(pp_configs, launch(4, pp_configs))})
    return out


@pytest.mark.parametrize("name,stage,p", RUNS, ids=[f"{n}-stage{s}-{prec(p)}" for n, s, p in RUNS])
def test_sequence_parallel_stages_give_the_bits_of_sp_alone(runs, name, stage, p):
    ref = runs[key(GPT + p + ["--stage", stage])]
    run = runs[key(GPT + p + ["--stage", stage, "--pp", "2"] + SCHEDULES[name])]
    assert same(run, ref), (name, stage, run["losses"], ref["losses"])
    assert run["steps_applied"] == ref["steps_applied"] and run["params"] == ref["params"]
    if p is FP16:
        assert run["steps_applied"] < 5                 # some steps were skipped, the same ones
    assert (run["pipeline"]["pp"], run["pipeline"]["sp"], run["pipeline"]["dp"]) == (2, 2, 1)
    assert run["activation_bytes"] == run["activation_theory_bytes"]
    sp = run["sequence_parallel"]                # the one schema: the SP facts where an unpipelined run has them
    assert sp["bytes_per_step"] == sp["theory_bytes_per_step"] > 0
    assert run["pp_bytes_per_step"] == run["pp_theory_bytes_per_step"]
    assert len(run["pp_bytes_per_step"]["activations"]) == 2          # one entry per stage


def test_data_and_sequence_parallel_stages_on_eight_ranks():
    """dp 2 x sp 2 x pp 2 against dp 2 x sp 2; tp 2 x sp 2 x pp 2 against tp 2 x sp 2 (TP's sums are its own)."""
    big = ["--batch", "16"]
    flags = [GPT + FP32 + big + ["--stage", "3", "--schedule", "1f1b"],
             GPT + FP32 + ["--n-head", "8", "--tp", "2", "--stage", "2", "--schedule", "zb-h1"]]
    refs = launch(4, [[a for a in f if a not in ("--schedule", "1f1b", "zb-h1")] for f in flags])
    piped = launch(8, [f + ["--pp", "2"] for f in flags], timeout=900)
    for ref, run in zip(refs, piped):
        assert same(run, ref), (run["losses"], ref["losses"])
        assert run["sequence_parallel"]["bytes_per_step"] == run["sequence_parallel"]["theory_bytes_per_step"] > 0
        assert run["pp_bytes_per_step"] == run["pp_theory_bytes_per_step"]
    assert piped[0]["pipeline"]["dp"] == 2 and piped[1]["pipeline"]["tp"] == 2


def test_a_sequence_parallel_pipeline_resumes_to_the_same_bits(tmp_path):
    """Saved after step 2 of 4 at sp 2 x pp 2, resumed there: the bits of the run that never stopped."""
    base = ["-m", "zerompi.train", *GPT, *FP32, "--pp", "2", "--stage", "2"]     # the last --steps counts
    whole, resumed = tmp_path / "whole.json", tmp_path / "resumed.json"
    run_mpi(4, [*base, "--steps", "4", "--metrics-json", whole], timeout=240)
    run_mpi(4, [*base, "--steps", "2", "--save-dir", tmp_path / "ck"], timeout=240)
    run_mpi(4, [*base, "--steps", "4", "--resume", tmp_path / "ck", "--metrics-json", resumed], timeout=240)
    a, b = (json.loads(p.read_text()) for p in (whole, resumed))
    assert a["final_params_sha256"] == b["final_params_sha256"] and a["losses"][-1] == b["losses"][-1]
