"""The command-line tools under bad input: one line naming the value and what is allowed, exit
status 2, within seconds (docs/failures.md). Every case runs the tool as a subprocess with a
timeout, so a hang fails the test, never CI."""
import json
import subprocess
import sys

import pytest

from tests import mpirun
from tests.mpirun import ROOT, run_mpi
from zerompi.engine.config import FLOAT_RULES, ZeroConfig
from zerompi.errors import ConfigError

MLP = ["-m", "zerompi.train", "--model", "mlp", "--width", "16", "--depth", "2", "--batch", "4", "--steps", "2"]
LIMIT = 60       # seconds any of these may take (they take about one start-up of the ranks)


def one_line(proc, prog: str, needle: str, status: int = 2) -> str:
    """The one stderr line of a tool that refused its input (nothing on stdout: no step ran);
    what a launcher adds is not counted (tests/mpirun.py)."""
    line = mpirun.one_line(proc, status, needle)
    assert line.startswith(f"{prog}: error"), line
    assert "step " not in proc.stdout, proc.stdout
    return line


def tool(module: str, *args, **kwargs):
    """``python -m module args`` (one process, no mpiexec)."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=LIMIT, cwd=str(ROOT), **kwargs)


# ---- non-finite and out-of-range floats (the whole family, in ZeroConfig) ----------------------
@pytest.mark.parametrize("flags,needle", [
    (["--lr", "inf"], "lr=inf"),
    (["--lr", "1e39"], "lr=1e+39 is inf in float32"),
    (["--lr", "nan"], "lr=nan is not allowed; use a finite number > 0"),
    (["--weight-decay", "inf"], "weight_decay=inf"),
    (["--weight-decay", "1e30"], "lr x weight_decay"),
    (["--loss-scale", "inf"], "--loss-scale: init_loss_scale=inf"),
    (["--loss-scale", "1e39"], "init_loss_scale=1e+39"),
    (["--clip", "inf"], "clip=inf"),
    (["--bucket-mb", "inf"], "bucket_mb=inf"),
])
def test_float_flags_must_be_finite_and_fit_float32(flags, needle):
    one_line(run_mpi(2, MLP + flags, timeout=LIMIT, check=False), "zerompi.train", needle)


# 1e39 only where the rule itself allows it and the field is float32 arithmetic (not bucket_mb, beta1, beta2)
EVERY_FLOAT = [(name, value) for name, (_, ok, float32) in sorted(FLOAT_RULES.items())
               for value in (float("inf"), float("-inf"), float("nan"), 1e39)
               if value != 1e39 or (float32 and ok(value))]


@pytest.mark.parametrize("name,value", EVERY_FLOAT)
def test_every_float_field_of_zero_config_is_checked(name, value):
    with pytest.raises(ConfigError, match=f"^{name}=.*(finite|float32)"):   # says what is allowed
        ZeroConfig(**{name: value})


def test_float32_rounding_counts():
    with pytest.raises(ConfigError, match="beta2=0.9999999999 is 1.0 in float32"):
        ZeroConfig(beta2=0.9999999999)
    with pytest.raises(ConfigError, match="lr=1e-50 is 0.0 in float32"):
        ZeroConfig(lr=1e-50)
    assert ZeroConfig(lr=3e38).lr == 3e38                 # large, but float32 holds it


# ---- integers, seeds, and sizes that cannot fit -------------------------------------------
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_negative_seed(model):
    proc = run_mpi(2, ["-m", "zerompi.train", "--model", model, "--seed", "-1"], timeout=LIMIT, check=False)
    one_line(proc, "zerompi.train", "seed=-1 must be an integer >= 0")


@pytest.mark.parametrize("flags,needle", [
    (["-b", "inf"], "size 'inf'"),
    (["-e", "inf"], "size 'inf'"),
    (["-f", "inf"], "factor=inf"),
    (["-f", "nan"], "factor=nan must be a finite number > 1"),
    (["-f", "1.0000000001"], "at most 1000 are allowed"),     # used to spin for ever building the sizes
    (["-b", "4096G", "-e", "4096G"], "per rank"),            # said before any buffer is allocated
    (["--json", ""], "json='' is an empty path"),
])
def test_bench_bad_sizes(flags, needle):
    one_line(run_mpi(2, ["-m", "zerompi.bench", *flags], timeout=LIMIT, check=False), "zerompi.bench", needle)


@pytest.mark.parametrize("flags,needle", [
    (["--model", "mlp", "--width", "10000000"], "per rank"),
    (["--model", "gpt", "--seq-len", "1000000", "--batch", "2"], "activations 43.7 TiB"),   # the attention's, T^2
])
def test_a_job_that_cannot_fit_is_refused_before_it_allocates(flags, needle):
    line = one_line(run_mpi(2, ["-m", "zerompi.train", *flags], timeout=LIMIT, check=False), "zerompi.train", needle)
    assert "the job needs at least" in line and "this rank has" in line and "zerompi.estimate" in line


def test_estimate_bad_numbers():
    for args, needle in ((["--bucket-mb", "inf"], "'inf' is not a finite number"),
                         (["--largest-layer", "inf"], "'inf' is not a finite number"),
                         (["--latency-us", "nan"], "'nan' is not a finite number"),
                         (["--bandwidth-gbps", "inf"], "'inf' is not a finite number"),
                         (["--json", ""], "json='' is an empty path")):
        proc = tool("zerompi.estimate", "--params", "1e9", "--ranks", "8", *args)
        one_line(proc, "zerompi.estimate", needle)
        assert proc.stdout == ""


@pytest.mark.parametrize("content,needle", [
    ([{"op": "all_gather", "bytes": 4096}], "holds a JSON list"),                      # a bench --json
    ({"world_size": 2}, "it has no params"),
    ({"params": 10, "world_size": 2, "dtype": "fp16", "stage": 7, "memory_bytes": {}, "peak_buffer_bytes": 0,
      "comm_bytes_per_step": 0}, "stage=7"),
    ({"params": 10, "world_size": 2, "dtype": "fp16", "stage": 2, "memory_bytes": [], "peak_buffer_bytes": 0,
      "comm_bytes_per_step": 0}, "TypeError"),
])
def test_estimate_from_run_of_the_wrong_json(tmp_path, content, needle):
    path = tmp_path / "wrong.json"
    path.write_text(json.dumps(content))
    proc = tool("zerompi.estimate", "--from-run", path)
    line = one_line(proc, "zerompi.estimate", needle)
    assert "is not the --metrics-json of a zerompi.train run" in line


# ---- empty paths are not "off" --------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--save-dir", "--resume", "--metrics-json"])
def test_empty_paths_are_refused(flag):
    proc = run_mpi(2, MLP + [flag, ""], timeout=LIMIT, check=False)
    one_line(proc, "zerompi.train", f"{flag[2:].replace('-', '_')}='' is an empty path")


def test_empty_paths_of_the_offline_tools():
    one_line(tool("zerompi.estimate", "--from-run", ""), "zerompi.estimate", "from_run='' is an empty path")
    one_line(tool("zerompi.checkpoint", "consolidate", ROOT, ""), "zerompi.checkpoint", "out='' is an empty path")


# ---- flags of the other model ----------------------------------------------------------------
@pytest.mark.parametrize("model,flags,owner", [
    ("mlp", ["--n-layer", "3"], "gpt"), ("mlp", ["--seq-len", "8"], "gpt"), ("mlp", ["--d-model", "32"], "gpt"),
    ("mlp", ["--n-head", "2"], "gpt"), ("mlp", ["--eval-every", "5"], "gpt"), ("mlp", ["--n-layer", "2"], "gpt"),
    ("gpt", ["--width", "64"], "mlp"), ("gpt", ["--depth", "4"], "mlp"),
])
def test_flags_of_the_other_model_are_refused(model, flags, owner):
    proc = run_mpi(2, ["-m", "zerompi.train", "--model", model, "--steps", "2", *flags], timeout=LIMIT, check=False)
    line = one_line(proc, "zerompi.train", f"applies to model {owner} only")
    assert f"drop {flags[0]} or use --model {owner}" in line


# ---- ZEROMPI_FAULT that can never fire ---------------------------------------------------------
@pytest.mark.parametrize("fault,needle", [
    ("raise@rank5:step1", "names rank 5; this job has ranks 0-1"),
    ("hang@rank1:step30", "names step 30; this job runs steps 1-2"),
    ("hang@rank1:step1:metrics", "the final metrics follow the last step, 2"),
    ("exit@rank0:step2:save", "no checkpoint is saved after step 2"),
])
def test_a_fault_naming_a_rank_or_step_that_does_not_exist_is_said(fault, needle):
    proc = run_mpi(2, MLP, timeout=LIMIT, check=False, env={"ZEROMPI_FAULT": fault})
    one_line(proc, "zerompi.train", needle)


# ---- output paths are checked at the start, not after the run -------------------------------------
def test_unwritable_save_dir_is_found_at_start(tmp_path):
    (tmp_path / "file").write_text("in the way")
    for path, needle in ((tmp_path / "file", "is a file, not a folder"),
                         (tmp_path / "file" / "ck", "file' is a file, not a folder")):
        proc = run_mpi(2, MLP + ["--save-dir", path], timeout=LIMIT, check=False)
        one_line(proc, "zerompi.train", needle)
    assert (tmp_path / "file").read_text() == "in the way"


@pytest.mark.parametrize("where,needle", [("missing/m.json", "does not exist"), ("file/m.json", "is a file"),
                                          ("folder", "is a folder")])
def test_output_files_are_checked_before_the_first_step(tmp_path, where, needle):
    (tmp_path / "file").write_text("")
    (tmp_path / "folder").mkdir()
    path = tmp_path / where
    one_line(run_mpi(2, MLP + ["--metrics-json", path], timeout=LIMIT, check=False), "zerompi.train", needle)
    bench = ["-m", "zerompi.bench", "-b", "1K", "-e", "1K", "--iters", "1", "--json", path]
    one_line(run_mpi(2, bench, timeout=LIMIT, check=False), "zerompi.bench", needle)
    proc = tool("zerompi.estimate", "--params", "1e9", "--ranks", "8", "--json", path)
    one_line(proc, "zerompi.estimate", needle)
    assert proc.stdout == ""


# ---- help, and a closed stdout -----------------------------------------------------------------
def test_checkpoint_help_prints_usage():
    proc = tool("zerompi.checkpoint", "--help")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("usage: python -m zerompi.checkpoint") and "consolidate" in proc.stdout
    assert tool("zerompi.checkpoint", "consolidate", "--help").stdout.startswith("usage:")
    one_line(tool("zerompi.checkpoint", "inspect"), "zerompi.checkpoint", "inspect DIR")


@pytest.mark.parametrize("argv", [
    ["-m", "zerompi.estimate", "--params", "1e9", "--ranks", "8"],
    ["-m", "zerompi.train", "--model", "mlp", "--width", "16", "--depth", "2", "--batch", "4", "--steps", "2"],
    ["-m", "zerompi.bench", "-b", "1K", "-e", "1K", "--iters", "1", "--warmup", "0"],
])
def test_a_closed_stdout_ends_the_tool_quietly(argv):
    """As ``... | head -1`` once head has gone: no traceback, the status of a tool SIGPIPE ends."""
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(ROOT))
    proc.stdout.close()                       # no reader from the start: the first write fails
    try:
        err = proc.communicate(timeout=LIMIT)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"timed out: {argv}")
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert proc.returncode == 141, (proc.returncode, err)
