"""How fast a node fault ends a job on the emulated cluster (scripts/cluster.py), and what it says.

    python scripts/bench_cluster_faults.py [--repeat 3] [--timeout-s 5] [--json OUT.json]

Under this Python's MPI, 2 nodes x 2 ranks, the MLP at stage 3 (``--log-every 1``), each case
``--repeat`` times on a fresh cluster; one JSON line per case with the median and every run:

- ``cut``: node 1's link cut after step 3 is printed: seconds from the cut until no rank is
  left on any node (the watchdog, ``--timeout-s``, plus the reports and the abort); the exit
  status (Open MPI's launcher waits for the lost daemon: killed, null);
- ``kill``: node 1's ranks killed (SIGKILL) after step 3: seconds until the launcher ended;
- ``unreachable``: node 1's link cut before the launch: seconds until the launcher ended;
- ``flap``: node 1's link down for ``--flap-s`` after step 2, a 12-step run: its wall time
  beside the same run's without the flap.
"""
import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cluster  # noqa: E402
import cluster_mpi  # noqa: E402

MLP = ["python", "-m", "zerompi.train", "--model", "mlp", "--width", "64", "--depth", "3", "--batch", "24",
       "--stage", "3", "--bucket-mb", "0.01", "--log-every", "1"]
LIMIT = 300


def cut(c, a):
    job = cluster_mpi.Job(c, 2, MLP + ["--steps", "100000", "--timeout-s", str(a.timeout_s)])
    job.start_until("step     3/", LIMIT)
    c.cut(1)
    t = time.monotonic()
    left = job.wait_gone(LIMIT)
    seconds = time.monotonic() - t
    code = job.proc.poll()
    job.kill()
    said = [line for line in job.stderr().splitlines() if "collective timeout" in line][:1]
    return {"seconds": seconds, "exit": code, "ranks_left": left, "line": said[0] if said else None}


def kill(c, a):
    job = cluster_mpi.Job(c, 2, MLP + ["--steps", "100000"])
    job.start_until("step     3/", LIMIT)
    t = time.monotonic()
    for pid in job.ranks_left().get(1, []):
        os.kill(pid, signal.SIGKILL)
    proc = job.wait(LIMIT)
    return {"seconds": time.monotonic() - t, "exit": proc.returncode, "ranks_left": job.wait_gone(10)}


def unreachable(c, a):
    c.cut(1)
    job = cluster_mpi.Job(c, 2, MLP + ["--steps", "3"])
    proc = job.run(timeout=LIMIT)
    said = [line for line in proc.stderr.splitlines() if line.startswith("cluster agent:")]
    return {"seconds": job.seconds, "exit": proc.returncode, "line": said[0] if said else None}


def flap(c, a):
    plain = cluster_mpi.Job(c, 2, MLP + ["--steps", "12"])
    plain.run(timeout=LIMIT)
    job = cluster_mpi.Job(c, 2, MLP + ["--steps", "12", "--timeout-s", "60"])
    job.start_until("step     2/", LIMIT)
    c.cut(1)
    time.sleep(a.flap_s)
    c.restore(1)
    proc = job.wait(LIMIT)
    return {"seconds": job.seconds, "without_flap_s": plain.seconds, "exit": proc.returncode}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=5.0, help="the watchdog's, in the cut case")
    p.add_argument("--flap-s", type=float, default=2.0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    why = cluster.unavailable()
    if why:
        print(f"bench_cluster_faults: error: {why}", file=sys.stderr)
        return 2
    out = []
    for name, case in (("cut", cut), ("kill", kill), ("unreachable", unreachable), ("flap", flap)):
        runs = []
        for _ in range(a.repeat):
            with cluster.Cluster(2) as c:
                runs.append(case(c, a))
        rec = {"case": name, "mpi": cluster_mpi.flavour(), "median_s": statistics.median(r["seconds"] for r in runs),
               "runs": runs, "timeout_s": a.timeout_s if name == "cut" else None}
        out.append(rec)
        print(json.dumps(rec), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
