"""A save folder keeps what it holds (issue 29): a resume into another run's folder is refused as a
fresh run is; a resume into its own folder keeps the checkpoints of later steps unless --overwrite;
``latest`` carries the sha256 of the manifest it names (an edited pointer is refused, a pointer of
one line is followed and said to be unverified) and the readers say when later complete checkpoints
exist; a checkpoint whose every shard was written is published when the job fails before it could
(async save, then a failure in the next step), or by the next run into the folder.

Oracles: the files themselves (which checkpoints exist, what ``latest`` names) and the bytes of the
checkpoints the runs must not touch."""
import hashlib
import json
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.mpirun import one_line, run_mpi
from tests.test_checkpoint import SMALL, checkpoint_cli
from zerompi.checkpoint.pointer import latest_name

pytestmark = pytest.mark.every_mpi       # CI runs these under Open MPI too (.ci/run)

TRAIN = ["-m", "zerompi.train", *SMALL, "--stage", "2", "--optimizer-impl", "numpy"]
LIMIT = 90


def tree(folder):
    return sorted(p.name for p in folder.iterdir())


def digest(folder):
    """sha256 of every file under ``folder``, by relative path: what must stay as it was."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """A save folder with the checkpoints of steps 1, 2 and 3 of one run."""
    ck = tmp_path_factory.mktemp("three") / "ck"
    run_mpi(2, [*TRAIN, "--steps", "3", "--save-every", "1", "--save-dir", ck], timeout=LIMIT)
    assert tree(ck) == ["latest", "step_000001", "step_000002", "step_000003"]
    return ck


def copy(three, where):
    shutil.copytree(three, where)
    return where


def test_a_resume_into_another_runs_folder_is_refused(three, tmp_path):
    other = copy(three, tmp_path / "other")
    before = digest(other)
    proc = run_mpi(2, [*TRAIN, "--steps", "5", "--resume", three / "step_000002", "--save-dir", other], timeout=LIMIT,
                   check=False)
    line = one_line(proc, 2, "zerompi.train: error (rank 0): save_dir=", "already holds checkpoints",
                    f"of another run than the one --resume {three / 'step_000002'} continues", "--overwrite")
    assert "step_000003" in line and digest(other) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_resume_into_its_own_folder_keeps_the_later_steps(three, tmp_path, overwrite):
    ck = copy(three, tmp_path / "ck")
    later = {k: v for k, v in digest(ck).items() if k.startswith(("step_000002", "step_000003"))}
    flags = ["--overwrite"] if overwrite else []
    proc = run_mpi(2, [*TRAIN, "--steps", "3", "--save-every", "1", "--keep-last", "1", "--save-dir", ck,
                       "--resume", ck / "step_000001", *flags], timeout=LIMIT)
    assert "of later steps than the one resumed from (step 1): step_000002, step_000003" in proc.stdout
    if overwrite:                    # told: they go once the first checkpoint of this run is saved
        assert tree(ck) == ["latest", "step_000003"] and latest_name(ck) == "step_000003"
        return
    # --keep-last 1 kept this run's newest; the later steps of the run it continued are untouched, and the
    # checkpoints of the same steps are written beside them.
    assert tree(ck) == ["latest", "step_000002", "step_000003", "step_000003-1"], tree(ck)
    assert latest_name(ck) == "step_000003-1"
    assert {k: v for k, v in digest(ck).items() if k.startswith(("step_000002/", "step_000003/"))} == later


def test_latest_is_verified_and_later_checkpoints_are_named(three, tmp_path):
    ck = copy(three, tmp_path / "ck")
    pointer = (ck / "latest").read_text()
    assert pointer.splitlines()[0] == "step_000003" and pointer.splitlines()[1].startswith("sha256 ")
    (ck / "latest").write_text(pointer.replace("step_000003", "step_000001"))      # edited to an older one
    for proc in (checkpoint_cli("inspect", ck),
                 run_mpi(2, [*TRAIN, "--steps", "4", "--resume", ck], timeout=LIMIT, check=False)):
        one_line(proc, 2, "latest names 'step_000001' but carries the sha256 of another manifest.json",
                 "step_000001, step_000002, step_000003")
    (ck / "latest").write_text("step_000001\n")            # one line, by hand (or an older zerompi): followed
    proc = checkpoint_cli("inspect", ck)
    assert proc.returncode == 0, proc.stderr
    assert "carries no checksum of the manifest it names" in proc.stdout
    assert "holds complete checkpoints of later steps than step_000001, which" in proc.stdout
    assert "step_000002, step_000003; to use one, name it" in proc.stdout


@pytest.mark.parametrize("fault,dtype", [("raise@rank1:step3", "fp16"), ("nan@rank1:step3", "fp32")])
def test_an_async_save_whose_shards_are_written_is_published_when_the_next_step_fails(tmp_path, fault, dtype):
    """raise: the failing rank aborts the job (published by its abort hook); nan in fp32: every rank stops
    together (published by the rank whose write ends last)."""
    ck = tmp_path / "ck"
    proc = run_mpi(2, [*TRAIN, "--steps", "6", "--save-every", "2", "--async-save", "--dtype", dtype, "--save-dir", ck],
                   timeout=LIMIT, check=False, env={"ZEROMPI_FAULT": fault})
    # Published by the salvage ("published" on stdout), or, on a loaded machine, already by the background writer
    # during step 3, before the fault (its announcement comes after the step, which never ends): either way
    # latest names step 2 and nothing is left in a temporary folder.
    assert proc.returncode != 0, (proc.stdout, proc.stderr)
    seen = (tree(ck) if ck.is_dir() else None, proc.stdout[-2000:], proc.stderr[-2000:])   # what a failure shows
    assert latest_name(ck) == "step_000002" and [n for n in tree(ck) if n.startswith(".tmp")] == [], seen
    assert checkpoint_cli("inspect", ck).returncode == 0


def test_a_complete_unpublished_checkpoint_is_published_by_the_next_run(tmp_path):
    ck = tmp_path / "ck"
    common = [*TRAIN, "--save-every", "2", "--save-dir", ck]
    proc = run_mpi(2, [*common, "--steps", "4"], timeout=LIMIT, check=False,
                   env={"ZEROMPI_CHECKPOINT_CRASH": "after_shards@4:all"})    # killed before the rename
    assert proc.returncode != 0 and latest_name(ck) == "step_000002"
    note = checkpoint_cli("inspect", ck).stdout
    assert "holds a complete checkpoint of step 4 that was never published" in note, note
    proc = run_mpi(2, [*common, "--steps", "6", "--resume", ck], timeout=LIMIT)
    assert "published " in proc.stderr and "resumed from " + str(ck / "step_000004") in proc.stdout, proc.stdout
    assert tree(ck) == ["latest", "step_000002", "step_000004", "step_000006"]


@pytest.mark.parametrize("first,then", [(["--pp", "2"], []), ([], ["--pp", "2"])])
def test_overwrite_by_a_run_of_another_layout_replaces_all_of_the_old_run(tmp_path, first, then):
    """A pipelined run's part folders (pp{c}-of-{C}) replaced by an unpipelined run's --overwrite, and the
    reverse: nothing of the old run is left for a later --resume with its layout to continue."""
    ck = tmp_path / "ck"
    flags = [*TRAIN, "--depth", "4", "--micro-batches", "2", "--steps", "2", "--save-dir", ck]
    run_mpi(2, [*flags, *first], timeout=LIMIT)
    proc = run_mpi(2, [*flags, *then, "--overwrite"], timeout=LIMIT)
    assert "--overwrite: removed the earlier run's checkpoints" in proc.stdout, proc.stdout
    want = ["pp0-of-2", "pp1-of-2"] if then else ["latest", "step_000002"]
    assert [n for n in tree(ck) if not n.startswith(".")] == want
    proc = run_mpi(2, [*flags, *first, "--steps", "3", "--resume", ck], timeout=LIMIT, check=False)
    assert proc.returncode == 2 and "resumed from" not in proc.stdout, proc.stdout + proc.stderr
    proc = run_mpi(2, [*flags, *then, "--steps", "3", "--resume", ck], timeout=LIMIT)
    assert "resumed from " in proc.stdout, proc.stdout


def hold_lock(ck, code: str):
    """A process running ``code`` holds ck's lock (its pid and start time, as a job's rank 0 writes them)."""
    proc = subprocess.Popen([sys.executable, "-c", code])
    with open(f"/proc/{proc.pid}/stat") as f:
        start = f.read().rpartition(")")[2].split()[19]
    ck.mkdir()
    (ck / ".zerompi.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": proc.pid, "start": start,
                                                  "since": "2000-01-01 00:00:00"}))
    return proc


@pytest.mark.parametrize("holder", ["exiting", "exited"])
def test_a_run_right_after_a_crashed_one_is_not_refused_by_its_dying_rank(tmp_path, holder):
    """The lock of a job whose rank 0 is still exiting (Open MPI's mpiexec can return before it is gone) or has
    exited unreaped (a zombie): a run started at once waits for it (a bounded time), takes the lock over and
    runs, where it was refused as 'in use by another job'."""
    ck = tmp_path / "ck"
    proc = hold_lock(ck, "import time; time.sleep(2)" if holder == "exiting" else "pass")
    if holder == "exiting":
        threading.Thread(target=proc.wait, daemon=True).start()      # reaped once it ends, as by its launcher
    else:
        while open(f"/proc/{proc.pid}/stat").read().rpartition(")")[2].split()[0] != "Z":
            time.sleep(0.01)                                          # exited, not reaped: a zombie
    try:
        run = run_mpi(2, [*TRAIN, "--steps", "1", "--save-dir", ck], timeout=LIMIT)
        assert "took over the lock" in run.stderr and tree(ck) == ["latest", "step_000001"], run.stderr
    finally:
        proc.kill()
        proc.wait()
