"""Run a command under mpiexec as a subprocess with a timeout: a hang fails the test, never CI.

The tests run under whichever MPI library this Python's mpi4py uses (MPICH from the ``mpi``
extra; CI also runs a subset under Open MPI). They judge zerompi's own output: the lines it
prints start with ``zerompi`` (:func:`zerompi_lines`), and what a launcher adds around them
(Open MPI's "prterun detected that one or more processes exited ..." banner) is not counted.
"""
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]

# Open MPI's mpirun refuses to run as root and to start more ranks than cores without these
# (README, "On a cluster"); MPICH's needs nothing.
OPEN_MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


def mpiexec() -> str:
    """The mpiexec next to this Python (the MPI wheel's), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if not found:
        raise RuntimeError("mpiexec not found: pip install -e '.[mpi,test]'")
    return found


@functools.lru_cache(maxsize=None)
def launcher() -> str:
    """"openmpi", "mpich" or "other": whose mpiexec :func:`mpiexec` is (from its --version)."""
    try:
        text = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "other"
    if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text:
        return "openmpi"
    return "mpich" if "HYDRA" in text or "MPICH" in text else "other"


def launcher_env() -> dict:
    """What :func:`launcher` needs in the environment here: Open MPI's OPEN_MPI_ENV, else nothing."""
    return dict(OPEN_MPI_ENV) if launcher() == "openmpi" else {}


def env_flag(key: str, value: str) -> list:
    """mpiexec's flags that set KEY=VALUE for the ranks of one MPMD part (hydra -env, Open MPI -x)."""
    return ["-x", f"{key}={value}"] if launcher() == "openmpi" else ["-env", key, value]


def mpi_env(env=None) -> dict:
    """The environment of a job: this one, one BLAS thread, the repository on PYTHONPATH,
    Open MPI's settings for root and oversubscription when it is the launcher, then ``env``."""
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.setdefault("OPENBLAS_NUM_THREADS", "1")
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    for key, value in launcher_env().items():
        full_env.setdefault(key, value)
    if env:
        full_env.update(env)
    return full_env


def run_mpi(n: int, args, timeout: float = 120, env=None, check: bool = True) -> subprocess.CompletedProcess:
    """``mpiexec -n n python ARGS...``; raises AssertionError on timeout, or on failure when check."""
    cmd = [mpiexec(), "-n", str(n), sys.executable] + [str(a) for a in args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpi_env(env), cwd=str(ROOT))
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


# ---- judging zerompi's own output --------------------------------------------------------------
PYTHON_NOISE = ("Traceback (most recent call last)", "Warning: ")   # never printed by a clean exit


def zerompi_lines(text: str, prefixes=("zerompi",)) -> List[str]:
    """The lines zerompi printed in ``text``: those that start with ``zerompi`` (its messages
    do: ``zerompi.train: error: ...``, ``zerompi: rank 1: collective timeout ...``), or with
    one of ``prefixes`` (a test driver's program name)."""
    return [line for line in text.splitlines() if line.startswith(tuple(prefixes))]


def no_python_noise(text: str) -> None:
    """Assert that ``text`` holds no Python traceback or warning (PYTHON_NOISE)."""
    assert not any(noise in text for noise in PYTHON_NOISE), text


def one_line(proc: subprocess.CompletedProcess, status: int, *needles: str) -> str:
    """Assert that the job exited with ``status`` and zerompi printed exactly one line on
    stderr, holding every needle, and no Python traceback or warning; returns the line.
    Whatever else the launcher printed is ignored."""
    err = proc.stderr
    lines = zerompi_lines(err)
    assert proc.returncode == status, f"exit {proc.returncode}, expected {status}\n{err}"
    assert len(lines) == 1, err
    assert all(needle in lines[0] for needle in needles), (needles, err)
    no_python_noise(err)
    return lines[0]
