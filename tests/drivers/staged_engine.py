"""The engine on the staged Communicator (host transfers) against the engine on the host
one: stages 0-3, fp16 and fp32, two micro-batches; prints one JSON line per case on rank 0
with how many ranks' final fp32 masters differ, whether training moved them, and the bytes
that were staged."""
import json
import sys

import numpy as np
from mpi4py import MPI

from zerompi import ZeroEngine
from zerompi.comm.communicator import Communicator
from zerompi.errors import install_abort_hook
from zerompi.train.models.mlp import train_losses
from zerompi.comm.staging import HostTransfers, StagedCommunicator
from zerompi.train.config import parse_config
from zerompi.train.run import build_model

install_abort_hook()


def run(cfg, comm, steps=3) -> np.ndarray:
    model, data = build_model(cfg)
    engine = ZeroEngine(model.init_layers(), cfg.zero, comm)
    for step in range(steps):
        train_losses(engine, model, data, step, cfg.batch, cfg.zero.micro_batches)
        engine.step()
    master = engine.unpadded_master().copy()
    engine.close()
    return master


for dtype in ("fp16", "fp32"):
    for stage in range(4):
        cfg = parse_config(["--model", "mlp", "--stage", str(stage), "--dtype", dtype, "--width", "24",
                            "--depth", "3", "--batch", "24", "--micro-batches", "2", "--bucket-mb", "0.001"])
        initial = run(cfg, Communicator(MPI.COMM_WORLD), steps=0)
        plain = run(cfg, Communicator(MPI.COMM_WORLD))
        staged_comm = StagedCommunicator(Communicator(MPI.COMM_WORLD), HostTransfers())
        staged = run(cfg, staged_comm)
        same = int(MPI.COMM_WORLD.allreduce(int(not np.array_equal(plain.view(np.uint32), staged.view(np.uint32)))))
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(json.dumps({"dtype": dtype, "stage": stage, "ranks_differing": same,
                              "trained": bool(np.any(plain != initial)),
                              "staged_bytes": staged_comm.staged["to_host_bytes"]}))
sys.exit(0)
