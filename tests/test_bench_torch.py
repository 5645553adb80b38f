"""scripts/bench_torch_gpt.py: PyTorch's copy of the GPT computes what zerompi's does (the check
that makes its step-time comparison meaningful), and without PyTorch it says so in one line."""
import json
import subprocess
import sys

import pytest

from .mpirun import ROOT, mpi_env

SCRIPT = str(ROOT / "scripts" / "bench_torch_gpt.py")


def test_without_torch_one_line_exit_2():
    code = ("import sys, runpy; sys.modules['torch'] = None; sys.argv = ['bench_torch_gpt.py']; "
            f"runpy.run_path({SCRIPT!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=mpi_env())
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "needs PyTorch" in proc.stderr


def test_torch_gpt_matches_zerompi_and_times_both(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--repeats", "1", "--warmup", "0", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=mpi_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (rec,) = json.loads(out.read_text())
    assert rec["parity"]["ok"] and rec["parity"]["loss_rel"] < 1e-5 and rec["parity"]["grad_worst_rel"] < 2e-5
    assert set(rec["step_s"]) == {"torch_fp32", "torch_bf16", "zerompi_fp32", "zerompi_bf16"}
