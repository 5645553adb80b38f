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

One group's reduction is started nonblocking (:func:`ireduce_scatter_sources`: one Ialltoall of the
(rank, source) blocks, the sum when the handle is waited), so the engine overlaps it with the backward as its
other reduce-scatters; the two-level one runs to the end when started.
"""
import numpy as np

from ..optim import impl
from .watchdog import watched


def reduce_scatter_sources(comm, send, out, scale: float, accumulate: bool, sources: int, tag=None,
                           per_node: int = None) -> None:
    """Blocking form of :func:`ireduce_scatter_sources`."""
    ireduce_scatter_sources(comm, send, out, scale, accumulate, sources, tag, per_node).wait()


class SourcesHandle:
    """A started reduce-scatter of sources (a Communicator Handle's interface: ``op``, ``tag``, ``test()``,
    ``wait()``): the exchange in flight, its sum in :meth:`wait`. ``request`` None: nothing in flight (one rank,
    or the two-level reduction, which ran at the start)."""

    op = "reduce_scatter"

    def __init__(self, counter, request, finish, tag, buffers, sources: int = 0):
        self.what = f"expert gradients: reduce-scatter of {sources} sources per rank"   # the watchdog's name
        self._counter, self._request, self._finish, self.tag = counter, request, finish, tag
        self._buffers = buffers          # kept alive while MPI may touch them
        self.done = False

    def then(self, finish) -> "SourcesHandle":
        """Run ``finish()`` after the sum, in :meth:`wait` (a staged reduction's copy up)."""
        first = self._finish
        self._finish = finish if first is None else (lambda: (first(), finish()))
        return self

    def test(self) -> bool:
        return self.done or self._request is None or self._request.Test()

    def wait(self) -> None:
        if self.done:
            return
        if self._request is not None:
            with watched(self._counter, self.what):
                self._request.Wait()
        if self._finish is not None:
            self._finish()
        self._buffers, self._finish, self.done = (), None, True


def ireduce_scatter_sources(comm, send, out, scale: float, accumulate: bool, sources: int, tag=None,
                            per_node: int = None) -> SourcesHandle:
    """Start ``out = [out +] scale * Σ send[r, s][my slice]`` over ranks r, then sources s, of ``comm``: the
    exchange nonblocking (a flat group: one Ialltoall), the sum in the handle's ``wait()``, the same rows in the
    same order as the blocking form. Over nodes (two levels) it runs to the end here and the handle is done.

    ``send``: (sources, size·k) -- each source's whole contribution, laid out as a plain reduce-scatter's
    send buffer; ``out``: this rank's k elements, send's dtype. ``comm``: a Communicator, or a
    HierarchicalCommunicator (its node level then holds K < P sources' ranks); ``per_node``: P, where the
    sources' world ranks span nodes of P (K a multiple of P), else None. ``send`` may be written again once this
    returns; ``out`` is written in ``wait()``. Device arrays (CuPy, ``comm`` a staged Communicator) go down to
    the host at the start and ``out`` comes back up in ``wait()``: the host's sum, the same bits."""
    if impl.is_device(send):
        host = impl.to_host(out) if accumulate else np.empty(out.shape, out.dtype)
        handle = ireduce_scatter_sources(getattr(comm, "host", comm), impl.to_host(send), host, scale, accumulate,
                                         sources, tag, per_node)

        def up():
            out[...] = impl.array_module(out).asarray(host)
        return handle.then(up)
    if getattr(comm, "hierarchical", False) and comm.k > 1:
        _two_level(comm, send, out, scale, accumulate, sources)
        return SourcesHandle(comm, None, None, tag, ())
    if per_node is not None:
        nodes = sources // per_node                    # sum each node's partials here, in world order
        partials = np.empty((nodes, send.shape[1]), send.dtype)
        for c in range(nodes):
            impl.sum_rows(send[c * per_node:(c + 1) * per_node], partials[c], scale, False)
        send, sources, scale = partials, nodes, 1.0
    level = comm.inter if getattr(comm, "hierarchical", False) else comm   # one rank per node: slot = rank
    return _iflat(level, comm.mpi, send, out, scale, accumulate, sources, tag)


def _iflat(counter, mpi, send, out, scale, accumulate, sources, tag=None) -> SourcesHandle:
    """One group's reduce-scatter of sources: every (rank, source) block to its slice's owner by one Ialltoall,
    the owner's N·K rows summed in (rank, source) order when the handle is waited."""
    n, k = mpi.Get_size(), out.size
    blocks = np.ascontiguousarray(send.reshape(sources, n, k).transpose(1, 0, 2))    # (rank, source, k)
    recv = np.empty_like(blocks)
    finish = lambda: impl.sum_rows(recv.reshape(n * sources, k), out, scale, accumulate)   # noqa: E731
    if n == 1:
        recv[...] = blocks
        return SourcesHandle(counter, None, finish, tag, ())
    request = mpi.Ialltoall(blocks.view(np.uint8).reshape(n, -1), recv.view(np.uint8).reshape(n, -1))
    counter.count("reduce_scatter", sources * k * send.itemsize)
    return SourcesHandle(counter, request, finish, tag, (blocks, recv), sources)


def _flat(counter, mpi, send, out, scale, accumulate, sources) -> None:
    """Blocking :func:`_iflat`."""
    _iflat(counter, mpi, send, out, scale, accumulate, sources).wait()


def _two_level(comm, send, out, scale, accumulate, sources) -> None:
    """The node's P = k·K rows of every super-slice summed at its owner, then the plain across-node level.
    Blocking, on the levels' first-step communicators (whose collectives start at the call, in one order on
    every rank; the second-step ones start when a rank sees the first arrive)."""
    k = comm.k
    span = send.shape[1] // k                       # one super-slice
    partial = np.empty(span, send.dtype)
    _flat(comm.intra, comm.intra.mpi, send, partial, scale, False, sources)
    comm.inter.reduce_scatter(partial, out, 1.0, accumulate)
