"""Activation memory and checkpointing, measured (issue 23): ``python scripts/bench_activations.py``.

For two GPTs (the default one, and 6 blocks x 256 channels at seq_len 512) in fp32, fp16 and bf16
storage, with and without --checkpoint-activations, it runs ``mpiexec -n N python -m zerompi.train``
for a few steps and prints, as one JSON line per run and a markdown table at the end: the per-rank
bytes the run measured (model states, the engine's buffers at peak, the GPT's activations beside
their formula), their sum, the peak resident memory of the largest rank (getrusage), the median
step time and the final-parameter hash (equal with and without checkpointing, as it must be).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from launch import mpiexec  # noqa: E402  (one launcher and environment for every script)
MODELS = {
    "default GPT (2 x 64, T 64, batch 48)": [],
    "6 x 256 GPT (T 512, 8 heads, batch 8)": ["--n-layer", "6", "--d-model", "256", "--n-head", "8",
                                               "--seq-len", "512", "--batch", "8"],
}


def run(ranks: int, steps: int, flags) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.json"
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "zerompi.train", "--steps", str(steps),
               "--eval-every", "0", "--log-every", "1000", "--metrics-json", str(metrics), *flags]
        # A wrapper process per run: its children's peak RSS is this run's largest rank (ru_maxrss, KiB).
        wrapper = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
                   "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        out = subprocess.run([sys.executable, "-c", wrapper, *cmd], check=True, capture_output=True, text=True,
                             cwd=str(ROOT), timeout=1800,
                             env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
        m = json.loads(metrics.read_text())
    states, buffers, act = m["memory_bytes"]["total"], m["peak_buffer_bytes"], m["activation_bytes"]
    return {"states": states, "buffers": buffers, "activations": act, "formula": m["activation_theory_bytes"],
            "total": states + buffers + act, "rss": int(out.stdout.split()[-1]) * 1024,
            "step_s": m["step_time_s"], "step_times_s": m["step_times_s"], "sha": m["final_params_sha256"],
            "final_loss": m["losses"][-1]}


def mib(n: int) -> str:
    return f"{n / 2 ** 20:,.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="steps per run (the step time is their median)")
    p.add_argument("--stage", type=int, default=2)
    a = p.parse_args(argv)
    rows = []
    for model, flags in MODELS.items():
        for dtype in ("fp32", "fp16", "bf16"):
            for ckpt in (False, True):
                r = run(a.ranks, a.steps, [*flags, "--dtype", dtype, "--stage", str(a.stage)] +
                        (["--checkpoint-activations"] if ckpt else []))
                r.update(model=model, dtype=dtype, checkpoint=ckpt)
                print(json.dumps(r), flush=True)
                rows.append(r)
    print(f"\nN = {a.ranks}, stage {a.stage}, {a.steps} steps; MiB per rank (measured; activations beside "
          "their formula); step time: median of the steps")
    print("| model | dtype | checkpointing | model states | buffers | activations (formula) | total | "
          "peak RSS | step time | same bits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        twin = next(o for o in rows if o["model"] == r["model"] and o["dtype"] == r["dtype"] and o is not r)
        same = "yes" if twin["sha"] == r["sha"] else "NO"
        print(f"| {r['model']} | {r['dtype']} | {'on' if r['checkpoint'] else 'off'} | {mib(r['states'])} | "
              f"{mib(r['buffers'])} | {mib(r['activations'])} ({mib(r['formula'])}) | {mib(r['total'])} | "
              f"{mib(r['rss'])} | {r['step_s'] * 1e3:,.0f} ms | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
