"""Errors a user can act on, and the rule that one failing rank ends the whole job."""
import os
import sys
import time
import traceback


class ConfigError(ValueError):
    """Bad user input: printed as one line and the process exits with status 2."""


class UsageError(RuntimeError):
    """The engine was driven in a wrong order (step before all gradients, closed engine...)."""


class JobError(Exception):
    """Raised on every rank at the same point, from values the ranks agreed on (an all-reduce),
    so no rank is left waiting in a collective: the CLI prints it once and every rank exits."""


class MismatchError(JobError, ConfigError):
    """The ranks were started with different configurations or models (exit status 2)."""


class NonFiniteError(JobError, RuntimeError):
    """Non-finite gradients that the step cannot skip (fp32, or too many consecutive fp16 skips)."""


EXIT_TIMEOUT = 3   # exit status of a job a collective watchdog aborted (docs/failures.md)


def check(cond: bool, message: str) -> None:
    """Raise ConfigError(message) unless cond holds."""
    if not cond:
        raise ConfigError(message)


def install_abort_hook(comm=None) -> None:
    """Make an uncaught exception on any rank end every rank of the job.

    mpi4py leaves the other ranks spinning in their next collective when one rank
    raises; this hook prints the traceback with the rank and calls MPI Abort.
    ConfigError is printed as one line and aborts with status 2. Installing it again
    (every engine does) changes nothing.
    """
    from mpi4py import MPI

    if getattr(sys.excepthook, "zerompi_abort_hook", False):
        return
    comm = comm or MPI.COMM_WORLD
    previous = sys.excepthook

    def hook(kind, value, tb):
        rank = comm.Get_rank()
        if issubclass(kind, (ConfigError, JobError)):
            sys.stderr.write(f"zerompi: error: {value}\n")
            code = 2 if issubclass(kind, ConfigError) else 1
        elif issubclass(kind, KeyboardInterrupt):
            previous(kind, value, tb)
            code = 130
        else:
            sys.stderr.write(f"zerompi: rank {rank} failed:\n")
            sys.stderr.write("".join(traceback.format_exception(kind, value, tb)))
            code = 1
        sys.stderr.flush()
        sys.stdout.flush()
        abort_job(comm, code)

    hook.zerompi_abort_hook = True
    sys.excepthook = hook


def abort_job(comm, code: int) -> None:
    """End every rank of ``comm``'s job now with exit status ``code``; never returns.

    MPI Abort when it is safe from this thread (the main thread, or MPI_THREAD_MULTIPLE);
    otherwise this process exits at once, and mpiexec ends the others when it sees that.
    """
    import threading

    from mpi4py import MPI

    sys.stderr.flush()
    sys.stdout.flush()
    if comm.Get_size() > 1:
        # mpiexec forwards this rank's output through a pipe; an abort tears the job down at
        # once and was seen to drop the traceback just written. Give the forwarder a moment.
        time.sleep(0.3)
    safe = threading.current_thread() is threading.main_thread() or MPI.Query_thread() == MPI.THREAD_MULTIPLE
    if comm.Get_size() > 1 and safe:
        comm.Abort(code)
    os._exit(code)


def agree_on_errors(comm, error, prog: str) -> bool:
    """After every rank validated its input: True when any rank found an error.

    One small collective (an allgather of each rank's message or None), so that ranks
    given different flags stop together instead of leaving others in a collective.
    Rank 0 prints the first message as one line, naming the rank when they differ.
    """
    errors = comm.allgather(error)
    if not any(errors):
        return False
    if comm.Get_rank() == 0:
        rank, msg = next((r, m) for r, m in enumerate(errors) if m)
        where = "" if all(m == msg for m in errors) else f" (rank {rank})"
        sys.stderr.write(f"{prog}: error{where}: {msg}\n")
        sys.stderr.flush()
    return True
