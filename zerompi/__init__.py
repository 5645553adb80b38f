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
"""
from .config import ZeroConfig
from .engine import BucketState, StepResult, ZeroEngine
from .errors import ConfigError, UsageError
from .layout import FlatLayout

__all__ = ["ZeroConfig", "ZeroEngine", "StepResult", "BucketState", "FlatLayout", "ConfigError", "UsageError"]
__version__ = "0.1.0"
__all__ += ["estimate"]


def __getattr__(name):
    # zerompi.estimate(params=10e9, ranks=64): the module is callable. Imported lazily so that
    # `python -m zerompi.estimate` does not find its own module already imported.
    if name == "estimate":
        import importlib
        return importlib.import_module(".estimate", __name__)
    raise AttributeError(f"module 'zerompi' has no attribute {name!r}")
