"""The supervisor across emulated nodes (scripts/cluster.py: network and host-name namespaces), nodes found by MPI.

2 nodes x 2 ranks, GPT at stage 3: a rank killed with kill -9, and a node lost (both its ranks killed, its
shared-memory folder wiped): ``python -m zerompi.run --launcher ...`` relaunches over the same nodes, the job
ends with exit 0, at most one step lost, and its final parameters equal those of a run that never failed (the
same N: the checkpoint's resume is exact). A cluster of one node: one line, exit 2. The slow matrix: 2 nodes x 2
ranks and 4 x 1, GPT at stage 3, stage 1, stage 3 with --hpz, and --pp 2, each with a rank killed, a node lost
and a node's link cut, against the same oracle.
"""
import json
import os
import shlex
import subprocess
import sys
import threading
import time

import pytest

from tests.mpirun import ROOT

pytestmark = pytest.mark.cluster
sys.path.insert(0, str(ROOT / "scripts"))

import cluster_mpi  # noqa: E402

from zerompi.checkpoint.replica_files import job_dir  # noqa: E402
from zerompi.run.supervisor import kill  # noqa: E402
from zerompi.run.watch import ranks_of  # noqa: E402
from zerompi.train.replicas import read_failures  # noqa: E402

GPT = ["python", "-m", "zerompi.train", "--steps", "8", "--batch", "24", "--stage", "3", "--progress", "lines",
       "--eval-every", "0"]
LIMIT = 240


def supervised(c, tmp_path, job, nodes=2, kill_at=None, ranks=(), wipe=False, cut=False, flags=(), per_node=2):
    """(process, metrics or None) of the supervisor over ``nodes`` nodes of ``c``, ``per_node`` ranks each; ``cut``:
    instead of a kill, node 1's link is cut, and restored once the supervisor recorded the failure (a record more
    than before the cut)."""
    probe = cluster_mpi.Job(c, per_node, GPT, nodes=nodes)
    start = probe.launch_command()
    at = start.index("-n")
    start[at + 1] = "{n}"
    launcher = shlex.join(c.command(0, start[:start.index(sys.executable)]))
    out = tmp_path / f"{job}.json"
    n = per_node * nodes
    cmd = [sys.executable, "-m", "zerompi.run", "-n", str(n), "--launcher", launcher, "--",
           *GPT[3:], *flags, "--replicas", job, "--metrics-json", str(out)]
    done = threading.Event()

    def killer():
        while not done.is_set():
            seen = ranks_of(job)
            if len(seen) == n and all((r.get("step") or 0) >= kill_at for r in seen.values()):
                if not cut:
                    kill(job, list(ranks), wipe)
                    return
                before = len(read_failures(job))     # a launch that failed before any rank started has its own
                c.cut(1)
                while not done.is_set() and len(read_failures(job)) <= before:    # the cut's record, not that one
                    time.sleep(0.01)
                c.restore(1)
                return
            time.sleep(0.005)
    if kill_at:
        threading.Thread(target=killer, daemon=True).start()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=probe.process_env(), cwd=str(ROOT),
                              timeout=LIMIT)
    finally:
        done.set()
    assert not os.path.exists(job_dir(job))
    return proc, json.loads(out.read_text()) if out.exists() else None


def the_fault(failures):
    """The failures of ranks that ran: a relaunch whose launcher failed before any rank started (Open MPI's PMIx
    server in a fresh namespace, now and then: cluster_mpi.LAUNCH_FAILURES; seen once in this file's runs under
    Open MPI) is a record of its own, ``started`` false, no step lost, and is launched again."""
    assert all(f["steps_lost"] == 0 and f["rank"] is None for f in failures if not f["started"]), failures
    return [f for f in failures if f["started"]]


def straight(c, tmp_path, flags=(), per_node=2) -> str:
    path = tmp_path / "straight.json"
    proc = cluster_mpi.Job(c, per_node, GPT + [*flags, "--metrics-json", path]).run(timeout=LIMIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(path.read_text())["final_params_sha256"]


@pytest.mark.slow
def test_a_killed_rank_and_a_lost_node_on_real_nodes(cluster, tmp_path):
    c = cluster(2)
    want = straight(c, tmp_path)
    for tag, ranks, wipe in (("rank", [1], False), ("node", [2, 3], True)):
        proc, m = supervised(c, tmp_path, f"cl-{os.getpid()}-{tag}", kill_at=3, ranks=ranks, wipe=wipe)
        assert proc.returncode == 0, proc.stderr[-3000:]
        [f] = the_fault(m["failures"])
        assert f["steps_lost"] <= 1 and f["host"] == f"node{ranks[0] // 2}", f
        assert m["final_params_sha256"] == want, tag


def test_one_node_is_one_line(cluster, tmp_path):
    c = cluster(1)
    proc, _ = supervised(c, tmp_path, f"cl-{os.getpid()}-one", nodes=1)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("zerompi")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "keeps each shard's second copy on another node" in lines[0], lines


@pytest.mark.slow
def test_a_cut_link_ends_in_the_watchdog_and_the_job_goes_on(cluster, tmp_path):
    """Node 1's link cut mid-run: MPI hangs silently, the watchdog (--timeout-s 3) ends every rank (the first to
    exit is what the supervisor names), it relaunches once the link is back (a relaunch while it is still down
    fails at the launch and counts as one more failure), and the run ends with the bits of one that never failed."""
    c = cluster(2)
    want = straight(c, tmp_path)
    proc, m = supervised(c, tmp_path, f"cl-{os.getpid()}-cut", kill_at=3, cut=True, flags=["--timeout-s", "3"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "failed at step" in proc.stderr and "recovered from failure 1" in proc.stderr, proc.stderr[-3000:]
    assert m["failures"] and all(f["steps_lost"] <= 1 for f in m["failures"]), m["failures"]
    assert m["final_params_sha256"] == want


@pytest.mark.slow
def test_a_cut_link_behind_the_step_loses_at_most_two_steps_and_no_bits(cluster, tmp_path):
    """The same cut with ``--replicas-commit behind`` (each step's copies committed after the next step): the
    watchdog ends the job, the relaunch restores the last committed step (at most two behind the step in flight),
    and the run ends with the bits of the one that never failed."""
    c = cluster(2)
    want = straight(c, tmp_path)
    proc, m = supervised(c, tmp_path, f"cl-{os.getpid()}-cut-behind", kill_at=3, cut=True,
                         flags=["--timeout-s", "3", "--replicas-commit", "behind"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recovered from failure 1" in proc.stderr, proc.stderr[-3000:]
    assert m["failures"] and all(f["steps_lost"] <= 2 for f in m["failures"]), m["failures"]
    assert m["final_params_sha256"] == want


CONFIGS = {"stage3": [], "stage1": ["--stage", "1"], "hpz": ["--hpz"], "pp2": ["--pp", "2", "--micro-batches", "2"]}


@pytest.mark.slow
@pytest.mark.parametrize("nodes, per_node, config", [(n, r, cfg) for n, r in ((2, 2), (4, 1)) for cfg in CONFIGS
                                                     if (n, r, cfg) != (2, 2, "stage3")])   # that one: above
def test_faults_on_real_nodes_cost_at_most_one_step_and_no_bits(cluster, tmp_path, nodes, per_node, config):
    """On ``nodes`` x ``per_node``: rank 1 killed (kill -9) after step 3, the node of rank 2 lost (its ranks
    killed, its shared-memory folder wiped), and node 1's link cut (the watchdog's --timeout-s 3 ends the job):
    each run exits 0 with every failure's steps lost <= 1 and ends with the final parameters of the run that
    never failed (relaunched at the same N, where the resume from the restored step is exact)."""
    c = cluster(nodes)
    flags = CONFIGS[config]
    want = straight(c, tmp_path, flags, per_node)
    node2 = [r for r in range(nodes * per_node) if r // per_node == 2 // per_node]
    for tag, ranks, wipe, cut in (("rank", [1], False, False), ("node", node2, True, False), ("cut", [], False, True)):
        extra = ["--timeout-s", "3"] if cut else []
        proc, m = supervised(c, tmp_path, f"cl-{os.getpid()}-{config}-{nodes}-{tag}", nodes=nodes, kill_at=3,
                             ranks=ranks, wipe=wipe, cut=cut, flags=[*flags, *extra], per_node=per_node)
        assert proc.returncode == 0, (tag, proc.stderr[-3000:])
        assert m["failures"] and all(f["steps_lost"] <= 1 for f in m["failures"]), (tag, m["failures"])
        if not cut:
            [f] = the_fault(m["failures"])
            assert f["host"] == f"node{ranks[0] // per_node}" and f["restored_step"] >= 3, (tag, f)
        assert m["final_params_sha256"] == want, tag
