"""A rank never outlives its job (docs/failures.md, "A rank never outlives its job").

Killing a job's launcher with SIGKILL (mpiexec, or a rank's own parent: Open MPI's prterun, MPICH's
hydra proxy) used to leave its ranks running with parent 1: for ever if they slept or waited, since
no watchdog covers a rank that waits for nothing (seen: 42 minutes, under Open MPI, after every run
of the suite). Every rank now looks at its parent (comm/launcher.py) and ends by itself; and the
tests kill the whole tree they start (tests/mpirun.py: kill_tree)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.mpirun import ROOT, kill_tree, mpi_env, mpiexec, rank_pids, run_tree, still_alive
from zerompi.comm.launcher import LAUNCHER_ENV, launched

SMALL = ["--model", "mlp", "--width", "16", "--depth", "2", "--batch", "4"]
LIMIT = 60     # seconds: what a job here may take at most; the ranks used to live for ever


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.every_mpi
def test_a_rank_whose_launcher_is_killed_ends_by_itself(tmp_path):
    """Rank 1 sleeps (the injected hang), rank 0 waits for it in a collective, the watchdog is 600 s
    away; then each rank's parent is killed with SIGKILL. Both ranks end by themselves."""
    out = tmp_path / "out.txt"
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "zerompi.train", *SMALL, "--steps", "3", "--timeout-s", "600"]
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True,
                                env=mpi_env({"ZEROMPI_FAULT": "hang@rank1:step2"}))
    ranks = {}
    try:
        ranks = rank_pids(proc.pid, 2, b"zerompi.train", LIMIT)
        end = time.monotonic() + LIMIT
        while "injected fault 'hang'" not in out.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < end, out.read_text(errors="replace")
            time.sleep(0.1)
        for parent in {_parent(pid) for pid in ranks.values()}:   # prterun (Open MPI) or hydra's proxy (MPICH)
            subprocess.run(["kill", "-9", str(parent)], check=True)
        left = still_alive(ranks.values(), LIMIT)
        assert not left, f"ranks {left} still run after their launcher was killed\n{out.read_text(errors='replace')}"
    finally:
        kill_tree(proc)
        for pid in still_alive(ranks.values(), 0):     # orphans no tree holds any more: never left running
            os.kill(pid, signal.SIGKILL)


def test_a_launcher_killed_on_a_timeout_takes_its_tree_with_it(tmp_path):
    """tests/mpirun.run_tree on a timeout: the child, its descendants, and orphans of its session (Open
    MPI's ranks once their launcher is gone: parent 1, still in its session) are all killed."""
    pids = tmp_path / "pids"
    script = f"sleep 1000 & echo $! >> {pids}; (sleep 1000 & echo $! >> {pids}) ; sleep 1000"   # the second: an orphan
    with pytest.raises(AssertionError, match="timed out after"):
        run_tree(["bash", "-c", script], timeout=2)
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2 and not still_alive(started, 5), started


def test_the_launcher_check_runs_only_under_a_launcher():
    """A program started by hand (a singleton, maybe under nohup) keeps running when its shell goes."""
    assert not launched({}) and not launched({"HOME": "/"})
    assert all(launched({k: "0"}) for k in LAUNCHER_ENV)
