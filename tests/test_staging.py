"""Device placement and the staged Communicator, on the CPU.

The staged Communicator (zerompi/comm/staging.py) is run with HostTransfers: the "device"
arrays are NumPy arrays that the host Communicator is never allowed to see (asserted on
every call), so every copy down and up is exercised. Its results must equal the host
Communicator's bit for bit, and the float64 oracle within tolerance, at N = 1..4.
The CuPy transfers themselves need a GPU (scripts/gpu_check.sh).

Run by pytest, this file launches itself under mpiexec (``python tests/test_staging.py``);
with ``--cupy`` the device arrays are CuPy arrays and the transfers CuPy's (tests/test_gpu.py).
"""
import ctypes
import json
import sys

import numpy as np
import pytest

from zerompi.comm import device
from zerompi.errors import ConfigError

LENGTHS = (1, 37, 4099, 100_003)


# ---- the part that runs on every rank -----------------------------------------------------
def run_cases(on_gpu: bool = False) -> None:
    from mpi4py import MPI

    from tests.test_comm import rank_input, rank_order_fp32, within
    from zerompi.optim import impl
    from zerompi.comm.communicator import Communicator
    from zerompi.layout import FlatLayout
    from zerompi.comm.staging import CupyTransfers, HostTransfers, StagedCommunicator

    impl.use_impl("auto", verbose=False)
    on_device = []                                  # every "device" array made below (NumPy stand-ins)
    if on_gpu:
        import cupy as xp
        from zerompi.comm.device import place
        place("gpu", MPI.COMM_WORLD)
        transfers, host_array = CupyTransfers(), xp.asnumpy
    else:
        xp, transfers, host_array = np, HostTransfers(), np.asarray

    class NoDeviceBuffers(Communicator):
        """The host Communicator, refusing any buffer that is device memory."""

        def _refuse(self, *bufs):
            for b in bufs:
                assert not any(np.shares_memory(b, d) for d in on_device), "a device buffer reached MPI"

        def ireduce_scatter(self, send, out, *a, **k):
            self._refuse(send, out)
            return super().ireduce_scatter(send, out, *a, **k)

        def iall_gather(self, buf, tag=None, logical_block=None, sig=None):
            self._refuse(buf)
            return super().iall_gather(buf, tag, logical_block, sig)

        def all_reduce(self, buf, scale=1.0):
            self._refuse(buf)
            return super().all_reduce(buf, scale)

    host = Communicator(MPI.COMM_WORLD)
    staged = StagedCommunicator(NoDeviceBuffers(MPI.COMM_WORLD), transfers)
    n, me = host.size, host.rank
    results = []

    def dev(a):
        a = xp.array(a, copy=True)
        if not on_gpu:
            on_device.append(a)
        return a

    def report(case, bits_differ, wrong=0):
        tot = host.mpi.allreduce(np.array([bits_differ, wrong]))
        results.append({"case": case, "bits_differ": int(tot[0]), "wrong": int(tot[1])})

    def differ(a, b) -> int:
        a, b = host_array(a), host_array(b)
        return int(np.count_nonzero(a.view(np.uint8) != b.view(np.uint8)))

    for dname, dtype in (("fp16", np.float16), ("fp32", np.float32)):
        for length in LENGTHS:
            bucket = FlatLayout([("l", [("p", (length,))])], n, bucket_numel=length, align=4).buckets[0]
            k, lo, hi = bucket.slice_numel, *bucket.slice_bounds(me)
            bufs = []
            for r in range(n):
                b = np.zeros(bucket.numel, dtype)
                b[:bucket.used] = rank_input(r, bucket.used, dtype, 3)
                bufs.append(b)
            x64 = np.array(bufs, np.float64)
            mine = bufs[me]

            # reduce-scatter with scale, then accumulate onto it: host vs staged, and the oracle
            want = np.empty(k, dtype)
            host.reduce_scatter(mine, want, 0.5)
            got = dev(np.full(k, np.nan, dtype))
            staged.reduce_scatter(dev(mine), got, 0.5)
            report(f"{dname} L={length} reduce_scatter", differ(got, want),
                   within(host_array(got), x64.sum(0)[lo:hi] * 0.5, np.abs(x64).sum(0)[lo:hi] * 0.5, n))
            exact = rank_order_fp32([b[lo:hi] for b in bufs], 0.5)
            report(f"{dname} L={length} reduce_scatter rank order", differ(got, exact))
            prior = want.copy()
            host.reduce_scatter(mine, want, 0.25, accumulate=True)
            staged.reduce_scatter(dev(mine), got, 0.25, accumulate=True)
            report(f"{dname} L={length} reduce_scatter accumulate", differ(got, want),
                   within(host_array(got), x64.sum(0)[lo:hi] * 0.25 + prior,
                          np.abs(x64).sum(0)[lo:hi] * 0.25 + np.abs(prior), n + 1))

            # two in flight, waited in reverse order
            outs = [dev(np.full(k, np.nan, dtype)) for _ in range(2)]
            hs = [staged.ireduce_scatter(dev(mine), outs[0]), staged.ireduce_scatter(dev(mine * 2), outs[1])]
            while not all(h.test() for h in hs):
                pass
            for h in reversed(hs):
                h.wait()
                h.wait()
            want2 = np.empty(k, dtype)
            host.reduce_scatter(mine * 2, want2)
            host.reduce_scatter(mine, want)
            report(f"{dname} L={length} ireduce_scatter x2", differ(outs[0], want) + differ(outs[1], want2))

            # all-gather in place: only the own slice is read, the whole bucket written
            # (new values: a pooled host buffer may still hold this rank's earlier inputs)
            fresh = [rank_input(r, bucket.numel, dtype, 4) for r in range(n)]
            g = dev(np.full(bucket.numel, np.nan, dtype))
            g[lo:hi] = xp.asarray(fresh[me][lo:hi])
            staged.all_gather(g)
            full = np.concatenate([fresh[r][r * k:(r + 1) * k] for r in range(n)])
            report(f"{dname} L={length} all_gather", differ(g, full))

            # all-reduce in place
            a = dev(mine)
            staged.all_reduce(a, 1.0 / n)
            b = mine.copy()
            host.all_reduce(b, 1.0 / n)
            report(f"{dname} L={length} all_reduce", differ(a, b))

    # Pinned buffers are pooled: two of each (bucket, slice) shape were ever needed at once.
    expected = sum(2 * (FlatLayout([("l", [("p", (L,))])], n, bucket_numel=L, align=4).buckets[0].numel
                        + FlatLayout([("l", [("p", (L,))])], n, bucket_numel=L, align=4).buckets[0].slice_numel)
                   * np.dtype(d).itemsize for d in (np.float16, np.float32) for L in LENGTHS)
    if me == 0:
        for r in results:
            print(json.dumps(r))
        print(json.dumps({"pinned": staged.pinned_bytes, "pinned_expected": expected, "staged": staged.staged}))


# ---- the pytest part ----------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_staged_collectives_equal_the_host_ones(n):
    from tests.mpirun import run_mpi
    proc = run_mpi(n, [__file__], timeout=90)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    cases = [r for r in lines if "case" in r]
    footer = next(r for r in lines if "pinned" in r)
    assert len(cases) == 2 * len(LENGTHS) * 6, proc.stdout
    bad = [r for r in cases if r["bits_differ"] or r["wrong"]]
    assert not bad, bad
    assert footer["pinned"] == footer["pinned_expected"]
    assert footer["staged"]["to_host_bytes"] > 0 and footer["staged"]["to_device_bytes"] > 0


@pytest.mark.parametrize("n", [2, 3])
def test_engine_on_the_staged_communicator_matches_the_host_one(n):
    """The engine uses nothing of the Communicator that staging lacks, and every stage trains
    to the same bits through it (tests/drivers/staged_engine.py)."""
    from tests.mpirun import ROOT, run_mpi
    proc = run_mpi(n, [ROOT / "tests" / "drivers" / "staged_engine.py"], timeout=120)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 8, proc.stdout
    assert all(r["ranks_differing"] == 0 and r["trained"] and r["staged_bytes"] > 0 for r in rows), rows


class FakeComm:
    """What device.place asks of an MPI communicator (a node of `size` ranks)."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Split_type(self, kind, key=0):
        return FakeNode(self.rank, self.size)


class FakeNode(FakeComm):
    def Get_size(self):
        return self.size

    def Free(self):
        pass


def test_place_binds_local_rank_modulo_gpus():
    bound = []
    bind = lambda i: (bound.append(i) or "xp-gpu", "Fake GPU")
    for rank, want in ((0, 0), (1, 1), (2, 0), (5, 1)):
        p = device.place("gpu", FakeComm(rank, 6), probe=lambda: (2, ""), bind=bind)
        assert (p.kind, p.gpu, p.xp, p.local_rank, p.local_size) == ("gpu", want, "xp-gpu", rank, 6)
        assert "shared by 6 local ranks" in p.describe()
    assert bound == [0, 1, 0, 1]
    auto = device.place("auto", FakeComm(3, 4), probe=lambda: (4, ""), bind=bind)
    assert (auto.kind, auto.gpu) == ("gpu", 3)


def test_place_without_a_gpu():
    none = lambda: (0, "ImportError: No module named 'cupy'")
    p = device.place("auto", FakeComm(0, 2), probe=none)
    assert p.kind == "cpu" and p.xp is np and "No module named 'cupy'" in p.note
    assert device.place("cpu", FakeComm(1, 2), probe=lambda: 1 / 0).kind == "cpu"   # cpu never probes
    with pytest.raises(ConfigError, match=r"device='gpu' needs CuPy and a visible GPU \(ImportError"):
        device.place("gpu", FakeComm(0, 2), probe=none)
    with pytest.raises(ConfigError, match="device='tpu' is not allowed; use auto, cpu or gpu"):
        device.place("tpu", FakeComm(0, 1))


def test_place_probes_this_machine():
    from mpi4py import MPI
    count, why = device.probe_gpus()
    p = device.place("auto", MPI.COMM_WORLD)
    assert (p.local_rank, p.local_size) == (0, 1)
    if count == 0:
        assert p.kind == "cpu" and why
        with pytest.raises(ConfigError):
            device.place("gpu", MPI.COMM_WORLD)


def test_banner_names_where_the_buffers_are():
    class Staged:
        path = "staged through pinned host buffers"

    gpu = device.Placement("gpu", np, 1, 4, gpu=1, gpu_count=2, name="Fake GPU")
    text = device.describe_buffers(gpu, Staged())
    assert text.startswith("device buffers on gpu 1 of 2 (Fake GPU, shared by 4 local ranks; CuPy), "
                           "collectives staged through pinned host buffers (MPI CUDA-aware: ")
    assert device.describe_buffers(None, Staged()) == "host buffers (NumPy)"
    cpu = device.Placement("cpu", np, 0, 1, note="no GPU: CuPy sees no GPU")
    assert device.describe_buffers(cpu, Staged()) == "host buffers (NumPy); no GPU: CuPy sees no GPU"


def test_cuda_awareness_query_and_override():
    class Lib:
        def __init__(self, answer):
            self.MPIX_Query_cuda_support = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: answer)

    assert device.mpi_cuda_aware({}, Lib(1)) == (True, "MPIX_Query_cuda_support() = 1")
    assert device.mpi_cuda_aware({}, Lib(0))[0] is False
    assert device.mpi_cuda_aware({}, object()) == (False, "the MPI library has no MPIX_Query_cuda_support")
    assert device.mpi_cuda_aware({"ZEROMPI_CUDA_AWARE": "1"}, Lib(0)) == (True, "ZEROMPI_CUDA_AWARE=1")
    with pytest.raises(ConfigError, match="ZEROMPI_CUDA_AWARE='yes' is not allowed"):
        device.mpi_cuda_aware({"ZEROMPI_CUDA_AWARE": "yes"})
    # The library this test runs with: the MPICH and Open MPI wheels are not CUDA-aware.
    aware, how = device.mpi_cuda_aware({})
    assert aware is False and how


if __name__ == "__main__":
    run_cases(on_gpu="--cupy" in sys.argv[1:])
    sys.exit(0)
