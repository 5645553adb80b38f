"""The expert reduce-scatter of several sources started and left in flight: ``python sources_overlap.py``.

Each rank starts three buckets' reduce-scatters of K = 3 sources' partials (comm/sources_reduce.py's
ireduce_scatter_sources) in turn: rank r only once rank r - 1 has started its own and handed it a token, none
waited before all have started. A start that blocked until every peer had joined would hang here (rank r + 1
starts only after rank r's start has returned). The handles are then waited in reverse order and every bucket's sum
compared bit for bit with the blocking form's, and with a float64 oracle's rounding. Rank 0 prints one JSON line.
"""
import json

import numpy as np
from mpi4py import MPI

from zerompi.comm.communicator import Communicator
from zerompi.comm.sources_reduce import ireduce_scatter_sources, reduce_scatter_sources
from zerompi.errors import install_abort_hook
from zerompi.optim import impl

install_abort_hook()
impl.use_impl("auto", verbose=False)
world = Communicator(MPI.COMM_WORLD)
n, me = world.size, world.rank
S, sizes = 3, (1, 17, 250)
rng = np.random.default_rng(7)
inputs = [[rng.standard_normal((S, n * k)).astype(np.float16) for k in sizes] for _ in range(n)]   # every rank's
scale = 1.0 / (n * S)
outs = [np.full(k, 0.5, np.float16) for k in sizes]
token = np.zeros(1, np.int64)
if me > 0:                       # rank r starts only once rank r - 1 has started (and returned)
    world.mpi.Recv(token, source=me - 1)
handles = [ireduce_scatter_sources(world, inputs[me][b].copy(), outs[b], scale, True, S, (b, 1))
           for b in range(len(sizes))]
if me < n - 1:
    world.mpi.Send(token + 1, dest=me + 1)
for h in reversed(handles):
    h.wait()
wrong = oracle_far = 0
for b, k in enumerate(sizes):
    want = np.full(k, 0.5, np.float16)
    reduce_scatter_sources(world, inputs[me][b].copy(), want, scale, True, S)
    wrong += int((outs[b].view(np.uint16) != want.view(np.uint16)).sum())
    x64 = sum(inputs[r][b][s, me * k:(me + 1) * k].astype(np.float64) for r in range(n) for s in range(S))
    exact = 0.5 + scale * x64
    oracle_far += int((np.abs(outs[b] - exact) > 1e-2 * (1 + np.abs(exact))).sum())
wrong, oracle_far = world.mpi.allreduce(wrong), world.mpi.allreduce(oracle_far)
if me == 0:
    print(json.dumps({"wrong": wrong, "oracle_far": oracle_far, "ranks": n}))
