"""The GPT's training step at N = 1 by operation: what its time beyond the matrix multiplies is (JSON to stdout).

    python scripts/bench_gpt_ops.py                          # GPT 6 x 256 (seq 128, batch 16), stage 0
    python scripts/bench_gpt_ops.py --model gpt-default --steps 10

One process, one BLAS thread, the train CLI's step (bench_floor.py's: this rank's rows, forward, backward,
the engine's optimizer step, the loss summed) with every operation of the model timed where it is called:
the blocks' matrix multiplies (every ``np.matmul``), the C kernels (LayerNorm, GELU, the causal softmax,
the bias + residual add: each forward and backward), the embedding (its gather and its one-hot backward,
a small matmul), the head with its loss (its three small matmuls over the vocabulary, softmax, log), the
rest of each block and layer (the bias adds and bias-gradient sums, the parameters' casts, Python), the
engine's optimizer step, and what is left of the step (the engine's hand-back of the gradients, the loss,
calls). Times are exclusive (an operation inside another counts once, in the inner one), medians over
``--steps`` steps after two warm-up steps; beside them the GEMM floor of bench_floor.py on the same shapes
in the same process. The timers add about a microsecond per call (``calls`` says how many).
"""
import argparse
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_floor import MODELS, floor_fn, gpt_gemms  # noqa: E402  (the same models and GEMM floor)


class Clock:
    """Exclusive seconds and calls per name: a timed call inside another is taken out of the outer one."""

    def __init__(self):
        self.seconds, self.calls, self.stack = defaultdict(float), Counter(), []

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self.stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.perf_counter() - t0
                inner = self.stack.pop()
                self.seconds[name] += total - inner
                self.calls[name] += 1
                if self.stack:
                    self.stack[-1] += total
        return timed

    def take(self):
        out, calls = dict(self.seconds), dict(self.calls)
        self.seconds.clear(), self.calls.clear()
        return out, calls


class TimedNumpy:
    """NumPy with its matmul timed (put in place of a module's ``np``)."""

    def __init__(self, clock: Clock):
        self.matmul = clock.wrap("matmul", np.matmul)

    def __getattr__(self, name):
        return getattr(np, name)


def instrument(model, clock: Clock) -> None:
    """Every operation of the GPT's fast path timed under its name (the C kernels, NumPy's matmul, the embedding,
    the head and loss, each block's and layer's rest)."""
    from zerompi.train import model_kernels
    from zerompi.train.models import gpt_fast
    kernels = {"layernorm_fwd": "layernorm", "layernorm_bwd": "layernorm backward", "gelu_fwd": "gelu",
               "gelu_bwd": "gelu backward", "softmax_causal_fwd": "softmax", "softmax_causal_bwd": "softmax backward",
               "bias_residual": "bias + residual add"}
    for method, name in kernels.items():
        setattr(model_kernels.Kernels, method, clock.wrap(name, getattr(model_kernels.Kernels, method)))
    gpt_fast.np = TimedNumpy(clock)
    for cls, methods in ((gpt_fast.FusedLayers, ("block_forward", "block_backward_parts", "ln_forward",
                                                  "ln_backward")),):
        for m in methods:
            setattr(cls, m, clock.wrap("block rest (bias adds and sums, casts, Python)", getattr(cls, m)))
    for m, name in (("embed_forward", "embedding"), ("embed_backward", "embedding"), ("head", "head + loss"),
                    ("forward_layer", "layer rest"), ("backward_layer", "layer rest"),
                    ("backward_layer_parts", "layer rest")):
        setattr(model, m, clock.wrap(name, getattr(model, m)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpts = [m for m in MODELS if m.startswith("gpt")]
    p.add_argument("--model", default="gpt-6x256", choices=gpts)
    p.add_argument("--steps", type=int, default=8, help="timed steps (after 2 warm-up steps)")
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error(f"--steps {a.steps} must be >= 1")
    from mpi4py import MPI
    from zerompi import ZeroEngine
    from zerompi.comm.communicator import Communicator
    from zerompi.train.config import parse_config
    from zerompi.train.job import step_losses
    from zerompi.train.run import _one_blas_thread, build_model
    if MPI.COMM_WORLD.Get_size() != 1:
        p.error("runs as one process (N = 1)")
    _one_blas_thread()
    cfg = parse_config(MODELS[a.model])
    model, data = build_model(cfg, np)
    floor = floor_fn(gpt_gemms(model, cfg.batch))
    engine = ZeroEngine(model.init_layers(), replace(cfg.zero, stage=0), Communicator(MPI.COMM_WORLD.Dup()), xp=np)
    losses_of, clock = step_losses("gpt"), Clock()
    instrument(model, clock)
    steps, floors = [], []
    for step in range(a.steps + 2):
        engine.timers.take()
        clock.take()
        t0 = time.perf_counter()
        local = losses_of(engine, model, data, step, cfg.batch, cfg.zero.micro_batches)
        engine.step()
        engine.comm.sum_scalars([sum(local) / len(local), 0.0])
        total = time.perf_counter() - t0
        parts, calls = clock.take()
        parts["optimizer"] = engine.timers.take()["optimizer"]
        parts["rest of the step (gradient hand-back, loss, calls)"] = total - sum(parts.values())
        t1 = time.perf_counter()
        floor()
        floors.append(time.perf_counter() - t1)
        if step >= 2:
            steps.append((total, parts, calls))
    engine.close()
    med = statistics.median
    step_s = med(t for t, _, _ in steps)
    ops = {k: med(p.get(k, 0.0) for _, p, _ in steps) for k in steps[0][1]}
    rec = {"model": a.model, "flags": MODELS[a.model], "kernels": getattr(getattr(model, "layers", None), "name", ""),
           "dtype": cfg.zero.dtype, "step_s": step_s, "floor_s": med(floors[2:]),
           "ops_s": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
           "ops_share": {k: v / step_s for k, v in sorted(ops.items(), key=lambda kv: -kv[1])},
           "calls_per_step": steps[0][2]}
    rec["beyond_matmul_s"] = step_s - ops.get("matmul", 0.0)
    print(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
