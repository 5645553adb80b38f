"""Train on the GPU's path with tests/fake_cupy.py's ``cupy`` standing in for CuPy, then on the host's array
path, then on the host's default path (the GPT's C kernels); rank 0 prints one JSON line per run, ``path``
"gpu", "cpu" or "c".

The "gpu" runs are --device gpu as the job takes it: a Placement whose array module is the stand-in, so every
engine buffer and the model's arrays are device arrays that refuse an implicit transfer or a host array mixed
in; the engine's collectives staged through host buffers (comm/staging.py, with the stand-in's Transfers); the
model's array layers (gpt_numpy.py, the path CuPy takes) and the optimizer's reference on the device arrays
(the CUDA kernels' bits: tests/test_kernels.py). The "cpu" runs are the same flags on NumPy with the GPT's array
layers (not the C kernels), so the two must give the same bits: NumPy computes both. The "c" runs are what a
CPU run computes, within float32's rounding of the others (docs/kernels.md).

Usage: mpiexec -n N python tests/drivers/gpu_path.py '[["--stage", "0", ...], ...]'    ({path} in a flag: the path)
"""
import json
import sys

from mpi4py import MPI

from tests import fake_cupy
from zerompi.comm.device import Placement
from zerompi.errors import install_abort_hook
from zerompi.train import run
from zerompi.train.config import parse_config
from zerompi.train.models import gpt

install_abort_hook()
transfers = fake_cupy.install()
c_kernels = gpt.fused_layers
gpu = Placement("gpu", fake_cupy.cupy, 0, 1, gpu=0, gpu_count=1, name="stand-in")

for path in ("gpu", "cpu", "c"):
    gpt.fused_layers = c_kernels if path == "c" else (lambda *a, **k: None)   # the array layers, or the C kernels
    for flags in json.loads(sys.argv[1]):
        given = [f.replace("{path}", path) for f in flags]      # a folder of each path's own: {path}
        cfg = parse_config(given + ["--optimizer-impl", "numpy"] + (["--device", "gpu"] if path == "gpu" else []))
        before = dict(vars(transfers))
        metrics = run.train(cfg, placement=gpu if path == "gpu" else None)
        staged = {k: v - before[k] for k, v in vars(transfers).items()}     # this run's copies down and up
        if MPI.COMM_WORLD.Get_rank() == 0:
            print("METRICS " + json.dumps({"path": path, "flags": flags, "staged": staged, **metrics}, default=str),
                  flush=True)
