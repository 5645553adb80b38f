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
elif case == "rs_length":          # the case: reduce-scatter of 8 elements on rank 0, 16 on rank 1
    comm = zerompi.Communicator()
    send = np.ones(8 * (1 + rank), np.float32)
    comm.reduce_scatter(send, np.empty(send.size // comm.size, np.float32))
elif case == "ar_dtype":           # fp32 on rank 0, fp16 on rank 1
    comm = zerompi.Communicator()
    comm.all_reduce(np.ones(8, np.float16 if rank == 1 else np.float32))
elif case == "op":                 # rank 0 all-gathers, rank 1 starts a reduce-scatter of the same buffer
    comm = zerompi.Communicator()
    h = comm.iall_gather(x) if rank == 0 else comm.ireduce_scatter(x, np.empty(4, np.float32))
    h.wait()
elif case == "scalars":            # sum_scalars of 2 numbers on rank 0, 3 on rank 1
    zerompi.Communicator().sum_scalars([1.0] * (2 + rank))
elif case == "quant":              # qgZ with int8 on rank 0, int4 on rank 1
    from zerompi.comm.quantized import quantization
    comm = zerompi.Communicator()
    comm.reduce_scatter(np.ones(128, np.float32), np.empty(64, np.float32), quant=quantization(
        "int4" if rank == 1 else "int8", 64))
elif case == "tp_length":          # the case: Mesh.tp_comm.all_reduce of 8 and 16 elements
    mesh = zerompi.Mesh(tp=2)
    mesh.tp_comm.all_reduce(np.ones(8 * (1 + rank), np.float32))
elif case == "two_level":          # 4 ranks in two nodes of 2: the group's reduce-scatter, 32 elements on rank 3
    from zerompi.comm.topology import Topology, build
    group = build(zerompi.Communicator(), Topology(4, 2, 4)).group
    send = np.ones(32 if rank == 3 else 16, np.float32)
    group.reduce_scatter(send, np.empty(send.size // 4, np.float32))
elif case == "mesh_hang":           # a Mesh: rank 1 never joins the TP all-reduce (ZEROMPI_TIMEOUT_S is short)
    mesh = zerompi.Mesh(tp=2)
    mesh.tp_comm.all_reduce(x)
    if rank == 1:
        time.sleep(3600)
    mesh.tp_comm.all_reduce(x)
print(f"collectives: rank {rank} finished {case}", flush=True)
