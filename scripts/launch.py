"""How the benchmark scripts start an MPI job: the launcher beside this Python, and the environment.

``mpiexec()``: the ``mpiexec`` of this Python's environment (the PyPI MPI wheel's, in a venv), else the
first on PATH; ``mpicc()`` the same for the MPI library's C compiler wrapper (``$MPICC`` first).
``job_env(root)``: the environment with one BLAS thread per rank (ranks share the
cores) and ``root`` (the repository) on PYTHONPATH, so the job imports this checkout's zerompi.
"""
import os
import shutil
import sys
from pathlib import Path


def beside_python(name: str):
    """The program ``name`` next to this Python (an MPI wheel's, in a venv), else the first on PATH, or None."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def mpiexec() -> str:
    return beside_python("mpiexec") or "mpiexec"


def mpicc():
    """``$MPICC``, else the MPI library's compiler wrapper (:func:`beside_python`), or None."""
    return os.environ.get("MPICC") or beside_python("mpicc")


def job_env(root) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
