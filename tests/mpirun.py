"""Run a command under mpiexec as a subprocess with a timeout: a hang fails the test, never CI."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mpiexec() -> str:
    """The mpiexec next to this Python (the MPI wheel's), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if not found:
        raise RuntimeError("mpiexec not found: pip install -e '.[mpi,test]'")
    return found


def run_mpi(n: int, args, timeout: float = 120, env=None, check: bool = True) -> subprocess.CompletedProcess:
    """``mpiexec -n n python ARGS...``; raises AssertionError on timeout, or on failure when check."""
    cmd = [mpiexec(), "-n", str(n), sys.executable] + [str(a) for a in args]
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.setdefault("OPENBLAS_NUM_THREADS", "1")
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    if env:
        full_env.update(env)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=str(ROOT))
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{e.stdout}\n{e.stderr}")
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def run_train(n: int, tmp_path, *flags, timeout: float = 120, env=None, tag: str = "m") -> dict:
    """Run ``python -m zerompi.train`` on n ranks and return its metrics JSON."""
    path = Path(tmp_path) / f"{tag}.json"
    run_mpi(n, ["-m", "zerompi.train", *flags, "--metrics-json", path], timeout=timeout, env=env)
    return json.loads(path.read_text())
