"""The emulated cluster itself (scripts/cluster.py, scripts/cluster_mpi.py): jobs span its nodes
under this Python's MPI, data crosses the links, links shape, cut and restore, and everything
is taken down again -- on a normal end, on an error, on SIGTERM, and after a SIGKILL -- without
touching the machine's own network namespace."""
import json
import os
import signal
import subprocess
import tempfile
import sys
from pathlib import Path

import pytest

from tests.mpirun import ROOT

pytestmark = pytest.mark.cluster
SCRIPTS = ROOT / "scripts"
PROBE = ROOT / "tests" / "drivers" / "cluster_probe.py"


def harness():
    sys.path.insert(0, str(SCRIPTS))
    import cluster
    import cluster_mpi
    return cluster, cluster_mpi


def host_network() -> list:
    """The machine's own namespace: its links, addresses and routes (must not change)."""
    out = []
    for what in (["link", "show"], ["addr", "show"], ["route", "show"], ["-6", "route", "show"]):
        text = subprocess.run(["ip", "-j"] + what, capture_output=True, text=True).stdout
        rows = json.loads(text or "[]")
        for row in rows:              # counters and timers move by themselves
            for key in ("stats64", "stats", "valid_life_time", "preferred_life_time"):
                row.pop(key, None)
            for addr in row.get("addr_info", []):
                addr.pop("valid_life_time", None)
                addr.pop("preferred_life_time", None)
        out.append(rows)
    return out


def ours(prefix: str) -> list:
    """The namespaces and /etc/netns folders of the cluster ``prefix`` still there."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return sorted([n for n in names if n.startswith(prefix + "-")] +
                  [f"/etc/netns/{p.name}" for p in Path("/etc/netns").glob(f"{prefix}-*")])


@pytest.mark.parametrize("placement", ["block", "round-robin"])
def test_a_job_spans_the_nodes_and_its_data_crosses_the_links(cluster, placement):
    _, mpi = harness()
    before = host_network()
    c = cluster(2)
    links = c.all_link_bytes()
    proc = mpi.Job(c, 2, ["python", PROBE, 4], placement=placement).run(timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                  key=lambda r: r["rank"])
    assert len(rows) == 4, proc.stdout + proc.stderr
    on = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]} if placement == "block" else \
        {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}
    for r in rows:
        node = "node0" if 0 in on[r["rank"]] else "node1"
        assert (r["host"], r["processor"], r["node"], r["sum_ok"]) == (node, node, on[r["rank"]], True), r
    after = c.all_link_bytes()
    for k in range(2):   # each node's half of a 4 MiB all-reduce went out and came in over its link
        assert after[k]["tx"] - links[k]["tx"] >= 2 * 2 ** 20, (k, links, after)
        assert after[k]["rx"] - links[k]["rx"] >= 2 * 2 ** 20, (k, links, after)
    assert host_network() == before       # nothing added to the machine's own namespace


def test_links_shape_cut_and_restore(cluster):
    c = cluster(2)
    c.shape(1, "100mbit")
    for ns, dev in ((c.namespaces[1], "eth0"), (c.switch, "p1")):   # both ends of node 1's link
        qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc, qdisc
    with pytest.raises(ValueError, match="link rate 'fast' is not allowed"):
        c.shape(1, "fast")
    c.shape(1, None)
    assert "tbf" not in subprocess.run(["tc", "-n", c.namespaces[1], "qdisc", "show", "dev", "eth0"],
                                       capture_output=True, text=True).stdout
    connect = [sys.executable, "-c", "import socket, sys; socket.create_connection(('node1', 9), timeout=1)"]

    def reach() -> str:   # node 1 has nothing on port 9: refused when the link is up, a timeout when cut
        err = subprocess.run(c.command(0, connect), capture_output=True, text=True, timeout=30).stderr
        return "refused" if "ConnectionRefused" in err else ("timeout" if "timed out" in err else err)

    assert reach() == "refused"
    c.cut(1)
    assert reach() == "timeout"
    c.restore(1)
    assert reach() == "refused"


TEARDOWN = """
import sys, time
sys.path.insert(0, {scripts!r})
import cluster
c = cluster.Cluster(2).up()
print(c.prefix, flush=True)
{then}
"""


@pytest.mark.parametrize("end", ["error", "SIGTERM", "SIGKILL"])
def test_teardown_leaves_nothing_behind(cluster, end):
    cluster(1)                           # skips where namespaces cannot be made
    then = {"error": "raise RuntimeError('a failing test')",
            "SIGTERM": "time.sleep(60)", "SIGKILL": "time.sleep(60)"}[end]
    code = TEARDOWN.format(scripts=str(SCRIPTS), then=then)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    prefix = proc.stdout.readline().strip()
    assert prefix.startswith("zmc"), proc.stderr.read()
    if end != "error":
        assert ours(prefix) == sorted([f"{prefix}-s", f"{prefix}-n0", f"{prefix}-n1",
                                       f"/etc/netns/{prefix}-n0", f"/etc/netns/{prefix}-n1"])
        proc.send_signal(getattr(signal, end))
    proc.wait(timeout=30)
    if end == "SIGKILL":                 # no teardown ran: the next harness removes what is left
        assert ours(prefix)
        cl, _ = harness()
        assert set(cl.remove_stale()) >= {f"{prefix}-s", f"{prefix}-n0", f"{prefix}-n1"}
    assert ours(prefix) == []
    assert list(Path(tempfile.gettempdir()).glob(f"{prefix}-*")) == []     # its agent's folder too


def test_unavailable_says_why(monkeypatch):
    cl, _ = harness()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "need root" in cl.unavailable()


def test_a_launcher_that_failed_to_start_is_told_apart():
    """Job.run starts again only a launcher that never started (Open MPI's PMIx listener, now and then in a fresh
    namespace); a job that ran and failed, or printed the words and succeeded, is not run again."""
    _, mpi = harness()
    said = "--------\\nThe PMIx server's listener thread failed to start. We cannot\\ncontinue.\\n"
    assert mpi.launch_failed(subprocess.CompletedProcess([], 213, "", said))
    assert not mpi.launch_failed(subprocess.CompletedProcess([], 0, "", said))
    assert not mpi.launch_failed(subprocess.CompletedProcess([], 1, "", "zerompi.train: error: batch=3 ..."))
    # PRRTE's daemons that did not wire up print on stdout; a node the agent cannot reach is down, not a flake
    daemon = "----\nA daemon was unable to complete a TCP connection\nto another daemon:\n  Local host: node0\n"
    assert mpi.launch_failed(subprocess.CompletedProcess([], 213, daemon, ""))
    unreachable = "cluster agent: cannot reach node1: no answer in 2 s (its link is down)\n"
    spawned = "A daemon failed to report back after being spawned. This could\n"
    assert mpi.launch_failed(subprocess.CompletedProcess([], 213, spawned, ""))
    assert not mpi.launch_failed(subprocess.CompletedProcess([], 213, spawned, unreachable))


class _Here:
    """A one-node stand-in for scripts/cluster.Cluster: node 0's commands run here."""
    nodes = 1

    def command(self, k, argv):
        return list(argv)

    def kill_node(self, k):
        pass


def test_start_until_starts_again_a_launcher_that_failed_and_no_job_that_ran(tmp_path):
    """Job.start_until: a launch whose daemons failed to wire up is started again until the job prints its line;
    a job that ran and failed is not started again, and its failure is raised."""
    _, mpi = harness()
    tries = tmp_path / "tries"

    class Flaky(mpi.Job):
        def launch_command(self):
            script = ("import pathlib, sys; p = pathlib.Path(sys.argv[1]); n = len(p.read_text()) if p.exists() "
                      "else 0; p.write_text('x' * (n + 1))\n"
                      "if n < int(sys.argv[2]): print(sys.argv[3]); sys.exit(213)\n"
                      "print('step     2/8'); sys.stdout.flush()")
            return [sys.executable, "-c", script, str(tries), str(self.fail_first), self.says]

    job = Flaky(_Here(), 1, ["python"])
    job.fail_first, job.says = 2, "A daemon was unable to complete a TCP connection"
    assert job.start_until("step     2/", 60) >= 0
    assert job.wait(60).returncode == 0 and tries.read_text() == "xxx"      # two failed launches, then the job

    tries.unlink()
    job.fail_first, job.says = 5, "zerompi.train: error: batch=3 ..."      # a job that ran and failed: once
    with pytest.raises(TimeoutError, match="batch=3"):
        job.start_until("step     2/", 60)
    assert tries.read_text() == "x"
