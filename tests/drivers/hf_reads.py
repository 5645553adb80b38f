"""A train CLI job that counts the safetensors elements each rank reads for --init-from (tests/test_hf_import.py):
OUT FLAGS...; each rank writes the count to OUT.RANK at the end."""
import sys

from mpi4py import MPI

from zerompi.checkpoint import safetensors_files
from zerompi.train import run

read = [0]
real = safetensors_files.MappedTensor.read


def counted(self, lo, hi):
    read[0] += hi - lo
    return real(self, lo, hi)


safetensors_files.MappedTensor.read = counted
status = run.main(sys.argv[2:])
with open(f"{sys.argv[1]}.{MPI.COMM_WORLD.Get_rank()}", "w") as f:
    f.write(str(read[0]))
sys.exit(status)
