"""The tensor-parallel GPT's training step measured: ``python scripts/bench_tp_step.py > tp_step.json``.

One command, one JSON document on stdout (progress on stderr; ``--markdown`` adds the table of
docs/tensor-parallel.md to stderr). The GPT 4 x 256 with 8 heads, seq_len 64, global batch 16, fp32,
stage 1, at N ranks (default 2 and 4): the ``--tp 2`` step beside the ``--tp 1`` step (pure data
parallelism over the same ranks). Rounds are interleaved (every configuration once per round, in
turn), so a change in the machine's load falls on all of them alike; each run's step time is the
median of its steps, and a configuration's is the median over rounds.

``--old DIR``: another checkout of zerompi (e.g. the commit before a change, unpacked with ``git
archive``); its runs are interleaved with this checkout's in every round, as ``code: old`` beside
``code: new``, for a fair before/after on the same machine in the same session.

Each record also carries the TP all-reduce seconds and bytes per step and the activation bytes the
run measured beside its formula (null where the code measured none). Times are only as good as the
machine is quiet.
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

GPT = ["--model", "gpt", "--n-layer", "4", "--d-model", "256", "--n-head", "8", "--seq-len", "64", "--batch", "16",
       "--eval-every", "0", "--log-every", "1000", "--dtype", "fp32", "--stage", "1"]


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def train(root: Path, ranks: int, tp: int, steps: int) -> dict:
    """One zerompi.train job of checkout ``root``; its metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.json"
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "zerompi.train", *GPT, "--tp", str(tp),
               "--steps", str(steps), "--metrics-json", str(path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(root), timeout=1800, env=job_env(root))
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} in {root}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        return json.loads(path.read_text())


def record(m: dict, code: str, ranks: int, rnd: int) -> dict:
    t = m.get("tensor_parallel") or {}
    return {"code": code, "ranks": ranks, "tp": m["config"]["zero"]["tp"], "round": rnd,
            "step_time_s": m["step_time_s"], "tp_seconds_per_step": t.get("seconds_per_step", 0.0),
            "tp_bytes_per_step": t.get("bytes_per_step", 0), "activation_bytes": m["activation_bytes"],
            "activation_theory_bytes": m["activation_theory_bytes"], "final_loss": m["losses"][-1],
            "final_params_sha256": m["final_params_sha256"]}


def summarize(runs: list) -> list:
    """Per (ranks, code, tp): the median step time over rounds, and the rounds' values."""
    keys = sorted({(r["ranks"], r["code"], r["tp"]) for r in runs}, key=lambda k: (k[0], k[1] != "old", k[2]))
    out = []
    for n, code, tp in keys:
        mine = [r for r in runs if (r["ranks"], r["code"], r["tp"]) == (n, code, tp)]
        times = [r["step_time_s"] for r in mine]
        out.append({"ranks": n, "code": code, "tp": tp, "step_time_s": statistics.median(times),
                    "step_times_s": times,
                    "tp_seconds_per_step": statistics.median(r["tp_seconds_per_step"] for r in mine),
                    "activation_bytes": mine[0]["activation_bytes"],
                    "activation_theory_bytes": mine[0]["activation_theory_bytes"]})
    return out


def paired(runs: list) -> list:
    """Per N and tp, the ratios of runs of one round, next to each other in time (the machine's load changes
    between rounds more than between neighbours): new / old (with --old), and tp 2 / tp 1 of each code; the
    median of each over rounds."""
    at = {(r["code"], r["ranks"], r["tp"], r["round"]): r["step_time_s"] for r in runs}
    rounds = sorted({r["round"] for r in runs})
    out = []
    for n in sorted({r["ranks"] for r in runs}):
        pairs = [(f"new/old tp={tp}", ("new", tp), ("old", tp)) for tp in (1, 2)]
        pairs += [(f"{code} tp2/tp1", (code, 2), (code, 1)) for code in ("old", "new")]
        for name, (ca, ta), (cb, tb) in pairs:
            ratios = [at[(ca, n, ta, k)] / at[(cb, n, tb, k)] for k in rounds
                      if (cb, n, tb, k) in at and (ca, n, ta, k) in at]
            if ratios:
                out.append({"ranks": n, "ratio": name, "median": statistics.median(ratios), "rounds": ratios})
    return out


def markdown(rows: list, ratios: list = ()) -> str:
    mib = lambda b: "—" if b is None else f"{b / 2 ** 20:.2f}"   # noqa: E731
    lines = ["| N | code | mesh | step time (median) | rounds | TP all-reduce s/step | activations measured "
             "(formula), MiB |", "|---|---|---|---:|---|---:|---|"]
    for r in rows:
        mesh = f"dp {r['ranks'] // r['tp']} × tp {r['tp']}"
        lines.append(f"| {r['ranks']} | {r['code']} | {mesh} | {r['step_time_s'] * 1e3:.0f} ms | "
                     f"{', '.join(f'{t * 1e3:.0f}' for t in r['step_times_s'])} | "
                     f"{r['tp_seconds_per_step'] * 1e3:.0f} ms | "
                     f"{mib(r['activation_bytes'])} ({mib(r['activation_theory_bytes'])}) |")
    if ratios:
        lines += ["", "| N | ratio of a round's neighbours | median | rounds |", "|---|---|---:|---|"]
        lines += [f"| {r['ranks']} | {r['ratio']} | {r['median']:.2f} | {', '.join(f'{x:.2f}' for x in r['rounds'])} |"
                  for r in ratios]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--old", type=Path, default=None, help="another checkout to interleave with this one")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args(argv)
    codes = ([("old", a.old.resolve())] if a.old else []) + [("new", ROOT)]
    runs = []
    for rnd in range(a.rounds):
        for n in a.ranks:
            for code, root in codes:
                for tp in (1, 2):
                    m = train(root, n, tp, a.steps)
                    runs.append(record(m, code, n, rnd))
                    log(f"round {rnd} N={n} {code} tp={tp}: step {m['step_time_s'] * 1e3:.1f} ms")
    rows, ratios = summarize(runs), paired(runs)
    bad = [f"N={r['ranks']} {r['code']} tp={r['tp']}: activations {r['activation_bytes']} != formula "
           f"{r['activation_theory_bytes']}" for r in rows
           if r["activation_bytes"] is not None and r["activation_bytes"] != r["activation_theory_bytes"]]
    if a.old:       # without TP the code did not change: the same bits (the TP runs' losses differ by rounding)
        sha = {(r["code"], r["ranks"], r["tp"]): r["final_params_sha256"] for r in runs}
        bad += [f"N={n} tp=1: new final_params_sha256 differs from old" for n in a.ranks
                if sha[("old", n, 1)] != sha[("new", n, 1)]]
    json.dump({"config": {"flags": GPT, "steps": a.steps, "rounds": a.rounds, "ranks": a.ranks,
                          "old": str(a.old) if a.old else None},
               "summary": rows, "paired": ratios, "runs": runs, "validation": bad}, sys.stdout, indent=1)
    print()
    if a.markdown:
        log(markdown(rows, ratios))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
