"""One forward and backward of the tensor-parallel MoE GPT on K ranks against the full model in one process.

Usage: mpiexec -n K python tests/drivers/moe_tp_model.py [S]   (S: shared experts per MoE block, default 0)
Rank 0 prints one line ``RESULT {json}``: per dtype, the largest relative error of the loss and of every gradient
(split ones merged from every rank's piece) against the unsplit model, whether the replicated gradients (the
router's and the experts' among them) are bit-identical on every TP rank, the TP all-reduce calls and bytes
beside the model's formula, and whether activation checkpointing gave the same bits and routing counts.
"""
import json
import sys

import numpy as np
from mpi4py import MPI

from gpt_pass import one_pass   # tests/drivers/gpt_pass.py
from zerompi.comm.mesh import Mesh
from zerompi.comm.tp_pieces import merge
from zerompi.train.models.gpt import GPT
from zerompi.train.moe.mlp import MoESpec

world = MPI.COMM_WORLD
tp = Mesh(world, tp=world.Get_size()).tp_comm
V, T, L, H, C, B = 11, 8, 4, 4, 16, 3
SHARED = int(sys.argv[1]) if len(sys.argv) > 1 else 0
SPEC = MoESpec(4, 2, 24, every=2, shared=SHARED)        # blocks 1 and 3 MoE, 0 and 2 dense


def compare(loss, grads, split, full_loss, full_grads):
    every = tp.mpi.allgather(grads)
    out = {"loss": abs(loss - full_loss) / abs(full_loss), "grad": 0.0, "replicated_identical": True,
           "names": sorted(grads) == sorted(full_grads), "experts_replicated": 0}
    for name, ref in full_grads.items():
        if name in split:
            got = merge([e[name] for e in every], *split[name])
        else:
            got = every[0][name]
            out["replicated_identical"] &= all(np.array_equal(e[name], got) for e in every)
            out["experts_replicated"] += ".experts." in name or ".router." in name or ".shared." in name
        out["grad"] = max(out["grad"], float(np.abs(got - ref).max() / np.abs(ref).max()))
    return out


rng = np.random.default_rng(5)
idx = rng.integers(0, V, (B, T))
tgt = rng.integers(0, V, (B, T))
results = {}
for dtype in (np.float64, np.float32):
    cast = lambda layers: [(n, {k: a.astype(dtype) for k, a in p.items()}) for n, p in layers]   # noqa: E731
    full = GPT(V, T, L, H, C, seed=3, dtype=dtype, kernels="numpy", moe=SPEC)
    full_loss, full_grads = full.loss_and_grads(cast(full.init_layers()), idx, tgt)
    runs = {}
    for ckpt in (False, True):
        part = GPT(V, T, L, H, C, seed=3, dtype=dtype, tp=tp, moe=SPEC, checkpoint_activations=ckpt)
        before = tp.bytes_sent(), tp.stats["tp_all_reduce"].calls
        loss, grads = one_pass(part, cast(part.init_layers()), idx, tgt)
        r = compare(loss, grads, part.tp_split(), full_loss, full_grads)
        r["bytes"], r["calls"] = tp.bytes_sent() - before[0], tp.stats["tp_all_reduce"].calls - before[1]
        r["formula_bytes"] = part.tp_bytes_per_micro_batch(B, np.dtype(dtype).itemsize)
        r["tokens"] = {str(b): v.tolist() for b, v in part.moe_blocks.mlp.stats.take()[0].items()}
        runs[ckpt] = (loss, grads, r)
    r = runs[False][2]
    r["ckpt"] = {k: runs[True][2][k] for k in ("calls", "bytes", "formula_bytes")}
    r["checkpoint_same_bits"] = runs[False][0] == runs[True][0] and all(
        np.array_equal(runs[False][1][n], runs[True][1][n]) for n in runs[False][1])
    r["checkpoint_same_tokens"] = runs[True][2]["tokens"] == r["tokens"]
    full_tokens = {str(b): v.tolist() for b, v in full.moe_blocks.mlp.stats.take()[0].items()}
    r["same_tokens_as_full"] = r["tokens"] == full_tokens
    results[np.dtype(dtype).name] = r
if world.Get_rank() == 0:
    print("RESULT " + json.dumps(results), flush=True)
