"""scripts/gpu_check.sh's plumbing on the CPU: the script parses, and gpu_summary.py passes a
complete set of good results and fails each kind of bad one (the checks themselves need a GPU)."""
import json
import shutil
import subprocess
import sys

import pytest

from .mpirun import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_summary  # noqa: E402


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_script_parses():
    proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def write_results(out, **change):
    """A complete, passing result folder; ``change`` breaks one part of it."""
    steps = ["pytest_gpu", "bench_adam", "bench_comm", "bench_nccl", "gpt", "gpt_nccl"]
    (out / "env.json").write_text(json.dumps({"gpu": "Test GPU", "gpus": 1, "cupy": "x", "mpi": "MPICH",
                                              "cuda_aware": False}))
    (out / "pytest_gpu.xml").write_text('<testsuites><testsuite tests="60" failures="0" errors="0" '
                                        f'skipped="{change.get("skipped", 0)}"/></testsuites>')
    for n in (2, 4):
        for dtype in ("fp32", "fp16"):
            for dev in ("gpu", "cpu"):
                for s in range(4):
                    name = f"parity_{dev}_n{n}_{dtype}_s{s}"
                    steps.append(name)
                    losses = [1.0, 0.5, 0.25]
                    sha = "a" if dev == "gpu" else "b"
                    if change.get("gpu_stage_differs") and dev == "gpu" and s == 3:
                        sha = "c"
                    if change.get("loss_off") and dev == "gpu" and dtype == "fp32":
                        losses = [1.0, 0.5, 0.26]
                    (out / f"{name}.json").write_text(json.dumps({"final_params_sha256": sha, "losses": losses,
                                                                  "device": f"{dev} 0 of 1"}))
    copy = 4000.0
    (out / "bench_adam.json").write_text(json.dumps({"records": [
        {"backend": "gpu", "n": 1 << 20, "fused_gbps": 100.0, "copy_gbps": copy, "numpy_gbps": 50.0},
        {"backend": "gpu", "n": 64 << 20, "fused_gbps": change.get("fused", 3500.0), "copy_gbps": copy,
         "numpy_gbps": 300.0}]}))
    for name in ("bench_comm", "bench_nccl"):
        (out / f"{name}.json").write_text(json.dumps([
            {"op": "reduce_scatter", "impl": "zerompi", "bytes": 1 << 20, "busbw": 3.0,
             "wrong": change.get("wrong", 0) if name == "bench_comm" else 0},
            {"op": "reduce_scatter", "impl": "mpi", "bytes": 1 << 20, "busbw": 4.0, "wrong": 0}]))
    for name in ("gpt", "gpt_nccl"):
        (out / f"{name}.json").write_text(json.dumps({"losses": [5.5, 2.0], "val_losses": [[60, 2.1]],
                                                      "device": "gpu 0 of 1 (Test GPU; CuPy)", "tokens_per_s": 1e5}))
    (out / "status.txt").write_text("".join(f"{s} {change.get('rc', 0) if s == 'gpt' else 0} 3\n" for s in steps))


def test_summary_passes_good_results(tmp_path, capsys):
    write_results(tmp_path)
    assert gpu_summary.main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "ALL PASSED" in text and "Test GPU" in text and "FAIL" not in text
    assert json.loads((tmp_path / "summary.json").read_text())["ok"] is True


@pytest.mark.parametrize("change,needle", [
    ({"skipped": 3}, "oracles (pytest)"),
    ({"gpu_stage_differs": True}, "GPU stages DIFFER"),
    ({"loss_off": True}, "GPU vs CPU losses within 4.0e-02 (tolerance 0.0001)"),
    ({"fused": 3000.0}, "fused >= 0.8 x device copy"),
    ({"wrong": 5}, "5 wrong"),
    ({"rc": 124}, "failed steps: gpt"),
])
def test_summary_fails_each_bad_result(tmp_path, capsys, change, needle):
    write_results(tmp_path, **change)
    assert gpu_summary.main([str(tmp_path)]) == 1
    text = capsys.readouterr().out
    assert "SOME CHECKS FAILED" in text and needle in text, text


def test_summary_with_nothing_there_fails(tmp_path, capsys):
    assert gpu_summary.main([str(tmp_path)]) == 1
    assert "missing runs" in capsys.readouterr().out
