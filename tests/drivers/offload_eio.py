"""The train CLI with rank R's optimizer file failing from its Kth transfer on: ``offload_eio.py R K HOW
[flags...]``; HOW: "eio" (every read and write of the file fails with EIO, as on a dying disk) or
"truncate" (the file is cut to nothing there, as by a disk that lost it)."""
import errno
import os
import sys

from mpi4py import MPI

from zerompi.engine.offload import files

rank, after, how, flags = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
if MPI.COMM_WORLD.Get_rank() == rank:
    transfer, calls = files.OffloadFile._transfer, [0]

    def eio(fd, views, offset):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    def failing(self, fd, view, at, end, offset, io, what, record):
        calls[0] += 1
        if calls[0] >= after and "optimizer" in self.path:
            if how == "eio":
                io = eio
            elif calls[0] == after:
                os.truncate(self.path, 0)
        return transfer(self, fd, view, at, end, offset, io, what, record)
    files.OffloadFile._transfer = failing
from zerompi.train import run   # noqa: E402  (the patch is in place before any engine exists)
sys.exit(run.main(flags))
