"""Mesh: N ranks as N/K data-parallel groups x K tensor-parallel ranks, and the TP all-reduce.

Ranks ``K*d .. K*d + K-1`` form tensor-parallel group ``d`` (TP ranks adjacent, so a TP group
sits inside a node); ranks ``t, t+K, t+2K, ...`` form data-parallel group ``t`` (one TP rank's
replicas, over which the engine shards that rank's pieces of the model)::

    mesh = zerompi.Mesh(tp=2)                       # COMM_WORLD, 4 ranks: [[0, 1], [2, 3]]
    engine = zerompi.ZeroEngine(layers, cfg, comm=mesh, tp_split=split)   # ZeRO over mesh.dp_comm
    mesh.tp_comm.all_reduce(partial)                # Megatron's f / g: sum over the TP group

``tp_comm`` (TPComm) sums in rank order (reduce-scatter by Alltoall, then Allgather), so every TP
rank gets the same bits, in any float dtype; its bytes are counted in its own table, apart from
the engine's data-parallel traffic.
"""
import time
from collections import defaultdict
from typing import Dict, List, Optional

import numpy as np
from mpi4py import MPI

from ..errors import ConfigError, UsageError
from .communicator import Communicator, OpStats, sum_table
from .split import split
from .watchdog import WaitRecord


class TPComm:
    """The tensor-parallel group's collectives: a deterministic all-reduce of any float array."""

    def __init__(self, mpi_comm, waiting=None):
        self.mpi = mpi_comm
        self.waiting = waiting if waiting is not None else WaitRecord()   # what the watchdog times
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.stats: Dict[str, OpStats] = defaultdict(OpStats)
        self._scratch: Dict[tuple, np.ndarray] = {}

    def all_reduce(self, x, op: str = "tp_all_reduce") -> np.ndarray:
        """Sum ``x`` over the TP ranks, in place (x contiguous, its size a multiple of the group size):
        an Alltoall of the K slices, each rank sums its slice's K rows in rank order, an Allgather.
        Sends 2 (K-1)/K of x's bytes per rank, counted under ``op``. Returns x."""
        k = self.size
        if k == 1:
            return x
        if not (isinstance(x, np.ndarray) and x.flags.c_contiguous and x.size % k == 0):
            raise UsageError(f"TP all-reduce: a contiguous array whose size divides by {k} is needed "
                             f"(got {getattr(x, 'shape', type(x).__name__)})")
        t = time.perf_counter()
        flat = x.reshape(k, -1)
        n = flat.shape[1]
        key = (n, x.dtype.str)
        recv = self._scratch.get(key)
        if recv is None:
            recv = self._scratch[key] = np.empty((k, n), x.dtype)
        with self.waiting(op):
            self.mpi.Alltoall(flat, recv)
        mine = recv[0].copy()
        for r in range(1, k):          # rank order: the same bits on every rank, at every stage
            mine += recv[r]
        with self.waiting(op):
            self.mpi.Allgather(mine, flat)
        st = self.stats[op]
        st.calls += 1
        st.sent(n * x.itemsize, (k - 1, 0))   # the reduce-scatter's K-1 slices ...
        st.sent(n * x.itemsize, (k - 1, 0))   # ... and the all-gather's
        st.seconds += time.perf_counter() - t
        return x

    def sum_scalars(self, values) -> np.ndarray:
        """A few float64 numbers summed over the TP ranks in rank order (not counted as traffic)."""
        local = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
        if self.size == 1:
            return local.copy()
        table = np.empty((self.size, local.size), np.float64)
        self.mpi.Allgather(local, table)
        return sum_table(table)

    def bytes_sent(self) -> int:
        return sum(s.bytes for s in self.stats.values())

    def seconds(self) -> float:
        return sum(s.seconds for s in self.stats.values())


class Mesh:
    """The 2-D mesh of ``comm`` (mpi4py communicator or zerompi Communicator; default COMM_WORLD).

    ``tp``: ranks per tensor-parallel group (must divide the ranks). ``node_size`` (optional, in
    ranks): checked to be a multiple of ``tp``, so that no TP group spans two nodes.
    Attributes: ``tp``, ``dp`` (sizes), ``tp_rank``, ``dp_rank``, ``ranks`` (dp x tp world ranks),
    ``tp_comm`` (TPComm), ``dp_comm`` (a zerompi Communicator over this rank's data-parallel group,
    counting into ``comm``'s table when ``comm`` is a Communicator) and ``dp_mpi``/``tp_mpi``.
    """

    def __init__(self, comm=None, tp: int = 1, node_size: Optional[int] = None):
        share = comm if isinstance(comm, Communicator) else None
        world = comm.mpi if share is not None else (comm if comm is not None else MPI.COMM_WORLD)
        n = world.Get_size()
        check_tp(tp, n, node_size)
        self.world, self.tp, self.dp = world, tp, n // tp
        rank = world.Get_rank()
        self.tp_rank, self.dp_rank = rank % tp, rank // tp
        self.ranks: List[List[int]] = [[d * tp + t for t in range(tp)] for d in range(self.dp)]
        self.tp_mpi = split(world, lambda r: r // tp)     # TP ranks adjacent
        self.dp_mpi = split(world, lambda r: r % tp)
        self.dp_comm = Communicator(self.dp_mpi, share=share)
        self.tp_comm = TPComm(self.tp_mpi, self.dp_comm.waiting)   # timed by the engine's watchdog too

    def describe(self) -> str:
        return f"{self.dp} data-parallel x {self.tp} tensor-parallel (TP ranks adjacent: {self.ranks[0]}, ...)"


def check_tp(tp, n: int, node_size: Optional[int] = None, shard_size: Optional[int] = None) -> None:
    """ConfigError (one line, naming the value) unless ``tp`` divides ``n`` ranks, ``node_size`` and
    ``shard_size`` (both in ranks, None: not set)."""
    if not (isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 and n % tp == 0):
        raise ConfigError(f"tp={tp!r} does not divide the {n} ranks; use a divisor of {n}")
    if node_size is not None and node_size % tp:
        raise ConfigError(f"tp={tp} does not divide node_size={node_size}; a tensor-parallel group must sit "
                          "inside one node")
    if shard_size is not None and shard_size % tp:
        raise ConfigError(f"tp={tp} does not divide shard_size={shard_size}; a shard group holds whole "
                          "tensor-parallel groups")
