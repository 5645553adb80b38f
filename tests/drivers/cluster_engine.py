"""Train the MLP under several configurations; report the bits, and the bytes across nodes two ways.

Usage: mpiexec ... python tests/drivers/cluster_engine.py OUT_PREFIX STEPS '[{ZeroConfig kwargs}, ...]' [LINK|- [WIDTH]]

For each config (rank 0 prints a JSON line; the final fp32 parameters go to OUT_PREFIX<i>.npz):
one warm-up step, then STEPS steps between two points where nothing is in flight
(``synchronize`` and a barrier), over which every rank's engine counters (bytes to peers on
other nodes: ``level_bytes()["inter"]``) are summed per node, and -- with LINK, the name of the
node's network interface (the emulated cluster's ``eth0``) -- the first rank of each node reads
that interface's byte counters (/sys/class/net/LINK/statistics). Nothing else of this driver
moves between the two points but the steps' own small all-gathers (the norm and the step's
contract) and two barriers: they and the transport's framing are the overhead.
"""
import json
import sys

import numpy as np
from mpi4py import MPI

from zerompi import MeshConfig, ZeroConfig, ZeroEngine
from zerompi.comm.meshconfig import FIELDS as MESH_FIELDS
from zerompi.comm.communicator import Communicator
from zerompi.train.models.mlp import MLP, TeacherData, train_losses

prefix, steps, configs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
link = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else None
WIDTH, DEPTH, BATCH = int(sys.argv[5]) if len(sys.argv) > 5 else 48, 4, 24
comm = Communicator(MPI.COMM_WORLD)
model, data = MLP(WIDTH, DEPTH, 0), TeacherData(WIDTH, DEPTH, 0)


def counters():
    if link is None:
        return [0, 0]
    return [int(open(f"/sys/class/net/{link}/statistics/{k}_bytes").read()) for k in ("tx", "rx")]


def quiet(engine):
    engine.synchronize()
    comm.mpi.Barrier()


for i, kwargs in enumerate(configs):
    mesh = MeshConfig(**{k: kwargs.pop(k) for k in MESH_FIELDS if k in kwargs})
    engine = ZeroEngine(model.init_layers(), ZeroConfig(**kwargs), comm, mesh_config=mesh)
    node = engine.rank // engine.topology.node_size      # the engine's ranks are node by node
    first_of_node = engine.rank % engine.topology.node_size == 0
    train_losses(engine, model, data, 0, BATCH, engine.config.micro_batches)
    engine.step()
    quiet(engine)
    sent0, link0 = comm.level_bytes()["inter"], counters()
    comm.mpi.Barrier()          # no rank sends before every node's counters were read
    for step in range(1, 1 + steps):
        train_losses(engine, model, data, step, BATCH, engine.config.micro_batches)
        engine.step()
    quiet(engine)
    sent, wire = comm.level_bytes()["inter"] - sent0, [b - a for a, b in zip(link0, counters())]
    rows = comm.mpi.gather((engine.rank, node, sent, wire if first_of_node else None))
    params = engine.full_parameters()
    if comm.rank == 0:
        nodes = engine.topology.nodes
        engine_tx = [sum(s for _, n, s, _ in rows if n == k) for k in range(nodes)]
        link_tx = [next(w for _, n, _, w in rows if n == k and w is not None)[0] for k in range(nodes)]
        link_rx = [next(w for _, n, _, w in rows if n == k and w is not None)[1] for k in range(nodes)]
        np.savez(f"{prefix}{i}.npz", **params)
        print(json.dumps({"config": kwargs, "topology": engine.topology.describe(), "engine_tx": engine_tx,
                          "link_tx": link_tx, "link_rx": link_rx, "formula_inter": engine.comm_theory_bytes_by_level()[
                              "inter"], "hierarchical": bool(engine.group.hierarchical)}), flush=True)
    engine.close()
