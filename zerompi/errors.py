"""Errors a user can act on, and the rule that one failing rank ends the whole job."""
import argparse
import os
import sys
import time
import traceback
from typing import Optional


class ConfigError(ValueError):
    """Bad user input: printed as one line and the process exits with status 2."""


class UsageError(RuntimeError):
    """The engine was driven in a wrong order (step before all gradients, closed engine...)."""


class JobError(Exception):
    """Raised on every rank at the same point, from values the ranks agreed on (an all-reduce),
    so no rank is left waiting in a collective: the CLI prints it once and every rank exits.
    The CLI checks that they did (:func:`end_together`): one raised on some ranks only ends the
    job within ERROR_AGREEMENT_S with that rank's line."""


class MismatchError(JobError, ConfigError):
    """The ranks were started with different configurations or models (exit status 2)."""


class AgreedConfigError(JobError, ConfigError):
    """Bad input that every rank finds at the same point, from values the ranks have agreed on (a
    --no-decay pattern that matches no parameter of the agreed layout): printed once, exit status 2."""


class NonFiniteError(JobError, RuntimeError):
    """Non-finite gradients that the step cannot skip (fp32, or too many consecutive fp16 skips)."""


class OutputError(Exception):
    """An output file (metrics, records) could not be written at the end of a run whose work is
    done: printed as one line that says what was kept, exit status EXIT_OUTPUT."""


class HelpRequested(Exception):
    """``--help`` on a rank of an MPI tool: carries the usage text, printed once every rank has
    reached the start-up agreement (:func:`agree_on_start`), so no rank leaves before the others."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


class OneLineParser(argparse.ArgumentParser):
    """The tools' command lines: a bad argument is one ConfigError line (exit status 2), not
    argparse's usage dump."""

    def error(self, message):
        raise ConfigError(message)


class RankParser(OneLineParser):
    """The MPI tools' command lines (train, bench): ``--help`` raises HelpRequested, printed once
    every rank has reached the start-up agreement."""

    def print_help(self, file=None):
        raise HelpRequested(self.format_help())


EXIT_TIMEOUT = 3   # exit status of a job a collective watchdog aborted (docs/failures.md)
EXIT_OUTPUT = 1    # the work is done, but an output file could not be written (docs/failures.md)
EXIT_CLOSED_STDOUT = 141   # stdout was closed under a tool (``| head -1``): the shell's status for SIGPIPE
START_TIMEOUT_S = 30.0     # seconds the ranks wait for each other in the start-up agreement
ABORT_GRACE_S = 3.0        # seconds MPI Abort may take before the process exits by itself
ERROR_AGREEMENT_S = 5.0    # seconds a rank that caught a job error waits for every rank to report one too


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
        if issubclass(kind, BrokenPipeError):     # stdout closed under us (``| head``): leave quietly
            code = quiet_exit_on_closed_stdout()
        elif issubclass(kind, (ConfigError, JobError)):
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


_AT_ABORT: list = []   # callables abort_job runs first (engine/trace.py: this rank's events are written)


def at_abort(fn, add: bool = True) -> None:
    """Have :func:`abort_job` call ``fn()`` before it ends the job (its errors are ignored);
    ``add=False`` takes it off again."""
    if add:
        _AT_ABORT.append(fn)
    elif fn in _AT_ABORT:
        _AT_ABORT.remove(fn)


def abort_job(comm, code: int) -> None:
    """End every rank of ``comm``'s job now with exit status ``code``; never returns.

    MPI Abort when it is safe from this thread (the main thread, or MPI_THREAD_MULTIPLE);
    otherwise this process exits at once, and mpiexec ends the others when it sees that.
    What :func:`at_abort` registered runs first.
    """
    import threading

    from mpi4py import MPI

    for fn in list(_AT_ABORT):
        try:
            fn()
        except Exception:          # the abort matters more than what a hook could not do
            pass
    sys.stderr.flush()
    sys.stdout.flush()
    if comm.Get_size() > 1:
        # mpiexec forwards this rank's output through a pipe; an abort tears the job down at
        # once and was seen to drop the traceback just written. Give the forwarder a moment.
        time.sleep(0.3)
    safe = threading.current_thread() is threading.main_thread() or MPI.Query_thread() == MPI.THREAD_MULTIPLE
    if comm.Get_size() > 1 and safe:
        # MPI Abort asks the launcher to end the job; when the launcher cannot be reached (a
        # node cut off: Open MPI's daemon waits on its link) it never returns: exit by itself then.
        timer = threading.Timer(ABORT_GRACE_S, os._exit, (code,))
        timer.daemon = True
        timer.start()
        comm.Abort(code)
    os._exit(code)


def quiet_exit_on_closed_stdout() -> int:
    """After a BrokenPipeError on stdout: point stdout at /dev/null, so that Python's own flush at
    exit cannot raise again, and return EXIT_CLOSED_STDOUT (the status of a tool SIGPIPE ends)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EXIT_CLOSED_STDOUT


def agree_on_errors(comm, error, prog: str, timeout_s: float = START_TIMEOUT_S) -> bool:
    """After every rank validated its input: True when any rank found an error (rank 0 has
    printed it as one line; the caller exits 2). :func:`agree_on_start` without ``--help``."""
    return agree_on_start(comm, error, prog, timeout_s) is not None


_REPORT_TAG, _VERDICT_TAG = 0x7A51, 0x7A52   # the start-up agreement's messages (COMM_WORLD, point to point)
_ERROR_TAG = 0x7A53                          # end_together's messages


def end_together(comm, error: BaseException, prog: str, timeout_s: Optional[float] = None) -> None:
    """Return once every rank of ``comm`` has caught an error too, else end the job with this one.

    ``error``: what this rank caught and expects every rank to raise at the same point (a JobError, a
    CheckpointError), so that the caller prints it once and every rank exits. Whatever its class, it
    may have been raised on this rank alone (a read of this rank's own file failed): the others then
    wait in a collective, and only an abort frees them. So every rank that calls this reports to every
    other rank and waits ``timeout_s`` for all their reports; when one is missing, it prints its own
    line, ``PROG: error (rank R): ...``, and ends the job with the error's status (2 for a
    ConfigError, else 1). ``timeout_s`` None: ERROR_AGREEMENT_S. A second call for the same error
    returns at once.
    """
    if getattr(error, "zerompi_together", False) or comm.Get_size() == 1:
        return
    if getattr(comm, "simulated", False):     # comm/simulated_world: the stand-ins mirror this rank, so raised it too
        error.zerompi_together = True
        return
    timeout_s = ERROR_AGREEMENT_S if timeout_s is None else timeout_s
    rank, size = comm.Get_rank(), comm.Get_size()
    requests = [comm.isend(rank, dest=r, tag=_ERROR_TAG) for r in range(size) if r != rank]
    heard, deadline = set(), time.monotonic() + timeout_s
    from mpi4py import MPI
    status = MPI.Status()
    while len(heard) < size - 1:
        if comm.Iprobe(source=MPI.ANY_SOURCE, tag=_ERROR_TAG, status=status):
            heard.add(comm.recv(source=status.Get_source(), tag=_ERROR_TAG))
        elif time.monotonic() > deadline:
            missing = [r for r in range(size) if r != rank and r not in heard]
            raised_on = _ranks(sorted(heard | {rank}))
            sys.stderr.write(f"{prog}: error (rank {rank}): {error} ({_ranks(missing)} did not raise it within "
                             f"{timeout_s:g} s: it was raised on {raised_on} only; ending the job)\n")
            abort_job(comm, 2 if isinstance(error, ConfigError) else 1)
        else:
            time.sleep(0.002)
    MPI.Request.waitall(requests)
    error.zerompi_together = True


def agree_on_start(comm, error, prog: str, timeout_s: float = START_TIMEOUT_S) -> Optional[int]:
    """The ranks agree whether the job may start: None when it may, else the exit status every rank
    returns (2 on an error; 0 when every rank was given ``--help`` and rank 0 printed it once).

    ``error``: this rank's one-line message, None, or a HelpRequested. ``prog`` names the program
    ("zerompi.train"): ranks that run different programs are an error (an MPMD launch of train
    beside bench would otherwise pair unrelated collectives). Every rank reports to rank 0, which
    prints the one line (naming the rank when they differ) and sends the verdict back.

    Timed, as no other start-up step can be: rank 0 waits ``timeout_s`` for every report, the
    others twice that for the verdict (ranks above 1 a second more, so that one line is printed);
    then the rank that waits prints which rank never came (it exited or hangs) and aborts the
    job with status 2.
    """
    from mpi4py import MPI
    help_text = error.text if isinstance(error, HelpRequested) else None
    mine = (prog, help_text is not None, None if error is None or help_text is not None else str(error))
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank != 0:
        request = comm.isend(mine, dest=0, tag=_REPORT_TAG)
        later = min(rank - 1, 1)          # if rank 0 never answers, rank 1 says so; its abort ends the others
        _poll(comm, 0, _VERDICT_TAG, time.monotonic() + 2 * timeout_s + later, prog,
              lambda: f"rank 0 sent no start-up verdict within {2 * timeout_s:g} s (it exited or hangs)")
        verdict = comm.recv(source=0, tag=_VERDICT_TAG)
        request.wait()
        return verdict
    reports = {0: mine}
    status, deadline = MPI.Status(), time.monotonic() + timeout_s
    while len(reports) < size:
        source = _poll(comm, MPI.ANY_SOURCE, _REPORT_TAG, deadline, prog, lambda: _missing(reports, size, timeout_s),
                       status)
        reports[source] = comm.recv(source=source, tag=_REPORT_TAG)
    verdict, line = _judge([reports[r] for r in range(size)], prog)
    requests = [comm.isend(verdict, dest=r, tag=_VERDICT_TAG) for r in range(1, size)]
    if verdict == 0:
        sys.stdout.write(help_text or "")
        sys.stdout.flush()
    elif line:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    MPI.Request.Waitall(requests)
    return verdict


def _poll(comm, source: int, tag: int, deadline: float, prog: str, why, status=None) -> int:
    """Wait until a message from ``source`` with ``tag`` is there (returns its source), or
    print ``why()`` and abort the job with status 2 at ``deadline``."""
    while not comm.Iprobe(source=source, tag=tag, status=status):
        if time.monotonic() > deadline:
            sys.stderr.write(f"{prog}: error: {why()}; start every rank with the same program and flags\n")
            abort_job(comm, 2)
        time.sleep(0.002)
    return source if status is None else status.Get_source()


def _missing(reports, size: int, timeout_s: float) -> str:
    gone = [r for r in range(size) if r not in reports]
    return f"{_ranks(gone)} did not reach the start-up agreement within {timeout_s:g} s (exited or hangs)"


def _judge(reports, prog: str):
    """(verdict, line) from every rank's (program, asked for help, message): see agree_on_start."""
    programs = {}
    for r, (name, _, _) in enumerate(reports):
        programs.setdefault(name, []).append(r)
    if len(programs) > 1:
        which = ", ".join(f"{name} on {_ranks(rs)}" for name, rs in programs.items())
        return 2, f"{prog}: error: the ranks run different programs: {which}; start every rank with the same program"
    errors = [(r, m) for r, (_, _, m) in enumerate(reports) if m is not None]
    if errors:
        rank, msg = errors[0]
        where = "" if all(m == msg for _, _, m in reports) else f" (rank {rank})"
        return 2, f"{prog}: error{where}: {msg}"
    helped = [r for r, (_, asked, _) in enumerate(reports) if asked]
    if helped and len(helped) == len(reports):
        return 0, None
    if helped:
        return 2, (f"{prog}: error: --help was given to {_ranks(helped)} only; give it to every rank, "
                   "or to none to run the job")
    return None, None


def _ranks(ranks) -> str:
    """[1] -> 'rank 1'; [0, 2] -> 'ranks 0, 2'."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)
