"""The newer features' flags under careless input (tensor parallelism, offload, weight-decay
patterns, quantization, traces, plots, TP checkpoints): one line naming the value and what is
allowed, exit status 2, within seconds, never a traceback or a hang. Every case runs the tool as a
subprocess with a timeout, as tests/test_cli_errors.py does."""
from tests.mpirun import run_mpi, run_train
from tests.test_cli_errors import LIMIT, MLP, one_line, tool


def test_offload_params_alone_trains(tmp_path):
    """--offload-params nvme without --offload-optimizer: the step writes the parameter file, and
    the parameters are those of the run without offload (it was a traceback in the first step)."""
    flags = MLP[2:] + ["--stage", "3"]
    plain = run_train(2, tmp_path, *flags, timeout=LIMIT, tag="plain")
    off = run_train(2, tmp_path, *flags, "--offload-params", "nvme", "--offload-dir", tmp_path, timeout=LIMIT)
    assert off["final_params_sha256"] == plain["final_params_sha256"]
