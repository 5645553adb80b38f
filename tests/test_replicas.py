"""A job that carries on: ``python -m zerompi.run`` over ``--replicas`` (train/replicas.py, run/).

A rank killed (kill -9) or a whole emulated node lost (its ranks killed and its shared-memory folder wiped) in
the middle of a run: the supervisor relaunches, the job finishes with exit 0, at most one step is lost, and the
final parameters equal bit for bit those of an independent oracle: a run that saved a disk checkpoint at the
restored step, resumed from it at the new world size (checkpoint/collective.py's resume). Give-ups and bad
input are one line. Nothing is left in /dev/shm.
"""
import json
import os
import sys
import threading
import time

import numpy as np
import pytest

from tests.mpirun import ROOT, mpi_env, one_line, run_mpi, run_tree
from zerompi.checkpoint.format import build_manifest, read_manifest
from zerompi.checkpoint.replica_files import assemble, commit, job_dir, rank_dir, step_dir
from zerompi.checkpoint.writer import write_shard
from zerompi.run import segments

GPT = ["--steps", "8", "--batch", "24", "--progress", "lines", "--eval-every", "0"]


def supervise(tmp_path, job, n, flags, kill_at=None, ranks=(), wipe=False, extra=(), timeout=240, env=None):
    """``python -m zerompi.run`` with ``flags``; with ``kill_at``, a thread kills ``ranks`` once every rank has
    committed step ``kill_at`` (and wipes their nodes' folders with ``wipe``). (process, metrics or None)."""
    from zerompi.run.supervisor import kill
    from zerompi.run.watch import ranks_of
    metrics = tmp_path / f"{job}.json"
    cmd = [sys.executable, "-m", "zerompi.run", "-n", str(n), *extra, "--", *flags, "--replicas", job,
           "--metrics-json", str(metrics)]
    done, restore_left = threading.Event(), []

    def killer():
        while not done.is_set():
            seen = ranks_of(job)
            if len(seen) == n and all((r.get("step") or 0) >= kill_at for r in seen.values()):
                kill(job, list(ranks), wipe)
                break
            time.sleep(0.005)
        while not done.is_set():           # once a step after the restore is committed, its folder is freed
            seen = ranks_of(job)
            if seen and min(r.get("step") or 0 for r in seen.values()) > kill_at + 1:
                restore_left.append(os.path.exists(os.path.join(job_dir(job), "restore")))
                return
            time.sleep(0.005)

    before = segments.present()
    thread = threading.Thread(target=killer, daemon=True) if kill_at else None
    if thread:
        thread.start()
    try:
        proc = run_tree(cmd, timeout, mpi_env(env))
    finally:
        done.set()
    assert not os.path.exists(job_dir(job)), os.listdir(job_dir(job))
    assert not any(restore_left), "the restore folder outlived the first commit after the restore"
    busy = segments.held()      # the killed attempts' MPI segments: removed by the supervisor, not left to pile up
    left = [n for n in segments.present() - before if segments.SEGMENT.match(n) and f"{segments.SHM}/{n}" not in busy]
    assert not left, left
    return proc, json.loads(metrics.read_text()) if metrics.exists() else None


def oracle(tmp_path, n_before, n_after, flags, step):
    """The digest of a run saved to disk at ``step`` on ``n_before`` ranks and resumed on ``n_after``."""
    ck = tmp_path / "ck"
    run_mpi(n_before, ["-m", "zerompi.train", *flags, "--steps", str(step), "--save-dir", ck], timeout=180)
    out = tmp_path / "oracle.json"
    run_mpi(n_after, ["-m", "zerompi.train", *flags, "--resume", ck, "--metrics-json", out], timeout=180)
    return json.loads(out.read_text())["final_params_sha256"]


def tiny_engine():
    """What build_manifest reads of an engine: 6 parameters in 2 shards of 32 at step 5, stage 3, AdamW's rows."""
    from zerompi.engine.config import ZeroConfig
    from zerompi.layout import FlatLayout

    class Engine:
        layout = FlatLayout([("l0", [("w", (6,))])], 2, 64, 1)
        steps_taken, step_count, config, optimizer = 5, 5, ZeroConfig(stage=3), None
        scaler = type("Scaler", (), {"state_dict": lambda self: {"scale": 1.0, "good_steps": 0}})()

        def recorded_config(self):
            return {}
    return Engine()


def job_name(tag):
    return f"test-{os.getpid()}-{tag}"


@pytest.mark.parametrize("stage", [3, 1])
def test_a_killed_rank_costs_at_most_one_step_and_no_bits(tmp_path, stage):
    flags = GPT + ["--stage", str(stage), "--node-size", "2"]
    proc, m = supervise(tmp_path, job_name(f"rank{stage}"), 4, flags, kill_at=3, ranks=[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    [f] = m["failures"]
    assert f["rank"] == 1 and f["steps_lost"] <= 1 and f["restored_step"] >= 3, f
    assert all(f[k] is not None and f[k] >= 0 for k in ("detect_s", "relaunch_s", "restore_s", "recovery_s")), f
    assert "zerompi.run: rank 1 (" in proc.stderr and "recovered from failure 1" in proc.stderr
    assert m["final_params_sha256"] == oracle(tmp_path, 4, 4, flags, f["restored_step"])


def failing_launcher(tmp_path, which: int) -> str:
    """A --launcher whose launch number ``which`` (0: the first) fails before any rank starts, as Open MPI's PMIx
    server does now and then in a fresh network namespace; the others are mpiexec's. Counts in tmp_path/launches."""
    from tests.mpirun import mpiexec
    count = tmp_path / "launches"
    script = (f'c=$(cat {count} 2>/dev/null || echo 0); echo $((c + 1)) > {count}; '
              f'[ "$c" = {which} ] && {{ echo "the launcher failed" >&2; exit 1; }}; exec {mpiexec()} "$@"')
    return f"sh -c '{script}' launcher -n {{n}}"


def test_a_relaunch_whose_launcher_fails_to_start_is_recorded_and_loses_no_step(tmp_path):
    """Rank 1 killed after step 3; the relaunch's launcher then fails before any rank starts: a second record,
    ``started`` false, no rank, no step lost, said in one line; the next restores the same step, finishes
    both recoveries (the kill's spans the failed launch) and ends with the bits of a run resumed there."""
    flags = GPT + ["--stage", "3", "--node-size", "2"]
    proc, m = supervise(tmp_path, job_name("launch"), 4, flags, kill_at=3, ranks=[1],
                        extra=["--launcher", failing_launcher(tmp_path, 1)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    killed, launch = m["failures"]
    assert killed["started"] and killed["rank"] == 1 and killed["steps_lost"] == 1, killed
    assert not launch["started"] and launch["rank"] is None and launch["steps_lost"] == 0, launch
    assert launch["restored_step"] == killed["restored_step"], (killed, launch)
    for f in (killed, launch):
        assert all(f[k] is not None and f[k] >= 0 for k in ("detect_s", "relaunch_s", "restore_s", "recovery_s")), f
    assert killed["relaunch_s"] > launch["relaunch_s"], (killed, launch)     # from its own detection
    assert "zerompi.run: the launch (exit status 1, no rank started) failed at step" in proc.stderr
    assert (tmp_path / "launches").read_text().strip() == "3"
    assert m["final_params_sha256"] == oracle(tmp_path, 4, 4, flags, killed["restored_step"])


def test_a_first_launch_that_fails_to_start_is_launched_again(tmp_path):
    """The first launch fails before any rank starts (nothing committed yet): the same launch again, from the
    start, one record (``started`` false, no step lost), and the bits of the run never relaunched."""
    flags = GPT + ["--stage", "1", "--node-size", "2"]
    proc, m = supervise(tmp_path, job_name("first"), 4, flags, extra=["--launcher", failing_launcher(tmp_path, 0)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    [f] = m["failures"]
    assert (f["started"], f["rank"], f["restored_step"], f["steps_lost"]) == (False, None, None, 0), f
    assert "zerompi.run: the launch (exit status 1, no rank started) failed; launching it again from the start" \
        in proc.stderr
    out = tmp_path / "plain.json"
    run_mpi(4, ["-m", "zerompi.train", *flags, "--metrics-json", out], timeout=180)
    assert m["final_params_sha256"] == json.loads(out.read_text())["final_params_sha256"]


def test_a_lost_node_is_restored_from_its_buddies(tmp_path):
    """Both ranks of node 1 killed and its shared memory wiped: its shards come from node 0's buddy copies."""
    flags = GPT + ["--stage", "3", "--node-size", "2"]
    proc, m = supervise(tmp_path, job_name("node"), 4, flags, kill_at=4, ranks=[2, 3], wipe=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [f] = m["failures"]
    assert f["steps_lost"] <= 1 and f["rank"] == 2, f
    assert m["final_params_sha256"] == oracle(tmp_path, 4, 4, flags, f["restored_step"])


@pytest.mark.slow
def test_a_lost_node_in_the_buddy_exchange_loses_one_step(tmp_path):
    """The synchronous commit (the default): each step's buddy exchange held back 1.5 s
    (ZEROMPI_REPLICAS_SEND_DELAY_S) and node 1 lost once step 3 is committed, while step 4's copies are on
    their way: step 3 is on both nodes, one step lost (an exchange behind the next step would lose two)."""
    flags = GPT + ["--stage", "3", "--node-size", "2"]
    proc, m = supervise(tmp_path, job_name("window"), 4, flags, kill_at=3, ranks=[2, 3], wipe=True,
                        env={"ZEROMPI_REPLICAS_SEND_DELAY_S": "1.5"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    [f] = m["failures"]
    assert (f["failed_step"], f["restored_step"], f["steps_lost"]) == (4, 3, 1), f
    assert m["final_params_sha256"] == oracle(tmp_path, 4, 4, flags, f["restored_step"])


def test_shrink_reshards_to_the_ranks_left(tmp_path):
    """4 nodes of 1, rank 3 lost, --shrink: the job goes on at N=3 (resharded by the checkpoint's load)."""
    flags = GPT + ["--stage", "3", "--node-size", "1"]
    proc, m = supervise(tmp_path, job_name("shrink"), 4, flags, kill_at=3, ranks=[3], wipe=True, extra=["--shrink"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    [f] = m["failures"]
    assert m["world_size"] == 3 and f["steps_lost"] <= 1, (m["world_size"], f)
    assert m["final_params_sha256"] == oracle(tmp_path, 4, 3, flags, f["restored_step"])


def test_no_surviving_copy_gives_up_in_one_line(tmp_path):
    """4 nodes of 1: node 1 and its buddy node 2 lost (rank 1's copy lives on rank 2): shard 1 has no copy."""
    flags = GPT + ["--stage", "3", "--node-size", "1"]
    proc, _ = supervise(tmp_path, job_name("gone"), 4, flags, kill_at=2, ranks=[1, 2], wipe=True)
    line = one_line(proc, 1, "zerompi.run: giving up: rank 1 (", "no surviving copy of shard 1 of committed step")
    assert "a node and its buddy both lost" in line


@pytest.mark.parametrize("args, needle", [
    (["--max-restarts", "-1", "--", "--node-size", "2"], "--max-restarts -1 is not allowed"),
    (["--", "--node-size", "4"], "make 1 node: use 2 nodes or more"),
    (["--", "--stage", "3"], "no node size is given"),
    (["--", "--replicas", "a/b", "--node-size", "2"], "replicas='a/b' is not a job name"),
    (["--max-restarts", "2"], "no train flags: use python -m zerompi.run -n N"),
    (["--launcher", "mpiexec -n 4", "--", "--node-size", "2"], "has no {n}"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    proc = run_tree([sys.executable, "-m", "zerompi.run", "-n", "4", *args], 60, mpi_env())
    one_line(proc, 2, "zerompi.run: error:", needle)


def test_assemble_links_each_shard_from_a_surviving_copy(tmp_path, monkeypatch):
    """No MPI: two nodes of one rank, each folder holding its own shard of step 5 and the other's copy. Node 0
    wiped: step 5 is assembled from node 1's folder alone (hard links, the manifest beside them), the shards'
    bytes those written; node 1's copy of shard 0 lost too: one line names the shard with no copy."""
    monkeypatch.setenv("ZEROMPI_REPLICAS_ROOT", str(tmp_path))
    e = tiny_engine()
    numel = e.layout.shard_numel
    rows = [np.full((3, numel), 1.5 + r, np.float32) for r in (0, 1)]
    entries = []
    for r in (0, 1):
        here = step_dir(rank_dir("j", r, r), 5)
        os.makedirs(here)
        entries.append(write_shard(here, r, numel, iter(rows[r])))
        write_shard(here, 1 - r, numel, iter(rows[1 - r]))          # the copy of the rank whose buddy it is
    for r in (0, 1):
        commit(rank_dir("j", r, r), 5, {"": build_manifest(e, entries, {"data_step": 5})})
    import shutil
    shutil.rmtree(os.path.join(job_dir("j"), "node000"))
    step, folder = assemble("j")
    manifest, saved = read_manifest(folder)
    assert step == 5 and manifest["extra"] == {"data_step": 5}
    for r in (0, 1):
        assert np.array_equal(np.load(os.path.join(folder, f"shard_{r:05d}.npy")), rows[r])
    shutil.rmtree(os.path.join(job_dir("j"), "restore"))
    os.unlink(os.path.join(step_dir(rank_dir("j", 1, 1), 5), "shard_00000.npy"))
    with pytest.raises(Exception, match="no surviving copy of shard 0 of committed step 5"):
        assemble("j")


def test_a_run_cleans_its_own_jobs_stale_folder_only(tmp_path):
    """What a killed run of job A left (a rank folder, a restore folder) is removed by the next run of A, which
    leaves nothing behind; job B's folder is not touched. The run's bits are those of a run without --replicas."""
    a, b = job_name("stale-a"), job_name("stale-b")
    for job in (a, b):
        os.makedirs(os.path.join(rank_dir(job, 0, 0), "step_000003"))
        os.makedirs(os.path.join(job_dir(job), "restore", "step_000003"))
    try:
        flags = ["-m", "zerompi.train", *GPT, "--steps", "3", "--node-size", "1"]
        out = run_mpi(2, [*flags, "--replicas", a, "--metrics-json", tmp_path / "a.json"], timeout=120).stdout
        assert f"replicas (shared memory, {a}):" in out and "2 steps x 2 files x (12 S + 128)" in out
        run_mpi(2, [*flags, "--metrics-json", tmp_path / "plain.json"], timeout=120)
        assert not os.path.exists(job_dir(a))
        assert os.path.isdir(os.path.join(rank_dir(b, 0, 0), "step_000003"))
        got, want = (json.loads((tmp_path / f"{t}.json").read_text()) for t in ("a", "plain"))
        assert got["final_params_sha256"] == want["final_params_sha256"] and got["losses"] == want["losses"]
        assert got["failures"] == [] and want["replicas"] is None and got["replicas"]["commit_s"] > 0
    finally:
        import shutil
        shutil.rmtree(job_dir(b), ignore_errors=True)


def test_a_relaunch_goes_on_saving_into_the_runs_save_dir(tmp_path):
    """With --save-dir: the relaunch (resumed from the replicas) continues the run whose checkpoints the folder
    holds (not refused as another run's), saves its later steps there, and ends with the bits of a run that
    never failed (same N: the resume is exact)."""
    flags = GPT + ["--stage", "1", "--node-size", "2"]
    ck = tmp_path / "ck"
    proc, m = supervise(tmp_path, job_name("saves"), 4, flags + ["--save-dir", str(ck), "--save-every", "2"],
                        kill_at=3, ranks=[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert m["failures"][0]["steps_lost"] <= 1
    assert (ck / "latest").read_text().startswith("step_000008")
    run_mpi(4, ["-m", "zerompi.train", *flags, "--metrics-json", tmp_path / "straight.json"], timeout=180)
    assert m["final_params_sha256"] == json.loads((tmp_path / "straight.json").read_text())["final_params_sha256"]


@pytest.mark.parametrize("extra", [["--stage", "0"], ["--stage", "3", "--hpz"], ["--stage", "3", "--shard-size", "2"],
                                   ["--stage", "1", "--offload-optimizer", "cpu", "--dtype", "fp32"],
                                   ["--stage", "3", "--optimizer", "muon"]])
def test_replicas_change_no_bits(tmp_path, extra):
    """--replicas copies the state and changes nothing of the run: losses and final parameters as without."""
    flags = ["-m", "zerompi.train", *GPT, "--steps", "3", "--node-size", "2", *extra]
    job = job_name("bits")
    run_mpi(4, [*flags, "--replicas", job, "--metrics-json", tmp_path / "r.json"], timeout=120)
    run_mpi(4, [*flags, "--metrics-json", tmp_path / "p.json"], timeout=120)
    got, want = (json.loads((tmp_path / f"{t}.json").read_text()) for t in ("r", "p"))
    assert got["final_params_sha256"] == want["final_params_sha256"] and got["losses"] == want["losses"]
    assert got["replicas"]["shm_bytes"] >= got["replicas"]["theory_bytes"]["total"] // 2 > 0
    assert got["replicas"]["theory_bytes"]["rows"] == (4 if "muon" in extra else 3)   # the optimizer's rows
    assert not os.path.exists(job_dir(job))


def test_a_supervisor_ended_by_sigterm_ends_its_job_and_leaves_nothing(tmp_path):
    """SIGTERM to the supervisor mid-run: its job's processes are ended, the job's folder removed, no unheld MPI
    segment of it left."""
    import signal
    import subprocess
    from tests.mpirun import alive
    from zerompi.run.watch import ranks_of
    job = job_name("term")
    before = segments.present()
    cmd = [sys.executable, "-m", "zerompi.run", "-n", "4", "--", *GPT, "--steps", "400", "--node-size", "2",
           "--replicas", job]
    proc = subprocess.Popen(cmd, env=mpi_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 120
        while not (len(ranks_of(job)) == 4 and all(r.get("step") for r in ranks_of(job).values())):
            assert time.monotonic() < end and proc.poll() is None, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.01)
        pids = [r["pid"] for r in ranks_of(job).values()]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not alive(pids) and not os.path.exists(job_dir(job))
    busy = segments.held()
    assert not [n for n in segments.present() - before if segments.SEGMENT.match(n) and f"{segments.SHM}/{n}"
                not in busy]


def test_help_is_printed_and_exits_0():
    proc = run_tree([sys.executable, "-m", "zerompi.run", "--help"], 60, mpi_env())
    assert proc.returncode == 0 and "--max-restarts" in proc.stdout and "--launcher" in proc.stdout, proc.stderr


@pytest.mark.parametrize("kind", ["crc32", "zck64"])
def test_assemble_passes_over_a_damaged_copy_while_the_other_is_sound(tmp_path, monkeypatch, kind):
    """No MPI: two nodes of one rank, each folder holding its own shard of step 5 and the other's copy (entries of
    the kind given: zck64, the replicas' own, or CRC-32). One byte of node 0's shard 0 changed: step 5 is
    assembled with node 1's copy, the bytes written; both copies changed: the restore's load refuses shard 0 in
    one line (verify_shard), never a damaged shard used."""
    import shutil
    from zerompi.checkpoint.format import CheckpointError, verify_shard, zck64
    monkeypatch.setenv("ZEROMPI_REPLICAS_ROOT", str(tmp_path))
    e = tiny_engine()
    numel = e.layout.shard_numel
    rows = [np.arange(3 * numel, dtype=np.float32).reshape(3, numel) + 10 * r for r in (0, 1)]
    entries = []
    for r in (0, 1):
        here = step_dir(rank_dir("j", r, r), 5)
        os.makedirs(here)
        entry = write_shard(here, r, numel, iter(rows[r]))
        write_shard(here, 1 - r, numel, iter(rows[1 - r]))
        if kind == "zck64":
            with open(os.path.join(here, entry["file"]), "rb") as f:
                entry = {"file": entry["file"], "bytes": entry["bytes"], "zck64": zck64(f.read())}
        entries.append(entry)
    for r in (0, 1):
        commit(rank_dir("j", r, r), 5, {"": build_manifest(e, entries, {"data_step": 5})})

    def damage(r):
        path = os.path.join(step_dir(rank_dir("j", r, r), 5), "shard_00000.npy")
        data = bytearray(open(path, "rb").read())
        data[-7] ^= 1
        open(path, "wb").write(bytes(data))
    damage(0)
    step, folder = assemble("j")
    manifest = read_manifest(folder)[0]
    assert step == 5 and kind in manifest["shards"][0]
    assert np.array_equal(np.load(verify_shard(folder, manifest, 0)), rows[0])
    shutil.rmtree(os.path.join(job_dir("j"), "restore"))
    damage(1)
    step, folder = assemble("j")
    with pytest.raises(CheckpointError, match=f"{kind} checksum mismatch: the file is corrupted"):
        verify_shard(folder, read_manifest(folder)[0], 0)


@pytest.mark.parametrize("fused", [True, False])
def test_a_shards_entry_is_its_files_checksum(tmp_path, monkeypatch, fused):
    """No MPI: Replicas._copy writes a stage-0 engine's rows (two buckets' slices each: pieces, in shard order)
    into its mapped shard file; the entry is the written file's checksum, read back by file_checksum: zck64
    taken in the copy's pass, or CRC-32 of the file where the kernel does not build (``fused`` False)."""
    from zerompi.checkpoint import replicas
    from zerompi.checkpoint.format import file_checksum, zck64
    from zerompi.engine.config import ZeroConfig
    if not fused:
        monkeypatch.setattr(replicas, "zck64_stream", lambda: None)
    elif zck64(b"") is None:
        pytest.skip("the checksum kernel does not build here")
    rng = np.random.default_rng(3)
    full = {name: rng.random(40, np.float32) for name in ("master", "exp_avg", "exp_avg_sq")}
    buckets = [type("B", (), {"world_slice": lambda self, slot, a=a: slice(a + 3 * slot, a + 3 * slot + 3)})()
               for a in (0, 20)]

    class Engine:
        config, layout = ZeroConfig(stage=0), type("L", (), {"buckets": buckets})()
        optimizer = type("O", (), {"rows": None, "read_row": lambda self, name: full[name]})()
        slot = 1
    r = replicas.Replicas.__new__(replicas.Replicas)
    r._maps, r.table, r.rank, r.theirs, entries = {}, [[("", 1, (3, 6))]], 0, [], {}
    arr = r._copy(Engine(), str(tmp_path), "", 1, (3, 6), entries)
    want = np.stack([np.r_[v[3:6], v[23:26]] for v in full.values()])
    assert np.array_equal(arr, want)
    path = tmp_path / "shard_00001.npy"
    kind = "zck64" if fused else "crc32"
    assert entries[""] == {"file": path.name, "bytes": path.stat().st_size, kind: file_checksum(str(path), kind)}
    assert np.array_equal(np.load(path), want)
    for f, _, _ in r._maps.values():
        f.close()


def test_a_zck64_entry_is_verified_at_load(tmp_path):
    """A replica manifest's zck64 entry: verify_shard accepts the file as written and refuses one changed byte
    (one line naming the file) -- the check a restore makes before it uses a shard."""
    from zerompi.checkpoint.format import CheckpointError, verify_shard, zck64
    numel = 8
    write_shard(str(tmp_path), 0, numel, iter(np.arange(3 * numel, dtype=np.float32).reshape(3, numel)))
    path = tmp_path / "shard_00000.npy"
    data = path.read_bytes()
    manifest = {"shards": [{"file": path.name, "bytes": len(data), "zck64": zck64(data)}], "world_size": 1,
                "shard_numel": numel, "optimizer": {"name": "adamw"}}
    assert verify_shard(str(tmp_path), manifest, 0) == str(path)
    path.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    with pytest.raises(CheckpointError, match="zck64 checksum mismatch: the file is corrupted"):
        verify_shard(str(tmp_path), manifest, 0)


def test_an_injected_fault_fires_in_the_first_launch_only(tmp_path):
    """ZEROMPI_FAULT=exit@rank1:step3 ends rank 1 in step 3 (os._exit, no cleanup); the relaunch, resumed at the
    committed step 2, runs step 3 again without the hook (else it would fail there for ever) and finishes."""
    flags = GPT + ["--stage", "3", "--node-size", "2"]
    job = job_name("fault")
    cmd = [sys.executable, "-m", "zerompi.run", "-n", "4", "--max-restarts", "1", "--", *flags, "--replicas", job,
           "--metrics-json", str(tmp_path / "m.json")]
    proc = run_tree(cmd, 240, mpi_env({"ZEROMPI_FAULT": "exit@rank1:step3"}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    [f] = json.loads((tmp_path / "m.json").read_text())["failures"]
    assert (f["failed_step"], f["restored_step"], f["steps_lost"]) == (3, 2, 1), f
    assert not os.path.exists(job_dir(job))


@pytest.mark.slow
def test_soak_every_kill_recovered_and_the_bits_kept():
    """scripts/soak_replicas.py: a random rank killed every ~15 steps over 60; exit 0 means every kill recovered,
    at most one step lost each, the final digest that of the run without faults."""
    proc = run_tree([sys.executable, str(ROOT / "scripts" / "soak_replicas.py"), "--steps", "60", "--every", "15"],
                    900, mpi_env())
    out = json.loads(proc.stdout)
    assert proc.returncode == 0 and out["ok"] and len(out["kills"]) >= 2, out


@pytest.mark.parametrize("done", [True, False])
def test_a_rank_that_finished_is_no_failure(tmp_path, monkeypatch, done):
    """No MPI: a fake launcher registers a rank whose process has ended, then exits 0 half a second later (ranks
    leave before their launcher does). Marked done (its run closed), the attempt ends with status 0; not done,
    it is a failure, detected."""
    from zerompi.run.watch import attempt
    monkeypatch.setenv("ZEROMPI_REPLICAS_ROOT", str(tmp_path))
    script = ("import json, os, subprocess, time, sys\n"
              "p = subprocess.Popen(['true']); p.wait()\n"
              "d = os.path.join(sys.argv[1], 'ranks'); os.makedirs(d)\n"
              "json.dump({'rank': 0, 'pid': p.pid, 'host': 'h', 'node': 0, 'step': 5, 't': time.time(), "
              f"'done': {done}}}, open(os.path.join(d, 'rank00000.json'), 'w'))\n"
              "time.sleep(0.5)\n")
    out = attempt([sys.executable, "-c", script, job_dir("j")], dict(os.environ), "j", lambda: None)
    assert (out.status, [d["rank"] for d in out.dead]) == ((0, []) if done else (None, [0])), out
