"""Two-level collectives against the float64 oracle: ``python hier_comm.py NODE_SIZE``.

Every rank of the world is one shard group. Rank 0 prints one JSON line per case: elements
outside the oracle's rounding bound (reduce-scatter, all-reduce) or not bit-equal
(all-gather), and the bytes each level moved against the formula."""
import json
import sys

import numpy as np
from mpi4py import MPI

from tests.test_comm import rank_input, within
from zerompi.comm.communicator import Communicator
from zerompi.comm.topology import Topology, build
from zerompi.errors import install_abort_hook
from zerompi.optim import impl

install_abort_hook()
impl.use_impl("auto", verbose=False)
world = Communicator(MPI.COMM_WORLD)
n, me = world.size, world.rank
topo = Topology(n, int(sys.argv[1]), n)
group = build(world, topo).group
K, M = topo.node_size, topo.nodes
lines = []


def report(case, wrong, **extra):
    lines.append(dict(case=case, wrong=int(world.mpi.allreduce(wrong)), **extra))


for dname, dtype in (("fp16", np.float16), ("fp32", np.float32)):
    for k in (1, 16, 333):
        numel = n * k
        bufs = [rank_input(r, numel, dtype, 3) for r in range(n)]
        x64 = np.array(bufs, np.float64)
        slot = group.slot
        lo, hi = slot * k, (slot + 1) * k
        for scale, acc in ((1.0, False), (0.25, True)):
            prior = np.full(k, 0.5, dtype)
            out = prior.copy()
            before = {op: (s.intra, s.inter) for op, s in world.stats.items()}
            group.reduce_scatter(bufs[me].copy(), out, scale, acc)
            st = world.stats["reduce_scatter"]
            intra = st.intra - before.get("reduce_scatter", (0, 0))[0]
            inter = st.inter - before.get("reduce_scatter", (0, 0))[1]
            isz = np.dtype(dtype).itemsize
            want = (x64.sum(0) * scale)[lo:hi] + (0.5 if acc else 0.0)
            bound = (np.abs(x64).sum(0) * scale)[lo:hi] + (0.5 if acc else 0.0)
            report(f"{dname} k={k} rs scale={scale} acc={acc}", within(out, want, bound, n + 2),
                   intra=intra, inter=inter, intra_formula=(K - 1) * M * k * isz, inter_formula=(M - 1) * k * isz)
        g = np.full(numel, np.nan, dtype)
        g[lo:hi] = bufs[me][lo:hi]
        full = np.empty(numel, dtype)
        for r in range(n):        # slot s of the result comes from the rank holding slot s
            s = world.mpi.bcast(group.slot if r == me else None, root=r)
            full[s * k:(s + 1) * k] = bufs[r][s * k:(s + 1) * k]
        group.all_gather(g)
        report(f"{dname} k={k} ag", int(np.count_nonzero(g.view(np.uint8) != full.view(np.uint8))))
        a = bufs[me].copy()
        group.all_reduce(a, 1.0 / n)
        report(f"{dname} k={k} ar", within(a, x64.sum(0) / n, np.abs(x64).sum(0) / n, n + 2))
if me == 0:
    for line in lines:
        print(json.dumps(line))
