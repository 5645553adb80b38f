"""The public collectives used on their own, as someone's code would (tests/test_collective_checks.py):
CASE. A rank that fails outside any engine must not leave the others waiting; ranks that pass
different buffers must all stop with one MismatchError naming the ranks and values."""
import sys
import time

import numpy as np
from mpi4py import MPI

import zerompi

case = sys.argv[1]
rank = MPI.COMM_WORLD.Get_rank()
x = np.ones(8, np.float32)

if case == "bare_raise":            # a bare Communicator: rank 1 raises between two all-reduces
    comm = zerompi.Communicator()
    comm.all_reduce(x)
    if rank == 1:
        raise RuntimeError("collectives: rank 1 raises outside any engine")
    comm.all_reduce(x)
elif case == "mesh_hang":           # a Mesh: rank 1 never joins the TP all-reduce (ZEROMPI_TIMEOUT_S is short)
    mesh = zerompi.Mesh(tp=2)
    mesh.tp_comm.all_reduce(x)
    if rank == 1:
        time.sleep(3600)
    mesh.tp_comm.all_reduce(x)
print(f"collectives: rank {rank} finished {case}", flush=True)
