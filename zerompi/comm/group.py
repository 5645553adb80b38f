"""GroupComm: what a model-parallel group's collectives share: the group, its waits, its counters.

The tensor-parallel all-reduce (mesh.TPComm) and the sequence-parallel all-to-all
(alltoall.SPComm) run on sub-communicators of the Mesh; each counts its calls, bytes and
seconds in its own table (apart from ZeRO's traffic), and times its waits in the engine's
WaitRecord, so the watchdog ends a job stuck in one of them.
"""
from collections import defaultdict
from typing import Dict

import numpy as np

from .blocks import OpStats, sum_table
from .watchdog import WaitRecord


class GroupComm:
    """One group of the mesh: ``mpi`` (mpi4py), ``rank``/``size`` in it, ``stats`` {op: OpStats}."""

    kind = "group"      # what its waits are named by: tp, sp

    def __init__(self, mpi_comm, waiting=None):
        self.mpi = mpi_comm
        self.waiting = waiting if waiting is not None else WaitRecord()   # what the watchdog times
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.stats: Dict[str, OpStats] = defaultdict(OpStats)

    def sum_scalars(self, values) -> np.ndarray:
        """A few float64 numbers summed over the group in rank order (not counted as traffic)."""
        local = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
        if self.size == 1:
            return local.copy()
        table = np.empty((self.size, local.size), np.float64)
        with self.waiting(f"{self.kind}_sum_scalars"):
            self.mpi.Allgather(local, table)
        return sum_table(table)

    def bytes_sent(self) -> int:
        return sum(s.bytes for s in self.stats.values())

    def calls(self) -> int:
        return sum(s.calls for s in self.stats.values())

    def seconds(self) -> float:
        return sum(s.seconds for s in self.stats.values())
