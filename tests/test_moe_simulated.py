"""The MoE under a simulated world (--simulate-world N --experts E --ep K): one process as rank R of an EP job.

The stand-ins mirror this rank (comm/simulated_world.py's RULE): the counts every peer sends are this rank's own,
and the EP all-to-all(v)'s blocks are this rank's own block, repeated or cut to the length the peer sends. With
exactly balanced routing (tests/drivers/moe_routing.py's ``cycle``) the simulated rank's bytes per step -- ZeRO's
dense and expert traffic, the EP all-to-all's, the model states -- equal ``python -m zerompi.estimate``'s to the
byte (N = 64 at EP = 64 and EP = 16, N = 8 at EP = 8 and 4), and equal a real 4-rank job's rank 0. With --pp 2
(each stage's chunks their own dense and expert engines, EP groups inside a stage) a rank of each pipeline stage
equals the estimate's row of its stage (N = 8 at EP = 2, N = 64 at EP = 8, a stage without MoE blocks), and rank 0
of a real 8-rank job."""
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.mpirun import ROOT, mpi_env, run_mpi
from zerompi import SimulatedWorld
from zerompi.comm.ep_alltoall import EPComm
from zerompi.comm.simulated_world import RULE
from zerompi.estimate import cli

DRIVER = ROOT / "tests" / "drivers" / "moe_routing.py"
# a GPT whose engines each have buckets of one length (one bucket: the estimate's plan is the engine's layout)
GPT = ["--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "64", "--batch", "64",
       "--expert-hidden", "24", "--bucket-mb", "1"]


def metrics_of(stdout: str) -> dict:
    return [json.loads(line[8:]) for line in stdout.splitlines() if line.startswith("METRICS ")][0]


def simulated(flags, timeout=300) -> dict:
    """The metrics of one process as rank 0 of the job, its routing exactly balanced."""
    proc = subprocess.run([sys.executable, str(DRIVER), "cycle", json.dumps(flags)], capture_output=True, text=True,
                          timeout=timeout, env=mpi_env(), cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics_of(proc.stdout)


def estimate(tmp_path, n, experts, ep, top_k, dtype, micro_batches=1) -> dict:
    path = tmp_path / "est.json"
    argv = GPT + ["--vocab", "32", "--ranks", n, "--experts", experts, "--ep", ep, "--top-k", top_k, "--dtype", dtype,
                  "--micro-batches", micro_batches, "--json", path]
    assert cli.main([str(a) for a in argv]) == 0
    return json.loads(path.read_text())


def job(n, experts, ep, stage, top_k, dtype, micro_batches=1):
    return ["--model", "gpt", *GPT, "--experts", str(experts), "--ep", str(ep), "--top-k", str(top_k),
            "--stage", str(stage), "--dtype", dtype, "--micro-batches", str(micro_batches), "--steps", "3",
            "--eval-every", "0", "--log-every", "100", "--simulate-world", str(n)]


# ---- the stand-ins' answers ----------------------------------------------------------------------
def test_ep_exchange_over_mirrors():
    """EPComm over rank 2 of 4 simulated: every peer sends this rank the counts it sends itself, and the rows it
    sends itself (a block of another length: its own rows repeated or cut); the bytes are the ones it sends."""
    ep = EPComm(SimulatedWorld(4, 2))
    counts = np.array([[1, 0], [2, 1], [3, 0], [0, 4]], np.int64)        # rows to EP rank r's two experts
    got = ep.counts(counts)
    assert (got == [[3, 0]] * 4).all()
    send = np.arange(11 * 2, dtype=np.float32).reshape(11, 2)           # 1 + 3 + 3 + 4 rows, in rank order
    own = send[4:7]                                                      # this rank's rows to itself
    x = ep.rows(send, counts.sum(axis=1), got.sum(axis=1))
    assert (x == np.concatenate([own] * 4)).all()
    back = ep.rows(x[::-1].copy(), got.sum(axis=1), counts.sum(axis=1))   # the reverse: 1, 3, 3, 4 rows back
    mine = x[::-1][6:9]
    assert (back == np.concatenate([mine[:1], mine, mine, np.concatenate([mine, mine[:1]])])).all()
    # bytes sent to the others only: 8 of the 4 x 2 counts per peer; (1 + 3 + 4) rows, then 3 x 3 rows, of 8 B
    assert (ep.stats["ep_counts"].bytes, ep.stats["ep_all_to_all"].bytes) == (3 * 16, (8 + 9) * 8)
    empty = ep.rows(np.zeros((3, 2), np.float32), [1, 1, 0, 1], [2, 0, 0, 1])   # nothing to itself: zeros
    assert empty.shape == (3, 2) and not empty.any()
    assert "expert-parallel all-to-allv" in RULE


# ---- the simulated rank beside the estimate -------------------------------------------------------------
CASES = [(64, 64, 64, 3, 2, "fp16", 1), (64, 64, 16, 1, 2, "bf16", 1), (64, 64, 16, 3, 1, "fp32", 1),
         (8, 8, 8, 2, 2, "fp16", 1), (8, 8, 4, 0, 2, "fp32", 2)]


@pytest.mark.parametrize("n,experts,ep,stage,top_k,dtype,mb", CASES)
def test_simulated_ep_rank_equals_the_estimate(tmp_path, n, experts, ep, stage, top_k, dtype, mb):
    """Rank 0 of N at EP = K, balanced: each step's EP all-to-all bytes, the steady step's ZeRO bytes (dense over
    N, experts over N/K with K sources' partials, less what stage 3 keeps gathered at the turn), the dense and
    expert model states: the estimate's to the byte; and the run's own estimate beside it agrees."""
    m = simulated(job(n, experts, ep, stage, top_k, dtype, mb))
    est = estimate(tmp_path, n, experts, ep, top_k, dtype, mb)
    dense, row = est["stages"][stage], est["moe"]["stages"][stage]
    moe = m["moe"]
    assert moe["tokens_min"] == moe["tokens_max"] == [64 * 64 * top_k // experts] * 3   # every expert, every step
    assert est["moe"]["all_to_all_bytes_per_step"] > 0
    assert moe["all_to_all_bytes"] == [est["moe"]["all_to_all_bytes_per_step"]] * 3
    assert moe["all_to_all_theory_bytes"] == est["moe"]["all_to_all_bytes_per_step"]
    # each engine's bytes as it sends them (one node: the ring's volume less what stage 3 keeps at the turns)
    assert row["dense_comm_bytes_per_step"] == dense["comm_bytes_per_step"] - dense["comm_bytes_kept_at_turns"]
    zero = row["dense_comm_bytes_per_step"] + row["expert_comm_bytes_per_step"]
    assert m["comm_bytes_per_step"] == zero
    assert (row["expert_comm_bytes_per_step"] > 0) == (ep < n)
    mem = moe["memory_bytes_by_engine"]
    assert (mem["dense"]["measured"], mem["experts"]["measured"]) == (row["dense_padded_bytes"],
                                                                      row["expert_padded_bytes"])
    assert (mem["dense"]["theory"], mem["experts"]["theory"]) == (row["dense_bytes"], row["expert_bytes"])
    assert m["memory_bytes"]["total"] == row["dense_padded_bytes"] + row["expert_padded_bytes"]
    sim = m["simulated"]
    assert (sim["world_size"], sim["rank"], sim["rule"]) == (n, 0, RULE)
    assert sim["estimate"]["model_state_bytes"] == sim["measured"]["model_state_bytes"] == m["memory_bytes"]["total"]
    assert sim["estimate"]["comm_bytes_per_step"] - sim["estimate"]["comm_bytes_kept_at_turns"] == zero
    assert sim["estimate"]["formula"].endswith("for each of 2 engines (the dense over its N ranks, the experts over "
                                               "their N/K)")


def test_cli_runs_rank_0_of_64_experts_at_ep_64(tmp_path):
    """``python -m zerompi.train --simulate-world 64 --experts 64 --ep 64``: one process, the rule in the banner,
    its step lines say the loss is not a real run's, and the model states are the estimate's (any routing)."""
    out = tmp_path / "m.json"
    flags = job(64, 64, 64, 3, 2, "fp16")[:-2] + ["--simulate-world", "64", "--metrics-json", str(out)]
    proc = subprocess.run([sys.executable, "-m", "zerompi.train", *flags], capture_output=True, text=True,
                          timeout=300, env=mpi_env(), cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SIMULATED: this one process is rank 0 of 64" in proc.stdout and RULE in proc.stdout
    assert "(simulated rank: not a real run's loss)" in proc.stdout
    m = json.loads(out.read_text())
    row = estimate(tmp_path, 64, 64, 64, 2, "fp16")["moe"]["stages"][3]
    assert m["memory_bytes"]["total"] == row["dense_padded_bytes"] + row["expert_padded_bytes"]
    assert m["moe"]["ep"] == 64 and len(m["moe"]["all_to_all_bytes"]) == 3


# ---- one rank, real and simulated --------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 3])
def test_real_and_simulated_rank_0_send_the_same_bytes(stage):
    """A real 4-rank job at EP = 2 (experts over 2 expert-data-parallel ranks) and one process as its rank 0:
    the same ZeRO bytes per step and per collective, the same EP all-to-all bytes, model states by engine."""
    flags = job(4, 4, 2, stage, 2, "fp16")[:-2]
    flags[flags.index("--seq-len") + 1], flags[flags.index("--batch") + 1] = "8", "16"
    real = metrics_of(run_mpi(4, [str(DRIVER), "cycle", json.dumps(flags)], timeout=240).stdout)
    sim = simulated(flags + ["--simulate-world", "4"])
    for key in ("comm_bytes_per_step", "comm_bytes_first_step", "comm_bytes_per_step_by_op", "memory_bytes",
                "params", "padded_params"):
        assert sim[key] == real[key], key
    for key in ("all_to_all_bytes", "all_to_all_theory_bytes", "tokens_min", "tokens_max", "memory_bytes_by_engine"):
        assert sim["moe"][key] == real["moe"][key], key
    assert real["moe"]["all_to_all_bytes"][-1] > 0 and real["comm_bytes_per_step"] > 0


# ---- one rank of a pipelined EP job ----------------------------------------------------------------------
PP_CASES = [(8, 2, 1, []), (64, 8, 3, []),
            (8, 2, 2, ["--n-layer", "4", "--moe-every", "2", "--schedule", "interleaved", "--chunks", "2"]),
            (8, 2, 2, ["--node-size", "2"]), (8, 2, 3, ["--node-size", "1", "--hpz"])]   # each stage's nodes, hpZ


def pp_job(n, ep, stage, extra):
    return ["--model", "gpt", *GPT, "--experts", "8", "--ep", str(ep), "--top-k", "2", "--stage", str(stage),
            "--dtype", "fp16", "--micro-batches", "2", "--steps", "3", "--eval-every", "0", "--log-every", "100",
            "--pp", "2", *extra]


@pytest.mark.parametrize("n,ep,stage,extra", PP_CASES)
def test_simulated_pipelined_ep_ranks_equal_the_estimate(tmp_path, n, ep, stage, extra):
    """--simulate-world N --pp 2 --ep K, balanced: rank 0 (pipeline stage 0) and rank N/2 (stage 1) each send their
    stage's all-to-all (its own MoE blocks: 0 bytes where it holds none) and its engines' ZeRO bytes (stage 3:
    less what each chunk keeps gathered at the turn), and hold its stage's dense and expert model states (formulas
    and padded layouts): ``zerompi.estimate --pp 2``'s row of that stage, to the byte; also in nodes of 2, and of
    1 with hpZ (the stage's engines in its nodes, the expert group across them)."""
    path = tmp_path / "est.json"
    argv = GPT + ["--vocab", "32", "--ranks", n, "--experts", 8, "--ep", ep, "--top-k", 2, "--dtype", "fp16",
                  "--micro-batches", 2, "--pp", 2, *extra, "--json", path]
    assert cli.main([str(a) for a in argv]) == 0
    pm = json.loads(path.read_text())["moe"]
    for rank in (0, n // 2):
        m = simulated(pp_job(n, ep, stage, extra) + ["--simulate-world", str(n), "--simulate-rank", str(rank)])
        st = pm["pipeline_stages"][rank // (n // 2)]
        row = st["zero_stages"][stage]
        assert m["simulated"]["rank"] == rank and m["moe"]["ep"] == ep
        assert m["moe"]["all_to_all_bytes"] == [st["all_to_all_bytes_per_step"]] * 3
        assert m["comm_bytes_per_step"] == row["comm_bytes_per_step"] - row["comm_bytes_kept_at_turns"] > 0
        mem = m["moe"]["memory_bytes_by_engine"]
        assert (mem["dense"]["measured"], mem["experts"]["measured"]) == (row["dense_padded_bytes"],
                                                                          row["expert_padded_bytes"])
        assert (mem["dense"]["theory"], mem["experts"]["theory"]) == (row["dense_bytes"], row["expert_bytes"])
        assert (mem["dense"]["params"], mem["experts"]["params"]) == (st["dense_params"], st["expert_params"])
        sim = m["simulated"]
        assert sim["estimate"]["model_state_bytes"] == sim["measured"]["model_state_bytes"] == \
            row["dense_padded_bytes"] + row["expert_padded_bytes"]
    assert [s["moe_blocks"] for s in pm["pipeline_stages"]] == ([0, 2] if "--moe-every" in extra else [1, 1])


@pytest.mark.slow
def test_real_and_simulated_pipelined_ep_rank_0_send_the_same_bytes():
    """A real 8-rank job at --pp 2 --ep 2 (stage 1, balanced) and one process as its rank 0: the same ZeRO bytes per
    step and per collective, the same EP all-to-all bytes (the stages' blocks alike), model states by engine."""
    flags = pp_job(8, 2, 1, [])
    flags[flags.index("--seq-len") + 1], flags[flags.index("--batch") + 1] = "8", "16"
    real = metrics_of(run_mpi(8, [str(DRIVER), "cycle", json.dumps(flags)], timeout=400).stdout)
    sim = simulated(flags + ["--simulate-world", "8"])
    for key in ("comm_bytes_per_step", "comm_bytes_per_step_by_op", "memory_bytes", "padded_params"):
        assert sim[key] == real[key], key
    for key in ("all_to_all_bytes", "all_to_all_theory_bytes", "memory_bytes_by_engine"):
        assert sim["moe"][key] == real["moe"][key], key
    assert real["moe"]["all_to_all_bytes"][-1] > 0 and real["comm_bytes_per_step"] > 0
