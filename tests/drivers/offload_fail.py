"""Rank 1's optimizer file is cut to nothing after step 2 (a disk that lost it): the next step's
read must stop every rank with one line naming the file and the step. Eight buckets: more than
the buffer sets that read the first buckets' rows ahead before the cut."""
import sys

from mpi4py import MPI

from zerompi import ZeroConfig, ZeroEngine
from zerompi.train.models.mlp import MLP, TeacherData, train_losses

directory = sys.argv[1]
model, data = MLP(24, 8, 0), TeacherData(24, 8, 0)
engine = ZeroEngine(model.init_layers(), ZeroConfig(stage=2, dtype="fp32", bucket_mb=0.001, offload_optimizer="nvme",
                                                    offload_dir=directory, timeout_s=20))
for step in range(5):
    if step == 2 and MPI.COMM_WORLD.Get_rank() == 1:
        with open(engine.optimizer.rows.file.path, "r+b") as f:
            f.truncate(0)
    train_losses(engine, model, data, step, 12 * MPI.COMM_WORLD.Get_size(), 1)
    engine.step()
print("finished", flush=True)
