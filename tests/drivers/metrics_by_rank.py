"""Run training configurations in one MPI job; rank 0 prints one JSON line each with every rank's per-rank metrics
(``replicas``: the bytes its shared-memory folder held; ``moe``: its engines' model states;
``comm_bytes_per_step_by_op``: its own ZeRO collectives' bytes of a steady step), gathered as ``by_rank``.

Usage: mpiexec -n N python tests/drivers/metrics_by_rank.py '[["--replicas", "JOB", ...], ...]'
"""
import json
import sys

from mpi4py import MPI

from zerompi.errors import install_abort_hook
from zerompi.train.config import parse_config
from zerompi.train.run import train

install_abort_hook()
for flags in json.loads(sys.argv[1]):
    metrics = train(parse_config(flags))
    every = MPI.COMM_WORLD.gather({k: metrics.get(k) for k in ("replicas", "moe", "comm_bytes_per_step_by_op")}, root=0)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("METRICS " + json.dumps({"flags": flags, **metrics, "by_rank": every}), flush=True)
