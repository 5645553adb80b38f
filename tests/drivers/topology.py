"""Train the MLP under topologies and report what the tests compare (rank 0, a JSON line per run).

Usage: mpiexec -n N python tests/drivers/topology.py OUT_PREFIX STEPS WIDTH DEPTH BATCH '[{ZeroConfig kwargs}, ...]'
       [LOAD_DIR|-] [SAVE_DIR]

For each config: the losses, the bytes sent in the last step inside and across nodes (the
most any rank sent, from the engine's Communicator counters) beside the formula, whether
every step after the first sent the same, and the memory ledger beside the formula; the
final fp32 parameters go to OUT_PREFIX<i>.npz. With LOAD_DIR each run starts from that
checkpoint; with SAVE_DIR the last run saves there.
"""
import json
import sys

import numpy as np
from mpi4py import MPI

from zerompi import MeshConfig, ZeroConfig, ZeroEngine
from zerompi.comm.meshconfig import FIELDS as MESH_FIELDS
from zerompi.comm.communicator import Communicator
from zerompi.train.models.mlp import MLP, TeacherData, train_losses

prefix, steps, width, depth, batch = sys.argv[1], *map(int, sys.argv[2:6])
configs = json.loads(sys.argv[6])
load_dir = sys.argv[7] if len(sys.argv) > 7 and sys.argv[7] != "-" else None
save_dir = sys.argv[8] if len(sys.argv) > 8 else None
comm = Communicator(MPI.COMM_WORLD)
model, data = MLP(width, depth, 0), TeacherData(width, depth, 0)

for i, kwargs in enumerate(configs):
    mesh = MeshConfig(**{k: kwargs.pop(k) for k in MESH_FIELDS if k in kwargs})
    engine = ZeroEngine(model.init_layers(), ZeroConfig(**kwargs), comm, mesh_config=mesh)
    start = engine.load(load_dir).manifest["step"] if load_dir else 0
    losses, levels = [], []
    for step in range(start, start + steps):
        before = comm.level_bytes()
        local = train_losses(engine, model, data, step, batch, engine.config.micro_batches)
        engine.step()
        after = comm.level_bytes()
        levels.append([after["intra"] - before["intra"], after["inter"] - before["inter"]])
        losses.append(float(comm.sum_scalars([np.mean(local)])[0] / comm.size))
    # The last step: a collective started at the end of one step (stage 3's prefetch for the
    # next forward) may finish its second level in the next, so the first step can differ.
    last = np.array(levels[-1] if levels else [0, 0], dtype=np.int64)
    comm.mpi.Allreduce(MPI.IN_PLACE, last, op=MPI.MAX)
    steady = comm.mpi.allreduce(int(all(s == levels[-1] for s in levels[1:])), op=MPI.MIN)
    mem = engine.memory_report()
    params = engine.full_parameters()
    if save_dir and i == len(configs) - 1:
        engine.save(save_dir)
    if comm.rank == 0:
        np.savez(f"{prefix}{i}.npz", **params)
        print(json.dumps({
            "config": kwargs, "losses": losses,
            "bytes_by_level": {"intra": int(last[0]), "inter": int(last[1])}, "steady": bool(steady),
            "formula_by_level": engine.comm_theory_bytes_by_level(),
            "memory": mem["measured"], "memory_formula": mem["theory_padded"],
            "topology": engine.topology.describe(), "hierarchical": bool(engine.group.hierarchical),
            "secondary": engine.gatherer.secondary is not None,
        }), flush=True)
    engine.close()
