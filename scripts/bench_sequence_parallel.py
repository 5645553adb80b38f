"""Sequence parallelism measured (issue 32): ``python scripts/bench_sequence_parallel.py > sp.json``.

One command, one JSON document on stdout (progress on stderr; ``--markdown`` adds the tables of
docs/sequence-parallel.md to stderr). At N ranks (default 4), the GPT 4 x 256 with 8 heads, one
sequence per data-parallel rank (batch = N / sp), fp32 storage:

- ``longest``: for sp 1, 2, 4 the longest sequence (a multiple of 64) whose per-rank need, as the
  train preflight counts it (train/preflight.memory_needed: model states and buffers by the
  estimate, the activations by their formula), fits ``--cap-mib``; then that job run for a few
  steps: its step time and tokens/s, the bytes it measured (model states, buffers at peak,
  activations) against the cap, and the peak RSS of its largest rank;
- ``activations``: at seq_len 2048, for sp 1, 2, 4, with and without activation checkpointing,
  the activation bytes per rank measured by the model's workspace beside the formula in K;
- ``all_to_all``: in those runs, the SP all-to-all seconds and bytes of a step beside the step's
  forward and backward (the compute the all-to-alls split) and the formula's bytes;
- ``bench``: zerompi.bench --sp 2 and --sp 4 over the same N ranks (zerompi-sp beside MPI's Alltoall).

``validation`` lists every check that failed (empty: measured bytes equal their formulas, each
longest job fits the cap by what it measured). Times are only as good as the machine is quiet.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from launch import job_env, mpiexec  # noqa: E402  (one launcher and environment for every script)
GPT = ["--model", "gpt", "--n-layer", "4", "--d-model", "256", "--n-head", "8", "--eval-every", "0",
       "--log-every", "1000", "--dtype", "fp32"]
SPS = (1, 2, 4)


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def job_flags(a, sp: int, seq_len: int, ckpt: bool = False) -> list:
    return GPT + ["--seq-len", str(seq_len), "--batch", str(a.ranks // sp), "--sp", str(sp), "--stage", str(a.stage),
                  "--steps", str(a.steps)] + (["--checkpoint-activations"] if ckpt else [])


def train(a, flags) -> dict:
    """One zerompi.train job; its metrics, and the peak RSS of its largest rank (getrusage of the children)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.json"
        cmd = [mpiexec(), "-n", str(a.ranks), sys.executable, "-m", "zerompi.train", *flags,
               "--metrics-json", str(path)]
        wrapper = ("import resource, subprocess, sys; "
                   "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
                   "sys.stderr.write(p.stderr[-2000:]); "
                   "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        out = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, cwd=str(ROOT),
                             timeout=3600, env=job_env(ROOT))
        code, rss = out.stdout.split()[-2:]
        if code != "0":
            raise RuntimeError(f"{' '.join(flags)}: exit {code}\n{out.stderr}")
        m = json.loads(path.read_text())
    return dict(m, peak_rss_bytes=int(rss) * 1024)


def summary(m: dict) -> dict:
    """The numbers of one run the tables use."""
    sp = m.get("sequence_parallel") or {}
    tb = m["time_breakdown_s"]
    return {"sp": m["config"]["zero"]["sp"], "seq_len": m["config"]["seq_len"], "batch": m["config"]["batch"],
            "checkpoint": m["config"]["checkpoint_activations"], "stage": m["stage"],
            "step_time_s": m["step_time_s"],
            "tokens_per_s": m["config"]["batch"] * m["config"]["seq_len"] / m["step_time_s"],
            "forward_s": tb.get("forward", 0.0), "backward_s": tb.get("backward", 0.0),
            "model_states_bytes": m["memory_bytes"]["total"], "peak_buffer_bytes": m["peak_buffer_bytes"],
            "activation_bytes": m["activation_bytes"], "activation_theory_bytes": m["activation_theory_bytes"],
            "all_to_all_bytes_per_step": sp.get("bytes_per_step", 0),
            "all_to_all_theory_bytes_per_step": sp.get("theory_bytes_per_step", 0),
            "all_to_all_seconds_per_step": sp.get("seconds_per_step", 0.0),
            "peak_rss_bytes": m["peak_rss_bytes"], "final_loss": m["losses"][-1]}


def need_bytes(a, sp: int, seq_len: int) -> int:
    """What the train preflight counts per rank for this job (train/preflight.memory_needed)."""
    from zerompi.train.config import parse_config
    from zerompi.train.preflight import memory_needed
    return sum(memory_needed(parse_config(job_flags(a, sp, seq_len)), a.ranks).values())


def longest(a, sp: int, cap: int) -> int:
    """The longest multiple of 64 whose preflight need fits ``cap`` (the need grows with the length)."""
    lo, hi = 0, 64
    while need_bytes(a, sp, hi) <= cap:
        lo, hi = hi, hi * 2
    while hi - lo > 64:
        mid = (lo + hi) // 2 // 64 * 64
        lo, hi = (mid, hi) if need_bytes(a, sp, mid) <= cap else (lo, mid)
    return lo


def bench(a, sp: int) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "b.json"
        subprocess.run([mpiexec(), "-n", str(a.ranks), sys.executable, "-m", "zerompi.bench", "--sp", str(sp),
                        "-b", "64K", "-e", "16M", "-f", "4", "--check", "--no-overlap", "--json", str(path)],
                       check=True, capture_output=True, cwd=str(ROOT), timeout=1800, env=job_env(ROOT))
        return json.loads(path.read_text())


def validate(out: dict, cap: int) -> list:
    bad = []
    for r in out["longest"] + out["activations"]:
        what = f"sp={r['sp']} seq_len={r['seq_len']} checkpoint={r['checkpoint']}"
        if r["activation_bytes"] != r["activation_theory_bytes"]:
            bad.append(f"{what}: activations measured {r['activation_bytes']} "
                       f"!= formula {r['activation_theory_bytes']}")
        if r["all_to_all_bytes_per_step"] != r["all_to_all_theory_bytes_per_step"]:
            bad.append(f"{what}: all-to-all bytes measured {r['all_to_all_bytes_per_step']} != formula "
                       f"{r['all_to_all_theory_bytes_per_step']}")
    for r in out["longest"]:
        held = r["model_states_bytes"] + r["peak_buffer_bytes"] + r["activation_bytes"]
        if held > cap:
            bad.append(f"sp={r['sp']} seq_len={r['seq_len']}: measured {held} bytes > cap {cap}")
    for rec in out["bench"]:
        if rec["wrong"]:
            bad.append(f"bench sp={rec['sp']} {rec['impl']} {rec['bytes']} B: {rec['wrong']} wrong elements")
    return bad


def markdown(out: dict) -> str:
    mib = lambda b: f"{b / 2 ** 20:,.1f}"
    lines = ["| sp | longest seq_len | preflight need (MiB) | measured: states + buffers + activations (MiB) | "
             "peak RSS (MiB) | step time | tokens/s |", "|---|---|---|---|---|---|---|"]
    for r in out["longest"]:
        held = r["model_states_bytes"] + r["peak_buffer_bytes"] + r["activation_bytes"]
        lines.append(f"| {r['sp']} | {r['seq_len']} | {mib(r['need_bytes'])} | {mib(held)} "
                     f"| {mib(r['peak_rss_bytes'])} | {r['step_time_s']:.2f} s | {r['tokens_per_s']:,.0f} |")
    lines += ["", "| sp | checkpointing | activations measured (MiB) | formula (MiB) | step time | tokens/s | "
              "fwd + bwd | all-to-all s/step | all-to-all share of fwd + bwd | all-to-all bytes/step (formula) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["activations"]:
        compute = r["forward_s"] + r["backward_s"]
        share = r["all_to_all_seconds_per_step"] / compute if compute else 0.0
        lines.append(f"| {r['sp']} | {'on' if r['checkpoint'] else 'off'} | {mib(r['activation_bytes'])} | "
                     f"{mib(r['activation_theory_bytes'])} | {r['step_time_s']:.2f} s | {r['tokens_per_s']:,.0f} | "
                     f"{compute:.2f} s | {r['all_to_all_seconds_per_step']:.3f} | {share:.1%} | "
                     f"{mib(r['all_to_all_bytes_per_step'])} ({mib(r['all_to_all_theory_bytes_per_step'])}) |")
    lines += ["", "| sp | size (B) | zerompi-sp busbw (GB/s) | mpi Alltoall busbw (GB/s) | ratio |",
              "|---|---|---|---|---|"]
    rows = {(r["sp"], r["bytes"], r["impl"]): r for r in out["bench"]}
    for (sp, size, impl), r in sorted(rows.items()):
        if impl != "zerompi-sp":
            continue
        m = rows[(sp, size, "mpi")]
        lines.append(f"| {sp} | {size:,} | {r['busbw']:.2f} | {m['busbw']:.2f} | {r['busbw'] / m['busbw']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--cap-mib", type=float, default=512.0, help="per-rank memory cap the longest sequence must fit")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="steps per run (the step time is their median)")
    p.add_argument("--seq-len", type=int, default=2048, help="of the activation and all-to-all table")
    p.add_argument("--markdown", action="store_true", help="also print the tables to stderr")
    a = p.parse_args(argv)
    cap = int(a.cap_mib * 2 ** 20)
    out = {"ranks": a.ranks, "cap_bytes": cap, "stage": a.stage, "steps": a.steps, "model": "GPT 4 x 256, 8 heads",
           "batch": "N / sp (one sequence per data-parallel rank)", "longest": [], "activations": [], "bench": []}
    for sp in SPS:
        t = longest(a, sp, cap)
        log(f"sp={sp}: longest seq_len {t} under {a.cap_mib:g} MiB; running it")
        r = summary(train(a, job_flags(a, sp, t)))
        out["longest"].append(dict(r, need_bytes=need_bytes(a, sp, t)))
    for sp in SPS:
        for ckpt in (False, True):
            log(f"sp={sp} seq_len={a.seq_len} checkpointing={ckpt}")
            out["activations"].append(summary(train(a, job_flags(a, sp, a.seq_len, ckpt))))
    for sp in SPS[1:]:
        log(f"zerompi.bench --sp {sp}")
        out["bench"] += bench(a, sp)
    out["validation"] = validate(out, cap)
    print(json.dumps(out, indent=1))
    if a.markdown:
        log(markdown(out))
    return 1 if out["validation"] else 0


if __name__ == "__main__":
    sys.exit(main())
