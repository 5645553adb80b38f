"""Train the MLP through the public API and save the final fp32 parameters and losses (rank 0).

Usage: mpiexec -n N python tests/drivers/mlp_params.py OUT.npz [train flags...]
"""
import sys

import numpy as np

from zerompi import ZeroEngine
from zerompi.comm.communicator import Communicator
from zerompi.errors import install_abort_hook
from zerompi.train.models.mlp import train_losses
from zerompi.train.config import parse_config
from zerompi.train.run import build_model

install_abort_hook()
out_path, flags = sys.argv[1], sys.argv[2:]
cfg = parse_config(["--model", "mlp"] + flags)
comm = Communicator()
model, data = build_model(cfg)
engine = ZeroEngine(model.init_layers(), cfg.zero, comm)
losses, skipped = [], []
for step in range(cfg.steps):
    local = train_losses(engine, model, data, step, cfg.batch, cfg.zero.micro_batches)
    skipped.append(engine.step().skipped)
    losses.append(comm.sum_scalars([np.mean(local)])[0] / comm.size)
params = engine.full_parameters()
if comm.rank == 0:
    np.savez(out_path, losses=np.array(losses), skipped=np.array(skipped), **params)
engine.close()
