"""Step time, memory and hidden communication of each ZeRO stage, through the train CLI.

    python scripts/bench_stages.py                      # stages 0-3 at N = 2 and 4, fp32 and fp16
    python scripts/bench_stages.py --bar                # issue 6's bar: stage 3 vs stage 2 at N = 2

Each configuration runs ``mpiexec -n N python -m zerompi.train --model mlp ...`` in a
subprocess; the configurations are run in rounds, each in a random order, so a drift in
machine load hits every one alike. One JSON record per configuration is printed: the
median step time over every round's steps after the warm-up, model-state bytes per rank
as allocated by the engine (plus the peak transient buffers), comm_hidden_fraction and
the engine's time breakdown (medians, seconds); with ``--baseline`` each is also run with
``--no-overlap`` and the record gains ``hidden_vs_serial``. The bar record compares stage
3's median step time with stage 2's measured in the same run against ``--ceiling``.
Exit status: 0, or 1 when ``--bar`` misses its ceiling.
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
sys.path.insert(0, str(ROOT / "scripts"))
from launch import mpiexec  # noqa: E402  (one launcher and environment for every script)


def run_train(n: int, stage: int, dtype: str, overlap: bool, a, workdir: Path, tag: str) -> dict:
    """One training run on n ranks; returns its metrics JSON (raises on failure or timeout)."""
    path = workdir / f"{tag}.json"
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "zerompi.train", "--model", "mlp",
           "--stage", str(stage), "--dtype", dtype, "--width", str(a.width), "--depth", str(a.depth),
           "--batch", str(a.batch_per_rank * n), "--steps", str(a.steps), "--bucket-mb", str(a.bucket_mb),
           "--prefetch", str(a.prefetch), "--log-every", str(a.steps), "--metrics-json", str(path)] + a.train_args
    if not overlap:
        cmd.append("--no-overlap")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env, cwd=str(ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(path.read_text())


def record(n: int, stage: int, dtype: str, overlap: bool, runs, warmup: int) -> dict:
    """Pool the runs of one configuration into one record."""
    steps = [t for m in runs for t in m["step_times_s"][warmup:]]
    parts = runs[0]["time_breakdown_s"].keys()
    return {
        "stage": stage, "N": n, "dtype": dtype, "overlap": overlap,
        "median_step_s": statistics.median(steps),
        "steps_timed": len(steps),
        "run_medians_s": [round(statistics.median(m["step_times_s"][warmup:]), 4) for m in runs],  # the noise
        "memory_bytes_per_rank": runs[0]["memory_bytes"]["total"],
        "theory_bytes_per_rank": runs[0]["theory_bytes"]["total"],
        "peak_buffer_bytes": max(m["peak_buffer_bytes"] for m in runs),
        "comm_hidden_fraction": statistics.median(m["comm_hidden_fraction"] for m in runs),
        "time_breakdown_s": {k: statistics.median(m["time_breakdown_s"][k] for m in runs) for k in parts},
        "comm_bytes_per_step": runs[0]["comm_bytes_per_step"],
        "final_params_sha256": runs[0]["final_params_sha256"],
    }


def order(configs, rounds: int, seed: int):
    """Every configuration once per round, in a fresh seeded random order each round.

    (Not ABBA: a fixed pattern lines up with periodic load from other jobs -- seen here,
    when the two middle slots of every round ran 1.5x slower.)
    """
    rng = random.Random(seed)
    for _ in range(rounds):
        batch = list(configs)
        rng.shuffle(batch)
        yield from batch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4", help="comma-separated world sizes")
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--dtypes", default="fp32,fp16")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch-per-rank", type=int, default=32, help="rows per rank per step")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--steps", type=int, default=6, help="steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps of each run left out of the median")
    p.add_argument("--rounds", type=int, default=2, help="runs of each configuration, interleaved")
    p.add_argument("--seed", type=int, default=0, help="seeds the order of the runs in each round")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--bar", action="store_true",
                   help="issue 6's bar: width 2048, depth 8, global batch 64, fp16, N=2, stages 2 and 3")
    p.add_argument("--ceiling", type=float, default=1.15, help="--bar: allowed stage-3 / stage-2 step-time ratio")
    p.add_argument("--baseline", action="store_true",
                   help="also run each configuration with --no-overlap: the serial baseline, whose exposed "
                        "communication is all of it (adds hidden_vs_serial to each record)")
    p.add_argument("train_args", nargs="*", help="after --: more train CLI flags (e.g. -- --comm-progress thread)")
    a = p.parse_args(argv)
    if a.bar:
        a.ranks, a.stages, a.dtypes, a.width, a.depth, a.batch_per_rank = "2", "2,3", "fp16", 2048, 8, 32
    if a.warmup >= a.steps:
        p.error(f"--warmup {a.warmup} must be below --steps {a.steps}")
    configs = [(int(n), int(s), d, overlap) for n in a.ranks.split(",") for d in a.dtypes.split(",")
               for s in a.stages.split(",") for overlap in ((True, False) if a.baseline else (True,))]
    runs = {c: [] for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for i, c in enumerate(order(configs, a.rounds, a.seed)):
            runs[c].append(run_train(*c, a, Path(tmp), f"run{i}"))
    records = {c: record(*c, runs[c], a.warmup) for c in configs}
    for (n, s, d, overlap), rec in records.items():
        serial = records.get((n, s, d, False))
        if overlap and serial:
            # Under --no-overlap every collective is waited for at once: its exposed time is the
            # whole communication time, so this share of it left the critical path.
            wait, full = rec["time_breakdown_s"]["comm_wait"], serial["time_breakdown_s"]["comm_wait"]
            rec["hidden_vs_serial"] = 1.0 - wait / full if full > 0 else 0.0
            rec["serial_comm_s"] = full
    for rec in records.values():
        print(json.dumps(rec))
    same = all(len({r["final_params_sha256"] for r in records.values() if (r["N"], r["dtype"]) == (n, d)}) == 1
               for n, _, d, _ in configs)
    print(json.dumps({"check": "stage parity (final parameters bit-identical per N and dtype)", "ok": same}))
    status = 0 if same else 1
    for n in sorted({c[0] for c in configs}):
        for d in sorted({c[2] for c in configs}):
            two, three = records.get((n, 2, d, True)), records.get((n, 3, d, True))
            if two and three:
                ratio = three["median_step_s"] / two["median_step_s"]
                ok = ratio <= a.ceiling
                # Runs of the same round ran next to each other: their ratios show the drift in load.
                rounds = [round(t3 / t2, 3) for t2, t3 in zip(two["run_medians_s"], three["run_medians_s"])]
                print(json.dumps({"bar": "stage 3 / stage 2 median step time", "N": n, "dtype": d,
                                  "ratio": round(ratio, 4), "ceiling": a.ceiling, "ok": ok, "round_ratios": rounds,
                                  "width": a.width, "depth": a.depth, "global_batch": a.batch_per_rank * n}))
                if a.bar and not ok:
                    status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
