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


# ---- the offline checkpoint tools on odd tensor-parallel folders --------------------------------
def test_checkpoint_tools_on_odd_tp_folder_names(tmp_path):
    """Folder names that look like TP ranks' but are not whole: one line, never a traceback
    ('tpx-of-y') nor a list of a billion names (a hang)."""
    for name in ("tpx-of-y", "tp0-of-999999999", "tp0-of-0"):
        save = tmp_path / name.replace("-", "_")
        (save / name).mkdir(parents=True)
        proc = tool("zerompi.checkpoint", "consolidate", save, tmp_path / "out.npz")
        one_line(proc, "zerompi.checkpoint", str(save))
