"""Mesh: N ranks as tensor-parallel x sequence-parallel x data-parallel ranks x pipeline stages.

The rank order, innermost first (Megatron-LM's tp-cp-dp-pp)::

    world rank = tp_i + TP * (sp_i + SP * (dp_i + DP * pp_i))

so a TP group is TP adjacent ranks and an SP group the SP adjacent TP groups around it (both
inside a node), the TP x SP x DP ranks of one pipeline stage are one contiguous block, and pipeline
neighbours are DP·SP·TP ranks apart (possibly on other nodes). The groups, each an mpi4py
sub-communicator over the ranks that differ in its axes only, in world order:

- ``tp_comm`` (TPComm): the TP ranks, which split each block's matrices;
- ``sp_comm`` (alltoall.SPComm): the SP ranks, which split each sequence (DeepSpeed-Ulysses);
- ``zero_comm`` (a zerompi Communicator): the dp x sp ranks of one (tp_i, pp_i), which hold the
  same parameters (the SP ranks compute on other tokens of them) and over which ZeRO shards them
  and reduces their gradients, as DeepSpeed-Ulysses does;
- ``pp_comm`` (p2p.PointToPoint): one rank of each stage, the pipeline's messages::

    mesh = zerompi.Mesh(tp=2)                       # COMM_WORLD, 4 ranks: TP groups [0, 1], [2, 3]
    engine = zerompi.ZeroEngine(layers, cfg, comm=mesh, tp_split=split)   # ZeRO over mesh.zero_comm
    mesh.tp_comm.all_reduce(partial)                # Megatron's f / g: sum over the TP group
    mesh = zerompi.Mesh(tp=2, sp=2)                 # 8 ranks: SP groups [0, 2], [1, 3], [4, 6], [5, 7]
    mesh.sp_comm.all_to_all(qkv, scatter=3, gather=1)   # Ulysses: the whole sequence, heads / SP
    mesh = zerompi.Mesh(tp=2, pp=2)                 # 8 ranks: stage 0 = ranks 0-3, stage 1 = ranks 4-7

``tp_comm`` sums in rank order (reduce-scatter by an all-to-all, then Allgather), so every TP rank
gets the same bits, in any float dtype. The TP, SP and pipeline bytes are counted in their own
tables, apart from the engine's ZeRO traffic. The TP and SP exchanges are checked as the
Communicator's collectives are (comm/signature.py): ranks of a group that pass different lengths,
dtypes or operations all stop with one MismatchError.
"""
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ..errors import ConfigError, UsageError
from ..optim import impl
from .alltoall import SPComm
from .communicator import Communicator
from .consistency import check_consistent
from .group import GroupComm
from .p2p import PointToPoint
from .subcomm import split
from .topology import check_tp, node_size_env, nodes_of

AXES = ("tp", "sp", "dp", "pp")      # the mesh's axes, innermost (adjacent ranks) first


class TPComm(GroupComm):
    """The tensor-parallel group's collectives: a deterministic all-reduce of any float array."""

    kind = "tp"

    def __init__(self, mpi_comm, waiting=None, check: bool = True):
        super().__init__(mpi_comm, waiting, check)
        self._scratch: Dict[tuple, np.ndarray] = {}

    def all_reduce(self, x, op: str = "tp_all_reduce") -> np.ndarray:
        """Sum ``x`` over the TP ranks, in place (x contiguous, its size a multiple of the group size):
        an Alltoall of the K slices, each rank sums its slice's K rows in rank order, an Allgather (a
        device array is staged through host memory: the same bits, its two copies in the op's seconds).
        Sends 2 (K-1)/K of x's bytes per rank, counted under ``op``. Returns x."""
        k = self.size
        if k == 1:
            return x
        if impl.is_device(x):   # device memory (CuPy): one copy each way, counted in the op's seconds
            t, st = time.perf_counter(), self.stats[op]
            before = st.seconds
            x[...] = impl.array_module(x).asarray(self.all_reduce(impl.to_host(x), op))
            st.seconds = before + time.perf_counter() - t
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
            self.exchange(op, x, flat, recv)
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


class Mesh:
    """The mesh of ``comm`` (mpi4py communicator or zerompi Communicator; default COMM_WORLD).

    ``tp``: ranks per tensor-parallel group; ``sp``: TP groups per sequence-parallel group; ``pp``:
    pipeline stages (tp x sp x pp must divide the ranks; the rest is ``dp``). ``node_size``
    (optional, in ranks): checked to be a multiple of tp x sp, so that no TP or SP group spans two
    nodes. Every rank must pass the same tp, sp and pp (checked first: MismatchError on every rank
    naming them). Attributes: ``tp``, ``sp``, ``dp``, ``pp`` (sizes), ``tp_rank``, ``sp_rank``,
    ``dp_rank``, ``pp_rank`` (this rank's coordinates); ``ranks`` (this stage's TP groups' world ranks,
    in order); ``tp_ranks``, ``sp_ranks``, ``zero_ranks``, ``pp_ranks`` (the world ranks of this rank's
    groups: the pipeline's one of each stage); the communicators ``tp_comm`` / ``tp_mpi``, ``sp_comm``
    / ``sp_mpi``, ``zero_comm`` / ``zero_mpi`` (counting into ``comm``'s table), ``pp_comm`` / ``pp_mpi``,
    and ``stage_mpi`` (this pipeline stage's ranks: what an engine of this stage must agree with; the
    world itself when pp = 1). Every wait of them is timed by ``comm``'s watchdog (a Communicator is made
    over an mpi4py ``comm``: its watchdog, abort hook and launcher check guard the mesh's collectives, as
    an engine's guard its own).
    """

    def __init__(self, comm=None, tp: int = 1, *, sp: int = 1, pp: int = 1, node_size: Optional[int] = None):
        world = comm.mpi if isinstance(comm, Communicator) else (comm if comm is not None else MPI.COMM_WORLD)
        n = world.Get_size()
        share = comm if isinstance(comm, Communicator) else Communicator(world)   # its watchdog times the waits
        # Agreed first: a rank with another size would split into groups the others never join.
        check_consistent(share, "mesh", {"tp": tp, "sp": sp, "pp": pp})
        check_mesh(n, tp, pp, node_size, sp=sp)
        self.world, self.tp, self.sp, self.pp, self.dp = world, tp, sp, pp, n // (tp * sp * pp)
        self.node_size = node_size
        self.shape = {"tp": tp, "sp": sp, "dp": self.dp, "pp": pp}     # AXES order
        rank = world.Get_rank()
        self.tp_rank, self.sp_rank, self.dp_rank, self.pp_rank = (self.coords(rank)[a] for a in AXES)
        self.ranks: List[List[int]] = [[self.rank_of(tp=t, sp=s, dp=d, pp=self.pp_rank) for t in range(tp)]
                                       for d in range(self.dp) for s in range(sp)]
        self.tp_ranks, self.sp_ranks = self.members("tp"), self.members("sp")
        self.zero_ranks, self.pp_ranks = self.members("sp", "dp"), self.members("pp")
        self.tp_mpi = self._split("tp")
        self.sp_mpi = self._split("sp")
        self.zero_mpi = self._split("sp", "dp")
        self.stage_mpi = world if pp == 1 else self._split("tp", "sp", "dp")
        self.pp_mpi = self._split("pp")
        self.zero_comm = Communicator(self.zero_mpi, share=share)
        self.tp_comm = TPComm(self.tp_mpi, self.zero_comm.waiting, share.checked)   # timed by the engine's watchdog too
        self.sp_comm = SPComm(self.sp_mpi, self.zero_comm.waiting, share.checked)
        self._nodes = self._find_nodes() if pp > 1 else None   # pipeline neighbours may be on other nodes
        self.pp_comm = PointToPoint(self.pp_mpi, self.zero_comm.waiting,
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

    def members(self, *vary: str) -> List[int]:
        """The world ranks that share this rank's coordinates on every axis but ``vary``, in world order."""
        me = self.coords(self.world.Get_rank())
        return [r for r in range(self.world.Get_size())
                if all(c == me[a] for a, c in self.coords(r).items() if a not in vary)]

    def _split(self, *vary: str):
        """The sub-communicator of :meth:`members` (a collective), ordered as in the world; its color a
        function of the rank (comm/subcomm.py: what a simulated world evaluates for every rank)."""
        def color_of(rank: int) -> int:
            at, color = self.coords(rank), 0
            for axis in reversed(AXES):
                color = color * self.shape[axis] + (0 if axis in vary else at[axis])
            return color
        return split(self.world, color_of)

    def node_of(self, rank: int) -> int:
        """The node of world rank ``rank``: blocks of ``node_size`` (or $ZEROMPI_NODE_SIZE) where given; else,
        with pipeline stages, the nodes MPI's shared-memory split found (in any placement); else 0."""
        if self._nodes is not None:
            return self._nodes[rank]
        k = self.node_size or node_size_env()
        return rank // k if k else 0

    def _find_nodes(self) -> List[int]:
        """The node of every world rank (a collective when MPI's split has to be asked): the node size given,
        a simulated world's nodes, or the shared-memory split's nodes, numbered by their lowest rank."""
        n = self.world.Get_size()
        k = self.node_size or node_size_env() or getattr(self.world, "node_size", None)   # simulated: its nodes
        if k:
            return [r // k for r in range(n)]
        where = [0] * n
        for i, ranks in enumerate(nodes_of(self.world)):
            for r in ranks:
                where[r] = i
        return where

    # ---- the ZeRO group's settings ----------------------------------------------------------
    def zero_sizes(self, node_size: Optional[int], shard_size: Optional[int]) -> Tuple[Optional[int], Optional[int]]:
        """(node_size, shard_size) of this rank's ZeRO group (its dp x sp ranks) for the world's settings (in
        ranks; None: not set; node_size None reads $ZEROMPI_NODE_SIZE): a node of S ranks holds S / tp ranks
        of the group when it lies inside one stage, the whole group when it holds whole stages."""
        if node_size is None:
            node_size = node_size_env()       # a bad value is one line naming the variable
        n = self.world.Get_size()
        check_mesh(n, self.tp, self.pp, node_size, shard_size, sp=self.sp)
        stage = self.dp * self.sp * self.tp
        node = None if node_size is None else (min(node_size, stage) if self.pp > 1 else node_size) // self.tp
        shard = None if shard_size is None else shard_size // self.tp
        return node, shard

    def describe(self) -> str:
        parts = [f"{self.dp} data-parallel"] + [f"{k} {what}-parallel"
                                                 for k, what in ((self.sp, "sequence"), (self.tp, "tensor"))
                                                 if k > 1 or what == "tensor"]
        adjacent = [f"TP ranks adjacent: {self.ranks[0]}"]
        adjacent += [f"SP ranks {[g[0] for g in self.ranks[:self.sp]]}"] if self.sp > 1 else []
        text = f"{' x '.join(parts)} ({', '.join(adjacent)}, ...)"
        text += f"; ZeRO over {self.dp * self.sp} ranks (data x sequence parallel)" if self.sp > 1 else ""
        if self.pp > 1:
            block = self.dp * self.sp * self.tp
            text = (f"{self.pp} pipeline stages x {text}; stage s holds ranks {block}·s .. {block}·s + {block - 1}, "
                    f"pipeline neighbours {block} ranks apart")
        return text


def check_sp(sp, tp: int, n: int, node_size: Optional[int] = None) -> None:
    """ConfigError (one line, naming the value) unless ``sp`` divides the ``n / tp`` TP groups and, with
    ``node_size`` (in ranks), tp x sp divides it (an SP group inside one node)."""
    if not (isinstance(sp, int) and not isinstance(sp, bool) and sp >= 1 and (n // tp) % sp == 0):
        what = f"the {n} ranks" if tp == 1 else f"the {n // tp} tensor-parallel groups of tp={tp} ({n} ranks)"
        raise ConfigError(f"sp={sp!r} does not divide {what}; use a divisor of {n // tp}")
    if node_size is not None and node_size % (tp * sp):
        raise ConfigError(f"tp x sp = {tp * sp} does not divide node_size={node_size}; a sequence-parallel "
                          "group must sit inside one node")


def check_mesh(n: int, tp, pp=1, node_size: Optional[int] = None, shard_size: Optional[int] = None,
               sp=1) -> None:
    """ConfigError (one line, naming the value) unless ``n`` ranks form pp stages of dp x sp x tp ranks: tp as
    :func:`check_tp`, sp as :func:`check_sp`; pp dividing n / (tp sp); with pp > 1, a node either inside one
    stage (node_size dividing the stage's ranks) or holding whole stages, and a shard group inside one stage."""
    check_tp(tp, n, node_size, shard_size)
    check_sp(sp, tp, n, node_size)
    left, by = n // (tp * sp), f"tp={tp}" + (f" x sp={sp}" if sp > 1 else "")
    if not (isinstance(pp, int) and not isinstance(pp, bool) and pp >= 1 and left % pp == 0):
        raise ConfigError(f"pp={pp!r} does not divide the {left} ranks left by {by}; use a divisor of {left}"
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
