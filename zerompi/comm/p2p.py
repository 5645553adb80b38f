"""PointToPoint: the pipeline's messages between stages, non-blocking, counted in bytes.

A pipeline stage sends its activations to the next stage and their gradients to the previous one.
Each message is one contiguous array, posted with ``isend`` / ``irecv`` (MPI's non-blocking
point-to-point calls) and waited for only when its data is needed (a receive) or its buffer is
reused (a send); :meth:`PointToPoint.poll` moves the posted ones on between computations.
Messages between one pair of ranks in one direction are matched in the order they are posted
(MPI's non-overtaking rule), each kind of message under its own tag, so both sides must post
them in the same order: the pipeline's schedule validator checks that before anything runs.

Device arrays (CuPy) travel through host memory: a send takes a copy down, and with ``xp`` set to the
device's array module a received message is handed out as a device array (one copy up).

Every message is counted as traffic under its kind (``stats``: calls, bytes sent by this rank,
split into peers on this node and on other nodes; seconds waited), apart from the engine's
collectives; every wait is timed by the engine's watchdog (``waiting``).
"""
import time
from collections import defaultdict
from typing import Dict, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from ..errors import UsageError
from ..optim import impl
from .blocks import OpStats
from .watchdog import WaitRecord


class Message:
    """One posted send or receive: its MPI request and the array it keeps alive until done."""

    __slots__ = ("request", "array", "peer", "kind", "done", "send", "posted")

    def __init__(self, request, array, peer: int, kind: str, send: bool):
        self.request, self.array, self.peer, self.kind, self.send = request, array, peer, kind, send
        self.done = False
        self.posted = time.perf_counter()


class PointToPoint:
    """Non-blocking sends and receives over ``mpi_comm`` (the pipeline group: rank = stage).

    ``waiting``: the WaitRecord the watchdog reads (the engine's); ``node_of``: the node of each
    rank of ``mpi_comm`` (bytes to a peer on another node count as "inter").
    """

    def __init__(self, mpi_comm, waiting: Optional[WaitRecord] = None, node_of: Optional[Sequence[int]] = None):
        self.mpi = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.waiting = waiting if waiting is not None else WaitRecord()
        self.node_of: List[int] = list(node_of) if node_of is not None else [0] * self.size
        self.stats: Dict[str, OpStats] = defaultdict(OpStats)
        self.posted: List[Message] = []        # not yet known to be complete
        self.xp = np                           # the array module received messages are handed out in
        # a list: each message's (kind, send?, peer, bytes, posted, done) goes there
        self.events: Optional[list] = None

    def _check(self, array, peer: int, what: str) -> None:
        if not (isinstance(array, np.ndarray) and array.flags.c_contiguous):
            raise UsageError(f"{what}: a contiguous NumPy array is needed (got {getattr(array, 'shape', type(array))})")
        if not (isinstance(peer, (int, np.integer)) and 0 <= peer < self.size and peer != self.rank):
            raise UsageError(f"{what}: peer={peer!r} is not another rank of the {self.size}-rank pipeline group")

    def isend(self, array: np.ndarray, peer: int, tag: int, kind: str) -> Message:
        """Post the send of ``array`` to ``peer`` (counted under ``kind``); the array must not change
        until the message is done (:meth:`wait`, :meth:`poll`, :meth:`wait_all`). A device array travels as a
        host copy (so it may change at once)."""
        if impl.is_device(array):
            array = np.ascontiguousarray(impl.to_host(array))
        self._check(array, peer, f"send of {kind}")
        st = self.stats[kind]
        st.calls += 1
        remote = self.node_of[peer] != self.node_of[self.rank]
        st.sent(array.nbytes, (0, 1) if remote else (1, 0))
        msg = Message(self.mpi.Isend(array.reshape(-1).view(np.uint8), peer, tag), array, peer, kind, True)
        self.posted.append(msg)
        return msg

    def isend_copy(self, array, peer: int, tag: int, kind: str) -> Message:
        """:meth:`isend` of a copy of ``array``: the caller may reuse its own at once."""
        return self.isend(np.ascontiguousarray(array).copy() if isinstance(array, np.ndarray) else array, peer, tag,
                          kind)

    def irecv(self, array: np.ndarray, peer: int, tag: int, kind: str) -> Message:
        """Post the receive of ``peer``'s next message under ``tag`` into ``array`` (its exact size)."""
        self._check(array, peer, f"receive of {kind}")
        msg = Message(self.mpi.Irecv(array.reshape(-1).view(np.uint8), peer, tag), array, peer, kind, False)
        self.posted.append(msg)
        return msg

    def wait(self, msg: Message, what: Optional[str] = None, tag=None) -> np.ndarray:
        """Block until ``msg`` is done (timed by the watchdog as ``what``); returns its array (a received one
        in ``xp``)."""
        if not msg.done:
            t = time.perf_counter()
            with self.waiting(what or f"pipeline {msg.kind} with stage {msg.peer}", tag):
                msg.request.Wait()
            self.stats[msg.kind].seconds += time.perf_counter() - t
            self._done(msg)
        if self.xp is not np and not msg.send and isinstance(msg.array, np.ndarray):
            msg.array = self.xp.asarray(msg.array)     # received into host memory: up to the device once
        return msg.array

    def _done(self, msg: Message) -> None:
        msg.done = True
        if self.events is not None:
            self.events.append((msg.kind, msg.send, msg.peer, msg.array.nbytes, msg.posted, time.perf_counter()))

    def poll(self) -> None:
        """Let MPI move the posted messages on (one Testall; no wait) and forget the finished ones."""
        if not self.posted:
            return
        live = [m for m in self.posted if not m.done]
        if live:
            for m in live:
                if m.request.Test():
                    self._done(m)
        self.posted = [m for m in self.posted if not m.done]

    def wait_all(self, what: str = "pipeline messages at the end of the step") -> None:
        """Block until every posted message is done (the step's sends before their buffers are reused)."""
        for m in list(self.posted):
            self.wait(m, what)
        self.posted = []

    def bytes_sent(self) -> int:
        return sum(s.bytes for s in self.stats.values())

    def seconds(self) -> float:
        return sum(s.seconds for s in self.stats.values())

    def cancel_all(self) -> None:
        """Cancel what is still posted (a job stopping on an error: nothing must wait for these)."""
        for m in self.posted:
            if not m.done:
                try:
                    m.request.Cancel()
                except MPI.Exception:
                    pass
        self.posted = []
