"""Pipeline parallelism at N ranks, one command printing JSON (docs/pipeline.md's table).

    python scripts/bench_pipeline.py                 # N = 4, GPT of 8 blocks: (pp 4), (pp 2 x dp 2), (pp 2 x tp 2)
    python scripts/bench_pipeline.py --quick         # fewer steps and rows (a check that it runs)
    python scripts/bench_pipeline.py --ranks 2 --meshes pp --schedules zb-h1 --ms 8 --no-stage-rows   # one row

For each mesh, each schedule (gpipe, 1f1b, interleaved with 2 chunks per stage, zb-h1) and m = 4 and 8
micro-batches, one zerompi.train run (fp32, stage 1; every run of a mesh in one mpiexec launch): the
median step time, the bubble measured from the actions' timers (zerompi/pipeline/measure.py) beside the
simulator's on each step's own action costs (replayed), on the median costs and on equal costs,
activation and model-state bytes per rank (the largest), and the bytes per step by kind (point-to-point
per stage, ZeRO's data-parallel, TP's). Then,
on pp 2 x dp N/2, stage 3 against stage 1 with 1F1B, m = 8 (model states per rank: what sharding the
stage's parameters over its data-parallel group saves when the pipeline already divides the model by
P), and stage 3 with its gathers kept for the step (--pp-gather step).
The medians are over the steps after the first two. A shared machine makes the times and the measured
bubble noisy; the bytes and the simulated bubble do not depend on it.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = {"gpipe": [], "1f1b": [], "interleaved": ["--chunks", "2"], "zb-h1": []}


def meshes(n: int):
    return {f"pp {n}": ["--pp", str(n)], f"pp 2 x dp {n // 2}": ["--pp", "2"],
            f"pp 2 x tp {n // 2}": ["--pp", "2", "--tp", str(n // 2)]}


MESH_KEYS = ("pp", "dp", "tp")      # --meshes: the three meshes of meshes(n), in their order


def configs(a):
    gpt = ["--model", "gpt", "--n-layer", str(a.n_layer), "--d-model", str(a.d_model), "--n-head", "4", "--seq-len",
           str(a.seq_len), "--eval-every", "0", "--dtype", "fp32", "--log-every", "1000", "--steps", str(a.steps),
           "--bucket-mb", str(a.bucket_mb)]
    ms = a.ms or ((4,) if a.quick else (4, 8))
    rows = []
    for key, (mesh, flags) in zip(MESH_KEYS, meshes(a.ranks).items()):
        if key not in a.meshes:
            continue
        for name, extra in SCHEDULES.items():
            if (a.quick and name in ("gpipe", "interleaved")) or (a.schedules and name not in a.schedules):
                continue
            for m in ms:
                rows.append({"mesh": mesh, "schedule": name, "m": m, "stage": 1,
                             "flags": gpt + flags + ["--schedule", name, *extra, "--micro-batches", str(m),
                                                     "--batch", str(a.batch_per_mb * m), "--stage", "1"]})
    if not a.stage_rows:
        return rows
    mesh, flags = list(meshes(a.ranks).items())[1]          # pp 2 x dp N/2: stage 3 shards over dp ranks
    for stage, gather in ((1, None), (3, None), (3, "step")):
        rows.append({"mesh": mesh, "schedule": "1f1b", "m": 8, "stage": stage, "gather": gather or "micro-batch",
                     "flags": gpt + flags + ["--micro-batches", "8", "--batch", str(a.batch_per_mb * 8),
                                             "--stage", str(stage)] + (["--pp-gather", gather] if gather else [])})
    return rows


def worker(rows) -> None:
    from mpi4py import MPI
    from zerompi.errors import install_abort_hook
    from zerompi.train.config import parse_config
    from zerompi.train.run import train
    install_abort_hook()
    for row in rows:
        m = train(parse_config(row["flags"]))
        if MPI.COMM_WORLD.Get_rank() == 0:
            print("ROW " + json.dumps(summarize(row, m)), flush=True)


def summarize(row, m) -> dict:
    import statistics
    times = m["step_times_s"][2:] or m["step_times_s"]
    per = m["pipeline"]["bubble_fraction_per_step"]
    return {k: v for k, v in row.items() if k != "flags"} | {
        "step_time_s": statistics.median(times), "bubble_measured": statistics.median(per[1:] or per),
        "bubble_simulated": m["bubble_fraction_schedule"], "bubble_replayed": m["bubble_fraction_replayed"],
        "bubble_equal_costs": m["bubble_fraction_unit"],
        "activation_bytes": m["activation_bytes"], "activation_theory_bytes": m["activation_theory_bytes"],
        "model_state_bytes": m["memory_bytes"]["total"], "model_state_theory_bytes": m["theory_bytes_padded"],
        "peak_buffer_bytes": m["peak_buffer_bytes"], "zero_theory_bytes_per_step": m["comm_theory_bytes_per_step"],
        "zero_most_bytes_per_step": m["comm_most_bytes_per_step"],
        "pp_bytes_per_step": m["pp_bytes_per_step"], "pp_theory_bytes_per_step": m["pp_theory_bytes_per_step"],
        "zero_bytes_per_step": m["comm_bytes_per_step"],
        "tp_bytes_per_step": (m["tensor_parallel"] or {}).get("bytes_per_step", 0),
        "params": m["params"], "costs_s": m["pipeline"]["costs_s"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-per-mb", type=int, default=4, help="sequences per micro-batch over the data-parallel ranks")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--bucket-mb", type=float, default=0.25,
                   help="buckets of about one block (stage 3 gathers per layer)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--meshes", default=",".join(MESH_KEYS),
                   help="comma-separated, of pp (pp N), dp (pp 2 x dp N/2), tp (pp 2 x tp N/2)")
    p.add_argument("--schedules", default=None, help=f"comma-separated, of {', '.join(SCHEDULES)} (default: all)")
    p.add_argument("--ms", default=None, help="comma-separated micro-batch counts (default 4,8; --quick 4)")
    p.add_argument("--no-stage-rows", dest="stage_rows", action="store_false",
                   help="leave out the stage 1 / stage 3 rows on pp 2 x dp N/2")
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(json.loads(a.worker))
        return 0
    a.meshes = a.meshes.split(",")
    a.schedules = a.schedules.split(",") if a.schedules else None
    a.ms = [int(m) for m in a.ms.split(",")] if a.ms else None
    bad = [k for k in a.meshes if k not in MESH_KEYS] + [s for s in a.schedules or () if s not in SCHEDULES]
    if bad:
        p.error(f"unknown meshes or schedules {bad}; meshes of {', '.join(MESH_KEYS)}, schedules of "
                f"{', '.join(SCHEDULES)}")
    if a.quick:
        a.steps = 4
    rows = configs(a)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    out = []
    for mesh in dict.fromkeys(r["mesh"] for r in rows):
        mine = [r for r in rows if r["mesh"] == mesh]
        proc = subprocess.run([mpiexec, "-n", str(a.ranks), sys.executable, __file__, "--worker", json.dumps(mine)],
                              capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=3600)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-4000:])
            return proc.returncode
        out += [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    load = os.getloadavg()
    result = {"ranks": a.ranks, "gpt": {"n_layer": a.n_layer, "d_model": a.d_model, "seq_len": a.seq_len,
                                        "batch_per_micro_batch": a.batch_per_mb}, "steps": a.steps,
              "bucket_mb": a.bucket_mb,
              "cpus": os.cpu_count(), "load_average_at_end": load, "rows": out}
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
