"""How a bucket travels: slices as blocks, their checks, the receive rows, the counters.

Counts: a slice travels as ONE element of a contiguous derived datatype ("block") of the
slice's length, so every count and displacement MPI sees is a rank number, whatever the
bucket's size (byte counts overflow a C int past 2 GiB). :func:`block_layout` is that
arithmetic; :func:`check_flat` the argument check of every public collective (UsageError);
:class:`RecvRows` a reduce-scatter's receive buffer; :class:`OpStats` one operation's counters.
"""
import ctypes

import numpy as np

from ..errors import UsageError
from ..optim.dtypes import is_bf16

F32 = np.float32
DTYPES = (np.dtype(np.float16), np.dtype(np.float32))   # what the collectives sum
MOVED = DTYPES + (np.dtype(np.uint8),)                  # what the all-gather moves (uint8: quantized wire blocks)
MAX_BLOCK = 2 ** 31 - 1    # elements in one slice: the block datatype's count is a C int
WORD = {1: "BYTE", 2: "UINT16_T", 4: "UINT32_T", 8: "UINT64_T"}   # MPI moves bits: an integer type of the same size


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


def check_reduce_scatter(send, out, size: int) -> int:
    """The elements of one slice of ``send`` (check_flat) over ``size`` ranks; UsageError unless ``out`` holds
    that many of ``send``'s dtype."""
    check_flat("reduce_scatter send", send, size)
    k = send.size // size
    if getattr(out, "dtype", None) != send.dtype or out.size != k:
        raise UsageError(f"reduce_scatter out: {getattr(out, 'size', '?')} elements of "
                         f"{getattr(out, 'dtype', type(out).__name__)}; "
                         f"use {k} elements (one slice) of {send.dtype}, the send buffer's dtype")
    return k


class RecvRows:
    """A reduce-scatter's receive buffer: the N-1 peers' slices (none for this rank), and
    the N rows the local sum reads in rank order, the own slice's slot filled per call.

    ``addrs`` holds the rows' addresses for the C sum (a ctypes array), so that a call
    costs one address lookup, not one per row. Pooled by the Communicator and owned by one
    in-flight reduce-scatter at a time.
    """

    __slots__ = ("array", "wire", "rows", "addrs", "rank", "nbytes", "address")

    def __init__(self, size: int, rank: int, k: int, dtype):
        self.array = np.empty((size - 1, k), dtype)     # peer r < rank in row r, r > rank in row r - 1
        self.wire = _bytes_view(self.array)              # what MPI receives into
        self.rank = rank
        self.nbytes = self.array.nbytes
        self.address = self.array.ctypes.data           # where the peers' slices land (a checked plan's key)
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


def sum_table(table: np.ndarray) -> np.ndarray:
    """The rows of a gather_scalars table summed in rank order (the same bits on every rank)."""
    total = table[0].copy()
    for r in range(1, table.shape[0]):
        total += table[r]
    return total
