"""A simulated world (comm/simulated_world.py, train/simulated_run.py): one process as rank R of N.

Its memory and traffic must be rank R's in the real job: checked against a real 4-rank job rank by
rank (tests/drivers/simulated.py: flat, two levels, shard groups, quantized, hpZ, offload, tensor
parallel), through the CLI, and against zerompi.estimate to the byte at world sizes no job here
could run (N = 64, 512, 4096). The stand-in rule is in the output and the metrics; bad input is one
line and exit status 2."""
import json
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

import zerompi
from zerompi import Mesh, SimulatedWorld, ZeroConfig, ZeroEngine
from zerompi.comm.simulated_world import RULE
from zerompi.engine import lazy
from zerompi.errors import ConfigError, UsageError
from tests.mpirun import ROOT, mpi_env, one_line, run_mpi, zerompi_lines

DRIVER = ROOT / "tests" / "drivers" / "simulated.py"


# ---- the stand-ins' answers ---------------------------------------------------------------
def test_every_peer_mirrors_this_rank():
    w = SimulatedWorld(4, 2)
    assert (w.Get_rank(), w.Get_size(), w.allgather("x"), w.bcast(5), w.allreduce(3)) == (2, 4, ["x"] * 4, 5, 12)
    send = np.arange(8, dtype=np.float32)
    table = np.zeros((4, 8), np.float32)
    w.Allgather(send, table)
    assert (table == send).all()
    buf = np.arange(8, dtype=np.float16)
    w.Iallgather(MPI.IN_PLACE, [MPI.buffer(buf), 1, MPI.UINT16_T.Create_contiguous(2).Commit()]).Wait()
    assert buf.tolist() == [4, 5] * 4                           # every slice is this rank's (slice 2)
    recv = np.zeros((4, 2), np.float32)
    w.Alltoall(send.reshape(4, 2), recv)
    assert (recv == [4, 5]).all()
    with pytest.raises(UsageError, match="function of the rank"):
        w.Split(0, 2)


def test_groups_are_the_ranks_the_rule_names():
    mesh = Mesh(SimulatedWorld(8, 5), tp=2)                     # TP groups [4, 5], ZeRO group (dp x sp) [1, 3, 5, 7]
    assert (mesh.tp_rank, mesh.dp_rank, mesh.tp_mpi.members, mesh.zero_mpi.members) == (1, 2, [4, 5], [1, 3, 5, 7])
    assert SimulatedWorld(8, 5, node_size=2).shared_size == 2 and SimulatedWorld(8, 5).shared_size == 8
    for bad, word in (((4, 4), "out of range"), ((0, 0), "simulate_world=0"), ((6, 1, 4), "does not divide")):
        with pytest.raises(ConfigError, match=word):
            SimulatedWorld(*bad)


# ---- one rank, real and simulated -------------------------------------------------------------
def test_simulated_rank_is_the_real_rank():
    real = json.loads(run_mpi(4, [DRIVER], timeout=240).stdout.strip().splitlines()[-1])
    for rank in (1, 3):
        proc = subprocess.run([sys.executable, DRIVER, str(rank)], capture_output=True, text=True, timeout=240,
                              env=mpi_env(), cwd=str(ROOT))
        assert proc.returncode == 0, proc.stderr
        sim = json.loads(proc.stdout.strip().splitlines()[-1])
        for case, ranks in real.items():
            assert sim[case] == ranks[rank], (case, rank)


def test_cli_simulated_rank_reports_the_real_ranks_memory_and_traffic(tmp_path):
    flags = ["--stage", "3", "--steps", "2", "--batch", "8", "--n-layer", "2", "--eval-every", "0", "--no-overlap",
             "--node-size", "2", "--progress", "lines"]
    run_mpi(4, ["-m", "zerompi.train", *flags, "--metrics-json", tmp_path / "real.json"], timeout=240)
    proc = subprocess.run([sys.executable, "-m", "zerompi.train", "--simulate-world", "4", "--simulate-rank", "3",
                           *flags, "--metrics-json", tmp_path / "sim.json"], capture_output=True, text=True,
                          timeout=240, env=mpi_env(), cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    real, sim = (json.loads((tmp_path / f"{k}.json").read_text()) for k in ("real", "sim"))
    for key in ("memory_bytes", "peak_buffer_bytes", "activation_bytes", "comm_bytes_per_step",
                "comm_bytes_per_step_by_level", "comm_logical_bytes_per_step", "world_size"):
        assert sim[key] == real[key], key
    assert sim["simulated"]["rule"] == RULE and sim["simulated"]["world_size"] == 4
    assert sim["final_params_sha256"] is None
    assert sim["simulated"]["measured"]["model_state_bytes"] == sim["simulated"]["estimate"]["model_state_bytes"]
    assert "SIMULATED: this one process is rank 3 of 4" in proc.stdout and RULE in proc.stdout
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert steps and all("not a real run's loss" in line for line in steps)
    assert "measured beside zerompi.estimate" in proc.stdout and "peak RSS" in proc.stdout


@pytest.mark.parametrize("stage", [2, 3])
def test_cli_simulated_rank_holds_the_real_ranks_buffers_with_overlap(tmp_path, stage):
    """The default overlap over six buckets: the real ranks' reductions are still pending when the next buckets
    fill (stage 2: the cap's row, 2 pending; stage 3: less, its gathers' waits bring the reductions before them),
    and the simulated rank, whose stand-ins arrive when it waits, holds the same bytes."""
    flags = ["--stage", str(stage), "--steps", "2", "--batch", "8", "--n-layer", "4", "--bucket-mb", "0.05",
             "--loss-scale", "256", "--eval-every", "0", "--progress", "lines"]
    run_mpi(4, ["-m", "zerompi.train", *flags, "--metrics-json", tmp_path / "real.json"], timeout=240)
    proc = subprocess.run([sys.executable, "-m", "zerompi.train", "--simulate-world", "4", "--simulate-rank", "1",
                           *flags, "--metrics-json", tmp_path / "sim.json"], capture_output=True, text=True,
                          timeout=240, env=mpi_env(), cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    real, sim = (json.loads((tmp_path / f"{k}.json").read_text()) for k in ("real", "sim"))
    est = sim["simulated"]["estimate"]
    assert sim["peak_buffer_bytes"] == real["peak_buffer_bytes"] > est["buffer_bytes_best_case"]
    if stage == 2:
        assert sim["peak_buffer_bytes"] == est["buffer_bytes"]


@pytest.mark.parametrize("stage", [1, 2])
def test_stand_in_overflow_changes_neither_traffic_nor_memory(tmp_path, stage):
    """Rank 0 of 64 mirrors its shard 64 times, and at the default loss scale those stand-in gradients overflow
    fp16; the steps are applied anyway (zero gradients), so the all-gathers are sent: the same bytes and buffers as
    with a loss scale that does not overflow, and the formula's bytes."""
    runs, said = {}, {}
    for scale in ("65536", "256"):
        out = tmp_path / f"{scale}.json"
        proc = subprocess.run([sys.executable, "-m", "zerompi.train", "--simulate-world", "64", "--stage", str(stage),
                               "--batch", "64", "--steps", "3", "--d-model", "256", "--eval-every", "0", "--progress",
                               "lines", "--loss-scale", scale, "--metrics-json", out], capture_output=True, text=True,
                              timeout=240, env=mpi_env(), cwd=str(ROOT))
        assert proc.returncode == 0, proc.stderr
        runs[scale], said[scale] = json.loads(out.read_text()), proc.stdout
    hot, cool = runs["65536"], runs["256"]
    for m in (hot, cool):
        assert m["steps_applied"] == 3 and m["comm_bytes_per_step"] == m["comm_theory_bytes_per_step"]
    for key in ("comm_bytes_per_step", "peak_buffer_bytes", "memory_bytes"):
        assert hot[key] == cool[key], key
    assert hot["simulated"]["comm_by_op"]["all_gather"] == cool["simulated"]["comm_by_op"]["all_gather"]
    assert hot["simulated"]["stand_in_overflows"] > 0 == cool["simulated"]["stand_in_overflows"]
    assert "applied with zero gradients, not skipped" in said["65536"] and "zero gradients" not in said["256"]


# ---- at world sizes no job here could run ------------------------------------------------------
MODELS = {   # layer shapes: buckets of one length (the estimate's buffers are then reached exactly) ...
    "4 x 512^2 + a short one": [(512, 512)] * 4 + [(1000,)],
    "8 x 512^2": [(512, 512)] * 8,
    "3 x 1024 x 512": [(1024, 512)] * 3,
    "mixed": [(300, 1600), (1000,), (512, 2048), (64, 900)],   # ... and of four lengths: a bound, not reached
}


def _layers(shapes):
    stream = lazy.Stream(9)
    return [(f"l{i}", {f"w{i}": stream.normal(s, scale=0.01)}) for i, s in enumerate(shapes)]


def _two_steps(eng) -> int:
    """Two steps of constant gradients; the bytes the second sent (every collective but the scalars')."""
    lay = eng.layout
    for _ in range(2):
        before = eng.comm.total_bytes() - eng.comm.stats["sum_scalars"].bytes
        for i in range(lay.num_layers):
            with eng.unsharded(i):
                pass
        for i in reversed(range(lay.num_layers)):
            with eng.unsharded(i):
                pass
            eng.grads_ready(i, {n: np.full(lay.params[n].shape, 1e-3, np.float32) for n in lay.layer_params[i]})
        assert not eng.step().skipped
    return eng.comm.total_bytes() - eng.comm.stats["sum_scalars"].bytes - before


@pytest.mark.parametrize("n,rank", [(64, 0), (512, 300), (4096, 4095)])
def test_model_states_buffers_and_traffic_equal_the_estimate_to_the_byte(n, rank):
    for name, shapes in MODELS.items():                          # Ψ from 1.05 M to 2.1 M
        for stage in range(4):
            eng = ZeroEngine(_layers(shapes), ZeroConfig(stage=stage, dtype="fp16", bucket_mb=0.5),
                             SimulatedWorld(n, rank))
            sent = _two_steps(eng)
            row = zerompi.estimate(layout=eng.layout, ranks=n, dtype="fp16")["stages"][stage]
            report = eng.memory_report()
            case = (n, name, stage)
            assert report["measured"]["total"] == row["model_state_bytes"], case
            assert sent == sum(row["comm_bytes_per_step_by_level"].values()), case
            # Collectives arrive when the rank waits: stages 0-2 (no gathers to wait for) hold the cap's row; at
            # stage 3 a gather's wait brings the reductions started before it, as on a real rank: between the two.
            peak = report["peak_buffers"]["bytes"]
            if name == "mixed":                                   # four lengths: the rows are bounds
                assert peak <= row["buffer_bytes"], case
            elif stage == 3:
                assert row["buffer_bytes_best_case"] <= peak <= row["buffer_bytes"], case
            else:
                assert peak == row["buffer_bytes"], case
            eng.close()


def test_checkpoints_are_refused_on_a_simulated_world(tmp_path):
    eng = ZeroEngine(_layers(MODELS["mixed"]), ZeroConfig(stage=3), SimulatedWorld(8, 1))
    with pytest.raises(UsageError, match="simulated world"):
        eng.save(str(tmp_path / "ck"))
    eng.close()


# ---- bad input: one line, exit 2 ------------------------------------------------------------------
@pytest.mark.parametrize("flags,words", [
    (["--simulate-world", "4", "--simulate-rank", "4"], ["simulate_rank=4 is out of range", "0..3"]),
    (["--simulate-world", "3", "--batch", "8"], ["batch=8 does not split over 3"]),
    (["--simulate-world", "4", "--model", "mlp", "--width", "48", "--tp", "3"], ["tp=3 does not divide the 4 ranks"]),
    (["--simulate-rank", "1"], ["simulate_rank=1 needs simulate_world"]),
    (["--simulate-world", "4", "--save-dir", "ck"], ["save_dir='ck' is not available with simulate_world=4"]),
])
def test_bad_simulation_flags_are_one_line_and_exit_2(flags, words):
    proc = subprocess.run([sys.executable, "-m", "zerompi.train", "--steps", "1", *flags], capture_output=True,
                          text=True, timeout=120, env=mpi_env(), cwd=str(ROOT))
    one_line(proc, 2, *words)


def test_simulating_under_several_processes_is_one_line_and_exit_2():
    proc = run_mpi(2, ["-m", "zerompi.train", "--steps", "1", "--simulate-world", "8"], check=False, timeout=120)
    one_line(proc, 2, "simulate_world=8 runs one process as rank 0 of 8, and 2 were launched")


# ---- the fault injector in a simulated world ---------------------------------------------------
SIM = ["--simulate-world", "4", "--simulate-rank", "3", "--model", "mlp", "--width", "32", "--depth", "2",
       "--steps", "3", "--progress", "lines"]


def _simulate(fault: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerompi.train", *SIM, *flags], capture_output=True, text=True,
                          timeout=120, env=mpi_env({"ZEROMPI_FAULT": fault}), cwd=str(ROOT))


@pytest.mark.parametrize("fault", ["raise@rank1:step2", "hang@rank0:step2", "exit@rank2:step3"])
def test_a_fault_on_a_stand_in_rank_is_refused(fault):
    """Only rank 3 runs: a fault on a stand-in could never fire (it was accepted, and the run ended 0)."""
    rank = fault.split("@rank")[1][0]
    one_line(_simulate(fault), 2, f"ZEROMPI_FAULT='{fault}' names rank {rank}, a stand-in of the simulated "
                                  "world", "runs rank 3 alone); use rank3")


@pytest.mark.parametrize("point,where", [("", "the next collective at step 2"),
                                         (":metrics", "the final metrics' first collective at step 3")])
def test_a_hang_in_a_simulated_world_ends_as_the_real_worlds_watchdog_ends_it(point, where):
    """The hang slept forever (nothing else runs to time it out); now the rank's watchdog ends it: exit 3."""
    step = "step3" if point else "step2"
    proc = _simulate(f"hang@rank3:{step}{point}", "--timeout-s", "1")
    assert proc.returncode == 3, proc.stderr
    lines = zerompi_lines(proc.stderr)
    assert lines[0].startswith(f"zerompi: injected fault 'hang' on rank 3 at {step.replace('step', 'step ')}")
    assert lines[1].startswith("zerompi: rank 3: collective timeout: waited ") and where in lines[1], proc.stderr
    assert "the 3 stand-in ranks of this simulated world waited there for rank 3" in lines[1]


def test_a_nan_in_a_simulated_world_is_the_one_error_line():
    """It was the error and a traceback of end_together, which asked the stand-ins to report it."""
    one_line(_simulate("nan@rank3:step2", "--dtype", "fp32"), 1, "non-finite gradients at step 2")
