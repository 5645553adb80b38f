"""What zerompi.bench measures: the cases (an op on one implementation), their inputs and
float64 oracle, and the timers (interleaved medians, OSU overlap, copy bandwidth).

Inputs are a hash of (rank, element index), so any rank can compute every rank's input
and the oracle needs no communication.
"""
import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import numpy as np

TYPE_NAMES = {"fp16": "half", "fp32": "float"}
OVERLAP_CHUNKS = 20      # compute pieces per collective in the overlap measurement: 20 test() calls
SPIN_ELEMENTS = 4096     # dummy compute works on this many cache-resident fp32 values per unit
FILL_CHUNK = 1 << 20     # elements generated at a time (bounds the generator's temporaries)


# ---- data and oracle -----------------------------------------------------------
def rank_values(rank: int, lo: int, hi: int) -> np.ndarray:
    """Rank's input elements lo..hi-1: float64 in [-0.5, 0.5), a hash of (rank, index).

    Any rank can compute any other rank's input, so the oracle needs no communication.
    """
    out = np.empty(hi - lo, np.float64)
    salt = np.uint64((rank + 1) * 0x9E3779B97F4A7C15 % (1 << 64))
    for a in range(lo, hi, FILL_CHUNK):
        i = np.arange(a, min(hi, a + FILL_CHUNK), dtype=np.uint64)
        h = i * np.uint64(0xBF58476D1CE4E5B9) + salt       # wraps mod 2**64 on purpose
        h ^= h >> np.uint64(31)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(29)
        out[a - lo:a - lo + i.size] = (h >> np.uint64(40)).astype(np.float64) / float(1 << 24) - 0.5
    return out


def fill(buf: np.ndarray, rank: int, lo: int = 0) -> None:
    """buf[:] = rank's input elements lo.. (cast to buf's dtype)."""
    buf[...] = rank_values(rank, lo, lo + buf.size)


def oracle_sum(dtype, n: int, lo: int, hi: int) -> Tuple[np.ndarray, np.ndarray]:
    """(sum over ranks, sum of |x|) of elements lo..hi-1, float64, from dtype-rounded inputs."""
    total = np.zeros(hi - lo)
    mag = np.zeros(hi - lo)
    for r in range(n):
        x = rank_values(r, lo, hi).astype(dtype).astype(np.float64)
        total += x
        mag += np.abs(x)
    return total, mag


def count_wrong(got: np.ndarray, want: np.ndarray, mag: Optional[np.ndarray], n: int) -> int:
    """Elements of got outside tolerance: |got - want| <= n*eps*mag + tiny (exact when mag is None)."""
    g = got.astype(np.float64)
    if mag is None:
        return int(np.count_nonzero(~(g == want)))
    fi = np.finfo(got.dtype)
    tol = n * float(fi.eps) * mag + float(fi.smallest_subnormal)
    return int(np.count_nonzero(~(np.abs(g - want) <= tol)))     # NaN counts as wrong


# ---- one row: an op on one implementation ---------------------------------------
@dataclass
class Case:
    """Buffers and calls for one (op, impl) on one size. ``start`` is None when there is no non-blocking form."""
    run: Callable[[], None]                   # the blocking collective
    start: Optional[Callable[[], object]]     # starts it; the result has test() and wait()
    reset: Callable[[], None]                 # writes the input; untimed, before every run
    poison: Callable[[], None]                # fills what the op must write with NaN (--check)
    verify: Callable[[], int]                 # wrong elements on this rank after one run
    type_name: str                            # what the type column shows
    count: int                                # elements of that type in the whole buffer
    wire_bytes: Optional[int] = None          # bytes of the whole buffer as it travels (quantized rows)
    error: Optional[Callable[[], tuple]] = None   # quantized rows, after verify(): (max, sum of squares, count)
    bound: Optional[float] = None             # ... of |result - exact| / scale; beyond it an element is wrong


class _Request:
    """An MPI request with the Handle's test()/wait() names."""

    def __init__(self, req):
        self._req = req

    def test(self) -> bool:
        return self._req.Test()

    def wait(self) -> None:
        self._req.Wait()


def make_case(op: str, impl: str, comm, buf: np.ndarray, out: np.ndarray, dtype_name: str, xp=np) -> Case:
    """Set up op on ``buf`` (the whole buffer) and ``out`` (one slice) for impl.

    ``impl``: "mpi" (the library's collective on ``comm.mpi``), else one of zerompi's (the
    collectives of ``comm``: a Communicator, or a two-level one whose rank holds slice
    ``comm.slot``). ``xp`` other than NumPy (CuPy, for the zerompi rows of ``--device gpu``):
    the case runs on device copies of the buffers, and verify() reads them back to the host.
    """
    from mpi4py import MPI
    n, me, mpi = comm.size, comm.rank, comm.mpi
    ours = impl != "mpi"
    slot = getattr(comm, "slot", me) if ours else me                         # the slice this rank holds
    owner = {s: r for r, s in enumerate(getattr(comm, "slots", range(n)) if ours else range(n))}   # slice -> rank
    k = buf.size // n
    wire = buf
    type_name = TYPE_NAMES[dtype_name]
    if impl == "mpi" and op != "all_gather" and buf.dtype == np.float16:
        wire, type_name = buf.view(np.float32), "float*"    # MPI has no fp16 sum: fp32 of the same bytes
    wout = out.view(wire.dtype)
    kw = wire.size // n
    mtype = MPI.FLOAT if wire.dtype == np.float32 else None
    pristine = np.empty_like(wire)
    fill(pristine, me)
    host = np.asarray
    if xp is not np:
        wire, wout, pristine, host = xp.asarray(wire), xp.asarray(wout), xp.asarray(pristine), xp.asnumpy

    if op == "reduce_scatter":
        def reset():
            wire[...] = pristine

        def poison():
            wout[...] = np.nan

        def verify():
            want, mag = oracle_sum(wire.dtype, n, slot * kw, (slot + 1) * kw)
            return count_wrong(host(wout), want, mag, n)
        if ours:
            run, start = (lambda: comm.reduce_scatter(wire, wout)), (lambda: comm.ireduce_scatter(wire, wout))
        else:
            run = lambda: mpi.Reduce_scatter_block([wire, mtype], [wout, mtype], op=MPI.SUM)
            start = lambda: _Request(mpi.Ireduce_scatter_block([wire, mtype], [wout, mtype], op=MPI.SUM))
    elif op == "all_gather":
        def reset():
            wire[slot * k:(slot + 1) * k] = pristine[slot * k:(slot + 1) * k]

        def poison():
            wire[:slot * k] = np.nan
            wire[(slot + 1) * k:] = np.nan

        def verify():
            want = np.concatenate([rank_values(owner[s], s * k, (s + 1) * k).astype(wire.dtype) for s in range(n)])
            return count_wrong(host(wire), want.astype(np.float64), None, n)
        if ours:
            run, start = (lambda: comm.all_gather(wire)), (lambda: comm.iall_gather(wire))
        else:
            byt = wire.view(np.uint8)
            run = lambda: mpi.Allgather(MPI.IN_PLACE, [byt, MPI.BYTE])
            start = lambda: _Request(mpi.Iallgather(MPI.IN_PLACE, [byt, MPI.BYTE]))
    else:
        def reset():           # in place: without it the values would grow by N each run
            wire[...] = pristine
        poison = reset         # every element is overwritten by the sum

        def verify():
            want, mag = oracle_sum(wire.dtype, n, 0, wire.size)
            return count_wrong(host(wire), want, mag, n)
        if ours:
            run, start = (lambda: comm.all_reduce(wire)), None   # the engine never starts a non-blocking all-reduce
        else:
            run = lambda: mpi.Allreduce(MPI.IN_PLACE, [wire, mtype], op=MPI.SUM)
            start = lambda: _Request(mpi.Iallreduce(MPI.IN_PLACE, [wire, mtype], op=MPI.SUM))
    return Case(run, start, reset, poison, verify, type_name, wire.size)


# ---- timing ---------------------------------------------------------------------
def time_medians(mpi, bodies: List[Tuple[Callable[[], None], Optional[Callable[[], None]]]],
                 iters: int, warmup: int) -> List[float]:
    """Median seconds of each (body, reset) pair's body() over iters, after warmup.

    The bodies take turns iteration by iteration, so that load from other processes on a
    shared machine hits every implementation alike; all ranks start each run together.
    """
    times = [[] for _ in bodies]
    for i in range(warmup + iters):
        for (body, reset), ts in zip(bodies, times):
            if reset is not None:
                reset()
            mpi.Barrier()
            t = time.perf_counter()
            body()
            if i >= warmup:
                ts.append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]


def time_median(mpi, body: Callable[[], None], iters: int, warmup: int,
                reset: Optional[Callable[[], None]] = None) -> float:
    """Median seconds of body() over iters, after warmup (see time_medians)."""
    return time_medians(mpi, [(body, reset)], iters, warmup)[0]


class Spinner:
    """Dummy compute of a requested length: fixed work units, so interference shows as time."""

    def __init__(self):
        self._a = np.full(SPIN_ELEMENTS, 1.0, np.float32)
        self.unit_s = min(self._time(200) for _ in range(3)) / 200

    def _time(self, units: int) -> float:
        t = time.perf_counter()
        self.spin(units)
        return time.perf_counter() - t

    def spin(self, units: int) -> None:
        a = self._a
        for _ in range(units):
            np.sqrt(a, out=a)          # stays 1.0: no denormals, no overflow

    def units_for(self, seconds: float) -> int:
        return max(1, round(seconds / self.unit_s))


def measure_overlap(mpi, case: Case, spinner: Spinner, iters: int, warmup: int) -> dict:
    """OSU overlap of case.start(): pure, compute-only and overlapped times (s), on this rank."""
    def pure():
        case.start().wait()
    t_pure = time_median(mpi, pure, iters, warmup, case.reset)
    piece = spinner.units_for(t_pure / OVERLAP_CHUNKS)

    def compute():
        for _ in range(OVERLAP_CHUNKS):
            spinner.spin(piece)

    def overlapped():
        h = case.start()
        for _ in range(OVERLAP_CHUNKS):
            spinner.spin(piece)
            h.test()
        h.wait()
    t_cpu = time_median(mpi, compute, iters, warmup)
    t_ovl = time_median(mpi, overlapped, iters, warmup, case.reset)
    return {"t_pure": t_pure, "t_cpu": t_cpu, "t_ovl": t_ovl}


def overlap_pct(t_pure: float, t_cpu: float, t_ovl: float) -> float:
    """OSU: the share of the pure communication time hidden behind compute, in [0, 100]."""
    if t_pure <= 0:
        return 0.0
    return float(min(100.0, max(0.0, 100.0 * (1.0 - (t_ovl - t_cpu) / t_pure))))


def copy_seconds(mpi, buf: np.ndarray, iters: int, warmup: int) -> float:
    """Median seconds of one np.copyto of buf's bytes, all ranks copying at once."""
    dst = np.empty_like(buf)
    return time_median(mpi, lambda: np.copyto(dst, buf), iters, warmup)
