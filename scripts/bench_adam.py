"""Bandwidth of the fused AdamW kernel against the NumPy reference and a plain copy, same run.

    python scripts/bench_adam.py --json results/bench_adam.json        # 1M, 16M, 64M parameters
    python scripts/bench_adam.py --bar                                  # exit 1 if the CPU bar is missed

Accounting, every column alike: 28 bytes per parameter in fp16 mode, the floor of one
AdamW step on a shard (read the fp16 gradient 2 B and the fp32 master, m, v 12 B; write
master, m, v 12 B and the fp16 parameter copy 2 B). ``fused_gbps`` and ``numpy_gbps``
are 28 * n / seconds of one update of n parameters; ``copy_gbps`` copies a 14 * n-byte
buffer (NumPy copy on the CPU, device-to-device on the GPU) and counts read + written,
also 28 * n bytes. ``prepass_gbps``: the gradient pre-pass (sum of squares + non-finite
flag), 2 B per parameter read. Sizes are n = 2**20 * M. Times are medians of --repeats
runs after one warm-up, the three measured in interleaved rounds so a drift in machine
load hits each alike; the CPU runs on one thread. One JSON record per (backend, size).

Bar (issue 4), CPU at 64M: fused_gbps >= 0.5 * copy_gbps and >= 10 * numpy_gbps.
"""
import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")    # one thread: the bar is per core

import argparse       # noqa: E402
import datetime       # noqa: E402
import json           # noqa: E402
import statistics     # noqa: E402
import sys            # noqa: E402
import time           # noqa: E402

import numpy as np    # noqa: E402

from suite_doc import cpu_model   # noqa: E402  (scripts/: the machine a table was measured on)
from zerompi.optim import cuda, fused_cpu, reference   # noqa: E402

BYTES_PER_PARAM = 28
SCALARS = reference.adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, step=10, grad_scale=1 / 65536)


def state(xp, n: int, rng):
    """master, m, v (fp32), grad, param_out (fp16): a realistic shard of n parameters."""
    master = xp.asarray(rng.standard_normal(n, dtype=np.float32))
    m = xp.zeros(n, np.float32)
    v = xp.zeros(n, np.float32)
    grad = xp.asarray((rng.standard_normal(n, dtype=np.float32) * 1000).astype(np.float16))
    return master, m, v, grad, xp.empty(n, np.float16)


def measure(named, repeats: int, clock) -> dict:
    """Median seconds of each callable: one warm-up each, then ``repeats`` interleaved rounds."""
    for fn in named.values():
        fn()
    times = {name: [] for name in named}
    for _ in range(repeats):
        for name, fn in named.items():
            times[name].append(clock(fn))
    return {name: statistics.median(ts) for name, ts in times.items()}


def cpu_clock(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def gpu_clock(fn) -> float:
    import cupy
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / 1e3


def plain_copy(xp, n: int):
    """A copy of a 14 * n-byte buffer, as a callable; the buffers live as long as it does."""
    src = xp.ones(BYTES_PER_PARAM // 2 * n, np.uint8)
    dst = xp.empty_like(src)
    return lambda: xp.copyto(dst, src)


def bench_size(backend: str, n: int, repeats: int, numpy_repeats: int) -> dict:
    rng = np.random.default_rng(0)
    if backend == "gpu":
        import cupy as xp
        fused, stats, clock = cuda.adamw_fused_gpu, cuda.grad_stats_fused_gpu, gpu_clock
    else:
        xp = np
        fused, stats, clock = fused_cpu.adamw_fused_cpu, fused_cpu.grad_stats_fused_cpu, cpu_clock
    arrays = state(xp, n, rng)
    ref_arrays = state(xp, n, rng)
    # the copy's buffers go with this dict, before the NumPy reference runs
    fast = measure({"fused": lambda: fused(*arrays, SCALARS),
                    "copy": plain_copy(xp, n),
                    "prepass": lambda: stats(arrays[3])}, repeats, clock)
    slow = measure({"numpy": lambda: reference.adamw_reference(*ref_arrays, SCALARS)}, numpy_repeats, clock)
    gbps = lambda seconds, nbytes: nbytes / seconds / 1e9
    moved = BYTES_PER_PARAM * n
    rec = {
        "backend": backend, "n": n, "bytes_per_param": BYTES_PER_PARAM, "mode": "fp16",
        "fused_gbps": round(gbps(fast["fused"], moved), 3),
        "numpy_gbps": round(gbps(slow["numpy"], moved), 3),
        "copy_gbps": round(gbps(fast["copy"], moved), 3),
        "prepass_gbps": round(gbps(fast["prepass"], 2 * n), 3),
        "fused_s": fast["fused"], "numpy_s": slow["numpy"], "copy_s": fast["copy"], "prepass_s": fast["prepass"],
    }
    rec["fused_over_copy"] = round(rec["fused_gbps"] / rec["copy_gbps"], 3)
    rec["fused_over_numpy"] = round(rec["fused_gbps"] / rec["numpy_gbps"], 2)
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="also write the records, as a JSON list, to PATH")
    p.add_argument("--sizes", default="1,16,64", help="parameter counts in units of 2**20 (default 1,16,64)")
    p.add_argument("--backend", default="all", choices=("all", "cpu", "gpu"))
    p.add_argument("--repeats", type=int, default=9, help="timed runs of fused and copy (median)")
    p.add_argument("--numpy-repeats", type=int, default=5, help="timed runs of the slow NumPy reference")
    p.add_argument("--bar", action="store_true", help="exit 1 when the CPU bar at the largest size is missed")
    a = p.parse_args(argv)
    try:
        sizes = [int(float(s) * 2 ** 20) for s in a.sizes.split(",")]
    except ValueError:
        sys.stderr.write(f"bench_adam: error: --sizes={a.sizes!r} is not a comma-separated list of numbers\n")
        return 2
    backends = []
    if a.backend in ("all", "cpu"):
        if fused_cpu.library() is None:
            sys.stderr.write(f"bench_adam: cpu skipped: {fused_cpu.unavailable_reason()}\n")
        else:
            backends.append("cpu")
    if a.backend in ("all", "gpu"):
        reason = cuda.unavailable_reason()
        if reason:
            sys.stderr.write(f"bench_adam: gpu skipped: {reason}\n")
        else:
            backends.append("gpu")
    header = {"date": datetime.date.today().isoformat(), "cpu": cpu_model(), "threads": 1,
              "fp16_path": fused_cpu.library().zmp_fp16_path().decode() if "cpu" in backends else None,
              "accounting": "28 B/param (fp16 grad + param copy, fp32 master/m/v), read + written; "
                            "copy moves the same 28 B/param (14 B read + 14 B written)"}
    if "gpu" in backends:
        import cupy
        header["gpu"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(json.dumps(header), flush=True)
    records = []
    for backend in backends:
        for n in sizes:
            rec = bench_size(backend, n, a.repeats, a.numpy_repeats)
            records.append(rec)
            print(json.dumps(rec), flush=True)
    bar = None
    cpu = [r for r in records if r["backend"] == "cpu"]
    if cpu:
        big = max(cpu, key=lambda r: r["n"])
        bar = {"bar": f"cpu n={big['n']}: fused_gbps >= 0.5 * copy_gbps and >= 10 * numpy_gbps",
               "fused_over_copy": big["fused_over_copy"], "fused_over_numpy": big["fused_over_numpy"],
               "met": big["fused_over_copy"] >= 0.5 and big["fused_over_numpy"] >= 10}
        print(json.dumps(bar), flush=True)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({**header, "records": records, "cpu_bar": bar}, f, indent=1)
    return 1 if a.bar and bar is not None and not bar["met"] else 0


if __name__ == "__main__":
    sys.exit(main())
