"""One rank's memory and traffic, real and simulated, over the same cases (tests/test_simulated.py).

``mpiexec -n 4 python simulated.py``: a real 4-rank job; rank 0 prints one JSON line, every rank's
report per case. ``python simulated.py R``: one process as rank R of 4 (comm/simulated_world.py), the same
cases; it prints one JSON line, its report per case. A report is what the engine measured: model
states and peak buffers (ledger + receive scratch), calls and bytes of every collective (by level,
and unquantized), and the tensor-parallel all-reduce bytes. Overlap is off, so the buffers a real
run holds do not depend on its timing.
"""
import json
import sys

import numpy as np

from zerompi import Mesh, MeshConfig, ZeroConfig, ZeroEngine
from zerompi.comm.meshconfig import FIELDS as MESH_FIELDS
from zerompi.train import loop
from zerompi.train.models.mlp import MLP
from zerompi.train.models.mlp_tp import TPMLP

N = 4
WIDTH, DEPTH, ROWS = 64, 4, 8
CASES = {
    "stage0": dict(stage=0),
    "stage3": dict(stage=3),
    "stage2-nodes": dict(stage=2, node_size=2),
    "stage1-groups-qgz-micro": dict(stage=1, node_size=2, shard_size=2, quantize_grads="int8", micro_batches=2),
    "stage3-hpz-qwz": dict(stage=3, node_size=2, hpz=True, quantize_weights="int8"),
    "stage2-offload": dict(stage=2, offload_optimizer="cpu"),
    "tp2-stage2": dict(stage=2, tp=2),
}


def run(world, kw: dict) -> dict:
    kw = dict(kw)
    sizes = MeshConfig(**{k: kw.pop(k) for k in MESH_FIELDS if k in kw})
    tp = sizes.tp
    cfg = ZeroConfig(**{"dtype": "fp16", "bucket_mb": 0.01, "overlap": False, "timeout_s": 60, **kw})
    mesh = Mesh(world, tp=tp) if tp > 1 else None
    model = TPMLP(WIDTH, DEPTH, seed=1, tp=mesh.tp_comm) if mesh else MLP(WIDTH, DEPTH, seed=1)
    eng = ZeroEngine(model.lazy_layers(), cfg, mesh or world, tp_split=model.tp_split() if mesh else None,
                     mesh_config=sizes)
    rng = np.random.default_rng([eng.rank, 3])
    for _ in range(2):
        x = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
        for xm, ym in loop.micro_batches(x, np.tanh(x), cfg.micro_batches):
            loop.run_micro_batch(eng, model, xm, ym)
        eng.step()
    report = eng.memory_report()
    out = {"states": report["measured"], "peak_buffers": report["peak_buffers"]["bytes"],
           "comm": {op: [s.calls, s.bytes, s.intra, s.inter, s.logical] for op, s in sorted(eng.comm.stats.items())},
           "tp": mesh.tp_comm.bytes_sent() if mesh else 0}
    eng.close()
    return out


def main(run=run, cases=CASES, n: int = N):
    """Rank R of n simulated (``sys.argv[1]``: R) or the real job: ``run(world, case)`` for every case."""
    if len(sys.argv) > 1:
        from zerompi import SimulatedWorld
        rank = int(sys.argv[1])
        print(json.dumps({name: run(SimulatedWorld(n, rank), kw) for name, kw in cases.items()}))
        return
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    out = {name: world.gather(run(world, kw), root=0) for name, kw in cases.items()}
    if world.Get_rank() == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
