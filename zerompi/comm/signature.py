"""Collectives that check what the ranks pass together: a signature rides with the data.

Ranks that call one collective with different lengths, dtypes or operations got silently
wrong sums (MPI pairs the messages anyway), garbage (fp16 summed as fp32), a hang, or, under
Open MPI, a receive buffer overrun (a longer message than the buffer posted for it is written
past its end: measured with Open MPI 5.0.11). So every public collective is a set of
point-to-point messages on a private duplicate of the communicator (:class:`Checks`), two to
and from every peer:

- a **header**, HEADER_BYTES: this rank's signature (:func:`signature`): the operation, the
  dtype, the buffer's elements, the quantization, the caller's label (bucket, step), the scale
  and whether the result accumulates;
- the **data**, tagged with a hash of that signature, so that it only matches a receive posted
  for the same signature: a message of another length is never received into a buffer made
  for this one.

Before any result is used, the headers are compared; when any two differ, every rank raises
the same MismatchError naming the ranks and what each passed (every rank has every header).
The data of the ranks that disagree is then never received; the job ends on the error. Bytes:
the headers are counted apart (``Communicator.check_stats``), never in the operations' counters.
"""
import struct
import zlib
from typing import Dict, Optional, Sequence

import numpy as np
from mpi4py import MPI

from ..errors import MismatchError
from .consistency import rank_set

WORDS = ("operation", "dtype", "length", "quantization", "bucket", "step", "scale", "accumulate")   # an int64 each
HEADER_BYTES = 8 * len(WORDS)    # bytes of one header message
HEADER_TAG = 0                   # the headers' tag; the data's: 1 + a hash of the signature
MAX_TAG = 2 ** 29 - 1            # MPICH's upper bound of tags (Open MPI's is 2**31 - 1; MPI promises 32767)
_NAMES: Dict[int, str] = {}      # code -> name of every operation, dtype and label this process signed


def _code(name: str) -> int:
    """A name as a number that is the same in every process (crc32), remembered to name it back."""
    code = zlib.crc32(name.encode())
    _NAMES.setdefault(code, name)
    return code


def _known(*names: str) -> None:
    for name in names:
        _code(name)


_known("reduce_scatter", "all_gather", "all_reduce", "gather_scalars", "sum_scalars", "tp_all_reduce",
       "tp_sum_scalars", "bench_tp_all_reduce", "float16", "float32", "float64", "bfloat16", "uint8", "int8",
       "int16", "int32", "int64", "complex64", "complex128")    # named in a message even when only another rank signed them


def _label(tag):
    """(bucket, step) words of a caller's label: None, a bucket index, or the engine's (bucket, step)."""
    if tag is None:
        return -1, -1
    if isinstance(tag, (int, np.integer)) and not isinstance(tag, bool):
        return int(tag), -1
    if isinstance(tag, tuple) and len(tag) == 2 and all(t is None or isinstance(t, (int, np.integer)) for t in tag):
        return -1 if tag[0] is None else int(tag[0]), -1 if tag[1] is None else int(tag[1])
    return -2 - _code(repr(tag)), -1          # any other label: its repr's code, below -1


def signature(op: str, dtype, elements: int, tag=None, scale: float = 1.0, accumulate: bool = False,
              quant=None) -> tuple:
    """What one rank passes to one collective, as len(WORDS) integers (module docstring).

    ``elements``: of the whole buffer (a reduce-scatter's send, an all-gather's buffer), unquantized;
    ``quant``: a comm.quantized.Quantization, or None."""
    bucket, step = _label(tag)
    q = 0 if quant is None else quant.bits << 32 | quant.block
    bits = struct.unpack("<q", struct.pack("<d", float(scale)))[0]
    return (_code(op), _code(np.dtype(dtype).name), int(elements), q, bucket, step, bits, int(bool(accumulate)))


def describe(words: Sequence[int]) -> str:
    """'reduce_scatter of 1,024 float32 (bucket 2, step 7)' from a signature."""
    op, dtype, elements, q, bucket, step, bits, accumulate = (int(w) for w in words)
    text = f"{_NAMES.get(op, f'operation #{op}')} of {elements:,} {_NAMES.get(dtype, f'dtype #{dtype}')}"
    if q:
        text += f" as int{q >> 32} blocks of {q & 0xFFFFFFFF}"
    scale = struct.unpack("<d", struct.pack("<q", bits))[0]
    if scale != 1.0:
        text += f", scale {scale:.6g}"
    if accumulate:
        text += ", accumulated"
    if bucket <= -2:
        text += f" ({_NAMES.get(-2 - bucket, 'a label')})"
    elif bucket >= 0 or step >= 0:
        text += " (" + ", ".join(p for p in (bucket >= 0 and f"bucket {bucket}", step >= 0 and f"step {step}") if p) + ")"
    return text


def mismatch_message(table: np.ndarray, ranks: Sequence[int]) -> str:
    """One line naming what each rank passed (``table``: one signature per rank of the communicator,
    in its rank order; ``ranks``: their world ranks) and in which words they differ."""
    groups: Dict[bytes, list] = {}
    for row, rank in zip(table, ranks):
        groups.setdefault(row.tobytes(), [row, []])[1].append(rank)
    differ = [name for i, name in enumerate(WORDS) if len({int(row[i]) for row in table}) > 1]
    parts = "; ".join(f"{describe(row)} on {rank_set(rs)}" for row, rs in groups.values())
    return (f"collective mismatch between ranks: {parts} (they differ in: {', '.join(differ)}); every rank must call "
            "the same collectives in the same order, with buffers of the same length and dtype")


class Checks:
    """One communicator's checked collectives: its private link, the world ranks of its ranks, and
    :meth:`exchange`. Made with its Communicator, a collective: the link is a duplicate of
    ``mpi_comm``, made now (timed by the watchdog), never inside a collective's start, where two
    ranks making the links of two communicators in different orders would wait for each other.

    ``stats``: an OpStats that counts the headers (calls and bytes, shared by a topology's
    communicators); ``peers``: (peers on this node, on other nodes), as the Communicator counts."""

    def __init__(self, mpi_comm, stats, peers, waiting):
        self.mpi, self.stats, self.peers, self.waiting = mpi_comm, stats, peers, waiting
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.others = [r for r in range(self.size) if r != self.rank]
        with waiting("duplicating the communicator for the collectives' checks"):
            self.link = mpi_comm.Dup()              # private: only the checked collectives' messages
        self.link.Set_errhandler(MPI.ERRORS_RETURN)
        self.max_tag = min(MAX_TAG, MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767)   # set on COMM_WORLD only (Open MPI)
        world = MPI.COMM_WORLD.Get_group()
        self.ranks = MPI.Group.Translate_ranks(mpi_comm.Get_group(), list(range(self.size)), world)   # world ranks
        self.error: Optional[MismatchError] = None   # the first mismatch seen: the link is not usable after it

    def exchange(self, sig: tuple, sends, recvs) -> "Exchange":
        """Start a checked collective: ``sends`` and ``recvs`` are (peer, mpi4py message) pairs, at
        most one each per peer (every rank sends and receives one message per peer of each
        collective, so the headers of any two collectives pair up, whatever they are)."""
        if self.error is not None:
            raise self.error
        self.stats.calls += 1
        self.stats.sent(HEADER_BYTES, self.peers)
        return Exchange(self, sig, sends, recvs)


class Exchange:
    """A checked collective in flight, with the request interface (``Test``, ``Wait``) a Handle
    drives: the headers first, compared as soon as they are in; then the data."""

    __slots__ = ("_checks", "_table", "_heads", "_data", "_checked")

    def __init__(self, checks: Checks, sig: tuple, sends, recvs):
        link, me = checks.link, checks.rank
        table = np.empty((checks.size, len(WORDS)), np.int64)
        mine = table[me]
        mine[:] = sig
        tag = 1 + zlib.crc32(mine.tobytes()) % checks.max_tag
        heads = [link.Irecv(table[p], p, HEADER_TAG) for p in checks.others]
        data = [link.Irecv(message, p, tag) for p, message in recvs]
        heads += [link.Isend(mine, p, HEADER_TAG) for p in checks.others]
        data += [link.Isend(message, p, tag) for p, message in sends]
        self._checks, self._table, self._heads, self._data, self._checked = checks, table, heads, data, False

    def _check(self) -> None:
        table, me = self._table, self._checks.rank
        if table.tobytes() != table[me].tobytes() * len(table):
            error = self._checks.error = MismatchError(mismatch_message(table, self._checks.ranks))
            raise error
        self._checked = True

    def Test(self) -> bool:
        if not self._checked:
            if self._checks.error is not None:
                raise self._checks.error
            if not MPI.Request.Testall(self._heads):
                return False
            self._check()
        return MPI.Request.Testall(self._data)

    def Wait(self) -> None:
        if not self._checked:
            if self._checks.error is not None:
                raise self._checks.error
            MPI.Request.Waitall(self._heads)
            self._check()
        MPI.Request.Waitall(self._data)
