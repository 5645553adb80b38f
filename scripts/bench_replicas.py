"""What the in-memory replicas cost each step, and how long a recovery from a killed rank takes.

    python scripts/bench_replicas.py                      # GPT 6x256, N = 4 in 2 emulated nodes of 2, stage 3
    python scripts/bench_replicas.py --rounds 3 --recoveries 3
    python scripts/bench_replicas.py --modes none,sync,behind --recoveries 0 --recovery-commit behind

Steady state: each round runs the same job once per mode of ``--modes``: ``none`` without ``--replicas``,
``sync`` and ``behind`` with ``--replicas --replicas-commit`` that mode (in a fresh random order each round, so a
drift in the machine's load hits every mode alike), and takes the wall time from one step's progress line to
the next as rank 0 prints it (``--log-every 1``; the first two steps left out): a step's compute, its replicas'
commit and everything else between steps. A mode's ``cost`` is the median over rounds of (mode - none) / none,
``ratio`` 1 + cost. Also: the commit's own median (``commit_s``: sync, the time after the step until every
rank's copies are agreed; behind, the last step's commit finished and this step's started. Either also absorbs
the ranks' skew, which the next step's first collective would otherwise wait for), and the shared-memory bytes
per rank measured beside the formula (train/replicas.replica_bytes).

Recovery: ``--recoveries`` supervised runs (``python -m zerompi.run``, ``--replicas-commit`` the
``--recovery-commit`` mode) in which rank 1 is killed with SIGKILL once every rank has taken step 3; the
metrics' failure record gives detect, relaunch and restore seconds and the steps lost.

Prints one JSON object (medians). The machine this ran on may be shared and noisy: compare within one output.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--recoveries", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--node-size", type=int, default=2)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--modes", default="none,sync", help="comma-separated: none, sync, behind (default none,sync)")
    p.add_argument("--recovery-commit", default="sync", choices=("sync", "behind"))
    a = p.parse_args(argv)
    a.modes = a.modes.split(",")
    if "none" not in a.modes or not set(a.modes) <= {"none", "sync", "behind"} or len(set(a.modes)) < 2:
        p.error(f"--modes {','.join(a.modes)}: use none and one or more of sync, behind")
    return a


def env():
    e = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    e.setdefault("OMP_NUM_THREADS", "1")
    e.setdefault("OPENBLAS_NUM_THREADS", "1")
    return e


def mpiexec():
    from zerompi.run.supervisor import mpiexec as found
    return found()


def flags(a, steps):
    return ["--stage", str(a.stage), "--n-layer", str(a.n_layer), "--d-model", str(a.d_model), "--steps", str(steps),
            "--node-size", str(a.node_size), "--eval-every", "0", "--progress", "lines", "--log-every", "1"]


def steady_run(a, tmp, mode):
    """(median step-to-step wall seconds, metrics) of one run (``mode``: none, sync or behind)."""
    out = Path(tmp) / "m.json"
    cmd = [mpiexec(), "-n", str(a.ranks), sys.executable, "-m", "zerompi.train", *flags(a, a.steps),
           "--metrics-json", str(out)]
    if mode != "none":
        cmd += ["--replicas", f"bench-{os.getpid()}", "--replicas-commit", mode]
    stamps = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env()) as proc:
        for line in proc.stdout:
            if line.startswith("step "):
                stamps.append(time.perf_counter())
    assert proc.returncode == 0, f"exit {proc.returncode}: {' '.join(cmd)}"
    gaps = [b - x for x, b in zip(stamps[2:], stamps[3:])]
    return statistics.median(gaps), json.loads(out.read_text())


def recovery_run(a, tmp, k):
    from zerompi.run.supervisor import kill
    from zerompi.run.watch import ranks_of
    job, out = f"bench-{os.getpid()}-r{k}", Path(tmp) / f"r{k}.json"
    cmd = [sys.executable, "-m", "zerompi.run", "-n", str(a.ranks), "--max-restarts", "1", "--",
           *flags(a, 6), "--replicas", job, "--replicas-commit", a.recovery_commit, "--metrics-json", str(out)]
    done = threading.Event()

    def killer():
        while not done.is_set():
            seen = ranks_of(job)
            if len(seen) == a.ranks and all((r.get("step") or 0) >= 3 for r in seen.values()):
                kill(job, [1])
                return
            time.sleep(0.005)
    threading.Thread(target=killer, daemon=True).start()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=600)
    finally:
        done.set()
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())["failures"][0]


def main(argv=None):
    a = parse(argv)
    med = statistics.median
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.rounds):
            rounds.append({mode: steady_run(a, tmp, mode) for mode in random.sample(a.modes, len(a.modes))})
        recoveries = [recovery_run(a, tmp, k) for k in range(a.recoveries)]
    off = [r["none"][0] for r in rounds]
    steady = {"none": {"step_wall_s": med(off), "step_time_s": med([r["none"][1]["step_time_s"] for r in rounds]),
                       "rounds": off}}
    for mode in (m for m in a.modes if m != "none"):
        on = [r[mode][0] for r in rounds]
        cost = med([(y - x) / x for x, y in zip(off, on)])
        steady[mode] = {"step_wall_s": med(on), "cost": cost, "ratio": 1 + cost,
                        "commit_s": med([r[mode][1]["replicas"]["commit_s"] for r in rounds]),
                        "step_time_s": med([r[mode][1]["step_time_s"] for r in rounds]),
                        "steps_lost_at_most": rounds[-1][mode][1]["replicas"]["steps_lost_at_most"], "rounds": on}
    last = rounds[-1][next(m for m in a.modes if m != "none")][1]
    rep = last["replicas"]
    result = {
        "setup": {"model": f"gpt {a.n_layer}x{a.d_model}", "params": last["params"],
                  "ranks": a.ranks, "node_size": a.node_size, "stage": a.stage, "steps": a.steps,
                  "rounds": a.rounds, "modes": a.modes, "cpus": os.cpu_count(),
                  "note": "a shared machine: noisy; medians"},
        "steady": steady,
        "memory_per_rank": {"shm_bytes_measured": rep["shm_bytes"], "formula": rep["theory_bytes"],
                            "formula_text": "2 steps x 2 files x (12 S + 128), S = Ψ/N padded; plus the manifest"},
    }
    if recoveries:
        result["recovery"] = {"commit": a.recovery_commit, **{k: med([r[k] for r in recoveries]) for k in (
            "detect_s", "relaunch_s", "restore_s", "recovery_s", "steps_lost")}}
        result["recoveries"] = recoveries
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
