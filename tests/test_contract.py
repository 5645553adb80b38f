"""Issue: no silent wrong results. The engine checks the cross-rank contract (engine/contract.py)
and its own API; each case here gave a wrong answer, a hang or a traceback before.

Multi-rank cases run tests/drivers/contract.py under mpiexec with a timeout; the oracles are the
same run with every rank in the same order (bits), and a float64 NumPy AdamW first step.
"""
import json
import time

import numpy as np
import pytest

import zerompi
from tests.mpirun import ROOT, run_mpi
from zerompi import ConfigError, UsageError, ZeroConfig, ZeroEngine
from zerompi.comm.blocks import MAX_BLOCK, block_layout
from zerompi.engine.faults import GradientGuard, _all_finite
from zerompi.errors import NonFiniteError

DRIVER = ROOT / "tests" / "drivers" / "contract.py"


def driver(n, case, stage, timeout=90, check=True):
    proc = run_mpi(n, [DRIVER, case, stage], timeout=timeout, check=check)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else None), proc


def one_error(errors, kind="MismatchError"):
    """Every rank raised the same error type with the same message; returns the message."""
    assert all(e[0] == kind for e in errors), errors
    assert len({e[1] for e in errors}) == 1, errors
    return errors[0][1]


# ---- 1. reductions do not depend on the order gradients arrive in ---------------------------
@pytest.mark.parametrize("n,stage", [(2, 0), (2, 2), (3, 1), (3, 3), (4, 2)])
def test_any_hand_back_order_gives_the_same_bits(n, stage):
    out, _ = driver(n, "order", stage)
    assert out["bits_equal"], out
    assert out["step1_worst"] < 1e-6, out          # first AdamW step: lr against the sign of the mean


# ---- 2. step() while a layer is unsharded --------------------------------------------------
def small():
    rng = np.random.default_rng(0)
    return [("a", {"x": rng.standard_normal(8).astype(np.float32)}),
            ("b", {"y": rng.standard_normal(8).astype(np.float32)})]


def hand_back(eng):
    for i, name in ((1, "y"), (0, "x")):
        eng.grads_ready(i, {name: np.ones(8, np.float32)})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_while_unsharded_is_refused(stage):
    eng = ZeroEngine(small(), ZeroConfig(stage=stage, dtype="fp32", bucket_mb=1e-4))
    with eng.unsharded(0):
        hand_back(eng)
        with pytest.raises(UsageError, match=r"step\(\) while layers \[0\] are unsharded .*reshard"):
            eng.step()
    assert eng.step().step == 1       # once resharded, the same step goes ahead
    eng.close()


# ---- 3. views held across step() -----------------------------------------------------------
@pytest.mark.parametrize("n,stage", [(2, 1), (3, 2)])
def test_views_held_across_steps_are_current(n, stage):
    out, _ = driver(n, "stale", stage)
    assert out["stale_reads"] == 0, out


# ---- 4. initial values ----------------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 3])
def test_different_initial_values_stop_every_rank(stage):
    out, _ = driver(3, "init_check", stage)
    msg = one_error(out["errors"])
    assert msg.startswith("initial values differ between ranks: parameter 'w0' of layer 'l0' has 3 different values")
    assert "rank 1 (first element" in msg and "init_values='broadcast'" in msg


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_broadcast_takes_rank_0s_values(stage):
    out, _ = driver(3, "init_broadcast", stage)
    assert all(e[0] is None for e in out["errors"]), out


# ---- 5. lr and unshard order ------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 3])
def test_different_lr_stops_every_rank_before_the_update(stage):
    out, _ = driver(3, "lr", stage)
    msg = one_error(out["errors"])
    assert msg == ("ranks called step() with different learning rates: lr=0.001 on ranks 0, 2, lr=0.002 on rank 1; "
                   "every rank must use the same lr (and schedule)")
    assert out["unchanged"]


def test_different_unshard_order_stops_every_rank_at_the_gather():
    """The gather carries its bucket in its signature (comm/signature.py): detected at the gather
    itself, so no rank ever computes with another layer's values (found only in step(), it was)."""
    out, _ = driver(3, "gather_order", 3)
    msg = one_error(out["errors"])
    assert msg.startswith("collective mismatch between ranks: all_gather of 48 float32 (bucket 0, step 1) on ranks "
                          "0, 2; all_gather of 48 float32 (bucket 1, step 1) on rank 1 (they differ in: bucket)"), msg
    assert out["computed"] == [[], [], []], out["computed"]


# ---- 6. parameter arrays -----------------------------------------------------------------------
@pytest.mark.parametrize("value,what", [(np.arange(4), "dtype int64"), (np.ones(4, bool), "dtype bool"),
                                        (np.ones(4, np.complex64), "dtype complex64"), ([1.0, 2.0], "a list")])
def test_non_float_parameters_are_refused(value, what):
    with pytest.raises(UsageError, match=f"parameter 'p' of layer 'l' is {what}; a floating array"):
        ZeroEngine([("l", {"p": value})], ZeroConfig(stage=2, dtype="fp32"))


def test_float64_parameters_are_accepted():
    eng = ZeroEngine([("l", {"p": np.full(4, 0.25)})], ZeroConfig(stage=2, dtype="fp32"))
    assert eng.full_parameters()["p"].tolist() == [0.25] * 4
    eng.close()


# ---- 7. the Communicator checks its arguments -------------------------------------------------
def test_communicator_is_public_and_checks_dtypes_and_lengths():
    comm = zerompi.Communicator()
    send = np.ones(8, np.float16)
    with pytest.raises(UsageError, match=r"reduce_scatter out: 8 elements of float32; use 8 elements \(one slice\) "
                                         r"of float16"):
        comm.reduce_scatter(send, np.zeros(8, np.float32))
    with pytest.raises(UsageError, match="reduce_scatter out: 4 elements of float16; use 8"):
        comm.reduce_scatter(send, np.zeros(4, np.float16))
    with pytest.raises(UsageError, match="an array of int32 is not allowed; "
                                         "use a float16 or float32 or bfloat16 array"):
        comm.reduce_scatter(np.ones(8, np.int32), np.zeros(8, np.int32))
    with pytest.raises(UsageError, match="not contiguous"):
        comm.all_gather(np.ones(16, np.float32)[::2])
    out = np.zeros(8, np.float16)
    comm.reduce_scatter(send, out, scale=0.5)
    assert out.tolist() == [0.5] * 8


# ---- 8. NCCL in fp16 (host stand-in; tests/drivers/nccl_host.py) -------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_nccl_fp16_sum_does_not_overflow(n):
    proc = run_mpi(n, [ROOT / "tests" / "drivers" / "nccl_host.py"], timeout=90)
    big = next(json.loads(line) for line in proc.stdout.splitlines() if '"loss_scaled"' in line)
    assert big["loss_scaled"] == [40000.0, 40000.0], big


# ---- 9. an exception on one rank ends a library job --------------------------------------------
def test_library_exception_on_one_rank_ends_the_job_quickly():
    t = time.monotonic()
    _, proc = driver(3, "raise", 2, timeout=60, check=False)
    assert proc.returncode != 0
    assert "rank 1 failed" in proc.stderr and "injected failure on rank 1" in proc.stderr
    assert time.monotonic() - t < 45        # the watchdog's default is 300 s


def test_abort_hook_can_be_left_alone():
    import sys
    before = sys.excepthook
    try:
        sys.excepthook = sys.__excepthook__
        ZeroEngine(small(), ZeroConfig(dtype="fp32", abort_on_exception=False)).close()
        assert sys.excepthook is sys.__excepthook__
        ZeroEngine(small(), ZeroConfig(dtype="fp32")).close()
        assert getattr(sys.excepthook, "zerompi_abort_hook", False)
    finally:
        sys.excepthook = before


# ---- 10. the GPU paths that can be run on the CPU ------------------------------------------------
class DeviceArray(np.lib.mixins.NDArrayOperatorsMixin):
    """A CuPy stand-in: ufuncs dispatch to it, but it cannot become a NumPy array."""

    def __init__(self, a):
        self.a = np.asarray(a)
        self.size = self.a.size

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        arrays = [x.a if isinstance(x, DeviceArray) else x for x in inputs]
        return DeviceArray(getattr(ufunc, method)(*arrays, **kwargs))

    def all(self):
        return DeviceArray(self.a.all())

    def __bool__(self):
        return bool(self.a)


def test_non_finite_report_works_on_device_arrays():
    from mpi4py import MPI
    assert _all_finite(DeviceArray([1.0, 2.0])) and not _all_finite(DeviceArray([1.0, np.nan]))
    guard = GradientGuard(rank=0, dtype=np.float32, max_skipped_steps=3)
    with pytest.raises(NonFiniteError, match=r"first in bucket 0, in the slice rank 0 reduces.*every parameter is "
                                             r"still finite"):
        guard.on_skip(1, MPI.COMM_SELF, [DeviceArray([np.nan])], 1.0, master=DeviceArray([1.0]))
    with pytest.raises(NonFiniteError, match=r"already non-finite before this step \(the master on rank 0\)"):
        guard.on_skip(2, MPI.COMM_SELF, [DeviceArray([np.nan])], 1.0, master=DeviceArray([np.inf]))


def test_nccl_set_up_is_timed_by_the_watchdog():
    t = time.monotonic()
    proc = run_mpi(2, [ROOT / "tests" / "drivers" / "nccl_hang.py", "2"], timeout=60, check=False)
    assert proc.returncode == 3, proc.stderr           # EXIT_TIMEOUT
    assert "collective timeout" in proc.stderr and "nccl: creating the communicator" in proc.stderr
    assert "created" not in proc.stdout and time.monotonic() - t < 40


def test_gpu_extra_pins_a_cupy_with_non_blocking_get():
    text = (ROOT / "setup.py").read_text()
    assert '"cupy-cuda12x>=13"' in text


# ---- 11. a program that ends without close() ----------------------------------------------------
@pytest.mark.parametrize("stage", [1, 3])
def test_exit_without_close_finishes_collectives_in_flight(stage):
    out, proc = driver(2, "no_close", stage)
    assert out["in_flight"] > 0          # the case does leave collectives in flight
    assert "pending" not in proc.stderr and proc.returncode == 0, proc.stderr


# ---- 12. counts ------------------------------------------------------------------------------------
def test_counts_are_blocks_never_bytes():
    for n, rank, k in ((2, 0, 1), (4, 1, 2 ** 30 + 7), (64, 63, MAX_BLOCK)):   # a 4 GiB fp16 slice and beyond
        sc, sd, rc, rd = block_layout(n, rank, k)
        assert sc == rc == [0 if r == rank else 1 for r in range(n)]
        assert sd == list(range(n)) and rd == [r - (r > rank) for r in range(n)]
        assert max(sd + rd) < 2 ** 31
    with pytest.raises(UsageError, match=f"a slice of {MAX_BLOCK + 1:,} elements is not allowed"):
        block_layout(2, 0, MAX_BLOCK + 1)


# ---- 13. messages ---------------------------------------------------------------------------------
def test_a_gradient_given_as_a_list_is_a_usage_error():
    eng = ZeroEngine(small(), ZeroConfig(stage=2, dtype="fp32"))
    with pytest.raises(UsageError, match=r"gradient 'y' is a list; pass an array .* of shape \(8,\)"):
        eng.grads_ready(1, {"y": [0.0] * 8})
    eng.close()


def test_shape_mismatch_names_the_parameter_and_both_shapes():
    out, _ = driver(3, "shape", 2)
    msg = one_error(out["errors"])
    assert "shape.w1 = [40] on ranks 0, 2, [41] on rank 1" in msg, msg


@pytest.mark.parametrize("lr", [float("inf"), float("nan"), 1e39, -1.0, 0.0])
def test_step_lr_must_be_a_float32_number(lr):
    eng = ZeroEngine(small(), ZeroConfig(stage=1, dtype="fp32"))
    hand_back(eng)
    with pytest.raises(ConfigError, match=r"step\(lr=.*\) is not allowed; use a number > 0 and <= 3.403e\+38"):
        eng.step(lr=lr)
    eng.close()
