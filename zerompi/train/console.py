"""How rank 0 shows the steps going by: a redrawn bar, or one line per logged step.

``--progress auto`` chooses: a bar only for a person at a terminal, since in a file or a
pipe every redraw becomes part of the log. isatty() alone cannot tell under Open MPI's
mpirun: it gives every rank a pseudo-terminal for stdout even when mpirun's own output
goes to a file, so a rank started by it (known by the variables the launcher sets) gets
lines. Under MPICH's mpiexec and Slurm's srun a rank's stdout is a pipe: lines too.
"""
import os
import sys
from typing import Mapping, Optional, TextIO

PROGRESS_MODES = ("auto", "bar", "lines")
# Set in every rank by a launcher that hands ranks a pseudo-terminal whatever its own output is:
# Open MPI's mpirun (both its runtimes, ORTE and PRRTE) and PRRTE's own prterun.
PTY_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PRTE_LAUNCHED")


def pty_launcher(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The variable that shows this rank was started by such a launcher, or None."""
    return next((name for name in PTY_LAUNCHER_VARS if name in environ), None)


def choose_progress(mode: str, stream: Optional[TextIO] = None, environ: Mapping[str, str] = os.environ) -> str:
    """"bar" or "lines" for ``--progress mode`` (one of PROGRESS_MODES) on ``stream``
    (default sys.stdout): auto is a bar only on a terminal that no launcher stands behind."""
    if mode != "auto":
        return mode
    stream = sys.stdout if stream is None else stream
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):        # a replaced or closed stream
        terminal = False
    return "bar" if terminal and pty_launcher(environ) is None else "lines"
