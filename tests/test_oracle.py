"""Stage 0..3 on N ranks against the single-process float64 reference of the same training."""
import numpy as np
import pytest

from tests.mpirun import run_mpi
from tests.reference import train_reference

W, D, B, STEPS, LR = 32, 3, 24, 6, 1e-2

# Tolerance on ||p - p_ref|| / ||p_ref - p_init||: fp32 storage agrees to rounding;
# fp16 stores parameters and gradients in half precision (about 3 significant digits).
# Measured: fp32 ~4e-7, fp16 ~4e-4 (6 steps, width 32).
TOL = {"fp32": 1e-5, "fp16": 5e-3}
LOSS_TOL = {"fp32": 1e-6, "fp16": 1e-3}


def run_engine(tmp_path, n, stage, dtype, *extra):
    out = tmp_path / f"p{n}{stage}{dtype}.npz"
    run_mpi(n, ["tests/drivers/mlp_params.py", out, "--stage", stage, "--dtype", dtype, "--width", W,
                "--depth", D, "--batch", B, "--steps", STEPS, "--lr", LR, "--bucket-mb", "0.004", *extra],
            timeout=120)
    return np.load(out)


@pytest.mark.parametrize("n,stage,dtype,extra", [
    (1, 0, "fp32", ()),
    (2, 0, "fp32", ("--clip", "0.05")),
    (3, 0, "fp32", ("--micro-batches", "2", "--weight-decay", "0.1")),
    (3, 3, "fp32", ("--clip", "0.05", "--micro-batches", "2")),
    (4, 2, "fp16", ()),
    (3, 1, "fp16", ("--clip", "0.05")),
])
def test_matches_float64_reference(tmp_path, n, stage, dtype, extra):
    flags = dict(zip(extra[::2], extra[1::2]))
    clip = float(flags.get("--clip", 0))
    wd = float(flags.get("--weight-decay", 0))
    ref_losses, ref = train_reference(W, D, 0, STEPS, B, LR, wd=wd, clip=clip)
    _, init = train_reference(W, D, 0, 0, B, LR)
    got = run_engine(tmp_path, n, stage, dtype, *extra)
    assert not got["skipped"].any()
    np.testing.assert_allclose(got["losses"], ref_losses, rtol=LOSS_TOL[dtype])
    for name, want in ref.items():
        moved = np.linalg.norm(want - init[name])
        err = np.linalg.norm(got[name].astype(np.float64) - want)
        assert moved > 0
        assert err / moved < TOL[dtype], (name, err / moved)
