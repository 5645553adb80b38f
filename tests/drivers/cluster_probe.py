"""Where each rank of a job runs, as MPI sees it, and one all-reduce across the nodes.

Usage: mpiexec ... python tests/drivers/cluster_probe.py MEGABYTES

Rank 0 prints a JSON line per rank (gathered: the launcher may interleave the ranks' output):
its rank, host name, MPI's processor name, the world ranks of its shared-memory node
(MPI_COMM_TYPE_SHARED) and the all-reduce's result check.
"""
import json
import socket
import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
members = node.allgather(comm.rank)
data = np.full(int(float(sys.argv[1]) * 2 ** 20) // 4, comm.rank + 1, np.float32)
comm.Allreduce(MPI.IN_PLACE, data)
expected = comm.size * (comm.size + 1) / 2
rows = comm.gather({"rank": comm.rank, "host": socket.gethostname(), "processor": MPI.Get_processor_name(),
                    "node": members, "sum_ok": bool(np.all(data == expected))})
for row in rows or []:
    print(json.dumps(row), flush=True)
