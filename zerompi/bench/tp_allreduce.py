"""``zerompi.bench --tp K``: the all-reduce over tensor-parallel groups of K adjacent ranks.

One concern: the rows of the TP all-reduce as tensor parallelism calls it. The N ranks form
N/K groups of K adjacent ranks, as ``zerompi.Mesh(tp=K)`` makes them (ranks K·d .. K·d+K-1),
and every group all-reduces its own buffer at the same time (as every data-parallel replica's
TP group does in a step). ``zerompi-tp`` is the Mesh's ``tp_comm.all_reduce`` (Alltoall of the
K slices, a sum in rank order, Allgather: the same bits on every TP rank), ``mpi`` the MPI
library's ``Allreduce`` in place on the same sub-communicator (``mesh.tp_mpi``).

``size`` is the buffer each rank all-reduces (padded to K slices, 2K elements for fp16, so that
the MPI rows' fp32 view splits too), busbw = algbw x 2(K-1)/K (the all-reduce's bus factor for
a group of K), times per rank as the other rows' (min / avg / max over all N ranks). With
--check the float64 oracle is the sum over the rank's own group of the dtype-rounded inputs,
within K x eps x sum |x| (cases.count_wrong); a rank whose result differs in any bit from its
group's TP rank 0 counts every differing element as wrong too, for the zerompi-tp rows (their
promise: the same bits on every TP rank). MPI's rows are not held to that.
"""
from typing import List, Optional

import numpy as np

from .cases import TYPE_NAMES, Case, Spinner, _Request, copy_seconds, count_wrong, fill, rank_values, time_medians
from .config import DTYPES, BenchConfig
from .records import _ranks, make_record, overlap_record, padded_count
from .table import footer, print0, table_header, table_row

TP_IMPL = "zerompi-tp"
OP = "all_reduce"


def check_tp_size(tp: Optional[int], n: int) -> None:
    """ConfigError naming the value unless ``tp`` divides the ``n`` ranks (the Mesh's own check)."""
    if tp is None:
        return
    from ..comm.topology import check_tp
    check_tp(tp, n)


def bus_factor(k: int) -> float:
    """busbw / algbw of an all-reduce over a group of k ranks."""
    return 2.0 * (k - 1) / k


def group_oracle(dtype, group: List[int], lo: int, hi: int):
    """(sum over the group's ranks, sum of |x|) of elements lo..hi-1, float64, from dtype-rounded inputs."""
    total, mag = np.zeros(hi - lo), np.zeros(hi - lo)
    for r in group:
        x = rank_values(r, lo, hi).astype(dtype).astype(np.float64)
        total += x
        mag += np.abs(x)
    return total, mag


def make_tp_case(impl: str, mesh, buf: np.ndarray, dtype_name: str) -> Case:
    """The all-reduce of ``buf`` over this rank's TP group by ``impl`` (zerompi-tp or mpi)."""
    from mpi4py import MPI
    wire, type_name = buf, TYPE_NAMES[dtype_name]
    if impl == "mpi" and buf.dtype == np.float16:
        wire, type_name = buf.view(np.float32), "float*"      # MPI has no fp16 sum: fp32 of the same bytes
    me = mesh.world.Get_rank()
    group = mesh.tp_ranks
    pristine = np.empty_like(wire)
    fill(pristine, me)

    def reset():       # in place: without it the values would grow K-fold each run
        wire[...] = pristine

    def verify():
        want, mag = group_oracle(wire.dtype, group, 0, wire.size)
        wrong = count_wrong(wire, want, mag, mesh.tp)
        if impl == TP_IMPL:        # the same bits on every TP rank: compared with TP rank 0's (a collective)
            ref = wire.copy()
            mesh.tp_mpi.Bcast(ref, root=0)
            bits = np.dtype(f"u{wire.itemsize}")
            wrong += int(np.count_nonzero(ref.view(bits) != wire.view(bits)))
        return wrong

    if impl == TP_IMPL:
        run, start = (lambda: mesh.tp_comm.all_reduce(wire, op="bench_tp_all_reduce")), None
    else:
        tp_mpi, mtype = mesh.tp_mpi, MPI.FLOAT if wire.dtype == np.float32 else None
        run = lambda: tp_mpi.Allreduce(MPI.IN_PLACE, [wire, mtype], op=MPI.SUM)
        start = lambda: _Request(tp_mpi.Iallreduce(MPI.IN_PLACE, [wire, mtype], op=MPI.SUM))
    return Case(run, start, reset, reset, verify, type_name, wire.size)


def run_tp(cfg: BenchConfig, mesh) -> List[dict]:
    """Every (size, impl) row of the all-reduce over the TP groups of ``mesh``; returns the records
    (the same on every rank): run.make_record's, busbw over the group, and the group's size."""
    world, k = mesh.world, mesh.tp
    dtype = DTYPES[cfg.dtype]
    spinner = Spinner() if cfg.overlap else None
    impls = cfg.op_impls(OP)
    records, here = [], _World(world)
    print0(here, table_header(OP, cfg))
    for nbytes in cfg.sizes():
        buf = np.zeros(padded_count(nbytes, np.dtype(dtype).itemsize, k), dtype)
        copy_s = _ranks(world, copy_seconds(world, buf, cfg.iters, cfg.warmup))["avg"]
        cases = [make_tp_case(impl, mesh, buf, cfg.dtype) for impl in impls]
        checked = [check(world, c) if cfg.check else None for c in cases]
        medians = time_medians(world, [(c.run, c.reset) for c in cases], cfg.iters, cfg.warmup)
        for impl, case, wrong, t in zip(impls, cases, checked, medians):
            rec = make_record(cfg, here, OP, impl, case, buf, _ranks(world, t), wrong)
            rec.update(busbw=rec["algbw"] * bus_factor(k), tp=k, group_size=k, groups=mesh.dp,
                       local_sum=None)
            if spinner is not None and case.start is not None:
                rec.update(overlap_record(world, case, spinner, cfg))
            rec["copy_GBps"] = buf.nbytes / copy_s / 1e9
            records.append(rec)
            print0(here, table_row(rec, cfg))
    print0(here, footer(records, cfg))
    if cfg.check:
        print0(here, f"# --tp: N in that tolerance is the group's K = {k}; a {TP_IMPL} element that differs in any "
                     f"bit from its group's TP rank 0 counts as wrong too")
    return records


def check(world, case: Case) -> int:
    """Wrong elements of one run of ``case``, summed over every rank (from the pristine input: an
    all-reduce that did nothing leaves it, which the oracle counts wrong)."""
    case.poison()
    case.run()
    return int(world.allreduce(case.verify()))


class _World:
    """What make_record and print0 read of a communicator: the world's size (the record's ``ranks``)
    and rank (rank 0 prints)."""

    def __init__(self, world):
        self.size, self.rank = world.Get_size(), world.Get_rank()


def banner(mesh) -> str:
    return (f"# tensor-parallel groups: {mesh.dp} of {mesh.tp} adjacent ranks ({mesh.ranks[0]}, ...; zerompi.Mesh), "
            f"all-reducing at once; {TP_IMPL}: mesh.tp_comm.all_reduce (Alltoall + sum in rank order + Allgather), "
            f"mpi: Allreduce on the same sub-communicator; size: the buffer each rank all-reduces; "
            f"busbw = algbw x 2(K-1)/K with K = {mesh.tp}")
