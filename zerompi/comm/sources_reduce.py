"""A reduce-scatter whose ranks each hand in several sources' partial sums: the expert gradients of EP.

Under expert parallelism (train/moe/config.py's --ep K) a rank holding an expert computes its weight gradient
once per source rank of its EP group (the tokens each sent), as that source would have computed it without
EP. Each rank of the expert-data-parallel group hands in those K partials; the owner of a slice sums all
N = D·K rows in (rank, source) order -- the order of the world's ranks -- with the reduce-scatter's own fp32 row
sum (optim/impl.sum_rows): the bits of a plain reduce-scatter over the N ranks, at any K. The price is K times
the bytes of one reduce-scatter over D ranks (docs/moe.md).
"""
import numpy as np

from ..optim import impl
from .watchdog import watched


def reduce_scatter_sources(comm, send, out, scale: float, accumulate: bool, sources: int, tag=None) -> None:
    """``out = [out +] scale * Σ send[r, s][my slice]`` over ranks r, then sources s, of ``comm`` (blocking).

    ``send``: (sources, size·k) -- each source's whole contribution, laid out as a plain reduce-scatter's
    send buffer; ``out``: this rank's k elements, send's dtype."""
    n, k = comm.size, out.size
    blocks = np.ascontiguousarray(send.reshape(sources, n, k).transpose(1, 0, 2))    # (rank, source, k)
    recv = np.empty_like(blocks)
    if n > 1:
        with watched(comm, f"expert gradients: reduce-scatter of {sources} sources per rank"):
            comm.mpi.Alltoall(blocks.view(np.uint8).reshape(n, -1), recv.view(np.uint8).reshape(n, -1))
        comm.count("reduce_scatter", sources * k * send.itemsize)
    else:
        recv[...] = blocks
    impl.sum_rows(recv.reshape(n * sources, k), out, scale, accumulate)
