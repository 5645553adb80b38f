"""Library misuse across ranks (tests/test_library_misuse.py): CASE [DIR]. The engine is used as a
library; a misuse must end every rank with one line (the abort hook's), never a hang or a silent result."""
import sys

import numpy as np
from mpi4py import MPI

import zerompi

case = sys.argv[1]
directory = sys.argv[2] if len(sys.argv) > 2 else None
rank = MPI.COMM_WORLD.Get_rank()


def one_step(engine, grads):
    for i in reversed(range(len(grads))):
        engine.grads_ready(i, {k: v * engine.loss_scale for k, v in grads[i].items()})
    return engine.step()


def dense():
    layers = [("a", {"a.w": np.full((4, 4), 0.5, np.float32), "a.b": np.zeros(4, np.float32)}),
              ("b", {"b.w": np.ones(8, np.float32)})]
    grads = [{"a.w": np.ones((4, 4), np.float32), "a.b": np.ones(4, np.float32)}, {"b.w": np.ones(8, np.float32)}]
    return layers, grads


if case.startswith("save_"):          # ranks disagree on save()'s arguments
    layers, grads = dense()
    engine = zerompi.ZeroEngine(layers, zerompi.ZeroConfig(stage=2, dtype="fp32", lr=0.1))
    one_step(engine, grads)
    kwargs = {"save_blocking": {"blocking": rank == 0}, "save_keep": {"keep_last": 1 + rank},
              "save_keep0": {"keep_last": 0}}[case]
    engine.save(directory, **kwargs)
    one_step(engine, grads)
    engine.close()
elif case.startswith("tp_"):          # tensor parallelism over Mesh(tp=2)
    mesh = zerompi.Mesh(tp=2)
    t = mesh.tp_rank
    lr = 0.2 if case == "tp_lr" and t == 1 else 0.1
    split = {"w": (1, 1)}
    if case == "tp_split_rank" and t == 1:
        split = {}
    split = {"tp_axis": {"w": (2, 1)}, "tp_groups": {"w": (1, 3)}, "tp_int": {"w": 1}}.get(case, split)
    bias = np.full(4, 1.0 + (t if case == "tp_init" else 0), np.float32)
    layers = [("l", {"w": np.full((4, 2), 0.5, np.float32), "b": bias})]
    engine = zerompi.ZeroEngine(layers, zerompi.ZeroConfig(stage=1, dtype="fp32", lr=lr), comm=mesh, tp_split=split)
    step_lr = 0.3 if case == "tp_step_lr" and t == 1 else None
    for _ in range(2):
        engine.grads_ready(0, {"w": np.ones((4, 2), np.float32), "b": np.ones(4, np.float32)})
        engine.step(lr=step_lr)
    engine.close()
elif case in ("ckpt_tp_save", "ckpt_tp_load", "ckpt_tp_load_split"):
    # CASE DIR: saves at steps 2 and 4; loads DIR, one more step
    mesh = zerompi.Mesh(tp=2)
    layers = [("l", {"w": np.full((4, 2), 0.5, np.float32), "b": np.ones(4, np.float32)})]
    split = {"w": (0, 1) if case == "ckpt_tp_load_split" else (1, 1)}
    engine = zerompi.ZeroEngine(layers, zerompi.ZeroConfig(stage=1, dtype="fp32"), comm=mesh, tp_split=split)
    if case != "ckpt_tp_save":
        engine.load(directory)
        print(f"library_misuse: rank {rank} loaded {engine.full_parameters()['w'].ravel()[:2]}", flush=True)
    for s in range(1 if case == "ckpt_tp_load" else 4):
        engine.grads_ready(0, {"w": np.ones((4, 2), np.float32), "b": np.ones(4, np.float32)})
        engine.step()
        if s % 2:
            engine.save(directory, blocking=False)
    engine.close()
elif case == "split_one_rank":     # tp_split on rank 1 only, no tensor parallelism
    layers, grads = dense()
    engine = zerompi.ZeroEngine(layers, zerompi.ZeroConfig(stage=2, dtype="fp32"),
                                tp_split={"b.w": (0, 1)} if rank == 1 else None)
    one_step(engine, grads)
    engine.close()
elif case == "trace_tp":           # CASE FILE: tensor parallelism, traced
    mesh = zerompi.Mesh(tp=2)
    layers = [("l", {"w": np.full((4, 2), 0.5, np.float32), "b": np.ones(4, np.float32)})]
    engine = zerompi.ZeroEngine(layers, zerompi.ZeroConfig(stage=1, dtype="fp32", trace=directory, trace_steps=2),
                                comm=mesh, tp_split={"w": (1, 1)})
    for _ in range(3):
        engine.grads_ready(0, {"w": np.ones((4, 2), np.float32), "b": np.ones(4, np.float32)})
        engine.step()
    engine.close()
elif case == "qgz_overflow":      # CASE STAGE: an overflow in the block the padding shares, then finite steps
    engine = zerompi.ZeroEngine([("a", {"w": np.zeros(37, np.float32)})],
                                zerompi.ZeroConfig(stage=int(sys.argv[2]), dtype="fp16", quantize_grads="int8"))
    skipped = []
    for s in range(4):
        g = np.ones(37, np.float32)
        g[36] = np.inf if s == 0 else 1.0      # rank 1's slice, the quantization block of the padding
        engine.grads_ready(0, {"w": g})
        skipped.append(engine.step().skipped)
    print(f"library_misuse: rank {rank} skipped {skipped}", flush=True)
    engine.close()
print(f"library_misuse: rank {rank} finished {case}", flush=True)
