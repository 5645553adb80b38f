"""A simulated rank of a pipelined or sequence-parallel mesh (comm/simulated_world.py, train/simulated_run.py).

Point-to-point messages from another pipeline stage are stood in for by zeros (the RULE): the rank's
memory and every byte it sends must still be rank R's in the real job. Checked rank by rank against
a real 4-rank job (tests/drivers/simulated_mesh.py: 1F1B, with cpu offload too, ZB-H1 with stage-3 gathers per step, the
interleaved schedule over two nodes in bf16, stage 3 with hpZ, qwZ and qgZ over nodes of one rank, four
stages, pp x tp, pp x sp, the MLP reducing per step), through
the CLI's metrics (the pipeline's and the sequence-parallel run's), and against zerompi.estimate to
the byte at world sizes no job here could run."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from zerompi import SimulatedWorld
from zerompi.comm.p2p import PointToPoint
from zerompi.comm.simulated_world import RULE
from zerompi.errors import UsageError
from tests.mpirun import ROOT, mpi_env, one_line, run_mpi

DRIVER = ROOT / "tests" / "drivers" / "simulated_mesh.py"
GPT = ["--n-layer", "4", "--d-model", "32", "--n-head", "2", "--seq-len", "16", "--eval-every", "2", "--no-overlap",
       "--progress", "lines"]


def simulate(args, timeout=240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=mpi_env(), cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    return proc


# ---- the point-to-point stand-ins ------------------------------------------------------------------
def test_another_stages_message_holds_zeros_and_has_arrived():
    w = SimulatedWorld(4, 1)
    got = np.ones(6, np.float32)
    req = w.Irecv(got.view(np.uint8), 2, 21)
    assert req.Test() and (got == 0).all()
    w.Isend(np.ones(3), 0, 21).Wait()
    for bad in (1, 4, -1):                                       # itself, and not a rank of the 4
        with pytest.raises(UsageError, match=f"peer={bad}"):
            w.Isend(got, bad, 21)
    p2p = PointToPoint(w.split_by(lambda r: r % 2), node_of=[0, 1])   # ranks 1, 3: this one is rank 0 of 2
    p2p.isend(np.ones((4, 8), np.float16), 1, 21, "activations")
    back = p2p.wait(p2p.irecv(np.full((4, 8), 7.0, np.float32), 1, 22, "activation gradients"))
    p2p.wait_all()
    assert (back == 0).all() and p2p.stats["activations"].inter == 64 and p2p.bytes_sent() == 64
    assert "a point-to-point message from another pipeline stage holds zeros" in RULE


# ---- one pipelined rank, real and simulated ------------------------------------------------------------
@pytest.mark.slow
def test_simulated_pipeline_rank_is_the_real_rank():
    real = json.loads(run_mpi(4, [DRIVER], timeout=300).stdout.strip().splitlines()[-1])
    for case, ranks in real.items():                             # the stages differ: a wrong rank would show
        assert ranks[0] != ranks[-1], case
    for rank in range(4):
        sim = json.loads(simulate([DRIVER, rank]).stdout.strip().splitlines()[-1])
        for case, ranks in real.items():
            assert sim[case] == ranks[rank], (case, rank)


def test_cli_simulated_pipeline_rank_reports_its_stage(tmp_path):
    flags = [*GPT, "--pp", "2", "--stage", "2", "--micro-batches", "2", "--batch", "8", "--steps", "3"]
    run_mpi(4, ["-m", "zerompi.train", *flags, "--metrics-json", tmp_path / "real.json"], timeout=240)
    real = json.loads((tmp_path / "real.json").read_text())
    for rank, stage in ((1, 0), (2, 1)):
        out = tmp_path / f"sim{rank}.json"
        proc = simulate(["-m", "zerompi.train", "--simulate-world", 4, "--simulate-rank", rank, *flags,
                         "--metrics-json", out])
        sim = json.loads(out.read_text())
        for kind, per in real["pp_bytes_per_step"].items():     # its own stage's messages; the others unknown
            assert sim["pp_bytes_per_step"][kind] == [b if s == stage else None for s, b in enumerate(per)], kind
            assert sim["pp_theory_bytes_per_step"][kind][stage] == real["pp_theory_bytes_per_step"][kind][stage]
        assert (sim["params"], sim["world_size"]) == (real["params"], 4)
        assert sim["final_params_sha256"] is None and sim["bubble_fraction"] is None
        s = sim["simulated"]
        assert (s["rule"], s["rank"], s["world_size"]) == (RULE, rank, 4)
        assert s["measured"]["model_state_bytes"] == s["estimate"]["model_state_bytes"] == sim["memory_bytes"]["total"]
        assert s["measured"]["buffer_bytes"] == s["estimate"]["buffer_bytes_best_case"]
        assert "SIMULATED: this one process is rank" in proc.stdout and RULE in proc.stdout
        steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
        words = "not a real run's loss" if stage == 1 else "simulated rank of stage 0: no loss is computed there"
        assert len(steps) == 3 and all(words in line for line in steps), proc.stdout
        assert "measured beside zerompi.estimate" in proc.stdout and "peak RSS" in proc.stdout
        # the rule, seen: the last stage receives zeros (activations and the tied weight's value), so its logits are
        # 0 and every loss -- its own, held-out too -- is log(vocab); stage 0 computes none
        want = math.log(32) if stage == 1 else 0.0
        assert all(abs(v - want) < 1e-6 for v in sim["losses"] + [v for _, v in sim["val_losses"]]), sim["losses"]
    # the stage-1 rank holds the last chunk: a real rank's memory is at most the mesh's maximum
    assert sim["memory_bytes"]["total"] <= real["memory_bytes"]["total"]


@pytest.mark.parametrize("n,rank,stage,chunks", [(512, 300, 1, 1), (512, 7, 2, 2), (4096, 4095, 3, 1),
                                                 (4096, 2000, 3, 2)])
def test_simulated_pipeline_rank_equals_the_estimate_to_the_byte(tmp_path, n, rank, stage, chunks):
    """Four stages of n / 4 data-parallel ranks: the rank's chunks (two per stage: the interleaved schedule, whose
    engines share the stage's communicator) against the estimate of their layouts: the buffers of its cap of pending
    reductions (the stand-ins' collectives arrive when the rank waits; two chunks' buckets reach it)."""
    out = tmp_path / "m.json"
    schedule = ["--schedule", "interleaved", "--chunks", chunks] if chunks > 1 else []
    simulate(["-m", "zerompi.train", "--simulate-world", n, "--simulate-rank", rank, "--stage", stage, "--pp", 4,
              "--micro-batches", 4, "--batch", n, "--n-layer", 8, "--d-model", 64, "--n-head", 2, "--seq-len", 16,
              "--steps", 2, "--eval-every", 0, "--progress", "lines", "--metrics-json", out, *schedule])
    s = json.loads(out.read_text())["simulated"]
    est, got = s["estimate"], s["measured"]
    assert got["model_state_bytes"] == est["model_state_bytes"]
    assert got["buffer_bytes"] == est["buffer_bytes"]
    assert got["comm_bytes_per_step"] == sum(est["comm_bytes_per_step_by_level"].values())


# ---- one sequence-parallel rank, real and simulated ---------------------------------------------------------
@pytest.mark.parametrize("mesh", [["--sp", "2"], ["--sp", "2", "--tp", "2", "--stage", "3", "--n-head", "4"]])
def test_cli_simulated_sequence_parallel_rank_is_the_real_rank(tmp_path, mesh):
    flags = [*GPT, *mesh, "--batch", "4", "--steps", "2", "--seq-len", "32"]
    run_mpi(4, ["-m", "zerompi.train", *flags, "--metrics-json", tmp_path / "real.json"], timeout=240)
    real = json.loads((tmp_path / "real.json").read_text())
    for rank in (1, 2):
        out = tmp_path / f"sim{rank}.json"
        simulate(["-m", "zerompi.train", "--simulate-world", 4, "--simulate-rank", rank, *flags, "--metrics-json", out])
        sim = json.loads(out.read_text())
        for key in ("memory_bytes", "peak_buffer_bytes", "activation_bytes", "comm_bytes_per_step",
                    "comm_bytes_per_step_by_level", "params"):
            assert sim[key] == real[key], (key, rank)
        for key in ("bytes_per_step", "heads_per_rank", "chunk"):
            assert sim["sequence_parallel"][key] == real["sequence_parallel"][key], (key, rank)
        assert sim["simulated"]["measured"]["model_state_bytes"] == sim["simulated"]["estimate"]["model_state_bytes"]


def test_a_mesh_the_simulated_world_cannot_divide_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "zerompi.train", "--simulate-world", "6", "--pp", "4",
                           "--micro-batches", "4", "--n-layer", "4", "--steps", "1"],
                          capture_output=True, text=True, timeout=120, env=mpi_env(), cwd=str(ROOT))
    one_line(proc, 2, "pp=4 does not divide the 6 ranks")
