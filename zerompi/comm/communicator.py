"""Communicator: the collectives ZeRO needs, over an mpi4py communicator.

reduce-scatter is an all-to-all of the bucket's slices (none to this rank itself) followed
by a local fp32 sum in rank order: MPI has no fp16 sum, the fixed order makes results
deterministic and identical in every stage, and on the MPICH wheel it measured as fast as
``Reduce_scatter_block`` (docs/bench.md). all-gather is an all-gather in place. all-reduce is
reduce-scatter then all-gather, so its bits equal a reduce-scatter's. Every operation is
counted: calls, bytes sent by this rank, and seconds. How slices travel (one block datatype per
slice) and the argument checks of every public call (UsageError) are in comm/blocks.py.

Every collective is checked (comm/signature.py): its messages go point to point, one to and
from every peer, beside a header with this rank's signature, and ranks that pass different
lengths, dtypes or operations all raise one MismatchError before any result is used. With
``check=False`` the same collectives are MPI's own (``Ialltoallv``, ``Iallgather``), unchecked.
"""
import time
from collections import defaultdict
from typing import Callable, Dict, Optional

import numpy as np
from mpi4py import MPI

from ..errors import ConfigError
from ..optim import impl
from .blocks import WORD, MOVED, OpStats, RecvRows, block_layout, check_flat, check_reduce_scatter, sum_table
from .checked import Checks, allgather_rows
from .signature import signature
from .simulated_world import simulated
from .watchdog import WaitRecord, guard_job

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

    In a job of several ranks, a Communicator made without ``share`` also guards its job, as an
    engine does (docs/failures.md): its own collective :attr:`watchdog` (``timeout_s`` seconds in one
    wait, None: ZEROMPI_TIMEOUT_S or 300 s), the abort hook (an uncaught exception on any rank ends
    every rank; ``abort_on_exception=False`` leaves ``sys.excepthook`` alone) and the launcher check
    (comm/launcher.py). An engine over it times its waits with its own config's timeout instead.

    ``check``: every collective checks that the ranks passed the same operation, length, dtype,
    label and scale (comm/signature.py: a MismatchError on every rank otherwise); None: as
    ``share`` does, else True. Off, the collectives are MPI's own (Ialltoallv, Iallgather): for
    the benchmark of what the check costs (scripts/bench_signature.py).
    """

    def __init__(self, mpi_comm=MPI.COMM_WORLD, share: Optional["Communicator"] = None, node_of=None,
                 timeout_s: Optional[float] = None, abort_on_exception: bool = True,
                 check: Optional[bool] = None):
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
        if hasattr(self.mpi, "waits_in"):   # a simulated world: its collectives arrive when this rank waits
            self.mpi.waits_in(self.waiting)
        self.watchdog = share.watchdog if share is not None else guard_job(self, timeout_s, abort_on_exception)
        self.check_stats = share.check_stats if share is not None else OpStats()   # the checks' headers, counted apart
        default = not simulated(self.mpi)      # a simulated world's stand-ins agree by construction
        self.checked = (share.checked if share is not None else default) if check is None else bool(check)
        self.checks = Checks(self.mpi, self.check_stats, self.peers, self.waiting) if self.checked and self.size > 1 \
            else None
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
            blk = self._types[key] = (getattr(MPI, WORD[itemsize]).Create_contiguous(k).Commit(), layout)
        return blk

    def free_types(self) -> None:
        """Free the cached block datatypes and the checks' idle plans that use them (a collective in
        flight keeps its own until it completes)."""
        if self.checks is not None:
            self.checks.free_plans()
        for dtype, _ in self._types.values():
            dtype.Free()
        self._types.clear()

    # ---- reduce-scatter --------------------------------------------------
    def ireduce_scatter(self, send, out, scale: float = 1.0, accumulate: bool = False, tag=None,
                        quant=None, op_name: str = "reduce_scatter") -> Handle:
        """Start: ``out = [out +] scale * sum_r send_r[my slice]``, summed in fp32 in rank order.

        ``send``: flat array of ``size * k`` elements (this rank's contribution to every slice),
        not to be written until ``wait()`` (the sum reads the own slice where it lies).
        ``out``: ``k`` elements, same dtype; written only in ``wait()``; may be the own slice
        of ``send`` (an in-place all-reduce). ``quant``: a comm.quantized.Quantization: the
        slices travel quantized and are dequantized into the sum (qgZ). ``op_name``: the operation
        the check names (an all-reduce's reduce-scatter says ``all_reduce``).
        """
        if quant is not None:
            return self._ireduce_scatter_quantized(send, out, scale, accumulate, tag, quant, op_name)
        n, me = self.size, self.rank
        k = check_reduce_scatter(send, out, n)
        sig = signature(op_name, send.dtype, send.size, tag, scale, accumulate) if self.checks else None
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
        req = self._all_to_all(sig, wire, recv.wire, blk, (sc, sd, rc, rd), (wire.address, wire.nbytes, recv.address))
        # The sum reads the own slice where it lies: no copy at any N.
        rows = recv.with_own(flat[me * k:(me + 1) * k], wire.address + me * block)
        st.seconds += time.perf_counter() - t

        def finish():
            impl.sum_rows(rows.rows, out, scale, accumulate, rows.addrs)

        return Handle(self, "reduce_scatter", req, (recv, send, out), finish, tag)

    def reduce_scatter(self, send, out, scale: float = 1.0, accumulate: bool = False, quant=None) -> None:
        """Blocking form of :meth:`ireduce_scatter`."""
        self.ireduce_scatter(send, out, scale, accumulate, quant=quant).wait()

    def _ireduce_scatter_quantized(self, send, out, scale, accumulate, tag, quant, op_name) -> Handle:
        """qgZ: every slice quantized into a wire block, an all-to-all of the blocks, then the
        N rows dequantized and summed in fp32 in rank order (the own row quantized too, so that
        every rank's contribution is treated alike)."""
        n, me = self.size, self.rank
        k = check_reduce_scatter(send, out, n)
        sig = signature(op_name, send.dtype, send.size, tag, scale, accumulate, quant) if self.checks else None
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
        req = self._all_to_all(sig, blocks, wire.wire, blk, (sc, sd, rc, rd))
        st.seconds += time.perf_counter() - t
        rows = [wire.rows[r] if r != me else blocks[me * wb:(me + 1) * wb] for r in range(n)]

        def finish():
            parts = [quant.rows(row, k) for row in rows]
            impl.dequant_sum([v for v, _ in parts], [s for _, s in parts], k, quant.bits, quant.block, out, scale,
                             accumulate)
            self._wire_pool.setdefault(blocks.size, []).append(blocks)

        return Handle(self, "reduce_scatter", req, (wire, blocks, send, out), finish, tag)

    def _all_to_all(self, sig, send, recv, blk, layout, key=None):
        """Block r of ``send`` to every peer r, and each peer's block into ``recv`` (``layout``: the
        block_layout): one checked exchange (comm/signature.py), or MPI's Ialltoallv unchecked.
        ``key``: (send address, send bytes, recv address): the exchange is planned (checked.Plan)."""
        sc, sd, rc, rd = layout
        if sig is None:
            return self.mpi.Ialltoallv([send, (sc, sd), blk], [recv, (rc, rd), blk])
        others = self.checks.others
        if key is None:
            return self.checks.exchange(sig, [(r, [send, (1, r), blk]) for r in others],
                                        [(r, [recv, (1, rd[r]), blk]) for r in others])

        def messages():
            out, into = _at(key[0], key[1]), _at(key[2], (self.size - 1) * key[1] // self.size)
            return [(r, [out, (1, r), blk]) for r in others], [(r, [into, (1, rd[r]), blk]) for r in others]

        return self.checks.planned(sig, key, messages)

    # ---- all-gather --------------------------------------------------------
    def iall_gather(self, buf, tag=None, logical_block: int = None, sig=None) -> Handle:
        """Start: every rank's slice r of ``buf`` is copied into slice r of ``buf`` on all ranks, in place.

        ``buf`` may be uint8 (quantized wire blocks, comm/quantized.py); ``logical_block``: then
        the bytes of one slice unquantized, for the counters, and ``sig`` the check's signature of
        the unquantized buffer (comm/signature.py; default: ``buf``'s own; False: not checked)."""
        n = self.size
        check_flat("all_gather buf", buf, n, MOVED)
        blk, _ = self._block(buf.size // n, buf.itemsize)
        st = self.stats["all_gather"]
        if self.counting:
            self.count("all_gather", buf.nbytes // n, logical_block)
        t = time.perf_counter()
        wire = MPI.buffer(buf.reshape(-1))
        if self.checks is None or sig is False:
            req = self.mpi.Iallgather(MPI.IN_PLACE, [wire, 1, blk])
        else:
            others, me, key = self.checks.others, self.slot, (wire.address, wire.nbytes)

            def messages():
                at = _at(*key)
                return [(r, [at, (1, me), blk]) for r in others], [(r, [at, (1, r), blk]) for r in others]

            req = self.checks.planned(sig or signature("all_gather", buf.dtype, buf.size, tag), key, messages)
        st.seconds += time.perf_counter() - t
        return Handle(self, "all_gather", req, (), None, tag)

    def all_gather(self, buf, tag=None, logical_block: int = None, sig=None) -> None:
        """Blocking form of :meth:`iall_gather`."""
        self.iall_gather(buf, tag, logical_block, sig).wait()

    # ---- all-reduce --------------------------------------------------------
    def all_reduce(self, buf, scale: float = 1.0) -> None:
        """``buf = scale * sum_r buf_r`` in place: reduce-scatter then all-gather (same bits as RS).
        The reduce-scatter is checked as an all_reduce; the all-gather of the same buffer then needs no check."""
        k = buf.size // self.size
        mine = buf.reshape(-1)[self.slot * k:(self.slot + 1) * k]
        self.ireduce_scatter(buf, mine, scale, op_name="all_reduce").wait()
        self.all_gather(buf, sig=False)

    def gather_scalars(self, values, op_name: str = "gather_scalars") -> np.ndarray:
        """Every rank's few float64 numbers: a (size, len(values)) table, identical on every rank
        (one all-gather, counted under "sum_scalars"). Every rank must pass the same count (checked)."""
        local = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
        table = np.empty((self.size, local.size), np.float64)
        t = time.perf_counter()
        with self.waiting("sum_scalars"):
            allgather_rows(self.mpi, self.checks, op_name, local, table)
        st = self.stats["sum_scalars"]
        st.calls += 1
        st.sent(local.nbytes, self.peers)
        st.seconds += time.perf_counter() - t
        return table

    def sum_scalars(self, values) -> np.ndarray:
        """Sum a few float64 numbers over ranks, in rank order (deterministic, bit-identical everywhere)."""
        return sum_table(self.gather_scalars(values, "sum_scalars"))

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


def _at(address: int, nbytes: int):
    """``nbytes`` of memory at ``address`` as a buffer that does not keep its owner alive (a plan's)."""
    return MPI.buffer.fromaddress(address, nbytes)


def as_communicator(comm, timeout_s: Optional[float] = None, abort_on_exception: bool = True):
    """``comm`` itself when it is a Communicator or has its interface (staging.StagedCommunicator),
    else a new Communicator over the mpi4py communicator ``comm`` (None: COMM_WORLD) guarded with
    these settings (an engine's: its config's timeout and abort_on_exception)."""
    if hasattr(comm, "ireduce_scatter"):
        return comm
    return Communicator(MPI.COMM_WORLD if comm is None else comm, timeout_s=timeout_s,
                        abort_on_exception=abort_on_exception)


def world_rank(mpi_comm=None) -> int:
    """This process's rank in the job (MPI.COMM_WORLD): what the launcher, the fault injector and
    every rank's own lines number (a sub-communicator's rank is another number). ``mpi_comm`` a
    simulated world (comm/simulated_world.py) or one of its groups: the rank it simulates."""
    if simulated(mpi_comm):
        return mpi_comm.world_rank
    return MPI.COMM_WORLD.Get_rank()


def mpi_library() -> str:
    """First line of the MPI library's version string, e.g. 'MPICH Version: 4.2.0'."""
    return " ".join(MPI.Get_library_version().splitlines()[0].split())
