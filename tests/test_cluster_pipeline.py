"""A pipeline across emulated nodes (scripts/cluster.py): stage s on node s, its data-parallel ZeRO group
inside the node, the pipeline's messages over the link.

Against the same job on one host with --node-size 2: the same losses and the same model digest (the
transport cannot change a bit). Bytes: the pipeline's messages are the only engine traffic that crosses
a node (ZeRO's groups are inside one; the step's loss sums and its totals over the stages are small),
each rank's across-node bytes by kind equal the schedule's messages x their sizes (message_theory) for
every step, the nodes are found by MPI's shared-memory split (no --node-size on the cluster), and each
node's link carried its ranks' bytes plus the transport's overhead."""
import json
import sys

import pytest

from tests.mpirun import ROOT, run_mpi

pytestmark = pytest.mark.cluster
sys.path.insert(0, str(ROOT / "scripts"))

import cluster_mpi  # noqa: E402

DRIVER = ROOT / "tests" / "drivers" / "cluster_pipeline.py"
STEPS = 3
FLAGS = ["--pp", "2", "--micro-batches", "4", "--n-layer", "4", "--d-model", "128", "--n-head", "4", "--seq-len", "64",
         "--batch", "16", "--eval-every", "0", "--dtype", "fp32"]
OVERHEAD = 0.05       # TCP/IP and MPI framing, ACKs, the loss sums and the stages' totals: 0.9-1.1 % measured


def rows_of(stdout):
    out = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert len(out) == 1, stdout
    return out[0]


@pytest.mark.parametrize("schedule", [["--schedule", "1f1b", "--stage", "3"], ["--schedule", "zb-h1", "--stage", "1"]])
def test_a_pipeline_across_two_nodes_gives_the_one_host_bits_and_its_messages_cross_the_link(cluster, schedule):
    c = cluster(2)
    job = cluster_mpi.Job(c, 2, ["python", DRIVER, STEPS, "eth0", *FLAGS, *schedule])
    proc = job.run(timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = rows_of(proc.stdout)
    host = rows_of(run_mpi(4, [DRIVER, STEPS, "-", *FLAGS, *schedule, "--node-size", "2"], timeout=300).stdout)
    assert (found["losses"], found["digest"]) == (host["losses"], host["digest"]) and found["digest"]
    for r, h in zip(found["rows"], host["rows"]):
        assert (r["node"], r["stage"]) == (h["node"], h["stage"]) == (r["rank"] // 2, r["rank"] // 2), r
        crossed = {k: v for k, v in r["pp_inter"].items() if v}
        assert crossed == {k: v for k, v in h["pp_inter"].items() if v} == \
            {k: STEPS * v for k, v in r["theory"].items() if v}, r
    for node in range(2):
        ranks = [r for r in found["rows"] if r["node"] == node]
        sent = sum(sum(r["pp_inter"].values()) + r["zero_inter"] for r in ranks)
        wire = next(r["link"] for r in ranks if r["link"] is not None)[0]
        assert sent <= wire <= sent * (1 + OVERHEAD), (node, sent, wire, ranks)
