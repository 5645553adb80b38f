"""Mesh: N ranks as tensor-parallel x sequence-parallel x data-parallel groups, and the TP all-reduce.

The rank order, innermost first, is tp, sp, dp (Megatron-LM's tp-cp-dp): world rank
``tp_i + TP * (sp_i + SP * dp_i)``, so a TP group is TP adjacent ranks and an SP group the SP
adjacent TP groups around it (both inside a node). The groups, each an mpi4py sub-communicator:

- ``tp_comm`` (TPComm): the TP ranks of one (sp_i, dp_i), which split each block's matrices;
- ``sp_comm`` (alltoall.SPComm): the SP ranks of one (tp_i, dp_i), which split each sequence;
- ``zero_comm`` (a zerompi Communicator): the dp x sp ranks of one tp_i, which hold the same
  parameters (the SP ranks compute on other tokens of them) and over which ZeRO shards them and
  reduces their gradients, as DeepSpeed-Ulysses does::

    mesh = zerompi.Mesh(tp=2, sp=2)                 # COMM_WORLD, 8 ranks: TP groups [0, 1], [2, 3], ...
    engine = zerompi.ZeroEngine(layers, cfg, comm=mesh, tp_split=split)   # ZeRO over mesh.zero_comm
    mesh.tp_comm.all_reduce(partial)                # Megatron's f / g: sum over the TP group
    mesh.sp_comm.all_to_all(qkv, scatter=3, gather=1)   # Ulysses: the whole sequence, heads / SP

``tp_comm`` sums in rank order (reduce-scatter by Alltoall, then Allgather), so every TP rank gets
the same bits, in any float dtype. The TP and SP bytes are counted in their own tables, apart from
the engine's ZeRO traffic.
"""
import time
from typing import Dict, List, Optional

import numpy as np
from mpi4py import MPI

from ..errors import ConfigError, UsageError
from .alltoall import SPComm
from .communicator import Communicator
from .consistency import check_consistent
from .group import GroupComm


class TPComm(GroupComm):
    """The tensor-parallel group's collectives: a deterministic all-reduce of any float array."""

    def __init__(self, mpi_comm, waiting=None):
        super().__init__(mpi_comm, waiting)
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


class Mesh:
    """The mesh of ``comm`` (mpi4py communicator or zerompi Communicator; default COMM_WORLD).

    ``tp``: ranks per tensor-parallel group, ``sp``: TP groups per sequence-parallel group (tp x sp must
    divide the ranks); ``node_size`` (optional, in ranks): checked to be a multiple of tp x sp, so that no
    TP or SP group spans two nodes. Every rank must pass the same tp and sp (checked: MismatchError on
    every rank naming them). Attributes: ``tp``, ``sp``, ``dp`` (sizes), ``tp_rank``, ``sp_rank``,
    ``dp_rank``; ``tp_ranks``, ``sp_ranks``, ``zero_ranks`` (the world ranks of this rank's groups),
    ``ranks`` (every TP group's world ranks, in order); ``tp_comm``, ``sp_comm``, ``zero_comm`` (counting
    into ``comm``'s table when ``comm`` is a Communicator) and ``tp_mpi``, ``sp_mpi``, ``zero_mpi``.
    """

    def __init__(self, comm=None, tp: int = 1, node_size: Optional[int] = None, sp: int = 1):
        share = comm if isinstance(comm, Communicator) else None
        world = comm.mpi if share is not None else (comm if comm is not None else MPI.COMM_WORLD)
        n = world.Get_size()
        # Agreed first: a rank with another size would split into groups the others never join.
        check_consistent(share if share is not None else world, "mesh", {"tp": tp, "sp": sp})
        check_tp(tp, n, node_size)
        check_sp(sp, tp, n, node_size)
        self.world, self.tp, self.sp, self.dp = world, tp, sp, n // (tp * sp)
        rank = world.Get_rank()
        self.tp_rank, self.sp_rank, self.dp_rank = rank % tp, rank // tp % sp, rank // (tp * sp)
        at = lambda t, s, d: t + tp * (s + sp * d)          # world rank of mesh coordinates
        self.tp_ranks = [at(t, self.sp_rank, self.dp_rank) for t in range(tp)]
        self.sp_ranks = [at(self.tp_rank, s, self.dp_rank) for s in range(sp)]
        self.zero_ranks = [at(self.tp_rank, s, d) for d in range(self.dp) for s in range(sp)]
        self.ranks: List[List[int]] = [list(range(g * tp, (g + 1) * tp)) for g in range(n // tp)]
        self.tp_mpi = world.Split(rank // tp, rank)                          # one (sp_i, dp_i)
        self.sp_mpi = world.Split(self.tp_rank + tp * self.dp_rank, rank)   # one (tp_i, dp_i)
        self.zero_mpi = world.Split(self.tp_rank, rank)                      # one tp_i: dp x sp
        self.zero_comm = Communicator(self.zero_mpi, share=share)
        self.tp_comm = TPComm(self.tp_mpi, self.zero_comm.waiting)   # timed by the engine's watchdog too
        self.sp_comm = SPComm(self.sp_mpi, self.zero_comm.waiting)

    def describe(self) -> str:
        parts = [f"{self.dp} data-parallel"]
        parts += [f"{self.sp} sequence-parallel"] if self.sp > 1 else []
        parts += [f"{self.tp} tensor-parallel"] if self.tp > 1 else []
        adjacent = [f"TP ranks adjacent: {self.ranks[0]}"] if self.tp > 1 else []
        adjacent += [f"SP ranks {list(range(0, self.tp * self.sp, self.tp))}"] if self.sp > 1 else []
        zero = f"; ZeRO over {self.dp * self.sp} ranks (data x sequence parallel)" if self.sp > 1 else ""
        return f"{' x '.join(parts)}" + (f" ({', '.join(adjacent)}, ...)" if adjacent else "") + zero


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


def check_sp(sp, tp: int, n: int, node_size: Optional[int] = None) -> None:
    """ConfigError (one line, naming the value) unless ``sp`` divides the ``n / tp`` TP groups and, with
    ``node_size`` (in ranks), tp x sp divides it (an SP group inside one node)."""
    if not (isinstance(sp, int) and not isinstance(sp, bool) and sp >= 1 and (n // tp) % sp == 0):
        what = f"the {n} ranks" if tp == 1 else f"the {n // tp} tensor-parallel groups of tp={tp} ({n} ranks)"
        raise ConfigError(f"sp={sp!r} does not divide {what}; use a divisor of {n // tp}")
    if node_size is not None and node_size % (tp * sp):
        raise ConfigError(f"tp x sp = {tp * sp} does not divide node_size={node_size}; a sequence-parallel "
                          "group must sit inside one node")
