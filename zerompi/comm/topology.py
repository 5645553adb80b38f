"""Where the ranks are: nodes, shard groups, and the communicators of each level.

**Nodes** are blocks of ``node_size`` consecutive ranks: found by MPI's shared-memory split
(``MPI_COMM_TYPE_SHARED``), or set by ``MeshConfig.node_size`` / ``ZEROMPI_NODE_SIZE``
(which is how one machine simulates several nodes). Ranks that MPI placed round-robin
(``mpirun --map-by node``: node 0 holds ranks 0, 2, ...) are numbered again node by node
(:func:`place`): the engine's rank is then the rank's position in that order, and the run
gives the bits of the same ranks placed in blocks. **Shard groups** are blocks of
``shard_size`` consecutive ranks, whole nodes (MiCS, FSDP's hybrid sharding): each group
holds one sharded copy of the model states, and the ``N / shard_size`` groups are replicas.

The communicators, all counting into the world Communicator's table (bytes split into
intra- and inter-node) and timed by its watchdog:

- ``group``: the shard group, where gradients are reduce-scattered and parameters
  gathered. Within one node it is a flat Communicator; across nodes a
  HierarchicalCommunicator (inside the node, then across nodes: comm/hierarchical.py);
- ``replica``: the ranks holding the same slice in every group (None with one group),
  where each step's reduced gradient shard is all-reduced;
- ``intra``: this rank's node within its group (hpZ's secondary gathers).
"""
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..errors import AgreedConfigError, ConfigError
from .communicator import Communicator
from .subcomm import split

NODE_SIZE_ENV = "ZEROMPI_NODE_SIZE"


@dataclass(frozen=True)
class Topology:
    """``size`` ranks in nodes of ``node_size`` and shard groups of ``shard_size`` (both consecutive)."""
    size: int
    node_size: int
    shard_size: int

    def __post_init__(self):
        n, k, s = self.size, self.node_size, self.shard_size
        if not (isinstance(k, int) and k >= 1 and n % k == 0):
            raise ConfigError(f"node_size={k!r} does not divide the {n} ranks; use a divisor of {n}")
        if not (isinstance(s, int) and s >= 1 and n % s == 0 and s % k == 0):
            raise ConfigError(f"shard_size={s!r} is not allowed with {n} ranks in nodes of {k}; use a divisor of "
                              f"{n} that is a multiple of the node size {k} (shard groups are whole nodes)")

    @property
    def nodes(self) -> int:
        return self.size // self.node_size

    @property
    def replicas(self) -> int:
        """Shard groups: copies of the sharded model states."""
        return self.size // self.shard_size

    @property
    def nodes_per_group(self) -> int:
        return self.shard_size // self.node_size

    def node_of(self, rank: int) -> int:
        return rank // self.node_size

    def describe(self) -> str:
        """One line for the banner."""
        nodes = f"{self.nodes} node{'s' if self.nodes > 1 else ''} of {self.node_size}"
        if self.replicas == 1:
            return f"{nodes}; shards over all {self.size} ranks"
        return f"{nodes}; {self.replicas} shard groups of {self.shard_size} (replicated across groups)"


def node_size_env(environ=os.environ) -> Optional[int]:
    """$ZEROMPI_NODE_SIZE as ranks per node, None when unset or blank; ConfigError naming the variable
    unless it is a whole number >= 1."""
    text = environ.get(NODE_SIZE_ENV, "").strip()
    if not text:
        return None
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise ConfigError(f"{NODE_SIZE_ENV}={text!r} is not allowed; use a whole number of ranks per node >= 1 "
                          "(or leave it unset: MPI's shared-memory split)")
    return k


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


def check_sizes(ranks: int, node_size: int, shard_size: Optional[int], tp: int = 1, env: bool = False) -> None:
    """ConfigError, in the user's units, unless ``ranks`` ranks (the world) make nodes of ``node_size`` and
    shard groups of ``shard_size`` (None: all), each holding whole tensor-parallel groups of ``tp``.
    ``env``: the node size is $ZEROMPI_NODE_SIZE's, and the message names the variable."""
    try:
        if tp > 1:
            check_tp(tp, ranks, node_size, shard_size)
        Topology(ranks, node_size, shard_size or ranks)
    except ConfigError as e:
        if env:
            raise ConfigError(f"{NODE_SIZE_ENV}={node_size} sets the node size, and {e}") from None
        raise


def placement_from(mpi_comm, requested: Optional[int], environ=os.environ) -> Tuple[int, Optional[List[int]]]:
    """(node size, order): ``requested``, else $ZEROMPI_NODE_SIZE (nodes are then blocks of
    consecutive ranks, simulated), else the nodes MPI's shared-memory split finds (a collective).
    ``order``: None when every node holds consecutive ranks; else the ranks node by node (nodes
    in the order of their lowest rank, each node's ranks in rank order), the numbering the
    engine then uses (:func:`renumbered`). AgreedConfigError, raised by every rank alike, when
    the nodes hold different numbers of ranks."""
    if requested is not None:
        return requested, None
    k = node_size_env(environ)
    if k is not None:
        return k, None
    if hasattr(mpi_comm, "shared_size"):     # a simulated world (simulated_world.py): its nodes, as it was given them
        return mpi_comm.shared_size, None
    nodes = nodes_of(mpi_comm)
    sizes = sorted({len(ranks) for ranks in nodes})
    if len(sizes) > 1:
        raise AgreedConfigError(f"the nodes hold different numbers of ranks ({describe_nodes(nodes)}); ZeRO's "
                                f"nodes must be equal: start the same number of ranks on every node, or set "
                                f"MeshConfig.node_size (--node-size) / {NODE_SIZE_ENV} to simulate nodes of that many "
                                "ranks")
    order = [r for ranks in nodes for r in ranks]
    return sizes[0], (None if order == list(range(len(order))) else order)


def node_size_from(mpi_comm, requested: Optional[int], environ=os.environ) -> int:
    """The node size alone (:func:`placement_from`; a collective)."""
    return placement_from(mpi_comm, requested, environ)[0]


def nodes_of(mpi_comm) -> List[List[int]]:
    """The ranks of every node, as MPI's shared-memory split finds them (a collective): nodes in
    the order of their lowest rank, each node's ranks in rank order."""
    from mpi4py import MPI
    rank = mpi_comm.Get_rank()
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        first = node.allreduce(rank, op=MPI.MIN)
    finally:
        node.Free()
    firsts = mpi_comm.allgather(first)
    return [[r for r, f in enumerate(firsts) if f == lowest] for lowest in sorted(set(firsts))]


def nodes_from_order(order: List[int], k: int) -> List[List[int]]:
    return [order[i:i + k] for i in range(0, len(order), k)]


def describe_nodes(nodes: List[List[int]], limit: int = 4) -> str:
    """'node 0: ranks [0, 2]; node 1: ranks [1, 3]' (the first ``limit`` nodes, then how many more)."""
    shown = "; ".join(f"node {i}: ranks {ranks}" for i, ranks in enumerate(nodes[:limit]))
    return shown + (f"; {len(nodes) - limit} more nodes" if len(nodes) > limit else "")


def renumbered(comm, order: List[int]):
    """``comm`` (a zerompi Communicator, or a device one over a host Communicator) with its ranks
    numbered ``order`` (rank ``order[i]`` becomes rank i), counting into the same table and timed
    by the same watchdog (a collective). ConfigError over a path that cannot be renumbered (NCCL)."""
    host = getattr(comm, "host", None)
    rewrap = getattr(comm, "rewrap", None)
    if host is not None and rewrap is None:
        raise ConfigError(f"the ranks are placed round-robin over the nodes (not in blocks), which "
                          f"{getattr(comm, 'path', type(comm).__name__)} cannot renumber; place them in blocks "
                          "(mpiexec's block mapping) or use --comm mpi")
    base = host if host is not None else comm
    position = order.index(base.rank)
    again = Communicator(base.mpi.Split(0, position), share=base)
    return rewrap(again) if host is not None else again


@dataclass
class Communicators:
    """The communicators of one rank in a Topology (see the module docstring)."""
    group: object                      # Communicator or HierarchicalCommunicator over the shard group
    replica: Optional[Communicator]    # None with one shard group
    intra: Communicator                # this rank's node within its group


def build(world: Communicator, topo: Topology) -> Communicators:
    """Split ``world`` into the communicators of ``topo`` (collectives: every rank calls it)."""
    k, s = topo.node_size, topo.shard_size
    mpi = world.mpi
    group_mpi = split(mpi, lambda r: r // s)              # consecutive blocks of s; g below is a rank in one
    node_mpi = split(group_mpi, lambda g: g // k)
    intra = Communicator(node_mpi, share=world)           # every peer on this node
    if topo.nodes_per_group == 1:
        group = intra
    else:
        from .hierarchical import HierarchicalCommunicator
        across = Communicator(split(group_mpi, lambda g: g % k), share=world,
                              node_of=list(range(topo.nodes_per_group)))
        group = HierarchicalCommunicator(intra, across, group_mpi)
    replica = None
    if topo.replicas > 1:
        replica = Communicator(split(mpi, lambda r: r % s), share=world, node_of=list(range(topo.replicas)))
    return Communicators(group, replica, intra)


def place(comm, node_size: Optional[int], shard_size: Optional[int], renumber: bool = True, tp: int = 1):
    """(communicator, Topology) for these settings: ``comm`` itself, or -- when MPI's nodes hold
    ranks that are not consecutive (a round-robin placement, ``mpirun --map-by node``) -- ``comm``
    renumbered node by node (:func:`renumbered`), so that every node is a block of ranks again
    (``renumber`` False: AgreedConfigError instead, for a Mesh's group, whose order is the mesh's).
    A collective; ConfigError naming the values when they do not fit the ranks. ``tp``: ``comm`` is one
    data-parallel group of a tensor-parallel mesh and the sizes are the world's divided by tp; the message
    gives the world's."""
    n = comm.size
    if n == 1:
        return comm, Topology(1, 1, 1)
    host = getattr(comm, "host", comm)
    k, order = placement_from(host.mpi, node_size)
    from_env = node_size is None and node_size_env() is not None
    check_sizes(n * tp, k * tp, shard_size and shard_size * tp, tp, env=from_env)   # in the user's units
    topo = Topology(n, k, shard_size or n)        # the sizes checked before anything is split
    if order is not None and not renumber:
        raise AgreedConfigError(f"the data-parallel group's ranks are not placed in blocks per node (nodes: "
                                f"{describe_nodes(nodes_from_order(order, k))}); with a mesh (tensor or pipeline "
                                "parallelism) place the ranks in blocks (mpiexec's block mapping)")
    return (comm if order is None else renumbered(comm, order)), topo


def arrange(comm, topo: Topology, quantized: bool = False) -> Communicators:
    """The communicators of ``topo`` over ``comm``: ``comm`` itself when there is one node and
    one shard group; else split from its host Communicator and, for device buffers, staged
    again through the same transfers (collectives: every rank calls it). ``quantized``: the
    engine will quantize what travels (comm/quantized.py), which NCCL's path does not offer."""
    if quantized and getattr(comm, "host", None) is not None and getattr(comm, "rewrap", None) is None:
        path = getattr(comm, "path", type(comm).__name__)
        raise ConfigError(f"quantized communication is not available over {path}; use --comm mpi")
    if topo.nodes == 1 and topo.replicas == 1:
        return Communicators(comm, None, comm)
    rewrap = getattr(comm, "rewrap", None)
    if rewrap is None and getattr(comm, "host", None) is not None:
        raise ConfigError(f"node_size / shard_size across {topo.nodes} nodes and {topo.replicas} shard groups "
                          f"are not available over {getattr(comm, 'path', type(comm).__name__)}; use --comm mpi")
    comms = build(getattr(comm, "host", comm), topo)
    if rewrap is not None:
        comms = Communicators(rewrap(comms.group), comms.replica and rewrap(comms.replica), rewrap(comms.intra))
    return comms
