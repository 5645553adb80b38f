"""Expert parallelism measured: ``python scripts/bench_moe.py --json > moe.json``.

The default GPT with 8 experts, top-2, at N ranks (default 4), stage 3: one run per --ep (default 1, 2, 4) per
round, the rounds interleaved (every configuration once per round, in turn) so a change in the machine's load
falls on all alike. Per configuration: the median step time over rounds, tokens/s, the EP all-to-all's
seconds per step and its share of the step, its bytes per rank per step beside the balanced formula, the run's
traffic beside its formula, and the final sha256 (the same at every --ep: docs/moe.md). ``--json``: one JSON
document on stdout (progress on stderr); else a markdown table. Times are only as good as the machine is quiet.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    a = p.parse_args()
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
