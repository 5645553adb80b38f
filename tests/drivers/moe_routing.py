"""Train the MoE GPT with the router forced: ``one`` sends every token to expert 0 (top-1 of a one-hot),
``per-rank`` to expert (world rank mod E) -- each rank routes differently (no-hang checks; ``per-dp-rank``: the
data-parallel rank, world rank // --tp, so the TP ranks of one group agree); ``cycle`` token i of a micro-batch
to expert i mod E, or with --top-k k to experts k·i .. k·i + k - 1 mod E (exactly balanced: the all-to-all's
bytes are its formula's). Rank 0 prints the metrics (with --simulate-world, the one process does).

Usage: mpiexec -n N python tests/drivers/moe_routing.py MODE '["--stage", "3", ...]'
"""
import json
import sys

import numpy as np
from mpi4py import MPI

from zerompi.errors import install_abort_hook
from zerompi.train.config import parse_config
from zerompi.train.moe import mlp as moe
from zerompi.train.run import train

install_abort_hook()
mode, flags = sys.argv[1], json.loads(sys.argv[2])
rank = route = MPI.COMM_WORLD.Get_rank()
if mode == "per-dp-rank":
    mode, route = "per-rank", rank // (int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1)
real = moe.softmax


def forced(xp, logits):
    p = real(xp, logits)
    out = np.full_like(p, 1e-3)
    if mode == "cycle":
        for j in range(top_k):                     # distinct weights: the top-k order is the slot order
            out[np.arange(len(p)), (top_k * np.arange(len(p)) + j) % p.shape[1]] = 1.0 - 0.1 * j
    else:
        out[:, 0 if mode == "one" else route % logits.shape[1]] = 1.0
    return out / out.sum(axis=1, keepdims=True) + 0 * p


cfg = parse_config(flags)
top_k = cfg.moe.top_k
moe.softmax = forced
metrics = train(cfg)
if rank == 0:
    print("METRICS " + json.dumps(metrics), flush=True)
