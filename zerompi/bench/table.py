"""The nccl-tests-style table the benchmark prints on rank 0: per op a header, a row per
(size, implementation), and the footer (average bus bandwidth, the copy ceiling, the
reduce-scatter ratio against MPI's own; the quantized rows' error)."""
import statistics
import sys
from typing import List, Tuple

from . import quantized
from .config import BenchConfig
from .levels import HEADER

PLACE = {"reduce_scatter": "out-of-place (bucket -> own slice)", "all_gather": "in place",
         "all_reduce": "in place", "all_to_all": "out-of-place (a chunk of all heads -> the whole sequence of 1/K)",
         "all_to_allv": "out-of-place (each rank's token rows -> the rows for this rank's experts)"}


def width(cfg: BenchConfig) -> int:
    """Of the impl column: 8, or the longest name (zerompi-2level-q8)."""
    return max(8, *map(len, cfg.row_impls()))


def table_header(op: str, cfg: BenchConfig) -> str:
    w = width(cfg)
    parts = ([quantized.HEADER] if cfg.quantized else []) + ([HEADER] if cfg.node_size is not None else [])
    more = ("".join(p[0] for p in parts), "".join(p[1] for p in parts))
    return (f"#\n# {op}: {PLACE[op]}\n"
            f"# {'size':>10} {'count':>10} {'type':>6} {'impl':>{w}} {'time_min':>9} {'time_avg':>9} "
            f"{'time_max':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'overlap':>7}{more[0]}\n"
            f"# {'(B)':>10} {'(elts)':>10} {'':>6} {'':>{w}} {'(us)':>9} {'(us)':>9} {'(us)':>9} "
            f"{'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'(%)':>7}{more[1]}")


def table_row(r: dict, cfg: BenchConfig) -> str:
    wrong = "N/A" if r["wrong"] is None else str(r["wrong"])
    ovl = "-" if r["overlap_pct"] is None else f"{r['overlap_pct']:.0f}"
    w = width(cfg)
    return (f"  {r['bytes']:>10} {r['count']:>10} {r['type']:>6} {r['impl']:>{w}} {r['time_us_min']:>9.1f} "
            f"{r['time_us']:>9.1f} {r['time_us_max']:>9.1f} {r['algbw']:>7.2f} {r['busbw']:>7.2f} "
            f"{wrong:>6} {ovl:>7}")


def footer(records: List[dict], cfg: BenchConfig) -> str:
    lines = ["#"]
    for impl in cfg.row_impls():
        mine = [r for r in records if r["impl"] == impl]
        per_op = ", ".join(f"{op} {statistics.mean(r['busbw'] for r in mine if r['op'] == op):.2f}"
                           for op in cfg.ops if impl in cfg.op_impls(op))
        lines.append(f"# Avg bus bandwidth {impl:>8}: {statistics.mean(r['busbw'] for r in mine):.2f} GB/s "
                     f"({per_op})")
    copies = sorted({r["bytes"]: r["copy_GBps"] for r in records}.items())
    lines.append(f"# Copy bandwidth of the same buffers (np.copyto, all ranks at once; ceiling per rank): "
                 f"median {statistics.median(c for _, c in copies):.2f} GB/s, "
                 f"{min(c for _, c in copies):.2f}..{max(c for _, c in copies):.2f} over sizes")
    ratios = rs_ratios(records)
    if ratios:
        worst = min(ratios, key=lambda x: x[1])
        lines.append(f"# reduce_scatter busbw zerompi/mpi at sizes >= 1 MiB: min {worst[1]:.2f} "
                     f"(at {worst[0]} B), median {statistics.median(x for _, x in ratios):.2f}")
    moves = ("all_gather", "all_to_all", "all_to_allv")          # no sum: no fp32 stand-in
    if cfg.dtype == "fp16" and "mpi" in cfg.impls and any(o not in moves for o in cfg.ops):
        lines.append("# float*: MPI has no fp16 sum; the built-in reduces fp32 elements of the same byte size")
    if cfg.check:
        lines.append(f"# #wrong: {sum(r['wrong'] for r in records)} elements in all rows "
                     f"(tolerance N x eps x sum|x| for sums, bit-exact for all_gather and all_to_all(v)" +
                     ("; quantized rows: |result - exact| <= bound x scale" if cfg.quantized else "") + ")")
    if cfg.quantized:
        lines += quantized.footer(records)
    return "\n".join(lines)


def rs_ratios(records: List[dict]) -> List[Tuple[int, float]]:
    """(bytes, zerompi busbw / mpi busbw) of the reduce-scatter rows >= 1 MiB."""
    rows = {(r["impl"], r["bytes"]): r["busbw"] for r in records if r["op"] == "reduce_scatter"}
    return [(b, bw / rows[("mpi", b)]) for (impl, b), bw in sorted(rows.items())
            if impl == "zerompi" and b >= 1 << 20 and rows.get(("mpi", b), 0) > 0]


def print0(comm, text: str) -> None:
    if comm.rank == 0:
        print(text)
        sys.stdout.flush()
