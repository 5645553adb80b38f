"""Your own model, layer by layer, on zerompi: a tanh network fit to y = sin(3x).

The model below is plain NumPy. zerompi only sees named parameters grouped into layers;
each layer is unsharded for its forward and again for its backward (stage 3 gathers it
then and frees it after), and its gradients are handed back as soon as they exist.

The cross-rank contract (README, "The library"): every rank builds the same layers from the
same seed (init_values="check" stops every rank if they differ), unshards them in the same
order, and steps with the same lr; only the data each rank sees differs.

    mpiexec -n 4 python examples/custom_model.py --stage 3 --dtype fp16
"""
import argparse

import numpy as np
from mpi4py import MPI

import zerompi

F32 = np.float32


class Dense:
    """y = act(x @ W + b); act is tanh or identity."""

    def __init__(self, name, n_in, n_out, act, rng):
        self.name, self.act = name, act
        self.init = {f"{name}.W": (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(F32),
                     f"{name}.b": np.zeros(n_out, F32)}

    def forward(self, p, x):
        z = x @ p[f"{self.name}.W"].astype(F32) + p[f"{self.name}.b"].astype(F32)
        y = np.tanh(z) if self.act else z
        return y, (x, y)

    def backward(self, p, cache, dy):
        x, y = cache
        dz = dy * (1 - y * y) if self.act else dy
        grads = {f"{self.name}.W": x.T @ dz, f"{self.name}.b": dz.sum(0)}
        return dz @ p[f"{self.name}.W"].astype(F32).T, grads


def build(seed=0, hidden=32):
    rng = np.random.default_rng(seed)
    return [Dense("in", 1, hidden, True, rng), Dense("mid", hidden, hidden, True, rng),
            Dense("out", hidden, 1, False, rng)]


def batch(step, size=96):
    """The global batch of a step: the same on every rank, whatever the world size."""
    x = np.random.default_rng([1, step]).uniform(-1, 1, (size, 1)).astype(F32)
    return x, np.sin(3 * x)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", help="save the final parameters (rank 0) to this .npz")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    model = build()
    engine = zerompi.ZeroEngine([(lay.name, lay.init) for lay in model],
                                zerompi.ZeroConfig(stage=args.stage, dtype=args.dtype, lr=1e-2, bucket_mb=0.002))
    for step in range(args.steps):
        x, y = batch(step)
        per = len(x) // n
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        caches, h = [], x
        for i, lay in enumerate(model):
            with engine.unsharded(i) as prm:
                h, c = lay.forward(prm, h)
            caches.append(c)
        loss = float(np.mean((h - y) ** 2))
        dy = (2.0 / h.size) * (h - y) * F32(engine.loss_scale)   # scale the loss for fp16
        for i in reversed(range(len(model))):
            with engine.unsharded(i) as prm:
                dy, grads = model[i].backward(prm, caches[i], dy)
            engine.grads_ready(i, grads)
        result = engine.step()
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss(rank 0) {loss:.5f}  grad norm {result.grad_norm:.4f}  "
                  f"scale {result.loss_scale:g}")
    params = engine.full_parameters()
    if rank == 0 and args.out:
        np.savez(args.out, **params)
    engine.close()


if __name__ == "__main__":
    main()
