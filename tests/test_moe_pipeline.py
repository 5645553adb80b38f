"""The MoE GPT pipelined (--pp 2, --ep 1): the unpipelined run's bits at stages 0 and 3, fp32 and fp16 (final
parameters, losses, held-out losses, routing, gradient norms); the aux loss's gradient carries the loss scale on
every stage, not only the head's."""
import json

import pytest

from tests.mpirun import run_mpi

FLAGS = ["--model", "gpt", "--n-layer", "2", "--n-head", "2", "--d-model", "16", "--seq-len", "8",
         "--batch", "12", "--lr", "3e-3", "--bucket-mb", "0.004", "--log-every", "100", "--micro-batches", "2",
         "--experts", "4", "--top-k", "2", "--expert-hidden", "24", "--steps", "3", "--eval-every", "3"]
CONFIGS = [FLAGS + ["--stage", str(stage), "--dtype", dtype] for stage in (0, 3) for dtype in ("fp32", "fp16")]


def run_many(n, configs):
    proc = run_mpi(n, ["tests/drivers/train_many.py", json.dumps(configs)], timeout=300)
    return [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("METRICS ")]


def test_pipelined_equals_unpipelined():
    flat = run_many(2, CONFIGS)
    piped = run_many(4, [c + ["--pp", "2"] for c in CONFIGS])
    assert len(flat) == len(piped) == 4
    for a, b in zip(flat, piped):
        assert b["pipeline"] is not None and a["pipeline"] is None
        for key in ("final_params_sha256", "losses", "val_losses"):
            assert a[key] == b[key], (key, a["stage"], a["dtype"])
        for key in ("tokens_min", "tokens_max", "dropped", "grad_norms"):
            assert a["moe"][key] == pytest.approx(b["moe"][key], rel=1e-15), key
        assert a["moe"]["aux_loss"] == pytest.approx(b["moe"]["aux_loss"], rel=1e-12)


def test_split_backward_and_interleaved_schedules():
    """zb-h1 (the MoE blocks' weight gradients deferred with their input gradients') and interleaved chunks, with
    dense blocks between the MoE ones (--moe-every 2): the unpipelined run's bits."""
    flags = [f for f in FLAGS]
    flags[flags.index("--n-layer") + 1] = "4"
    flags += ["--moe-every", "2", "--stage", "2", "--dtype", "fp16"]
    flat = run_many(2, [flags])
    piped = run_many(4, [flags + ["--pp", "2", "--schedule", "zb-h1"],
                         flags + ["--pp", "2", "--schedule", "interleaved", "--chunks", "2"]])
    assert len(flat) == 1 and len(piped) == 2
    assert flat[0]["moe"]["moe_blocks"] == [1, 3]
    for b in piped:
        for key in ("final_params_sha256", "losses", "val_losses"):
            assert b[key] == flat[0][key], (key, b["pipeline"]["schedule"])
