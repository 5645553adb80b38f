"""zerompi: ZeRO stages 0-3 on MPI with flat NumPy (or CuPy) buffers, no framework.

    import zerompi
    engine = zerompi.ZeroEngine(layers, zerompi.ZeroConfig(stage=3, dtype="fp32"))
    for i in range(n_layers):                        # forward
        with engine.unsharded(i) as p: ...
    for i in reversed(range(n_layers)):              # backward
        with engine.unsharded(i) as p: ...
        engine.grads_ready(i, grads)                 # gradients of this rank's loss x loss_scale
    result = engine.step()                           # StepResult(skipped, grad_norm, loss_scale, ...)
    params = engine.full_parameters()                # {name: fp32 array}, a collective

Memory is in bytes per rank, sizes in elements. See README.md for the CLI and the tables.

The package, by layer (each may import only those above it; train, bench and plot not from
each other; docs/architecture.md):

Modules:
- errors: the errors a user can act on; one failing rank ends the job
- flags: command-line flags made from the configs' fields
- strict: the configs' fields' one typing rule
- inputs: opening and reading a file the user names (a schedule, a run's metrics, the data), checked
- layout: FlatLayout, the flat buffer, its buckets and slices
- optim/: AdamW and the local sum: NumPy references, fused C and CUDA kernels
- comm/: collectives: Communicator, device staging, NCCL, the Mesh, the simulated world, watchdog
- checkpoint/: sharded save / load / reshard; ``python -m zerompi.checkpoint``
- engine/: ZeroEngine and its parts: reducer, gatherer, buffers, optimizer state, offload, config
- pipeline/: schedules as data (no MPI) and the executor: an engine per pipeline chunk
- estimate/: memory and traffic before launch; ``python -m zerompi.estimate``
- train/: the training job; ``python -m zerompi.train``
- bench/: the collectives benchmark; ``python -m zerompi.bench``
- plot/: figures of a run's metrics; ``python -m zerompi.plot``
- data/: training data made offline, a text tokenized; ``python -m zerompi.data``
- run/: the supervisor: a job that carries on after a lost rank or node; ``python -m zerompi.run``

The names below are loaded on first use, so that ``import zerompi`` (and the offline tools,
estimate and checkpoint) work where mpi4py cannot be imported.
"""
import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "ZeroEngine": "zerompi.engine.zero_engine",
    "StepResult": "zerompi.engine.step",
    "ZeroConfig": "zerompi.engine.config",
    "FlatLayout": "zerompi.layout",
    "BucketState": "zerompi.engine.gatherer",
    "Communicator": "zerompi.comm.communicator",
    "Mesh": "zerompi.comm.mesh",
    "MeshConfig": "zerompi.comm.meshconfig",
    "SimulatedWorld": "zerompi.comm.simulated_world",
    "ConfigError": "zerompi.errors",
    "UsageError": "zerompi.errors",
    "JobError": "zerompi.errors",
    "MismatchError": "zerompi.errors",
    "NonFiniteError": "zerompi.errors",
}
__all__ = sorted(_PUBLIC) + ["estimate", "lazy"]


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    if name == "estimate":     # zerompi.estimate(params=10e9, ranks=64): the package is callable
        return importlib.import_module("zerompi.estimate")
    if name == "lazy":         # zerompi.lazy.Normal(...): parameters given as rules (engine/lazy.py)
        return importlib.import_module("zerompi.engine.lazy")
    raise AttributeError(f"module 'zerompi' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
