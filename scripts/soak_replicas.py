"""Soak of the supervisor: a random rank killed every ~20 steps over a few hundred, and the bits must not move.

    python scripts/soak_replicas.py                       # 300 steps, N = 4 (2 nodes of 2), stage 3, a kill ~every 20
    python scripts/soak_replicas.py --steps 100 --every 10 --seed 1
    python scripts/soak_replicas.py --steps 100 --every 10 --replicas-commit behind

Runs ``python -m zerompi.run`` with ``--replicas`` and a killer thread that, each time every rank has committed
a step past the next kill point (drawn ``--every`` +- 50% steps after the last one), sends SIGKILL to a random
rank; then the same job straight, without faults or replicas (the reference). Prints one JSON object: the kills,
the failure records (metrics ``failures``), the total steps lost, and whether the final digest equals the
reference's. Exit status 0 when every kill was recovered, the steps lost are at most the kills (with
``--replicas-commit behind``, twice the kills: each may lose the step whose commit was under way too), and the
digests are equal; else 1.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zerompi.run.supervisor import kill, mpiexec  # noqa: E402
from zerompi.run.watch import ranks_of  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=20, help="steps between kills, on average (default 20)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--node-size", type=int, default=2)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas-commit", default="sync", choices=("sync", "behind"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    rng = random.Random(a.seed)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    flags = ["--stage", str(a.stage), "--steps", str(a.steps), "--node-size", str(a.node_size), "--batch", "24",
             "--eval-every", "0", "--progress", "lines", "--log-every", "50"]
    job, kills, done = f"soak-{os.getpid()}", [], threading.Event()

    def killer():
        at = rng.randint(a.every // 2, a.every * 3 // 2)
        while not done.is_set():
            seen = ranks_of(job)
            steps = [r.get("step") or 0 for r in seen.values()]
            if len(seen) == a.ranks and min(steps) >= at and at < a.steps - 2:
                rank = rng.randrange(a.ranks)
                try:
                    kill(job, [rank])
                except (KeyError, ProcessLookupError):
                    continue                       # a rank being relaunched: try again
                kills.append({"rank": rank, "after_step": min(steps)})
                at = min(steps) + rng.randint(a.every // 2, a.every * 3 // 2)
                while not done.is_set() and any(r.get("step") for r in ranks_of(job).values()):
                    time.sleep(0.01)                # until the relaunch has registered afresh
            time.sleep(0.005)

    with tempfile.TemporaryDirectory() as tmp:
        out, ref = Path(tmp) / "soak.json", Path(tmp) / "ref.json"
        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        try:
            proc = subprocess.run([sys.executable, "-m", "zerompi.run", "-n", str(a.ranks), "--max-restarts",
                                   str(a.steps), "--", *flags, "--replicas", job, "--replicas-commit",
                                   a.replicas_commit, "--metrics-json", str(out)],
                                  capture_output=True, text=True, env=env, timeout=3600)
        finally:
            done.set()
        subprocess.run([mpiexec(), "-n", str(a.ranks), sys.executable, "-m", "zerompi.train", *flags,
                        "--metrics-json", str(ref)], capture_output=True, env=env, timeout=3600, check=True)
        metrics = json.loads(out.read_text()) if out.exists() else {}
        want = json.loads(ref.read_text())["final_params_sha256"]
    failures = metrics.get("failures", [])
    lost = sum(f["steps_lost"] for f in failures)
    per_kill = 2 if a.replicas_commit == "behind" else 1       # train/replicas.STEPS_LOST
    ok = proc.returncode == 0 and len(failures) == len(kills) and lost <= per_kill * len(kills) \
        and metrics.get("final_params_sha256") == want
    print(json.dumps({"steps": a.steps, "ranks": a.ranks, "commit": a.replicas_commit, "exit": proc.returncode,
                      "kills": kills,
                      "failures": failures, "steps_lost": lost, "digest_equal": metrics.get("final_params_sha256")
                      == want, "ok": ok, "stderr_tail": proc.stderr[-1500:] if not ok else ""}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
