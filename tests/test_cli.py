"""Bad input stops every rank with one line and exit 2; a failing rank ends the whole job."""
import time

import pytest

from tests.mpirun import one_line, run_mpi

pytestmark = pytest.mark.every_mpi       # CI runs these under Open MPI too (.ci/run)

BAD = [
    (["--stage", "5"], "stage=5"),
    (["--model", "resnet"], "model='resnet'"),
    (["--dtype", "fp8"], "dtype='fp8'"),
    (["--lr", "0"], "lr=0.0"),
    (["--lr=-1e-3"], "lr=-0.001"),
    (["--bucket-mb", "0"], "bucket_mb=0.0"),
    (["--steps", "0"], "steps=0"),
    (["--micro-batches", "0"], "micro_batches=0"),
    (["--batch", "10"], "batch=10"),
    (["--stage", "two"], "invalid int value"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--device", "tpu"], "device='tpu'"),
]


@pytest.mark.parametrize("flags,needle", BAD)
def test_bad_input_exits_2_with_one_line(flags, needle):
    proc = run_mpi(3, ["-m", "zerompi.train", "--model", "mlp"] + flags, timeout=60, check=False)
    assert one_line(proc, 2, needle).startswith("zerompi.train: error")
    assert proc.stdout == ""


def test_device_gpu_without_a_gpu_exits_2_with_one_line():
    from zerompi.comm.device import probe_gpus
    if probe_gpus()[0]:
        pytest.skip("this machine has a GPU")
    proc = run_mpi(3, ["-m", "zerompi.train", "--model", "mlp", "--batch", "12", "--device", "gpu"], timeout=60,
                   check=False)
    assert one_line(proc, 2).startswith("zerompi.train: error: device='gpu' needs CuPy and a visible GPU")
    assert proc.stdout == ""


def test_failing_rank_ends_the_job():
    t = time.monotonic()
    proc = run_mpi(3, ["tests/drivers/raise_mid.py"], timeout=60, check=False)
    assert proc.returncode != 0
    assert "rank 1 failed" in proc.stderr and "injected failure on rank 1" in proc.stderr
    assert time.monotonic() - t < 30


def test_every_built_in_model_has_the_same_step_interface():
    """train() runs a step with one call whatever the model: models.<name>.train_losses."""
    import inspect
    from zerompi.train.config import MODELS
    from zerompi.train.job import step_losses
    for model in MODELS:
        assert list(inspect.signature(step_losses(model)).parameters) == [
            "engine", "model", "data", "step", "batch", "micro_batches"], model
