"""The newer features' flags under careless input (tensor parallelism, offload, weight-decay
patterns, quantization, traces, plots, TP checkpoints): one line naming the value and what is
allowed, exit status 2, within seconds, never a traceback or a hang. Every case runs the tool as a
subprocess with a timeout, as tests/test_cli_errors.py does."""
import pytest

from tests.mpirun import run_mpi, run_train
from tests.test_cli_errors import LIMIT, MLP, one_line, tool


def test_offload_params_alone_trains(tmp_path):
    """--offload-params nvme without --offload-optimizer: the step writes the parameter file, and
    the parameters are those of the run without offload (it was a traceback in the first step)."""
    flags = MLP[2:] + ["--stage", "3"]
    plain = run_train(2, tmp_path, *flags, timeout=LIMIT, tag="plain")
    (tmp_path / "off").mkdir()                 # the metrics go outside the offload folder
    off = run_train(2, tmp_path, *flags, "--offload-params", "nvme", "--offload-dir", tmp_path / "off", timeout=LIMIT)
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


GPT_TP = ["-m", "zerompi.train", "--model", "gpt", "--n-layer", "2", "--d-model", "32", "--n-head", "4",
          "--seq-len", "16", "--batch", "4", "--eval-every", "0"]


def test_a_tp_save_directory_is_named_as_one(tmp_path):
    """inspect, or --resume without --tp, of a --tp 2 save directory: the line says it is a TP save
    and what to do (it said the folder held no checkpoint)."""
    save = tmp_path / "save"
    run_mpi(2, GPT_TP + ["--steps", "1", "--tp", "2", "--save-dir", save], timeout=LIMIT)
    line = one_line(tool("zerompi.checkpoint", "inspect", save), "zerompi.checkpoint", "tensor-parallel save")
    assert "--tp 2" in line and "tp0-of-2" in line, line
    proc = run_mpi(2, GPT_TP + ["--steps", "2", "--resume", save], timeout=LIMIT, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "a tensor-parallel save" in proc.stderr and "--tp 2" in proc.stderr, proc.stderr


# ---- errors found at start-up on every rank alike: one line, not one per rank --------------------
def test_offload_dir_not_a_folder_is_one_line(tmp_path):
    for where in (tmp_path / "missing", tmp_path / "file"):
        (tmp_path / "file").write_text("")
        proc = run_mpi(2, MLP + ["--stage", "2", "--offload-optimizer", "nvme", "--offload-dir", where],
                       timeout=LIMIT, check=False)
        one_line(proc, "zerompi.train", f"offload_dir='{where}' is not a folder")


def test_an_offload_dir_without_room_is_one_line():
    """The free bytes are checked once the engine knows its files' size, inside the run: a ConfigError raised there on
    every rank was printed by each rank, with MPI's abort banner; now rank 0 prints it once and every rank exits 2.
    /proc takes no file and reports no free byte (skipped where it is not seen so)."""
    import os
    if os.statvfs("/proc").f_bavail != 0 or not os.access("/proc", os.W_OK):
        pytest.skip("/proc is not a writable-looking folder with no free byte here")
    proc = run_mpi(2, MLP + ["--stage", "2", "--offload-optimizer", "nvme", "--offload-dir", "/proc"],
                   timeout=LIMIT, check=False)
    one_line(proc, "zerompi.train", "offload_dir='/proc' has 0 bytes free")
    assert "Abort" not in proc.stdout + proc.stderr, proc.stderr


def test_a_resume_folder_that_is_not_there_is_one_line_before_the_run_starts(tmp_path):
    """--resume of a path that does not exist, or of a file: its one line at start-up, before the banner (it came after
    the banner, once the engines were built)."""
    (tmp_path / "file").write_text("")
    for where, what in ((tmp_path / "missing", "does not exist"), (tmp_path / "file", "is a file")):
        proc = run_mpi(2, MLP + ["--resume", where], timeout=LIMIT, check=False)
        one_line(proc, "zerompi.train", f"{where}: {what}")
        assert "ranks, stage" not in proc.stdout, proc.stdout


def test_no_decay_pattern_matching_nothing_is_one_line():
    for flags in (MLP + ["--no-decay", "zzz*"], GPT_TP + ["--steps", "1", "--tp", "2", "--no-decay", "h0.*"]):
        proc = run_mpi(2, flags, timeout=LIMIT, check=False)
        one_line(proc, "zerompi.train", "matches no parameter")


# ---- the estimate ------------------------------------------------------------------------------
GPT_DIMS = ["--ranks", "8", "--d-model", "256", "--n-head", "4", "--seq-len", "64", "--batch", "8", "--vocab", "32"]


def test_estimate_of_a_gpt_with_very_many_layers():
    """--n-layer 10**26 was an OverflowError traceback, 10**9 a hang (a list of every block's size)."""
    for n_layer in ("99999999999999999999999999", "1000000000"):
        proc = tool("zerompi.estimate", "--n-layer", n_layer, *GPT_DIMS)
        assert proc.returncode == 0 and not proc.stderr, proc.stderr


@pytest.mark.parametrize("flags", [["--model", "gpt", "--n-layer", "99999999999999999999999"],
                                   ["--model", "gpt", "--n-layer", "1000000000"],
                                   ["--model", "mlp", "--depth", "1000000000"]])
def test_train_of_a_model_with_very_many_layers_is_refused_at_once(flags):
    """The memory check counted the layers in a list: 10**23 was a traceback, 10**9 filled the memory."""
    proc = run_mpi(2, ["-m", "zerompi.train", "--steps", "1", *flags], timeout=20, check=False)
    one_line(proc, "zerompi.train", "the job needs at least")


# ---- images: a format matplotlib writes, never over an input -----------------------------------
@pytest.fixture(scope="module")
def run_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "run.json"
    run_mpi(2, MLP + ["--metrics-json", path], timeout=LIMIT)
    return path


def test_plot_out_in_a_format_with_no_writer(run_json, tmp_path):
    """--out x.txt was exit status 1 after drawing; it is bad input, refused before any work."""
    proc = tool("zerompi.plot", run_json, "--out", tmp_path / "x.txt")
    one_line(proc, "zerompi.plot", "no image format .txt; use one of")


def test_plot_out_never_replaces_its_input(run_json, tmp_path):
    png = tmp_path / "run.png"                      # a metrics file named like an image
    png.write_bytes(run_json.read_bytes())
    proc = tool("zerompi.plot", png, "--out", png)
    one_line(proc, "zerompi.plot", "is also the input")
    assert png.read_bytes() == run_json.read_bytes()


BENCH = ["-m", "zerompi.bench", "-b", "1K", "-e", "2K", "--iters", "1", "--warmup", "0", "--op", "all_reduce"]


def test_bench_plot_in_a_format_with_no_writer_or_over_its_json(tmp_path):
    proc = run_mpi(2, BENCH + ["--plot", tmp_path / "b.txt"], timeout=LIMIT, check=False)
    one_line(proc, "zerompi.bench", "no image format .txt")
    both = tmp_path / "b.png"
    proc = run_mpi(2, BENCH + ["--json", both, "--plot", both], timeout=LIMIT, check=False)
    one_line(proc, "zerompi.bench", "are the same file: one output would replace the other")
    assert not both.exists()


# ---- flags that mean nothing in the setting given: refused, not silently ignored -----------------
@pytest.mark.parametrize("flags,needle", [
    (["--dtype", "bf16", "--loss-scale", "1024"], "init_loss_scale=1024.0 (--loss-scale) applies with --dtype fp16"),
    (["--dtype", "fp32", "--loss-scale-window", "5"], "loss_scale_window=5 (--loss-scale-window) applies with --dtype"),
    (["--quant-block", "128"], "quant_block=128 (--quant-block) applies with --quantize-weights or --quantize-grads"),
    (["--trace-steps", "5"], "trace_steps=5 (--trace-steps) applies with --trace FILE only"),
])
def test_flags_that_apply_in_one_setting_only(flags, needle):
    one_line(run_mpi(2, MLP + flags, timeout=LIMIT, check=False), "zerompi.train", needle)


