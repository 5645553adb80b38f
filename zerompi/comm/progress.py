"""ProgressThread: advance non-blocking MPI collectives from a helper thread during compute.

MPI moves a non-blocking collective forward only while some call into the library is
running on that rank. With ``progress="thread"`` the engine runs this thread, which polls
MPI (an ``Iprobe`` on a private duplicate communicator, so it never touches the engine's
requests) every ``interval_s`` while collectives are in flight, and sleeps otherwise.
NumPy releases the GIL inside matmuls and most array loops, so the polls interleave with
compute. It needs ``MPI_THREAD_MULTIPLE`` (mpi4py requests it by default).
"""
import threading
import time

from mpi4py import MPI

from ..errors import check


class ProgressThread:
    """A daemon thread that polls MPI while :meth:`busy` is on. Creating and closing it are collectives."""

    def __init__(self, mpi_comm, interval_s: float = 1e-4):
        level = MPI.Query_thread()
        check(level == MPI.THREAD_MULTIPLE,
              f"progress='thread' needs MPI_THREAD_MULTIPLE, but MPI was initialized at thread level {level}; "
              "use progress='test'")
        self.interval_s = interval_s            # seconds between polls while busy
        self._comm = mpi_comm.Dup()             # private: its probes never match the engine's traffic
        self._busy = threading.Event()
        self._stopping = False
        self.polls = 0                          # Iprobe calls made (a measure of its CPU use)
        self._thread = threading.Thread(target=self._run, name="zerompi-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._busy.wait()
            if self._stopping:
                return
            self._comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
            self.polls += 1
            time.sleep(self.interval_s)

    def busy(self, on: bool) -> None:
        """Poll while ``on`` (collectives in flight); sleep otherwise."""
        if on:
            self._busy.set()
        else:
            self._busy.clear()

    def close(self) -> None:
        """Stop the thread and free its communicator (every rank must call it)."""
        self._stopping = True
        self._busy.set()
        self._thread.join()
        self._comm.Free()
