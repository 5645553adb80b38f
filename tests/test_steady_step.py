"""A steady step's figures leave out the run's first step (train/history.py), which can send more (stage 3 also
gathers for the step after it); a run of one step has no steady step, and says so instead of a number.

The oracle is the engine's traffic formula (engine/traffic.py, ``comm_theory_bytes_per_step``), which counts a
steady step, and the steps of a longer run of the same job."""
import json
import subprocess
import sys

import pytest

from zerompi.train.history import StepLog
from tests.mpirun import ROOT, mpi_env

GPT = ["--simulate-world", "4", "--stage", "3", "--batch", "8", "--eval-every", "0", "--progress", "lines",
       "--loss-scale", "256"]


def _run(tmp_path, steps, *flags):
    out = tmp_path / f"m{steps}.json"
    proc = subprocess.run([sys.executable, "-m", "zerompi.train", *GPT, *flags, "--steps", str(steps),
                           "--metrics-json", out], capture_output=True, text=True, timeout=240, env=mpi_env(),
                          cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_step_log_leaves_out_the_first_step():
    log = StepLog(0, {})
    log.record(1.0, 0.1, 10, {})
    assert log.steady_median(log.comm_bytes) is None and log.first_value(log.comm_bytes) == 10
    for sent in (4, 6, 4):
        log.record(1.0, 0.1, sent, {})
    assert log.steady_median(log.comm_bytes) == 4 and log.first_value(log.comm_bytes) == 10
    short = StepLog(0, {}, cap=2)                       # the first step no longer kept: every kept one is steady
    for sent in (10, 4, 6):
        short.record(1.0, 0.1, sent, {})
    assert short.steady(short.comm_bytes) == [4, 6] and short.first_value(short.comm_bytes) is None


def test_unpipelined_steady_step_is_the_formula_and_one_step_measures_none(tmp_path):
    one, said = _run(tmp_path, 1)
    assert one["comm_bytes_per_step"] is None and one["comm_bytes_per_step_by_level"] is None
    assert one["comm_bytes_first_step"] > one["comm_theory_bytes_per_step"]     # stage 3's first step sends more
    assert "no steady step was measured" in said
    for steps in (2, 3):
        m, said = _run(tmp_path, steps)
        assert m["comm_bytes_per_step"] == m["comm_theory_bytes_per_step"], steps
        assert sum(m["comm_bytes_per_step_by_op"].values()) == m["comm_theory_bytes_per_step"], steps
        assert sum(m["comm_bytes_per_step_by_level"].values()) == m["comm_theory_bytes_per_step"], steps
        assert m["comm_bytes_first_step"] == one["comm_bytes_first_step"]
        ops = m["simulated"]["comm_by_op"]
        assert sum(ops[op]["bytes"] for op in ("all_gather", "reduce_scatter")) == m["comm_theory_bytes_per_step"]
        assert "no steady step" not in said


@pytest.mark.parametrize("extra", [[], ["--sp", "2"]])
def test_pipelined_steady_step_leaves_out_the_first(tmp_path, extra):
    flags = ["--pp", "2", "--micro-batches", "2", *extra]
    one, said = _run(tmp_path, 1, *flags)
    assert one["comm_bytes_per_step"] is None and "no steady step was measured" in said
    if extra:
        assert one["sequence_parallel"]["bytes_per_step"] is None
    two, three = _run(tmp_path, 2, *flags)[0], _run(tmp_path, 3, *flags)[0]
    assert two["comm_bytes_per_step"] == three["comm_bytes_per_step"] < one["simulated"]["comm_by_op"]["all_gather"][
        "first_step_bytes"] + one["simulated"]["comm_by_op"]["reduce_scatter"]["first_step_bytes"]
    assert two["pp_bytes_per_step"] == three["pp_bytes_per_step"] == one["pp_theory_bytes_per_step"]
    if extra:
        sp = two["sequence_parallel"]
        assert sp["bytes_per_step"] == sp["theory_bytes_per_step"]
