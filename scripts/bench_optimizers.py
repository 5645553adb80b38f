"""AdamW and Muon, measured (issue 44): ``python scripts/bench_optimizers.py [--json] [--quality]``.

- Step time: the GPT 6 x 256 (T 256, 8 heads, batch 8, fp32) at N ranks (default 4), stages 1 and 3,
  AdamW and Muon in interleaved rounds (so a busy machine slows each alike); per run the median step
  time and the optimizer phase's median (the engine's timers), then the median over the rounds.
- Newton-Schulz's share: NS timed in this process on the matrices each rank owns (engine/matrix_owners.py's
  plan for the same layout), the most loaded rank's time (the step waits for it) and all of them (one rank);
  its GEMM floor: NS's multiply-adds over the float32 GEMM rate measured here (a 1024^3 matmul), one BLAS
  thread, as each rank has.
- ``--quality``: the default job (GPT 2 x 64) for 300 steps, AdamW and Muon each at 3 learning rates: the
  held-out loss at step 300, and each optimizer's best; ``--data FILE``: on a text file instead.

One JSON object with ``--json``, else a markdown table. The numbers are as noisy as the machine is shared.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
from launch import job_env, mpiexec  # noqa: E402

GPT_6x256 = ["--model", "gpt", "--n-layer", "6", "--d-model", "256", "--n-head", "8", "--seq-len", "256",
             "--batch", "8", "--dtype", "fp32", "--eval-every", "0", "--log-every", "1000"]
LRS = (1e-3, 3e-3, 1e-2)


def train(ranks: int, flags, timeout: float = 1800) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.json"
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "zerompi.train", *map(str, flags),
               "--metrics-json", str(metrics)]
        subprocess.run(cmd, check=True, capture_output=True, cwd=str(ROOT), timeout=timeout, env=job_env(ROOT))
        return json.loads(metrics.read_text())


def step_times(ranks: int, steps: int, rounds: int) -> dict:
    runs = {(o, s): [] for s in (1, 3) for o in ("adamw", "muon")}
    for _ in range(rounds):
        for (opt, stage), got in runs.items():      # interleaved: each round runs every case once
            m = train(ranks, GPT_6x256 + ["--steps", steps, "--stage", stage, "--optimizer", opt])
            got.append((statistics.median(m["step_times_s"][1:]), m["time_breakdown_s"]["optimizer"]))
    out = {}
    for (opt, stage), got in runs.items():
        out[f"{opt}-stage{stage}"] = {"step_s": statistics.median(s for s, _ in got),
                                      "optimizer_s": statistics.median(o for _, o in got),
                                      "rounds_step_s": [s for s, _ in got]}
    for stage in (1, 3):
        a, m = out[f"adamw-stage{stage}"]["step_s"], out[f"muon-stage{stage}"]["step_s"]
        out[f"muon/adamw-stage{stage}"] = m / a
    return out


def newton_schulz_share(ranks: int, repeats: int = 5) -> dict:
    """NS on each rank's own matrices (the plan of the 6 x 256 GPT's layout at ``ranks``), timed here."""
    import numpy as np
    from zerompi.engine.config import ZeroConfig
    from zerompi.engine.matrix_owners import muon_names, ns_cost, plan
    from zerompi.layout import FlatLayout
    from zerompi.optim.muon import NS_STEPS, newton_schulz
    from zerompi.train.data import GeneratedData
    from zerompi.train.models.gpt import GPT
    model = GPT(GeneratedData(256, 0).corpus.vocab, 256, 6, 8, 256)
    spec = [(name, [(n, np.shape(a)) for n, a in params.items()]) for name, params in model.lazy_layers()]
    c = ZeroConfig()
    layout = FlatLayout(spec, ranks, c.bucket_bytes // 4, c.align)
    mats = plan(layout, muon_names({n: p.shape for n, p in layout.params.items()}, ("*.w",)), 1, ranks)
    rng = np.random.default_rng(0)

    def timed(shape) -> float:
        u = rng.standard_normal(shape).astype(np.float32)
        best = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            newton_schulz(u)
            best.append(time.perf_counter() - t0)
        return statistics.median(best)

    per = {m.name: timed(m.shape) for m in mats}
    by_rank = [sum(per[m.name] for m in mats if m.owner == r) for r in range(ranks)]
    a = rng.standard_normal((1024, 1024)).astype(np.float32)
    gemm = min(_time(lambda: a @ a) for _ in range(repeats))
    rate = 2 * 1024 ** 3 / gemm                                # float32 multiply-adds x 2 per second

    def flops(shape):
        m, n = min(shape), max(shape)
        return NS_STEPS * (2 * m * m * n * 2 + 2 * m ** 3)     # X X^T, A A, B X per iteration

    floor = [sum(flops(m.shape) for m in mats if m.owner == r) / rate for r in range(ranks)]
    return {"matrices": len(mats), "ns_s_most_loaded_rank": max(by_rank), "ns_s_all_matrices": sum(by_rank),
            "ns_s_by_rank": by_rank, "gemm_gflops": rate / 1e9, "ns_floor_s_most_loaded_rank": max(floor),
            "cost_by_rank": [sum(ns_cost(m.shape) for m in mats if m.owner == r) for r in range(ranks)]}


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def quality(ranks: int, steps: int, data=None) -> dict:
    out = {}
    for opt in ("adamw", "muon"):
        for lr in LRS:
            m = train(ranks, ["--steps", steps, "--eval-every", steps, "--log-every", "1000", "--optimizer", opt,
                              "--lr", lr] + (["--data", data] if data else []))
            out[f"{opt}@{lr:g}"] = m["val_losses"][-1][1]
        best = min(LRS, key=lambda lr: out[f"{opt}@{lr:g}"])
        out[f"{opt}-best"] = {"lr": best, "val_loss": out[f"{opt}@{best:g}"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="steps per timing run (the first is not counted)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quality", action="store_true", help="also the held-out loss after 300 steps")
    p.add_argument("--no-timing", action="store_true", help="skip the step times")
    p.add_argument("--data", help="with --quality: train on this text file (byte-level tokens) instead")
    a = p.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")    # as each rank has (launch.job_env)
    result = {"ranks": a.ranks, "ns": newton_schulz_share(a.ranks)}
    if not a.no_timing:
        result["step"] = step_times(a.ranks, a.steps, a.rounds)
    if a.quality:
        result["quality"] = quality(a.ranks, 300, a.data and os.path.abspath(a.data))
    if a.json:
        print(json.dumps(result))
        return
    ns = result["ns"]
    print(f"Newton-Schulz, most loaded of {a.ranks} ranks: {ns['ns_s_most_loaded_rank'] * 1e3:.1f} ms "
          f"(floor {ns['ns_floor_s_most_loaded_rank'] * 1e3:.1f} ms at {ns['gemm_gflops']:.1f} GFLOP/s); "
          f"all {ns['matrices']} matrices on one rank {ns['ns_s_all_matrices'] * 1e3:.1f} ms")
    for k, v in result.get("step", {}).items():
        print(f"| {k} | {v if isinstance(v, float) else round(v['step_s'] * 1e3, 1)} |")
    for k, v in result.get("quality", {}).items():
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
