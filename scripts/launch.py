"""How the benchmark scripts start an MPI job: the launcher beside this Python, and the environment.

``mpiexec()``: the ``mpiexec`` of this Python's environment (the PyPI MPI wheel's, in a venv), else the
first on PATH. ``job_env(root)``: the environment with one BLAS thread per rank (ranks share the
cores) and ``root`` (the repository) on PYTHONPATH, so the job imports this checkout's zerompi.
"""
import os
import shutil
import sys
from pathlib import Path


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else (shutil.which("mpiexec") or "mpiexec")


def job_env(root) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
