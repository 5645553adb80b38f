"""ZeRO-Offload's delayed parameter update against its float64 reference: ``python delayed.py STAGE [WARMUP]``.

Least squares, each rank its own rows: every step a rank takes its gradient at the parameters
the engine shows it, hands it back, and steps. With the delayed update, step k's gradient is
taken at the parameters before update k - 1 (one step stale); the reference does exactly that
in float64. Rank 0 prints the largest difference, and the same for the plain (not delayed)
run and its own reference, so the test can see the two algorithms differ. With WARMUP, the
delayed run's first WARMUP updates are not delayed (offload_delayed_warmup), and so in its
reference; it is also compared with the delayed reference without a warm-up."""
import json
import sys

import numpy as np
from mpi4py import MPI

from zerompi import ZeroConfig, ZeroEngine

stage, steps, lr = int(sys.argv[1]), 25, 0.05
warmup = int(sys.argv[2]) if len(sys.argv) > 2 else 0
world = MPI.COMM_WORLD
rank, n = world.Get_rank(), world.Get_size()
rng = np.random.default_rng(0)
a_all, b_all = rng.standard_normal((60, 16)), rng.standard_normal(60)
rows = slice(rank * 60 // n, (rank + 1) * 60 // n)
a, b = a_all[rows], b_all[rows]


def grad(x, a, b):
    return (2.0 / 60) * a.T @ (a @ x - b)      # this rank's part of the gradient of the mean squared error


def reference(delayed: bool, warmup: int = 0) -> np.ndarray:
    """float64 AdamW (the engine's betas, eps, no weight decay) on the mean of the ranks' gradients;
    ``delayed``: after the first ``warmup`` updates."""
    x = np.zeros(16)
    shown = x.copy()            # what the model sees
    m = v = np.zeros(16)
    for t in range(1, steps + 1):
        g = sum(grad(shown, a_all[r * 60 // n:(r + 1) * 60 // n], b_all[r * 60 // n:(r + 1) * 60 // n])
                for r in range(n))    # the engine averages the handed-back n * part: the sum of the parts
        late = delayed and t > warmup
        if late:
            shown = x.copy()    # step t publishes update t - 1, then runs update t behind the next step
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        x = x - lr * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
        if not late:
            shown = x.copy()
    return x


def engine_run(delayed: bool, warmup: int = 0) -> np.ndarray:
    cfg = ZeroConfig(stage=stage, dtype="fp32", lr=lr, offload_optimizer="cpu", offload_delayed_update=delayed,
                     offload_delayed_warmup=warmup)
    eng = ZeroEngine([("lin", {"x": np.zeros(16, np.float32)})], cfg)
    for _ in range(steps):
        with eng.unsharded(0) as p:
            x = p["x"].astype(np.float64)
        eng.grads_ready(0, {"x": (n * grad(x, a, b)).astype(np.float32)})
        eng.step()
    out = eng.full_parameters()["x"].astype(np.float64)
    eng.close()
    return out


result = {}
for delayed in (True, False):
    got = engine_run(delayed)
    result["delayed" if delayed else "plain"] = {
        "vs_own_reference": float(np.max(np.abs(got - reference(delayed)))),
        "vs_other_reference": float(np.max(np.abs(got - reference(not delayed)))),
    }
if warmup:
    got = engine_run(True, warmup)
    result["warmup"] = {"vs_own_reference": float(np.max(np.abs(got - reference(True, warmup)))),
                        "vs_plain_reference": float(np.max(np.abs(got - reference(False)))),
                        "vs_delayed_reference": float(np.max(np.abs(got - reference(True))))}
if rank == 0:
    print(json.dumps(result))
