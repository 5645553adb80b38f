"""Your own model in pipeline stages: a tanh network fit to y = sin(3x), its 4 layers on 2 stages.

zerompi's pipeline pieces used as a library (docs/pipeline.md). A Mesh with ``pp=2`` makes the
stages (world ranks 0 .. N/2-1 are stage 0, the rest stage 1; each stage's ranks a data-parallel
group). A schedule is data: made (GPipe or 1F1B here) and validated before anything runs. Each
stage builds a ZeroEngine over its own layers and data-parallel group -- any ZeRO stage -- and a
runner: the object that says how its layers run a micro-batch forward and backward (the executor
calls it; the activations and their gradients travel between the stages without it). Each step the
executor runs the stage's actions of the schedule, then the step is taken over the whole mesh
(one gradient norm, one overflow decision for both stages: pipeline.step.step_together).

    mpiexec -n 4 python examples/pipeline_model.py --stage 3 --schedule 1f1b --micro-batches 4
"""
import argparse
from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

import zerompi
from zerompi.pipeline import schedules, validate
from zerompi.pipeline.executor import PipelineExecutor
from zerompi.pipeline.step import step_together

F32 = np.float32
BATCH = 96                     # rows of a step's global batch


class Dense:
    """y = act(x @ W + b); act is tanh or identity (as in custom_model.py)."""

    def __init__(self, name, n_in, n_out, act, rng):
        self.name, self.act, self.n_in, self.n_out = name, act, n_in, n_out
        self.init = {f"{name}.W": (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(F32),
                     f"{name}.b": np.zeros(n_out, F32)}

    def forward(self, p, x):
        y = x @ p[f"{self.name}.W"].astype(F32) + p[f"{self.name}.b"].astype(F32)
        y = np.tanh(y) if self.act else y
        return y, (x, y)

    def backward(self, p, cache, dy):
        x, y = cache
        dz = dy * (1 - y * y) if self.act else dy
        return dz @ p[f"{self.name}.W"].astype(F32).T, {f"{self.name}.W": x.T @ dz, f"{self.name}.b": dz.sum(0)}


def build(seed=0, hidden=32):
    rng = np.random.default_rng(seed)
    return [Dense("in", 1, hidden, True, rng), Dense("mid1", hidden, hidden, True, rng),
            Dense("mid2", hidden, hidden, True, rng), Dense("out", hidden, 1, False, rng)]


def batch(step):
    """The global batch of a step: the same on every rank, whatever the world size."""
    x = np.random.default_rng([2, step]).uniform(-1, 1, (BATCH, 1)).astype(F32)
    return x, np.sin(3 * x)


class StageRunner:
    """One stage's layers as the executor drives them (zerompi/pipeline/executor.py: the protocol)."""

    def __init__(self, engine, layers, first, last, dp_rank, dp, micro_batches):
        self.engine, self.layers, self.first, self.last = engine, layers, first, last
        self.dp_rank, self.dp, self.m = dp_rank, dp, micro_batches
        self.rows = BATCH // dp // micro_batches            # rows of one micro-batch on this rank
        self.caches, self.dy, self.losses = {}, {}, {}

    def begin_step(self, step):
        x, y = batch(step)
        lo = self.dp_rank * self.rows * self.m               # this data-parallel rank's rows, cut in m
        self.x = [x[lo + k * self.rows:lo + (k + 1) * self.rows] for k in range(self.m)]
        self.y = [y[lo + k * self.rows:lo + (k + 1) * self.rows] for k in range(self.m)]
        self.losses = {}

    def end_step(self):
        pass

    def input_spec(self, mb):                               # what this stage receives: the activations ...
        return (self.rows, self.layers[0].n_in), F32

    def grad_spec(self, mb):                                # ... and the gradient of what it sends on
        return (self.rows, self.layers[-1].n_out), F32

    def forward(self, mb, x):
        e, h, caches = self.engine, self.x[mb] if self.first else x, []
        e.begin_forward()
        for i, lay in enumerate(self.layers):
            with e.unsharded(i) as p:
                h, c = lay.forward(p, h)
            caches.append(c)
        self.caches[mb] = caches
        if not self.last:
            return h                                         # the executor sends it to the next stage
        self.losses[mb] = float(np.mean((h - self.y[mb]) ** 2))
        self.dy[mb] = (2.0 / h.size) * (h - self.y[mb]) * F32(e.loss_scale)   # scaled for fp16
        return None

    def backward(self, mb, dy, weights):
        e, caches = self.engine, self.caches.pop(mb)
        dy = self.dy.pop(mb) if self.last else dy
        e.begin_backward()
        for i in reversed(range(len(self.layers))):
            with e.unsharded(i) as p:
                dy, grads = self.layers[i].backward(p, caches[i], dy)
            e.grads_ready(i, grads)
        return None if self.first else dy                    # the executor sends it to the stage before

    def weights(self, mb):
        raise NotImplementedError("this runner does not split its backward (no zb-h1 schedule)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", help="save the final parameters (world rank 0) to this .npz")
    args = p.parse_args(argv)
    mesh = zerompi.Mesh(pp=2)                                # COMM_WORLD: 2 stages of N/2 ranks
    schedule = schedules.make(args.schedule, 2, args.micro_batches)
    validate.check(schedule, micro_batches=args.micro_batches, ranks=2)
    first, last = mesh.pp_rank == 0, mesh.pp_rank == 1
    layers = build()[:2] if first else build()[2:]
    cfg = zerompi.ZeroConfig(stage=args.stage, dtype=args.dtype, lr=1e-2, bucket_mb=0.002,
                             micro_batches=args.micro_batches)
    engine = zerompi.ZeroEngine([(lay.name, lay.init) for lay in layers], cfg, mesh)   # over the stage's dp group
    runner = StageRunner(engine, layers, first, last, mesh.dp_rank, mesh.dp, args.micro_batches)
    executor = PipelineExecutor(schedule, mesh.pp_comm, {mesh.pp_rank: runner})
    stages = SimpleNamespace(mpi=mesh.pp_mpi, waiting=engine.comm.waiting, ranks=mesh.pp_ranks)
    world = MPI.COMM_WORLD
    for step in range(args.steps):
        executor.run(step)
        result = step_together([engine], stages)[0]           # the same decision on every rank of the mesh
        if last and mesh.dp_rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss(stage 1, dp rank 0) {np.mean(list(runner.losses.values())):.5f}  "
                  f"grad norm {result.grad_norm:.4f}  scale {result.loss_scale:g}", flush=True)
    params = engine.full_parameters()                        # this stage's layers (a collective of its group)
    parts = world.gather(params if mesh.dp_rank == 0 else None, root=0)
    if world.Get_rank() == 0 and args.out:
        np.savez(args.out, **{k: v for part in parts if part for k, v in part.items()})
    engine.close()


if __name__ == "__main__":
    main()
