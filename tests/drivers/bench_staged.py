"""zerompi.bench's --device gpu path on the CPU: the zerompi rows run the staged
Communicator with host transfers on copies of the buffers made by a stand-in array module,
with --check; prints the records as JSON on rank 0."""
import json
import sys
import types

import numpy as np
from mpi4py import MPI

from zerompi.bench import run as bench
from zerompi.optim import impl
from zerompi.comm.communicator import Communicator
from zerompi.errors import install_abort_hook
from zerompi.comm.staging import HostTransfers, StagedCommunicator

install_abort_hook()
impl.use_impl("auto", verbose=False)
cfg = bench.parse_config(sys.argv[1:] + ["--check", "--no-overlap", "--iters", "2", "--warmup", "1"])
comm = Communicator(MPI.COMM_WORLD)
staged = StagedCommunicator(comm, HostTransfers())
# a "device" module: its arrays are separate copies, read back with asnumpy
fake_xp = types.SimpleNamespace(asarray=lambda a: np.array(a, copy=True), asnumpy=lambda a: np.array(a, copy=True))
records = bench.run_bench(cfg, comm, staged, fake_xp)
if comm.rank == 0:
    print(json.dumps({"records": records, "staged": staged.staged}))
