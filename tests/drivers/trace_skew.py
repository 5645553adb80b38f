"""tests/drivers/mlp_params.py with every rank's trace clock 1000 s ahead of the previous rank's.

Usage: mpiexec -n N python tests/drivers/trace_skew.py OUT.npz [train flags... --trace FILE]
"""
import runpy
import sys
import time

from mpi4py import MPI

from zerompi.engine import trace

rank = MPI.COMM_WORLD.Get_rank()
trace.CLOCK = lambda: time.perf_counter() + 1000.0 * rank
sys.argv = [sys.argv[0]] + sys.argv[1:]
runpy.run_path("tests/drivers/mlp_params.py", run_name="__main__")
