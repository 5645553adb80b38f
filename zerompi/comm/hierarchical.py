"""Two-level collectives for a shard group that spans nodes: inside the node, then across.

The group's G = K * M ranks sit in M nodes of K. Slice ``slot`` of every bucket belongs to
the rank at local position l on node m, with ``slot = l * M + m``: so local rank l's M
slices are contiguous (its *super-slice*), and each level moves contiguous blocks:

- **reduce-scatter**: inside the node, a reduce-scatter of the K super-slices (scaled, summed
  in fp32 in node-rank order, stored in the bucket's dtype); then across nodes, among the M
  ranks of local position l, a reduce-scatter of that super-slice into this rank's slice
  (summed in fp32 in node order, accumulated as asked). Only 1/K of the bucket crosses nodes.
- **all-gather**: across nodes first (the super-slice, from its M pieces), then inside the
  node (the bucket, from its K super-slices). ``iall_gather_intra`` is the second half
  alone: hpZ's gather from a node-local secondary copy of the super-slice.

The summation order is fixed by the topology, so results are deterministic and identical
in every stage; against one flat group they differ by rounding (the node's partial sum is
rounded to the bucket's dtype before it crosses).
"""
import time

import numpy as np

from .blocks import MOVED, check_flat, check_reduce_scatter
from .communicator import Communicator


class TwoLevelHandle:
    """A collective in two steps; the second is started by its :class:`SecondStages` queue, in the
    order the collectives were started, once the first has arrived."""

    def __init__(self, op: str, tag, first, then, queue: "SecondStages", done=None):
        self.op, self.tag = op, tag
        self.first, self.then, self._done = first, then, done
        self.second = None
        self.started = time.perf_counter()
        self._queue = queue
        queue.append(self)

    def test(self) -> bool:
        if self.second is None:
            self._queue.pump()
            if self.second is None:
                return False
        return self.second.test()

    def wait(self) -> None:
        self._queue.pump(until=self)
        self.second.wait()
        if self._done is not None:
            self._done()
            self._done = None


class SecondStages:
    """Two-level collectives whose second step has not started, in the order they were started.

    MPI matches the collectives of one communicator by call order, so every rank must start
    the second steps in one order: the order of the first steps, never the order in which
    this rank happened to see them arrive. (Each kind of step also has a communicator of its
    own, so a second step never races a first one on the same communicator.)"""

    def __init__(self):
        self._waiting = []

    def append(self, handle: TwoLevelHandle) -> None:
        self._waiting.append(handle)

    def pump(self, until: TwoLevelHandle = None) -> None:
        """Start the second steps whose turn has come and whose first step has arrived; with
        ``until``, wait for the first steps up to and including that handle's."""
        while self._waiting:
            head = self._waiting[0]
            if until is None and not head.first.test():
                return
            head.first.wait()
            head.second = head.then()
            self._waiting.pop(0)
            if head is until:
                return


class _Arrived:
    """The first step of a collective that has none."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class HierarchicalCommunicator:
    """The Communicator's interface over a group of ``intra.size * inter.size`` ranks.

    ``intra``: this rank's node (K ranks); ``inter``: the ranks of the same local position on
    the group's other nodes (M ranks); ``group_mpi``: the whole group (its rank numbering).
    """

    hierarchical = True

    def __init__(self, intra: Communicator, inter: Communicator, group_mpi):
        self.intra, self.inter, self.mpi = intra, inter, group_mpi
        # A communicator per kind of step (see SecondStages): first steps start at the call,
        # second steps in the order of their first; hpZ's node-only gathers queue with the latter.
        self.intra_second = Communicator(intra.mpi.Dup(), share=intra)
        self.inter_second = Communicator(inter.mpi.Dup(), share=inter, node_of=list(range(inter.size)))
        # A second step's bytes are counted when the collective is called, not when the step
        # starts (it may start in the next training step): the counters stay per call.
        self.intra_second.counting = self.inter_second.counting = False
        self._rs, self._ag = SecondStages(), SecondStages()
        self.k, self.m = intra.size, inter.size
        self.size = self.k * self.m
        self.rank = group_mpi.Get_rank()
        self.slot = intra.rank * self.m + inter.rank
        # the slot of every group rank (rank = node * K + local): to place what MPI gathers in rank order
        self.slots = [(g % self.k) * self.m + g // self.k for g in range(self.size)]
        self.stats, self.waiting = intra.stats, intra.waiting
        self._spare = {}            # (elements, dtype) -> node-partial buffers, kept for reuse
        self.partial_bytes = 0      # bytes of node-partial buffers allocated (in use or spare)

    # ---- scratch ----------------------------------------------------------------
    def _take(self, n: int, dtype):
        spare = self._spare.get((n, np.dtype(dtype).str))
        if spare:
            return spare.pop()
        buf = np.empty(n, dtype)
        self.partial_bytes += buf.nbytes
        return buf

    def _give(self, buf) -> None:
        self._spare.setdefault((buf.size, buf.dtype.str), []).append(buf)

    @property
    def scratch_bytes(self) -> int:
        return sum(c.scratch_bytes for c in self._levels()) + self.partial_bytes

    @property
    def peak_scratch_bytes(self) -> int:
        return sum(c.peak_scratch_bytes for c in self._levels()) + self.partial_bytes

    def _levels(self):
        return (self.intra, self.inter, self.intra_second, self.inter_second)

    def free_scratch(self) -> None:
        self._spare.clear()
        self.partial_bytes = 0
        for c in (self.intra, self.inter, self.intra_second, self.inter_second):
            c.free_scratch()

    # ---- reduce-scatter ----------------------------------------------------------
    def ireduce_scatter(self, send, out, scale: float = 1.0, accumulate: bool = False, tag=None,
                        quant=None) -> TwoLevelHandle:
        """``out = [out +] scale * sum over the group of send[this rank's slice]``, in two levels
        (``quant``: each level quantizes what it sends: the node's partial sum is re-quantized)."""
        k = check_reduce_scatter(send, out, self.size)
        partial = self._take(self.m * k, send.dtype)
        first = self.intra.ireduce_scatter(send, partial, scale, False, tag, quant)
        self.inter_second.count("reduce_scatter", k * send.itemsize if quant is None else quant.wire_bytes(k),
                                k * send.itemsize)
        then = lambda: self.inter_second.ireduce_scatter(partial, out, 1.0, accumulate, tag, quant)
        return TwoLevelHandle("reduce_scatter", tag, first, then, self._rs, lambda: self._give(partial))

    def reduce_scatter(self, send, out, scale: float = 1.0, accumulate: bool = False, quant=None) -> None:
        self.ireduce_scatter(send, out, scale, accumulate, quant=quant).wait()

    # ---- all-gather -----------------------------------------------------------------
    def iall_gather(self, buf, tag=None, logical_block: int = None, sig=None) -> TwoLevelHandle:
        """In place: every rank's slice of ``buf`` on every rank of the group (across nodes, then
        inside). ``logical_block``: a slice's unquantized bytes, when ``buf`` holds wire blocks, and
        ``sig`` the check's signature of the unquantized buffer, sent at both levels."""
        check_flat("all_gather buf", buf, self.size, MOVED)
        span = buf.size // self.k           # one super-slice
        mine = buf.reshape(-1)[self.intra.rank * span:(self.intra.rank + 1) * span]
        first = self.inter.iall_gather(mine, tag, logical_block, sig)
        logical_span = None if logical_block is None else logical_block * self.m
        self.intra_second.count("all_gather", span * buf.itemsize, logical_span)
        return TwoLevelHandle("all_gather", tag, first,
                              lambda: self.intra_second.iall_gather(buf, tag, logical_span, sig), self._ag)

    def all_gather(self, buf, tag=None, logical_block: int = None, sig=None) -> None:
        self.iall_gather(buf, tag, logical_block, sig).wait()

    def iall_gather_intra(self, buf, tag=None) -> TwoLevelHandle:
        """In place, inside the node only: ``buf`` already holds this rank's super-slice (hpZ).
        It queues behind the all-gathers' second steps, which use the same communicator."""
        self.intra_second.count("all_gather", buf.nbytes // self.k)
        return TwoLevelHandle("all_gather", tag, _Arrived(), lambda: self.intra_second.iall_gather(buf, tag), self._ag)

    def super_slice(self, n: int):
        """(lo, hi) of this rank's super-slice in a bucket of ``n`` elements."""
        span = n // self.k
        return self.intra.rank * span, (self.intra.rank + 1) * span

    def all_reduce(self, buf, scale: float = 1.0) -> None:
        k = buf.size // self.size
        mine = buf.reshape(-1)[self.slot * k:(self.slot + 1) * k]
        self.reduce_scatter(buf, mine, scale)
        self.all_gather(buf)

    # ---- accounting --------------------------------------------------------------------
    def snapshot(self):
        return {op: s.as_dict() for op, s in self.stats.items()}

    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.stats.values())
