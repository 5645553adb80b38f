"""SPComm: the sequence-parallel group's all-to-all (DeepSpeed-Ulysses), on NumPy arrays.

K ranks hold K contiguous chunks of each sequence. Before attention one all-to-all turns this
rank's (sequence chunk, all heads) into (whole sequence, its heads / K): the head axis is cut into K
parts, part j goes to rank j, and what arrives from rank i is placed as the i-th chunk of the
time axis. After attention the reverse turns (whole sequence, heads / K) back into (chunk, all
heads). Both are one call::

    sp.all_to_all(qkv, scatter=3, gather=1)     # (B, T/K, 3, H, hd) -> (B, T, 3, H/K, hd)
    sp.all_to_all(y, scatter=1, gather=2)       # (B, T, H/K, hd)    -> (B, T/K, H, hd)

and the backward of one is the other on the gradient. MPI moves contiguous blocks, so the parts
are packed into ``send`` (K blocks, rank order), exchanged into ``recv`` (checked as every
collective is: comm/group.py; MPI's own ``Alltoall`` with the check off) and unpacked into
``out``: two copies of the array, no arithmetic (the same bits on every path).
Each call sends (K-1)/K of the array's bytes from every rank, counted under its ``op``.
"""
import time
from typing import Optional

import numpy as np

from ..errors import UsageError
from ..optim import impl
from .group import GroupComm


class SPComm(GroupComm):
    """The all-to-all of the sequence-parallel group (rank, size, all_to_all, counters)."""

    kind = "sp"

    def all_to_all(self, x: np.ndarray, scatter: int, gather: int, out: Optional[np.ndarray] = None,
                   send: Optional[np.ndarray] = None, recv: Optional[np.ndarray] = None,
                   op: str = "sp_all_to_all") -> np.ndarray:
        """``x`` cut into K parts along axis ``scatter`` (part j to SP rank j); the K parts received, in
        rank order, joined along axis ``gather`` into ``out`` (shape: x's, the scatter axis / K, the
        gather axis x K; a new array when None). ``send``/``recv``: flat scratch arrays of x's dtype
        with at least x.size elements (new ones when None). A device array is staged through host memory
        (the same bits, its two copies in the op's seconds; ``send``/``recv`` unused). Returns out."""
        if impl.is_device(x):   # device memory (CuPy): one copy each way, counted in the op's seconds
            t, st = time.perf_counter(), self.stats[op]
            before = st.seconds
            host = self.all_to_all(impl.to_host(x), scatter, gather, op=op)
            out = impl.array_module(x).empty(host.shape, host.dtype) if out is None else out.reshape(host.shape)
            out[...] = impl.array_module(x).asarray(host)
            st.seconds = before + time.perf_counter() - t
            return out
        k = self.size
        shape = x.shape
        if not (0 <= scatter < x.ndim and 0 <= gather < x.ndim and shape[scatter] % k == 0):
            raise UsageError(f"SP all-to-all: axis {scatter} of shape {shape} does not cut into {k} parts "
                             f"(or axis {gather} is not one of its axes)")
        part = shape[:scatter] + (shape[scatter] // k,) + shape[scatter + 1:]
        joined = part[:gather] + (k * part[gather],) + part[gather + 1:]
        out = np.empty(joined, x.dtype) if out is None else out
        if out.shape != joined and out.size == x.size and out.flags.c_contiguous:
            out = out.reshape(joined)            # a view: the caller's buffer in another shape
        if out.shape != joined or out.dtype != x.dtype or not out.flags.c_contiguous:
            raise UsageError(f"SP all-to-all: out has shape {out.shape} ({out.dtype}); a contiguous {joined} "
                             f"({x.dtype}) is needed")
        if k == 1:
            out[...] = x
            return out
        t = time.perf_counter()
        blocks = (k,) + part
        send = _scratch(send, x)
        recv = _scratch(recv, x)
        sendv, recvv = send.reshape(blocks), recv.reshape(blocks)
        np.copyto(sendv, np.moveaxis(x.reshape(shape[:scatter] + (k, part[scatter]) + shape[scatter + 1:]),
                                     scatter, 0))
        with self.waiting(op):       # as bytes: MPI has no float16 type, and an all-to-all only moves them
            rows_in = recvv.reshape(k, -1).view(np.uint8)
            self.exchange(op, x, sendv.reshape(k, -1).view(np.uint8), rows_in)
            if self.checks is not None:
                rows_in[self.rank] = sendv.reshape(k, -1).view(np.uint8)[self.rank]   # not moved: its own part
        np.copyto(out.reshape(part[:gather] + (k,) + part[gather:]), np.moveaxis(recvv, 0, gather))
        st = self.stats[op]
        st.calls += 1
        st.sent(x.nbytes // k, (k - 1, 0))      # one part to each of the K-1 others
        st.seconds += time.perf_counter() - t
        return out


def _scratch(buf: Optional[np.ndarray], x: np.ndarray) -> np.ndarray:
    """The first x.size elements of the flat scratch ``buf`` (a new array when None)."""
    if buf is None:
        return np.empty(x.size, x.dtype)
    if buf.dtype != x.dtype or buf.size < x.size or not buf.flags.c_contiguous:
        raise UsageError(f"SP all-to-all: a contiguous {x.dtype} scratch of at least {x.size} elements is needed "
                         f"(got {buf.size} of {buf.dtype})")
    return buf.reshape(-1)[:x.size]
