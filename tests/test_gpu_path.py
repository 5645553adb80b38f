"""Every mode of the train job on the GPU's path, run on the CPU: tests/fake_cupy.py's ``cupy`` stands in for CuPy.

The job is placed on a "GPU" whose array module is the stand-in (tests/drivers/gpu_path.py): every engine buffer
and the model's arrays are device arrays that refuse an implicit transfer (``np.asarray``, a buffer of their
memory) and a host array mixed into their arithmetic, as CuPy's do, and every copy between host and device is an
explicit one: the engine's collectives staged through host buffers (comm/staging.py), the TP all-reduce, the SP
all-to-all, the pipeline's messages, the expert all-to-all and the expert reduce of sources each staging their
own. Each run is compared with the same flags on the host's array path (NumPy; the GPT's array layers, the path
CuPy takes): the same losses and the same final parameters' sha256, bit for bit, since NumPy computes both; and
with the CPU's default path (the GPT's C kernels): the losses within float32's rounding. What
the stand-in cannot show is what only a GPU can (the CUDA kernels, CuPy's own arithmetic, pinned copies):
scripts/gpu_check.sh runs these modes there.
"""
import hashlib
import json

import numpy as np
import pytest

from tests.fake_cupy import CupyArray, cupy
from tests.mpirun import run_mpi

GPT = ["--n-layer", "4", "--d-model", "32", "--n-head", "4", "--seq-len", "16", "--batch", "8", "--steps", "3",
       "--eval-every", "3"]
MLP = ["--model", "mlp", "--width", "32", "--depth", "4", "--batch", "12", "--steps", "3"]
MOE = GPT + ["--experts", "4", "--top-k", "2"]
KERNELS_RTOL = 1e-5           # the C kernels' losses against the array code's, 3 steps (docs/kernels.md)


def test_the_stand_in_behaves_as_cupy_towards_numpy():
    """Dispatches what CuPy dispatches, refuses what CuPy refuses: else the bits below would prove less."""
    a = cupy.asarray(np.arange(4.0, dtype=np.float32))
    assert isinstance(np.sqrt(a), CupyArray) and isinstance(np.sum(a * a), CupyArray)
    out = cupy.zeros(4, np.float32)
    assert np.add(a, a, out=out) is out and float(out[3]) == 6.0
    host = np.ones(4, np.float32)
    for refused in (lambda: np.asarray(a), lambda: np.ascontiguousarray(a), lambda: a + host,
                    lambda: hashlib.sha256(a.data), lambda: np.copyto(host, a)):
        with pytest.raises(TypeError):
            refused()
    np.testing.assert_array_equal(a.get(), [0, 1, 2, 3])
    a.get(out=host)
    np.testing.assert_array_equal(host, [0, 1, 2, 3])


def runs_of(proc, flags):
    runs = [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("METRICS ")]
    n = len(flags)
    assert [r["path"] for r in runs] == ["gpu"] * n + ["cpu"] * n + ["c"] * n, proc.stderr[-3000:]
    return zip(runs[:n], runs[n:2 * n], runs[2 * n:])


def check_same_bits(proc, flags):
    """The GPU's path = the host's array path bit for bit; the CPU's C kernels within float32's rounding."""
    for gpu, cpu, c in runs_of(proc, flags):
        what = " ".join(gpu["flags"])
        assert gpu["flags"] == cpu["flags"] == c["flags"]
        np.testing.assert_allclose(gpu["losses"], c["losses"], rtol=KERNELS_RTOL, err_msg=what)
        assert gpu["device"].startswith("gpu 0 of 1 (stand-in") and cpu["device"] == "cpu (NumPy)", what
        assert gpu["staged"]["to_host_bytes"] > 0 and gpu["staged"]["to_device_bytes"] > 0, what
        assert cpu["staged"] == {"to_host_bytes": 0, "to_device_bytes": 0}, what
        assert gpu["losses"] == cpu["losses"], what
        assert gpu["val_losses"] == cpu["val_losses"], what
        assert gpu["final_params_sha256"] == cpu["final_params_sha256"], what


FAST = [GPT + ["--stage", "3", "--batch", "9"], MLP + ["--stage", "2", "--dtype", "fp32"],
        GPT + ["--stage", "1", "--tp", "3", "--n-head", "3", "--d-model", "24", "--batch", "9"]]


def test_the_gpu_path_has_the_host_bits_at_three_ranks():
    """An odd world: stage 3 with a tail, the MLP at stage 2, tensor parallelism over 3 ranks."""
    proc = run_mpi(3, ["tests/drivers/gpu_path.py", json.dumps(FAST)], timeout=300)
    check_same_bits(proc, FAST)


def every_mode(tmp):
    return [
        GPT + ["--stage", "0", "--dtype", "fp32"], GPT + ["--stage", "2", "--dtype", "bf16", "--micro-batches", "2"],
        MLP + ["--stage", "3", "--tp", "2"], GPT + ["--stage", "3", "--tp", "2", "--checkpoint-activations"],
        GPT + ["--stage", "1", "--sp", "2"], GPT + ["--stage", "2", "--tp", "2", "--sp", "2", "--dtype", "fp16"],
        GPT + ["--stage", "3", "--pp", "2", "--micro-batches", "2"],
        GPT + ["--stage", "1", "--pp", "2", "--tp", "2", "--schedule", "1f1b", "--micro-batches", "4"],
        GPT + ["--stage", "2", "--pp", "4", "--schedule", "zb-h1", "--micro-batches", "4"],
        GPT + ["--stage", "3", "--pp", "2", "--chunks", "2", "--schedule", "interleaved", "--micro-batches", "2"],
        MLP + ["--stage", "3", "--pp", "2", "--micro-batches", "2"],
        MOE + ["--stage", "3", "--ep", "2", "--capacity-factor", "1.0"],
        MOE + ["--stage", "1", "--ep", "4", "--micro-batches", "2", "--batch", "16"],
        MOE + ["--stage", "3", "--ep", "2", "--pp", "2", "--micro-batches", "2"],
        MOE + ["--stage", "2", "--ep", "2", "--tp", "2"],
        GPT + ["--stage", "2", "--node-size", "2", "--quantize-weights", "int8", "--quantize-grads", "int4"],
        GPT + ["--stage", "3", "--node-size", "2", "--hpz"],
        GPT + ["--stage", "3", "--offload-optimizer", "cpu"],
        GPT + ["--stage", "3", "--offload-optimizer", "nvme", "--offload-params", "nvme", "--offload-dir",
               str(tmp / "offload")],
        GPT + ["--stage", "2", "--optimizer", "muon", "--dtype", "fp32", "--tp", "2"],
        GPT + ["--stage", "3", "--pp", "2", "--micro-batches", "2", "--save-dir", str(tmp / "pp-ckpt"),
               "--save-every", "2", "--async-save", "--overwrite"],
        GPT + ["--stage", "2", "--replicas", f"gpu-path-{tmp.name}", "--node-size", "2"],
        GPT + ["--stage", "1", "--pp", "2", "--micro-batches", "2", "--pp-grad-reduce", "step"],
        GPT + ["--stage", "3", "--pp", "2", "--micro-batches", "2", "--pp-gather", "step", "--checkpoint-activations"],
        GPT + ["--stage", "2", "--pp", "2", "--sp", "2", "--micro-batches", "2"],
        MOE + ["--stage", "3", "--sp", "2"],
        MOE + ["--stage", "2", "--ep", "2", "--optimizer", "muon", "--dtype", "fp32"],
        GPT + ["--stage", "1", "--pp", "2", "--micro-batches", "2", "--optimizer", "muon", "--dtype", "fp32"],
        GPT + ["--stage", "3", "--clip", "0.5", "--micro-batches", "2", "--tp", "2"],
        GPT + ["--stage", "2", "--shard-size", "2", "--node-size", "2"],
        GPT + ["--stage", "3", "--offload-optimizer", "cpu", "--offload-delayed-update"],
    ]


@pytest.mark.slow
def test_every_mode_on_the_gpu_path_has_the_host_bits(tmp_path):
    """N = 4: tensor, sequence and pipeline parallelism (every schedule kind, the per-step reduce and gather, with
    --tp and --sp), experts over 2 and 4 ranks (with --pp, --tp, --sp, Muon), two levels with qwZ/qgZ and hpZ, shard
    groups, offload to memory, to files and delayed, Muon, bf16/fp16, clipping, asynchronous pipeline checkpoints
    and the in-memory replicas."""
    (tmp_path / "offload").mkdir()
    flags = every_mode(tmp_path)
    proc = run_mpi(4, ["tests/drivers/gpu_path.py", json.dumps(flags)], timeout=900)
    check_same_bits(proc, flags)
    lines = proc.stdout.splitlines()                         # every run says where its buffers are, pipelined too
    assert sum("device buffers on gpu 0 of 1 (stand-in; CuPy)" in line for line in lines) == len(flags)
    assert sum(line.endswith("host buffers (NumPy)") for line in lines) == 2 * len(flags)


def test_a_checkpoint_saved_on_the_gpu_path_resumes_on_the_host(tmp_path):
    """Saved by the device engines at stage 3 (each path in its own folder), the device's resumed at stage 1 on
    every path: the same bits."""
    save = GPT + ["--stage", "3", "--save-dir", str(tmp_path / "ck-{path}"), "--save-every", "2"]
    proc = run_mpi(2, ["tests/drivers/gpu_path.py", json.dumps([save])], timeout=300)
    check_same_bits(proc, [save])
    resume = GPT + ["--stage", "1", "--steps", "5", "--resume", str(tmp_path / "ck-gpu")]
    proc = run_mpi(2, ["tests/drivers/gpu_path.py", json.dumps([resume])], timeout=300)
    check_same_bits(proc, [resume])


def test_the_library_stages_a_host_communicator_for_device_arrays():
    """ZeroEngine(layers, config, comm, xp=cupy) given the default communicator or a Mesh(tp=2): the engine stages
    its collectives itself; every rank's final master the NumPy engine's bits, stages 0-3."""
    proc = run_mpi(4, ["tests/drivers/gpu_library.py"], timeout=300)
    cases = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("CASE ")]
    assert [(c["stage"], c["tp"]) for c in cases] == [(s, tp) for s in range(4) for tp in (1, 2)], proc.stderr
    for c in cases:
        assert c["ranks_differing"] == 0 and c["trained"] and c["staged_bytes"] > 0, c


def test_the_sp_all_to_all_writes_a_device_array_into_the_callers_buffer(monkeypatch):
    """The staged all-to-all into a given device ``out`` (another shape, the same size): written in place, its
    copies timed."""
    from mpi4py import MPI

    from zerompi.comm.alltoall import SPComm
    from zerompi.optim import impl
    monkeypatch.setattr(impl, "is_device", lambda a: isinstance(a, CupyArray))      # as fake_cupy.install() does
    monkeypatch.setattr(impl, "array_module", lambda a: cupy if isinstance(a, CupyArray) else np)
    monkeypatch.setattr(impl, "to_host", lambda a: a.get() if isinstance(a, CupyArray) else np.asarray(a))
    x = cupy.asarray(np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    out = cupy.zeros(24, np.float32)
    sp = SPComm(MPI.COMM_SELF)
    got = sp.all_to_all(x, 2, 1, out=out)
    assert isinstance(got, CupyArray) and got.shape == (2, 3, 4)
    np.testing.assert_array_equal(out.get().reshape(2, 3, 4), x.get())
    assert sp.stats["sp_all_to_all"].seconds > 0
