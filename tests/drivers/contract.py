"""The cross-rank contract under mpiexec: one case per run (``python contract.py CASE STAGE``).

Rank 0 prints one JSON line: what the case measured. Cases that must stop every rank catch
the error on every rank and report each rank's error type and message.
"""
import json
import sys

import numpy as np
from mpi4py import MPI

from zerompi import MeshConfig, ZeroConfig, ZeroEngine
from zerompi.comm.meshconfig import FIELDS as MESH_FIELDS

WORLD = MPI.COMM_WORLD
RANK, N = WORLD.Get_rank(), WORLD.Get_size()
SIZES = [40, 64, 24, 100]                 # one layer per bucket, of different lengths
LR = 1e-3


def layers(sizes=SIZES, seed=0):
    rng = np.random.default_rng(seed)
    return [(f"l{i}", {f"w{i}": rng.standard_normal(n).astype(np.float32)}) for i, n in enumerate(sizes)]


def grads(step, rank, sizes=SIZES):
    """Rank ``rank``'s gradients at ``step``: known to every rank (the float64 oracle needs them)."""
    return [np.random.default_rng([step, rank, i]).standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)]


def engine(stage, sizes=SIZES, seed=0, **kw):
    cfg = dict(stage=stage, dtype="fp32", bucket_mb=1e-4, lr=LR, timeout_s=20)
    cfg.update(kw)
    mesh = MeshConfig(**{k: cfg.pop(k) for k in MESH_FIELDS if k in cfg})
    return ZeroEngine(layers(sizes, seed), ZeroConfig(**cfg), mesh_config=mesh)


def forward(eng, order):
    for i in order:
        with eng.unsharded(i):
            pass


def train(eng, steps, order, sizes=SIZES):
    """``steps`` steps handing gradients back in ``order``; returns the parameters after each step."""
    out = []
    for step in range(1, steps + 1):
        forward(eng, range(len(sizes)))
        g = grads(step, RANK, sizes)
        for i in order:
            eng.grads_ready(i, {f"w{i}": g[i]})
        eng.step()
        out.append(eng.full_parameters())
    return out


def errors_on_every_rank(run):
    """Run ``run()``; every rank's (error type, message), all-gathered."""
    try:
        run()
        mine = (None, "")
    except Exception as e:    # noqa: BLE001 -- reported, not swallowed
        mine = (type(e).__name__, str(e))
    return WORLD.allgather(mine)


def case_order(stage):
    """Ranks hand gradients back in different orders: the parameters must equal those of the same
    order bit for bit, and step 1 must move every element by lr against the sign of the float64
    mean gradient (AdamW's first step)."""
    orders = [[3, 2, 1, 0], [0, 1, 2, 3], [2, 0, 3, 1], [1, 3, 0, 2]]
    mixed = train(engine(stage), 3, orders[RANK % 4])
    same = train(engine(stage), 3, [3, 2, 1, 0])
    equal = all(np.array_equal(mixed[s][k], same[s][k]) for s in range(3) for k in same[s])
    init = dict(p for _, ps in layers() for p in ps.items())
    mean = [np.mean([grads(1, r)[i].astype(np.float64) for r in range(N)], axis=0) for i in range(len(SIZES))]
    worst = max(float(np.max(np.abs(mixed[0][f"w{i}"] - (init[f"w{i}"] - LR * np.sign(m)))))
                for i, m in enumerate(mean))
    return {"bits_equal": bool(WORLD.allreduce(int(not equal)) == 0), "step1_worst": WORLD.allreduce(worst, MPI.MAX)}


def case_stale(stage):
    """Views of every layer taken once, before training, read right after each step()."""
    eng = engine(stage)
    views = [eng.params(i) for i in range(len(SIZES))]
    bad = 0
    for step in range(1, 6):
        forward(eng, range(len(SIZES)))
        g = grads(step, RANK)
        for i in reversed(range(len(SIZES))):
            eng.grads_ready(i, {f"w{i}": g[i]})
        eng.step()
        seen = {k: v.copy() for view in views for k, v in view.items()}   # before anything else waits
        now = eng.full_parameters()
        bad += sum(not np.array_equal(seen[k], now[k]) for k in now)
    return {"stale_reads": WORLD.allreduce(bad)}


def case_init(stage, mode):
    """Every rank seeds its initial values with its rank (a common mistake)."""
    def run():
        extra = {} if mode == "check" else {"init_values": mode}    # "check" is the default
        eng = ZeroEngine(layers(seed=RANK), ZeroConfig(stage=stage, dtype="fp32", bucket_mb=1e-4, **extra))
        got = eng.full_parameters()
        want = dict(p for _, ps in layers(seed=0) for p in ps.items())
        if not all(np.array_equal(got[k], want[k]) for k in want):
            raise AssertionError("broadcast: not rank 0's values")
    return {"errors": errors_on_every_rank(run)}


def case_lr(stage):
    """Rank 1 passes another lr to step(): every rank stops before any parameter changes."""
    eng = engine(stage)
    init = eng.full_parameters()

    def run():
        forward(eng, range(len(SIZES)))
        g = grads(1, RANK)
        for i in reversed(range(len(SIZES))):
            eng.grads_ready(i, {f"w{i}": g[i]})
        eng.step(lr=2e-3 if RANK == 1 else 1e-3)
    errs = errors_on_every_rank(run)
    after = eng.full_parameters()
    return {"errors": errs, "unchanged": all(np.array_equal(after[k], init[k]) for k in init)}


def case_gather_order(stage):
    """Stage 3: rank 1 unshards layer 1 where the others unshard layer 0 (equal bucket lengths, so
    MPI pairs the gathers without a word): every rank stops at that gather, before any computes
    (it stopped in step(), after rank 1 had computed with layer 0's values)."""
    sizes = [48, 48, 48]
    eng = engine(stage, sizes, prefetch=0)
    computed = []                 # (layer, its first value) of every layer this rank computed with

    def run():
        for i in [1, 0, 2] if RANK == 1 else [0, 1, 2]:
            with eng.unsharded(i) as p:
                computed.append((i, float(p[f"w{i}"][0])))
        g = grads(1, RANK, sizes)
        for i in reversed(range(len(sizes))):
            eng.grads_ready(i, {f"w{i}": g[i]})
        eng.step()
    errors = errors_on_every_rank(run)
    return {"errors": errors, "computed": WORLD.allgather(computed)}


def case_shape(stage):
    """Rank 1 builds its model with another shape of w1."""
    sizes = [40, 41 if RANK == 1 else 40]
    return {"errors": errors_on_every_rank(lambda: engine(stage, sizes))}


def case_raise(stage):
    """Library use, no hook installed by the caller: rank 1 raises mid-step; the job must end."""
    eng = engine(stage)
    forward(eng, range(len(SIZES)))
    if RANK == 1:
        raise RuntimeError("injected failure on rank 1")
    g = grads(1, RANK)
    for i in reversed(range(len(SIZES))):
        eng.grads_ready(i, {f"w{i}": g[i]})
    eng.step()          # the others wait here for rank 1's reductions
    return {}


def case_no_close(stage):
    """A program that ends after step() without close(), collectives still in flight
    (stage 3: the next forward's prefetch; stages 1/2 with lazy_publish: the all-gathers)."""
    sizes = SIZES + [4_000_000]      # a 16 MB layer: its gather cannot have arrived when step() returns
    eng = engine(stage, sizes, lazy_publish=True)
    forward(eng, range(len(sizes)))
    g = grads(1, RANK, sizes)
    for i in reversed(range(len(sizes))):
        eng.grads_ready(i, {f"w{i}": g[i]})
    eng.step()
    return {"in_flight": WORLD.allreduce(len(eng.inflight))}


CASES = {"order": case_order, "stale": case_stale, "init_check": lambda s: case_init(s, "check"),
         "init_broadcast": lambda s: case_init(s, "broadcast"), "lr": case_lr, "gather_order": case_gather_order,
         "shape": case_shape, "raise": case_raise, "no_close": case_no_close}

if __name__ == "__main__":
    result = CASES[sys.argv[1]](int(sys.argv[2]))
    if RANK == 0:
        print(json.dumps(result), flush=True)
