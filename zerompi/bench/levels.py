"""``zerompi.bench --node-size K``: the two-level collectives beside the flat ones.

One concern: the rows of the two-level reduce-scatter, all-gather and all-reduce
(comm/hierarchical.py, impl ``zerompi-2level``) over all N ranks in simulated nodes of K
consecutive ranks, and the bytes one call sends inside and across nodes, for them and for the
flat ``zerompi`` rows (whose Communicator is then told the nodes, so it counts both levels).
The MPI library's rows send what its algorithm chooses: no count (None).
"""
from typing import Optional, Tuple

from ..errors import ConfigError

TWO_LEVEL = "zerompi-2level"


def check_node_size(node_size: Optional[int], n: int, device: str) -> None:
    """ConfigError naming the value unless ``node_size`` splits the ``n`` ranks into 2 nodes or more."""
    if node_size is None:
        return
    if device != "cpu":
        raise ConfigError(f"node_size={node_size} needs --device cpu: the two-level rows run on host buffers")
    if n % node_size:
        raise ConfigError(f"node_size={node_size} does not divide the {n} ranks; use a divisor of {n} below {n}")
    if node_size == n:
        raise ConfigError(f"node_size={node_size} puts all {n} ranks on one node: there is no two-level collective "
                          f"to measure; use a divisor of {n} below {n}")


def communicators(world, node_size: Optional[int]) -> Tuple[object, Optional[object]]:
    """(the flat Communicator, the two-level one or None) over the mpi4py communicator ``world``
    (collectives: every rank calls it). The flat one counts bytes per level when there are nodes."""
    from ..comm.communicator import Communicator
    if node_size is None:
        return Communicator(world), None
    from ..comm.topology import Topology, build
    n = world.Get_size()
    flat = Communicator(world, node_of=[r // node_size for r in range(n)])
    return flat, build(flat, Topology(n, node_size, n)).group


def bytes_per_call(mpi, stats, case) -> dict:
    """{"intra_bytes", "inter_bytes"}: what one run of ``case`` sent inside and across nodes (the most
    any rank sent), read off the shared counters ``stats`` (the Communicator's per-op table)."""
    import numpy as np
    from mpi4py import MPI

    def levels():
        return np.array([sum(s.intra for s in stats.values()), sum(s.inter for s in stats.values())], np.int64)
    case.reset()
    mpi.Barrier()
    before = levels()
    case.run()
    sent = levels() - before
    mpi.Allreduce(MPI.IN_PLACE, sent, op=MPI.MAX)
    return {"intra_bytes": int(sent[0]), "inter_bytes": int(sent[1])}


def level_record(node_size: int, impl: str, mpi, stats, case) -> dict:
    """The record's fields of a run with nodes: the node size and one call's bytes per level."""
    sent = bytes_per_call(mpi, stats, case) if impl != "mpi" else {"intra_bytes": None, "inter_bytes": None}
    return {"node_size": node_size, **sent}


def banner(n: int, node_size: int) -> str:
    return (f"# nodes: {n // node_size} of {node_size} ranks (simulated); {TWO_LEVEL}: inside the node, then "
            f"across (comm/hierarchical.py); intra / inter: bytes one call sends inside and across nodes, the most "
            f"any rank sent")


def columns(rec: dict) -> str:
    """The table's two extra columns: bytes of one call inside and across nodes ('-' for MPI's rows)."""
    show = lambda v: "-" if v is None else str(v)
    return f" {show(rec.get('intra_bytes')):>10} {show(rec.get('inter_bytes')):>10}"


HEADER = (f" {'intra':>10} {'inter':>10}", f" {'(B/call)':>10} {'(B/call)':>10}")
