"""The library on the GPU's path: ``ZeroEngine(layers, config, comm, xp=cupy)`` given a host communicator (the
default COMM_WORLD) or a ``zerompi.Mesh``, with tests/fake_cupy.py's ``cupy`` standing in for CuPy; then the same
engine on NumPy. Rank 0 prints one JSON line per case: whether every rank's final fp32 master is the same bits on
both, whether training moved it, and the bytes the engine's own staging copied down.

Usage: mpiexec -n 4 python tests/drivers/gpu_library.py
"""
import json

import numpy as np
from mpi4py import MPI

from tests import fake_cupy
from zerompi import Mesh, ZeroConfig, ZeroEngine
from zerompi.errors import install_abort_hook
from zerompi.optim import impl
from zerompi.train.models.mlp import MLP, TeacherData, train_losses
from zerompi.train.models.mlp_tp import TPMLP

install_abort_hook()
transfers = fake_cupy.install()
WIDTH, DEPTH, BATCH = 32, 4, 16


def run(xp, stage: int, tp: int, steps: int = 3) -> np.ndarray:
    mesh = Mesh(tp=tp) if tp > 1 else None
    model = TPMLP(WIDTH, DEPTH, 3, mesh.tp_comm) if mesh else MLP(WIDTH, DEPTH, 3)
    config = ZeroConfig(stage=stage, dtype="fp16", micro_batches=2, bucket_mb=0.004, optimizer_impl="numpy")
    engine = ZeroEngine(model.init_layers(), config, mesh, xp=xp, tp_split=model.tp_split() if mesh else None)
    for step in range(steps):
        train_losses(engine, model, TeacherData(WIDTH, DEPTH, 3), step, BATCH, config.micro_batches)
        engine.step()
    master = impl.to_host(engine.unpadded_master())
    engine.close()
    return master


for stage in range(4):
    for tp in (1, 2):
        before = transfers.to_host_bytes
        device, host, initial = run(fake_cupy.cupy, stage, tp), run(np, stage, tp), run(np, stage, tp, steps=0)
        differ = MPI.COMM_WORLD.allreduce(int(not np.array_equal(device.view(np.uint32), host.view(np.uint32))))
        if MPI.COMM_WORLD.Get_rank() == 0:
            print("CASE " + json.dumps({"stage": stage, "tp": tp, "ranks_differing": differ,
                                        "trained": bool(np.any(host != initial)),
                                        "staged_bytes": transfers.to_host_bytes - before}), flush=True)
