"""Run several training configurations in one MPI job (saves launches); rank 0 prints one JSON line each.

Usage: mpiexec -n N python tests/drivers/train_many.py '[["--stage", "0", ...], ...]'
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
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("METRICS " + json.dumps({"flags": flags, **metrics}), flush=True)
