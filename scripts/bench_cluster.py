"""The across-node features measured in seconds, on a cluster on one machine (scripts/cluster.py).

    python scripts/bench_cluster.py --nodes 2 --ranks-per-node 2 --link 250mbit --mpi mpich --json OUT.json
    .venv-ompi/bin/python scripts/bench_cluster.py ... --mpi openmpi --json OUT.json    # Open MPI's venv

Makes the cluster (as root), shapes every node's link to ``--link`` (both ends), measures what
the links give an MPI job (scripts/cluster_rates.py: Gbit/s across a link and inside a node,
latency), then trains the GPT (default 4 x 256, seq 64, batch 4, fp16, 1 MiB buckets: a size
where communication matters) once per configuration, nodes found from MPI:

    flat1/2/3     stage 1/2/3 told one node (--node-size N): flat collectives across the nodes
    two-level1/2/3  the same with the real nodes: inside the node, then 1/K of a bucket across
    hpz3          + hpZ (stage 3's backward gathers stay inside the node)
    hpz-qwz3      + qwZ int8 (the parameter gathers quantized)
    zeropp        + qgZ int4 (the gradient reduce-scatters quantized): all of ZeRO++
    mics3         stage 3 in shard groups of one node (MiCS / hybrid sharding)

For each, one JSON record (``--json`` writes the list; stdout has one line each, then the
goals): ``step_s`` (median over the steps after ``--warmup`` of every round: ``--rounds R`` runs each
configuration R times, each round in a fresh random order; ``round_step_s`` each round's),
``tokens_per_s``, ``inter_bytes`` (the engine's bytes across nodes per step, the node's ranks
together: for the flat rows, whose engine was told one node, the formula's count of what their
flat collectives send across), ``link_bytes`` (read off node 1's link at each step's line: the
bytes it sent per step over the steps after the warm-up; ``link_rx_bytes`` received),
``final_loss`` (the last step's) and ``final_val_loss``, and
``estimate_step_s``: the estimator's communication time for the configuration (both levels),
fed the measured rates (across nodes: the link's rate shared by the node's ranks; inside: the
measured one; the measured latency per message), added to the run's compute (its step time
less its waits) less the share of communication the engine's timers saw run behind compute
(``comm_hidden_fraction``): compute + comm x (1 - hidden). The estimator models communication,
not compute or overlap; those two come from the run. The records also keep the bounds,
``estimate_no_overlap_step_s`` and ``estimate_link_hidden_step_s`` (max(compute, across) + inside).

Exit status 0, or 1 when a goal is missed (listed on stdout). The machine it runs on shares
its cores between the "nodes": the numbers are the cluster's, not a real one's (docs/cluster.md).
"""
import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import cluster  # noqa: E402
import cluster_mpi  # noqa: E402
from zerompi.estimate.fromrun import run_estimate  # noqa: E402

CHAIN = ["flat3", "two-level3", "hpz3", "hpz-qwz3", "zeropp"]   # each adds one piece to the one before


def configs(n: int, k: int) -> dict:
    """name: (stage, train flags) on n ranks in nodes of k."""
    flat = ["--node-size", str(n)]
    return {
        "flat1": (1, flat), "two-level1": (1, []), "flat2": (2, flat), "two-level2": (2, []),
        "flat3": (3, flat), "two-level3": (3, []), "hpz3": (3, ["--hpz"]),
        "hpz-qwz3": (3, ["--hpz", "--quantize-weights", "int8"]),
        "zeropp": (3, ["--hpz", "--quantize-weights", "int8", "--quantize-grads", "int4"]),
        "mics3": (3, ["--shard-size", str(k)]),
    }


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--link", default="250mbit", help="every node's link rate, tc's units (250mbit, 1gbit)")
    p.add_argument("--mpi", choices=("mpich", "openmpi"), required=True,
                   help="the MPI of this Python's mpi4py (run Open MPI's with its venv's python)")
    p.add_argument("--json", required=True, help="write the records here (a JSON list)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    p.add_argument("--rounds", type=int, default=1, help="runs of every configuration, each round in a new order")
    p.add_argument("--only", default=None, help="comma-separated configuration names (default: all)")
    p.add_argument("--gpt", default="--n-layer 4 --d-model 256 --seq-len 64 --batch 4",
                   help="the GPT's flags (default: %(default)s)")
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--bucket-mb", default="1")
    p.add_argument("--timeout", type=float, default=900, help="seconds one training run may take")
    p.add_argument("--seed", type=int, default=0, help="the order of the runs (shuffled)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds} must be at least 1")
    if a.warmup >= a.steps:
        p.error(f"--warmup {a.warmup} leaves no step of --steps {a.steps} to time")
    return a


class LinkLog:
    """Node ``k``'s link counters read each time the job prints a step line (a thread)."""

    def __init__(self, c, k: int, job):
        self.c, self.k, self.job = c, k, job
        self.samples = []                      # (step, tx, rx) at the step's line
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        seen = 0
        while self.job.proc.poll() is None:
            lines = self.job.lines()
            steps = [int(line.split()[1].split("/")[0]) for line in lines[seen:] if line.startswith("step ")]
            seen = len(lines)
            if steps:
                b = self.c.link_bytes(self.k)
                self.samples.append((steps[-1], b["tx"], b["rx"]))
            time.sleep(0.005)

    def per_step(self, first: int, last: int):
        """Bytes per step (sent, received) from the line of step ``first`` to that of step ``last``
        (the mean over the window: a step's traffic does not end at its line -- stage 3 starts
        the next forward's gathers -- but what one step's line misses the next one's counts)."""
        self._thread.join(timeout=10)
        rows = [s for s in self.samples if first <= s[0] <= last]
        if len(rows) < 2 or rows[-1][0] == rows[0][0]:
            return None, None
        a, b = rows[0], rows[-1]
        return (b[1] - a[1]) / (b[0] - a[0]), (b[2] - a[2]) / (b[0] - a[0])


def rates(c, a) -> dict:
    job = cluster_mpi.Job(c, a.ranks_per_node, ["python", ROOT / "scripts" / "cluster_rates.py", a.ranks_per_node])
    proc = job.run(timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"the rate probe failed: {proc.stderr[-2000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))


def train(c, a, name: str, stage: int, flags, workdir: Path) -> dict:
    metrics = workdir / f"{name}.json"
    argv = ["python", "-m", "zerompi.train", "--model", "gpt", *a.gpt.split(), "--dtype", a.dtype, "--bucket-mb",
            a.bucket_mb, "--stage", str(stage), "--steps", str(a.steps), "--log-every", "1",
            "--metrics-json", metrics, *flags]
    job = cluster_mpi.Job(c, a.ranks_per_node, argv)
    for _ in range(cluster_mpi.LAUNCH_TRIES):           # a launcher that failed to start is started again
        job.start()
        log = LinkLog(c, 1, job)
        proc = job.wait(a.timeout)
        if not cluster_mpi.launch_failed(proc):
            break
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    m = json.loads(metrics.read_text())
    m["link_per_step"] = log.per_step(a.warmup, a.steps - 1)   # the last step's line comes after the held-out loss
    return m


def estimate_s(m: dict, name: str, r: dict, a, compute: float, hidden: float) -> dict:
    """The estimator's communication seconds per level for this run's configuration at the measured
    rates, and the step time they predict with the run's compute and the share of its communication
    that ran behind compute (the engine's timers: ``hidden``): compute + (across + inside) x (1 - hidden).
    The bounds: no overlap (compute + both) and the link wholly behind compute (max(compute, across) + inside)."""
    n, k = a.nodes * a.ranks_per_node, a.ranks_per_node
    feed = dict(inter_gbps=r["inter_gbps"] / k, intra_gbps=r["intra_gbps"] or 100.0, latency_us=r["latency_us"])
    if name.startswith("flat"):        # the engine was told one node: price its flat collectives across the real ones
        est = run_estimate(m, node_size=k, shard_size=n, hpz=False, **feed)["stages"][m["stage"]]
        seconds, inter = est["comm_seconds_per_step_if_flat"], est["comm_bytes_per_step_if_flat"]["inter"]
    else:
        est = run_estimate(m, **feed)["stages"][m["stage"]]
        seconds, inter = est["comm_seconds_per_step_by_level"], est["comm_bytes_per_step_by_level"]["inter"]
    comm = seconds["intra"] + seconds["inter"]
    return {"estimate_step_s": compute + comm * (1 - hidden), "estimate_comm_s": comm,
            "estimate_comm_s_by_level": seconds, "comm_hidden_fraction": hidden,
            "estimate_no_overlap_step_s": compute + comm,
            "estimate_link_hidden_step_s": max(compute, seconds["inter"]) + seconds["intra"],
            "estimate_inter_bytes_per_rank": inter}


def record(name: str, runs: list, r: dict, a) -> dict:
    """One configuration's record from its runs (one per round: the steps of every round together)."""
    m = runs[0]
    steps = [t for x in runs for t in x["step_times_s"][a.warmup:]]
    waits = [w for x in runs for w in x["step_breakdown_s"]["comm_wait"][a.warmup:]]
    step_s = statistics.median(steps)
    compute = statistics.median(t - w for t, w in zip(steps, waits))
    busy = sum(b for x in runs for b in x["step_breakdown_s"]["comm_busy"][a.warmup:])
    hidden = min(1.0, max(0.0, (busy - sum(waits)) / busy)) if busy > 0 else 0.0
    est = estimate_s(m, name, r, a, compute, hidden)
    k = a.ranks_per_node
    inter = m["comm_bytes_per_step_by_level"]["inter"] * k
    if name.startswith("flat"):
        inter = est["estimate_inter_bytes_per_rank"] * k
    tokens = m["config"]["batch"] * m["config"]["seq_len"]
    links = [x["link_per_step"] for x in runs if x["link_per_step"][0] is not None]
    tx, rx = (statistics.median(t for t, _ in links), statistics.median(v for _, v in links)) if links else (None, None)
    return {"name": name, "stage": m["stage"], "nodes": a.nodes, "ranks_per_node": k, "link": a.link,
            "mpi": a.mpi, "step_s": step_s, "tokens_per_s": tokens / step_s, "compute_s": compute,
            "wait_s": statistics.median(waits), "inter_bytes": inter,
            "inter_bytes_source": "formula (engine told one node)" if name.startswith("flat") else "engine",
            "link_bytes": tx, "link_rx_bytes": rx, "final_loss": m["losses"][-1],
            "final_val_loss": m["val_losses"][-1][1] if m["val_losses"] else None,
            **est, "steps_timed": len(steps),
            "round_step_s": [statistics.median(x["step_times_s"][a.warmup:]) for x in runs],
            "params": m["params"], "topology": m["topology"]}


def goals(rows: dict) -> list:
    """(goal, met, what was measured) for the goals of docs/cluster.md."""
    out = []
    if "flat3" in rows and "zeropp" in rows:
        ratio = rows["zeropp"]["step_s"] / rows["flat3"]["step_s"]
        out.append(("all of ZeRO++ at most 0.35x the step time of flat stage 3", ratio <= 0.35, f"{ratio:.3f}x"))
    if "hpz3" in rows and "zeropp" in rows:
        a, b = rows["zeropp"]["final_loss"], rows["hpz3"]["final_loss"]
        out.append(("ZeRO++'s final loss within 2% of the unquantized run's", abs(a - b) <= 0.02 * abs(b),
                    f"{a:.4f} vs {b:.4f}"))
    chain = [n for n in CHAIN if n in rows]
    for before, after in zip(chain, chain[1:]):
        t0, t1 = rows[before]["step_s"], rows[after]["step_s"]
        out.append((f"{after} never slower than {before}", t1 <= t0, f"{t1:.3f} vs {t0:.3f} s"))
    for name, r in rows.items():
        err = r["estimate_step_s"] / r["step_s"] - 1
        out.append((f"{name}: estimate within 25%", abs(err) <= 0.25,
                    f"{r['estimate_step_s']:.3f} vs {r['step_s']:.3f} s ({err:+.0%})"))
    return out


def main(argv=None) -> int:
    a = parse(argv)
    if cluster_mpi.flavour() != a.mpi:
        print(f"bench_cluster: error: --mpi {a.mpi}, but this Python's mpiexec is {cluster_mpi.flavour()}'s; run "
              f"this script with the Python of a venv whose mpi4py uses {a.mpi}", file=sys.stderr)
        return 2
    why = cluster.unavailable()
    if why:
        print(f"bench_cluster: error: {why}", file=sys.stderr)
        return 2
    table = configs(a.nodes * a.ranks_per_node, a.ranks_per_node)
    names = list(table) if a.only is None else a.only.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        print(f"bench_cluster: error: unknown configurations {unknown}; use some of {list(table)}", file=sys.stderr)
        return 2
    runs = {n: [] for n in names}
    shuffle = random.Random(a.seed)
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp, cluster.Cluster(a.nodes) as c:
        c.shape_all(a.link)
        r = rates(c, a)
        print(json.dumps({"rates": r, "link": a.link, "mpi": a.mpi}), flush=True)
        for round_ in range(a.rounds):        # each round in a fresh order: a drift in the load hits all alike
            order = names[:]
            shuffle.shuffle(order)
            for name in order:
                stage, flags = table[name]
                runs[name].append(train(c, a, f"{name}.{round_}", stage, flags, Path(tmp)))
                print(json.dumps({"round": round_, "name": name, "step_s": statistics.median(
                    runs[name][-1]["step_times_s"][a.warmup:])}), flush=True)
    rows = {n: record(n, runs[n], r, a) for n in names}
    for n in names:
        print(json.dumps(rows[n]), flush=True)
    records = [dict(rows[n], rates=r) for n in names]
    Path(a.json).write_text(json.dumps(records, indent=1) + "\n")
    missed = 0
    for goal, met, what in goals({n: rows[n] for n in names}):
        print(f"{'met   ' if met else 'MISSED'}  {goal}: {what}")
        missed += not met
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
