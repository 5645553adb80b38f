"""Every mode keeps its bits: a matrix of small runs whose final parameter digest and losses were recorded
on main before the job's shape changed (tests/digests.json), run again and compared exactly.

A digest that changes is a bug unless a commit says why and checks the new value against its oracle; then
record again with ``ZEROMPI_RECORD_DIGESTS=1 python -m pytest tests/test_digests.py`` and say so in the commit.
The losses are compared as exact floats too (a simulated rank has no digest: its losses are what it has).

The bits of a matrix multiply depend on the BLAS kernel, which OpenBLAS picks by CPU: the digests were recorded
with its Haswell (AVX2) kernels, and an AVX-512 machine's own kernels give other bits (every case differs from its
first loss). So on x86-64 every job here runs with OPENBLAS_CORETYPE=Haswell (any AVX2 CPU runs them); zerompi's
own C kernels and NumPy's element-wise loops give the same bits on both kinds of CPU.
"""
import json
import os
import platform
from pathlib import Path

import pytest

from tests.mpirun import run_mpi, run_train

RECORD = Path(__file__).with_name("digests.json")
GPT = ["--model", "gpt", "--n-layer", "4", "--d-model", "32", "--n-head", "4", "--seq-len", "16", "--batch", "8",
       "--eval-every", "0", "--steps", "3", "--log-every", "1000", "--bucket-mb", "0.01"]
MLP = ["--model", "mlp", "--width", "32", "--depth", "4", "--batch", "8", "--steps", "3", "--log-every", "1000",
       "--bucket-mb", "0.002"]
PP = ["--micro-batches", "4"]

# name -> (ranks, flags); {tmp} in a flag is the test's folder
CASES = {
    **{f"gpt-stage{s}-fp16-n2": (2, [*GPT, "--stage", str(s), "--dtype", "fp16"]) for s in range(4)},
    "gpt-stage3-fp32-n3": (3, [*GPT, "--stage", "3", "--dtype", "fp32", "--batch", "6"]),
    "gpt-stage1-bf16-n3": (3, [*GPT, "--stage", "1", "--dtype", "bf16", "--batch", "6"]),
    "mlp-stage2-fp16-n2": (2, [*MLP, "--stage", "2", "--dtype", "fp16"]),
    "gpt-stage2-microbatch-clip-n2": (2, [*GPT, "--stage", "2", "--micro-batches", "2", "--clip", "0.05"]),
    "gpt-stage3-checkpointing-n2": (2, [*GPT, "--stage", "3", "--checkpoint-activations"]),
    "gpt-stage2-no-overlap-n2": (2, [*GPT, "--stage", "2", "--no-overlap", "--dtype", "fp32"]),
    **{f"gpt-pp2-{sch}-stage{s}-n4": (4, [*GPT, *PP, "--stage", str(s), "--pp", "2", "--schedule", sch])
       for sch, s in (("gpipe", 0), ("1f1b", 1), ("zb-h1", 2), ("1f1b", 3))},
    "gpt-pp2-interleaved-stage3-n2": (2, [*GPT, *PP, "--stage", "3", "--pp", "2", "--schedule", "interleaved",
                                          "--chunks", "2"]),
    "gpt-pp2-gradreduce-step-fp32-n4": (4, [*GPT, *PP, "--stage", "2", "--pp", "2", "--dtype", "fp32",
                                            "--pp-grad-reduce", "step"]),
    "gpt-pp2-checkpointing-n2": (2, [*GPT, *PP, "--stage", "3", "--pp", "2", "--checkpoint-activations"]),
    "mlp-pp2-stage1-n2": (2, [*MLP, *PP, "--stage", "1", "--pp", "2"]),
    "gpt-tp2-stage2-n2": (2, [*GPT, "--stage", "2", "--tp", "2"]),
    "gpt-tp2-stage3-n4": (4, [*GPT, "--stage", "3", "--tp", "2", "--dtype", "bf16"]),
    "mlp-tp2-stage1-n2": (2, [*MLP, "--stage", "1", "--tp", "2"]),
    "gpt-sp2-stage3-n2": (2, [*GPT, "--stage", "3", "--sp", "2"]),
    "gpt-dp2-sp2-stage2-n4": (4, [*GPT, "--stage", "2", "--sp", "2", "--dtype", "fp32"]),
    "gpt-pp2-tp2-stage1-n4": (4, [*GPT, *PP, "--stage", "1", "--pp", "2", "--tp", "2"]),
    "gpt-pp2-sp2-stage3-n4": (4, [*GPT, *PP, "--stage", "3", "--pp", "2", "--sp", "2"]),
    "gpt-hier-stage3-n4": (4, [*GPT, "--stage", "3", "--node-size", "2"]),
    "gpt-hpz-qwz-qgz-stage3-n4": (4, [*GPT, "--stage", "3", "--node-size", "2", "--hpz", "--quantize-weights",
                                      "int8", "--quantize-grads", "int8"]),
    "gpt-shard-size2-stage2-n4": (4, [*GPT, "--stage", "2", "--shard-size", "2", "--node-size", "2"]),
    "gpt-offload-cpu-stage2-n2": (2, [*GPT, "--stage", "2", "--offload-optimizer", "cpu"]),
    "gpt-offload-nvme-params-stage3-n2": (2, [*GPT, "--stage", "3", "--offload-optimizer", "nvme",
                                              "--offload-params", "nvme", "--offload-dir", "{tmp}/off"]),
    "gpt-offload-delayed-stage1-n2": (2, [*GPT, "--stage", "1", "--offload-optimizer", "cpu",
                                          "--offload-delayed-update", "--offload-delayed-warmup", "1"]),
    "gpt-simulated-rank1-of-8-stage3": (1, [*GPT, "--stage", "3", "--simulate-world", "8", "--simulate-rank", "1"]),
    "moe-ep2-stage3-fp16-n4": (4, [*GPT, "--stage", "3", "--dtype", "fp16", "--micro-batches", "2", "--experts", "4",
                                   "--top-k", "2", "--expert-hidden", "48", "--ep", "2"]),
}
RESUMED = "gpt-resume-n2-stage1-to-n3-stage3"     # saved at step 2 by 2 ranks, resumed to step 4 by 3 at stage 3
BLAS = {"OPENBLAS_CORETYPE": "Haswell"} if platform.machine() in ("x86_64", "AMD64") else {}


def _recorded() -> dict:
    return json.loads(RECORD.read_text()) if RECORD.exists() else {}


def _check(name: str, metrics: dict) -> None:
    got = {"final_params_sha256": metrics.get("final_params_sha256"), "losses": metrics["losses"]}
    if os.environ.get("ZEROMPI_RECORD_DIGESTS"):
        record = _recorded()
        record[name] = got
        RECORD.write_text(json.dumps(dict(sorted(record.items())), indent=1) + "\n")
        return
    want = _recorded().get(name)
    assert want is not None, f"{name}: no recorded digest; record with ZEROMPI_RECORD_DIGESTS=1"
    assert got == want, f"{name}: {got} != recorded {want}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_mode_keeps_its_bits(name, tmp_path):
    n, flags = CASES[name]
    (tmp_path / "off").mkdir()
    flags = [str(f).replace("{tmp}", str(tmp_path)) for f in flags]
    _check(name, run_train(n, tmp_path, *flags, timeout=300, env=BLAS))


def test_a_resume_at_another_world_size_and_stage_keeps_its_bits(tmp_path):
    base = [*GPT, "--steps", "4", "--dtype", "fp32", "--batch", "12"]   # 12 splits over 2 and 3 ranks
    run_mpi(2, ["-m", "zerompi.train", *base, "--stage", "1", "--save-every", "2", "--save-dir", tmp_path / "ck"],
            timeout=300, env=BLAS)
    _check(RESUMED, run_train(3, tmp_path, *base, "--stage", "3", "--resume", tmp_path / "ck" / "step_000002",
                              timeout=300, env=BLAS))
