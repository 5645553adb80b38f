"""Offloaded optimizer state and parameters against no offload: ``python offload.py DIR '[cases]'``.

Each case (a dict of ZeroConfig kwargs, plus "staged": true to run through the staged
Communicator with host transfers, whose "device" arrays make every copy down and up happen,
and "lr_schedule": true to pass step() a learning rate that changes every other step) trains
the MLP a few steps; rank 0 prints one JSON line per case: whether the final fp32 parameters
equal those of the same config without offload bit for bit (every rank), the memory by place,
the offload files left behind after close(), and how many steps' updates ran in the backward
and were kept or taken back (engine/in_backward.py)."""
import json
import os
import sys

import numpy as np
from mpi4py import MPI

from zerompi import MeshConfig, ZeroConfig, ZeroEngine
from zerompi.comm.meshconfig import FIELDS as MESH_FIELDS
from zerompi.comm.communicator import Communicator
from zerompi.comm.staging import HostTransfers, StagedCommunicator
from zerompi.train.models.mlp import MLP, TeacherData, train_losses

directory, cases = sys.argv[1], json.loads(sys.argv[2])
world = MPI.COMM_WORLD


def run(kw, staged, schedule, steps=6):
    model, data = MLP(24, 3, 0), TeacherData(24, 3, 0)
    comm = Communicator(world)
    comm = StagedCommunicator(comm, HostTransfers()) if staged else comm
    mesh = MeshConfig(**{k: kw.pop(k) for k in MESH_FIELDS if k in kw})
    engine = ZeroEngine(model.init_layers(), ZeroConfig(**kw), comm, mesh_config=mesh)
    for step in range(steps):
        train_losses(engine, model, data, step, 12 * world.Get_size(), engine.config.micro_batches)
        engine.step(lr=1e-3 * (1 + step // 2) if schedule else None)
    params = np.concatenate([v.reshape(-1) for v in engine.full_parameters().values()])
    places = engine.ledger.by_place()
    early = {"kept": engine.in_backward.early_steps, "taken_back": engine.in_backward.taken_back}
    engine.close()
    return params, places, early


for case in cases:
    case = dict(case)
    staged, schedule = case.pop("staged", False), case.pop("lr_schedule", False)
    base = {k: v for k, v in case.items() if not k.startswith("offload")}
    want, _, _ = run(base, False, schedule)
    got, places, early = run(dict(case, offload_dir=directory if "nvme" in case.values() else None), staged, schedule)
    differ = world.allreduce(int(not np.array_equal(want.view(np.uint32), got.view(np.uint32))))
    left = os.listdir(directory)
    if world.Get_rank() == 0:
        print(json.dumps({"case": case, "staged": staged, "lr_schedule": schedule, "ranks_differing": differ,
                          "places": places, "files_left": left, "in_backward": early}), flush=True)
