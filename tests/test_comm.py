"""Communicator collectives against a NumPy float64 oracle, at N = 1, 2, 3, 4.

Run by pytest, this file launches itself under mpiexec (``python tests/test_comm.py``);
every rank then checks its own results and rank 0 prints one JSON line per case with
the worst error seen over ranks. Buffers are padded to whole slices as the engine pads
a bucket (FlatLayout, padding zeroed), so lengths that do not divide by N are covered.
"""
import json
import sys

import numpy as np
import pytest

DTYPES = {"fp16": np.float16, "fp32": np.float32}
LENGTHS = (1, 37, 4099, 300_001)  # parameter elements in the bucket, before padding: slices shorter
                                  # than the C sum's 16-element step, with tails, and long ones
ALIGN = 4


def rank_input(rank: int, numel: int, dtype, seed: int) -> np.ndarray:
    """Rank's contribution, in the storage dtype (any rank can compute any other's)."""
    rng = np.random.default_rng([seed, rank])
    return rng.uniform(-1.0, 1.0, numel).astype(dtype)


def rank_order_fp32(rows, scale=1.0, prior=None):
    """The promised arithmetic: fp32 sum in rank order, then scale, then + prior, cast back."""
    acc = rows[0].astype(np.float32)
    for r in rows[1:]:
        acc = acc + r.astype(np.float32)
    if scale != 1.0:
        acc = acc * np.float32(scale)
    if prior is not None:
        acc = acc + prior.astype(np.float32)
    return acc.astype(rows[0].dtype)


def within(got, want64, mag64, n) -> int:
    """Elements outside n * eps(dtype) * sum|x| (+ the smallest subnormal) of the float64 answer."""
    fi = np.finfo(got.dtype)
    tol = n * float(fi.eps) * mag64 + float(fi.smallest_subnormal)
    return int(np.count_nonzero(~(np.abs(got.astype(np.float64) - want64) <= tol)))


# ---- the part that runs on every rank -----------------------------------------------
def run_cases() -> None:
    from mpi4py import MPI

    from zerompi.optim import impl
    from zerompi.comm.communicator import Communicator
    from zerompi.layout import FlatLayout
    impl.use_impl("auto", verbose=False)        # the local sum the engine would use
    comm = Communicator(MPI.COMM_WORLD)
    n, me = comm.size, comm.rank
    results = []

    def report(case, wrong, bits_differ=0, pad_nonzero=0):
        tot = comm.mpi.allreduce(np.array([wrong, bits_differ, pad_nonzero]))
        results.append({"case": case, "wrong": int(tot[0]), "bits_differ": int(tot[1]), "pad_nonzero": int(tot[2])})

    for dname, dtype in DTYPES.items():
        for length in LENGTHS:
            bucket = FlatLayout([("layer", [("p", (length,))])], n, bucket_numel=length, align=ALIGN).buckets[0]
            k, lo, hi = bucket.slice_numel, *bucket.slice_bounds(me)

            def inputs(seed):
                """(padded inputs of every rank, float64 sum, float64 sum of |x|) for the whole bucket."""
                bufs = []
                for r in range(n):
                    b = np.zeros(bucket.numel, dtype)            # padding joins the sum: zero, as in the engine
                    b[:bucket.used] = rank_input(r, bucket.used, dtype, seed)
                    bufs.append(b)
                x64 = np.array(bufs, np.float64)
                return bufs, x64.sum(0), np.abs(x64).sum(0)

            # reduce-scatter, blocking, with the engine's scale; then accumulate onto it
            bufs, want, mag = inputs(1)
            scale = 1.0 / n
            out = np.full(k, np.nan, dtype)
            comm.reduce_scatter(bufs[me], out, scale)
            exact = rank_order_fp32([b[lo:hi] for b in bufs], scale)
            report(f"{dname} L={length} reduce_scatter", within(out, want[lo:hi] * scale, mag[lo:hi] * scale, n),
                   int(np.count_nonzero(out.view(np.uint8) != exact.view(np.uint8))),
                   int(np.count_nonzero(out[max(0, bucket.used - lo):])) if hi > bucket.used else 0)
            bufs2, want2, mag2 = inputs(2)
            prior = out.copy()
            comm.reduce_scatter(bufs2[me], out, scale, accumulate=True)
            exact2 = rank_order_fp32([b[lo:hi] for b in bufs2], scale, prior)
            report(f"{dname} L={length} reduce_scatter accumulate",
                   within(out, want2[lo:hi] * scale + prior, (mag2[lo:hi] * scale + np.abs(prior)), n + 1),
                   int(np.count_nonzero(out.view(np.uint8) != exact2.view(np.uint8))))

            # two non-blocking reduce-scatters in flight, progressed with test(), waited in reverse order
            outs = [np.full(k, np.nan, dtype) for _ in range(2)]
            handles = [comm.ireduce_scatter(bufs[me], outs[0]), comm.ireduce_scatter(bufs2[me], outs[1])]
            while not all(h.test() for h in handles):
                pass
            for h in reversed(handles):
                h.wait()
                h.wait()                                        # idempotent
            for tag, o, w, m, bb in (("a", outs[0], want, mag, bufs), ("b", outs[1], want2, mag2, bufs2)):
                ex = rank_order_fp32([b[lo:hi] for b in bb])
                report(f"{dname} L={length} ireduce_scatter {tag}", within(o, w[lo:hi], m[lo:hi], n),
                       int(np.count_nonzero(o.view(np.uint8) != ex.view(np.uint8))))

            # all-gather in place, blocking and non-blocking: bit-exact copies
            full = np.concatenate([bufs[r][r * k:(r + 1) * k] for r in range(n)])
            for blocking in (True, False):
                g = np.full(bucket.numel, np.nan, dtype)
                g[lo:hi] = bufs[me][lo:hi]
                if blocking:
                    comm.all_gather(g)
                else:
                    h = comm.iall_gather(g)
                    while not h.test():
                        pass
                    h.wait()
                name = "all_gather" if blocking else "iall_gather"
                report(f"{dname} L={length} {name}", int(np.count_nonzero(g.view(np.uint8) != full.view(np.uint8))))

            # all-reduce in place: equals reduce-scatter then all-gather, bit for bit
            a = bufs[me].copy()
            comm.all_reduce(a, scale)
            exact_all = rank_order_fp32(bufs, scale)
            report(f"{dname} L={length} all_reduce", within(a, want * scale, mag * scale, n),
                   int(np.count_nonzero(a.view(np.uint8) != exact_all.view(np.uint8))))

    st = comm.snapshot()
    # Receive scratch: N-1 slices per pooled buffer (none for the own slice), at most two
    # buffers of each (length, dtype) held at once (the two reduce-scatters in flight above).
    scratch = sum(2 * (n - 1) * FlatLayout([("l", [("p", (length,))])], n, bucket_numel=length,
                                            align=ALIGN).buckets[0].slice_numel * np.dtype(d).itemsize
                  for d in DTYPES.values() for length in LENGTHS)
    if me == 0:
        for r in results:
            print(json.dumps(r))
        print(json.dumps({"stats": st, "ranks": n, "scratch": comm.scratch_bytes, "scratch_expected": scratch,
                          "checks": comm.check_stats.as_dict()}))
    comm.free_scratch()


# ---- the pytest part ----------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_collectives_match_float64_oracle(n):
    from tests.mpirun import run_mpi
    proc = run_mpi(n, [__file__], timeout=90)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    cases = [r for r in lines if "case" in r]
    footer = next(r for r in lines if "stats" in r)
    stats = footer["stats"]
    # 2 dtypes x len(LENGTHS) lengths x (2 RS + 2 iRS + 2 AG + 1 AR)
    assert len(cases) == 2 * len(LENGTHS) * 7, proc.stdout
    bad = [r for r in cases if r["wrong"] or r["bits_differ"] or r["pad_nonzero"]]
    assert not bad, bad
    # per-rank accounting: 4 RS calls per (dtype, length), plus one inside each all-reduce; the counters
    # hold the collectives' data only (the bytes of the slices each rank sends)
    assert stats["reduce_scatter"]["calls"] == 2 * len(LENGTHS) * 5
    assert stats["all_gather"]["calls"] == 2 * len(LENGTHS) * 3
    # the checks (comm/signature.py), counted apart: one 64-byte header to each peer per collective, the
    # all-reduce's all-gather unchecked (its reduce-scatter checked the same buffer): 4 + 2 + 1 per case
    checks = footer["checks"]
    assert checks["calls"] == (2 * len(LENGTHS) * 7 if n > 1 else 0), checks
    assert checks["bytes"] == checks["calls"] * 64 * (n - 1), checks
    assert footer["scratch"] == footer["scratch_expected"]


def test_tolerance_check_catches_a_wrong_sum():
    """The oracle comparison used above fails when one rank's contribution is missing."""
    rows = [rank_input(r, 1000, np.float16, 5) for r in range(3)]
    x64 = np.array(rows, np.float64)
    good = rank_order_fp32(rows)
    assert within(good, x64.sum(0), np.abs(x64).sum(0), 3) == 0
    bad = good.copy()
    i = int(np.argmax(np.abs(rows[2])))
    bad[i] = rows[0][i] + rows[1][i]                   # rank 2's term dropped
    assert within(bad, x64.sum(0), np.abs(x64).sum(0), 3) == 1


if __name__ == "__main__":
    run_cases()
    sys.exit(0)
