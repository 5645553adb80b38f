"""Offloaded optimizer state, measured (issue 20): ``python scripts/bench_offload.py --dir DIR``.

For each mode (none, cpu, nvme) it runs ``mpiexec -n N python -m zerompi.train`` on an MLP of
about ``--params`` parameters and reports, as JSON on stdout: the optimizer's time per step
(the median of the engine's "opt" timer), the bytes the optimizer read and wrote per step (nvme:
its rows, 12 bytes per shard element each way), the peak resident memory of a rank (getrusage
of the ranks) and the ledger's bytes by place. In the same run it measures the ceiling: the
sequential write (with fsync) and read bandwidth of a file of the same size in the same DIR.
The targets (docs/offload.md): the nvme optimizer holds at most 4 buckets' rows in memory,
streams at >= 0.7 of the ceiling (both directions counted), and its step is no slower than
reading and writing the state once at the ceiling.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def disk_ceiling(directory: str, nbytes: int, repeats: int = 3) -> dict:
    """Sequential write and read bandwidth of a file of ``nbytes`` in ``directory``, medians: the write
    as the offload writes (through the page cache, no fsync per step) and, beside it, with fsync."""
    buf = np.ones(min(nbytes, 64 << 20) // 4, np.float32)
    writes, synced, reads = [], [], []
    for _ in range(repeats):
        fd, path = tempfile.mkstemp(dir=directory)
        try:
            t = time.perf_counter()
            done = 0
            while done < nbytes:
                done += os.pwrite(fd, memoryview(buf).cast("B")[:min(buf.nbytes, nbytes - done)], done)
            writes.append(nbytes / (time.perf_counter() - t))
            os.fsync(fd)
            synced.append(nbytes / (time.perf_counter() - t))
            out = bytearray(buf.nbytes)
            t = time.perf_counter()
            done = 0
            while done < nbytes:
                got = os.preadv(fd, [memoryview(out)[:min(len(out), nbytes - done)]], done)
                done += got
            reads.append(nbytes / (time.perf_counter() - t))
        finally:
            os.close(fd)
            os.unlink(path)
    return {"write_bytes_per_s": statistics.median(writes), "read_bytes_per_s": statistics.median(reads),
            "write_fsync_bytes_per_s": statistics.median(synced)}


def run(mode: str, args, directory: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.json"
        cmd = [mpiexec(), "-n", str(args.ranks), sys.executable, "-m", "zerompi.train", "--model", "mlp",
               "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.ranks * 2),
               "--steps", str(args.steps), "--stage", str(args.stage), "--dtype", "fp32",
               "--bucket-mb", str(args.bucket_mb), "--offload-optimizer", mode, "--offload-dir", directory,
               "--log-every", "1000", "--metrics-json", str(metrics)]
        # A wrapper process per run: its children's peak RSS is this run's largest rank (ru_maxrss, KiB).
        wrapper = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
                   "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        out = subprocess.run([sys.executable, "-c", wrapper, *cmd], check=True, capture_output=True, text=True,
                             cwd=str(ROOT), timeout=1800,
                             env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
        rss = int(out.stdout.split()[-1])
        m = json.loads(metrics.read_text())
    shard = m["padded_params"] // args.ranks
    return {
        "mode": mode,
        "optimizer_s": m["time_breakdown_s"]["optimizer"],      # the median step's optimizer time
        "step_s": m["step_time_s"],
        "optimizer_bytes_read_per_step": 12 * shard if mode == "nvme" else 0,
        "optimizer_bytes_written_per_step": 12 * shard if mode == "nvme" else 0,
        "peak_rss_bytes": rss * 1024,
        "memory_bytes_by_place": m["memory_bytes_by_place"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="the folder of the offload files (and of the ceiling's file)")
    p.add_argument("--width", type=int, default=3584)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--bucket-mb", type=float, default=16.0)
    p.add_argument("--modes", default="none,cpu,nvme")
    args = p.parse_args()
    params = args.depth * (args.width * args.width + args.width)
    state = 12 * params // args.ranks
    ceiling = disk_ceiling(args.dir, state)
    rows = [run(mode, args, args.dir) for mode in args.modes.split(",")]
    both = 1 / (1 / ceiling["read_bytes_per_s"] + 1 / ceiling["write_bytes_per_s"])   # read then write, per byte
    for r in rows:
        if r["mode"] == "nvme":
            moved = r["optimizer_bytes_read_per_step"] + r["optimizer_bytes_written_per_step"]
            r["streamed_bytes_per_s"] = moved / r["optimizer_s"]
            r["of_ceiling"] = r["streamed_bytes_per_s"] / (2 * both)
            r["state_once_at_ceiling_s"] = state / both
            host = r["memory_bytes_by_place"]["host"].get("buffers", 0)
            r["resident_optimizer_bytes"] = host
            bucket = max(args.width * args.width + args.width, args.bucket_mb * 2 ** 20 / 4)   # buckets hold whole layers
            r["buckets_of_rows_resident"] = host / (12 * bucket / args.ranks)
    print(json.dumps({"params": params, "ranks": args.ranks, "stage": args.stage,
                      "state_bytes_per_rank": state, "ceiling": ceiling, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
