"""Offloaded optimizer state and parameters against no offload: ``python offload.py DIR '[cases]'``.

Each case (a dict of ZeroConfig kwargs, plus "staged": true to run through the staged
Communicator with host transfers, whose "device" arrays make every copy down and up happen)
trains the MLP a few steps; rank 0 prints one JSON line per case: whether the final fp32
parameters equal those of the same config without offload bit for bit (every rank), the
memory by place, and the offload files left behind after close()."""
import json
import os
import sys

import numpy as np
from mpi4py import MPI

from zerompi import ZeroConfig, ZeroEngine
from zerompi.comm.communicator import Communicator
from zerompi.comm.staging import HostTransfers, StagedCommunicator
from zerompi.train.models.mlp import MLP, TeacherData, train_losses

directory, cases = sys.argv[1], json.loads(sys.argv[2])
world = MPI.COMM_WORLD


def run(kw, staged, steps=4):
    model, data = MLP(24, 3, 0), TeacherData(24, 3, 0)
    comm = Communicator(world)
    comm = StagedCommunicator(comm, HostTransfers()) if staged else comm
    engine = ZeroEngine(model.init_layers(), ZeroConfig(**kw), comm)
    for step in range(steps):
        train_losses(engine, model, data, step, 12 * world.Get_size(), engine.config.micro_batches)
        engine.step()
    params = np.concatenate([v.reshape(-1) for v in engine.full_parameters().values()])
    places = engine.ledger.by_place()
    engine.close()
    return params, places


for case in cases:
    case = dict(case)
    staged = case.pop("staged", False)
    base = {k: v for k, v in case.items() if not k.startswith("offload")}
    want, _ = run(base, False)
    got, places = run(dict(case, offload_dir=directory if "nvme" in case.values() else None), staged)
    differ = world.allreduce(int(not np.array_equal(want.view(np.uint32), got.view(np.uint32))))
    left = os.listdir(directory)
    if world.Get_rank() == 0:
        print(json.dumps({"case": case, "staged": staged, "ranks_differing": differ, "places": places,
                          "files_left": left}), flush=True)
