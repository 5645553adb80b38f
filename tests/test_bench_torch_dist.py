"""scripts/bench_torch_dist_gpt.py: GPT-2 under PyTorch DDP and FSDP2 on CPU processes runs and reports each step
and each rank's memory (the numbers beside zerompi's in docs/interop.md). Needs torch and transformers."""
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.mpirun import ROOT

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_dist_bench_runs(tmp_path, mode):
    np.random.default_rng(0).integers(0, 300, 5000).astype(np.uint16).tofile(tmp_path / "t.bin")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_torch_dist_gpt.py"), "--mode", mode,
                           "--ranks", "2", "--data", str(tmp_path / "t.bin"), "--steps", "2", "--n-layer", "1",
                           "--d-model", "32", "--n-head", "2", "--seq-len", "16", "--vocab", "300", "--batch", "4",
                           "--port", str(29600 + (mode == "ddp"))], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mode"] == mode and len(out["step_s"]) == 2 and len(out["max_rss_bytes"]) == 2
    assert all(t > 0 for t in out["tokens_per_s"])
