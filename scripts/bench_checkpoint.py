"""How long a checkpoint stops training, synchronous and asynchronous, against the disk's own speed.

    python scripts/bench_checkpoint.py                         # Ψ = 100M, N = 2, stage 1, fp32, 7 rounds
    python scripts/bench_checkpoint.py --params 20e6 --rounds 3

Runs itself under ``mpiexec -n N`` (the MPI wheel's next to this Python, else the one on PATH).
A ZeroEngine of Ψ parameters (``--layers`` equal layers) trains on fixed gradients; each
round, in a fresh random order (so a drift in the machine's load hits all alike), measures:

- ``sync``: the stall of ``engine.save(DIR)`` (blocking): the time the training loop waits.
- ``async``: the stall of ``engine.save(DIR, blocking=False)`` (the temporary folder agreed
  and the host copy of the shard), plus every later moment the loop waits for that save:
  the per-step agreement while it is written, up to the step that learns it is published
  (``checkpoint.collective.poll``, timed here after a barrier: ``polls_skew_s``, the ranks'
  skew that barrier absorbed, is reported apart, since without the poll the step's next
  collective would wait for it), and a wait at the next save (none here: the loop steps
  until it is published). Also reported: the background write's duration, the host copy
  alone, and the step time while a background write runs against without one (on a
  machine with few cores the writer competes with training for them).
- ``ceiling``: the disk, for the same bytes in the same run: every rank writes its shard's
  byte count to a file at once and fsyncs it, plainly and with the writeback started per
  64 MiB chunk (what the shard writer does); the faster median is the ceiling. Each round
  measures it right before or after the sync save (in random order), and
  ``median_round_vs_ceiling`` is the median over rounds of the sync save against the faster
  of that round's two, which a load drift between rounds does not skew.
- ``checksum_s``: sha256 and CRC-32 over every rank's shard at once (the checksum's CPU cost).

Prints one JSON object (medians, seconds) and the two targets of docs/checkpoint.md:
the async stall <= 10% of the sync one, the sync save <= 1.5x bytes / ceiling. Exit
status 0, or 1 when a target is missed. The checkpoints are written under ``--dir``
(default: a temporary folder in the current directory, removed at the end). Before each
timed part the earlier checkpoints are deleted and everything is flushed (``os.sync``),
untimed: on a file system mounted with ``discard`` a deletion's TRIM slows the writes that
follow it, which would charge one part's clean-up to the next (the saves use no
``keep_last``; retention's own cost is that of deleting the files).
"""
import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 64 << 20


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=100e6, help="Ψ, parameters (default 100e6)")
    p.add_argument("--ranks", type=int, default=2, help="N (default 2)")
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--settle-s", type=float, default=1.0, help="pause after the flush before each timed part")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder here)")
    p.add_argument("--timeout", type=float, default=3000, help="seconds before the run is killed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def launch(a) -> int:
    here = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(here) if here.exists() else (shutil.which("mpiexec") or "mpiexec")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [mpiexec, "-n", str(a.ranks), sys.executable, __file__, "--worker"] + sys.argv[1:]
    proc = subprocess.run(cmd, env=env, timeout=a.timeout)
    return proc.returncode


def write_file(path: str, data, kick: bool) -> None:
    with open(path, "wb", buffering=0) as f:
        view = memoryview(data).cast("B")
        for at in range(0, len(view), CHUNK):
            chunk, done = view[at:at + CHUNK], 0
            while done < len(chunk):
                done += f.write(chunk[done:])
            if kick and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), at, len(chunk), os.POSIX_FADV_DONTNEED)
        os.fsync(f.fileno())


def worker(a) -> int:
    import numpy as np
    from mpi4py import MPI
    from zerompi import ZeroConfig, ZeroEngine
    from zerompi.checkpoint import collective, writer
    from zerompi.checkpoint.format import Crc32
    from zerompi.checkpoint.pointer import complete_checkpoints, latest_name

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    psi, L = int(a.params), a.layers
    size = psi // L
    rng = np.random.default_rng(0)
    layers = [(f"l{i}", {f"w{i}": rng.standard_normal(size, dtype=np.float32) * 0.02}) for i in range(L)]
    grads = {f"w{i}": np.full(size, 1e-3, np.float32) for i in range(L)}
    engine = ZeroEngine(layers, ZeroConfig(stage=a.stage, dtype=a.dtype, timeout_s=600.0))
    del layers
    base = a.dir or "."
    folder = tempfile.mkdtemp(prefix="bench_checkpoint-", dir=base) if rank == 0 else None
    folder = comm.bcast(folder, root=0)
    ckdir = os.path.join(folder, "ck")

    # checkpoint.collective.poll, inside step(): its own time, after a barrier that takes out the ranks'
    # skew (which the step's next collective would wait for anyway), and that skew, reported apart.
    polled, skew = [0.0], [0.0]
    real_poll = collective.poll

    def timed_poll(e):
        if getattr(e, collective.PENDING, None) is None:
            return
        t = time.perf_counter()
        comm.Barrier()
        t1 = time.perf_counter()
        real_poll(e)
        polled[0] += time.perf_counter() - t1
        skew[0] += t1 - t
    collective.poll = timed_poll

    def step():
        t = time.perf_counter()
        for i in range(L):
            with engine.unsharded(i):
                pass
        for i in reversed(range(L)):
            with engine.unsharded(i):
                pass
            engine.grads_ready(i, {f"w{i}": grads[f"w{i}"]})
        engine.step()
        return time.perf_counter() - t

    def settle():
        """Before each timed part: the earlier checkpoints and files removed, and everything on disk
        (os.sync), so that one part's deletions and writeback do not slow the next one down."""
        if rank == 0:
            for name in complete_checkpoints(ckdir):
                if name != latest_name(ckdir):
                    shutil.rmtree(os.path.join(ckdir, name))
        os.sync()
        time.sleep(a.settle_s)
        comm.Barrier()

    def timed(fn):
        settle()
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out

    res = {k: [] for k in ("sync", "async", "async_copy", "async_publish", "async_write", "ceiling_plain",
                           "ceiling_writeback", "step_idle", "step_writing", "sha256", "crc32", "async_skew")}

    def run_sync():
        res["step_idle"].append(step())
        res["sync"].append(timed(lambda: engine.save(ckdir))[0])

    def run_async():
        res["step_idle"].append(step())
        polled[0] = skew[0] = 0.0
        stall, pending = timed(lambda: engine.save(ckdir, blocking=False))
        begun = time.perf_counter() - stall
        while True:                      # train until the save is published (every rank agrees on it)
            res["step_writing"].append(step())
            if pending.path:
                break
        res["async_write"].append(time.perf_counter() - begun)
        res["async_publish"].append(polled[0])
        res["async_skew"].append(skew[0])
        res["async"].append(stall + polled[0])

    def run_copy():
        res["async_copy"].append(timed(lambda: writer.snapshot(engine))[0])

    def run_checksums():                 # the shard checksum's cost: every rank over its shard at once
        host = writer.snapshot(engine)
        for key, fn in (("sha256", lambda: hashlib.sha256(host)), ("crc32", lambda: Crc32().update(host))):
            comm.Barrier()
            t = time.perf_counter()
            fn()
            comm.Barrier()
            res[key].append(time.perf_counter() - t)

    def run_ceiling():
        host = writer.snapshot(engine)
        for kick, key in ((False, "ceiling_plain"), (True, "ceiling_writeback")):
            path = os.path.join(folder, f"ceiling-{rank}.bin")
            settle()
            t = time.perf_counter()
            if rank < engine.layout.world_size:      # the ranks that write shard files
                write_file(path, host, kick)
            comm.Barrier()                           # every rank's file on disk
            res[key].append(time.perf_counter() - t)
            if os.path.exists(path):
                os.unlink(path)

    step()                               # warm up: the first step and the first host copy allocate
    run_copy()
    order = random.Random(1)
    for _ in range(a.rounds):
        pair = [run_sync, run_ceiling]   # back to back, in either order: a ratio per round
        order.shuffle(pair)
        todo = [lambda: [fn() for fn in pair], run_async, run_copy, run_checksums]
        order.shuffle(todo)
        for fn in todo:
            fn()
    engine.close()
    if rank != 0:
        return 0
    med = {k: statistics.median(v) for k, v in res.items() if v}
    nbytes = engine.layout.world_size * (128 + 12 * engine.layout.shard_numel)
    ceiling = min(med["ceiling_plain"], med["ceiling_writeback"])
    out = {
        "params": psi, "ranks": comm.Get_size(), "stage": a.stage, "dtype": a.dtype, "rounds": a.rounds,
        "bytes_per_save": nbytes, "cpus": os.cpu_count(), "latest": latest_name(ckdir),
        "ceiling": {"median_s": round(ceiling, 4), "GB_per_s": round(nbytes / ceiling / 1e9, 3),
                    "plain_s": [round(x, 4) for x in res["ceiling_plain"]],
                    "writeback_s": [round(x, 4) for x in res["ceiling_writeback"]]},
        "sync": {"median_stall_s": round(med["sync"], 4), "stalls_s": [round(x, 4) for x in res["sync"]],
                 "vs_ceiling": round(med["sync"] / ceiling, 3),
                 "median_round_vs_ceiling": round(statistics.median(
                     x / min(p, w)
                     for x, p, w in zip(res["sync"], res["ceiling_plain"], res["ceiling_writeback"])), 3)},
        "async": {"median_stall_s": round(med["async"], 4), "stalls_s": [round(x, 4) for x in res["async"]],
                  "median_copy_s": round(med["async_copy"], 4), "median_polls_s": round(med["async_publish"], 4),
                  "median_polls_skew_s": round(med["async_skew"], 4),
                  "median_background_write_s": round(med["async_write"], 4),
                  "vs_sync": round(med["async"] / med["sync"], 4)},
        "step_s": {"median_idle": round(med["step_idle"], 4), "median_while_writing": round(med["step_writing"], 4)},
        "checksum_s": {"sha256": round(med["sha256"], 4), "crc32": round(med["crc32"], 4)},
    }
    out["targets"] = {"async_stall_at_most_10pct_of_sync": out["async"]["vs_sync"] <= 0.10,
                      "sync_within_1.5x_of_ceiling": out["sync"]["vs_ceiling"] <= 1.5}
    print(json.dumps(out, indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    return 0 if all(out["targets"].values()) else 1


def main(argv=None) -> int:
    a = parse(argv)
    return worker(a) if a.worker else launch(a)


if __name__ == "__main__":
    sys.exit(main())
