"""StepTimers: where one rank's step time goes, from the engine's own clocks (seconds).

Two kinds of time are kept:

- phase time: wall seconds in the forward, the backward and the optimizer step, *minus*
  the exposed communication inside them (so the parts add up);
- communication: ``comm_wait`` (exposed) is the wall time the training thread spends
  inside the engine's MPI calls -- starting, testing and waiting for collectives, and the
  few blocking ones; ``comm_busy`` is the wall time during which at least one of the
  engine's collectives is in flight, from the call that starts it until a test or a wait
  sees it complete. ``comm_busy - comm_wait`` is communication that ran behind compute.

Completion is only seen at the next test, so ``comm_busy`` can overstate a collective by
up to the compute between two progress calls (one layer): the hidden fraction is an upper
estimate, exact when every collective is waited for.

``trace`` (engine/trace.py, None when off) hears of phase changes, exposed blocks and
blocking collectives; :meth:`busy_total` and :meth:`wait_total` are never reset by take().
"""
import time
from contextlib import contextmanager
from typing import Dict

from .phase import Phase

KEYS = ("forward", "backward", "optimizer", "comm_wait")


class StepTimers:
    """Accumulates phase and communication seconds until :meth:`take` resets them."""

    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self.phase = Phase.IDLE            # the phase being charged now
        self._phase_start = clock()        # when it began (or was last taken)
        self._phase_wait = 0.0             # exposed seconds inside the current phase interval
        self.seconds: Dict[str, float] = dict.fromkeys(KEYS, 0.0)
        self.comm_busy = 0.0               # seconds with >= 1 collective in flight
        self._in_flight = 0                # collectives started and not yet seen complete
        self._busy_since = 0.0
        self._busy_sum = self._wait_sum = 0.0   # comm_busy and comm_wait since creation (take() keeps them)
        self.trace = None                  # the timeline's Tracer (engine/trace.py), or None

    # ---- phases --------------------------------------------------------------
    def enter(self, phase: Phase) -> None:
        """Close the current phase interval and start charging ``phase``."""
        if phase is self.phase:
            return
        self._close_phase()
        self.phase = phase
        if self.trace is not None:
            self.trace.phase(phase)

    def _close_phase(self) -> None:
        now = self._clock()
        if self.phase is not Phase.IDLE:
            self.seconds[self.phase.value] += now - self._phase_start - self._phase_wait
        self._phase_start, self._phase_wait = now, 0.0

    # ---- communication -----------------------------------------------------
    @contextmanager
    def exposed(self, what: str = "wait", handle=None):
        """Charge the enclosed block (an MPI call on the training thread) as exposed communication;
        ``what`` (and the ``handle`` waited for) name it in the trace."""
        t = self._clock()
        try:
            yield
        finally:
            end = self._clock()
            dt = end - t
            self.seconds["comm_wait"] += dt
            self._phase_wait += dt
            self._wait_sum += dt
            if self.trace is not None:
                self.trace.wait(what, t, end, handle)

    def comm_started(self) -> float:
        """A collective is about to start (call before the MPI call that starts it); returns the time."""
        now = self._clock()
        if self._in_flight == 0:
            self._busy_since = now
        self._in_flight += 1
        return now

    def comm_completed(self) -> float:
        """A collective was seen complete by a test or a wait; returns the time."""
        now = self._clock()
        self._in_flight -= 1
        if self._in_flight == 0:
            self.comm_busy += now - self._busy_since
            self._busy_sum += now - self._busy_since
        return now

    @contextmanager
    def blocking(self, what: str = "blocking collective"):
        """A blocking collective (``what`` names it in the trace): in flight and exposed for its whole duration."""
        t = self.comm_started()
        record = self.trace.comm_begin(what, t) if self.trace is not None else None
        try:
            with self.exposed(what):
                yield
        finally:
            t = self.comm_completed()
            if record is not None:
                self.trace.comm_end(record, t)

    # ---- reading -------------------------------------------------------------
    def take(self) -> Dict[str, float]:
        """Seconds accumulated since the last take (phases, ``comm_wait``, ``comm_busy``); resets them.

        An open phase or busy interval is split at this instant, so nothing is lost or counted twice.
        """
        self._close_phase()
        now = self._clock()
        if self._in_flight:
            self.comm_busy += now - self._busy_since
            self._busy_sum += now - self._busy_since
            self._busy_since = now
        out = dict(self.seconds, comm_busy=self.comm_busy)
        self.seconds = dict.fromkeys(KEYS, 0.0)
        self.comm_busy = 0.0
        return out

    def now(self) -> float:
        """This object's clock."""
        return self._clock()

    def busy_total(self, now: float) -> float:
        """Seconds with >= 1 collective in flight since this object was made, up to ``now`` (its clock)."""
        return self._busy_sum + (now - self._busy_since if self._in_flight else 0.0)

    def wait_total(self) -> float:
        """Exposed seconds since this object was made."""
        return self._wait_sum


def hidden_fraction(comm_busy: float, comm_wait: float) -> float:
    """Share of communication time that did not show as waiting: (busy - wait) / busy, in [0, 1]."""
    if comm_busy <= 0:
        return 0.0
    return min(1.0, max(0.0, (comm_busy - comm_wait) / comm_busy))


def summarize(per_step, step_times):
    """(time_breakdown_s, comm_hidden_fraction) over steps from :meth:`StepTimers.take` dicts.

    The breakdown holds the median over steps of each part, ``other`` being the step time not
    in a phase or waiting (data, loss, logging); the fraction is over the sums of all steps.
    """
    import statistics
    keys = KEYS + ("comm_busy",)
    out = {k: statistics.median(p[k] for p in per_step) for k in keys}
    out["other"] = statistics.median(max(0.0, t - sum(p[k] for k in KEYS)) for p, t in zip(per_step, step_times))
    fraction = hidden_fraction(sum(p["comm_busy"] for p in per_step), sum(p["comm_wait"] for p in per_step))
    return out, fraction


def per_step(parts, step_times):
    """{part: [seconds of each step]} from :meth:`StepTimers.take` dicts and the steps' wall times:
    the parts of :func:`summarize` (``other`` as there), step by step (the metrics' step_breakdown_s)."""
    out = {k: [p[k] for p in parts] for k in KEYS + ("comm_busy",)}
    out["other"] = [max(0.0, t - sum(p[k] for k in KEYS)) for p, t in zip(parts, step_times)]
    return out


def format_breakdown(parts) -> str:
    """One progress-line fragment, milliseconds: 'fwd 12.0 bwd 20.1 opt 5.2 wait 1.3 ms'."""
    return (f"fwd {parts['forward'] * 1e3:.1f} bwd {parts['backward'] * 1e3:.1f} "
            f"opt {parts['optimizer'] * 1e3:.1f} wait {parts['comm_wait'] * 1e3:.1f} ms")
