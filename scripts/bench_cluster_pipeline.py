"""Pipeline stages across nodes against ZeRO across nodes, in seconds, on the emulated cluster.

    python scripts/bench_cluster_pipeline.py --link 250mbit --mpi mpich --json OUT.json

Makes the cluster (scripts/cluster.py; 2 nodes x 2 ranks by default), shapes every link, measures the
rates an MPI job gets (scripts/cluster_rates.py), then trains the same GPT on the same global batch
once per configuration (scripts/bench_cluster.py's run: step lines, the node's link counters):

    two-level3    ZeRO stage 3 over all 4 ranks, nodes found from MPI (two-level collectives)
    zeropp        + hpZ, qwZ int8, qgZ int4: all of ZeRO++ (the best ZeRO row of docs/cluster.md)
    pp-gpipe1     2 pipeline stages, one per node, ZeRO stage 1 inside each (2 data-parallel ranks)
    pp-1f1b1      the same with 1F1B
    pp-zb1        ... with ZB-H1
    pp-1f1b3      1F1B with ZeRO stage 3 inside the stages

The pipelined rows cut the global batch into ``--micro-batches`` micro-batches; the ZeRO rows run
it whole (one micro-batch). One JSON record each (``--json`` writes the list): ``step_s`` (median of
the steps after ``--warmup``), ``tokens_per_s``, ``link_bytes`` (node 1's link, sent per step),
``link_s`` (those bytes at the measured rate across a node: the link's floor for that step), the final
loss; for the pipelined rows the measured bubble, the simulator's on the measured costs, and the
pipeline's bytes per stage. The cores are shared between the "nodes": the cluster's numbers, not a
real one's (docs/cluster.md).
"""
import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_cluster  # noqa: E402
import cluster  # noqa: E402
import cluster_mpi  # noqa: E402


def configs(m: int) -> dict:
    """name: (stage, train flags)."""
    pp = ["--pp", "2", "--micro-batches", str(m)]
    return {"two-level3": (3, []), "zeropp": (3, ["--hpz", "--quantize-weights", "int8", "--quantize-grads", "int4"]),
            "pp-gpipe1": (1, pp + ["--schedule", "gpipe"]), "pp-1f1b1": (1, pp + ["--schedule", "1f1b"]),
            "pp-zb1": (1, pp + ["--schedule", "zb-h1"]), "pp-1f1b3": (3, pp + ["--schedule", "1f1b"])}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link", default="250mbit", help="every node's link rate, tc's units (250mbit, 1gbit)")
    p.add_argument("--mpi", choices=("mpich", "openmpi"), required=True)
    p.add_argument("--json", required=True, help="write the records here (a JSON list)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the medians")
    p.add_argument("--micro-batches", type=int, default=4, help="of the pipelined rows")
    p.add_argument("--gpt", default="--n-layer 4 --d-model 256 --seq-len 64 --batch 8",
                   help="the GPT's flags (default: %(default)s)")
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--bucket-mb", default="1")
    p.add_argument("--only", default=None, help="comma-separated configuration names (default: all)")
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args(argv)
    if a.warmup >= a.steps:
        p.error(f"--warmup {a.warmup} leaves no step of --steps {a.steps} to time")
    a.nodes, a.ranks_per_node = 2, 2           # what bench_cluster.train reads
    return a


def record(name: str, m: dict, a, r: dict) -> dict:
    steps = m["step_times_s"][a.warmup:]
    step_s = statistics.median(steps)
    tx, rx = m["link_per_step"]
    rate = r["inter_gbps"] * 1e9 / 8                 # bytes/s one link carries (the probe's rate across a node)
    out = {"name": name, "stage": m["stage"], "link": a.link, "mpi": a.mpi, "step_s": step_s,
           "tokens_per_s": m["config"]["batch"] * m["config"]["seq_len"] / step_s, "link_bytes": tx,
           "link_rx_bytes": rx, "link_s": tx / rate if tx is not None else None, "final_loss": m["losses"][-1],
           "params": m["params"], "steps_timed": len(steps)}
    if "pipeline" in m:
        out.update(bubble=m["bubble_fraction"], bubble_simulated=m["bubble_fraction_schedule"],
                   pp_bytes_per_step=m["pp_bytes_per_step"], zero_bytes_per_step=m["comm_bytes_per_step"])
    else:
        out.update(zero_bytes_per_step=m["comm_bytes_per_step"],
                   inter_bytes=m["comm_bytes_per_step_by_level"]["inter"] * a.ranks_per_node)
    return out


def main(argv=None) -> int:
    a = parse(argv)
    if cluster_mpi.flavour() != a.mpi:
        print(f"bench_cluster_pipeline: error: --mpi {a.mpi}, but this Python's mpiexec is {cluster_mpi.flavour()}'s",
              file=sys.stderr)
        return 2
    why = cluster.unavailable()
    if why:
        print(f"bench_cluster_pipeline: error: {why}", file=sys.stderr)
        return 2
    table = configs(a.micro_batches)
    names = list(table) if a.only is None else a.only.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        print(f"bench_cluster_pipeline: error: unknown configurations {unknown}; use some of {list(table)}",
              file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-cluster-pp-") as tmp, cluster.Cluster(a.nodes) as c:
        c.shape_all(a.link)
        r = bench_cluster.rates(c, a)
        print(json.dumps({"rates": r, "link": a.link, "mpi": a.mpi}), flush=True)
        for name in names:
            stage, flags = table[name]
            m = bench_cluster.train(c, a, name, stage, flags, Path(tmp))
            rows.append(dict(record(name, m, a, r), rates=r))
            print(json.dumps(rows[-1]), flush=True)
    Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
