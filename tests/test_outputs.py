"""Nothing is lost: output files are written atomically (a full disk leaves the old file, not an
empty one, and one line that says so), consolidate writes only regular files, a data file cut
while a run reads it is named, and the train CLI's per-step history stays bounded."""
import json
import os
import resource
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from tests.mpirun import ROOT, no_python_noise, run_mpi, run_train, zerompi_lines
from zerompi.checkpoint.outputs import save_json, write_atomic
from zerompi.errors import EXIT_OUTPUT

MLP = ["--model", "mlp", "--width", "16", "--depth", "2", "--batch", "4", "--steps", "2", "--optimizer-impl", "numpy"]
LIMIT = 60
SMALL_DISK = 1000        # bytes a file may hold in the full-disk runs: less than any of these outputs


def checkpoint_cli(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "zerompi.checkpoint", *map(str, args)], capture_output=True,
                          text=True, timeout=LIMIT, cwd=str(ROOT), **kwargs)


def only_line(proc, prog):
    lines = zerompi_lines(proc.stderr)         # what a launcher adds is not counted (tests/mpirun.py)
    no_python_noise(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ck")
    run_train(2, tmp, *MLP, "--steps", "1", "--save-dir", tmp / "ck")
    return tmp / "ck"


# ---- consolidate: a regular file or a new path, nothing else ------------------------------------
def test_consolidate_refuses_what_is_not_a_regular_file(checkpoint, tmp_path):
    fifo, folder, link = tmp_path / "fifo", tmp_path / "folder", tmp_path / "null"
    os.mkfifo(fifo)
    folder.mkdir()
    link.symlink_to(os.devnull)                 # its target, a device, is what a write would replace
    for out, needle in ((fifo, "is a FIFO"), (folder, "is a folder"), (link, "is a character device")):
        proc = checkpoint_cli("consolidate", checkpoint, out)
        assert proc.returncode == 2, proc.stderr
        assert needle in only_line(proc, "zerompi.checkpoint") and f"out='{out}'" in proc.stderr
    assert fifo.is_fifo() and folder.is_dir() and not any(folder.iterdir()) and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "folder", "null"]     # no partial file left
    out = tmp_path / "full.npz"                  # a regular file is replaced, a new path written
    out.write_text("old")
    assert checkpoint_cli("consolidate", checkpoint, out).returncode == 0
    assert len(np.load(out).files) == 4 and sorted(p.name for p in tmp_path.iterdir()) == [
        "fifo", "folder", "full.npz", "null"]


def test_inspect_on_a_closed_stdout_is_quiet(checkpoint):
    proc = subprocess.Popen([sys.executable, "-m", "zerompi.checkpoint", "inspect", str(checkpoint)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    proc.stdout.close()
    err = proc.communicate(timeout=LIMIT)[1]
    assert proc.returncode == 141 and err == "", (proc.returncode, err)


# ---- a full disk at the end: the old file stays, one line says what was kept ---------------------------
def small_disk():
    resource.setrlimit(resource.RLIMIT_FSIZE, (SMALL_DISK, SMALL_DISK))


def test_estimate_json_on_a_full_disk(tmp_path):
    out = tmp_path / "e.json"
    out.write_text("old")
    proc = subprocess.run([sys.executable, "-m", "zerompi.estimate", "--params", "1e9", "--ranks", "8",
                           "--json", out], capture_output=True, text=True, timeout=LIMIT, cwd=str(ROOT),
                          preexec_fn=small_disk)
    assert proc.returncode == EXIT_OUTPUT, proc.stderr
    assert "cannot write json=" in only_line(proc, "zerompi.estimate") and "File too large" in proc.stderr
    assert "16Ψ/N" in proc.stdout                        # the table was printed: that much is kept
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["e.json"]


@pytest.mark.parametrize("module,flags", [
    ("zerompi.train", MLP + ["--metrics-json"]),
    ("zerompi.bench", ["-b", "1K", "-e", "4K", "--iters", "1", "--warmup", "0", "--json"]),
])
def test_mpi_tools_on_a_full_disk(tmp_path, module, flags):
    out = tmp_path / "out.json"
    out.write_text("old")
    proc = run_mpi(2, ["tests/drivers/small_disk.py", SMALL_DISK, module, *flags, out], timeout=LIMIT, check=False)
    assert proc.returncode == EXIT_OUTPUT, proc.stderr
    line = only_line(proc, module)
    assert f"cannot write {'metrics_json' if module.endswith('train') else 'json'}='{out}'" in line, line
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_save_json_keeps_a_copy_when_the_folder_went_away(tmp_path):
    gone = tmp_path / "gone" / "m.json"
    line = save_json(str(gone), {"losses": [1.0]}, "metrics_json")
    assert line.startswith(f"cannot write metrics_json='{gone}' (No such file or directory); a copy is in ")
    kept = line.rsplit(" ", 1)[1]
    try:
        assert json.loads(open(kept).read()) == {"losses": [1.0]}
    finally:
        os.unlink(kept)
    path = tmp_path / "m.json"
    assert save_json(str(path), {"a": 1}, "x") is None and json.loads(path.read_text()) == {"a": 1}


def test_write_atomic_leaves_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "f"
    path.write_text("old")

    def fails(f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError):
        write_atomic(str(path), fails)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f"]


# ---- a data file cut while the run reads it ---------------------------------------------------------
def test_a_data_file_truncated_mid_run_is_named(tmp_path):
    data = tmp_path / "corpus.bin"
    data.write_bytes(np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint8).tobytes())
    proc = run_mpi(2, ["tests/drivers/truncate_data.py", "--data", data, "--n-layer", "1", "--d-model", "16",
                       "--n-head", "2", "--seq-len", "16", "--batch", "4", "--steps", "4"], timeout=LIMIT, check=False)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)          # not SIGBUS
    lines = set(zerompi_lines(proc.stderr))
    no_python_noise(proc.stderr)
    assert len(lines) == 1, proc.stderr                                 # each rank that read it: the same line
    line = lines.pop()
    assert f"data='{data}' was truncated while the run reads it: it has 100 bytes, 20,000 when" in line, line


# ---- the per-step history is bounded -------------------------------------------------------------
CAPPED = """
import sys
from zerompi.train import history, run
history.HISTORY_STEPS = 4
sys.exit(run.main(sys.argv[1:]))
"""


def test_the_metrics_keep_the_last_history_steps(tmp_path):
    flags = [*MLP, "--steps", "10"]
    full = run_train(2, tmp_path, *flags, tag="full")
    run_mpi(2, ["-c", CAPPED, *flags, "--metrics-json", tmp_path / "capped.json"], timeout=LIMIT)
    capped = json.loads((tmp_path / "capped.json").read_text())
    assert capped["final_params_sha256"] == full["final_params_sha256"]
    assert capped["losses"] == full["losses"][-4:] and capped["first_step"] == 6
    assert len(capped["step_times_s"]) == 4 and capped["steps_run"] == full["steps_run"] == 10
    assert capped["history_steps"] == 4 and full["first_step"] == 0 and len(full["losses"]) == 10


def test_step_log_memory_is_bounded():
    from zerompi.train.history import StepLog
    parts = {"forward": 0.1, "backward": 0.2, "optimizer": 0.3, "comm_wait": 0.0, "comm_busy": 0.0}
    log = StepLog(0, {}, cap=1000)
    tracemalloc.start()
    for step in range(1000):                     # fill it
        log.record(float(step), 0.01 * step, step, dict(parts))
    filled = tracemalloc.get_traced_memory()[0]
    for step in range(1000, 21000):              # 20x more steps: nothing more is kept
        log.record(float(step), 0.01 * step, step, dict(parts))
    grown = tracemalloc.get_traced_memory()[0] - filled
    tracemalloc.stop()
    assert len(log.losses) == len(log.parts) == 1000 and log.steps_run == 21000
    assert log.first_kept == 20000 and log.losses[0] == 20000.0 and list(log.comm_bytes)[-1] == 20999
    assert grown < 100_000, grown                # about 430 bytes a step, were every step kept
