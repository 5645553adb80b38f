"""Rank R leaves (sys.exit(0), as a rank that printed --help used to) before the start-up agreement;
the others must end in about TIMEOUT seconds, naming it. Usage: leave_early.py R TIMEOUT."""
import sys

from mpi4py import MPI

from zerompi.errors import agree_on_start, install_abort_hook

install_abort_hook()
leaver, timeout_s = int(sys.argv[1]), float(sys.argv[2])
if MPI.COMM_WORLD.Get_rank() == leaver:
    sys.exit(0)
sys.exit(agree_on_start(MPI.COMM_WORLD, None, "leave_early", timeout_s=timeout_s) or 0)
