"""The collectives a rank has started and not yet seen complete.

The gradient reducer and the parameter gatherer start their collectives through one
:class:`InFlight`. :meth:`InFlight.poll` tests every one of them once -- this is what moves
MPI on between layers -- and hands each one that has arrived back to its owner (the
``on_arrival`` given at launch), so a reduction's staging bucket is freed as soon as its
data is in. :meth:`InFlight.finish` blocks until one has arrived (exposed time) and runs
its local part; it tests in a loop that yields the core between tests (with more ranks than
cores, a rank that spins takes the core from one that computes: measured on 4 ranks of an
emulated 2-node cluster on 2 cores, stage 3 flat 1.06-1.30 -> 0.81-0.85 s per step, ZeRO++
0.81-0.92 -> 0.60-0.65 s; the yield is a system call of about a microsecond where the core is
free). The timers learn when collectives start and end; the progress thread (when
there is one) polls MPI only while something is in flight; the trace (engine/trace.py, when
on) records each collective from launch to completion, and each local part.
"""
import os
from typing import Callable, Dict


class InFlight:
    """Started collectives not yet seen complete, each with what to do when it arrives."""

    def __init__(self, comm, timers, progress_thread=None):
        self.comm = comm                        # a zerompi Communicator (its ``waiting`` is watched)
        self.timers = timers                    # StepTimers: exposed time and the busy interval
        self.progress_thread = progress_thread  # ProgressThread or None
        self._pending: Dict[object, Callable[[], None]] = {}   # handle -> on_arrival, in launch order
        self.trace = None                       # the timeline's Tracer (engine/trace.py), or None

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, handle) -> bool:
        return handle in self._pending

    def launch(self, start: Callable[[], object], on_arrival: Callable[[], None]):
        """Start a collective (``start()`` returns its handle); ``on_arrival`` runs when
        :meth:`poll` sees it complete (the owner then finishes it)."""
        sent = self.trace.launching() if self.trace is not None else None
        t = self.timers.comm_started()
        with self.timers.exposed("start"):
            handle = start()
        if sent is not None:
            self.trace.launched(handle, t, sent)
        self._pending[handle] = on_arrival
        if self.progress_thread is not None:
            self.progress_thread.busy(True)
        return handle

    def _seen_complete(self, handle) -> Callable[[], None]:
        on_arrival = self._pending.pop(handle)
        t = self.timers.comm_completed()
        if self.trace is not None:
            self.trace.completed(handle, t)
        if self.progress_thread is not None and not self._pending:
            self.progress_thread.busy(False)
        return on_arrival

    def finish(self, handle) -> None:
        """Block until the handle's data has arrived (exposed time), then run its local part."""
        if handle in self._pending:
            # the watchdog times this
            with self.timers.exposed("wait", handle), self.comm.waiting(handle.op, handle.tag):
                while not handle.test():     # test, not wait: the local sum below is compute, not waiting
                    os.sched_yield()         # the core, to a rank that computes on it (more ranks than cores)
            self._seen_complete(handle)
        if self.trace is not None:
            self.trace.local_part(handle)    # handle.wait(), as a span of the compute track
        else:
            handle.wait()

    def poll(self) -> None:
        """Test every in-flight collective once, and hand those that have arrived to their owners."""
        if not self._pending:
            return
        with self.timers.exposed("test"):
            arrived = [h for h in self._pending if h.test()]
        for on_arrival in [self._seen_complete(h) for h in arrived]:
            on_arrival()

    def drain(self, timeout_s: float) -> None:
        """Wait for every collective still in flight (at interpreter exit, before MPI is finalized:
        an engine forgotten or never closed must not leave requests pending). Timed by a watchdog
        of ``timeout_s``, as every wait is: a rank that left early must not hang the exit."""
        if not self._pending:
            return
        from ..comm.watchdog import Watchdog
        from ..errors import MismatchError
        dog = Watchdog(self.comm.waiting, timeout_s, self.comm.rank, self.comm.mpi)
        try:
            for handle in list(self._pending):
                self._pending.pop(handle)
                with self.comm.waiting(handle.op, handle.tag):
                    handle.wait()
        except MismatchError:       # the ranks passed different collectives: the job ends on that error
            self._pending.clear()
        finally:
            dog.close()

    def close(self) -> None:
        if self.progress_thread is not None:
            self.progress_thread.close()
            self.progress_thread = None
