"""Soak: thousands of small steps, and resident memory must stay flat after the warm-up.

    mpiexec -n 2 python scripts/soak.py                  # 2000 steps, stage 3, fp16
    mpiexec -n 3 python scripts/soak.py --stage 2 --steps 5000

Every rank samples, every ``--every`` steps: its resident set size (/proc/self/statm),
the count of live objects gc tracks (containers and instances: a leaked handle shows),
the engine's transient buffer bytes, the communicator's pooled scratch bytes, the
collectives in flight and the live threads.
Rank 0 prints one JSON object: the samples (max over ranks) and, over the samples after
``--warmup`` steps, the slope of each (least squares, per step) and the growth.

Ceilings, measured in the same run: a leak of one step's transient buffers every
``LEAK_FRACTION_INV`` steps would make the RSS slope exceed
``peak_buffer_bytes / LEAK_FRACTION_INV`` bytes per step; a leak of one Python object every
``LEAK_FRACTION_INV`` steps would make the object slope exceed ``1 / LEAK_FRACTION_INV``.
The engine's transient buffers plus the communicator's scratch must stay within the most
``zerompi.estimate`` says the engine can hold for this layout (both are pools that keep
their high-water mark: under load a late step may still reach a new high once, which is
not a leak; a leak would pass any bound), and the in-flight and thread counts must not
grow at all. Exit status 0 when all hold, else 1.
"""
import argparse
import gc
import json
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

from mpi4py import MPI  # noqa: E402

from zerompi import ZeroConfig, ZeroEngine  # noqa: E402
from zerompi.train.models.mlp import MLP, TeacherData, train_losses  # noqa: E402

LEAK_FRACTION_INV = 10   # the ceilings catch a leak of 1/10 of a step's buffers (or of one object) per step


def rss_bytes() -> int:
    """Resident set size of this process, bytes (Linux /proc; getrusage's peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def sample(engine) -> dict:
    """What one rank holds now."""
    return {
        "rss": rss_bytes(),
        "objects": len(gc.get_objects()),
        "buffers": engine.ledger.current["buffers"],
        "scratch": engine.comm.scratch_bytes,
        "in_flight": len(engine.inflight),
        "threads": threading.active_count(),
    }


def slope(xs, ys) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200, help="steps before the flat part starts")
    p.add_argument("--every", type=int, default=100, help="steps between samples")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=12, help="global batch (a multiple of the ranks)")
    p.add_argument("--bucket-mb", type=float, default=0.01, help="small buckets: many collectives per step")
    p.add_argument("--leak-bytes", type=int, default=0,
                   help="keep this many bytes per step on purpose (shows that the checks catch a leak)")
    a = p.parse_args(argv)
    if a.steps < a.warmup + 3 * a.every:
        p.error(f"--steps {a.steps} leaves fewer than 3 samples after --warmup {a.warmup}; use more steps")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    comm = MPI.COMM_WORLD
    model, data = MLP(a.width, a.depth, 0), TeacherData(a.width, a.depth, 0)
    engine = ZeroEngine(model.init_layers(), ZeroConfig(stage=a.stage, dtype=a.dtype, bucket_mb=a.bucket_mb), comm)
    samples, leaked = [], []
    for step in range(a.steps + 1):
        if step % a.every == 0:
            gc.collect()
            samples.append({"step": step, **sample(engine)})
        if step == a.steps:
            break
        train_losses(engine, model, data, step, a.batch, 1)
        engine.step()
        if a.leak_bytes:
            # Like a forgotten handle holding its buffer: a tracked object (gc sees it) and
            # touched bytes (resident, not just reserved).
            leaked.append([step, bytearray(b"x" * a.leak_bytes)])
    peak_buffers = engine.memory_report()["peak_buffers"]["bytes"]
    bound = buffer_bound(engine, a)
    per_rank = comm.gather(samples)
    engine.close()
    if comm.Get_rank() != 0:
        return 0
    report = summarize(per_rank, a, peak_buffers, bound)
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


def buffer_bound(engine, a) -> int:
    """The most transient buffer + scratch bytes the engine can hold (the estimate, on its layout)."""
    import zerompi
    c = engine.config
    est = zerompi.estimate(layout=engine.layout, dtype=c.dtype, bucket_mb=c.bucket_mb, prefetch=c.prefetch,
                           micro_batches=c.micro_batches, overlap=c.overlap)
    return est["stages"][c.stage]["buffer_bytes"]


def summarize(per_rank, a, peak_buffers: int, bound: int) -> dict:
    """Samples (max over ranks), slopes and growth after the warm-up, checks against the ceilings."""
    keys = ("rss", "objects", "buffers", "scratch", "in_flight", "threads")
    steps = [s["step"] for s in per_rank[0]]
    series = {k: [max(r[i][k] for r in per_rank) for i in range(len(steps))] for k in keys}
    flat = [i for i, st in enumerate(steps) if st >= a.warmup]
    xs = [steps[i] for i in flat]
    slopes = {k: max(slope(xs, [r[i][k] for i in flat]) for r in per_rank) for k in keys}
    growth = {k: max(r[flat[-1]][k] - r[flat[0]][k] for r in per_rank) for k in keys}
    ceilings = {"rss_bytes_per_step": peak_buffers / LEAK_FRACTION_INV, "objects_per_step": 1 / LEAK_FRACTION_INV}
    checks = {
        "rss_slope_below_ceiling": slopes["rss"] < ceilings["rss_bytes_per_step"],
        "object_slope_below_ceiling": slopes["objects"] < ceilings["objects_per_step"],
        "buffers_and_scratch_within_the_estimate": all(
            r[i]["buffers"] + r[i]["scratch"] <= bound for r in per_rank for i in flat),
        "in_flight_and_threads_flat": all(growth[k] <= 0 for k in ("in_flight", "threads")),
    }
    return {
        "ranks": len(per_rank), "steps": a.steps, "warmup": a.warmup, "stage": a.stage, "dtype": a.dtype,
        "leak_bytes_per_step": a.leak_bytes,
        "samples": {"step": steps, **series},
        "slope_per_step_after_warmup": slopes,
        "growth_after_warmup": growth,
        "peak_buffer_bytes": peak_buffers,
        "buffer_bound_bytes": bound,
        "ceilings": ceilings,
        "checks": checks,
        "ok": all(checks.values()),
    }


if __name__ == "__main__":
    sys.exit(main())
