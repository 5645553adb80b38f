"""``--comm nccl``: the Communicator's interface over NCCL, for CuPy buffers.

NCCL moves and reduces device memory directly (NVLink, PCIe, InfiniBand with GPUDirect),
with no host staging. Its unique id is broadcast over MPI; the small host-side reductions
(``sum_scalars``) stay on MPI. Two differences from the MPI path, both NCCL's:

- **The sum**: NCCL adds in its own (ring or tree) order, so results can differ in the
  last bits from the MPI path's rank-order sum. fp16 buckets are widened to fp32 on the
  device and summed in fp32, as the MPI path sums: a loss-scaled fp16 gradient summed in
  fp16 over N ranks overflows N times sooner than each rank's own value does (40000 on
  every rank of two: inf). So the reduce-scatter moves 4 bytes per fp16 element, twice the
  MPI path's, and the traffic table says so. The scale and the accumulate
  (``out = [out +] scale * sum``) are then applied in fp32, as there.
- **One GPU per rank**: NCCL refuses two ranks of one communicator on the same GPU, so
  several ranks sharing a GPU need the MPI path.

Operations are enqueued on the current CuPy stream, after whatever produced their inputs;
a handle's test() and wait() look at a CUDA event recorded after the operation. The
NCCL calls go through a small backend (:class:`CupyNccl`); the tests drive the rest with
a host stand-in.
"""
import time

import numpy as np

from ..optim.dtypes import bfloat16
from ..optim.reference import sum_rows_reference
from .blocks import check_flat, check_reduce_scatter
from .communicator import Communicator

F32 = np.dtype(np.float32)


class CupyNccl:
    """The NCCL calls, on CuPy arrays: pointers, the dtype code, the current stream, events."""

    name = "nccl"

    def __init__(self, host: Communicator):
        import cupy
        from cupy.cuda import nccl
        if not getattr(nccl, "available", True):
            raise RuntimeError("CuPy was built without NCCL")
        self._cupy, self._nccl = cupy, nccl
        uid = nccl.get_unique_id() if host.rank == 0 else None
        with host.waiting("nccl: broadcast of the unique id"):
            uid = host.mpi.bcast(uid, root=0)
        self._comm = nccl.NcclCommunicator(host.size, uid, host.rank)
        self._types = {np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32}
        bf16 = bfloat16(required=False)
        if bf16 is not None:   # only all-gathered (moved, never summed: sums run in float32), so any 2-byte type
            self._types[bf16] = nccl.NCCL_FLOAT16
        self.xp = cupy

    def _stream(self) -> int:
        return self._cupy.cuda.get_current_stream().ptr

    def reduce_scatter(self, send, recv) -> None:
        """recv (k elements) = the sum over ranks of send's k-element slice of this rank."""
        self._comm.reduceScatter(send.data.ptr, recv.data.ptr, recv.size, self._types[send.dtype],
                                 self._nccl.NCCL_SUM, self._stream())

    def all_gather(self, buf, k: int, rank: int) -> None:
        """In place: slice r of buf from rank r, every r."""
        self._comm.allGather(buf.data.ptr + rank * k * buf.itemsize, buf.data.ptr, k, self._types[buf.dtype],
                             self._stream())

    def all_reduce(self, buf) -> None:
        self._comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._types[buf.dtype],
                             self._nccl.NCCL_SUM, self._stream())

    def record(self):
        """An event after everything enqueued so far: .done and .synchronize()."""
        ev = self._cupy.cuda.Event(block=False, disable_timing=True)
        ev.record()
        return ev

    def close(self) -> None:
        self._comm.destroy()


class NcclHandle:
    """An NCCL collective in flight: an event after it, and the buffers it uses."""

    def __init__(self, comm: "NcclCommunicator", op: str, event, buffers: tuple, tag=None):
        self._comm, self.op, self.tag = comm, op, tag
        self._event, self._buffers = event, buffers
        self.started = time.perf_counter()
        self.done = False

    def test(self) -> bool:
        return self.done or self._event.done

    def wait(self) -> None:
        if self.done:
            return
        t = time.perf_counter()
        with self._comm.waiting(self.op, self.tag):     # timed by the collective watchdog
            self._event.synchronize()
        self._comm.stats[self.op].seconds += time.perf_counter() - t
        self._buffers = ()
        self.done = True


class NcclCommunicator:
    """The Communicator's interface on CuPy arrays, over NCCL (``--comm nccl``).

    ``host``: the MPI Communicator (unique-id broadcast, ``sum_scalars``, the watchdog's
    record, the statistics); ``backend``: the NCCL calls (:class:`CupyNccl` by default).
    """

    path = "NCCL (device to device)"

    def __init__(self, host: Communicator, backend=None):
        self.host = host
        self.backend = backend if backend is not None else CupyNccl(host)
        self.xp = self.backend.xp
        self.mpi, self.rank, self.size = host.mpi, host.rank, host.size
        self.stats = host.stats
        self.waiting = host.waiting
        self.scratch_bytes = self.peak_scratch_bytes = 0

    def _count(self, op: str, nbytes: int) -> None:
        st = self.stats[op]
        st.calls += 1
        st.bytes += nbytes

    def ireduce_scatter(self, send, out, scale: float = 1.0, accumulate: bool = False, tag=None) -> NcclHandle:
        """Start: ``out = [out +] scale * sum_r send_r[my slice]`` (NCCL's sum, then fp32 scale)."""
        n = self.size
        k = check_reduce_scatter(send, out, n)
        flat, target = send.reshape(-1), out.reshape(-1)
        if send.dtype == F32 and scale == 1.0 and not accumulate:
            self._count("reduce_scatter", (n - 1) * k * send.itemsize)
            self.backend.reduce_scatter(flat, target)
            buffers = (send, out)
        else:
            wide = flat if flat.dtype == F32 else flat.astype(F32)   # fp16: the sum runs in fp32 (module docstring)
            summed = self.xp.empty(k, F32)
            self._count("reduce_scatter", (n - 1) * k * F32.itemsize)
            self.backend.reduce_scatter(wide, summed)
            # out = cast([out +] scale * summed) in fp32, the reference's order: enqueued behind the sum
            sum_rows_reference([summed], target, scale, accumulate)
            buffers = (send, out, wide, summed)
        return NcclHandle(self, "reduce_scatter", self.backend.record(), buffers, tag)

    def reduce_scatter(self, send, out, scale: float = 1.0, accumulate: bool = False) -> None:
        self.ireduce_scatter(send, out, scale, accumulate).wait()

    def iall_gather(self, buf, tag=None) -> NcclHandle:
        check_flat("all_gather buf", buf, self.size)
        flat = buf.reshape(-1)
        k = flat.size // self.size
        self._count("all_gather", (self.size - 1) * k * flat.itemsize)
        self.backend.all_gather(flat, k, self.rank)
        return NcclHandle(self, "all_gather", self.backend.record(), (buf,), tag)

    def all_gather(self, buf, tag=None) -> None:
        self.iall_gather(buf, tag).wait()

    def all_reduce(self, buf, scale: float = 1.0) -> None:
        """In place: ``buf = scale * sum_r buf_r`` (NCCL's sum, in fp32 for fp16 buffers, then the fp32 scale)."""
        check_flat("all_reduce buf", buf, self.size)
        flat = buf.reshape(-1)
        wide = flat if flat.dtype == F32 else flat.astype(F32)
        self._count("all_reduce", 2 * (self.size - 1) * (flat.size // self.size) * wide.itemsize)
        self.backend.all_reduce(wide)
        if scale != 1.0 or wide is not flat:
            sum_rows_reference([wide], flat, scale, False)   # the fp32 scale, in place (cast back for fp16)
        NcclHandle(self, "all_reduce", self.backend.record(), (buf, wide)).wait()

    def gather_scalars(self, values) -> np.ndarray:
        return self.host.gather_scalars(values)

    def sum_scalars(self, values) -> np.ndarray:
        return self.host.sum_scalars(values)

    def free_scratch(self) -> None:
        self.host.free_scratch()

    def snapshot(self):
        return self.host.snapshot()

    def total_bytes(self) -> int:
        return self.host.total_bytes()

    def close(self) -> None:
        getattr(self.backend, "close", lambda: None)()
