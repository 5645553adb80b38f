"""Node faults across emulated nodes (scripts/cluster.py), under this Python's MPI.

- A link cut mid-collective hangs MPI silently: the engine's watchdog ends the job, naming the
  collective, bucket and step and the node that did not answer; one rank prints the flight
  recorder's summary; no rank is left on any node.
- A checkpoint taken before the cut resumes on a fresh cluster to the bits of a run that was
  never cut; a link that flaps for less than the timeout changes nothing, bits included.
- A node's ranks killed: the job ends at once and MPI names the node; a node unreachable at
  the start: the agent's one line, not a hang.
"""
import json
import os
import re
import signal
import sys

import pytest

from tests.mpirun import ROOT

pytestmark = pytest.mark.cluster
sys.path.insert(0, str(ROOT / "scripts"))

import cluster_mpi  # noqa: E402

MLP = ["python", "-m", "zerompi.train", "--model", "mlp", "--width", "64", "--depth", "3", "--batch", "24",
       "--stage", "3", "--bucket-mb", "0.01", "--log-every", "1"]
STEPS = 12
TIMEOUT_S = 3          # the watchdog's, in the cut runs
LIMIT = 120            # the subprocess limit of any job here: a hang fails the test, never CI


def train(c, *flags):
    return cluster_mpi.Job(c, 2, MLP + [str(f) for f in flags])


def sha(path) -> str:
    return json.loads(path.read_text())["final_params_sha256"]


def run_ok(job) -> str:
    proc = job.run(timeout=LIMIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_a_link_that_flaps_changes_nothing_a_cut_one_ends_the_job_and_its_checkpoint_resumes_the_bits(
        cluster, tmp_path):
    c = cluster(2)
    run_ok(train(c, "--steps", STEPS, "--metrics-json", tmp_path / "ref.json"))

    # a link down for less than the timeout: TCP retransmits, the run goes on, the same bits
    job = train(c, "--steps", STEPS, "--timeout-s", 30, "--metrics-json", tmp_path / "flap.json")
    job.start_until("step     2/", LIMIT)
    c.cut(1)
    cluster_mpi.time.sleep(1.5)
    c.restore(1)
    proc = job.wait(LIMIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sha(tmp_path / "flap.json") == sha(tmp_path / "ref.json")

    # a link cut for good mid-step: MPI hangs silently; the watchdog ends the job and names node 1
    ck = tmp_path / "ck"
    job = train(c, "--steps", 400, "--timeout-s", TIMEOUT_S, "--save-dir", ck, "--save-every", 2)
    job.start_until("step     3/", LIMIT)
    c.cut(1)
    if cluster_mpi.flavour() == "mpich":
        proc = job.wait(LIMIT)
        assert proc.returncode == 3, proc.stderr[-3000:]   # EXIT_TIMEOUT: the watchdog ended it
    else:   # Open MPI's mpirun waits for node 1's daemon for ever (docs/cluster.md): the ranks are what ends
        job.wait_for("zerompi: rank 0: flight recorder: rank 3", LIMIT, "stderr")
    assert job.wait_gone(TIMEOUT_S + 15) == {}, job.ranks_left()   # no rank left on any node
    err = job.stderr()
    line = next(err_line for err_line in err.splitlines() if err_line.startswith("zerompi: rank 0: collective timeout"))
    # the line names what rank 0 waited in and the step; where the cut lands decides which of a step's
    # collectives that is: a bucket's, the step's loss and stop-flag sum, or the checkpoint save's agreement
    waited = re.search(r"waited [\d.]+ s in (.+?) at step \d+ ", line)
    assert waited and re.fullmatch(r"\w+ of bucket \d+|sum_scalars|checkpoint save: .+", waited.group(1)), line
    assert "not arrived: no answer from ranks 2-3 on node1 (dead, hung, or cut off" in line, line
    # rank 1, on node 0, answered: in the same collective, or already in the next one (several are in flight)
    assert "waiting in it too: rank 1" in line or "rank 1 (node0) waits in " in line, line
    recorder = [err_line for err_line in err.splitlines() if err_line.startswith("zerompi: rank 0: flight recorder: ")]
    assert len(recorder) == 4 and "rank 2 (node1): no answer" in recorder[2], recorder
    assert "last collectives: " in recorder[0] and "reduce_scatter of bucket" in recorder[0], recorder
    job.kill()                                      # Open MPI's launcher and daemons (nothing under MPICH)
    c.down()

    # the checkpoint taken before the cut, on a fresh cluster: the bits of the run never cut
    fresh = cluster(2)
    run_ok(train(fresh, "--steps", STEPS, "--resume", ck, "--metrics-json", tmp_path / "resumed.json"))
    assert sha(tmp_path / "resumed.json") == sha(tmp_path / "ref.json")


def test_a_nodes_ranks_killed_end_the_job_and_mpi_names_the_node(cluster):
    c = cluster(2)
    job = train(c, "--steps", 400)
    job.start_until("step     2/", LIMIT)
    killed = job.ranks_left().get(1, [])
    assert len(killed) == 2, job.ranks_left()
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    proc = job.wait(LIMIT)
    assert proc.returncode != 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert ("RUNNING AT node1" in said) if cluster_mpi.flavour() == "mpich" else ("node1" in said), said[-3000:]
    assert job.wait_gone(10) == {}, job.ranks_left()


def test_a_node_unreachable_at_the_start_is_one_line_not_a_hang(cluster):
    c = cluster(2)
    c.cut(1)
    proc = train(c, "--steps", 3).run(timeout=LIMIT)
    assert proc.returncode != 0
    lines = [err_line for err_line in proc.stderr.splitlines() if err_line.startswith("cluster agent:")]
    assert lines == ["cluster agent: cannot reach node1: no answer in 2 s (its link is down)"], proc.stderr
