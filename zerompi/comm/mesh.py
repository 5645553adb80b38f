"""Mesh: N ranks as pp pipeline stages x dp data-parallel ranks x tp tensor-parallel ranks.

The rank order, innermost first (Megatron's tp-dp-pp order)::

    world rank = tp_i + TP * (dp_i + DP * pp_i)

so a TP group is TP adjacent ranks (inside a node), the DP×TP ranks of one pipeline stage are
one contiguous block, and pipeline neighbours are DP·TP ranks apart (possibly on other nodes).
ZeRO shards over the data-parallel group of each (pp, tp) coordinate::

    mesh = zerompi.Mesh(tp=2)                       # COMM_WORLD, 4 ranks: [[0, 1], [2, 3]]
    engine = zerompi.ZeroEngine(layers, cfg, comm=mesh, tp_split=split)   # ZeRO over mesh.dp_comm
    mesh.tp_comm.all_reduce(partial)                # Megatron's f / g: sum over the TP group
    mesh = zerompi.Mesh(tp=2, pp=2)                 # 8 ranks: stage 0 = ranks 0-3, stage 1 = ranks 4-7

``tp_comm`` (TPComm) sums in rank order (reduce-scatter by an all-to-all, then Allgather), so every
TP rank gets the same bits, in any float dtype; its bytes are counted in its own table, apart from
the engine's data-parallel traffic. Its all-to-all is checked as the Communicator's collectives are
(comm/signature.py): TP ranks that pass different lengths, dtypes or operations all stop with one
MismatchError. ``pp_comm`` (comm/p2p.py) carries the pipeline's point-to-point messages between
neighbouring stages, counted the same way.
"""
import os
import time
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ..errors import ConfigError, UsageError
from .blocks import OpStats, sum_table
from .communicator import Communicator
from .checked import Checks
from .p2p import PointToPoint
from .signature import signature
from .watchdog import WaitRecord

AXES = ("tp", "dp", "pp")      # the mesh's axes, innermost (adjacent ranks) first


class TPComm:
    """The tensor-parallel group's collectives: a deterministic all-reduce of any float array."""

    def __init__(self, mpi_comm, waiting=None, check: bool = True):
        self.mpi = mpi_comm
        self.waiting = waiting if waiting is not None else WaitRecord()   # what the watchdog times
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.stats: Dict[str, OpStats] = defaultdict(OpStats)
        self.check_stats = OpStats()      # the checks' headers (comm/signature.py), counted apart
        self.checks = Checks(mpi_comm, self.check_stats, (self.size - 1, 0), self.waiting) \
            if check and self.size > 1 else None
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
            if self.checks is None:
                self.mpi.Alltoall(flat, recv)
            else:
                others, nbytes = self.checks.others, n * x.itemsize
                self.checks.exchange(signature(op, x.dtype, x.size), [(r, [flat[r], nbytes, MPI.BYTE]) for r in others],
                                     [(r, [recv[r], nbytes, MPI.BYTE]) for r in others]).Wait()
        rows = [flat[r] if r == self.rank else recv[r] for r in range(k)]
        mine = rows[0].copy()
        for row in rows[1:]:           # rank order: the same bits on every rank, at every stage
            mine += row
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
        with self.waiting("tp_sum_scalars"):
            if self.checks is None:
                self.mpi.Allgather(local, table)
            else:
                others = self.checks.others
                self.checks.exchange(signature("tp_sum_scalars", local.dtype, local.size), [(r, local) for r in others],
                                     [(r, table[r]) for r in others]).Wait()
                table[self.rank] = local
        return sum_table(table)

    def bytes_sent(self) -> int:
        return sum(s.bytes for s in self.stats.values())

    def seconds(self) -> float:
        return sum(s.seconds for s in self.stats.values())


class Mesh:
    """The mesh of ``comm`` (mpi4py communicator or zerompi Communicator; default COMM_WORLD).

    ``tp``: ranks per tensor-parallel group; ``pp``: pipeline stages (tp x pp must divide the ranks;
    the rest is ``dp``). ``node_size`` (optional, in ranks): checked to be a multiple of ``tp``, so
    that no TP group spans two nodes. Attributes: ``tp``, ``dp``, ``pp`` (sizes), ``tp_rank``,
    ``dp_rank``, ``pp_rank`` (this rank's coordinates), ``ranks`` (this stage's dp x tp world
    ranks), ``pp_ranks`` (this rank's pipeline group: the world rank of each stage), and the
    communicators, each over the ranks that differ in its axes only, in world order:
    ``tp_comm`` (TPComm) / ``tp_mpi``, ``dp_comm`` (a zerompi Communicator over this rank's
    data-parallel group, counting into ``comm``'s table) / ``dp_mpi``, ``pp_comm``
    (PointToPoint) / ``pp_mpi``, and ``stage_mpi`` (this pipeline stage's dp x tp ranks: what an
    engine of this stage must agree with; the world itself when pp = 1). Every wait of them is
    timed by ``comm``'s watchdog (a Communicator is made over an mpi4py ``comm``: its watchdog,
    abort hook and launcher check guard the mesh's collectives, as an engine's guard its own).
    """

    def __init__(self, comm=None, tp: int = 1, *, pp: int = 1, node_size: Optional[int] = None):
        world = comm.mpi if isinstance(comm, Communicator) else (comm if comm is not None else MPI.COMM_WORLD)
        n = world.Get_size()
        check_mesh(n, tp, pp, node_size)
        share = comm if isinstance(comm, Communicator) else Communicator(world)
        self.world, self.tp, self.pp, self.dp = world, tp, pp, n // (tp * pp)
        self.node_size = node_size
        self.shape = {"tp": tp, "dp": self.dp, "pp": pp}     # AXES order
        rank = world.Get_rank()
        self.tp_rank, self.dp_rank, self.pp_rank = (self.coords(rank)[a] for a in AXES)
        self.ranks: List[List[int]] = [[self.rank_of(tp=t, dp=d, pp=self.pp_rank) for t in range(tp)]
                                       for d in range(self.dp)]
        self.pp_ranks: List[int] = [self.rank_of(tp=self.tp_rank, dp=self.dp_rank, pp=p) for p in range(pp)]
        self.tp_mpi = self._split("tp")
        self.dp_mpi = self._split("dp")
        self.stage_mpi = world if pp == 1 else self._split("tp", "dp")
        self.pp_mpi = self._split("pp")
        self.dp_comm = Communicator(self.dp_mpi, share=share)
        self.tp_comm = TPComm(self.tp_mpi, self.dp_comm.waiting, share.checked)   # timed by the engine's watchdog too
        self.pp_comm = PointToPoint(self.pp_mpi, self.dp_comm.waiting,
                                    [self.node_of(r) for r in self.pp_ranks] if pp > 1 else [0])

    # ---- coordinates ---------------------------------------------------------------------
    def coords(self, rank: int) -> Dict[str, int]:
        """{axis: index} of world rank ``rank``."""
        out = {}
        for axis in AXES:
            rank, out[axis] = divmod(rank, self.shape[axis])
        return out

    def rank_of(self, **coords: int) -> int:
        """The world rank at ``coords`` (every axis given)."""
        rank = 0
        for axis in reversed(AXES):
            rank = rank * self.shape[axis] + coords[axis]
        return rank

    def _split(self, *vary: str):
        """The sub-communicator of the ranks that share this rank's coordinates on every axis but ``vary``
        (a collective), ordered as in the world."""
        me = self.coords(self.world.Get_rank())
        color = 0
        for axis in reversed(AXES):
            color = color * self.shape[axis] + (0 if axis in vary else me[axis])
        return self.world.Split(color, self.world.Get_rank())

    def node_of(self, rank: int) -> int:
        """The node of world rank ``rank`` when the node size is known (``node_size``, or
        $ZEROMPI_NODE_SIZE), else 0 (every rank counted on one node)."""
        k = self.node_size or _env_node_size()
        return rank // k if k else 0

    # ---- the data-parallel group's settings ------------------------------------------------
    def dp_sizes(self, node_size: Optional[int], shard_size: Optional[int]) -> Tuple[Optional[int], Optional[int]]:
        """(node_size, shard_size) of this rank's data-parallel group for the world's settings (in ranks;
        None: not set; node_size None reads $ZEROMPI_NODE_SIZE): a node of S ranks holds S / tp ranks of a
        DP group when it lies inside one stage, the whole group when it holds whole stages."""
        if node_size is None:
            node_size = _env_node_size()
        n = self.world.Get_size()
        check_mesh(n, self.tp, self.pp, node_size, shard_size)
        stage = self.dp * self.tp
        node = None if node_size is None else (min(node_size, stage) if self.pp > 1 else node_size) // self.tp
        shard = None if shard_size is None else shard_size // self.tp
        return node, shard

    def describe(self) -> str:
        text = f"{self.dp} data-parallel x {self.tp} tensor-parallel (TP ranks adjacent: {self.ranks[0]}, ...)"
        if self.pp > 1:
            text = (f"{self.pp} pipeline stages x {text}; stage s holds ranks {self.dp * self.tp}·s .. "
                    f"{self.dp * self.tp}·s + {self.dp * self.tp - 1}, pipeline neighbours {self.dp * self.tp} ranks apart")
        return text


def _env_node_size() -> Optional[int]:
    text = os.environ.get("ZEROMPI_NODE_SIZE", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


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


def check_mesh(n: int, tp, pp=1, node_size: Optional[int] = None, shard_size: Optional[int] = None) -> None:
    """ConfigError (one line, naming the value) unless ``n`` ranks form pp stages of dp x tp ranks: tp as
    :func:`check_tp`; pp dividing n / tp; with pp > 1, a node either inside one stage (node_size dividing the
    stage's dp x tp ranks) or holding whole stages, and a shard group inside one stage."""
    check_tp(tp, n, node_size, shard_size)
    if not (isinstance(pp, int) and not isinstance(pp, bool) and pp >= 1 and (n // tp) % pp == 0):
        raise ConfigError(f"pp={pp!r} does not divide the {n // tp} ranks left by tp={tp}; use a divisor of {n // tp}"
                          if isinstance(pp, int) and pp >= 1 else f"pp={pp!r} must be a whole number of stages >= 1")
    stage = n // pp
    if pp > 1 and node_size is not None and n % node_size:
        raise ConfigError(f"node_size={node_size} does not divide the {n} ranks; use a divisor of {n}")
    if pp > 1 and node_size is not None and stage % node_size and node_size % stage:
        raise ConfigError(f"node_size={node_size} with pp={pp}: a node must lie inside one pipeline stage of "
                          f"{stage} ranks or hold whole stages; use a divisor or a multiple of {stage}")
    if pp > 1 and shard_size is not None and stage % shard_size:
        raise ConfigError(f"shard_size={shard_size} with pp={pp}: a shard group lies inside one pipeline stage of "
                          f"{stage} ranks; use a divisor of {stage}")
