"""``zerompi.bench --sp K``: the all-to-all over sequence-parallel groups of K adjacent ranks.

One concern: the rows of the Ulysses all-to-all as sequence parallelism calls it. The N ranks form
N/K groups of K adjacent ranks, as ``zerompi.Mesh(sp=K)`` makes them, and every group exchanges
its own buffer at the same time (as every data-parallel replica's SP group does in a step).
``zerompi-sp`` is the Mesh's ``sp_comm.all_to_all`` exactly as the GPT's attention calls it before
attention: the buffer is a chunk's q, k and v, (t positions, 3, K heads, HEAD_DIM), turned into the
whole sequence's for one head, (K t, 3, 1, HEAD_DIM), its pack and unpack copies included; ``mpi``
is the MPI library's ``Alltoall`` of the same bytes on the same sub-communicator (``mesh.sp_mpi``),
contiguous blocks in, contiguous blocks out: the ceiling of the exchange itself.

``size`` is the buffer each rank sends (padded to whole rows: 3 K HEAD_DIM elements), busbw =
algbw x (K-1)/K (the part that leaves the rank), times per rank as the other rows' (min / avg /
max over all N ranks). With --check every element must arrive bit-exact where the layout says
(an all-to-all moves values, it sums nothing).
"""
from typing import List, Optional

import numpy as np

from .cases import TYPE_NAMES, Case, copy_seconds, rank_values, time_medians
from .config import DTYPES, BenchConfig
from .records import _ranks, make_record
from .table import footer, print0, table_header, table_row
from .tp_allreduce import _World, check

SP_IMPL = "zerompi-sp"
OP = "all_to_all"
HEAD_DIM = 64        # elements of one head's q (or k, v) per position: the GPT 4 x 256's is 32, larger ones' 64-128


def check_sp_size(sp: Optional[int], n: int) -> None:
    """ConfigError naming the value unless ``sp`` divides the ``n`` ranks (the Mesh's own check)."""
    if sp is None:
        return
    from ..comm.mesh import check_sp
    check_sp(sp, 1, n)


def padded_elements(nbytes: int, itemsize: int, k: int) -> int:
    """Elements of a buffer of at least nbytes, in whole positions of 3 K HEAD_DIM elements."""
    row = 3 * k * HEAD_DIM
    elems = -(-nbytes // itemsize)
    return max(1, -(-elems // row)) * row


def make_sp_case(impl: str, mesh, count: int, dtype) -> Case:
    """The all-to-all of this rank's ``count`` elements over its SP group by ``impl`` (zerompi-sp or mpi)."""
    k, me, s = mesh.sp, mesh.world.Get_rank(), mesh.sp_rank
    t = count // (3 * k * HEAD_DIM)
    x = np.empty((t, 3, k, HEAD_DIM), dtype)
    pristine = rank_values(me, 0, count).astype(dtype).reshape(x.shape)
    if impl == SP_IMPL:
        out = np.empty((k * t, 3, 1, HEAD_DIM), dtype)
        send, recv = np.empty(count, dtype), np.empty(count, dtype)
        run = lambda: mesh.sp_comm.all_to_all(x, 2, 0, out, send, recv, op="bench_sp_all_to_all")

        def got(i):                # what arrived from SP rank i: its positions, this rank's head
            return out[i * t:(i + 1) * t]
    else:
        out = np.empty((k, count // k), dtype)
        wire_in, wire_out = x.reshape(k, -1).view(np.uint8), out.view(np.uint8)
        run = lambda: mesh.sp_mpi.Alltoall(wire_in, wire_out)

        def got(i):
            return out[i]

    def reset():
        x[...] = pristine

    def poison():                  # the input written, every element it must move NaN until it arrives
        reset()
        out[...] = np.nan

    def verify():
        wrong = 0
        for i, r in enumerate(mesh.sp_ranks):
            theirs = rank_values(r, 0, count).astype(dtype).reshape(x.shape)
            want = theirs[:, :, s:s + 1] if impl == SP_IMPL else theirs.reshape(k, -1)[s]
            wrong += int(np.count_nonzero(got(i).reshape(want.shape).view(f"u{x.itemsize}")
                                          != np.ascontiguousarray(want).view(f"u{x.itemsize}")))
        return wrong
    type_name = TYPE_NAMES["fp16" if x.dtype == np.float16 else "fp32"]
    return Case(run, None, reset, poison, verify, type_name, count)


def run_sp(cfg: BenchConfig, mesh) -> List[dict]:
    """Every (size, impl) row of the all-to-all over the SP groups of ``mesh``; returns the records
    (the same on every rank): run.make_record's, busbw over the group, and the group's size."""
    world, k = mesh.world, mesh.sp
    dtype = DTYPES[cfg.dtype]
    impls = cfg.op_impls(OP)
    records, here = [], _World(world)
    print0(here, table_header(OP, cfg))
    for nbytes in cfg.sizes():
        count = padded_elements(nbytes, np.dtype(dtype).itemsize, k)
        buf = np.zeros(count, dtype)
        copy_s = _ranks(world, copy_seconds(world, buf, cfg.iters, cfg.warmup))["avg"]
        cases = [make_sp_case(impl, mesh, count, dtype) for impl in impls]
        checked = [check(world, c) if cfg.check else None for c in cases]
        medians = time_medians(world, [(c.run, c.reset) for c in cases], cfg.iters, cfg.warmup)
        for impl, case, wrong, t in zip(impls, cases, checked, medians):
            rec = make_record(cfg, here, OP, impl, case, buf, _ranks(world, t), wrong)
            rec.update(busbw=rec["algbw"] * (k - 1) / k, sp=k, group_size=k, groups=world.Get_size() // k,
                       local_sum=None)
            rec["copy_GBps"] = buf.nbytes / copy_s / 1e9
            records.append(rec)
            print0(here, table_row(rec, cfg))
    print0(here, footer(records, cfg))
    ratios = [(r["bytes"], r["busbw"] / m["busbw"]) for r in records for m in records
              if r["impl"] == SP_IMPL and m["impl"] == "mpi" and m["bytes"] == r["bytes"] and m["busbw"] > 0]
    if ratios:
        print0(here, f"# all_to_all busbw {SP_IMPL}/mpi: median {np.median([x for _, x in ratios]):.2f}, min "
                     f"{min(x for _, x in ratios):.2f} (the pack and unpack copies are {SP_IMPL}'s own)")
    return records


def banner(mesh) -> str:
    return (f"# sequence-parallel groups: {mesh.world.Get_size() // mesh.sp} of {mesh.sp} adjacent ranks "
            f"({list(range(mesh.sp))}, ...; zerompi.Mesh), exchanging at "
            f"once; {SP_IMPL}: mesh.sp_comm.all_to_all of a chunk's q, k, v (t, 3, K heads, {HEAD_DIM}) -> the "
            f"whole sequence's (K t, 3, 1 head, {HEAD_DIM}), packing and unpacking included; mpi: Alltoall of the "
            f"same bytes on the same sub-communicator; size: the buffer each rank sends; busbw = algbw x (K-1)/K "
            f"with K = {mesh.sp}")
