"""A train run whose rank R finds the disk full from its K-th shard write on: that write's thread
sets RLIMIT_FSIZE to LIMIT bytes (the process's files may then grow no further: EFBIG, as on a
full disk). Usage: fail_write.py R K LIMIT [train flags...]."""
import resource
import sys

from mpi4py import MPI

from zerompi.checkpoint import writer
from zerompi.train import run

rank, k, limit, flags = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
real_write, writes = writer.PendingSave._write, []


def _write(self, rows):
    writes.append(1)
    if MPI.COMM_WORLD.Get_rank() == rank and len(writes) == k:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return real_write(self, rows)


writer.PendingSave._write = _write
sys.exit(run.main(flags))
