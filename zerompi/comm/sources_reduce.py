"""A reduce-scatter whose ranks each hand in several sources' partial sums: the expert gradients of EP.

Under expert parallelism (train/moe/config.py's --ep K) a rank holding an expert computes its weight gradient
once per source rank of its EP group (the tokens each sent), as that source would have computed it without
EP. Each rank of the expert-data-parallel group hands in those K partials; the owner of a slice sums all
N = D·K rows in (rank, source) order -- the order of the world's ranks -- with the reduce-scatter's own fp32 row
sum (optim/impl.sum_rows): the bits of a plain reduce-scatter over the N ranks, at any K. The price is K times
the bytes of one reduce-scatter over D ranks (docs/moe.md).

Over nodes (comm/hierarchical.py) the sum is the two-level one of the N ranks without EP, element for
element: each node's P ranks summed (fp32, scaled, rounded to the bucket's dtype), then the nodes' partials
summed in node order. Where an EP group sits inside a node (K < P), the node level is an exchange among the
node's expert-data-parallel ranks (each sends its K partials of every super-slice to its owner, who sums the
node's P rows in world order), and the across-node level is the plain one (only the node's partial crosses).
Where it spans nodes (K a multiple of P, ``per_node`` = P: one expert-data-parallel rank per node), a rank's
K sources are K/P whole nodes: it sums each node's P partials itself and hands in those K/P.
"""
import numpy as np

from ..optim import impl
from .watchdog import watched


def reduce_scatter_sources(comm, send, out, scale: float, accumulate: bool, sources: int, tag=None,
                           per_node: int = None) -> None:
    """``out = [out +] scale * Σ send[r, s][my slice]`` over ranks r, then sources s, of ``comm`` (blocking).

    ``send``: (sources, size·k) -- each source's whole contribution, laid out as a plain reduce-scatter's
    send buffer; ``out``: this rank's k elements, send's dtype. ``comm``: a Communicator, or a
    HierarchicalCommunicator (its node level then holds K < P sources' ranks); ``per_node``: P, where the
    sources' world ranks span nodes of P (K a multiple of P), else None."""
    if getattr(comm, "hierarchical", False) and comm.k > 1:
        return _two_level(comm, send, out, scale, accumulate, sources)
    if per_node is not None:
        nodes = sources // per_node                    # sum each node's partials here, in world order
        partials = np.empty((nodes, send.shape[1]), send.dtype)
        for c in range(nodes):
            impl.sum_rows(send[c * per_node:(c + 1) * per_node], partials[c], scale, False)
        send, sources, scale = partials, nodes, 1.0
    level = comm.inter if getattr(comm, "hierarchical", False) else comm   # one rank per node: slot = rank
    _flat(level, comm.mpi, send, out, scale, accumulate, sources)


def _flat(counter, mpi, send, out, scale, accumulate, sources) -> None:
    n, k = mpi.Get_size(), out.size
    blocks = np.ascontiguousarray(send.reshape(sources, n, k).transpose(1, 0, 2))    # (rank, source, k)
    recv = np.empty_like(blocks)
    if n > 1:
        with watched(counter, f"expert gradients: reduce-scatter of {sources} sources per rank"):
            mpi.Alltoall(blocks.view(np.uint8).reshape(n, -1), recv.view(np.uint8).reshape(n, -1))
        counter.count("reduce_scatter", sources * k * send.itemsize)
    else:
        recv[...] = blocks
    impl.sum_rows(recv.reshape(n * sources, k), out, scale, accumulate)


def _two_level(comm, send, out, scale, accumulate, sources) -> None:
    """The node's P = k·K rows of every super-slice summed at its owner, then the plain across-node level.
    Blocking, on the levels' first-step communicators (whose collectives start at the call, in one order on
    every rank; the second-step ones start when a rank sees the first arrive)."""
    k = comm.k
    span = send.shape[1] // k                       # one super-slice
    partial = np.empty(span, send.dtype)
    _flat(comm.intra, comm.intra.mpi, send, partial, scale, False, sources)
    comm.inter.reduce_scatter(partial, out, 1.0, accumulate)
