"""A CLI run whose files may hold at most ``LIMIT`` bytes (RLIMIT_FSIZE, set after MPI has started:
MPI's own shared-memory files need more), so writing a larger output fails as on a full disk
(EFBIG). Usage: small_disk.py LIMIT MODULE [flags...]; MODULE: zerompi.train or zerompi.bench."""
import importlib
import resource
import sys

from mpi4py import MPI

assert MPI.Is_initialized()            # MPI starts before the limit
limit, module, flags = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
sys.exit(importlib.import_module(f"{module}.run").main(flags))
