"""zerompi.bench --tp with the Mesh's TP all-reduce broken on purpose, to show that --check sees it.

Usage: mpiexec -n N python tests/drivers/bench_tp_broken.py MODE BENCH-FLAGS...
MODE: "skip" (the all-reduce does nothing: the oracle must count every element) or "lastbit" (right
within tolerance, but TP rank 1 flips the lowest bit of its first element: the bit check must count it).
"""
import sys

import numpy as np

from zerompi.bench.run import main
from zerompi.comm.mesh import TPComm

mode = sys.argv[1]
right = TPComm.all_reduce


def broken(self, x, op="tp_all_reduce"):
    if mode == "skip":
        return x
    right(self, x, op)
    if self.rank == 1:
        bits = x.view(np.dtype(f"u{x.itemsize}"))
        bits[0] ^= 1
    return x


TPComm.all_reduce = broken
sys.exit(main(sys.argv[2:]))
