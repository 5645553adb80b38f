"""One row's record of zerompi.bench: the padded buffer size, the bus factor, the JSON record
(times, bandwidths, the check) and the overlap fields, shared by run.py's rows and tp_allreduce.py's.
"""
from typing import Optional

from .cases import Case, measure_overlap, overlap_pct
from .config import BenchConfig, quant_bits


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for op on n ranks (nccl-tests' factors)."""
    return 2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def padded_count(nbytes: int, itemsize: int, n: int) -> int:
    """Elements of a buffer of at least nbytes, padded to whole slices as the engine pads buckets.

    fp16 pads to 2N elements so that the MPI rows' fp32 view also splits into N whole slices.
    """
    quantum = n * max(1, 4 // itemsize)
    elems = -(-nbytes // itemsize)
    return -(-elems // quantum) * quantum


def make_record(cfg: BenchConfig, comm, op: str, impl: str, case: Case, buf, t: dict, wrong,
                error: Optional[dict] = None) -> dict:
    """One JSON record; times in µs (t: seconds, min/avg/max over ranks), bandwidths in GB/s, on the
    logical bytes (``bytes``, the buffer unquantized); ``wire_bytes``: the buffer as it travels."""
    algbw = buf.nbytes / t["avg"] / 1e9
    bits = quant_bits(impl)
    return {"op": op, "impl": impl, "dtype": cfg.dtype, "type": case.type_name, "ranks": comm.size,
            "bytes": buf.nbytes, "count": case.count, "time_us": t["avg"] * 1e6, "time_us_min": t["min"] * 1e6,
            "time_us_max": t["max"] * 1e6, "algbw": algbw, "busbw": algbw * bus_factor(op, comm.size),
            "wrong": wrong, "overlap_pct": None, "local_sum": cfg.local_sum if impl != "mpi" else None,
            "wire_bytes": case.wire_bytes if case.wire_bytes is not None else buf.nbytes,
            "quant": {"bits": bits, "block": cfg.quant_block} if bits else None,
            "quant_err_max": error and error["max"], "quant_err_rms": error and error["rms"],
            "quant_err_bound": case.bound}


def overlap_record(mpi, case: Case, spinner, cfg: BenchConfig) -> dict:
    """overlap_pct and its three times (µs, averaged over ranks)."""
    o = {k: _ranks(mpi, v)["avg"] for k, v in measure_overlap(mpi, case, spinner, cfg.iters, cfg.warmup).items()}
    return {"overlap_pct": overlap_pct(o["t_pure"], o["t_cpu"], o["t_ovl"]),
            "t_pure_us": o["t_pure"] * 1e6, "t_cpu_us": o["t_cpu"] * 1e6, "t_ovl_us": o["t_ovl"] * 1e6}


def _ranks(mpi, value: float) -> dict:
    """min / avg / max of one number over ranks."""
    vals = mpi.allgather(value)
    return {"min": min(vals), "avg": sum(vals) / len(vals), "max": max(vals)}
