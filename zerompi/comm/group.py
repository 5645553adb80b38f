"""GroupComm: what a model-parallel group's collectives share: the group, its waits, its counters.

The tensor-parallel all-reduce (mesh.TPComm) and the sequence-parallel all-to-all
(alltoall.SPComm) run on sub-communicators of the Mesh; each counts its calls, bytes and
seconds in its own table (apart from ZeRO's traffic), and times its waits in the engine's
WaitRecord, so the watchdog ends a job stuck in one of them. Their exchanges are checked as the
Communicator's collectives are (comm/checked.py, comm/signature.py): ranks of a group that pass
different lengths, dtypes or operations all stop with one MismatchError; the headers are
counted apart, in ``check_stats``.
"""
from collections import defaultdict
from typing import Dict

import numpy as np
from mpi4py import MPI

from .blocks import OpStats, sum_table
from .checked import Checks, allgather_rows
from .signature import signature
from .watchdog import WaitRecord


class GroupComm:
    """One group of the mesh: ``mpi`` (mpi4py), ``rank``/``size`` in it, ``stats`` {op: OpStats}."""

    kind = "group"      # what its waits are named by: tp, sp

    def __init__(self, mpi_comm, waiting=None, check: bool = True):
        self.mpi = mpi_comm
        self.waiting = waiting if waiting is not None else WaitRecord()   # what the watchdog times
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.stats: Dict[str, OpStats] = defaultdict(OpStats)
        self.check_stats = OpStats()      # the checks' headers (comm/signature.py), counted apart
        self.checks = Checks(mpi_comm, self.check_stats, (self.size - 1, 0), self.waiting) \
            if check and self.size > 1 else None

    def exchange(self, op: str, x: np.ndarray, send_rows, recv_rows) -> None:
        """One all-to-all of ``send_rows`` [k] into ``recv_rows`` [k] (row r to / from group rank r; this
        rank's own row is not moved), checked unless the group was made with check=False (MPI's own
        Alltoall then). ``op``/``x``: the signature (operation, dtype, size) the ranks must agree on."""
        if self.checks is None:
            self.mpi.Alltoall(send_rows, recv_rows)
            return
        others, nbytes = self.checks.others, send_rows[0].nbytes
        self.checks.exchange(signature(op, x.dtype, x.size),
                             [(r, [send_rows[r], nbytes, MPI.BYTE]) for r in others],
                             [(r, [recv_rows[r], nbytes, MPI.BYTE]) for r in others]).Wait()

    def sum_scalars(self, values) -> np.ndarray:
        """A few float64 numbers summed over the group in rank order (not counted as traffic)."""
        local = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
        if self.size == 1:
            return local.copy()
        table = np.empty((self.size, local.size), np.float64)
        op = f"{self.kind}_sum_scalars"
        with self.waiting(op):
            allgather_rows(self.mpi, self.checks, op, local, table)
        return sum_table(table)

    def bytes_sent(self) -> int:
        return sum(s.bytes for s in self.stats.values())

    def calls(self) -> int:
        return sum(s.calls for s in self.stats.values())

    def seconds(self) -> float:
        return sum(s.seconds for s in self.stats.values())
