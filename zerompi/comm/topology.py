"""Where the ranks are: nodes, shard groups, and the communicators of each level.

**Nodes** are blocks of ``node_size`` consecutive ranks: found by MPI's shared-memory split
(``MPI_COMM_TYPE_SHARED``), or set by ``ZeroConfig.node_size`` / ``ZEROMPI_NODE_SIZE``
(which is how one machine simulates several nodes). **Shard groups** are blocks of
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
from typing import Optional

from ..errors import ConfigError
from .communicator import Communicator
from .split import split

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


def node_size_from(mpi_comm, requested: Optional[int], environ=os.environ) -> int:
    """The node size: ``requested``, else $ZEROMPI_NODE_SIZE, else the shared-memory split (a
    collective; ConfigError unless every node holds the same number of consecutive ranks)."""
    if requested is not None:
        return requested
    text = environ.get(NODE_SIZE_ENV, "").strip()
    if text:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{NODE_SIZE_ENV}={text!r} is not allowed; use a whole number of ranks per node") from None
    if hasattr(mpi_comm, "shared_size"):     # a simulated world (comm/simulated.py): its nodes, as it was given them
        return mpi_comm.shared_size
    from mpi4py import MPI
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    try:
        first = node.allreduce(mpi_comm.Get_rank(), op=MPI.MIN)
        mine = (node.Get_size(), first, node.Get_rank())
    finally:
        node.Free()
    everyone = mpi_comm.allgather(mine)
    k = everyone[0][0]
    if any(size != k or first != r - local for r, (size, first, local) in enumerate(everyone)) \
            or any(first % k for _, first, _ in everyone):
        sizes = sorted({size for size, _, _ in everyone})
        raise ConfigError(f"the ranks are not placed in equal blocks of consecutive ranks per node (ranks per node: "
                          f"{sizes}); place them so (e.g. mpiexec's block mapping) or set ZeroConfig.node_size / "
                          f"{NODE_SIZE_ENV}")
    return k


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


def topology_of(comm, node_size: Optional[int], shard_size: Optional[int]) -> Topology:
    """The Topology of ``comm`` (a zerompi Communicator, host or device) for these settings
    (ConfigError naming the values when they do not fit the ranks)."""
    n = comm.size
    if n == 1:
        return Topology(1, 1, 1)
    host = getattr(comm, "host", comm)
    k = node_size_from(host.mpi, node_size)
    return Topology(n, k, shard_size or n)


def arrange(comm, topo: Topology, quantized: bool = False) -> Communicators:
    """The communicators of ``topo`` over ``comm``: ``comm`` itself when there is one node and
    one shard group; else split from its host Communicator and, for device buffers, staged
    again through the same transfers (collectives: every rank calls it). ``quantized``: the
    engine will quantize what travels (comm/quantized.py), which NCCL's path does not offer."""
    if quantized and getattr(comm, "host", None) is not None and getattr(comm, "rewrap", None) is None:
        raise ConfigError(f"quantized communication is not available over {getattr(comm, 'path', type(comm).__name__)}; "
                          "use --comm mpi")
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
