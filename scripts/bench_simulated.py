"""The seed's question measured (issue 35): one rank of the ~10B GPT on 64 cards, ZeRO 1, 2 and 3.

``python scripts/bench_simulated.py`` runs, for each stage and storage dtype, one process as rank 0 of
64 (``python -m zerompi.train --simulate-world 64``): the GPT of 48 blocks x 4096 channels (Ψ = 9.67 B,
the estimator's 10B example), a short sequence and one micro-batch (one sequence per rank), two steps
(the bytes per step are a steady step's: the first is left out),
each run in a fresh process under an address-space limit (``--limit-gib``, default 8: this machine's
share). It prints one JSON object: per run the ledger's model states and buffers, the activations, the
process's peak resident set, the bytes and calls of each collective per step and the step time, beside
zerompi.estimate's numbers for the same flags (each run also as one JSON line on stderr as it ends);
where the preflight refuses a run (exit 2, one line: the job cannot fit), that line is the run's
answer, with the estimate. ``--n-layer`` / ``--d-model`` make a smaller model (check the RSS
prediction on one before the big run); ``--pp P`` runs rank R of the job as P pipeline stages
(1F1B, P micro-batches of one sequence each; the estimate is the run's own of its stage's chunks);
``--table`` also prints the markdown table of docs/estimate.md.
"""
import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GIB = 2 ** 30


def flags(a, stage: int, dtype: str):
    piped = ["--pp", str(a.pp), "--micro-batches", str(a.pp)] if a.pp > 1 else []   # 1F1B: m = P, one sequence each
    return ["--simulate-world", str(a.world), "--simulate-rank", str(a.rank), "--stage", str(stage), "--dtype", dtype,
            "--n-layer", str(a.n_layer), "--d-model", str(a.d_model), "--n-head", str(a.n_head),
            "--seq-len", str(a.seq_len), "--batch", str(a.world), "--steps", str(a.steps), "--eval-every", "0",
            "--progress", "lines", *piped]


def estimate(argv):
    """zerompi.estimate's row for the run's flags (the engine's layout), and the preflight's parts."""
    from zerompi.train import preflight
    from zerompi.train.config import parse_config
    cfg = parse_config(argv)
    row = preflight.stage_estimate(cfg, cfg.simulate_world)
    return {"model_state_bytes": row["model_state_bytes"], "buffer_bytes_best_case": row["buffer_bytes_best_case"],
            "buffer_bytes": row["buffer_bytes"], "comm_bytes_per_step": row["comm_bytes_per_step"],
            "formula": row["formula"], "preflight_parts": preflight.memory_needed(cfg, cfg.simulate_world),
            "params": preflight.model_size(cfg)[0]}


def run(a, stage: int, dtype: str) -> dict:
    argv = flags(a, stage, dtype)
    out = {"stage": stage, "dtype": dtype, "estimate": estimate(argv) if a.pp == 1 else None}   # --pp: the run's own
    limit = int(a.limit_gib * GIB)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.json"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "zerompi.train", *argv, "--metrics-json", str(path)],
                              capture_output=True, text=True, cwd=str(ROOT), timeout=a.timeout_s,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
        out.update(exit=proc.returncode, wall_s=round(time.perf_counter() - t0, 1))
        if proc.returncode != 0:
            out["refusal"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""   # exit 2: one line
            return out
        m = json.loads(path.read_text())
    sim = m["simulated"]
    # no preflight per pipeline stage: the estimate of the rank's chunks, as the run printed
    if a.pp > 1:
        by_level = sim["estimate"]["comm_bytes_per_step_by_level"]
        out["estimate"] = dict(sim["estimate"], comm_bytes_per_step=sum(by_level.values()))
        stage = a.rank // (a.world // a.pp)     # world rank = dp rank + DP x stage (no tp, sp)
        out["pp_bytes_per_step"] = {k: v[stage] for k, v in m["pp_bytes_per_step"].items()}
    out.update(measured={"model_state_bytes": m["memory_bytes"]["total"], "memory_bytes": m["memory_bytes"],
                         "buffer_bytes": m["peak_buffer_bytes"], "activation_bytes": m["activation_bytes"],
                         "peak_rss_bytes": sim["peak_rss_bytes"]},
               comm_by_op=sim["comm_by_op"], comm_bytes_per_step=m["comm_bytes_per_step"],
               comm_theory_bytes_per_step=m["comm_theory_bytes_per_step"], step_time_s=m["step_time_s"],
               time_breakdown_s=m.get("time_breakdown_s"), rule=sim["rule"])   # (none with --pp)
    return out


def table(report) -> str:
    gb = lambda v: f"{v / 1e9:.3f}"
    lines = ["| stage | dtype | model states, GB: estimate / measured | buffers, GB: estimate best (2 pending) / "
             "measured | peak RSS, GB | bytes per step, GB: all-gather, reduce-scatter (estimate total) "
             "| step | answer |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        e = r["estimate"]
        head = f"| {r['stage']} | {r['dtype']} | {gb(e['model_state_bytes'])} / "
        if "measured" not in r:
            how = "refused by the preflight" if r["exit"] == 2 else "failed"
            lines.append(head + f"- | {gb(e['buffer_bytes_best_case'])} ({gb(e['buffer_bytes'])}) / - | - | - "
                                f"({gb(e['comm_bytes_per_step'])}) | - | {how} (exit {r['exit']}): {r['refusal']} |")
            continue
        m, ops = r["measured"], r["comm_by_op"]
        steady = lambda op: ops.get(op, {}).get("bytes")    # None: one step ran, no steady step measured
        sent = ", ".join(gb(steady(op)) if steady(op) is not None else
                         f"{gb(ops.get(op, {}).get('first_step_bytes') or 0)} (the first step's; no steady step)"
                         for op in ("all_gather", "reduce_scatter"))
        lines.append(head + f"{gb(m['model_state_bytes'])} | {gb(e['buffer_bytes_best_case'])} "
                            f"({gb(e['buffer_bytes'])}) / {gb(m['buffer_bytes'])} | {gb(m['peak_rss_bytes'])} | {sent} "
                            f"({gb(e['comm_bytes_per_step'])}) | {r['step_time_s']:.0f} s | ran |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=64)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--n-layer", type=int, default=48)
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--n-head", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=2, help="steps run; the bytes per step are the steps' after the first")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B, as many micro-batches)")
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"])
    p.add_argument("--limit-gib", type=float, default=8.0, help="address-space limit of each run (GiB)")
    p.add_argument("--timeout-s", type=float, default=7200)
    p.add_argument("--table", action="store_true", help="also print the markdown table")
    a = p.parse_args()
    runs = []
    for s in a.stages:
        for d in a.dtypes:
            runs.append(run(a, s, d))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)    # each run as it ends: a long one shows progress
    report = {"world": a.world, "rank": a.rank, "model": {"n_layer": a.n_layer, "d_model": a.d_model,
              "n_head": a.n_head, "seq_len": a.seq_len}, "pp": a.pp, "limit_gib": a.limit_gib, "runs": runs}
    print(json.dumps(report))
    if a.table:
        print(table(report))


if __name__ == "__main__":
    main()
