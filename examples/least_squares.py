"""Least squares with ZeRO: no neural network, just sharded parameters and AdamW.

Each rank holds a slice of the rows of A and b (the slices may be uneven) and computes
the gradient of its part of  L(x, c) = ||A x + c - b||^2 / m ; zerompi reduces the
gradients, shards x, c and the optimizer state, and steps.

The cross-rank contract (README, "The library"): every rank builds the engine with the same
config, layers and initial values (here: zeros) and calls step() with the same lr (here: a
schedule of the step number); the rows of A each rank holds may differ. A rank that breaks
it stops every rank with one error naming the ranks.

    mpiexec -n 4 python examples/least_squares.py --stage 3
"""
import argparse
import math

import numpy as np
from mpi4py import MPI

import zerompi


def make_problem(seed: int = 0, rows: int = 1201, cols: int = 40):
    """A random, well-conditioned problem: (A, b) with b = A x_true + 0.5 + noise."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((rows, cols))
    b = a @ rng.standard_normal(cols) + 0.5 + 0.1 * rng.standard_normal(rows)
    return a, b


def lr_at(step: int, steps: int, peak: float = 0.1, floor: float = 1e-3) -> float:
    """Cosine decay from peak to floor, so that Adam settles at the minimum."""
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * step / steps))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", help="save the solution (rank 0) to this .npz")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    a, b = make_problem()
    rows = np.array_split(np.arange(len(b)), n)[rank]       # this rank's rows only
    a_mine, b_mine = a[rows].astype(np.float32), b[rows].astype(np.float32)

    layers = [("linear", {"x": np.zeros(a.shape[1], np.float32), "c": np.zeros(1, np.float32)})]
    config = zerompi.ZeroConfig(stage=args.stage, dtype="fp32", lr=0.1)
    engine = zerompi.ZeroEngine(layers, config)
    # The engine averages the ranks' gradients; with uneven slices each rank hands back
    # n / m times its partial sum, so that the average is the gradient of the global mean.
    weight = np.float32(n / len(b))
    for step in range(args.steps):
        with engine.unsharded(0) as prm:
            r = a_mine @ prm["x"] + prm["c"] - b_mine
        engine.grads_ready(0, {"x": 2 * weight * (a_mine.T @ r), "c": 2 * weight * r.sum(keepdims=True)})
        engine.step(lr=lr_at(step, args.steps))
    sol = engine.full_parameters()
    exact = np.linalg.lstsq(np.c_[a, np.ones(len(b))], b, rcond=None)[0]
    if rank == 0:
        err = np.linalg.norm(np.r_[sol["x"], sol["c"]] - exact) / np.linalg.norm(exact)
        print(f"least squares on {n} ranks, stage {args.stage}: relative distance to lstsq solution {err:.2e}")
        if args.out:
            np.savez(args.out, x=sol["x"], c=sol["c"])
    engine.close()


if __name__ == "__main__":
    main()
