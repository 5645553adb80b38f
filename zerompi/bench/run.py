"""``mpiexec -n N python -m zerompi.bench``: how fast are the collectives the engine uses?

A table in the form of nccl-tests: one row per (op, size, implementation). ``zerompi`` is
the engine's own Communicator, exactly as the engine calls it (reduce-scatter = Ialltoallv
+ fp32 sum in rank order, all-gather = Iallgather in place, all-reduce = the two in
sequence; the local sum is the one impl.use_impl picks, as in the engine);
``mpi`` is the MPI library's built-in collective on the same memory (Reduce_scatter_block,
Allgather in place, Allreduce in place); with --node-size K, ``zerompi-2level`` is the
two-level Communicator over nodes of K ranks (bench/levels.py). The implementations take
turns iteration by iteration, so that load from other processes hits them alike.

Definitions (as in nccl-tests):
  size   bytes of the whole buffer (N slices); count = elements of it.
  time   per rank the median over iterations, then min / avg / max over ranks, in µs.
  algbw  size / avg time;  busbw = algbw x (N-1)/N (reduce-scatter, all-gather) or
         algbw x 2(N-1)/N (all-reduce). GB/s are 1e9 bytes per second.
  #wrong elements outside tolerance of a NumPy float64 oracle, summed over ranks
         (--check): sums within N x eps(dtype) x sum_r |x_r|, all-gather bit-exact.
MPI has no portable fp16 sum (MPICH's native one measured 30-60x slower than fp32 here),
so for fp16 the built-in reduce rows reduce fp32 elements of the same byte size; their
type column says float*. Overlap follows the OSU method: t_pure is the non-blocking
collective alone, t_cpu a dummy compute of that length, t_ovl the collective started,
then the compute in OVERLAP_CHUNKS pieces with a test() between pieces (the way the
engine progresses its handles), then wait(); overlap = 1 - (t_ovl - t_cpu) / t_pure.
"""
import sys
from dataclasses import replace
from typing import List, Optional, Tuple

import numpy as np

from .cases import Case, Spinner, copy_seconds, make_case, time_medians
from .config import DTYPES, BenchConfig, parse_config, quant_bits
from .records import _ranks, make_record, overlap_record, padded_count
from .levels import TWO_LEVEL, banner, check_node_size, columns, communicators, level_record
from .plot import check_plot, save_plot
from .table import footer, print0, table_header, table_row
from . import ep_alltoallv, quantized, sp_alltoall, tp_allreduce
from ..comm.quantized import Quantization
from ..checkpoint.outputs import check_file, check_roles, save_json
from ..errors import EXIT_OUTPUT, ConfigError, HelpRequested, agree_on_errors, agree_on_start, install_abort_hook


# ---- the run --------------------------------------------------------------------
def memory_error(cfg: BenchConfig, n: int, placement) -> Optional[str]:
    """One line when the largest size cannot fit in this rank's share of the machine, else None.

    A rank holds at least the whole buffer, the output slice, and a pristine copy of its input per
    implementation (make_case) at once; the copy-bandwidth scratch one more buffer before them.
    """
    from ..estimate.machine import available_per_rank, human_bytes
    have = available_per_rank(placement)
    itemsize = np.dtype(DTYPES[cfg.dtype]).itemsize
    count = padded_count(cfg.max_bytes, itemsize, n)
    nbytes = count * itemsize
    # a quantized row also holds its wire blocks: the ones it sends and the ones it receives
    wire = sum(2 * n * Quantization(quant_bits(i), cfg.quant_block).wire_bytes(count // n)
               for i in cfg.row_impls() if quant_bits(i))
    need = nbytes * (1 + len(cfg.row_impls())) + nbytes // n + wire
    if have is None or need <= have[0]:
        return None
    return (f"max size={cfg.max_bytes} bytes needs at least {human_bytes(need)} per rank (the buffer, its output "
            f"slice and a copy per implementation) and this rank has {human_bytes(have[0])} ({have[1]}); "
            f"use a smaller -e")


def run_bench(cfg: BenchConfig, comm, device_comm=None, xp=np, two_level=None) -> List[dict]:
    """Every (op, size, impl) row; returns the records (the same on every rank).

    ``device_comm`` and ``xp``: with ``--device gpu``, the zerompi rows run the staged
    Communicator on CuPy buffers; the MPI rows always move host buffers (the MPI library
    is not assumed CUDA-aware). ``two_level``: with ``cfg.node_size``, the two-level
    Communicator over the same ranks (its counters shared with ``comm``'s).
    """
    mpi, n = comm.mpi, comm.size
    device_comm = device_comm or comm
    dtype = DTYPES[cfg.dtype]
    spinner = Spinner() if cfg.overlap else None
    records = []
    for op in cfg.ops:
        impls = cfg.op_impls(op)
        if not impls:                   # only quantized implementations, which have no all-reduce
            continue
        print0(comm, table_header(op, cfg))
        for nbytes in cfg.sizes():
            count = padded_count(nbytes, np.dtype(dtype).itemsize, n)
            buf = np.zeros(count, dtype)
            out = np.empty(count // n, dtype)
            copy_s = _ranks(mpi, copy_seconds(mpi, buf, cfg.iters, cfg.warmup))["avg"]
            cases = [row_case(cfg, op, impl, (comm, device_comm, two_level), buf, out, xp) for impl in impls]
            checked = [check_case(mpi, c) if cfg.check else (None, None) for c in cases]
            medians = time_medians(mpi, [(c.run, c.reset) for c in cases], cfg.iters, cfg.warmup)
            for impl, case, (w, err), t in zip(impls, cases, checked, medians):
                rec = make_record(cfg, comm, op, impl, case, buf, _ranks(mpi, t), w, err)
                if cfg.node_size is not None:
                    rec.update(level_record(cfg.node_size, impl, mpi, comm.stats, case))
                if spinner is not None and case.start is not None:
                    rec.update(overlap_record(mpi, case, spinner, cfg))
                rec["copy_GBps"] = buf.nbytes / copy_s / 1e9
                records.append(rec)
                print0(comm, table_row(rec, cfg) + (quantized.columns(rec) if cfg.quantized else "") +
                       (columns(rec) if cfg.node_size is not None else ""))
    print0(comm, footer(records, cfg))
    if xp is not np:
        print0(comm, "# --device gpu: zerompi rows include the copies between the GPU and pinned host buffers; "
                     "mpi rows move host buffers")
    return records


def row_case(cfg: BenchConfig, op: str, impl: str, comms, buf, out, xp) -> Case:
    """The case of one row. ``comms``: (the flat Communicator, the one the zerompi rows use: the
    device one with --device gpu, the two-level one or None)."""
    comm, device_comm, two_level = comms
    ours = two_level if impl.startswith(TWO_LEVEL) else device_comm if impl != "mpi" else comm
    on = xp if impl != "mpi" and ours is device_comm else np       # device buffers: the flat zerompi rows
    bits = quant_bits(impl)
    if bits:
        return quantized.make_quant_case(op, ours, buf, out, cfg.dtype, Quantization(bits, cfg.quant_block), on)
    return make_case(op, impl, ours, buf, out, cfg.dtype, on)


def check_case(mpi, case: Case) -> Tuple[int, Optional[dict]]:
    """Wrong elements of one run of case, summed over ranks; for a quantized case also its error
    relative to the scale, max and RMS over every rank's elements (else None)."""
    case.reset()
    case.poison()
    case.run()
    wrong = int(mpi.allreduce(case.verify()))
    if case.error is None:
        return wrong, None
    every = mpi.allgather(case.error())
    count = sum(c for _, _, c in every)
    return wrong, {"max": max(m for m, _, _ in every), "rms": (sum(s for _, s, _ in every) / max(count, 1)) ** 0.5}


# ---- entry point ----------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> int:
    from mpi4py import MPI

    from ..optim import impl
    from ..comm.communicator import mpi_library
    from ..comm.device import describe_buffers, place_every_rank
    install_abort_hook(MPI.COMM_WORLD)
    world = MPI.COMM_WORLD
    error = None
    try:
        cfg = parse_config(argv)
        check_node_size(cfg.node_size, world.Get_size(), cfg.device)
        tp_allreduce.check_tp_size(cfg.tp, world.Get_size())
        sp_alltoall.check_sp_size(cfg.sp, world.Get_size())
        ep_alltoallv.check_ep_size(cfg.ep, world.Get_size())
        if world.Get_rank() == 0:
            check_roles([("json", cfg.json_path), ("plot", cfg.plot_path)])   # never one over the other
            check_file(cfg.json_path, "json")   # rank 0 writes it: checked before any measurement
            check_plot(cfg.plot_path)
        # what the engine's constructor does; "fused" raises here when the C kernels cannot be had
        cfg = replace(cfg, local_sum=impl.use_impl(cfg.sum_impl, verbose=world.Get_rank() == 0))
    except (ConfigError, HelpRequested) as e:
        error = e if isinstance(e, HelpRequested) else str(e)
    status = agree_on_start(world, error, "zerompi.bench")
    if status is not None:
        return status
    placement = place_every_rank(cfg.device, world, "zerompi.bench")   # gpu: needs CuPy and a GPU
    if placement is None:
        return 2
    if agree_on_errors(world, memory_error(cfg, world.Get_size(), placement), "zerompi.bench"):
        return 2                                            # before the first buffer is allocated
    if cfg.ep is not None:
        return finish(cfg, ep_records(cfg, world, placement))
    if cfg.tp is not None or cfg.sp is not None:
        return finish(cfg, group_records(cfg, world, placement))
    comm, two_level = communicators(world, cfg.node_size)
    from ..comm.staging import device_communicator
    device_comm = device_communicator(comm, placement.xp, cfg.comm)   # the host one on the CPU
    print0(comm, f"# zerompi.bench: {comm.size} ranks, {mpi_library()}, {describe_buffers(placement, device_comm)}, "
                 f"dtype {cfg.dtype}, "
                 f"iters {cfg.iters} (median) after {cfg.warmup} warmup, local sum {cfg.local_sum}")
    print0(comm, "# time: per-rank median over iterations, then min/avg/max over ranks; bw from the avg")
    if cfg.quantized:
        print0(comm, quantized.banner(cfg.quant_block))
    if two_level is not None:
        print0(comm, banner(world.Get_size(), cfg.node_size))
    return finish(cfg, run_bench(cfg, comm, device_comm, placement.xp, two_level))


def group_records(cfg: BenchConfig, world, placement) -> List[dict]:
    """--tp K or --sp K: the banner and the rows over the Mesh's TP groups (the all-reduce, bench/tp_allreduce.py)
    or SP groups (the all-to-all, bench/sp_alltoall.py)."""
    from ..comm.communicator import mpi_library
    from ..comm.device import describe_buffers
    from ..comm.mesh import Mesh
    mesh = Mesh(world, cfg.tp or 1, sp=cfg.sp or 1)
    part = tp_allreduce if cfg.tp is not None else sp_alltoall
    if world.Get_rank() == 0:
        print(f"# zerompi.bench: {world.Get_size()} ranks, {mpi_library()}, {describe_buffers(placement, None)}, "
              f"dtype {cfg.dtype}, iters {cfg.iters} (median) after {cfg.warmup} warmup")
        print("# time: per-rank median over iterations, then min/avg/max over all ranks; bw from the avg")
        print(part.banner(mesh), flush=True)
    return tp_allreduce.run_tp(cfg, mesh) if cfg.tp is not None else sp_alltoall.run_sp(cfg, mesh)


def ep_records(cfg: BenchConfig, world, placement) -> List[dict]:
    """--ep K: the banner and the rows over the EP groups (the all-to-all(v), bench/ep_alltoallv.py)."""
    from ..comm.communicator import mpi_library
    from ..comm.device import describe_buffers
    if world.Get_rank() == 0:
        print(f"# zerompi.bench: {world.Get_size()} ranks, {mpi_library()}, {describe_buffers(placement, None)}, "
              f"dtype {cfg.dtype}, iters {cfg.iters} (median) after {cfg.warmup} warmup")
        print("# time: per-rank median over iterations, then min/avg/max over all ranks; bw from the avg")
        print(ep_alltoallv.banner(world.Get_size(), cfg.ep), flush=True)
    return ep_alltoallv.run_ep(cfg, world)


def finish(cfg: BenchConfig, records: List[dict]) -> int:
    """Rank 0 writes --json and --plot; EXIT_OUTPUT with one line when it cannot."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank0 = comm.Get_rank() == 0
    problem = save_json(cfg.json_path, records, "json") if cfg.json_path and rank0 else None
    problem = problem or (save_plot(records, cfg.plot_path) if cfg.plot_path and rank0 else None)
    if problem:                  # the table is on stdout; the line says where the records are
        sys.stderr.write(f"zerompi.bench: error: {problem}\n")
        return EXIT_OUTPUT
    return 0
