"""Across nodes (issue 18): bytes per level and step time of each mode, measured, beside the formula.

    python scripts/bench_hierarchical.py                 # N = 4, nodes of 2 (simulated), the MLP

Modes, each at ZeRO stage 2 and 3 unless said: ``flat`` (one node of 4: every collective flat),
``two-level`` (nodes of 2, one shard group of 4: collectives inside the node, then across),
``shard-groups`` (nodes of 2, shard groups of 2 = one node each, replicated: MiCS / hybrid
sharding), and ``hpz`` (stage 3, nodes of 2, ZeRO++'s node-local secondary copy). Each runs
``mpiexec -n 4 python -m zerompi.train --model mlp ... --metrics-json`` in a subprocess; the
runs are made in rounds, each in a fresh random order, so a drift in the machine's load hits
every mode alike. Printed as JSON lines: one record per mode (the median step time over every
round's steps after the warm-up; bytes per step inside and across nodes, measured, the most any
rank sent, beside the formula of engine/traffic.py and the estimator's; memory per rank), the
checks of the target (with hpZ the backward gather leaves no node; with shard groups of one
node only the all-reduce of 1/K of the model crosses), and the estimator's prediction for the
seed's example: 10B parameters on 64 ranks as 8 nodes of 8, at 200 Gbit/s inside and 25 Gbit/s
across nodes. Exit status: 0, or 1 when a check fails.

Bytes are measured twice. The timed runs report the median over their steps: exact across
nodes (a collective's step across nodes starts when it is called), but inside the node only
when every collective's second step starts in the step that called it -- the train CLI
publishes stage 1/2 parameters lazily (their all-gathers finish in the next forward) and stage 3
prefetches the next forward's first buckets, so a two-level all-gather's step inside the node can
start in the next step, and those medians vary with timing. So each mode also makes one untimed
run with ``--no-overlap`` (every collective waited for as it starts: each step's bytes are its
own), whose bytes per level must equal its formula to the byte on both levels.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from launch import mpiexec  # noqa: E402  (one launcher and environment for every script)

import zerompi  # noqa: E402  (the estimator: no MPI needed)

N, NODE = 4, 2
MODES = {   # name: (stage, train flags)
    "flat s2": (2, ["--node-size", str(N)]),
    "flat s3": (3, ["--node-size", str(N)]),
    "two-level s2": (2, ["--node-size", str(NODE)]),
    "two-level s3": (3, ["--node-size", str(NODE)]),
    "shard-groups s2": (2, ["--node-size", str(NODE), "--shard-size", str(NODE)]),
    "shard-groups s3": (3, ["--node-size", str(NODE), "--shard-size", str(NODE)]),
    "hpz s3": (3, ["--node-size", str(NODE), "--hpz"]),
}
EXAMPLE = {   # the seed's example as 8 nodes of 8: name: (stage, estimate's topology)
    "flat collectives (as before two levels), stage 3": (3, dict(node_size=8), "flat"),
    "two-level, one shard group of 64, stage 3": (3, dict(node_size=8), "levels"),
    "shard groups of 8, stage 2": (2, dict(node_size=8, shard_size=8), "levels"),
    "shard groups of 8, stage 3": (3, dict(node_size=8, shard_size=8), "levels"),
    "hpZ, stage 3": (3, dict(node_size=8, hpz=True), "levels"),
}


def run_train(mode: str, a, workdir: Path, tag: str, overlap: bool = True) -> dict:
    stage, flags = MODES[mode]
    path = workdir / f"{tag}.json"
    steps = a.steps if overlap else 3
    cmd = [mpiexec(), "-n", str(N), sys.executable, "-m", "zerompi.train", "--model", "mlp", "--stage", str(stage),
           "--dtype", a.dtype, "--width", str(a.width), "--depth", str(a.depth), "--batch", str(a.batch_per_rank * N),
           "--steps", str(steps), "--bucket-mb", str(a.bucket_mb), "--log-every", str(steps),
           "--metrics-json", str(path)] + flags + ([] if overlap else ["--no-overlap"])
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("ZEROMPI_NODE_SIZE", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env, cwd=str(ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(path.read_text())


def estimated(m: dict, a) -> dict:
    """The estimator's bytes per level for the configuration of a train run (its --metrics-json)."""
    zero = m["config"]["zero"]
    est = zerompi.estimate(params=m["params"], ranks=N, dtype=a.dtype, bucket_mb=a.bucket_mb, layers=a.depth,
                           prefetch=zero["prefetch"], overlap=zero["overlap"], node_size=m["topology"]["node_size"],
                           shard_size=m["topology"]["shard_size"], hpz=m["topology"]["hpz"])
    return est["stages"][m["stage"]]["comm_bytes_per_step_by_level"]


def record(mode: str, runs, serial: dict, a) -> dict:
    first = runs[0]
    steps = [t for m in runs for t in m["step_times_s"][a.warmup:]]
    rec = {
        "mode": mode, "N": N, "stage": first["stage"], "dtype": a.dtype, "topology": first["topology"],
        # the untimed --no-overlap run: each step's bytes are its own
        "bytes_per_step": serial["comm_bytes_per_step_by_level"],
        "bytes_per_step_formula": serial["comm_theory_bytes_per_step_by_level"],
        "bytes_per_step_estimate": estimated(serial, a),
        # the timed runs (overlap on): the median over steps of each run, and their formula
        "timed_bytes_per_step": [m["comm_bytes_per_step_by_level"] for m in runs],
        "timed_bytes_per_step_formula": first["comm_theory_bytes_per_step_by_level"],
        "timed_bytes_per_step_estimate": estimated(first, a),
        "median_step_s": statistics.median(steps),
        "steps_timed": len(steps),
        "run_medians_s": [round(statistics.median(m["step_times_s"][a.warmup:]), 4) for m in runs],
        "model_state_bytes_per_rank": first["memory_bytes"],
        "peak_buffer_bytes": max(m["peak_buffer_bytes"] for m in runs),
        "padded_params": first["padded_params"],
        "final_params_sha256": first["final_params_sha256"],
    }
    if mode.startswith("flat"):    # were the 4 ranks 2 nodes of 2: what these flat collectives send across
        flat = zerompi.estimate(params=serial["params"], ranks=N, dtype=a.dtype, bucket_mb=a.bucket_mb,
                                layers=a.depth, overlap=False, node_size=NODE)     # as the --no-overlap run
        rec["bytes_per_step_if_nodes_of_2"] = flat["stages"][serial["stage"]]["comm_bytes_per_step_if_flat"]
    return rec


def checks(records: dict, itemsize: int) -> list:
    """The target, each against a hand formula: p bytes per element, padded Psi, one micro-batch."""
    out = []
    for name, r in records.items():
        out.append({"check": f"{name}: bytes per level measured == formula == estimate (--no-overlap run)",
                    "ok": r["bytes_per_step"] == r["bytes_per_step_formula"] == r["bytes_per_step_estimate"]})
        inter = r["timed_bytes_per_step_formula"]["inter"]
        out.append({"check": f"{name}: across nodes, timed runs == formula == estimate",
                    "ok": all(b["inter"] == inter for b in r["timed_bytes_per_step"])
                    and r["timed_bytes_per_step_estimate"] == r["timed_bytes_per_step_formula"]})
    k, m, s = NODE, N // NODE, N
    hpz = records["hpz s3"]
    psi = hpz["padded_params"]     # (the --no-overlap run: no prefetch, so the turns keep one bucket)
    # hpZ: across nodes only the reduce-scatter and the first forward's gather, (M-1)/S of the model each
    want = 2 * (m - 1) * itemsize * psi // s
    out.append({"check": "hpz s3: across nodes = reduce-scatter + forward gather; the backward gather stays inside",
                "inter": hpz["bytes_per_step"]["inter"], "want": want, "ok": hpz["bytes_per_step"]["inter"] == want,
                "without_hpz": records["two-level s3"]["bytes_per_step"]["inter"]})
    for stage in (2, 3):
        r = records[f"shard-groups s{stage}"]
        groups = N // k
        want = 2 * (groups - 1) * itemsize * (r["padded_params"] // k) // groups   # all-reduce of Psi/K
        out.append({"check": f"shard-groups s{stage}: across nodes only the all-reduce of 1/K of the model",
                    "inter": r["bytes_per_step"]["inter"], "want": want, "ok": r["bytes_per_step"]["inter"] == want})
    return out


def example(a) -> list:
    """The estimator on 10B parameters, 64 ranks as 8 nodes of 8, fp16, at the two bandwidths."""
    out = []
    for name, (stage, topo, kind) in EXAMPLE.items():
        est = zerompi.estimate(params=10e9, ranks=64, intra_gbps=a.intra_gbps, inter_gbps=a.inter_gbps, **topo)
        row = est["stages"][stage]
        rec = {"example": "10B parameters, 64 ranks as 8 nodes of 8, fp16", "mode": name, "stage": stage,
               "memory_per_rank_bytes": row["total_bytes"], "model_state_bytes": row["model_state_bytes"],
               "secondary_bytes": row["secondary_bytes"], "intra_gbps": a.intra_gbps, "inter_gbps": a.inter_gbps}
        sent, seconds = ((row["comm_bytes_per_step_if_flat"], row["comm_seconds_per_step_if_flat"]) if kind == "flat"
                         else (row["comm_bytes_per_step_by_level"], row["comm_seconds_per_step_by_level"]))
        rec.update(intra_bytes_per_step=sent["intra"], inter_bytes_per_step=sent["inter"], seconds_per_step=seconds,
                   comm_seconds_per_step=sum(seconds.values()))
        out.append(rec)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch-per-rank", type=int, default=32)
    p.add_argument("--bucket-mb", type=float, default=5.0, help="one MLP layer per bucket at width 1024")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1, help="steps of each run left out of the median")
    p.add_argument("--rounds", type=int, default=3, help="runs of each mode, interleaved")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--intra-gbps", type=float, default=200.0, help="the example: bandwidth inside a node")
    p.add_argument("--inter-gbps", type=float, default=25.0, help="the example: bandwidth across nodes")
    a = p.parse_args(argv)
    if a.warmup >= a.steps:
        p.error(f"--warmup {a.warmup} must be below --steps {a.steps}")
    if a.steps < 3:   # the first step can differ (stage 3 gathers the next forward's first buckets at its end)
        p.error(f"--steps {a.steps} must be at least 3, so that the median over steps is a steady step")
    runs = {mode: [] for mode in MODES}
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = list(MODES)
            rng.shuffle(order)
            for mode in order:
                runs[mode].append(run_train(mode, a, Path(tmp), f"{r}-{len(runs[mode])}-{mode.replace(' ', '_')}"))
        serial = {mode: run_train(mode, a, Path(tmp), f"serial-{mode.replace(' ', '_')}", False) for mode in MODES}
    records = {mode: record(mode, runs[mode], serial[mode], a) for mode in MODES}
    for rec in records.values():
        print(json.dumps(rec))
    results = checks(records, 2 if a.dtype == "fp16" else 4)
    for c in results:
        print(json.dumps(c))
    for rec in example(a):
        print(json.dumps(rec))
    return 0 if all(c["ok"] for c in results) else 1


if __name__ == "__main__":
    sys.exit(main())
