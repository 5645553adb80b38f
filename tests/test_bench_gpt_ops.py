"""scripts/bench_gpt_ops.py: the GPT step at N = 1 by operation. Oracle: the model's shape (each block makes 18
matrix multiplies a step: 6 forward, 8 backward, 4 weight gradients; LayerNorm 2 per block + the final one,
GELU and the softmax one per block, each way), and the parts adding up to the step. No timing asserted."""
import json
import subprocess
import sys

import pytest

from tests.mpirun import ROOT, mpi_env


@pytest.mark.slow
def test_every_op_of_the_step_timed_once(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpt_ops.py"), "--steps", "1"],
                          capture_output=True, text=True, timeout=600, cwd=str(ROOT), env=mpi_env())
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)
    L = 6                                                   # gpt-6x256
    calls = rec["calls_per_step"]
    assert calls["matmul"] == 18 * L and calls["embedding"] == 2 and calls["head + loss"] == 1
    if rec["kernels"] == "c":
        assert calls["layernorm"] == calls["layernorm backward"] == 2 * L + 1
        assert calls["gelu"] == calls["gelu backward"] == calls["softmax"] == calls["softmax backward"] == L
        assert calls["bias + residual add"] == 2 * L
    assert sum(rec["ops_s"].values()) == pytest.approx(rec["step_s"], rel=1e-9)     # one step: its parts exactly
    assert rec["floor_s"] > 0 and rec["beyond_matmul_s"] == rec["step_s"] - rec["ops_s"]["matmul"]


def test_bad_steps_one_line_exit_2():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpt_ops.py"), "--steps", "0"],
                          capture_output=True, text=True, timeout=120, env=mpi_env())
    assert proc.returncode == 2 and "--steps 0 must be >= 1" in proc.stderr
