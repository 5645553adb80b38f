"""What the collectives' check costs (comm/signature.py): each collective with the check, against the
same collective without it (MPI's own: Ialltoallv, Iallgather), in one run.

    mpiexec -n 2 python scripts/bench_signature.py            # 1 MiB and 64 MiB fp32 buffers
    mpiexec -n 4 python scripts/bench_signature.py --sizes 1M,64M --rounds 11

Each operation (reduce_scatter, all_gather, all_reduce, and the TP all-reduce of a Mesh of every
rank) is run by a Communicator with ``check=True`` and one with ``check=False`` over the same
MPI communicator, alternately in rounds: a round times a block of calls of each (the blocks'
order drawn afresh), a barrier before each block; a call's time is the block's mean (the slowest
rank's). Rank 0 prints one JSON object: per operation and size, the median over rounds of each
form, their ratio (checked / unchecked) and the spread of the per-round ratios, the best block
of each form and their ratio (on a loaded machine the least disturbed estimate); and whether
every median ratio is under the 2% the check must stay under to be on by default. Exit status 0 always (a shared
machine's noise is not a failure; read the spread).
"""
import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerompi.bench.config import parse_size  # noqa: E402
from zerompi.comm.communicator import Communicator, mpi_library  # noqa: E402
from zerompi.comm.mesh import TPComm  # noqa: E402
from zerompi.optim import impl  # noqa: E402

LIMIT = 0.02     # the check stays on by default while it costs less than this (the bar)


def cases(world, nbytes: int):
    """{name: (checked call, unchecked call)} on fp32 buffers of ``nbytes`` (rounded to whole slices)."""
    n = world.Get_size()
    numel = max(n, nbytes // 4 // n * n)
    send, out_slice, buf = np.ones(numel, np.float32), np.empty(numel // n, np.float32), np.ones(numel, np.float32)
    out = {}
    for checked in (True, False):     # the same buffers for both forms: what moves is alike
        comm = Communicator(world, check=checked)
        tp = TPComm(world, check=checked)
        calls = {"reduce_scatter": lambda c=comm: c.reduce_scatter(send, out_slice),
                 "all_gather": lambda c=comm: c.all_gather(buf),
                 "all_reduce": lambda c=comm: c.all_reduce(buf, 1.0 / n),     # the values stay 1
                 "tp_all_reduce": lambda t=tp: t.all_reduce(buf)}      # values grow to inf: as fast to sum
        for name, call in calls.items():
            out.setdefault(name, [None, None])[0 if checked else 1] = call
    return out


def block_time(world, call, reps: int) -> float:
    world.Barrier()
    t = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - t) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,64M", help="buffer sizes, comma-separated (K, M, G suffixes)")
    ap.add_argument("--rounds", type=int, default=9, help="rounds of every form (default 9)")
    ap.add_argument("--seconds", type=float, default=0.05, help="about how long one block runs (default 0.05)")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    impl.use_impl("auto", verbose=False)
    rng = random.Random(7)                      # the same order on every rank
    results = []
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        for name, (checked, unchecked) in cases(world, size).items():
            for call in (checked, unchecked, checked, unchecked):   # warm-up: buffers, datatypes, the link
                call()
            once = world.allreduce(block_time(world, unchecked, 1), op=MPI.MAX)
            reps = max(1, int(args.seconds / max(once, 1e-6)))
            rows = {"checked": [], "unchecked": []}
            for _ in range(args.rounds):
                order = [("checked", checked), ("unchecked", unchecked)]
                rng.shuffle(order)
                for form, call in order:
                    rows[form].append(world.allreduce(block_time(world, call, reps), op=MPI.MAX))
            med = {form: statistics.median(v) for form, v in rows.items()}
            ratios = [c / u for c, u in zip(rows["checked"], rows["unchecked"])]
            best = {form: min(v) for form, v in rows.items()}   # the least loaded block of each: a floor
            results.append({"op": name, "bytes": size, "calls_per_block": reps,
                            "checked_us": med["checked"] * 1e6, "unchecked_us": med["unchecked"] * 1e6,
                            "ratio": med["checked"] / med["unchecked"],
                            "best_us": {form: v * 1e6 for form, v in best.items()},
                            "best_ratio": best["checked"] / best["unchecked"],
                            "round_ratios": {"min": min(ratios), "median": statistics.median(ratios),
                                             "max": max(ratios)}})
    if world.Get_rank() == 0:
        print(json.dumps({"ranks": world.Get_size(), "mpi": mpi_library(), "limit": LIMIT,
                          "under_limit": all(r["ratio"] < 1 + LIMIT for r in results), "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
