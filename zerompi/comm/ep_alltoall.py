"""EPComm: the expert-parallel group's all-to-all(v) of token rows, on NumPy arrays.

Under --ep K a rank sends each of the K ranks of its EP group the rows (tokens) routed to the experts that
rank holds, a different number to each: first the counts (one all-to-all of integers: rows per expert), then
the rows themselves (one all-to-allv, as bytes: MPI has no float16 type and nothing is summed). The reverse
(the experts' outputs back; the backward's row gradients there and back) reuses the counts, swapped. Every rank
makes every call, with zero rows where it has none: no rank skips a collective. Bytes sent to the other ranks
are counted per operation, apart from ZeRO's traffic (train/moe/routing.py reports them beside their formula).
"""
import time

import numpy as np
from mpi4py import MPI

from .group import GroupComm
from .simulated_world import simulated


class EPComm(GroupComm):
    """The all-to-all(v) of the expert-parallel group (rank, size, counts, rows, counters)."""

    kind = "ep"

    def __init__(self, mpi_comm, waiting=None, check: bool = True):
        # a simulated world's stand-ins agree by construction (comm/simulated_world.py): no headers to check
        super().__init__(mpi_comm, waiting, check and not simulated(mpi_comm))

    def counts(self, send: np.ndarray, op: str = "ep_counts") -> np.ndarray:
        """(K, m) integers: row r of ``send`` to EP rank r; returns what each rank sent this one, by rank."""
        send = np.ascontiguousarray(send, np.int64)
        recv = np.empty_like(send)
        t = time.perf_counter()
        with self.waiting(op):
            self.mpi.Alltoall(send, recv)
        self._count(op, send[0].nbytes * (self.size - 1), t)
        return recv

    def rows(self, send, send_rows, recv_rows, op: str = "ep_all_to_all", xp=np):
        """The rows of ``send`` (n, C), ``send_rows[r]`` of them to EP rank r in rank order; returns the rows
        received, ``recv_rows[r]`` from rank r, in rank order (an (sum, C) array of send's dtype). ``xp``: the
        array module of ``send`` and of the result; device rows (CuPy) are staged through host buffers (one copy
        down, one up: what MPI reads and writes is host memory, CUDA-aware or not)."""
        if xp is not np:
            return xp.asarray(self.rows(xp.asnumpy(send), send_rows, recv_rows, op))
        width = int(np.prod(send.shape[1:], dtype=np.int64)) * send.itemsize
        send = np.ascontiguousarray(send)
        recv = np.empty((int(np.sum(recv_rows)),) + send.shape[1:], send.dtype)
        sc = np.asarray(send_rows, np.int64) * width
        rc = np.asarray(recv_rows, np.int64) * width
        sd, rd = np.concatenate([[0], np.cumsum(sc)[:-1]]), np.concatenate([[0], np.cumsum(rc)[:-1]])
        t = time.perf_counter()
        with self.waiting(op):
            self.mpi.Alltoallv([send.view(np.uint8).reshape(-1), (sc, sd), MPI.BYTE],
                               [recv.view(np.uint8).reshape(-1), (rc, rd), MPI.BYTE])
        self._count(op, int(sc.sum() - sc[self.rank]), t)
        return recv

    def _count(self, op: str, nbytes: int, t0: float) -> None:
        st = self.stats[op]
        st.calls += 1
        st.bytes += nbytes
        st.seconds += time.perf_counter() - t0
