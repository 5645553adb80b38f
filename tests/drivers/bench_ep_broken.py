"""zerompi.bench --ep with the EP exchange broken on purpose, to show that --check sees it.

Usage: mpiexec -n N python tests/drivers/bench_ep_broken.py MODE BENCH-FLAGS...
MODE: "lastbit" (EP group rank 1 flips the lowest bit of the first element it receives: one wrong element per
group and row) or "order" (the received blocks in reverse source order: every element from a group rank other
than the middle one is misplaced).
"""
import sys

import numpy as np

from zerompi.bench.run import main
from zerompi.comm.ep_alltoall import EPComm

mode = sys.argv[1]
right = EPComm.rows


def broken(self, send, send_rows, recv_rows, op="ep_all_to_all"):
    out = right(self, send, send_rows, recv_rows, op)
    if mode == "lastbit":
        if self.rank == 1 and out.size:
            bits = out.reshape(-1).view(np.dtype(f"u{out.itemsize}"))
            bits[0] ^= 1
        return out
    blocks = np.split(out, np.cumsum(np.asarray(recv_rows))[:-1])
    return np.concatenate(blocks[::-1])


EPComm.rows = broken
sys.exit(main(sys.argv[2:]))
