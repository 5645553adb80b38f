"""A pipelined train job's bits and bytes across nodes (tests/test_cluster_pipeline.py).

Usage: mpiexec ... python tests/drivers/cluster_pipeline.py STEPS LINK|- TRAIN-FLAGS...

The job of the train flags (--pp, ...; train/pipeline.PipelineJob): one warm-up step, then STEPS steps
between two points where nothing is in flight (every message waited for at a step's end, the engines
synchronized, a barrier), over which every rank's counters of bytes to peers on other nodes are read:
the pipeline's messages by kind (comm/p2p.py) and ZeRO's collectives (the loss sums included) -- and,
with LINK (the emulated cluster's ``eth0``), the first rank of each node reads that interface's byte
counters. Rank 0 prints one JSON line: the losses, the model's digest, the schedule's bytes per step of
each rank (PipelineJob.message_theory), and the counters per rank and per node.
"""
import json
import sys

from mpi4py import MPI

from zerompi.comm.communicator import as_communicator
from zerompi.errors import install_abort_hook
from zerompi.pipeline.digest import model_digest
from zerompi.train.config import parse_config
from zerompi.train.pipeline import PipelineJob
from zerompi.train.run import build_model

install_abort_hook()
steps, link, flags = int(sys.argv[1]), (None if sys.argv[2] == "-" else sys.argv[2]), sys.argv[3:]
cfg = parse_config(flags)
comm = as_communicator(MPI.COMM_WORLD, 120)
job = PipelineJob(cfg, comm, build_model)
mesh, pc = job.mesh, job.mesh.pp_comm


def counters():
    if link is None:
        return [0, 0]
    return [int(open(f"/sys/class/net/{link}/statistics/{k}_bytes").read()) for k in ("tx", "rx")]


def quiet():
    for e in job.engines:
        e.synchronize()
    comm.mpi.Barrier()


def sent():
    pp = {k: s.inter for k, s in pc.stats.items()}
    return pp, sum(s.inter for s in comm.stats.values())


losses = []
_, first, _ = job.step_once(0)
job.reduce_loss(first)
quiet()
pp0, zero0 = sent()
wire0 = counters()
comm.mpi.Barrier()                     # no rank sends before every node's counters were read
for step in range(1, 1 + steps):
    _, mine, _ = job.step_once(step)
    losses.append(job.reduce_loss(mine)[0])
quiet()
pp1, zero1 = sent()
wire = [b - a for a, b in zip(wire0, counters())]
node = mesh.node_of(comm.rank)
first_of_node = all(mesh.node_of(r) != node for r in range(comm.rank))
row = {"rank": comm.rank, "node": node, "stage": mesh.pp_rank,
       "pp_inter": {k: v - pp0.get(k, 0) for k, v in pp1.items()},
       "zero_inter": zero1 - zero0, "theory": job.message_theory(), "link": wire if first_of_node else None}
rows = comm.mpi.gather(row)
digest = model_digest(job.engines.engines, job.schedule, mesh)
digest = comm.mpi.bcast(digest, root=0)
if comm.rank == 0:
    print(json.dumps({"losses": losses, "digest": digest, "rows": rows}), flush=True)
job.close()
