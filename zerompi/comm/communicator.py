"""Communicator: the collectives ZeRO needs, over an mpi4py communicator.

reduce-scatter is an Alltoallv of the bucket's slices (none to this rank itself) followed
by a local fp32 sum in rank order: MPI has no fp16 sum, the fixed order makes results
deterministic and identical in every stage, and on the MPICH wheel it measured as fast as
``Reduce_scatter_block`` (docs/bench.md). all-gather is ``Allgather`` in place. all-reduce is reduce-scatter then
all-gather, so its bits equal a reduce-scatter's. Every operation is counted: calls, bytes
sent by this rank, and seconds.

Counts: a slice travels as ONE element of a contiguous derived datatype ("block") of the
slice's length, so every count and displacement MPI sees is a rank number, whatever the
bucket's size (byte counts overflow a C int past 2 GiB). :func:`block_layout` is that
arithmetic. Every public call checks its arguments' dtypes and lengths (UsageError).
"""
import ctypes
import time
from collections import defaultdict
from typing import Callable, Dict, Optional

import numpy as np
from mpi4py import MPI

from ..errors import ConfigError, UsageError
from ..optim import impl
from ..optim.dtypes import is_bf16
from .watchdog import WaitRecord

F32 = np.float32
DTYPES = (np.dtype(np.float16), np.dtype(np.float32))   # what the collectives sum
MOVED = DTYPES + (np.dtype(np.uint8),)                  # what the all-gather moves (uint8: quantized wire blocks)
MAX_BLOCK = 2 ** 31 - 1    # elements in one slice: the block datatype's count is a C int
_WORD = {1: "BYTE", 2: "UINT16_T", 4: "UINT32_T", 8: "UINT64_T"}   # MPI moves bits: an integer type of the same size


def block_layout(size: int, rank: int, k: int):
    """Alltoallv's (send counts, send displacements, receive counts, receive displacements),
    in blocks of one slice (``k`` elements): one block to and from every peer, none to
    ``rank`` itself, the received blocks packed in rank order without a gap for ``rank``.
    Every number is at most ``size``, so nothing overflows at any slice size up to
    MAX_BLOCK elements (UsageError beyond)."""
    if not 0 < k <= MAX_BLOCK:
        raise UsageError(f"a slice of {k:,} elements is not allowed; use 1 .. {MAX_BLOCK:,} elements per rank "
                         "(smaller buckets: ZeroConfig.bucket_mb)")
    counts = [0 if r == rank else 1 for r in range(size)]
    return counts, list(range(size)), counts, [r - (r > rank) for r in range(size)]


def check_flat(what: str, arr, size: int, dtypes=DTYPES) -> None:
    """UsageError unless ``arr`` is a C-contiguous array of ``dtypes`` (and bfloat16, which every
    collective here takes: sums run in float32) whose length splits into ``size`` slices."""
    dt = getattr(arr, "dtype", None)
    if dt not in dtypes and not (dt is not None and is_bf16(dt)):
        raise UsageError(f"{what}: an array of {dt if dt is not None else type(arr).__name__} is not allowed; "
                         f"use a {' or '.join([d.name for d in dtypes] + ['bfloat16'])} array")
    if not arr.flags.c_contiguous:
        raise UsageError(f"{what}: the array is not contiguous; pass a contiguous array (np.ascontiguousarray)")
    if arr.size == 0 or arr.size % size:
        raise UsageError(f"{what}: {arr.size} elements do not split into {size} equal slices; "
                         f"use a length that is a positive multiple of {size}")


class RecvRows:
    """A reduce-scatter's receive buffer: the N-1 peers' slices (none for this rank), and
    the N rows the local sum reads in rank order, the own slice's slot filled per call.

    ``addrs`` holds the rows' addresses for the C sum (a ctypes array), so that a call
    costs one address lookup, not one per row. Pooled by the Communicator and owned by one
    in-flight reduce-scatter at a time.
    """

    __slots__ = ("array", "wire", "rows", "addrs", "rank", "nbytes")

    def __init__(self, size: int, rank: int, k: int, dtype):
        self.array = np.empty((size - 1, k), dtype)     # peer r < rank in row r, r > rank in row r - 1
        self.wire = _bytes_view(self.array)              # what MPI receives into
        self.rank = rank
        self.nbytes = self.array.nbytes
        peers = list(self.array)
        self.rows = peers[:rank] + [None] + peers[rank:]
        self.addrs = (ctypes.c_void_p * size)(*[0 if r is None else r.ctypes.data for r in self.rows])

    def with_own(self, mine, address: int) -> "RecvRows":
        """Put the own slice (``mine``, at ``address``) in its slot; returns self."""
        self.rows[self.rank] = mine
        self.addrs[self.rank] = address
        return self

    def drop_own(self) -> None:
        self.rows[self.rank] = None     # do not keep the caller's buffer alive from the pool


class OpStats:
    """Per-operation counters of one rank: calls, bytes sent (split by where the peer is), seconds."""

    __slots__ = ("calls", "bytes", "intra", "inter", "logical", "seconds")

    def __init__(self):
        self.calls = 0      # operations started
        self.bytes = 0      # bytes this rank sent on the wire (intra + inter)
        self.intra = 0      # of them, to peers on this rank's node
        self.inter = 0      # of them, to peers on other nodes
        self.logical = 0    # what they would have been unquantized (= bytes when nothing is quantized)
        self.seconds = 0.0  # wall seconds spent in blocking calls and in wait()

    def sent(self, block: int, peers, logical: int = None) -> None:
        """Count ``block`` bytes to each of ``peers`` = (peers on this node, peers on other nodes);
        ``logical``: the block's unquantized size (default ``block``)."""
        self.intra += block * peers[0]
        self.inter += block * peers[1]
        self.bytes += block * (peers[0] + peers[1])
        self.logical += (block if logical is None else logical) * (peers[0] + peers[1])

    def as_dict(self) -> dict:
        return {"calls": self.calls, "bytes": self.bytes, "intra": self.intra, "inter": self.inter,
                "logical": self.logical, "seconds": self.seconds}


def _bytes_view(arr) -> np.ndarray:
    """The array's memory as a flat uint8 view (MPI moves bits; the dtype does not matter)."""
    return arr.reshape(-1).view(np.uint8)


class Handle:
    """An in-flight collective. Keeps its buffers alive until wait(); wait() is idempotent."""

    def __init__(self, comm: "Communicator", op: str, request, buffers: tuple, finish: Optional[Callable],
                 tag=None):
        self._comm = comm
        self.op = op                 # "reduce_scatter" or "all_gather"
        self.tag = tag               # the caller's label, e.g. (bucket, step): named by the watchdog
        self._request = request      # the MPI request
        self._buffers = buffers      # kept alive while MPI may touch them
        self._finish = finish        # local work once the data has arrived
        self.started = time.perf_counter()
        self.done = False

    def test(self) -> bool:
        """Progress MPI; True once the data has arrived (call wait() to finish)."""
        return self.done or self._request.Test()

    def wait(self) -> None:
        """Block until complete, then run the local part (the fp32 sum of a reduce-scatter)."""
        if self.done:
            return
        t = time.perf_counter()
        with self._comm.waiting(self.op, self.tag):   # timed by the collective watchdog
            self._request.Wait()
        if self._finish is not None:
            self._finish()
        self._comm.stats[self.op].seconds += time.perf_counter() - t
        self._comm._release(self._buffers)
        self._buffers = ()
        self.done = True


class Communicator:
    """Bucketed reduce-scatter, all-gather and all-reduce over ``mpi_comm`` (default MPI.COMM_WORLD;
    None is refused: a communicator that was never made is a bug, not the world).

    Buffers are flat arrays whose length is a multiple of the world size; rank r's slice
    is the r-th of ``size`` equal parts. Counts are in elements, accounting in bytes.

    ``share``: another Communicator whose counters and wait record this one shares (the
    sub-communicators of a topology count into one table and are timed by one watchdog).
    ``node_of``: the node of every rank of ``mpi_comm`` (None: all on one node), so that the
    bytes sent are counted per level: to peers on this node (intra) and on others (inter).
    """

    def __init__(self, mpi_comm=MPI.COMM_WORLD, share: Optional["Communicator"] = None, node_of=None):
        if mpi_comm is None or not all(hasattr(mpi_comm, a) for a in ("Get_rank", "Get_size")):
            raise ConfigError(f"Communicator(mpi_comm={mpi_comm!r}): not an mpi4py communicator; pass one "
                              "(MPI.COMM_WORLD, a Split of it), or nothing for MPI.COMM_WORLD")
        self.mpi = mpi_comm
        self.rank = self.mpi.Get_rank()   # this process
        self.size = self.mpi.Get_size()   # ranks in the data-parallel group
        self.counting = True              # False: the caller counts this one's calls (comm/hierarchical.py)
        self.slot = self.rank             # which slice of every bucket this rank holds
        self.slots = list(range(self.size))   # ... and every rank's, in rank order
        self.hierarchical = False
        nodes = node_of if node_of is not None else [0] * self.size
        same = sum(1 for r in range(self.size) if r != self.rank and nodes[r] == nodes[self.rank])
        self.peers = (same, self.size - 1 - same)   # (peers on this node, peers on other nodes)
        self.stats: Dict[str, OpStats] = share.stats if share is not None else defaultdict(OpStats)
        self._pool: Dict[tuple, list] = defaultdict(list)  # reusable receive buffers
        self.scratch_bytes = 0            # bytes of receive buffers currently allocated
        self.peak_scratch_bytes = 0
        self.waiting = share.waiting if share is not None else WaitRecord()   # what this rank is blocked in
        self._layouts: Dict[int, tuple] = {}   # slice elements -> block_layout (a bucket's shape repeats every step)
        self._types: Dict[tuple, object] = {}  # (slice elements, itemsize) -> committed block datatype
        self._wire_pool: Dict[int, list] = {}  # bytes -> quantized send buffers (qgZ), kept for reuse

    # ---- scratch buffers -------------------------------------------------
    def _recv_rows(self, k: int, dtype) -> RecvRows:
        key = (k, np.dtype(dtype).str)
        if self._pool[key]:
            return self._pool[key].pop()
        recv = RecvRows(self.size, self.rank, k, dtype)
        self.scratch_bytes += recv.nbytes
        self.peak_scratch_bytes = max(self.peak_scratch_bytes, self.scratch_bytes)
        return recv

    def _release(self, buffers) -> None:
        # By convention the first buffer of a reduce-scatter handle is its pooled RecvRows.
        if buffers:
            recv = buffers[0]
            recv.drop_own()
            self._pool[(recv.array.shape[1], recv.array.dtype.str)].append(recv)

    def free_scratch(self) -> None:
        """Drop pooled receive buffers and cached datatypes (the engine calls this when it is closed)."""
        self._pool.clear()
        self._wire_pool.clear()
        self.scratch_bytes = 0
        self.free_types()

    def _block(self, k: int, itemsize: int):
        """(block datatype, Alltoallv layout) for slices of ``k`` elements of ``itemsize`` bytes.

        Cached: a bucket's shape repeats every step, and at 1 MiB each microsecond of Python
        is about 1% of a reduce-scatter (docs/bench.md)."""
        key = (k, itemsize)
        blk = self._types.get(key)
        if blk is None:
            layout = self._layouts.get(k) or self._layouts.setdefault(k, block_layout(self.size, self.rank, k))
            blk = self._types[key] = (getattr(MPI, _WORD[itemsize]).Create_contiguous(k).Commit(), layout)
        return blk

    def free_types(self) -> None:
        """Free the cached block datatypes (a collective in flight keeps its own until it completes)."""
        for dtype, _ in self._types.values():
            dtype.Free()
        self._types.clear()

    # ---- reduce-scatter --------------------------------------------------
    def ireduce_scatter(self, send, out, scale: float = 1.0, accumulate: bool = False, tag=None,
                        quant=None) -> Handle:
        """Start: ``out = [out +] scale * sum_r send_r[my slice]``, summed in fp32 in rank order.

        ``send``: flat array of ``size * k`` elements (this rank's contribution to every slice),
        not to be written until ``wait()`` (the sum reads the own slice where it lies).
        ``out``: ``k`` elements, same dtype; written only in ``wait()``; may be the own slice
        of ``send`` (an in-place all-reduce). ``quant``: a comm.quantized.Quantization: the
        slices travel quantized and are dequantized into the sum (qgZ).
        """
        if quant is not None:
            return self._ireduce_scatter_quantized(send, out, scale, accumulate, tag, quant)
        n, me = self.size, self.rank
        check_flat("reduce_scatter send", send, n)
        k = send.size // n
        if getattr(out, "dtype", None) != send.dtype or out.size != k:
            raise UsageError(f"reduce_scatter out: {getattr(out, 'size', '?')} elements of "
                             f"{getattr(out, 'dtype', type(out).__name__)}; use {k} elements (one slice) of {send.dtype}, "
                             "the send buffer's dtype")
        blk, (sc, sd, rc, rd) = self._block(k, send.itemsize)
        recv = self._recv_rows(k, send.dtype)
        st = self.stats["reduce_scatter"]
        block = k * send.itemsize
        if self.counting:
            self.count("reduce_scatter", block)
        t = time.perf_counter()
        # Every peer's block at once (Ialltoallv), none to itself. Measured (docs/bench.md):
        # as fast as Ialltoall at N=2 and about 2x faster with more ranks than cores, where
        # Ialltoall's pairwise rounds each wait on the scheduler.
        flat = send.reshape(-1)
        wire = MPI.buffer(flat)        # its address costs 0.2 µs; ndarray.ctypes.data costs 1.2 µs
        req = self.mpi.Ialltoallv([wire, (sc, sd), blk], [recv.wire, (rc, rd), blk])
        # The sum reads the own slice where it lies: no copy at any N.
        rows = recv.with_own(flat[me * k:(me + 1) * k], wire.address + me * block)
        st.seconds += time.perf_counter() - t

        def finish():
            impl.sum_rows(rows.rows, out, scale, accumulate, rows.addrs)

        return Handle(self, "reduce_scatter", req, (recv, send, out), finish, tag)

    def reduce_scatter(self, send, out, scale: float = 1.0, accumulate: bool = False, quant=None) -> None:
        """Blocking form of :meth:`ireduce_scatter`."""
        self.ireduce_scatter(send, out, scale, accumulate, quant=quant).wait()

    def _ireduce_scatter_quantized(self, send, out, scale, accumulate, tag, quant) -> Handle:
        """qgZ: every slice quantized into a wire block, an all-to-all of the blocks, then the
        N rows dequantized and summed in fp32 in rank order (the own row quantized too, so that
        every rank's contribution is treated alike)."""
        n, me = self.size, self.rank
        check_flat("reduce_scatter send", send, n)
        k = send.size // n
        if getattr(out, "dtype", None) != send.dtype or out.size != k:
            raise UsageError(f"reduce_scatter out: {getattr(out, 'size', '?')} elements of "
                             f"{getattr(out, 'dtype', type(out).__name__)}; use {k} elements (one slice) of {send.dtype}")
        wb = quant.wire_bytes(k)
        flat = send.reshape(-1)
        wire = self._recv_rows(wb, np.uint8)       # the peers' wire blocks (pooled)
        spare = self._wire_pool.get(n * wb)
        blocks = spare.pop() if spare else np.empty(n * wb, np.uint8)   # this rank's: one per slice
        for r in range(n):
            quant.pack(flat[r * k:(r + 1) * k], blocks[r * wb:(r + 1) * wb])
        blk, (sc, sd, rc, rd) = self._block(wb, 1)
        st = self.stats["reduce_scatter"]
        if self.counting:
            self.count("reduce_scatter", wb, k * send.itemsize)
        t = time.perf_counter()
        req = self.mpi.Ialltoallv([blocks, (sc, sd), blk], [wire.wire, (rc, rd), blk])
        st.seconds += time.perf_counter() - t
        rows = [wire.rows[r] if r != me else blocks[me * wb:(me + 1) * wb] for r in range(n)]

        def finish():
            parts = [quant.rows(row, k) for row in rows]
            impl.dequant_sum([v for v, _ in parts], [s for _, s in parts], k, quant.bits, quant.block, out, scale,
                             accumulate)
            self._wire_pool.setdefault(blocks.size, []).append(blocks)

        return Handle(self, "reduce_scatter", req, (wire, blocks, send, out), finish, tag)

    # ---- all-gather --------------------------------------------------------
    def iall_gather(self, buf, tag=None, logical_block: int = None) -> Handle:
        """Start: every rank's slice r of ``buf`` is copied into slice r of ``buf`` on all ranks, in place.

        ``buf`` may be uint8 (quantized wire blocks, comm/quantized.py); ``logical_block``: then
        the bytes of one slice unquantized, for the counters."""
        n = self.size
        check_flat("all_gather buf", buf, n, MOVED)
        blk, _ = self._block(buf.size // n, buf.itemsize)
        st = self.stats["all_gather"]
        if self.counting:
            self.count("all_gather", buf.nbytes // n, logical_block)
        t = time.perf_counter()
        req = self.mpi.Iallgather(MPI.IN_PLACE, [MPI.buffer(buf.reshape(-1)), 1, blk])
        st.seconds += time.perf_counter() - t
        return Handle(self, "all_gather", req, (), None, tag)

    def all_gather(self, buf, tag=None, logical_block: int = None) -> None:
        """Blocking form of :meth:`iall_gather`."""
        self.iall_gather(buf, tag, logical_block).wait()

    # ---- all-reduce --------------------------------------------------------
    def all_reduce(self, buf, scale: float = 1.0) -> None:
        """``buf = scale * sum_r buf_r`` in place: reduce-scatter then all-gather (same bits as RS)."""
        k = buf.size // self.size
        mine = buf.reshape(-1)[self.slot * k:(self.slot + 1) * k]
        self.reduce_scatter(buf, mine, scale)
        self.all_gather(buf)

    def gather_scalars(self, values) -> np.ndarray:
        """Every rank's few float64 numbers: a (size, len(values)) table, identical on every rank
        (one Allgather, counted under "sum_scalars"). Every rank must pass the same count."""
        local = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
        table = np.empty((self.size, local.size), np.float64)
        t = time.perf_counter()
        with self.waiting("sum_scalars"):
            self.mpi.Allgather(local, table)
        st = self.stats["sum_scalars"]
        st.calls += 1
        st.sent(local.nbytes, self.peers)
        st.seconds += time.perf_counter() - t
        return table

    def sum_scalars(self, values) -> np.ndarray:
        """Sum a few float64 numbers over ranks, in rank order (deterministic, bit-identical everywhere)."""
        return sum_table(self.gather_scalars(values))

    # ---- accounting --------------------------------------------------------
    def snapshot(self) -> Dict[str, dict]:
        return {op: s.as_dict() for op, s in self.stats.items()}

    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.stats.values())

    def count(self, op: str, block: int, logical: int = None) -> None:
        """One call of ``op`` sending ``block`` bytes to each peer (``logical``: unquantized)."""
        st = self.stats[op]
        st.calls += 1
        st.sent(block, self.peers, logical)

    def logical_bytes(self, exclude=("sum_scalars",)) -> int:
        """What the bytes sent so far would have been unquantized."""
        return sum(s.logical for op, s in self.stats.items() if op not in exclude)

    def level_bytes(self, exclude=("sum_scalars",)) -> Dict[str, int]:
        """{"intra": bytes, "inter": bytes} sent so far, over every operation but ``exclude``."""
        ops = [s for op, s in self.stats.items() if op not in exclude]
        return {"intra": sum(s.intra for s in ops), "inter": sum(s.inter for s in ops)}


def mpi_library() -> str:
    """First line of the MPI library's version string, e.g. 'MPICH Version: 4.2.0'."""
    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def sum_table(table: np.ndarray) -> np.ndarray:
    """The rows of a gather_scalars table summed in rank order (the same bits on every rank)."""
    total = table[0].copy()
    for r in range(1, table.shape[0]):
        total += table[r]
    return total
