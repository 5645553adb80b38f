"""Collectives on device buffers through pinned host buffers, for an MPI that is not CUDA-aware.

:class:`StagedCommunicator` has the Communicator's interface and arithmetic: each
collective copies what MPI must read from the device into a pinned host buffer,
synchronizes the stream (MPI must never see a buffer a copy is still writing), runs the
host Communicator's collective on the host buffers, and in ``wait()`` copies the result
back to the device. The reduce-scatter's fp32 rank-order sum therefore runs on the host,
with the same C kernel as on the CPU, so a GPU run reduces to the same bits as a CPU run,
and only 1/N of a bucket travels back to the device.

Pinned buffers are pooled per (elements, dtype) and each in-flight collective holds its
own, so two reductions in flight are double-buffered: the engine stages the next bucket
while MPI moves the previous one.

The device side is a :class:`Transfers` object: :class:`CupyTransfers` on a GPU;
:class:`HostTransfers` (plain NumPy copies) lets the tests run every path on a CPU.
"""
import time
from collections import defaultdict
from typing import Callable, Dict, Optional

import numpy as np

from .communicator import Communicator


class HostTransfers:
    """The device is the host: copies are ``np.copyto`` (for tests, and a reference)."""

    name = "host"

    def pinned(self, numel: int, dtype) -> np.ndarray:
        return np.empty(numel, dtype)

    def to_host(self, dev, host) -> None:
        np.copyto(host, dev)

    def to_device(self, host, dev) -> None:
        np.copyto(dev, host)

    def synchronize(self) -> None:
        pass


class CupyTransfers:
    """CuPy on the current device and stream: page-locked host buffers, asynchronous
    copies on the current stream, and a stream synchronize before MPI touches a buffer."""

    name = "cupy"

    def __init__(self):
        import cupy
        import cupyx
        self._cupy, self._cupyx = cupy, cupyx

    def pinned(self, numel: int, dtype) -> np.ndarray:
        return self._cupyx.empty_pinned((numel,), dtype=dtype)

    def to_host(self, dev, host) -> None:
        dev.get(stream=self._cupy.cuda.get_current_stream(), out=host, blocking=False)

    def to_device(self, host, dev) -> None:
        dev.set(host, stream=self._cupy.cuda.get_current_stream())

    def synchronize(self) -> None:
        self._cupy.cuda.get_current_stream().synchronize()


class StagedHandle:
    """A staged collective in flight: the host collective's handle, and the copy back."""

    def __init__(self, inner, finish: Callable[[], None]):
        self._inner = inner
        self._finish = finish
        self.op = inner.op
        self.tag = inner.tag
        self.started = inner.started
        self.done = False

    def test(self) -> bool:
        return self.done or self._inner.test()

    def wait(self) -> None:
        if self.done:
            return
        self._inner.wait()
        self._finish()
        self.done = True


class StagedCommunicator:
    """The Communicator's interface on device arrays, through pinned host buffers.

    ``host``: the Communicator that runs the collectives on host buffers; ``transfers``:
    the device copies (:class:`CupyTransfers` on a GPU).
    """

    path = "staged through pinned host buffers"

    def __init__(self, host: Communicator, transfers):
        self.host = host
        self.transfers = transfers
        self.mpi, self.rank, self.size, self.slot = host.mpi, host.rank, host.size, host.slot
        self.hierarchical = getattr(host, "hierarchical", False)
        self.slots = host.slots
        self.stats = host.stats
        self.waiting = host.waiting
        self._pool: Dict[tuple, list] = defaultdict(list)
        self.pinned_bytes = 0            # pinned host bytes allocated now
        self.staged = {"to_host_bytes": 0, "to_device_bytes": 0, "seconds": 0.0}

    # ---- pinned buffers ----------------------------------------------------------
    def _take(self, numel: int, dtype) -> np.ndarray:
        key = (int(numel), np.dtype(dtype).str)
        if self._pool[key]:
            return self._pool[key].pop()
        buf = self.transfers.pinned(int(numel), dtype)
        self.pinned_bytes += buf.nbytes
        return buf

    def _give(self, *bufs) -> None:
        for b in bufs:
            self._pool[(b.size, b.dtype.str)].append(b)

    def _down(self, pairs) -> None:
        """Copy (device, host) pairs to the host and wait for them: MPI reads the host side next."""
        t = time.perf_counter()
        for dev, host in pairs:
            self.transfers.to_host(dev, host)
            self.staged["to_host_bytes"] += host.nbytes
        self.transfers.synchronize()
        self.staged["seconds"] += time.perf_counter() - t

    def _up(self, host, dev) -> None:
        """Copy a host result to the device and wait for it: the host buffer goes back to the pool."""
        t = time.perf_counter()
        self.transfers.to_device(host, dev)
        self.transfers.synchronize()
        self.staged["to_device_bytes"] += host.nbytes
        self.staged["seconds"] += time.perf_counter() - t

    # ---- the Communicator's interface --------------------------------------------
    def ireduce_scatter(self, send, out, scale: float = 1.0, accumulate: bool = False, tag=None,
                        quant=None) -> StagedHandle:
        """Communicator.ireduce_scatter on device arrays (same arithmetic, same bits; ``quant``:
        quantized on the host, after the copy down)."""
        h_send = self._take(send.size, send.dtype)
        h_out = self._take(out.size, out.dtype)
        self._down([(send.reshape(-1), h_send)] + ([(out.reshape(-1), h_out)] if accumulate else []))
        inner = self.host.ireduce_scatter(h_send, h_out, scale, accumulate, tag, quant)

        def finish():
            self._up(h_out, out.reshape(-1))
            self._give(h_send, h_out)

        return StagedHandle(inner, finish)

    def reduce_scatter(self, send, out, scale: float = 1.0, accumulate: bool = False, quant=None) -> None:
        self.ireduce_scatter(send, out, scale, accumulate, quant=quant).wait()

    def iall_gather(self, buf, tag=None, logical_block: int = None, sig=None) -> StagedHandle:
        """Communicator.iall_gather on a device array: only the own slice goes down, all of it comes up."""
        flat = buf.reshape(-1)
        k = flat.size // self.size
        mine = slice(self.slot * k, (self.slot + 1) * k)
        h_buf = self._take(flat.size, flat.dtype)
        self._down([(flat[mine], h_buf[mine])])
        inner = self.host.iall_gather(h_buf, tag, logical_block, sig)

        def finish():
            self._up(h_buf, flat)
            self._give(h_buf)

        return StagedHandle(inner, finish)

    def all_gather(self, buf, tag=None, logical_block: int = None, sig=None) -> None:
        self.iall_gather(buf, tag, logical_block, sig).wait()

    def super_slice(self, n: int):
        return self.host.super_slice(n)

    @property
    def k(self) -> int:
        return self.host.k

    def iall_gather_intra(self, buf, tag=None) -> StagedHandle:
        """The host's gather inside the node (hpZ): this rank's super-slice goes down, the bucket comes up."""
        flat = buf.reshape(-1)
        lo, hi = self.host.super_slice(flat.size)
        h_buf = self._take(flat.size, flat.dtype)
        self._down([(flat[lo:hi], h_buf[lo:hi])])
        inner = self.host.iall_gather_intra(h_buf, tag)

        def finish():
            self._up(h_buf, flat)
            self._give(h_buf)

        return StagedHandle(inner, finish)

    def rewrap(self, host) -> "StagedCommunicator":
        """The same staging over another host Communicator (a topology's sub-communicators)."""
        return StagedCommunicator(host, self.transfers)

    def all_reduce(self, buf, scale: float = 1.0) -> None:
        """In place, through one host buffer: the host Communicator's all-reduce (same bits)."""
        flat = buf.reshape(-1)
        h_buf = self._take(flat.size, flat.dtype)
        self._down([(flat, h_buf)])
        self.host.all_reduce(h_buf, scale)
        self._up(h_buf, flat)
        self._give(h_buf)

    def gather_scalars(self, values) -> np.ndarray:
        return self.host.gather_scalars(values)

    def sum_scalars(self, values) -> np.ndarray:
        return self.host.sum_scalars(values)

    # ---- accounting ----------------------------------------------------------------
    @property
    def scratch_bytes(self) -> int:
        return self.host.scratch_bytes + self.pinned_bytes

    @property
    def peak_scratch_bytes(self) -> int:
        return self.host.peak_scratch_bytes + self.pinned_bytes

    def free_scratch(self) -> None:
        self.host.free_scratch()
        self._pool.clear()
        self.pinned_bytes = 0

    def snapshot(self) -> Dict[str, dict]:
        return self.host.snapshot()

    def total_bytes(self) -> int:
        return self.host.total_bytes()


def device_communicator(host: Communicator, xp, comm: str = "mpi", timeout_s: Optional[float] = None):
    """The Communicator for arrays of ``xp``: the host one for NumPy; for CuPy, staged through
    pinned buffers (``comm="mpi"``; CUDA-aware MPI is detected, but device buffers are staged
    either way until the direct path has been run on a GPU) or NCCL (``comm="nccl"``: created
    under a collective watchdog of ``timeout_s`` seconds, since creating it waits for every
    rank; the caller closes it)."""
    if getattr(xp, "__name__", "") != "cupy":
        return host
    if comm == "nccl":
        from .nccl import NcclCommunicator
        from .watchdog import Watchdog, default_timeout_s
        dog = Watchdog(host.waiting, timeout_s or default_timeout_s(), host.rank, host.mpi)
        try:
            with host.waiting("nccl: creating the communicator"):
                return NcclCommunicator(host)
        finally:
            dog.close()
    return StagedCommunicator(host, CupyTransfers())


def on_device(comm, xp):
    """``comm`` for arrays of ``xp``: itself when it moves them already (NumPy's host Communicator, a staged or an
    NCCL one: their ``path``), else :func:`device_communicator`'s staging over it (an engine given CuPy and a
    host Communicator)."""
    return comm if hasattr(comm, "path") else device_communicator(comm, xp)


def device_transfers(comm, xp):
    """The device <-> host copies for buffers of ``xp``: a staged Communicator's (a GPU's, or the
    tests' stand-in), CuPy's for CuPy arrays, else None (the arrays are host memory)."""
    transfers = getattr(comm, "transfers", None)
    if transfers is None and getattr(xp, "__name__", "") == "cupy":
        transfers = CupyTransfers()
    return transfers
