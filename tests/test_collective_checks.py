"""The public collectives on their own (a bare Communicator, a Mesh): the same rules as in an engine.

A rank that raises or hangs outside any engine must end the job (the abort hook, the collective
watchdog: a Communicator made on its own guards its job, comm/watchdog.py: guard_job); ranks that
pass one collective different lengths, dtypes or operations all stop with one MismatchError naming
the ranks and values (comm/signature.py). Driver: tests/drivers/collectives.py."""
import pytest

from tests.mpirun import ROOT, no_python_noise, run_mpi, zerompi_lines

DRIVER = ROOT / "tests" / "drivers" / "collectives.py"
LIMIT = 60        # these used to wait for ever


@pytest.mark.every_mpi
def test_a_rank_that_raises_beside_a_bare_communicator_ends_the_job():
    proc = run_mpi(2, [DRIVER, "bare_raise"], timeout=LIMIT, check=False)
    assert proc.returncode == 1 and "zerompi: rank 1 failed:" in proc.stderr, (proc.returncode, proc.stderr)
    assert "rank 1 raises outside any engine" in proc.stderr and "finished" not in proc.stdout


@pytest.mark.every_mpi
def test_a_rank_that_never_joins_a_mesh_all_reduce_is_named_by_the_watchdog():
    proc = run_mpi(2, [DRIVER, "mesh_hang"], timeout=LIMIT, check=False, env={"ZEROMPI_TIMEOUT_S": "2"})
    lines = [line for line in zerompi_lines(proc.stderr) if "collective timeout" in line]
    assert proc.returncode == 3 and lines, (proc.returncode, proc.stderr)
    assert lines[0].startswith("zerompi: rank 0: collective timeout") and "in tp_all_reduce" in lines[0], lines


# ---- ranks that pass different buffers: every rank stops with the same MismatchError --------------------
MISMATCHES = {   # case: what the one line must say (the driver's rank 0 and rank 1 disagree)
    "rs_length": ("reduce_scatter of 8 float32 on rank 0; reduce_scatter of 16 float32 on rank 1 "
                  "(they differ in: length)"),
    "ar_dtype": "all_reduce of 8 float32 on rank 0; all_reduce of 8 float16 on rank 1 (they differ in: dtype)",
    "op": "all_gather of 8 float32 on rank 0; reduce_scatter of 8 float32 on rank 1 (they differ in: operation)",
    "scalars": "sum_scalars of 2 float64 on rank 0; sum_scalars of 3 float64 on rank 1 (they differ in: length)",
    "quant": ("reduce_scatter of 128 float32 as int8 blocks of 64 on rank 0; reduce_scatter of 128 float32 as int4 "
              "blocks of 64 on rank 1 (they differ in: quantization)"),
    "tp_length": "tp_all_reduce of 8 float32 on rank 0; tp_all_reduce of 16 float32 on rank 1 (they differ in: length)",
    # after the same collectives agreed three times (their plans made, then started again: comm/checked.py)
    "plan_scale": ("reduce_scatter of 8 float32, scale 0.5 (bucket 0, step 3) on rank 0; reduce_scatter of 8 float32, "
                   "scale 0.25 (bucket 0, step 3) on rank 1 (they differ in: scale)"),
    "plan_step": ("all_gather of 8 float32 (bucket 1, step 3) on rank 0; all_gather of 8 float32 (bucket 1, step 4) "
                  "on rank 1 (they differ in: step)"),
    "plan_length": ("all_gather of 8 float32 (bucket 1, step 3) on rank 0; all_gather of 16 float32 (bucket 1, "
                    "step 3) on rank 1 (they differ in: length)"),
}


def stopped_together(n, case):
    """Every rank printed the same one line and the job exited 2 (a MismatchError is a ConfigError); returns it."""
    proc = run_mpi(n, [DRIVER, case], timeout=LIMIT, check=False)
    lines = zerompi_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == n and len(set(lines)) == 1, (proc.returncode, proc.stderr)
    no_python_noise(proc.stderr)
    assert "finished" not in proc.stdout, proc.stdout
    return lines[0]


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.every_mpi) if c in ("rs_length", "tp_length")
                                  else c for c in MISMATCHES])
def test_ranks_that_pass_different_buffers_all_stop_naming_them(case):
    """They got silently wrong sums (lengths), garbage (fp32 beside fp16), or (the TP all-reduce) an error on
    one rank and a hang on the other; under Open MPI a longer message than the buffer overran it."""
    line = stopped_together(2, case)
    assert line.startswith("zerompi: error: collective mismatch between ranks: " + MISMATCHES[case]), line


def test_a_two_level_collective_that_disagrees_ends_the_job():
    """Two nodes of 2 (simulated): rank 3 passes another length to the group's reduce-scatter. Its node
    stops at the first level with the line; the other node is ended by their abort."""
    proc = run_mpi(4, [DRIVER, "two_level"], timeout=LIMIT, check=False)
    lines = zerompi_lines(proc.stderr)
    assert proc.returncode == 2 and lines, (proc.returncode, proc.stderr)
    assert all("collective mismatch between ranks: reduce_scatter of 16 float32 on rank 2; reduce_scatter of 32 "
               "float32 on rank 3 (they differ in: length)" in line for line in lines), lines


@pytest.mark.every_mpi
def test_repeated_collectives_are_planned_once_and_give_the_oracles_values():
    """A bucket's reduce-scatter and all-gather repeat every step with the same buffers: each is made once
    (persistent requests) and started again, a new label every step; the values equal the float64 sums
    every step. A plan still in flight is not restarted: the second call gets a fresh exchange, both arrive.
    Beyond the plans kept, the oldest idle one is freed for each new one, and the values stay right."""
    proc = run_mpi(2, [DRIVER, "planned"], timeout=LIMIT, check=False)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    no_python_noise(proc.stderr)
    assert proc.stdout.count("plans 3") == 2, proc.stdout   # the two collectives and the in-flight key
