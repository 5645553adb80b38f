"""Expert parallelism measured: ``python scripts/bench_moe.py --json > moe.json``.

The default GPT with 8 experts, top-2, at N ranks (default 4), stage 3: one run per --ep (default 1, 2, 4) per
round, the rounds interleaved (every configuration once per round, in turn) so a change in the machine's load
falls on all alike. Per configuration: the median step time over rounds, tokens/s, the EP all-to-all's
seconds per step and its share of the step, its bytes per rank per step beside the balanced formula, the run's
traffic beside its formula, and the final sha256 (the same at every --ep: docs/moe.md). ``--json``: one JSON
document on stdout (progress on stderr); else a markdown table. Times are only as good as the machine is quiet.

``--cluster`` (as root: scripts/cluster.py): the same job on the emulated cluster, 2 nodes x 2 ranks in blocks,
nodes found from MPI, every link shaped to ``--link``, the router forced to exactly balanced routing (the
all-to-all's bytes are then its formula's: tests/drivers/moe_routing.py's ``cycle``). Per --ep: node 1's link
counters per step (sent; the steps after ``--warmup``) beside the formula of what crosses it: the node's ranks'
ZeRO bytes across nodes (both engines, engine/traffic.py) plus their all-to-all bytes to the other node (the
estimator's all-to-all bytes per rank, estimate/moe_bytes.py, times (K - P)/(K - 1) of a rank's K - 1 peers off
its node of P, when an EP group spans nodes).
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from launch import job_env, mpiexec  # noqa: E402  (one launcher and environment for every script)

MOE = ["--experts", "8", "--top-k", "2", "--stage", "3", "--eval-every", "0", "--log-every", "1000"]


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def train(ranks: int, ep: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.json"
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "zerompi.train", *MOE, "--ep", str(ep),
               "--steps", str(steps), "--metrics-json", str(path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT), timeout=1800, env=job_env(ROOT))
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        return json.loads(path.read_text())


def record(m: dict, ep: int, rnd: int) -> dict:
    moe = m["moe"]
    steady = moe["all_to_all_seconds"][1:] or moe["all_to_all_seconds"]
    return {"ep": ep, "round": rnd, "step_time_s": m["step_time_s"], "tokens_per_s": m["tokens_per_s"],
            "all_to_all_seconds_per_step": statistics.median(steady),
            "all_to_all_bytes_per_step": moe["all_to_all_bytes"][-1],
            "all_to_all_theory_bytes_per_step": moe["all_to_all_theory_bytes"],
            "comm_bytes_per_step": m["comm_bytes_per_step"],
            "comm_theory_bytes_per_step": m["comm_theory_bytes_per_step"],
            "final_loss": m["losses"][-1], "final_params_sha256": m["final_params_sha256"]}


def cluster_train(c, a, ep: int, workdir: Path) -> dict:
    """One --ep on the cluster (balanced routing); the metrics with node 1's link bytes per step."""
    import bench_cluster
    import cluster_mpi
    metrics = workdir / f"ep{ep}.json"
    flags = MOE + ["--ep", str(ep), "--steps", str(a.steps), "--log-every", "1", "--metrics-json", str(metrics)]
    job = cluster_mpi.Job(c, a.ranks_per_node, ["python", ROOT / "tests" / "drivers" / "moe_routing.py", "cycle",
                                                json.dumps(flags)])
    for _ in range(cluster_mpi.LAUNCH_TRIES):       # a launcher that failed to start is started again
        job.start()
        links = bench_cluster.LinkLog(c, 1, job)
        proc = job.wait(1800)
        if not cluster_mpi.launch_failed(proc):
            break
    if proc.returncode != 0:
        raise RuntimeError(f"--ep {ep}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    m = json.loads(metrics.read_text())
    m["link_per_step"] = links.per_step(a.warmup, a.steps - 1)
    return m


def cluster_record(m: dict, ep: int, p: int) -> dict:
    """What node 1's link carried per step beside the formula of what crosses it (the node's p ranks)."""
    moe, tx = m["moe"], m["link_per_step"][0]
    across = (ep - p) / (ep - 1) if ep > p else 0.0          # a rank's peers off its node, of its K - 1
    a2a = p * moe["all_to_all_theory_bytes"] * across
    zero = p * m["comm_theory_bytes_per_step_by_level"]["inter"]
    return {"ep": ep, "link_bytes_per_step": tx, "link_rx_bytes_per_step": m["link_per_step"][1],
            "formula_bytes_per_step": zero + a2a, "zero_inter_formula_bytes": zero,
            "all_to_all_across_formula_bytes": a2a,
            "zero_inter_bytes": p * m["comm_bytes_per_step_by_level"]["inter"],
            "all_to_all_bytes_per_rank": moe["all_to_all_bytes"][-1],
            "all_to_all_theory_bytes_per_rank": moe["all_to_all_theory_bytes"],
            "overhead": tx / (zero + a2a) - 1 if tx is not None else None,
            "step_time_s": m["step_time_s"], "final_params_sha256": m["final_params_sha256"]}


def cluster_main(a) -> None:
    import cluster
    why = cluster.unavailable()
    if why:
        sys.exit(f"bench_moe: error: {why}")
    a.nodes = 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-moe-cluster-") as tmp, cluster.Cluster(a.nodes) as c:
        c.shape_all(a.link)
        for ep in a.ep:
            log(f"cluster {a.nodes} x {a.ranks_per_node}, --ep {ep}")
            rows.append(cluster_record(cluster_train(c, a, ep, Path(tmp)), ep, a.ranks_per_node))
    doc = {"cluster": f"{a.nodes} nodes x {a.ranks_per_node} ranks", "link": a.link, "steps": a.steps,
           "warmup": a.warmup, "flags": MOE + ["(routing: cycle, exactly balanced)"], "results": rows,
           "same_bits": len({r["final_params_sha256"] for r in rows}) == 1}
    if a.json:
        print(json.dumps(doc, indent=1))
        return
    print("| --ep | node 1's link, B/step | formula | ZeRO across (formula) | all-to-all across (formula) | overhead |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ep']} | {r['link_bytes_per_step']:,.0f} | {r['formula_bytes_per_step']:,.0f} | "
              f"{r['zero_inter_bytes']:,} ({r['zero_inter_formula_bytes']:,}) | "
              f"{r['all_to_all_across_formula_bytes']:,.0f} | {r['overhead']:+.2%} |")
    print(f"\nthe same final parameters at every --ep: {doc['same_bits']}")


def summarize(runs: list) -> list:
    out = []
    for ep in sorted({r["ep"] for r in runs}):
        mine = [r for r in runs if r["ep"] == ep]
        step = statistics.median(r["step_time_s"] for r in mine)
        a2a = statistics.median(r["all_to_all_seconds_per_step"] for r in mine)
        out.append({"ep": ep, "step_time_s": step, "step_times_s": [r["step_time_s"] for r in mine],
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                    "all_to_all_seconds_per_step": a2a, "all_to_all_share": a2a / step,
                    **{k: mine[-1][k] for k in ("all_to_all_bytes_per_step", "all_to_all_theory_bytes_per_step",
                                                "comm_bytes_per_step", "comm_theory_bytes_per_step",
                                                "final_params_sha256")}})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("--cluster", action="store_true", help="on the emulated cluster, 2 nodes x --ranks-per-node")
    p.add_argument("--ranks-per-node", type=int, default=2, help="with --cluster (default %(default)s)")
    p.add_argument("--link", default="1gbit",
                   help="with --cluster: every link's rate (tc's units; default %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="with --cluster: steps left out of the link's count")
    a = p.parse_args()
    if a.cluster:
        if a.warmup + 2 > a.steps:
            p.error(f"--warmup {a.warmup} leaves fewer than 2 step lines of --steps {a.steps} to count the link over")
        cluster_main(a)
        return
    runs = []
    for rnd in range(a.rounds):
        for ep in a.ep:
            log(f"round {rnd}: N={a.ranks} --ep {ep}")
            runs.append(record(train(a.ranks, ep, a.steps), ep, rnd))
    rows = summarize(runs)
    doc = {"ranks": a.ranks, "steps": a.steps, "rounds": a.rounds, "flags": MOE, "results": rows, "runs": runs,
           "same_bits": len({r["final_params_sha256"] for r in runs}) == 1}
    if a.json:
        print(json.dumps(doc, indent=1))
        return
    print("| --ep | step | tokens/s | all-to-all s/step (share) | all-to-all B/step (formula) "
          "| ZeRO B/step (formula) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ep']} | {r['step_time_s'] * 1e3:.1f} ms | {r['tokens_per_s']:,.0f} | "
              f"{r['all_to_all_seconds_per_step'] * 1e3:.1f} ms ({r['all_to_all_share']:.0%}) | "
              f"{r['all_to_all_bytes_per_step']:,.0f} ({r['all_to_all_theory_bytes_per_step']:,}) | "
              f"{r['comm_bytes_per_step']:,} ({r['comm_theory_bytes_per_step']:,}) |")
    print(f"\nthe same final parameters at every --ep: {doc['same_bits']}")


if __name__ == "__main__":
    main()
