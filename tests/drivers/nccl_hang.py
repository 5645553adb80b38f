"""Creating the NCCL communicator waits for every rank: here rank 1 never arrives (its NCCL
set-up hangs), and rank 0's watchdog must end the job, naming what it waited in."""
import sys
import time
import types

from mpi4py import MPI

from zerompi.comm import nccl, staging
from zerompi.comm.communicator import Communicator


class HangingNccl:
    def __init__(self, host):
        if host.rank == 1:
            while True:            # a set-up that never returns on this rank
                time.sleep(3600)
        with host.waiting("nccl: set-up"):
            host.mpi.barrier()     # NCCL's init waits for every rank


nccl.NcclCommunicator = HangingNccl
fake_cupy = types.SimpleNamespace(__name__="cupy")
staging.device_communicator(Communicator(MPI.COMM_WORLD), fake_cupy, "nccl", timeout_s=float(sys.argv[1]))
print("created", flush=True)
