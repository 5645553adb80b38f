"""Rank 1 raises in the middle of stage-3 training; the whole job must end with its traceback."""
from zerompi import ZeroEngine
from zerompi.comm.communicator import Communicator
from zerompi.errors import install_abort_hook
from zerompi.train.loop import local_rows, run_micro_batch
from zerompi.train.config import parse_config
from zerompi.train.run import build_model

install_abort_hook()
cfg = parse_config(["--model", "mlp", "--stage", "3", "--width", "32", "--depth", "3", "--batch", "12"])
comm = Communicator()
model, data = build_model(cfg)
engine = ZeroEngine(model.init_layers(), cfg.zero, comm)
for step in range(1000):
    x, y = data.global_batch(step, cfg.batch)
    rows = local_rows(cfg.batch, comm.rank, comm.size)
    if step == 2 and comm.rank == 1:
        raise RuntimeError("injected failure on rank 1")
    run_micro_batch(engine, model, x[rows], y[rows])
    engine.step()
