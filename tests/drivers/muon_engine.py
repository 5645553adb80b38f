"""A small model on the engine fed fixed gradients (tests/test_muon.py), with a stacked parameter as an MoE's
experts: rank 0 hands ``N g_t`` and the
other ranks zeros, so the engine's mean is exactly ``g_t`` at N = 1, 2, 4 (powers of two) and any
difference between world sizes, stages or the oracle is the optimizer's. Rank 0 saves the parameters
after step 1 and after the last step.

Usage: mpiexec -n N python tests/drivers/muon_engine.py OUT.npz STAGE OPTIMIZER STEPS [BUCKET_MB]
"""
import sys

import numpy as np

from zerompi import ZeroConfig, ZeroEngine
from zerompi.comm.communicator import Communicator
from zerompi.errors import install_abort_hook

SHAPES = {"a.w": (24, 40), "a.b": (40,), "b.w": (40, 16), "b.g": (16,), "c.w": (12, 12), "emb": (30, 8),
          "x.w": (3, 20, 12), "x.b": (3, 12)}
LAYERS = [("a", ("a.w", "a.b")), ("b", ("b.w", "b.g")), ("c", ("c.w", "emb")), ("x", ("x.w", "x.b"))]
MUON, NO_DECAY, LR, WD = ("*.w",), ("*.b", "*.g", "emb"), 0.02, 0.1
STACKED = ("x.*",)     # an MoE's experts: x.w is 3 matrices (20, 12), x.b 3 vectors


def initial():
    rng = np.random.default_rng(7)
    return {n: (rng.standard_normal(s) * 0.1).astype(np.float32) for n, s in SHAPES.items()}


def gradient(step: int):
    """Step ``step``'s (1-based) gradient of every parameter: fixed draws, independent of the parameters."""
    rng = np.random.default_rng(1000 + step)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def main():
    install_abort_hook()
    out, stage, optimizer, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    bucket_mb = float(sys.argv[5]) if len(sys.argv) > 5 else 0.004
    comm = Communicator()
    init = initial()
    layers = [(name, {p: init[p] for p in names}) for name, names in LAYERS]
    cfg = ZeroConfig(stage=stage, dtype="fp32", optimizer=optimizer, muon_params=MUON, muon_stacked=STACKED,
                     no_decay=NO_DECAY, lr=LR, weight_decay=WD, bucket_mb=bucket_mb, optimizer_impl="numpy")
    engine = ZeroEngine(layers, cfg, comm)
    saved = {}
    for t in range(1, steps + 1):
        g = gradient(t)
        for i in reversed(range(len(LAYERS))):
            with engine.unsharded(i):
                pass
            mine = {p: g[p] * np.float32(comm.size) if comm.rank == 0 else np.zeros_like(g[p]) for p in LAYERS[i][1]}
            engine.grads_ready(i, mine)
        engine.step()
        if t == 1 or t == steps:
            for k, v in engine.full_parameters().items():
                saved[f"{k}@{t}"] = v
    if comm.rank == 0:
        np.savez(out, **saved)
    engine.close()


if __name__ == "__main__":
    main()
