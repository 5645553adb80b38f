"""NcclCommunicator's logic on the CPU: its NCCL calls replaced by the host Communicator on
NumPy arrays (events always done). Prints one JSON line per case on rank 0: elements outside
the float64 oracle's tolerance, and (fp32, where NCCL's sum and the MPI path's agree) bits
that differ from the host Communicator's result."""
import json
import sys

import numpy as np
from mpi4py import MPI

from tests.test_comm import rank_input, within
from zerompi.optim import impl
from zerompi.comm.communicator import Communicator
from zerompi.errors import install_abort_hook
from zerompi.layout import FlatLayout
from zerompi.comm.nccl import NcclCommunicator

install_abort_hook()
impl.use_impl("auto", verbose=False)


class Done:
    done = True

    def synchronize(self):
        pass


class HostNccl:
    """What NCCL does, by the host Communicator: sums in the storage dtype."""
    xp = np

    def __init__(self, host):
        self.host = host
        self.calls = []

    def reduce_scatter(self, send, recv):
        self.calls.append("reduce_scatter")
        self.host.reduce_scatter(send.copy(), recv)

    def all_gather(self, buf, k, rank):
        self.calls.append("all_gather")
        assert buf.size == k * self.host.size
        self.host.all_gather(buf)

    def all_reduce(self, buf):
        self.calls.append("all_reduce")
        self.host.all_reduce(buf)

    def record(self):
        return Done()


host = Communicator(MPI.COMM_WORLD)
backend = HostNccl(Communicator(MPI.COMM_WORLD))
nc = NcclCommunicator(host, backend)
n, me = host.size, host.rank
out_lines = []


def report(case, wrong, bits=0):
    tot = host.mpi.allreduce(np.array([wrong, bits]))
    out_lines.append({"case": case, "wrong": int(tot[0]), "bits_differ": int(tot[1])})


for dname, dtype in (("fp16", np.float16), ("fp32", np.float32)):
    for length in (1, 37, 4099):
        bucket = FlatLayout([("l", [("p", (length,))])], n, bucket_numel=length, align=4).buckets[0]
        k, lo, hi = bucket.slice_numel, *bucket.slice_bounds(me)
        bufs = []
        for r in range(n):
            b = np.zeros(bucket.numel, dtype)
            b[:bucket.used] = rank_input(r, bucket.used, dtype, 5)
            bufs.append(b)
        x64 = np.array(bufs, np.float64)
        want, mag = x64.sum(0)[lo:hi], np.abs(x64).sum(0)[lo:hi]
        mine = bufs[me]
        for scale, acc in ((1.0, False), (0.5, False), (0.25, True)):
            prior = np.full(k, 0.75, dtype)
            got = prior.copy()
            h = nc.ireduce_scatter(mine.copy(), got, scale, acc)
            assert h.test()
            h.wait()
            ref = prior.copy()
            host.reduce_scatter(mine.copy(), ref, scale, acc)
            oracle = want * scale + (prior.astype(np.float64) if acc else 0.0)
            bound = mag * scale + (np.abs(prior.astype(np.float64)) if acc else 0.0)
            bits = int(np.count_nonzero(got.view(np.uint8) != ref.view(np.uint8))) if dtype == np.float32 else 0
            report(f"{dname} L={length} reduce_scatter scale={scale} accumulate={acc}",
                   within(got, oracle, bound, n + 2), bits)
        g = np.full(bucket.numel, np.nan, dtype)
        g[lo:hi] = mine[lo:hi]
        nc.all_gather(g)
        full = np.concatenate([bufs[r][r * k:(r + 1) * k] for r in range(n)])
        report(f"{dname} L={length} all_gather", int(np.count_nonzero(g.view(np.uint8) != full.view(np.uint8))))
        a = mine.copy()
        nc.all_reduce(a, 1.0 / n)
        report(f"{dname} L={length} all_reduce", within(a, x64.sum(0) / n, np.abs(x64).sum(0) / n, n + 2))

# A loss-scaled fp16 gradient of 40000 on every rank: summed in fp16 it is inf from two ranks on.
big = np.full(2 * n, 40000, np.float16)
big_out = np.zeros(2, np.float16)
nc.reduce_scatter(big, big_out, 1.0 / n)
out_lines.append({"loss_scaled": big_out.astype(float).tolist()})

if me == 0:
    for line in out_lines:
        print(json.dumps(line))
    print(json.dumps({"stats": host.snapshot(), "calls": sorted(set(backend.calls))}))
sys.exit(0)
