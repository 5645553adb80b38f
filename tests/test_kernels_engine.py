"""The engine with the fused kernels: same bits as with the NumPy reference, stages 0-3 still identical.

Tolerance: without clipping the fused run must give the reference's exact parameters (the
AdamW and reduce-scatter kernels are 0-ulp, and the pre-pass only decides overflow). With
clipping the clip coefficient comes from the float64 norm, whose summation order differs
from NumPy's, so there the losses are compared to a relative 1e-6.
"""
import json

import numpy as np
import pytest

from zerompi import ZeroConfig, ZeroEngine
from zerompi.optim import fused_cpu

from .mpirun import run_mpi

N = 3
BASE = ["--model", "mlp", "--width", "48", "--depth", "3", "--steps", "6", "--lr", "1e-2", "--bucket-mb", "0.01",
        "--batch", str(8 * N * 2)]
needs_cc = pytest.mark.skipif(fused_cpu.find_compiler() is None, reason="no C compiler: the fused CPU path is off")


@pytest.fixture(scope="module")
def runs():
    """(impl, stage, options) -> metrics, from one MPI job on N ranks."""
    plan = [("numpy", 2, "fp16-micro"), ("fused", 0, "fp16-micro"), ("fused", 1, "fp16-micro"),
            ("fused", 2, "fp16-micro"), ("fused", 3, "fp16-micro"), ("numpy", 3, "fp32-clip"),
            ("fused", 3, "fp32-clip")]
    options = {"fp16-micro": ["--dtype", "fp16", "--micro-batches", "2"],
               "fp32-clip": ["--dtype", "fp32", "--clip", "0.05"]}
    configs = [BASE + ["--optimizer-impl", impl, "--stage", str(stage)] + options[opt] for impl, stage, opt in plan]
    proc = run_mpi(N, ["tests/drivers/train_many.py", json.dumps(configs)], timeout=240)
    metrics = [json.loads(line[8:]) for line in proc.stdout.splitlines() if line.startswith("METRICS ")]
    assert len(metrics) == len(plan)
    return dict(zip(plan, metrics)), proc.stdout


@needs_cc
def test_fused_is_used_and_named_in_the_banner(runs):
    metrics, stdout = runs
    for (impl, _, _), m in metrics.items():
        assert m["optimizer_impl"] == impl
    assert "optimizer: adamw_fused_cpu" in stdout and "optimizer: adamw_reference" in stdout


@needs_cc
def test_fused_equals_reference_and_stages_stay_identical(runs):
    metrics, _ = runs
    shas = {stage: metrics[(impl, stage, "fp16-micro")]["final_params_sha256"]
            for impl, stage, opt in metrics if impl == "fused" and opt == "fp16-micro"}
    assert sorted(shas) == [0, 1, 2, 3]
    assert set(shas.values()) == {metrics[("numpy", 2, "fp16-micro")]["final_params_sha256"]}
    assert metrics[("fused", 0, "fp16-micro")]["steps_applied"] >= 1


@needs_cc
def test_fused_with_clipping_within_tolerance(runs):
    metrics, _ = runs
    ref, fused = metrics[("numpy", 3, "fp32-clip")], metrics[("fused", 3, "fp32-clip")]
    assert ref["losses"][-1] < ref["losses"][0]                   # it trained
    np.testing.assert_allclose(fused["losses"], ref["losses"], rtol=1e-6, atol=0)


@needs_cc
def test_non_finite_gradient_flagged_and_never_applied():
    """One rank, in process: an inf in the fp16 gradient makes the step skip; nothing moves."""
    rng = np.random.default_rng(0)
    layers = [("l0", {"w": rng.standard_normal((5, 7)).astype(np.float32)}),
              ("l1", {"b": rng.standard_normal(9).astype(np.float32)})]
    eng = ZeroEngine(layers, ZeroConfig(stage=2, dtype="fp16", bucket_mb=1e-4, optimizer_impl="fused"))
    try:
        assert eng.optimizer_impl == "fused"
        before = eng.unpadded_master().copy()
        grads = {"l0": {"w": np.ones((5, 7), np.float32)}, "l1": {"b": np.ones(9, np.float32)}}
        grads["l1"]["b"][8] = np.inf
        for i, name in reversed(list(enumerate(["l0", "l1"]))):
            eng.grads_ready(i, grads[name])
        result = eng.step()
        assert result.skipped and eng.step_count == 0
        assert np.array_equal(eng.unpadded_master(), before)
        grads["l1"]["b"][8] = 1.0                                 # a finite step does move them
        for i, name in reversed(list(enumerate(["l0", "l1"]))):
            eng.grads_ready(i, grads[name])
        assert not eng.step().skipped
        assert not np.array_equal(eng.unpadded_master(), before)
    finally:
        eng.close()


def test_bad_optimizer_impl_is_one_line_exit_2():
    proc = run_mpi(1, ["-m", "zerompi.train", "--optimizer-impl", "fast"], timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "zerompi.train: error: optimizer_impl='fast' is not allowed; use one of auto, fused, numpy"]
