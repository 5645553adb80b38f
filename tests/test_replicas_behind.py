"""``--replicas-commit behind``: each step's replica copy and buddy exchange finished after the next step.

The copy changes no bit of the run (the same losses and final parameters as the synchronous commit and as a run
without replicas); a rank killed (kill -9) under ``python -m zerompi.run`` is recovered from the copies committed
behind, with the final parameters of a run that never failed, and the supervisor's record counts the steps lost
(at most 2: the one in flight and the one whose commit was under way); a bad value is one line and exit 2.
"""
import json
import os
import sys

from tests.mpirun import mpi_env, one_line, run_mpi, run_tree
from tests.test_replicas import GPT, job_name, supervise
from zerompi.checkpoint.replica_files import job_dir


def _run(tmp_path, tag, n, flags, *extra):
    out = tmp_path / f"{tag}.json"
    proc = run_mpi(n, ["-m", "zerompi.train", *flags, *extra, "--metrics-json", out], timeout=180)
    return dict(json.loads(out.read_text()), stdout=proc.stdout)


def test_behind_gives_the_bits_of_sync_and_of_no_replicas(tmp_path):
    """N = 4 in 2 nodes of 2 at stage 3, and N = 3 in 3 nodes of 1 at stage 1 (an odd world): the three runs'
    losses and final parameters are equal; behind's metrics say so and its folder is gone at the end."""
    for n, extra in ((4, ["--stage", "3", "--node-size", "2"]), (3, ["--stage", "1", "--node-size", "1"])):
        flags = [*GPT, "--steps", "5", *extra]
        plain = _run(tmp_path, f"plain{n}", n, flags)
        job = job_name(f"bits{n}")
        sync = _run(tmp_path, f"sync{n}", n, flags, "--replicas", job + "s")
        behind = _run(tmp_path, f"behind{n}", n, flags, "--replicas", job + "b", "--replicas-commit", "behind")
        for got in (sync, behind):
            assert got["final_params_sha256"] == plain["final_params_sha256"] and got["losses"] == plain["losses"]
        assert (sync["replicas"]["commit"], sync["replicas"]["steps_lost_at_most"]) == ("sync", 1)
        assert (behind["replicas"]["commit"], behind["replicas"]["steps_lost_at_most"]) == ("behind", 2)
        assert len(behind["replicas"]["commit_times_s"]) == 6        # 5 steps, and the last one's finished at the end
        assert "(median, finished behind the next step: at most 2 steps lost)" in behind["stdout"]
        assert "finished behind" not in sync["stdout"]
        assert behind["replicas"]["shm_bytes"] == sync["replicas"]["shm_bytes"]   # the same two steps' files
        assert not os.path.exists(job_dir(job + "s")) and not os.path.exists(job_dir(job + "b"))


def test_a_killed_rank_behind_is_recovered_with_the_bits_of_a_run_that_never_failed(tmp_path):
    """kill -9 of rank 1 once every rank has taken 3 steps: exit 0, the supervisor's record counts failed -
    restored steps (1 or 2), and the final parameters are those of the same run without a failure."""
    flags = GPT + ["--stage", "3", "--node-size", "2"]
    proc, m = supervise(tmp_path, job_name("bkill"), 4, flags + ["--replicas-commit", "behind"], kill_at=3,
                        ranks=[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    [f] = m["failures"]
    assert f["rank"] == 1 and f["steps_lost"] == f["failed_step"] - f["restored_step"], f
    assert 1 <= f["steps_lost"] <= 2 and f["restored_step"] >= 2, f
    lost = f"({f['steps_lost']} step{'s' if f['steps_lost'] > 1 else ''} lost)"
    assert f"restoring committed step {f['restored_step']} {lost}" in proc.stderr, proc.stderr
    assert m["final_params_sha256"] == _run(tmp_path, "plain", 4, flags)["final_params_sha256"]


def test_a_rank_ended_in_a_step_behind_loses_that_step_and_the_one_under_commit(tmp_path):
    """ZEROMPI_FAULT ends rank 1 inside step 3 (index 2): 2 steps were taken and, behind, only step 1 is committed
    (step 2's commit is finished after step 3): the record is failed 3, restored 1, 2 steps lost (sync: 3, 2, 1,
    tests/test_replicas.py); the final parameters those of a run that never failed."""
    flags = GPT + ["--stage", "3", "--node-size", "2"]
    job = job_name("bfault")
    cmd = [sys.executable, "-m", "zerompi.run", "-n", "4", "--max-restarts", "1", "--", *flags, "--replicas", job,
           "--replicas-commit", "behind", "--metrics-json", str(tmp_path / "m.json")]
    proc = run_tree(cmd, 240, mpi_env({"ZEROMPI_FAULT": "exit@rank1:step3"}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((tmp_path / "m.json").read_text())
    [f] = m["failures"]
    assert (f["failed_step"], f["restored_step"], f["steps_lost"]) == (3, 1, 2), f
    assert "restoring committed step 1 (2 steps lost)" in proc.stderr and "2 steps lost in all" in proc.stderr
    assert m["final_params_sha256"] == _run(tmp_path, "plain", 4, flags)["final_params_sha256"]
    assert not os.path.exists(job_dir(job))


def test_a_bad_commit_mode_is_one_line_and_exit_2():
    proc = run_tree([sys.executable, "-m", "zerompi.train", *GPT, "--node-size", "2", "--replicas", "j",
                     "--replicas-commit", "later"], 60, mpi_env())
    one_line(proc, 2, "replicas_commit='later' is not allowed; use sync or behind")
    proc = run_tree([sys.executable, "-m", "zerompi.train", *GPT, "--replicas-commit", "behind"], 60, mpi_env())
    one_line(proc, 2, "replicas_commit='behind' needs replicas (--replicas JOB")
    proc = run_tree([sys.executable, "-m", "zerompi.run", "-n", "4", "--", "--node-size", "2", "--replicas-commit",
                     "soon"], 60, mpi_env())
    one_line(proc, 2, "zerompi.run: error:", "replicas_commit='soon' is not allowed")


def test_the_supervisor_takes_behind_without_a_job_name():
    """python -m zerompi.run names the job itself: --replicas-commit behind is taken without --replicas (the
    name is added), and a --replicas given is kept."""
    from zerompi.run.supervisor import configure, parse
    opts, flags = parse(["-n", "4", "--", "--node-size", "2", "--replicas-commit", "behind"])
    cfg, flags, job, _ = configure(opts, flags)
    assert job.startswith("run-") and flags[-2:] == ["--replicas", job] and cfg.replicas_commit == "behind"
    opts, flags = parse(["-n", "4", "--", "--node-size", "2", "--replicas", "mine", "--replicas-commit", "behind"])
    cfg, flags, job, _ = configure(opts, flags)
    assert job == "mine" and flags.count("--replicas") == 1 and cfg.replicas == "mine"


def test_pp_a_lost_node_behind_is_restored_from_its_buddies(tmp_path):
    """--pp 2 (a part per stage, each sent on its own) on 2 nodes of 2: node 1, the whole second stage, killed
    and its shared memory wiped while its copies go behind the next step: the job ends with the bits of a run
    that never failed, from node 0's copies of a step committed on both nodes."""
    flags = GPT + ["--pp", "2", "--micro-batches", "2", "--node-size", "2", "--stage", "3"]
    proc, m = supervise(tmp_path, job_name("bpp"), 4, flags + ["--replicas-commit", "behind"], kill_at=4,
                        ranks=[2, 3], wipe=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [f] = m["failures"]
    assert f["rank"] == 2 and 1 <= f["steps_lost"] == f["failed_step"] - f["restored_step"] <= 2, f
    assert m["replicas"]["parts"] == ["pp0-of-2"] and m["replicas"]["commit"] == "behind"
    assert m["final_params_sha256"] == _run(tmp_path, "plain", 4, flags)["final_params_sha256"]
