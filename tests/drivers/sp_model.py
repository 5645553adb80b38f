"""One forward and backward of the sequence-parallel GPT on N ranks against the full model in one process.

Usage: mpiexec -n N python tests/drivers/sp_model.py TP
The N ranks form a Mesh of tp=TP x sp=N/TP (no data parallelism). Rank 0 prints ``RESULT {json}``: per
case (kernels, dtype, checkpointing) the largest relative error of the loss (the SP ranks' mean) and of
every gradient (the SP ranks' gradients summed, / K, split ones merged over the TP ranks) against the full
model, the all-to-all calls and bytes of the pass beside the formula, and (C kernels) the activation
bytes the workspace measured beside estimate/activations.py's formula.
"""
import json
import sys

import numpy as np
from mpi4py import MPI

from gpt_pass import one_pass   # tests/drivers/gpt_pass.py
from zerompi.comm.mesh import Mesh
from zerompi.comm.tp_pieces import merge
from zerompi.estimate.activations import gpt_activation_bytes
from zerompi.train.models.gpt import GPT
from zerompi.estimate.sp_bytes import all_to_all_bytes

world = MPI.COMM_WORLD
TP = int(sys.argv[1])
mesh = Mesh(world, tp=TP, sp=world.Get_size() // TP)
sp, K = mesh.sp_comm, mesh.sp
V, T, L, H, C, B = 11, 8, 2, 4, 16, 3



rng = np.random.default_rng(5)
rows = rng.integers(0, V, (B, T + 1))
results = {}
for kernels, dtype, ckpt in (("c", np.float64, False), ("c", np.float32, False), ("c", np.float32, True),
                             ("numpy", np.float64, False), ("numpy", np.float32, False), ("numpy", np.float32, True)):
    cast = lambda layers: [(n, {k: a.astype(dtype) for k, a in p.items()}) for n, p in layers]
    full = GPT(V, T, L, H, C, seed=3, dtype=dtype, kernels=kernels)
    full_loss, full_grads = full.loss_and_grads(cast(full.init_layers()), rows[:, :-1], rows[:, 1:])
    part = GPT(V, T, L, H, C, seed=3, dtype=dtype, kernels=kernels, checkpoint_activations=ckpt, sp=sp,
               tp=mesh.tp_comm)
    split = part.tp_split() if TP > 1 else {}
    before = sp.bytes_sent(), sp.calls()
    loss, grads = one_pass(part, cast(part.init_layers()), *part.local_sequence(rows))
    sent, calls = sp.bytes_sent() - before[0], sp.calls() - before[1]
    loss = float(sp.sum_scalars([loss])[0]) / K
    out = {"loss": abs(loss - full_loss) / abs(full_loss), "grad": 0.0, "names": sorted(grads) == sorted(full_grads)}
    for name in sorted(full_grads):
        total = np.empty_like(grads[name])
        sp.mpi.Allreduce(grads[name], total, op=MPI.SUM)    # the SP ranks' shares of the gradient
        total /= K
        got = merge(mesh.tp_mpi.allgather(total), *split[name]) if name in split else total
        ref = full_grads[name]
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        out["grad"] = max(out["grad"], float(np.abs(got - ref).max() / np.abs(ref).max()))
    isz = np.dtype(dtype).itemsize
    out.update(bytes=sent, calls=calls, formula_bytes=all_to_all_bytes(L, B, T // K, C // TP, K, isz, ckpt),
               formula_calls=L * (6 if ckpt else 4))
    if kernels == "c":
        out["activation_bytes"] = part.activation_bytes
        out["activation_formula"] = gpt_activation_bytes(B, T, C, L, H, V, ckpt, isz, sp=K, tp=TP)["total"]
    results[f"{kernels}-{np.dtype(dtype).name}{'-ckpt' if ckpt else ''}"] = out
if world.Get_rank() == 0:
    print("RESULT " + json.dumps(results), flush=True)
