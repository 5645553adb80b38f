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


def write_metrics(out, name, sha, losses=(1.0, 0.5, 0.25), dev="gpu"):
    (out / f"{name}.json").write_text(json.dumps({"final_params_sha256": sha, "losses": list(losses),
                                                  "device": f"{dev} 0 of 1"}))


def write_results(out, **change):
    """A complete, passing result folder; ``change`` breaks one part of it."""
    steps = ["pytest_gpu", "bench_adam", "bench_comm", "bench_nccl", "gpt", "gpt_nccl", "bench_floor", "bench_torch"]
    (out / "env.json").write_text(json.dumps({"gpu": "Test GPU", "gpus": 1, "cupy": "x", "mpi": "MPICH",
                                              "cuda_aware": False}))
    (out / "pytest_gpu.xml").write_text('<testsuites><testsuite tests="60" failures="0" errors="0" '
                                        f'skipped="{change.get("skipped", 0)}"/></testsuites>')
    for n in (2, 4):
        for dtype in ("fp32", "fp16"):
            for dev in ("gpu", "cpu") if n == 2 else ("gpu",):
                for s in range(4):
                    name = f"parity_{dev}_n{n}_{dtype}_s{s}"
                    steps.append(name)
                    losses = [1.0, 0.5, 0.25]
                    sha = ("a" if dtype == "fp16" else "f") if dev == "gpu" else "b"
                    if change.get("gpu_stage_differs") and dev == "gpu" and s == 3:
                        sha = "c"
                    if change.get("loss_off") and dev == "gpu" and dtype == "fp32":
                        losses = [1.0, 0.5, 0.26]
                    write_metrics(out, name, sha, losses, dev)
    for dev in ("gpu", "cpu"):
        for s in range(4):
            steps.append(f"bf16_{dev}_s{s}")
            bad = change.get("bf16_loss_off") and dev == "gpu"
            write_metrics(out, f"bf16_{dev}_s{s}", "d" + dev, (1.0, 0.5, 0.3 if bad else 0.25), dev)
    for dev in ("gpu", "cpu"):
        for s in range(4):
            steps.append(f"muon_{dev}_s{s}")
            sha = "m" + dev + ("x" if change.get("muon_stage_differs") and dev == "gpu" and s == 2 else "")
            write_metrics(out, f"muon_{dev}_s{s}", sha, (1.0, 0.5, 0.25), dev)
    for dev in ("gpu", "cpu"):
        steps.append(f"moe_{dev}_s3")
        (out / f"moe_{dev}_s3.json").write_text(json.dumps({
            "final_params_sha256": "o" + dev, "device": f"{dev} 0 of 1",
            "losses": [2.0, 1.5, 1.2 if change.get("moe_loss_off") and dev == "gpu" else 1.0],
            "moe": {"tokens_min": [3], "tokens_max": [9], "dropped": [0]}}))
    for mode in ("tp", "sp", "pp", "ep"):
        for dev, s in (("gpu", 1), ("gpu", 3), ("cpu", 3)):
            steps.append(f"{mode}_{dev}_s{s}")
            sha = mode + dev + ("x" if change.get("mode_stage_differs") == mode and s == 3 else "")
            off = change.get("mode_loss_off") == mode and dev == "gpu"
            write_metrics(out, f"{mode}_{dev}_s{s}", sha, (1.0, 0.5, 0.3 if off else 0.25), dev)
    for s in (1, 2, 3):
        steps.append(f"zeropp_gpu_s{s}")
        write_metrics(out, f"zeropp_gpu_s{s}", "q", (1.0, 1.2 if change.get("zeropp_diverges") else 0.5))
    for name in ("hpz_gpu_s3", "twolevel_gpu_s3"):
        steps.append(name)
        write_metrics(out, name, "h" if name == "twolevel_gpu_s3" or not change.get("hpz_differs") else "x")
    for s in (2, 3):
        for where in ("cpu", "nvme"):
            steps.append(f"offload_{where}_gpu_s{s}")
            write_metrics(out, f"offload_{where}_gpu_s{s}", "e" if change.get("offload_differs") and where == "nvme"
                          else "a")
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
    floor = {"model": "gpt-default", "N": 1, "device": "gpu 0 of 1 (Test GPU; CuPy)", "floor_s": 0.001,
             "stages_bit_identical": not change.get("floor_stages_differ"),
             "stages": {str(s): {"over_floor": 2.0 + s} for s in range(4)}}
    (out / "bench_floor.log").write_text("starting\n" + json.dumps(floor) + "\n" + json.dumps({"cpus": 16}) + "\n")
    if change.get("no_torch"):
        (out / "bench_torch.log").write_text("== bench_torch: PyTorch with CUDA is not installed here: not compared\n")
    else:
        (out / "bench_torch.json").write_text(json.dumps([{
            "model": "gpt-default", "parity": {"ok": not change.get("torch_parity_off")},
            "step_s": {"torch_fp32": 0.002, "torch_bf16": 0.0015}, "zerompi_over_torch_fp32": 1.5,
            "zerompi_over_torch_bf16": 2.0, "skipped": {}}]))
    rc = lambda s: change.get("rc", 0) if s == "gpt" else (-1 if change.get("not_run") and s == "bench_torch" else 0)
    (out / "status.txt").write_text("".join(f"{s} {rc(s)} 3\n" for s in steps))


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
    ({"not_run": True}, "not run (the time budget was spent): bench_torch"),
    ({"bf16_loss_off": True}, "GPU vs CPU losses within 2.0e-01 (tolerance 0.05)"),
    ({"zeropp_diverges": True}, "loss 1 -> 1.2"),
    ({"hpz_differs": True}, "DIFFER: {'hpz_gpu_s3': 'x'"),
    ({"muon_stage_differs": True}, "FAIL  Muon stages 0-3"),
    ({"offload_differs": True}, "'offload_nvme_gpu_s2': 'e'"),
    ({"moe_loss_off": True}, "FAIL  MoE --experts 4 stage 3"),
    ({"mode_stage_differs": "pp"}, "FAIL  --pp 2, stages 1 and 3"),
    ({"mode_stage_differs": "ep"}, "FAIL  --experts 4 --ep 2, stages 1 and 3"),
    ({"mode_loss_off": "tp"}, "GPU vs CPU losses within 2.0e-01 (tolerance 0.0001)"),
    ({"floor_stages_differ": True}, "FAIL  GPT step per stage against its GEMM floor"),
    ({"torch_parity_off": True}, "FAIL  the GPT under PyTorch"),
])
def test_summary_fails_each_bad_result(tmp_path, capsys, change, needle):
    write_results(tmp_path, **change)
    assert gpu_summary.main([str(tmp_path)]) == 1
    text = capsys.readouterr().out
    assert "SOME CHECKS FAILED" in text and needle in text, text


def test_summary_without_torch_passes(tmp_path, capsys):
    write_results(tmp_path, no_torch=True)
    assert gpu_summary.main([str(tmp_path)]) == 0
    assert "PyTorch with CUDA is not installed here" in capsys.readouterr().out


def test_summary_with_nothing_there_fails(tmp_path, capsys):
    assert gpu_summary.main([str(tmp_path)]) == 1
    assert "missing runs" in capsys.readouterr().out
