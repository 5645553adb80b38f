"""zerompi.estimate with the GPT's dimensions: Ψ and the activation bytes per rank against what a
train run measured, the totals with them, and bad input (one line, exit 2); without mpi4py."""
import json
import os
import subprocess
import sys

import pytest

from tests.mpirun import ROOT, run_mpi
from zerompi.estimate import cli

DIMS = {"--n-layer": 3, "--d-model": 16, "--n-head": 2, "--seq-len": 8, "--batch": 12}
TRAIN = ["--model", "gpt", "--steps", "1", "--eval-every", "0", "--log-every", "100", "--dtype", "fp32",
         "--bucket-mb", "0.004"] + [str(x) for kv in DIMS.items() for x in kv]
CASES = [[], ["--checkpoint-activations"], ["--micro-batches", "2", "--checkpoint-activations"],
         ["--micro-batches", "3"]]


def estimate_json(tmp_path, *args):
    path = tmp_path / "est.json"
    assert cli.main([*map(str, args), "--json", str(path)]) == 0
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def runs():
    configs = [TRAIN + ["--stage", str(stage)] + case for case in CASES for stage in (1, 3)]
    proc = run_mpi(2, ["tests/drivers/train_many.py", json.dumps(configs)], timeout=300)
    out = [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("METRICS ")]
    assert len(out) == len(configs)
    return out


def test_estimate_equals_the_measured_activations(runs, tmp_path, capsys):
    for m in runs:
        case = m["flags"][len(TRAIN) + 2:]
        est = estimate_json(tmp_path, "--ranks", 2, "--dtype", "fp32", "--bucket-mb", "0.004", "--vocab", 32,
                            *[x for kv in DIMS.items() for x in kv], *case)
        out = capsys.readouterr().out
        assert est["params"] == m["params"]                      # Ψ from the dimensions
        row = est["stages"][m["stage"]]
        assert m["activation_bytes"] is not None
        assert row["activation_bytes"] == m["activation_bytes"] == est["activations"]["bytes"], (case, m["stage"])
        assert row["total_bytes_with_activations"] == row["total_bytes"] + m["activation_bytes"]
        assert f"= {m['activation_bytes']:,} bytes per rank" in out and "total with activations" in out
        # what a rank needs: the measured model states + buffers + activations within the estimate's total
        measured = m["memory_bytes"]["total"] + m["peak_buffer_bytes"] + m["activation_bytes"]
        assert row["total_bytes_with_activations_best_case"] <= measured <= row["total_bytes_with_activations"]
    by = {(m["stage"], tuple(m["flags"][len(TRAIN) + 2:])): m["activation_bytes"] for m in runs}
    assert by[1, ("--checkpoint-activations",)] < by[1, ()]     # the runs differ: not one number for all


@pytest.mark.parametrize("args,needle", [
    (["--ranks", "2", "--n-layer", "2"], "missing: --d-model --n-head --seq-len --batch --vocab"),
    (["--ranks", "2", "--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch", "12"],
     "missing: --vocab"),
    (["--ranks", "5", *map(str, sum(DIMS.items(), ())), "--vocab", "32"], "batch=12 does not split over 5 ranks"),
    (["--ranks", "2", "--n-layer", "0", "--d-model", "16", "--n-head", "2", "--seq-len", "8", "--batch", "12",
      "--vocab", "32"], "n_layer=0 must be an integer >= 1"),
    (["--ranks", "2", "--n-layer", "2", "--d-model", "16", "--n-head", "3", "--seq-len", "8", "--batch", "12",
      "--vocab", "32"], "d_model=16 is not divisible by n_head=3"),
    (["--ranks", "2", "--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "-8", "--batch", "12",
      "--vocab", "32"], "seq_len=-8 must be an integer >= 1"),
    (["--params", "1e6", "--ranks", "2", "--checkpoint-activations"], "--checkpoint-activations needs the GPT's"),
    (["--params", "1e6", "--ranks", "2", *map(str, sum(DIMS.items(), ())), "--vocab", "32"],
     "or the GPT's dimensions, not both"),
    ([*map(str, sum(DIMS.items(), ())), "--vocab", "32"], "give --ranks"),
    (["--n-layer", "x"], "--n-layer: invalid int value: 'x'"),
])
def test_bad_gpt_options_are_one_line_exit_2(args, needle, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zerompi.estimate: error:") and needle in err[0], err


def test_gpt_options_run_without_mpi():
    """The estimate package imports no MPI: the GPT options run where mpi4py cannot be imported."""
    code = ("import sys, runpy; sys.modules['mpi4py'] = None; sys.argv = ['zerompi.estimate'] + sys.argv[1:]; "
            "runpy.run_module('zerompi.estimate', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code, "--ranks", "2", "--n-layer", "2", "--d-model", "64",
                           "--n-head", "4", "--seq-len", "64", "--batch", "48", "--vocab", "32"],
                          capture_output=True, text=True, timeout=60, cwd=str(ROOT),
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    assert "= 25,030,656 bytes per rank" in proc.stdout      # the default GPT at N = 2 (test_activations.py)
