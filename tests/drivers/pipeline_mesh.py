"""zerompi.Mesh with pipeline stages, on every rank: each mesh's coordinates, groups and point-to-point
messages, and an engine per pipeline stage over a Mesh without TP. Rank 0 prints one JSON line
``MESH [...]`` (every rank's rows) for tests/test_pipeline_mesh.py to judge against its own arithmetic."""
import json
import sys

import numpy as np
from mpi4py import MPI

import zerompi
from zerompi.comm.mesh import check_mesh

world = MPI.COMM_WORLD
rank, n = world.Get_rank(), world.Get_size()
specs = json.loads(sys.argv[1])          # [[tp, sp, pp], ...] for this world size
rows = []
for tp, sp, pp in specs:
    m = zerompi.Mesh(tp=tp, sp=sp, pp=pp)
    # What each communicator holds, as world ranks in its own rank order.
    members = {name: getattr(m, name + "_mpi").allgather(rank) for name in ("tp", "sp", "zero", "pp", "stage")}
    # Point-to-point: every stage sends its world rank (as 3 float32 values) to the next stage.
    got = None
    if pp > 1:
        pc = m.pp_comm
        nxt, prv = m.pp_rank + 1, m.pp_rank - 1
        recv = np.zeros(3, np.float32)
        msgs = []
        if prv >= 0:
            msgs.append(pc.irecv(recv, prv, 7, "activation"))
        if nxt < pp:
            msgs.append(pc.isend(np.full(3, rank, np.float32), nxt, 7, "activation"))
        pc.poll()
        for msg in msgs:
            pc.wait(msg)
        got = recv.tolist() if prv >= 0 else None
        sent = pc.stats["activation"].bytes if "activation" in pc.stats else 0
    else:
        sent = 0
    rows.append({"tp": tp, "sp": sp, "pp": pp, "rank": rank, "coords": [m.tp_rank, m.sp_rank, m.dp_rank, m.pp_rank],
                 "dp": m.dp, "ranks": m.ranks, "pp_ranks": m.pp_ranks, "members": members, "got": got, "sent": sent,
                 "zero_comm": m.zero_comm.size, "zero_ranks": m.zero_ranks, "describe": m.describe()})
    if pp > 1 and tp == 1:
        # An engine per stage, each stage with its own layers (names and shapes differ between stages):
        # ZeRO over the stage's data- (x sequence-) parallel group, with no tensor-parallel split to give.
        width = 4 + m.pp_rank
        layers = [(f"stage{m.pp_rank}", {f"w{m.pp_rank}": np.full((width,), 0.5, np.float32)})]
        eng = zerompi.ZeroEngine(layers, zerompi.ZeroConfig(stage=3, dtype="fp32", lr=0.1), comm=m)
        with eng.unsharded(0):
            pass
        eng.grads_ready(0, {f"w{m.pp_rank}": np.full((width,), float(m.dp_rank + 1), np.float32)})
        pending = eng.begin_step()
        result = eng.finish_step(pending)
        rows[-1]["engine"] = {"world": eng.world_size, "norm": result.grad_norm,
                              "value": eng.full_parameters()[f"w{m.pp_rank}"].tolist()}
        eng.close()
errors = []
for args in ((n, 1, 4), (n, 2, n), (n, 1, 1, 3), (n, 1, 2, 3), (n, 1, 2, None, 3), (n, 1, 2, 4), (n, 1, 2, 2),
             (n, 1, 3, None, 4), (n, 1, 0)):
    try:
        check_mesh(*args)
        errors.append(None)
    except zerompi.ConfigError as e:
        errors.append(str(e))
try:                                    # an engine of a pipelined config needs the mesh that says so
    zerompi.ZeroEngine([("a", {"w": np.ones(4, np.float32)})], zerompi.ZeroConfig(pp=2), comm=world)
    errors.append(None)
except zerompi.UsageError as e:
    errors.append(str(e))
m = zerompi.Mesh(pp=2) if n % 2 == 0 else None
if m is not None:                       # the step's halves: each once, in order
    eng = zerompi.ZeroEngine([("a", {"w": np.ones(4, np.float32)})], zerompi.ZeroConfig(stage=1, dtype="fp16"), comm=m)
    eng.grads_ready(0, {"w": np.ones(4, np.float32)})
    pending = eng.begin_step()
    for call in (lambda: eng.begin_step(), lambda: eng.finish_step(None)):
        try:
            call()
            errors.append(None)
        except zerompi.UsageError as e:
            errors.append(str(e))
    errors.append(eng.finish_step(pending, (0.0, 1.0)).skipped)     # totals given: a non-finite count skips (fp16)
    eng.close()
everyone = world.gather(rows)
if rank == 0:
    print("MESH " + json.dumps({"rows": everyone, "errors": errors}), flush=True)
