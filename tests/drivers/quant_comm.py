"""Quantized collectives against the oracles: ``python quant_comm.py NODE_SIZE``.

The group (flat with NODE_SIZE = N, else two-level) reduce-scatters quantized (qgZ) and
all-gathers quantized (qwZ). The oracle is the algorithm written out in NumPy with the
reference kernels (optim/reference.py): every level quantizes what it sends per destination
block and sums the dequantized rows in fp32 in rank order, so the result must be equal bit
for bit; the float64 sum of the inputs must also lie within the quantization steps. Rank 0
prints one JSON line per case: elements not equal to the oracle, elements outside the
float64 bound, and the bytes counted beside the wire and logical formulas."""
import json
import sys

import numpy as np
from mpi4py import MPI

from tests.test_comm import rank_input
from zerompi.comm.communicator import Communicator
from zerompi.comm.quantized import QuantizedGather, Quantization
from zerompi.comm.topology import Topology, build
from zerompi.errors import install_abort_hook
from zerompi.optim import impl
from zerompi.optim import reference as R

install_abort_hook()
impl.use_impl("auto", verbose=False)
world = Communicator(MPI.COMM_WORLD)
n, me = world.size, world.rank
topo = Topology(n, int(sys.argv[1]), n)
group = build(world, topo).group if topo.nodes > 1 else world
K, M = topo.node_size, topo.nodes
lines = []


def rs_level(rows, q, scale, dtype):
    """One level: each row quantized, dequantized and summed in fp32 in row order, cast."""
    out = np.zeros(rows[0].size, dtype)
    parts = [R.quantize_reference(r, q.bits, q.block) for r in rows]
    R.dequant_sum_reference([a for a, _ in parts], [s for _, s in parts], rows[0].size, q.bits, q.block,
                            out, scale, False)
    return out


def oracle_rs(bufs, k, q, dtype, rank):
    """The slice ``rank`` ends with: node level over super-slices, then across nodes over slices."""
    j, local = rank // K, rank % K
    span = M * k
    mine = slice(local * span, (local + 1) * span)   # this rank's super-slice of every row
    partial = {jj: rs_level([bufs[jj * K + ll][mine] for ll in range(K)], q, 0.5, dtype)
               for jj in range(M)}
    if M == 1:
        return partial[0]
    return rs_level([partial[jj][j * k:(j + 1) * k] for jj in range(M)], q, 1.0, dtype)


def step_bound(bufs, k, q, dtype, rank):
    """How far the result may be from the float64 sum: half a quantization step of every row at
    each level (the node's partial sums bounded by the sum of the magnitudes), and the roundings."""
    j, local = rank // K, rank % K
    span = M * k
    mine = slice(local * span, (local + 1) * span)
    x = np.abs(np.array(bufs, np.float64)) * 0.5
    def half_steps(rows):   # per element: sum over rows of half its block's step
        out = np.zeros(rows[0].size)
        for r in rows:
            b = np.abs(r).reshape(-1)
            pad = np.zeros(-(-b.size // q.block) * q.block)
            pad[:b.size] = b
            out += np.repeat(pad.reshape(-1, q.block).max(1), q.block)[:b.size] / R.QMAX[q.bits] / 2
        return out
    level1 = [half_steps([x[jj * K + ll][mine] for ll in range(K)])[j * k:(j + 1) * k]
              for jj in range(M)]
    sums = [x[jj * K:(jj + 1) * K, mine].sum(0) for jj in range(M)]
    level2 = half_steps([s[j * k:(j + 1) * k] + 1e-30 for s in sums]) * 1.01 if M > 1 else 0
    unit = 2.0 ** -10 if dtype == np.float16 else 2.0 ** -20
    rounding = x[:, (local * M + j) * k:(local * M + j + 1) * k].sum(0) * unit * 4
    return sum(level1) * 1.01 + level2 + rounding

for dname, dtype in (("fp16", np.float16), ("fp32", np.float32)):
    for bits, block in ((8, 256), (4, 8), (8, 8)):
        q = Quantization(bits, block)
        for k in (16, 48, 528):
            bufs = [rank_input(r, n * k, dtype, 3) for r in range(n)]
            slot = group.slot
            lo, hi = slot * k, (slot + 1) * k
            out = np.zeros(k, dtype)
            before = world.stats["reduce_scatter"].as_dict()
            group.reduce_scatter(bufs[me].copy(), out, 0.5, quant=q)
            after = world.stats["reduce_scatter"].as_dict()
            want = oracle_rs(bufs, k, q, dtype, me)
            wrong = int(np.count_nonzero(out.view(np.uint8) != want.view(np.uint8)))
            exact = (np.array(bufs, np.float64).sum(0) * 0.5)[lo:hi]
            step = step_bound(bufs, k, q, dtype, me)
            outside = int(np.count_nonzero(~(np.abs(out.astype(np.float64) - exact) <= step)))
            wire = {"intra": (K - 1) * q.wire_bytes(M * k), "inter": (M - 1) * q.wire_bytes(k)}
            itemsize = np.dtype(dtype).itemsize
            lines.append({"case": f"{dname} int{bits}/{block} k={k} rs", "wrong": world.mpi.allreduce(wrong),
                          "outside": world.mpi.allreduce(outside),
                          "bytes": [after["intra"] - before["intra"], after["inter"] - before["inter"]],
                          "formula": [wire["intra"], wire["inter"]],
                          "logical": after["logical"] - before["logical"],
                          "logical_formula": ((K - 1) * M * k + (M - 1) * k) * itemsize})
            g = np.full(n * k, np.nan, dtype)
            g[lo:hi] = bufs[me][lo:hi]
            QuantizedGather(group, q).all_gather(g)
            want_g = np.empty(n * k, np.float32)
            for r in range(n):
                s = world.mpi.bcast(group.slot if r == me else None, root=r)
                part = bufs[r][s * k:(s + 1) * k]
                want_g[s * k:(s + 1) * k] = R.dequantize_reference(*R.quantize_reference(part, bits, block),
                                                                   k, bits, block)
            wrong_g = int(np.count_nonzero(g.view(np.uint8) != want_g.astype(dtype).view(np.uint8)))
            lines.append({"case": f"{dname} int{bits}/{block} k={k} ag", "wrong": world.mpi.allreduce(wrong_g)})
if me == 0:
    for line in lines:
        print(json.dumps(line))
