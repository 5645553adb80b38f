"""Errors a user can act on, and the rule that one failing rank ends the whole job."""
import os
import sys
import traceback


class ConfigError(ValueError):
    """Bad user input: printed as one line and the process exits with status 2."""


class UsageError(RuntimeError):
    """The engine was driven in a wrong order (step before all gradients, closed engine...)."""


def check(cond: bool, message: str) -> None:
    """Raise ConfigError(message) unless cond holds."""
    if not cond:
        raise ConfigError(message)


def install_abort_hook(comm=None) -> None:
    """Make an uncaught exception on any rank end every rank of the job.

    mpi4py leaves the other ranks spinning in their next collective when one rank
    raises; this hook prints the traceback with the rank and calls MPI Abort.
    ConfigError is printed as one line and aborts with status 2.
    """
    from mpi4py import MPI

    comm = comm or MPI.COMM_WORLD
    previous = sys.excepthook

    def hook(kind, value, tb):
        rank = comm.Get_rank()
        if issubclass(kind, ConfigError):
            sys.stderr.write(f"zerompi: error: {value}\n")
            code = 2
        elif issubclass(kind, KeyboardInterrupt):
            previous(kind, value, tb)
            code = 130
        else:
            sys.stderr.write(f"zerompi: rank {rank} failed:\n")
            sys.stderr.write("".join(traceback.format_exception(kind, value, tb)))
            code = 1
        sys.stderr.flush()
        sys.stdout.flush()
        if comm.Get_size() > 1:
            comm.Abort(code)
        os._exit(code)

    sys.excepthook = hook
