"""``zerompi.bench --ep K``: the all-to-all(v) over expert-parallel groups of K adjacent ranks, balanced and skewed.

One concern: the rows of the exchange that carries a mixture of experts' tokens to their experts. The N ranks form
N/K groups of K adjacent ranks, as the train job's ``--ep K`` makes them (train/moe/expert_parallel.py: rank r in
group r // K), and every group exchanges at once. ``zerompi-ep`` is comm/ep_alltoall.py's EPComm as the MoE calls
it: the counts first (one Alltoall of integers), then the rows (one Alltoallv of bytes); ``mpi`` is the MPI
library's own ``Alltoallv`` of the same rows, typed, on the same sub-communicator, its counts known beforehand (the
ceiling of the row exchange itself).

``size`` is the buffer each rank sends (its own block included), whole rows of ROW elements, a multiple of
rows_quantum(K) rows (sizes that pad to the same rows are measured once). Two count patterns
per size: ``balanced`` (every rank sends every group rank 1/K of its rows: routing in balance) and ``skewed`` (every
rank sends group rank 0 half of its rows, the others a share of the rest each: one rank's experts take half of
everything). busbw = the bytes that leave a rank (its own block stays), the mean over ranks, over the time:
algbw x (K-1)/K when balanced, as nccl-tests' alltoall. ``recv_max_bytes``: the most any rank receives from the
others (the skewed pattern's bottleneck). With --check every row must arrive bit-exact where the counts say.
"""
from typing import List, Optional

import numpy as np
from mpi4py import MPI

from .cases import TYPE_NAMES, Case, copy_seconds, rank_values, time_medians
from .config import DTYPES, BenchConfig
from .records import _ranks, make_record
from .table import footer, print0, table_header, table_row
from .tp_allreduce import _World, check

EP_IMPL = "zerompi-ep"
OP = "all_to_allv"
ROW = 1024           # elements of one token's row (d_model): the exchange moves whole rows
PATTERNS = ("balanced", "skewed")


def check_ep_size(ep: Optional[int], n: int) -> None:
    """ConfigError naming the value unless ``ep`` divides the ``n`` ranks (the train job's own check)."""
    if ep is None:
        return
    from ..errors import check as ensure
    ensure(n % ep == 0, f"ep={ep} does not divide the {n} ranks; the ranks form groups of ep, so use a divisor of {n}")


def rows_quantum(k: int) -> int:
    """Rows of a send buffer split evenly both ways: k blocks (balanced), and a half plus k-1 equal shares."""
    return int(np.lcm(k, 2 * (k - 1)))


def padded_rows(nbytes: int, itemsize: int, k: int) -> int:
    """Rows of ROW elements of a send buffer of at least nbytes, a multiple of rows_quantum(k)."""
    q = rows_quantum(k)
    rows = -(-nbytes // (itemsize * ROW))
    return max(1, -(-rows // q)) * q


def send_rows(pattern: str, rows: int, k: int) -> np.ndarray:
    """Rows each rank sends each group rank (the same from every rank): balanced, or half to group rank 0."""
    if pattern == "balanced":
        return np.full(k, rows // k, np.int64)
    rest = rows // (2 * (k - 1))
    return np.array([rows // 2] + [rest] * (k - 1), np.int64)


def make_ep_case(impl: str, ep, world_rank: int, group: List[int], rows: int, pattern: str, dtype) -> Case:
    """The exchange of this rank's ``rows`` rows over its EP group (``ep``: an EPComm) by ``impl``."""
    k, me = ep.size, ep.rank
    sent = send_rows(pattern, rows, k)
    got = np.full(k, sent[me], np.int64)                  # every group rank sends this one the same share
    count = rows * ROW
    x = np.empty((rows, ROW), dtype)
    pristine = rank_values(world_rank, 0, count).astype(dtype).reshape(x.shape)
    out = np.empty((int(got.sum()), ROW), dtype)
    arrived = [out]                # what the last run received (EPComm.rows returns a new array, as the MoE uses it)
    if impl == EP_IMPL:
        counts = sent.reshape(k, 1)

        def run():
            theirs = ep.counts(counts, op="bench_ep_counts")
            arrived[0] = ep.rows(x, sent, theirs.sum(axis=1), op="bench_ep_all_to_all")
    else:
        mtype = MPI.FLOAT if x.dtype == np.float32 else MPI.UINT16_T      # MPI has no fp16: the same bits
        sc, rc = sent * ROW, got * ROW
        sd, rd = np.concatenate([[0], np.cumsum(sc)[:-1]]), np.concatenate([[0], np.cumsum(rc)[:-1]])
        wire_in = x.view(np.uint16) if x.dtype == np.float16 else x
        wire_out = out.view(np.uint16) if x.dtype == np.float16 else out
        run = lambda: ep.mpi.Alltoallv([wire_in, (sc, sd), mtype], [wire_out, (rc, rd), mtype])   # noqa: E731

    def reset():
        x[...] = pristine

    def poison():                  # the input written, every row it must receive NaN until it arrives
        reset()
        out[...] = np.nan
        arrived[0] = out

    def verify():
        wrong, lo = 0, int(sent[:me].sum())             # where a sender's block for this rank starts
        bits = f"u{x.itemsize}"
        for i, r in enumerate(group):
            theirs = rank_values(r, lo * ROW, (lo + int(sent[me])) * ROW).astype(dtype)
            mine = arrived[0][i * int(sent[me]):(i + 1) * int(sent[me])].reshape(-1)
            wrong += int(np.count_nonzero(mine.view(bits) != theirs.view(bits)))
        return wrong
    return Case(run, None, reset, poison, verify, TYPE_NAMES["fp16" if x.dtype == np.float16 else "fp32"], count)


def run_ep(cfg: BenchConfig, world) -> List[dict]:
    """Every (size, pattern, impl) row of the all-to-all(v) over the EP groups of ``world``; returns the records
    (the same on every rank): run.make_record's, busbw from the bytes that leave a rank, the group's size, the
    pattern, and the bytes the busiest receiver takes."""
    from ..comm.ep_alltoall import EPComm
    from ..comm.subcomm import split
    k, n, me = cfg.ep, world.Get_size(), world.Get_rank()
    ep = EPComm(split(world, lambda r: r // k))
    group = [me // k * k + j for j in range(k)]
    dtype = DTYPES[cfg.dtype]
    isz = np.dtype(dtype).itemsize
    impls = cfg.op_impls(OP)
    records, here = [], _World(world)
    head = table_header(OP, cfg).split("\n")
    print0(here, "\n".join(head[:-2] + [head[-2] + f" {'counts':>9}", head[-1]]))
    sizes = dict.fromkeys(padded_rows(nbytes, isz, k) for nbytes in cfg.sizes())   # sizes that pad alike: once
    for rows in sizes:
        buf = np.zeros(rows * ROW, dtype)
        copy_s = _ranks(world, copy_seconds(world, buf, cfg.iters, cfg.warmup))["avg"]
        for pattern in PATTERNS:
            sent = send_rows(pattern, rows, k)
            left = [int(sent.sum() - sent[j]) * ROW * isz for j in range(k)]    # what leaves group rank j
            cases = [make_ep_case(impl, ep, me, group, rows, pattern, dtype) for impl in impls]
            checked = [check(world, c) if cfg.check else None for c in cases]
            medians = time_medians(world, [(c.run, c.reset) for c in cases], cfg.iters, cfg.warmup)
            for impl, case, wrong, t in zip(impls, cases, checked, medians):
                rec = make_record(cfg, here, OP, impl, case, buf, _ranks(world, t), wrong)
                rec.update(busbw=np.mean(left) / (rec["time_us"] * 1e-6) / 1e9, ep=k, group_size=k, groups=n // k,
                           counts=pattern, send_rows=sent.tolist(), left_bytes=float(np.mean(left)),
                           recv_max_bytes=(k - 1) * int(sent.max()) * ROW * isz, local_sum=None)
                rec["copy_GBps"] = buf.nbytes / copy_s / 1e9
                records.append(rec)
                print0(here, table_row(rec, cfg) + f" {pattern:>9}")
    print0(here, footer(records, cfg))
    for pattern in PATTERNS:
        ratios = [r["busbw"] / m["busbw"] for r in records for m in records
                  if r["impl"] == EP_IMPL and m["impl"] == "mpi" and r["counts"] == m["counts"] == pattern
                  and m["bytes"] == r["bytes"] and m["busbw"] > 0]
        if ratios:
            print0(here, f"# {OP} {pattern} busbw {EP_IMPL}/mpi: median {np.median(ratios):.2f}, min "
                         f"{min(ratios):.2f} (the counts' exchange is {EP_IMPL}'s own)")
    return records


def banner(n: int, k: int) -> str:
    return (f"# expert-parallel groups: {n // k} of {k} adjacent ranks ({list(range(k))}, ...; as --ep {k} makes "
            f"them), exchanging at once; {EP_IMPL}: comm/ep_alltoall.py's EPComm, the counts (Alltoall) then the "
            f"rows (Alltoallv of bytes); mpi: Alltoallv of the same rows, typed, on the same sub-communicator, the "
            f"counts known; size: the buffer each rank sends, rows of {ROW} elements; counts balanced (1/K to "
            f"each) and skewed (half to group rank 0, the rest shared); busbw = the bytes that leave a rank / time "
            f"(balanced: algbw x (K-1)/K with K = {k})")
