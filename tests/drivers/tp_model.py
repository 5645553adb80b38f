"""One forward and backward of the tensor-parallel GPT and MLP on K ranks against the full models.

Usage: mpiexec -n K python tests/drivers/tp_model.py
Rank 0 prints one line ``RESULT {json}``: per model and dtype, the largest relative error of the
loss and of every gradient (split ones merged from every rank's piece) against the full model in
one process, whether the replicated gradients are bit-identical on every TP rank, and the TP
all-reduce calls and bytes of the pass. For the GPT on the C kernels also, run as the engine driver runs
it (model.activations, the model's workspace), with and without activation checkpointing: the activation
bytes measured beside estimate/activations.py's formula in tp, and whether checkpointing gave the same bits.
"""
import json

import numpy as np
from mpi4py import MPI

from gpt_pass import one_pass   # tests/drivers/gpt_pass.py
from zerompi.comm.mesh import Mesh
from zerompi.comm.tp_pieces import merge
from zerompi.estimate.activations import gpt_activation_bytes
from zerompi.train.models.gpt import GPT
from zerompi.train.models.mlp import MLP
from zerompi.train.models.mlp_tp import TPMLP

world = MPI.COMM_WORLD
mesh = Mesh(world, tp=world.Get_size())
tp = mesh.tp_comm
V, T, L, H, C, B = 11, 8, 2, 4, 16, 3


def compare(loss, grads, split, full_loss, full_grads):
    """Max relative errors against the full model; replicated grads identical on every TP rank."""
    every = tp.mpi.allgather(grads)
    out = {"loss": abs(loss - full_loss) / abs(full_loss), "grad": 0.0, "replicated_identical": True,
           "names": sorted(grads) == sorted(full_grads)}
    for name, ref in full_grads.items():
        if name in split:
            got = merge([e[name] for e in every], *split[name])
        else:
            got = every[0][name]
            out["replicated_identical"] &= all(np.array_equal(e[name], got) and e[name].dtype == got.dtype
                                               for e in every)
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        out["grad"] = max(out["grad"], float(np.abs(got - ref).max() / np.abs(ref).max()))
    return out



rng = np.random.default_rng(5)
idx = rng.integers(0, V, (B, T))
tgt = rng.integers(0, V, (B, T))
results = {}
for dtype in (np.float64, np.float32):
    full = GPT(V, T, L, H, C, seed=3, dtype=dtype, kernels="numpy")
    part = GPT(V, T, L, H, C, seed=3, dtype=dtype, tp=tp)
    cast = lambda layers: [(n, {k: a.astype(dtype) for k, a in p.items()}) for n, p in layers]
    full_loss, full_grads = full.loss_and_grads(cast(full.init_layers()), idx, tgt)
    before = tp.bytes_sent(), tp.stats["tp_all_reduce"].calls
    loss, grads = part.loss_and_grads(cast(part.init_layers()), idx, tgt)
    r = compare(loss, grads, part.tp_split(), full_loss, full_grads)
    r["bytes"], r["calls"] = tp.bytes_sent() - before[0], tp.stats["tp_all_reduce"].calls - before[1]
    r["formula_bytes"] = part.tp_bytes_per_micro_batch(B, np.dtype(dtype).itemsize)
    r["kernels"] = part.layers.name
    results[f"gpt-{np.dtype(dtype).name}"] = r
    runs = {}
    for ckpt in (False, True):
        model = GPT(V, T, L, H, C, seed=3, dtype=dtype, tp=tp, checkpoint_activations=ckpt)
        before = tp.stats["tp_all_reduce"].calls
        loss, grads = one_pass(model, cast(model.init_layers()), idx, tgt)
        runs[ckpt] = (loss, grads)
        r[f"activations{'-ckpt' if ckpt else ''}"] = [model.activation_bytes, gpt_activation_bytes(
            B, T, C, L, H, V, ckpt, np.dtype(dtype).itemsize, tp=tp.size)["total"]]
        r[f"calls{'-ckpt' if ckpt else ''}"] = tp.stats["tp_all_reduce"].calls - before
    r["checkpoint_same_bits"] = runs[False][0] == runs[True][0] and all(
        np.array_equal(runs[False][1][n], runs[True][1][n]) for n in runs[False][1])
    r["driven_same_bits"] = runs[False][0] == loss and all(np.array_equal(runs[False][1][n], grads[n]) for n in grads)

# The MLP (float32 compute only): forward and backward through every layer, MSE loss.
W, D, R = 16, 4, 6
full, part = MLP(W, D, seed=2), TPMLP(W, D, seed=2, tp=tp)
x = rng.standard_normal((R, W)).astype(np.float32)
y = rng.standard_normal((R, W)).astype(np.float32)


def run(model):
    layers = [p for _, p in model.init_layers()]
    h, caches, grads = x, [], {}
    for i, p in enumerate(layers):
        h, c = model.forward_layer(i, p, h)
        caches.append(c)
    loss, dy = model.loss(h, y)
    for i in reversed(range(len(layers))):
        dy, g = model.backward_layer(i, layers[i], caches[i], dy)
        grads.update(g)
    return loss, grads


before = tp.bytes_sent(), tp.stats["tp_all_reduce"].calls
loss, grads = run(part)
r = compare(loss, grads, part.tp_split(), *run(full))
r["bytes"], r["calls"] = tp.bytes_sent() - before[0], tp.stats["tp_all_reduce"].calls - before[1]
r["formula_bytes"] = part.tp_bytes_per_micro_batch(R)
results["mlp-float32"] = r
if world.Get_rank() == 0:
    print("RESULT " + json.dumps(results), flush=True)
