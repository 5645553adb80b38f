"""A rank never outlives its job: the launcher check, beside the collective watchdog.

A rank's launcher (mpiexec's proxy under MPICH, ``prterun`` under Open MPI, ``slurmstepd``
under Slurm) is its parent process. When the launcher is killed (SIGKILL, an OOM kill, a lost
node), MPI does not tell the ranks: measured with Open MPI 5, a rank whose ``mpirun`` was
killed kept running with parent 1, for ever if it was asleep or waiting, since no watchdog
covers a rank that waits for nothing. The others' collectives would end it, but the others
may be gone too.

So every rank of a launched job runs one daemon thread per process that looks at its parent
every CHECK_INTERVAL_S; once the parent is another process than at the start (the kernel
hands an orphan to init or a subreaper), the rank prints one line and exits at once, whatever
its main thread is doing (computing, asleep, blocked in MPI), within about that interval.
Only under a launcher (its environment says so): a program started by hand as a single MPI
process has a shell for a parent, which may go while it runs on purpose (``nohup``).
"""
import os
import sys
import threading

CHECK_INTERVAL_S = 0.5     # seconds between looks at the parent process
EXIT_LAUNCHER_GONE = 1     # this rank's exit status when its launcher is gone (nobody is left to read it)
# set by MPICH, Open MPI, Slurm
LAUNCHER_ENV = ("PMI_RANK", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")

_watching: list = []       # the one thread of this process, once started


def launched(environ=os.environ) -> bool:
    """True when a launcher started this process (one of LAUNCHER_ENV is set)."""
    return any(k in environ for k in LAUNCHER_ENV)


def watch(rank: int, interval_s: float = CHECK_INTERVAL_S) -> bool:
    """Start this process's launcher check (once; later calls do nothing); True when it runs.
    ``rank``: this process's rank in the job (MPI.COMM_WORLD), named in the line."""
    if _watching or not launched():
        return bool(_watching)
    parent = os.getppid()
    thread = threading.Thread(target=_run, args=(parent, rank, interval_s), name="zerompi-launcher-check",
                              daemon=True)
    _watching.append(thread)
    thread.start()
    return True


def _run(parent: int, rank, interval_s: float) -> None:
    stop = threading.Event()
    while not stop.wait(interval_s):
        now = os.getppid()
        if now != parent:
            _leave(f"zerompi: rank {rank}: the launcher is gone (parent process {parent} exited, this rank's "
                   f"parent is now {now}); ending this rank\n")


def _leave(line: str) -> None:
    """Say why on stderr without waiting for a reader (the launcher forwarded it), then exit at once."""
    try:
        os.set_blocking(sys.stderr.fileno(), False)
        os.write(sys.stderr.fileno(), line.encode())
    except (OSError, ValueError, AttributeError):    # no stderr, or nobody reads it any more
        pass
    os._exit(EXIT_LAUNCHER_GONE)
