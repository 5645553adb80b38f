"""How a job ends on time: the collective watchdog and the stop signal.

The watchdog: when one rank dies, hangs or takes another path, every other rank waits
in its next collective forever (MPI has no timeouts). Each rank runs a daemon thread that
reads what its main thread is blocked in (a :class:`WaitRecord` the Communicator fills
around every wait) and, after ``timeout_s`` seconds in the *same* wait, prints the
operation, bucket, step and timeout and aborts the job. Only time spent waiting in a
collective counts: a long compute (a first step that compiles, a big model) never trips
it, and every rank that is stuck ends by itself, whichever rank caused it.

Blocking MPI calls made directly on the mpi4py communicator (checkpoint protocol, final
metrics, full parameters, the consistency check) go under the same record with
:func:`watched`, so no collective of a job is left untimed (docs/failures.md).

The stop signal: SIGTERM, SIGINT or SIGUSR1 (or a stop file appearing) sets a flag that the
training loop adds to its per-step all-reduce, so every rank stops after the same step
(docs/failures.md; README, "On a cluster", for what each launcher does with signals).
"""
import os
import signal
import sys
import threading
import time
import weakref
from collections import deque
from contextlib import nullcontext
from typing import Callable, Optional

from ..errors import EXIT_TIMEOUT, ConfigError, abort_job, install_abort_hook

DEFAULT_TIMEOUT_S = 300.0           # seconds one collective may wait before the job is aborted
TIMEOUT_ENV = "ZEROMPI_TIMEOUT_S"   # overrides DEFAULT_TIMEOUT_S (a --timeout-s flag overrides both)
MIN_INTERVAL_S = 0.001              # the thread never checks more often than this (a tiny timeout must not spin)
_fired: list = []                   # the message of every watchdog of this process that fired
HISTORY = 8                         # waits a WaitRecord remembers (the flight recorder's last collectives)


def default_timeout_s(environ=os.environ) -> float:
    """ZEROMPI_TIMEOUT_S when set (seconds, > 0), else DEFAULT_TIMEOUT_S.

    Read when a job starts (the train CLI's flag parsing, or a Watchdog given no timeout),
    never at import: a bad value is then one line and exit status 2, and tools that do not
    wait in collectives (estimate, checkpoint inspect) never read it.
    """
    text = environ.get(TIMEOUT_ENV)
    if text is None or text.strip() == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{TIMEOUT_ENV}={text!r} is not allowed; use a number of seconds > 0 "
                          f"(the longest one collective may wait; default {DEFAULT_TIMEOUT_S:g})")
    return value


class WaitRecord:
    """The collective this rank's main thread is blocked in now, read by the watchdog thread.

    ``with record(op, tag):`` around a blocking wait; ``current`` is ``(op, tag, since)``
    while inside (``since`` from time.monotonic) and None otherwise. Nested waits keep the
    outer one. One assignment per enter and exit (and an append to ``history``, the flight
    recorder comm/flight.py reports): cheap enough for every wait.

    ``watchdogs``: the open :class:`Watchdog` s of this record, oldest first; only the newest
    times it (a Communicator's own, then an engine's with its config's timeout over it).
    """

    __slots__ = ("current", "history", "watchdogs", "_next", "_depth", "__weakref__")

    def __init__(self):
        self.current = None   # (op, tag, since) while blocked, else None
        self.history = deque(maxlen=HISTORY)   # (op, tag) of the last waits left, oldest first
        self.watchdogs = []   # open watchdogs of this record, oldest first: the last one times it
        self._next = None     # (op, tag) of the wait about to be entered
        self._depth = 0       # nesting depth (the outermost wait is the one timed)

    def __call__(self, op: str, tag=None) -> "WaitRecord":
        self._next = (op, tag)
        return self

    def __enter__(self) -> None:
        if self._depth == 0:
            op, tag = self._next
            self.current = (op, tag, time.monotonic())
        self._depth += 1

    def __exit__(self, *exc) -> bool:
        self._depth -= 1
        if self._depth == 0:
            left = self.current[:2]
            if not self.history or self.history[-1] != left:   # a collective's test loop and its wait: once
                self.history.append(left)
            self.current = None
        return False


def describe_wait(op: str, tag, step: Optional[int]) -> str:
    """'reduce_scatter of bucket 2 at step 7' from a WaitRecord entry.

    ``tag``: None, a bucket index, or (bucket, step) as the engine labels its collectives;
    (None, step) for a wait outside any bucket, (None, None) for one the step does not name.
    Only a bare None or bucket index lets the watchdog's ``step()`` fill in the step.
    """
    bucket = None
    if isinstance(tag, tuple):
        bucket, step = tag
    elif tag is not None:
        bucket = tag
    where = f"{op} of bucket {bucket}" if bucket is not None else op
    return f"{where} at step {step}" if step is not None else where


def watched(comm, op: str, step: Optional[int] = None):
    """``with watched(comm, op, step):`` around a blocking MPI call made directly on the mpi4py
    communicator, so the collective watchdog times it and its message names ``op`` (at ``step``).

    ``comm``: a zerompi Communicator (its WaitRecord). A bare mpi4py communicator has none:
    the call is then not timed. ``step``: the step the message names, None for none.
    The call must release the GIL while it waits, or this thread never runs: buffer
    collectives and mpi4py's pickled bcast/gather/allgather do; its pickled allreduce and
    reduce do not (measured, docs/failures.md).
    """
    record = getattr(comm, "waiting", None)
    return nullcontext() if record is None else record(op, (None, step))


class Watchdog:
    """A daemon thread that aborts the job when ``record`` shows one wait longer than ``timeout_s``.

    ``step()`` names the current step for waits not labelled with one. ``abort(code)``
    ends the job (default: MPI Abort on ``mpi_comm``, or os._exit where that is unsafe).
    Checks every min(1 s, timeout_s / 10) (at least MIN_INTERVAL_S apart), so it fires within
    10% (or 1 s) of the timeout. ``timeout_s`` None: :func:`default_timeout_s`, read now.

    Several may watch one record (a Communicator's own, and an engine's over the same
    Communicator): the newest open one times it, the older ones wait until it is closed. The
    thread holds the record weakly: it ends once nothing else uses the record.
    """

    def __init__(self, record: WaitRecord, timeout_s: Optional[float], rank: int, mpi_comm=None,
                 step: Callable[[], Optional[int]] = lambda: None, abort: Optional[Callable[[int], None]] = None):
        self.peers = None                   # comm/flight.py's Peers: the other ranks' reports, once set
        self.stand_ins = 0                  # a simulated world's stand-in ranks (they wait for this one), or 0
        self.timeout_s = float(default_timeout_s() if timeout_s is None else timeout_s)   # seconds one wait may last
        self.rank = rank
        self.fired: Optional[str] = None    # the message, once it has fired
        self._record = weakref.ref(record)
        self._step = step
        self._abort = abort or (lambda code: abort_job(mpi_comm, code))
        self._stop = threading.Event()
        record.watchdogs.append(self)
        self._thread = threading.Thread(target=self._run, name="zerompi-watchdog", daemon=True)
        self._thread.start()

    @property
    def record(self) -> Optional[WaitRecord]:
        """The record this watchdog times (None once nothing uses it any more)."""
        return self._record()

    def _run(self) -> None:
        interval = min(1.0, max(MIN_INTERVAL_S, self.timeout_s / 10))
        while not self._stop.wait(interval):
            if self._check():
                return

    def _check(self) -> bool:
        """One look at the record (held only during the look); True once the thread is done."""
        record = self._record()
        if record is None:
            return True
        entry = record.current if record.watchdogs[-1:] == [self] else None   # the newest one times it
        if entry is None:
            return False
        op, tag, since = entry
        waited = time.monotonic() - since
        if waited >= self.timeout_s and record.current is entry:
            self._fire(op, tag, waited)
            return True
        return False

    def _fire(self, op: str, tag, waited: float) -> None:
        try:
            step = self._step()
        except Exception:      # the engine may be half torn down; the message matters more
            step = None
        where = describe_wait(op, tag, step)
        line = (f"zerompi: rank {self.rank}: collective timeout: waited {waited:.1f} s in {where} (timeout "
                f"{self.timeout_s:g} s: ZeroConfig.timeout_s, --timeout-s or {TIMEOUT_ENV}); "
                + (f"the {self.stand_ins} stand-in ranks of this simulated world waited there for rank {self.rank}, "
                   "which did not join it (it hangs)" if self.stand_ins else
                   "another rank did not join it (it died, hangs, or took another path)"))
        self.fired = line + "; aborting the job"
        _fired.append(self.fired)    # before the abort: the main thread may finish the job meanwhile
        summary = []
        if self.peers is not None:   # who had not arrived: every rank's report (comm/flight.py)
            try:
                clause, summary = self.peers.explain(where, self.timeout_s)
                self.fired = f"{line}; {clause}; aborting the job"
                _fired[-1] = self.fired
            except Exception:        # the abort matters more than the report
                pass
        sys.stderr.write("".join(f"{text}\n" for text in [self.fired] + [
            f"zerompi: rank {self.rank}: flight recorder: {s}" for s in summary]))
        sys.stderr.flush()
        self._abort(EXIT_TIMEOUT)

    def close(self, wait: bool = False) -> None:
        """Stop the thread; it ends within one check interval (``wait``: join it). An older watchdog
        of the same record times it again. The peers' reporter stops too."""
        self._stop.set()
        if self.peers is not None:
            self.peers.close()
        record = self._record()
        if record is not None and self in record.watchdogs:
            record.watchdogs.remove(self)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()


def guard_job(comm, timeout_s: Optional[float], abort_on_exception: bool = True) -> Optional[Watchdog]:
    """What a Communicator made on its own (without ``share``) does in a job of several ranks, so
    that its collectives end as an engine's do: the abort hook (``abort_on_exception``), the launcher
    check (comm/launcher.py) and a collective watchdog over ``comm``'s waits (returned). None in a job
    of one rank: there is nothing to wait for."""
    from mpi4py import MPI
    from . import launcher
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        return None
    if abort_on_exception:
        install_abort_hook(world)
    launcher.watch(world.Get_rank())
    return Watchdog(comm.waiting, timeout_s, world.Get_rank(), comm.mpi)


def fired() -> Optional[str]:
    """The message of the first watchdog of this process that fired, or None.

    A CLI checks it before it exits: the abort takes a moment (abort_job lets the output
    through first), and a short job can reach its end meanwhile; it must not then exit 0.
    """
    return _fired[0] if _fired else None


class StopSignal:
    """SIGTERM, SIGINT and SIGUSR1 ask the training loop to stop after the current step, and
    so does ``stop_file`` appearing.

    The first signal only sets :attr:`received`; the loop all-reduces :attr:`flag` with its
    per-step numbers, so every rank stops after the same step. The previous handlers come
    back at once, so a second signal acts as usual (SIGINT: KeyboardInterrupt, which
    aborts the job). Install from the main thread; :meth:`restore` puts the old handlers back.

    SIGUSR1 is for Open MPI's mpirun: it passes SIGUSR1 on to every rank and lets the job end,
    where SIGTERM or SIGINT make it kill the ranks half a second later. ``stop_file`` works
    under any launcher; one rank watching it (the caller passes it on rank 0) is enough.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, stop_file: Optional[str] = None):
        self.received: Optional[str] = None    # what asked: "SIGTERM", ..., or "the stop file PATH"
        self.stop_file = stop_file             # looked for at every flag read; None: no file
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
        self.restore()

    @property
    def flag(self) -> float:
        """1.0 once a signal arrived on this rank or the stop file exists, else 0.0 (summed
        over ranks by the loop, once per step)."""
        if self.received is None and self.stop_file is not None and os.path.lexists(self.stop_file):
            self.received = f"the stop file {self.stop_file}"
        return 0.0 if self.received is None else 1.0

    def restore(self) -> None:
        for s, h in self._previous.items():
            if signal.getsignal(s) == self._handle:
                signal.signal(s, h)
