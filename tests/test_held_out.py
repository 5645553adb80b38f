"""The held-out loss of a short --data file: fewer held-out rows than data-parallel ranks.

A rank whose share of the held-out set is empty took part in the evaluation with an empty forward,
which crashed ("cannot reshape array of size 0"), with and without --pp / --sp. It now computes
nothing and adds no loss and no row: the loss is the mean over the rows that exist, and the step
line and the metrics say how many rows that is. The oracle: one rank evaluating the same row (the
parameters differ from the 4-rank run's only in the order of their gradient sums)."""
import json
import subprocess
import sys

import pytest

from tests.mpirun import ROOT, mpi_env, run_mpi

FLAGS = ["--seq-len", "8", "--n-layer", "2", "--batch", "8", "--steps", "2", "--eval-every", "1", "--dtype", "fp32",
         "--progress", "lines"]


@pytest.fixture
def short_file(tmp_path):
    """40 bytes: the last 9 held out, one window of 9 tokens, so val_size 1 (one row for 4 ranks)."""
    path = tmp_path / "short.txt"
    path.write_bytes(b"the cat sat on the mat; the dog sat too.")
    return path


def _vals(stdout: str):
    return [line.split("  val ")[1].split("  ")[0] for line in stdout.splitlines() if line.startswith("step ")]


@pytest.mark.parametrize("mesh", [[], ["--pp", "2", "--micro-batches", "2"], ["--sp", "2"]])
def test_ranks_without_a_held_out_row_add_nothing(tmp_path, short_file, mesh):
    one, four = tmp_path / "one.json", tmp_path / "four.json"
    run_mpi(1, ["-m", "zerompi.train", "--data", short_file, *FLAGS, "--metrics-json", one], timeout=240)
    proc = run_mpi(4, ["-m", "zerompi.train", "--data", short_file, *FLAGS, *mesh, "--metrics-json", four],
                   timeout=240)
    assert all(v.endswith(" (1 row)") for v in _vals(proc.stdout)) and len(_vals(proc.stdout)) == 2, proc.stdout
    want, got = (json.loads(p.read_text()) for p in (one, four))
    assert want["val_rows"] == got["val_rows"] == 1
    assert [s for s, _ in got["val_losses"]] == [1, 2]
    for (_, a), (_, b) in zip(want["val_losses"], got["val_losses"]):
        assert b == pytest.approx(a, rel=1e-5)


@pytest.mark.parametrize("flags,reason", [
    (["--simulate-rank", "3"], "simulated rank 3's share of the held-out set is empty"),
    (["--simulate-rank", "1", "--pp", "2", "--micro-batches", "2"],
     "simulated rank of stage 0, which computes no loss"),
])
def test_no_held_out_row_anywhere_is_one_note_not_a_number(tmp_path, short_file, flags, reason):
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "zerompi.train", "--simulate-world", "4", "--data", str(short_file),
                           *FLAGS, *flags, "--metrics-json", str(out)], capture_output=True, text=True, timeout=240,
                          env=mpi_env(), cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stdout.splitlines() if "held-out" in line]
    assert notes == [f"  note: no held-out loss: {reason}" + notes[0].split(reason)[1]], proc.stdout
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and not any(" val " in line or "nan" in line for line in steps), proc.stdout
    m = json.loads(out.read_text())
    assert (m["val_losses"], m["val_rows"]) == ([], 0)
