"""Checkpoints that do not stop training and do not eat the disk (issue 25): the background save,
its failures and crashes, retention, the manifest's own checksum, inspect's verdict, the save
directory's lock and the refusal to overwrite another run, and a missing ``latest``.

Oracles: the synchronous save (an async checkpoint must be the same bytes), tests/test_checkpoint.py's
``reassemble`` (shards read from the manifest alone) and straight runs' final parameters.
"""
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.mpirun import CRASH_BACKSTOP, ROOT, kill_tree, mpi_env, mpiexec, rank_pids, run_mpi, run_train, still_alive
from tests.test_checkpoint import SMALL, checkpoint_cli, reassemble, snapshot
from zerompi.checkpoint.pointer import latest_name

TRAIN = ["-m", "zerompi.train"]
SLOW = {"ZEROMPI_CHECKPOINT_DELAY_S": "1.5"}   # each background write starts 1.5 s late: steps run meanwhile
SLOW_COPY = {"ZEROMPI_CHECKPOINT_COPY_DELAY_S": "1.5"}   # the host copy too: the next update must wait for it


def errors_of(proc):
    return [line for line in proc.stderr.splitlines() if "error" in line]


def tree(directory):
    return sorted(p.name for p in directory.iterdir())


# ---- the background save ---------------------------------------------------------------
@pytest.mark.parametrize("n,flags,env", [
    (2, ["--stage", "2", "--dtype", "fp16", "--loss-scale-window", "2"], SLOW),
    (3, ["--stage", "3", "--dtype", "fp32", "--micro-batches", "2", "--batch", "12"], SLOW),
    (2, ["--stage", "1", "--dtype", "fp32"], SLOW_COPY),
    (2, ["--stage", "0", "--dtype", "fp16"], SLOW_COPY),
    # The optimizer rows in a file, and the delayed update (running behind the next step): the copy is
    # still taken before they change.
    (2, ["--stage", "2", "--offload-optimizer", "nvme", "--offload-dir", "OFFLOAD"], SLOW_COPY),
    (2, ["--stage", "1", "--offload-optimizer", "cpu", "--offload-delayed-update"], SLOW_COPY),
    # bf16 storage with a no-decay group: the shards hold the fp32 master, m and v all the same.
    (2, ["--stage", "3", "--dtype", "bf16", "--weight-decay", "0.5", "--no-decay", "*.bias"], SLOW),
])
def test_async_checkpoints_are_the_sync_ones_and_resume_bit_identically(tmp_path, n, flags, env):
    flags = [str(tmp_path / "offload") if f == "OFFLOAD" else f for f in flags]
    (tmp_path / "offload").mkdir()       # --offload-dir must be an existing folder
    common = SMALL + flags + ["--steps", "6", "--save-every", "2", "--log-every", "1"]
    sync = run_train(n, tmp_path, *common, "--save-dir", tmp_path / "s", tag="sync")
    proc = run_mpi(n, [*TRAIN, *common, "--save-dir", tmp_path / "a", "--async-save",
                       "--metrics-json", tmp_path / "async.json"], env=env)
    lines = proc.stdout.splitlines()
    # The write (or the host copy) of step 2's checkpoint starts 1.5 s late: step 3's forward and
    # backward ran meanwhile, step 4 changed the optimizer state before it was written, and it was
    # published after them.
    saved = next(i for i, line in enumerate(lines) if "step_000002 (written in the background)" in line)
    assert any(line.startswith("step     4/6") for line in lines[:saved]), proc.stdout
    # Every checkpoint is the synchronous one, byte for byte (shards and manifest).
    for step in ("step_000002", "step_000004", "step_000006"):
        assert snapshot(tmp_path / "a" / step) == snapshot(tmp_path / "s" / step), step
    assert json.loads((tmp_path / "async.json").read_text())["final_params_sha256"] == sync["final_params_sha256"]
    # Resumed from the async checkpoint: the bits of the resume from the sync one, which are the straight
    # run's (except with the delayed update, whose one-step lag starts afresh at a resume: docs/checkpoint.md).
    resumed = {src: run_train(n, tmp_path, *SMALL, *flags, "--steps", "6", "--resume", tmp_path / src / "step_000002",
                              tag=f"resumed-{src}") for src in ("a", "s")}
    assert resumed["a"]["final_params_sha256"] == resumed["s"]["final_params_sha256"]
    assert resumed["a"]["losses"] == resumed["s"]["losses"]
    if "--offload-delayed-update" not in flags:
        assert resumed["s"]["final_params_sha256"] == sync["final_params_sha256"]
        assert resumed["s"]["losses"] == sync["losses"][2:]


def test_async_checkpoint_loads_across_world_size_and_stage(tmp_path):
    old = SMALL + ["--stage", "3", "--dtype", "fp32", "--steps", "4", "--save-every", "2"]
    run_train(2, tmp_path, *old, "--save-dir", tmp_path / "s", tag="sync")
    run_train(2, tmp_path, *old, "--save-dir", tmp_path / "a", "--async-save", env=SLOW, tag="async")
    oracle = reassemble(tmp_path / "s" / "step_000002")
    got = reassemble(tmp_path / "a" / "step_000002")
    assert all(np.array_equal(got[row][k], oracle[row][k]) for row in oracle for k in oracle[row])
    new = SMALL + ["--stage", "1", "--dtype", "fp32", "--bucket-mb", "0.005", "--steps", "5"]
    from_sync = run_train(3, tmp_path, *new, "--resume", tmp_path / "s" / "step_000002", tag="from-sync")
    from_async = run_train(3, tmp_path, *new, "--resume", tmp_path / "a" / "step_000002", tag="from-async")
    assert from_async["final_params_sha256"] == from_sync["final_params_sha256"]
    assert from_async["losses"] == from_sync["losses"]


LIBRARY = r"""
import sys
import numpy as np
from mpi4py import MPI
from zerompi import ZeroConfig, ZeroEngine
from zerompi.train.models.mlp import MLP, TeacherData, train_losses
ck = sys.argv[1]
model, data = MLP(16, 3, 0), TeacherData(16, 3, 0)
engine = ZeroEngine(model.init_layers(), ZeroConfig(stage=2, bucket_mb=0.0005))
for step in range(2):
    train_losses(engine, model, data, step, 8, 1)
    engine.step()
want = engine.full_parameters()
pending = engine.save(ck, blocking=False)
assert pending.path is None, "published before any step or wait"
train_losses(engine, model, data, 2, 8, 1)
engine.step()                                     # changes the state; the checkpoint keeps step 2's
engine.close()                                    # waits for the background write and publishes it
assert pending.path and pending.path.endswith("step_000002"), pending.path
assert pending.wait() == pending.path
again = ZeroEngine(MLP(16, 3, 1).init_layers(), ZeroConfig(stage=1, bucket_mb=0.001))
again.load(ck)
got = again.full_parameters()
assert all(np.array_equal(got[k], want[k]) for k in want)
print("ok", MPI.COMM_WORLD.rank)
"""


def test_library_async_save_is_published_by_close(tmp_path):
    proc = run_mpi(2, ["-c", LIBRARY, tmp_path / "ck"], env=SLOW)
    assert proc.stdout.count("ok") == 2, proc.stdout
    assert latest_name(tmp_path / "ck") == "step_000002"


# ---- failures and crashes ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["--async-save", None])
def test_a_failed_write_stops_every_rank_with_one_line(tmp_path, mode):
    """Rank 1's disk is full from its second checkpoint (step 4) on: every rank stops, with one line
    naming the file, at the next step (async) or in the save (sync); step 2's checkpoint stays latest
    and the failed save's temporary folder is gone."""
    ck = tmp_path / "ck"
    flags = [*SMALL, "--steps", "30", "--save-every", "2", "--save-dir", ck] + ([mode] if mode else [])
    proc = run_mpi(2, ["tests/drivers/fail_write.py", "1", "2", "4096", *flags], check=False)
    assert proc.returncode == 2, proc.stderr
    errors = errors_of(proc)
    assert len(errors) == 1, proc.stderr
    assert "rank 1 could not write" in errors[0] and "shard_00001.npy" in errors[0], errors[0]
    assert "File too large" in errors[0] and "step 4 was not saved" in errors[0], errors[0]
    assert "step    30/30" not in proc.stdout      # it stopped then, not at the end
    assert latest_name(ck) == "step_000002"
    assert tree(ck) == ["latest", "step_000002"]  # no temporary folder, no lock left
    assert checkpoint_cli("inspect", ck).returncode == 0


def wait_for_lock_owner(ck, limit_s: float = 30) -> None:
    """Until the process named in ck's lock (if any) has ended, at most ``limit_s``."""
    try:
        pid = json.loads((ck / ".zerompi.lock").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return
    deadline = time.monotonic() + limit_s
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.mark.parametrize("env", [
    {"ZEROMPI_CHECKPOINT_CRASH": "after_shards@4"},
    {"ZEROMPI_CHECKPOINT_CRASH": "mid_shard@4:rank1", **SLOW},     # rank 1 dies mid-write, rank 0 trains on
    {"ZEROMPI_CHECKPOINT_CRASH": "before_rename@4"},
    {"ZEROMPI_CHECKPOINT_CRASH": "before_latest@4"},
    {"ZEROMPI_FAULT": "exit@rank1:step4:save"},
])
def test_crash_during_an_async_save_leaves_the_previous_checkpoint(tmp_path, env):
    ck = tmp_path / "ck"
    common = [*TRAIN, *SMALL, "--stage", "2", "--steps", "6", "--save-every", "2", "--async-save"]
    proc = run_mpi(2, [*common, "--save-dir", ck], timeout=90, env={**env, **CRASH_BACKSTOP}, check=False)
    assert proc.returncode != 0, proc.stderr
    assert latest_name(ck) == "step_000002"
    before = reassemble(ck / "step_000002")["master"]
    assert checkpoint_cli("consolidate", ck, tmp_path / "p.npz").returncode == 0
    got = np.load(tmp_path / "p.npz")
    assert all(np.array_equal(got[k], v) for k, v in before.items())
    # The next run resumes from it (taking over the dead job's lock) and finishes. Open MPI's mpirun may
    # return while the rank holding the lock is still being killed: until it is gone the lock is live.
    wait_for_lock_owner(ck)
    proc = run_mpi(2, [*common, "--save-dir", ck, "--resume", ck], timeout=90)
    assert latest_name(ck) == "step_000006"
    assert not (ck / ".zerompi.lock").exists()


# ---- retention -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["--async-save", None])
def test_keep_last_keeps_the_newest(tmp_path, mode):
    ck = tmp_path / "ck"
    run_train(2, tmp_path, *SMALL, "--steps", "5", "--save-every", "1", "--keep-last", "2", "--save-dir", ck,
              *([mode] if mode else []))
    assert tree(ck) == ["latest", "step_000004", "step_000005"]
    assert latest_name(ck) == "step_000005"
    for step in ("step_000004", "step_000005"):
        assert checkpoint_cli("inspect", ck / step).returncode == 0


def test_retention_never_removes_latest_nor_a_save_under_way(tmp_path):
    from zerompi.checkpoint.savedir import retain
    from zerompi.checkpoint.format import wait_removals
    for k, name in enumerate(["step_000030", "step_000010", "step_000020", "step_000012"]):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
        os.utime(tmp_path / name / "manifest.json", (1000 + k, 1000 + k))   # published in this order
    (tmp_path / ".tmp-step_000014-abcd").mkdir()                               # a save under way
    (tmp_path / "latest").write_text("step_000010\n")
    # latest names step_000010 (an older one was resumed): kept, with the newest other one.
    assert sorted(retain(str(tmp_path), 2, "step_000010")) == ["step_000020", "step_000030"]
    wait_removals()
    assert tree(tmp_path) == [".tmp-step_000014-abcd", "latest", "step_000010", "step_000012"]
    assert retain(str(tmp_path), None, "step_000010") == []


# ---- the manifest's own checksum, and inspect ---------------------------------------------------
@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A complete 2-rank stage 3 checkpoint at step 2 (its save dir)."""
    tmp = tmp_path_factory.mktemp("good")
    run_train(2, tmp, *SMALL, "--stage", "3", "--steps", "2", "--save-dir", tmp / "ck")
    return tmp / "ck"


def copy_of(good, tmp_path):
    shutil.copytree(good, tmp_path / "ck")
    return tmp_path / "ck"


@pytest.mark.parametrize("change", [
    lambda t: t.replace('"data_step": 2', '"data_step": 9'),        # 7 steps of data silently skipped
    lambda t: t.replace('"stage": 3', '"stage": 1'),
    lambda t: t.replace("\n ", "\n  ", 1),                          # even a space
    lambda t: t[:-8] + ("0" if t[-8] != "0" else "1") + t[-7:],      # the checksum itself
])
def test_a_changed_manifest_byte_is_refused(good, tmp_path, change):
    ck = copy_of(good, tmp_path)
    manifest = ck / "step_000002" / "manifest.json"
    text = manifest.read_text()
    assert change(text) != text
    manifest.write_text(change(text))
    before = snapshot(ck)
    proc = run_mpi(2, [*TRAIN, *SMALL, "--stage", "3", "--steps", "4", "--resume", ck, "--save-dir", ck],
                   timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    errors = errors_of(proc)
    assert len(errors) == 1 and "manifest.json" in errors[0] and "checksum mismatch" in errors[0], proc.stderr
    assert snapshot(ck) == before
    proc = checkpoint_cli("inspect", ck)
    assert proc.returncode == 2 and "manifest.json" in proc.stderr and "checksum" in proc.stderr, proc.stderr


def test_format_1_checkpoints_still_load(good, tmp_path):
    """A checkpoint of the previous format (sha256 per shard, no manifest checksum) is read as before."""
    ck = copy_of(good, tmp_path)
    manifest = ck / "step_000002" / "manifest.json"
    m = json.loads(manifest.read_text())
    del m["manifest_sha256"]
    m["format_version"] = 1
    for s in m["shards"]:
        s["sha256"] = hashlib.sha256((ck / "step_000002" / s["file"]).read_bytes()).hexdigest()
        del s["crc32"]
    manifest.write_text(json.dumps(m, indent=1))
    (ck / "latest").write_text("step_000002\n")          # as the zerompi of format 1 wrote it: no checksum
    proc = checkpoint_cli("inspect", ck)
    assert proc.returncode == 0 and "format 1" in proc.stdout, proc.stderr
    run_train(2, tmp_path, *SMALL, "--stage", "1", "--steps", "3", "--resume", ck, tag="v1")
    with open(ck / "step_000002" / "shard_00001.npy", "r+b") as f:
        f.seek(-3, 2)
        f.write(b"\x00\x01\x02")
    proc = checkpoint_cli("inspect", ck)
    assert proc.returncode == 2 and "sha256 checksum mismatch" in proc.stderr, proc.stderr


def test_inspect_verifies_every_checksum(good, tmp_path):
    proc = checkpoint_cli("inspect", good)
    assert proc.returncode == 0, proc.stderr
    assert "manifest sha256 verified" in proc.stdout and proc.stdout.count(" ok") == 2, proc.stdout
    ck = copy_of(good, tmp_path)
    os.truncate(ck / "step_000002" / "shard_00000.npy", 1000)
    data = bytearray((ck / "step_000002" / "shard_00001.npy").read_bytes())
    data[-5] ^= 0x40
    (ck / "step_000002" / "shard_00001.npy").write_bytes(bytes(data))
    proc = checkpoint_cli("inspect", ck)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.count("DAMAGED") == 2 and "block2.weight" in proc.stdout, proc.stdout   # the table, still
    line, = proc.stderr.splitlines()
    assert "2 of the checkpoint's files damaged" in line and "truncated" in line and "crc32 checksum" in line
    assert "shard_00000.npy" in line and "shard_00001.npy" in line


# ---- the save directory: no silent overwrite, one job at a time, a broken latest ----------------------
def test_a_fresh_run_does_not_overwrite_another_runs_checkpoints(good, tmp_path):
    ck = copy_of(good, tmp_path)
    before = snapshot(ck)
    proc = run_mpi(2, [*TRAIN, *SMALL, "--steps", "1", "--save-dir", ck], timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    errors = errors_of(proc)
    assert len(errors) == 1 and "already holds checkpoints (step_000002" in errors[0], proc.stderr
    assert "--resume" in errors[0] and "--overwrite" in errors[0]
    assert snapshot(ck) == before
    # --overwrite: the old run's checkpoint goes once this run's first one is saved.
    proc = run_mpi(2, [*TRAIN, *SMALL, "--steps", "1", "--save-dir", ck, "--overwrite"], timeout=60)
    assert "removed the earlier run's checkpoints step_000002" in proc.stdout, proc.stdout
    assert tree(ck) == ["latest", "step_000001"]


def write_lock(ck, **fields):
    ck.mkdir(exist_ok=True)
    lock = {"host": socket.gethostname(), "pid": os.getpid(), "start": None, "since": "2000-01-01 00:00:00"}
    lock.update(fields)
    (ck / ".zerompi.lock").write_text(json.dumps(lock))


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("holder,expect", [
    pytest.param({}, "in use by another job (pid {pid} on this host", marks=pytest.mark.slow),   # waits HOLDER_WAIT_S
    ({"host": "elsewhere-node"}, "locked by pid {pid} on host elsewhere-node"),
])
def test_a_second_job_in_the_same_save_dir_stops_at_start(tmp_path, holder, expect):
    ck = tmp_path / "ck"
    write_lock(ck, **holder)
    proc = run_mpi(2, [*TRAIN, *SMALL, "--steps", "1", "--save-dir", ck], timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    errors = errors_of(proc)
    assert len(errors) == 1 and expect.format(pid=os.getpid()) in errors[0], proc.stderr
    assert "step " not in proc.stdout and tree(ck) == [".zerompi.lock"]


@pytest.mark.parametrize("holder", [{"pid": "dead"}, {"start": "1"}])   # gone, or its pid now reused
def test_a_stale_lock_on_this_host_is_taken_over(tmp_path, holder):
    ck = tmp_path / "ck"
    write_lock(ck, **{k: (dead_pid() if v == "dead" else v) for k, v in holder.items()})
    proc = run_mpi(2, [*TRAIN, *SMALL, "--steps", "1", "--save-dir", ck], timeout=60)
    assert "zerompi.train: note: took over the lock" in proc.stderr and "no longer running" in proc.stderr
    assert tree(ck) == ["latest", "step_000001"]                # released at the end


@pytest.mark.slow
def test_two_real_jobs_into_one_save_dir(tmp_path):
    ck = tmp_path / "ck"
    # The first job hangs in its second step (rank 1) and holds the lock until its watchdog ends it.
    env = mpi_env({"ZEROMPI_FAULT": "hang@rank1:step2"})     # with the launcher's own settings (Open MPI as root)
    first = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, *TRAIN, *SMALL, "--steps", "3",
                              "--timeout-s", "60", "--save-dir", str(ck)], cwd=str(ROOT), env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ranks = {}
    try:
        deadline = time.monotonic() + 60
        while not (ck / ".zerompi.lock").exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.2)
        assert (ck / ".zerompi.lock").exists()
        ranks = rank_pids(first.pid, 2, b"zerompi.train")
        proc = run_mpi(2, [*TRAIN, *SMALL, "--steps", "1", "--save-dir", ck, "--overwrite"], timeout=60, check=False)
        assert proc.returncode == 2 and "in use by another job" in proc.stderr, proc.stderr
    finally:
        kill_tree(first)           # the launcher and its ranks: os.killpg left Open MPI's hung rank 1 running
    left = still_alive(ranks.values())
    assert not left, f"ranks {left} of the killed job still run"


def test_a_missing_or_broken_latest_names_the_complete_checkpoints(good, tmp_path):
    ck = copy_of(good, tmp_path)
    shutil.copytree(ck / "step_000002", ck / "step_000001")
    (ck / ".tmp-step_000003-deadbeef").mkdir()                  # an interrupted save: not offered
    for broken in (None, "step_000003\n", ""):
        if broken is None:
            (ck / "latest").unlink()
        else:
            (ck / "latest").write_text(broken)
        proc = run_mpi(2, [*TRAIN, *SMALL, "--stage", "3", "--steps", "4", "--resume", ck], timeout=60, check=False)
        assert proc.returncode == 2, proc.stderr
        line, = errors_of(proc)
        assert "the complete checkpoints there are step_000001, step_000002" in line, line
        assert f"--resume {ck / 'step_000002'}" in line, line
    run_train(2, tmp_path, *SMALL, "--stage", "3", "--steps", "4", "--resume", ck / "step_000002")


def test_the_new_flags_are_checked():
    from zerompi.errors import ConfigError
    from zerompi.train.config import parse_config
    for flags, message in ((["--keep-last", "0", "--save-dir", "x"], "keep_last=0 must be an integer >= 1"),
                           (["--async-save"], "async_save=True needs save_dir"),
                           (["--keep-last", "2"], "keep_last=2 needs save_dir"),
                           (["--overwrite"], "overwrite=True needs save_dir")):
        with pytest.raises(ConfigError, match=message):
            parse_config(flags)
    cfg = parse_config(["--save-dir", "x", "--async-save", "--keep-last", "3", "--overwrite"])
    assert cfg.async_save and cfg.keep_last == 3 and cfg.overwrite


def test_the_background_writer_needs_no_mpi():
    """The writer thread's module (and the save directory's) load where mpi4py cannot be imported:
    no MPI call can come from the background thread."""
    code = ("import sys; sys.modules['mpi4py'] = None; import zerompi.checkpoint.writer, "
            "zerompi.checkpoint.savedir, zerompi.checkpoint.format; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=str(ROOT))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
