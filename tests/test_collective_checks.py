"""The public collectives on their own (a bare Communicator, a Mesh): the same rules as in an engine.

A rank that raises or hangs outside any engine must end the job (the abort hook, the collective
watchdog: a Communicator made on its own guards its job, comm/watchdog.py: guard_job). Driver:
tests/drivers/collectives.py."""
import pytest

from tests.mpirun import ROOT, run_mpi, zerompi_lines

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
