"""The engine used as a library, misused: arguments that ranks disagree on, and values outside what is
allowed. Every case must end every rank with the same one line naming the values (exit status 2),
never hang and never give a silent result (driver: tests/drivers/library_misuse.py)."""
import json

import pytest

from tests.mpirun import ROOT, no_python_noise, run_mpi, zerompi_lines

DRIVER = ROOT / "tests" / "drivers" / "library_misuse.py"


def stopped(n, case, *args):
    """Every rank printed the same one zerompi line and the job exited with status 2; returns the line."""
    proc = run_mpi(n, [DRIVER, case, *args], timeout=60, check=False)
    lines = zerompi_lines(proc.stderr)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert lines and len(set(lines)) == 1, proc.stderr
    no_python_noise(proc.stderr)
    assert "finished" not in proc.stdout, proc.stdout
    return lines[0]


# ---- save(): every rank must pass the same blocking and keep_last ------------------------------
def test_save_with_blocking_on_one_rank_only_stops_every_rank(tmp_path):
    line = stopped(2, "save_blocking", tmp_path / "ck")
    assert "blocking=True on rank 0, blocking=False on rank 1" in line, line


def test_save_with_different_keep_last_stops_every_rank(tmp_path):
    line = stopped(2, "save_keep", tmp_path / "ck")
    assert "keep_last=1 on rank 0, keep_last=2 on rank 1" in line, line


def test_keep_last_zero_is_refused(tmp_path):
    line = stopped(2, "save_keep0", tmp_path / "ck")
    assert "keep_last=0" in line and "None" in line, line


# ---- tensor parallelism: what the TP ranks must agree on, and tp_split's values -----------------
@pytest.mark.parametrize("n", [2, 4])
def test_config_differing_between_tp_ranks_stops_every_rank(n):
    line = stopped(n, "tp_lr")
    assert "zero.lr = 0.1 on rank" in line and "0.2 on rank" in line, line


def test_tp_split_differing_between_tp_ranks_stops_every_rank():
    line = stopped(2, "tp_split_rank")
    assert "tp_split" in line and "rank 0" in line and "rank 1" in line, line


def test_replicated_initial_values_differing_between_tp_ranks_stop_every_rank():
    line = stopped(2, "tp_init")
    assert "'b'" in line and "rank 0" in line and "rank 1" in line, line


def test_step_lr_differing_between_tp_ranks_stops_every_rank():
    line = stopped(2, "tp_step_lr")
    assert "lr=0.1 on rank 0, lr=0.3 on rank 1" in line, line


@pytest.mark.parametrize("case,needle", [("tp_axis", "axis 2"), ("tp_groups", "3"), ("tp_int", "(axis, groups)")])
def test_bad_tp_split_values_are_refused_in_one_line(case, needle):
    line = stopped(2, case)
    assert "tp_split" in line and "'w'" in line and needle in line, line


# ---- qgZ in fp16: an overflow must cost one step, not every step after it ------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_quantized_gradients_recover_from_an_overflow(stage):
    # Stages 0/1 reduce in place in the whole local gradient, whose bucket padding the quantized sum wrote
    # NaN into (a block's scale was inf): later steps sent it again and were all skipped.
    proc = run_mpi(2, [DRIVER, "qgz_overflow", stage], timeout=60)
    assert proc.stdout.count("skipped [True, False, False, False]") == 2, proc.stdout


# ---- the trace with tensor parallelism: one file holding every rank of the mesh ------------------
def test_tp_trace_holds_every_rank(tmp_path):
    # Each data-parallel group's rank 0 wrote its own group's events to the same path: the file held the
    # ranks of one group (whichever wrote last), numbered within it.
    path = tmp_path / "trace.json"
    run_mpi(4, [DRIVER, "trace_tp", path], timeout=60)
    other = json.loads(path.read_text())["otherData"]["zerompi"]
    assert other["ranks"] == 4 and other["ranks_in_file"] == [0, 1, 2, 3], other
    assert sorted({e["pid"] for e in json.loads(path.read_text())["traceEvents"]}) == [0, 1, 2, 3]


# ---- tensor-parallel checkpoints: every TP rank must restore the same step ----------------------
def test_tp_load_of_pieces_of_different_steps_stops_every_rank(tmp_path):
    ckpt = tmp_path / "ck"
    run_mpi(2, [DRIVER, "ckpt_tp_save", ckpt], timeout=60)
    assert run_mpi(2, [DRIVER, "ckpt_tp_load", ckpt], timeout=60).stdout.count("loaded") == 2
    (ckpt / "tp1-of-2" / "latest").write_text("step_000002")   # as if TP rank 1's step 4 was never published
    line = stopped(2, "ckpt_tp_load", ckpt)
    assert "would restore different steps" in line and "(step 4) on rank 0" in line and "(step 2) on rank 1" in line
    (ckpt / "tp1-of-2" / "latest").write_text("step_000004")
    line = stopped(2, "ckpt_tp_load_split", ckpt)     # the same shapes, cut another way: loaded silently
    assert "ranks 0-1 was saved with tp_split={'w': [1, 1]}, this engine has tp_split={'w': [0, 1]}" in line, line


# ---- bf16: a non-finite gradient stops the job, and the message names bf16 ----------------------
def test_bf16_non_finite_gradient_names_bf16():
    import numpy as np

    from zerompi import ZeroConfig, ZeroEngine
    from zerompi.errors import NonFiniteError
    engine = ZeroEngine([("a", {"w": np.ones(8, np.float32)})], ZeroConfig(stage=1, dtype="bf16"))
    engine.grads_ready(0, {"w": np.full(8, np.nan, np.float32)})
    with pytest.raises(NonFiniteError, match="bf16 has no loss scale to lower"):
        engine.step()
    engine.close()


# ---- after close(): every reader of the master says the engine is closed ----------------------
@pytest.mark.parametrize("method", ["full_parameters", "gather_master", "unpadded_master"])
def test_master_readers_after_close_are_usage_errors(method):
    import numpy as np

    from zerompi import UsageError, ZeroConfig, ZeroEngine
    engine = ZeroEngine([("a", {"w": np.ones(8, np.float32)})], ZeroConfig(stage=2, dtype="fp32"))
    engine.close()
    with pytest.raises(UsageError, match="this engine was closed"):   # gather_master raised KeyError: 'master'
        getattr(engine, method)()


def test_engine_argument_error_on_one_rank_ends_the_job():
    # The abort hook was installed after the argument checks: the rank that raised exited alone and the
    # others waited in the start-up collectives (a hang past the watchdog's timeout).
    proc = run_mpi(2, [DRIVER, "split_one_rank"], timeout=60, check=False)
    assert proc.returncode != 0 and "tp_split given without tensor parallelism" in proc.stderr, proc.stderr


def test_paths_may_be_pathlib_paths(tmp_path):
    from zerompi import ZeroConfig
    cfg = ZeroConfig(stage=2, trace=tmp_path / "t.json", offload_optimizer="nvme", offload_dir=tmp_path)
    assert cfg.trace == str(tmp_path / "t.json") and cfg.offload_dir == str(tmp_path)   # refused as "not a path"
